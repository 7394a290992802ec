"""Thin ctypes wrappers for the Linux calls Python's os module lacks (3.11):
mount, umount2, unshare, setns, pivot_root, sethostname, prctl, capset,
openat2; and spawn_in_namespaces (posix_spawn from a thread that unshared
its namespaces: the child is PID 1 of a new pid namespace).

Each raises OSError with errno set, like the os module does.
"""
from __future__ import annotations

import ctypes
import errno
import ctypes.util
import os
import re

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

# clone flags
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000

# mount flags
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2

# prctl
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

SYS_pivot_root = 155   # x86_64
SYS_capset = 126
SYS_openat2 = 437

# openat2 resolve flags (linux/openat2.h)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _b(s):
    if s is None:
        return None
    return os.fsencode(s)


def mount(source, target, fstype, flags=0, data=None):
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
           f"mount {fstype or ''} on {os.fsdecode(target)}")


def umount2(target, flags=0):
    _check(_libc.umount2(_b(target), flags), f"umount {os.fsdecode(target)}")


def unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def setns(fd, nstype=0):
    _check(_libc.setns(fd, nstype), "setns")


def pivot_root(new_root, put_old):
    _check(_libc.syscall(SYS_pivot_root, _b(new_root), _b(put_old)), "pivot_root")


def sethostname(name: str):
    b = name.encode()
    _check(_libc.sethostname(b, len(b)), "sethostname")


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    r = _libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                    ctypes.c_ulong(arg4), ctypes.c_ulong(arg5))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")
    return r


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def clear_capabilities():
    """Empty the effective, permitted and inheritable sets of this thread."""
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.syscall(SYS_capset, ctypes.byref(hdr), ctypes.byref(data)), "capset")


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def drop_bounding_set():
    for cap in range(last_cap() + 1):
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            pass
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass


def set_name(name: str):
    """Set this thread's comm (what /proc/PID/comm and ps show)."""
    _libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2): e.g. a path inside a rootfs that can never resolve outside it
    (RESOLVE_IN_ROOT: absolute symlinks and ".." stop at dirfd)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(SYS_openat2, ctypes.c_int(dirfd), _b(path), ctypes.byref(how), ctypes.c_size_t(24))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fsdecode(path))
    return fd


_SIGDEF: list | None = None


def _sigdef() -> list:
    """The signals posix_spawn resets to their default action (all but SIGKILL/SIGSTOP, < 32)."""
    global _SIGDEF
    if _SIGDEF is None:
        import signal
        _SIGDEF = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP) and s < 32]
    return _SIGDEF


_POSIX_SPAWN_SETSIGDEF = 0x04          # glibc's spawn.h
_POSIX_SPAWN_SETSIGMASK = 0x08


class _SpawnOpaque(ctypes.Structure):  # posix_spawnattr_t (336 bytes in glibc) / posix_spawn_file_actions_t (80)
    _fields_ = [("_", ctypes.c_ubyte * 1024)]


class _Sigset(ctypes.Structure):       # sigset_t: 1024 bits in glibc
    _fields_ = [("_", ctypes.c_ubyte * 128)]


def _spawn_rc(rc: int, what: str) -> None:
    if rc:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")


def posix_spawn_nogil(path: str, argv: list, fd_as_3: int) -> int:
    """os.posix_spawn(path, argv, {}, file_actions=[dup2 fd_as_3 -> 3], setsigmask=(),
    setsigdef=_sigdef()) through libc with ctypes, which releases the GIL for the call:
    CPython's os.posix_spawn holds it across vfork + exec (the caller is suspended until
    the child has exec'd), ~1 ms per sandbox in which no other thread of the agent ran
    (13% of the GIL's held time at concurrency 32)."""
    by = ctypes.byref
    fa, attr, mask, dflt = _SpawnOpaque(), _SpawnOpaque(), _Sigset(), _Sigset()
    _spawn_rc(_libc.posix_spawn_file_actions_init(by(fa)), "posix_spawn_file_actions_init")
    try:
        _spawn_rc(_libc.posix_spawn_file_actions_adddup2(by(fa), fd_as_3, 3), "posix_spawn_file_actions_adddup2")
        _spawn_rc(_libc.posix_spawnattr_init(by(attr)), "posix_spawnattr_init")
        try:
            _libc.sigemptyset(by(mask))
            _libc.sigemptyset(by(dflt))
            for sig in _sigdef():
                _libc.sigaddset(by(dflt), int(sig))
            _spawn_rc(_libc.posix_spawnattr_setsigmask(by(attr), by(mask)), "posix_spawnattr_setsigmask")
            _spawn_rc(_libc.posix_spawnattr_setsigdefault(by(attr), by(dflt)), "posix_spawnattr_setsigdefault")
            _spawn_rc(_libc.posix_spawnattr_setflags(by(attr), ctypes.c_short(
                _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK)), "posix_spawnattr_setflags")
            args = [os.fsencode(a) for a in argv]
            c_argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
            c_envp = (ctypes.c_char_p * 1)(None)
            pid = ctypes.c_int(0)
            err = _libc.posix_spawn(by(pid), os.fsencode(path), by(fa), by(attr), c_argv, c_envp)
            if err:
                raise OSError(err, os.strerror(err), path)
            return pid.value
        finally:
            _libc.posix_spawnattr_destroy(by(attr))
    finally:
        _libc.posix_spawn_file_actions_destroy(by(fa))


