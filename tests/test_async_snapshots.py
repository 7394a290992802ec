"""The asyncio SDK's snapshot, fork and restore (issue 19: "snapshot/fork once
issue 17 lands") against a real agent on a real image."""
from __future__ import annotations

import asyncio
import os

import images as T  # noqa: F401 - the fixtures' module
from images import layout, store_dir  # noqa: F401 - fixtures
from test_agent import AgentProc
from agent.sandbox import images


def test_async_snapshot_fork_restore(layout, store_dir, clickhouse_url, tmp_path):
    from agent.node.client import AsyncClient
    st = images.ImageStore(store_dir)
    st.import_image(f"{layout}:app")
    os.makedirs(tmp_path / "agent")
    agent = AgentProc(str(tmp_path / "agent"), clickhouse_url,
                      {"images": {"store": store_dir}, "capacity": {"cpus": 8, "memory": "8G"}})
    agent.env["DSEC_SNAPSHOT_STORE"] = str(tmp_path / "snaps")
    agent.start()

    async def main():
        async with AsyncClient(agent.socket) as c:
            sb = await c.create(image="layout:app", user="root")
            await sb.exec(["/bin/sh", "-c", "echo one > /opt/app/s.txt"])
            snap = await sb.snapshot()
            assert snap["step"] == 1 and snap["id"]
            await sb.exec(["/bin/sh", "-c", "echo two > /opt/app/s.txt"])
            kids = await c.fork(snap["id"], 3)
            outs = await asyncio.gather(*(k.exec(["/bin/cat", "/opt/app/s.txt"]) for k in kids))
            assert [o.stdout for o in outs] == [b"one\n"] * 3
            r = await sb.restore(snap["id"])
            assert r["step"] == 1
            assert (await sb.exec(["/bin/cat", "/opt/app/s.txt"])).stdout == b"one\n"
            await asyncio.gather(*(k.close() for k in kids))
            await sb.close()
    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        agent.stop()
