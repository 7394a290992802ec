"""Deliver what waits in the spool to the sinks: ClickHouse, an OTLP
collector, a JSON-lines file or stdout. Each sink has its own cursor in the
spool, so each gets every record once, whatever the others do.

examples:
  dsec export                                  # the sinks of the environment (default: ClickHouse)
  dsec export --timeout 0                      # one attempt, no waiting
  dsec export --follow                         # keep exporting until interrupted (what an agent does)
  dsec export --sink clickhouse --sink otlp    # exactly these
  dsec export --sink jsonl --jsonl-path -      # every pending event as JSON lines on stdout
  OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 dsec export --sink otlp

Without --sink the sinks come from the environment: DSEC_SINKS (auto: ClickHouse,
plus OTLP when OTEL_LOGS_EXPORTER=otlp or an OTLP endpoint is set, plus JSON
lines when DSEC_JSONL_PATH is set). The OTLP sink honours the standard
OTEL_EXPORTER_OTLP_* variables (docs/exporters.md).

Every `dsec run` exports its own record when it ends; events that could not
be sent then (a sink down) stay in the spool (DSEC_SPOOL_DIR, default
/var/lib/dsec/spool) until the next run or this command delivers them.

Prints what each sink was sent and what is still pending (on stderr when the
events go to stdout). exit status: 0 everything delivered; 1 something still
pending (a sink unreachable) or a fatal error (e.g. a newer schema than this
dsec knows); 2 bad usage.
"""
from __future__ import annotations

import signal
import sys
import threading

from agent.errors import DsecError, EXIT_USAGE

HELP = "deliver spooled audit events to ClickHouse, OTLP, JSON lines"


def register(p):
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="how long to retry (default: 30)")
    p.add_argument("--follow", action="store_true", help="keep exporting until interrupted")
    p.add_argument("--sink", action="append", metavar="clickhouse|otlp|jsonl",
                   help="deliver to this sink (repeat or comma-separate; default: the environment's)")
    p.add_argument("--jsonl-path", metavar="FILE|-", help="the JSON-lines sink's file (default: DSEC_JSONL_PATH, "
                                                          "else - = stdout)")
    p.add_argument("--otlp-endpoint", metavar="URL", help="the OTLP sink's collector, e.g. http://127.0.0.1:4317 "
                                                          "(default: OTEL_EXPORTER_OTLP_ENDPOINT)")


def _specs(args):
    from exporters.configure import TYPES, env_sinks, sinks_from_names
    if not args.sink:
        if args.jsonl_path or args.otlp_endpoint:
            raise DsecError("--jsonl-path/--otlp-endpoint need --sink jsonl/--sink otlp", EXIT_USAGE)
        return env_sinks()
    names = [n.strip() for item in args.sink for n in item.split(",") if n.strip()]
    bad = [n for n in names if n not in TYPES]
    if bad or not names:
        raise DsecError(f"--sink {','.join(bad) or ''!r}: use {', '.join(TYPES)}", EXIT_USAGE)
    return sinks_from_names(names, jsonl_path=args.jsonl_path, otlp_endpoint=args.otlp_endpoint)


def run(args) -> int:
    from exporters.spool import Spool
    from exporters.configure import flush_sinks, start_sinks, stop_sinks
    if args.timeout < 0:
        raise DsecError(f"--timeout {args.timeout}: must be >= 0", EXIT_USAGE)
    specs = _specs(args)
    to_stdout = any(s.type == "jsonl" and s.cfg.path == "-" for s in specs)
    out = sys.stderr if to_stdout else sys.stdout
    spool = Spool()
    if args.follow:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        threads = start_sinks(spool, specs, stop)
        out.write(f"exporting to {', '.join(f'{s.name} ({s.type})' for s in specs)} until interrupted\n")
        out.flush()
        while not stop.is_set():
            stop.wait(1.0)
        stop_sinks(threads)
        return 0
    results = flush_sinks(spool, specs, max(0.0, args.timeout))
    sys.stdout.flush()
    ok = True
    for s in specs:
        r = results.get(s.name)
        if r is None:
            continue
        prefix = f"{s.name}: " if len(specs) > 1 or s.type != "clickhouse" else ""
        out.write(prefix + r.summary() + "\n")
        ok &= r.ok
    out.flush()
    return 0 if ok else 1
