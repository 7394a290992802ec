"""Fresh network namespaces made ahead of the sandboxes that will use them.

    netpool.enable(4)        # the node agent, at its start: keep up to 4 ready
    fd = netpool.take()      # a start: an fd of a never-used network namespace, or -1
    netpool.close()          # the agent's stop: the unused ones go

Making a network namespace is the largest part of a sandbox's clone: ~0.6 ms of
a ~1.0 ms clone3 with every CLONE_NEW* flag on this machine (the loopback
device's registration, the per-namespace sysctl tables, every subsystem's
pernet init), paid on a cold start's critical path. A thread of the agent makes
them ahead instead: unshare(CLONE_NEWNET), open /proc/thread-self/ns/net, then
setns back to the agent's own namespace; the spawn's child joins one
(setns, agent/sandbox/spawn.c) instead of CLONE_NEWNET, and its fd is closed
once the spawn returns, so each namespace is used by exactly one sandbox and by
nothing before it (the making thread left it at once; it has only a loopback
device, down, exactly as a clone makes it; dsec-init brings it up).

Nothing is named or mounted: the namespaces are held by the pool's fds only, so
an agent that dies leaves nothing behind (the kernel frees them with the fds).
The pool is the agent's alone (`dsec run` in-process starts one sandbox: it
clones its namespace as before), and the posix_spawn fallback (spawn.py) does
not use it. When the pool is empty (a burst), a start clones its namespace as
before: it never waits for the pool. The agent's metric dsec.sandbox.netns
counts the starts by source (pool | clone). Where the pool cannot make one
(unshare refused: no CAP_SYS_ADMIN, a seccomp profile of the agent's service),
it says why once (logger dsec.launcher) and stays empty.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

log = logging.getLogger("dsec.launcher")
CLONE_NEWNET = 0x40000000
SIZE = 4                    # ready namespaces kept: a cold start takes one, the thread makes the next
# ... this long after the take: not beside the start that took it (its dsec-init's mounts), whose
# critical path the making's ~0.6 ms of kernel work on the node's other CPU would lengthen
REFILL_DELAY_S = 0.02

_libc = ctypes.CDLL(None, use_errno=True)
_lock = threading.Lock()
_ready: list[int] = []
_want = 0                   # 0: no pool (take() returns -1)
_wake = threading.Condition(_lock)
_thread: threading.Thread | None = None
_broken = ""
_last_take = 0.0


def enable(size: int = SIZE) -> None:
    """Keep up to `size` namespaces ready (made by a thread of this process); none with
    DSEC_NETNS_POOL=0."""
    global _want, _thread
    if os.environ.get("DSEC_NETNS_POOL", "1") == "0":
        return
    with _lock:
        _want = size
        if _thread is None and not _broken:
            _thread = threading.Thread(target=_run, name="dsec-netns-pool", daemon=True)
            _thread.start()
        _wake.notify()


def take() -> int:
    """An fd of a fresh network namespace (the caller closes it), or -1 (none ready)."""
    global _last_take
    with _lock:
        if not _ready:
            return -1
        fd = _ready.pop()
        _last_take = time.monotonic()
        _wake.notify()
        return fd


def ready() -> int:
    with _lock:
        return len(_ready)


def close() -> None:
    """No more pool: the unused namespaces go (their fds closed), the thread ends (what it
    is making goes too); enable() starts it again."""
    global _want
    with _lock:
        _want = 0
        fds, _ready[:] = list(_ready), []
        _wake.notify()
    for fd in fds:
        os.close(fd)


def _make(home: int) -> int:
    """One new network namespace, this thread back in `home` after; its fd."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
    fd = -1
    try:
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if _libc.setns(home, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            if fd >= 0:
                os.close(fd)
            # this thread stays in a namespace it made: it makes no more (none is handed out twice)
            raise RuntimeError(f"setns back to the agent's network namespace: {os.strerror(e)}")
    return fd


def _run() -> None:
    global _broken, _thread
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        while True:
            with _lock:
                while _want and len(_ready) >= _want:
                    _wake.wait()
                if not _want:
                    _thread = None      # close(): no more pool (an enable() now starts another)
                    return
                later = _last_take + REFILL_DELAY_S - time.monotonic()
            if later > 0:
                time.sleep(later)
            try:
                fd = _make(home)
            except (RuntimeError, OSError) as e:      # (RuntimeError: this thread could not go back)
                _broken = str(e)
                log.warning("network namespace pool stopped: %s; sandboxes clone their own", e)
                return
            with _lock:
                if len(_ready) < _want:
                    _ready.append(fd)
                    fd = -1
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(home)
        with _lock:
            if _thread is threading.current_thread():
                _thread = None
