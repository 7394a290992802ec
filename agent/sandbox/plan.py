"""What dsec-init does for one sandbox, computed on the host: the mount plan,
the sysctls, the credentials and the seccomp program (docs/launcher.md).

    msg = config_message(Plan(...))        # the CONFIG message for dsec-init (its items: config_items)
    prog = seccomp_program(policy)         # struct sock_filter[] bytes, compiled once per policy
    path = init_path()                     # the dsec-init binary (built by scripts/setup.sh)

Every path of the plan that lies inside the sandbox is resolved by dsec-init
with openat2(RESOLVE_IN_ROOT) from the new root: a symlink in a rootfs (or in
the upper layer) never makes dsec create, chown or mount anything on the host.
"""
from __future__ import annotations

import os
import stat
import subprocess
import threading
from collections import OrderedDict

from agent.errors import DsecError, EXIT_DSEC
from agent.sandbox import initproto as ip
from agent.sandbox import sysutil as su

T, OP = ip.T, ip.OP

# OCI runtime defaults (runc/crun): paths masked and made read-only in /proc and /sys.
MASKED = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
          "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
          "/proc/config.gz", "/proc/kallsyms", "/proc/modules",
          "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug",
          "/sys/kernel/tracing", "/sys/kernel/security", "/sys/fs/bpf")
READONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
           ("urandom", 1, 9), ("tty", 5, 0))
DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"), ("core", "/proc/kcore"))
NSX = su.MS_NOSUID | su.MS_NODEV | su.MS_NOEXEC


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = os.uname().release.split("-")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (ValueError, IndexError):
        return False


# A sandbox's writable layers are mounted `volatile` (overlayfs, Linux 5.10+): the overlay's
# sync (on every umount, and a workload's fsync/syncfs) would otherwise sync the whole file
# system the upper layer lives on (the node's /var/lib/dsec): each close wrote back every
# dirty page of the node (2.5 -> 7.5 ms an umount here with 8 MB dirty elsewhere), and a
# workload calling syncfs() in a loop stalled the node's disk. The layer dies with the
# sandbox, so nothing of it needs to survive a host crash (gc removes what one leaves).
OVERLAY_VOLATILE = ",volatile" if _kernel_at_least(5, 10) else ""
WORKLOAD_OOM_SCORE_ADJ = 1000       # the workload is the OOM victim, never PID 1
INIT_OOM_SCORE_ADJ = -1000


class Plan:
    """Inputs of one sandbox's CONFIG (plain class; see launcher.Sandbox._start)."""

    def __init__(self, *, root, upper, work, lowers, host_dirs, hostname, uid, gid, tmp_size,
                 layout, volumes=(), seccomp=b"", sysctls=(), hold=False, seccomp_shared=False):
        self.root = root                  # host dir the root overlay is mounted on
        self.upper = upper                # upper layers: <upper>/_root, <upper>/<host dir>
        self.work = work
        self.lowers = list(lowers)        # root overlay lower layers, topmost first
        self.host_dirs = list(host_dirs)  # default base: /usr, /lib... each its own overlay
        self.hostname = hostname
        self.uid, self.gid = uid, gid
        self.tmp_size = tmp_size
        self.layout = layout              # policies.compile.MountLayout
        self.volumes = list(volumes)      # [{"source": host path, "target": path, "readonly": bool}]
        self.seccomp = seccomp
        self.seccomp_shared = seccomp_shared    # seccomp_shareable(policy): loaded into dsec-init once
        self.sysctls = list(sysctls)      # [(path, value, if_exists)]
        self.hold = hold


def _op(kind, **kw) -> tuple[int, list]:
    items = [(T.KIND, kind)]
    for k, v in kw.items():
        if v is None or v is False:
            continue
        tag = getattr(T, k.upper())
        items.append((tag, b"" if v is True else v))
    return (T.OP, items)


