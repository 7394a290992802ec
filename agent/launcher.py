"""The sandbox launcher: one sandbox from spec to summary.

    spec = SandboxSpec(argv=["/bin/true"])
    result = launch(spec)          # blocks until the sandbox is gone
    result.exit_code, result.summary

Sequence: state dir (exclusive, locked for our lifetime) -> cgroups with limits
-> fork an intermediate child that joins the cgroups and unshares pid, mount,
ipc, uts and net namespaces, then forks the supervisor (PID 1 inside; see
agent/supervisor.py) and exits; we are the child subreaper, so the supervisor
becomes our child -> host side of the network -> "go" -> wait (timeout: SIGTERM
to everything inside, grace, then SIGKILL) -> tear down: kill what is left in
the cgroups, remove cgroups and veth, walk the upper layer for the change
manifest, remove the state dir unless --keep.

Hooks let the audit pipeline watch the sandbox: `on_cgroup(sandbox_id,
cgroup_id)` runs before any sandbox process exists; `on_exit(summary)` after
the sandbox is gone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import select
import signal
import sys
import time

from agent import cgroups, rootfs
from agent import sysutil as su
from agent.errors import DsecError, EXIT_DSEC, EXIT_NOEXEC, EXIT_NOTFOUND, EXIT_TIMEOUT
# imported before any fork: a child must not import (another thread may hold the import lock)
from agent.supervisor import supervisor_main

SANDBOX_DIR = os.path.join(rootfs.STATE_ROOT, "sandboxes")
KEPT_DIR = os.path.join(rootfs.STATE_ROOT, "kept")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


class SandboxSpec:
    """What to run and how (plain class: dataclasses would cost `dsec run` ~6 ms of imports)."""

    def __init__(self, argv, sandbox_id=None, cpus=None, memory=1 << 30, pids=1024, timeout=None,
                 grace=3.0, rootfs=None, network="none", env=None, workdir="/workspace",
                 user="sandbox", keep=False, tmp_size=None, policy=None):
        self.argv: list[str] = list(argv)
        self.sandbox_id: str | None = sandbox_id
        self.cpus: float | None = cpus
        self.memory: int | None = memory
        self.pids: int | None = pids
        self.timeout: float | None = timeout
        self.grace: float = grace
        self.rootfs: str | None = rootfs
        self.network: str = network
        self.env: dict[str, str] = dict(env or {})
        self.workdir: str = workdir
        self.user: str = user
        self.keep: bool = keep
        self.tmp_size: int | None = tmp_size
        self.policy = policy              # policies.model.Policy or None (no filter, all writable)


class Result:
    def __init__(self, exit_code: int, summary: dict):
        self.exit_code = exit_code     # what `dsec run` returns
        self.summary = summary


def new_sandbox_id() -> str:
    return "sbx-" + os.urandom(6).hex()


def validate_id(sid: str) -> str:
    if not ID_RE.match(sid):
        raise DsecError(f"invalid sandbox id {sid!r}: use 1-63 of [A-Za-z0-9_.-], starting alphanumeric", EXIT_DSEC)
    return sid


def preflight():
    if os.geteuid() != 0:
        raise DsecError("must run as root (sandboxes need namespaces, cgroups and mounts)", EXIT_DSEC)
    for ns in ("pid", "mnt", "ipc", "uts", "net"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            raise DsecError(f"kernel lacks {ns} namespaces (/proc/self/ns/{ns} missing)", EXIT_DSEC)
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                raise DsecError("kernel lacks overlayfs (not in /proc/filesystems)", EXIT_DSEC)
    except OSError as e:
        raise DsecError(f"cannot read /proc/filesystems: {e.strerror}", EXIT_DSEC)


def _passwd_lookup(lower: str, user: str) -> tuple[int, int, str]:
    """Resolve NAME | UID | UID:GID against the sandbox's own /etc/passwd."""
    uid = gid = None
    name = user
    home = "/"
    if re.match(r"^\d+(:\d+)?$", user):
        u, _, g = user.partition(":")
        uid, gid = int(u), (int(g) if g else None)
    entries = []
    try:
        with open(os.path.join(lower, "etc/passwd"), errors="surrogateescape") as f:
            for line in f:
                p = line.rstrip("\n").split(":")
                if len(p) >= 7 and p[2].isdigit() and p[3].isdigit():
                    entries.append((p[0], int(p[2]), int(p[3]), p[5]))
    except OSError:
        pass
    for n, u, g, h in entries:
        if (uid is None and n == user) or (uid is not None and u == uid):
            name, home = n, h
            uid = u if uid is None else uid
            gid = g if gid is None else gid
            break
    if uid is None:
        raise DsecError(f"--user {user}: no such user in the sandbox's /etc/passwd", EXIT_DSEC)
    if gid is None:
        gid = uid
    if uid > 0xFFFFFFFE or gid > 0xFFFFFFFE:
        raise DsecError(f"--user {user}: uid/gid out of range", EXIT_DSEC)
    return uid, gid, home if uid != 0 or home != "/" else "/root"


