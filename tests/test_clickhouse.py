"""Spool -> ClickHouse -> query layer, against a real clickhouse-server on
loopback started by dsec's own code (exporters/clickhouse_server.py).

Why this file is long: the spool, the exporter and the query layer are tested
against the same session server and database (tests/fixtures_clickhouse.py),
one section each."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from exporters.clickhouse_server import PrivateServer, connect, ensure_clickhouse, parse_url
from audit_schema.errors import ReportedError
from replay.store import AuditStore
from exporters.spool import HEADER_BYTES, Position, Spool, encode_frame
from audit_schema import migrations
from audit_schema.events import FIELDS, from_bytes
from exporters.clickhouse import ClickHouseExporter

from fixtures_clickhouse import (SESSION_DB, clickhouse_client, clickhouse_server, clickhouse_url,  # noqa: F401
                                 free_ports, scratch_clickhouse)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DSEC = [sys.executable, "-m", "agent.cli"]


def new_sid():
    return "sb-" + uuid.uuid4().hex[:12]


def events(sid, n, start=0, **kw):
    t0 = 1_800_000_000_000_000_000
    out = []
    for i in range(start, start + n):
        r = {"event_id": f"{sid}-{i}", "ts_ns": t0 + i * 1000, "node": "node-a", "sandbox_id": sid,
             "kind": ("exec", "connect", "open_write")[i % 3], "pid": 100 + i, "ppid": 1, "step": 1,
             "path": f"/work/f{i}", "decision": "allowed"}
        r.update(kw)
        out.append(r)
    return out


def final_count(client, db, sid):
    return client.execute(f"SELECT count(), uniqExact(event_id) FROM {db}.events FINAL "
                          f"WHERE sandbox_id = %(s)s", {"s": sid})[0]


def run_dsec(*args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT)
    e.update(env or {})
    return subprocess.run([*DSEC, *args], capture_output=True, cwd=ROOT, env=e, timeout=120)


@pytest.fixture
def spool(tmp_path):
    s = Spool(str(tmp_path / "spool"), fsync="never")
    yield s
    s.close()


# --- the private server ----------------------------------------------------------------

def test_private_server_listens_on_loopback_only(clickhouse_server):
    st = clickhouse_server.status()
    assert st.running and st.pid
    assert st.data_dir.startswith(clickhouse_server.home)
    listen = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) in (st.tcp_port, st.http_port):
            listen.append(local.split(":")[0])
    assert listen and set(listen) == {"0100007F"}   # 127.0.0.1
    # starting again reuses it
    assert clickhouse_server.start().pid == st.pid
    assert PrivateServer().start().pid == st.pid


def test_ensure_clickhouse_prefers_the_url_from_the_environment(monkeypatch, clickhouse_server):
    monkeypatch.setenv("DSEC_CLICKHOUSE_URL", "clickhouse://u:p@db.example:9440/audit?secure=1")
    assert ensure_clickhouse() == "clickhouse://u:p@db.example:9440/audit?secure=1"
    t = parse_url(ensure_clickhouse())
    assert (t.host, t.port, t.user, t.password, t.database, t.secure) == ("db.example", 9440, "u", "p", "audit", True)
    monkeypatch.setenv("DSEC_CLICKHOUSE_URL", "postgres://x/y")
    with pytest.raises(ReportedError, match="DSEC_CLICKHOUSE_URL"):
        ensure_clickhouse()
    monkeypatch.setenv("DSEC_CLICKHOUSE_URL", "clickhouse://h/bad-name")
    with pytest.raises(ReportedError, match="database name"):
        connect(os.environ["DSEC_CLICKHOUSE_URL"])
    monkeypatch.delenv("DSEC_CLICKHOUSE_URL")
    assert ensure_clickhouse() == clickhouse_server.url


def test_cli_start_stop_status_on_a_private_home(tmp_path):
    tcp, http = free_ports(2)
    env = {"DSEC_CLICKHOUSE_DIR": str(tmp_path / "ch"), "DSEC_CLICKHOUSE_PORT": str(tcp),
           "DSEC_CLICKHOUSE_HTTP_PORT": str(http), "DSEC_CLICKHOUSE_URL": ""}
    try:
        r = run_dsec("clickhouse", "status", env=env)
        assert r.returncode == 1 and b"not running" in r.stdout
        r = run_dsec("clickhouse", "start", env=env)
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split(b"(pid ")[1].split(b")")[0])
        assert b"started" in r.stdout
        r = run_dsec("clickhouse", "start", env=env)
        assert r.returncode == 0 and b"already running" in r.stdout and f"(pid {pid})".encode() in r.stdout
        r = run_dsec("clickhouse", "status", env=env)
        assert r.returncode == 0
        for want in (f"127.0.0.1:{tcp}", f"127.0.0.1:{http}", str(tmp_path / "ch" / "data"), "ClickHouse 18."):
            assert want.encode() in r.stdout, r.stdout
        r = run_dsec("clickhouse", "stop", env=env)
        assert r.returncode == 0 and f"stopped (pid {pid})".encode() in r.stdout
        assert not os.path.exists(f"/proc/{pid}") or b"clickhouse" not in open(f"/proc/{pid}/cmdline", "rb").read()
        r = run_dsec("clickhouse", "status", env=env)
        assert r.returncode == 1
        r = run_dsec("clickhouse", "status", env={**env, "DSEC_CLICKHOUSE_PORT": "99999"})
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"DSEC_CLICKHOUSE_PORT" in r.stderr
    finally:
        PrivateServer(str(tmp_path / "ch"), tcp, http).stop()


def test_port_taken_by_someone_else_is_a_clear_error(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        srv = PrivateServer(str(tmp_path / "ch"), s.getsockname()[1], free_ports(1)[0])
        with pytest.raises(ReportedError, match="taken by another process"):
            srv.start()
    finally:
        s.close()


# --- schema -------------------------------------------------------------------------------

@pytest.fixture
def scratch_db(clickhouse_url):
    client, _ = connect(clickhouse_url)
    db = f"{SESSION_DB}_m{uuid.uuid4().hex[:6]}"
    yield client, db
    client.execute(f"DROP DATABASE IF EXISTS {db}")
    client.disconnect()


def test_migrations_are_idempotent_and_recorded(scratch_db):
    client, db = scratch_db
    r1 = migrations.migrate(client, db)
    assert (r1.before, r1.after, r1.applied) == (0, migrations.LATEST, [v for v, _, _ in migrations.MIGRATIONS])
    r2 = migrations.migrate(client, db)
    assert (r2.before, r2.after, r2.applied, r2.added_columns) == (migrations.LATEST, migrations.LATEST, [], [])
    rows = client.execute(f"SELECT version, name, server_version FROM {db}.schema_migrations FINAL ORDER BY version")
    assert [r[0] for r in rows] == [v for v, _, _ in migrations.MIGRATIONS]
    assert rows[0][2] == client.execute("SELECT version()")[0][0]
    cols = migrations.table_columns(client, db)
    feat = migrations.detect_features(client)
    for f in FIELDS:   # every field a column, LowCardinality where FIELDS asks for it
        assert cols[f.name] == migrations.column_type(f, feat)
    assert cols["node"] == "LowCardinality(String)" and cols["path"] == "String"
    engine, = client.execute("SELECT engine FROM system.tables WHERE database = %(d)s AND name = 'events'",
                             {"d": db})[0]
    assert engine == "ReplacingMergeTree"
    ddl = client.execute(f"SHOW CREATE TABLE {db}.events")[0][0]
    assert "ORDER BY (kind, sandbox_id, ts_ns, event_id)" in ddl
    assert "PARTITION BY toYYYYMM(toDateTime(intDiv(ts_ns, 1000000000), 'UTC'))" in ddl


def test_missing_column_is_added_and_a_type_change_is_refused(scratch_db):
    client, db = scratch_db
    migrations.migrate(client, db)
    client.execute(f"ALTER TABLE {db}.events DROP COLUMN shebang")   # as if FIELDS had grown
    assert migrations.migrate(client, db).added_columns == ["shebang"]
    client.execute(f"ALTER TABLE {db}.events DROP COLUMN shebang")
    client.execute(f"ALTER TABLE {db}.events ADD COLUMN shebang UInt8")
    with pytest.raises(ReportedError, match=r"shebang is UInt8 .* String"):
        migrations.migrate(client, db)


def test_a_dropped_events_table_is_recreated(scratch_db):
    client, db = scratch_db
    migrations.migrate(client, db)
    client.execute(f"DROP TABLE {db}.events")
    client.execute(f"DROP TABLE {db}.sandboxes")
    r = migrations.migrate(client, db)
    assert r.before == migrations.LATEST and r.applied == [v for v, _, _ in migrations.MIGRATIONS]
    assert set(migrations.table_columns(client, db)) >= {f.name for f in FIELDS}


def test_a_newer_schema_is_refused_and_nothing_is_lost(scratch_db, clickhouse_server, spool):
    client, db = scratch_db
    migrations.migrate(client, db)
    client.execute(f"INSERT INTO {db}.schema_migrations (version, name) VALUES", [(migrations.LATEST + 1, "future")])
    with pytest.raises(ReportedError, match=f"schema version {migrations.LATEST + 1}, newer"):
        migrations.migrate(client, db)
    url = clickhouse_server.url_for(db)
    with pytest.raises(ReportedError, match="newer"):
        list(AuditStore(url).events("x"))
    spool.append_many(events("sb-future", 5))
    exp = ClickHouseExporter(spool, url)
    res = exp.flush(timeout=5)
    assert res.fatal and "newer" in res.error and res.pending == 5 and res.sent == 0
    exp.close()


# --- export --------------------------------------------------------------------------------

def test_export_and_query_dedup_by_event_id(clickhouse_url, clickhouse_client, spool):
    client, db = clickhouse_client
    sid = new_sid()
    evs = events(sid, 2500)
    spool.append_many(evs[:1000])
    spool.append_many(evs[1000:])
    exp = ClickHouseExporter(spool, clickhouse_url, batch_records=700)
    res = exp.flush(timeout=60)
    assert res.ok and res.sent == 2500 and res.pending == 0
    # re-send everything (as after a crash between insert and cursor commit)
    spool.save_cursor("clickhouse", Position(spool.segments()[0], 0))
    assert exp.flush(timeout=60).sent == 2500
    raw = client.execute(f"SELECT count() FROM {db}.events WHERE sandbox_id = %(s)s", {"s": sid})[0][0]
    assert 2500 <= raw <= 5000   # copies may or may not be merged yet
    assert final_count(client, db, sid) == (2500, 2500)
    store = AuditStore(clickhouse_url)
    got = list(store.events(sid))
    assert [g["event_id"] for g in got] == [e["event_id"] for e in evs]       # once each, time-ordered
    assert [g["pid"] for g in store.events(sid, ["connect"], limit=3)] == [101, 104, 107]
    assert store.count(sid) == 2500
    exp.close()
    store.close()


def test_non_utf8_bytes_round_trip_exactly(clickhouse_url, clickhouse_client, spool):
    client, db = clickhouse_client
    sid = new_sid()
    every_byte = bytes(range(1, 256))
    path = b"/tmp/\xff\xfe/caf\xc3\xa9/\x00nul\n"
    big = b"\xc3" + b"x" * (200 * 1024)
    rec = {"event_id": f"{sid}-bytes", "ts_ns": 1, "sandbox_id": sid, "kind": "exec",
           "path": from_bytes(path), "argv": [from_bytes(every_byte), from_bytes(big), ""],
           "comm": from_bytes(b"\x80\x81comm"), "argv_truncated": 1}
    spool.append(rec)
    assert ClickHouseExporter(spool, clickhouse_url).flush(timeout=30).ok
    row = client.execute(f"SELECT path, argv, comm FROM {db}.events FINAL WHERE sandbox_id = %(s)s",
                         {"s": sid}, settings={"strings_as_bytes": True})
    assert row == [(path, [every_byte, big, b""], b"\x80\x81comm")]
    got, = list(AuditStore(clickhouse_url).events(sid))
    assert os.fsencode(got["path"]) == path and [os.fsencode(a) for a in got["argv"]] == [every_byte, big, b""]
    # the CLI's JSON lines carry the same bytes as \udcXX escapes
    r = run_dsec("events", "--sandbox", sid, "--format", "json", env={"DSEC_CLICKHOUSE_URL": clickhouse_url})
    assert r.returncode == 0, r.stderr
    line, = r.stdout.decode("utf-8").splitlines()
    obj = json.loads(line)
    assert set(obj) == {f.name for f in FIELDS}
    assert os.fsencode(obj["path"]) == path and os.fsencode(obj["argv"][0]) == every_byte
    assert "\\udcff" in line
    # a query by exact non-UTF-8 path, through the literal escaping
    from replay.store import sql_string
    n = client.execute(f"SELECT count() FROM {db}.events FINAL WHERE path = {sql_string(from_bytes(path))}")[0][0]
    assert n == 1


def test_batch_frames_of_raw_bytes_arrive_exactly(clickhouse_url, clickhouse_client, spool):
    """A batch of normalized records (batch frames, the columns inserted as
    they are, String columns encoded by one map each) with raw bytes, NULs,
    empty strings and non-ASCII: every row, every byte, once."""
    from audit_schema.events import normalize
    client, db = clickhouse_client
    sid = new_sid()
    paths = [b"/tmp/\xff\xfe/%d" % i if i % 3 == 0 else b"" if i % 3 == 1 else ("/caf\u00e9/\0/%d" % i).encode()
             for i in range(64)]
    recs = [normalize({"event_id": f"{sid}-{i:03d}", "ts_ns": 1000 + i, "sandbox_id": sid, "kind": "open_write",
                       "path": from_bytes(p), "comm": from_bytes(b"\x80c%d" % i), "argv": [from_bytes(p), ""]})
            for i, p in enumerate(paths)]
    spool.append_many(recs)
    assert ClickHouseExporter(spool, clickhouse_url).flush(timeout=30).ok
    rows = client.execute(f"SELECT event_id, path, comm, argv FROM {db}.events FINAL WHERE sandbox_id = %(s)s "
                          "ORDER BY event_id", {"s": sid}, settings={"strings_as_bytes": True})
    assert rows == [(f"{sid}-{i:03d}".encode(), p, b"\x80c%d" % i, [p, b""]) for i, p in enumerate(paths)]


def test_batch_frames_are_inserted_from_their_columns_with_the_gap_beside_them(clickhouse_url, clickhouse_client,
                                                                              spool):
    """A read of batch frames is inserted from its columns, no dict per record
    ever built (Batch.records stays unbuilt); bit rot in the middle frame is an
    events_lost row in the same insert; the rows are the records, field for field."""
    from audit_schema.events import FIELD_NAMES, normalize
    from exporters.spool import MAGIC_BATCH
    client, db = clickhouse_client
    sid = new_sid()
    recs = [normalize(dict(e, argv=[] if i % 2 else ["sh", "-c", f"x{i}"]))
            for i, e in enumerate(events(sid, 120))]
    for k in range(3):
        spool.append_many(recs[40 * k:40 * (k + 1)])          # three batch frames of 40
    seg = spool.seg_path(spool.segments()[-1])
    data = bytearray(open(seg, "rb").read())
    second = data.index(MAGIC_BATCH, 1)
    data[second + HEADER_BYTES + 60] ^= 0x20                  # the middle frame's CRC fails
    open(seg, "wb").write(bytes(data))
    exp = ClickHouseExporter(spool, clickhouse_url)
    b = exp.reader.read(10_000)
    assert b.count == 80 and len(b.damage) == 1 and b.columns
    exp._send(b)
    assert b._records is None                                 # the dicts were never built
    exp.close()
    cols = ", ".join(FIELD_NAMES)
    rows = client.execute(f"SELECT {cols} FROM {db}.events FINAL WHERE sandbox_id = %(s)s ORDER BY event_id",
                          {"s": sid})
    want = sorted(recs[:40] + recs[80:], key=lambda r: r["event_id"])
    assert [dict(zip(FIELD_NAMES, r)) for r in rows] == [dict(r, argv=list(r["argv"])) for r in want]
    gaps = client.execute(f"SELECT count FROM {db}.events FINAL WHERE kind = 'events_lost' AND sandbox_id = '' "
                          f"AND extra LIKE %(p)s", {"p": f"%{spool.path}%"})
    assert gaps == [(40,)]


def test_all_default_columns_are_left_to_the_server_and_the_rows_are_the_same(clickhouse_url, clickhouse_client,
                                                                             spool):
    """insert_block leaves out a column only when every value of the batch is
    the default ('' / 0 / no argv); one non-default value in it (the last
    record's sha256, a 0 beside None) sends the column; the rows read back are
    the records, field for field, either way."""
    from audit_schema.events import FIELDS, FIELD_NAMES, normalize
    from exporters.clickhouse import insert_block
    client, db = clickhouse_client
    sid = new_sid()
    recs = [normalize(dict(e, argv=[])) for e in events(sid, 64)]
    recs[-1]["sha256"] = "ab" * 32
    names, cols = insert_block([[r[f.name] for r in recs] for f in FIELDS])
    assert "sha256" in names and "argv" not in names and "shebang" not in names and "event_id" in names
    assert len(names) == len(cols) < len(FIELDS)
    assert "ppid" in insert_block([[None, 0] if f.name == "ppid" else [f.name, f.name] for f in FIELDS])[0]
    spool.append_many(recs)
    exp = ClickHouseExporter(spool, clickhouse_url)
    b = exp.reader.read(10_000)
    assert b.columns and b.count == 64
    exp._send(b)
    exp.close()
    rows = client.execute(f"SELECT {', '.join(FIELD_NAMES)} FROM {db}.events FINAL WHERE sandbox_id = %(s)s "
                          f"ORDER BY event_id", {"s": sid})
    want = sorted(recs, key=lambda r: r["event_id"])
    assert [dict(zip(FIELD_NAMES, r)) for r in rows] == [dict(r, argv=list(r["argv"])) for r in want]


def test_cli_events_table_and_bad_usage(clickhouse_url, spool):
    sid = new_sid()
    spool.append_many(events(sid, 6, path=from_bytes(b"/etc/\x1b[31mred\xff")))
    assert ClickHouseExporter(spool, clickhouse_url).flush(timeout=30).ok
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "COLUMNS": "200"}
    r = run_dsec("events", "--sandbox", sid, "--kind", "exec,open_write", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.count("exec") == 2 and out.count("open_write") == 2 and "connect" not in out
    assert "\x1b" not in out and "\\x1b[31mred\\xff" in out       # no terminal escapes from hostile names
    r = run_dsec("events", "--sandbox", sid, "--kind", "execve", env=env)
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"execve" in r.stderr
    r = run_dsec("events", "--sandbox", "no-such-sandbox", env=env)
    assert r.returncode == 1 and b"no events" in r.stderr and r.stderr.count(b"\n") == 1
    r = run_dsec("events", "--sandbox", sid, env={"DSEC_CLICKHOUSE_URL": "clickhouse://127.0.0.1:1/x"})
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1 and b"Connection refused" in r.stderr


def test_sandboxes_view_summarises_lifecycle(clickhouse_url, spool):
    sid = new_sid()
    spool.append_many([
        {"event_id": f"{sid}-s", "ts_ns": 10, "sandbox_id": sid, "kind": "sandbox_start", "node": "n1",
         "argv": ["python3", "-c", "x"], "policy_name": "default", "mode": "audit"},
        *events(sid, 3),
        {"event_id": f"{sid}-l", "ts_ns": 20, "sandbox_id": sid, "kind": "events_lost", "count": 7},
        {"event_id": f"{sid}-e", "ts_ns": 30, "sandbox_id": sid, "kind": "sandbox_exit", "exit_code": 3},
    ])
    assert ClickHouseExporter(spool, clickhouse_url).flush(timeout=30).ok
    s = AuditStore(clickhouse_url).sandbox(sid)
    assert s["started_ns"] == 10 and s["ended_ns"] == 30 and s["exit_code"] == 3 and s["events_lost"] == 7
    assert s["argv"] == ["python3", "-c", "x"] and s["mode"] == "audit" and s["exited"] == 1
    assert AuditStore(clickhouse_url).sandbox("nope") is None


def test_unreachable_clickhouse_keeps_events_in_the_spool(clickhouse_url, clickhouse_client, spool):
    client, db = clickhouse_client
    sid = new_sid()
    spool.append_many(events(sid, 40))
    dead = f"clickhouse://default@127.0.0.1:{free_ports(1)[0]}/{db}"
    exp = ClickHouseExporter(spool, dead)
    res = exp.flush(timeout=0.5)
    assert res.sent == 0 and res.pending == 40 and "refused" in res.error.lower() and not res.fatal
    exp.close()
    res = ClickHouseExporter(spool, clickhouse_url).flush(timeout=30)
    assert res.ok and res.sent == 40
    assert final_count(client, db, sid) == (40, 40)


def test_clickhouse_stopped_mid_stream_every_event_arrives_once(scratch_clickhouse, tmp_path):
    server = scratch_clickhouse
    url = server.url_for("outage")
    spool = Spool(str(tmp_path / "sp"), fsync="never")
    exp = ClickHouseExporter(spool, url, batch_records=50)
    stop = threading.Event()
    results = []
    t = threading.Thread(target=exp.run, args=(stop,), kwargs={"interval": 0.02, "on_result": results.append})
    t.start()
    sid, total = new_sid(), 0
    try:
        for chunk in range(6):
            spool.append_many(events(sid, 200, start=total))
            total += 200
            if chunk == 1:
                server.stop()                 # ClickHouse goes away mid-stream
            if chunk == 3:
                deadline = time.monotonic() + 60
                while not any(r.error for r in results) and time.monotonic() < deadline:
                    time.sleep(0.02)          # the exporter has seen the outage
                server.start()                # and comes back
    finally:
        stop.set()
        t.join(60)
    res = exp.flush(timeout=60)
    assert res.ok and res.pending == 0
    assert any(r.error for r in results)      # the outage was reported, not hidden
    client, db = connect(url)
    assert final_count(client, db, sid) == (total, total)
    got = [e["event_id"] for e in AuditStore(url).events(sid)]
    assert got == [f"{sid}-{i}" for i in range(total)]
    client.disconnect()
    exp.close()
    spool.close()


_KILLED_EXPORTER = """
import sys, time
sys.path.insert(0, {root!r})
from exporters.spool import Spool
from exporters.clickhouse import ClickHouseExporter
exp = ClickHouseExporter(Spool({spool!r}, fsync="never"), {url!r})
while True:                      # deliver slowly, one small batch at a time
    b = exp.reader.read(25)
    if not b:
        break
    exp._send(b)
    print("sent", flush=True)
    time.sleep(0.05)
time.sleep(3600)
"""

_SPOOLER = """
import sys, time
sys.path.insert(0, {root!r})
from exporters.spool import Spool
s = Spool({spool!r})
s.append_many({recs!r})
print("spooled", flush=True)
time.sleep(3600)                 # about to send: never gets there
"""


def test_sigkilled_after_spooling_before_sending_delivers_on_next_start(clickhouse_url, clickhouse_client, tmp_path):
    client, db = clickhouse_client
    sid = new_sid()
    path = str(tmp_path / "sp")
    recs = events(sid, 300)
    p = subprocess.Popen([sys.executable, "-c", _SPOOLER.format(root=ROOT, spool=path, recs=recs)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "spooled"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert final_count(client, db, sid) == (0, 0)
    res = ClickHouseExporter(Spool(path), clickhouse_url).flush(timeout=60)   # "next start"
    assert res.ok and res.sent == 300
    assert final_count(client, db, sid) == (300, 300)


def test_exporter_sigkilled_mid_delivery_resumes_without_duplicates(clickhouse_url, clickhouse_client, tmp_path):
    client, db = clickhouse_client
    sid = new_sid()
    path = str(tmp_path / "sp")
    s = Spool(path, fsync="never", frames="record")    # small batches: read(25) (a batch frame is not split)
    s.append_many(events(sid, 1000))
    p = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORTER.format(root=ROOT, spool=path, url=clickhouse_url)],
                         stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert p.stdout.readline().strip() == "sent"
    finally:                                           # never left behind, also when the test fails
        p.send_signal(signal.SIGKILL)
        p.wait()
    sent_before = final_count(client, db, sid)[0]
    assert 75 <= sent_before < 1000
    res = ClickHouseExporter(s, clickhouse_url).flush(timeout=60)
    assert res.ok
    assert final_count(client, db, sid) == (1000, 1000)
    s.close()


def test_corrupt_segment_delivers_the_rest_and_records_the_gap(clickhouse_url, clickhouse_client, tmp_path):
    client, db = clickhouse_client
    sid = new_sid()
    evs = events(sid, 100)
    spool = Spool(str(tmp_path / "spool"), fsync="never", frames="record")   # bit rot in one record's frame
    spool.append_many(evs)
    seg = spool.seg_path(spool.segments()[-1])
    data = bytearray(open(seg, "rb").read())
    off = sum(len(encode_frame(e)) for e in evs[:50])
    data[off + HEADER_BYTES + 3] ^= 0x55                  # bit rot in record 50
    data += encode_frame(events(sid, 1, start=100)[0])[:30]   # and a torn tail
    open(seg, "wb").write(bytes(data))
    exp = ClickHouseExporter(spool, clickhouse_url)
    res = exp.flush(timeout=30)
    assert res.ok and res.sent == 99 and res.damaged == 2
    got = {e["event_id"] for e in AuditStore(clickhouse_url).events(sid)}
    assert got == {e["event_id"] for e in evs} - {f"{sid}-50"}
    gaps = client.execute(f"SELECT count, extra FROM {db}.events FINAL WHERE kind = 'events_lost' "
                          f"AND sandbox_id = '' AND extra LIKE %(p)s", {"p": f"%{spool.path}%"})
    assert len(gaps) == 2 and all(c >= 1 for c, _ in gaps)
    details = sorted(json.loads(x)["detail"] for _, x in gaps)
    assert any("CRC" in d for d in details) and any("torn" in d for d in details)
    assert os.path.getsize(os.path.join(spool.path, "damage.log")) > 0
    # re-sent (crash between insert and commit): the gap events are the same events
    spool.save_cursor("clickhouse", Position(spool.segments()[0], 0))
    assert exp.flush(timeout=30).damaged == 2
    n = client.execute(f"SELECT count() FROM {db}.events FINAL WHERE kind = 'events_lost' AND sandbox_id = '' "
                       f"AND extra LIKE %(p)s", {"p": f"%{spool.path}%"})[0][0]
    assert n == 2
    spool.append_many(events(sid, 1, start=101))
    assert exp.flush(timeout=30).sent == 1
    exp.close()
    spool.close()


def test_database_dropped_under_a_live_exporter_is_recreated(clickhouse_server, spool):
    client, _ = connect(clickhouse_server.url)
    db = f"{SESSION_DB}_d{uuid.uuid4().hex[:6]}"
    url = clickhouse_server.url_for(db)
    try:
        sid = new_sid()
        spool.append_many(events(sid, 10))
        exp = ClickHouseExporter(spool, url)
        assert exp.flush(timeout=30).sent == 10
        client.execute(f"DROP DATABASE {db}")
        spool.append_many(events(sid, 10, start=10))
        res = exp.flush(timeout=30)
        assert res.ok and res.sent == 10
        assert final_count(client, db, sid) == (10, 10)
        exp.close()
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
        client.disconnect()


def test_module_flush_for_short_lived_runs(clickhouse_url, clickhouse_client, spool):
    from exporters.clickhouse import flush
    client, db = clickhouse_client
    sid = new_sid()
    spool.append_many(events(sid, 3))
    res = flush(spool, clickhouse_url, timeout=30)
    assert res.ok and res.sent == 3 and "3 event(s) sent" in res.summary()


def _as_default_user(port: int) -> subprocess.CompletedProcess:
    """What any local process could do on main: clickhouse-client as `default`, no password."""
    return subprocess.run(["clickhouse-client", "--port", str(port), "-q", "SELECT count() FROM system.tables"],
                          capture_output=True, text=True, timeout=60)


def test_private_server_has_a_generated_password_and_no_default_user(clickhouse_server, tmp_path):
    """Issue 13 point 5: `clickhouse-client --port 19000` answered any local user
    (the `default` user had no password), who could delete audit rows."""
    s = clickhouse_server
    st = os.stat(s.password_file)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == 0
    assert os.stat(s.home).st_mode & 0o077 == 0
    assert os.stat(os.path.join(s.home, "users.xml")).st_mode & 0o077 == 0
    pw = s.password()
    assert len(pw) >= 32
    with open(os.path.join(s.home, "users.xml")) as f:
        users = f.read()
    assert pw not in users and "<default>" not in users.split("<users>")[1].split("</users>")[0]
    r = _as_default_user(s.tcp_port)
    assert r.returncode != 0 and ("default" in r.stderr or "password" in r.stderr.lower()), r.stderr
    r = subprocess.run(["clickhouse-client", "--port", str(s.tcp_port), "--user", "dsec", "--password", "wrong",
                        "-q", "SELECT 1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    client, _ = connect(s.url)                                   # dsec's own URL carries the credentials
    try:
        assert client.execute("SELECT 1") == [(1,)]
    finally:
        client.disconnect()
    # what dsec prints never shows the password
    out = run_dsec("clickhouse", "status", env={"DSEC_CLICKHOUSE_URL": ""})
    assert out.returncode == 0, out.stderr
    out.stdout = out.stdout.decode()
    assert pw not in out.stdout and "dsec:***@" in out.stdout and s.password_file in out.stdout
    assert "schema version" in out.stdout or "not created yet" in out.stdout


def _wait_count(url, sid, want, timeout=30):
    client, db = connect(url)
    n, deadline = 0, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                n = final_count(client, db, sid)[0]
            except Exception:   # the database may not exist before the first export
                n = 0
            if n == want:
                break
            time.sleep(0.2)
    finally:
        client.disconnect()
    return n


def test_agent_exporter_process_delivers_is_restarted_and_stops(clickhouse_url, tmp_path, caplog):
    """Issue 15: the agent's ClickHouse exporter runs in a child process of its own.
    It delivers what the agent spools (its counters become the agent's metrics), a
    child killed while the agent runs is restarted (counted, logged, nothing lost),
    and close() -- or the agent's end, its stdin -- stops it."""
    from agent.node.export import ExporterProcess
    from exporters.metrics import METRICS
    spool = Spool(str(tmp_path / "spool"), fsync="never")
    ex = ExporterProcess(spool, 0.1, url=clickhouse_url).start()
    sid = "xproc-" + uuid.uuid4().hex[:8]
    rows = lambda a, b: [{"event_id": f"{sid}-{i}", "ts_ns": time.time_ns(), "sandbox_id": sid,  # noqa: E731
                          "kind": "exec", "path": "/bin/true"} for i in range(a, b)]
    exported0 = METRICS.counter("dsec.events.exported", sink="clickhouse")
    restarts0 = METRICS.counter("dsec.exporter.restarts", sink="clickhouse")
    try:
        first = ex.pid
        assert first and os.getpid() != first
        with open(f"/proc/{first}/cmdline", "rb") as f:      # readable by anyone: no URL (password) there
            assert b"clickhouse://" not in f.read()
        spool.append_many(rows(0, 10))
        assert ex.wait_exported(ex.head(), 30)
        assert _wait_count(clickhouse_url, sid, 10) == 10
        deadline = time.monotonic() + 10
        while METRICS.counter("dsec.events.exported", sink="clickhouse") < exported0 + 10 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert METRICS.counter("dsec.events.exported", sink="clickhouse") == exported0 + 10
        assert ex.backlog() == 0
        os.kill(first, signal.SIGKILL)
        spool.append_many(rows(10, 25))
        deadline = time.monotonic() + 30
        while (ex.pid in (None, first)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.pid not in (None, first), "the killed exporter process was not restarted"
        assert ex.restarts == 1 and "exit status -9" in ex.last_crash
        assert METRICS.counter("dsec.exporter.restarts", sink="clickhouse") == restarts0 + 1
        assert any("exited unexpectedly" in r.getMessage() for r in caplog.records)
        assert ex.wait_exported(ex.head(), 30)
        assert _wait_count(clickhouse_url, sid, 25) == 25
        second = ex.pid
    finally:
        ex.close()
        spool.close()
    assert ex.pid is None and ex.restarts == 1
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    # the agent gone without close(): the child sees its stdin end, delivers and exits
    spool = Spool(str(tmp_path / "spool"), fsync="never")
    ex = ExporterProcess(spool, 30.0, url=clickhouse_url).start()
    try:
        spool.append_many(rows(25, 30))
        ex._stopping.set()                 # as if the agent died: nobody restarts it
        ex.proc.stdin.close()
        assert ex.proc.wait(timeout=30) == 0
        assert _wait_count(clickhouse_url, sid, 30) == 30
    finally:
        ex.close()
        spool.close()


def test_the_exporter_process_under_a_profiler_writes_its_stats_at_exit(clickhouse_url, tmp_path, monkeypatch):
    """DSEC_EXPORT_PROFILE=FILE (benchmarks): the child delivers as ever and, at
    its end, leaves its cProfile stats in FILE, the spool read among them."""
    import pstats
    from agent.node.export import ExporterProcess
    stats = tmp_path / "export.prof"
    monkeypatch.setenv("DSEC_EXPORT_PROFILE", str(stats))
    spool = Spool(str(tmp_path / "spool"), fsync="never")
    ex = ExporterProcess(spool, 0.1, url=clickhouse_url).start()
    sid = "xprof-" + uuid.uuid4().hex[:8]
    try:
        spool.append_many([{"event_id": f"{sid}-{i}", "ts_ns": time.time_ns(), "sandbox_id": sid, "kind": "exec",
                            "path": "/bin/true"} for i in range(40)])
        assert ex.wait_exported(ex.head(), 30)
    finally:
        ex.close()
        spool.close()
    assert _wait_count(clickhouse_url, sid, 40) == 40
    funcs = {f"{os.path.basename(k[0])}:{k[2]}" for k in pstats.Stats(str(stats)).stats}
    assert "spool.py:read" in funcs and "clickhouse.py:insert" in funcs


def test_agent_exporter_restarts_after_an_unexpected_error(clickhouse_url, tmp_path, caplog):
    """Issue 13 point 8: the agent's exporter thread died for good on an unexpected
    error, the spool then filled and dropped. Now it logs, counts and restarts."""
    from agent.node.export import ClickHouseExport
    from exporters.metrics import METRICS
    spool = Spool(str(tmp_path / "spool"), fsync="never")
    ex = ClickHouseExport(spool, 0.1)
    ex.exporter._url = clickhouse_url
    real, crashes = ex.exporter.flush, [3]

    def flaky(*a, **kw):
        if crashes[0] > 0:
            crashes[0] -= 1
            raise RuntimeError("unexpected (injected)")
        return real(*a, **kw)
    ex.exporter.flush = flaky
    before = sum(METRICS._counters.get("dsec.exporter.restarts", {}).values())
    sid = "restart-" + uuid.uuid4().hex[:8]
    spool.append_many([{"event_id": f"{sid}-{i}", "ts_ns": time.time_ns(), "sandbox_id": sid, "kind": "exec",
                        "path": "/bin/true"} for i in range(10)])
    ex.start()
    try:
        deadline = time.monotonic() + 30
        client, db = connect(clickhouse_url)
        n = 0
        while time.monotonic() < deadline:
            try:
                n = final_count(client, db, sid)[0]
            except Exception:   # the database may not exist before the first export
                n = 0
            if n == 10:
                break
            time.sleep(0.2)
        client.disconnect()
        assert n == 10
        assert ex.restarts == 3 and "injected" in ex.last_crash
        assert ex._thread.is_alive()
        assert sum(METRICS._counters.get("dsec.exporter.restarts", {}).values()) == before + 3
        assert sum(1 for r in caplog.records if "exporter failed unexpectedly" in r.getMessage()) == 3
    finally:
        ex.close()
        spool.close()


def test_the_low_cardinality_writer_puts_the_drivers_own_bytes_on_the_wire():
    """exporters/clickhouse.py's LowCardinality encoder (the dictionary built in
    C) writes exactly what clickhouse-driver's own does: one value, a few, more
    than 256 (UInt16 keys) and more than 65,536 (UInt32 keys), empty."""
    from exporters.clickhouse import _install_low_cardinality_writer, _wire_bytes, _write_low_cardinality
    _lowcard_bytes = lambda items, write: _wire_bytes(write, items)  # noqa: E731
    from clickhouse_driver.columns.lowcardinalitycolumn import LowCardinalityColumn
    _install_low_cardinality_writer()
    assert LowCardinalityColumn._write_data._dsec           # this driver: installed
    own = LowCardinalityColumn._write_data._driver_own
    cases = [[b"node-a"] * 50, [b"allowed", b"denied", b"", b"allowed", b"\xff\x00x"] * 30,
             [b"h%d" % (i % 300) for i in range(2000)], [b"v%d" % i for i in range(70_000)], []]
    for items in cases:
        want = _lowcard_bytes(items, own)
        assert _lowcard_bytes(items, _write_low_cardinality) == want
        assert _lowcard_bytes(items, LowCardinalityColumn._write_data) == want
    assert _lowcard_bytes(cases[2], own) != _lowcard_bytes(cases[1], own)


def test_a_driver_whose_low_cardinality_bytes_differ_keeps_its_own_writer(monkeypatch, caplog):
    """The driver is not pinned: one whose LowCardinality writer puts other bytes
    on the wire than dsec's (another version of the format) keeps its own, logged."""
    from clickhouse_driver.columns.lowcardinalitycolumn import LowCardinalityColumn as C
    from exporters import clickhouse as ch
    ch._install_low_cardinality_writer()
    drivers = C._write_data._driver_own

    def other_format(self, items, buf):
        buf.write(b"\x07")
        return drivers(self, items, buf)
    monkeypatch.setattr(C, "_write_data", other_format)
    monkeypatch.setattr(C, "_dsec_kept", False, raising=False)
    ch._install_low_cardinality_writer()
    assert C._write_data is other_format and C._dsec_kept
    assert any("kept as it is" in r.getMessage() for r in caplog.records)


def test_columns_of_few_distinct_values_arrive_byte_for_byte(clickhouse_url, clickhouse_client, spool):
    """String columns encoded once per distinct value (a LowCardinality column
    of 300 distinct values: UInt16 keys; a plain column of raw bytes, 1/8
    distinct; '' among them) and columns of one value throughout, read as a
    Repeat (raw bytes, an argv, 2**64-1, the default ''): every row, every byte."""
    from audit_schema.events import normalize
    from exporters.spool import Repeat
    client, db = clickhouse_client
    sid = new_sid()
    n = 2400
    raw = [b"/tmp/\xff\xfe%d" % k for k in range(n // 8 - 1)] + [b""]
    recs = [normalize({"event_id": f"{sid}-{i:05d}", "ts_ns": 1000 + i, "sandbox_id": sid, "kind": "open_write",
                       "path": from_bytes(raw[i % len(raw)]), "policy_hash": f"h{i % 300}",
                       "comm": from_bytes(b"\x80same"), "decision": ("allowed", "denied", "")[i % 3],
                       "argv": ["sh", from_bytes(b"\xff-c")], "count": 2**64 - 1})
            for i in range(n)]
    for i in range(0, n, 1000):
        spool.append_many(recs[i:i + 1000])
    exp = ClickHouseExporter(spool, clickhouse_url)
    b = exp.reader.read(10_000)
    assert {k for k, c in b.raw_columns.items() if c.__class__ is Repeat} >= {"comm", "argv", "count", "node"}
    exp.close()
    assert ClickHouseExporter(spool, clickhouse_url).flush(timeout=30).ok
    rows = client.execute(f"SELECT event_id, path, policy_hash, comm, decision, argv, count, node FROM {db}.events "
                          "FINAL WHERE sandbox_id = %(s)s ORDER BY event_id", {"s": sid},
                          settings={"strings_as_bytes": True})
    assert rows == [(f"{sid}-{i:05d}".encode(), raw[i % len(raw)], b"h%d" % (i % 300), b"\x80same",
                     (b"allowed", b"denied", b"")[i % 3], [b"sh", b"\xff-c"], 2**64 - 1, b"") for i in range(n)]
