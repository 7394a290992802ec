"""The sandbox launcher.

    sb = Sandbox(SandboxSpec(argv=[])).start()          # ready, nothing running yet
    r = sb.exec(["python3", "step1.py"], stdout=fd)      # one step; blocks until it exits
    r = sb.exec(["python3", "step2.py"], timeout=30)     # files and background processes persist
    summary = sb.close()                                 # kill what is left, tear down, manifest

    result = launch(SandboxSpec(argv=["/bin/true"]))      # one-shot: start + exec + close

start(): state dir (exclusive, locked for our lifetime, 0700) -> a host uid of
its own for the sandbox's user (agent/sandbox/uids.py) -> cgroups with limits
-> dsec-init (agent/sandbox/init/dsec-init.c), an exec'd minimal PID 1 that
never held our memory, started by clone3 in new pid, mount, ipc, uts and net
namespaces and in the sandbox's cgroup2 directory; it joins the v1 cgroups
itself (agent/sandbox/spawn.py; the fallback: posix_spawn, then we move it)
-> HELLO -> the sensors watch the cgroup (on_started) -> CONFIG (the
mount plan, credentials, sysctls and the policy's seccomp program, all
computed here: agent/sandbox/plan.py) -> READY -> the host side of the network
-> GO. The control channel is one SOCK_SEQPACKET socket (protocol:
agent/sandbox/init/proto.h).
exec(): the step's stdin/stdout/stderr fds go to dsec-init (SCM_RIGHTS),
which forks and execs; on timeout the step's process group gets SIGTERM, the
grace period, then SIGKILL.
close(): everything left is killed; the cgroups, veth and state dir removed;
the upper layer walked for the change manifest (kept with --keep, 0700,
setuid/setgid bits and file capabilities stripped).

The boundary it holds (docs/launcher.md has the list): a policy whose rules
only eBPF enforces (egress, exec) runs with the enforcement sensor or not at
all; under an exec allowlist every writable layer is noexec and the image is
read-only; IPv6 is off inside an egress sandbox unless the policy allows IPv6
egress; a custom rootfs is checked (rootfs.check_rootfs) and read only with
RESOLVE_IN_ROOT and O_NONBLOCK.

Hooks let the audit pipeline watch: on_cgroup(sandbox_id, cgroup_id) before
any sandbox process exists; on_started(sandbox_id, init_pid) once dsec-init is
in the cgroups and has said HELLO (its own start done: born inside the cgroup,
its exec would be recorded by a watch begun earlier), before it does anything
of the sandbox's (it returns the rule kinds the eBPF
sensor enforces for the sandbox); on_step(sandbox_id, step) before each step
starts, on_step_info(sandbox_id, step, {argv, env, workdir, timeout, stdin, ts_ns})
once dsec-init has been sent the step (ts_ns: the time just before), on_step_end(sandbox_id, StepResult) when it has ended;
on_workload_exit(sandbox_id) once every process but dsec-init is gone (the
sandbox's mount namespace is held until it returns); on_exit(summary) after
teardown.

Why this file is long: start, exec and close share one state (the control
channel, the cgroups, the watch, the network) and one order of teardown; what
stands alone already lives beside it (spawn, plan, cgroups, netns, rootfs,
volumes, snapshots, trash).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import sys
import threading
import time

from agent.sandbox import cgroups
from agent.sandbox import initproto as ip
from agent.sandbox import plan as plans
from agent.sandbox import rootfs
from agent.sandbox import spawn
from agent.sandbox import sysutil as su
from agent.sandbox import trash
from agent.sandbox import trees
from agent.sandbox import uids
from agent.sandbox.status import STATUS, StatusLoop
from agent.sandbox.stdio import default_stdio, forward_signals, relay, restore_signals
from agent.errors import DsecError, EXIT_DSEC, EXIT_USAGE, EXIT_TIMEOUT, ReportedError
from agent.sandbox.stepresult import StepResult, _finish_step
from agent.sandbox.spec import ID_RE, SandboxSpec, _volume, new_sandbox_id, validate_id  # noqa: F401 (re-exported)

SANDBOX_DIR = os.path.join(rootfs.STATE_ROOT, "sandboxes")
KEPT_DIR = os.path.join(rootfs.STATE_ROOT, "kept")
NODE_NAME: str | None = None     # the node agent's host.node_name (default: the hostname)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
DEFAULT_USER = "sandbox"
NS_FLAGS = su.CLONE_NEWPID | su.CLONE_NEWNS | su.CLONE_NEWIPC | su.CLONE_NEWUTS | su.CLONE_NEWNET
CTL_BUFFER = 4 << 20
MSG, T = ip.MSG, ip.T


class Result:
    def __init__(self, exit_code: int, summary: dict):
        self.exit_code = exit_code     # what `dsec run` returns
        self.summary = summary


_DEVNULL = -1


def _devnull() -> int:
    """One /dev/null descriptor for the steps given no stdin (or output) of their own, opened
    once (dsec-init receives its own copy with each step)."""
    global _DEVNULL
    if _DEVNULL < 0:
        _DEVNULL = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    return _DEVNULL


_preflight_ok = False
_private_ok: set = set()
CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)   # what file times are stamped from


def _private_dir(path: str, spread: bool = False):
    """A directory of dsec's state that only root may enter (0700), made so once per process;
    spread: its subdirectories spread over the file system (rootfs.spread_subdirs)."""
    if path in _private_ok:
        return
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)
    if spread:
        rootfs.spread_subdirs(path)
    _private_ok.add(path)


def preflight():
    global _preflight_ok
    if os.geteuid() != 0:
        raise DsecError("must run as root (sandboxes need namespaces, cgroups and mounts)", EXIT_DSEC)
    if _preflight_ok:
        return
    for ns in ("pid", "mnt", "ipc", "uts", "net"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            raise DsecError(f"kernel lacks {ns} namespaces (/proc/self/ns/{ns} missing)", EXIT_DSEC)
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                raise DsecError("kernel lacks overlayfs (not in /proc/filesystems)", EXIT_DSEC)
    except OSError as e:
        raise DsecError(f"cannot read /proc/filesystems: {e.strerror}", EXIT_DSEC)
    try:
        os.close(su.openat2(-100, "/", os.O_PATH, su.RESOLVE_IN_ROOT))
    except OSError as e:
        raise DsecError(f"kernel lacks openat2 (Linux 5.6+), which dsec needs to resolve paths inside a rootfs: "
                        f"{e.strerror}", EXIT_DSEC)
    plans.init_path()
    _preflight_ok = True


def _user_of(layers: list[str], user: str, lease) -> tuple[int, int, str]:
    """NAME | UID | UID:GID against the sandbox's own /etc/passwd (read inside
    the rootfs, never outside it); the default user gets the leased uid."""
    if user == DEFAULT_USER and lease is not None:
        return lease.uid, lease.gid, "/workspace"
    uid = gid = None
    home = "/"
    if re.match(r"^\d+(:\d+)?$", user):
        u, _, g = user.partition(":")
        uid, gid = int(u), (int(g) if g else None)
    entries = rootfs.parse_passwd(rootfs.read_in_layers(layers, "etc/passwd"))
    for n, u, g, h in entries:
        if (uid is None and n == user) or (uid is not None and u == uid):
            home = h
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
    """This process's start time (clock ticks after boot): read once, it does not change."""
    global _own_start
    if _own_start is None:
        with open("/proc/self/stat") as f:
            _own_start = f.read().rsplit(")", 1)[1].split()[19]
    return _own_start