def _owner_start_time() -> str:
    with open("/proc/self/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


class _Sandbox:
    """Explicit state of one launch, so teardown knows exactly what exists."""

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.sid = spec.sandbox_id
        self.dir = os.path.join(SANDBOX_DIR, self.sid)
        self.lock_fd = -1
        self.cg: cgroups.SandboxCgroup | None = None
        self.sup_pid = 0
        self.pidfd = -1
        self.ctl_w = -1
        self.status_r = -1
        self.net = None
        self.messages: list[dict] = []
        self.created_mountpoints: list[str] = []
        self.layers: list[tuple[str, str, str]] = []


def launch(spec: SandboxSpec, on_cgroup=None, on_exit=None, stdio=None, on_started=None, on_go=None,
           on_workload_exit=None) -> Result:
    preflight()
    spec.sandbox_id = validate_id(spec.sandbox_id or new_sandbox_id())
    if not spec.argv:
        raise DsecError("no command given", EXIT_DSEC)
    if spec.network not in ("none", "egress"):
        raise DsecError(f"--network {spec.network}: expected none or egress", EXIT_DSEC)
    layout = cgroups.detect()
    if spec.rootfs:
        rf = os.path.abspath(spec.rootfs)
        if not os.path.isdir(rf):
            raise DsecError(f"--rootfs {spec.rootfs}: no such directory", EXIT_DSEC)
        if any(c in rf for c in ",:\\"):
            raise DsecError(f"--rootfs {spec.rootfs}: path must not contain ',', ':' or '\\'", EXIT_DSEC)
        lower, host_dirs = rf, []
    else:
        lower, host_dirs = rootfs.ensure_base()
    uid, gid, home = _passwd_lookup(lower, spec.user)

    sb = _Sandbox(spec)
    t_start = time.time()
    os.makedirs(SANDBOX_DIR, exist_ok=True)
    try:
        os.mkdir(sb.dir, 0o700)
    except FileExistsError:
        raise DsecError(f"sandbox id {sb.sid} is already in use (state dir {sb.dir} exists; `dsec gc` removes stale ones)", EXIT_DSEC)
    try:
        hooks = {"on_cgroup": on_cgroup, "on_exit": on_exit, "on_started": on_started, "on_go": on_go,
                 "on_workload_exit": on_workload_exit}
        return _launch(sb, layout, lower, host_dirs, uid, gid, home, hooks, stdio, t_start)
    finally:
        _teardown_leftovers(sb)


def _launch(sb, layout, lower, host_dirs, uid, gid, home, hooks, stdio, t_start):
    spec = sb.spec
    sb.lock_fd = os.open(os.path.join(sb.dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(sb.lock_fd, fcntl.LOCK_EX)
    with open(os.path.join(sb.dir, "state.json"), "w") as f:
        json.dump({"sandbox_id": sb.sid, "owner_pid": os.getpid(), "owner_start": _owner_start_time(),
                   "created": t_start, "argv": [os.fsencode(a).decode("utf-8", "replace") for a in spec.argv],
                   "network": spec.network}, f)
    sb.cg = cgroups.SandboxCgroup(layout, sb.sid)
    sb.cg.create(spec.cpus, spec.memory, spec.pids)
    cgroup_id = sb.cg.cgroup_id
    if hooks["on_cgroup"]:
        hooks["on_cgroup"](sb.sid, cgroup_id)

    env = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "HOSTNAME": sb.sid,
           "USER": spec.user if not spec.user[0].isdigit() else str(uid)}
    env.update(spec.env)
    upper, work = os.path.join(sb.dir, "upper"), os.path.join(sb.dir, "work")
    root = os.path.join(sb.dir, "root")
    os.mkdir(root)
    os.mkdir(upper)
    os.mkdir(work)
    sb.layers = [("/", os.path.join(upper, "_root"), lower)] + \
        [("/" + d, os.path.join(upper, d), "/" + d) for d in host_dirs]
    cfg = {"root": root, "upper": upper, "work": work, "lower": lower, "host_dirs": host_dirs,
           "hostname": sb.sid, "argv": spec.argv, "env": env, "workdir": spec.workdir,
           "uid": uid, "gid": gid, "tmp_size": spec.tmp_size or spec.memory or (512 << 20),
           "seccomp": None, "writable": None, "hold_after_exit": bool(hooks["on_workload_exit"])}
    if spec.policy is not None:
        from policies.compile import seccomp_filter, writable_paths
        try:
            cfg["seccomp"] = seccomp_filter(spec.policy)   # built here, loaded by the workload right before execve
        except DsecError as e:
            raise DsecError(f"policy {spec.policy.name}: {e.message}", EXIT_DSEC)
        if spec.policy.mode == "enforce":
            cfg["writable"] = writable_paths(spec.policy)

    stdio = stdio or _default_stdio()
    ctl_r, sb.ctl_w = os.pipe2(os.O_CLOEXEC)
    sb.status_r, status_w = os.pipe2(os.O_CLOEXEC)
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
    su.prctl(su.PR_SET_CHILD_SUBREAPER, 1)
    sys.stdout.flush()
    sys.stderr.flush()
    mid = os.fork()
    if mid == 0:  # intermediate: join cgroups, new namespaces, fork PID 1, exit
        code = 125
        try:
            os.close(sb.lock_fd)
            for fd, target in zip(stdio["child"], (0, 1, 2)):
                if fd != target:
                    os.dup2(fd, target)
            sb.cg.join(0)
            su.unshare(su.CLONE_NEWPID | su.CLONE_NEWNS | su.CLONE_NEWIPC | su.CLONE_NEWUTS | su.CLONE_NEWNET)
            pid = os.fork()
            if pid == 0:
                supervisor_main(cfg, ctl_r, status_w)   # never returns
            os.write(pid_w, f"{pid}\n".encode())
            code = 0
        except OSError as e:
            os.write(pid_w, f"error {e.strerror or e}\n".encode())
        finally:
            os._exit(code)
    for fd in (ctl_r, status_w, pid_w):
        os.close(fd)
    for fd in stdio["close_after_fork"]:
        os.close(fd)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = os.read(pid_r, 256)
        if not chunk:
            break
        reply += chunk
    os.close(pid_r)
    os.waitpid(mid, 0)
    text = reply.decode(errors="replace").strip()
    if not text.isdigit():
        raise DsecError(f"cannot create sandbox namespaces: {text.removeprefix('error ') or 'launcher child died'}", EXIT_DSEC)
    sb.sup_pid = int(text)
    sb.pidfd = os.pidfd_open(sb.sup_pid)
    if hooks["on_started"]:
        hooks["on_started"](sb.sid, sb.sup_pid)
    with open(os.path.join(sb.dir, "state.json"), "r+") as f:
        st = json.load(f)
        st["supervisor_pid"] = sb.sup_pid
        f.seek(0)
        json.dump(st, f)
        f.truncate()

    ready = _wait_message(sb, ("ready",))
    sb.created_mountpoints = ready.get("created", [])
    net_cfg = None
    if spec.network == "egress":
        from agent import netns
        sb.net = netns.setup_egress(sb.sid, sb.sup_pid)
        net_cfg = sb.net
    if hooks["on_go"]:
        hooks["on_go"](sb.sid)
    os.write(sb.ctl_w, (json.dumps({"cmd": "go", "net": net_cfg}) + "\n").encode())
    t_go = time.monotonic()
    final, timed_out = _wait_exit(sb, stdio["relay"], t_go, hooks["on_workload_exit"])
    wall_ms = int((time.monotonic() - t_go) * 1000)

    oom = sb.cg.oom_kills() > 0
    peak = sb.cg.memory_peak()
    summary = {"sandbox_id": sb.sid, "node": os.uname().nodename, "argv": spec.argv,
               "exit_code": None, "signal": None, "timed_out": timed_out, "oom_killed": oom,
               "wall_ms": wall_ms, "cpu_ms": final.get("cpu_ms", 0),
               # peak of the sandbox's memory cgroup: the honest figure for a whole sandbox
               # (per-process ru_maxrss would count the forked supervisor's image).
               "max_rss_bytes": peak,
               "cgroup_id": cgroup_id, "started_at": t_start, "error": None}
    if final.get("ev") == "error":
        summary["error"] = final["msg"]
        code = EXIT_DSEC
    elif final.get("exec_errno") is not None:
        e = final["exec_errno"]
        summary["error"] = f"{final.get('exec_stage')}: {final.get('exec_msg')}"
        if final.get("exec_stage") == "exec":
            code = EXIT_NOTFOUND if e == errno.ENOENT else EXIT_NOEXEC
            summary["exit_code"] = code
        else:
            code = EXIT_DSEC
    elif final.get("status") is not None:
        st = final["status"]
        if os.WIFSIGNALED(st):
            summary["signal"] = os.WTERMSIG(st)
            code = 128 + summary["signal"]
        else:
            summary["exit_code"] = os.WEXITSTATUS(st)
            code = summary["exit_code"]
    else:
        # supervisor killed before reporting (timeout SIGKILL, OOM of PID 1, ...)
        summary["signal"] = signal.SIGKILL
        code = 128 + signal.SIGKILL
    if timed_out:
        code = EXIT_TIMEOUT

    _stop_processes(sb)
    ch, total = rootfs.changes(sb.layers)
    created = set(sb.created_mountpoints)
    summary["changes"] = [c for c in ch if c["path"] not in created]
    summary["changes_total"] = total - (len(ch) - len(summary["changes"]))
    summary["changes_truncated"] = total > len(ch)
    if spec.keep:
        import shutil
        os.makedirs(KEPT_DIR, exist_ok=True)
        dest = os.path.join(KEPT_DIR, sb.sid)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(os.path.join(sb.dir, "upper"), dest)
        summary["kept_upper"] = dest
    if hooks["on_exit"]:
        hooks["on_exit"](summary)
    return Result(code, summary)


def _default_stdio() -> dict:
    """Wire the sandbox's stdin/stdout/stderr.

    A terminal is never handed to untrusted code (TIOCSTI and friends): stdin
    becomes /dev/null and output is relayed through pipes. Files and pipes are
    passed through as they are."""
    child, relay, close_after = [], {}, []
    for fd in (0, 1, 2):
        try:
            tty = os.isatty(fd)
            os.fstat(fd)
            valid = True
        except OSError:
            tty, valid = False, False
        if not valid:
            n = os.open(os.devnull, os.O_RDWR)
            child.append(n)
            close_after.append(n)
        elif tty and fd == 0:
            n = os.open(os.devnull, os.O_RDONLY)
            child.append(n)
            close_after.append(n)
        elif tty:
            r, w = os.pipe()
            child.append(w)
            close_after.append(w)
            relay[r] = fd
        else:
            child.append(fd)
    return {"child": child, "relay": relay, "close_after_fork": close_after}


def _read_messages(sb) -> bool:
    """Read status lines; returns False on EOF."""
    try:
        data = os.read(sb.status_r, 65536)
    except BlockingIOError:
        return True
    if not data:
        return False
    sb._buf = getattr(sb, "_buf", b"") + data
    while b"\n" in sb._buf:
        line, sb._buf = sb._buf.split(b"\n", 1)
        try:
            sb.messages.append(json.loads(line))
        except ValueError:
            pass
    return True


def _wait_message(sb, kinds, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for m in sb.messages:
            if m.get("ev") == "error":
                raise DsecError(f"sandbox setup failed: {m['msg']}", EXIT_DSEC)
            if m.get("ev") in kinds:
                sb.messages.remove(m)
                return m
        left = deadline - time.monotonic()
        if left <= 0:
            raise DsecError(f"sandbox supervisor did not answer within {timeout:.0f}s", EXIT_DSEC)
        r, _, _ = select.select([sb.status_r, sb.pidfd], [], [], left)
        if sb.status_r in r:
            if not _read_messages(sb):
                raise DsecError("sandbox supervisor died during setup", EXIT_DSEC)
        elif sb.pidfd in r and not _read_messages(sb):
            raise DsecError("sandbox supervisor died during setup", EXIT_DSEC)


def _wait_exit(sb, relay: dict, t_go: float, on_workload_exit=None) -> tuple[dict, bool]:
    spec = sb.spec
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_wake = signal.set_wakeup_fd(wake_w)
    got = []
    handlers = {}
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        handlers[s] = signal.signal(s, lambda sig, _f: got.append(sig))
    deadline = t_go + spec.timeout if spec.timeout else None
    kill_at = None
    timed_out = False
    exited = False
    status_open = True
    try:
        while not exited or status_open:
            fds = [wake_r] + list(relay)
            if not exited:
                fds.append(sb.pidfd)
            if status_open:
                fds.append(sb.status_r)
            now = time.monotonic()
            waits = [t for t in (deadline, kill_at) if t is not None]
            tmo = max(0.0, min(waits) - now) if waits and not exited else (1.0 if exited else None)
            try:
                r, _, _ = select.select(fds, [], [], tmo)
            except InterruptedError:
                r = []
            now = time.monotonic()
            if wake_r in r:
                try:
                    os.read(wake_r, 1024)
                except BlockingIOError:
                    pass
            while got:
                sig = got.pop(0)
                try:
                    os.kill(sb.sup_pid, sig)
                except ProcessLookupError:
                    pass
                if kill_at is None:
                    kill_at = now + spec.grace
            for rfd in list(relay):
                if rfd in r:
                    data = os.read(rfd, 65536)
                    if not data:
                        os.close(rfd)
                        del relay[rfd]
                    else:
                        _write_all(relay[rfd], data)
            if sb.status_r in r:
                status_open = _read_messages(sb)
                if on_workload_exit and any(m.get("ev") == "exit" for m in sb.messages):
                    # every process but the supervisor is gone; it holds the
                    # sandbox's namespaces until we release it
                    try:
                        on_workload_exit(sb.sid)
                    finally:
                        on_workload_exit = None
                        try:
                            os.write(sb.ctl_w, b'{"cmd": "release"}\n')
                        except OSError:
                            pass
            if sb.pidfd in r and not exited:
                os.waitpid(sb.sup_pid, 0)
                exited = True
            if exited and not r:
                break   # status pipe should have closed with the supervisor; don't hang
            if not exited and deadline is not None and now >= deadline and not timed_out:
                timed_out = True
                try:
                    os.write(sb.ctl_w, b'{"cmd": "terminate"}\n')
                except OSError:
                    pass
                kill_at = now + spec.grace
            if not exited and kill_at is not None and now >= kill_at:
                sb.cg.kill_all(timeout=0.5)
                try:
                    os.kill(sb.sup_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                kill_at = None
        for rfd in list(relay):   # drain what is left of the output
            while True:
                try:
                    data = os.read(rfd, 65536)
                except OSError:
                    break
                if not data:
                    break
                _write_all(relay[rfd], data)
            os.close(rfd)
    finally:
        signal.set_wakeup_fd(old_wake)
        for s, h in handlers.items():
            signal.signal(s, h)
        os.close(wake_r)
        os.close(wake_w)
    final = next((m for m in sb.messages if m.get("ev") in ("exit", "error")), {})
    return final, timed_out


def _write_all(fd, data):
    while data:
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        except OSError:
            return
        data = data[n:]


def _stop_processes(sb):
    if sb.cg:
        sb.cg.kill_all()


def _teardown_leftovers(sb):
    """Remove everything the sandbox had on the host, whatever state we are in."""
    if sb.sup_pid:
        try:
            os.kill(sb.sup_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(sb.sup_pid, 0)
        except ChildProcessError:
            pass
    for fd in (sb.pidfd, sb.ctl_w, sb.status_r):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    left = []
    if sb.cg:
        left = sb.cg.remove()
    if sb.net or sb.spec.network == "egress":
        from agent import netns
        netns.teardown(sb.sid)
    if not left:
        import shutil
        shutil.rmtree(sb.dir, ignore_errors=True)
    if sb.lock_fd >= 0:
        os.close(sb.lock_fd)
    if left:
        sys.stderr.write(f"dsec: warning: could not remove cgroups {left}; run `dsec gc`\n")
