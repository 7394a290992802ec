#!/usr/bin/env python3
"""cProfile of the agent's hot path: bench/audit.py's part-2 pipeline (eBPF
sensor -> decoder -> spool -> ClickHouse exporter, in this process) at one
paced open_write rate, with the poll thread (ring read, decode, spool append)
and the exporter thread (spool read, insert) each under its own profiler.

usage:
  .venv/bin/python bench/profile_pipeline.py [--rate 20000] [--seconds 8] [--top 25]

Prints the step's verdict line (as bench/audit.py) and, per thread, the
functions with the most own time. Profiling slows Python down (~1.5-2x):
read the split, not the absolute figures.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import drop_database, entry  # noqa: E402

PROFILES: dict[str, cProfile.Profile] = {}


def _profiled(name, fn):
    def run(*a, **k):
        prof = cProfile.Profile()
        PROFILES[name] = prof
        return prof.runcall(fn, *a, **k)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20000)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/profile_pipeline.py: must run as root")
    import audit as bench_audit
    from agent.sensors.audit import cgroup2_mount
    from agent.sensors.recorder import Recorder
    from exporters.clickhouse import ClickHouseExporter
    from exporters.clickhouse_server import PrivateServer, connect
    Recorder._loop = _profiled("poll thread (ring, decode, spool append)", Recorder._loop)
    ClickHouseExporter.run = _profiled("exporter thread (spool read, insert)", ClickHouseExporter.run)
    server = PrivateServer()
    server.start()
    db = f"dsec_prof_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = server.url_for(db)
    client, _ = connect(url)
    client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
    tmp = tempfile.mkdtemp(prefix="dsec-prof-")
    gen_dir = tempfile.mkdtemp(prefix="dsec-prof-gen-", dir="/dev/shm")
    pipe = None
    try:
        pipe = bench_audit.Pipeline(url, os.path.join(tmp, "spool"), gen_dir, cgroup2_mount())
        print(bench_audit.STEP_HEADER)
        r = pipe.step(a.rate, a.seconds, 1.0, client, db, server.pid())
        bench_audit.print_step(r)
        bench_audit.print_breakdown(r)
    finally:
        if pipe is not None:
            pipe.close()
        drop_database(client, db)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(gen_dir, ignore_errors=True)
    for name, prof in PROFILES.items():
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(a.top)
        print(f"\n==== {name}")
        print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())[:20000])
    return 0


if __name__ == "__main__":
    entry(main, "bench/profile_pipeline.py")
