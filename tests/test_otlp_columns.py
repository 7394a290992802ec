"""The OTLP sink's column path (exporters/otlp_columns.py, issue 15): a spool
read of batch frames hands the sink columns, and the ExportLogsServiceRequest
it makes of them must be byte for byte the record path's (OtlpSink.log_request
of the same rows) and equal to what the SDK's own encoder makes of the SDK's
log records: raw bytes, huge values, every kind the recorder writes mixed in
one batch, several sandboxes and nodes, damage rows at the end. And delivered
through a real receiver, each record arrives once."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from audit_schema.events import FIELDS, KINDS, from_bytes, normalize
from exporters.otel import OtlpSink
from exporters.spool import Spool
from test_exporters import _hostile_batch, evs, lifecycle
from otlp_receiver import OtlpReceiver


def _kinds_batch(sid: str, n: int, node: str = "node-a") -> list[dict]:
    """n normalized records cycling through every kind, with the values that
    move an attribute or a body: raw bytes, errors, ipv6, unix sockets, zeros
    that mean something, counts past int64, long strings and argv."""
    raw = from_bytes(b"/w/\xff\xfe-raw")
    out = []
    for i in range(n):
        k = KINDS[i % len(KINDS)]
        r = {"event_id": uuid.uuid4().hex if i % 50 else f"{sid}-k{i}", "ts_ns": 0 if i % 11 == 0 else 1_700_000_000_000_000_000 + i, "node": node,
             "sandbox_id": sid if i % 13 else "", "step": i % 3, "kind": k, "pid": i % 5, "ppid": 1, "uid": i % 2,
             "comm": ("python3", from_bytes(b"c\x80"), "")[i % 3], "policy_name": "p", "mode": "audit",
             "decision": ("allowed", "denied", "would-deny", "")[i % 4], "path": (f"/w/f{i % 7}", raw, "")[i % 3],
             "path2": raw if i % 2 else "/w/dst", "argv": [["a", raw, "c d"], [], ["x" * 5000]][i % 3],
             "argv_truncated": i % 2, "flags": (0o101, 0o2101, 0)[i % 3], "ret": (0, -13, 3, -99999)[i % 4],
             "family": ("ipv4", "ipv6", "unix", "")[i % 4], "addr": ("10.0.0.1", "::1", "/run/s.sock", "")[i % 4],
             "port": (0, 443, 53)[i % 3], "child_pid": i, "exit_code": (0, 1, -1)[i % 3], "signal": (0, 9)[i % 2],
             "sha256": "ab" * 32 if i % 2 else "", "count": (2**64 - 1, 0, 5)[i % 3], "syscall": "ptrace",
             "protocol": ("tcp", "", "udp")[i % 3], "extra": json.dumps({"i": i, "state": "queued"}),
             "path_raw": "\u2028" * (i % 2) + "x" * (70000 if i == 5 else 1), "dirfd": "AT_FDCWD"}
        out.append(normalize(r))
    return out


def _batches(sp: Spool, sink: str, n: int):
    rd = sp.reader(sink)
    out = []
    while True:
        b = rd.read(n)
        if not b:
            return out
        out.append(b)
        rd.commit(b)


@pytest.mark.parametrize("which", ["hostile", "kinds", "plain", "lifecycle"])
def test_column_request_is_the_record_paths(tmp_path, which):
    if which == "lifecycle":                     # no record the column path words: the record path whole
        recs = [normalize(dict(r, event_id=f"l{i}-{r['event_id']}")) for i in range(8) for r in lifecycle("sb-l")
                if r["kind"] != "exec"]
    elif which == "hostile":
        recs = _hostile_batch("sb-c1", 200) + _hostile_batch("sb-c2", 100, raw=False)
    elif which == "kinds":
        recs = _kinds_batch("sb-k1", 300) + _kinds_batch("sb-k2", 100, node="node-b")
    else:
        recs = [normalize(dict(r, event_id=f"{i:0126d}")) for i, r in enumerate(evs("sb-p", 400))]  # one length
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    sp.append_many(recs)
    sink = OtlpSink(sp, endpoint="http://127.0.0.1:1")
    try:
        batches = _batches(sp, "check", 128)
        assert sum(b.count for b in batches) == len(recs)
        now = time.time_ns()
        for b in batches:
            assert b.columns and list(b.columns) == [f.name for f in FIELDS]      # batch frames: columns
            got = sink.log_request_of(b, now)
            assert sink._columns is not None and sink._columns.usable(b.columns)
            rows = sink.rows_of(b)
            want = sink.log_request(rows, now)
            assert got.SerializeToString() == want.SerializeToString()           # the same bytes
            ref = sink._logs_exporter()._translate_data(sink.log_records(rows, now))
            assert got == ref                                                     # the SDK's encoder's
            assert sum(len(sl.log_records) for rl in got.resource_logs for sl in rl.scope_logs) == len(rows)
    finally:
        sink.close()
        sp.close()


def test_column_request_with_damage_rows(tmp_path):
    """A batch whose read found damage: the events_lost rows come after the
    records, as on the record path."""
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    sp.append_many(_kinds_batch("sb-d", 100))
    seg = sp.seg_path(sp.segments()[-1])
    sp.append_many(_kinds_batch("sb-e", 100))
    sp.close()
    with open(seg, "r+b") as f:                       # bit rot in the middle of the first batch frame
        f.seek(200)
        f.write(b"\x00garbage\x00")
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    sink = OtlpSink(sp, endpoint="http://127.0.0.1:1")
    try:
        batches = _batches(sp, "check", 10000)
        assert any(b.damage for b in batches)
        now = time.time_ns()
        for b in batches:
            rows = sink.rows_of(b)
            got = sink.log_request_of(b, now)
            assert got.SerializeToString() == sink.log_request(rows, now).SerializeToString()
            assert got == sink._logs_exporter()._translate_data(sink.log_records(rows, now))
        kinds = [lr.event_name for b in batches for rl in sink.log_request_of(b, now).resource_logs
                 for sl in rl.scope_logs for lr in sl.log_records]
        assert "dsec.events_lost" in kinds
    finally:
        sink.close()
        sp.close()


def test_column_path_delivers_each_record_once(tmp_path):
    """Through a real OTLP/gRPC receiver: every record of batch frames (and the
    spans of the lifecycle records among them) arrives once, by log.record.uid."""
    rx = OtlpReceiver()
    rx.start()
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    recs = _kinds_batch("sb-r", 500) + [normalize(r) for r in lifecycle("sb-r2")] * 8
    for i, r in enumerate(recs[500:]):
        r["event_id"] = f"life-{i}"
    sp.append_many(recs)
    sink = OtlpSink(sp, endpoint=rx.endpoint, insecure=True, batch_records=256)
    try:
        res = sink.flush(10)
        assert res.ok and res.sent == len(recs)
        uids = [a["log.record.uid"] for _, _, a in rx.logs()]
        assert sorted(uids) == sorted(r["event_id"] for r in recs)          # each once, none missing
        assert "sandbox sb-r2" in {sp.name for _, sp, _ in rx.spans()}       # spans from the lifecycle rows
    finally:
        sink.close()
        sp.close()
        rx.stop()
