"""Commands through the running node agent: `dsec run`, `dsec events` and
`dsec replay --rerun` use it when one answers on its socket (docs/agent.md),
and work in-process otherwise. `dsec run` starts one on first use when none
answers (DSEC_AGENT=auto, the default), which later runs reuse: it exits after
DSEC_AGENT_IDLE_EXIT seconds (600) with no sandbox and no call, or on
`dsec agent stop`.

    DSEC_AGENT=auto   (default) use the running agent; `dsec run` starts one if none answers
    DSEC_AGENT=reuse  use the running agent if one answers, else work in-process
    DSEC_AGENT=off    always in-process

    path = agent_socket()                 # None: no agent (or DSEC_AGENT=off)
    client = connect(path, "replay")      # None (and a note on stderr) when it does not answer
    path = start_agent("run")             # start one (or find the one another command started)
    result = run(spec, args)              # `dsec run` through the agent, or None
    for ev in events(sid, kinds, limit)   # `dsec events` through the agent, or None
    stop_agent(socket)                    # `dsec agent stop`
"""
from __future__ import annotations

import _signal as signal     # not `signal`, `re`, `threading`: their imports (enum ...) were a third of
import _thread              # `dsec run`'s start-up through the agent (agent/commands/run.py fast())
import os
import sys

from agent.errors import DsecError

_OFF = ("0", "off", "no", "false")
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"      # agent/sandbox/launcher.py ID_RE
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_REUSE = ("reuse", "on", "1", "yes", "true")
IDLE_EXIT_DEFAULT = 600.0               # seconds an agent started on first use stays without work
START_TIMEOUT = 120.0                   # its start (the eBPF compile is most of it)
# the warm pool of an agent started on first use: `dsec run`'s default shape (1G, 1024 pids, the
# default policy, no network), so that a later `dsec run` without options claims a sandbox started
# ahead of it (agent/node/warm.py; as fresh as a cold one: its own cgroup, netns, upper layer)
WARM_ENV = "DSEC_AGENT__WARM_POOL"
WARM_POOL = "[{name: run, count: 2}]"


def mode() -> str:
    """DSEC_AGENT: "auto" (default), "reuse" or "off"."""
    v = os.environ.get("DSEC_AGENT", "").strip().lower()
    if v in _OFF:
        return "off"
    if v in _REUSE:
        return "reuse"
    if v in ("", "auto"):
        return "auto"
    raise DsecError(f"DSEC_AGENT={v!r}: expected auto, reuse or off", 125)


def default_socket() -> str:
    from agent.node.runclient import DEFAULT_SOCKET, ENV_SOCKET
    return os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


def agent_socket() -> str | None:
    """The running agent's socket, or None (cheap: no gRPC import unless the socket exists).
    DSEC_AGENT=off makes every command work in-process."""
    if mode() == "off":
        return None
    path = default_socket()
    try:
        import stat
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return path


def connect(path: str, who: str, quiet: bool = False):
    from agent.node.client import AgentError, Client
    try:
        c = Client(path, connect_timeout=1.0, timeout=10.0)
        c.wait_ready(timeout=5.0)
        return c
    except (AgentError, OSError) as e:
        if not quiet:
            sys.stderr.write(f"dsec {who}: note: no agent answers at {path} ({getattr(e, 'message', e)}); "
                             f"working in-process\n")
        return None


