"""Repeats counted in the kernel (bpf/common.h "repeats", agent/sensors/repeats.py):
real BPF programs, real cgroups and sandboxes, the project's ClickHouse server.

The counts add up exactly (records + counted repeats = occurrences), the first
occurrence comes at once in full, summaries come at the end of a flush period
and at the sandbox's end, nothing is left in the kernel's table after it, denied
and failed records are never counted, and the off switch gives one record per
event."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from agent.sensors.repeats import KINDS
from conftest import dsec
from fixtures_bpf import PYTHON, listeners, run_in_cgroup
from test_bpf_audit import _kill

WORKLOAD = r'''
import os, socket, sys
d, n, port, upath = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for i in range(n):
    fd = os.open(d + "/r%d" % (i % 4), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.close(fd)
for i in range(n // 10):
    open(d + "/t", "w").close()
    os.rename(d + "/t", d + "/u")
    os.unlink(d + "/u")
    s = socket.socket(); s.connect(("127.0.0.1", port)); s.close()
    u = socket.socket(socket.AF_UNIX); u.connect(upath); u.close()
for i in range(20):                      # failed writes: never counted in the kernel
    try:
        os.open(d + "/missing/x", os.O_WRONLY | os.O_CREAT)
    except OSError:
        pass
print("done", flush=True)
sys.stdin.readline()
'''

STEPS = r'''
import os, sys
path = sys.argv[1]
for line in sys.stdin:
    for i in range(int(line)):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    print("ok", flush=True)
'''


def _extra(r) -> dict:
    return json.loads(r.get("extra") or "{}")


def _summary(r) -> bool:
    return bool(_extra(r).get("aggregated"))


def _occurrences(records) -> int:
    return sum(r["count"] if _summary(r) else 1 for r in records)


def _entries(sensor, cgroup_id) -> list:
    return [(k, v) for k, v in sensor.bpf[b"agg"].items() if k.cgroup_id == cgroup_id]


def test_repeats_counted_exactly_first_in_full_nothing_left(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    n = 1000
    srv, upath, usrv = listeners(tmp_path, 256)
    sbx = h.sandbox(audit_cgroups, aggregate=KINDS)
    d = str(tmp_path)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-S", "-B", "-c", WORKLOAD, d, str(n), str(srv.getsockname()[1]),
                               upath], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"done\n"
        # while the process still runs: the flush period's summaries, not only the sandbox's end
        assert h.poll_until(lambda: _occurrences([r for r in sbx.of_kind("open_write")
                                                  if r["path"] == d + "/r0"]) == n // 4, 20)
        stats = h.sensor.stats(sbx.cg.id)
        p.stdin.close()
        assert p.wait(30) == 0
    finally:
        _kill(p)
        srv.close()
        usrv.close()
    assert h.poll_until(lambda: any(r["kind"] == "exit" for r in sbx.records), 10)
    totals = sbx.remove()
    assert not _entries(h.sensor, sbx.cg.id)                 # nothing counted is left behind
    assert totals["lost_total"] == 0 and not sbx.of_kind("events_lost")
    assert set(stats["aggregated"]) == set(KINDS), stats

    def of(kind, **match):
        return [r for r in sbx.of_kind(kind) if all(r[k] == v for k, v in match.items())]

    groups = {("open_write", d + "/r%d" % i): (of("open_write", path=d + "/r%d" % i), n // 4) for i in range(4)}
    groups[("open_write", d + "/t")] = (of("open_write", path=d + "/t"), n // 10)
    groups[("rename", d + "/t")] = (of("rename", path=d + "/t"), n // 10)
    groups[("unlink", d + "/u")] = (of("unlink", path=d + "/u"), n // 10)
    groups[("connect", "tcp")] = (of("connect", family="ipv4"), n // 10)
    groups[("connect", "unix")] = (of("connect", family="unix"), n // 10)
    for what, (recs, want) in groups.items():
        assert _occurrences(recs) == want, (what, [(r["count"], r["extra"]) for r in recs])
        first, rest = recs[0], recs[1:]
        assert not _summary(first) and first["count"] == 0, what       # the first occurrence in full
        assert rest and all(_summary(r) for r in rest), what
        last = _extra(rest[-1])
        assert last["total"] == want and last["aggregated_by"] == "kernel" and last["pids"] == [first["pid"]]
        assert abs(last["first_ts_ns"] - first["ts_ns"]) < 10**6 <= last["last_ts_ns"] - first["ts_ns"] + 10**6
        assert rest[-1]["ts_ns"] == last["last_ts_ns"] and first["decision"] == rest[-1]["decision"]
        for k in ("path", "path2", "flags", "ret", "addr", "port", "comm", "step", "uid", "ppid"):
            assert all(r[k] == first[k] for r in rest), (what, k)
    failed = of("open_write", path=d + "/missing/x")
    assert len(failed) == 20 and not any(_summary(r) for r in failed) and all(r["ret"] < 0 for r in failed)
    # exact: the kernel's records plus the repeats it counted are the occurrences delivered
    kinds = ("open_write", "unlink", "rename", "connect")
    assert {k: _occurrences(sbx.of_kind(k)) for k in kinds} == \
        {k: totals["emitted"].get(k, 0) + totals["aggregated"].get(k, 0) - 0 for k in kinds}
    assert totals["summaries"] == sum(1 for r in sbx.records if _summary(r))


def test_step_change_retires_the_counts_and_off_switch(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    path = str(tmp_path / "s")
    sbx = h.sandbox(audit_cgroups, aggregate=KINDS)
    off = h.sandbox(audit_cgroups)                  # aggregate=(): one record per event
    procs = [run_in_cgroup(s.cg, [PYTHON, "-I", "-S", "-B", "-c", STEPS, path + s.sandbox_id],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE) for s in (sbx, off)]
    try:
        def ask(p, n):
            p.stdin.write(b"%d\n" % n)
            p.stdin.flush()
            assert p.stdout.readline() == b"ok\n"
        mine = lambda s: [r for r in s.of_kind("open_write") if r["path"] == path + s.sandbox_id]  # noqa: E731
        for p in procs:
            ask(p, 1)
        # the first occurrence comes at once, while its process waits
        assert h.poll_until(lambda: len(mine(sbx)) == 1 and len(mine(off)) == 1, 10)
        for p in procs:
            ask(p, 30)
        assert h.poll_until(lambda: _occurrences(mine(sbx)) == 31, 10)
        assert len(mine(sbx)) == 2 and _summary(mine(sbx)[1]) and mine(sbx)[1]["count"] == 30
        h.sensor.set_step(sbx.cg.id, 2)
        h.sensor.set_step(off.cg.id, 2)
        for p in procs:
            ask(p, 10)
        assert h.poll_until(lambda: _occurrences(mine(sbx)) == 41, 10)
        # the new step: its own first record, then its repeats; the old step's entry retired
        step2 = [r for r in mine(sbx) if r["step"] == 2]
        assert not _summary(step2[0]) and _occurrences(step2) == 10
        assert h.poll_until(lambda: all(k.gen == 1 for k, _ in _entries(h.sensor, sbx.cg.id)), 10)
        assert len(_entries(h.sensor, sbx.cg.id)) == 1
    finally:
        for p in procs:
            p.stdin.close()
            _kill(p)
    t_on, t_off = sbx.remove(), off.remove()
    assert not _entries(h.sensor, sbx.cg.id) and not _entries(h.sensor, off.cg.id)
    assert t_on["aggregated"] == {"open_write": 39} and t_on["lost_total"] == 0
    # the off switch: one record per event, nothing counted
    assert len(mine(off)) == 41 and not any(_summary(r) for r in mine(off))
    assert t_off["aggregated"] == {} and t_off["summaries"] == 0


def test_the_set_up_before_the_first_step_makes_no_entries(audit_sensor, audit_cgroups, tmp_path):
    """aggregate_from_step (the recorder's, for every sandbox it watches): what runs before
    the first step -- a sandbox's init setting it up, whose records the recorder leaves out
    -- is emitted one record per event and makes no entry of `agg`, where it made entries
    that stayed for the sandbox's life (two an idle sandbox: every read of the table walked
    them); from the first set_step on, repeats are counted as before."""
    h = audit_sensor
    path = str(tmp_path / "s")
    sbx = h.sandbox(audit_cgroups, aggregate=KINDS, aggregate_from_step=True)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-S", "-B", "-c", STEPS, path], stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE)
    mine = lambda: [r for r in sbx.of_kind("open_write") if r["path"] == path]  # noqa: E731

    def ask(n):
        p.stdin.write(b"%d\n" % n)
        p.stdin.flush()
        assert p.stdout.readline() == b"ok\n"
    try:
        ask(5)
        assert h.poll_until(lambda: len(mine()) == 5, 10)
        assert not any(_summary(r) for r in mine()) and not _entries(h.sensor, sbx.cg.id)
        h.sensor.set_step(sbx.cg.id, 1)
        ask(20)
        assert h.poll_until(lambda: _occurrences(mine()) == 25, 10)
        step1 = [r for r in mine() if r["step"] == 1]
        assert len(step1) == 2 and not _summary(step1[0]) and _summary(step1[1]), step1
        assert len(_entries(h.sensor, sbx.cg.id)) == 1
    finally:
        p.stdin.close()
        _kill(p)
    t = sbx.remove()
    assert not _entries(h.sensor, sbx.cg.id)
    assert t["aggregated"] == {"open_write": 19} and t["lost_total"] == 0


def test_quick_steps_retire_generations_without_the_periodic_flush(audit_sensor, audit_cgroups, tmp_path):
    """A sandbox stepping every few ms retires a generation a step: each is read a last
    time and deleted within a few settles, and the counts stay exact, without bringing
    the periodic flush (every sandbox's state, the whole table) forward to almost every
    poll, as it once did (a bystander's state was read each time)."""
    h = audit_sensor
    path = str(tmp_path / "q")
    sbx = h.sandbox(audit_cgroups, aggregate=KINDS)
    bystander = h.sandbox(audit_cgroups, aggregate=KINDS)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-S", "-B", "-c", STEPS, path],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    snapshots, read = [], []
    real_snap, real_read = h.sensor._snapshot_states, h.sensor._read_state
    h.sensor._snapshot_states = lambda: snapshots.append(1) or real_snap()
    h.sensor._read_state = lambda cgid: read.append(cgid) or real_read(cgid)
    steps = 0
    try:
        s = h.sensor.repeats._sbx[sbx.cg.id]
        h.sensor.poll(0)
        del snapshots[:], read[:]
        start = time.monotonic()
        while time.monotonic() - start < 1.0 and steps < 1000:     # bounded in count and time
            steps += 1
            h.sensor.set_step(sbx.cg.id, steps + 1)
            p.stdin.write(b"3\n")
            p.stdin.flush()
            assert p.stdout.readline() == b"ok\n"
            h.sensor.poll(2)
            time.sleep(0.002)                           # a step every few ms, for a second
        elapsed = time.monotonic() - start
        periods = elapsed / h.sensor.loss_interval_s
        assert s["released"] > 0                        # retired generations deleted meanwhile
        assert len(snapshots) <= periods + 2, (len(snapshots), steps, elapsed)
        assert read.count(bystander.cg.id) <= periods + 2, (read.count(bystander.cg.id), steps)
    finally:
        del h.sensor._snapshot_states, h.sensor._read_state
        p.stdin.close()
        _kill(p)
    totals = sbx.remove()
    assert not _entries(h.sensor, sbx.cg.id) and totals["lost_total"] == 0
    mine = [r for r in sbx.of_kind("open_write") if r["path"] == path]
    assert _occurrences(mine) == 3 * steps
    assert steps > 20


MANY = r'''
import os, sys, time
d, keys = sys.argv[1], int(sys.argv[2])
end = time.monotonic() + 20                      # bounded; killed long before
rounds = 0
while time.monotonic() < end:
    for i in range(keys):
        os.close(os.open(d + "/m%d" % i, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    rounds += 1
    if rounds == 2:
        print("two rounds", flush=True)
'''


def test_many_keys_recycled_and_removal_mid_flow_exact(audit_sensor, audit_cgroups, tmp_path):
    """More keys than half the sandbox's share of the table: generations are
    retired (entries deleted, counts reported) while it runs; the sandbox is
    removed while its process still writes. Exact all along; nothing left."""
    h = audit_sensor
    # no budgets (test_bpf_audit.py tests them): every retirement starts its keys again in full,
    # and how many retirements come before the removal depends on the machine's pace; the
    # default byte budget then counted some as over_bytes (lost, reported) in ~4 runs of 10
    sbx = h.sandbox(audit_cgroups, aggregate=KINDS, rate=0, byte_rate=0)
    keys = h.sensor.repeats.per_sandbox // 2 + 100
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-S", "-B", "-c", MANY, str(tmp_path), str(keys)],
                      stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"two rounds\n"
        s = h.sensor.repeats._sbx[sbx.cg.id]
        assert h.poll_until(lambda: s["released"] > 0, 10)       # a retired generation deleted
        totals = sbx.remove()                                     # while the process writes on
    finally:
        _kill(p)
    assert not _entries(h.sensor, sbx.cg.id)
    assert totals["lost_total"] == 0 and totals["aggregated"]["open_write"] > 0
    mine = [r for r in sbx.of_kind("open_write") if r["path"].startswith(str(tmp_path) + "/m")]
    assert _occurrences(mine) == totals["emitted"]["open_write"] + totals["aggregated"]["open_write"]
    firsts = [r for r in mine if not _summary(r)]
    assert len(firsts) > keys                                    # a retired key starts again in full
    assert len({r["path"] for r in firsts}) == keys


def test_aggregable_kinds_follow_the_policy():
    from policies.evaluate import aggregable_kinds
    from policies.load import load_policy_text
    base = "apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: p}\nspec:\n  mode: %s\n"
    files = "  files: {writable: [/tmp]}\n"
    egress = "  egress: {default: deny, allow: [{cidr: 10.0.0.0/8, ports: [443]}]}\n"
    assert aggregable_kinds(None) == KINDS
    assert aggregable_kinds(load_policy_text(base % "enforce")) == KINDS
    assert aggregable_kinds(load_policy_text(base % "learn" + files + egress)) == KINDS
    assert aggregable_kinds(load_policy_text(base % "audit" + files)) == ("connect",)
    assert aggregable_kinds(load_policy_text(base % "enforce" + egress)) == ("open_write", "unlink", "rename")
    assert aggregable_kinds(load_policy_text(base % "audit" + files + egress)) == ()


LOOP = ('import sys\nfor i in range(int(sys.argv[1])):\n'
        '    f = open(sys.argv[2] + "/f%d" % (i % 4), "a"); f.write("x"); f.close()\n')


@pytest.fixture
def audit_env(clickhouse_url, tmp_path):
    return {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}


def _run(env, sid, tmp_path, *args, extra_env=None):
    out = tmp_path / f"{sid}.json"
    r = dsec("run", "--sandbox-id", sid, "--summary-json", str(out), *args, env=dict(env, **(extra_env or {})))
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["audit"]


def _events(env, sid):
    r = dsec("events", "--sandbox", sid, "--kind", "open_write", "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.decode().splitlines()]


def test_sandbox_repeats_in_clickhouse_replay_denials_and_off(audit_env, sid, tmp_path):
    n = 2000
    # the default policy: writes are allowed whatever the path -> counted in the kernel
    a = _run(audit_env, sid, tmp_path, "--", "python3", "-I", "-S", "-c", LOOP, str(n), "/workspace")
    assert a["lost"] == 0 and a["pending"] == 0 and a["aggregated"]["open_write"] >= n - 8 and a["summaries"] >= 4
    evs = [e for e in _events(audit_env, sid) if e["path"].startswith("/workspace/f")]
    assert _occurrences(evs) == n and len(evs) < n // 10
    assert {e["decision"] for e in evs} == {"allowed"}
    text = dsec("replay", sid, env=audit_env).stdout.decode()
    assert "x500 between " in text, text[-3000:]

    # a policy whose writes outside /tmp would-deny (audit mode): never counted in the kernel; the
    # recorder's own denial summaries are the path denials always took
    pol = tmp_path / "p.yaml"
    pol.write_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: agg-audit}\n"
                   "spec:\n  mode: audit\n  files: {writable: [/tmp]}\n")
    sid2 = sid + "-audit"
    a2 = _run(audit_env, sid2, tmp_path, "--policy", str(pol), "--", "python3", "-I", "-S", "-c", LOOP, "40",
              "/workspace")
    assert a2["aggregated"] == {} and a2["summaries"] == 0
    evs2 = [e for e in _events(audit_env, sid2) if e["path"].startswith("/workspace/f")]
    assert {e["decision"] for e in evs2} == {"would-deny"} and _occurrences(evs2) == 40
    assert not any(_extra(e).get("aggregated_by") == "kernel" for e in evs2)

    # the off switch: one record per event
    sid3 = sid + "-off"
    a3 = _run(audit_env, sid3, tmp_path, "--", "python3", "-I", "-S", "-c", LOOP, "200", "/workspace",
              extra_env={"DSEC_AUDIT_AGGREGATE": "off"})
    assert a3["aggregated"] == {} and a3["summaries"] == 0
    evs3 = [e for e in _events(audit_env, sid3) if e["path"].startswith("/workspace/f")]
    assert len(evs3) == 200 and not any(_summary(e) for e in evs3)
    assert os.environ.get("DSEC_AUDIT_AGGREGATE") is None


def test_one_sandbox_end_leaves_the_others_counts_exact(audit_sensor, audit_cgroups, tmp_path):
    """A sandbox's end reads its own entries only, once (its removal's Repeats.finish; the drain
    before it leaves them: a read walks every sandbox's entries of `agg`): another sandbox's
    counts, and a generation it retired just before, stay exact to its own end and nothing of
    either is left in the table."""
    h = audit_sensor
    a = h.sandbox(audit_cgroups, aggregate=KINDS)
    b = h.sandbox(audit_cgroups, aggregate=KINDS)
    path = str(tmp_path / "s")
    procs = {s.sandbox_id: run_in_cgroup(s.cg, [PYTHON, "-I", "-S", "-B", "-c", STEPS, path + s.sandbox_id],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE) for s in (a, b)}
    mine = lambda s: [r for r in s.of_kind("open_write") if r["path"] == path + s.sandbox_id]  # noqa: E731

    def ask(s, n):
        p = procs[s.sandbox_id]
        p.stdin.write(b"%d\n" % n)
        p.stdin.flush()
        assert p.stdout.readline() == b"ok\n"
    try:
        for s in (a, b):
            ask(s, 20)
        assert h.poll_until(lambda: _occurrences(mine(a)) == 20 and _occurrences(mine(b)) == 20, 10)
        h.sensor.set_step(b.cg.id, 2)               # b's first generation retired
        ask(b, 5)
        ask(a, 5)
        reads = []
        real = h.sensor.repeats._entries
        h.sensor.repeats._entries = lambda scope=None: reads.append(scope) or real(scope)
        try:
            h.sensor.drain(a.cg.id, ending=True)    # a's end, as Recorder.catch_up: its removal follows
            assert reads == []                      # which reads its entries (one walk of `agg`, not two)
            _kill(procs[a.sandbox_id])
            t_a = a.remove()
            assert reads == [{a.cg.id}]
        finally:
            del h.sensor.repeats._entries
        ask(b, 5)
    finally:
        for p in procs.values():
            p.stdin.close()
            _kill(p)
    t_b = b.remove()
    assert not _entries(h.sensor, a.cg.id) and not _entries(h.sensor, b.cg.id)
    assert _occurrences(mine(a)) == 25 and _occurrences(mine(b)) == 30
    assert t_a["lost_total"] == 0 and t_b["lost_total"] == 0
    assert t_b["aggregated"]["open_write"] == 30 - len([r for r in mine(b) if not _summary(r)])
