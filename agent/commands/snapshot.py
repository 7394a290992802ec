"""Snapshots of running sandboxes (through the node agent), and their export.

examples:
  dsec snapshot create sbx-1a2b3c          # freeze, copy the writable layer, thaw; prints the snapshot id
  dsec snapshot ls
  dsec snapshot inspect 3f2a9c01b2d4       # JSON: step context, base image, ordered changes, in_use_by
  dsec snapshot export 3f2a9c01b2d4 -o ./snap-layout     # an OCI image layout: `dsec image import` it elsewhere
  dsec snapshot restore sbx-1a2b3c 3f2a9c01b2d4  # roll the live sandbox back (--force: also mid-step)
  dsec snapshot rm 3f2a9c01b2d4

A snapshot holds the sandbox's filesystem state (its writable layer over its
image) and the step context (step, env, workdir, user); not its processes.
Fork: the SDK's client.fork(snapshot_id, n), or CreateSandbox(from_snapshot=...).
See docs/snapshots.md.

exit status: 0 ok; 1 failure; 2 bad input (unknown snapshot, a sandbox that
cannot be snapshotted, the store's disk budget exceeded, `rm` of a snapshot a
running fork or restored sandbox uses).
"""
from __future__ import annotations

import json
import sys

from agent.errors import DsecError

HELP = "snapshot running sandboxes (through the agent), list, inspect, export as an OCI image"


def register(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = sub.add_parser("create", help="snapshot a running sandbox of the agent")
    c.add_argument("sandbox", metavar="SANDBOX")
    sub.add_parser("ls", help="list snapshots")
    i = sub.add_parser("inspect", help="a snapshot as JSON")
    i.add_argument("snapshot", metavar="ID")
    e = sub.add_parser("export", help="write an OCI image layout (base image + snapshot layers)")
    e.add_argument("snapshot", metavar="ID")
    e.add_argument("-o", "--output", required=True, metavar="DIR")
    e.add_argument("--ref", default="snapshot", help="the layout's ref name (default: snapshot)")
    rs = sub.add_parser("restore", help="roll a running sandbox of the agent back to a snapshot")
    rs.add_argument("sandbox", metavar="SANDBOX")
    rs.add_argument("snapshot", metavar="ID")
    rs.add_argument("--force", action="store_true", help="also while a step runs (it is ended)")
    r = sub.add_parser("rm", help="remove a snapshot")
    r.add_argument("snapshot", metavar="ID")


def run(args) -> int:
    from agent.sandbox.snapshots import SnapshotStore
    from agent.sandbox.snapexport import export
    if args.action in ("create", "restore"):
        from agent.node import via_agent
        from agent.node.client import AgentError
        path = via_agent.agent_socket()
        if path is None:
            raise DsecError(f"dsec snapshot {args.action} needs the node agent (sandboxes of `dsec run` are not "
                            "addressable): start `dsec agent`", 1)
        c = via_agent.connect(path, "snapshot")
        if c is None:
            raise DsecError(f"no agent answers at {path}", 1)
        try:
            if args.action == "restore":
                r = c.restore(args.sandbox, args.snapshot, force=args.force)
                print(f"restored {args.sandbox} to snapshot {r['snapshot']} (step {r['step']}) in {r['total_ms']:.1f} ms")
                return 0
            s = c.snapshot(args.sandbox)
        except AgentError as e:
            raise DsecError(e.message, 2 if e.status in ("NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT")
                            else 1)
        finally:
            c.close()
        print(f"snapshot {s['id']} of {s['sandbox_id']} at step {s['step']}: {s['files']} files, {s['bytes']} bytes, "
              f"frozen {s['frozen_ms']:.1f} ms")
        return 0
    st = SnapshotStore()
    if args.action == "ls":
        print(f"{'SNAPSHOT':14} {'SANDBOX':24} {'STEP':>4} {'FILES':>6} {'BYTES':>10} {'PARENT':14} IMAGE")
        for s in st.list():
            img = (s["base"].get("image") or {}).get("name") or s["base"].get("rootfs") or "-"
            print(f"{s['id'][:12]:14} {s['sandbox_id'][:24]:24} {s['step']:>4} {s['files']:>6} {s['bytes']:>10} "
                  f"{(s['chain'][0][:12] if s['chain'] else '-'):14} {img}")
        return 0
    if args.action == "inspect":
        snap = st.get(args.snapshot)
        print(json.dumps(dict(snap, in_use_by=st.users(snap["id"])), indent=2))
        return 0
    if args.action == "export":
        from agent.commands.image import store
        r = export(st, st.get(args.snapshot), args.output, store(), args.ref)
        print(f"exported {args.snapshot} to {r['layout']}:{r['ref']} ({r['layers']} layers, {r['manifest_digest']})")
        return 0
    if args.action == "rm":
        s = st.remove(args.snapshot)
        print(f"removed snapshot {s['id']}")
        return 0
    sys.stderr.write(f"dsec snapshot: unknown action {args.action}\n")
    return 2