def _mount(target, *, src=None, fstype=None, flags=0, data=None, host=False, what=None, **kw):
    return _op(OP.MOUNT, target=target, src=src, fstype=fstype, flags=flags, data=data, target_host=host,
               what=what or f"mount {fstype or 'bind'} on {target}", **kw)


def _exec_ok(path: str, exec_dirs) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in exec_dirs)


def _check_data(data: str, what: str) -> str:
    if len(data.encode()) > 4000:
        raise DsecError(f"{what}: the overlay option string is {len(data)} bytes (the kernel takes one page): "
                        "use fewer or shorter layer paths", EXIT_DSEC)
    return data


def mount_ops(p: Plan) -> list:
    """The mount plan: overlays, /proc, /sys, /dev, /tmp, masks, volumes, the
    writable layout (noexec under an exec allowlist), pivot_root."""
    return _head_ops(p) + _inner_ops(p.layout, p.tmp_size, _volume_kinds(p.volumes)) + _tail_ops(p)


def _head_ops(p: Plan) -> list:
    """The sandbox's own layers: / made private, the root overlay, each host dir's overlay."""
    ops = [_mount("/", flags=su.MS_REC | su.MS_PRIVATE, host=True, what="making / private")]
    data = _check_data(f"lowerdir={':'.join(p.lowers)},upperdir={p.upper}/_root,workdir={p.work}/_root"
                       f"{OVERLAY_VOLATILE}",
                       "root overlay")
    ops.append(_mount(p.root, src="overlay", fstype="overlay", flags=su.MS_NOSUID | su.MS_NODEV, data=data,
                      host=True, what="mount overlay on /"))
    ops.append(_op(OP.ROOT, target=p.root))
    for d in p.host_dirs:
        ops.append(_mount(d, src="overlay", fstype="overlay", flags=su.MS_NOSUID | su.MS_NODEV, dir=True,
                          data=_check_data(f"lowerdir=/{d},upperdir={p.upper}/{d},workdir={p.work}/{d}"
                                          f"{OVERLAY_VOLATILE}", d),
                          what=f"mount overlay on /{d}"))
    return ops


def _volume_kinds(volumes) -> tuple:
    """(source, target, read-only, source is a file) of each volume: what its mounts depend on."""
    return tuple((v["source"], v["target"], bool(v.get("readonly")), os.path.isfile(v["source"]))
                 for v in volumes)


def _inner_ops(lay, tmp_size, volumes: tuple) -> list:
    """What every sandbox of one layout, /tmp size and volumes mounts inside its root
    (paths relative to it): nothing of one sandbox's own, so config_message encodes it
    once per such set."""
    noexec = lay.noexec
    ops = []
    ops.append(_mount("proc", src="proc", fstype="proc", flags=NSX, mkdir=0o555, record=True))
    ops.append(_mount("sys", src="sysfs", fstype="sysfs", flags=NSX | su.MS_RDONLY, mkdir=0o555, record=True))
    ops.append(_mount("dev", src="tmpfs", fstype="tmpfs", flags=su.MS_NOSUID | su.MS_STRICTATIME,
                      data="mode=755,size=65536k", mkdir=0o755, record=True))
    for name, major, minor in DEVICES:
        ops.append(_op(OP.MKNOD, target=f"dev/{name}", mode=0o666 | stat.S_IFCHR, dev=os.makedev(major, minor),
                       what=f"mknod /dev/{name}"))
    ops.append(_op(OP.MKDIR, target="dev/pts", mode=0o755))
    ops.append(_op(OP.MKDIR, target="dev/shm", mode=0o1777))
    ops.append(_mount("dev/pts", src="devpts", fstype="devpts", flags=su.MS_NOSUID | su.MS_NOEXEC,
                      data="newinstance,ptmxmode=0666,mode=0620,gid=5"))
    shm_exec = _exec_ok("/dev/shm", lay.exec_dirs) and noexec
    ops.append(_mount("dev/shm", src="shm", fstype="tmpfs", flags=NSX & ~(su.MS_NOEXEC if shm_exec else 0),
                      data="mode=1777,size=65536k"))
    for link, target in DEV_LINKS:
        ops.append(_op(OP.SYMLINK, target=f"dev/{link}", value=target, what=f"symlink /dev/{link}"))
    tmp_flags = su.MS_NOSUID | su.MS_NODEV | (su.MS_NOEXEC if noexec and not _exec_ok("/tmp", lay.exec_dirs) else 0)
    ops.append(_mount("tmp", src="tmpfs", fstype="tmpfs", flags=tmp_flags, data=f"mode=1777,size={tmp_size}",
                      mkdir=0o1777, record=True))
    for m in MASKED:
        ops.append(_op(OP.MASK, target=m))
    for r in READONLY:
        ops.append(_mount(r, src=r, src_in_root=True, flags=su.MS_BIND | su.MS_REC, if_exists=True,
                          what=f"bind {r}"))
        ops.append(_mount(r, flags=su.MS_BIND | su.MS_REMOUNT | su.MS_RDONLY | NSX, if_exists=True,
                          what=f"read-only {r}"))
    for src, target, ro, is_file in volumes:
        # not recursive: no host submounts under the volume's source
        ops.append(_mount(target, src=src, flags=su.MS_BIND,
                          mkdir=None if is_file else 0o755, mkfile=is_file, record=True,
                          what=f"volume {src} on {target}"))
        flags = su.MS_BIND | su.MS_REMOUNT | su.MS_NOSUID | su.MS_NODEV
        if ro:
            flags |= su.MS_RDONLY
        elif noexec and not _exec_ok(target, lay.exec_dirs):
            flags |= su.MS_NOEXEC
        ops.append(_mount(target, flags=flags, what=f"volume flags on {target}"))
    return ops + _writable_ops(lay)


