"""Run the node agent, or talk to the running one.

examples:
  dsec agent                                   # serve on /run/dsec/agent.sock (foreground; SIGTERM stops)
  dsec agent --config /etc/dsec/agent.yaml
  dsec agent --check-config --config agent.yaml
  dsec agent status                            # capabilities, capacity, warm pool of the running agent
  dsec agent ls --label job=rl-7 --state running
  dsec agent tail --kind exec,connect --decision denied     # live audit events (tail -f)
  dsec agent --idle-exit 600                   # exit after 10 minutes with no sandbox and no call
  dsec agent stop                              # stop the running agent (its sandboxes are killed)

`dsec run` starts an agent like `dsec agent --idle-exit 600` on first use when
none answers (DSEC_AGENT=auto, the default; docs/agent.md "Started on first use").

The agent loads the eBPF programs once, exports the audit to ClickHouse
continuously, schedules sandboxes on this node (capacity, priorities with
aging, preemption, warm pool) and serves the gRPC API (docs/agent.md).
Sandboxes die with the agent; a restarted agent cleans up what the previous
one left and records it.

exit status: 0 after a clean shutdown (also an idle exit, and `stop` when no
agent answers); 1 the agent failed or did not stop (one line on stderr); 2 bad
usage or configuration.
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
    p.add_argument("action", nargs="?", choices=("serve", "status", "ls", "tail", "stop"), default="serve",
                   help="serve (default), status, ls, tail, stop")
    p.add_argument("--idle-exit", metavar="SECONDS", type=_seconds,
                   help="serve: exit after SECONDS with no live sandbox and no API call (default: never)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="ls/tail: only sandboxes with this label")
    p.add_argument("--state", action="append", default=[], metavar="STATE", help="ls: only these states")
    p.add_argument("--sandbox", action="append", default=[], metavar="ID", help="tail: only these sandboxes")
    p.add_argument("--kind", action="append", default=[], metavar="KIND", help="tail: only these kinds")
    p.add_argument("--decision", action="append", default=[], metavar="D",
                   help="tail: only these decisions (allowed, denied, would-deny)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="ls/tail output")


def _seconds(text):
    import argparse
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not v > 0 or v != v:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds")
    return v


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
    if args.action == "stop":
        from agent.node.via_agent import stop_agent
        return stop_agent(args.socket)
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
        from audit_schema.describe import detail, fmt_ts, printable, to_json_line
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
                                     f"{dec}{detail(ev, full=True)}\n")
                sys.stdout.flush()
        except KeyboardInterrupt:
            return 0
    return 0


M_ARENA_MAX = -8      # glibc's mallopt parameter


def _few_malloc_arenas(n: int = 2):
    """glibc gives each thread that allocates its own malloc arena (up to 8 per core), and
    freed memory stays in them: the agent's ~50 threads (connections, steps, sensors, gRPC)
    grew ~100-150 MiB of RSS in arenas over a few hundred sandboxes while its Python objects
    grew ~3 MiB (tests/test_agent.py's 300 sandboxes at concurrency 20). Two arenas keep
    it flat; the interpreter's lock serialises most allocations anyway. MALLOC_ARENA_MAX
    in the environment, which glibc reads itself, wins."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        import ctypes
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, n)
    except (OSError, AttributeError):
        pass                      # not glibc: its own allocator's behaviour


def _serve(args) -> int:
    from agent.node.config import load_config
    cfg = load_config(args.config)
    if args.check_config:
        print(f"{args.config or '<defaults>'}: ok (socket {cfg.socket}"
              + (f", tcp {cfg.tcp.listen}" if cfg.tcp else "")
              + (f", http {cfg.http.listen}" if cfg.http else "")
              + f", {len(cfg.warm_pool)} warm profile(s))")
        return 0
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()), stream=sys.stderr,
                        format="dsec agent: %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        raise DsecError("must run as root (sandboxes need namespaces, cgroups, mounts; eBPF needs CAP_BPF)")
    _few_malloc_arenas()
    from agent.node.api import serve
    from agent.node.daemon import Agent
    stop = threading.Event()

    def on_signal(sig, _frame):
        logging.getLogger("dsec.agent").info("signal %d: shutting down", sig)
        stop.set()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    serve(Agent(cfg), stop, idle_exit=args.idle_exit)
    return 0
