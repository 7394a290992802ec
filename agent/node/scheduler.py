"""The node scheduler: admission against node capacity, a priority queue with
aging, preemption of preemptible sandboxes and warm-pool accounting.

Why this file is long: the scheduling rules are one pure state machine under
one lock (docs/scheduler.md); the admission, queue, preemption and warm-slot
rules read each other's state at every decision.

A pure, deterministic, thread-safe component with explicit state: no I/O, no
threads, no sleeping, no knowledge of how a sandbox is launched. The agent
calls it and carries out what it returns (launch the admitted requests,
SIGTERM/grace/SIGKILL the victims, destroy the drained warm sandboxes, then
confirm with release() / release_warm()). Time comes from an injectable clock
(default time.time), read once per call and never allowed to go backwards.
Every public method holds one lock, so the agent's threads may call it
concurrently.

The rules, with a worked example, are in docs/scheduler.md. In short:

- capacity = node total - reserve; CPU may be committed up to
  cpu_oversubscription x allocatable CPUs, memory and pids never beyond
  allocatable; one request may never ask for more than the allocatable amount
- queue order: the virtual start time `submitted + rank x aging_seconds`
  (rank: reserved 0, standard 1, preemptible 2), then submit time, then arrival:
  exactly "effective priority = rank - waited/aging_seconds, ties by submit
  time", which never reorders two queued requests as time passes
- head of line: a request that cannot be satisfied blocks everything behind
  it; a request covered by resources already being freed (victims, drained
  warm sandboxes) holds a reservation, and requests behind it may use only
  what is left after that reservation (a backfill that never delays it)
- a reserved or standard request that does not fit first drains warm
  sandboxes, then preempts preemptible sandboxes it outranks (youngest first),
  only if that makes it fit, and only an irreducible set
- resource windows (Request.window): a sandbox holds its current phase's
  resources; admission also needs the sum of every holder's base plus the
  `concurrent_peaks` largest (peak - base) bursts to fit the limit, so that many
  peaks are always possible at once; a phase switch up (set_phase) that does not
  fit waits in a FIFO ahead of the queue (it reserves its delta: new admissions
  cannot take it) or is refused; resize() changes a fixed sandbox's size
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from agent.errors import DsecError, EXIT_USAGE

__all__ = [
    "CLASSES", "Request", "Window", "Decision", "Actions", "Transition", "Scheduler", "SchedulerError",
    "QUEUED", "ADMITTED", "PREEMPTING", "RELEASED", "PREEMPTED", "REJECTED", "CANCELLED",
    "TERMINAL", "WARM_READY", "WARM_DRAINING", "WARM_CLAIMED", "WARM_RELEASED",
    "WAIT_PENDING", "WAIT_CAPACITY", "WAIT_HEAD_OF_LINE",
]

CLASSES = ("reserved", "standard", "preemptible")
RANK = {c: i for i, c in enumerate(CLASSES)}
PREEMPTIBLE_RANK = RANK["preemptible"]

# request states
QUEUED, ADMITTED, PREEMPTING = "queued", "admitted", "preempting"
APPLIED = "applied"                   # set_phase() / resize() outcome: in force now
RELEASED, PREEMPTED, REJECTED, CANCELLED = "released", "preempted", "rejected", "cancelled"
LIVE = frozenset({QUEUED, ADMITTED, PREEMPTING})
TERMINAL = frozenset({RELEASED, PREEMPTED, REJECTED, CANCELLED})

# warm slot states (transitions of kind "warm")
WARM_READY, WARM_DRAINING = "warm_ready", "warm_draining"
WARM_CLAIMED, WARM_RELEASED = "warm_claimed", "warm_released"

# why a queued request waits
WAIT_PENDING = "pending"              # covered by resources being freed: admitted when they are
WAIT_CAPACITY = "capacity"            # the first request that cannot be satisfied: waits for releases
WAIT_HEAD_OF_LINE = "head_of_line"    # behind a request that waits for capacity

MAX_ID_CHARS = 128
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 128
MAX_LABEL_VALUE_CHARS = 1024
MILLI = 1000                          # CPUs are accounted in millicores (exact integer sums)


class SchedulerError(DsecError):
    """Misuse of the scheduler: bad configuration, unknown id, wrong state. One clear line."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message, code)


@dataclass(frozen=True)
class Request:
    """What a sandbox asks for. cpus in CPUs (millicore granularity), memory in
    bytes, pids the pids limit. `submitted` defaults to now; the agent may pass
    the time the request reached it (never a time in the future)."""
    id: str
    cpus: float
    memory: int
    pids: int = 1024
    priority: str = "standard"
    submitted: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    window: "Window | None" = None


@dataclass(frozen=True)
class Window:
    """A resource window: `base` is held for the whole life, `peak` is the most any
    phase may ask for; the Request's cpus/memory are the phase it starts in (between
    the two). pids are the Request's, in every phase."""
    base_cpus: float
    base_memory: int
    peak_cpus: float
    peak_memory: int


@dataclass(frozen=True)
class Actions:
    """What the agent must do after a call: launch `admitted` (in this order),
    stop `preempt` (SIGTERM, grace, SIGKILL, then release(id)), destroy the warm
    sandboxes in `drain_warm` (then release_warm(slot)), apply the phase switches
    granted to `phases` (set_phase() that had to wait)."""
    admitted: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    drain_warm: tuple[str, ...] = ()
    phases: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.admitted or self.preempt or self.drain_warm or self.phases)


@dataclass(frozen=True)
class Decision:
    """The answer to submit() / claim_warm() / adopt(). outcome is "admitted",
    "queued" or "rejected"; reason says why it was queued or rejected;
    warm_slot names the warm sandbox the request took (claim_warm only)."""
    id: str
    outcome: str
    reason: str | None = None
    actions: Actions = Actions()
    warm_slot: str | None = None

    @property
    def admitted(self) -> bool:
        return self.outcome == ADMITTED

    @property
    def queued(self) -> bool:
        return self.outcome == QUEUED

    @property
    def rejected(self) -> bool:
        return self.outcome == REJECTED

    @property
    def victims(self) -> tuple[str, ...]:
        return self.actions.preempt


@dataclass(frozen=True)
class Transition:
    """One state change, for the agent to audit. kind: "request", "warm", or
    "scheduler" (state "lost": transitions were dropped because nobody drained
    them; `reason` says how many). seq increases by one per transition."""
    seq: int
    at: float
    kind: str
    id: str
    state: str
    previous: str | None = None
    priority: str | None = None
    profile: str | None = None
    reason: str | None = None
    cause: str | None = None          # the request that caused a preemption / drain / claim
    waited: float | None = None       # seconds queued (on "admitted")
    labels: Mapping[str, str] = field(default_factory=dict)


