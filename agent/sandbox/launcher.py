"""The sandbox launcher.

    sb = Sandbox(SandboxSpec(argv=[])).start()          # ready, nothing running yet
    r = sb.exec(["python3", "step1.py"], stdout=fd)      # one step; blocks until it exits
    r = sb.exec(["python3", "step2.py"], timeout=30)     # files and background processes persist
    summary = sb.close()                                 # kill what is left, tear down, manifest

    result = launch(SandboxSpec(argv=["/bin/true"]))      # one-shot: start + exec + close

start(): state dir (exclusive, locked for our lifetime) -> cgroups with limits
-> fork an intermediate child that joins the cgroups and unshares pid, mount,
ipc, uts and net namespaces, then forks the supervisor (PID 1 inside; see
agent/sandbox/supervisor.py) and exits; we are the child subreaper, so the supervisor
becomes our child -> host side of the network -> "go".
exec(): the step's stdin/stdout/stderr fds go to the supervisor (SCM_RIGHTS),
which forks and execs; on timeout the step's process group gets SIGTERM, the
grace period, then SIGKILL.
close(): everything left is killed; the cgroups, veth and state dir removed;
the upper layer walked for the change manifest (kept with --keep).

Hooks let the audit pipeline watch: on_cgroup(sandbox_id, cgroup_id) before
any sandbox process exists; on_started(sandbox_id, supervisor_pid);
on_step(sandbox_id, step) before each step starts, on_step_info(sandbox_id,
step, {argv, env, workdir, timeout, stdin}) right after it, on_step_end(sandbox_id,
StepResult) when it has ended; on_workload_exit(sandbox_id)
once every process but the supervisor is gone (the sandbox's mount namespace is
held until it returns); on_exit(summary) after teardown.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time

from agent.sandbox import cgroups
from agent.sandbox import rootfs
from agent.sandbox import sysutil as su
from agent.errors import DsecError, EXIT_DSEC, EXIT_USAGE, EXIT_NOEXEC, EXIT_NOTFOUND, EXIT_TIMEOUT, ReportedError
# imported before any fork: a child must not import (another thread may hold the import lock)
from agent.sandbox.supervisor import supervisor_main

SANDBOX_DIR = os.path.join(rootfs.STATE_ROOT, "sandboxes")
KEPT_DIR = os.path.join(rootfs.STATE_ROOT, "kept")
NODE_NAME: str | None = None     # the node agent's host.node_name (default: the hostname)
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


class SandboxSpec:
    """What to run and how (plain class: dataclasses would cost `dsec run` ~6 ms of imports)."""

    def __init__(self, argv, sandbox_id=None, cpus=None, memory=1 << 30, pids=1024, timeout=None,
                 grace=3.0, rootfs=None, network="none", env=None, workdir="/workspace",
                 user="sandbox", keep=False, tmp_size=None, policy=None, layers=None, image=None, volumes=None):
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
        # an image (agent/sandbox/images): its unpacked layers as overlay lower dirs, top first,
        # and what the record says about it; volumes: agent/sandbox/volumes.Volume, checked
        self.layers: list[str] = list(layers or ())
        self.image: dict | None = image
        self.volumes: list = list(volumes or ())


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


class StepResult:
    """How one step ended. `code` follows `dsec run`'s exit-status convention."""

    def __init__(self, step: int):
        self.step = step
        self.pid = 0
        self.status = None          # raw wait status
        self.exit_code = None       # CMD's exit status, or None when killed by a signal
        self.signal = None
        self.timed_out = False
        self.error = None           # exec failure / setup failure text
        self.code = EXIT_DSEC
        self.cpu_ms = 0
        self.max_rss_bytes = 0
        self.wall_ms = 0
        self.started_ns = 0
        self.done = False

    def to_dict(self) -> dict:
        return {"step": self.step, "exit_code": self.exit_code, "signal": self.signal,
                "timed_out": self.timed_out, "error": self.error, "code": self.code,
                "cpu_ms": self.cpu_ms, "max_rss_bytes": self.max_rss_bytes, "wall_ms": self.wall_ms}


