"""Live resources of the node agent's sandboxes (docs/scheduler.md "Resource
windows", docs/agent.md "Live resources"): changing a running sandbox's cgroup
limits, resource windows and their phases, and the per-sandbox circuit breaker.

    update_resources(agent, sid, cpus=2, memory=..., pids=..., force=False, thaw=False)   # UpdateResources
    set_phase(agent, sid, "verify", wait_seconds=5)                                       # SetPhase
    win = window_of(request["window"], pids)          # CreateSandbox's window, checked (WindowSpec | None)
    Breaker(agent).start()                            # OOM loops and pinned CPU quotas -> cut / freeze / stop
    limit_memory_of_fresh(agent, rec, memory, why)    # run_code's memory_limit_MB on a just-claimed sandbox

Every change goes through the scheduler first when it asks for more (re-admission:
refused with the reason when the node has no room), is written to the cgroup (v1
or v2) in the order that never leaves the books claiming less than the kernel
enforces, and is recorded as a lifecycle event: resources_updated, phase_waiting,
phase_switched, phase_refused, breaker_tripped, thawed.
"""
from __future__ import annotations

import errno
import logging
import math
import re
import threading
import time
from collections import deque

from agent.node.records import KILLED, RUNNING, ApiError, _bad

log = logging.getLogger("dsec.agent")

_PHASE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_PHASES = 16
MIN_MEMORY = 4 << 20


def _fmt(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"


def _res(cpus, memory, pids) -> dict:
    return {"cpus": cpus, "memory": memory, "pids": pids}


# ---------------------------------------------------------------- windows

class WindowSpec:
    """A sandbox's resource window: base, peak, named phases (cpus, memory); the
    phase it is in and the one it waits for."""

    def __init__(self, base, peak, phases: dict, phase: str):
        self.base = base                  # (cpus, memory)
        self.peak = peak
        self.phases = phases              # name -> (cpus, memory); "base" and "peak" included
        self.phase = phase
        self.pending: str | None = None
        self.asked = 0.0

    def sched_window(self):
        from agent.node.scheduler import Window
        return Window(self.base[0], self.base[1], self.peak[0], self.peak[1])

    def to_dict(self) -> dict:
        return {"base": {"cpus": self.base[0], "memory": self.base[1]},
                "peak": {"cpus": self.peak[0], "memory": self.peak[1]},
                "phases": {n: {"cpus": c, "memory": m} for n, (c, m) in self.phases.items()},
                "phase": self.phase, "pending": self.pending}


def window_of(w: dict | None, cpus=0.0, memory=0) -> WindowSpec | None:
    """CreateSandbox's window ({"base": {cpus, memory_bytes}, "peak": ..., "phases": {name: ...},
    "initial_phase": name}) checked: a WindowSpec, None, or ApiError naming every problem.
    cpus/memory: the request's fixed resources, which a window replaces."""
    if not w:
        return None
    problems = []
    if cpus or memory:
        problems.append("resources.cpus / resources.memory_bytes and window: give one (with a window, the "
                        "sandbox's size is its phase's)")

    def res(what, r):
        if not r:
            return None
        c, m = r.get("cpus") or 0.0, r.get("memory_bytes") or 0
        if not isinstance(c, (int, float)) or math.isnan(c) or math.isinf(c) or c <= 0:
            problems.append(f"window.{what}.cpus: a resource window needs CPUs > 0 (its phases are CPU quotas), "
                            f"got {c!r}")
        if not isinstance(m, int) or m < MIN_MEMORY:
            problems.append(f"window.{what}.memory_bytes: at least 4 MiB, got {m!r}")
        return (float(c), int(m))
    phases = {}
    raw_phases = w.get("phases") or {}
    if len(raw_phases) > MAX_PHASES:
        problems.append(f"window.phases: at most {MAX_PHASES}, got {len(raw_phases)}")
    for name, r in list(raw_phases.items())[:MAX_PHASES + 1]:
        if not _PHASE_RE.match(name or "") or name in ("base", "peak"):
            problems.append(f"window.phases: name {str(name)[:40]!r}: 1-63 of [A-Za-z0-9_.-] "
                            f"('base' and 'peak' are the window's own)")
            continue
        phases[name] = res(f"phases.{name}", r)
    base, peak = res("base", w.get("base")), res("peak", w.get("peak"))
    named = [v for v in phases.values() if v]
    if base is None and named:
        base = (min(c for c, _ in named), min(m for _, m in named))
    if peak is None and named:
        peak = (max(c for c, _ in named), max(m for _, m in named))
    if base is None or peak is None:
        problems.append("window: give base and peak (or named phases to derive them from)")
    if problems:
        raise _bad("; ".join(problems))
    if base[0] > peak[0] or base[1] > peak[1]:
        raise _bad(f"window: base ({base[0]:g} CPUs, {_fmt(base[1])}) is above peak ({peak[0]:g} CPUs, "
                   f"{_fmt(peak[1])})")
    for name, (c, m) in phases.items():
        if not (base[0] <= c <= peak[0] and base[1] <= m <= peak[1]):
            problems.append(f"window.phases.{name}: ({c:g} CPUs, {_fmt(m)}) is outside base..peak")
    phases.update(base=base, peak=peak)
    initial = w.get("initial_phase") or "base"
    if initial not in phases:
        problems.append(f"window.initial_phase {initial[:40]!r}: not a phase ({', '.join(sorted(phases))})")
    if problems:
        raise _bad("; ".join(problems))
    return WindowSpec(base, peak, phases, initial)


# ---------------------------------------------------------------- cgroup changes

def _write_limits(rec, cpus=None, memory=None, pids=None):
    """cgroup limits (None: unchanged); ApiError naming what the kernel refused."""
    cg = rec.cg
    if cg is None:
        raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} has no cgroup to change")
    try:
        cg.update_limits(cpus=cpus, memory=memory, pids=pids)
    except OSError as e:
        what = ", ".join(k for k, v in (("cpus", cpus), ("memory", memory), ("pids", pids)) if v is not None)
        if e.errno == errno.EBUSY and memory is not None:
            raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id}: memory {_fmt(memory)}: the kernel could not "
                                                  f"reclaim down to it (cgroup v1 refuses rather than OOM-kill); "
                                                  f"the limit is unchanged") from None
        raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id}: the kernel refused the new {what} limit: "
                                              f"{e.strerror or e}") from None


