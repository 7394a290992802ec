"""dsec run -> eBPF -> spool -> ClickHouse -> dsec events/replay, end to end.

Real BPF programs in the running kernel, a real sandbox, the project's own
ClickHouse server on loopback."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import dsec

WORKLOAD = r'''
import os, socket, subprocess, sys
marker = sys.argv[1]
# 3 execs (plus this python3 itself): two /bin/true and one /bin/echo with a 200 KB argv
subprocess.run(["/bin/true"]); subprocess.run(["/bin/true"])
subprocess.run(["/bin/echo"] + ["A" * 50_000] * 4, stdout=subprocess.DEVNULL)
# 2 connects: a listener of our own, and a closed port
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c1 = socket.socket(); c1.connect(("127.0.0.1", srv.getsockname()[1]))
c2 = socket.socket()
try:
    c2.connect(("127.0.0.1", 1))
except OSError:
    pass
# 3 file writes, one with a non-UTF-8 name
base = os.getcwd().encode()
open(base + b"/a-" + marker.encode() + b".txt", "w").write("a")
open(base + b"/caf\xe9-\xff-" + marker.encode(), "wb").write(b"x")
with open("/tmp/b-" + marker, "a") as f:
    f.write("b")
os.unlink(base + b"/a-" + marker.encode() + b".txt")
os.rename("/tmp/b-" + marker, "/tmp/c-" + marker)
'''


def events(sid, env, *kinds):
    args = ["events", "--sandbox", sid, "--format", "json"]
    for k in kinds:
        args += ["--kind", k]
    r = dsec(*args, env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.decode().splitlines()]


@pytest.fixture
def audit_env(clickhouse_url, tmp_path):
    return {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}


def test_completeness_exact_events_and_nothing_from_outside(audit_env, sid, tmp_path):
    marker = os.urandom(4).hex()
    out = tmp_path / "s.json"
    # the same workload on the host, at the same time, must leave no trace
    hostdir = tmp_path / "host"
    hostdir.mkdir()
    host = subprocess.Popen([sys.executable, "-B", "-c", WORKLOAD, "host" + marker], cwd=hostdir)
    r = dsec("run", "--sandbox-id", sid, "--summary-json", str(out), "--", "python3", "-B", "-c", WORKLOAD, marker,
             env=audit_env)
    assert host.wait(timeout=60) == 0
    os.unlink(f"/tmp/c-host{marker}")             # the host run's renamed file (the sandbox's /tmp is its own)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["audit"]["lost"] == 0 and s["audit"]["pending"] == 0

    evs = events(sid, audit_env)
    assert all(e["sandbox_id"] == sid for e in evs)
    assert not [e for e in evs if "host" + marker in json.dumps(e)]
    work = [e for e in evs if e["step"] == 1]

    execs = [e for e in work if e["kind"] == "exec" and e["ret"] == 0]
    assert [os.path.basename(e["path"]) for e in execs][1:] == ["true", "true", "echo"]
    assert os.path.basename(execs[0]["path"]).startswith("python3")
    true_sha = hashlib.sha256(open("/usr/bin/true", "rb").read()).hexdigest()
    assert execs[1]["sha256"] == true_sha and execs[1]["build_id"], execs[1]["extra"]
    assert execs[1]["interp"].startswith("/lib") and execs[1]["is_static"] == 0
    echo = execs[3]
    assert echo["argv_truncated"] == 1 and echo["argv"][0] == "/bin/echo" and echo["argv"][1].startswith("AAAA")

    conns = [e for e in work if e["kind"] == "connect"]
    assert len(conns) == 2
    assert conns[0]["family"] == "ipv4" and conns[0]["addr"] == "127.0.0.1" and conns[0]["ret"] == 0
    assert conns[1]["port"] == 1 and conns[1]["ret"] == -111

    writes = [os.fsencode(e["path"]) for e in work if e["kind"] == "open_write" and marker in e["path"]]
    assert writes == [f"/workspace/a-{marker}.txt".encode(), b"/workspace/caf\xe9-\xff-" + marker.encode(),
                      f"/tmp/b-{marker}".encode()]
    unl = [e for e in work if e["kind"] == "unlink"]
    assert [e["path"] for e in unl] == [f"/workspace/a-{marker}.txt"]
    ren = [e for e in work if e["kind"] == "rename"]
    assert [(e["path"], e["path2"]) for e in ren] == [(f"/tmp/b-{marker}", f"/tmp/c-{marker}")]

    kinds = {e["kind"] for e in evs}
    assert {"sandbox_start", "sandbox_exit", "fork", "exit"} <= kinds

    # replay reads the same record back as a tree and a timeline
    rr = dsec("replay", sid, env=audit_env)
    assert rr.returncode == 0, rr.stderr
    text = rr.stdout.decode()
    assert "process tree:" in text and "/bin/echo" in text and "connect  ipv4 127.0.0.1:1 -> ECONNREFUSED" in text
    assert "rename   /tmp/b-" in text


def test_clickhouse_down_then_back_loses_nothing(scratch_clickhouse, tmp_path, sid):
    env = {"DSEC_CLICKHOUSE_URL": scratch_clickhouse.url_for("dsec_outage"), "DSEC_SPOOL_DIR": str(tmp_path / "spool")}
    scratch_clickhouse.stop()
    r = dsec("run", "--sandbox-id", sid, "--", "sh", "-c", "for i in 1 2 3 4 5; do echo $i > /workspace/f$i; done",
             env=env)
    assert r.returncode == 0
    assert b"wait in the spool" in r.stderr
    scratch_clickhouse.start()
    r = dsec("export", "--timeout", "30", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # a second export (a retry after a crash, say) must not duplicate anything
    assert dsec("export", env=env).returncode == 0
    evs = events(sid, env)
    ids = [e["event_id"] for e in evs]
    assert len(ids) == len(set(ids))
    files = sorted(e["path"] for e in evs if e["kind"] == "open_write" and e["path"].startswith("/workspace/f"))
    assert files == [f"/workspace/f{i}" for i in range(1, 6)]
    assert {"sandbox_start", "sandbox_exit"} <= {e["kind"] for e in evs}


def test_audit_off_records_nothing(audit_env, sid):
    r = dsec("run", "--audit", "off", "--sandbox-id", sid, "--", "true", env=audit_env)
    assert r.returncode == 0
    r = dsec("events", "--sandbox", sid, "--format", "json", env=audit_env)
    assert r.stdout == b""


FLOOD = ("import os\n"      # a name each: repeats of one would be counted in the kernel, not over budget
         "for i in range(40000):\n"
         "    fd = os.open('/tmp/f%d' % i, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
         "    os.close(fd)\n"
         "print('done')\n")


def test_flood_over_budget_is_counted_never_silent(audit_env, sid, tmp_path):
    out = tmp_path / "s.json"
    r = dsec("run", "--sandbox-id", sid, "--summary-json", str(out), "--", "python3", "-c", FLOOD, env=audit_env)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    lost = s["audit"]["lost"]
    assert lost > 1000                                    # 40k events against a burst of 25k
    assert b"LOST" in r.stderr
    evs = events(sid, audit_env)
    gaps = [e for e in evs if e["kind"] == "events_lost"]
    assert gaps and sum(e["count"] for e in gaps) == lost
    # occurrences: a summary of repeats counted in the kernel (extra.aggregated) stands for its count
    writes = sum(e["count"] if '"aggregated": true' in e["extra"] else 1 for e in evs if e["kind"] == "open_write")
    assert 0.9 * 40000 <= writes + lost <= 40000 + 100     # recorded + counted = what happened
    text = dsec("replay", sid, env=audit_env).stdout.decode()
    assert "the record has holes" in text and "!! LOST" in text


def test_over_budget_stop_kills_the_sandbox(audit_env, sid, tmp_path):
    out = tmp_path / "s.json"
    r = dsec("run", "--sandbox-id", sid, "--over-budget", "stop", "--summary-json", str(out), "--",
             "python3", "-c", FLOOD, env=audit_env)
    s = json.loads(out.read_text())
    assert b"done" not in r.stdout
    assert r.returncode == 128 + 9 and s["audit"]["stopped_over_budget"] is True


# a shell that forks (/bin/true, exec'd: fork, exec, exit records) and writes (open_write) until it is killed
FORK_WRITE = "i=0; while :; do i=$((i+1)); /bin/true; echo $i > /tmp/w$i; done"
FENCE_POLICY = """\
apiVersion: dsec/v1
kind: SandboxPolicy
metadata: {name: close-fence}
spec:
  mode: audit
  exec: {allow: ["/usr/bin/env"]}
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    from agent.sensors.recorder import Recorder
    from exporters.spool import Spool
    rec = Recorder(spool=Spool(str(tmp_path_factory.mktemp("spool"))))
    yield rec
    rec.close()