def _restricted(lay) -> bool:
    """files.writable (or the implied set) limits what is writable: the image's layers go read-only."""
    w = lay.writable
    return w is not None and not any(x.rstrip("/") in ("", "/") for x in w)


def _writable_ops(lay) -> list:
    """files.writable (or, under an exec allowlist, the implied writable set):
    each path becomes a bind mount of itself (created, owned by the workload's
    user, when missing); then (_tail_ops) the image's layers are remounted
    read-only. Under an exec allowlist every writable bind is noexec unless it
    lies under exec.allow_written_under; a directory of that list inside a
    noexec mount gets an exec-allowed bind of its own."""
    if not _restricted(lay):
        return []
    ops = []
    flags_base = su.MS_BIND | su.MS_REMOUNT | su.MS_NOSUID | su.MS_NODEV
    binds = []
    for path in sorted(set(lay.writable)):
        if path in ("/tmp", "/dev/shm", "/proc", "/sys") or path.startswith(("/tmp/", "/dev/", "/proc/", "/sys/")):
            continue                      # scratch tmpfs mounts: writable already; kernel interfaces: their own rules
        binds.append(path)
        kw = {"if_exists": True} if lay.implied and path != "/workspace" else \
            {"mkdir": 0o755, "owner": True, "record": lay.implied}
        ops.append(_mount(path, src=path, src_in_root=True, flags=su.MS_BIND | su.MS_REC,
                          what=f"files.writable {path}", **kw))
        exec_ok = not lay.noexec or _exec_ok(path, lay.exec_dirs)
        ops.append(_mount(path, flags=flags_base | (0 if exec_ok else su.MS_NOEXEC), if_exists=True,
                          what=f"files.writable {path} flags"))
    if lay.noexec:
        for d in lay.exec_dirs:
            inside = [m for m in binds + ["/tmp", "/dev/shm"] if d != m and d.startswith(m.rstrip("/") + "/")]
            if inside:
                ops.append(_mount(d, src=d, src_in_root=True, flags=su.MS_BIND | su.MS_REC, mkdir=0o755,
                                  owner=True, what=f"exec.allow_written_under {d}"))
                ops.append(_mount(d, flags=flags_base, what=f"exec.allow_written_under {d} flags"))
    return ops


