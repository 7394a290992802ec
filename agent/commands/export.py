"""Deliver what waits in the spool to ClickHouse.

examples:
  dsec export               # send everything pending, wait up to 30 s
  dsec export --timeout 0   # one attempt, no waiting
  dsec export --follow      # keep exporting until interrupted (what an agent does)

Every `dsec run` exports its own record when it ends; events that could not
be sent then (ClickHouse down) stay in the spool (DSEC_SPOOL_DIR, default
/var/lib/dsec/spool) until the next run or this command delivers them. Events
are never duplicated in query results, however often they are sent.

Prints what was sent and what is still pending. exit status: 0 everything
delivered; 1 something still pending (ClickHouse unreachable) or a fatal
error (e.g. a newer schema than this dsec knows).
"""
from __future__ import annotations

import sys

HELP = "deliver spooled audit events to ClickHouse"


def register(p):
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="how long to retry (default: 30)")
    p.add_argument("--follow", action="store_true", help="keep exporting until interrupted")


def run(args) -> int:
    from agent.spool import Spool
    from exporters.clickhouse import export_forever, flush
    if args.follow:
        export_forever()
        return 0
    res = flush(Spool(), timeout=max(0.0, args.timeout))
    print(res.summary())
    return 0 if res.ok else 1
