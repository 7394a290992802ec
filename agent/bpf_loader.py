"""AuditSensor: the eBPF audit programs of bpf/ loaded with BCC.

    sensor = AuditSensor(on_record=spool.put)        # compiles, loads, attaches
    sensor.add_sandbox(cgroup_id, "sbx-1", policy_name="p", root_pid=pid)
    ... sensor.poll(100) in the agent's loop ...
    sensor.set_step(cgroup_id, 2)
    totals = sensor.remove_sandbox(cgroup_id)          # drains, reports losses
    sensor.close()

One AuditSensor per process (one compile, ~1 s). poll(), add_sandbox(),
set_step() and remove_sandbox() may be called from different threads: they
are serialised by a lock, and poll() holds it while it waits, so keep poll
timeouts short (<= 100 ms) when other threads manage sandboxes.

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

import ctypes as ct
import os
import platform
import re
import socket
import tempfile
import threading
import time
import uuid
from collections import deque

from agent.decoder import Decoder, SandboxInfo, load_constants
from agent.errors import DsecError

BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bpf")
SOURCES = ("common.h", "process.c", "net.c", "files.c")   # concatenated in this order

DEFAULT_RING_BYTES = 32 << 20
DEFAULT_ARGV_BYTES = 16384
DEFAULT_MAX_ARGS = 256
DEFAULT_RATE = 5000          # events per second per sandbox
DEFAULT_BURST = 25000        # events
DEFAULT_MAX_INFLIGHT = 512   # syscalls in flight per sandbox
OVER_BUDGET = ("summarise", "stop")
LABELS = ("policy_name", "policy_hash", "mode")

TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
BPF_MAP_TYPE_RINGBUF = 27
BPF_MAP_CREATE = 0
SYS_bpf = 321                # x86_64


# ---------------------------------------------------------------- features

def _source_text() -> str:
    parts = []
    for name in SOURCES:
        with open(os.path.join(BPF_DIR, name), encoding="utf-8") as f:
            parts.append(f'#line 1 "{name}"\n' + f.read())
    return "\n".join(parts)


def tracepoints_used(text: str | None = None) -> list[str]:
    text = _source_text() if text is None else text
    return sorted(set(f"{c}/{e}" for c, e in re.findall(r"TRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)", text)))


def _ringbuf_supported() -> bool:
    """Create (and close) a one-page BPF ring buffer map."""
    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long
    attr = (ct.c_uint32 * 32)()           # union bpf_attr, zeroed
    attr[0] = BPF_MAP_TYPE_RINGBUF        # map_type
    attr[3] = os.sysconf("SC_PAGE_SIZE")  # max_entries (bytes)
    fd = libc.syscall(SYS_bpf, BPF_MAP_CREATE, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        return False
    os.close(fd)
    return True


def cgroup2_mount() -> str | None:
    """Where the cgroup2 hierarchy is mounted (/sys/fs/cgroup/unified on hybrid
    hosts, /sys/fs/cgroup on pure v2), or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


