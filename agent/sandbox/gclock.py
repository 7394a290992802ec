"""gc.lock: `dsec gc` holds it exclusively from its first listing to its last
removal; a launcher holds it shared (start_guard) from before its state
directory exists until its cgroups exist and its state lock is held, so gc
never takes a starting sandbox for an orphan (agent/sandbox/gc.py). Its own
module so that the launcher and gc need not import each other."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager


def _lock_path() -> str:
    from agent.sandbox import rootfs
    return os.path.join(rootfs.STATE_ROOT, "gc.lock")


@contextmanager
def gc_lock(mode: int):
    os.makedirs(os.path.dirname(_lock_path()), exist_ok=True)
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


class StartGuard:
    """gc.lock held shared by a launcher while its sandbox comes into being (gc
    waits); release() is idempotent."""

    def __init__(self):
        path = _lock_path()
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:       # the state root not made yet: made once, not looked at per start
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(self.fd)
            raise

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def start_guard() -> StartGuard:
    return StartGuard()
