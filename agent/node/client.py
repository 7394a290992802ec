"""The Python SDK of the dsec node agent (what training code calls).

Why this file is long: it is the one module users import (and the only door
replay/ may use into agent/): the blocking Client and the asyncio AsyncClient
share its values, errors and request builders, so they live side by side.

    from agent.node.client import Client

    with Client() as c:                                   # unix socket (DSEC_AGENT_SOCKET or /run/dsec/agent.sock)
        with c.create(memory="512M", labels={"job": "rl-7", "trajectory": "t-42"}) as sb:
            r = sb.exec(["python3", "-c", "print(6*7)"])     # one step; blocks until it exits
            print(r.code, r.stdout)                          # 0 b'42\\n'
            r = sb.exec(["sh", "-c", "cat > f"], stdin=b"data", timeout=30)
        # leaving the block closes the sandbox (tear down, change manifest in sb.summary)

    import asyncio
    from agent.node.client import AsyncClient

    async def main():
        async with AsyncClient() as c:                    # the same calls and errors, awaited
            async with await c.create(cpus=0.5) as sb:
                r = await sb.exec(["true"])
                async for kind, value in sb.exec_stream(["sh", "-c", "echo a; echo b"]):
                    ...                                  # ("started", 1), ("stdout", b"a\n") ... ("exit", r)

Remote agents: Client("node7:7443", tls=TLS(ca="ca.pem", cert="me.pem", key="me.key")).

Errors are AgentError subclasses with the gRPC status name in `.status` and
the agent's one-line message: InvalidArgument, NotFound, PermissionDenied,
AgentUnavailable, SandboxFailed (it could not start), SandboxStopped (the
sandbox was killed/closed under a running step; `.result` has what the step
produced) and its subclass SandboxPreempted.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
from dataclasses import dataclass, field

from agent.errors import DsecError
from agent.node.runclient import DEFAULT_SOCKET, ENV_SOCKET, run_socket_path  # noqa: F401 - defined where dsec run reads them

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

MAX_MESSAGE = 256 << 20


# ---------------------------------------------------------------- errors

class AgentError(DsecError):
    def __init__(self, status: str, message: str):
        super().__init__(message, 1)
        self.status = status


class InvalidArgument(AgentError):
    pass


class NotFound(AgentError):
    pass


class PermissionDenied(AgentError):
    pass


class AgentUnavailable(AgentError):
    pass


class ResourceExhausted(AgentError):
    """The node has no room: a resize or phase that does not fit, too many sandboxes."""


class SandboxFailed(AgentError):
    """The sandbox could not start; `.reason` is the agent's reason."""

    def __init__(self, status: str, message: str, reason: str = ""):
        super().__init__(status, message)
        self.reason = reason or message


class SandboxStopped(AgentError):
    """The sandbox was stopped (killed, closed, lifetime, agent shutdown) under a step."""

    def __init__(self, status: str, message: str, result: "ExecResult | None" = None):
        super().__init__(status, message)
        self.result = result


class SandboxPreempted(SandboxStopped):
    """The scheduler preempted the sandbox for a higher-priority request."""


_BY_STATUS = {"INVALID_ARGUMENT": InvalidArgument, "NOT_FOUND": NotFound, "PERMISSION_DENIED": PermissionDenied,
              "UNAVAILABLE": AgentUnavailable, "UNAUTHENTICATED": PermissionDenied,
              "RESOURCE_EXHAUSTED": ResourceExhausted}


def _unimplemented(e) -> bool:
    import grpc
    return isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED


def grpc_aio_eof():
    import grpc.aio
    return grpc.aio.EOF


def _convert(e, result=None) -> AgentError:
    import grpc
    if not isinstance(e, grpc.RpcError):
        return e
    code = e.code()
    name = code.name if code is not None else "UNKNOWN"
    return _status_error(name, e.details() or name, result)


def _status_error(name: str, msg: str, result=None) -> AgentError:
    if name == "ABORTED":
        cls = SandboxPreempted if "preempted" in msg else SandboxStopped
        return cls(name, msg, result)
    if name == "UNAVAILABLE":
        msg = f"dsec agent unavailable: {msg}"
    return _BY_STATUS.get(name, AgentError)(name, msg)


# ---------------------------------------------------------------- values

@dataclass
class TLS:
    """Mutual TLS for a TCP agent: the CA that signed the agent's certificate,
    and this client's certificate and key (PEM files)."""
    ca: str
    cert: str
    key: str
    server_name: str | None = None     # when the address is not in the agent certificate's SAN


@dataclass
class ExecResult:
    step: int = 0
    code: int = 0                      # exit code | 128+signal | 124 timeout | 125 dsec | 126 | 127
    exit_code: int | None = None
    signal: int = 0
    timed_out: bool = False
    oom_killed: bool = False
    error: str = ""
    wall_ms: int = 0
    cpu_ms: int = 0
    max_rss_bytes: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    sandbox_state: str = ""
    sandbox_reason: str = ""
    preempted: bool = False
    summary: dict | None = None
    sandbox_id: str = ""               # run_once: the sandbox it ran in
    warm: bool = False                 # run_once: it was a warm sandbox
    stdout_dropped: int = 0            # run_once: output past max_output, read but not returned
    stderr_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass
class SandboxInfo:
    sandbox_id: str
    state: str
    reason: str = ""
    priority: str = ""
    cpus: float = 0.0
    memory: int = 0
    pids: int = 0
    labels: dict = field(default_factory=dict)
    policy_name: str = ""
    policy_hash: str = ""
    mode: str = ""
    network: str = ""
    created_ns: int = 0
    admitted_ns: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    queued_seconds: float = 0.0
    steps: int = 0
    warm: bool = False
    warm_profile: str = ""
    waiting: str = ""
    queue_position: int = -1
    preempted_for: str = ""
    node: str = ""
    cgroup_id: int = 0
    summary: dict | None = None
    timed_out: bool = False
    image: str = ""
    image_digest: str = ""
    window: dict | None = None            # a resource window: {"base", "peak", "phases": {name: {cpus, memory}}}
    phase: str = ""
    frozen: bool = False

    @property
    def ended(self) -> bool:
        return self.state in ("exited", "killed", "preempted", "failed", "cancelled")


def _info(m) -> SandboxInfo:
    return SandboxInfo(
        sandbox_id=m.sandbox_id, state=m.state, reason=m.reason, priority=m.priority, cpus=m.resources.cpus,
        memory=m.resources.memory_bytes, pids=m.resources.pids, labels=dict(m.labels), policy_name=m.policy_name,
        policy_hash=m.policy_hash, mode=m.mode, network=m.network, created_ns=m.created_ns,
        admitted_ns=m.admitted_ns, started_ns=m.started_ns, ended_ns=m.ended_ns, queued_seconds=m.queued_seconds,
        steps=m.steps, warm=m.warm, warm_profile=m.warm_profile, waiting=m.waiting,
        queue_position=m.queue_position, preempted_for=m.preempted_for, node=m.node, cgroup_id=m.cgroup_id,
        summary=json.loads(m.summary_json) if m.summary_json else None, timed_out=m.timed_out,
        image=m.image, image_digest=m.image_digest,
        window=_window_dict(m.window) if m.HasField("window") else None, phase=m.phase, frozen=m.frozen)


