"""The sinks beside ClickHouse: OTLP (logs, traces, metrics) against a real
OTLP/gRPC receiver on loopback (tests/otlp_receiver.py: grpcio + the
opentelemetry-proto collector stubs, no mock of the exporter), JSON lines,
several sinks at once with their own cursors, configuration, the agent's
metrics, and `dsec run` / `dsec export` driven by the standard OTEL_*
environment."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid

import grpc
import pytest

from exporters.errors import ExportError
from exporters.metrics import INSTRUMENTS, METRICS
from exporters.spool import Spool
from audit_schema.events import FIELDS, from_bytes
from exporters.base import RetryPolicy
from exporters.configure import env_sinks, flush_sinks, sinks_from_config, start_sinks, stop_sinks
from exporters.jsonl import JsonlSink
from exporters.otel import (ATTRIBUTES, OtlpSink, attribute_name, attributes_for, logs_enabled_by_env,
                            semconv_names, span_id_of, trace_id_of)

from otlp_receiver import OtlpReceiver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DSEC = os.path.join(ROOT, ".venv", "bin", "dsec")
T0 = 1_800_000_000_000_000_000


def evs(sid, n, start=0, node="node-a", **kw):
    out = []
    for i in range(start, start + n):
        r = {"event_id": f"{sid}-{i}", "ts_ns": T0 + i * 1000, "node": node, "sandbox_id": sid, "step": 1,
             "kind": ("exec", "connect", "open_write")[i % 3], "pid": 100 + i, "ppid": 1, "path": f"/w/f{i}",
             "decision": "allowed"}
        r.update(kw)
        out.append(r)
    return out


def lifecycle(sid, node="node-a", t=T0):
    """A `dsec run`-shaped lifecycle: sandbox_start, step 1, a few events, exit."""
    ms = 1_000_000
    return [
        {"event_id": f"{sid}-start", "ts_ns": t, "node": node, "sandbox_id": sid, "kind": "sandbox_start",
         "argv": ["python3", "-c", "x"], "policy_name": "default", "mode": "enforce"},
        {"event_id": f"{sid}-s1", "ts_ns": t + 100 * ms, "node": node, "sandbox_id": sid, "kind": "step_start",
         "step": 1, "argv": ["python3", "-c", "x"]},
        {"event_id": f"{sid}-x", "ts_ns": t + 110 * ms, "node": node, "sandbox_id": sid, "kind": "exec", "step": 1,
         "pid": 7, "ppid": 6, "uid": 1000, "path": "/usr/bin/python3", "argv": ["python3", "-c", "x"],
         "build_id": "ab" * 20, "sha256": "cd" * 32},
        {"event_id": f"{sid}-e1", "ts_ns": t + 300 * ms, "node": node, "sandbox_id": sid, "kind": "step_end",
         "step": 1, "exit_code": 3, "extra": json.dumps({"wall_ms": 200, "timed_out": False})},
        {"event_id": f"{sid}-end", "ts_ns": t + 400 * ms, "node": node, "sandbox_id": sid, "kind": "sandbox_exit",
         "step": 1, "exit_code": 3},
    ]


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path / "spool"), fsync="never")
    yield s
    s.close()


@pytest.fixture
def receiver():
    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


# --- the attribute mapping ---------------------------------------------------------------

def test_every_schema_field_is_mapped_to_a_semconv_or_dsec_attribute():
    assert set(ATTRIBUTES) == {f.name for f in FIELDS}          # one table, every field
    known = semconv_names()
    assert "process.pid" in known and len(known) > 500
    for field, (where, name) in ATTRIBUTES.items():
        assert where in ("attr", "resource", "record"), field
        names = name.values() if isinstance(name, dict) else [name]
        for n in names:
            if where == "record":
                assert n in ("time_unix_nano", "event_name")
            elif not n.startswith("dsec."):
                assert n in known, f"{field} -> {n}: not an OTel semantic-convention attribute"
    # the ones the issue names
    assert attribute_name("pid", "exec") == "process.pid"
    assert attribute_name("ppid", "fork") == "process.parent_pid"
    assert attribute_name("path", "exec") == "process.executable.path"
    assert attribute_name("path", "open_write") == "file.path"
    assert attribute_name("argv", "exec") == "process.command_args"
    assert attribute_name("addr", "connect") == "network.peer.address"
    assert attribute_name("port", "connect") == "network.peer.port"
    assert attribute_name("sha256", "exec") == "dsec.sha256"


def test_attributes_keep_bytes_and_leave_defaults_out():
    raw = b"/tmp/\xff\xfe/x"
    a = attributes_for({"event_id": "e", "kind": "exec", "pid": 5, "ppid": 0, "path": from_bytes(raw),
                        "argv": ["ok", from_bytes(b"\x80")], "count": 2**64 - 1, "uid": 0})
    assert a["process.executable.path"] == raw.decode("utf-8", "replace") and a["dsec.raw.path"] == raw
    assert a["process.command_args"] == ("ok", "\ufffd") and a["dsec.raw.argv"] == (b"ok", b"\x80")
    assert a["dsec.count"] == str(2**64 - 1)                      # int64 overflow -> decimal string
    assert "process.parent_pid" not in a and "process.real_user.id" not in a
    c = attributes_for({"event_id": "c", "kind": "connect", "family": "unix", "addr": "/run/x.sock", "ret": 0})
    assert c["network.transport"] == "unix" and "network.type" not in c and c["dsec.ret"] == 0
    t = attributes_for({"event_id": "t", "kind": "egress_denied", "family": "ipv4", "protocol": "tcp", "port": 0})
    assert (t["network.type"], t["network.transport"], t["network.peer.port"]) == ("ipv4", "tcp", 0)


# --- OTLP, for real --------------------------------------------------------------------

def test_otlp_logs_and_lifecycle_traces_reach_a_real_receiver(receiver, spool):
    sid = "sb-" + uuid.uuid4().hex[:8]
    recs = lifecycle(sid) + evs(sid, 30, start=100) + [
        {"event_id": f"{sid}-lost", "ts_ns": T0 + 5, "node": "node-a", "sandbox_id": sid, "kind": "events_lost",
         "count": 4, "extra": json.dumps({"reason": "ringbuf_full"})},
        {"event_id": f"{sid}-deny", "ts_ns": T0 + 6, "node": "node-a", "sandbox_id": sid, "kind": "egress_denied",
         "decision": "denied", "family": "ipv4", "addr": "203.0.113.9", "port": 443, "protocol": "tcp"},
        {"event_id": f"{sid}-bytes", "ts_ns": T0 + 7, "node": "node-a", "sandbox_id": sid, "kind": "open_write",
         "path": from_bytes(b"/w/\xff"), "flags": 0o101, "ret": 3},
    ]
    spool.append_many(recs)
    sink = OtlpSink(spool, endpoint=receiver.endpoint, batch_records=7)
    res = sink.flush(timeout=20)
    assert res.ok and res.sent == len(recs), res.summary()
    logs = receiver.logs()
    assert sorted(a["log.record.uid"] for _, _, a in logs) == sorted(r["event_id"] for r in recs)   # each once
    by_id = {a["log.record.uid"]: (res_, lr, a) for res_, lr, a in logs}
    res_, lr, a = by_id[f"{sid}-x"]
    assert res_["container.id"] == sid and res_["dsec.sandbox.id"] == sid and res_["host.name"] == "node-a"
    assert res_["service.name"] == "dsec" and res_["container.runtime.name"] == "dsec"
    assert lr.event_name == "dsec.exec" and lr.time_unix_nano == T0 + 110_000_000 and lr.severity_text == "INFO"
    assert (a["process.pid"], a["process.parent_pid"], a["process.real_user.id"]) == (7, 6, 1000)
    assert a["process.executable.path"] == "/usr/bin/python3"
    assert a["process.command_args"] == ("python3", "-c", "x")
    assert a["process.executable.build_id.gnu"] == "ab" * 20 and a["dsec.sha256"] == "cd" * 32
    assert a["dsec.step"] == 1 and a["dsec.kind"] == "exec"
    assert "/usr/bin/python3" in lr.body.string_value
    # the log record sits in its step's span of the sandbox's trace
    assert lr.trace_id == trace_id_of("node-a", sid).to_bytes(16, "big")
    assert lr.span_id == span_id_of("node-a", sid, "step", 1).to_bytes(8, "big")
    _, lr, a = by_id[f"{sid}-{101}"]
    assert (a["network.peer.address"] if "network.peer.address" in a else None) is None   # no addr: left out
    _, lr, a = by_id[f"{sid}-deny"]
    assert lr.severity_text == "WARN" and a["network.peer.address"] == "203.0.113.9"
    assert (a["network.peer.port"], a["network.transport"], a["dsec.decision"]) == (443, "tcp", "denied")
    _, lr, a = by_id[f"{sid}-lost"]
    assert lr.severity_text == "ERROR" and a["dsec.count"] == 4
    _, lr, a = by_id[f"{sid}-bytes"]
    assert a["file.path"] == "/w/\ufffd" and a["dsec.raw.path"] == b"/w/\xff" and a["dsec.ret"] == 3
    # traces: the sandbox, its launch and its step
    spans = {sp.name: (sp, a) for _, sp, a in receiver.spans()}
    assert set(spans) == {f"sandbox {sid}", "launch", "step 1"}
    root, ra = spans[f"sandbox {sid}"]
    step, sa = spans["step 1"]
    launch, _ = spans["launch"]
    assert root.parent_span_id == b"" and step.parent_span_id == root.span_id == launch.parent_span_id
    assert root.trace_id == step.trace_id == trace_id_of("node-a", sid).to_bytes(16, "big")
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (T0, T0 + 400_000_000)
    assert (launch.start_time_unix_nano, launch.end_time_unix_nano) == (T0, T0 + 100_000_000)
    assert (step.start_time_unix_nano, step.end_time_unix_nano) == (T0 + 100_000_000, T0 + 300_000_000)
    assert sa["process.exit.code"] == 3 and sa["process.command_args"] == ("python3", "-c", "x")
    assert step.status.code == 2 and root.status.code == 2             # STATUS_CODE_ERROR: exit 3
    assert ra["security_rule.ruleset.name"] == "default"
    sink.close()


def test_agent_lifecycle_phases_span_across_batches_and_restarts(receiver, spool):
    """Phase spans from the agent's lifecycle records; the state a span needs
    survives a new sink process (it is committed with the cursor)."""
    sid = "sb-" + uuid.uuid4().hex[:8]
    ms = 1_000_000

    def lc(i, state, t, **extra):
        return {"event_id": f"{sid}-l{i}", "ts_ns": T0 + t * ms, "node": "n", "sandbox_id": sid, "kind": "lifecycle",
                "extra": json.dumps({"state": state, **extra})}
    spool.append_many([lc(0, "requested", 0), lc(1, "queued", 5), lc(2, "admitted", 50)])
    s1 = OtlpSink(spool, endpoint=receiver.endpoint)
    assert s1.flush(10).ok
    s1.close()
    spool.append_many([lc(3, "started", 80, launch_ms=30.0),
                       {"event_id": f"{sid}-st", "ts_ns": T0 + 60 * ms, "node": "n", "sandbox_id": sid,
                        "kind": "sandbox_start", "argv": ["sh"]},
                       {"event_id": f"{sid}-ex", "ts_ns": T0 + 900 * ms, "node": "n", "sandbox_id": sid,
                        "kind": "sandbox_exit", "exit_code": 0},
                       lc(4, "exited", 901), lc(5, "cleaned", 950)])
    s2 = OtlpSink(spool, endpoint=receiver.endpoint)             # "after a restart"
    assert s2.flush(10).ok
    spans = {sp.name: sp for _, sp, _ in receiver.spans()}
    assert {"phase requested", "phase queued", "phase admitted", f"sandbox {sid}"} <= set(spans)
    q = spans["phase queued"]
    assert (q.start_time_unix_nano, q.end_time_unix_nano) == (T0 + 5 * ms, T0 + 50 * ms)
    assert spans["phase admitted"].end_time_unix_nano == T0 + 80 * ms
    assert spans[f"sandbox {sid}"].start_time_unix_nano == T0          # from the first lifecycle record
    assert json.load(open(spool.cursor_path("otlp")))["state"]["spans"]["sandboxes"] == {}   # all closed
    s2.close()


def test_otlp_standard_env_vars_are_honoured(receiver, spool, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-dsec-tenant=blue,authorization=Bearer%20t0k")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "audit-node-7")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=staging,k8s.cluster.name=c1")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.delenv("OTEL_LOGS_EXPORTER", raising=False)
    assert logs_enabled_by_env()
    assert [s.type for s in env_sinks()] == ["clickhouse", "otlp"]
    sid = "sb-" + uuid.uuid4().hex[:8]
    spool.append_many(lifecycle(sid))
    sink = OtlpSink(spool)                                 # everything from the environment
    assert sink.flush(10).ok
    res, _, _ = receiver.logs()[0]
    assert res["service.name"] == "audit-node-7" and res["deployment.environment.name"] == "staging"
    assert res["k8s.cluster.name"] == "c1"
    assert all(h.get("x-dsec-tenant") == "blue" and h.get("authorization") == "Bearer t0k" for h in receiver.headers)
    assert receiver.spans() == []                          # OTEL_TRACES_EXPORTER=none
    sink.close()
    monkeypatch.setenv("OTEL_LOGS_EXPORTER", "none")
    assert not logs_enabled_by_env() and [s.type for s in env_sinks()] == ["clickhouse"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(ExportError, match="gRPC only"):
        OtlpSink(spool)


def test_otlp_failures_are_retried_and_auth_errors_are_fatal(receiver, spool):
    spool.append_many(evs("sb-f", 10))
    receiver.fail_with = grpc.StatusCode.UNAVAILABLE
    sink = OtlpSink(spool, endpoint=receiver.endpoint, retry=RetryPolicy(initial=0.05, maximum=0.1))
    res = sink.flush(timeout=0.6)
    assert not res.ok and res.pending == 10 and "UNAVAILABLE" in res.error and not res.fatal
    assert receiver.calls >= 2                             # retried within the flush
    receiver.fail_with = grpc.StatusCode.UNAUTHENTICATED
    res = sink.flush(timeout=5)
    assert res.fatal and "UNAUTHENTICATED" in res.error and "OTEL_EXPORTER_OTLP_HEADERS" in res.error
    receiver.fail_with = None
    res = sink.flush(timeout=5)
    assert res.ok and res.sent == 10 and len(receiver.logs()) == 10
    sink.close()


def test_agent_metrics_over_otlp(receiver, spool):
    METRICS.reset()
    sid = "sb-" + uuid.uuid4().hex[:8]
    spool.append_many(lifecycle(sid) + evs(sid, 20) + [
        {"event_id": f"{sid}-l", "ts_ns": T0, "sandbox_id": sid, "kind": "events_lost", "count": 9,
         "extra": json.dumps({"reason": "ringbuf_full"})},
        {"event_id": f"{sid}-a", "ts_ns": T0, "sandbox_id": "agent-sb", "kind": "lifecycle",
         "extra": json.dumps({"state": "started", "launch_ms": 250.0})}])
    sink = JsonlSink(spool, path=os.path.join(spool.path, "..", "m.jsonl"))
    assert sink.flush(5).ok
    assert METRICS.counter("dsec.events.spooled") == 27 and METRICS.counter("dsec.events.spooled", kind="exec") == 8
    assert METRICS.counter("dsec.events.exported", sink="jsonl") == 27
    assert METRICS.counter("dsec.events.lost", reason="ringbuf_full") == 9
    assert METRICS.histogram("dsec.sandbox.launch.duration")["count"] == 2    # dsec run (0.1 s) and agent (0.25 s)
    assert METRICS.histogram("dsec.export.latency", sink="jsonl")["count"] == 1
    assert METRICS.gauge("dsec.sandboxes")[(("state", "running"),)] == 1      # agent-sb; the run has exited
    METRICS.configure(otlp=True, endpoint=receiver.endpoint, interval_s=3600)
    try:
        METRICS.record("dsec.ringbuf.lag", 0.002)         # histograms: what is recorded from now on
        METRICS.record("dsec.sandbox.launch.duration", 0.3)
        assert METRICS.force_flush(10)
        names = receiver.metric_names()
        assert {"dsec.events.spooled", "dsec.events.exported", "dsec.events.lost", "dsec.ringbuf.lag",
                "dsec.sandboxes", "dsec.spool.usage", "dsec.sandbox.launch.duration"} <= names
        assert names <= set(INSTRUMENTS)
        res, m = next((r, m) for r, m in receiver.metrics() if m.name == "dsec.events.lost")
        assert res["service.name"] == "dsec" and res["host.name"]
        pts = {tuple(sorted((kv.key, kv.value.string_value) for kv in p.attributes)): p.as_int
               for p in m.sum.data_points}
        assert pts[(("reason", "ringbuf_full"),)] == 9
    finally:
        METRICS.shutdown()
        sink.close()


def test_an_append_framed_by_column_is_counted_as_one_framed_by_record(tmp_path):
    """The spool counts an append of normalized kernel records from its columns
    (no Python step per record): the same received/spooled counts by kind and
    the same ring-buffer lag as the same records framed one by one; a batch with
    the launcher's records in it takes the per-record path (losses, lifecycles)."""
    from audit_schema.events import normalize
    from exporters.spool import Spool
    now = T0 + 10**9
    got = []
    for frames in ("batch", "record"):
        METRICS.reset()
        s = Spool(str(tmp_path / frames), fsync="never", frames=frames)
        real = METRICS.observe_records
        METRICS.observe_records = lambda recs, now_ns=None, **kw: real(recs, now, **kw)
        try:
            s.append_many([normalize(r) for r in evs("sb-c", 90)])
            s.append_many([normalize(r) for r in evs("sb-c", 40, start=90) + [
                {"event_id": "sb-c-l", "ts_ns": T0, "sandbox_id": "sb-c", "kind": "events_lost", "count": 7,
                 "extra": json.dumps({"reason": "ringbuf_full"})}]])
        finally:
            del METRICS.observe_records
        got.append((METRICS.counters("dsec.events.spooled"), METRICS.counters("dsec.events.received"),
                     METRICS.counter("dsec.events.lost", reason="ringbuf_full"),
                     METRICS.histogram("dsec.ringbuf.lag")))
        s.close()
    assert got[0] == got[1]
    spooled, _, lost, lag = got[0]
    assert spooled[(("kind", "open_write"),)] == 43 and lost == 7 and lag["count"] == 2 and lag["max"] == 1.0
    METRICS.reset()