def _check_usage(rec, memory: int | None, force: bool, what: str):
    if memory is None or force:
        return
    cg = rec.cg
    cur = cg.memory_current() if cg is not None else 0
    if memory < cur:
        raise ApiError("FAILED_PRECONDITION", f"{what}: memory {_fmt(memory)} is below sandbox {rec.id}'s current "
                                              f"usage {_fmt(cur)} (force: let the kernel reclaim down to it, "
                                              f"or OOM-kill)")


def _began_to_stop(rec) -> ApiError:
    return ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: it began to stop while its "
                                           f"resources were changing")


def _running(agent, sid: str, caller=None, method: str = "UpdateResources"):
    rec = agent.lookup(sid, caller, method) if caller is not None else agent.lookup(sid)
    if rec.state != RUNNING or rec.sandbox is None:
        raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: only a running sandbox's "
                                              f"resources can change")
    return rec


def update_resources(agent, sid: str, cpus: float = 0.0, memory: int = 0, pids: int = 0, force: bool = False,
                     thaw: bool = False, reason: str = "", by: str = "api", caller=None) -> dict:
    """UpdateResources: 0 = unchanged. Returns {"sandbox_id", "resources", "previous", "thawed"}."""
    problems = []
    if not isinstance(cpus, (int, float)) or math.isnan(cpus) or math.isinf(cpus) or cpus < 0:
        problems.append(f"resources.cpus: must be a number >= 0 (0 = unchanged), got {cpus!r}")
    if memory < 0 or 0 < memory < MIN_MEMORY:
        problems.append(f"resources.memory_bytes: 0 (unchanged) or at least 4 MiB, got {memory}")
    if pids < 0 or pids > (1 << 22):
        problems.append(f"resources.pids: between 0 (unchanged) and {1 << 22}, got {pids}")
    if len(reason) > 1024:
        problems.append("reason: at most 1024 characters")
    if problems:
        raise _bad("; ".join(problems))
    rec = _running(agent, sid, caller)
    if getattr(rec, "window", None) is not None and (cpus or memory or pids):
        raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} has a resource window: switch its phase with "
                                              f"SetPhase (its limits follow the phase)")
    old = (rec.cpus, rec.memory, rec.pids, rec.spec.cpus)
    new_acc = float(cpus) if cpus else rec.cpus
    new_quota = float(cpus) if cpus else old[3]
    new_mem = int(memory) if memory else rec.memory
    new_pids = int(pids) if pids else rec.pids
    thawed = False
    if new_quota != old[3] or new_mem != old[1] or new_pids != old[2]:
        _check_usage(rec, new_mem if new_mem < old[1] else None, force, f"sandbox {rec.id}")
        # what the kernel enforces lower goes first, what it enforces higher after the scheduler
        # granted it: the books never claim less than the kernel lets the sandbox use
        tighter = (new_quota if new_quota is not None and (old[3] is None or new_quota < old[3]) else None,
                   new_mem if new_mem < old[1] else None, new_pids if new_pids < old[2] else None)
        looser = (new_quota if new_quota is not None and old[3] is not None and new_quota > old[3] else None,
                  new_mem if new_mem > old[1] else None, new_pids if new_pids > old[2] else None)
        undo = (old[3] or 0.0 if tighter[0] is not None else None, old[1] if tighter[1] is not None else None,
                old[2] if tighter[2] is not None else None)
        if any(v is not None for v in tighter):
            _write_limits(rec, *tighter)
        with agent._lock:
            # checked again under the lock: a sandbox that began to stop since _running (a kill,
            # a preemption) is no longer the scheduler's to resize
            d = agent.sched.resize(rec.id, new_acc, new_mem, new_pids) \
                if rec.state == RUNNING and rec.stop_kind is None else None
            if d is not None and d.rejected:
                agent._after_sched_locked(d.actions)
        if d is None:
            raise _began_to_stop(rec)
        if d.rejected:
            if any(v is not None for v in undo):
                _write_limits(rec, *undo)
            agent._flush_emits()
            raise ApiError("RESOURCE_EXHAUSTED", d.reason or "the scheduler refused the new size")
        try:
            if any(v is not None for v in looser):
                _write_limits(rec, *looser)
        except ApiError as e:
            # the kernel kept the old limit where it was to rise: the books keep the smaller of
            # old and new in every dimension (a shrink of what was granted: it always fits)
            part = (min(new_acc, old[0]), min(new_mem, old[1]), min(new_pids, old[2]))
            with agent._lock:
                if rec.state != RUNNING or rec.stop_kind is not None:
                    raise _began_to_stop(rec) from None
                agent._after_sched_locked(agent.sched.resize(rec.id, *part).actions)
                rec.cpus, rec.memory, rec.pids = part
                rec.spec.cpus = tighter[0] if tighter[0] is not None else old[3]
                rec.spec.memory, rec.spec.pids = part[1], part[2]
                agent._lifecycle(rec.id, "resources_updated", step=rec.steps, by=by, partial=True,
                                 reason=e.message, resources={"cpus": rec.spec.cpus, "cpus_accounted": part[0],
                                                              "memory": part[1], "pids": part[2]})
            agent._flush_emits()
            raise
        with agent._lock:
            rec.cpus, rec.memory, rec.pids = new_acc, new_mem, new_pids
            rec.spec.cpus, rec.spec.memory, rec.spec.pids = new_quota, new_mem, new_pids
            agent._lifecycle(rec.id, "resources_updated", step=rec.steps, by=by, reason=reason or None,
                             forced=force or None,
                             previous={"cpus": old[3], "cpus_accounted": old[0], "memory": old[1], "pids": old[2]},
                             resources={"cpus": new_quota, "cpus_accounted": new_acc, "memory": new_mem,
                                        "pids": new_pids})
            agent._after_sched_locked(d.actions)
    if thaw and getattr(rec, "frozen", False):
        thawed = thaw_sandbox(agent, rec, reason or "thawed on request")
    agent._flush_emits()
    return {"sandbox_id": rec.id, "resources": _res(rec.spec.cpus or 0.0, rec.memory, rec.pids),
            "previous": _res(old[3] or 0.0, old[1], old[2]), "thawed": thawed}