def _tail_ops(p: Plan) -> list:
    """The image's layers read-only when the layout restricts what is writable, then pivot_root."""
    ops = []
    if _restricted(p.layout):
        ro = su.MS_BIND | su.MS_REMOUNT | su.MS_RDONLY | su.MS_NOSUID | su.MS_NODEV
        ops.append(_mount(p.root, flags=ro, host=True, what="read-only /"))
        for d in p.host_dirs:
            ops.append(_mount(d, flags=ro, what=f"read-only /{d}"))
    ops.append(_op(OP.PIVOT, target=p.root))
    return ops


def _settings(p: Plan) -> list:
    items = [(T.HOSTNAME, p.hostname), (T.UID, p.uid), (T.GID, p.gid), (T.HOLD, bool(p.hold)),
             (T.OOM_ADJ, WORKLOAD_OOM_SCORE_ADJ), (T.SELF_OOM_ADJ, INIT_OOM_SCORE_ADJ)]
    if p.seccomp:
        items.append((T.SECCOMP, p.seccomp))
        if p.seccomp_shared:
            items.append((T.SECCOMP_SHARED, True))
    for path, value, if_exists in p.sysctls:
        items.append((T.SYSCTL, [(T.PATH, path), (T.VALUE, value)] + ([(T.IF_EXISTS, b"")] if if_exists else [])))
    return items


def config_items(p: Plan) -> list:
    return _settings(p) + mount_ops(p)


# the encoded _inner_ops of each (layout, /tmp size, volumes) seen lately: ~50 operations that are
# the same for every sandbox of a kind (encoding them was ~0.3 ms of the agent's CPU a sandbox)
_INNER_CACHE: OrderedDict = OrderedDict()
_INNER_LOCK = threading.Lock()
_INNER_KEEP = 64


def config_message(p: Plan) -> bytes:
    """The CONFIG message, ip.encode(MSG.CONFIG, config_items(p)) byte for byte: a message is
    its items' encodings one after another, so the part every sandbox of a layout shares is
    encoded once and spliced between the sandbox's own."""
    lay = p.layout
    vols = _volume_kinds(p.volumes)
    key = (None if lay.writable is None else tuple(lay.writable), lay.implied, lay.noexec,
           tuple(lay.exec_dirs), p.tmp_size, vols)
    with _INNER_LOCK:
        inner = _INNER_CACHE.get(key)
        if inner is not None:
            _INNER_CACHE.move_to_end(key)
    if inner is None:
        inner = ip.encode_items(_inner_ops(lay, p.tmp_size, vols))
        with _INNER_LOCK:
            _INNER_CACHE[key] = inner
            while len(_INNER_CACHE) > _INNER_KEEP:
                _INNER_CACHE.popitem(last=False)
    return b"".join((ip.encode(ip.MSG.CONFIG, _settings(p) + _head_ops(p)), inner,
                     ip.encode_items(_tail_ops(p))))


# ---------------------------------------------------------------- seccomp

_SECCOMP_CACHE: OrderedDict = OrderedDict()
_SECCOMP_LOCK = threading.Lock()


def seccomp_program(policy) -> bytes:
    """The policy's seccomp program (struct sock_filter[]), compiled by
    libseccomp once per policy (content hash and mode) and handed to dsec-init
    as bytes; b"" in learn mode (nothing to filter)."""
    if policy is None or policy.mode == "learn":
        return b""
    key = (policy.hash, policy.mode)
    with _SECCOMP_LOCK:
        hit = _SECCOMP_CACHE.get(key)
        if hit is not None:
            _SECCOMP_CACHE.move_to_end(key)
            return hit
    from policies.compile import seccomp_filter
    from audit_schema.errors import ReportedError
    try:
        filt = seccomp_filter(policy)
    except ReportedError as e:
        raise DsecError(f"policy {policy.name}: {e.message}", EXIT_DSEC)
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", closefd=True) as f:
            filt.export_bpf(f)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(r)
    if not data or len(data) % 8:
        raise DsecError(f"policy {policy.name}: libseccomp exported {len(data)} bytes, not a BPF program", EXIT_DSEC)
    with _SECCOMP_LOCK:
        _SECCOMP_CACHE[key] = data
        while len(_SECCOMP_CACHE) > 256:
            _SECCOMP_CACHE.popitem(last=False)
    return data


