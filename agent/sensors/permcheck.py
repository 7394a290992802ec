"""Would the kernel have refused this write anyway? (issue 21: denial records a
reviewer can read)

    roots = SandboxRoots()
    roots.add(sandbox_id, supervisor_pid)     # once the sandbox's PID 1 is in its root (READY)
    why = roots.refused_anyway(sandbox_id, rec)   # "EACCES: ..." or None
    roots.remove(sandbox_id)                  # after the sandbox's last record

In enforce mode the read-only layout answers a write outside files.writable
with EROFS before the kernel looks at permissions (the mount check comes
first). Some of those writes would have failed anyway: a test that writes
into its own install directory under /usr, owned by root, as uid 1000. Such a
write is forbidden, but it is not a policy denial -- the policy changed
nothing. This module answers, for one EROFS record, whether the sandbox's
user lacks the permission the write needs, by looking at the file's mode bits
the way the kernel's generic permission check does for a task without
capabilities (every sandbox runs with none):

  open for writing   write on the file if it exists, else write+search on
                     its directory (the create)
  unlink, rmdir      write+search on the directory
  rename             write+search on both directories

It looks as root, after the fact, through the sandbox's own root (the
supervisor's /proc/<pid>/root, opened once dsec-init has pivoted into it --
READY, before the workload's first step: earlier it is the host's tree -- and
held with its mount namespace until its last record, so a write in the
sandbox's last moment is still checked) with openat2(RESOLVE_IN_ROOT): symlinks resolve
inside the sandbox, never on the host; O_PATH, so nothing is opened (no FIFO
blocks). What is read-only cannot have changed since the write, so "after the
fact" sees what the write saw.

Best effort and conservative: the answer is "refused anyway" only when the
mode bits positively refuse the sandbox's uid/gid (the workload has no
supplementary groups: the supervisor clears them). Anything uncertain -- the
path cannot be looked up, POSIX ACLs on the file or directory, the sandbox's
root is gone -- answers None, and the record stays a policy denial. The
record says how it was decided (extra.refused_anyway, extra.refused_anyway_by).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import posixpath
import stat
import threading

SYS_OPENAT2 = 437                 # x86_64
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
W_OK_BITS = {"owner": stat.S_IWUSR, "group": stat.S_IWGRP, "other": stat.S_IWOTH}
X_OK_BITS = {"owner": stat.S_IXUSR, "group": stat.S_IXGRP, "other": stat.S_IXOTH}
ACL_XATTR = "system.posix_acl_access"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _openat2_path(root_fd: int, path: bytes) -> int:
    """An O_PATH fd of `path` resolved inside root_fd (symlinks stay inside); raises OSError."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(SYS_OPENAT2, ctypes.c_int(root_fd), ctypes.c_char_p(path), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return fd


def _class(st: os.stat_result, uid: int, gid: int) -> str:
    if st.st_uid == uid:
        return "owner"
    if st.st_gid == gid:
        return "group"
    return "other"


def _has_acl(fd: int) -> bool | None:
    try:
        os.getxattr(f"/proc/self/fd/{fd}", ACL_XATTR)
        return True
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        return None


def _lacks(root_fd: int, path: bytes, need_x: bool, uid: int, gid: int) -> str | None:
    """'what is missing' when uid/gid positively lack write (and search, need_x)
    on path; None when they have it or it cannot be known."""
    try:
        fd = _openat2_path(root_fd, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if _has_acl(fd) is not False:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    who = _class(st, uid, gid)
    missing = [n for n, bits in (("write", W_OK_BITS), ("search", X_OK_BITS))
               if (n == "write" or need_x) and not st.st_mode & bits[who]]
    if not missing:
        return None
    show = path.decode("utf-8", "backslashreplace")
    return (f"{show} is {st.st_uid}:{st.st_gid} {stat.filemode(st.st_mode)}: uid {uid} gid {gid} "
            f"({who}) has no {'/'.join(missing)} permission")


def refused_anyway(root_fd: int, rec: dict) -> str | None:
    """Why the write of `rec` would have failed with EACCES whatever the layout
    ("EACCES: <path> is 0:0 drwxr-xr-x: ..."), or None."""
    uid = rec.get("uid")
    try:
        gid = int(json.loads(rec.get("extra") or "{}").get("gid"))
    except (TypeError, ValueError, AttributeError):
        return None
    if not isinstance(uid, int):
        return None
    kind = rec.get("kind")
    paths = [rec.get("path") or ""]
    if kind == "rename":
        paths.append(rec.get("path2") or "")
    for p in paths:
        if not p.startswith("/"):
            return None                         # not placed: nothing to look at
    for p in paths:
        b = p.encode("utf-8", "surrogateescape")
        parent = posixpath.dirname(b.rstrip(b"/")) or b"/"
        if kind == "open_write":
            try:
                fd = _openat2_path(root_fd, b)
                os.close(fd)
                exists = True
            except OSError as e:
                if e.errno != errno.ENOENT:
                    return None
                exists = False
            why = _lacks(root_fd, b, False, uid, gid) if exists else _lacks(root_fd, parent, True, uid, gid)
        else:
            why = _lacks(root_fd, parent, True, uid, gid)
        if why:
            return "EACCES: " + why
    return None


class SandboxRoots:
    """Each watched sandbox's root (and mount namespace, which keeps its mounts),
    held from its start until its last record.

    Closing the last descriptor of a mount namespace unmounts its tree, and the kernel
    waits an expedited RCU grace period before it frees the mounts (namespace_unlock): a
    wait of milliseconds on a loaded node, which was on every close's critical path (the
    unwatch that a sandbox's exit record waits for). remove() hands the descriptors to one
    closing thread instead; close() closes what is left before it returns."""

    def __init__(self):
        self._fds: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._closing: list = []                 # descriptors of removed sandboxes, not closed yet
        self._wake = threading.Condition(self._lock)
        self._closer = None

    def add(self, sandbox_id: str, pid: int):
        try:
            root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(root)
            return
        with self._lock:
            old = self._fds.pop(sandbox_id, None)
            self._fds[sandbox_id] = (root, ns)
        if old:
            self._close_later(old)

    def remove(self, sandbox_id: str):
        with self._lock:
            fds = self._fds.pop(sandbox_id, None)
        if fds:
            self._close_later(fds)

    def _close_later(self, fds) -> None:
        with self._lock:
            if self._closer is None:
                try:
                    t = threading.Thread(target=self._close_loop, name="dsec-roots-close", daemon=True)
                    t.start()
                    self._closer = t
                except RuntimeError:             # no thread to be had: closed here, as before
                    pass
            if self._closer is not None:
                self._closing.extend(fds)
                self._wake.notify()
                return
        for fd in fds:
            os.close(fd)

    def _close_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing:
                    self._wake.wait()
                fds, self._closing = self._closing, []
            for fd in fds:
                os.close(fd)

    def pending_closes(self) -> int:
        with self._lock:
            return len(self._closing)

    def close(self):
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            left, self._closing = self._closing, []
        for fd in left:
            os.close(fd)
        for pair in fds:
            for fd in pair:
                os.close(fd)

    def refused_anyway(self, sandbox_id: str, rec: dict) -> str | None:
        with self._lock:
            fds = self._fds.get(sandbox_id)
            if fds is None:
                return None
            # under the lock: remove() cannot close the fd while it is in use
            try:
                return refused_anyway(fds[0], rec)
            except Exception:  # noqa: BLE001 - best effort: uncertain means a policy denial
                return None
