"""Many live sandboxes in one agent (issue 13 point 7): create N idle sandboxes
(pids 16, 32 MiB, 0.1 CPU each, no warm pool), keep them all alive, run one
step in each while all are alive, then close them all; report the agent's RSS,
open fds and threads per live sandbox, and check that nothing is left behind
(cgroups, mounts, state dirs, netns, links) and that the agent's fds and
threads fall back to where they were.

    bench/many.py                  # 1,000 sandboxes, 16 creates in flight (~5 min)
    bench/many.py --count 200 --concurrency 8

Baseline: the same agent before the first sandbox (its idle RSS, fds and
threads); figures are (at N live - baseline) / N. Needs root and `make setup`;
the agent starts with a soft open-file limit of 1024 (as under a default
systemd unit) to show it raises its own.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, entry  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))


def proc_figures(pid: int) -> dict:
    """RSS (bytes), open fds, highest fd number and threads of process pid."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    fds = [int(x) for x in os.listdir(f"/proc/{pid}/fd")]
    return {"rss": rss, "fds": len(fds), "max_fd": max(fds), "threads": len(os.listdir(f"/proc/{pid}/task"))}


def fd_kinds(pid: int, top: int = 6) -> list:
    """What process pid's fds point at, most common first (a path's last part
    replaced by '*' when it holds a digit: one entry per kind of leak)."""
    kinds: dict = {}
    for x in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{x}")
        except OSError:
            continue
        head, _, last = t.rpartition("/")
        k = f"{head}/*" if head and any(c.isdigit() for c in last) else t.split(":[")[0]
        kinds[k] = kinds.get(k, 0) + 1
    return sorted(kinds.items(), key=lambda kv: -kv[1])[:top]


async def hold_many(socket_path: str, n: int, conc: int, pid: int, log=print) -> dict:
    """Create n sandboxes (conc at a time), all alive at once; then one step in
    each (conc at a time); then close them all. Returns figures and results."""
    from agent.node.client import AsyncClient
    out = {"n": n, "base": proc_figures(pid)}
    sem = asyncio.Semaphore(conc)
    async with AsyncClient(socket_path) as c:
        async def create(i):
            async with sem:
                return await c.create(memory="32M", pids=16, cpus=0.1, labels={"job": "many"}, warm=False)
        t0 = time.monotonic()
        sbs = await asyncio.gather(*(create(i) for i in range(n)), return_exceptions=True)
        out["create_s"] = round(time.monotonic() - t0, 1)
        ok = [s for s in sbs if not isinstance(s, BaseException)]
        out["create_errors"] = [repr(s) for s in sbs if isinstance(s, BaseException)][:3]
        out["live"] = proc_figures(pid)
        log(f"many: {len(ok)} live after {out['create_s']}s: {out['live']}")

        async def step(i, sb):
            async with sem:
                return await sb.exec(["sh", "-c", f"echo {i}; ulimit -n"], timeout=60)
        t0 = time.monotonic()
        res = await asyncio.gather(*(step(i, sb) for i, sb in enumerate(ok)), return_exceptions=True)
        out["step_s"] = round(time.monotonic() - t0, 1)
        out["steps"] = res
        out["after_steps"] = proc_figures(pid)
        log(f"many: {len(ok)} steps in {out['step_s']}s: {out['after_steps']}")

        async def close(sb):
            async with sem:
                return await sb.close()
        t0 = time.monotonic()
        out["closed"] = await asyncio.gather(*(close(sb) for sb in ok), return_exceptions=True)
        out["close_s"] = round(time.monotonic() - t0, 1)
        out["ids"] = [sb.id for sb in ok]
    await asyncio.sleep(1.0)
    out["end"] = proc_figures(pid)
    out["end_fd_kinds"] = fd_kinds(pid)
    live = len(ok) or 1
    b, p = out["base"], out["after_steps"]
    out["per_sandbox"] = {"rss_kib": round((p["rss"] - b["rss"]) / live / 1024, 1),
                          "fds": round((p["fds"] - b["fds"]) / live, 2),
                          "threads": round((p["threads"] - b["threads"]) / live, 2)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    from launch import BenchAgent
    from hosts import leftovers     # the suite's own census of what sandboxes leave behind
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))    # the agent inherits it
    try:
        ag = BenchAgent(0, {"capacity": {"cpus": 4, "memory": "64G", "reserve_memory": 0,
                                         "cpu_oversubscription": 64},
                            "scheduling": {"tick_seconds": 0.2, "max_parallel_starts": 16},
                            "warm_pool": []})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        lim = ag.client.capabilities()["limits"]
        print(f"many: agent pid {ag.proc.pid}, open-file limit {lim.get('open_files')} (started with 1024)")
        r = asyncio.run(hold_many(ag.socket, a.count, a.concurrency, ag.proc.pid))
    finally:
        ag.stop()
    bad = [s for s in r["steps"] if isinstance(s, BaseException) or s.code != 0]
    left = leftovers()
    mine = [x for k in ("cgroups", "mounts", "state", "netns") for x in left[k] if any(i in x for i in r["ids"])]
    print(f"many: {len(r['ids'])} of {a.count} sandboxes live at once (errors: {r['create_errors']}); "
          f"steps failed: {len(bad)}; left behind: {len(mine)}")
    print(f"many: create {r['create_s']}s, steps {r['step_s']}s, close {r['close_s']}s")
    print(f"many: agent before: {r['base']}")
    print(f"many: agent with {len(r['ids'])} live: {r['after_steps']}")
    print(f"many: agent after close: {r['end']}")
    print(f"many: per live sandbox: {r['per_sandbox']}")
    if bad or mine or r["create_errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    entry(main, "bench/many.py")
