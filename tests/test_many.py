"""Many sandboxes in one long-lived agent (issue 13 point 7): fds past 1023 are
watched with poll (never select), the agent raises its own open-file limit (and
sandboxes keep the one it started with), and per-sandbox state is freed when a
sandbox ends. The suite holds 250 live sandboxes (MANY); bench/many.py and
DSEC_TEST_MANY=1000 hold the full 1,000 and print the figures."""
from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import time

import pytest

from agents import AgentProc
from fixtures_bpf import run_in_cgroup
from hosts import leftovers

from agent.errors import DsecError
from agent.sensors.common import FINALS_KEPT

# bench/ on sys.path only while many.py loads: left there, bench/replay.py would hide the
# replay package from every test file that runs after this one
_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, _BENCH)
try:
    from many import hold_many  # noqa: E402
finally:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != _BENCH]

# live at once. 250 in the suite (~25 s on the 2-core machine: the agent's fds pass 1,500,
# well past select()'s 1023, while the suite stays under its 20 minutes); bench/many.py and
# DSEC_TEST_MANY=1000 hold the full 1,000 (2.3 min here, figures in bench/README.md)
MANY = int(os.environ.get("DSEC_TEST_MANY", "250"))


def test_many_live_sandboxes_one_step_each_nothing_left(tmp_path, clickhouse_url):
    a = AgentProc(str(tmp_path), clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "64G", "reserve_memory": 0, "cpu_oversubscription": 64},
        "scheduling": {"tick_seconds": 0.2, "max_parallel_starts": 16},
    })
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))    # the agent starts as under a default systemd unit
    try:
        a.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with a.client() as c:
            lim = c.capabilities()["limits"]
        assert lim["open_files"] == hard, lim          # raised from 1024 to the hard limit
        assert "open-file limit (RLIMIT_NOFILE): %d (hard %d, was 1024)" % (hard, hard) in a.read_log()
        r = asyncio.run(hold_many(a.socket, MANY, 16, a.pid, log=lambda s: print("\n" + s)))
    finally:
        rc = a.stop()
    assert rc == 0, a.read_log()[-3000:]
    print(f"\nmany: {MANY} live: per sandbox {r['per_sandbox']}; agent {r['base']} -> {r['after_steps']} -> "
          f"{r['end']}; create {r['create_s']}s, steps {r['step_s']}s, close {r['close_s']}s")
    assert not r["create_errors"], r["create_errors"]
    assert len(r["ids"]) == MANY
    # the agent held more fds than select() can watch, and every step still ran
    assert r["live"]["max_fd"] > 1023, r["live"]
    bad = [(i, s) for i, s in enumerate(r["steps"]) if isinstance(s, BaseException) or s.code != 0
           or s.stdout != f"{i}\n1024\n".encode()]                 # the sandbox keeps the limit of 1024
    assert not bad, bad[:3]
    bad = [x for x in r["closed"] if isinstance(x, BaseException) or x.state != "exited"]
    assert not bad, bad[:3]
    # fds and threads back where they were (a per-sandbox leak of one fd would show)
    print("\nmany: fds at the end:", r["end_fd_kinds"])
    assert r["end"]["fds"] <= r["base"]["fds"] + 16, (r["base"], r["end"], r["end_fd_kinds"])
    # threads: the agent's work pool (max(32, 4 x max_parallel_starts) = 64) stays, nothing per sandbox
    assert r["end"]["threads"] <= r["base"]["threads"] + 64 + 8, (r["base"], r["end"])
    left = leftovers()
    mine = [x for k in ("cgroups", "mounts", "state", "netns") for x in left[k] if any(i in x for i in r["ids"])]
    assert not mine, mine[:5]


def test_removed_sandboxes_state_is_freed(audit_sensor, audit_cgroups):
    """A long-lived sensor keeps no per-sandbox state of removed sandboxes, past
    the totals of the last FINALS_KEPT (for a late stats())."""
    h = audit_sensor
    s = h.sensor
    n = FINALS_KEPT + 40
    first = last = None
    for i in range(n):
        sbx = h.sandbox(audit_cgroups, step=1)
        sbx.remove()
        first = first or sbx.cg.id
        last = sbx.cg.id
        assert sbx.cg.id not in s.decoder.sandboxes
    assert len(s._finals) <= FINALS_KEPT
    assert isinstance(s.stats(last), dict)                   # the most recent totals are still there
    with pytest.raises(DsecError):
        s.stats(first)                                        # the oldest are forgotten
    for d in (s._reported, s._last_flush_wall, s._steps, s._modes, s._stop_notified):
        assert first not in d and last not in d
    assert not [k for k in s.decoder.sys_reported if k[0] in (first, last)]


def test_a_removed_sandbox_lets_go_of_its_pinned_init(audit_sensor, audit_cgroups):
    """The sandbox's init is pinned by a /proc/<pid> descriptor (procs.PinnedPid); once the
    sandbox is removed nothing of the sensor holds it (the batch decoder's record templates
    and a finished enrichment's pids used to: one fd per sandbox, for good)."""
    h = audit_sensor
    inits, mine = [], []
    try:
        for i in range(3):
            cg = audit_cgroups()
            init = run_in_cgroup(cg, ["sleep", "30"])
            inits.append(init)
            deadline = time.monotonic() + 5
            while init.pid not in cg.pids() and time.monotonic() < deadline:
                time.sleep(0.01)
            sbx = h._sandbox(audit_cgroups, cg, lambda cg, sid: h.sensor.add_sandbox(cg.id, sid, root_pid=init.pid))
            p = run_in_cgroup(cg, ["/bin/sh", "-c", "/bin/true; /bin/echo hi"], stdout=subprocess.DEVNULL)
            p.wait()
            assert h.poll_until(lambda: len(sbx.of_kind("exec")) >= 3), sbx.records
            assert any(f"/proc/{init.pid}" == t for t in _fd_targets()), "the init is not pinned"
            sbx.remove()
            mine.append(f"/proc/{init.pid}")
        held = [t for t in _fd_targets() if t in mine]
        assert not held, held
    finally:
        for p in inits:
            p.kill()
            p.wait()


def _fd_targets() -> list:
    out = []
    for x in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{x}"))
        except OSError:
            pass
    return out


def test_sandbox_roots_are_closed_off_the_removal_path_and_none_is_kept():
    """A removed sandbox's root and mount-namespace descriptors are closed by one closing
    thread (the namespace's teardown waits an RCU grace period), never kept; close()
    closes what is left."""
    from agent.sensors.permcheck import SandboxRoots
    before = len(os.listdir("/proc/self/fd"))
    roots = SandboxRoots()
    for i in range(20):
        roots.add(f"s{i}", os.getpid())
    assert len(os.listdir("/proc/self/fd")) >= before + 40
    for i in range(20):
        roots.remove(f"s{i}")
    deadline = time.monotonic() + 10
    while roots.pending_closes() and time.monotonic() < deadline:
        time.sleep(0.01)
    roots.add("last", os.getpid())
    roots.close()
    assert roots.pending_closes() == 0
    time.sleep(0.05)                             # a batch the closing thread had taken
    assert len(os.listdir("/proc/self/fd")) <= before + 1, os.listdir("/proc/self/fd")