_own_start: str | None = None


def ipv6_allowed(policy) -> bool:
    """Does the policy allow IPv6 egress (then the sandbox keeps IPv6; otherwise
    an egress sandbox has it disabled: nothing reaches the host's link-local)?"""
    if policy is None or policy.spec.egress is None:
        return False
    e = policy.spec.egress
    if e.default == "allow":
        return True
    return any((r.cidr and ":" in r.cidr) or r.host for r in e.allow) or any(":" in a for a in e.dns)


class Sandbox:
    """One sandbox, alive from start() to close(); explicit state so teardown
    knows exactly what exists. Thread-safe: steps may run concurrently."""

    def __init__(self, spec: SandboxSpec, on_cgroup=None, on_started=None, on_step=None,
                 on_workload_exit=None, on_exit=None, on_step_info=None, on_step_end=None, on_gone=None,
                 on_ready=None):
        self.spec = spec
        self.hooks = {"on_cgroup": on_cgroup, "on_started": on_started, "on_step": on_step,
                      # dsec-init is READY: its mounts made and its root the sandbox's (pivot_root),
                      # before GO and anything of the workload (the sensors open that root then)
                      "on_ready": on_ready,
                      "on_workload_exit": on_workload_exit, "on_exit": on_exit,
                      "on_step_info": on_step_info, "on_step_end": on_step_end,
                      # close(): its init reaped and its cgroups found empty (nothing of the sandbox can
                      # run again), before the manifest and the teardown; what it starts may run
                      # alongside them and must be done by on_exit (the node agent stops the sensors'
                      # watch there: agent/node/daemon.py _hooks)
                      "on_gone": on_gone}
        self.sid = None
        self.dir = None
        self.lock_fd = -1
        self.lease = None
        self.teardown_later = False      # the node agent's: an egress host side off the close (trash.py)
        self.teardown_deferred = False           # the rest of the teardown is queued (trash.later), not yet done
        self.teardown_error: str | None = None   # what the teardown could not remove (after_teardown's fn reads it)
        self._state: dict = {}           # what state.json says (written, never read back)
        self.uid = self.gid = None
        self.cg: cgroups.SandboxCgroup | None = None
        self.cgroup_id = 0
        self.sup_pid = 0                  # dsec-init, PID 1 inside (host pid)
        self.pidfd = -1
        self.ctl: socket.socket | None = None
        self.net = None
        self.created_mountpoints: list[str] = []
        self.generated: dict[str, str | None] = {}   # sandbox path -> sha256 of what dsec wrote there
        self.seeded: dict[str, tuple] = {}   # upper path -> (inode, ctime_ns, size, sha256) as dsec wrote it
        self.sealed_ns: int | None = None    # the coarse wall clock as the first step was sent
        self.layers: list[tuple[str, str, str]] = []
        self.env: dict = {}
        self.started_at = 0.0
        self.state = "new"              # new -> starting -> running -> closing -> closed
        self.steps: dict[int, StepResult] = {}
        self.next_step = 1
        self.closed_msg: dict | None = None
        self.supervisor_dead = False      # dsec-init has exited
        self._emptied = False             # close() found its cgroups empty (teardown need not kill again)
        self.setup_error: str | None = None
        self._ready: dict | None = None
        self._cond = threading.Condition()
        self._reader: StatusLoop | None = None     # reads dsec-init's status (one loop, every sandbox)
        self._send_lock = threading.Lock()
        self.summary: dict | None = None

    # -- start ------------------------------------------------------------------
    def start(self) -> "Sandbox":
        spec = self.spec
        preflight()
        self.sid = spec.sandbox_id = validate_id(spec.sandbox_id or new_sandbox_id())
        if spec.network not in ("none", "egress"):
            raise DsecError(f"--network {spec.network}: expected none or egress", EXIT_DSEC)
        layout = cgroups.detect()
        if spec.layers:                     # image layers, top first: one overlay over all of them
            lowers, host_dirs = [], []
            for lw in spec.layers:
                if not os.path.isdir(lw) or any(c in lw for c in ",:\\"):
                    raise DsecError(f"lower layer {lw}: not a directory (or contains ',', ':', '\\')", EXIT_DSEC)
                lowers.append(os.path.realpath(lw))
        elif spec.rootfs:
            try:
                lowers, host_dirs = [rootfs.check_rootfs(spec.rootfs, spec.rootfs_roots)], []
            except ValueError as e:
                raise DsecError(f"--rootfs {spec.rootfs}: {e}", EXIT_DSEC) from None
        else:
            base, host_dirs = rootfs.ensure_base()
            lowers = [base]
        volumes = [_volume(v) for v in spec.volumes]
        for v in volumes:
            src, tgt = v.get("source") or "", v.get("target") or ""
            if not os.path.exists(src) or not tgt.startswith("/"):
                raise DsecError(f"volume {src!r} -> {tgt!r}: the source must exist on the host and the target "
                                f"be an absolute path", EXIT_DSEC)
        self.started_at = time.time()
        _private_dir(SANDBOX_DIR, spread=True)
        self.dir = os.path.join(SANDBOX_DIR, self.sid)
        from agent.sandbox.gclock import start_guard
        trash.wait_for(self.sid)         # a closed sandbox of this id: its teardown's end
        self._gc_guard = start_guard()   # gc waits until this sandbox is visibly live (issue 13)
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            self._gc_guard.release()
            raise DsecError(f"sandbox id {self.sid} is already in use (state dir {self.dir} exists; "
                            f"`dsec gc` removes stale ones)", EXIT_DSEC)
        self.state = "starting"
        try:
            if spec.user == DEFAULT_USER:
                self.lease = uids.allocate(self.sid)
            self.uid, self.gid, home = _user_of(lowers, spec.user, self.lease)
            if not spec.allow_root and (self.uid == 0 or self.gid == 0):
                raise DsecError(f"--user {spec.user}: uid/gid 0 inside the sandbox is not allowed for this caller",
                                EXIT_DSEC)
            self._start(layout, lowers, host_dirs, home)
        except BaseException:
            self._gc_guard.release()
            self._teardown()
            self.state = "closed"
            raise
        self.state = "running"
        return self

    def _start(self, layout, lowers, host_dirs, home):
        spec = self.spec
        from policies.compile import ebpf_concerns, mount_layout
        self.lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self._write_state({"sandbox_id": self.sid, "owner_pid": os.getpid(), "owner_start": _owner_start_time(),
                           "created": self.started_at, "network": spec.network, "uid": self.uid})
        self.cg = cgroups.SandboxCgroup(layout, self.sid)
        try:
            self.cg.create(spec.cpus, spec.memory, spec.pids)
        finally:
            self._gc_guard.release()        # locked state dir + cgroups: gc sees it live
        self.cgroup_id = self.cg.cgroup_id
        self._hook("on_cgroup", self.sid, self.cgroup_id)

        self.env = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "HOSTNAME": self.sid,
                    "USER": spec.user if not spec.user[0].isdigit() else str(self.uid)}
        self.env.update(spec.env)
        upper, work = os.path.join(self.dir, "upper"), os.path.join(self.dir, "work")
        root = os.path.join(self.dir, "root")
        for d in (root, upper, work):
            os.mkdir(d, 0o700 if d != root else 0o755)
        for d in ["_root"] + host_dirs:
            os.mkdir(os.path.join(upper, d))
            os.mkdir(os.path.join(work, d))
        self._seed_upper(os.path.join(upper, "_root"), lowers)
        reown = getattr(spec, "reown", None)
        if reown and self.lease is not None and (reown["uid"], reown["gid"]) != (self.uid, self.gid):
            from agent.sandbox.snapshots import reown_into
            self.generated.update(reown_into(os.path.join(upper, "_root"), reown["layers"], reown["uid"],
                                             reown["gid"], self.uid, self.gid))
        self.layers = [("/", os.path.join(upper, "_root"), ":".join(lowers))] + \
            [("/" + d, os.path.join(upper, d), "/" + d) for d in host_dirs]
        policy = spec.policy
        sysctls = []
        if spec.network == "egress" and not ipv6_allowed(policy):
            # before the veth arrives: it comes up without IPv6 (no link-local address to reach the host by)
            sysctls.append(("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1", True))
        lay = mount_layout(policy)
        if policy is not None and policy.mode == "enforce" and lay.writable:
            bad = rootfs.writable_conflicts(lay.writable, lowers[0], host_dirs)
            if bad:
                raise DsecError(f"policy {policy.name}: files.writable {bad[0][1]!r}: {bad[0][2]} "
                                f"(dsec policy check names every such entry)", EXIT_USAGE)
        if lay.noexec:
            # a memfd is a writable layer too: executable memfds refused (per pid namespace)
            sysctls.append(("/proc/sys/vm/memfd_noexec", "2", True))
        volumes = [_volume(v) for v in spec.volumes]

        ctl_parent, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sk in (ctl_parent,):
            for opt in (getattr(socket, "SO_SNDBUFFORCE", 32), getattr(socket, "SO_RCVBUFFORCE", 33)):
                try:
                    sk.setsockopt(socket.SOL_SOCKET, opt, CTL_BUFFER)
                except OSError:
                    pass
        self.ctl = ctl_parent
        try:      # born in its cgroups (clone3), or the fallback: joined by us after HELLO (spawn.py)
            self.sup_pid, self.pidfd, join_left = spawn.start_init(self.cg, plans.init_path(), ctl_parent,
                                                                  ctl_child.fileno(), NS_FLAGS)
        except OSError as e:
            raise DsecError(f"cannot start the sandbox init (namespaces, cgroups): {e.strerror or e}", EXIT_DSEC)
        finally:
            ctl_child.close()
        # its exec may still be under way when the spawn returns (~0.5 ms): the plan is built meanwhile
        cfg = plans.Plan(root=root, upper=upper, work=work, lowers=lowers, host_dirs=host_dirs,
                         hostname=self.sid, uid=self.uid, gid=self.gid,
                         tmp_size=spec.tmp_size or spec.memory or (512 << 20), layout=lay, volumes=volumes,
                         seccomp=plans.seccomp_program(policy), seccomp_shared=plans.seccomp_shareable(policy),
                         sysctls=sysctls,
                         hold=bool(self.hooks["on_workload_exit"]))
        config = plans.config_message(cfg)
        # nothing of the sandbox's until HELLO
        if why := ip.await_hello(self.ctl, 30.0):
            raise DsecError(f"sandbox {self.sid}: its init {why}", EXIT_DSEC)
        self._reader = STATUS.add(self)
        if join_left:
            try:
                self.cg.join(self.sup_pid)
            except OSError as e:
                raise DsecError(f"cannot move the sandbox init into its cgroups: {e.strerror}", EXIT_DSEC)
        # the sensors watch the cgroup from here (docs/launcher.md): init's own start is not in the
        # record, and nothing of the sandbox's has run (init waits for CONFIG)
        enforced = self._hook("on_started", self.sid, self.sup_pid)
        need = ebpf_concerns(policy)
        missing = [c for c in need if c not in set(enforced or ())]
        if missing:
            # one rule for every entry point: rules that live in eBPF are enforced by eBPF, or no sandbox
            raise DsecError(f"policy {policy.name} ({policy.mode}) has {' and '.join(missing)} rules, which only "
                            f"eBPF enforces, and this sandbox has no eBPF enforcement (audit off, or the eBPF "
                            f"programs could not load): refused", EXIT_DSEC)
        self._send(config)
        # for gc, while dsec-init mounts (it dies with our end of its socket: never unsupervised)
        self._write_state({"supervisor_pid": self.sup_pid})
        ready = self._wait_for(lambda: self._ready, 30.0, "did not become ready")
        self.created_mountpoints += ready.get("created", [])
        self._hook("on_ready", self.sid, self.sup_pid)
        if spec.network == "egress":
            from agent.sandbox import netns
            self.net = netns.setup_egress(self.sid, self.sup_pid, policy_egress=bool(
                policy is not None and policy.spec.egress is not None))
        self._send(ip.encode(MSG.GO))

    def _seed_upper(self, upper_root: str, lowers: list[str]):
        """The default user's passwd/group entries and /workspace, written into the root's
        upper layer before it is mounted (rootfs.seed_upper); not changes of the workload."""
        if self.lease is None:
            return
        created, generated, seeded = rootfs.seed_upper(upper_root, lowers, DEFAULT_USER, self.uid, self.gid)
        self.created_mountpoints += created
        self.generated.update(generated)
        self.seeded.update(seeded)

    def _write_state(self, update: dict):
        """state.json (for gc) replaced atomically; its content kept here, not read back."""
        path = os.path.join(self.dir, "state.json")
        st = self._state
        st.update(update)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(st).encode())
        finally:
            os.close(fd)
        os.rename(path + ".tmp", path)

    def _hook(self, name, *args):
        fn = self.hooks.get(name)
        if fn:
            return fn(*args)
        return None

    def _send(self, data: bytes, fds=()):
        with self._send_lock:
            if self.ctl is None:
                raise DsecError(f"sandbox {self.sid} is closed", EXIT_DSEC)
            try:
                socket.send_fds(self.ctl, [data], list(fds))
            except OSError as e:
                raise DsecError(f"sandbox {self.sid}: its init is gone ({e.strerror})", EXIT_DSEC)

    # -- the status reader -------------------------------------------------------
    def _status_readable(self) -> bool:
        """dsec-init's control socket is readable (StatusLoop): its message
        dispatched; False at EOF (init closed its end: it is exiting)."""
        try:
            data = self.ctl.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            self._dispatch(data)
            return True
        return False

    def _status_exited(self, ctl_open: bool) -> None:
        """dsec-init exited (its pidfd is readable): drain what it sent, reap it."""
        while ctl_open:
            try:
                data = self.ctl.recv(1 << 20, socket.MSG_DONTWAIT)
            except OSError:
                break
            if not data:
                break
            self._dispatch(data)
        try:
            os.waitpid(self.sup_pid, 0)
        except ChildProcessError:
            pass
        with self._cond:
            self.supervisor_dead = True
            self._cond.notify_all()
            waiting = [st.on_done for st in self.steps.values() if not st.done and st.on_done is not None]
        for fn in waiting:
            fn()

    def _dispatch(self, data: bytes):
        try:
            mtype, items = ip.decode(data)
        except ValueError:
            return
        f = ip.fields(items)
        done = None

        def one(tag, conv=ip.u64, default=None):
            v = f.get(tag)
            return conv(v[0]) if v else default

        with self._cond:
            if mtype == MSG.READY:
                self._ready = {"created": [ip.text(c) for c in f.get(T.CREATED, [])]}
            elif mtype == MSG.ERROR:
                self.setup_error = one(T.MSG, ip.text, "unknown error")
            elif mtype == MSG.STEP_EXIT:
                st = self.steps.get(one(T.STEP, default=0))
                if st and not st.done:
                    st.pid = one(T.PID, default=0)
                    m = {"status": one(T.STATUS, ip.i64), "cpu_ms": one(T.CPU_US, default=0) // 1000,
                         "max_rss_bytes": one(T.MAXRSS_KB, default=0) * 1024}
                    if T.EXEC_ERRNO in f:
                        m.update(exec_errno=one(T.EXEC_ERRNO), exec_stage=one(T.STAGE, ip.text, "setup"),
                                 exec_msg=one(T.MSG, ip.text, ""))
                    _finish_step(st, m)
                    done = st.on_done
            elif mtype == MSG.CLOSED:
                self.closed_msg = {"cpu_ms": one(T.CPU_US, default=0) // 1000,
                                   "max_rss_bytes": one(T.MAXRSS_KB, default=0) * 1024,
                                   "owner_gone": bool(one(T.OWNER_GONE, default=0))}
            self._cond.notify_all()
        if done is not None:
            done()

    def _wait_for(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                v = pred()
                if v:
                    return v
                if self.setup_error:
                    raise DsecError(f"sandbox setup failed: {self.setup_error}", EXIT_DSEC)
                if self.supervisor_dead:
                    raise DsecError(f"sandbox {self.sid}: its init died ({what})", EXIT_DSEC)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DsecError(f"sandbox {self.sid}: its init {what} within {timeout:.0f}s", EXIT_DSEC)
                self._cond.wait(min(left, 1.0))

    # -- steps ---------------------------------------------------------------------
    def exec(self, argv, *, env=None, workdir=None, stdin=None, stdout=None, stderr=None,
             timeout=None, grace=None, stdin_bytes: bytes | None = None) -> StepResult:
        """Run one step and wait for its main process to exit. stdin/stdout/stderr
        are fds (None = /dev/null), passed to dsec-init. On timeout: SIGTERM to
        the step's process group, `grace` seconds, SIGKILL."""
        st = self.exec_begin(argv, env=env, workdir=workdir, stdin=stdin, stdout=stdout, stderr=stderr,
                             timeout=timeout, grace=grace, stdin_bytes=stdin_bytes)
        self.exec_wait(st)
        return self.exec_end(st)

    def exec_wait(self, st: StepResult) -> None:
        """Block until the step sent by exec_begin is over (its timeout's signals sent)."""
        with self._cond:
            while (left := self._exec_tick(st)) is not None:
                self._cond.wait(left)

    def exec_begin(self, argv, *, env=None, workdir=None, stdin=None, stdout=None, stderr=None,
                   timeout=None, grace=None, stdin_bytes: bytes | None = None, on_done=None) -> StepResult:
        """exec() in three parts, for a caller that waits for the step on its own thread (the
        agent's step: no thread hand-off, agent/node/steps.py): send the step to dsec-init and
        return its StepResult; then exec_poll(st) until it returns None (it sends the timeout's
        signals), on_done() telling when to look (called from the status thread when the step
        ended or init died); then exec_end(st). The fds may be closed once this returns."""
        if not argv:
            raise DsecError("no command given", EXIT_DSEC)
        with self._cond:
            if self.state != "running":
                raise DsecError(f"sandbox {self.sid} is {self.state}", EXIT_DSEC)
            step = self.next_step
            self.next_step += 1
            st = self.steps[step] = StepResult(step)
            st.on_done = on_done
            if self.sealed_ns is None:      # before the first workload code runs: see _manifest
                self.sealed_ns = time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
        e = dict(self.env)
        if env:
            e.update(env)
        wd = workdir or self.spec.workdir
        self._hook("on_step", self.sid, step)
        items = [(T.STEP, step)] + [(T.ARG, a) for a in argv] + \
            [(T.ENV, f"{k}={v}") for k, v in e.items()] + [(T.WORKDIR, wd), (T.PATHVAR, e.get("PATH", ""))]
        msg = ip.encode(MSG.EXEC, items)
        st.oom_before = self.cg.oom_kills() if self.cg else 0
        st.started_ns = time.time_ns()
        st.sent_at = time.monotonic()
        fds = [stdin, stdout, stderr]
        while fds and fds[-1] is None:
            fds.pop()
        if None in fds:
            null = _devnull()
            fds = [null if fd is None else fd for fd in fds]
        try:
            self._send(msg, fds)
        finally:
            # what the step runs (the step_start record, stamped before the send): built while
            # dsec-init clones and execs the step, not before (it is only queued; the record's
            # order and time are as before; ~50 us of a step's latency on a busy node)
            self._hook("on_step_info", self.sid, step, {"argv": list(argv), "env": e, "workdir": wd,
                                                        "timeout": timeout, "stdin": stdin_bytes,
                                                        "ts_ns": st.started_ns})
        st.grace = self.spec.grace if grace is None else grace
        st.deadline = st.sent_at + timeout if timeout else None
        return st

    def exec_poll(self, st: StepResult) -> float | None:
        """None once the step is over (exec_end next); else the seconds until it is worth
        looking again (its timeout's SIGTERM, the grace's SIGKILL; at most 1 s)."""
        with self._cond:
            return self._exec_tick(st)

    def _exec_tick(self, st: StepResult) -> float | None:
        if st.done or self.supervisor_dead:
            return None
        now = time.monotonic()
        if st.deadline is not None and now >= st.deadline and not st.timed_out:
            st.timed_out = True
            st.kill_at = now + st.grace
            self._signal_step(st.step, signal.SIGTERM)
        if st.kill_at is not None and now >= st.kill_at:
            self._signal_step(st.step, signal.SIGKILL)
            st.kill_at = now + 1.0
        waits = [t for t in ((None if st.timed_out else st.deadline), st.kill_at) if t is not None]
        return min([1.0] + [max(0.0, t - now) for t in waits])

    def exec_end(self, st: StepResult) -> StepResult:
        """The step is over (exec_poll said so): its result, its on_step_end hook."""
        with self._cond:
            if not st.done:      # init died under the step (killed from outside)
                _finish_step(st, {"status": signal.SIGKILL})
        st.wall_ms = int((time.monotonic() - st.sent_at) * 1000)
        if self.cg:
            st.oom_kills = max(0, self.cg.oom_kills() - st.oom_before)
        if st.signal == signal.SIGKILL and st.oom_kills:
            st.oom_killed = True
            st.error = st.error or "out of memory: killed by the sandbox's memory limit"
        if st.timed_out:
            st.code = EXIT_TIMEOUT
        self._hook("on_step_end", self.sid, st)
        return st

    def _signal_step(self, step, sig):
        try:
            self._send(ip.encode(MSG.SIGNAL, [(T.SIG, int(sig)), (T.STEP, step), (T.GROUP, True)]))
        except ReportedError:
            pass

    def signal(self, sig: int, step: int | None = None):
        """Forward a signal to the main process of a step (or of every running step)."""
        try:
            self._send(ip.encode(MSG.SIGNAL, [(T.SIG, int(sig)), (T.STEP, step or 0), (T.GROUP, False)]))
        except ReportedError:
            pass

    def terminate(self):
        """SIGTERM to every process of the sandbox (preemption, shutdown)."""
        with contextlib.suppress(ReportedError):
            self._send(ip.encode(MSG.TERMINATE))

    def kill(self):
        """SIGKILL everything in the sandbox now (its cgroup)."""
        if self.cg:
            self.cg.kill_all(timeout=1.0)

    # -- close ---------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> dict:
        """Kill what is left, tear down, return the summary."""
        if self.summary is not None:
            return self.summary
        with self._cond:
            self.state = "closing"
        try:
            if not self.supervisor_dead:
                try:
                    self._send(ip.encode(MSG.CLOSE))
                    self._wait_for(lambda: self.closed_msg, timeout, "did not close")
                except ReportedError:
                    self.kill()
                if self.closed_msg and not self.supervisor_dead:
                    try:
                        self._hook("on_workload_exit", self.sid)
                    finally:
                        with contextlib.suppress(ReportedError):
                            self._send(ip.encode(MSG.RELEASE))
            # CLOSED came after dsec-init SIGKILLed and reaped every other process of its pid
            # namespace: the layers are final, so the manifest is built while init exits
            # (else after the cgroup is empty, below)
            manifest = self._manifest() if self.closed_msg else None
            with self._cond:
                end = time.monotonic() + timeout
                while not self.supervisor_dead and time.monotonic() < end:
                    self._cond.wait(0.5)
            if not self.supervisor_dead:
                self.kill()
            empty = self.cg.kill_all() if self.cg else False
            self._emptied = empty
            if empty and self.supervisor_dead:
                self._hook("on_gone", self.sid)      # first: what it starts runs beside the rest
            summary = self._summary()
            summary.update(manifest or self._manifest())
            if self.spec.keep:
                _private_dir(KEPT_DIR)
                dest = os.path.join(KEPT_DIR, self.sid)
                trees.remove(dest)
                trees.move(os.path.join(self.dir, "upper"), dest)
                os.chmod(dest, 0o700)
                summary["kept_privileges_stripped"] = rootfs.strip_privileges(dest)
                summary["kept_upper"] = dest
            self.summary = summary
        finally:
            self._teardown()
            self.state = "closed"
        self._hook("on_exit", self.summary)
        return self.summary

    def _manifest(self) -> dict:
        """The file-change manifest of the summary: what the workload changed in the
        layers, less the mountpoints and files dsec itself made (unless changed since)."""
        # a file dsec seeded is taken as unchanged (not read again) when its inode, ctime and size
        # are as written and that ctime is older than the first step: a change by the workload
        # moves the ctime to at least the (coarse) clock of its time, so one within the clock
        # tick of the seeding is not mistaken for none (git's "racily clean" entries); with no
        # step sent, no code of the workload ran
        sealed = self.sealed_ns
        known = {p: k for p, k in self.seeded.items() if sealed is None or k[1] < sealed}
        ch, total = rootfs.changes(self.layers, known=known)
        created = set(self.created_mountpoints)
        keep = [c for c in ch if c["path"] not in created
                and not ((g := self.generated.get(c["path"])) is not None and c.get("sha256") == g)]
        return {"changes": keep, "changes_total": total - (len(ch) - len(keep)),
                "changes_truncated": total > len(ch) or any("not_walked" in c for c in ch)}

    def _summary(self) -> dict:
        last = self.steps[max(self.steps)] if self.steps else None
        cm = self.closed_msg or {}
        return {"sandbox_id": self.sid, "node": NODE_NAME or os.uname().nodename,
                "argv": self.spec.argv, "exit_code": last.exit_code if last else None,
                "signal": last.signal if last else None,
                "timed_out": bool(last and last.timed_out),
                "oom_killed": self.cg.oom_kills() > 0 if self.cg else False,
                "wall_ms": int((time.time() - self.started_at) * 1000),
                "cpu_ms": cm.get("cpu_ms", sum(s.cpu_ms for s in self.steps.values())),
                # peak of the sandbox's memory cgroup: the honest figure for a whole sandbox
                "max_rss_bytes": self.cg.memory_peak() if self.cg else 0,
                "cgroup_id": self.cgroup_id, "started_at": self.started_at, "uid": self.uid,
                "error": (last.error if last else None) or self.setup_error,
                "steps": [s.to_dict() for s in self.steps.values()]}

    def _teardown(self):
        """Remove everything the sandbox had on the host, whatever state we are in."""
        if self.sup_pid and not self.supervisor_dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.sup_pid, signal.SIGKILL)
            if self._reader is None:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.sup_pid, 0)
        if self._reader is not None:
            with self._cond:
                self._cond.wait_for(lambda: self.supervisor_dead, timeout=5)
            STATUS.remove(self)      # before its fds are closed (their numbers are reused)
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
        self.pidfd = -1
        with self._send_lock:
            if self.ctl is not None:
                self.ctl.close()
                self.ctl = None
        # emptied by close (every member killed and gone, dsec-init too: nothing is left to fork
        # into it) or killed here; either way the rmdirs wait out an EBUSY
        left = self.cg.remove(kill=not self._emptied) if self.cg else []
        if left:
            self.teardown_error = f"cgroups left: {' '.join(left)}"
        if (self.net or self.spec.network == "egress") and self.teardown_later:
            self.teardown_deferred = True
            return trash.later(self.sid, lambda: self._teardown_rest(left))
        self._teardown_rest(left)

    def after_teardown(self, fn) -> None:
        """fn() once the whole teardown is done: now, or (an egress host side removed off
        the close's path: teardown_later) on the trash thread right after it. A record that
        says the sandbox is gone from the host waits for this, not for close()."""
        if self.teardown_deferred:
            trash.later(self.sid, fn)
        else:
            fn()

    def _teardown_rest(self, left: list):
        """The host link, the state dir, its lock, the uid lease: gc sees it live until then."""
        if self.net or self.spec.network == "egress":
            from agent.sandbox import netns
            pol = self.spec.policy
            try:
                netns.teardown(self.sid, policy_egress=bool(self.net) and pol is not None and pol.spec.egress is not None)
            except Exception as e:  # noqa: BLE001 - said by after_teardown's record, and on stderr by trash
                self.teardown_error = f"host link: {e}"
                raise
        if self.dir and not left:
            trash.remove_later(self.dir)     # renamed now, removed off the close's path (trash.py)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.lease is not None and not left:
            self.lease.release()          # a uid whose processes may live on stays leased (until we exit)
        if left:
            sys.stderr.write(f"dsec: warning: could not remove cgroups {left}; run `dsec gc`\n")


