"""AuditSensor: the eBPF audit programs of bpf/ loaded with BCC.

    sensor = AuditSensor(on_record=spool.put)        # compiles, loads, attaches
    sensor.add_sandbox(cgroup_id, "sbx-1", policy_name="p", root_pid=pid)
    ... sensor.poll(100) in the agent's loop ...
    sensor.set_step(cgroup_id, 2)
    totals = sensor.remove_sandbox(cgroup_id)          # drains, reports losses
    sensor.close()

One AuditSensor per process (one compile, ~1 s). poll(), add_sandbox(),
set_step() and remove_sandbox() may be called from different threads: they
are serialised by a lock. poll() waits for the ring buffer WITHOUT the lock
(poll(2) on the ring buffer's map fd) and takes it only to consume and decode,
so a step's set_step() or a new sandbox never waits out a poll timeout. Woken
from a quiet ring, it waits WAKE_SETTLE_S (5 ms) more before it reads: the
burst that woke it (a step) runs without the decoding beside it.

Losses are never silent: every event the kernel could not emit is counted per
sandbox, by reason (ringbuf_full, over_budget, inflight_full) and kind; poll()
turns new counts into `events_lost` records at most every loss_interval_s, and
remove_sandbox() reports the rest before it returns the totals.

Over budget (the per-sandbox fair share, a token bucket of `rate` events/s and
`burst` events enforced in the kernel):
  "summarise"  (default) what is over budget is counted and reported as
               events_lost; the sandbox runs on.
  "stop"       the kernel also SIGKILLs the process whose event could not be
               recorded (any loss: budget, ring buffer, in-flight table), and
               the agent calls on_over_budget(cgroup_id, sandbox_id, lost) once
               so the launcher stops the whole sandbox; stopped(cgroup_id) says
               whether it happened.
"""
from __future__ import annotations

import os
import select
import time

from agent.sandbox.cgroups import cgroup_populated
from agent.sensors.common import BPF_DIR, TRACEFS, RINGBUF_MISSING, RingSensor, base_missing, cgroup2_mount
from agent.sensors.common import StderrCapture as _StderrCapture, first_error as _first_error  # noqa: F401 (API)
from agent.sensors.common import ringbuf_supported as _ringbuf_supported
from agent.sensors.common import (check_sandbox_ids, compile_text, describe, loss_totals,
                              map_discard, ring_pages, source_text, token_bucket, tracepoints_in, unavailable,
                              byte_bucket)
from agent.sensors.decoder import SandboxInfo, load_constants
from agent.sensors.procs import pin_root, root_ready
from agent.sensors.repeats import ENV as AGGREGATE_ENV, KINDS as AGGREGATE_KINDS, RETIRE_SETTLE_S, Repeats
from agent.errors import DsecError

SOURCES = ("membership.h", "common.h", "process.c", "net.c", "files.c")   # concatenated in this order

DEFAULT_RING_BYTES = 32 << 20
DEFAULT_ARGV_BYTES = 16384
DEFAULT_MAX_ARGS = 256
DEFAULT_RATE = 5000          # events per second per sandbox
DEFAULT_BURST = 25000        # events
DEFAULT_MAX_INFLIGHT = 512   # syscalls in flight per sandbox and kind
DEFAULT_PENDING_ENTRIES = 16384   # file/connect syscalls in flight, all sandboxes (a quarter kept in reserve)
PENDING_FAIR = 16            # DSEC_PENDING_FAIR: in flight per sandbox that the reserve serves
DEFAULT_BYTE_RATE = 8 << 20  # bytes of records per second per sandbox
BYTE_BURST_SHARE = 8         # default byte burst: the ring buffer's size / this
OVER_BUDGET = ("summarise", "stop")
LABELS = ("policy_name", "policy_hash", "mode")
REMOVAL_SETTLE_S = 0.005     # remove_sandbox of a cgroup that may still run: from the map removal to the last consume
# poll(): the first record after a quiet ring (the kernel wakes the reader at once, bpf/common.h
# DSEC_WAKE_NS) is usually the first of a burst -- a step's clone and exec -- and reading it at
# once decoded a handful of records while that step ran, on the agent's interpreter lock and two
# CPUs the step's own reply needed: the reader waits this long first, and decodes the burst in
# one pass (bench/launch.py, steps alone, 9 pairs: step - fork+exec 1.01-2.04 -> 0.95-1.56 ms,
# p99 6.8-13.2 -> 5.6-8.2 ms). Records already waiting are read at once; a burst's records reach
# the spool at most WAKE_SETTLE_S later, within the poll timeout (20 ms) that bounded them before.
WAKE_SETTLE_S = 0.005


