"""Network namespaces made ahead of the starts (agent/sandbox/netpool.py): each sandbox
gets a fresh one of its own (a loopback device only, brought up by dsec-init), never one
that another sandbox or the agent used; the making thread goes back to the agent's own;
an empty pool (a burst) means the start's clone makes it, as before. Real sandboxes, in
this process (the node agent enables the pool at its start: tests/test_agent.py runs
every agent sandbox through it)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from agent.sandbox import netpool
from agent.sandbox.launcher import Sandbox
from agent.sandbox.spec import SandboxSpec
from exporters.metrics import METRICS

PROBE = ["sh", "-c", "stat -L -c %i /proc/self/ns/net; ls /sys/class/net; cat /sys/class/net/lo/flags"]


def _probe(sb) -> tuple[int, list[str], int]:
    """The sandbox's network namespace inode, its devices, its loopback's flags."""
    r, w = os.pipe()
    try:
        st = sb.exec(PROBE, stdout=w, stderr=w)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode(errors="replace").split()
    assert st.exit_code == 0, out
    return int(out[0]), out[1:-1], int(out[-1], 16)


def _ready(n: int) -> int:
    deadline = time.monotonic() + 10
    while netpool.ready() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return netpool.ready()


@pytest.fixture
def pool():
    netpool.enable(2)
    yield
    netpool.close()


def test_each_sandbox_gets_a_fresh_namespace_of_its_own_from_the_pool(pool):
    host = os.stat("/proc/self/ns/net").st_ino
    sbs, seen = [], []
    try:
        for _ in range(4):      # all alive at once: a namespace's inode number is reused once it is freed
            assert _ready(2) == 2
            before = METRICS.counter("dsec.sandbox.netns", source="pool")
            sbs.append(Sandbox(SandboxSpec(argv=[])).start())
            assert METRICS.counter("dsec.sandbox.netns", source="pool") == before + 1
            ino, devices, lo_flags = _probe(sbs[-1])
            seen.append(ino)
            assert devices == ["lo"]                   # fresh: nothing but the loopback
            assert lo_flags & 0x1                      # IFF_UP: dsec-init brought it up, as with a clone
    finally:
        for sb in sbs:
            sb.close()
    assert host not in seen and len(set(seen)) == 4, seen   # its own: never the agent's, never another's
    # the making thread is in a new namespace only between its unshare and its setns back, and it
    # adds a namespace to the pool after that: with the pool full again it is idle, at home
    assert _ready(2) == 2
    maker = next(t for t in threading.enumerate() if t.name == "dsec-netns-pool")
    assert os.stat(f"/proc/self/task/{maker.native_id}/ns/net").st_ino == host


def test_an_empty_pool_means_the_clone_makes_the_namespace(pool):
    netpool.close()                                    # a burst took every one
    host = os.stat("/proc/self/ns/net").st_ino
    before = {s: METRICS.counter("dsec.sandbox.netns", source=s) for s in ("pool", "clone")}
    sb = Sandbox(SandboxSpec(argv=[])).start()
    try:
        ino, devices, lo_flags = _probe(sb)
    finally:
        sb.close()
    assert METRICS.counter("dsec.sandbox.netns", source="clone") == before["clone"] + 1
    assert METRICS.counter("dsec.sandbox.netns", source="pool") == before["pool"]
    assert ino != host and devices == ["lo"] and lo_flags & 0x1