# --- JSON lines -----------------------------------------------------------------------

def test_jsonl_lines_are_the_dsec_events_json_form(tmp_path, spool):
    from audit_schema.describe import to_json_line
    from audit_schema.events import normalize
    path = str(tmp_path / "audit.jsonl")
    recs = evs("sb-j", 5) + [{"event_id": "nb", "kind": "exec", "path": from_bytes(b"/\xff\xfe"),
                              "argv": [from_bytes(b"a\x80"), "caf\u00e9"]}]
    spool.append_many(recs)
    sink = JsonlSink(spool, path=path)
    assert sink.flush(5).sent == 6
    lines = open(path, encoding="utf-8").read().splitlines()
    assert lines == [to_json_line(normalize(r)) for r in recs]
    obj = json.loads(lines[-1])
    assert list(obj) == [f.name for f in FIELDS]                    # every field, schema order
    assert os.fsencode(obj["path"]) == b"/\xff\xfe" and "\\udcff" in lines[-1] and "café" in lines[-1]
    sink.close()


def _hostile_batch(sid: str, n: int, raw: bool = True) -> list[dict]:
    """n normalized records (the recorder's shape: batch frames) whose strings hold
    every character class a JSON writer can get wrong: controls, quotes,
    backslashes, non-ASCII, U+2028, astral, and raw bytes (surrogateescape)."""
    from audit_schema.events import normalize
    specials = ["\x00\x01\x1f\x7f", '"q"\\', "\n\r\t\b\f", "caf\u00e9 \u2028\u2029 \U0001f600",
                from_bytes(b"/raw-\xff\xfe") if raw else "/no-raw", "\ufeff\uffff", "plain"]
    out = []
    for i in range(n):
        r = evs(sid, 1, start=i)[0]
        r.update(path=f"/w/{specials[i % len(specials)]}{i}", comm=specials[(i + 3) % len(specials)],
                 argv=[specials[i % len(specials)], str(i)], count=2**64 - 1 - i, ret=-i,
                 extra=json.dumps({"i": i, "s": specials[(i + 1) % len(specials)]}))
        out.append(normalize(r))
    return out


