"""What the two BCC sensors share: the audit sensor (agent/sensors/audit.py,
bpf/process.c net.c files.c) and the enforcement sensor
(agent/sensors/enforce.py, bpf/enforce.c).

  - the source text: BCC rewrites map calls (.lookup, .ringbuf_output, ...)
    only in its main source text, not in #included files, so a sensor's files
    are concatenated into one text, each behind a #line marker (compiler
    messages name the real file); bpf/shared.h, which has no map calls, is
    #included by both;
  - feature checks (root, BCC, kernel headers, tracefs and the tracepoints a
    source uses, ring buffers, cgroup2 and bpffs mounts);
  - compiling with the compiler/verifier log captured, reported as one line;
  - RingSensor: the ring buffer -> decoder -> backlog -> on_record plumbing and
    the per-sandbox loss reporting (events_lost records) both sensors run.
    The ring buffer is read in bulk by agent/sensors/ringbuf.py (mmap of the
    map, the committed records copied out per call); BCC's per-record
    callback reader remains where that is unsupported (not x86-64) or asked
    for (DSEC_RING_READER=bcc).

Why this file is long: it is the one path both sensors run from source to
records (checks, compile, ring, loss reports); every part is imported by the
same two sensors, so splitting it would only add imports.
"""
from __future__ import annotations

import array
import ctypes as ct
import errno
import logging
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque

from agent.sandbox import sysutil
from agent.sensors import bpfcache, bpfsys, ringbuf
from agent.sensors.batchdecode import BatchDecoder
from agent.sensors.decoder import Decoder
from agent.errors import DsecError

log = logging.getLogger("dsec.audit")

# DSEC_BPF_DIR: the sensors' BPF sources from another bpf/ directory (benchmarks compare
# two versions of the kernel side with the same userspace, e.g. bench/audit.py part 1)
BPF_DIR = os.environ.get("DSEC_BPF_DIR") or \
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf")
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
RINGBUF_MISSING = "BPF ring buffers unsupported by this kernel (needs Linux >= 5.8)"


# ---------------------------------------------------------------- source

def source_text(names) -> str:
    """The files `names` of bpf/ as one main source text, with #line markers."""
    parts = []
    for name in names:
        with open(os.path.join(BPF_DIR, name), encoding="utf-8") as f:
            parts.append(f'#line 1 "{name}"\n' + f.read())
    return "\n".join(parts)


_ALSO = re.compile(r"^\s*DSEC_ATTACH_ALSO\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)


def attach_also(text: str) -> list[tuple[str, str, str]]:
    """(category, event, also) of a source text's DSEC_ATTACH_ALSO lines (bpf/shared.h):
    the program of TRACEPOINT_PROBE(category, event) is attached to category:also too."""
    return _ALSO.findall(text)


def tracepoint_program(text: str, category: str, event: str) -> bytes:
    """The name of the program a source text runs at category:event (its own
    TRACEPOINT_PROBE, or the one it shares through DSEC_ATTACH_ALSO)."""
    for cat, primary, also in attach_also(text):
        if (cat, also) == (category, event):
            event = primary
            break
    return f"tracepoint__{category}__{event}".encode()


def tracepoints_in(text: str) -> list[str]:
    """The "category/event" tracepoints a source text attaches programs to
    (TRACEPOINT_PROBEs and the DSEC_ATTACH_ALSO tracepoints that share them)."""
    tps = set(f"{c}/{e}" for c, e in re.findall(r"\bTRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)", text))
    tps.update(f"{c}/{a}" for c, _, a in attach_also(text))
    return sorted(tps)


def tracepoint_fields(tracefs: str, category: str, event: str) -> list[str]:
    """The field lines of a tracepoint's format (declaration, offset, size, sign),
    without the event's name and id: two tracepoints with equal lists hand a
    program the same context."""
    path = os.path.join(tracefs, "events", category, event, "format")
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip().startswith("field:")]


# ---------------------------------------------------------------- features

def find_tracefs(roots=TRACEFS) -> str | None:
    return next((t for t in roots if os.path.isdir(os.path.join(t, "events"))), None)


