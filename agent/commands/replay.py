"""Replay what one sandbox did: its process tree and a time-ordered timeline.

examples:
  dsec replay sbx-1a2b3c4d5e6f
  dsec replay sbx-1a2b3c4d5e6f --step 2
  dsec replay sbx-1a2b3c4d5e6f --format json > trajectory.json

The process tree shows every process (fork/exec/exit) with its argv, the
binary's sha256 and build-id, and how it ended. The timeline shows execs,
connects, file writes, unlinks, renames and denials in time order; holes in
the record (lost events) are shown as "!! LOST" lines and announced at the
top, never hidden.

Reads from DSEC_CLICKHOUSE_URL or dsec's private server.
exit status: 0 ok; 1 nothing recorded for that sandbox or ClickHouse failed;
2 bad usage.
"""
from __future__ import annotations

import json
import sys

from agent.errors import DsecError

HELP = "replay a sandbox's trajectory (process tree and timeline)"


def register(p):
    p.add_argument("sandbox_id", metavar="ID", help="sandbox id")
    p.add_argument("--step", type=int, metavar="N", help="only this step's timeline")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")


def run(args) -> int:
    from agent.query import AuditStore
    from replay.render_text import render
    from replay.trajectory import reconstruct

    with AuditStore() as store:
        records = list(store.events(args.sandbox_id))
    if not records:
        raise DsecError(f"no events recorded for sandbox {args.sandbox_id}", 1)
    t = reconstruct(args.sandbox_id, records)
    if args.format == "json":
        from agent.commands.events import to_json_line
        for r in t.timeline(step=args.step):
            sys.stdout.write(to_json_line(r) + "\n")
    else:
        sys.stdout.write(render(t, step=args.step))
    return 0