def start_agent(who: str) -> str | None:
    """Start a node agent on the default socket for this and later commands
    (`dsec agent --idle-exit DSEC_AGENT_IDLE_EXIT`, detached, its log beside the
    socket), or find the one a concurrent command started. Returns its socket,
    or None (a note on stderr: the command then works in-process)."""
    import fcntl
    import subprocess
    import time
    if os.geteuid() != 0:
        return None                 # the agent needs root; the in-process path says so
    path = default_socket()
    d = os.path.dirname(path) or "."
    idle = os.environ.get("DSEC_AGENT_IDLE_EXIT", "").strip() or f"{IDLE_EXIT_DEFAULT:g}"
    try:
        if not float(idle) > 0:
            raise ValueError
    except ValueError:
        raise DsecError(f"DSEC_AGENT_IDLE_EXIT={idle!r}: expected a positive number of seconds", 125) from None
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        lock = os.open(os.path.join(d, "agent-start.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        sys.stderr.write(f"dsec {who}: note: cannot start an agent at {path} ({e.strerror}); working in-process\n")
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)     # one starter at a time; the others then find it answering
        c = connect(path, who, quiet=True) if _is_socket(path) else None
        if c is not None:
            c.close()
            return path
        log_path = os.path.join(d, "agent.log")
        cmd = [sys.executable, "-m", "agent.cli", "agent", "--idle-exit", idle]
        env = dict(os.environ, DSEC_AGENT_SOCKET=path)
        env.setdefault(WARM_ENV, WARM_POOL)     # later runs take a sandbox started ahead of them
        with open(log_path, "ab") as log:
            os.chmod(log_path, 0o600)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    start_new_session=True, close_fds=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            rc = proc.poll()
            if rc is not None:
                sys.stderr.write(f"dsec {who}: note: the agent it started exited ({rc}; log {log_path}: "
                                 f"{_last_line(log_path)}); working in-process\n")
                return None
            c = connect(path, who, quiet=True) if _is_socket(path) else None
            if c is not None:
                c.close()
                break
            if time.monotonic() > deadline:
                proc.terminate()
                sys.stderr.write(f"dsec {who}: note: the agent it started did not answer within "
                                 f"{START_TIMEOUT:.0f}s (log {log_path}); working in-process\n")
                return None
            time.sleep(0.05)
        sys.stderr.write(f"dsec {who}: started a node agent (pid {proc.pid}) on {path} for this and later runs; "
                         f"it exits after {float(idle):g}s without work, `dsec agent stop` stops it (log {log_path})\n")
        sys.stderr.flush()
        return path
    finally:
        os.close(lock)


def _is_socket(path: str) -> bool:
    """A unix socket that something listens on (a stale one left by a dead agent: False, at once)."""
    from agent.node.client import _accepts
    return _accepts(path)


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 2048))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else "(empty)"
    except OSError as e:
        return f"unreadable: {e.strerror}"


def stop_agent(socket: str | None) -> int:
    """`dsec agent stop`: SIGTERM to the agent answering on `socket` (its sandboxes
    are stopped: SIGTERM, grace, SIGKILL), then wait until it has exited."""
    import time
    from agent.node.client import AgentError, Client
    path = socket or default_socket()
    try:
        with Client(path, connect_timeout=2.0) as c:
            pid = int(c.capabilities(timeout=5.0)["pid"])
    except (AgentError, OSError) as e:
        print(f"dsec agent stop: no agent answers at {path} ({getattr(e, 'message', e)}): nothing to stop")
        return 0
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise DsecError(f"agent pid {pid} on {path}: {e.strerror}", 1) from None
    try:
        os.kill(pid, signal.SIGTERM)
        import select
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        t0 = time.monotonic()
        if not p.poll(90_000):
            raise DsecError(f"the agent (pid {pid}) on {path} did not exit within 90s of SIGTERM", 1)
    finally:
        os.close(pidfd)
    print(f"dsec agent stop: stopped the agent (pid {pid}) on {path} in {time.monotonic() - t0:.1f}s")
    return 0


def run(spec, args):
    """`dsec run` through the running agent: the same sandbox, exit status, output
    passthrough and summary. Returns a launcher.Result, or None when no agent runs."""
    m = mode()
    if m == "off":
        return None
    path = agent_socket()
    if path is None and m != "auto":
        return None
    create, wait_export = request(spec, args)
    if path is not None:
        fast = run_socket(path, spec, create, wait_export)      # dsec run's own socket: no gRPC import
        if fast is not None:
            return fast
    return _run_grpc(path, m, spec, create, wait_export)


def request(spec, args) -> tuple[dict, bool]:
    """`dsec run`'s request to the agent: (the create() keywords, wait_export). Raises DsecError
    on what the launcher would refuse on this side, with the same messages as in-process
    (without importing it: this is `dsec run`'s fast path)."""
    from agent.errors import EXIT_DSEC
    if spec.sandbox_id and not _id_ok(spec.sandbox_id):
        raise DsecError(f"invalid sandbox id {spec.sandbox_id!r}: use 1-63 of [A-Za-z0-9_.-], starting "
                        f"alphanumeric", EXIT_DSEC)
    if spec.rootfs:
        rf = os.path.abspath(spec.rootfs)
        if not os.path.isdir(rf):
            raise DsecError(f"--rootfs {spec.rootfs}: no such directory", EXIT_DSEC)
        if any(ch in rf for ch in ",:\\"):
            raise DsecError(f"--rootfs {spec.rootfs}: path must not contain ',', ':' or '\\'", EXIT_DSEC)
    pol = {"policy": args.policy} if _is_builtin_ref(args.policy) else None
    if pol is None:
        try:
            with open(args.policy, encoding="utf-8", errors="surrogateescape") as f:
                pol = {"policy_yaml": f.read(), "policy_source": args.policy}
        except OSError as e:
            raise DsecError(f"--policy {args.policy}: {e.strerror}", EXIT_DSEC)
    image = getattr(args, "image", None)
    create = dict(sandbox_id=spec.sandbox_id, cpus=spec.cpus, memory=spec.memory, pids=spec.pids,
                  rootfs=os.path.abspath(spec.rootfs) if spec.rootfs else None, network=spec.network,
                  env=spec.env, workdir=args.workdir if image else spec.workdir,
                  user=args.user if image else spec.user, keep=spec.keep, grace=spec.grace,
                  image=image, volumes=list(getattr(args, "volume", None) or ()),
                  over_budget=args.over_budget, audit=args.audit == "on", mode=args.mode,
                  labels={"client": "dsec-run"}, **pol)
    wait_export = args.audit == "on" and bool(getattr(args, "wait_export", False))
    return create, wait_export


