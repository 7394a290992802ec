"""The sandbox supervisor: PID 1 inside the sandbox's pid namespace.

It is forked (not exec'd) from the launcher after the namespaces are created,
so it starts with the launcher's memory and needs no interpreter start-up.
It builds the sandbox's mount tree, pivots into it, waits for the launcher's
"go" (network configured), then forks the workload, which drops every
privilege and execs CMD. It reaps every orphan, forwards SIGTERM/SIGINT/SIGHUP/
SIGQUIT/SIGUSR1/SIGUSR2 to the workload, kills everything left when the
workload's main process exits, and reports the exit status and resource usage
to the launcher over a pipe.

If the launcher dies (its control pipe closes), the supervisor kills the whole
sandbox: nothing keeps running unsupervised.

Protocol (JSON lines):
  launcher -> supervisor (ctl):  {"cmd": "go", "net": {...}|null}  {"cmd": "terminate"}
  supervisor -> launcher (status): {"ev": "ready"}  {"ev": "started", "pid": N}
       {"ev": "exit", "status": wait-status|null, "exec_errno": N|null, "cpu_ms": N,
        "max_rss_bytes": N}  {"ev": "error", "msg": "..."}
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import resource  # noqa: F401 - os.wait4 imports it lazily; after pivot_root it may not exist
import select
import signal
import socket
import struct
import time
import traceback

from agent import sysutil as su

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)

# OCI runtime defaults (runc/crun): paths masked and made read-only in /proc and /sys.
MASKED = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
          "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
          "/proc/config.gz", "/proc/kallsyms", "/proc/modules",
          "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
          "/sys/kernel/tracing", "/sys/kernel/security", "/sys/fs/bpf")
READONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
HOLD_MAX_S = 30.0
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
           ("urandom", 1, 9), ("tty", 5, 0))


class SetupError(Exception):
    pass


def _send(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    try:
        os.write(fd, data)
    except OSError:
        pass


def _mkdirs(path, mode=0o755):
    try:
        os.makedirs(path, mode, exist_ok=True)
    except OSError as e:
        raise SetupError(f"cannot create {path}: {e.strerror}")


def _mount(src, target, fstype, flags=0, data=None):
    try:
        su.mount(src, target, fstype, flags, data)
    except OSError as e:
        raise SetupError(f"mount {fstype or 'bind'} on {target} failed: {e.strerror}")


def _overlay(lower, upper, work, target):
    for d in (upper, work):
        _mkdirs(d)
    _mount("overlay", target, "overlay", su.MS_NOSUID | su.MS_NODEV,
           f"lowerdir={lower},upperdir={upper},workdir={work}")


def build_mounts(cfg: dict) -> list[str]:
    """Assemble the sandbox root under cfg['root'] (in our private mount ns).

    Returns the mount points dsec had to create in the upper layer (they are
    not changes made by the workload)."""
    created = []
    _mount(None, "/", None, su.MS_REC | su.MS_PRIVATE)
    root = cfg["root"]
    up, wk = cfg["upper"], cfg["work"]
    _overlay(cfg["lower"], f"{up}/_root", f"{wk}/_root", root)
    for d in cfg["host_dirs"]:
        _overlay("/" + d, f"{up}/{d}", f"{wk}/{d}", f"{root}/{d}")

    def mp(rel, mode=0o755):
        p = root + rel
        if not os.path.isdir(p):
            if os.path.lexists(p):
                raise SetupError(f"rootfs: {rel} exists and is not a directory")
            _mkdirs(p, mode)
            created.append(rel)
        return p

    nsx = su.MS_NOSUID | su.MS_NODEV | su.MS_NOEXEC
    _mount("proc", mp("/proc", 0o555), "proc", nsx)
    _mount("sysfs", mp("/sys", 0o555), "sysfs", nsx | su.MS_RDONLY)
    _mount("tmpfs", mp("/dev"), "tmpfs", su.MS_NOSUID | su.MS_STRICTATIME, "mode=755,size=65536k")
    dev = root + "/dev"
    old = os.umask(0)
    try:
        for name, major, minor in DEVICES:
            os.mknod(f"{dev}/{name}", 0o666 | 0o020000, os.makedev(major, minor))
        os.mkdir(f"{dev}/pts", 0o755)
        os.mkdir(f"{dev}/shm", 0o1777)
    finally:
        os.umask(old)
    _mount("devpts", f"{dev}/pts", "devpts", su.MS_NOSUID | su.MS_NOEXEC,
           "newinstance,ptmxmode=0666,mode=0620,gid=5")
    _mount("shm", f"{dev}/shm", "tmpfs", nsx, "mode=1777,size=65536k")
    for link, target in (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                         ("core", "/proc/kcore")):
        os.symlink(target, f"{dev}/{link}")
    _mount("tmpfs", mp("/tmp", 0o1777), "tmpfs", su.MS_NOSUID | su.MS_NODEV,
           f"mode=1777,size={cfg['tmp_size']}")
    for p in MASKED:
        t = root + p
        if os.path.isdir(t) and not os.path.islink(t):
            _mount("tmpfs", t, "tmpfs", su.MS_RDONLY | nsx, "size=0")
        elif os.path.exists(t):
            _mount(f"{dev}/null", t, None, su.MS_BIND)
    for p in READONLY:
        t = root + p
        if os.path.exists(t):
            _mount(t, t, None, su.MS_BIND | su.MS_REC)
            _mount(None, t, None, su.MS_BIND | su.MS_REMOUNT | su.MS_RDONLY | nsx)
    if cfg.get("writable") is not None:
        _writable_layout(cfg, root)
    os.chdir(root)
    try:
        su.pivot_root(".", ".")
        su.umount2(".", su.MNT_DETACH)
    except OSError as e:
        raise SetupError(f"pivot_root into {root} failed: {e.strerror}")
    os.chdir("/")
    return created


def _writable_layout(cfg: dict, root: str):
    """files.writable in enforce mode: only the listed paths stay writable.

    Each writable path becomes a bind mount of itself (created, owned by the
    workload's user, if missing); then the overlay mounts are remounted
    read-only. The scratch tmpfs mounts (/tmp, /dev, /dev/shm) stay writable."""
    for w in cfg["writable"]:
        if w.rstrip("/") in ("", "/"):
            return                       # everything writable: nothing to do
    for w in cfg["writable"]:
        t = root + w.rstrip("/")
        if not os.path.lexists(t):
            _mkdirs(t)
            os.chown(t, cfg["uid"], cfg["gid"])
        elif os.path.islink(t) or not os.path.isdir(t) and not os.path.isfile(t):
            raise SetupError(f"files.writable: {w} is not a directory or file in the sandbox")
        _mount(t, t, None, su.MS_BIND | su.MS_REC)
    ro = su.MS_BIND | su.MS_REMOUNT | su.MS_RDONLY | su.MS_NOSUID | su.MS_NODEV
    _mount(None, root, None, ro)
    for d in cfg["host_dirs"]:
        _mount(None, f"{root}/{d}", None, ro)


def loopback_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s, 0x8913, struct.pack("16sh22x", b"lo", 0))   # SIOCGIFFLAGS
        flags = struct.unpack("16sh", res[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))  # SIOCSIFFLAGS IFF_UP
    finally:
        s.close()


def _resolve(cmd: str, path_var: str) -> str:
    """execvp's PATH search, done before seccomp is loaded (so it needs no extra calls after)."""
    if "/" in cmd:
        return cmd
    first_err = None
    for d in (path_var or "/usr/bin:/bin").split(":"):
        cand = os.path.join(d or ".", cmd)
        if os.path.isfile(cand):
            if os.access(cand, os.X_OK):
                return cand
            first_err = first_err or OSError(errno.EACCES, "Permission denied")
    if first_err:
        raise first_err
    raise OSError(errno.ENOENT, "No such file or directory")


def _exec_workload(cfg: dict, err_w: int):
    """In the workload child: drop everything, exec CMD. Never returns."""
    stage = "setup"
    try:
        for sig in range(1, signal.NSIG):
            try:
                if sig not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.setsid()
        uid, gid = cfg["uid"], cfg["gid"]
        stage = "workdir"
        wd = cfg["workdir"]
        if not os.path.isdir(wd):
            os.makedirs(wd, 0o755, exist_ok=True)
            os.chown(wd, uid, gid)
        os.chdir(wd)
        stage = "fds"
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 65536)
        stage = "privileges"
        su.drop_bounding_set()
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if uid == 0:
            su.clear_capabilities()
        su.prctl(su.PR_SET_NO_NEW_PRIVS, 1)
        stage = "exec"
        argv = cfg["argv"]
        path = _resolve(argv[0], cfg["env"].get("PATH", ""))
        filt = cfg.get("seccomp")
        if filt is not None:
            # Last step before execve: the filter must not have to allow our own
            # set-up calls, only execve itself (see docs/launcher.md).
            stage = "seccomp"
            filt.load()
            stage = "exec"
        os.execve(path, argv, cfg["env"])
    except OSError as e:
        os.write(err_w, json.dumps({"stage": stage, "errno": e.errno or errno.EIO,
                                    "msg": e.strerror or str(e)}).encode())
    except BaseException as e:  # noqa: BLE001 - must never return into the launcher
        try:
            os.write(err_w, json.dumps({"stage": stage, "errno": errno.EIO, "msg": repr(e)}).encode())
        except BaseException:
            pass
    os._exit(127)


