"""The JSON-lines sink's column path (exporters/jsonl.json_lines_columns, issue
15): a batch of batch frames is written from its columns, one orjson call per
column, and must be byte for byte what json_line makes of each record (the
`dsec events --format json` line): raw bytes as \\udcXX escapes, quotes and
backslashes that could fake a boundary, huge values, every kind, columns of
one value and columns of many."""
from __future__ import annotations

import json
import os

import pytest

from audit_schema.describe import to_json_line
from audit_schema.events import FIELDS, from_bytes, normalize
from exporters.jsonl import JsonlSink, json_lines, json_lines_columns
from exporters.spool import Repeat, Spool
from test_exporters import _hostile_batch, evs
from test_otlp_columns import _REPEAT_GROUPS, _batches, _has_repeat, _kinds_batch, _repeat_batch


def _tricky(sid: str, n: int) -> list[dict]:
    """Strings whose JSON holds '","' inside a value (an escaped quote next to
    the real one), backslashes at the end, empty strings, a value shared by
    every record but one."""
    vals = ['a",', '","', "x\\", '\\"', "", "],[", '"', "plain"]
    out = []
    for i in range(n):
        r = evs(sid, 1, start=i)[0]
        r.update(comm=vals[i % len(vals)], path=vals[(i + 1) % len(vals)] + str(i), policy_name="same",
                 mode="odd" if i == n - 1 else "audit", argv=[vals[i % len(vals)], vals[(i + 2) % len(vals)]],
                 addr=from_bytes(b"\xff") if i == 3 else "", count=2**64 - 1)
        out.append(normalize(r))
    return out


@pytest.mark.parametrize("which", ["hostile", "kinds", "tricky", "plain", "repeat", "repeat-wide"])
def test_column_lines_are_json_line(tmp_path, which):
    """Batch frames read as columns (a column of one value a Repeat, as a read
    keeps it, written once): the lines are json_line's, byte for byte."""
    groups = None
    if which.startswith("repeat"):
        groups = _repeat_batch("sb-r1") + _repeat_batch("sb-r2")
        recs = [r for g in groups for r in g]
    else:
        recs = {"hostile": lambda: _hostile_batch("sb-h", 200) + _hostile_batch("sb-i", 100, raw=False),
                "kinds": lambda: _kinds_batch("sb-k", 300),
                "tricky": lambda: _tricky("sb-t", 200),
                "plain": lambda: [normalize(r) for r in evs("sb-p", 300)]}[which]()
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    for g in groups or [recs]:
        sp.append_many(g)
    try:
        batches = _batches(sp, "check", {"repeat": 40, "repeat-wide": 1000}.get(which, 100))
        assert sum(b.count for b in batches) == len(recs)
        assert all(_has_repeat(b) for b in batches)                 # columns of one value, as a read keeps them
        got = b""
        for b in batches:
            raw = b.raw_columns
            assert raw and list(raw) == [f.name for f in FIELDS]
            repeats = {k for k, c in raw.items() if c.__class__ is Repeat}
            data = json_lines_columns(raw, b.count)
            assert {k for k, c in b.raw_columns.items() if c.__class__ is Repeat} == repeats   # not made lists
            assert data == json_lines(b.records, normalized=True)
            got += data
        assert got == b"".join(to_json_line(r).encode("utf-8") + b"\n" for r in recs)
        for line, r in zip(got.splitlines(), recs):
            assert json.loads(line)["event_id"] == r["event_id"]
    finally:
        sp.close()


def test_sink_writes_columns_and_damage_lines(tmp_path):
    """Through the sink: batch frames, one of them damaged: every intact
    record's line exactly once and in order, and an events_lost line for the
    damage after them."""
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    a, b = _tricky("sb-a", 100), _kinds_batch("sb-b", 100)
    sp.append_many(a)
    seg = sp.seg_path(sp.segments()[-1])
    off = os.path.getsize(seg)
    sp.append_many(b)
    sp.append_many(_hostile_batch("sb-c", 100))
    sp.close()
    with open(seg, "r+b") as f:                  # bit rot inside the second batch frame
        f.seek(off + 300)
        f.write(b"\x00rot\x00")
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    path = str(tmp_path / "out.jsonl")
    sink = JsonlSink(sp, path=path)
    try:
        res = sink.flush(5)
        assert res.ok and res.damaged >= 1
    finally:
        sink.close()
        sp.close()
    lines = open(path, "rb").read().splitlines()
    objs = [json.loads(x) for x in lines]
    ids = [o["event_id"] for o in objs if o["kind"] != "events_lost"]
    want = [r["event_id"] for r in a + _hostile_batch("sb-c", 100)]
    assert ids == want                           # the damaged frame's records are gone, the rest in order
    assert lines[:100] == [to_json_line(r).encode("utf-8") for r in a]
    lost = [o for o in objs if o["kind"] == "events_lost"]
    assert lost and sum(o["count"] for o in lost) >= 1 and objs.index(lost[0]) >= 100


def test_every_column_one_value(tmp_path):
    """A frame whose every column but event_id is one value, and frames where
    even that is the same line over and over (the columns of one record):
    json_lines_columns of Repeats alone is json_line's."""
    same = dict(_REPEAT_GROUPS[0], node="n", sandbox_id="s", step=1, pid=2, ppid=1, uid=0, decision="allowed",
                mode="audit", policy_name="p", ts_ns=9)
    recs = [normalize({**r, **same, "event_id": f"e{i:03d}"}) for i, r in enumerate(evs("s", 64))]
    cols = {f.name: Repeat(recs[0][f.name], 64) for f in FIELDS}
    line = to_json_line(recs[0]).encode("utf-8") + b"\n"
    assert json_lines_columns(cols, 64) == line * 64
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    sp.append_many(recs)
    try:
        (b,) = _batches(sp, "check", 1000)
        assert sum(c.__class__ is Repeat for c in b.raw_columns.values()) == len(FIELDS) - 1
        assert json_lines_columns(b.raw_columns, b.count) == b"".join(
            to_json_line(r).encode("utf-8") + b"\n" for r in recs)
    finally:
        sp.close()


def test_sink_delivers_repeat_columns_as_they_are(tmp_path):
    """JsonlSink.deliver_batch writes a read's columns as the read holds them:
    its Repeats stay Repeats (never made lists) and the file is json_line's."""
    sp = Spool(str(tmp_path / "spool"), fsync="never")
    groups = _repeat_batch("sb-d")
    for g in groups:
        sp.append_many(g)
    path = str(tmp_path / "out.jsonl")
    sink = JsonlSink(sp, path=path)
    try:
        b = sink.reader.read(1000)
        repeats = {k for k, c in b.raw_columns.items() if c.__class__ is Repeat}
        assert repeats
        sink.deliver_batch(b)
        assert {k for k, c in b.raw_columns.items() if c.__class__ is Repeat} == repeats
    finally:
        sink.close()
        sp.close()
    assert open(path, "rb").read() == b"".join(to_json_line(r).encode("utf-8") + b"\n" for g in groups for r in g)