def set_phase(agent, sid: str, phase: str, wait_seconds: float = 0.0, force: bool = False, caller=None) -> dict:
    """SetPhase: the sandbox's limits follow the phase's resources once the scheduler
    grants it. Returns {"sandbox_id", "phase", "resources", "waited_seconds"}."""
    if not isinstance(wait_seconds, (int, float)) or math.isnan(wait_seconds) or not 0 <= wait_seconds <= 3600:
        raise _bad(f"wait_seconds: between 0 and 3600, got {wait_seconds!r}")
    rec = _running(agent, sid, caller, "SetPhase")
    win = getattr(rec, "window", None)
    if win is None:
        raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} has no resource window (CreateSandbox.window): "
                                              f"change its size with UpdateResources")
    if phase not in win.phases:
        raise _bad(f"phase {phase[:40]!r}: sandbox {rec.id}'s phases are {', '.join(sorted(win.phases))}")
    t0 = time.monotonic()
    cpus, memory = win.phases[phase]
    cur = win.phases[win.phase]
    if phase == win.phase and win.pending is None:
        return {"sandbox_id": rec.id, "phase": phase, "resources": _res(cpus, memory, rec.pids), "waited_seconds": 0.0}
    _check_usage(rec, memory if memory < cur[1] else None, force, f"phase {phase!r}")
    lo = (min(cpus, cur[0]) if cpus < cur[0] else None, min(memory, cur[1]) if memory < cur[1] else None)
    if any(v is not None for v in lo):            # what shrinks goes to the kernel first
        _write_limits(rec, lo[0], lo[1])
    with agent._lock:
        d = agent.sched.set_phase(rec.id, cpus, memory, wait=wait_seconds > 0)
        if d.outcome == "applied":
            _switched(agent, rec, phase, 0.0)
        elif d.outcome == "queued":
            win.pending, win.asked = phase, time.monotonic()
            agent._lifecycle(rec.id, "phase_waiting", step=rec.steps, phase=phase, previous=win.phase,
                             reason=d.reason)
        else:
            agent._lifecycle(rec.id, "phase_refused", step=rec.steps, phase=phase, previous=win.phase,
                             reason=d.reason)
        agent._after_sched_locked(d.actions)
    agent._flush_emits()
    if d.rejected:
        if any(v is not None for v in lo):
            _write_limits(rec, cur[0] if lo[0] is not None else None, cur[1] if lo[1] is not None else None)
        raise ApiError("RESOURCE_EXHAUSTED", f"phase {phase!r} of sandbox {rec.id} does not fit now: {d.reason}")
    deadline = t0 + wait_seconds
    with rec.changed:                             # the agent's lock; woken by this sandbox's changes
        while win.pending == phase and rec.state == RUNNING and time.monotonic() < deadline:
            rec.changed.wait(min(0.25, max(0.0, deadline - time.monotonic())))
        if win.pending == phase and rec.state != RUNNING:
            win.pending = None                    # it ended while waiting: the scheduler let go of it
            timed_out = False
        elif win.pending == phase:                # still waiting: withdraw it
            win.pending = None
            acts = agent.sched.cancel_phase(rec.id)
            agent._lifecycle(rec.id, "phase_refused", step=rec.steps, phase=phase, previous=win.phase,
                             reason=f"did not fit within {wait_seconds:g}s: {d.reason}")
            agent._after_sched_locked(acts)
            timed_out = True
        else:
            timed_out = False
    agent._flush_emits()
    if timed_out:
        if any(v is not None for v in lo):
            _write_limits(rec, cur[0] if lo[0] is not None else None, cur[1] if lo[1] is not None else None)
        raise ApiError("RESOURCE_EXHAUSTED", f"phase {phase!r} of sandbox {rec.id} did not fit within "
                                             f"{wait_seconds:g}s: {d.reason}")
    if win.phase != phase:
        raise ApiError("ABORTED", f"sandbox {rec.id} ended while its phase {phase!r} waited")
    return {"sandbox_id": rec.id, "phase": phase, "resources": _res(cpus, memory, rec.pids),
            "waited_seconds": round(time.monotonic() - t0, 6)}


