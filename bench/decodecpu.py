#!/usr/bin/env python3
"""The agent's CPU per audited exec: the Recorder (eBPF sensors -> decoder ->
enrichment -> spool) in a process of its own, one cgroup2 of ours watched as a
sandbox with a live process in it named as its init (as the agent names
dsec-init), and a sh loop in it exec'ing /bin/true N times (fork + exec + exit:
three records, the exec enriched: sha256, build-id). Measured: that process's
CPU (utime + stime) from the loop's start until the sandbox is unwatched (its
last records drained and spooled), less the same process's CPU over the same
wall time with nothing running in the sandbox (the baseline, measured right
after: the poll loop's own wake-ups), divided by N.

    .venv/bin/python bench/decodecpu.py [--n 2000] [--reps 5] [--live] [--compare DIR ...]

--compare DIR: the same measurement with another tree's code (e.g. a worktree of
main) in the same run, interleaved rep by rep; printed as a ratio to the first
tree (this one). The spool is fsync=never (the decode path, not the disk).
Nothing is left behind (cgroups, processes, the temp spool).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median

from _common import entry

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, os, shutil, sys, tempfile, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
from fixtures_bpf import CgroupFactory, run_in_cgroup
from agent.sensors.recorder import Recorder
from exporters.spool import Spool
n = int(sys.argv[1])
prog = sys.argv[2] if len(sys.argv) > 2 else "/bin/true"
d = tempfile.mkdtemp(prefix="dsec-decodecpu-")
rec = None
cgs = CgroupFactory()
try:
    rec = Recorder(node="bench", spool=Spool(os.path.join(d, "sp"), fsync="never"), enforce=False)
    cg = cgs()
    rec.watch("bench-" + os.urandom(4).hex(), cg.id, rate=0)
    init = run_in_cgroup(cg, ["sleep", "120"])
    while not cg.pids():
        time.sleep(0.01)
    rec.sensor.set_root_pid(cg.id, init.pid)
    if hasattr(rec, "ready"):                        # READY, as the launcher's hook says it (older trees: none)
        rec.ready(cg.id, init.pid)
    t0, w0 = os.times(), time.monotonic()
    p = run_in_cgroup(cg, ["/bin/sh", "-c", f"i=0; while [ $i -lt {n} ]; do {prog}; i=$((i+1)); done; wait"])
    p.wait()
    init.kill(); init.wait()
    tot = rec.unwatch(cg.id)
    t1, wall = os.times(), time.monotonic() - w0
    busy = (t1.user - t0.user) + (t1.system - t0.system)
    time.sleep(wall)                                  # the baseline: the same process idle, as long
    t2 = os.times()
    idle = (t2.user - t1.user) + (t2.system - t1.system)
    print(json.dumps({"cpu": busy, "idle": idle, "wall": wall, "events": sum(tot["emitted"].values()),
                      "lost": tot["lost_total"]}))
finally:
    if rec is not None:                               # the sensors may fail to load: the temp dir goes anyway
        rec.close()
    cgs.cleanup()
    shutil.rmtree(d, ignore_errors=True)
'''


def one(tree: str, n: int, prog: str) -> dict:
    py = os.path.join(tree, ".venv", "bin", "python")
    r = subprocess.run([py, "-c", CHILD, str(n), prog], cwd=tree, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="execs per rep")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare", action="append", default=[], metavar="DIR", help="another tree to measure")
    ap.add_argument("--live", action="store_true",
                    help="start `sleep 0.05` in the background instead of running /bin/true: each exec'ing "
                         "process still alive when its record is decoded (read through its own root and exe), "
                         "as in a build or a test suite")
    a = ap.parse_args()
    trees = [HERE] + [os.path.abspath(t) for t in a.compare]
    per = {t: [] for t in trees}
    for rep in range(a.reps):
        for t in trees:
            m = one(t, a.n, "/bin/sleep 0.05 & :" if a.live else "/bin/true")
            us = max(m["cpu"] - m["idle"], 0) / a.n * 1e6
            per[t].append(us)
            print(f"rep {rep} {t}: {m['events']} events, {m['lost']} lost, {m['cpu'] * 1000:.0f} ms CPU "
                  f"(idle {m['idle'] * 1000:.0f} ms) in {m['wall']:.2f} s: {us:.1f} us per exec", flush=True)
    base = median(per[HERE])
    print(f"\nagent CPU per exec (fork + exec + exit, enriched), median of {a.reps}:")
    for t in trees:
        m = median(per[t])
        print(f"  {t}: {m:.1f} us" + ("" if t == HERE else f"  ({m / base:.2f}x this tree's)"))
    return 0


if __name__ == "__main__":
    entry(main, "decodecpu")
