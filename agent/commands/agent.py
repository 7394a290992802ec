"""Run the node agent, or talk to the running one.

examples:
  dsec agent                                   # serve on /run/dsec/agent.sock (foreground; SIGTERM stops)
  dsec agent --config /etc/dsec/agent.yaml
  dsec agent --check-config --config agent.yaml
  dsec agent status                            # capabilities, capacity, warm pool of the running agent
  dsec agent ls --label job=rl-7 --state running
  dsec agent tail --kind exec,connect --decision denied     # live audit events (tail -f)

The agent loads the eBPF programs once, exports the audit to ClickHouse
continuously, schedules sandboxes on this node (capacity, priorities with
aging, preemption, warm pool) and serves the gRPC API (docs/agent.md).
Sandboxes die with the agent; a restarted agent cleans up what the previous
one left and records it.

exit status: 0 after a clean shutdown; 1 the agent failed (one line on
stderr); 2 bad usage or configuration.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from agent.errors import DsecError, EXIT_USAGE

HELP = "run the node agent (gRPC API, scheduler, warm pool), or query it"


def register(p):
    p.add_argument("--config", metavar="FILE", help="agent configuration (YAML; see docs/agent.md)")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    p.add_argument("--socket", metavar="PATH", help="agent socket for status/ls/tail (default: "
                                                    "$DSEC_AGENT_SOCKET or /run/dsec/agent.sock)")
    p.add_argument("action", nargs="?", choices=("serve", "status", "ls", "tail"), default="serve",
                   help="serve (default), status, ls, tail")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="ls/tail: only sandboxes with this label")
    p.add_argument("--state", action="append", default=[], metavar="STATE", help="ls: only these states")
    p.add_argument("--sandbox", action="append", default=[], metavar="ID", help="tail: only these sandboxes")
    p.add_argument("--kind", action="append", default=[], metavar="KIND", help="tail: only these kinds")
    p.add_argument("--decision", action="append", default=[], metavar="D",
                   help="tail: only these decisions (allowed, denied, would-deny)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="ls/tail output")


def _split(items):
    out = []
    for item in items:
        out += [x.strip() for x in item.split(",") if x.strip()]
    return out


def _labels(items):
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise DsecError(f"--label {item!r}: expected K=V", EXIT_USAGE)
        out[k] = v
    return out


def run(args) -> int:
    if args.action == "serve":
        return _serve(args)
    from agent.node.client import Client
    target = args.socket
    with Client(target, connect_timeout=3.0) as c:
        if args.action == "status":
            caps = c.capabilities()
            if args.format == "json":
                print(json.dumps(caps, indent=2))
                return 0
            cap = caps["capacity"]
            print(f"dsec agent {caps['agent_version']} pid {caps['pid']} on {caps['node']} "
                  f"(kernel {caps['kernel']}, cgroups {caps['cgroup_mode']})")
            print(f"  transports: {', '.join(caps['transports'])}")
            print(f"  {caps['audit']['detail']}")
            print(f"  {caps['enforcement']['detail']}")
            print(f"  cpu: {cap['cpu']['used']:g} of {cap['cpu']['limit']:g} committed "
                  f"(allocatable {cap['cpu']['allocatable']:g} x {cap['cpu']['oversubscription']:g})")
            print(f"  memory: {cap['memory']['used'] >> 20} of {cap['memory']['allocatable'] >> 20} MiB")
            print(f"  running {cap['running_total']}, queued {cap['queue']['length']}, "
                  f"preempting {cap['preempting']}, warm ready {cap['warm']['ready']}")
            for w in caps["warm_profiles"]:
                print(f"  warm profile {w['name']}: {w['ready']}/{w['count']} ready")
            for d in caps["degraded"]:
                print(f"  degraded: {d}")
            return 0
        if args.action == "ls":
            infos = c.list(_labels(args.label), _split(args.state))
            if args.format == "json":
                for i in infos:
                    d = dict(i.__dict__)
                    d.pop("summary", None)
                    print(json.dumps(d))
                return 0
            print(f"{'SANDBOX':24} {'STATE':10} {'PRIORITY':12} {'STEPS':>5} {'CPUS':>5} {'MEM':>7}  LABELS")
            for i in infos:
                labels = ",".join(f"{k}={v}" for k, v in sorted(i.labels.items()))
                print(f"{i.sandbox_id:24} {i.state:10} {i.priority:12} {i.steps:5d} {i.cpus:5g} "
                      f"{i.memory >> 20:6d}M  {labels}")
            return 0
        from agent.commands.events import detail, fmt_ts, printable, to_json_line
        try:
            for ev in c.events(_split(args.sandbox), _split(args.kind), _split(args.decision), _labels(args.label)):
                if "lost" in ev and "kind" not in ev:
                    sys.stderr.write(f"dsec agent tail: {ev['lost']} event(s) not delivered to this stream "
                                     f"({ev['reason']})\n")
                    continue
                if args.format == "json":
                    sys.stdout.write(to_json_line(ev) + "\n")
                else:
                    dec = f"[{ev['decision']}] " if ev.get("decision") and ev["decision"] != "allowed" else ""
                    sys.stdout.write(f"{fmt_ts(ev['ts_ns'])} {printable(ev.get('sandbox_id') or '-'):20} "
                                     f"{ev.get('step', 0):>3} {ev['kind']:14} {ev.get('pid', 0):>7} "
                                     f"{dec}{detail(ev)}\n")
                sys.stdout.flush()
        except KeyboardInterrupt:
            return 0
    return 0


def _serve(args) -> int:
    from agent.node.config import load_config
    cfg = load_config(args.config)
    if args.check_config:
        print(f"{args.config or '<defaults>'}: ok (socket {cfg.socket}"
              + (f", tcp {cfg.tcp.listen}" if cfg.tcp else "")
              + f", {len(cfg.warm_pool)} warm profile(s))")
        return 0
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()), stream=sys.stderr,
                        format="dsec agent: %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        raise DsecError("must run as root (sandboxes need namespaces, cgroups, mounts; eBPF needs CAP_BPF)")
    from agent.node.api import serve
    from agent.node.daemon import Agent
    stop = threading.Event()

    def on_signal(sig, _frame):
        logging.getLogger("dsec.agent").info("signal %d: shutting down", sig)
        stop.set()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    serve(Agent(cfg), stop)
    return 0


# ---------------------------------------------------------------- `dsec run` / `dsec events` through the agent

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


def _connect(path: str, who: str):
    from agent.node.client import AgentError, Client
    try:
        c = Client(path, connect_timeout=1.0, timeout=10.0)
        c.capabilities(timeout=5.0)
        return c
    except (AgentError, OSError) as e:
        sys.stderr.write(f"dsec {who}: note: no agent answers at {path} ({getattr(e, 'message', e)}); "
                         f"working in-process\n")
        return None


def run_via_agent(spec, args):
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
    c = _connect(path, "run")
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
        sb = c.create(sandbox_id=spec.sandbox_id, cpus=spec.cpus, memory=spec.memory, pids=spec.pids,
                      rootfs=os.path.abspath(spec.rootfs) if spec.rootfs else None, network=spec.network,
                      env=spec.env, workdir=spec.workdir, user=spec.user, keep=spec.keep, grace=spec.grace,
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
                select.select([], [fd], [])
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


def events_via_agent(sandbox: str, kinds: list, limit: int | None):
    """`dsec events` through the running agent (it delivers its spool first and
    reads its audit store). An iterator of event dicts, or None when no agent runs."""
    path = agent_socket()
    if path is None:
        return None
    c = _connect(path, "events")
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
