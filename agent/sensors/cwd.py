"""The agent's half of relative execs under enforce (bpf/enforce.c, "relative
execs"; issue 21).

    v = CwdVerifier(bpf, cgroup2_root)      # the enforcement sensor makes one; a thread of its own
    v.known_cwd(tgid)                       # the cwd last verified for a process (records)
    v.close()

The exec check matches a relative filename ("./prog") as <cwd>/<name>, the way
learning resolved it. BPF cannot read a task's cwd, and the path a process
passes to chdir is user memory it can change under us, so the kernel stops a
process (SIGSTOP) when its chdir/fchdir returns in a sandbox whose exec check is
enforced, and sends a cwd_req record here. This thread reads the kernel's own
answer -- readlink /proc/<tgid>/task/<tid>/cwd, in the sandbox's view -- writes
it into enf_cwd with the generation the kernel gave that chdir, and continues
the process (SIGCONT). The kernel uses the entry only while its generation is
current and no other chdir is in flight, so a verification that raced another
chdir is never used. Tasks the kernel did not stop (the supervisor's own, which
count their absolute chdir at once) are verified too, unless the kernel's entry
already stands.

Fail closed: a cwd that cannot be read (the process gone, a deleted directory,
longer than an exec key) is not written -- the process continues, and its
relative execs are refused with `cwd_unknown` until its next chdir. Lost
records (perf buffer full) are counted, and every process still stopped at an
unverified chdir is found and verified by a sweep of enf_cwd_gen. A heartbeat
tells the kernel this thread is alive; without it (the agent gone) the kernel
stops nobody and the cwd simply stays unknown.

Cost: one round trip through this thread per chdir in an enforced sandbox
(tens of microseconds when idle); `stats` counts them.
"""
from __future__ import annotations

import ctypes as ct
import logging
import os
import signal
import threading
import time

from agent.sensors.decoder import in_cgroup, sandbox_view

log = logging.getLogger("dsec.enforce")

HEARTBEAT_S = 0.5
POLL_MS = 200
MAX_KNOWN = 65536
DELETED = b" (deleted)"


class CwdReq(ct.Structure):
    """struct dsec_cwd_req (bpf/events.h): BCC cannot derive a perf record's type."""
    _fields_ = [("cgroup_id", ct.c_uint64), ("gen", ct.c_uint64), ("tgid", ct.c_uint32),
                ("tid", ct.c_uint32), ("stopped", ct.c_uint32), ("_pad", ct.c_uint32)]


