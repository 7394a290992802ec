#!/usr/bin/env python3
"""A rollout loop through dsec's asyncio SDK: N trajectories of M tool steps each,
run concurrently, one sandbox per trajectory (its files and processes persist
between the steps), every sandbox labelled with the run and the trajectory.
Prints throughput and, for each trajectory, where its audit record is.

    sudo .venv/bin/python docs/examples/rollout_async.py --trajectories 16 --steps 4
    sudo .venv/bin/python docs/examples/rollout_async.py --socket /run/dsec/agent.sock --concurrency 8

Needs a running `dsec agent` (docs/agent.md). The "model" here is a stub that
writes a small Python step; a trainer puts its policy's tool call there.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from agent.node.client import AgentError, AsyncClient  # noqa: E402


def model_step(trajectory: int, step: int) -> str:
    """Stands in for the policy: the code of the next tool call."""
    return ("import json, os\n"
            "st = json.load(open('state.json')) if os.path.exists('state.json') else {'total': 0}\n"
            f"st['total'] += {trajectory} * {step + 1}\n"
            "json.dump(st, open('state.json', 'w'))\n"
            "print(st['total'])\n")


async def trajectory(c: AsyncClient, run_id: str, t: int, steps: int, sem: asyncio.Semaphore) -> dict:
    async with sem:
        out = {"trajectory": f"t-{t}", "rewards": []}
        async with await c.create(memory="512M", pids=256, labels={"run": run_id, "trajectory": f"t-{t}"}) as sb:
            out["sandbox_id"] = sb.id
            for s in range(steps):
                r = await sb.exec(["python3", "-c", model_step(t, s)], timeout=30,
                                  env={"DSEC_STEP": str(s)})
                out["rewards"].append(float(r.stdout) if r.code == 0 else None)
        return out


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", "-n", type=int, default=8)
    ap.add_argument("--steps", "-m", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="trajectories in flight")
    ap.add_argument("--socket", default=None, help="agent socket (default: $DSEC_AGENT_SOCKET or /run/dsec/agent.sock)")
    a = ap.parse_args()
    run_id = "rollout-" + uuid.uuid4().hex[:8]
    sem = asyncio.Semaphore(a.concurrency)
    t0 = time.monotonic()
    async with AsyncClient(a.socket) as c:
        results = await asyncio.gather(*(trajectory(c, run_id, t, a.steps, sem) for t in range(a.trajectories)),
                                       return_exceptions=True)
    wall = time.monotonic() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    steps = sum(len(r["rewards"]) for r in done)
    print(f"run {run_id}: {len(done)} trajectories x {a.steps} steps in {wall:.1f}s: "
          f"{steps / wall:.1f} steps/s, {len(done) / wall:.2f} trajectories/s ({len(failed)} failed)")
    for r in done:
        print(f"  {r['trajectory']:6} rewards {r['rewards']}  audit: dsec replay {r['sandbox_id']}")
    for e in failed:
        print(f"  failed: {e.message if isinstance(e, AgentError) else e!r}")
    print(f"all of this run: dsec agent ls --label run={run_id}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
