"""Change a running sandbox's resources through the node agent (UpdateResources),
or switch a sandbox with a resource window to one of its phases (SetPhase).

examples:
  dsec resize sbx-1a2b3c4d5e6f --cpus 0.4                 # CPU quota 0.4 CPU (40 ms per 100 ms)
  dsec resize sbx-1a2b3c4d5e6f --memory 2G --pids 512
  dsec resize sbx-1a2b3c4d5e6f --memory 256M --force      # below its usage: the kernel reclaims or OOM-kills
  dsec resize sbx-1a2b3c4d5e6f --thaw                     # the circuit breaker froze it: let it run
  dsec resize sbx-1a2b3c4d5e6f --phase verify             # a windowed sandbox's phase
  dsec resize sbx-1a2b3c4d5e6f --phase rollout --wait 30  # wait up to 30 s for room

The scheduler re-admits a sandbox that grows: refused when the node has no
room (the reason names what is short). Shrinking always succeeds, except
memory below the sandbox's current usage, refused unless --force. Every change
is a `resources_updated` (or phase_switched / phase_refused) lifecycle event in
the sandbox's record.

Prints the limits in force (before -> after); --format json prints the reply.
exit status: 0 applied; 1 refused (no room, not running, below usage) or the
agent failed; 2 bad usage.
"""
from __future__ import annotations

import json

from agent.errors import EXIT_USAGE, UsageError

HELP = "change a running sandbox's CPU, memory or pids limits, or its phase (node agent)"


def register(p):
    p.add_argument("sandbox", metavar="ID")
    p.add_argument("--cpus", type=float, help="CPU quota in CPUs (e.g. 0.5)")
    p.add_argument("--memory", help="memory limit (512M, 2G, bytes)")
    p.add_argument("--pids", type=int, help="pids limit")
    p.add_argument("--force", action="store_true", help="memory below the current usage: apply anyway")
    p.add_argument("--thaw", action="store_true", help="thaw a sandbox the circuit breaker froze")
    p.add_argument("--phase", help="switch a sandbox with a resource window to this phase")
    p.add_argument("--wait", type=float, default=0.0, help="--phase: seconds to wait for room (default 0)")
    p.add_argument("--reason", default="", help="recorded with the change")
    p.add_argument("--socket", metavar="PATH", help="agent socket (default: $DSEC_AGENT_SOCKET or /run/dsec/agent.sock)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def _show(n) -> str:
    if not n:
        return "-"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def run(args) -> int:
    from agent.node.client import Client, InvalidArgument, _size
    if args.phase and (args.cpus or args.memory or args.pids):
        raise UsageError("--phase switches a windowed sandbox's phase; --cpus/--memory/--pids resize a fixed one: "
                         "give one or the other")
    if not args.phase and not (args.cpus or args.memory or args.pids or args.thaw):
        raise UsageError("nothing to change: give --cpus, --memory, --pids, --thaw or --phase")
    if args.cpus is not None and not args.cpus > 0:
        raise UsageError(f"--cpus: must be > 0, got {args.cpus:g}")
    if args.pids is not None and args.pids <= 0:
        raise UsageError(f"--pids: must be > 0, got {args.pids}")
    try:
        memory = _size(args.memory) if args.memory else None
    except InvalidArgument as e:
        raise UsageError(f"--memory: {e.message}") from None
    with Client(args.socket, connect_timeout=3.0) as c:
        try:
            if args.phase:
                r = c.set_phase(args.sandbox, args.phase, wait=args.wait, force=args.force)
            else:
                r = c.update_resources(args.sandbox, args.cpus, memory, args.pids, force=args.force,
                                       thaw=args.thaw, reason=args.reason)
        except InvalidArgument as e:
            raise UsageError(e.message, EXIT_USAGE) from None
    if args.format == "json":
        print(json.dumps(r))
        return 0
    if args.phase:
        res = r["resources"]
        print(f"{r['sandbox_id']}: phase {r['phase']} (cpus {res['cpus']:g}, memory {_show(res['memory'])}) "
              f"after {r['waited_seconds']:.2f}s")
        return 0
    a, b = r["previous"], r["resources"]
    parts = [f"{k} {_show(a[k]) if k == 'memory' else (a[k] or '-')} -> {_show(b[k]) if k == 'memory' else (b[k] or '-')}"
             for k in ("cpus", "memory", "pids") if a[k] != b[k]]
    print(f"{r['sandbox_id']}: " + (", ".join(parts) or "unchanged") + ("; thawed" if r["thawed"] else ""))
    return 0