def spawn_in_namespaces(path: str, argv: list, flags: int, fd_as_3: int) -> int:
    """Start `path` as the first process of new namespaces (`flags`, CLONE_NEW*).

    A short-lived thread unshares them (a thread's namespaces for its children
    are its own) and posix_spawns (vfork + exec, without the GIL) the program, which so becomes
    PID 1 of the new pid namespace, a child of this process, and starts with
    an empty environment, default signal dispositions, no blocked signals and
    `fd_as_3` as its fd 3 (every other fd of ours is close-on-exec)."""
    import _thread
    out = {}
    done = _thread.allocate_lock()
    done.acquire()

    def work():
        try:
            unshare(flags)
            out["pid"] = posix_spawn_nogil(path, argv, fd_as_3)
        except OSError as e:
            out["err"] = e
        finally:
            done.release()

    # a bare thread and one wait for its end (threading.Thread's start handshake and join are two
    # GIL hand-offs more, per sandbox); it exits right after, its namespaces with it
    try:
        _thread.start_new_thread(work, ())
    except RuntimeError as e:
        raise OSError(errno.EAGAIN, f"cannot start a thread: {e}") from None
    done.acquire()
    if "err" in out:
        raise out["err"]
    return out["pid"]


# -- open-file limit ---------------------------------------------------------------
# An agent holds a few fds per live sandbox (its control socket, pidfd, cgroup and
# step pipes); the usual soft limit of 1024 stops it near 200 sandboxes. The agent
# and `dsec run` raise the soft limit to the hard one at start (as Go programs and
# systemd services do); sandboxes keep the limit the agent was started with
# (restore_nofile on their PID 1), so the raise never reaches workload code.
_NOFILE_ORIG: tuple[int, int] | None = None


def raise_nofile() -> dict:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (once per process).
    Returns {"soft", "hard", "was", "error"}: error is "" or why it could not be raised."""
    import resource
    global _NOFILE_ORIG
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _NOFILE_ORIG is None:
        _NOFILE_ORIG = (soft, hard)
    err = ""
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:
            err = f"setrlimit(RLIMIT_NOFILE, {hard}): {e}"
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft": soft, "hard": hard, "was": _NOFILE_ORIG[0], "error": err}


def nofile_to_restore() -> tuple[int, int] | None:
    """The open-file limit this process started with, if raise_nofile() changed it
    (a sandbox's PID 1 gets it back), else None."""
    import resource
    if _NOFILE_ORIG is None or _NOFILE_ORIG == resource.getrlimit(resource.RLIMIT_NOFILE):
        return None
    return _NOFILE_ORIG


def restore_nofile(pid: int) -> None:
    """Give process `pid` (a sandbox's PID 1, before it runs anything) the open-file
    limit this process started with, if raise_nofile() changed it."""
    import resource
    orig = nofile_to_restore()
    if orig is not None:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, orig)


def mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of /proc/self/mounts, in its order (the last mount
    on a point is the one in force); the kernel's octal escapes of the point undone."""
    out = []
    try:
        with open("/proc/self/mounts", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2:
                    point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), parts[1])
                    out.append((os.fsdecode(point), parts[2].decode(errors="replace")))
    except OSError:
        pass
    return out