class _Entry:
    """A request's record (internal)."""
    __slots__ = ("id", "priority", "rank", "res", "labels", "submitted", "seq", "vkey", "key",
                 "state", "admitted_at", "ended_at", "reason", "waiting", "cause",
                 "warm_slot", "base", "peak")

    def __init__(self, rid, priority, res, labels, submitted, seq, aging):
        self.id = rid
        self.priority = priority
        self.rank = RANK[priority]
        self.res = res                            # (millicpus, memory bytes, pids)
        self.labels = dict(labels)
        self.submitted = submitted
        self.seq = seq
        # virtual start time: the instant at which a fresh reserved request would
        # have the same effective priority. Ordering by it is ordering by
        # effective priority at any time.
        self.vkey = submitted + self.rank * aging if aging else float(self.rank)
        self.key = (self.vkey, submitted, seq)
        self.state = QUEUED
        self.admitted_at = None
        self.ended_at = None
        self.reason = None
        self.waiting = None
        self.cause = None
        self.warm_slot = None
        self.base = res                           # resource window (fixed size: base = peak = res)
        self.peak = res


class _Switch:
    """A phase switch waiting for room (internal): FIFO, ahead of the queue."""
    __slots__ = ("entry", "new", "asked", "seq")

    def __init__(self, entry, new, asked, seq):
        self.entry = entry
        self.new = new
        self.asked = asked
        self.seq = seq


class _Slot:
    """A warm sandbox's hold on resources (internal)."""
    __slots__ = ("id", "profile", "res", "created", "seq", "state", "cause", "ended_at")

    def __init__(self, sid, profile, res, created, seq):
        self.id = sid
        self.profile = profile
        self.res = res
        self.created = created
        self.seq = seq
        self.state = WARM_READY
        self.cause = None
        self.ended_at = None


# ---- resource vectors: (millicpus, memory, pids) --------------------------------------------

_ZERO = (0, 0, 0)


def _add(a, b):
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _sub(a, b):
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def _fits(need, have) -> bool:
    return need[0] <= have[0] and need[1] <= have[1] and need[2] <= have[2]


def _short(need, have):
    return (max(0, need[0] - have[0]), max(0, need[1] - have[1]), max(0, need[2] - have[2]))


def _pos(v):
    return (max(0, v[0]), max(0, v[1]), max(0, v[2]))


def _topk(vectors, k: int):
    """Per dimension, the sum of the k largest values."""
    if k <= 0:
        return _ZERO
    cols = list(zip(*vectors)) if vectors else [(), (), ()]
    return tuple(sum(sorted(c, reverse=True)[:k]) for c in cols)


def _fmt_cpus(m) -> str:
    return f"{m / MILLI:g}"


def _fmt_bytes(n) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 30):.2f}GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f}MiB"
    return f"{n}B"


def _fmt_pids(n) -> str:
    return "unlimited" if n == math.inf else str(int(n))


def _describe_short(short) -> str:
    parts = []
    if short[0] > 0:
        parts.append(f"{_fmt_cpus(short[0])} CPUs")
    if short[1] > 0:
        parts.append(f"{_fmt_bytes(short[1])} memory")
    if short[2] > 0:
        parts.append(f"{_fmt_pids(short[2])} pids")
    return ", ".join(parts)


def _describe_free(have, need) -> str:
    """What is free, in the dimensions `need` asks for."""
    parts = []
    if need[0] > 0:
        parts.append(f"{_fmt_cpus(have[0])} CPUs")
    if need[1] > 0:
        parts.append(f"{_fmt_bytes(have[1])} memory")
    if need[2] > 0:
        parts.append(f"{_fmt_pids(have[2])} pids")
    return ", ".join(parts) or "nothing needed"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text_ok(s: str) -> bool:
    return s.isprintable()


