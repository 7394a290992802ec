"""Cluster mode on a current ClickHouse (26.x in-process through chdb, configured
with a one-shard cluster of itself), the placement ranking, and the agent
config's cluster and host sections. The 18.16 side, two real shards with
ZooKeeper, is tests/test_cluster.py."""
from __future__ import annotations

import csv
import io

import pytest

from audit_schema import migrations
from audit_schema.events import FIELD_NAMES
from agent.node.cluster.placement import ImageCached, NodeView, Request, SnapshotLocal, WarmProfile, rank
from replay.queries import execs_sql, sandbox_events_sql
from replay.store import count_sql, events_sql, sandbox_sql, sql_string

try:
    import chdb.session as chdb_session
except ImportError as e:  # no skip: the modern dialect must be checked
    raise ImportError("tests/test_cluster_schema.py needs chdb (a test extra: pip install -e '.[test]')") from e

CONFIG = """<clickhouse>
  <tcp_port>9000</tcp_port>
  <remote_servers><one><shard><replica><host>localhost</host><port>9000</port></replica></shard></one></remote_servers>
</clickhouse>
"""


@pytest.fixture(scope="module")
def chdb(tmp_path_factory):
    d = tmp_path_factory.mktemp("chdb-cluster")
    (d / "config.xml").write_text(CONFIG)
    s = chdb_session.Session(f"{d}/db?config-file={d}/config.xml")
    yield s
    s.close()


def rows(s, sql):
    return list(csv.reader(io.StringIO(s.query(sql, "CSV").bytes().decode())))


def test_cluster_ddl_and_the_readers_queries_on_a_current_engine(chdb):
    assert rows(chdb, "SELECT is_local FROM system.clusters WHERE cluster = 'one'") == [["1"]]
    version = rows(chdb, "SELECT version()")[0][0]
    feat = migrations.features_for(version, dict(rows(
        chdb, "SELECT name, value FROM system.settings WHERE name LIKE '%low_cardinality%'")))
    on = migrations.all_statements("cdb", feat, migrations.Target("one", "on_cluster"))
    each = migrations.all_statements("cdb", feat, migrations.Target("one", "each_host"))
    assert all(" ON CLUSTER one" in s for s in on if "schema_migrations" not in s)
    assert len(on) == len(each) and not any("ON CLUSTER" in s for s in each)
    for sql in on:      # the modern parser takes every ON CLUSTER statement (running them needs Keeper)
        assert rows(chdb, f"SELECT formatQuery({sql_string(sql)})")
    for sql in each:    # and runs the same statements host by host
        chdb.query(sql)
    engines = dict(rows(chdb, "SELECT name, engine FROM system.tables WHERE database = 'cdb'"))
    assert engines["events"] == "Distributed" and engines["events_local"] == "ReplacingMergeTree"
    # rows through the Distributed table (synchronously), read back by every reader's SQL
    vals = []
    for ts, eid, kind in [(1000, "e1", "sandbox_start"), (1001, "e2", "exec"), (1001, "e2", "exec"),
                          (1003, "e3", "sandbox_exit")]:
        v = {n: "0" for n in FIELD_NAMES}
        for n in ("node", "comm", "policy_name", "policy_hash", "mode", "decision", "path_raw", "path2", "family",
                  "addr", "sha256", "build_id", "interp", "shebang", "extra", "path", "syscall", "protocol"):
            if n in v:
                v[n] = "''"
        v.update(event_id=sql_string(eid), ts_ns=str(ts), sandbox_id="'s1'", kind=sql_string(kind),
                 argv="['sh']", path="'/workspace/needle'" if kind == "exec" else "''")
        vals.append("(" + ", ".join(v[n] for n in FIELD_NAMES) + ")")
    chdb.query(f"INSERT INTO cdb.events ({', '.join(FIELD_NAMES)}) SETTINGS insert_distributed_sync = 1 "
               f"VALUES {', '.join(vals)}")
    assert rows(chdb, count_sql("cdb", "s1")) == [["3"]]                     # the re-sent copy collapses
    assert [r[0] for r in rows(chdb, events_sql("cdb", "s1", columns=["event_id"]))] == ["e1", "e2", "e3"]
    assert rows(chdb, sandbox_sql("cdb", "s1"))[0][0] == "s1"
    assert len(rows(chdb, sandbox_events_sql("cdb", "s1"))) == 3
    hits = rows(chdb, execs_sql("cdb", path="needle"))
    assert [h[0] for h in hits] == ["s1"]
    # the setting a Distributed insert uses is still known (an alias of distributed_foreground_insert)
    assert rows(chdb, "SELECT alias_for FROM system.settings WHERE name = 'insert_distributed_sync'") == \
        [["distributed_foreground_insert"]]