def _occurrences(recs: list[dict]) -> dict:
    """kind -> events the records stand for (an aggregated record: its count)."""
    out: dict = {}
    for r in recs:
        agg = '"aggregated":true' in (r.get("extra") or "").replace(" ", "")
        out[r["kind"]] = out.get(r["kind"], 0) + ((r.get("count") or 1) if agg else 1)
    return out


def test_close_loses_no_event_of_a_workload_killed_while_it_forks_and_writes(recorder, sid):
    """Closed while its workload forks and writes, each sandbox's record holds
    every event both sensors' kernel counters say they emitted, none lost: the
    sensors' last read at a close is fenced by the ring's producer position once
    the cgroup is empty (agent/sandbox/cgroups.py cgroup_populated, _consume_past).
    Both ways a watch ends: on the launcher's on_gone (the node agent: the cgroup
    empty, still there) and at on_exit (`dsec run`: the cgroup removed)."""
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    from agent.sensors.watch import SandboxWatch
    from policies.load import load_policy_text
    policy = load_policy_text(FENCE_POLICY)
    seen: list[dict] = []
    recorder.add_tap(seen.extend)
    try:
        for i in range(12):
            spec = SandboxSpec(argv=[], sandbox_id=f"{sid}-{i}", policy=policy, memory="128M", pids=256)
            watch = SandboxWatch(recorder, spec)
            extra = {"on_gone": lambda _sid, w=watch: w.unwatch()} if i % 2 else {}
            fences = (recorder.sensor.fences, recorder.enforcer.fences)
            sb = Sandbox(spec, **watch.hooks(), **extra).start()
            try:
                st = sb.exec(["/bin/sh", "-c", f"({FORK_WRITE}) & sleep {0.05 + 0.03 * i}"])
                assert st.exit_code == 0, st.to_dict()
            finally:
                summary = sb.close()
            assert recorder.flush(timeout=10)
            stats = watch.stats
            assert stats["lost_total"] == 0, stats
            if recorder.sensor._reader is not None:       # the bulk reader (BCC's own: the settle instead)
                assert (recorder.sensor.fences, recorder.enforcer.fences) == (fences[0] + 1, fences[1] + 1)
            emitted = dict(stats["emitted"])
            for k, n in stats["enforcement"]["emitted"].items():
                emitted[k] = emitted.get(k, 0) + n
            recs = [r for r in seen if r.get("sandbox_id") == spec.sandbox_id and r["kind"] in emitted]
            got = _occurrences(recs)
            own = stats.get("init_own", 0)          # dsec-init's own writes: counted, not recorded
            assert sum(got.values()) == sum(emitted.values()) - own, (i, got, emitted, own)
            assert {k: n for k, n in got.items() if k not in ("open_write", "unlink", "rename")} == \
                {k: n for k, n in emitted.items() if k not in ("open_write", "unlink", "rename")}, (i, got, emitted)
            assert emitted["fork"] > 5 and emitted["open_write"] > 5 and emitted["exec_violation"] > 5, emitted
            assert summary["audit"]["lost"] == 0
    finally:
        recorder.remove_tap(seen.extend)
