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
from exporters.otlp_columns import ColumnLogs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from exporters.spool import Repeat, Spool
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


_RAW = from_bytes(b"/w/\xff\xfe-raw")
# per group of 40 records (one batch frame each): the columns whose value is the
# same in every record of the frame (a Repeat when read), among the values that
# move an attribute, a body or a JSON escape: raw bytes, past int64, lists, zeros
# that mean something, a kind-dependent attribute name, quotes and backslashes
_REPEAT_GROUPS = [
    dict(kind="open_write", path=_RAW, flags=0o101, ret=-13, comm=from_bytes(b"c\x80"), count=2**64 - 1,
         argv=["a", _RAW, "c d"], path2=_RAW, ts_ns=1_700_000_000_000_000_000, family="", addr="", port=0),
    dict(kind="open_write", path=_RAW, flags=0o101, ret=0, comm=from_bytes(b"c\x80"), count=2**64 - 1,
         argv=["a", _RAW, "c d"], path2="", family="", addr="", port=0),
    dict(kind="exec", path=_RAW, argv=[_RAW, "x" * 5000], ts_ns=0, sandbox_id="", sha256="ab" * 32,
         family="", comm='a","', path_raw="\u2028"),
    dict(kind="connect", family="unix", addr="/run/s.sock", port=0, ret=0),
    dict(kind="connect", family="ipv6", addr="::1", port=0, ret=0, argv=[], comm="x\\", step=0),
    dict(path=_RAW, exit_code=0, signal=0, comm='\\"', argv=[], decision="denied", family="ipv4",
         addr="10.0.0.1", port=443),
    dict(kind="fork", child_pid=7, ts_ns=5, pid=3, ppid=1, uid=0, step=2, decision="allowed", path="",
         path2="", argv=[], flags=0, ret=0, family="", addr="", port=0, exit_code=0, signal=0, count=0,
         extra="", syscall="", protocol="", sha256="", path_raw="", comm="sh", dirfd=""),
    dict(kind="exit", exit_code=0, signal=9, count=0, extra=json.dumps({"k": "\"v\""})),
    dict(kind="rename", path=_RAW, path2=from_bytes(b"/w/\x80"), ret=-99999, count=2**63),
    dict(kind="unlink", path="/w/same", ret=0, node="node-b"),
]


def _repeat_batch(sid: str, per: int = 40) -> list[list[dict]]:
    """Groups of records (one append each, so one batch frame each) whose
    _REPEAT_GROUPS columns hold one value: a read keeps those as Repeats while
    its frames agree on the value, and makes the others lists."""
    out = []
    for g, fixed in enumerate(_REPEAT_GROUPS):
        recs = _kinds_batch(sid, per, node="node-a")
        for i, r in enumerate(recs):
            r.update({"sandbox_id": sid}, **fixed, event_id=f"{sid}-g{g}-{i}")
        out.append([normalize(r) for r in recs])
    return out


def _has_repeat(b) -> bool:
    return any(c.__class__ is Repeat for c in b.raw_columns.values())


def _batches(sp: Spool, sink: str, n: int):
    rd = sp.reader(sink)
    out = []
    while True:
        b = rd.read(n)
        if not b:
            return out
        out.append(b)
        rd.commit(b)


@pytest.mark.parametrize("which", ["hostile", "kinds", "plain", "lifecycle", "repeat", "repeat-wide"])
def test_column_request_is_the_record_paths(tmp_path, which):
    """Batch frames read as columns (a column of one value a Repeat, as a read
    keeps it): the request is byte for byte the record path's and the SDK's."""
    if which == "lifecycle":                     # no record the column path words: the record path whole
        recs = [normalize(dict(r, event_id=f"l{i}-{r['event_id']}")) for i in range(8) for r in lifecycle("sb-l")
                if r["kind"] != "exec"]
    elif which == "hostile":
        recs = _hostile_batch("sb-c1", 200) + _hostile_batch("sb-c2", 100, raw=False)
    elif which == "kinds":
        recs = _kinds_batch("sb-k1", 300) + _kinds_batch("sb-k2", 100, node="node-b")
    elif which.startswith("repeat"):
        groups = _repeat_batch("sb-r1") + _repeat_batch("sb-r2")
        recs = [r for g in groups for r in g]
    else:
        recs = [normalize(dict(r, event_id=f"{i:0126d}")) for i, r in enumerate(evs("sb-p", 400))]  # one length
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    if which.startswith("repeat"):
        for g in groups:
            sp.append_many(g)
    else:
        sp.append_many(recs)
    sink = OtlpSink(sp, endpoint="http://127.0.0.1:1")
    try:
        batches = _batches(sp, "check", 1000 if which == "repeat-wide" else 40 if which == "repeat" else 128)
        assert sum(b.count for b in batches) == len(recs)
        if which != "lifecycle":
            assert all(_has_repeat(b) for b in batches)            # columns of one value, as a read keeps them
        now = time.time_ns()
        took = 0
        for b in batches:
            raw = b.raw_columns
            assert raw and list(raw) == [f.name for f in FIELDS]      # batch frames: columns
            repeats = {k for k, c in raw.items() if c.__class__ is Repeat}
            if ColumnLogs(sink).records(raw, b.count, now) is not None:   # the column path takes it:
                assert {k for k, c in b.raw_columns.items() if c.__class__ is Repeat} == repeats   # as they are
                took += 1
            sent = sink.log_request_bytes_of(b, now)      # what the sink sends: wire bytes, not parsed
            got = sink.log_request_of(b, now)
            assert sink._columns is not None and sink._columns.usable(b.raw_columns)
            if sent.__class__ is bytes:
                assert ExportLogsServiceRequest.FromString(sent) == got
            else:
                assert sent == got                            # the record path: a request
            rows = sink.rows_of(b)
            want = sink.log_request(rows, now)
            assert got.SerializeToString() == want.SerializeToString()           # the same bytes
            ref = sink._logs_exporter()._translate_data(sink.log_records(rows, now))
            assert got == ref                                                     # the SDK's encoder's
            assert sum(len(sl.log_records) for rl in got.resource_logs for sl in rl.scope_logs) == len(rows)
        if which == "repeat":                          # every frame but the 2 of unix connects (the record path)
            assert took == len(batches) - 2
        else:
            assert (took > 0) == (which != "lifecycle")
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
    for g in _repeat_batch("sb-r3"):               # frames with columns of one value (Repeats when read)
        sp.append_many(g)
        recs += g
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