def test_otlp_wire_request_is_the_sdk_encoders(tmp_path, spool):
    """The OTLP sink writes its ExportLogsServiceRequest as wire bytes
    (exporters/otlp_wire.py); parsed, it must equal what the SDK's encoder
    makes of the SDK's log records for the same rows: every record, resource,
    attribute (raw bytes, arrays, counts past int64, unix sockets), severity,
    trace/span id and body, in the same order."""
    from audit_schema.events import normalize
    rows = _hostile_batch("sb-w1", 150) + _hostile_batch("sb-w2", 50, raw=False)
    rows += [normalize(r) for r in lifecycle("sb-w3")]
    rows += [normalize({"event_id": "lost-1", "kind": "events_lost", "count": 7, "node": "node-b",
                        "extra": json.dumps({"reason": "ringbuf_full"})}),
             normalize({"event_id": "c-1", "kind": "connect", "sandbox_id": "sb-w1", "node": "node-a",
                        "family": "unix", "addr": "/run/x.sock", "decision": "would-deny", "step": 2}),
             normalize({"event_id": "d-1", "kind": "exec_denied", "sandbox_id": "sb-w2", "node": "node-a",
                        "path": "/bin/nc", "signal": 9, "decision": "denied"})]
    rows[3]["sandbox_id"] = ""                     # a record of no sandbox: the node's resource
    sink = OtlpSink(spool, endpoint="http://127.0.0.1:1")
    try:
        now = time.time_ns()
        ref = sink._logs_exporter()._translate_data(sink.log_records(rows, now))
        got = sink.log_request(rows, now)
        assert sum(len(sl.log_records) for rl in got.resource_logs for sl in rl.scope_logs) == len(rows)
        assert got == ref
        assert got.SerializeToString(deterministic=True) == ref.SerializeToString(deterministic=True)
    finally:
        sink.close()


