"""Live resources of agent sandboxes (issue 20; agent/node/resources.py): UpdateResources
(SDK, `dsec resize`) on real cgroups under load, re-admission, the record; resource
windows and SetPhase staggering two peaks that do not fit together; the circuit
breaker on a real OOM loop and a pinned CPU quota. One agent per concern (module
scope), real sandboxes, the session's ClickHouse."""
from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import dsec
from test_agent import AgentProc, _events, _states

from agent.node.client import AgentError, InvalidArgument, ResourceExhausted
from agent.sandbox.cgroups import SandboxCgroup, detect

BUSY = ["sh", "-c", "while :; do :; done"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    a = AgentProc(str(tmp_path_factory.mktemp("res")), clickhouse_url, {
        "capacity": {"cpus": 2, "memory": "2G", "reserve_memory": 0, "cpu_oversubscription": 1},
        "scheduling": {"tick_seconds": 0.1, "concurrent_peaks": 1},
        "breaker": {"oom": None, "cpu": None},
    }).start()
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


def _cg(sid) -> SandboxCgroup:
    return SandboxCgroup(detect(), sid)


def _throttled(cg, seconds=0.6) -> tuple[int, int]:
    """(periods, throttled periods) of the sandbox's CPU quota over `seconds`."""
    a = cg.cpu_stat()
    time.sleep(seconds)
    b = cg.cpu_stat()
    return b["nr_periods"] - a["nr_periods"], b["nr_throttled"] - a["nr_throttled"]


def _background(sb, argv):
    out = {}

    def go():
        try:
            out["r"] = sb.exec(argv)
        except AgentError as e:
            out["r"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def _lifecycle(evs, state):
    return [json.loads(e["extra"]) for e in evs if e["kind"] == "lifecycle"
            and json.loads(e["extra"])["state"] == state]


# ---------------------------------------------------------------- UpdateResources

def test_resize_down_and_up_under_load_takes_effect_and_is_recorded(client, clickhouse_url):
    sb = client.create(cpus=1, memory="512M", pids=128, warm=False)
    try:
        cg = _cg(sb.id)
        assert cg.limits() == {"cpus": 1.0, "memory": 512 << 20, "pids": 128}
        t, _ = _background(sb, BUSY)
        time.sleep(0.3)
        periods, thr = _throttled(cg)
        assert periods > 0 and thr / periods < 0.3, (periods, thr)   # one busy thread under a 1-CPU quota

        r = sb.update_resources(cpus=0.2, memory="256M", pids=64, reason="verify phase")
        assert r["previous"] == {"cpus": 1.0, "memory": 512 << 20, "pids": 128}
        assert r["resources"] == {"cpus": 0.2, "memory": 256 << 20, "pids": 64}
        assert cg.limits() == {"cpus": 0.2, "memory": 256 << 20, "pids": 64}
        periods, thr = _throttled(cg)
        assert periods > 0 and thr / periods > 0.7, (periods, thr)   # the cut quota bites at once

        r = sb.update_resources(cpus=1.5)
        assert r["resources"]["cpus"] == 1.5 and cg.limits()["cpus"] == 1.5
        periods, thr = _throttled(cg)
        assert thr / periods < 0.3, (periods, thr)
        sb.kill(grace=0)
        t.join(10)
    finally:
        sb.close()
    evs = _events(clickhouse_url, sb.id, want=lambda e: len(_lifecycle(e, "resources_updated")) >= 2
                  and "cleaned" in _states(e))
    ups = _lifecycle(evs, "resources_updated")
    assert ups[0]["previous"]["cpus"] == 1.0 and ups[0]["resources"] == {
        "cpus": 0.2, "cpus_accounted": 0.2, "memory": 256 << 20, "pids": 64}
    assert ups[0]["reason"] == "verify phase" and ups[0]["by"] == "api"
    assert ups[1]["resources"]["cpus"] == 1.5


def test_growth_is_re_admitted_and_refused_with_the_reason_when_the_node_is_full(client):
    a = client.create(cpus=1, memory="256M", warm=False)
    b = client.create(cpus=1, memory="256M", warm=False)
    try:
        with pytest.raises(ResourceExhausted) as ei:
            a.update_resources(cpus=1.5)
        assert "short of 0.5 CPUs" in ei.value.message, ei.value.message
        assert _cg(a.id).limits()["cpus"] == 1.0                       # nothing applied
        b.update_resources(cpus=0.5)                                     # shrinking frees room ...
        assert a.update_resources(cpus=1.5)["resources"]["cpus"] == 1.5  # ... the growth now fits
        with pytest.raises(ResourceExhausted):
            a.update_resources(memory="2G")                              # 2G + b's 256M > 2G
        assert _cg(a.id).limits()["memory"] == 256 << 20
    finally:
        a.close()
        b.close()


def test_memory_below_usage_is_refused_unless_forced(client):
    with client.create(cpus=1, memory="512M", warm=False) as sb:
        t, out = _background(sb, ["python3", "-c", "import time; b = bytearray(96 << 20); b[::4096] = b'x' * "
                                                   "len(b[::4096]); print('held', flush=True); time.sleep(30)"])
        cg = _cg(sb.id)
        deadline = time.monotonic() + 15
        while cg.memory_current() < 90 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cg.memory_current() >= 90 << 20
        with pytest.raises(AgentError) as ei:
            sb.update_resources(memory="32M")
        assert ei.value.status == "FAILED_PRECONDITION" and "below sandbox" in ei.value.message
        assert "current usage" in ei.value.message and "force" in ei.value.message
        assert cg.limits()["memory"] == 512 << 20
        if cg.layout.mode == "v2":                                       # the kernel OOM-kills the hog
            sb.update_resources(memory="32M", force=True)
            t.join(15)
            assert out["r"].signal == 9, out["r"]
            assert cg.limits()["memory"] == 32 << 20 and cg.oom_kills() >= 1
        else:                                   # cgroup v1 refuses what it cannot reclaim (EBUSY)
            with pytest.raises(AgentError) as ei:
                sb.update_resources(memory="32M", force=True)
            assert ei.value.status == "FAILED_PRECONDITION" and "could not reclaim" in ei.value.message
            assert cg.limits()["memory"] == 512 << 20
            sb.kill(grace=0)
            t.join(15)


def test_bad_resize_requests_are_clear(client):
    with pytest.raises(InvalidArgument) as ei:
        client.update_resources("sbx-000000000000", cpus=-1)
    assert "resources.cpus" in ei.value.message
    with pytest.raises(AgentError) as ei:
        client.update_resources("sbx-000000000000", cpus=1)
    assert ei.value.status == "NOT_FOUND"
    with client.create(memory="128M", warm=False) as sb:
        with pytest.raises(InvalidArgument) as ei:
            sb.update_resources(memory=1000)
        assert "at least 4 MiB" in ei.value.message
        with pytest.raises(AgentError) as ei:
            sb.set_phase("rollout")
        assert ei.value.status == "FAILED_PRECONDITION" and "no resource window" in ei.value.message


def test_dsec_resize_prints_before_after_and_exit_codes(client, agent):
    env = {"DSEC_AGENT_SOCKET": agent.socket}
    with client.create(cpus=0.5, memory="128M", warm=False) as sb:
        r = dsec("resize", sb.id, "--cpus", "0.25", "--memory", "64M", env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().strip() == f"{sb.id}: cpus 0.5 -> 0.25, memory 128M -> 64M", r.stdout
        assert _cg(sb.id).limits()["cpus"] == 0.25
        r = dsec("resize", sb.id, "--cpus", "64", env=env)
        assert r.returncode == 1 and b"Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and b"CPUs" in r.stderr, r.stderr
        r = dsec("resize", sb.id, env=env)
        assert r.returncode == 2 and b"nothing to change" in r.stderr
        r = dsec("resize", sb.id, "--memory", "lots", env=env)
        assert r.returncode == 2 and b"--memory" in r.stderr and b"Traceback" not in r.stderr
        r = dsec("resize", sb.id, "--pids", "99", "--format", "json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout)["resources"]["pids"] == 99


# ---------------------------------------------------------------- resource windows

WINDOW = {"base": {"cpus": 0.25, "memory": "128M"}, "peak": {"cpus": 1.5, "memory": "256M"},
          "phases": {"rollout": {"cpus": 1.5, "memory": "256M"}, "verify": {"cpus": 0.25, "memory": "128M"}}}


def test_two_windowed_sandboxes_whose_peaks_do_not_fit_are_staggered(client, clickhouse_url):
    a = client.create(window=WINDOW, warm=False)
    b = client.create(window=WINDOW, warm=False)           # bases 0.5 + one burst 1.25 fit 2 CPUs
    try:
        assert a.info().phase == "base" and _cg(a.id).limits()["cpus"] == 0.25
        assert a.set_phase("rollout")["phase"] == "rollout"
        assert _cg(a.id).limits()["cpus"] == 1.5 and _cg(a.id).limits()["memory"] == 256 << 20
        with pytest.raises(ResourceExhausted) as ei:        # no waiting: refused with the reason
            b.set_phase("rollout")
        assert "needs 1.25 CPUs, 128MiB memory more, 0.25 CPUs" in ei.value.message, ei.value.message
        done = {}

        def later():
            done["r"] = b.set_phase("rollout", wait=20)
        t = threading.Thread(target=later)
        t.start()
        time.sleep(0.5)
        assert "r" not in done and _cg(b.id).limits()["cpus"] == 0.25     # b waits for a's peak to pass
        a.set_phase("verify")
        t.join(20)
        assert done["r"]["phase"] == "rollout" and done["r"]["waited_seconds"] >= 0.4
        assert _cg(b.id).limits()["cpus"] == 1.5 and _cg(a.id).limits()["cpus"] == 0.25
        assert b.info().phase == "rollout"
        with pytest.raises(InvalidArgument):
            b.set_phase("nosuch")
        with pytest.raises(AgentError) as ei:
            b.update_resources(cpus=1)
        assert "resource window" in ei.value.message
        # a third window would leave no room for one peak on top of the bases: it queues
        c = client.create(window={"base": {"cpus": 0.5, "memory": "128M"}, "peak": {"cpus": 1.5, "memory": "128M"}},
                          warm=False, wait=False)
        assert client.get(c.id).state == "queued", client.get(c.id)
        client.kill(c.id)
    finally:
        a.close()
        b.close()
    evs = _events(clickhouse_url, b.id, want=lambda e: "phase_switched" in _states(e) and "cleaned" in _states(e))
    st = _states(evs)
    assert "phase_waiting" in st and st.index("phase_waiting") < st.index("phase_switched"), st
    sw = _lifecycle(evs, "phase_switched")[0]
    assert sw["phase"] == "rollout" and sw["previous"] == "base" and sw["resources"]["cpus"] == 1.5


def test_bad_windows_are_named(client):
    with pytest.raises(InvalidArgument) as ei:
        client.create(window={"base": {"cpus": 2, "memory": "128M"}, "peak": {"cpus": 1, "memory": "128M"}})
    assert "above peak" in ei.value.message
    with pytest.raises(InvalidArgument) as ei:
        client.create(cpus=1, window=WINDOW)
    assert "give one" in ei.value.message
    with pytest.raises(InvalidArgument) as ei:
        client.create(window={"phases": {"bad name!": {"cpus": 1, "memory": "128M"}}})
    assert "bad name" in ei.value.message


# ---------------------------------------------------------------- the circuit breaker

@pytest.fixture(scope="module")
def breaker_agent(tmp_path_factory, clickhouse_url):
    a = AgentProc(str(tmp_path_factory.mktemp("breaker")), clickhouse_url, {
        "capacity": {"cpus": 2, "memory": "2G", "reserve_memory": 0, "cpu_oversubscription": 1},
        "scheduling": {"tick_seconds": 0.1},
        "breaker": {"interval_seconds": 0.2, "oom": {"kills": 3, "window_seconds": 30, "action": "stop"},
                    "cpu": {"throttled_percent": 80, "for_seconds": 1.0, "action": "cut_quota", "cut_to": 0.5}},
    }).start()
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def test_an_oom_loop_trips_the_breaker_and_the_sandbox_is_stopped(breaker_agent, clickhouse_url):
    with breaker_agent.client() as c:
        sb = c.create(cpus=1, memory="256M", warm=False)
        hog = "while :; do python3 -c 'b = bytearray(1 << 30)'; sleep 0.1; done"
        t, out = _background(sb, ["sh", "-c", hog])
        info = c.wait(sb.id, timeout=30)
        t.join(10)
        assert info.state == "killed" and "circuit breaker" in info.reason and "OOM kills" in info.reason, info
        sb.close()
    evs = _events(clickhouse_url, sb.id, want=lambda e: "breaker_tripped" in _states(e) and "cleaned" in _states(e))
    trip = _lifecycle(evs, "breaker_tripped")[0]
    assert trip["trigger"] == "oom" and trip["action"] == "stop" and trip["oom_kills"] >= 3


def test_a_pinned_cpu_quota_is_cut_and_recorded(breaker_agent, clickhouse_url):
    with breaker_agent.client() as c:
        with c.create(cpus=0.2, memory="128M", warm=False) as sb:
            t, _ = _background(sb, BUSY)
            deadline = time.monotonic() + 20
            while _cg(sb.id).limits()["cpus"] == 0.2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _cg(sb.id).limits()["cpus"] == 0.1
            assert sb.info().state == "running"
            sb.kill(grace=0)
            t.join(10)
    evs = _events(clickhouse_url, sb.id, want=lambda e: "breaker_tripped" in _states(e) and "cleaned" in _states(e))
    trip = _lifecycle(evs, "breaker_tripped")[0]
    assert trip["trigger"] == "cpu" and trip["action"] == "cut_quota" and trip["throttled_percent"] >= 80
    assert trip["resources"]["cpus"] == 0.1
    up = _lifecycle(evs, "resources_updated")[0]
    assert up["by"] == "breaker" and up["resources"]["cpus"] == 0.1