# ---------------------------------------------------------------- features

def _source_text() -> str:
    return source_text(SOURCES)


def tracepoints_used(text: str | None = None) -> list[str]:
    return tracepoints_in(_source_text() if text is None else text)


def check_features(tracefs_roots=TRACEFS) -> list[str]:
    """What the audit sensor needs and does not have (empty list: all there)."""
    missing = base_missing(tracefs_roots, tracepoints_used())
    if os.geteuid() == 0 and not _ringbuf_supported():
        missing.append(RINGBUF_MISSING)
    if cgroup2_mount() is None:
        missing.append("no cgroup2 hierarchy mounted (sandboxes are keyed by cgroup2 id)")
    return missing


def require_features(tracefs_roots=TRACEFS) -> None:
    missing = check_features(tracefs_roots)
    if missing:
        raise DsecError(unavailable("audit", missing))


# ---------------------------------------------------------------- compile

def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def build_cflags(*, ring_bytes: int, argv_bytes: int, max_args: int, max_inflight: int,
                 pending_entries: int = DEFAULT_PENDING_ENTRIES) -> list[str]:
    pages = ring_pages(ring_bytes, "audit")
    if argv_bytes & (argv_bytes - 1) or not 4096 <= argv_bytes <= 131072:
        raise DsecError(f"argv bound {argv_bytes} must be a power of two between 4096 and 131072")
    if not 1 <= max_args <= 1024:
        raise DsecError(f"argument count bound {max_args} must be between 1 and 1024")
    if not 1 <= max_inflight <= 1 << 20:
        raise DsecError(f"in-flight bound {max_inflight} must be between 1 and 1048576")
    if not 4 * PENDING_FAIR <= pending_entries <= 1 << 20:
        raise DsecError(f"in-flight table of {pending_entries} entries: must be between {4 * PENDING_FAIR} "
                        "and 1048576")
    from bcc.utils import get_possible_cpus   # noqa: WPS433 (bcc only here)
    ncpu = max(get_possible_cpus()) + 1
    return [
        f"-I{BPF_DIR}",
        f"-DDSEC_RING_PAGES={pages}",
        f"-DDSEC_ARGV_BYTES={argv_bytes}",
        f"-DDSEC_EXEC_OFF_MASK={_pow2_at_least(4096 + argv_bytes) - 1}",
        f"-DDSEC_MAX_ARGS={max_args}",
        f"-DDSEC_NCPU={ncpu}",
        f"-DDSEC_MAX_INFLIGHT={max_inflight}",
        f"-DDSEC_PENDING_ENTRIES={pending_entries}",
        "-DDSEC_SBX_T=struct dsec_sandbox",          # the configuration type of membership.h's sandboxes
    ]


def compile_bpf(cflags: list[str], pins: dict | None = None):
    return compile_text(_source_text(), cflags, "audit", pins=pins)


def _cwd_cflags(pins: dict | None) -> list[str]:
    """process.c opens the enforcement sensor's cwd maps at these bpffs paths."""
    if not pins:
        return []
    for p in pins.values():
        if '"' in p or "\\" in p:
            raise DsecError(f"cwd map pin {p!r}: not a plain path")
    return [f'-DDSEC_CWD_PIN_GEN="{pins["gen"]}"', f'-DDSEC_CWD_PIN_CWD="{pins["cwd"]}"']


def _cwd_map_pins(pins: dict | None) -> dict | None:
    """{map name: pinned path} of process.c's two cwd maps (compile_text's pins)."""
    return {"enf_cwd_gen": pins["gen"], "enf_cwd": pins["cwd"]} if pins else None


# ---------------------------------------------------------------- the sensor