def check_features(tracefs_roots=TRACEFS) -> list[str]:
    """What the audit sensor needs and does not have (empty list: all there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("not root (loading BPF programs needs CAP_BPF/CAP_SYS_ADMIN)")
    try:
        import bcc.table
        if not hasattr(bcc.table, "RingBuf"):
            missing.append("BCC too old: no ring buffer support (needs bcc >= 0.22)")
    except ImportError:
        missing.append("python module bcc not importable (Debian python3-bpfcc; run scripts/setup.sh)")
    build = f"/lib/modules/{platform.release()}/build"
    if not os.path.isdir(build):
        missing.append(f"kernel headers missing at {build} (run scripts/setup.sh)")
    tracefs = next((t for t in tracefs_roots if os.path.isdir(os.path.join(t, "events"))), None)
    if tracefs is None:
        missing.append("tracefs not mounted (mount -t tracefs tracefs /sys/kernel/tracing)")
    else:
        absent = [tp for tp in tracepoints_used() if not os.path.isdir(os.path.join(tracefs, "events", tp))]
        if absent:
            missing.append("tracepoints missing: " + ", ".join(absent))
    if os.geteuid() == 0 and not _ringbuf_supported():
        missing.append("BPF ring buffers unsupported by this kernel (needs Linux >= 5.8)")
    if cgroup2_mount() is None:
        missing.append("no cgroup2 hierarchy mounted (sandboxes are keyed by cgroup2 id)")
    return missing


def require_features(tracefs_roots=TRACEFS) -> None:
    missing = check_features(tracefs_roots)
    if missing:
        raise DsecError("eBPF audit unavailable: " + "; ".join(missing))


# ---------------------------------------------------------------- compile

def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def build_cflags(*, ring_bytes: int, argv_bytes: int, max_args: int, max_inflight: int) -> list[str]:
    page = os.sysconf("SC_PAGE_SIZE")
    pages = ring_bytes // page
    if ring_bytes % page or pages < 1 or pages & (pages - 1):
        raise DsecError(f"audit ring buffer size {ring_bytes} is not a power-of-two number of {page}-byte pages")
    if argv_bytes & (argv_bytes - 1) or not 4096 <= argv_bytes <= 131072:
        raise DsecError(f"argv bound {argv_bytes} must be a power of two between 4096 and 131072")
    if not 1 <= max_args <= 1024:
        raise DsecError(f"argument count bound {max_args} must be between 1 and 1024")
    if not 1 <= max_inflight <= 1 << 20:
        raise DsecError(f"in-flight bound {max_inflight} must be between 1 and 1048576")
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
    ]


class _StderrCapture:
    """Collect what BCC/clang/the verifier print on fd 2 while compiling."""

    def __enter__(self):
        self.file = tempfile.NamedTemporaryFile(prefix="dsec-bpf-", suffix=".log", delete=False)
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.close()
        with open(self.file.name, "rb") as f:
            self.text = f.read().decode("utf-8", "replace")
        return False


def _first_error(log: str) -> str:
    """The line of a BCC/clang/verifier log that says what went wrong."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln[:300]
    for i, ln in enumerate(lines):          # the verifier: its complaint precedes "processed N insns"
        if ln.startswith("processed ") and i > 0:
            return lines[i - 1][:300]
    return lines[-1][:300] if lines else "no diagnostic"


def compile_bpf(cflags: list[str]):
    from bcc import BPF
    text = _source_text()
    with _StderrCapture() as cap:
        try:
            bpf = BPF(text=text.encode(), cflags=cflags)
        except Exception as e:   # BCC raises bare Exception for compile/load failures
            err = e
        else:
            err = None
    if err is not None:
        raise DsecError(f"eBPF audit: BPF compile/load failed: {err}; {_first_error(cap.text)} "
                        f"(full log: {cap.file.name})")
    os.unlink(cap.file.name)
    return bpf


# ---------------------------------------------------------------- the sensor

