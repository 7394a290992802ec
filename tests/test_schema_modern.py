"""The DDL and the query layer's SQL on a current ClickHouse (26.x, embedded
in-process by chdb), next to the 18.16 server the other tests use."""
from __future__ import annotations

import csv
import io

import pytest

from replay.store import count_sql, events_sql, sandbox_sql, sql_string
from audit_schema import migrations
from audit_schema.events import FIELD_NAMES, from_bytes

try:
    import chdb.session as chdb_session
except ImportError as e:  # no skip: the modern dialect must be checked
    raise ImportError("tests/test_schema_modern.py needs chdb (a test extra: pip install -e '.[test]')") from e


@pytest.fixture(scope="module")
def chdb(tmp_path_factory):
    s = chdb_session.Session(str(tmp_path_factory.mktemp("chdb")))
    yield s
    s.close()


def q(s, sql, fmt="CSV"):
    return s.query(sql, fmt).bytes().decode("utf-8")


def rows(s, sql):
    return list(csv.reader(io.StringIO(q(s, sql))))


def modern_features(s):
    version = rows(s, "SELECT version()")[0][0]
    settings = dict(rows(s, "SELECT name, value FROM system.settings WHERE name LIKE '%low_cardinality%'"))
    return migrations.features_for(version, settings)


def test_the_version_gate_matches_the_engine(chdb):
    feat = modern_features(chdb)
    assert migrations.parse_version(feat.version) >= (24,)
    assert not feat.lc_setting and feat.skip_indexes and feat.ddl_settings == {}
    # why the gate exists: the 18.16 setting is unknown here
    with pytest.raises(Exception, match="allow_experimental_low_cardinality_type"):
        chdb.query("SELECT 1 SETTINGS allow_experimental_low_cardinality_type = 1")
    old = migrations.features_for("18.16.1", {"allow_experimental_low_cardinality_type": "0"})
    assert old.lc_setting and not old.skip_indexes
    assert old.ddl_settings == {"allow_experimental_low_cardinality_type": 1}


def _row(eid, ts, sid, kind, path=b"", argv=(), **ints):
    vals = {n: "0" for n in FIELD_NAMES}
    for n in ("node", "comm", "policy_name", "policy_hash", "mode", "decision", "path_raw", "path2",
              "family", "addr", "sha256", "build_id", "interp", "shebang", "extra"):
        vals[n] = "''"
    vals.update(event_id=sql_string(eid), ts_ns=str(ts), sandbox_id=sql_string(sid), kind=sql_string(kind),
                path=sql_string(path), argv="[" + ", ".join(sql_string(a) for a in argv) + "]")
    for k, v in ints.items():
        vals[k] = str(v)
    return "(" + ", ".join(vals[n] for n in FIELD_NAMES) + ")"


@pytest.mark.parametrize("dialect", ["modern", "as-created-by-18.16"])
def test_ddl_and_replay_queries_on_a_current_engine(chdb, dialect):
    feat = modern_features(chdb) if dialect == "modern" else \
        migrations.features_for("18.16.1", {"allow_experimental_low_cardinality_type": "1"})
    db = "m_" + dialect.replace("-", "_").replace(".", "_")
    for _ in range(2):   # idempotent
        for sql in migrations.all_statements(db, feat):
            chdb.query(sql)
    ddl = rows(chdb, f"SELECT create_table_query FROM system.tables WHERE database = '{db}' AND name = 'events'")[0][0]
    assert "ReplacingMergeTree" in ddl and "ORDER BY (kind, sandbox_id, ts_ns, event_id)" in ddl
    assert "`node` LowCardinality(String)" in ddl
    assert ("bloom_filter" in ddl) == feat.skip_indexes
    cols = dict(rows(chdb, f"SELECT name, type FROM system.columns WHERE database = '{db}' AND table = 'events'"))
    assert set(FIELD_NAMES) <= set(cols)

    weird = b"/tmp/\xff\xfe\n'\\x"
    values = [
        _row("s1", 1000, "sb-1", "sandbox_start", argv=[b"sh", b"-c", b"x"]),
        _row("e1", 2000, "sb-1", "exec", path=weird, argv=[weird, b"\x00\x80"], pid=7),
        _row("c1", 3000, "sb-1", "connect", pid=7, port=443),
        _row("w1", 2000, "sb-1", "open_write", path=b"/etc/passwd", pid=7),
        _row("l1", 3500, "sb-1", "events_lost", count=4),
        _row("x1", 4000, "sb-1", "sandbox_exit", exit_code=2),
        _row("o1", 1500, "sb-2", "exec", path=b"/bin/true"),
    ]
    insert = f"INSERT INTO {db}.events ({', '.join(FIELD_NAMES)}) VALUES "
    chdb.query(insert + ", ".join(values))
    chdb.query(insert + ", ".join(values[1:3]))     # the exporter re-sent a batch

    got = rows(chdb, events_sql(db, "sb-1", columns=["event_id", "ts_ns", "kind"]))
    assert [r[0] for r in got] == ["s1", "e1", "w1", "c1", "l1", "x1"]   # once each, (ts, event_id) order
    got = rows(chdb, events_sql(db, "sb-1", ["exec", "connect"], since_ns=1500, until_ns=3100,
                                columns=["event_id"], limit=10))
    assert [r[0] for r in got] == ["e1", "c1"]
    h = rows(chdb, f"SELECT hex(path), arrayMap(x -> hex(x), argv) FROM ({events_sql(db, 'sb-1', ['exec'])})")
    assert h[0][0] == weird.hex().upper() and weird.hex().upper() in h[0][1] and "0080" in h[0][1]
    n = rows(chdb, f"SELECT count() FROM {db}.events FINAL WHERE path = {sql_string(from_bytes(weird))}")
    assert n == [["1"]]
    assert rows(chdb, count_sql(db, "sb-1")) == [["6"]]
    sb = rows(chdb, sandbox_sql(db, "sb-1"))
    assert len(sb) == 1
    sid, node, started, ended, code, sig, argv, pol, mode, lost, exited = sb[0]
    assert (sid, started, ended, code, lost, exited) == ("sb-1", "1000", "4000", "2", "4", "1")
    assert argv == "['sh','-c','x']"
    assert [r[0] for r in rows(chdb, sandbox_sql(db, limit=5))] == ["sb-1"]
    # the brief's audit questions run as written in docs/storage.md
    assert rows(chdb, f"SELECT DISTINCT sandbox_id FROM {db}.events FINAL WHERE kind = 'open_write' "
                      "AND startsWith(path, '/etc/')") == [["sb-1"]]
    assert rows(chdb, f"SELECT sandbox_id FROM {db}.events FINAL WHERE kind = 'exec' AND path = '/bin/true'") \
        == [["sb-2"]]