class CwdVerifier:
    def __init__(self, bpf, cgroup2_root: str | None, proc: str = "/proc"):
        self.bpf = bpf
        self.cgroup2_root = cgroup2_root
        self.proc = proc
        self._cwd = bpf[b"enf_cwd"]
        self._gen = bpf[b"enf_cwd_gen"]
        self._hb = bpf[b"cwd_agent"]
        self._key_path = self._cwd.Leaf.path.size       # the char array (bytes of it stop at NUL)
        self._known: dict[int, bytes] = {}
        self.stats = {"verified": 0, "unknown": 0, "overtaken": 0, "continued": 0, "lost": 0, "swept": 0}
        self._stop = threading.Event()
        self._lost_seen = 0
        self._last_hb = 0.0
        bpf[b"cwd_req"].open_perf_buffer(self._on_req, page_cnt=64, lost_cb=self._on_lost)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="dsec-cwd", daemon=True)
        self._thread.start()

    # -- the thread ---------------------------------------------------------------
    def _beat(self):
        self._hb[ct.c_int(0)] = ct.c_uint64(time.monotonic_ns())     # bpf_ktime_get_ns's clock
        self._last_hb = time.monotonic()

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.bpf.perf_buffer_poll(POLL_MS)
                if time.monotonic() - self._last_hb >= HEARTBEAT_S:
                    self._beat()
                if self.stats["lost"] != self._lost_seen:
                    self._lost_seen = self.stats["lost"]
                    self.sweep()
            except Exception:  # noqa: BLE001 - never let a stopped process wait for a dead thread
                log.exception("cwd verifier: error (continuing)")
                time.sleep(0.05)

    def close(self):
        """Stop the thread; the kernel then stops nobody (no heartbeat), and any
        process still stopped at a chdir is continued."""
        self._hb[ct.c_int(0)] = ct.c_uint64(0)
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.bpf.perf_buffer_poll(0)          # requests already queued
            self.sweep()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass

    def _on_lost(self, count):
        self.stats["lost"] += count
        log.error("cwd verifier: %d chdir record(s) lost: sweeping for stopped processes", count)

    def _on_req(self, cpu, data, size):
        if size < ct.sizeof(CwdReq):
            return
        r = ct.cast(data, ct.POINTER(CwdReq)).contents
        self.verify(r.cgroup_id, r.gen, r.tgid, r.tid, bool(r.stopped))

    # -- one verification -----------------------------------------------------------
    def read_cwd(self, tgid: int, tid: int) -> bytes | None:
        """The process's cwd in its sandbox's view, or None."""
        for link in (f"{self.proc}/{tgid}/task/{tid}/cwd", f"{self.proc}/{tgid}/cwd"):
            try:
                raw = os.readlink(os.fsencode(link))
                break
            except OSError:
                continue
        else:
            return None
        if not raw.startswith(b"/") or raw.endswith(DELETED):
            return None
        path = sandbox_view(tgid, raw, self.proc)
        if not path.startswith(b"/") or len(path) > self._key_path - 2:
            return None
        return path

    def verify(self, cgroup_id: int, gen: int, tgid: int, tid: int, stopped: bool):
        key = self._cwd.Key(tgid)
        if not in_cgroup(tgid, cgroup_id, self.cgroup2_root, self.proc):
            return                      # gone (and its pid perhaps reused): nothing to write or continue
        if not stopped:
            old = self._cwd.get(key)
            if old is not None and old.gen == gen:
                self._remember(tgid, bytes(old.path[:old.len]))
                return                  # the kernel's entry for an exempt task's chdir stands
        cur = self._gen.get(key)
        if cur is None or cur.gen != gen:
            # overtaken: the process ran on after this chdir (continued early: a sibling's
            # SIGCONT, the kernel's orphaned-group SIGHUP+SIGCONT) and chdir'd again, or
            # exited. Its cwd is unknown to the check until the later chdir's own record
            # is verified -- which also continues it if that chdir stopped it. Writing this
            # gen would count for nothing (and could replace the later entry).
            self.stats["overtaken"] += 1
            return
        path = self.read_cwd(tgid, tid)
        if path is None:
            self.stats["unknown"] += 1  # no entry with this gen: relative execs refused (cwd_unknown)
        else:
            v = self._cwd.Leaf()
            v.gen = gen
            v.len = len(path)
            ct.memmove(ct.addressof(v) + type(v).path.offset, path, len(path))   # v.path would be a copy
            self._cwd[key] = v
            self._remember(tgid, path)
            self.stats["verified"] += 1
        if stopped:
            try:
                os.kill(tgid, signal.SIGCONT)
                self.stats["continued"] += 1
            except ProcessLookupError:
                pass

    def _remember(self, tgid: int, path: bytes):
        if len(self._known) >= MAX_KNOWN:
            self._known.pop(next(iter(self._known)))
        self._known[tgid] = path

    def known_cwd(self, tgid: int) -> bytes | None:
        return self._known.get(tgid)

    # -- lost records -----------------------------------------------------------------
    def sweep(self):
        """Verify and continue every stopped process whose cwd entry is not current
        (its chdir's record was lost). A process the workload stopped itself, with
        a current entry, is left alone."""
        for k, g in list(self._gen.items()):
            tgid = k.value
            cur = self._cwd.get(k)
            if cur is not None and cur.gen == g.gen:
                continue
            if not _stopped(tgid, self.proc):
                continue
            cgid = _cgroup_id(tgid, self.cgroup2_root, self.proc)
            if cgid:
                self.stats["swept"] += 1
                self.verify(cgid, g.gen, tgid, tgid, True)


def _stopped(pid: int, proc: str) -> bool:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return data[data.rindex(b")") + 2:][:1] == b"T"
    except (OSError, ValueError):
        return False


def _cgroup_id(pid: int, cgroup2_root: str | None, proc: str) -> int:
    if not cgroup2_root:
        return 0
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            rel = next((ln[3:] for ln in f.read(65536).splitlines() if ln.startswith(b"0::")), None)
        return os.stat(os.fsencode(cgroup2_root) + rel).st_ino if rel is not None else 0
    except OSError:
        return 0