def launch(spec: SandboxSpec, on_cgroup=None, on_exit=None, stdio=None, on_started=None, on_go=None,
           on_workload_exit=None, on_step_info=None, on_step_end=None, on_ready=None) -> Result:
    """One-shot: start, run spec.argv as step 1 with the caller's stdio, close."""
    if not spec.argv:
        raise DsecError("no command given", EXIT_DSEC)
    sb = Sandbox(spec, on_cgroup=on_cgroup, on_started=on_started,
                 on_step=(lambda sid, step: on_go(sid)) if on_go else None,
                 on_workload_exit=on_workload_exit, on_exit=on_exit,
                 on_step_info=on_step_info, on_step_end=on_step_end, on_ready=on_ready)
    sb.start()
    relay_threads = []
    try:
        stdio = stdio or default_stdio()
        for r, w in stdio["relay"].items():
            t = threading.Thread(target=relay, args=(r, w), daemon=True)
            t.start()
            relay_threads.append(t)
        forwarded = forward_signals(sb)
        try:
            child = stdio["child"]
            st = sb.exec(spec.argv, stdin=child[0], stdout=child[1], stderr=child[2], timeout=spec.timeout)
        finally:
            for fd in stdio["close_after_fork"]:
                os.close(fd)
            restore_signals(forwarded)
    except BaseException:
        sb.close()
        raise
    summary = sb.close()
    for t in relay_threads:
        t.join(timeout=5)
    summary["wall_ms"] = st.wall_ms
    summary["timed_out"] = st.timed_out
    return Result(st.code, summary)