@pytest.mark.parametrize("frames", ["batch", "record"])
def test_jsonl_batch_lines_are_exactly_json_line(tmp_path, frames):
    """The batch-shaped JSON-lines writer (one orjson call per record, no
    normalize for a batch of batch frames) writes exactly json_line's bytes
    for every record, in order, none dropped or added, damage rows included."""
    from audit_schema.describe import to_json_line
    from audit_schema.events import normalize
    sp = Spool(str(tmp_path / "spool"), fsync="never", frames=frames)
    recs = _hostile_batch("sb-jb", 300) + _hostile_batch("sb-jc", 300, raw=False)   # + one orjson call a batch
    sp.append_many(recs[:200])
    sp.append_many(recs[200:300])
    sp.append_many(recs[300:])
    path = str(tmp_path / "b.jsonl")
    sink = JsonlSink(sp, path=path, batch_records=128)
    try:
        assert sink.flush(5).sent == 600
    finally:
        sink.close()
        sp.close()
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"".join(to_json_line(normalize(r)).encode("utf-8") + b"\n" for r in recs)


def test_jsonl_is_exactly_once_across_a_crash_between_write_and_commit(tmp_path, spool):
    path = str(tmp_path / "a.jsonl")
    open(path, "w").write("a line from before\n")
    spool.append_many(evs("sb-c", 10))
    s1 = JsonlSink(spool, path=path)
    b = s1.reader.read(6)
    s1.reader.lock()
    s1._open()
    s1.deliver(s1.rows_of(b))                      # written and fsynced ...
    s1.reader.unlock()
    s1._close_fd()                                 # ... and the process dies before the commit
    assert len(open(path).read().splitlines()) == 7
    s2 = JsonlSink(spool, path=path)               # the next process
    assert s2.flush(5).sent == 10
    lines = open(path).read().splitlines()
    assert lines[0] == "a line from before"
    assert [json.loads(x)["event_id"] for x in lines[1:]] == [f"sb-c-{i}" for i in range(10)]
    # rotated away: reopened at the path, the old file is never cut
    os.rename(path, path + ".1")
    spool.append_many(evs("sb-c", 2, start=10))
    assert s2.flush(5).sent == 2
    assert len(open(path + ".1").read().splitlines()) == 11 and len(open(path).read().splitlines()) == 2
    s2.close()