class AuditSensor:
    def __init__(self, on_record=None, *, node: str | None = None,
                 ring_bytes: int = DEFAULT_RING_BYTES, argv_bytes: int = DEFAULT_ARGV_BYTES,
                 max_args: int = DEFAULT_MAX_ARGS, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 over_budget: str = "summarise", on_over_budget=None,
                 enrich: bool = True, loss_interval_s: float = 0.5):
        require_features()
        self.on_record = on_record
        self.on_over_budget = on_over_budget
        self.defaults = {"rate": rate, "burst": burst, "over_budget": over_budget}
        _budget(rate, burst, over_budget)   # validate early
        self.ring_bytes = ring_bytes
        self.argv_bytes = argv_bytes
        self.max_args = max_args
        self.loss_interval_s = loss_interval_s
        self.consts = load_constants()
        self.bpf = compile_bpf(build_cflags(ring_bytes=ring_bytes, argv_bytes=argv_bytes,
                                            max_args=max_args, max_inflight=max_inflight))
        self._sandboxes_map = self.bpf[b"sandboxes"]
        self._state_map = self.bpf[b"sbx_state"]
        enricher = None
        if enrich:
            from agent.elfinfo import ElfInfoCache
            enricher = ElfInfoCache()
        self.instance = uuid.uuid4().hex
        self.decoder = Decoder(self.bpf[b"exec_scratch"].Leaf, self.consts,
                               node=node or socket.gethostname(), instance=self.instance,
                               enricher=enricher, cgroup2_root=cgroup2_mount())
        self._lock = threading.RLock()
        self._raw: list[bytes] = []
        self._backlog: deque = deque()
        self._reported: dict[int, dict] = {}    # cgroup id -> {reason: {kind: count}} already reported
        self._last_flush_wall: dict[int, int] = {}
        self._steps: dict[int, int] = {}
        self._modes: dict[int, str] = {}
        self._stop_notified: set[int] = set()
        self._finals: dict[int, dict] = {}
        self._next_flush = 0.0
        self._closed = False
        self.bpf[b"events"].open_ring_buffer(self._on_raw)

    # -- lifecycle --------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Report outstanding losses, detach everything."""
        with self._lock:
            if self._closed:
                return
            try:
                for cgid in list(self.decoder.sandboxes):
                    self.remove_sandbox(cgid)
                self._deliver()
            finally:
                self._closed = True
                from agent.bpfsys import fast_detach
                fast_detach(self.bpf)

    def _check_open(self):
        if self._closed:
            raise DsecError("audit sensor is closed")

    # -- sandboxes --------------------------------------------------------------

    def add_sandbox(self, cgroup_id: int, sandbox_id: str, **labels) -> None:
        """Audit the processes of cgroup2 `cgroup_id` (and its sub-cgroups).

        labels: step (int, default 0), policy_name, policy_hash, mode (copied
        into every record), root_pid (a process of the sandbox whose root is
        used for exec enrichment once the exec'ing process is gone), rate,
        burst, over_budget ("summarise" | "stop") overriding the defaults.
        """
        known = set(LABELS) | {"step", "root_pid", "rate", "burst", "over_budget"}
        bad = sorted(set(labels) - known)
        if bad:
            raise DsecError(f"add_sandbox: unknown label(s) {', '.join(bad)} (known: {', '.join(sorted(known))})")
        if not isinstance(cgroup_id, int) or cgroup_id <= 1:
            raise DsecError(f"add_sandbox: cgroup id must be a cgroup2 directory's inode number, got {cgroup_id!r}")
        if not sandbox_id:
            raise DsecError("add_sandbox: empty sandbox id")
        rate = labels.get("rate", self.defaults["rate"])
        burst = labels.get("burst", self.defaults["burst"])
        mode = labels.get("over_budget", self.defaults["over_budget"])
        interval, tolerance = _budget(rate, burst, mode)
        step = int(labels.get("step", 0))
        with self._lock:
            self._check_open()
            if cgroup_id in self.decoder.sandboxes:
                raise DsecError(f"add_sandbox: cgroup {cgroup_id} is already audited as "
                                f"{self.decoder.sandboxes[cgroup_id].sandbox_id}")
            self.decoder.register(SandboxInfo(
                cgroup_id, sandbox_id, {k: labels[k] for k in LABELS if k in labels},
                labels.get("root_pid")))
            self._reported[cgroup_id] = {}
            self._last_flush_wall[cgroup_id] = time.time_ns()
            self._steps[cgroup_id] = step
            self._modes[cgroup_id] = mode
            self._finals.pop(cgroup_id, None)
            cfg = self._sandboxes_map.Leaf()
            cfg.interval_ns, cfg.tolerance_ns, cfg.step = interval, tolerance, step
            cfg.mode = self.consts.over[mode]
            try:
                self._state_map[self._state_map.Key(cgroup_id)] = self._state_map.Leaf()  # zeroed first
                self._sandboxes_map[self._sandboxes_map.Key(cgroup_id)] = cfg
            except Exception as e:   # BCC raises bare Exception when a map update fails
                for m in (self._sandboxes_map, self._state_map):
                    try:
                        del m[m.Key(cgroup_id)]
                    except KeyError:
                        pass
                self.decoder.forget(cgroup_id)
                for d in (self._reported, self._last_flush_wall, self._steps, self._modes):
                    d.pop(cgroup_id, None)
                raise DsecError(f"add_sandbox: cannot register cgroup {cgroup_id} in the kernel "
                                f"(at most {self.consts.values['DSEC_MAX_SANDBOXES']} sandboxes): {e}") from None

    def set_root_pid(self, cgroup_id: int, pid: int) -> None:
        """Name a live process of the sandbox (its supervisor) once it exists."""
        with self._lock:
            info = self.decoder.sandboxes.get(cgroup_id)
            if info is not None:
                info.root_pid = pid

    def set_step(self, cgroup_id: int, step: int) -> None:
        """Events admitted from now on carry `step`."""
        with self._lock:
            self._check_open()
            key = self._sandboxes_map.Key(cgroup_id)
            try:
                cfg = self._sandboxes_map[key]
            except KeyError:
                raise DsecError(f"set_step: cgroup {cgroup_id} is not audited") from None
            cfg.step = step
            self._sandboxes_map[key] = cfg
            self._steps[cgroup_id] = step

    def remove_sandbox(self, cgroup_id: int) -> dict:
        """Stop auditing: drain what the sandbox already emitted, report its
        losses as events_lost records, and return its totals
        ({"emitted": {kind: n}, "lost": {reason: {kind: n}}, "lost_total": n})."""
        with self._lock:
            self._check_open()
            if cgroup_id not in self.decoder.sandboxes:
                if cgroup_id in self._finals:
                    return self._finals[cgroup_id]
                raise DsecError(f"remove_sandbox: cgroup {cgroup_id} is not audited")
            try:
                del self._sandboxes_map[self._sandboxes_map.Key(cgroup_id)]
            except KeyError:
                pass
            # programs already past the lookup finish within microseconds
            self._consume()
            time.sleep(0.005)
            self._consume()
            self._decode_raw()
            state = self._read_state(cgroup_id)
            unfinished = max(0, state["inflight"]) if state else 0
            self._flush_losses(cgroup_id, state, unfinished=unfinished)
            try:
                del self._state_map[self._state_map.Key(cgroup_id)]
            except KeyError:
                pass
            totals = self._totals(state, unfinished)
            self._finals[cgroup_id] = totals
            self.decoder.forget(cgroup_id)
            for d in (self._reported, self._last_flush_wall, self._steps, self._modes):
                d.pop(cgroup_id, None)
            self._stop_notified.discard(cgroup_id)
            self._deliver()
            return totals

    # -- reading ----------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to timeout_ms for events; hand decoded records to on_record.
        Returns how many records were delivered."""
        with self._lock:
            self._check_open()
            self.bpf.ring_buffer_poll(int(timeout_ms))
            self._decode_raw()
            now = time.monotonic()
            if now >= self._next_flush:
                self._next_flush = now + self.loss_interval_s
                self.decoder.sync_clock()
                for cgid in list(self.decoder.sandboxes):
                    self._flush_losses(cgid, self._read_state(cgid))
            return self._deliver()

    def drain(self) -> int:
        """Consume everything already in the ring buffer (no waiting), report
        losses, deliver."""
        with self._lock:
            self._check_open()
            self._consume()
            self._decode_raw()
            for cgid in list(self.decoder.sandboxes):
                self._flush_losses(cgid, self._read_state(cgid))
            return self._deliver()

    def stats(self, cgroup_id: int) -> dict:
        """Kernel counters of an audited sandbox (or the totals of a removed one)."""
        with self._lock:
            if cgroup_id not in self.decoder.sandboxes:
                if cgroup_id in self._finals:
                    return self._finals[cgroup_id]
                raise DsecError(f"stats: cgroup {cgroup_id} is not audited")
            state = self._read_state(cgroup_id)
            totals = self._totals(state, 0)
            totals["inflight"] = state["inflight"] if state else 0
            return totals

    def lost(self, cgroup_id: int) -> int:
        """Events of this sandbox counted as lost so far (all reasons)."""
        return self.stats(cgroup_id)["lost_total"]

    def stopped(self, cgroup_id: int) -> bool:
        """True once the "stop" over-budget action fired for this sandbox."""
        return self.stats(cgroup_id).get("stopped", 0) > 0

    # -- internals --------------------------------------------------------------

    def _on_raw(self, ctx, data, size):
        self._raw.append(ct.string_at(data, size))
        return 0

    def _consume(self) -> None:
        for _ in range(1000):        # bounded; each round empties what is there
            before = len(self._raw)
            self.bpf.ring_buffer_consume()
            if len(self._raw) == before:
                return

    def _decode_raw(self) -> None:
        raw, self._raw = self._raw, []
        for r in raw:
            rec = self.decoder.decode(r)
            if rec is not None:
                self._backlog.append(rec)

    def _deliver(self) -> int:
        n = 0
        while self._backlog:
            rec = self._backlog[0]
            if self.on_record is not None:
                self.on_record(rec)      # raises: the record stays for the next call
            self._backlog.popleft()
            n += 1
        return n

    def _read_state(self, cgroup_id: int) -> dict | None:
        try:
            st = self._state_map[self._state_map.Key(cgroup_id)]
        except KeyError:
            return None
        nk = len(st.emitted)
        kinds = self.consts.kinds
        lost = {}
        for reason_idx, reason in self.consts.lost.items():
            per = {}
            for k in range(nk):
                v = st.lost[reason_idx * nk + k]
                if v:
                    per[kinds.get(k, str(k))] = v
            lost[reason] = per
        emitted = {kinds.get(k, str(k)): st.emitted[k] for k in range(nk) if st.emitted[k]}
        return {"emitted": emitted, "lost": lost, "inflight": st.inflight, "stopped": st.stopped}

    def _totals(self, state: dict | None, unfinished: int) -> dict:
        if state is None:
            return {"emitted": {}, "lost": {}, "lost_total": unfinished, "stopped": 0}
        lost = {r: dict(k) for r, k in state["lost"].items() if k}
        if unfinished:
            lost["unfinished"] = {"any": unfinished}
        total = sum(sum(k.values()) for k in lost.values())
        return {"emitted": dict(state["emitted"]), "lost": lost, "lost_total": total,
                "stopped": state["stopped"]}

    def _flush_losses(self, cgroup_id: int, state: dict | None, unfinished: int = 0) -> None:
        info = self.decoder.sandboxes.get(cgroup_id)
        if info is None or state is None:
            return
        seen = self._reported.setdefault(cgroup_id, {})
        now = time.time_ns()
        window = (self._last_flush_wall.get(cgroup_id, now), now)
        step = self._steps.get(cgroup_id, 0)
        any_new = False
        for reason, per_kind in state["lost"].items():
            before = seen.get(reason, {})
            delta = {k: v - before.get(k, 0) for k, v in per_kind.items() if v - before.get(k, 0) > 0}
            if delta:
                any_new = True
                self._backlog.append(self.decoder.lost_record(info, step, reason, sum(delta.values()),
                                                              delta, window))
                seen[reason] = dict(per_kind)
        if unfinished:
            any_new = True
            self._backlog.append(self.decoder.lost_record(
                info, step, "unfinished", unfinished, {"any": unfinished}, window))
        if any_new:
            self._last_flush_wall[cgroup_id] = now
        if (state["stopped"] and self._modes.get(cgroup_id) == "stop"
                and cgroup_id not in self._stop_notified):
            self._stop_notified.add(cgroup_id)
            if self.on_over_budget is not None:
                self.on_over_budget(cgroup_id, info.sandbox_id, self._totals(state, 0)["lost"])


def _budget(rate, burst, mode) -> tuple[int, int]:
    """(interval_ns, tolerance_ns) of a token bucket; (0, 0) = unlimited."""
    if mode not in OVER_BUDGET:
        raise DsecError(f"over_budget must be one of {', '.join(OVER_BUDGET)}, got {mode!r}")
    if rate is None or rate == 0:
        return 0, 0
    if rate < 0 or burst is None or burst < 1:
        raise DsecError(f"fair share: rate must be > 0 events/s and burst >= 1 (got rate={rate}, burst={burst})")
    interval = max(1, int(1e9 / rate))
    return interval, interval * (int(burst) - 1)


def describe_features() -> str:
    """One line for `dsec` status output."""
    missing = check_features()
    return "eBPF audit: available" if not missing else "eBPF audit unavailable: " + "; ".join(missing)


__all__ = ["AuditSensor", "check_features", "require_features", "describe_features",
           "cgroup2_mount", "tracepoints_used"]