class Sandbox:
    """One sandbox, alive from start() to close(); explicit state so teardown
    knows exactly what exists. Thread-safe: steps may run concurrently."""

    def __init__(self, spec: SandboxSpec, on_cgroup=None, on_started=None, on_step=None,
                 on_workload_exit=None, on_exit=None, on_step_info=None, on_step_end=None):
        self.spec = spec
        self.hooks = {"on_cgroup": on_cgroup, "on_started": on_started, "on_step": on_step,
                      "on_workload_exit": on_workload_exit, "on_exit": on_exit,
                      "on_step_info": on_step_info, "on_step_end": on_step_end}
        self.sid = None
        self.dir = None
        self.lock_fd = -1
        self.cg: cgroups.SandboxCgroup | None = None
        self.cgroup_id = 0
        self.sup_pid = 0
        self.pidfd = -1
        self.ctl: socket.socket | None = None
        self.status_r = -1
        self.net = None
        self.created_mountpoints: list[str] = []
        self.layers: list[tuple[str, str, str]] = []
        self.env: dict = {}
        self.started_at = 0.0
        self.state = "new"              # new -> starting -> running -> closing -> closed
        self.steps: dict[int, StepResult] = {}
        self.next_step = 1
        self.closed_msg: dict | None = None
        self.supervisor_dead = False
        self.setup_error: str | None = None
        self._ready: dict | None = None
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
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
        pw_root = None
        if spec.layers:                     # image layers, top first: one overlay over all of them
            from agent.sandbox.images import passwd_root
            lower, host_dirs, pw_root = ":".join(spec.layers), [], passwd_root(spec.layers)
        elif spec.rootfs:
            rf = os.path.abspath(spec.rootfs)
            if not os.path.isdir(rf):
                raise DsecError(f"--rootfs {spec.rootfs}: no such directory", EXIT_DSEC)
            if any(c in rf for c in ",:\\"):
                raise DsecError(f"--rootfs {spec.rootfs}: path must not contain ',', ':' or '\\'", EXIT_DSEC)
            lower, host_dirs = rf, []
        else:
            lower, host_dirs = rootfs.ensure_base()
        uid, gid, home = _passwd_lookup(pw_root or lower, spec.user)
        self.started_at = time.time()
        self.dir = os.path.join(SANDBOX_DIR, self.sid)
        os.makedirs(SANDBOX_DIR, exist_ok=True)
        from agent.sandbox import gc
        self._gc_guard = gc.start_guard()   # gc waits until this sandbox is visibly live (issue 13)
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            self._gc_guard.release()
            raise DsecError(f"sandbox id {self.sid} is already in use (state dir {self.dir} exists; "
                            f"`dsec gc` removes stale ones)", EXIT_DSEC)
        self.state = "starting"
        try:
            self._start(layout, lower, host_dirs, uid, gid, home)
        except BaseException:
            self._gc_guard.release()
            self._teardown()
            self.state = "closed"
            raise
        self.state = "running"
        return self

    def _start(self, layout, lower, host_dirs, uid, gid, home):
        spec = self.spec
        self.lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self._write_state({"sandbox_id": self.sid, "owner_pid": os.getpid(), "owner_start": _owner_start_time(),
                           "created": self.started_at, "network": spec.network})
        self.cg = cgroups.SandboxCgroup(layout, self.sid)
        try:
            self.cg.create(spec.cpus, spec.memory, spec.pids)
        finally:
            self._gc_guard.release()        # locked state dir + cgroups: gc sees it live
        self.cgroup_id = self.cg.cgroup_id
        self._hook("on_cgroup", self.sid, self.cgroup_id)

        self.env = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "HOSTNAME": self.sid,
                    "USER": spec.user if not spec.user[0].isdigit() else str(uid)}
        self.env.update(spec.env)
        upper, work = os.path.join(self.dir, "upper"), os.path.join(self.dir, "work")
        root = os.path.join(self.dir, "root")
        for d in (root, upper, work):
            os.mkdir(d)
        self.layers = [("/", os.path.join(upper, "_root"), lower)] + \
            [("/" + d, os.path.join(upper, d), "/" + d) for d in host_dirs]
        cfg = {"root": root, "upper": upper, "work": work, "lower": lower, "host_dirs": host_dirs,
               "hostname": self.sid, "argv": [], "env": self.env, "workdir": spec.workdir,
               "uid": uid, "gid": gid, "tmp_size": spec.tmp_size or spec.memory or (512 << 20),
               "seccomp": None, "writable": None, "volumes": [v.to_dict() for v in spec.volumes],
               "hold_after_exit": bool(self.hooks["on_workload_exit"])}
        if spec.policy is not None:
            from policies.compile import seccomp_filter, writable_paths
            try:
                cfg["seccomp"] = seccomp_filter(spec.policy)   # built here, loaded by each step right before execve
            except ReportedError as e:
                raise DsecError(f"policy {spec.policy.name}: {e.message}", EXIT_DSEC)
            if spec.policy.mode == "enforce":
                cfg["writable"] = writable_paths(spec.policy)
                bad = rootfs.writable_conflicts(cfg["writable"] or [], lower, host_dirs)
                if bad:
                    raise DsecError(f"policy {spec.policy.name}: files.writable {bad[0][1]!r}: {bad[0][2]} "
                                    f"(dsec policy check names every such entry)", EXIT_USAGE)

        ctl_parent, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctl = ctl_parent
        self.status_r, status_w = os.pipe2(os.O_CLOEXEC)
        pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
        su.prctl(su.PR_SET_CHILD_SUBREAPER, 1)
        sys.stdout.flush()
        sys.stderr.flush()
        mid = os.fork()
        if mid == 0:  # intermediate: join cgroups, new namespaces, fork PID 1, exit
            code = 125
            try:
                os.close(self.lock_fd)
                devnull = os.open(os.devnull, os.O_RDWR)
                for target in (0, 1, 2):     # the supervisor holds no terminal or caller pipe
                    os.dup2(devnull, target)
                self.cg.join(0)
                su.unshare(su.CLONE_NEWPID | su.CLONE_NEWNS | su.CLONE_NEWIPC | su.CLONE_NEWUTS | su.CLONE_NEWNET)
                pid = os.fork()
                if pid == 0:
                    supervisor_main(cfg, ctl_child.fileno(), status_w)   # never returns
                os.write(pid_w, f"{pid}\n".encode())
                code = 0
            except OSError as e:
                os.write(pid_w, f"error {e.strerror or e}\n".encode())
            finally:
                os._exit(code)
        ctl_child.close()
        os.close(status_w)
        os.close(pid_w)
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
            raise DsecError(f"cannot create sandbox namespaces: {text.removeprefix('error ') or 'launcher child died'}",
                            EXIT_DSEC)
        self.sup_pid = int(text)
        self.pidfd = os.pidfd_open(self.sup_pid)
        self._write_state({"supervisor_pid": self.sup_pid})
        self._hook("on_started", self.sid, self.sup_pid)
        self._reader = threading.Thread(target=self._read_status, name=f"dsec-sbx-{self.sid}", daemon=True)
        self._reader.start()
        ready = self._wait_for(lambda: self._ready, 30.0, "did not become ready")
        self.created_mountpoints = ready.get("created", [])
        if spec.network == "egress":
            from agent.sandbox import netns
            self.net = netns.setup_egress(self.sid, self.sup_pid)
        self._send({"cmd": "go"})

    def _write_state(self, update: dict):
        path = os.path.join(self.dir, "state.json")
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            st = {}
        st.update(update)
        with open(path + ".tmp", "w") as f:
            json.dump(st, f)
        os.rename(path + ".tmp", path)

    def _hook(self, name, *args):
        fn = self.hooks.get(name)
        if fn:
            fn(*args)

    def _send(self, msg: dict, fds=()):
        with self._send_lock:
            if self.ctl is None:
                raise DsecError(f"sandbox {self.sid} is closed", EXIT_DSEC)
            try:
                socket.send_fds(self.ctl, [json.dumps(msg).encode()], list(fds))
            except OSError as e:
                raise DsecError(f"sandbox {self.sid}: supervisor is gone ({e.strerror})", EXIT_DSEC)

    # -- the status reader -------------------------------------------------------
    def _read_status(self):
        buf = b""
        fds = [self.status_r, self.pidfd]
        while True:
            try:
                r, _, _ = select.select(fds, [], [])
            except InterruptedError:
                continue
            if self.status_r in r and self.pidfd not in r:
                data = os.read(self.status_r, 65536)
                if data:
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        self._dispatch(line)
                else:
                    fds.remove(self.status_r)
                continue
            # the supervisor exited: drain what it wrote, then reap it
            while True:
                try:
                    data = os.read(self.status_r, 65536)
                except OSError:
                    break
                if not data:
                    break
                buf += data
            for line in buf.split(b"\n"):
                self._dispatch(line)
            try:
                os.waitpid(self.sup_pid, 0)
            except ChildProcessError:
                pass
            with self._cond:
                self.supervisor_dead = True
                self._cond.notify_all()
            return

    def _dispatch(self, line: bytes):
        if not line.strip():
            return
        try:
            m = json.loads(line)
        except ValueError:
            return
        ev = m.get("ev")
        with self._cond:
            if ev == "ready":
                self._ready = m
            elif ev == "error":
                self.setup_error = m.get("msg")
            elif ev == "started":
                st = self.steps.get(m.get("step"))
                if st:
                    st.pid = m["pid"]
            elif ev == "step_exit":
                st = self.steps.get(m.get("step"))
                if st and not st.done:
                    _finish_step(st, m)
            elif ev == "closed":
                self.closed_msg = m
            self._cond.notify_all()

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
                    raise DsecError(f"sandbox {self.sid}: supervisor died ({what})", EXIT_DSEC)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DsecError(f"sandbox {self.sid}: supervisor {what} within {timeout:.0f}s", EXIT_DSEC)
                self._cond.wait(min(left, 1.0))

    # -- steps ---------------------------------------------------------------------
    def exec(self, argv, *, env=None, workdir=None, stdin=None, stdout=None, stderr=None,
             timeout=None, grace=None, stdin_bytes: bytes | None = None) -> StepResult:
        """Run one step and wait for its main process to exit. stdin/stdout/stderr
        are fds (None = /dev/null), passed to the supervisor. On timeout: SIGTERM to
        the step's process group, `grace` seconds, SIGKILL."""
        if not argv:
            raise DsecError("no command given", EXIT_DSEC)
        with self._cond:
            if self.state != "running":
                raise DsecError(f"sandbox {self.sid} is {self.state}", EXIT_DSEC)
            step = self.next_step
            self.next_step += 1
            st = self.steps[step] = StepResult(step)
        e = dict(self.env)
        if env:
            e.update(env)
        self._hook("on_step", self.sid, step)
        self._hook("on_step_info", self.sid, step, {"argv": list(argv), "env": e,
                                                    "workdir": workdir or self.spec.workdir,
                                                    "timeout": timeout, "stdin": stdin_bytes})
        fds, opened = [], []
        for fd, mode in ((stdin, os.O_RDONLY), (stdout, os.O_WRONLY), (stderr, os.O_WRONLY)):
            if fd is None:
                fd = os.open(os.devnull, mode | os.O_CLOEXEC)
                opened.append(fd)
            fds.append(fd)
        st.started_ns = time.time_ns()
        t0 = time.monotonic()
        try:
            self._send({"cmd": "exec", "step": step, "argv": list(argv), "env": e,
                        "workdir": workdir or self.spec.workdir}, fds)
        finally:
            for fd in opened:
                os.close(fd)
        grace = self.spec.grace if grace is None else grace
        deadline = t0 + timeout if timeout else None
        kill_at = None
        with self._cond:
            while not st.done and not self.supervisor_dead:
                now = time.monotonic()
                if deadline is not None and now >= deadline and not st.timed_out:
                    st.timed_out = True
                    kill_at = now + grace
                    self._signal_step(step, signal.SIGTERM)
                if kill_at is not None and now >= kill_at:
                    self._signal_step(step, signal.SIGKILL)
                    kill_at = now + 1.0
                waits = [t for t in ((None if st.timed_out else deadline), kill_at) if t is not None]
                self._cond.wait(min([1.0] + [max(0.0, t - now) for t in waits]))
            if not st.done:      # the supervisor died under the step (OOM of PID 1, killed ...)
                _finish_step(st, {"status": signal.SIGKILL})
        st.wall_ms = int((time.monotonic() - t0) * 1000)
        if st.timed_out:
            st.code = EXIT_TIMEOUT
        self._hook("on_step_end", self.sid, st)
        return st

    def _signal_step(self, step, sig):
        try:
            self._send({"cmd": "signal", "sig": int(sig), "step": step, "group": True})
        except ReportedError:
            pass

    def signal(self, sig: int, step: int | None = None):
        """Forward a signal to the main process of a step (or of every running step)."""
        try:
            self._send({"cmd": "signal", "sig": int(sig), "step": step, "group": False})
        except ReportedError:
            pass

    def terminate(self):
        """SIGTERM to every process of the sandbox (preemption, shutdown)."""
        try:
            self._send({"cmd": "terminate"})
        except ReportedError:
            pass

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
                    self._send({"cmd": "close"})
                    self._wait_for(lambda: self.closed_msg, timeout, "did not close")
                except ReportedError:
                    self.kill()
                if self.closed_msg and not self.supervisor_dead:
                    try:
                        self._hook("on_workload_exit", self.sid)
                    finally:
                        try:
                            self._send({"cmd": "release"})
                        except ReportedError:
                            pass
            with self._cond:
                end = time.monotonic() + timeout
                while not self.supervisor_dead and time.monotonic() < end:
                    self._cond.wait(0.5)
            if not self.supervisor_dead:
                self.kill()
            summary = self._summary()
            if self.cg:
                self.cg.kill_all()
            ch, total = rootfs.changes(self.layers)
            created = set(self.created_mountpoints)
            summary["changes"] = [c for c in ch if c["path"] not in created]
            summary["changes_total"] = total - (len(ch) - len(summary["changes"]))
            summary["changes_truncated"] = total > len(ch)
            if self.spec.keep:
                import shutil
                os.makedirs(KEPT_DIR, exist_ok=True)
                dest = os.path.join(KEPT_DIR, self.sid)
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(os.path.join(self.dir, "upper"), dest)
                summary["kept_upper"] = dest
            self.summary = summary
        finally:
            self._teardown()
            self.state = "closed"
        self._hook("on_exit", self.summary)
        return self.summary

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
                # (per-process ru_maxrss would count the forked supervisor's image).
                "max_rss_bytes": self.cg.memory_peak() if self.cg else 0,
                "cgroup_id": self.cgroup_id, "started_at": self.started_at,
                "error": (last.error if last else None) or self.setup_error,
                "steps": [s.to_dict() for s in self.steps.values()]}

    def _teardown(self):
        """Remove everything the sandbox had on the host, whatever state we are in."""
        if self.sup_pid and not self.supervisor_dead:
            try:
                os.kill(self.sup_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._reader is None:
                try:
                    os.waitpid(self.sup_pid, 0)
                except ChildProcessError:
                    pass
        if self._reader is not None:
            self._reader.join(timeout=5)
        for fd in (self.pidfd, self.status_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pidfd = self.status_r = -1
        with self._send_lock:
            if self.ctl is not None:
                self.ctl.close()
                self.ctl = None
        left = []
        if self.cg:
            left = self.cg.remove()
        if self.net or self.spec.network == "egress":
            from agent.sandbox import netns
            netns.teardown(self.sid)
        if self.dir and not left:
            import shutil
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if left:
            sys.stderr.write(f"dsec: warning: could not remove cgroups {left}; run `dsec gc`\n")


def _finish_step(st: StepResult, m: dict):
    st.done = True
    st.cpu_ms = m.get("cpu_ms", 0)
    st.max_rss_bytes = m.get("max_rss_bytes", 0)
    if m.get("exec_errno") is not None:
        e = m["exec_errno"]
        st.error = f"{m.get('exec_stage')}: {m.get('exec_msg')}"
        if m.get("exec_stage") == "exec":
            st.code = EXIT_NOTFOUND if e == errno.ENOENT else EXIT_NOEXEC
            st.exit_code = st.code
        else:
            st.code = EXIT_DSEC
        return
    status = m.get("status")
    if status is None:
        status = signal.SIGKILL
    st.status = status
    if os.WIFSIGNALED(status):
        st.signal = os.WTERMSIG(status)
        st.code = 128 + st.signal
    else:
        st.exit_code = os.WEXITSTATUS(status)
        st.code = st.exit_code


def launch(spec: SandboxSpec, on_cgroup=None, on_exit=None, stdio=None, on_started=None, on_go=None,
           on_workload_exit=None, on_step_info=None, on_step_end=None) -> Result:
    """One-shot: start, run spec.argv as step 1 with the caller's stdio, close."""
    if not spec.argv:
        raise DsecError("no command given", EXIT_DSEC)
    sb = Sandbox(spec, on_cgroup=on_cgroup, on_started=on_started,
                 on_step=(lambda sid, step: on_go(sid)) if on_go else None,
                 on_workload_exit=on_workload_exit, on_exit=on_exit,
                 on_step_info=on_step_info, on_step_end=on_step_end)
    sb.start()
    relay_threads = []
    try:
        stdio = stdio or _default_stdio()
        for r, w in stdio["relay"].items():
            t = threading.Thread(target=_relay, args=(r, w), daemon=True)
            t.start()
            relay_threads.append(t)
        forwarded = _forward_signals(sb)
        try:
            child = stdio["child"]
            st = sb.exec(spec.argv, stdin=child[0], stdout=child[1], stderr=child[2], timeout=spec.timeout)
        finally:
            for fd in stdio["close_after_fork"]:
                os.close(fd)
            _restore_signals(forwarded)
    except BaseException:
        sb.close()
        raise
    summary = sb.close()
    for t in relay_threads:
        t.join(timeout=5)
    summary["wall_ms"] = st.wall_ms
    summary["timed_out"] = st.timed_out
    return Result(st.code, summary)


def _forward_signals(sb: Sandbox) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        old[s] = signal.signal(s, lambda sig, _f: sb.signal(sig))
    return old


def _restore_signals(old: dict):
    for s, h in old.items():
        signal.signal(s, h)


def _relay(rfd: int, wfd: int):
    while True:
        try:
            data = os.read(rfd, 65536)
        except OSError:
            break
        if not data:
            break
        _write_all(wfd, data)
    os.close(rfd)


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