def _run_grpc(path, m, spec, create: dict, wait_export: bool):
    """`dsec run` through the agent's gRPC API (an agent without the run socket), starting one
    when none answers and DSEC_AGENT=auto; None when there is none."""
    from agent.errors import EXIT_DSEC
    c = connect(path, "run") if path is not None and (m != "auto" or _is_socket(path)) else None
    if c is None and m == "auto":
        path = start_agent("run")         # none answers: start one for this and later runs
        c = connect(path, "run") if path is not None else None
    if c is None:
        return None
    from agent.node.client import AgentError, SandboxFailed, SandboxStopped, _exec_start, _Inputs
    from agent.node.proto import pb
    try:
        sb = c.create(**create)
    except SandboxFailed as e:
        c.close()
        raise DsecError(e.reason.removeprefix("sandbox start failed: "), EXIT_DSEC)
    except AgentError as e:
        c.close()
        raise DsecError(e.message, EXIT_DSEC)
    if not spec.sandbox_id:
        sys.stderr.write(f"dsec: sandbox {sb.id}\n")
        sys.stderr.flush()
    stdin_ok = _stdin_ok()
    inputs = _Inputs(_exec_start(sb.id, spec.argv, stdin=None, close_stdin=not stdin_ok, timeout=spec.timeout,
                                 grace=spec.grace, close_after=True, wait_export=wait_export))
    if stdin_ok:
        _pump_stdin(lambda data: inputs.put(pb.ExecInput(stdin=data)),
                    lambda: inputs.put(pb.ExecInput(close_stdin=True)))
    old = _forward_signals(lambda sig: inputs.put(pb.ExecInput(signal=sig)))
    out = _Output()
    result = None
    try:
        for kind, value in c.exec_stream(sb.id, spec.argv, inputs=inputs):
            if kind == "stdout":
                out(1, value)
            elif kind == "stderr":
                out(2, value)
            elif kind == "exit":
                result = value
    except SandboxStopped as e:
        result = e.result
        if result is None or result.summary is None:
            raise DsecError(e.message, EXIT_DSEC)
    except AgentError as e:
        raise DsecError(f"through the agent: {e.message}", EXIT_DSEC)
    finally:
        inputs.end()
        for s, h in old.items():
            signal.signal(s, h)
        c.close()
    summary = result.summary or {"sandbox_id": sb.id, "exit_code": result.exit_code, "signal": result.signal,
                                 "error": result.error, "timed_out": result.timed_out}
    summary.setdefault("audit", {})
    summary["agent"] = path
    return RunResult(result.code, summary)


def _id_ok(sid: str) -> bool:
    """_ID_PATTERN matches sid: checked by hand for the ids it plainly matches (no `re` import)."""
    if 0 < len(sid) < 64 and sid[0] not in "_.-" and _ID_CHARS.issuperset(sid):
        return True
    import re
    return re.match(_ID_PATTERN, sid) is not None


def _stdin_ok() -> bool:
    """Our stdin is open and not a terminal: it is streamed into the step."""
    try:
        tty = os.isatty(0)
        os.fstat(0)
        return not tty
    except OSError:
        return False