def cgroup2_mount() -> str | None:
    """Where the cgroup2 hierarchy is mounted (/sys/fs/cgroup/unified on hybrid
    hosts, /sys/fs/cgroup on pure v2), or None."""
    return next((where for where, fstype in sysutil.mounts() if fstype == "cgroup2"), None)


def bpffs_mounted(path: str) -> bool:
    """Is `path` (or the directory it would be created in) on a bpf filesystem?"""
    best = ("", "")
    for where, fstype in sysutil.mounts():
        if (path == where or path.startswith(where.rstrip("/") + "/")) and len(where) > len(best[0]):
            best = (where, fstype)
    return best[1] == "bpf"


def ringbuf_supported() -> bool:
    """Create (and close) a one-page BPF ring buffer map."""
    try:
        bpfsys.probe_map(bpfsys.BPF_MAP_TYPE_RINGBUF, 0, 0, max_entries=os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return False
    return True


def base_missing(tracefs_roots, tracepoints) -> list[str]:
    """What every BCC sensor needs and does not have: root, BCC with ring
    buffers, the kernel headers, tracefs with `tracepoints`."""
    missing = []
    if os.geteuid() != 0:
        missing.append("not root (loading BPF programs needs CAP_BPF/CAP_SYS_ADMIN)")
    try:
        import bcc.table
        if not hasattr(bcc.table, "RingBuf"):
            missing.append("BCC too old: no ring buffer support (needs bcc >= 0.22)")
    except ImportError:
        missing.append("python module bcc not importable (Debian python3-bpfcc; run scripts/setup.sh)")
    build = f"/lib/modules/{os.uname().release}/build"
    if not os.path.isdir(build):
        missing.append(f"kernel headers missing at {build} (run scripts/setup.sh)")
    tracefs = find_tracefs(tracefs_roots)
    if tracefs is None:
        missing.append("tracefs not mounted (mount -t tracefs tracefs /sys/kernel/tracing)")
    else:
        absent = [tp for tp in tracepoints if not os.path.isdir(os.path.join(tracefs, "events", tp))]
        if absent:
            missing.append("tracepoints missing: " + ", ".join(absent))
    return missing


def unavailable(what: str, missing: list[str]) -> str:
    return f"eBPF {what} unavailable: " + "; ".join(missing)


def describe(what: str, missing: list[str]) -> str:
    """One line for `dsec` status output."""
    return f"eBPF {what}: available" if not missing else unavailable(what, missing)


# ---------------------------------------------------------------- compile

def ring_pages(ring_bytes: int, what: str) -> int:
    """A ring buffer size as its number of pages (a power of two)."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = ring_bytes // page
    if ring_bytes % page or pages < 1 or pages & (pages - 1):
        raise DsecError(f"{what} ring buffer size {ring_bytes} is not a power-of-two number of {page}-byte pages")
    return pages


class StderrCapture:
    """Collect what BCC/clang/the verifier print on fd 2 while compiling.

    The capture is an unnamed file (O_TMPFILE), so a process killed while it
    compiles leaves nothing behind; keep() writes a named copy for an error
    message to point at."""

    def __enter__(self):
        self.file = tempfile.TemporaryFile(prefix="dsec-bpf-", suffix=".log")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode("utf-8", "replace")
        self.file.close()
        return False

    def keep(self) -> str:
        """The captured log in a named file (for a failure's message); its path."""
        fd, path = tempfile.mkstemp(prefix="dsec-bpf-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(self.text)
        return path


def first_error(log: str) -> str:
    """The line of a BCC/clang/verifier log that says what went wrong."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln[:300]
    for i, ln in enumerate(lines):          # the verifier: its complaint precedes "processed N insns"
        if ln.startswith("processed ") and i > 0:
            return lines[i - 1][:300]
    return lines[-1][:300] if lines else "no diagnostic"


def debug_cflags() -> list[str]:
    """BCC compiles with -g (DWARF, turned into BTF): a third of the compile time
    of our sensors, for programs that are byte for byte the same without it. So
    -g0 unless DSEC_BPF_DEBUG=1 (then the maps carry BTF types for bpftool and a
    verifier log names source lines)."""
    return [] if os.environ.get("DSEC_BPF_DEBUG", "") not in ("", "0") else ["-g0"]


def compile_text(text: str, cflags: list[str], what: str, tracefs_roots=TRACEFS, pins: dict | None = None,
                 attach: bool = True):
    """BPF(text) compiled, loaded and attached (its DSEC_ATTACH_ALSO tracepoints
    too); failures as one DsecError line naming the first error and the full log.
    A text compiled before with the same cflags on this kernel and BCC is loaded
    from the program cache instead (agent/sensors/bpfcache.py). pins: {map name:
    path} of the maps the text opens pinned (their paths are in the cflags too).
    attach=False: every program loaded (and verified), none attached (the
    enforcement sensor attaches its own, through links or while a sandbox needs them)."""
    from bcc import BPF
    flags = cflags + debug_cflags()
    directory = bpfcache.cache_dir() if "-g0" in flags else None     # BTF (debug) builds: never cached
    why = bpfcache.unsafe(directory) if directory else None
    if why:
        log.warning("eBPF %s: program cache not used: %s; compiling", what, why)
        directory = None
    k = bpfcache.key(text, bpfcache.key_cflags(flags, pins), BPF_DIR) if directory else None
    bpf = _from_cache(directory, k, what, pins, attach) if k else None
    if bpf is None:
        with StderrCapture() as cap:
            try:
                bpf = (BPF if attach else bpfcache.unattached_class())(text=text.encode(), cflags=flags)
            except Exception as e:   # BCC raises bare Exception for compile/load failures
                err = e
            else:
                err = None
        if err is not None:
            raise DsecError(f"eBPF {what}: BPF compile/load failed: {err}; {first_error(cap.text)} "
                            f"(full log: {cap.keep()})")
        if k:
            try:
                bpfcache.store(directory, k, bpfcache.entry_of(bpf.module, pins or ()))
            except bpfcache.NotCacheable as e:
                log.info("eBPF %s: not cached (%s); it compiles on every load", what, e)
            except OSError as e:
                log.warning("eBPF %s: program cache %s unwritable (%s); it compiles on every load",
                            what, directory, e.strerror)
            except Exception as e:   # noqa: BLE001 - the compile stands; only its entry is missing
                log.warning("eBPF %s: not cached, the entry could not be made (%s: %s)", what,
                            type(e).__name__, e)
    try:
        _attach_also(bpf, text, what, tracefs_roots, attach)
    except BaseException:
        bpf.cleanup()
        raise
    return bpf


def _from_cache(directory: str, k: str, what: str, pins: dict | None, attach: bool):
    """The BPF object rebuilt from the cache entry k, or None (no entry, or one
    that did not load: then the caller compiles, and the reason is logged)."""
    try:
        entry = bpfcache.read(directory, k)
    except OSError as e:
        log.warning("eBPF %s: program cache %s unreadable (%s); compiling", what, directory, e.strerror)
        return None
    if entry is None:
        return None
    with StderrCapture() as cap:
        try:
            bpf = bpfcache.from_entry(entry, ["-g0"], pins, attach)
        except Exception as e:   # BCC raises bare Exception; NotCacheable for a shape that differs
            err = e
        else:
            log.debug("eBPF %s: loaded from the program cache (%s)", what, os.path.join(directory, k))
            return bpf
    log.warning("eBPF %s: cached programs did not load (%s; %s); compiling", what, err, first_error(cap.text))
    return None


def _attach_also(bpf, text: str, what: str, tracefs_roots, attach: bool = True) -> None:
    """One program for several tracepoints (DSEC_ATTACH_ALSO): only where the
    tracepoints' formats are field for field the same, checked here, so the
    shared program reads every one's arguments where they are (attached here
    unless attach is False: then only checked)."""
    tracefs = find_tracefs(tracefs_roots)
    for cat, primary, also in attach_also(text):
        try:
            same = tracefs is not None and tracepoint_fields(tracefs, cat, primary) == tracepoint_fields(tracefs, cat, also)
        except OSError as e:
            raise DsecError(f"eBPF {what}: tracepoint {cat}:{also} unreadable: {e.strerror}") from None
        if not same:
            raise DsecError(f"eBPF {what}: tracepoints {cat}:{primary} and {cat}:{also} differ in layout on this "
                            f"kernel; the program they share (bpf/ DSEC_ATTACH_ALSO) cannot serve both")
        if not attach:
            continue
        try:
            bpf.attach_tracepoint(tp=f"{cat}:{also}".encode(), fn_name=f"tracepoint__{cat}__{primary}".encode())
        except Exception as e:   # BCC raises bare Exception
            raise DsecError(f"eBPF {what}: cannot attach to tracepoint {cat}:{also}: {e}") from None


# ---------------------------------------------------------------- small pieces

def token_bucket(rate, burst, what: str, unit: str) -> tuple[int, int]:
    """(interval_ns, tolerance_ns) of the kernel's GCRA token bucket; (0, 0) = unlimited."""
    if rate is None or rate == 0:
        return 0, 0
    if rate < 0 or burst is None or burst < 1:
        raise DsecError(f"{what}: rate must be > 0 {unit}/s and burst >= 1 (got rate={rate}, burst={burst})")
    interval = max(1, int(1e9 / rate))
    return interval, interval * (int(burst) - 1)


def byte_bucket(rate, burst, what: str) -> tuple[int, int]:
    """(ps_per_byte, tolerance_ns) of the kernel's byte budget (shared.h
    dsec_gcra_bytes); (0, 0) = unlimited. rate in bytes/s, burst in bytes (a
    record larger than the burst is never admitted: keep burst >= 64 KiB)."""
    if rate is None or rate == 0:
        return 0, 0
    if rate < 0 or burst is None or burst < 65536:
        raise DsecError(f"{what}: byte rate must be > 0 bytes/s and byte burst >= 65536 bytes "
                        f"(got byte_rate={rate}, byte_burst={burst})")
    ps = max(1, int(1e12 / rate))
    return ps, int(burst) * ps // 1000


def check_sandbox_ids(cgroup_id, sandbox_id) -> None:
    if not isinstance(cgroup_id, int) or cgroup_id <= 1:
        raise DsecError(f"add_sandbox: cgroup id must be a cgroup2 directory's inode number, got {cgroup_id!r}")
    if not sandbox_id:
        raise DsecError("add_sandbox: empty sandbox id")


def lookup_batch(table, keys, vals) -> int:
    """Entries of BCC hash table `table` read by BPF_MAP_LOOKUP_BATCH into the ctypes arrays
    `keys` and `vals` (Key * n, Leaf * n: made once by the caller; BCC's items_lookup_batch
    allocates and zeroes max_entries of each on every call); returns how many were read:
    the table's entries, or len(keys) when they did not all fit. Raises OSError (the kernel has no batch operations on this map: read
    entries one by one)."""
    from bcc.libbcc import lib
    K, V, n = table.Key, table.Leaf, len(keys)
    tok, cnt, total = ct.c_uint32(0), ct.c_uint32(0), 0
    while True:
        cnt.value = n - total
        res = lib.bpf_lookup_batch(table.map_fd, ct.byref(tok) if total else None, ct.byref(tok),
                                   ct.byref(keys, ct.sizeof(K) * total), ct.byref(vals, ct.sizeof(V) * total),
                                   ct.byref(cnt))
        err = ct.get_errno()
        total += cnt.value
        if res != 0 and err != errno.ENOENT:
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
        if res != 0 or total == n or cnt.value == 0:     # done, full, or no progress
            return total


def map_discard(table, key) -> None:
    """Delete a BCC map entry (table.Key) that may not be there."""
    try:
        del table[key]
    except KeyError:
        pass


def loss_totals(state: dict | None, unfinished: int = 0) -> dict:
    """{"emitted", "lost", "lost_total"} of a sandbox's state (RingSensor._state_counts)."""
    if state is None:
        return {"emitted": {}, "lost": {}, "lost_total": unfinished}
    lost = {r: dict(k) for r, k in state["lost"].items() if k}
    if unfinished:
        lost["unfinished"] = {"any": unfinished}
    return {"emitted": dict(state["emitted"]), "lost": lost,
            "lost_total": sum(sum(k.values()) for k in lost.values())}


# ---------------------------------------------------------------- the sensors' plumbing

# drain() and remove_sandbox() wait at most this long for exec enrichment (and close() in all);
# what is not read by then goes out marked sha256_skipped (remove) or follows later (drain)
ENRICH_WAIT_S = 5.0
# totals of removed sandboxes kept for a late stats()/remove_sandbox() (the caller
# normally takes them from remove_sandbox's return): the most recent ones only, so
# a long-lived agent's memory does not grow with every sandbox it ever ran
FINALS_KEPT = 256
ENDED = "the sandbox ended before its file was read"
# a removal's fence (RingSensor._consume_past) waits at most this long for a record in the ring
# that is reserved and not yet committed (normally microseconds)
FENCE_WAIT_S = 1.0


def _u64s(arr) -> list:
    """A ctypes array of u64 as a list of ints (one copy, not one ctypes access per element)."""
    return array.array("Q", bytes(arr)).tolist()


class RingSensor:
    """Ring buffer -> Decoder -> backlog -> on_record, and loss reporting.

    A sensor sets self.bpf, self.consts, self.on_record, self.loss_interval_s
    and self._state_map (cgroup id -> a struct with emitted[] and lost[]),
    calls _init_records() last in __init__, and provides _sandbox_ids(),
    _read_state(), _flush_losses(), _teardown() and remove_sandbox()."""

    WHAT = "sensor"          # "audit" | "enforcement", in error messages
    VERB = "watched"         # "audited" | "enforced"
    # on_records(records, taken): the backlog in one call instead of on_record per record;
    # taken[0] counts the records it has consumed, in order (a raise leaves the rest queued)
    on_records = None

    def _init_records(self, ring, leaf_type, *, node: str | None, enricher) -> None:
        self.instance = uuid.uuid4().hex
        self.decoder = Decoder(leaf_type, self.consts, node=node or socket.gethostname(), instance=self.instance,
                               enricher=enricher, cgroup2_root=cgroup2_mount())
        self.enrich_worker = None       # reads exec'd files off the decode path (enrich.Enricher)
        if enricher is not None:
            from agent.sensors.enrich import Enricher
            self.enrich_worker = Enricher(enricher)
            self.enrich_worker.warm()       # pyelftools imported before the first exec needs it
            self.decoder.enrich_async = True
        self._close_by = None           # monotonic deadline of close()'s waits for enrichment
        self._enrich_warned: set[int] = set()   # cgroup ids whose skipped enrichment was logged
        self._lock = threading.RLock()
        # (blob, [(offset, length)]) chunks of the ring not decoded yet (BCC's callback: one record each)
        self._raw: list[tuple[bytes, list]] = []
        self._batch = BatchDecoder(self.decoder) if os.environ.get("DSEC_DECODE", "batch") != "record" else None
        self._backlog: deque = deque()
        self._reported: dict[int, dict] = {}    # cgroup id -> {reason: {kind: count}} already reported
        self._last_flush_wall: dict[int, int] = {}
        self._finals: OrderedDict[int, dict] = OrderedDict()    # totals of the last FINALS_KEPT removed
        self._next_flush = 0.0
        # the periodic flush reads every state map value in one batch read (_snapshot_states)
        # and flushes only the sandboxes whose value changed since the last one
        self._snap: dict | None = None          # cgroup id -> its state value's bytes, during a periodic flush
        self._changed: list[int] = []           # its sandboxes whose value changed
        self._snap_bytes: dict[int, bytes] = {}  # cgroup id -> its value at the last periodic flush
        self._snap_bufs = None
        self._closed = False
        self._reader = None             # ringbuf.RingReader, or None: BCC's callback reader
        self.fences = 0                 # removals whose last records were known exactly (_consume_past)
        if ringbuf.supported() and os.environ.get("DSEC_RING_READER", "bulk") != "bcc":
            try:
                self._reader = ringbuf.RingReader(ring.map_fd, int(ring.max_entries))
            except (OSError, ValueError) as e:      # e.g. a kernel that refuses to mmap the ring
                log.warning("eBPF %s: bulk ring buffer reader unavailable (%s); using BCC's callback reader "
                            "(slower: may lose events past ~40k/s, counted as ringbuf_full)", self.WHAT, e)
        if self._reader is None:
            ring.open_ring_buffer(self._on_raw)

    # -- lifecycle --------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._close_by = time.monotonic() + ENRICH_WAIT_S
                for cgid in self._sandbox_ids():
                    self.remove_sandbox(cgid)
                self._deliver()
            finally:
                self._closed = True
                try:
                    self._teardown()
                finally:
                    if self._reader is not None:
                        self._reader.close()

    def _check_open(self):
        if self._closed:
            raise DsecError(f"{self.WHAT} sensor is closed")

    def _final(self, cgroup_id: int, what: str) -> dict:
        """The totals of a removed sandbox, or DsecError: not one of ours."""
        if cgroup_id in self._finals:
            return self._finals[cgroup_id]
        raise DsecError(f"{what}: cgroup {cgroup_id} is not {self.VERB}")

    def _keep_final(self, cgroup_id: int, totals: dict) -> None:
        self._finals[cgroup_id] = totals
        self._finals.move_to_end(cgroup_id)
        while len(self._finals) > FINALS_KEPT:
            self._finals.popitem(last=False)

    def _track(self, cgroup_id: int) -> None:
        self._reported[cgroup_id] = {}
        self._last_flush_wall[cgroup_id] = time.time_ns()
        self._finals.pop(cgroup_id, None)

    def _untrack(self, cgroup_id: int) -> None:
        self.decoder.forget(cgroup_id)
        if self._batch is not None:
            self._batch.forget(cgroup_id)
        for d in (self._reported, self._last_flush_wall):
            d.pop(cgroup_id, None)
        self._enrich_warned.discard(cgroup_id)

    # -- reading ----------------------------------------------------------------

    def _poll(self, timeout_ms: int) -> int:
        with self._lock:
            self._check_open()
            self._ring_poll(int(timeout_ms))
            self._decode_raw()
            now = time.monotonic()
            periodic = now >= self._next_flush
            if periodic:
                self._next_flush = now + self.loss_interval_s
                self.decoder.sync_clock()
                self._periodic(now)
                self._snapshot_states()
                try:
                    self._flush_all(final=False)
                finally:
                    self._snap = None
            else:
                self._between_flushes(now)
            n = self._deliver()
        if periodic:
            self._after_periodic()
        return n

    def _drain(self, cgroup_id: int | None = None, ending: bool = False) -> int:
        with self._lock:
            self._check_open()
            self._consume()
            self._decode_raw()
        if self.enrich_worker is not None:
            # catch up on enrichment too: bounded, and without the lock (others' records keep flowing)
            if cgroup_id is None:
                self.enrich_worker.wait_all(ENRICH_WAIT_S)
            else:
                self.enrich_worker.wait_for(cgroup_id, ENRICH_WAIT_S)
        with self._lock:
            if self._closed:
                return 0
            self._take_enriched()
            self._flush_all(final=True, only=cgroup_id, ending=ending)
            return self._deliver()

    def _periodic(self, now: float) -> None:
        """Every loss_interval_s in poll(), with the lock, before the losses."""

    def _after_periodic(self) -> None:
        """Every loss_interval_s in poll(), after the lock is released."""

    def _between_flushes(self, now: float) -> None:
        """Every poll() that is not a periodic flush, under the lock, after the ring was read."""

    def _flush_all(self, final: bool, only: int | None = None, ending: bool = False) -> None:
        """ending: `only`'s end follows (its removal reads what is left of it)."""
        for cgid in self._flush_ids(only):
            self._flush_losses(cgid, self._read_state(cgid))

    def _flush_ids(self, only: int | None) -> list[int]:
        """The sandboxes a flush reads: all, or `only` (a drain for one sandbox's end: the
        others' losses and counts come at the next periodic flush, as they would have; reading
        every sandbox's state there made each close cost a map look-up per live sandbox), or,
        in a periodic flush, those whose state changed since the last one (_snapshot_states)."""
        if only is not None:
            return [only] if only in self._sandbox_ids() else []
        if self._snap is not None:
            return self._changed
        return self._sandbox_ids()

    SNAP_CHUNK = 256        # state map entries per batch read

    def _snapshot_states(self) -> None:
        """Under the lock, for a periodic flush: every sandbox's state map value in a batch read
        or a few (SNAP_CHUNK entries each), kept in self._snap for _state_entry, and in
        self._changed the sandboxes whose value differs from the last periodic flush's. An idle
        sandbox's value does not change (its counters, its rate limiter's clocks): at 500 live
        sandboxes the flush went from a look-up each (~7 ms a sensor, every loss_interval_s,
        under the lock) to one batch read. On a kernel without batch operations on the map,
        nothing is kept: the flush reads every sandbox as before."""
        t = self._state_map
        ids = self._sandbox_ids()
        K, V = t.Key, t.Leaf
        n = len(ids) + self.SNAP_CHUNK
        try:
            if self._snap_bufs is None or len(self._snap_bufs[0]) < n:
                self._snap_bufs = ((K * n)(), (V * n)())
            keys, vals = self._snap_bufs
            total = lookup_batch(t, keys, vals)
        except OSError:
            return
        if total >= len(keys):
            return                              # not all read: every sandbox read on its own
        size = ct.sizeof(V)
        raw = memoryview(vals).cast("B")
        seen = {int(keys[i]): bytes(raw[i * size:(i + 1) * size]) for i in range(total)}
        old = self._snap_bytes
        self._changed = [c for c in ids if c not in seen or old.get(c) != seen[c]]
        self._snap = seen
        self._snap_bytes = {c: seen[c] for c in ids if c in seen}

    def _on_raw(self, ctx, data, size):
        self._raw.append((ct.string_at(data, size), [(0, size)]))
        return 0

    def _ring_poll(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms for records, then take what the ring holds
        (at most about one ring's worth per call: bounded memory and latency)."""
        r = self._reader
        if r is None:
            self.bpf.ring_buffer_poll(timeout_ms)
            # the kernel wakes the reader at most every DSEC_WAKE_NS (bpf/common.h): records
            # that came without a wake-up are taken here (libbpf's poll reads woken rings only)
            self.bpf.ring_buffer_consume()
            return
        if not r.wait(timeout_ms) and not r.pending_bytes():
            return
        taken = 0
        while taken < r.size:
            if not self._take(r):
                return
            taken += r.max_bytes

    def _take(self, r) -> bool:
        """One bulk read of the ring into self._raw; False when it was empty."""
        blob, spans = r.read()
        if not blob:
            return False
        self._raw.append((blob, spans))
        return True

    def _consume(self) -> None:
        if self._reader is not None:
            for _ in range(1000):    # bounded; each round takes what is there
                if not self._take(self._reader):
                    return
            return
        for _ in range(1000):        # bounded; each round empties what is there
            before = len(self._raw)
            self.bpf.ring_buffer_consume()
            if len(self._raw) == before:
                return

    def _ring_fence(self) -> int | None:
        """The ring's producer position now: every record reserved so far lies
        before it. None with BCC's reader (no positions to read)."""
        return self._reader.producer_pos if self._reader is not None else None

    def _consume_past(self, fence: int) -> bool:
        """With the lock: consume until the consumer position has passed `fence`
        (_ring_fence): every record reserved before it is then read, committed or
        discarded -- the reader stops at a record still being written, so none is
        skipped, and this waits for it (a program commits or discards what it
        reserved before it returns: microseconds). False if FENCE_WAIT_S passed first."""
        r = self._reader
        deadline = None
        while True:
            self._consume()
            if r.consumer_pos >= fence:
                self.fences += 1
                return True
            now = time.monotonic()
            if deadline is None:
                deadline = now + FENCE_WAIT_S
            elif now >= deadline:
                log.warning("eBPF %s: a ring buffer record stayed uncommitted for %.1f s; a removed "
                            "sandbox's last records may come after its removal (counted unattributed)",
                            self.WHAT, FENCE_WAIT_S)
                return False
            time.sleep(0.0001)

    def _decoded(self, blob: bytes, spans) -> list:
        """Records and EnrichJobs of one chunk, in ring order: many per call
        (agent/sensors/batchdecode.py), or with DSEC_DECODE=record each
        through Decoder.decode (the same records, one call each)."""
        if self._batch is not None:
            return self._batch.decode_many(blob, spans)
        out = []
        for o, n in spans:
            rec = self.decoder.decode(blob[o:o + n])
            job = self.decoder.take_job()
            if job is not None:
                out.append(job)
            elif rec is not None:
                out.append(rec)
        return out

    def _decode_raw(self) -> None:
        raw, self._raw = self._raw, []
        worker = self.enrich_worker
        plain = type(self)._accept is RingSensor._accept      # no per-record hook of the sensor's own
        for blob, spans in raw:
            items = self._decoded(blob, spans)
            if plain and all(i.__class__ is dict for i in items):
                self._backlog.extend(items)
                continue
            for job in items:
                if job.__class__ is dict:
                    self._accept(job)
                    continue
                self._job_in(worker, job)
        self._take_enriched()

    def _job_in(self, worker, job) -> None:
        """An exec record whose file is to be read off the decode path."""
        if not worker.submit(job):       # comes back through _take_enriched()
            why = worker.full_reason(job.cgroup_id)
            job.skip(why)
            self._accept(job.rec)
            if job.cgroup_id not in self._enrich_warned:   # once per sandbox; each record says it
                self._enrich_warned.add(job.cgroup_id)
                log.warning("sandbox %s: exec records without sha256: %s", job.rec["sandbox_id"], why)

    def _take_enriched(self) -> None:
        """Exec records whose files the Enricher has read (or skipped) since."""
        if self.enrich_worker is not None:
            for job in self.enrich_worker.take_done():
                self._accept(job.rec)

    def _enrich_timeout(self) -> float:
        if self._close_by is None:
            return ENRICH_WAIT_S
        return max(0.0, self._close_by - time.monotonic())

    def _finish_enrichment(self, cgroup_id: int) -> None:
        """A sandbox is being removed: its records waiting for enrichment come
        in (its files read first; a bounded wait, what is left then is marked
        sha256_skipped). Called without the lock when the caller can."""
        if self.enrich_worker is not None:
            self.enrich_worker.finish(cgroup_id, self._enrich_timeout(), ENDED)

    def _finish_enrichment_now(self, cgroup_id: int) -> None:
        """With the lock, the removal's last step: whatever of the sandbox is
        still not read (queued since) is skipped at once; all of its records in."""
        if self.enrich_worker is not None:
            self.enrich_worker.finish(cgroup_id, 0.0, ENDED)
            self._take_enriched()

    def _accept(self, rec: dict) -> None:
        self._backlog.append(rec)

    def _deliver(self) -> int:
        n = 0
        if self.on_records is not None:
            while self._backlog:
                recs = list(self._backlog)
                taken = [0]
                try:
                    self.on_records(recs, taken)
                finally:
                    if taken[0] >= len(self._backlog):
                        self._backlog.clear()
                    else:
                        for _ in range(taken[0]):
                            self._backlog.popleft()
                    n += taken[0]
            return n
        while self._backlog:
            rec = self._backlog[0]
            if self.on_record is not None:
                self.on_record(rec)      # raises: the record stays for the next call
            self._backlog.popleft()
            n += 1
        return n

    # -- losses -----------------------------------------------------------------

    def _state_entry(self, cgroup_id: int):
        snap = self._snap
        if snap is not None:                    # a periodic flush's batch read
            b = snap.get(cgroup_id)
            return None if b is None else self._state_map.Leaf.from_buffer_copy(b)
        try:
            return self._state_map[self._state_map.Key(cgroup_id)]
        except KeyError:
            return None

    def _state_counts(self, st) -> tuple[dict, dict]:
        """(emitted {kind: n}, lost {reason: {kind: n}}) of a state map value."""
        # each ctypes array copied once into a list of ints (indexing a ctypes array per element
        # was 3% of the agent's Python time at 32 live sandboxes: every poll period reads every state)
        em, ls = _u64s(st.emitted), _u64s(st.lost)
        nk = len(em)
        kinds = self.consts.kinds
        lost = {}
        for ridx, reason in self.consts.lost.items():
            row = ls[ridx * nk:(ridx + 1) * nk]
            lost[reason] = {kinds.get(k, str(k)): n for k, n in enumerate(row) if n} if any(row) else {}
        emitted = {kinds.get(k, str(k)): n for k, n in enumerate(em) if n}
        return emitted, lost

    def _report_losses(self, cgroup_id: int, info, step: int, lost: dict, unfinished: int = 0) -> None:
        """events_lost records for what was lost since the last report."""
        seen = self._reported.setdefault(cgroup_id, {})
        now = time.time_ns()
        window = (self._last_flush_wall.get(cgroup_id, now), now)
        any_new = False
        for reason, per_kind in lost.items():
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
