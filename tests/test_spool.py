"""The durable spool: framing, cursors, rotation, concurrency, damage. Real
files, real processes, no ClickHouse needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from exporters.errors import ExportError
from exporters.spool import (HEADER_BYTES, MAGIC, MAX_RECORD_BYTES, Position, Spool, encode_frame,
                         validate_record)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rec(i, **kw):
    r = {"event_id": f"ev-{i}", "ts_ns": 1_700_000_000_000_000_000 + i, "sandbox_id": "sb", "kind": "exec",
         "pid": i, "path": f"/bin/p{i}"}
    r.update(kw)
    return r


def read_all(reader, commit=True, max_records=10000):
    out, damage = [], []
    while True:
        b = reader.read(max_records)
        if not b:
            return out, damage
        out += b.records
        damage += b.damage
        if commit:
            reader.commit(b)


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path / "spool"), fsync="never")
    yield s
    s.close()


def test_roundtrip_is_exact(spool):
    weird = os.fsdecode(b"/tmp/\xff\xfe caf\xc3\xa9 \x01\n\\")
    big = "A" * (200 * 1024)
    records = [rec(0, path=weird, argv=[weird, big, ""], comm="\udcff\udc80x"),
               rec(1, kind="connect", family="ipv6", addr="::1", port=65535, ret=-111),
               rec(2, kind="events_lost", count=2**64 - 1, extra=json.dumps({"k": "v"}))]
    spool.append_many(records)
    got, damage = read_all(spool.reader("t"))
    assert damage == []
    assert got == [{**r, "argv": list(r["argv"])} if "argv" in r else r for r in records]
    assert os.fsencode(got[0]["path"]) == b"/tmp/\xff\xfe caf\xc3\xa9 \x01\n\\"


def test_frames_are_ascii_json_with_crc(spool):
    spool.append(rec(0, path="\udcff"))
    raw = open(spool.seg_path(spool.segments()[0]), "rb").read()
    assert raw.startswith(MAGIC)
    payload = raw[HEADER_BYTES:]
    assert payload.isascii() and b"\\udcff" in payload
    assert json.loads(payload)["path"] == "\udcff"


@pytest.mark.parametrize("bad, words", [
    ({"event_id": "x", "kind": "exec", "nope": 1}, ["'x'", "unknown field 'nope'"]),
    ({"event_id": "x", "kind": "exec", "pid": "12"}, ["'x'", "'pid'", "integer"]),
    ({"event_id": "x", "kind": "exec", "port": 70000}, ["'port'", "out of range"]),
    ({"event_id": "x", "kind": "exec", "path": b"/bin"}, ["'path'", "str"]),
    ({"event_id": "x", "kind": "exec", "argv": "ls -l"}, ["'argv'", "list"]),
    ({"event_id": "x", "kind": "exec", "path": "\ud800"}, ["'path'", "surrogateescape"]),
    ({"event_id": "x", "kind": "teleport"}, ["kind 'teleport'"]),
    ({"kind": "exec"}, ["event_id"]),
    ({"event_id": "", "kind": "exec"}, ["event_id"]),
])
def test_bad_records_are_refused_with_a_clear_line(spool, bad, words):
    with pytest.raises(ExportError) as e:
        spool.append_many([rec(1), bad])          # all or nothing
    msg = e.value.message
    assert "\n" not in msg
    for w in words:
        assert w in msg
    assert spool.size_bytes() == 0


def test_oversized_record_is_cut_with_a_marker_never_refused(spool):
    """Issue 13 point 4: a sandbox_exit whose manifest holds 1,000 non-UTF-8
    4 KiB paths is ~28 MiB escaped, past the 16 MiB frame limit; on main the
    spool refused the batch and every record in it was lost."""
    bad = "/" + "\udcff" * 4095
    big = rec(1, kind="sandbox_exit", path="",
              extra=json.dumps({"changes": [{"path": bad, "kind": "added"}] * 1000, "exit_code": 0}))
    argv = rec(2, argv=["x" * (MAX_RECORD_BYTES + 1)])
    assert spool.append_many([rec(0), big, argv, rec(3)]) == 4
    out, damage = read_all(spool.reader("t"))
    assert [r["event_id"] for r in out] == ["ev-0", "ev-1", "ev-2", "ev-3"] and not damage
    ex = json.loads(out[1]["extra"])
    assert ex["dsec_truncated"] == {"extra": len(big["extra"])}
    assert ex["extra_prefix"].endswith("...[dsec: truncated]")
    assert big["extra"].startswith(ex["extra_prefix"][:-len("...[dsec: truncated]")])
    assert out[2]["argv"][-1] == "...[dsec: truncated]"
    assert json.loads(out[2]["extra"])["dsec_truncated"] == {"argv": 1}
    assert out[0] == rec(0) and out[3] == rec(3)


def test_cursor_persists_and_uncommitted_batch_is_read_again(spool, tmp_path):
    spool.frames = "record"      # read(30) of frames of one record (a batch frame is never split)
    spool.append_many([rec(i) for i in range(100)])
    r = spool.reader("sink")
    b = r.read(30)
    assert [x["pid"] for x in b.records] == list(range(30))
    b2 = r.read(30)  # not committed: the same records again
    assert b2.records == b.records
    r.commit(b)
    again = Spool(spool.path).reader("sink")  # another process, later
    rest, damage = read_all(again)
    assert [x["pid"] for x in rest] == list(range(30, 100)) and not damage
    cur = json.load(open(os.path.join(spool.path, "cursors", "sink.json")))
    assert cur["segment"] == spool.segments()[-1]


def test_rotation_and_deletion_wait_for_every_sink(tmp_path):
    s = Spool(str(tmp_path / "sp"), segment_bytes=4096, fsync="never")
    a, b = s.reader("a"), s.reader("b")
    for i in range(0, 200, 10):            # a segment rotates between appends, not within one
        s.append_many([rec(j) for j in range(i, i + 10)])
    segs = s.segments()
    assert len(segs) > 3
    got_a, _ = read_all(a)
    assert len(got_a) == 200
    assert s.segments() == segs            # b has not read them yet
    got_b, _ = read_all(b, max_records=7)
    assert got_b == got_a
    assert s.segments() == segs[-1:]       # only the head is kept
    s.append(rec(200))
    assert [x["pid"] for x in read_all(a)[0]] == [200]
    s.drop_sink("b")
    assert s.sinks() == ["a"]
    s.close()


def test_every_append_is_fsynced_by_default(tmp_path):
    s = Spool(str(tmp_path / "sp"))
    assert s.fsync == "always"
    s.append(rec(0))
    s.close()
    with pytest.raises(ExportError, match="DSEC_SPOOL_FSYNC"):
        Spool(str(tmp_path / "sp"), fsync="sometimes")


_WRITER = """
import sys, random
sys.path.insert(0, {root!r})
from exporters.spool import Spool
w, n = int(sys.argv[1]), int(sys.argv[2])
s = Spool({path!r}, segment_bytes=16384, fsync="never")
i = 0
rnd = random.Random(w)
while i < n:
    k = min(n - i, rnd.randint(1, 40))
    s.append_many([{{"event_id": f"w{{w}}-{{j}}", "kind": "open_write", "pid": w, "flags": j,
                     "path": "/x" * rnd.randint(0, 50)}} for j in range(i, i + k)])
    i += k