def _switched(agent, rec, phase: str, waited: float):
    """The scheduler granted `phase` (under the agent's lock): raise what grows, record it."""
    win = rec.window
    cpus, memory = win.phases[phase]
    prev = win.phases[win.phase]
    try:
        _write_limits(rec, cpus if cpus > prev[0] else None, memory if memory > prev[1] else None)
    except ApiError as e:                         # the books hold the phase: say the kernel did not follow
        log.error("sandbox %s: phase %s: %s", rec.id, phase, e.message)
        agent._lifecycle(rec.id, "phase_refused", step=rec.steps, phase=phase, previous=win.phase,
                         reason=e.message)
        return
    agent._lifecycle(rec.id, "phase_switched", step=rec.steps, phase=phase, previous=win.phase,
                     resources={"cpus": cpus, "memory": memory}, waited_s=round(waited, 6))
    win.phase, win.pending = phase, None
    rec.cpus, rec.memory = cpus, memory
    rec.spec.cpus, rec.spec.memory = cpus, memory
    agent._changed_locked(rec)


def on_actions(agent, actions):
    """The agent's hook for what the scheduler decided (under its lock): waiting phase
    switches it granted."""
    for rid in getattr(actions, "phases", ()) or ():
        rec = agent._records.get(rid)
        win = getattr(rec, "window", None) if rec is not None else None
        if win is not None and win.pending:
            _switched(agent, rec, win.pending, time.monotonic() - win.asked)