class Scheduler:
    """The scheduler of one node. See the module docstring and docs/scheduler.md.

    Scheduler(total_cpus, total_memory, reserve_cpus=0, reserve_memory=0,
              cpu_oversubscription=1.0, max_pids=None, aging_seconds=60.0,
              clock=time.time, history=10000, max_transitions=100000)

    aging_seconds: seconds of waiting worth one class step (None: no aging,
    strict class order). history: how many ended requests / warm slots are kept
    for state(). max_transitions: transitions kept until drained; beyond it the
    oldest are dropped and a "lost" transition says so.
    """

    def __init__(self, total_cpus: float, total_memory: int, reserve_cpus: float = 0,
                 reserve_memory: int = 0, cpu_oversubscription: float = 1.0,
                 max_pids: int | None = None, *, aging_seconds: float | None = 60.0,
                 clock: Callable[[], float] = time.time, history: int = 10_000,
                 max_transitions: int = 100_000, concurrent_peaks: int = 1):
        problems = []
        if not _is_int(concurrent_peaks) or concurrent_peaks < 0:
            problems.append(f"concurrent_peaks={concurrent_peaks!r} must be an integer >= 0")
        if not _is_number(total_cpus) or not math.isfinite(total_cpus) or total_cpus <= 0:
            problems.append(f"total_cpus={total_cpus!r} must be a positive number")
        if not _is_number(reserve_cpus) or not math.isfinite(reserve_cpus) or reserve_cpus < 0:
            problems.append(f"reserve_cpus={reserve_cpus!r} must be a number >= 0")
        if not _is_int(total_memory) or total_memory <= 0:
            problems.append(f"total_memory={total_memory!r} must be a positive number of bytes")
        if not _is_int(reserve_memory) or reserve_memory < 0:
            problems.append(f"reserve_memory={reserve_memory!r} must be a number of bytes >= 0")
        if (not _is_number(cpu_oversubscription) or not math.isfinite(cpu_oversubscription)
                or cpu_oversubscription < 1):
            problems.append(f"cpu_oversubscription={cpu_oversubscription!r} must be a number >= 1"
                            " (1 = no oversubscription)")
        if max_pids is not None and (not _is_int(max_pids) or max_pids <= 0):
            problems.append(f"max_pids={max_pids!r} must be a positive integer or None")
        if aging_seconds is not None and (not _is_number(aging_seconds)
                                          or not math.isfinite(aging_seconds) or aging_seconds <= 0):
            problems.append(f"aging_seconds={aging_seconds!r} must be a positive number of seconds"
                            " or None (no aging)")
        if not callable(clock):
            problems.append("clock must be a callable returning seconds")
        if not _is_int(history) or history < 0:
            problems.append(f"history={history!r} must be an integer >= 0")
        if not _is_int(max_transitions) or max_transitions <= 0:
            problems.append(f"max_transitions={max_transitions!r} must be a positive integer")
        if not problems:
            alloc_m = round(total_cpus * MILLI) - round(reserve_cpus * MILLI)
            if alloc_m < 1:
                problems.append(f"reserve_cpus={reserve_cpus:g} leaves no CPU of total_cpus="
                                f"{total_cpus:g} to allocate")
            if total_memory - reserve_memory < 1:
                problems.append(f"reserve_memory={reserve_memory} leaves no memory of total_memory="
                                f"{total_memory} to allocate")
        if problems:
            raise SchedulerError("scheduler configuration: " + "; ".join(problems))

        self.total_cpus = float(total_cpus)
        self.reserve_cpus = float(reserve_cpus)
        self.total_memory = total_memory
        self.reserve_memory = reserve_memory
        self.cpu_oversubscription = float(cpu_oversubscription)
        self.max_pids = max_pids
        self.aging_seconds = float(aging_seconds) if aging_seconds is not None else None
        self._clock = clock
        self._history = history
        self._max_transitions = max_transitions
        self.concurrent_peaks = concurrent_peaks

        # allocatable: what one request may at most ask for
        self._alloc = (round(total_cpus * MILLI) - round(reserve_cpus * MILLI),
                       total_memory - reserve_memory,
                       max_pids if max_pids is not None else math.inf)
        # limit: what all holders together may hold (CPU oversubscribed)
        self._limit = (math.floor(self._alloc[0] * self.cpu_oversubscription + 1e-9),
                       self._alloc[1], self._alloc[2])

        self._lock = threading.RLock()
        self._last = -math.inf
        self._seq = 0
        self._warm_seq = 0
        self._used = _ZERO
        self._live: dict[str, _Entry] = {}            # queued, admitted, preempting
        self._held: dict[str, _Entry] = {}            # admitted, preempting
        self._bursty: dict[str, _Entry] = {}          # those of _held with a window's burst (peak > base)
        self._pending = _ZERO                         # held by preempting / draining: being freed
        self._blocker: _Entry | None = None           # the request waiting for capacity, if any
        self._queue: list[_Entry] = []                # queued, sorted by key
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        self._warm: dict[str, _Slot] = {}             # ready, draining
        self._warm_done: OrderedDict[str, _Slot] = OrderedDict()
        self._events: deque[Transition] = deque()
        self._tseq = 0
        self._dropped = 0
        self._dropped_reported = 0
        self._scratch: list[dict] = []
        self._acts: dict[str, list[str]] = {"admitted": [], "preempt": [], "drain": [], "phases": []}
        self._burst = _ZERO                           # sum over holders of (res - base): phases above base
        self._switches: list[_Switch] = []            # phase switches waiting for room, FIFO
        self._counters = {k: 0 for k in ("submitted", "admitted", "queued", "rejected",
                                         "cancelled", "preempted", "released", "adopted",
                                         "warm_reserved", "warm_claimed", "warm_drained",
                                         "warm_released", "phase_switches", "phase_waits",
                                         "phase_refused", "resized", "resize_refused")}

    # ---- public API --------------------------------------------------------------------------

    def submit(self, req: Request, now: float | None = None) -> Decision:
        """Admit `req` at once if it fits beside the reservations of the requests
        ahead of it and none of them waits for capacity; queue it otherwise; or
        reject it with a reason naming each bad field. May choose warm
        sandboxes to drain and victims to preempt (decision.actions)."""
        with self._lock:
            t = self._now(now)
            self._begin()
            d = self._submit(req, t)
            return self._end(d)

    def claim_warm(self, profile: str, req: Request, now: float | None = None) -> Decision:
        """Like submit(), but if a ready warm sandbox of `profile` with exactly
        req's cpus, memory and pids exists, and no request that is waiting for
        capacity is ahead of req, req takes it: admitted with warm_slot set, the
        slot's resources passing to req. Otherwise the request goes through
        submit() and warm_slot is None (the agent launches it cold if admitted)."""
        with self._lock:
            t = self._now(now)
            self._begin()
            problems = self._check(req, t)
            slot = None
            if not problems:
                res = self._res(req)
                cands = [s for s in self._warm.values()
                         if s.state == WARM_READY and s.profile == profile and s.res == res]
                if cands:
                    slot = min(cands, key=lambda s: (s.created, s.seq))
            if slot is None:
                return self._end(self._submit(req, t))
            e = self._make_entry(req, t)
            blocker = self._blocker
            if blocker is not None and blocker.key < e.key:
                return self._end(self._submit(req, t, entry=e))
            # the swap is resource-neutral: nobody ahead is delayed
            self._register(e)
            del self._warm[slot.id]
            self._used = _sub(self._used, slot.res)
            slot.cause = e.id
            self._end_slot(slot, WARM_CLAIMED, t, reason=f"claimed by request {e.id!r}")
            self._counters["warm_claimed"] += 1
            e.warm_slot = slot.id
            self._admit(e, t, reason=f"took warm sandbox {slot.id!r}", previous=None)
            self._schedule(t)
            return self._end(Decision(e.id, ADMITTED, None, warm_slot=slot.id))

    def adopt(self, req: Request, now: float | None = None) -> Decision:
        """Account a sandbox that is already running (left by a previous agent):
        admitted if it fits in the free capacity, rejected otherwise (then the
        agent must stop it). Use before submitting anything new."""
        with self._lock:
            t = self._now(now)
            self._begin()
            problems = self._check(req, t)
            if not problems:
                e = self._make_entry(req, t)
                free = _sub(self._limit, self._used)
                if not _fits(e.res, free):
                    problems = [f"does not fit the free capacity (short of "
                                f"{_describe_short(_short(e.res, free))})"]
                else:
                    self._register(e)
                    self._counters["adopted"] += 1
                    self._admit(e, t, reason="adopted: already running", previous=None)
                    return self._end(Decision(e.id, ADMITTED))
            return self._end(self._reject(req, t, problems))

    def release(self, rid: str, reason: str | None = None, now: float | None = None) -> Actions:
        """A sandbox ended (admitted -> released) or a victim is gone (preempting
        -> preempted): its resources are freed and the queue is served.
        Releasing an ended request again is a no-op."""
        with self._lock:
            t = self._now(now)
            self._begin()
            e = self._live.get(rid) if isinstance(rid, str) else None
            if e is None:
                if isinstance(rid, str) and rid in self._done:
                    return self._end(None)
                raise SchedulerError(f"release({rid!r}): no such request")
            if e.state == QUEUED:
                raise SchedulerError(f"release({rid!r}): the request is queued, not running;"
                                     " use cancel()")
            self._used = _sub(self._used, e.res)
            self._burst = _sub(self._burst, _sub(e.res, e.base))
            self._switches = [w for w in self._switches if w.entry is not e]
            if e.state == PREEMPTING:
                self._pending = _sub(self._pending, e.res)
                self._counters["preempted"] += 1
                self._finish(e, PREEMPTED, t, reason or f"preempted for request {e.cause!r}")
            else:
                self._counters["released"] += 1
                self._finish(e, RELEASED, t, reason)
            self._schedule(t)
            return self._end(None)

    def cancel(self, rid: str, reason: str | None = None, now: float | None = None) -> Actions:
        """Withdraw a queued request (-> cancelled). Requests behind it may be
        admitted. Cancelling an ended request again is a no-op; a running one is
        an error (stop it, then release())."""
        with self._lock:
            t = self._now(now)
            self._begin()
            e = self._live.get(rid) if isinstance(rid, str) else None
            if e is None:
                if isinstance(rid, str) and rid in self._done:
                    return self._end(None)
                raise SchedulerError(f"cancel({rid!r}): no such request")
            if e.state != QUEUED:
                raise SchedulerError(f"cancel({rid!r}): the request is {e.state}, not queued;"
                                     " stop the sandbox and call release()")
            self._queue.remove(e)
            self._counters["cancelled"] += 1
            self._finish(e, CANCELLED, t, reason or "cancelled while queued")
            self._schedule(t)
            return self._end(None)

    def tick(self, now: float | None = None) -> Actions:
        """Advance the clock and serve the queue again. Waiting never reorders
        the queue (see docs), but it raises a waiting request's effective
        priority above the standing of running preemptible sandboxes, which can
        make them preemptible for it: call this periodically (e.g. each second)."""
        with self._lock:
            t = self._now(now)
            self._begin()
            self._schedule(t)
            return self._end(None)

    def reserve_warm(self, profile: str, cpus: float, memory: int, pids: int = 1024,
                     now: float | None = None) -> str | None:
        """Hold resources for one pre-created sandbox of `profile`. Returns the
        slot id, or None when a request is queued or the slot does not fit in
        the free capacity: warm sandboxes only use capacity nobody waits for."""
        with self._lock:
            t = self._now(now)
            self._begin()
            if not isinstance(profile, str) or not profile or len(profile) > MAX_ID_CHARS \
                    or not _text_ok(profile):
                raise SchedulerError(f"reserve_warm: profile={profile!r} must be a non-empty"
                                     f" printable string of at most {MAX_ID_CHARS} characters")
            problems = self._check_resources(cpus, memory, pids)
            if problems:
                raise SchedulerError(f"reserve_warm({profile!r}): " + "; ".join(problems))
            res = (round(cpus * MILLI), memory, pids)
            if self._queue or not _fits(res, _sub(self._limit, self._used)):
                self._end(None)
                return None
            self._warm_seq += 1
            slot = _Slot(f"warm-{profile}-{self._warm_seq}", profile, res, t, self._warm_seq)
            self._warm[slot.id] = slot
            self._used = _add(self._used, res)
            self._counters["warm_reserved"] += 1
            self._emit(t, "warm", slot.id, WARM_READY, None, profile=profile)
            self._end(None)
            return slot.id

    def release_warm(self, slot_id: str, reason: str | None = None,
                     now: float | None = None) -> Actions:
        """A warm sandbox is gone (drained on request, or destroyed by the agent
        for its own reasons): its resources are freed and the queue is served."""
        with self._lock:
            t = self._now(now)
            self._begin()
            slot = self._warm.get(slot_id) if isinstance(slot_id, str) else None
            if slot is None:
                if isinstance(slot_id, str) and slot_id in self._warm_done:
                    return self._end(None)
                raise SchedulerError(f"release_warm({slot_id!r}): no such warm slot")
            del self._warm[slot_id]
            self._used = _sub(self._used, slot.res)
            if slot.state == WARM_DRAINING:
                self._pending = _sub(self._pending, slot.res)
            self._counters["warm_released"] += 1
            self._end_slot(slot, WARM_RELEASED, t, reason=reason)
            self._schedule(t)
            return self._end(None)

    def set_phase(self, rid: str, cpus: float, memory: int, wait: bool = True,
                  now: float | None = None) -> Decision:
        """Switch a windowed sandbox to a phase asking for cpus/memory (between its
        window's base and peak). Down (or equal): applied at once. Up: applied if the
        increase fits what is free and no earlier switch waits; else, with `wait`,
        queued (outcome "queued": it reserves its increase, nothing new is admitted
        into it, and it is granted in FIFO order: actions.phases of a later call),
        without `wait` refused. A new switch replaces a waiting one of the same sandbox."""
        with self._lock:
            t = self._now(now)
            self._begin()
            e = self._held_entry(rid, "set_phase")
            problems = []
            if e.base == e.peak:
                problems.append("it has no resource window (a fixed size: use resize())")
            else:
                problems = self._check_resources(cpus, memory, e.res[2])
            if not problems:
                new = (round(cpus * MILLI), memory, e.res[2])
                if not (_fits(e.base, new) and _fits(new, e.peak)):
                    problems.append(f"cpus={cpus:g}, memory={_fmt_bytes(memory)} is outside its window "
                                    f"(base {_fmt_cpus(e.base[0])} CPUs / {_fmt_bytes(e.base[1])}, peak "
                                    f"{_fmt_cpus(e.peak[0])} CPUs / {_fmt_bytes(e.peak[1])})")
            if problems:
                self._counters["phase_refused"] += 1
                return self._end(Decision(rid, REJECTED, f"set_phase({rid!r}): " + "; ".join(problems)))
            self._switches = [w for w in self._switches if w.entry is not e]
            delta = _pos(_sub(new, e.res))
            free = self._free_after_switches()
            if delta == _ZERO or (not self._switches and _fits(delta, free)):
                self._apply(e, new)
                self._counters["phase_switches"] += 1
                self._schedule(t)
                return self._end(Decision(rid, APPLIED))
            have = _pos(free)
            why = (f"it needs {_describe_short(delta)} more, {_describe_free(have, delta)} free"
                   + (f", {len(self._switches)} earlier phase switch(es) waiting" if self._switches else "")
                   + " (other sandboxes' phases hold the rest)")
            if not wait:
                self._counters["phase_refused"] += 1
                self._schedule(t)
                return self._end(Decision(rid, REJECTED, f"set_phase({rid!r}): {why}"))
            self._seq += 1
            self._switches.append(_Switch(e, new, t, self._seq))
            self._counters["phase_waits"] += 1
            self._schedule(t)
            if not any(w.entry is e for w in self._switches):      # granted by the pass itself
                return self._end(Decision(rid, APPLIED))
            return self._end(Decision(rid, QUEUED, f"waiting: {why}"))

    def cancel_phase(self, rid: str, now: float | None = None) -> Actions:
        """Withdraw rid's waiting phase switch (no-op if none): its reservation goes back."""
        with self._lock:
            t = self._now(now)
            self._begin()
            self._switches = [w for w in self._switches if w.entry.id != rid]
            self._schedule(t)
            return self._end(None)

    def phase_waiting(self, rid: str) -> bool:
        with self._lock:
            return any(w.entry.id == rid for w in self._switches)

    def resize(self, rid: str, cpus: float, memory: int, pids: int, now: float | None = None) -> Decision:
        """A running fixed-size sandbox's new size (UpdateResources). Smaller: applied
        (what it frees may admit queued requests). Larger: re-admitted, i.e. applied only
        if the increase fits what is free (after waiting phase switches) and no queued
        request waits for capacity; else refused with the reason."""
        with self._lock:
            t = self._now(now)
            self._begin()
            e = self._held_entry(rid, "resize")
            problems = []
            if e.base != e.peak:
                problems.append("it has a resource window: switch phases with set_phase()")
            problems += self._check_resources(cpus, memory, pids)
            if problems:
                self._counters["resize_refused"] += 1
                return self._end(Decision(rid, REJECTED, f"resize({rid!r}): " + "; ".join(problems)))
            new = (round(cpus * MILLI), memory, pids)
            delta = _pos(_sub(new, e.res))
            if delta != _ZERO:
                free = self._free_after_switches()
                why = None
                if self._blocker is not None:
                    why = f"request {self._blocker.id!r} waits for capacity ahead of it"
                elif not _fits(delta, free):
                    why = f"the node is short of {_describe_short(_short(delta, free))}"
                elif not self._window_ok(None, _sub(new, e.res)):
                    why = "it would take the room kept for resource windows' peaks"
                if why:
                    self._counters["resize_refused"] += 1
                    return self._end(Decision(rid, REJECTED, f"resize({rid!r}) to {cpus:g} CPUs, "
                                                             f"{_fmt_bytes(memory)}, {pids} pids: {why}"))
            self._apply(e, new, base_too=True)
            self._counters["resized"] += 1
            self._schedule(t)
            return self._end(Decision(rid, APPLIED))

    def state(self, rid: str) -> str | None:
        """The state of a request (or warm slot), None if unknown or forgotten."""
        if not isinstance(rid, str):
            return None
        with self._lock:
            e = self._live.get(rid) or self._done.get(rid)
            if e is not None:
                return e.state
            s = self._warm.get(rid) or self._warm_done.get(rid)
            return s.state if s is not None else None

    def info(self, rid: str) -> dict | None:
        """Everything known about one request, for Get/List and status messages."""
        if not isinstance(rid, str):
            return None
        with self._lock:
            e = self._live.get(rid) or self._done.get(rid)
            if e is None:
                return None
            t = self._now(None)
            out = {
                "id": e.id, "state": e.state, "priority": e.priority,
                "cpus": e.res[0] / MILLI, "memory": e.res[1], "pids": e.res[2],
                "labels": dict(e.labels), "submitted": e.submitted,
                "admitted_at": e.admitted_at, "ended_at": e.ended_at, "reason": e.reason,
                "warm_slot": e.warm_slot,
            }
            if e.state == QUEUED:
                waiting, blocked_by, _ = self._wait(e)
                out.update(waiting=waiting, blocked_by=blocked_by, waited=t - e.submitted,
                           effective_priority=self._eff(e, t),
                           position=self._queue.index(e))
            if e.state in (PREEMPTING, PREEMPTED):
                out["preempted_for"] = e.cause
            if e.base != e.peak:
                out["window"] = {"base": {"cpus": e.base[0] / MILLI, "memory": e.base[1]},
                                 "peak": {"cpus": e.peak[0] / MILLI, "memory": e.peak[1]}}
                out["phase_waiting"] = any(w.entry is e for w in self._switches)
            return out

    def queue(self) -> list[str]:
        """Queued request ids, in the order they will be served."""
        with self._lock:
            return [e.id for e in self._queue]

    def running(self) -> list[str]:
        """Admitted and preempting request ids (they hold resources), oldest first."""
        with self._lock:
            return [e.id for e in sorted(self._held.values(), key=lambda e: (e.admitted_at, e.seq))]

    def warm_slots(self) -> dict[str, dict]:
        with self._lock:
            return {s.id: {"profile": s.profile, "state": s.state, "cpus": s.res[0] / MILLI,
                           "memory": s.res[1], "pids": s.res[2], "created": s.created}
                    for s in self._warm.values()}

    def drain_transitions(self) -> list[Transition]:
        """Every transition since the last drain, oldest first (and a "lost"
        marker first if some were dropped because the buffer was full)."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
            if self._dropped > self._dropped_reported:
                n = self._dropped - self._dropped_reported
                self._dropped_reported = self._dropped
                out.insert(0, Transition(seq=0, at=self._last, kind="scheduler", id="",
                                         state="lost",
                                         reason=f"{n} transitions dropped: nobody drained the"
                                                f" buffer of {self._max_transitions}"))
            return out

    def snapshot(self) -> dict:
        """Figures for metrics: capacity and use, running and queued by class,
        the oldest wait, the warm pool, counters."""
        with self._lock:
            t = self._now(None)
            by_state = {c: 0 for c in CLASSES}
            queued = {c: 0 for c in CLASSES}
            preempting = 0
            warm_use = _ZERO
            for e in self._held.values():
                if e.state == ADMITTED:
                    by_state[e.priority] += 1
                else:
                    preempting += 1
            for e in self._queue:
                queued[e.priority] += 1
            by_profile: dict[str, dict] = {}
            for s in self._warm.values():
                warm_use = _add(warm_use, s.res)
                p = by_profile.setdefault(s.profile, {"ready": 0, "draining": 0})
                p["ready" if s.state == WARM_READY else "draining"] += 1
            oldest = min((e.submitted for e in self._queue), default=None)
            head = self._queue[0] if self._queue else None
            return {
                "time": t,
                "cpu": {"total": self.total_cpus, "reserve": self.reserve_cpus,
                        "allocatable": self._alloc[0] / MILLI,
                        "oversubscription": self.cpu_oversubscription,
                        "limit": self._limit[0] / MILLI, "used": self._used[0] / MILLI,
                        "free": (self._limit[0] - self._used[0]) / MILLI,
                        "warm": warm_use[0] / MILLI},
                "memory": {"total": self.total_memory, "reserve": self.reserve_memory,
                           "allocatable": self._alloc[1], "used": self._used[1],
                           "free": self._limit[1] - self._used[1], "warm": warm_use[1]},
                "pids": {"max": self.max_pids, "used": self._used[2], "warm": warm_use[2]},
                "running": dict(by_state),
                "running_total": sum(by_state.values()),
                "preempting": preempting,
                "queue": {"length": len(self._queue), "by_class": queued,
                          "oldest_wait": (t - oldest) if oldest is not None else None,
                          "head": head.id if head else None,
                          "head_waiting": self._wait(head)[0] if head else None},
                "warm": {"ready": sum(p["ready"] for p in by_profile.values()),
                         "draining": sum(p["draining"] for p in by_profile.values()),
                         "by_profile": by_profile},
                "counters": dict(self._counters),
                "transitions": {"buffered": len(self._events), "dropped": self._dropped},
                "windows": {"concurrent_peaks": self.concurrent_peaks,
                            "burst_cpus": self._burst[0] / MILLI, "burst_memory": self._burst[1],
                            "bound_cpus": self._bound()[0] / MILLI, "bound_memory": self._bound()[1],
                            "phase_switches_waiting": len(self._switches)},
            }

    def verify(self) -> None:
        """Self-check of the internal accounting (tests, debugging): raises
        SchedulerError if the books do not balance or capacity is exceeded."""
        with self._lock:
            used = pending = _ZERO
            held = {}
            burst = _ZERO
            for e in self._live.values():
                if e.state in (ADMITTED, PREEMPTING):
                    used = _add(used, e.res)
                    burst = _add(burst, _sub(e.res, e.base))
                    held[e.id] = e
                if e.state == PREEMPTING:
                    pending = _add(pending, e.res)
            for s in self._warm.values():
                used = _add(used, s.res)
                if s.state == WARM_DRAINING:
                    pending = _add(pending, s.res)
            problems = []
            if used != self._used:
                problems.append(f"used {self._used} != sum of holders {used}")
            if pending != self._pending:
                problems.append(f"pending {self._pending} != sum of those being freed {pending}")
            if held != self._held:
                problems.append("held set out of sync")
            if {i for i, e in held.items() if e.peak != e.base} != set(self._bursty):
                problems.append("bursty set out of sync")
            if burst != self._burst:
                problems.append(f"burst {self._burst} != sum of phases above base {burst}")
            if any(w.entry.id not in held or held[w.entry.id].state != ADMITTED for w in self._switches):
                problems.append("a waiting phase switch belongs to a sandbox that is not running")
            if not _fits(used, self._limit):
                problems.append(f"used {used} exceeds the limit {self._limit}")
            q = [e for e in self._live.values() if e.state == QUEUED]
            if sorted(q, key=lambda e: e.key) != self._queue:
                problems.append("queue out of sync with queued requests")
            if any(k in self._done for k in self._live):
                problems.append("a request is both live and ended")
            if problems:
                raise SchedulerError("scheduler books: " + "; ".join(problems))

    # ---- internals ---------------------------------------------------------------------------

    def _now(self, at) -> float:
        t = self._clock() if at is None else at
        if not _is_number(t) or not math.isfinite(t):
            raise SchedulerError(f"time {t!r} is not a finite number of seconds")
        if t < self._last:
            t = self._last                       # never backwards
        self._last = float(t)
        return self._last

    def _eff(self, e: _Entry, t: float) -> float:
        """Effective priority of a queued request at t: rank - waited/aging (lower is served first)."""
        if self.aging_seconds is None:
            return float(e.rank)
        return (e.vkey - t) / self.aging_seconds

    def _begin(self):
        self._scratch = []
        self._acts = {"admitted": [], "preempt": [], "drain": [], "phases": []}

    def _end(self, d):
        acts = Actions(tuple(self._acts["admitted"]), tuple(self._acts["preempt"]),
                       tuple(self._acts["drain"]), tuple(self._acts["phases"]))
        for ev in self._scratch:
            self._tseq += 1
            self._events.append(Transition(seq=self._tseq, **ev))
            if len(self._events) > self._max_transitions:
                self._events.popleft()
                self._dropped += 1
        self._scratch = []
        if d is None:
            return acts
        return Decision(d.id, d.outcome, d.reason, acts, d.warm_slot)

    def _emit(self, at, kind, rid, state, previous, **kw):
        self._scratch.append(dict(at=at, kind=kind, id=rid, state=state, previous=previous, **kw))

    def _check_resources(self, cpus, memory, pids) -> list[str]:
        p = []
        if not _is_number(cpus) or not math.isfinite(cpus) or cpus <= 0:
            p.append(f"cpus={cpus!r} must be a positive number of CPUs")
        elif round(cpus * MILLI) < 1:
            p.append(f"cpus={cpus!r} is below the granularity of 0.001 CPU")
        elif round(cpus * MILLI) > self._alloc[0]:
            p.append(f"cpus={cpus:g} is more than this node can ever give one sandbox"
                     f" ({_fmt_cpus(self._alloc[0])} allocatable CPUs = {self.total_cpus:g} total"
                     f" - {self.reserve_cpus:g} reserved)")
        if not _is_int(memory) or memory <= 0:
            p.append(f"memory={memory!r} must be a positive number of bytes")
        elif memory > self._alloc[1]:
            p.append(f"memory={_fmt_bytes(memory)} is more than this node can ever give one"
                     f" sandbox ({_fmt_bytes(self._alloc[1])} allocatable ="
                     f" {_fmt_bytes(self.total_memory)} total - {_fmt_bytes(self.reserve_memory)}"
                     f" reserved)")
        if not _is_int(pids) or pids <= 0:
            p.append(f"pids={pids!r} must be a positive integer")
        elif pids > self._alloc[2]:
            p.append(f"pids={pids} is more than this node's max_pids={self.max_pids}")
        return p

    def _check(self, req, t) -> list[str]:
        if not isinstance(req, Request):
            return [f"expected a Request, got {type(req).__name__}"]
        p = []
        rid = req.id
        if not isinstance(rid, str) or not rid:
            p.append(f"id={rid!r} must be a non-empty string")
        elif len(rid) > MAX_ID_CHARS:
            p.append(f"id is {len(rid)} characters long, at most {MAX_ID_CHARS} allowed")
        elif not _text_ok(rid):
            p.append(f"id={rid!r} contains non-printable characters")
        elif rid in self._live:
            p.append(f"id {rid!r} is already {self._live[rid].state}")
        p += self._check_resources(req.cpus, req.memory, req.pids)
        p += self._check_window(req)
        if not isinstance(req.priority, str) or req.priority not in RANK:
            p.append(f"priority class {req.priority!r} is unknown (expected one of"
                     f" {', '.join(CLASSES)})")
        s = req.submitted
        if s is not None:
            if not _is_number(s) or not math.isfinite(s):
                p.append(f"submitted={s!r} must be a time in seconds")
            elif s > t:
                p.append(f"submitted={s!r} is in the future (now {t!r})")
        labels = req.labels
        if not isinstance(labels, Mapping):
            p.append(f"labels must be a mapping of strings, got {type(labels).__name__}")
        else:
            if len(labels) > MAX_LABELS:
                p.append(f"{len(labels)} labels, at most {MAX_LABELS} allowed")
            for k, v in list(labels.items())[:MAX_LABELS + 1]:
                if not isinstance(k, str) or not k or len(k) > MAX_LABEL_KEY_CHARS:
                    p.append(f"label key {str(k)[:40]!r} must be a non-empty string of at most"
                             f" {MAX_LABEL_KEY_CHARS} characters")
                elif not isinstance(v, str) or len(v) > MAX_LABEL_VALUE_CHARS:
                    p.append(f"label {k!r} must have a string value of at most"
                             f" {MAX_LABEL_VALUE_CHARS} characters")
        return p

    def _res(self, req: Request):
        return (round(req.cpus * MILLI), req.memory, req.pids)

    def _make_entry(self, req: Request, t: float) -> _Entry:
        self._seq += 1
        submitted = float(req.submitted) if req.submitted is not None else t
        e = _Entry(req.id, req.priority, self._res(req), req.labels, submitted, self._seq, self.aging_seconds)
        w = req.window
        if w is not None:
            e.base = (round(w.base_cpus * MILLI), w.base_memory, req.pids)
            e.peak = (round(w.peak_cpus * MILLI), w.peak_memory, req.pids)
        return e

    def _check_window(self, req) -> list[str]:
        w = req.window
        if w is None:
            return []
        if not isinstance(w, Window):
            return [f"window must be a Window, got {type(w).__name__}"]
        p = []
        for what, c, m in (("base", w.base_cpus, w.base_memory), ("peak", w.peak_cpus, w.peak_memory)):
            for problem in self._check_resources(c, m, 1):
                p.append(f"window {what}: {problem}")
        if p:
            return p
        base, peak = (round(w.base_cpus * MILLI), w.base_memory), (round(w.peak_cpus * MILLI), w.peak_memory)
        cur = (round(req.cpus * MILLI), req.memory) if _is_number(req.cpus) and _is_int(req.memory) else None
        if not (base[0] <= peak[0] and base[1] <= peak[1]):
            p.append(f"window base ({w.base_cpus:g} CPUs, {_fmt_bytes(w.base_memory)}) is above its peak "
                     f"({w.peak_cpus:g} CPUs, {_fmt_bytes(w.peak_memory)})")
        elif cur is not None and not (base[0] <= cur[0] <= peak[0] and base[1] <= cur[1] <= peak[1]):
            p.append(f"the starting phase ({req.cpus:g} CPUs, {_fmt_bytes(req.memory)}) is outside the window")
        return p

    def _held_entry(self, rid, what) -> _Entry:
        e = self._live.get(rid) if isinstance(rid, str) else None
        if e is None or e.state != ADMITTED:
            self._end(None)
            state = e.state if e is not None else ("ended" if isinstance(rid, str) and rid in self._done
                                                    else "unknown")
            raise SchedulerError(f"{what}({rid!r}): the request is {state}, not running")
        return e

    def _apply(self, e: _Entry, new, base_too: bool = False):
        """e holds `new` from now on (a phase switch, or a resize: base_too)."""
        self._used = _add(_sub(self._used, e.res), new)
        self._burst = _sub(self._burst, _sub(e.res, e.base))
        e.res = new
        if base_too:
            e.base = e.peak = new
            self._bursty.pop(e.id, None)
        self._burst = _add(self._burst, _sub(e.res, e.base))

    def _free_after_switches(self):
        free = _sub(self._limit, self._used)
        for w in self._switches:
            free = _sub(free, _pos(_sub(w.new, w.entry.res)))
        return free

    def _bound(self, extra=None, grow=_ZERO):
        """Bases of every holder (+ `extra`, a candidate entry; + `grow` on the bases)
        plus the concurrent_peaks largest bursts."""
        bases = _add(_sub(self._used, self._burst), grow)
        # only the holders with a burst: every other one's is zero, which adds nothing to the top k
        # (a walk over every holder was ~1 ms of each create beside 300 sandboxes)
        bursts = [_sub(h.peak, h.base) for h in self._bursty.values()]
        if extra is not None:
            bases = _add(bases, extra.base)
            bursts.append(_sub(extra.peak, extra.base))
        return _add(bases, _topk(bursts, self.concurrent_peaks))

    def _window_ok(self, e, grow=_ZERO) -> bool:
        return _fits(self._bound(e, grow), self._limit)

    def _reject(self, req, t, problems) -> Decision:
        rid = getattr(req, "id", None)
        shown = rid if isinstance(rid, str) else repr(rid)
        reason = f"request {shown[:MAX_ID_CHARS]!r} rejected: " + "; ".join(problems)
        self._counters["rejected"] += 1
        prio = getattr(req, "priority", None)
        prio = prio if isinstance(prio, str) and prio in RANK else None
        # keep a record (for state()) unless the id is unusable or belongs to a live request
        if (isinstance(rid, str) and rid and len(rid) <= MAX_ID_CHARS and rid not in self._live):
            self._seq += 1
            e = _Entry.__new__(_Entry)
            e.id, e.priority, e.rank, e.res = rid, prio, RANK.get(prio, -1), _ZERO
            e.labels, e.submitted, e.seq = {}, t, self._seq
            e.vkey, e.key, e.admitted_at, e.waiting = 0.0, (0.0, t, e.seq), None, None
            e.cause = e.warm_slot = None
            e.base = e.peak = _ZERO
            e.state = REJECTED
            e.ended_at, e.reason = t, reason
            self._remember(e)
        self._emit(t, "request", shown[:MAX_ID_CHARS], REJECTED, None, priority=prio, reason=reason)
        return Decision(shown, REJECTED, reason)

    def _submit(self, req, t, entry=None) -> Decision:
        if entry is None:
            problems = self._check(req, t)
            if problems:
                return self._reject(req, t, problems)
            entry = self._make_entry(req, t)
        e = entry
        self._register(e)
        self._insert(e)
        mark = len(self._scratch)
        self._emit(t, "request", e.id, QUEUED, None, priority=e.priority, labels=dict(e.labels))
        self._schedule(t)
        if e.state == ADMITTED:
            del self._scratch[mark]               # admitted at once: it was never queued
            for ev in self._scratch[mark:]:
                if ev["id"] == e.id and ev["state"] == ADMITTED:
                    ev["previous"] = None
            return Decision(e.id, ADMITTED)
        self._counters["queued"] += 1
        reason = self._wait(e)[2]
        self._scratch[mark]["reason"] = reason
        return Decision(e.id, QUEUED, reason)

    def _register(self, e: _Entry):
        self._counters["submitted"] += 1
        self._live[e.id] = e
        self._done.pop(e.id, None)                # a new life for a reused id

    def _insert(self, e: _Entry):
        q = self._queue
        lo, hi = 0, len(q)
        while lo < hi:
            mid = (lo + hi) // 2
            if q[mid].key < e.key:
                lo = mid + 1
            else:
                hi = mid
        q.insert(lo, e)

    def _admit(self, e: _Entry, t: float, reason: str | None = None, previous: str | None = QUEUED):
        e.state = ADMITTED
        e.admitted_at = t
        e.waiting = None
        e.reason = None
        self._used = _add(self._used, e.res)
        self._burst = _add(self._burst, _sub(e.res, e.base))
        self._held[e.id] = e
        if e.peak != e.base:
            self._bursty[e.id] = e
        self._counters["admitted"] += 1
        self._acts["admitted"].append(e.id)
        self._emit(t, "request", e.id, ADMITTED, previous, priority=e.priority, reason=reason,
                   waited=t - e.submitted, labels=dict(e.labels))

    def _finish(self, e: _Entry, state: str, t: float, reason: str | None):
        previous = e.state
        e.state = state
        e.ended_at = t
        e.reason = reason
        e.waiting = None
        del self._live[e.id]
        self._held.pop(e.id, None)
        self._bursty.pop(e.id, None)
        self._remember(e)
        self._emit(t, "request", e.id, state, previous, priority=e.priority, reason=reason,
                   cause=e.cause, labels=dict(e.labels))

    def _remember(self, e: _Entry):
        if self._history == 0:
            return
        self._done[e.id] = e
        self._done.move_to_end(e.id)
        while len(self._done) > self._history:
            self._done.popitem(last=False)

    def _end_slot(self, slot: _Slot, state: str, t: float, reason: str | None = None):
        previous = slot.state
        slot.state = state
        slot.ended_at = t
        if self._history:
            self._warm_done[slot.id] = slot
            while len(self._warm_done) > self._history:
                self._warm_done.popitem(last=False)
        self._emit(t, "warm", slot.id, state, previous, profile=slot.profile, reason=reason,
                   cause=slot.cause)

    def _standing(self, p: _Entry) -> float:
        """A running preemptible sandbox's effective priority frozen at admission
        (in the same units as _current)."""
        if self.aging_seconds is None:
            return float(p.rank)
        return p.vkey - p.admitted_at

    def _current(self, e: _Entry, t: float) -> float:
        if self.aging_seconds is None:
            return float(e.rank)
        return e.vkey - t

    def _wait(self, e: _Entry):
        """(waiting, blocked_by, reason) of a queued request. Requests behind
        the one waiting for capacity are not visited by the pass: derived here."""
        b = self._blocker
        if b is not None and b is not e and b.key < e.key:
            return (WAIT_HEAD_OF_LINE, b.id,
                    f"queued behind {b.id!r}, which waits for capacity (head of line)")
        return e.waiting, None, e.reason

    def _schedule(self, t: float):
        """One pass over the queue in order, up to the first request that must
        wait for capacity (see docs/scheduler.md, "The pass")."""
        # waiting phase switches first, in FIFO order: granted when their increase fits
        # what is free; the first that does not (and every one after it) reserves its increase
        waiting = False
        for w in list(self._switches):
            delta = _pos(_sub(w.new, w.entry.res))
            if not waiting and _fits(delta, _sub(self._limit, self._used)):
                self._apply(w.entry, w.new)
                self._switches.remove(w)
                self._counters["phase_switches"] += 1
                self._acts["phases"].append(w.entry.id)
            else:
                waiting = True
        avail = self._free_after_switches()                    # free right now (switches' reservations out)
        proj = _add(avail, self._pending)                      # free once those being freed are gone
        warm = prey = None                                     # reclaim candidates, youngest first
        self._blocker = None
        q = self._queue
        i = 0
        while i < len(q):
            e = q[i]
            need = e.res
            if _fits(need, avail) and _fits(need, proj):
                if not self._window_ok(e):
                    e.waiting = WAIT_CAPACITY
                    b = self._bound(e)
                    e.reason = (f"waiting for capacity: with it, the bases plus the {self.concurrent_peaks} "
                                f"largest peak(s) of the resource windows would need {_fmt_cpus(b[0])} CPUs "
                                f"and {_fmt_bytes(b[1])}; the limit is {_fmt_cpus(self._limit[0])} CPUs and "
                                f"{_fmt_bytes(self._limit[1])}")
                    self._blocker = e
                    return
                q.pop(i)
                self._admit(e, t)
                avail, proj = _sub(avail, need), _sub(proj, need)
                continue
            if not _fits(need, proj):
                if warm is None:
                    warm = sorted((s for s in self._warm.values() if s.state == WARM_READY),
                                  key=lambda s: (s.created, s.seq), reverse=True)
                cands = list(warm)
                if e.rank < PREEMPTIBLE_RANK:
                    if prey is None:
                        prey = sorted((h for h in self._held.values()
                                       if h.state == ADMITTED and h.rank == PREEMPTIBLE_RANK),
                                      key=lambda h: (h.admitted_at, h.seq), reverse=True)
                    cur = self._current(e, t)
                    cands += [p for p in prey if cur < self._standing(p)]
                short = _short(need, proj)
                chosen = _choose(short, cands)
                if chosen is None:
                    e.waiting = WAIT_CAPACITY
                    e.reason = (f"waiting for capacity: short of {_describe_short(short)}"
                                " after the requests ahead of it")
                    self._blocker = e
                    return
                for c in chosen:
                    if isinstance(c, _Slot):
                        warm.remove(c)
                        c.state, c.cause = WARM_DRAINING, e.id
                        self._counters["warm_drained"] += 1
                        self._acts["drain"].append(c.id)
                        self._emit(t, "warm", c.id, WARM_DRAINING, WARM_READY, profile=c.profile,
                                   reason=f"drained for request {e.id!r}", cause=e.id)
                    else:
                        prey.remove(c)
                        c.state, c.cause = PREEMPTING, e.id
                        self._acts["preempt"].append(c.id)
                        self._emit(t, "request", c.id, PREEMPTING, ADMITTED, priority=c.priority,
                                   reason=f"preempted for request {e.id!r} ({e.priority})",
                                   cause=e.id, labels=dict(c.labels))
                    self._pending = _add(self._pending, c.res)
                    proj = _add(proj, c.res)
            e.waiting = WAIT_PENDING
            e.reason = "waiting for preempted or drained sandboxes to exit"
            proj = _sub(proj, need)
            i += 1


def _choose(short, cands: Iterable):
    """Victims covering `short`, taken in the given order (warm sandboxes, then
    the youngest preemptible sandboxes), then pruned to an irreducible set by
    dropping, last-taken first, those that are not needed (so older sandboxes
    are spared first, and preemptions before warm drains). None if even all of
    them would not cover it."""
    cands = list(cands)
    total = _ZERO
    for c in cands:
        total = _add(total, c.res)
    if not _fits(short, total):
        return None
    picked, acc = [], _ZERO
    for c in cands:
        if _fits(short, acc):
            break
        picked.append(c)
        acc = _add(acc, c.res)
    for c in reversed(list(picked)):
        rest = _sub(acc, c.res)
        if _fits(short, rest):
            picked.remove(c)
            acc = rest
    return picked
