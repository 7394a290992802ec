#!/usr/bin/env python3
"""Resource windows against fixed limits on one node (issue 20): a synthetic
trace of sandboxes with sawtooth demand, each a rollout phase (CPU-heavy, two
busy threads under a 1.5-CPU quota for --rollout seconds) then a verify phase
(light: sleeps --verify seconds, as a task waiting on its verifier), run on the
node agent twice in one run:

  fixed     each sandbox asks for its peak (1.5 CPUs, 256 MiB) for its whole life
  windows   each sandbox has a window: base 0.25 CPU / 128 MiB (verify), peak
            1.5 CPUs / 256 MiB (rollout); it calls SetPhase("rollout", wait)
            before its rollout and SetPhase("verify") after

usage:
  .venv/bin/python bench/scheduler.py                    # 8 tasks, 3 s + 3 s each (~2 min)
  .venv/bin/python bench/scheduler.py --tasks 4 --rollout 2 --verify 2

One `dsec agent` of this script's own (capacity 2 CPUs, no oversubscription,
concurrent_peaks 1, no warm pool, eBPF audit on, exporting to ClickHouse). All
tasks are submitted at t=0. Reports per mode: makespan, achieved CPU
utilisation (the sandboxes' CPU time from their cgroups / (2 CPUs x
makespan)), and the wait for resources per task, median and p99: admission
(queued) and, with windows, the rollout phase switch. The ratio windows/fixed
of utilisation and makespan close the table. No timing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import entry, finish, med, pct, ratio, table  # noqa: E402
from launch import BenchAgent  # noqa: E402

NODE_CPUS = 2
PEAK = {"cpus": 1.5, "memory": "256M"}
BASE = {"cpus": 0.25, "memory": "128M"}


def _task(agent, mode: str, rollout: float, verify: float, out: list, errors: list):
    from agent.node.client import Client
    from agent.sandbox.cgroups import SandboxCgroup, detect
    busy = f"timeout {rollout:g} sh -c 'while :; do :; done' & timeout {rollout:g} sh -c 'while :; do :; done'; wait"
    t0 = time.monotonic()
    try:
        with Client(agent.socket, connect_timeout=5) as c:
            if mode == "fixed":
                sb = c.create(cpus=PEAK["cpus"], memory=PEAK["memory"], warm=False, timeout=3600)
            else:
                sb = c.create(window={"base": BASE, "peak": PEAK, "phases": {"rollout": PEAK, "verify": BASE}},
                              warm=False, timeout=3600)
            admitted = time.monotonic() - t0
            phase_wait = 0.0
            with sb:
                if mode == "windows":
                    phase_wait = sb.set_phase("rollout", wait=3600)["waited_seconds"]
                sb.exec(["sh", "-c", busy])
                if mode == "windows":
                    sb.set_phase("verify")
                sb.exec(["sleep", f"{verify:g}"])
                cpu = SandboxCgroup(detect(), sb.id).cpu_stat()["usage_usec"] / 1e6
            out.append({"admission_wait": admitted, "phase_wait": phase_wait, "wait": admitted + phase_wait,
                        "cpu": cpu, "end": time.monotonic()})
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")


def run_mode(agent, mode: str, tasks: int, rollout: float, verify: float) -> dict:
    out, errors = [], []
    t0 = time.monotonic()
    threads = [threading.Thread(target=_task, args=(agent, mode, rollout, verify, out, errors)) for _ in range(tasks)]
    for t in threads:
        t.start()
        time.sleep(0.05)                    # submission order = thread order
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{mode}: {len(errors)} task(s) failed: {errors[0]}")
    span = max(r["end"] for r in out) - t0
    return {"mode": mode, "makespan": span, "util": sum(r["cpu"] for r in out) / (NODE_CPUS * span),
            "wait_med": med(out, "wait"), "wait_p99": pct([r["wait"] for r in out], 99),
            "adm_med": med(out, "admission_wait"), "phase_med": med(out, "phase_wait")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rollout", type=float, default=3.0, help="seconds of the CPU-heavy phase")
    ap.add_argument("--verify", type=float, default=3.0, help="seconds of the light phase")
    a = ap.parse_args()
    if a.tasks < 1 or a.rollout <= 0 or a.verify <= 0:
        raise SystemExit("bench/scheduler.py: --tasks >= 1, --rollout and --verify > 0")
    t_start = time.monotonic()
    agent = BenchAgent(0, {"capacity": {"cpus": NODE_CPUS, "memory": "4G", "reserve_cpus": 0, "reserve_memory": 0,
                                        "cpu_oversubscription": 1},
                           "scheduling": {"tick_seconds": 0.1, "concurrent_peaks": 1}, "warm_pool": [],
                           "breaker": {"oom": None, "cpu": None}})
    try:
        results = [run_mode(agent, m, a.tasks, a.rollout, a.verify) for m in ("fixed", "windows")]
    finally:
        agent.stop()
    print(f"{a.tasks} tasks, rollout {a.rollout:g}s at 1.5 CPUs then verify {a.verify:g}s, node of {NODE_CPUS} CPUs")
    print(table(["mode", "makespan s", "CPU util", "wait med s", "wait p99 s", "admission med s", "phase med s"],
                [[r["mode"], f"{r['makespan']:.1f}", f"{r['util'] * 100:.0f}%", f"{r['wait_med']:.2f}",
                  f"{r['wait_p99']:.2f}", f"{r['adm_med']:.2f}", f"{r['phase_med']:.2f}"] for r in results]))
    f, w = results
    print(f"windows/fixed: utilisation {ratio(w['util'], f['util'])}, makespan {ratio(w['makespan'], f['makespan'])}, "
          f"median wait {ratio(w['wait_med'], f['wait_med'])}")
    finish(t_start)
    return 0


if __name__ == "__main__":
    entry(main, "bench/scheduler.py")
