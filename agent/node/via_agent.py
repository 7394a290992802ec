"""Commands through the running node agent: `dsec run`, `dsec events` and
`dsec replay --rerun` use it when one answers on its socket (docs/agent.md),
and work in-process otherwise.

    path = agent_socket()                 # None: no agent (or DSEC_AGENT=off)
    client = connect(path, "replay")      # None (and a note on stderr) when it does not answer
    result = run(spec, args)              # `dsec run` through the agent, or None
    for ev in events(sid, kinds, limit)   # `dsec events` through the agent, or None
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from agent.errors import DsecError

_OFF = ("0", "off", "no", "false")


def agent_socket() -> str | None:
    """The running agent's socket, or None (cheap: no gRPC import unless the socket exists).
    DSEC_AGENT=off makes every command work in-process."""
    if os.environ.get("DSEC_AGENT", "").strip().lower() in _OFF:
        return None
    from agent.node.client import DEFAULT_SOCKET, ENV_SOCKET
    path = os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET
    try:
        import stat
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return path


def connect(path: str, who: str):
    from agent.node.client import AgentError, Client
    try:
        c = Client(path, connect_timeout=1.0, timeout=10.0)
        c.capabilities(timeout=5.0)
        return c
    except (AgentError, OSError) as e:
        sys.stderr.write(f"dsec {who}: note: no agent answers at {path} ({getattr(e, 'message', e)}); "
                         f"working in-process\n")
        return None


def run(spec, args):
    """`dsec run` through the running agent: the same sandbox, exit status, output
    passthrough and summary. Returns a launcher.Result, or None when no agent runs."""
    path = agent_socket()
    if path is None:
        return None
    from agent.sandbox import launcher
    from agent.errors import EXIT_DSEC
    # what the launcher checks on this side, with the same messages as in-process
    if spec.sandbox_id:
        launcher.validate_id(spec.sandbox_id)
    if spec.rootfs:
        rf = os.path.abspath(spec.rootfs)
        if not os.path.isdir(rf):
            raise DsecError(f"--rootfs {spec.rootfs}: no such directory", EXIT_DSEC)
        if any(ch in rf for ch in ",:\\"):
            raise DsecError(f"--rootfs {spec.rootfs}: path must not contain ',', ':' or '\\'", EXIT_DSEC)
    c = connect(path, "run")
    if c is None:
        return None
    from agent.node.client import AgentError, SandboxFailed, SandboxStopped, _exec_start, _Inputs
    from agent.sandbox.launcher import Result
    from agent.node.proto import pb
    from policies.load import is_builtin_ref
    pol = {"policy": args.policy} if is_builtin_ref(args.policy) else None
    if pol is None:
        try:
            with open(args.policy, encoding="utf-8", errors="surrogateescape") as f:
                pol = {"policy_yaml": f.read(), "policy_source": args.policy}
        except OSError as e:
            raise DsecError(f"--policy {args.policy}: {e.strerror}", EXIT_DSEC)
    try:
        image = getattr(args, "image", None)
        sb = c.create(sandbox_id=spec.sandbox_id, cpus=spec.cpus, memory=spec.memory, pids=spec.pids,
                      rootfs=os.path.abspath(spec.rootfs) if spec.rootfs else None, network=spec.network,
                      env=spec.env, workdir=args.workdir if image else spec.workdir,
                      user=args.user if image else spec.user, keep=spec.keep, grace=spec.grace,
                      image=image, volumes=list(getattr(args, "volume", None) or ()),
                      over_budget=args.over_budget, audit=args.audit == "on", mode=args.mode,
                      labels={"client": "dsec-run"}, **pol)
    except SandboxFailed as e:
        c.close()
        raise DsecError(e.reason.removeprefix("sandbox start failed: "), EXIT_DSEC)
    except AgentError as e:
        c.close()
        raise DsecError(e.message, EXIT_DSEC)
    if not spec.sandbox_id:
        sys.stderr.write(f"dsec: sandbox {sb.id}\n")
        sys.stderr.flush()
    stdin_tty = False
    try:
        stdin_tty = os.isatty(0)
        os.fstat(0)
        stdin_ok = not stdin_tty
    except OSError:
        stdin_ok = False
    inputs = _Inputs(_exec_start(sb.id, spec.argv, stdin=None, close_stdin=not stdin_ok, timeout=spec.timeout,
                                 grace=spec.grace, close_after=True, wait_export=args.audit == "on"))
    if stdin_ok:
        def pump():
            while True:
                try:
                    data = os.read(0, 65536)
                except OSError:
                    data = b""
                if not data:
                    inputs.put(pb.ExecInput(close_stdin=True))
                    return
                inputs.put(pb.ExecInput(stdin=data))
        threading.Thread(target=pump, daemon=True).start()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            old[s] = signal.signal(s, lambda sig, _f: inputs.put(pb.ExecInput(signal=sig)))
    broken = set()

    def out(fd, data):
        if fd in broken:
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
                broken.add(fd)
                return
            view = view[n:]
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
    return Result(result.code, summary)


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
