"""Print one sandbox's audit events from ClickHouse, in time order.

examples:
  dsec events --sandbox sb-1a2b3c                          # a table
  dsec events --sandbox sb-1a2b3c --kind exec --kind connect
  dsec events --sandbox sb-1a2b3c --kind open_write,rename,unlink
  dsec events --sandbox sb-1a2b3c --format json | jq -r 'select(.kind=="exec") | .sha256'

--format json prints one JSON object per line with every field of
audit_schema/events.py. Paths, argv and other byte strings that are not valid
UTF-8 keep their bytes: each undecodable byte 0xHH appears as the escape
"\\udcHH" (Python: os.fsencode(value) gives the exact bytes back).
--format table shows the same events for a terminal; there, control
characters and undecodable bytes are shown as \\xHH (a hostile file name
cannot drive the terminal).

Events come from DSEC_CLICKHOUSE_URL, or dsec's private server (started if
needed). Each event appears once, even if the exporter sent it twice.

exit status: 0 ok; 1 no events recorded for that sandbox, or ClickHouse
failed; 2 bad usage (unknown kind ...).
"""
from __future__ import annotations

import sys

from agent.errors import DsecError, EXIT_USAGE
from audit_schema.describe import detail, fmt_ts, printable, to_json_line
from audit_schema.events import KINDS

HELP = "print a sandbox's audit events (JSON lines or a table)"

def register(p):
    p.add_argument("--sandbox", required=True, metavar="ID", help="sandbox id")
    p.add_argument("--kind", action="append", metavar="KIND",
                   help=f"only these kinds (repeat or comma-separate): {', '.join(KINDS)}")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.add_argument("--limit", type=int, metavar="N", help="at most N events")


def _kinds(args) -> list[str]:
    out = []
    for item in args.kind or ():
        for k in item.split(","):
            k = k.strip()
            if not k:
                continue
            if k not in KINDS:
                raise DsecError(f"--kind {k!r}: unknown event kind (kinds: {', '.join(KINDS)})", EXIT_USAGE)
            out.append(k)
    return out


def run(args) -> int:
    from replay.store import AuditStore
    kinds = _kinds(args)
    if not args.sandbox.strip():
        raise DsecError("--sandbox: empty sandbox id", EXIT_USAGE)
    if args.limit is not None and args.limit < 1:
        raise DsecError(f"--limit {args.limit}: must be at least 1", EXIT_USAGE)
    # the node agent answers when one is running (it delivers its spool first); else in-process
    from agent.node import via_agent
    via = via_agent.events(args.sandbox, kinds, args.limit)
    if via is not None:
        n = 0
        if args.format == "json":
            for ev in via:
                sys.stdout.write(to_json_line(ev) + "\n")
                n += 1
            sys.stdout.flush()
        else:
            n = _table(args.sandbox, via)
        return 0
    with AuditStore() as store:
        events = store.events(args.sandbox, kinds, limit=args.limit)
        n = 0
        if args.format == "json":
            out = sys.stdout
            for ev in events:
                out.write(to_json_line(ev) + "\n")
                n += 1
            out.flush()
        else:
            n = _table(args.sandbox, events)
        if n == 0 and store.count(args.sandbox) == 0:
            raise DsecError(f"no events recorded for sandbox {printable(args.sandbox)!r}", 1)
    return 0


def _table(sandbox: str, events) -> int:
    import os
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    table = Table(title=Text(f"sandbox {printable(sandbox)}"), show_lines=False)
    for col, kw in (("time (UTC)", {"no_wrap": True}), ("step", {"justify": "right", "no_wrap": True}),
                    ("kind", {"no_wrap": True}), ("pid", {"justify": "right", "no_wrap": True}),
                    ("ppid", {"justify": "right", "no_wrap": True}), ("comm", {"no_wrap": True}),
                    ("detail", {"overflow": "fold"})):
        table.add_column(col, **kw)
    n = 0
    for ev in events:
        d = detail(ev, full=True)
        if ev.get("decision") and ev["decision"] != "allowed":
            d = f"[{printable(ev['decision'])}] {d}"
        table.add_row(Text(fmt_ts(ev["ts_ns"])), Text(str(ev["step"])), Text(ev["kind"]), Text(str(ev["pid"])),
                      Text(str(ev["ppid"])), Text(printable(ev["comm"])), Text(d))
        n += 1
    if n:
        console = Console(highlight=False)
        if not console.is_terminal:  # a pipe or a file: do not squeeze into 80 columns
            console = Console(highlight=False, width=int(os.environ.get("COLUMNS") or 160))
        console.print(table)
    return n