class _Output:
    """out(fd, data): the step's output onto our stdout/stderr; a closed one is skipped."""

    def __init__(self):
        self.broken = set()

    def __call__(self, fd, data):
        if fd in self.broken:
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                import select
                p = select.poll()           # poll, not select: works for any fd number
                p.register(fd, select.POLLOUT)
                p.poll()
                continue
            except OSError:
                self.broken.add(fd)
                return
            view = view[n:]


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_socket(path: str, spec, create: dict, wait_export: bool):
    """`dsec run` over the agent's run socket (agent/node/runclient.py): the same sandbox, exit
    status, output, signals and summary as through gRPC, without importing gRPC. None when
    nothing answers on that socket (an agent older than it: the gRPC path is used)."""
    from agent.errors import EXIT_DSEC
    from agent.node import runclient as rc
    sock = rc.connect(rc.run_socket_path(path))
    if sock is None:
        return None
    w = rc.FrameWriter(sock)
    stdin_ok = _stdin_ok()
    try:
        w.send_json("R", {"create": create, "exec": {
            "argv": [os.fsdecode(a) for a in spec.argv], "stdin": stdin_ok, "timeout": spec.timeout,
            "grace": spec.grace, "wait_export": wait_export}})
    except OSError:
        sock.close()
        return None
    out = _Output()
    old = {}
    sid, result = None, None
    try:
        while True:
            try:
                f = rc.read_frame(sock)
            except (OSError, rc.ProtocolError) as e:
                raise DsecError(f"through the agent: {e}", EXIT_DSEC)
            if f is None:
                if sid is None:
                    raise DsecError("through the agent: it closed the connection before the sandbox ran "
                                    "(its log says why)", EXIT_DSEC)
                if result is None:
                    raise DsecError("through the agent: it ended the step without an exit status", EXIT_DSEC)
                break
            kind, p = f
            if kind == "o":
                out(1, p)
            elif kind == "e":
                out(2, p)
            elif kind == "x":
                result = rc.loads(p)
            elif kind == "C":
                sid = rc.loads(p)["sandbox_id"]
                if not spec.sandbox_id:
                    sys.stderr.write(f"dsec: sandbox {sid}\n")
                    sys.stderr.flush()
                _start_inputs(w, stdin_ok, old)
            elif kind == "E":
                err = rc.loads(p)
                msg = err.get("message") or err.get("code") or "error"
                if sid is None:
                    if err.get("code") == "FAILED":
                        raise DsecError((err.get("reason") or msg).removeprefix("sandbox start failed: "),
                                        EXIT_DSEC)
                    raise DsecError(msg, EXIT_DSEC)
                if result is not None and result.get("summary") is not None:
                    break                   # stopped after its exit (SandboxStopped with a result)
                raise DsecError(msg if err.get("code") == "ABORTED" else f"through the agent: {msg}", EXIT_DSEC)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sock.close()
    summary = result.get("summary") or {"sandbox_id": sid, "exit_code": result.get("exit_code"),
                                        "signal": result.get("signal"), "error": result.get("error"),
                                        "timed_out": result.get("timed_out")}
    summary.setdefault("audit", {})
    summary["agent"] = path
    return RunResult(result["code"], summary)


def _pump_stdin(send, send_eof):
    """Our stdin, read by a thread: send(data) per read, send_eof() at its end. An
    OSError from send ends the pump (the run is over: the agent closed the connection)."""
    def pump():
        try:
            while True:
                try:
                    data = os.read(0, 65536)
                except OSError:
                    data = b""
                if not data:
                    send_eof()
                    return
                send(data)
        except OSError:
            return
    _thread.start_new_thread(pump, ())        # a daemon thread: the run's end does not wait for it


def _forward_signals(send) -> dict:
    """The signals we get (_SIGNALS) handed to send(signum), from the main thread only;
    returns the handlers they replaced, to be put back."""
    old = {}
    for s in _SIGNALS:
        try:
            old[s] = signal.signal(s, lambda sig, _f: send(sig))
        except ValueError:          # not the main thread: it fails at the first one
            break
    return old


def _start_inputs(w, stdin_ok: bool, old: dict):
    """Our stdin (pumped by a thread) and the signals we get, onto the run socket."""
    if stdin_ok:
        _pump_stdin(lambda data: w.send("i", data), lambda: w.send("c"))

    def forward(sig):
        try:
            w.send("s", str(int(sig)).encode())
        except OSError:
            pass
    old.update(_forward_signals(forward))


class RunResult:
    """A run's exit code and summary (launcher.Result's shape, without importing the launcher)."""

    def __init__(self, exit_code: int, summary: dict):
        self.exit_code = exit_code
        self.summary = summary


_POLICY_SUFFIXES = (".yaml", ".yml", ".json")     # policies.load: a file needs a '/' or one of these


def _is_builtin_ref(ref: str) -> bool:
    """policies.load.is_builtin_ref without importing the policy model (pydantic)."""
    return "/" not in ref and not ref.endswith(_POLICY_SUFFIXES)


def events(sandbox: str, kinds: list, limit: int | None):
    """`dsec events` through the running agent (it delivers its spool first and
    reads its audit store). An iterator of event dicts, or None when no agent runs."""
    path = agent_socket()
    if path is None:
        return None
    c = connect(path, "events")
    if c is None:
        return None
    from agent.node.client import AgentError, NotFound

    def gen():
        try:
            yield from c.query_events(sandbox, kinds, limit=limit or 0)
        except NotFound as e:
            raise DsecError(e.message, 1)
        except AgentError as e:
            raise DsecError(f"through the agent: {e.message}", 1)
        finally:
            c.close()
    return gen()