class AuditSensor(RingSensor):
    WHAT = "audit"
    VERB = "audited"

    def __init__(self, on_record=None, *, node: str | None = None,
                 ring_bytes: int = DEFAULT_RING_BYTES, argv_bytes: int = DEFAULT_ARGV_BYTES,
                 max_args: int = DEFAULT_MAX_ARGS, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 pending_entries: int = DEFAULT_PENDING_ENTRIES,
                 rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 byte_rate: float = DEFAULT_BYTE_RATE, byte_burst: int | None = None,
                 over_budget: str = "summarise", on_over_budget=None,
                 enrich: bool = True, loss_interval_s: float = 0.5, cwd_pins: dict | None = None,
                 aggregate: bool | None = None):
        """cwd_pins: the enforcement sensor's pinned cwd maps (EnforcementSensor.cwd_pins):
        a relative exec's record then carries the cwd its exec check uses (process.c).
        aggregate: let the kernel count repeated records (agent/sensors/repeats.py) of
        the kinds each sandbox's `aggregate` label names (default: all it can count);
        None: $DSEC_AUDIT_AGGREGATE ("off" turns it off; on by default)."""
        require_features()
        self.on_record = on_record
        self.on_over_budget = on_over_budget
        if byte_burst is None:
            byte_burst = max(65536, ring_bytes // BYTE_BURST_SHARE)
        self.defaults = {"rate": rate, "burst": burst, "over_budget": over_budget,
                         "byte_rate": byte_rate, "byte_burst": byte_burst}
        _budget(rate, burst, over_budget)   # validate early
        byte_bucket(byte_rate, byte_burst, "byte budget")
        self.ring_bytes = ring_bytes
        self.argv_bytes = argv_bytes
        self.max_args = max_args
        self.loss_interval_s = loss_interval_s
        if aggregate is None:
            aggregate = os.environ.get(AGGREGATE_ENV, "on").strip().lower() not in ("off", "0", "no", "false")
        self.aggregate = bool(aggregate)
        self.consts = load_constants()
        self.bpf = compile_bpf(build_cflags(ring_bytes=ring_bytes, argv_bytes=argv_bytes,
                                            max_args=max_args, max_inflight=max_inflight,
                                            pending_entries=pending_entries) + _cwd_cflags(cwd_pins),
                               pins=_cwd_map_pins(cwd_pins))
        self._sandboxes_map = self.bpf[b"sandboxes"]
        self._gen = self.bpf[b"sbx_gen"]
        self._state_map = self.bpf[b"sbx_state"]
        enricher = None
        if enrich:
            from agent.sensors.elfinfo import ElfInfoCache
            enricher = ElfInfoCache()
        self._steps: dict[int, int] = {}
        self._modes: dict[int, str] = {}
        # each audited sandbox's `sandboxes` value as last written: this sensor is its only writer
        # (the programs read it), so a step's set_step writes it without reading it back first
        # (a BCC look-up less on every step's path); gone the moment the entry is removed
        self._cfgs: dict[int, object] = {}
        # sandboxes whose agg_kinds wait for their first set_step (add_sandbox's aggregate_from_step)
        self._agg_held: set[int] = set()
        self._stop_notified: set[int] = set()
        events = self.bpf[b"events"]
        self._init_records(events, self.bpf[b"exec_scratch"].Leaf, node=node, enricher=enricher)
        self.repeats = Repeats(self.bpf, self.decoder, self.consts)
        self._next_retire = 0.0         # the next poll that may read retired generations (_between_flushes)
        # a BPF ring buffer's map fd is pollable: readable when records wait (the same wake-up
        # libbpf's ring_buffer__poll waits for), so poll() can wait without the sensor lock
        self._ring_wait = select.poll()
        self._ring_wait.register(events.map_fd, select.POLLIN)

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Report outstanding losses, detach everything."""
        self._close()

    def _teardown(self) -> None:
        from agent.sensors.bpfsys import fast_detach
        if self.enrich_worker is not None:
            self.enrich_worker.close()
        fast_detach(self.bpf)

    def _sandbox_ids(self) -> list[int]:
        return list(self.decoder.sandboxes)

    # -- sandboxes --------------------------------------------------------------

    def add_sandbox(self, cgroup_id: int, sandbox_id: str, **labels) -> None:
        """Audit the processes of cgroup2 `cgroup_id` (and its sub-cgroups).

        labels: step (int, default 0), policy_name, policy_hash, mode (copied
        into every record), root_pid (a process of the sandbox whose root is
        used for exec enrichment once the exec'ing process is gone), rate,
        burst, byte_rate, byte_burst, over_budget ("summarise" | "stop")
        overriding the defaults, aggregate (the kinds whose repeats the kernel
        may count: only those the sandbox's policy can decide nothing but
        "allowed" for, policies.evaluate.aggregable_kinds; default all of
        repeats.KINDS; nothing when the sensor's aggregate is off), aggregate_from_step (True:
        the kernel counts repeats only from the first set_step on, so that the sandbox's own
        set-up -- its init's records, which the recorder leaves out of the record -- makes no
        entry of `agg` that would stay there for the sandbox's life: an idle sandbox held two,
        and every read of the table walks every sandbox's entries).
        """
        known = set(LABELS) | {"step", "root_pid", "rate", "burst", "byte_rate", "byte_burst", "over_budget",
                               "aggregate", "aggregate_from_step"}
        bad = sorted(set(labels) - known)
        if bad:
            raise DsecError(f"add_sandbox: unknown label(s) {', '.join(bad)} (known: {', '.join(sorted(known))})")
        check_sandbox_ids(cgroup_id, sandbox_id)
        rate = labels.get("rate", self.defaults["rate"])
        burst = labels.get("burst", self.defaults["burst"])
        mode = labels.get("over_budget", self.defaults["over_budget"])
        interval, tolerance = _budget(rate, burst, mode)
        byte_ps, byte_tol = byte_bucket(labels.get("byte_rate", self.defaults["byte_rate"]),
                                        labels.get("byte_burst", self.defaults["byte_burst"]), "byte budget")
        step = int(labels.get("step", 0))
        agg_kinds = tuple(labels.get("aggregate", AGGREGATE_KINDS)) if self.aggregate else ()
        agg_kinds = agg_kinds if self.repeats.table is not None else ()
        agg_mask = self.repeats.mask(agg_kinds)
        with self._lock:
            self._check_open()
            if cgroup_id in self.decoder.sandboxes:
                raise DsecError(f"add_sandbox: cgroup {cgroup_id} is already audited as "
                                f"{self.decoder.sandboxes[cgroup_id].sandbox_id}")
            self.decoder.register(SandboxInfo(
                cgroup_id, sandbox_id, {k: labels[k] for k in LABELS if k in labels},
                labels.get("root_pid")))
            self._track(cgroup_id)
            self._steps[cgroup_id] = step
            self._modes[cgroup_id] = mode
            cfg = self._sandboxes_map.Leaf()
            cfg.interval_ns, cfg.tolerance_ns, cfg.step = interval, tolerance, step
            cfg.byte_ps, cfg.byte_tol_ns = byte_ps, byte_tol
            cfg.mode = self.consts.over[mode]
            cfg.agg_kinds = agg_mask
            if labels.get("aggregate_from_step") and agg_mask:
                cfg.agg_kinds = 0
                self._agg_held.add(cgroup_id)
            self.repeats.add(cgroup_id, agg_kinds)
            try:
                self._state_map[self._state_map.Key(cgroup_id)] = self._state_map.Leaf()  # zeroed first
                self._sandboxes_map[self._sandboxes_map.Key(cgroup_id)] = cfg
                self._cfgs[cgroup_id] = cfg
                k = self._gen.Key(0)          # membership.h: the per-cgroup lookup cache is stale now
                self._gen[k] = self._gen.Leaf(self._gen[k].value + 1)
            except Exception as e:   # BCC raises bare Exception when a map update fails
                self._cfgs.pop(cgroup_id, None)
                self._agg_held.discard(cgroup_id)
                for m in (self._sandboxes_map, self._state_map):
                    map_discard(m, m.Key(cgroup_id))
                self._untrack(cgroup_id)
                raise DsecError(f"add_sandbox: cannot register cgroup {cgroup_id} in the kernel "
                                f"(at most {self.consts.values['DSEC_MAX_SANDBOXES']} sandboxes): {e}") from None

    def set_root_pid(self, cgroup_id: int, pid: int) -> None:
        """Name a live process of the sandbox (its supervisor) once it exists. Its /proc
        reads (~5 system calls) are made without the sensor's lock, which the poll thread and
        the other sandboxes' calls wait for."""
        root = pin_root(pid, cgroup_id, self.decoder.cgroup2_root, self.decoder.proc)
        with self._lock:
            info = self.decoder.sandboxes.get(cgroup_id)
            if info is not None:
                info.root_pid = root

    def root_ready(self, cgroup_id: int) -> None:
        """The sandbox's init has pivoted into its root (READY): procs.root_ready. Without the
        sensor's lock, which the poll thread holds while it decodes (on a start's path): one
        dict read and one attribute set, each atomic; the poll thread uses the root's identity
        once it is set."""
        info = self.decoder.sandboxes.get(cgroup_id)
        if info is not None:
            root_ready(info)

    def set_step(self, cgroup_id: int, step: int) -> None:
        """Events admitted from now on carry `step`."""
        with self._lock:
            self._check_open()

            def apply(cfg):
                cfg.step = step
                self.repeats.next_gen(cgroup_id, cfg)   # the step's repeats: counted afresh
                if cgroup_id in self._agg_held:         # the first step: repeats counted from now on
                    self._agg_held.discard(cgroup_id)
                    cfg.agg_kinds = self.repeats.mask(self.repeats.kinds(cgroup_id))
            if not self._update_cfg(cgroup_id, apply):
                raise DsecError(f"set_step: cgroup {cgroup_id} is not audited")
            self._steps[cgroup_id] = step

    def set_aggregate(self, cgroup_id: int, kinds) -> None:
        """The kinds whose repeats the kernel may count from now on (a new policy's);
        what was counted before is reported as it was (its generation retired)."""
        kinds = tuple(kinds) if self.aggregate else ()
        mask = self.repeats.mask(kinds)
        with self._lock:
            self._check_open()
            if cgroup_id not in self.decoder.sandboxes:
                raise DsecError(f"set_aggregate: cgroup {cgroup_id} is not audited")
            self.repeats.next_gen(cgroup_id, None)
            self.repeats.set_kinds(cgroup_id, kinds)

            def apply(cfg):
                if cgroup_id not in self._agg_held:     # (no step yet: the first step sets them)
                    cfg.agg_kinds = mask
                cfg.agg_gen = self.repeats.gen(cgroup_id)
            self._update_cfg(cgroup_id, apply)

    def remove_sandbox(self, cgroup_id: int, cgroup_path: str | None = None) -> dict:
        """Stop auditing: drain what the sandbox already emitted, report its
        losses as events_lost records, and return its totals
        ({"emitted": {kind: n}, "lost": {reason: {kind: n}}, "lost_total": n}).
        cgroup_path: its cgroup2 directory; once that is empty (or gone), the
        last record is known exactly (the fence below) instead of waited for."""
        # every task gone: each has reserved (and committed) its last record already, so
        # the ring's producer position read after this check bounds them all
        exited = cgroup_path is not None and not cgroup_populated(cgroup_path, cgroup_id)
        with self._lock:
            self._check_open()
            if cgroup_id not in self.decoder.sandboxes:
                return self._final(cgroup_id, "remove_sandbox")
            self._cfgs.pop(cgroup_id, None)     # first: no later write can put the entry back
            self._agg_held.discard(cgroup_id)
            map_discard(self._sandboxes_map, self._sandboxes_map.Key(cgroup_id))
            removed = time.monotonic()
            fence = self._ring_fence() if exited else None
            self._consume()
            self._decode_raw()
        # its exec records waiting for enrichment: its files read first, bounded, and
        # without the lock (unless the caller holds it: close()) so others keep decoding
        self._finish_enrichment(cgroup_id)
        if fence is None:
            # tasks may still run: programs already past the lookup finish (and commit their
            # records) within microseconds: the ring is consumed again REMOVAL_SETTLE_S after
            # the removal, and the wait holds no lock
            settle = REMOVAL_SETTLE_S - (time.monotonic() - removed)
            if settle > 0:
                time.sleep(settle)
        with self._lock:
            if self._closed or cgroup_id not in self.decoder.sandboxes:
                return self._final(cgroup_id, "remove_sandbox")     # removed meanwhile (close())
            if fence is None:
                self._consume()
            else:
                self._consume_past(fence)
            self._decode_raw()
            self._finish_enrichment_now(cgroup_id)
            state = self._read_state(cgroup_id)
            unfinished = max(0, state["inflight"]) if state else 0
            summaries, unreported = self.repeats.finish(cgroup_id, state)
            self._backlog.extend(summaries)
            self._flush_losses(cgroup_id, state, unfinished=unfinished, unreported=unreported)
            map_discard(self._state_map, self._state_map.Key(cgroup_id))
            totals = self._totals(state, unfinished)
            totals["summaries"] = self.repeats.summaries(cgroup_id)
            if unreported:
                totals["lost"]["aggregate_unreported"] = unreported
                totals["lost_total"] += sum(unreported.values())
            self._keep_final(cgroup_id, totals)
            self._untrack(cgroup_id)
            self._stop_notified.discard(cgroup_id)
            self._deliver()
            return totals

    def _untrack(self, cgroup_id: int) -> None:
        super()._untrack(cgroup_id)
        self.repeats.forget(cgroup_id)
        for d in (self._steps, self._modes):
            d.pop(cgroup_id, None)

    # -- reading ----------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to timeout_ms for events; hand decoded records to on_record.
        Returns how many records were delivered. The wait holds no lock: the
        other threads' add_sandbox/set_step/remove_sandbox go ahead meanwhile."""
        if timeout_ms > 0 and not self._closed:
            try:
                if not self._ring_wait.poll(0) and self._ring_wait.poll(int(timeout_ms)):
                    time.sleep(WAKE_SETTLE_S)     # woken from a quiet ring: let the burst come
            except (InterruptedError, ValueError):
                pass
            timeout_ms = 0          # then consume what is there, under the lock, without waiting again
        return self._poll(timeout_ms)

    def _between_flushes(self, now: float) -> None:
        """A poll that is not a periodic flush (under the lock, after the ring was read): the
        retired generations of repeats whose settle passed are read a last time and deleted
        now, not a period later (a sandbox that steps often retires one a step), at most every
        RETIRE_SETTLE_S, and only for the sandboxes that have one. It used to bring the whole
        periodic flush forward: every sandbox's state and the whole table at almost every poll
        (2.8 ms a poll beside 500 idle sandboxes while one stepped back to back)."""
        if now < self._next_retire:
            return
        due = self.repeats.retire_due()
        if due:
            self._next_retire = now + RETIRE_SETTLE_S
            states = {cgid: self._read_state(cgid) for cgid in due}
            self._backlog.extend(self.repeats.flush(states, self._update_cfg, scoped=True))

    def drain(self, cgroup_id: int | None = None, ending: bool = False) -> int:
        """Consume everything already in the ring buffer, report losses,
        deliver. Exec records waiting for enrichment are waited for (at most
        ENRICH_WAIT_S): those of `cgroup_id` (read first) when given, else all.
        ending: `cgroup_id`'s removal follows (Recorder.catch_up at a sandbox's end), and
        remove_sandbox reads its repeats a last time: they are not read here too (a read of
        `agg` walks every sandbox's entries, ~2 each even when idle: two such walks made each
        close ~1.2 ms longer beside 300 idle sandboxes)."""
        return self._drain(cgroup_id, ending)

    def stats(self, cgroup_id: int) -> dict:
        """Kernel counters of an audited sandbox (or the totals of a removed one)."""
        with self._lock:
            if cgroup_id not in self.decoder.sandboxes:
                return self._final(cgroup_id, "stats")
            state = self._read_state(cgroup_id)
            totals = self._totals(state, 0)
            totals["inflight"] = state["inflight_kind"] if state else {}
            return totals

    def lost(self, cgroup_id: int) -> int:
        """Events of this sandbox counted as lost so far (all reasons)."""
        return self.stats(cgroup_id)["lost_total"]

    def stopped(self, cgroup_id: int) -> bool:
        """True once the "stop" over-budget action fired for this sandbox."""
        return self.stats(cgroup_id).get("stopped", 0) > 0

    # -- internals --------------------------------------------------------------

    def _read_state(self, cgroup_id: int) -> dict | None:
        st = self._state_entry(cgroup_id)
        if st is None:
            return None
        emitted, lost = self._state_counts(st)
        kinds = self.consts.kinds
        by_kind = {kinds.get(k, str(k)): n for k, n in enumerate(st.inflight_kind) if n > 0}
        aggregated = {kinds.get(k, str(k)): n for k, n in enumerate(getattr(st, "aggregated", ())) if n}
        return {"emitted": emitted, "lost": lost, "inflight": st.inflight, "inflight_kind": by_kind,
                "stopped": st.stopped, "aggregated": aggregated, "agg_held": getattr(st, "agg_held", 0)}

    @staticmethod
    def _totals(state: dict | None, unfinished: int) -> dict:
        """loss_totals, the over-budget stops and "aggregated" ({kind: occurrences the
        kernel counted as repeats instead of emitting them: in summary records})."""
        totals = loss_totals(state, unfinished)
        totals["stopped"] = state["stopped"] if state else 0
        totals["aggregated"] = dict(state["aggregated"]) if state else {}
        return totals

    def _flush_all(self, final: bool, only: int | None = None, ending: bool = False) -> None:
        """Every flush period: the summaries of repeats counted in the kernel, then losses
        (ending: `only`'s repeats are left to its removal, Repeats.finish)."""
        ids = self._flush_ids(only)
        if only is None and self._snap is not None:     # unchanged, but a generation to delete
            have = set(ids)
            ids = ids + [c for c in self.repeats.retiring() if c not in have]
        states = {cgid: self._read_state(cgid) for cgid in ids}
        if not ending:
            self._backlog.extend(self.repeats.flush(states, self._update_cfg, scoped=only is not None))
        for cgid, state in states.items():
            self._flush_losses(cgid, state)

    def _update_cfg(self, cgroup_id: int, fn) -> bool:
        """fn(configuration) of an audited sandbox, written (with the lock); False when it is
        not audited. A copy of the kept value: that changes once the kernel has the new one."""
        old = self._cfgs.get(cgroup_id)
        if old is None:
            return False
        cfg = type(old).from_buffer_copy(old)
        fn(cfg)
        self._sandboxes_map[self._sandboxes_map.Key(cgroup_id)] = cfg
        self._cfgs[cgroup_id] = cfg
        return True

    def _flush_losses(self, cgroup_id: int, state: dict | None, unfinished: int = 0,
                      unreported: dict | None = None) -> None:
        info = self.decoder.sandboxes.get(cgroup_id)
        if info is None or state is None:
            return
        step = self._steps.get(cgroup_id, 0)
        if unreported:      # counted in the kernel, in no summary (repeats.py): a hole, never silent
            self._backlog.append(self.decoder.lost_record(info, step, "aggregate_unreported",
                                                          sum(unreported.values()), unreported))
        self._report_losses(cgroup_id, info, step, state["lost"], unfinished)
        if (state["stopped"] and self._modes.get(cgroup_id) == "stop"
                and cgroup_id not in self._stop_notified):
            self._stop_notified.add(cgroup_id)
            if self.on_over_budget is not None:
                self.on_over_budget(cgroup_id, info.sandbox_id, self._totals(state, 0)["lost"])


def _budget(rate, burst, mode) -> tuple[int, int]:
    """(interval_ns, tolerance_ns) of a token bucket; (0, 0) = unlimited."""
    if mode not in OVER_BUDGET:
        raise DsecError(f"over_budget must be one of {', '.join(OVER_BUDGET)}, got {mode!r}")
    return token_bucket(rate, burst, "fair share", "events")


def describe_features() -> str:
    """One line for `dsec` status output."""
    return describe("audit", check_features())


__all__ = ["AuditSensor", "check_features", "require_features", "describe_features",
           "cgroup2_mount", "tracepoints_used"]