# Every call dsec-init makes after its set-up (READY), and a step's child before its execve, as
# traced (strace -f of dsec-init through steps that run, fail to exec, make their workdir, time out,
# leave a background process, and a close), with what glibc may add (its allocator, the vDSO's
# fallback, signal returns) and capset (a step run as uid 0). tests/test_seccomp_shared.py runs
# those paths under a policy that kills on any other call.
INIT_SYSCALLS = ("access", "brk", "capset", "chdir", "chown", "clock_gettime", "clone", "close", "close_range",
                 "dup2", "execve", "exit", "exit_group", "fcntl", "kill", "mkdir", "mmap", "munmap", "newfstatat",
                 "openat", "pipe2", "poll", "prctl", "read", "recvmsg", "restart_syscall", "rt_sigaction",
                 "rt_sigprocmask", "rt_sigreturn", "sendmsg", "sendto", "setgroups", "setresgid", "setresuid",
                 "setsid", "wait4", "write")


def seccomp_shareable(policy) -> bool:
    """Can dsec-init load the policy's seccomp program into itself once, after its set-up, for
    every step's child to inherit (instead of each child loading it before its execve: ~0.1-0.2 ms
    a step)? Only when the program allows every call dsec-init and a step's child make from then
    on (INIT_SYSCALLS): a filter PID 1 runs under must never refuse it anything; the filter that
    reaches the workload is the same program either way."""
    if policy is None or policy.mode == "learn":
        return False
    from policies.compile import syscalls_allowed
    return syscalls_allowed(policy, INIT_SYSCALLS)


# ---------------------------------------------------------------- the init binary

INIT_SOURCES = ("dsec-init.c", "proto.h")
INIT_BUILD = os.path.join(ip.INIT_DIR, "build", "dsec-init")
_init_checked: str | None = None
_init_lock = threading.Lock()


def build_init(out: str = INIT_BUILD) -> str:
    """Compile dsec-init (static, -O2) from agent/sandbox/init; scripts/setup.sh calls this."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = ["cc", "-O2", "-Wall", "-Wextra", "-static", "-o", tmp, os.path.join(ip.INIT_DIR, "dsec-init.c")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise DsecError(f"cannot build dsec-init ({' '.join(cmd)}): {e.strerror}", EXIT_DSEC)
    if r.returncode != 0:
        raise DsecError(f"cannot build dsec-init: {(r.stderr.strip().splitlines() or ['cc failed'])[-1]}", EXIT_DSEC)
    os.rename(tmp, out)
    return out


def init_path() -> str:
    """The dsec-init binary ($DSEC_INIT, or agent/sandbox/init/build/dsec-init),
    checked once per process: present, executable, not older than its source."""
    global _init_checked
    if _init_checked:
        return _init_checked
    with _init_lock:
        if _init_checked:
            return _init_checked
        path = os.environ.get("DSEC_INIT") or INIT_BUILD
        try:
            st = os.stat(path)
        except OSError:
            raise DsecError(f"the sandbox init {path} is missing: run `make setup` (scripts/setup.sh builds "
                            f"agent/sandbox/init)", EXIT_DSEC) from None
        if not os.environ.get("DSEC_INIT"):
            newest = max(os.stat(os.path.join(ip.INIT_DIR, s)).st_mtime for s in INIT_SOURCES)
            if st.st_mtime < newest:
                raise DsecError(f"the sandbox init {path} is older than its source: run `make setup` "
                                f"(scripts/setup.sh rebuilds it)", EXIT_DSEC)
        if not os.access(path, os.X_OK):
            raise DsecError(f"the sandbox init {path} is not executable", EXIT_DSEC)
        _init_checked = path
        return path
