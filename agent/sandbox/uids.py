"""Host uids for sandboxes: each sandbox's default user ("sandbox") runs as a
host uid/gid of its own, leased from a configured range, so per-uid kernel
limits (inotify instances and watches, pipe-user pages, POSIX message queue
bytes, keys, RLIMIT_NPROC) never cross sandboxes and no sandbox shares a uid
with a login of the node.

    lease = allocate("sbx-1")         # lease.uid (== gid), held until lease.release()
    configure("1879048192-1879113727") # the range (agent config sandbox_uids, env DSEC_SANDBOX_UIDS)

A lease is an flock on /run/dsec/uids/<uid>, held by the launcher for the
sandbox's life: a crashed launcher's uids come free with its process. The
default range (65536 uids from 1879048192) lies past systemd's container
range (524288-1879048191) and below 2^31.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os

from agent.errors import DsecError, EXIT_DSEC

LEASE_DIR = "/run/dsec/uids"
DEFAULT_RANGE = "1879048192-1879113727"
_range: tuple[int, int] | None = None


def parse_range(text: str) -> tuple[int, int]:
    """"A-B" (inclusive) -> (first, count); DsecError naming what is wrong."""
    a, sep, b = text.strip().partition("-")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise DsecError(f"sandbox uid range {text!r}: expected FIRST-LAST, e.g. {DEFAULT_RANGE}", EXIT_DSEC)
    lo, hi = int(a), int(b)
    if not 1000 <= lo <= hi <= 0xFFFFFFFE:
        raise DsecError(f"sandbox uid range {text!r}: must lie within 1000-4294967294, first <= last", EXIT_DSEC)
    return lo, hi - lo + 1


def configure(text: str | None) -> None:
    global _range
    _range = parse_range(text) if text else None


def current_range() -> tuple[int, int]:
    if _range is not None:
        return _range
    return parse_range(os.environ.get("DSEC_SANDBOX_UIDS") or DEFAULT_RANGE)


class Lease:
    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self.gid = uid
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def allocate(sandbox_id: str) -> Lease:
    first, count = current_range()
    start = int(hashlib.sha1(sandbox_id.encode()).hexdigest()[:8], 16) % count
    for i in range(count):
        uid = first + (start + i) % count
        path = os.path.join(LEASE_DIR, str(uid))
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:   # the lease directory not made yet (made once, not looked at per lease)
                try:
                    os.makedirs(LEASE_DIR, mode=0o700, exist_ok=True)
                except OSError as e:
                    raise DsecError(f"cannot create {LEASE_DIR}: {e.strerror}", EXIT_DSEC) from None
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DsecError(f"cannot lease a sandbox uid in {LEASE_DIR}: {e.strerror}", EXIT_DSEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise DsecError(f"cannot lease sandbox uid {uid}: {e.strerror}", EXIT_DSEC)
        return Lease(uid, fd)
    raise DsecError(f"no free sandbox uid in {first}-{first + count - 1} ({count} sandboxes live): "
                    f"widen the range (sandbox_uids / DSEC_SANDBOX_UIDS)", EXIT_DSEC)