def _window_dict(w) -> dict:
    def r(x):
        return {"cpus": x.cpus, "memory": x.memory_bytes}
    return {"base": r(w.base), "peak": r(w.peak), "phases": {k: r(v) for k, v in w.phases.items()}}


def _window_msg(window: dict):
    """create(window={"base": {"cpus": 0.5, "memory": "512M"}, "peak": {...},
    "phases": {"rollout": {...}}, "initial_phase": "rollout"})."""
    from agent.node.proto import pb
    if not isinstance(window, dict):
        raise InvalidArgument("INVALID_ARGUMENT", "window: a dict with base, peak, phases, initial_phase")

    def res(what, r):
        if not isinstance(r, dict):
            raise InvalidArgument("INVALID_ARGUMENT", f"window.{what}: a dict with cpus and memory")
        return pb.Resources(cpus=float(r.get("cpus") or 0.0), memory_bytes=_size(r.get("memory")))
    m = pb.ResourceWindow(initial_phase=window.get("initial_phase") or "")
    for what in ("base", "peak"):
        if window.get(what) is not None:
            getattr(m, what).CopyFrom(res(what, window[what]))
    for name, r in (window.get("phases") or {}).items():
        m.phases[name].CopyFrom(res(f"phases.{name}", r))
    return m


def _resources_request(sandbox_id, cpus=None, memory=None, pids=None, force=False, thaw=False, reason=""):
    from agent.node.proto import pb
    return pb.UpdateResourcesRequest(sandbox_id=sandbox_id, resources=pb.Resources(
        cpus=float(cpus or 0.0), memory_bytes=_size(memory), pids=int(pids or 0)), force=force, thaw=thaw,
        reason=reason)


def _resources_reply(r) -> dict:
    def d(x):
        return {"cpus": x.cpus, "memory": x.memory_bytes, "pids": x.pids}
    return {"sandbox_id": r.sandbox_id, "resources": d(r.resources), "previous": d(r.previous), "thawed": r.thawed}


def _phase_reply(r) -> dict:
    return {"sandbox_id": r.sandbox_id, "phase": r.phase, "waited_seconds": r.waited_seconds,
            "resources": {"cpus": r.resources.cpus, "memory": r.resources.memory_bytes, "pids": r.resources.pids}}


def _b(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape")
    if isinstance(v, os.PathLike):
        return os.fsencode(v)
    return str(v).encode()


def _env(env) -> list:
    from agent.node.proto import pb
    return [pb.EnvVar(name=_b(k), value=_b(v)) for k, v in (env or {}).items()]


def _size(v) -> int:
    if v is None:
        return 0
    if isinstance(v, str):
        import re
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$", v)
        if not m:
            raise InvalidArgument("INVALID_ARGUMENT", f"memory {v!r}: expected a size like 512M or 1G")
        return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()])
    return int(v)


def _policy_ref(policy=None, policy_yaml=None, mode=None, source_name=None):
    from agent.node.proto import pb
    if policy is None and policy_yaml is None and not mode:
        return None
    ref = pb.PolicyRef(mode=mode or "", source_name=source_name or "")
    if policy_yaml is not None:
        ref.yaml = policy_yaml
    elif policy is not None:
        ref.name = policy
    return ref


def _create_request(*, sandbox_id=None, cpus=None, memory=None, pids=None, priority=None, policy=None,
                    policy_yaml=None, mode=None, policy_source=None, rootfs=None, network=None, labels=None,
                    env=None, workdir=None, user=None, lifetime=None, grace=None, keep=False, over_budget=None,
                    audit=True, warm=True, wait=True, image=None, volumes=None, from_snapshot=None, window=None,
                    auto_snapshot=None):
    from agent.node.proto import pb
    req = pb.CreateSandboxRequest(
        sandbox_id=sandbox_id or "", resources=pb.Resources(cpus=float(cpus or 0.0), memory_bytes=_size(memory),
                                                            pids=int(pids or 0)),
        priority=priority or "", rootfs=rootfs or "", network=network or "", labels=dict(labels or {}),
        env=_env(env), workdir=workdir or "", user=user or "", lifetime_seconds=float(lifetime or 0.0),
        grace_seconds=float(grace or 0.0), keep=keep, over_budget=over_budget or "", no_audit=not audit,
        no_warm=not warm, wait_running=wait, image=image or "", volumes=[_volume(v) for v in volumes or ()],
        from_snapshot=from_snapshot or "")
    ref = _policy_ref(policy, policy_yaml, mode, policy_source)
    if ref is not None:
        req.policy.CopyFrom(ref)
    if window is not None:
        req.window.CopyFrom(_window_msg(window))
    if auto_snapshot is not None:
        a = dict(auto_snapshot)
        unknown = set(a) - {"every_steps", "retention"}
        if unknown:
            raise InvalidArgument("INVALID_ARGUMENT", f"auto_snapshot: unknown key(s) {', '.join(sorted(unknown))} "
                                                      f"(every_steps, retention)")
        try:
            req.auto_snapshot.CopyFrom(pb.AutoSnapshot(every_steps=int(a.get("every_steps") or 0),
                                                       retention=int(a.get("retention") or 0)))
        except (TypeError, ValueError) as e:
            raise InvalidArgument("INVALID_ARGUMENT", f"auto_snapshot: {e}") from None
    return req


def _volume(v):
    """'HOST:SANDBOX[:ro|rw]', (host, sandbox[, 'rw'|'ro'|bool]) or {host, sandbox, mode}."""
    from agent.node.proto import pb
    if isinstance(v, str):
        parts = v.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise InvalidArgument("INVALID_ARGUMENT", f"volume {v!r}: expected HOST:SANDBOX[:ro|rw]")
        return pb.Volume(host_path=parts[0], sandbox_path=parts[1], read_write=len(parts) == 3 and parts[2] == "rw")
    if isinstance(v, dict):
        return pb.Volume(host_path=v["host"], sandbox_path=v["sandbox"], read_write=v.get("mode") == "rw")
    host, sandbox, *mode = v
    rw = bool(mode) and (mode[0] is True or mode[0] == "rw")
    return pb.Volume(host_path=host, sandbox_path=sandbox, read_write=rw)


def _check_argv(argv):
    if isinstance(argv, (str, bytes)):
        raise InvalidArgument("INVALID_ARGUMENT", "argv: a list of arguments, not one string "
                                                  "(use ['sh', '-c', cmd] for a shell command)")


def _exec_start(sandbox_id, argv, *, env=None, workdir=None, stdin=None, close_stdin=True, timeout=None,
                grace=None, close_after=False, wait_export=False, started=True):
    from agent.node.proto import pb
    _check_argv(argv)
    return pb.ExecInput(start=pb.ExecStart(
        sandbox_id=sandbox_id, argv=[_b(a) for a in argv], env=_env(env), workdir=workdir or "",
        stdin=_b(stdin) if stdin is not None else b"", close_stdin=close_stdin, timeout_seconds=float(timeout or 0),
        grace_seconds=float(grace or 0), close_after=close_after, wait_export=wait_export,
        no_started=not started))