def limit_memory_of_fresh(agent, rec, memory: int, reason: str) -> str | None:
    """A sandbox just handed to a request (nothing of the caller's ran yet) gets a lower
    memory limit than its profile's; the scheduler keeps accounting the profile's size
    (more than it uses: never over-commits). None, or why it could not be done."""
    sb = rec.sandbox
    if sb is None or sb.cg is None:
        return f"sandbox {rec.id}: no cgroup to limit"
    before = sb.cg.limits().get("memory")
    try:
        sb.cg.update_limits(memory=memory)
    except OSError as e:
        return f"sandbox {rec.id}: cannot set its memory limit to {memory} bytes: {e.strerror}"
    with agent._lock:
        agent._lifecycle(rec.id, "resources_updated", step=rec.steps, by="run_code", memory=memory,
                         previous={"memory": before}, accounted={"memory": rec.memory}, reason=reason)
    agent._flush_emits()
    return None


# ---------------------------------------------------------------- freezer

def thaw_sandbox(agent, rec, reason: str) -> bool:
    cg = rec.cg
    if cg is None or not getattr(rec, "frozen", False):
        return False
    try:
        cg.freeze(False)
    except OSError as e:
        log.error("sandbox %s: cannot thaw: %s", rec.id, e)
        return False
    with agent._lock:
        rec.frozen = False
        agent._lifecycle(rec.id, "thawed", step=rec.steps, reason=reason)
    return True


def thaw_if_frozen(agent, rec):
    """Before a frozen sandbox is stopped or closed: its supervisor must run to do it."""
    if getattr(rec, "frozen", False):
        thaw_sandbox(agent, rec, "thawed to be stopped")


# ---------------------------------------------------------------- the circuit breaker

