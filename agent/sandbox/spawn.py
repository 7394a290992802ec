"""How a sandbox's dsec-init is started: born in its cgroup (clone3), or the older path.

    pid, pidfd = spawn.spawn_init(path, argv, [ctl_fd], ns_flags, cgroup_fd)   # raises Unavailable
    spawn.available()          # False: the fallback (spawn.STATE["reason"] says why)

The clone3 path (agent/sandbox/spawn.c, loaded through ctypes: the GIL is released
for the call): one clone3(CLONE_VM | CLONE_VFORK | CLONE_PIDFD | CLONE_INTO_CGROUP |
the CLONE_NEW* flags) makes dsec-init PID 1 of its new namespaces, a member of the
sandbox's cgroup2 directory from its first instruction, and gives its pidfd; the v1
hierarchies of a hybrid host dsec-init joins itself by writing "0" into their
`tasks` files (fds the launcher passes in the JOIN message): one thread, not a
thread group, so the kernel skips the global cgroup_threadgroup_rwsem that a
cgroup.procs write of the launcher takes (its writer side waits for an RCU grace
period whenever no migration happened on the node within the last one: ~10 ms
median, p90 24 ms of a 43 ms cold start; docs/launch-figures.md).

The clone shares the agent's fd table (CLONE_FILES) and dsec-init takes a table of its
own holding only the fds below a few low slots reserved at import (close_range with
CLOSE_RANGE_UNSHARE, Linux 5.9; _Slots): a clone that copied the table made every start
pay for every fd the agent holds (~8 a live sandbox: the copy, then the exec closing each
again; beside 500 sandboxes ~2 ms of a start, docs/launch-figures.md).

The fallback (sysutil.spawn_in_namespaces: posix_spawn from a thread that unshared
the namespaces, then the launcher writes the pid into every hierarchy's
cgroup.procs) is taken when the library is not built or older than its source,
when the kernel lacks clone3 (before 5.3) or CLONE_INTO_CGROUP (before 5.7), on a
machine that is not x86_64, or with DSEC_CLONE3=0; a warning says why once, and
the agent's metric dsec.sandbox.starts counts the starts by path.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import socket
import threading

from agent.sandbox import initproto as ip
from agent.sandbox import netpool
from agent.sandbox import sysutil as su
from exporters.metrics import METRICS

log = logging.getLogger("dsec.launcher")
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "spawn.c")
LIB = os.path.join(HERE, "build", "libdsec_spawn.so")
# "clone3" or "posix_spawn" once decided; reason: why the fallback
STATE: dict = {"path": None, "reason": ""}
_lock = threading.Lock()
_fn = None
# errors that say "this kernel cannot do it" (not "this sandbox's start failed")
_UNSUPPORTED = (errno.ENOSYS, errno.E2BIG, errno.EINVAL)


class Unavailable(Exception):
    """The clone3 path cannot be used here: take the fallback."""


class _Slots:
    """Low fd numbers kept (on /dev/null, close-on-exec) for the fds a start hands
    dsec-init: the clone shares the agent's fd table and the child keeps only what is
    below the highest slot (spawn.c files_below), instead of a copy of the whole table
    (~8 fds a live sandbox) that its exec then closes again. Taken at import, while the
    process holds few fds; a start that finds none free copies the table as before."""

    COUNT = 8

    def __init__(self):
        self._lock = threading.Lock()
        self.free: list[int] = []
        self._null = -1
        try:
            self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            self.free = [os.dup(self._null) for _ in range(self.COUNT)]     # the lowest free numbers
        except OSError:
            pass

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self.free):
                return None
            got, self.free = self.free[:n], self.free[n:]
            return got

    def give(self, slots: list[int]) -> None:
        for s in slots:
            os.dup2(self._null, s, inheritable=False)     # what was put there is let go at once
        with self._lock:
            self.free.extend(slots)


_SLOTS = _Slots()


class _Rlimit(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_uint64), ("max", ctypes.c_uint64)]


def build(out: str = LIB) -> str:
    """Compile spawn.c (scripts/setup.sh)."""
    from exporters.columns import build_extension
    return build_extension(SRC, out)


def _fallback(why: str) -> None:
    STATE["path"], STATE["reason"] = "posix_spawn", why
    log.warning("sandbox start: %s; dsec-init is started by posix_spawn and moved into its cgroups by "
                "cgroup.procs writes (a cold start waits ~10 ms more for the kernel's cgroup lock)", why)


def _load():
    global _fn
    if STATE["path"] is not None:
        return _fn if STATE["path"] == "clone3" else None
    with _lock:
        if STATE["path"] is not None:
            return _fn if STATE["path"] == "clone3" else None
        if os.environ.get("DSEC_CLONE3", "1") == "0":
            _fallback("clone3 turned off (DSEC_CLONE3=0)")
            return None
        try:
            if os.stat(LIB).st_mtime < os.stat(SRC).st_mtime:
                _fallback(f"{LIB} is older than its source (run `make setup`)")
                return None
            fn = ctypes.CDLL(LIB, use_errno=False).dsec_spawn
        except OSError as e:
            _fallback(f"{LIB} cannot be loaded ({e.strerror or e}; run `make setup`)")
            return None
        fn.restype = ctypes.c_long
        fn.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                       ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Rlimit),
                       ctypes.POINTER(ctypes.c_int),
                       ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        _fn = fn
        STATE["path"] = "clone3"
        return fn


def available() -> bool:
    return _load() is not None


def spawn_init(path: str, argv: list, fds: list[int], ns_flags: int, cgroup_fd: int,
               nofile: tuple[int, int] | None = None, netns_fd: int = -1) -> tuple[int, int]:
    """Start `path` (argv, an empty environment, fds[i] as fd 3+i) as PID 1 of new
    namespaces (ns_flags) inside the cgroup2 directory open as `cgroup_fd` (-1: none),
    with the open-file limit `nofile` (soft, hard) when given; in the network namespace
    open as `netns_fd` instead of a new one, when given (agent/sandbox/netpool.py).
    Returns (pid, pidfd).
    Raises Unavailable (the kernel or build cannot: use the fallback; said once)
    or OSError (this start failed: the exec's errno, or the clone's)."""
    fn = _load()
    if fn is None:
        raise Unavailable(STATE["reason"])
    args = [os.fsencode(a) for a in argv]
    c_argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
    slots = _SLOTS.take(len(fds)) if fds else None
    try:
        if slots:
            for fd, slot in zip(fds, slots):
                os.dup2(fd, slot, inheritable=False)
        src = slots or fds
        c_fds = (ctypes.c_int * max(1, len(src)))(*src)
        rl = ctypes.byref(_Rlimit(*nofile)) if nofile else None
        pidfd, child_failed = ctypes.c_int(-1), ctypes.c_int(0)
        r = fn(os.fsencode(path), c_argv, c_fds, len(src), ns_flags, cgroup_fd, netns_fd, rl, ctypes.byref(pidfd),
               ctypes.byref(child_failed), max(slots) + 1 if slots else 0)
    finally:
        if slots:
            _SLOTS.give(slots)
    if r >= 0:
        return r, pidfd.value
    err = -r
    if err in _UNSUPPORTED and not child_failed.value and STATE["path"] == "clone3":
        with _lock:
            if STATE["path"] == "clone3":
                _fallback(f"clone3 with CLONE_INTO_CGROUP failed ({errno.errorcode.get(err, err)}: "
                          f"{os.strerror(err)}; clone3 needs Linux 5.3, CLONE_INTO_CGROUP 5.7)")
        raise Unavailable(STATE["reason"])
    raise OSError(err, os.strerror(err), path)


def start_init(cg, path: str, ctl, ctl_child_fd: int, ns_flags: int) -> tuple[int, int, bool]:
    """Start the sandbox's dsec-init (`path`) for the cgroups `cg` (cgroups.SandboxCgroup),
    `ctl_child_fd` its fd 3, and send it JOIN on `ctl`; with CLONE_NEWNET in ns_flags, in a
    network namespace of the pool when it has one (netpool.py). Returns (pid, pidfd, join_left):
    join_left when the launcher still has to move it into its cgroups (the fallback;
    cg.join after HELLO). Raises OSError when the start fails."""
    pid = pidfd = -1
    mine = []
    try:
        try:
            if cg.v2_path:
                mine.append(os.open(cg.v2_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            netns = netpool.take() if ns_flags & su.CLONE_NEWNET else -1
            try:
                pid, pidfd = spawn_init(path, ["dsec-init"], [ctl_child_fd], ns_flags, mine[0] if mine else -1,
                                        su.nofile_to_restore(), netns)
            finally:
                if netns >= 0:
                    os.close(netns)        # used once, by this start (or by none: it goes)
            join, join_left = list(cg.v1_paths.items()), False
            _count("clone3")
            if ns_flags & su.CLONE_NEWNET:
                METRICS.add("dsec.sandbox.netns", 1, source="pool" if netns >= 0 else "clone")
        except Unavailable:
            pid = su.spawn_in_namespaces(path, ["dsec-init"], ns_flags, ctl_child_fd)
            pidfd = os.pidfd_open(pid)
            su.restore_nofile(pid)      # the agent's raised fd limit is not the workload's
            join, join_left = [], True
            _count("posix_spawn")
        tasks = []
        for name, p in join:
            tasks.append(os.open(os.path.join(p, "tasks"), os.O_WRONLY | os.O_CLOEXEC))
            mine.append(tasks[-1])
        socket.send_fds(ctl, [ip.encode(ip.MSG.JOIN, [(ip.T.PATH, name) for name, _ in join])], tasks)
        return pid, pidfd, join_left
    except BaseException:
        if pid > 0:
            _kill(pid, pidfd)
        raise
    finally:
        for fd in mine:
            os.close(fd)


def _kill(pid: int, pidfd: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    if pidfd >= 0:
        os.close(pidfd)


def _count(path: str) -> None:
    METRICS.add("dsec.sandbox.starts", 1, path=path)