def _exit(m, out: bytearray, err: bytearray) -> ExecResult:
    return ExecResult(step=m.step, code=m.code, exit_code=m.exit_code if m.HasField("exit_code") else None,
                      signal=m.signal, timed_out=m.timed_out, oom_killed=m.oom_killed, error=m.error,
                      wall_ms=m.wall_ms, cpu_ms=m.cpu_ms, max_rss_bytes=m.max_rss_bytes, stdout=bytes(out),
                      stderr=bytes(err), sandbox_state=m.sandbox_state, sandbox_reason=m.sandbox_reason,
                      preempted=m.preempted, summary=json.loads(m.summary_json) if m.summary_json else None)


def _exit_json(d: dict, out: bytearray, err: bytearray) -> ExecResult:
    """A step socket's exit (agent/node/stepclient.py) as _exit makes a gRPC ExitStatus one."""
    return ExecResult(step=d["step"], code=d["code"], exit_code=d.get("exit_code"), signal=d.get("signal") or 0,
                      timed_out=bool(d.get("timed_out")), oom_killed=bool(d.get("oom_killed")),
                      error=d.get("error") or "", wall_ms=d.get("wall_ms") or 0, cpu_ms=d.get("cpu_ms") or 0,
                      max_rss_bytes=d.get("max_rss_bytes") or 0, stdout=bytes(out), stderr=bytes(err),
                      sandbox_state=d.get("sandbox_state") or "", sandbox_reason=d.get("sandbox_reason") or "",
                      preempted=bool(d.get("preempted")), summary=d.get("summary"))


def _step_frame(steps, sandbox_id, argv, stdin, stdin_stream, **kw) -> bytes | None:
    """The step as a step-socket frame when it can go that way (a unix-socket agent that serves
    it, no stdin stream, stdin small enough), else None (gRPC)."""
    if steps is None or not steps.supported or stdin_stream is not None:
        return None
    from agent.node.stepclient import step_request
    _check_argv(argv)
    return step_request(sandbox_id, argv, stdin=_b(stdin) if stdin is not None else None, **kw)


def _step_error(e, out: bytearray, err: bytearray, result) -> AgentError:
    if result is None and (out or err):
        result = ExecResult(stdout=bytes(out), stderr=bytes(err))
    return _status_error(e.code, e.message, result)


# the calls the run socket's frames carry (agent/node/callsock.py); the others are gRPC's
_FRAMED = frozenset(("CreateSandbox", "RunOnce", "Wait", "Kill", "CloseSandbox", "Get"))


def _call_frame(conns, method: str, req, timeout) -> bytes | None:
    """The call as a U frame when it can go over the run socket (a unix-socket agent that serves
    calls there, one of _FRAMED), else None (gRPC)."""
    if conns is None or not conns.calls or method not in _FRAMED:
        return None
    from agent.node.stepclient import call_request
    return call_request(method, req.SerializeToString(), timeout)


def _call_reply(method: str, payload: bytes):
    """A U call's reply bytes as the message gRPC's stub returns for `method`."""
    from agent.node.proto import pb
    out = pb.DESCRIPTOR.services_by_name["Agent"].methods_by_name[method].output_type
    return getattr(pb, out.name).FromString(payload)


def _exec_item(m, out: bytearray, err: bytearray):
    """One ExecOutput message -> ("started", step) | ("stdout"|"stderr", bytes) | ("exit", ExecResult);
    output is also appended to out/err."""
    kind = m.WhichOneof("msg")
    if kind == "stdout":
        out += m.stdout
        return ("stdout", m.stdout)
    if kind == "stderr":
        err += m.stderr
        return ("stderr", m.stderr)
    if kind == "started":
        return ("started", m.started.step)
    if kind == "exit":
        return ("exit", _exit(m.exit, out, err))
    return None


RUN_ONCE_OUTPUT = 4 << 20           # what run_once keeps of each stream by default (as the agent)


def _run_once_request(argv, *, stdin=None, timeout=None, grace=None, wait_export=False, max_output=None,
                      **spec):
    from agent.node.proto import pb
    ex = _exec_start("", argv, stdin=stdin, close_stdin=True, timeout=timeout, grace=grace, close_after=True,
                     wait_export=wait_export).start
    if max_output is not None and (not isinstance(max_output, int) or max_output < 1):
        raise InvalidArgument("INVALID_ARGUMENT", f"max_output: a number of bytes >= 1, got {max_output!r}")
    return pb.RunOnceRequest(create=_create_request(wait=True, **spec), exec=ex,
                             max_output_bytes=max_output or 0)


def _run_once_result(m) -> ExecResult:
    info = _info(m.sandbox)
    if not m.HasField("exit"):
        raise SandboxFailed("FAILED_PRECONDITION", f"sandbox {info.sandbox_id} failed: {info.reason}", info.reason)
    r = _exit(m.exit, m.stdout, m.stderr)
    r.sandbox_id, r.stdout_dropped, r.stderr_dropped = info.sandbox_id, m.stdout_dropped_bytes, m.stderr_dropped_bytes
    r.warm = info.warm
    if m.error_code:                    # stopped under the step: what Exec raises after its exit
        raise _status_error(m.error_code, m.error_message, r)
    return r


def _capped(r: ExecResult, sb, cap: int) -> ExecResult:
    """A fallback run_once's result as RunOnce returns it (the first `cap` bytes of each stream)."""
    r.sandbox_id, r.warm = sb.id, bool(sb.created and sb.created.warm)
    r.stdout_dropped, r.stderr_dropped = max(len(r.stdout) - cap, 0), max(len(r.stderr) - cap, 0)
    r.stdout, r.stderr = r.stdout[:cap], r.stderr[:cap]
    return r


def default_target() -> str:
    return "unix:" + (os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET)


def _accepts(path: str) -> bool:
    """Something listens on the unix socket `path` (a stale socket file: False, at once)."""
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _normalize_target(target: str | None) -> str:
    target = target or default_target()
    if target.startswith("/"):
        target = "unix:" + target
    return target


def _options(tls: TLS | None):
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.enable_retries", 0)]
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def _credentials(tls: TLS):
    import grpc
    with open(tls.ca, "rb") as f:
        ca = f.read()
    with open(tls.cert, "rb") as f:
        cert = f.read()
    with open(tls.key, "rb") as f:
        key = f.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _check_target(target: str, tls: TLS | None):
    if not target.startswith("unix:") and tls is None:
        raise AgentError("INVALID_ARGUMENT", f"{target}: a TCP agent is only reachable with mutual TLS "
                                             f"(pass tls=TLS(ca=..., cert=..., key=...))")


def agent_available(target: str | None = None, timeout: float = 1.0) -> bool:
    """True when an agent answers at `target` (default: the local unix socket)."""
    target = _normalize_target(target)
    if target.startswith("unix:") and not os.path.exists(target[5:]):
        return False
    try:
        with Client(target, connect_timeout=timeout) as c:
            c.capabilities(timeout=timeout)
        return True
    except (AgentError, OSError):
        return False


class _Inputs:
    """The request stream of an Exec call: start, then whatever is put()."""

    _END = object()

    def __init__(self, first):
        self.q: queue.Queue = queue.Queue()
        self.q.put(first)

    def put(self, msg):
        self.q.put(msg)

    def end(self):
        self.q.put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        m = self.q.get()
        if m is self._END:
            raise StopIteration
        return m