class Breaker:
    """Per-sandbox circuit breaker (config `breaker`): N OOM kills within a window, or
    its CPU quota throttled in more than X% of the periods for Y seconds, lead to the
    configured action (cut_quota, freeze, stop), recorded as `breaker_tripped`."""

    def __init__(self, agent):
        self.agent = agent
        self.cfg = agent.cfg.breaker
        self.state: dict[str, dict] = {}
        self.trips: dict[tuple, int] = {}
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        c = self.cfg
        if c.oom is None and c.cpu is None:
            return self
        self._thread = threading.Thread(target=self._loop, name="dsec-agent-breaker", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self):
        while not self._stop.wait(self.cfg.interval_seconds):
            try:
                self.sample(time.monotonic())
            except Exception:  # noqa: BLE001
                log.exception("circuit breaker sample failed")
            finally:
                self.agent._flush_emits()

    def sample(self, now: float):
        a = self.agent
        with a._lock:
            # (record, cgroup) taken together under the lock: a sandbox that ends meanwhile drops
            # its launcher (SandboxRecord.cg), and its cgroup's files then read as empty, never an error
            live = [(r, r.cg) for r in a._records.values() if r.state == RUNNING and r.cg is not None
                    and r.stop_kind is None and not r.frozen]
        ids = {r.id for r, _ in live}
        for sid in list(self.state):
            if sid not in ids:
                del self.state[sid]
        for rec, cg in live:
            st = self.state.get(rec.id)
            if st is None:
                st = self.state[rec.id] = {"oom_last": cg.oom_kills(), "ooms": deque(), "prev": cg.cpu_stat(),
                                           "since": None}
                continue
            o = self.cfg.oom
            if o is not None:
                k = cg.oom_kills()
                for _ in range(max(0, k - st["oom_last"])):
                    st["ooms"].append(now)
                st["oom_last"] = k
                while st["ooms"] and now - st["ooms"][0] > o.window_seconds:
                    st["ooms"].popleft()
                if len(st["ooms"]) >= o.kills:
                    n = len(st["ooms"])
                    st["ooms"].clear()
                    self.trip(rec, cg, "oom", o.action, f"{n} OOM kills within {o.window_seconds:g}s", {"oom_kills": n})
                    continue
            c = self.cfg.cpu
            if c is not None:
                cur = cg.cpu_stat()
                prev, st["prev"] = st["prev"], cur
                periods = cur["nr_periods"] - prev["nr_periods"]
                if periods <= 0:
                    st["since"] = None
                    continue
                pct = 100.0 * (cur["nr_throttled"] - prev["nr_throttled"]) / periods
                if pct < c.throttled_percent:
                    st["since"] = None
                    continue
                st["since"] = st["since"] or now
                if now - st["since"] >= c.for_seconds:
                    held = now - st["since"]
                    st["since"] = None
                    self.trip(rec, cg, "cpu", c.action, f"CPU throttled in {pct:.0f}% of its quota's periods for "
                                                    f"{held:.0f}s", {"throttled_percent": round(pct, 1)},
                              cut_to=c.cut_to)

    def trip(self, rec, cg, trigger: str, action: str, why: str, figures: dict, cut_to: float = 0.5):
        a = self.agent
        done = action
        detail = {}
        if action == "freeze":
            if not cg.can_freeze():
                done, detail["fallback"] = "stop", "no cgroup2 freezer on this host: stopped instead"
            else:
                with a._lock:              # under the lock: a stop that begins after this sees it frozen
                    if rec.state != RUNNING or rec.stop_kind is not None:
                        return
                    try:
                        cg.freeze(True)
                        rec.frozen = True
                    except OSError as e:
                        done, detail["fallback"] = "stop", f"freeze failed ({e.strerror}): stopped instead"
        elif action == "cut_quota":
            quota = rec.spec.cpus or rec.cpus
            new = max(0.01, round(quota * cut_to, 3))
            try:
                r = update_resources(a, rec.id, cpus=new, reason=f"circuit breaker: {why}", by="breaker")
                detail["resources"] = r["resources"]
            except ApiError as e:
                done, detail["fallback"] = "stop", f"cutting the quota failed ({e.message}): stopped instead"
        with a._lock:
            if done == "stop" and (rec.state != RUNNING or rec.stop_kind is not None):
                return                 # it ended or began to stop under the trip: no stop of ours to record
            self.trips[(trigger, done)] = self.trips.get((trigger, done), 0) + 1
            a._lifecycle(rec.id, "breaker_tripped", step=rec.steps, trigger=trigger, action=done, reason=why,
                         **figures, **detail)
            log.warning("sandbox %s: circuit breaker (%s): %s -> %s", rec.id, trigger, why, done)
            if done == "stop":
                a._begin_stop_locked(rec, KILLED, f"circuit breaker: {why}", a.cfg.defaults.grace_seconds)
        a._flush_emits()