def test_jsonl_to_stdout_via_dsec_export(tmp_path):
    env = dict(os.environ, DSEC_SPOOL_DIR=str(tmp_path / "sp"))
    s = Spool(env["DSEC_SPOOL_DIR"], fsync="never")
    s.append_many(evs("sb-o", 4))
    r = subprocess.run([DSEC, "export", "--sink", "jsonl", "--jsonl-path", "-"], env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["event_id"] for x in r.stdout.decode().splitlines()] == [f"sb-o-{i}" for i in range(4)]
    assert b"4 event(s) sent to JSON lines" in r.stderr
    r = subprocess.run([DSEC, "export", "--sink", "nope"], env=env, capture_output=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1


# --- several sinks at once ----------------------------------------------------------------

def test_a_dead_sink_never_blocks_the_others_and_catches_up_without_loss_or_duplicates(tmp_path, spool):
    """OTLP collector down (then slow), JSON lines keeps up the whole time; when
    the collector returns it receives everything, once."""
    rx = OtlpReceiver()                              # not started: down
    path = str(tmp_path / "live.jsonl")
    stop = threading.Event()
    specs = sinks_from_config({"otlp": {"endpoint": rx.endpoint, "flush_interval": 0.05, "metrics": False,
                                        "retry": {"initial": 0.05, "maximum": 0.3}},
                               "file": {"type": "jsonl", "path": path, "flush_interval": 0.05}})
    threads = start_sinks(spool, specs, stop)
    sinks = {t.sink.sink: t.sink for t in threads}
    sid, total = "sb-" + uuid.uuid4().hex[:8], 0
    try:
        for _ in range(10):                          # a steady load while OTLP is down
            spool.append_many(evs(sid, 50, start=total))
            total += 50
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sinks["file"].total_sent < total:
            time.sleep(0.02)
        assert sinks["file"].total_sent == total      # kept up although OTLP is dead
        assert sinks["otlp"].total_sent == 0 and sinks["otlp"].last_error
        assert sinks["otlp"].reader.backlog()[0] == total
        rx.delay = 0.3                                # back, but slow
        rx.start()
        for _ in range(5):
            spool.append_many(evs(sid, 50, start=total))
            total += 50
            time.sleep(0.05)
        t = time.monotonic()
        while time.monotonic() - t < 10 and sinks["file"].total_sent < total:
            time.sleep(0.02)
        assert sinks["file"].total_sent == total      # not held back by the slow one
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sinks["otlp"].total_sent < total:
            time.sleep(0.05)
    finally:
        stop.set()
        stop_sinks(threads)
        rx.stop()
    ids = rx.event_ids()
    assert len(ids) == total == len(set(ids))        # nothing lost, nothing twice
    assert set(ids) == {f"{sid}-{i}" for i in range(total)}
    lines = [json.loads(x)["event_id"] for x in open(path)]
    assert lines == [f"{sid}-{i}" for i in range(total)]
    assert len(spool.segments()) == 1                 # both cursors past: segments collected


def test_flush_sinks_one_dead_sink_does_not_fail_the_others(tmp_path, spool, receiver):
    spool.append_many(evs("sb-p", 20))
    dead = OtlpReceiver()
    specs = sinks_from_config({"up": {"type": "otlp", "endpoint": receiver.endpoint},
                               "down": {"type": "otlp", "endpoint": dead.endpoint},
                               "file": {"type": "jsonl", "path": str(tmp_path / "f.jsonl")}})
    res = flush_sinks(spool, specs, timeout=1.5)       # in parallel: a dead sink costs one timeout in all
    assert res["up"].ok and res["file"].ok and res["up"].sent == res["file"].sent == 20
    assert not res["down"].ok and res["down"].pending == 20


# --- configuration ------------------------------------------------------------------------

def test_sink_configuration_is_validated_with_clear_errors(tmp_path, monkeypatch):
    for env in ("DSEC_SINKS", "DSEC_JSONL_PATH", "OTEL_LOGS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"):
        monkeypatch.delenv(env, raising=False)
    specs = sinks_from_config({"clickhouse": {}, "otlp": {"endpoint": "http://c:4317", "headers": {"a": "b"}},
                               "audit": {"type": "jsonl", "path": str(tmp_path / "x"), "required": True},
                               "off": {"type": "jsonl", "path": "-", "enabled": False}})
    assert [(s.name, s.type) for s in specs] == [("clickhouse", "clickhouse"), ("otlp", "otlp"), ("audit", "jsonl")]
    assert specs[1].metrics is True                     # an OTLP sink in a config file carries the metrics
    assert [s.name for s in sinks_from_config({"sinks": {"otlp": {}}}, include_clickhouse=False)] == ["otlp"]
    assert [s.type for s in sinks_from_config(None)] == ["clickhouse"]          # no section: the environment
    for bad, words in [({"otlp": {"endpoit": "x"}}, ["sinks.otlp.endpoit", "unknown setting"]),
                       ({"x": {}}, ["sinks.x", "type"]),
                       ({"x": {"type": "kafka"}}, ["sinks.x.type", "kafka"]),
                       ({"j": {"type": "jsonl"}}, ["sinks.j.path"]),
                       ({"otlp": {"batch_records": 0}}, ["sinks.otlp.batch_records"]),
                       ({"otlp": {"protocol": "http/protobuf"}}, ["sinks.otlp.protocol"]),
                       ({"bad/name": {"type": "jsonl", "path": "-"}}, ["sinks.bad/name"]),
                       ([1, 2], ["sinks: expected a mapping"])]:
        with pytest.raises(ExportError) as e:
            sinks_from_config(bad)
        assert e.value.code == 2 and all(w in e.value.message for w in words), e.value.message
    monkeypatch.setenv("DSEC_JSONL_PATH", str(tmp_path / "e.jsonl"))
    assert [s.type for s in env_sinks()] == ["clickhouse", "jsonl"]
    monkeypatch.setenv("DSEC_SINKS", "jsonl")
    assert [s.type for s in env_sinks()] == ["jsonl"]
    monkeypatch.setenv("DSEC_SINKS", "kafka")
    with pytest.raises(ExportError, match="DSEC_SINKS"):
        env_sinks()
    built = specs[2].build(Spool(str(tmp_path / "sp2"), fsync="never"))
    assert built.reader.evictable is False             # required: true
    built.close()


def test_retry_backoff_grows_is_capped_and_jittered():
    p = RetryPolicy(initial=0.1, maximum=2.0, multiplier=2.0, jitter=0.5)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0), (30, 2.0)]:
        ds = [p.delay(attempt) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in ds) and len(set(ds)) > 150


