#!/usr/bin/env python3
"""cProfile of the agent's hot path: bench/audit.py's part-2 pipeline (eBPF
sensor -> decoder -> spool -> ClickHouse exporter, in this process) at one
paced open_write rate, with the poll thread (ring read, decode, spool append)
and the exporter thread (spool read, insert) each under its own profiler.

usage:
  .venv/bin/python bench/profile_pipeline.py [--rate 20000] [--seconds 8] [--top 25]
  .venv/bin/python bench/profile_pipeline.py --offline 40000 [--rounds 3]

Prints the step's verdict line (as bench/audit.py) and, per thread, the
functions with the most own time. Profiling slows Python down (~1.5-2x):
read the split, not the absolute figures.

--offline N: no eBPF, no sandbox: N normalized open_write records (the shape
part 2's generator makes) appended to a spool as batch frames, then delivered
to a throw-away ClickHouse database by ClickHouseExporter.flush(), timed with
this thread's CPU clock (the exporter child's work: spool read, columns,
clickhouse-driver's encoding; not the server's). Baseline in the same run,
alternating: the same delivery with a dict built per record (Batch.records
read before the insert, what the reader did before the sink took the
columns). Prints us of CPU per record for each and the ratio.
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
    ap.add_argument("--offline", type=int, default=0, metavar="N",
                    help="the exporter's CPU per record on N spooled records, no eBPF (see above)")
    ap.add_argument("--rounds", type=int, default=3, help="--offline: alternating rounds of each shape")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/profile_pipeline.py: must run as root")
    if a.offline:
        if not 1000 <= a.offline <= 1_000_000 or not 1 <= a.rounds <= 20:
            ap.error("--offline: 1000..1000000 records; --rounds: 1..20")
        return offline(a.offline, a.rounds)
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


def _records(n: int) -> list[dict]:
    from audit_schema.events import normalize
    return [normalize({"event_id": f"a1b2c3d4e5f60718{i:016x}", "ts_ns": 1_780_000_000_000_000_000 + i * 1000,
                       "node": "bench", "sandbox_id": "rate-40000-abc123", "kind": "open_write", "step": 1,
                       "pid": 4242, "ppid": 4200, "comm": "python3", "policy_name": "default",
                       "policy_hash": "0123456789abcdef", "mode": "enforce", "decision": "allowed",
                       "path": f"/dev/shm/gen/f{i & 63}", "path_raw": f"/dev/shm/gen/f{i & 63}", "flags": 0o102101,
                       "ret": 3, "dirfd": "AT_FDCWD", "path_resolution": "exact",
                       "extra": '{"mode": 420, "syscall": "openat"}'}) for i in range(n)]


def offline(n: int, rounds: int) -> int:
    import time
    from exporters.clickhouse import ClickHouseExporter
    from exporters.clickhouse_server import PrivateServer, connect
    from exporters.spool import Spool
    server = PrivateServer()
    server.start()
    db = f"dsec_prof_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = server.url_for(db)
    client, _ = connect(url)
    tmp = tempfile.mkdtemp(prefix="dsec-prof-")
    recs = _records(n)
    got: dict[str, list[float]] = {"columns": [], "dicts": []}
    try:
        for r in range(rounds):
            for shape in ("dicts", "columns") if r % 2 else ("columns", "dicts"):
                spool = Spool(os.path.join(tmp, f"s{r}{shape}"), fsync="never")
                spool.append_many(recs)
                exp = ClickHouseExporter(spool, url)
                exp._connected()                        # migrations outside the timing
                if shape == "dicts":
                    real = exp.deliver_batch

                    def deliver(batch, real=real):
                        batch.records                   # a dict per record, as before
                        return real(batch)
                    exp.deliver_batch = deliver
                t = time.thread_time()
                res = exp.flush(120)
                got[shape].append((time.thread_time() - t) / n * 1e6)
                exp.close()
                spool.close()
                if not res.ok or res.sent != n:
                    print(f"!! {shape}: {res.summary()}")
                    return 1
                client.execute(f"TRUNCATE TABLE {db}.events")
        c, d = min(got["columns"]), min(got["dicts"])
        print(f"exporter CPU per record ({n} open_write records from batch frames into ClickHouse, best of "
              f"{rounds}): columns {c:.2f} us, a dict per record (before) {d:.2f} us: {c / d:.2f}x")
        print("   every round:", {k: [round(v, 2) for v in vs] for k, vs in got.items()})
    finally:
        drop_database(client, db)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    entry(main, "bench/profile_pipeline.py")