# ================================================================= synchronous client

class Client:
    """A connection to a dsec agent. Thread-safe; use one per process."""

    def __init__(self, target: str | None = None, *, tls: TLS | None = None, timeout: float = 60.0,
                 connect_timeout: float = 5.0, step_socket: bool = True):
        import grpc
        from agent.node.proto import pb_grpc
        self.target = _normalize_target(target)
        _check_target(self.target, tls)
        self.timeout = timeout
        # steps in live sandboxes over the agent's run socket, not gRPC (agent/node/stepclient.py;
        # step_socket=False: always gRPC)
        self._steps = None
        if step_socket and tls is None and self.target.startswith("unix:"):
            from agent.node.stepclient import StepConnections
            self._steps = StepConnections(run_socket_path(self.target[len("unix:"):]))
        # server-streaming calls (ExecOnce, events) read on the caller's thread, not through
        # gRPC's channel spin thread: one thread hop less per message (grpc.experimental.ChannelOptions
        # .SingleThreadedUnaryStream; importing grpc.experimental costs start-up time)
        opts = _options(tls) + [("SingleThreadedUnaryStream", 1)]
        if tls is None:
            self._channel = grpc.insecure_channel(self.target, options=opts)
        else:
            self._channel = grpc.secure_channel(self.target, _credentials(tls), options=opts)
        self.stub = pb_grpc.AgentStub(self._channel)
        self.connect_timeout = connect_timeout
        self._ready = False
        self._no_exec_once = False          # the agent predates ExecOnce (answered UNIMPLEMENTED)
        self._no_run_once = False           # ... RunOnce

    def _connect(self):
        if self._ready:
            return
        import grpc
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.connect_timeout)
        except grpc.FutureTimeoutError:
            raise AgentUnavailable("UNAVAILABLE", f"no dsec agent answers at {self.target} "
                                                  f"(is `dsec agent` running?)") from None
        self._ready = True

    def wait_ready(self, timeout: float | None = None):
        """Connect (no call): AgentUnavailable when nothing answers within timeout.
        A unix socket that accepts a connection counts as ready at once: gRPC's
        channel_ready_future would start a connectivity poller whose 0.2 s watches
        hold up close() (a CLI pays ~0.1-0.2 s at exit for it)."""
        if timeout is not None:
            self.connect_timeout = timeout
        if self.target.startswith("unix:") and _accepts(self.target[len("unix:"):]):
            self._ready = True
            return
        self._connect()

    def _unary(self, method, req, timeout=None):
        return self._call(method, req, timeout if timeout is not None else self.timeout)

    def _call(self, method, req, timeout):
        """One unary call (timeout: its deadline, None = none): over the run socket's frames when
        it can go there (agent/node/callsock.py), else gRPC; either way the same reply or error."""
        frame = _call_frame(self._steps, method, req, timeout)
        if frame is not None:
            from agent.node.stepclient import StepError, Unsupported, run_call
            try:
                return _call_reply(method, run_call(self._steps, frame, timeout))
            except Unsupported:
                pass                    # nothing ran: gRPC below
            except StepError as e:
                raise _status_error(e.code, e.message) from None
        self._connect()
        try:
            return getattr(self.stub, method)(req, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise _convert(e) from None

    def close(self):
        if self._steps is not None:
            self._steps.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- sandboxes
    def create(self, *, wait: bool = True, timeout: float | None = None, **spec) -> "Sandbox":
        """Create a sandbox. spec: sandbox_id, cpus, memory (bytes or '512M'), pids, priority
        (reserved|standard|preemptible), policy (name), policy_yaml (text), mode, rootfs,
        network (none|egress), labels, env, workdir, user, lifetime, grace, keep, over_budget,
        audit (bool), warm (bool), image (NAME[:TAG] or a digest of the agent's image store),
        volumes (['HOST:SANDBOX[:ro|rw]', ...], from the agent's volumes.allowed_roots), window (a
        resource window instead of cpus/memory: {"base": {"cpus", "memory"}, "peak": {...},
        "phases": {name: {...}}, "initial_phase"}), auto_snapshot ({"every_steps": k, "retention": n}:
        this sandbox's automatic snapshots instead of the agent's `snapshots` config; every_steps 0 =
        none). wait=True returns once it runs (a queued request
        waits its turn, up to `timeout` seconds: then AgentError DEADLINE_EXCEEDED, and the agent
        closes the request); SandboxFailed if it could not start."""
        req = _create_request(wait=wait, **spec)
        m = self._unary("CreateSandbox", req, timeout=timeout if wait else None)
        info = _info(m)
        if info.state == "failed":
            raise SandboxFailed("FAILED_PRECONDITION", f"sandbox {info.sandbox_id} failed: {info.reason}",
                                info.reason)
        return Sandbox(self, info.sandbox_id, info)

    def run_once(self, argv, *, stdin=None, timeout=None, grace=None, wait_export=False, max_output=None,
                 call_timeout: float | None = None, **spec) -> ExecResult:
        """A one-shot run: create a sandbox (spec: as create()), run `argv` in it (stdin: all of
        it, bytes), close it, in one RunOnce call (an agent that predates RunOnce gets create +
        exec(close_after)). Returns the ExecResult with .summary and .sandbox_id; its stdout and
        stderr are the first `max_output` bytes of each (default 4 MiB), .stdout_dropped and
        .stderr_dropped count the rest. Raises as create() and exec() do. call_timeout: the
        whole call's deadline (default none; the step's own is `timeout`)."""
        req = _run_once_request(argv, stdin=stdin, timeout=timeout, grace=grace, wait_export=wait_export,
                                max_output=max_output, **spec)
        if not self._no_run_once:
            try:
                m = self._call("RunOnce", req, call_timeout)
            except AgentError as e:
                if e.status != "UNIMPLEMENTED":
                    raise
                self._no_run_once = True
            else:
                return _run_once_result(m)
        sb = self.create(timeout=call_timeout, **spec)
        r = self.exec(sb.id, argv, stdin=stdin, timeout=timeout, grace=grace, close_after=True,
                      wait_export=wait_export)
        return _capped(r, sb, max_output or RUN_ONCE_OUTPUT)

    def snapshot(self, sandbox_id: str, timeout: float | None = None) -> dict:
        """Snapshot a running sandbox (frozen while its writable layer is copied): the
        snapshot's record (id, step, files, bytes, frozen_ms, changes ...)."""
        from agent.node.proto import pb
        m = self._unary("Snapshot", pb.SnapshotRequest(sandbox_id=sandbox_id), timeout=timeout)
        return json.loads(m.json)

    def restore(self, sandbox_id: str, snapshot_id: str, force: bool = False, timeout: float | None = None) -> dict:
        """Roll a running sandbox back to a snapshot (processes of later steps are ended;
        a running step only with force=True)."""
        from agent.node.proto import pb
        m = self._unary("Restore", pb.RestoreRequest(sandbox_id=sandbox_id, snapshot_id=snapshot_id, force=force),
                        timeout=timeout)
        return {"sandbox_id": m.sandbox_id, "snapshot": m.snapshot_id, "step": m.step, "total_ms": m.total_ms}

    def fork(self, snapshot_id: str, n: int, **spec) -> list["Sandbox"]:
        """n new sandboxes from one snapshot, each with its own writable layer over the
        snapshot's (shared on disk); their sandbox_start records the lineage."""
        return [self.create(from_snapshot=snapshot_id, warm=False, **spec) for _ in range(int(n))]

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        return Sandbox(self, sandbox_id)

    def get(self, sandbox_id: str) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(self._unary("Get", pb.GetRequest(sandbox_id=sandbox_id)))

    def list(self, labels: dict | None = None, states=None, limit: int = 0) -> list[SandboxInfo]:
        from agent.node.proto import pb
        r = self._unary("List", pb.ListRequest(labels=labels or {}, states=list(states or ()), limit=limit))
        return [_info(m) for m in r.sandboxes]

    def wait(self, sandbox_id: str, until: str = "ended", timeout: float | None = None) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(self._unary("Wait", pb.WaitRequest(sandbox_id=sandbox_id, until=until,
                                                        timeout_seconds=float(timeout or 0)),
                                 timeout=None if timeout is None else timeout + 30))

    def kill(self, sandbox_id: str, grace: float | None = None, reason: str = "") -> SandboxInfo:
        from agent.node.proto import pb
        req = pb.KillRequest(sandbox_id=sandbox_id, reason=reason)
        if grace is not None:
            req.grace_seconds = float(grace)
        return _info(self._unary("Kill", req, timeout=None))

    def close_sandbox(self, sandbox_id: str) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(self._unary("CloseSandbox", pb.CloseRequest(sandbox_id=sandbox_id), timeout=None))

    def update_policy(self, sandbox_id: str, policy: str | None = None, policy_yaml: str | None = None,
                      mode: str | None = None) -> dict:
        from agent.node.proto import pb
        req = pb.UpdatePolicyRequest(sandbox_id=sandbox_id)
        ref = _policy_ref(policy, policy_yaml, mode)
        if ref is not None:
            req.policy.CopyFrom(ref)
        r = self._unary("UpdatePolicy", req)
        return {"sandbox_id": r.sandbox_id, "policy_name": r.policy_name, "policy_hash": r.policy_hash,
                "mode": r.mode, "applied": list(r.applied), "syscalls": r.syscalls}

    def capabilities(self, timeout: float | None = None) -> dict:
        from agent.node.proto import pb
        m = self._unary("Capabilities", pb.CapabilitiesRequest(), timeout=timeout)
        return _caps(m)

    def update_resources(self, sandbox_id: str, cpus=None, memory=None, pids=None, *, force: bool = False,
                         thaw: bool = False, reason: str = "") -> dict:
        """New limits for a running sandbox (None = unchanged): ResourceExhausted when the node
        has no room for the growth; AgentError FAILED_PRECONDITION for memory below its usage
        (unless force). Returns {"resources", "previous", "thawed"}."""
        return _resources_reply(self._unary("UpdateResources", _resources_request(
            sandbox_id, cpus, memory, pids, force, thaw, reason), timeout=None))

    def set_phase(self, sandbox_id: str, phase: str, *, wait: float = 0.0, force: bool = False) -> dict:
        """Switch a windowed sandbox to `phase`, waiting up to `wait` seconds for room
        (ResourceExhausted after that, with the reason)."""
        from agent.node.proto import pb
        return _phase_reply(self._unary("SetPhase", pb.SetPhaseRequest(sandbox_id=sandbox_id, phase=phase,
                                                                       wait_seconds=float(wait), force=force),
                                        timeout=wait + 30))

    # -- steps
    def exec_stream(self, sandbox_id: str, argv, *, stdin=None, stdin_stream=None, env=None, workdir=None,
                    timeout=None, grace=None, close_after=False, wait_export=False, inputs: _Inputs | None = None,
                    started=True):
        """Yield ("started", step), ("stdout", bytes), ("stderr", bytes), then ("exit", ExecResult).
        stdin: bytes; stdin_stream: an iterable of byte chunks; inputs: an _Inputs for callers that
        also forward signals (dsec run); started=False: no ("started", step) (the agent does not
        send it; the step is the result's)."""
        from agent.node.proto import pb
        frame = None if inputs is not None else _step_frame(
            self._steps, sandbox_id, argv, stdin, stdin_stream, env=env, workdir=workdir, timeout=timeout,
            grace=grace, close_after=close_after, wait_export=wait_export, started=started)
        if frame is not None:
            from agent.node.stepclient import StepError, Unsupported, run_step
            out, err = bytearray(), bytearray()
            result = final = None
            gen = run_step(self._steps, frame)
            try:
                for item in gen:
                    if item[0] == "exit":
                        final = item[1]
                        result = _exit_json(final, out, err)
                        continue
                    if item[0] == "stdout":
                        out += item[1]
                    elif item[0] == "stderr":
                        err += item[1]
                    yield item
            except Unsupported:
                pass                    # nothing ran: gRPC below
            except StepError as e:
                raise _step_error(e, out, err, result) from None
            else:
                if final.get("error_code"):
                    raise _status_error(final["error_code"], final.get("error_message") or "", result)
                yield ("exit", result)
                return
            finally:
                gen.close()             # left early: the connection closes, the step stops
        self._connect()
        if inputs is None:
            first = _exec_start(sandbox_id, argv, env=env, workdir=workdir, stdin=stdin,
                                close_stdin=stdin_stream is None, timeout=timeout, grace=grace,
                                close_after=close_after, wait_export=wait_export, started=started)

            def gen():
                yield first
                if stdin_stream is not None:
                    for chunk in stdin_stream:
                        yield pb.ExecInput(stdin=_b(chunk))
                    yield pb.ExecInput(close_stdin=True)
            requests = gen()
        else:
            requests = inputs
        # no stdin to stream: ExecOnce, a call without a request stream (gRPC's client would start a
        # thread per call to send one); an agent older than ExecOnce gets Exec
        once = inputs is None and stdin_stream is None and not self._no_exec_once
        call = self.stub.ExecOnce(first.start) if once else self.stub.Exec(requests)
        out, err = bytearray(), bytearray()
        result = final = None
        try:
            try:
                first_m = next(call, None)
            except Exception as e:  # noqa: BLE001
                if not (once and _unimplemented(e)):
                    raise
                self._no_exec_once = True
                call = self.stub.Exec(requests)
                first_m = next(call, None)
            for m in itertools.chain(() if first_m is None else (first_m,), call):
                item = _exec_item(m, out, err)
                if item is None:
                    continue
                if item[0] == "exit":
                    result = item[1]
                    if m.exit.final:    # it says how the call ends: no wait for the status behind it
                        final = m.exit
                        break
                else:
                    yield item
        except Exception as e:  # noqa: BLE001
            if result is None and (out or err):
                result = ExecResult(stdout=bytes(out), stderr=bytes(err))
            raise _convert(e, result) from None
        finally:
            if result is None or final is not None:     # stopped early, an error, or done: end the call
                call.cancel()
        if result is None:
            raise AgentError("UNKNOWN", "the agent ended the step without an exit status")
        if final is not None and final.error_code:
            raise _status_error(final.error_code, final.error_message, result)
        yield ("exit", result)

    def exec(self, sandbox_id: str, argv, *, on_stdout=None, on_stderr=None, **kw) -> ExecResult:
        result = None
        for kind, value in self.exec_stream(sandbox_id, argv, started=False, **kw):
            if kind == "stdout" and on_stdout:
                on_stdout(value)
            elif kind == "stderr" and on_stderr:
                on_stderr(value)
            elif kind == "exit":
                result = value
        return result

    # -- events
    def events(self, sandbox=None, kinds=None, decisions=None, labels=None):
        """Live audit events (a tail -f): yields dicts with every audit field; a
        {"lost": N, "reason": ...} dict when this stream fell behind. Runs until closed."""
        from agent.node.proto import pb
        self._connect()
        sandboxes = [sandbox] if isinstance(sandbox, str) else list(sandbox or ())
        call = self.stub.StreamEvents(pb.StreamEventsRequest(sandbox_ids=sandboxes, kinds=list(kinds or ()),
                                                             decisions=list(decisions or ()),
                                                             labels=dict(labels or {})))
        try:
            for m in call:
                if m.WhichOneof("msg") == "lost":
                    yield {"lost": m.lost.count, "reason": m.lost.reason}
                else:
                    yield json.loads(m.event.json)
        except Exception as e:  # noqa: BLE001
            import grpc
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise _convert(e) from None
        finally:
            call.cancel()

    def query_events(self, sandbox_id: str, kinds=None, limit: int = 0, flush_timeout: float = 0.0):
        """Recorded events of one sandbox (from ClickHouse, after the agent delivered its spool)."""
        from agent.node.proto import pb
        self._connect()
        call = self.stub.QueryEvents(pb.QueryEventsRequest(sandbox_id=sandbox_id, kinds=list(kinds or ()),
                                                           limit=limit, flush_timeout_seconds=flush_timeout))
        try:
            for m in call:
                yield json.loads(m.event.json)
        except Exception as e:  # noqa: BLE001
            raise _convert(e) from None


def _caps(m) -> dict:
    return {"node": m.node, "agent_version": m.agent_version, "kernel": m.kernel, "cgroup_mode": m.cgroup_mode,
            "audit": {"available": m.audit.available, "detail": m.audit.detail, "missing": list(m.audit.missing)},
            "enforcement": {"available": m.enforcement.available, "detail": m.enforcement.detail,
                            "missing": list(m.enforcement.missing)},
            "degraded": list(m.degraded), "capacity": json.loads(m.capacity_json or "{}"),
            "warm_profiles": [{"name": w.name, "count": w.count, "ready": w.ready,
                               "spec": json.loads(w.spec_json or "{}")} for w in m.warm_profiles],
            "limits": json.loads(m.limits_json or "{}"), "transports": list(m.transports), "pid": m.pid,
            "started_ns": m.started_ns, "images": json.loads(m.images_json or "{}"),
            "snapshots": json.loads(m.snapshots_json or "{}")}


class Sandbox:
    """A handle on one sandbox of an agent (no state of its own besides the id)."""

    def __init__(self, client: Client, sandbox_id: str, info: SandboxInfo | None = None):
        self.client = client
        self.id = sandbox_id
        self.created = info
        self.summary: dict | None = None

    def __repr__(self):
        return f"Sandbox({self.id!r})"

    def info(self) -> SandboxInfo:
        return self.client.get(self.id)

    def wait(self, until: str = "ended", timeout: float | None = None) -> SandboxInfo:
        return self.client.wait(self.id, until, timeout)

    def exec(self, argv, **kw) -> ExecResult:
        """One step. kw: stdin (bytes), stdin_stream, env, workdir, timeout, grace,
        on_stdout / on_stderr (callbacks per chunk). Returns ExecResult; raises
        SandboxPreempted / SandboxStopped if the sandbox is stopped under the step."""
        return self.client.exec(self.id, argv, **kw)

    def exec_stream(self, argv, **kw):
        return self.client.exec_stream(self.id, argv, **kw)

    def kill(self, grace: float | None = None, reason: str = "") -> SandboxInfo:
        return self.client.kill(self.id, grace, reason)

    def close(self) -> SandboxInfo:
        info = self.client.close_sandbox(self.id)
        self.summary = info.summary
        return info

    def update_policy(self, policy: str | None = None, policy_yaml: str | None = None, mode: str | None = None):
        return self.client.update_policy(self.id, policy, policy_yaml, mode)

    def update_resources(self, cpus=None, memory=None, pids=None, **kw) -> dict:
        return self.client.update_resources(self.id, cpus, memory, pids, **kw)

    def set_phase(self, phase: str, **kw) -> dict:
        return self.client.set_phase(self.id, phase, **kw)

    def events(self, kinds=None, decisions=None):
        return self.client.events(self.id, kinds, decisions)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except AgentError:
            if exc[0] is None:
                raise
        return False


# ================================================================= asyncio client

class AsyncClient:
    """The same API for asyncio code (grpc.aio), with the same errors. Create it inside
    the event loop:

        async with AsyncClient() as c:
            async with await c.create(labels={"trajectory": "t-1"}) as sb:
                r = await sb.exec(["python3", "-c", "print(1)"], timeout=30)
                async for kind, value in sb.exec_stream(["sh", "-c", "echo a; sleep 1; echo b"]):
                    ...   # ("started", step), ("stdout", b"a\n"), ..., ("exit", ExecResult)

    Cancelling the task that awaits a step cancels the call: the agent stops the
    step (SIGTERM, grace, SIGKILL), as when a blocking client goes away."""

    def __init__(self, target: str | None = None, *, tls: TLS | None = None, timeout: float = 60.0,
                 connect_timeout: float = 5.0, step_socket: bool = True):
        import grpc
        from agent.node.proto import pb_grpc
        self.target = _normalize_target(target)
        _check_target(self.target, tls)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._steps = None              # as Client's: steps over the run socket
        if step_socket and tls is None and self.target.startswith("unix:"):
            from agent.node.stepclient import AsyncStepConnections
            self._steps = AsyncStepConnections(run_socket_path(self.target[len("unix:"):]))
        if tls is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=_options(None))
        else:
            self._channel = grpc.aio.secure_channel(self.target, _credentials(tls), options=_options(tls))
        self.stub = pb_grpc.AgentStub(self._channel)
        self._ready = False
        self._no_exec_once = False          # the agent predates ExecOnce (answered UNIMPLEMENTED)
        self._no_run_once = False           # ... RunOnce

    async def _connect(self):
        if self._ready:
            return
        import asyncio
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.connect_timeout)
        except asyncio.TimeoutError:
            raise AgentUnavailable("UNAVAILABLE", f"no dsec agent answers at {self.target} "
                                                  f"(is `dsec agent` running?)") from None
        self._ready = True

    async def _unary(self, method, req, timeout=None, orphan=None):
        return await self._call(method, req, timeout if timeout is not None else self.timeout, orphan)

    async def _call(self, method, req, timeout, orphan=None):
        """As Client._call. orphan: see stepclient.run_call_async (a cancelled create's sandbox)."""
        frame = _call_frame(self._steps, method, req, timeout)
        if frame is not None:
            from agent.node.stepclient import StepError, Unsupported, run_call_async
            try:
                return _call_reply(method, await run_call_async(self._steps, frame, timeout, orphan))
            except Unsupported:
                pass                    # nothing ran: gRPC below
            except StepError as e:
                raise _status_error(e.code, e.message) from None
        await self._connect()
        try:
            return await getattr(self.stub, method)(req, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise _convert(e) from None

    async def close(self):
        if self._steps is not None:
            self._steps.close()
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
        return False

    # -- sandboxes
    async def create(self, *, wait: bool = True, timeout: float | None = None, **spec) -> "AsyncSandbox":
        """As Client.create (same spec keywords, same errors). A task cancelled while it awaits
        the sandbox leaves none behind: the agent closes it, or this client does if its reply
        was on its way."""
        req = _create_request(wait=wait, **spec)

        async def orphan(payload):
            left = _info(_call_reply("CreateSandbox", payload))
            if not left.ended:
                await self.close_sandbox(left.sandbox_id)
        info = _info(await self._unary("CreateSandbox", req, timeout=timeout if wait else None, orphan=orphan))
        if info.state == "failed":
            raise SandboxFailed("FAILED_PRECONDITION", f"sandbox {info.sandbox_id} failed: {info.reason}",
                                info.reason)
        return AsyncSandbox(self, info.sandbox_id, info)

    def sandbox(self, sandbox_id: str) -> "AsyncSandbox":
        return AsyncSandbox(self, sandbox_id)

    async def run_once(self, argv, *, stdin=None, timeout=None, grace=None, wait_export=False, max_output=None,
                       call_timeout: float | None = None, **spec) -> ExecResult:
        """As Client.run_once: create + one step + close in one RunOnce call. Cancelling the task
        cancels the call: the agent stops the step and ends the sandbox."""
        req = _run_once_request(argv, stdin=stdin, timeout=timeout, grace=grace, wait_export=wait_export,
                                max_output=max_output, **spec)
        if not self._no_run_once:
            try:
                m = await self._call("RunOnce", req, call_timeout)
            except AgentError as e:
                if e.status != "UNIMPLEMENTED":
                    raise
                self._no_run_once = True
            else:
                return _run_once_result(m)
        sb = await self.create(timeout=call_timeout, **spec)
        r = await self.exec(sb.id, argv, stdin=stdin, timeout=timeout, grace=grace, close_after=True,
                            wait_export=wait_export)
        return _capped(r, sb, max_output or RUN_ONCE_OUTPUT)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(await self._unary("Get", pb.GetRequest(sandbox_id=sandbox_id)))

    async def list(self, labels: dict | None = None, states=None, limit: int = 0) -> list[SandboxInfo]:
        from agent.node.proto import pb
        r = await self._unary("List", pb.ListRequest(labels=labels or {}, states=list(states or ()), limit=limit))
        return [_info(m) for m in r.sandboxes]

    async def wait(self, sandbox_id: str, until: str = "ended", timeout: float | None = None) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(await self._unary("Wait", pb.WaitRequest(sandbox_id=sandbox_id, until=until,
                                                              timeout_seconds=float(timeout or 0)),
                                       timeout=None if timeout is None else timeout + 30))

    async def kill(self, sandbox_id: str, grace: float | None = None, reason: str = "") -> SandboxInfo:
        from agent.node.proto import pb
        req = pb.KillRequest(sandbox_id=sandbox_id, reason=reason)
        if grace is not None:
            req.grace_seconds = float(grace)
        return _info(await self._unary("Kill", req, timeout=None))

    async def close_sandbox(self, sandbox_id: str) -> SandboxInfo:
        from agent.node.proto import pb
        return _info(await self._unary("CloseSandbox", pb.CloseRequest(sandbox_id=sandbox_id), timeout=None))

    async def update_policy(self, sandbox_id: str, policy=None, policy_yaml=None, mode=None) -> dict:
        from agent.node.proto import pb
        req = pb.UpdatePolicyRequest(sandbox_id=sandbox_id)
        ref = _policy_ref(policy, policy_yaml, mode)
        if ref is not None:
            req.policy.CopyFrom(ref)
        r = await self._unary("UpdatePolicy", req)
        return {"sandbox_id": r.sandbox_id, "policy_name": r.policy_name, "policy_hash": r.policy_hash,
                "mode": r.mode, "applied": list(r.applied), "syscalls": r.syscalls}

    async def capabilities(self, timeout: float | None = None) -> dict:
        from agent.node.proto import pb
        return _caps(await self._unary("Capabilities", pb.CapabilitiesRequest(), timeout=timeout))

    async def update_resources(self, sandbox_id: str, cpus=None, memory=None, pids=None, *, force: bool = False,
                               thaw: bool = False, reason: str = "") -> dict:
        return _resources_reply(await self._unary("UpdateResources", _resources_request(
            sandbox_id, cpus, memory, pids, force, thaw, reason), timeout=None))

    async def snapshot(self, sandbox_id: str, timeout: float | None = None) -> dict:
        """As Client.snapshot: the snapshot's record."""
        from agent.node.proto import pb
        m = await self._unary("Snapshot", pb.SnapshotRequest(sandbox_id=sandbox_id), timeout=timeout)
        return json.loads(m.json)

    async def restore(self, sandbox_id: str, snapshot_id: str, force: bool = False,
                      timeout: float | None = None) -> dict:
        """As Client.restore."""
        from agent.node.proto import pb
        m = await self._unary("Restore", pb.RestoreRequest(sandbox_id=sandbox_id, snapshot_id=snapshot_id,
                                                           force=force), timeout=timeout)
        return {"sandbox_id": m.sandbox_id, "snapshot": m.snapshot_id, "step": m.step, "total_ms": m.total_ms}

    async def fork(self, snapshot_id: str, n: int, **spec) -> list["AsyncSandbox"]:
        """n new sandboxes from one snapshot, created concurrently (as Client.fork)."""
        import asyncio
        return list(await asyncio.gather(*(self.create(from_snapshot=snapshot_id, warm=False, **spec)
                                           for _ in range(int(n)))))

    async def set_phase(self, sandbox_id: str, phase: str, *, wait: float = 0.0, force: bool = False) -> dict:
        from agent.node.proto import pb
        return _phase_reply(await self._unary("SetPhase", pb.SetPhaseRequest(
            sandbox_id=sandbox_id, phase=phase, wait_seconds=float(wait), force=force), timeout=wait + 30))

    # -- steps
    async def exec_stream(self, sandbox_id: str, argv, *, stdin=None, stdin_stream=None, env=None, workdir=None,
                          timeout=None, grace=None, close_after=False, wait_export=False, started=True):
        """An async generator of ("started", step), ("stdout", bytes), ("stderr", bytes), then
        ("exit", ExecResult). stdin: bytes; stdin_stream: an async (or plain) iterable of byte
        chunks; started=False: no ("started", step). Leaving the loop early (or cancelling the
        task) cancels the call."""
        from agent.node.proto import pb
        frame = _step_frame(self._steps, sandbox_id, argv, stdin, stdin_stream, env=env, workdir=workdir,
                            timeout=timeout, grace=grace, close_after=close_after, wait_export=wait_export,
                            started=started)
        if frame is not None:
            from agent.node.stepclient import StepError, Unsupported, run_step_async
            out, err = bytearray(), bytearray()
            result = final = None
            gen = run_step_async(self._steps, frame)
            try:
                async for item in gen:
                    if item[0] == "exit":
                        final = item[1]
                        result = _exit_json(final, out, err)
                        continue
                    if item[0] == "stdout":
                        out += item[1]
                    elif item[0] == "stderr":
                        err += item[1]
                    yield item
            except Unsupported:
                pass                    # nothing ran: gRPC below
            except StepError as e:
                raise _step_error(e, out, err, result) from None
            else:
                if final.get("error_code"):
                    raise _status_error(final["error_code"], final.get("error_message") or "", result)
                yield ("exit", result)
                return
            finally:
                await gen.aclose()      # left early or cancelled: the connection closes, the step stops
        first = _exec_start(sandbox_id, argv, env=env, workdir=workdir, stdin=stdin,
                            close_stdin=stdin_stream is None, timeout=timeout, grace=grace,
                            close_after=close_after, wait_export=wait_export, started=started)
        await self._connect()

        async def requests():
            yield first
            if stdin_stream is not None:
                if hasattr(stdin_stream, "__aiter__"):
                    async for chunk in stdin_stream:
                        yield pb.ExecInput(stdin=_b(chunk))
                else:
                    for chunk in stdin_stream:
                        yield pb.ExecInput(stdin=_b(chunk))
                yield pb.ExecInput(close_stdin=True)
        once = stdin_stream is None and not self._no_exec_once
        call = self.stub.ExecOnce(first.start) if once else self.stub.Exec(requests())
        out, err = bytearray(), bytearray()
        result = final = None
        try:
            try:
                first_m = await call.read()
            except Exception as e:  # noqa: BLE001
                if not (once and _unimplemented(e)):
                    raise
                self._no_exec_once = True       # an agent older than ExecOnce
                call = self.stub.Exec(requests())
                first_m = await call.read()
            eof, m = grpc_aio_eof(), first_m
            while m is not eof:
                item = _exec_item(m, out, err)
                if item is not None and item[0] == "exit":
                    result = item[1]
                    if m.exit.final:    # it says how the call ends: no wait for the status behind it
                        final = m.exit
                        break
                elif item is not None:
                    yield item
                m = await call.read()
        except Exception as e:  # noqa: BLE001
            if result is None and (out or err):
                result = ExecResult(stdout=bytes(out), stderr=bytes(err))
            raise _convert(e, result) from None
        finally:
            if result is None or final is not None:     # left early, an error, or done: end the call
                call.cancel()
        if result is None:
            raise AgentError("UNKNOWN", "the agent ended the step without an exit status")
        if final is not None and final.error_code:
            raise _status_error(final.error_code, final.error_message, result)
        yield ("exit", result)

    async def exec(self, sandbox_id: str, argv, *, on_stdout=None, on_stderr=None, **kw) -> ExecResult:
        """One step; as Client.exec (on_stdout / on_stderr are called per chunk)."""
        result = None
        gen = self.exec_stream(sandbox_id, argv, started=False, **kw)
        try:
            async for kind, value in gen:
                if kind == "stdout" and on_stdout:
                    on_stdout(value)
                elif kind == "stderr" and on_stderr:
                    on_stderr(value)
                elif kind == "exit":
                    result = value
        finally:
            await gen.aclose()
        return result

    # -- events
    async def events(self, sandbox=None, kinds=None, decisions=None, labels=None):
        """Live audit events, as Client.events (an async generator)."""
        from agent.node.proto import pb
        await self._connect()
        sandboxes = [sandbox] if isinstance(sandbox, str) else list(sandbox or ())
        call = self.stub.StreamEvents(pb.StreamEventsRequest(sandbox_ids=sandboxes, kinds=list(kinds or ()),
                                                             decisions=list(decisions or ()),
                                                             labels=dict(labels or {})))
        try:
            async for m in call:
                if m.WhichOneof("msg") == "lost":
                    yield {"lost": m.lost.count, "reason": m.lost.reason}
                else:
                    yield json.loads(m.event.json)
        except Exception as e:  # noqa: BLE001
            import grpc
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise _convert(e) from None
        finally:
            call.cancel()

    async def query_events(self, sandbox_id: str, kinds=None, limit: int = 0, flush_timeout: float = 0.0):
        """Recorded events of one sandbox from ClickHouse, as Client.query_events."""
        from agent.node.proto import pb
        await self._connect()
        call = self.stub.QueryEvents(pb.QueryEventsRequest(sandbox_id=sandbox_id, kinds=list(kinds or ()),
                                                           limit=limit, flush_timeout_seconds=flush_timeout))
        try:
            async for m in call:
                yield json.loads(m.event.json)
        except Exception as e:  # noqa: BLE001
            raise _convert(e) from None


class AsyncSandbox:
    """A handle on one sandbox, for asyncio code (AsyncClient)."""

    def __init__(self, client: AsyncClient, sandbox_id: str, info: SandboxInfo | None = None):
        self.client = client
        self.id = sandbox_id
        self.created = info
        self.summary: dict | None = None

    def __repr__(self):
        return f"AsyncSandbox({self.id!r})"

    async def info(self) -> SandboxInfo:
        return await self.client.get(self.id)

    async def wait(self, until: str = "ended", timeout: float | None = None) -> SandboxInfo:
        return await self.client.wait(self.id, until, timeout)

    async def exec(self, argv, **kw) -> ExecResult:
        """One step (as Sandbox.exec): stdin, stdin_stream, env, workdir, timeout, grace,
        on_stdout / on_stderr."""
        return await self.client.exec(self.id, argv, **kw)

    def exec_stream(self, argv, **kw):
        return self.client.exec_stream(self.id, argv, **kw)

    async def kill(self, grace: float | None = None, reason: str = "") -> SandboxInfo:
        return await self.client.kill(self.id, grace, reason)

    async def close(self) -> SandboxInfo:
        info = await self.client.close_sandbox(self.id)
        self.summary = info.summary
        return info

    async def snapshot(self, timeout: float | None = None) -> dict:
        return await self.client.snapshot(self.id, timeout)

    async def restore(self, snapshot_id: str, force: bool = False) -> dict:
        return await self.client.restore(self.id, snapshot_id, force)

    async def update_policy(self, policy=None, policy_yaml=None, mode=None):
        return await self.client.update_policy(self.id, policy, policy_yaml, mode)

    async def update_resources(self, cpus=None, memory=None, pids=None, **kw) -> dict:
        return await self.client.update_resources(self.id, cpus, memory, pids, **kw)

    async def set_phase(self, phase: str, **kw) -> dict:
        return await self.client.set_phase(self.id, phase, **kw)

    def events(self, kinds=None, decisions=None):
        return self.client.events(self.id, kinds, decisions)

    def query_events(self, kinds=None, limit: int = 0, flush_timeout: float = 0.0):
        return self.client.query_events(self.id, kinds, limit, flush_timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        try:
            await self.close()
        except AgentError:
            if exc[0] is None:
                raise
        return False


__all__ = ["Client", "AsyncClient", "Sandbox", "AsyncSandbox", "TLS", "ExecResult", "SandboxInfo", "AgentError",
           "InvalidArgument", "NotFound", "PermissionDenied", "AgentUnavailable", "ResourceExhausted", "SandboxFailed",
           "SandboxStopped",
           "SandboxPreempted", "agent_available", "default_target"]
