"""Multi-step sandboxes (the launcher's Sandbox API) with the audit recorder:
steps share the filesystem, every event carries its step number."""
from __future__ import annotations

import os

import pytest

from agent.sandbox.launcher import Sandbox, SandboxSpec
from agent.sensors.recorder import Recorder
from exporters.spool import Spool
from exporters.clickhouse import flush


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    rec = Recorder(spool=Spool(str(tmp_path_factory.mktemp("spool"))))
    yield rec
    rec.close()


def _audited_sandbox(rec, **spec):
    state = {}

    def on_cgroup(sid, cg):
        state["cg"] = cg

    def on_started(sid, pid):          # watched from init's HELLO, as SandboxWatch does
        rec.watch(sid, state["cg"], step=0)
        return rec.started(state["cg"], pid)

    sb = Sandbox(SandboxSpec(argv=[], **spec), on_cgroup=on_cgroup, on_started=on_started,
                 on_step=lambda sid, step: rec.sensor.set_step(state["cg"], step),
                 on_workload_exit=lambda sid: rec.catch_up(),
                 on_exit=lambda summary: rec.unwatch(state["cg"]))
    return sb.start()


def test_five_steps_share_state_and_events_carry_steps(recorder, clickhouse_url, sid):
    from replay.store import AuditStore
    sb = _audited_sandbox(recorder, sandbox_id=sid)
    r, w = os.pipe()
    try:
        results = [
            sb.exec(["sh", "-c", "echo one > /workspace/state"]),
            sb.exec(["sh", "-c", "echo two > /workspace/two"]),
            sb.exec(["cat", "/workspace/state"], stdout=w),
            sb.exec(["sh", "-c", "exit 7"]),
            sb.exec(["sleep", "30"], timeout=0.5, grace=0.5),
        ]
    finally:
        os.close(w)
        summary = sb.close()
    out = os.read(r, 100)
    os.close(r)
    assert out == b"one\n"                        # written in step 1, read in step 3
    assert [s.code for s in results] == [0, 0, 0, 7, 124]
    assert results[4].timed_out
    assert [s["step"] for s in summary["steps"]] == [1, 2, 3, 4, 5]
    res = flush(recorder.spool, url=clickhouse_url, timeout=20)
    assert res.ok, res.summary()
    with AuditStore(clickhouse_url) as store:
        evs = list(store.events(sid))
    execs = [(e["step"], os.path.basename(e["path"])) for e in evs if e["kind"] == "exec" and e["ret"] == 0]
    assert execs == [(1, "sh"), (2, "sh"), (3, "cat"), (4, "sh"), (5, "sleep")]
    writes = {e["path"]: e["step"] for e in evs if e["kind"] == "open_write" and e["path"].startswith("/workspace")}
    assert writes == {"/workspace/state": 1, "/workspace/two": 2}


def test_two_sandboxes_exec_one_binary_read_once_both_records_carry_sha256(recorder, clickhouse_url, sid):
    """Each sandbox sees /usr through an overlay of its own (another st_dev): the exec
    enrichment cache keys the file by the real lower file, so the second sandbox's exec of
    the same binary is a hit; both exec records carry its sha256 and build-id."""
    import hashlib
    from replay.store import AuditStore
    cache = recorder.sensor.decoder.enricher
    binary = "/usr/bin/expr"
    with open(os.path.realpath(binary), "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    reads = cache.reads
    ids = [f"{sid}-a", f"{sid}-b"]
    boxes = []
    try:
        for i in ids:                       # both live: two overlay mounts, two st_devs (a closed
            boxes.append(_audited_sandbox(recorder, sandbox_id=i))    # one's number is reused)
        for sb in boxes:
            assert sb.exec([binary, "1", "+", "1"]).code == 0
            recorder.catch_up()
            assert recorder.sensor.enrich_worker.wait_all(10)        # read before the next exec
    finally:
        for sb in boxes:
            sb.close()
    assert cache.reads - reads == 1
    res = flush(recorder.spool, url=clickhouse_url, timeout=20)
    assert res.ok, res.summary()
    with AuditStore(clickhouse_url) as store:
        for i in ids:
            (ev,) = [e for e in store.events(i) if e["kind"] == "exec" and e["path"] == binary]
            assert ev["sha256"] == want and ev["build_id"], (i, ev)


def test_background_process_survives_steps_until_close(recorder):
    sb = _audited_sandbox(recorder)
    try:
        assert sb.exec(["sh", "-c", "sleep 60 & echo $! > /tmp/bg"]).code == 0
        r, w = os.pipe()
        st = sb.exec(["sh", "-c", "kill -0 $(cat /tmp/bg) && echo alive"], stdout=w)
        os.close(w)
        assert os.read(r, 100) == b"alive\n" and st.code == 0
        os.close(r)
    finally:
        sb.close()
    assert not sb.cg.pids()


def test_exec_after_close_is_refused(recorder):
    from agent.errors import DsecError
    sb = _audited_sandbox(recorder)
    sb.close()
    with pytest.raises(DsecError, match="closed"):
        sb.exec(["true"])


def test_one_status_thread_for_every_live_sandbox():
    """Issue 13: the launcher read each sandbox's status (dsec-init's control socket and
    pidfd) in a thread of its own: 1,000 sandboxes, 1,000 threads. Now one loop reads all:
    12 live sandboxes, one status thread, each one's steps still answered; a sandbox whose
    init is SIGKILLed is seen dead while the others run on."""
    import signal
    import threading

    def status_threads():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("dsec-sbx"))

    boxes = []
    try:
        for i in range(12):
            boxes.append(Sandbox(SandboxSpec(argv=[], sandbox_id=f"st-{os.getpid()}-{i}", network="none")).start())
        assert status_threads() == ["dsec-sbx-status"]
        assert [b.exec(["sh", "-c", f"exit {i}"]).code for i, b in enumerate(boxes)] == list(range(12))
        victim = boxes.pop()
        os.kill(victim.sup_pid, signal.SIGKILL)
        with victim._cond:
            assert victim._cond.wait_for(lambda: victim.supervisor_dead, timeout=10)
        victim.close()
        assert [b.exec(["true"]).code for b in boxes] == [0] * 11
    finally:
        for b in boxes:
            b.close()
    assert status_threads() == ["dsec-sbx-status"]              # the loop stays, nothing per sandbox