# --- `dsec run` with the standard environment ----------------------------------------------------

def test_dsec_run_exports_to_otlp_and_jsonl_from_the_environment(tmp_path, receiver, clickhouse_url, sid):
    path = str(tmp_path / "run.jsonl")
    summ = str(tmp_path / "s.json")
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_SERVICE_NAME="dsec-ci",
               DSEC_JSONL_PATH=path, DSEC_CLICKHOUSE_URL=clickhouse_url, DSEC_SPOOL_DIR=str(tmp_path / "spool"))
    env.pop("OTEL_LOGS_EXPORTER", None)
    r = subprocess.run([DSEC, "run", "--sandbox-id", sid, "--summary-json", summ, "--",
                        "sh", "-c", "echo hi > /workspace/out; /bin/true"], env=env, capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr
    audit = json.load(open(summ))["audit"]
    assert audit["sinks"]["otlp"]["pending"] == 0 and audit["sinks"]["jsonl"]["pending"] == 0
    n = audit["exported"]
    assert audit["sinks"]["otlp"]["sent"] == audit["sinks"]["jsonl"]["sent"] == n > 5
    logs = [(res, lr, a) for res, lr, a in receiver.logs() if res.get("container.id") == sid]
    assert len(logs) == n and len({a["log.record.uid"] for _, _, a in logs}) == n
    kinds = {lr.event_name for _, lr, _ in logs}
    assert {"dsec.sandbox_start", "dsec.exec", "dsec.open_write", "dsec.sandbox_exit"} <= kinds
    assert all(res["service.name"] == "dsec-ci" for res, _, _ in logs)
    assert any(a.get("file.path", "").endswith("/workspace/out") for _, _, a in logs)
    names = {sp.name for res, sp, _ in receiver.spans() if res.get("container.id") == sid}
    assert {f"sandbox {sid}", "launch", "step 1"} <= names
    assert "dsec.events.spooled" in receiver.metric_names()
    # the JSON lines are what `dsec events --format json` prints, line for line
    ev = subprocess.run([DSEC, "events", "--sandbox", sid, "--format", "json"], env=env, capture_output=True,
                        timeout=60)
    assert ev.returncode == 0, ev.stderr
    assert sorted(ev.stdout.decode().splitlines()) == sorted(open(path, encoding="utf-8").read().splitlines())
    # a bad OTLP setting is one clear line before anything runs
    r = subprocess.run([DSEC, "run", "--sandbox-id", sid + "b", "--", "true"],
                       env={**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
                       capture_output=True, timeout=60)
    assert r.returncode == 125 and r.stderr.count(b"\n") == 1 and b"OTEL_EXPORTER_OTLP_PROTOCOL" in r.stderr


def test_dsec_export_delivers_to_several_sinks(tmp_path, receiver, clickhouse_url, clickhouse_client):
    client, db = clickhouse_client
    env = dict(os.environ, DSEC_SPOOL_DIR=str(tmp_path / "sp"), DSEC_CLICKHOUSE_URL=clickhouse_url)
    s = Spool(env["DSEC_SPOOL_DIR"], fsync="never")
    sid = "sb-" + uuid.uuid4().hex[:8]
    s.append_many(evs(sid, 25))
    path = str(tmp_path / "x.jsonl")
    r = subprocess.run([DSEC, "export", "--sink", "clickhouse,otlp", "--sink", "jsonl", "--jsonl-path", path,
                        "--otlp-endpoint", receiver.endpoint], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    for name, label in (("clickhouse", "ClickHouse"), ("otlp", "OTLP collector"), ("jsonl", "JSON lines")):
        assert f"{name}: 25 event(s) sent to {label}" in out, out
    assert client.execute(f"SELECT count() FROM {db}.events FINAL WHERE sandbox_id = %(s)s", {"s": sid})[0][0] == 25
    assert len(receiver.logs()) == 25 and len(open(path).read().splitlines()) == 25
    r = subprocess.run([DSEC, "export", "--sink", "otlp", "--otlp-endpoint", "http://127.0.0.1:1", "--timeout", "0"],
                       env=env, capture_output=True, timeout=60)
    assert r.returncode == 0                            # nothing pending for otlp any more
    s.append_many(evs(sid, 3, start=25))
    r = subprocess.run([DSEC, "export", "--sink", "otlp", "--otlp-endpoint", "http://127.0.0.1:1", "--timeout", "0"],
                       env=env, capture_output=True, timeout=60)
    assert r.returncode == 1 and b"3 still in the spool" in r.stdout and b"UNAVAILABLE" in r.stdout


def test_a_flush_delivers_what_the_spool_held_when_it_began_and_leaves_later_appends_to_the_next(tmp_path, spool):
    """Under a steady stream of appends, a flush used to chase the spool's end: one
    small batch after another with no pause (on ClickHouse, a part per insert to
    write and merge). It ends at the end it saw; run() waits its interval."""
    for i in range(5):
        spool.append_many(evs("sb-f", 5, start=5 * i))

    class Appending(JsonlSink):
        extra = 0

        def deliver_batch(self, batch):
            super().deliver_batch(batch)
            if self.extra < 3:                     # the recorder appending meanwhile
                spool.append_many(evs("sb-f", 1, start=100 + self.extra))
                self.extra += 1
    path = str(tmp_path / "f.jsonl")
    sink = Appending(spool, path=path, batch_records=10)
    first = sink.flush(5)            # 3 batches: the last one reads on past the end it saw, then it stops
    assert first.error is None and first.sent >= 25 and first.pending >= 1 and first.sent + first.pending == 28
    assert sink.flush(5).sent == first.pending
    assert [json.loads(x)["event_id"] for x in open(path).read().splitlines()] == \
        [f"sb-f-{i}" for i in range(25)] + ["sb-f-100", "sb-f-101", "sb-f-102"]
    sink.close()