s.close()
"""


def test_concurrent_writers_and_a_live_reader_lose_and_duplicate_nothing(tmp_path):
    path = str(tmp_path / "sp")
    s = Spool(path, segment_bytes=16384, fsync="never")
    reader = s.reader("live")
    script = _WRITER.format(root=ROOT, path=path)
    writers, n = 4, 1500
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w), str(n)]) for w in range(writers)]
    got, damage = [], []
    while True:  # read while they write (rotations, tails being written)
        running = any(p.poll() is None for p in procs)
        more, dmg = read_all(reader, max_records=97)
        got += more
        damage += dmg
        if not running and not more:
            break
    assert all(p.wait() == 0 for p in procs)
    more, dmg = read_all(reader)
    got += more
    assert damage == [] and dmg == []
    ids = [g["event_id"] for g in got]
    assert len(ids) == writers * n == len(set(ids))
    for w in range(writers):   # each writer's records in its own order
        seq = [g["flags"] for g in got if g["pid"] == w]
        assert seq == list(range(n))
    assert len(s.segments()) == 1
    s.close()


def test_torn_tail_of_a_crashed_writer_is_reported_and_skipped(spool):
    spool.append_many([rec(i) for i in range(10)])
    with open(spool.seg_path(spool.segments()[-1]), "ab") as f:
        f.write(encode_frame(rec(99))[:25])        # a writer died mid-write
    r = spool.reader("t")
    b = r.read()
    assert len(b.records) == 10
    assert len(b.damage) == 1 and "torn" in b.damage[0].reason and b.damage[0].length == 25
    r.commit(b)
    spool.append(rec(10))                            # new writes after the torn bytes
    got, damage = read_all(r)
    assert [x["pid"] for x in got] == [10] and not damage
    log = [json.loads(x) for x in open(os.path.join(spool.path, "damage.log"))]
    assert len(log) == 1 and log[0]["length"] == 25
    assert open(log[0]["bytes_file"], "rb").read() == encode_frame(rec(99))[:25]


def test_an_incomplete_frame_being_written_is_waited_for_not_reported(spool):
    spool.append(rec(0))
    r = spool.reader("t")
    r.commit(r.read())
    frame = encode_frame(rec(1))
    seg = spool.seg_path(spool.segments()[-1])
    result = {}
    with spool.locked():                             # we are "the writer", mid-write
        with open(seg, "ab") as f:
            f.write(frame[:20])
        t = threading.Thread(target=lambda: result.setdefault("b", r.read()))
        t.start()
        time.sleep(0.2)
        with open(seg, "ab") as f:
            f.write(frame[20:])
    t.join(10)
    b = result["b"]
    assert [x["pid"] for x in b.records] == [1] and b.damage == []


def test_a_reader_in_another_process_waits_for_a_write_in_progress(spool):
    spool.append(rec(0))
    frame = encode_frame(rec(1))
    seg = spool.seg_path(spool.segments()[-1])
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from exporters.spool import Spool; "
            f"r = Spool({spool.path!r}).reader('p'); b = r.read(); "
            "print(len(b.records), len(b.damage), flush=True)")
    with spool.locked():
        with open(seg, "ab") as f:
            f.write(frame[:20])
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        with open(seg, "ab") as f:
            f.write(frame[20:])
    out, _ = p.communicate(timeout=30)
    assert out.split() == ["2", "0"]


def test_corruption_in_the_middle_keeps_the_records_around_it(spool):
    spool.append_many([rec(i) for i in range(30)])
    seg = spool.seg_path(spool.segments()[-1])
    data = bytearray(open(seg, "rb").read())
    sizes = [len(encode_frame(rec(i))) for i in range(30)]
    off = [sum(sizes[:i]) for i in range(30)]
    data[off[10] + HEADER_BYTES + 5] ^= 0xFF         # payload bit rot: CRC fails
    data[off[20]:off[20] + 4] = b"XXXX"              # header smashed
    data[off[25]:off[25]] = b"\x00garbage\xd5\xec"   # junk spliced between frames
    open(seg, "wb").write(bytes(data))
    got, damage = read_all(spool.reader("t"))
    assert [x["pid"] for x in got] == [i for i in range(30) if i not in (10, 20)]
    reasons = sorted(d.reason for d in damage)
    assert len(damage) == 3, reasons
    assert any("CRC" in x for x in reasons) and any("magic" in x for x in reasons)


def test_torn_tail_in_a_closed_segment_then_later_segments(tmp_path):
    s = Spool(str(tmp_path / "sp"), segment_bytes=2048, fsync="never")
    s.append_many([rec(i) for i in range(20)])
    first = s.segments()[0]
    with open(s.seg_path(first), "ab") as f:
        f.write(b"\xd5\xec\x01\xfe\x10")             # torn header at the end of a closed segment
    got, damage = read_all(s.reader("t"))
    assert [x["pid"] for x in got] == list(range(20))
    assert len(damage) == 1 and damage[0].segment == first
    s.close()


def test_intact_frame_with_invalid_content_is_kept_in_the_damage_log(spool):
    spool.append(rec(0))
    bad = {"event_id": "bad", "kind": "exec", "mystery": 1}
    with open(spool.seg_path(spool.segments()[-1]), "ab") as f:
        payload = json.dumps(bad).encode()
        import struct
        import zlib
        n = struct.pack("<I", len(payload))
        f.write(MAGIC + n + struct.pack("<I", zlib.crc32(payload, zlib.crc32(n))) + payload)
    spool.append(rec(1))
    got, damage = read_all(spool.reader("t"))
    assert [x["pid"] for x in got] == [0, 1]
    assert len(damage) == 1 and "mystery" in damage[0].reason
    log = [json.loads(x) for x in open(os.path.join(spool.path, "damage.log"))]
    assert json.loads(log[0]["payload"]) == bad


def test_full_spool_refuses_appends_loudly(tmp_path):
    # on_full="error": the append raises. The default policy (drop with accounting)
    # is tested in tests/test_faults.py.
    s = Spool(str(tmp_path / "sp"), segment_bytes=1024, max_bytes=4096, fsync="never", on_full="error")
    s.reader("slow")
    with pytest.raises(ExportError, match="full"):
        for i in range(1000):
            s.append(rec(i))
    assert 0 < i < 1000
    s.close()


def test_backlog_counts_records(spool):
    spool.frames = "record"      # read(20) of frames of one record (a batch frame is never split)
    r = spool.reader("t")
    spool.append_many([rec(i) for i in range(50)])
    assert r.backlog()[0] == 50
    r.commit(r.read(20))
    assert r.backlog()[0] == 30


def test_unreadable_cursor_is_a_clear_error(spool):
    spool.reader("t")
    open(os.path.join(spool.path, "cursors", "t.json"), "w").write("{oops")
    with pytest.raises(ExportError, match="cursor"):
        spool.reader("t").read()


def test_validate_record_accepts_sparse_records():
    assert validate_record({"event_id": "a", "kind": "fork", "child_pid": 3}) == \
        {"event_id": "a", "kind": "fork", "child_pid": 3}


def test_position_order():
    assert Position(1, 99) < Position(2, 0)


# --- batch frames (issue 15): an append of many records with the same fields is framed by column

def full(i, **kw):
    """A record with every field of the schema, as the recorder appends them."""
    from audit_schema.events import normalize
    return normalize(rec(i, **kw))


def test_batch_frames_roundtrip_exactly_and_carry_their_columns(spool):
    from exporters.spool import BATCH_MAX, MAGIC_BATCH
    from exporters.clickhouse import columns_for, columns_of
    weird = os.fsdecode(b"/tmp/\xff\xfe caf\xc3\xa9 \x01\n\\")
    records = [full(i, path=weird if i % 3 == 0 else f"/bin/p{i}", argv=[weird, "x"] if i % 5 == 0 else [],
                    comm="\udcff\udc80x") for i in range(BATCH_MAX + 100)]
    spool.append_many(records)
    raw = open(spool.seg_path(spool.segments()[-1]), "rb").read()
    assert raw.startswith(MAGIC_BATCH) and raw.count(MAGIC_BATCH) == 2 and MAGIC not in raw
    r = spool.reader("t")
    assert r.backlog()[0] == len(records)           # counted from the frames' headers
    b = r.read(100_000)
    # the columns as read, no dict per record built until a sink asks for the records
    assert b.count == len(records) and b._records is None and b.ts_of(7) == records[7]["ts_ns"]
    assert columns_of(b.columns, b.count) == columns_for(records)
    assert b.damage == [] and b.records == records
    assert b.columns is not None and len(b.columns["event_id"]) == len(records)
    assert columns_of(b.columns, len(records)) == columns_for(records)
    r.commit(b)
    assert r.backlog() == (0, 0)
    # a few more appended one by one: frames of one record; a batch mixing both has no columns
    spool.append_many([full(i) for i in range(5)])
    spool.append_many([full(i) for i in range(40)])
    b = r.read(100_000)
    assert len(b.records) == 45 and b.count == 45 and b.columns is None
    # records of different fields are framed one by one
    mixed = [rec(i) if i % 2 else full(i, argv=[]) for i in range(40)]
    spool.append_many(mixed)
    assert spool.reader("u").read(100_000).records[-40:] == mixed


@pytest.mark.parametrize("bad, words", [
    ({"path": "\ud800"}, ["'ev-20'", "'path'", "surrogateescape"]),      # not a surrogateescape byte
    ({"argv": ["ok", "\udfff"]}, ["'ev-20'", "'argv'", "surrogateescape"]),
    ({"comm": b"raw"}, ["'ev-20'", "'comm'", "str"]),
    ({"pid": True}, ["'ev-20'", "'pid'", "integer"]),
    ({"port": 70000}, ["'ev-20'", "'port'", "out of range"]),
    ({"ts_ns": 2**64}, ["'ev-20'", "'ts_ns'", "out of range"]),          # past int64: checked in Python
    ({"ret": -2**63 - 1}, ["'ev-20'", "'ret'", "out of range"]),
    ({"exit_code": 2**31}, ["'ev-20'", "'exit_code'", "out of range"]),    # from the C pass's (min, max)
    ({"pid": -1}, ["'ev-20'", "'pid'", "out of range"]),
    ({"kind": "teleport"}, ["'ev-20'", "kind 'teleport'"]),
])
def test_a_bad_record_in_a_batch_is_refused_naming_it(spool, bad, words):
    """A batch (framed by column, its strings proven by the frame's ASCII JSON)
    is checked as strictly as record by record: one bad record refuses the
    append, named, nothing written."""
    records = [full(i) for i in range(40)]
    records[20].update(bad)
    with pytest.raises(ExportError) as e:
        spool.append_many(records)
    assert "\n" not in e.value.message
    for w in words:
        assert w in e.value.message
    assert spool.size_bytes() == 0


def test_batch_frames_json_is_the_column_by_column_form(tmp_path, monkeypatch):
    """The one orjson call per batch frame gives exactly the bytes of the
    column-by-column form (json.dumps of each column, what a spool without
    orjson writes), for ASCII batches and for batches with raw bytes
    (surrogates) or other non-ASCII text; both read back exact."""
    import exporters.spool as sp
    raw = os.fsdecode(b"/tmp/\xff caf\xc3\xa9")
    for n, kw in enumerate(({}, {"path": raw}, {"path": "/tmp/caf\u00e9", "argv": ["\u00e9", "x"]})):
        records = [full(i, **{"argv": [], **kw}) if i == 7 else full(i, argv=["a", str(i)]) for i in range(40)]
        got = {}
        for form in ("orjson", "json"):
            if form == "json":
                monkeypatch.setattr(sp, "orjson", None)
            s = Spool(str(tmp_path / f"s{n}{form}"), fsync="never")
            s.append_many(records)
            got[form] = open(s.seg_path(s.segments()[-1]), "rb").read()
            assert got[form].startswith(sp.MAGIC_BATCH)
            assert read_all(s.reader("t"))[0] == records
            s.close()
            monkeypatch.undo()
        assert got["orjson"] == got["json"], n


def test_the_c_columns_pass_is_in_use_and_gives_what_python_gives():
    """exporters/columns.c (built by make setup) makes the spool append's columns
    and their class masks: exactly what py_columns gives, value for value (the
    same objects), and None for every batch it is not for."""
    from collections import OrderedDict
    from exporters import columns as C
    assert C._load() is not None, "exporters/build/libdsec_columns.so: built by make setup"

    class S(str):
        pass
    odd = [None, True, 1.5, S("x"), b"raw", (), ["a"], ("b",), 2**70, -3, "\udcff"]
    base = [full(i) for i in range(50)]
    for i, v in enumerate(odd):
        base[i]["path"] = v                    # every class into one column
        base[i + 20]["pid"] = v
    names = tuple(base[0])
    base[30]["ts_ns"] = 2**64 - 1               # UInt64, past int64: min/max taken in Python
    base[31]["ret"] = -2**63
    got, want = C.columns(base, names), C.py_columns(base, names)
    assert got is not None and got[1] == want[1] and got[2] == want[2] and len(got[0]) == len(names)
    assert got[2][names.index("ts_ns")] is None and got[2][names.index("ret")] == (-2**63, 0)
    assert all(a == b and all(x is y for x, y in zip(a, b)) for a, b in zip(got[0], want[0]))
    assert got[1][names.index("path")] == C.CLS_NONE | C.CLS_STR | C.CLS_OTHER | C.CLS_LIST | C.CLS_TUPLE | \
        C.CLS_INT
    assert got[1][names.index("argv")] == C.CLS_TUPLE and got[1][names.index("event_id")] == C.CLS_STR
    reordered = dict(reversed(list(base[3].items())))
    extra = dict(base[3], nope=1)
    missing = dict(base[3])
    del missing["ret"]
    renamed = {("x" if k == "ret" else k): v for k, v in base[3].items()}
    for bad in (reordered, extra, missing, renamed, OrderedDict(base[3]), list(base[3].items()), None):
        batch = base[:10] + [bad] + base[10:]
        assert C.columns(batch, names) is None and C.py_columns(batch, names) is None, bad
    assert C.columns(tuple(base), names) is None and C.columns(base, list(names)) is None
    assert C.columns([], names) == C.py_columns([], names) == ([[] for _ in names], bytes(len(names)),
                                                               [None] * len(names))


def test_a_batch_of_records_in_another_field_order_is_framed_by_column_too(spool):
    """Records of the same fields in different orders: no C pass (it wants one
    order), transposed by name as before, still batch frames, read back exact."""
    from exporters.spool import MAGIC_BATCH
    records = [full(i, path=f"/p/{i}", argv=["a", str(i)]) for i in range(40)]
    records[5] = dict(reversed(list(records[5].items())))
    spool.append_many(records)
    assert open(spool.seg_path(spool.segments()[-1]), "rb").read().startswith(MAGIC_BATCH)
    got = read_all(spool.reader("t"))[0]
    assert got == records and list(got[5]) == list(records[0])


def test_bit_rot_in_a_batch_frame_loses_that_frame_counted_and_keeps_the_rest(spool):
    records = [full(i) for i in range(100)]
    spool.append_many(records[:10])                 # frames of one record
    spool.append_many(records[10:60])               # one batch frame (50)
    spool.append_many(records[60:])                 # another (40)
    seg = spool.seg_path(spool.segments()[-1])
    data = bytearray(open(seg, "rb").read())
    at = sum(len(encode_frame(r)) for r in records[:10])
    data[at + HEADER_BYTES + 40] ^= 0x20           # inside the first batch frame's JSON: its CRC fails
    open(seg, "wb").write(bytes(data))
    got, damage = read_all(spool.reader("t"))
    assert [x["pid"] for x in got] == list(range(10)) + list(range(60, 100))
    assert len(damage) == 1 and "CRC" in damage[0].reason
    assert damage[0].frames == 50                   # the batch frame's count (unverified: a lower bound)
    assert damage[0].offset == at


def test_an_invalid_record_in_a_batch_frame_is_damage_of_its_own(spool):
    """A writer that did not validate (another version, a bug): the frame is intact,
    one record in it is not; that record is damage (its own gap event id), the rest delivered."""
    import zlib
    from exporters.spool import MAGIC_BATCH, _U32, _dumps
    records = [full(i) for i in range(40)]
    records[7] = dict(records[7], pid="not a number")
    names = list(records[0])
    payload = _dumps({"k": names, "c": [[r[n] for r in records] for n in names]})
    body = _U32.pack(40) + payload
    n = _U32.pack(len(body))
    with open(spool.seg_path(1), "ab") as f:
        f.write(MAGIC_BATCH + n + _U32.pack(zlib.crc32(body, zlib.crc32(n))) + body)
    got, damage = read_all(spool.reader("t"))
    assert [x["pid"] for x in got] == [i for i in range(40) if i != 7]
    assert len(damage) == 1 and damage[0].index == 7 and "pid" in damage[0].reason
    from exporters.base import damage_event
    ev = damage_event(damage[0], spool)
    assert json.loads(ev["extra"])["index"] == 7
    assert ev["event_id"] != damage_event(dataclass_replace(damage[0], index=8), spool)["event_id"]


def test_a_batch_frame_with_this_schemas_mark_is_not_checked_again_and_any_other_is(spool, monkeypatch):
    """append_many's batch frames carry SCHEMA_MARK ("w": their records passed
    the checks against this schema before framing): the reader takes their
    columns without re-checking every value. A frame with another schema's
    mark (another dsec version) or none (an older writer) is checked value by
    value: its invalid record is damage of its own, the rest delivered."""
    import zlib
    from exporters import spool as spool_mod
    from exporters.spool import MAGIC_BATCH, SCHEMA_MARK, _U32, _dumps
    records = [full(i) for i in range(40)]
    spool.append_many(records)
    records = [dict(r, argv=list(r["argv"])) for r in records]       # as read back: lists
    raw = open(spool.seg_path(1), "rb").read()
    assert raw.startswith(MAGIC_BATCH) and raw.endswith(b',"w":%d}' % SCHEMA_MARK)
    checked = []
    real = spool_mod._column_lists_valid
    monkeypatch.setattr(spool_mod, "_column_lists_valid", lambda *a: checked.append(1) or real(*a))
    b = spool.reader("t").read(1000)
    assert b.count == 40 and b.records == records and checked == []      # trusted: not checked again
    bad = [dict(r, event_id=f"x{i}") for i, r in enumerate(records)]
    bad[7] = dict(bad[7], pid="not a number")
    names = list(bad[0])
    for mark in (b',"w":%d' % (SCHEMA_MARK ^ 1), b""):
        payload = _dumps({"k": names, "c": [[r[n] for r in bad] for n in names]})[:-1] + mark + b"}"
        body = _U32.pack(40) + payload
        n = _U32.pack(len(body))
        with open(spool.seg_path(1), "ab") as f:
            f.write(MAGIC_BATCH + n + _U32.pack(zlib.crc32(body, zlib.crc32(n))) + body)
    r = spool.reader("u")
    got, damage = read_all(r)
    assert got[:40] == records and [x["event_id"] for x in got[40:]] == [f"x{i}" for i in range(40) if i != 7] * 2
    assert [d.index for d in damage] == [7, 7] and all("pid" in d.reason for d in damage)
    assert len(checked) == 2


def test_a_constant_column_is_one_value_in_the_frame_and_every_record_gets_it_back(spool):
    """A column of one value throughout (raw bytes, an argv, 2**64-1, '') is
    {"r": value} in the batch frame; read back, every record has it exactly,
    each its own argv list; the columns that vary are lists as before."""
    weird = os.fsdecode(b"\xff\xfe/x")
    records = [full(i, comm="\udcff\udc80x", argv=["sh", weird], count=2**64 - 1, path=f"/p{i}")
               for i in range(50)]
    spool.append_many(records)
    raw = open(spool.seg_path(1), "rb").read()
    assert b'{"r":"\\udcff\\udc80x"}' in raw and b'{"r":["sh","\\udcff\\udcfe/x"]}' in raw
    assert b'{"r":18446744073709551615}' in raw and b'"/p0","/p1"' in raw
    b = spool.reader("t").read(1000)
    got = b.records
    assert b.damage == [] and got == [dict(r, argv=list(r["argv"])) for r in records]
    assert len({id(r["argv"]) for r in got}) == 50              # not one list shared by every record
    got[0]["argv"].append("x")
    assert got[1]["argv"] == ["sh", weird]


def test_a_read_keeps_a_column_of_one_value_as_a_repeat_until_a_sink_asks_for_lists(spool):
    """Frames that agree on a column's one value make one Repeat for the read
    (no list of references built and scanned); frames with another value, or
    a varying one, make a list; Batch.columns gives lists either way, and the
    records are the records."""
    from exporters.spool import Repeat
    a = [full(i, node="n1", comm="a", path=f"/p{i}") for i in range(40)]
    b = [full(i, node="n1", comm="b", path=f"/q{i}") for i in range(40, 80)]
    spool.append_many(a)
    spool.append_many(b)
    batch = spool.reader("t").read(1000)
    raw = batch.raw_columns
    assert raw["node"] == Repeat("n1", 80) and raw["argv"] == Repeat([], 80)
    assert raw["comm"] == ["a"] * 40 + ["b"] * 40 and raw["path"].__class__ is list
    assert batch.ts_of(79) == b[-1]["ts_ns"] and batch.oldest_ts() == a[0]["ts_ns"]
    assert batch._records is None
    cols = batch.columns
    assert cols["node"] == ["n1"] * 80 and cols["argv"] == [[]] * 80 and batch.raw_columns["node"].__class__ is list
    assert batch.records == [dict(r, argv=list(r["argv"])) for r in a + b]


def dataclass_replace(d, **kw):
    import dataclasses
    return dataclasses.replace(d, **kw)


def test_frames_record_writes_frames_of_one_record(tmp_path, monkeypatch):
    monkeypatch.setenv("DSEC_SPOOL_FRAMES", "record")
    s = Spool(str(tmp_path / "s"), fsync="never")
    s.append_many([full(i) for i in range(100)])
    raw = open(s.seg_path(1), "rb").read()
    assert raw.count(MAGIC) == 100
    s.close()
    monkeypatch.setenv("DSEC_SPOOL_FRAMES", "columns")
    with pytest.raises(ExportError, match="DSEC_SPOOL_FRAMES"):
        Spool(str(tmp_path / "s2"))