def _view(name, alive=True, warm=None, images=(), snapshots=(), sandboxes=0):
    return NodeView(name, None, {"ray_node_id": name, "agent": {"alive": alive, "reason": "" if alive else "down"},
                                 "warm": warm or {}, "images": list(images), "snapshots": list(snapshots),
                                 "sandboxes": sandboxes, "resources": {"dsec_cpu": 8}})


def test_the_preferences_rank_live_nodes_and_spread_otherwise():
    a, b, c = _view("a", sandboxes=3), _view("b", warm={"py": 1}, sandboxes=5), _view("c", alive=False, warm={"py": 4})
    assert [v.name for _, v, _ in rank(Request(), [a, b, c])] == ["a", "b"]          # least loaded; c is down
    ranked = rank(Request(profile="py"), [a, b, c])
    assert [(v.name, why) for _, v, why in ranked] == [("b", ["warm"]), ("a", [])]
    assert rank(Request(profile="py"), [a, _view("b", warm={"py": 0}, sandboxes=5)])[0][1].name == "a"
    img = _view("i", images=[{"digest": "sha256:ab"}], sandboxes=9)
    snap = _view("s", snapshots=["snap-1"], sandboxes=9)
    assert rank(Request(image="sha256:ab"), [a, img])[0][1].name == "i"
    r = rank(Request(profile="py", snapshot="snap-1"), [b, snap])
    assert [v.name for _, v, _ in r] == ["s", "b"]                  # snapshot local outweighs a warm sandbox
    assert SnapshotLocal.weight > WarmProfile.weight > ImageCached.weight


def test_the_cluster_and_host_config_sections(tmp_path):
    from agent.node.config import ConfigError, load_config
    p = tmp_path / "agent.yaml"
    p.write_text("clickhouse:\n  cluster: two\n  insert: distributed\nhost:\n  node_name: n1\n"
                 "  cgroup_parent: dsec-n1\n  egress_pool: 10.240.0.0/16\n")
    cfg = load_config(str(p), environ={})
    assert (cfg.clickhouse.cluster, cfg.clickhouse.insert, cfg.host.egress_pool) == ("two", "distributed",
                                                                                     "10.240.0.0/16")
    for bad, msg in (("clickhouse:\n  insert: everywhere\n", "agent.yaml:2: clickhouse.insert"),
                     ("host:\n  cgroup_parent: a/b\n", "agent.yaml:2: host.cgroup_parent"),
                     ("host:\n  egress_pool: 10.0.0.0/31\n", "at least a /30"),
                     ("clickhouse:\n  url: http://x\n", "clickhouse.url"),
                     ("clickhouse:\n  cluster: 'a b'\n", "clickhouse.cluster")):
        p.write_text(bad)
        with pytest.raises(ConfigError, match=msg.replace("/", ".")):
            load_config(str(p), environ={})
    p.write_text("sinks:\n  clickhouse: {url: 'clickhouse://u@h:9000/d'}\n")
    assert load_config(str(p), environ={}).clickhouse_url == "clickhouse://u@h:9000/d"