def supervisor_main(cfg: dict, ctl_r: int, status_w: int):
    """Entry point in the forked child that is PID 1 of the new pid namespace.

    Everything it needs is imported before pivot_root: the sandbox's root may
    have no Python at all."""
    code = 125
    try:
        code = _supervise(cfg, ctl_r, status_w)
    except SetupError as e:
        _send(status_w, {"ev": "error", "msg": str(e)})
        code = 125
    except BaseException as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        _send(status_w, {"ev": "error", "msg": f"supervisor: {e!r} at {os.path.basename(where.filename)}:{where.lineno}"})
        code = 125
    finally:
        os._exit(code)


def _supervise(cfg, ctl_r, status_w):
    su.set_name("dsec-init")
    keep = {0, 1, 2, ctl_r, status_w}
    for fd in list(map(int, os.listdir("/proc/self/fd"))):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    su.sethostname(cfg["hostname"])
    cfg["created_mountpoints"] = build_mounts(cfg)
    loopback_up()
    _send(status_w, {"ev": "ready", "created": cfg["created_mountpoints"]})

    line = _readline(ctl_r)
    if not line:
        return 125  # launcher gone before go
    json.loads(line)   # "go": the launcher has configured the network from outside

    # signals: forward to the workload; wake the loop on SIGCHLD
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    child = {"pid": 0}

    def forward(sig, _frame):
        if child["pid"]:
            try:
                os.kill(child["pid"], sig)
            except ProcessLookupError:
                pass

    for s in FORWARDED:
        signal.signal(s, forward)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        _exec_workload(cfg, err_w)
    child["pid"] = pid
    os.close(err_w)
    err = b""
    while True:
        try:
            chunk = os.read(err_r, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        err += chunk
    os.close(err_r)
    exec_err = json.loads(err) if err else None
    if not exec_err:
        _send(status_w, {"ev": "started", "pid": pid})

    cpu = 0.0
    maxrss = 0
    status = None
    owner_gone = False
    while status is None:
        # reap whatever is ready
        while True:
            try:
                p, st, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                p = 0
            if p == 0:
                break
            cpu += ru.ru_utime + ru.ru_stime
            maxrss = max(maxrss, ru.ru_maxrss)
            if p == pid:
                status = st
        if status is not None:
            break
        try:
            r, _, _ = select.select([ctl_r, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if ctl_r in r:
            line = _readline(ctl_r)
            if not line:
                owner_gone = True           # launcher died: fail closed
                _kill_all()
                continue
            cmd = json.loads(line).get("cmd")
            if cmd == "terminate":
                try:
                    os.kill(-1, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    # the main process is gone: nothing else may outlive it
    _kill_all()
    while True:
        try:
            p, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        cpu += ru.ru_utime + ru.ru_stime
        maxrss = max(maxrss, ru.ru_maxrss)
    _send(status_w, {"ev": "exit", "status": None if exec_err else status,
                     "exec_errno": exec_err["errno"] if exec_err else None,
                     "exec_stage": exec_err["stage"] if exec_err else None,
                     "exec_msg": exec_err["msg"] if exec_err else None,
                     "cpu_ms": int(cpu * 1000), "max_rss_bytes": maxrss * 1024,
                     "owner_gone": owner_gone})
    if cfg.get("hold_after_exit") and not owner_gone:
        # Keep the sandbox's mount namespace alive (every process but us is
        # gone) until the launcher has finished reading the record through it
        # (exec enrichment opens binaries inside /proc/1/root). Bounded.
        end = time.monotonic() + HOLD_MAX_S
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                r, _, _ = select.select([ctl_r], [], [], left)
            except InterruptedError:
                continue
            if not r:
                break
            line = _readline(ctl_r)
            if not line or b"release" in line:
                break
    return 0


def _kill_all():
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _readline(fd) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        try:
            c = os.read(fd, 1)
        except InterruptedError:
            continue
        if not c:
            return b""
        buf += c
    return buf
