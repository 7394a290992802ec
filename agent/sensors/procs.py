"""The processes an exec's enrichment reads a sandbox's files through
(agent/sensors/decoder.py exec_fields, agent/sensors/elfinfo.py for_exec):
in_cgroup (is a pid still in the sandbox), in_sandbox_root (is an exec'ing
process's root the sandbox's: one stat instead), the sandbox's init pinned by a
/proc/<pid> descriptor (PinnedPid), and the other candidates checked lazily
(LivePids)."""
from __future__ import annotations

import errno
import os


def in_cgroup(pid: int, cgroup_id: int, cgroup2_root: str | None, proc: str = "/proc") -> bool:
    """Is `pid` (still) in cgroup2 `cgroup_id` or below it? Guards against a
    pid that has been reused by a process outside the sandbox."""
    if not cgroup2_root:
        return False
    try:                                      # os.open/read: no buffered file object (per exec, per pid)
        fd = os.open(f"{proc}/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 65536)
        finally:
            os.close(fd)
    except OSError:
        return False
    for ln in data.split(b"\n"):
        if ln.startswith(b"0::"):
            rel = ln[3:]
            break
    else:
        return False
    root = os.fsencode(cgroup2_root)
    path = root + rel
    for _ in range(64):                       # bounded walk up the hierarchy
        try:
            if os.stat(path).st_ino == cgroup_id:
                return True
        except OSError:
            return False
        if len(path) <= len(root):
            return False
        path = os.path.dirname(path)
    return False


class ProcDir:
    """An O_PATH descriptor of /proc/<pid>: a lookup through it fails (ESRCH) once that
    process has exited, even when its pid has been reused. Closed when the last reference
    goes (a Pending on the enricher's thread may still hold it after the sandbox is gone)."""

    def __init__(self, pid: int, proc: str = "/proc"):
        self.fd = os.open(f"{proc}/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def __del__(self):
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


class PinnedPid(int):
    """A sandbox's init, checked to be in its cgroup once (Decoder.set_root_pid) and opened
    through its ProcDir from then on (elfinfo.open_in_root): it needs no in_cgroup per exec,
    and a reuse of its number by another process is never read through."""
    dir: ProcDir


def open_root(pid: int, proc: str = "/proc") -> int:
    """/proc/<pid>/root (O_PATH), through a PinnedPid's /proc descriptor when it has one."""
    pinned = getattr(pid, "dir", None)           # a PinnedPid: that process, not a reuse of its number
    if pinned is not None:
        return os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pinned.fd)
    return os.open(f"{proc}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def root_ready(info) -> None:
    """READY: the sandbox's init has made its mounts and pivoted into its root, and nothing of
    the workload has run: that root's identity (device, inode) is kept to recognise the
    sandbox's processes (in_sandbox_root). One stat through the init's /proc descriptor; no
    descriptor kept (the last one of a mount is costly to close: permcheck.SandboxRoots). Not
    earlier: before its pivot_root the init's root is the host's."""
    pinned = info.root_pid
    if isinstance(pinned, PinnedPid):
        st = os.stat("root", dir_fd=pinned.dir.fd)
        info.root_id = (st.st_dev, st.st_ino)


GONE = False


def in_sandbox_root(pid: int, info, proc: str = "/proc"):
    """An exec'ing process for its enrichment: pinned by its ProcDir (PinnedPid: its root and exe
    opened through it, never through a reuse of its number) when it is alive and its root is the
    sandbox's (info.root_id, root_ready's) -- the enrichment's question, "is this the sandbox's
    view?", answered by a stat instead of in_cgroup's reads; GONE when it has exited; None when
    the sandbox's root is not known or the process's root is another (then in_cgroup decides).
    The sandbox's init is alive after the match: its root's device (an overlay's, the sandbox's
    own) was not freed and given to another sandbox's root meanwhile."""
    init = info.root_pid
    if info.root_id is None or not isinstance(init, PinnedPid):
        return None
    try:
        d = ProcDir(pid, proc)
        st = os.stat("root", dir_fd=d.fd)
    except OSError as e:                          # exited (a zombie has no root), else not ours to say
        return GONE if e.errno in (errno.ENOENT, errno.ESRCH) else None
    if (st.st_dev, st.st_ino) != info.root_id:
        return None
    try:
        os.stat("root", dir_fd=init.dir.fd, follow_symlinks=False)
    except OSError:
        return None
    pinned = PinnedPid(pid)
    pinned.dir = d
    return pinned


def set_root_pid(info, pid: int, cgroup2_root: str | None, proc: str = "/proc") -> None:
    """The sandbox's init (for enrichment once an exec'ing process is gone): see pin_root."""
    info.root_pid = pin_root(pid, info.cgroup_id, cgroup2_root, proc)


def pin_root(pid: int, cgroup_id: int, cgroup2_root: str | None, proc: str = "/proc") -> int:
    """`pid` pinned (PinnedPid) when it is in the sandbox's cgroup now, else the plain pid,
    checked at each use. Its reads need no lock (a sensor takes it outside its own)."""
    if pid and in_cgroup(pid, cgroup_id, cgroup2_root, proc):
        try:
            pinned = PinnedPid(pid)
            pinned.dir = ProcDir(pid, proc)
        except OSError:
            return pid                            # gone already: a plain pid, checked per use
        return pinned
    return pid


class LivePids:
    """A sandbox's other processes still in it, for an exec's enrichment: its init, then the
    pids seen lately (newest first), at most `limit`, each checked with in_cgroup only when
    the iteration reaches it (most execs need none, a short-lived one the first). The
    candidates are copied now; what was checked is kept (a second iteration reads nothing)."""

    def __init__(self, dec, info, exclude=(), limit: int = 2):
        cands = [info.root_pid] + info.recent_pids[::-1]
        self._cands = [p for p in dict.fromkeys(cands) if p and p not in exclude]
        self._dec, self._cgid, self._limit = dec, info.cgroup_id, limit
        self._next, self._live = 0, []

    def __iter__(self):
        n, d = 0, self._dec
        while True:
            if n < len(self._live):
                yield self._live[n]
                n += 1
            elif len(self._live) >= self._limit or self._next >= len(self._cands):
                return
            else:
                p = self._cands[self._next]
                self._next += 1
                if isinstance(p, PinnedPid) or in_cgroup(p, self._cgid, d.cgroup2_root, d.proc):
                    self._live.append(p)
