"""Scale-out (docs/cluster.md), with real parts on this one machine: a local Ray
cluster of two simulated nodes, a `dsec agent` per node (own state dir, socket,
cgroup parent, egress pool, node name), and two ClickHouse 18.16 servers on
loopback as the two shards of one cluster (ZooKeeper for ON CLUSTER). One
module fixture builds it all once (tests/fixtures_cluster.py); the tests that
kill an agent and a raylet come last and leave the agent running again."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import dsec
from fixtures_cluster import (CLUSTER, TwoShards, ZooKeeper, add_ray_node, agent_config, cgroups_under, host_gc,
                              ray_cluster)
from audit_schema import migrations
from audit_schema.errors import ReportedError
from agent.node.cluster import ClusterClient, SandboxLost, register_node
from agent.node.cluster.node import LABEL_NODE, node_resources
from agent.node.config import load_config

ENDED = ("exited", "killed", "preempted", "failed", "cancelled")


class Cluster:
    pass


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    import ray
    from test_agent import AgentProc
    base = str(tmp_path_factory.mktemp("cluster"))
    c = Cluster()
    c.zk = ZooKeeper(os.path.join(base, "zk"))
    c.shards = TwoShards(base, c.zk)
    try:
        c.zk.start()
        c.shards.start()
    except BaseException:
        c.shards.stop()
        c.zk.stop()
        raise
    c.cfg = {"node-a": agent_config(os.path.join(base, "a"), "node-a", c.shards, 0, "local", "10.231.0.0/16"),
             "node-b": agent_config(os.path.join(base, "b"), "node-b", c.shards, 1, "distributed", "10.232.0.0/16",
                                    warm=[{"name": "py", "count": 2, "memory": "64M", "pids": 256}])}
    for n in c.cfg:
        os.makedirs(os.path.join(base, n[-1]), exist_ok=True)
    c.agents = {n: AgentProc(os.path.join(base, n[-1]), c.shards.url(i), c.cfg[n], name="agent")
                for i, n in enumerate(c.cfg)}
    box = {}
    ray_tmp = tempfile.mkdtemp(prefix="dsec-ray-")     # Ray's session dir, removed at the end

    def start_agents():         # in parallel with Ray's start (which must run in the main thread)
        try:
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda a: a.start(), c.agents.values()))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
    t = threading.Thread(target=start_agents)
    t.start()
    try:
        try:
            c.ray = box["cluster"] = ray_cluster(ray_tmp)
        finally:
            t.join()
        if "error" in box:
            raise box["error"]
        c.acfg = {n: load_config(a.config) for n, a in c.agents.items()}
        c.rnodes = {n: add_ray_node(c.ray, node_resources(c.acfg[n])) for n in c.agents}
        ray.init(address=c.ray.address, namespace="dsec", log_to_driver=False, _node_ip_address="127.0.0.1")
        for n, a in c.agents.items():
            register_node(c.acfg[n], config_path=a.config, address=None, ray_node_id=c.rnodes[n].node_id)
        c.lost_calls = []
        c.cc = ClusterClient(None, default_cpus=0.1, default_memory="64M",
                             on_lost=lambda h, why: c.lost_calls.append((h.id, why)))
        yield c
    finally:
        try:
            if getattr(c, "cc", None):
                for h in c.cc.sandboxes():
                    try:
                        h.close()
                    except Exception:  # noqa: BLE001
                        pass
                c.cc.close()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if box.get("cluster"):
                box["cluster"].shutdown()
            for a in c.agents.values():
                a.stop()
            for n, cfg in c.cfg.items():
                host_gc(cfg)
            c.shards.stop()
            c.zk.stop()
            shutil.rmtree(ray_tmp, ignore_errors=True)
            os.environ.pop("RAY_TMPDIR", None)
    left = {n: cgroups_under(cfg["host"]["cgroup_parent"]) for n, cfg in c.cfg.items()}
    assert not any(left.values()), f"the cluster's agents left cgroups behind: {left}"


def _sandbox_events(cl, sid, want, timeout=30.0):
    """Rows of `sid` from the Distributed table (shard 0's server), once want(rows) holds."""
    from replay.store import AuditStore
    deadline = time.monotonic() + timeout
    evs = []
    while time.monotonic() < deadline:
        with AuditStore(cl.shards.url(0)) as st:
            evs = list(st.events(sid))
        if want(evs):
            return evs
        time.sleep(0.3)
    return evs


def _lost_records(cl, sids, timeout=30.0) -> dict:
    client = cl.shards.client(0)
    deadline = time.monotonic() + timeout
    found = {}
    try:
        while time.monotonic() < deadline:
            rows = client.execute(
                f"SELECT sandbox_id, extra FROM {cl.shards.db}.events FINAL WHERE kind = 'lifecycle' "
                f"AND sandbox_id IN %(s)s", {"s": tuple(sids)})
            found = {sid: json.loads(extra) for sid, extra in rows if json.loads(extra).get("state") == "lost"}
            if set(found) >= set(sids):
                return found
            time.sleep(0.3)
    finally:
        client.disconnect()
    return found


# ---------------------------------------------------------------- the schema on two shards

def test_on_cluster_ddl_made_the_local_tables_and_the_distributed_table_on_both_shards(cl):
    db = cl.shards.db
    for i in (0, 1):
        client = cl.shards.client(i)
        try:
            eng = dict(client.execute("SELECT name, engine_full FROM system.tables WHERE database = %(d)s",
                                      {"d": db}))
            assert eng["events_local"].startswith("ReplacingMergeTree")
            assert eng["events"] == f"Distributed({CLUSTER}, {db}, events_local, cityHash64(sandbox_id))"
            assert "sandboxes" in eng
            cols = migrations.table_columns(client, db, "events_local")
            # distributed DDL runs with the servers' settings: plain String on 18.16
            assert cols["node"] == "String" and cols["kind"] == "String"
            assert migrations.table_columns(client, db, "events") .keys() >= cols.keys() - {"ts"}
        finally:
            client.disconnect()
    client = cl.shards.client(0)
    try:       # a second migration changes nothing and says how it ran
        r = migrations.migrate(client, db, CLUSTER)
        assert (r.applied, r.added_columns, r.cluster, r.ddl) == ([], [], CLUSTER, "on_cluster")
        assert [h[3] for h in r.hosts] == [True, False]
        assert migrations.migrate(client, db).cluster == CLUSTER       # found in the database itself
    finally:
        client.disconnect()


def test_host_by_host_ddl_and_clear_refusals(cl):
    c0 = cl.shards.client(0)
    db2, db3 = cl.shards.db + "_each", cl.shards.db + "_single"
    try:
        r = migrations.migrate(c0, db2, CLUSTER, ddl="each_host")
        assert r.ddl == "each_host" and r.applied == [v for v, _, _ in migrations.MIGRATIONS]
        c1 = cl.shards.client(1)
        try:
            assert migrations.cluster_of(c1, db2) == CLUSTER          # made on the other host too
            # host by host the session setting reaches 18.16: LowCardinality as on one server
            assert migrations.table_columns(c1, db2, "events_local")["node"] == "LowCardinality(String)"
        finally:
            c1.disconnect()
        migrations.migrate(c0, db3)
        with pytest.raises(ReportedError, match="single-server events table"):
            migrations.migrate(c0, db3, CLUSTER)
        with pytest.raises(ReportedError, match="'nope' is not defined"):
            migrations.migrate(c0, db3 + "x", "nope")
    finally:
        c0.execute(f"DROP DATABASE IF EXISTS {db2} ON CLUSTER {CLUSTER}")
        c0.execute(f"DROP DATABASE IF EXISTS {db3}")
        c0.disconnect()


# ---------------------------------------------------------------- placement

def test_forty_sandboxes_are_placed_on_both_nodes(cl):
    def one(i):
        sb = cl.cc.create(labels={"case": "forty", "i": str(i)}, warm=False)
        r = sb.exec(["sh", "-c", "uname -n"])
        assert r.code == 0 and r.stdout.decode().strip() == sb.id
        return sb

    with ThreadPoolExecutor(8) as ex:
        sbs = list(ex.map(one, range(40)))
    try:
        where = {}
        for sb in sbs:
            where.setdefault(sb.node, set()).add(sb.id)
        assert set(where) == {"node-a", "node-b"}, {n: len(s) for n, s in where.items()}
        for name, agent in cl.agents.items():       # each node's agent holds exactly the ones placed there
            with agent.client() as c:
                held = {i.sandbox_id for i in c.list(labels={LABEL_NODE: name, "case": "forty"},
                                                     states=["running"])}
            assert held == where[name]
    finally:
        with ThreadPoolExecutor(8) as ex:
            infos = list(ex.map(lambda sb: sb.close(), sbs))
    assert all(i.state == "exited" for i in infos)


def test_a_warm_sandbox_of_the_profile_is_preferred(cl):
    deadline = time.monotonic() + 30
    while cl.cc.nodes(refresh=True) and time.monotonic() < deadline:
        if {v.name: v.warm.get("py", 0) for v in cl.cc.nodes(refresh=True)}.get("node-b", 0) >= 2:
            break
        time.sleep(0.3)
    sbs = [cl.cc.create(profile="py") for _ in range(2)]
    try:
        assert [(sb.node, sb.created.warm, sb.created.warm_profile) for sb in sbs] == [("node-b", True, "py")] * 2
    finally:
        for sb in sbs:
            sb.close()


def test_dsec_cluster_status_and_resources(cl):
    r = dsec("cluster", "status", "--address", cl.ray.address, "--format", "json", timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    nodes = {n["node"]: n for n in json.loads(r.stdout)}
    assert set(nodes) == {"node-a", "node-b"} and all(n["alive"] for n in nodes.values())
    assert nodes["node-b"]["state"]["warm_specs"]["py"]["memory"] == 64 << 20
    r = dsec("cluster", "resources", "--config", cl.agents["node-a"].config)
    assert json.loads(r.stdout) == node_resources(cl.acfg["node-a"])
    assert json.loads(r.stdout)["dsec_cpu"] == 32.0          # 8 CPUs x oversubscription 4
    r = dsec("cluster", "resources", "--config", "/nonexistent/agent.yaml")
    assert r.returncode == 2 and r.stderr.decode().strip().splitlines() == [
        "dsec cluster: error: /nonexistent/agent.yaml: cannot read: No such file or directory"], r.stderr


def test_a_ray_task_uses_the_handle(cl):
    import ray

    @ray.remote(num_cpus=0)
    def task(sb, close):
        r = sb.exec(["sh", "-c", "echo from-task $(uname -n)"])
        out = (r.code, r.stdout.decode().strip())
        if close:
            return out, sb.close().state
        return out, None

    a, b = cl.cc.create(), cl.cc.create()
    try:
        res = ray.get([task.remote(a, False), task.remote(b, True)], timeout=120)
        assert res[0] == ((0, f"from-task {a.id}"), None)
        assert res[1] == ((0, f"from-task {b.id}"), "exited")
        assert a.exec(["true"]).code == 0           # still open: the task only used it
    finally:
        a.close()
        b.close()          # closed by the task already: ends quietly here (NotFound is fine too)


# ---------------------------------------------------------------- the record across shards

def test_replay_and_events_read_the_distributed_table(cl):
    sbs = []
    while {sb.node for sb in sbs} != {"node-a", "node-b"} and len(sbs) < 8:
        sbs.append(cl.cc.create())
    mark = uuid.uuid4().hex[:8]
    for sb in sbs:
        assert sb.exec(["sh", "-c", f"echo replay-{mark} > note; cat note"]).code == 0
        sb.close()
    by_node = {sb.node: sb for sb in reversed(sbs)}
    env = {"DSEC_AGENT": "off"}
    for node, sb in by_node.items():
        evs = _sandbox_events(cl, sb.id, lambda e: any(x["kind"] == "sandbox_exit" for x in e))
        assert any(e["kind"] == "exec" for e in evs), (node, [e["kind"] for e in evs])
        # read through the shard the sandbox's node does NOT write to: the Distributed table has it
        other = 1 if node == "node-a" else 0
        r = dsec("replay", sb.id, env=dict(env, DSEC_CLICKHOUSE_URL=cl.shards.url(other)))
        assert r.returncode == 0, r.stderr.decode()
        assert f"replay-{mark}".encode() in r.stdout
        r = dsec("events", "--sandbox", sb.id, "--kind", "exec", "--format", "json",
                 env=dict(env, DSEC_CLICKHOUSE_URL=cl.shards.url(other)))
        assert r.returncode == 0, r.stderr.decode()
        assert {json.loads(line)["kind"] for line in r.stdout.decode().splitlines()} == {"exec"}
    # one sandbox's record lives on one shard; node-a inserts into its own (shard 1)
    counts = {}
    for i in (0, 1):
        client = cl.shards.client(i)
        try:
            for node, sb in by_node.items():
                counts[(node, i)] = client.execute(
                    f"SELECT count() FROM {cl.shards.db}.events_local WHERE sandbox_id = %(s)s", {"s": sb.id})[0][0]
        finally:
            client.disconnect()
    assert counts[("node-a", 0)] > 0 and counts[("node-a", 1)] == 0, counts
    assert (counts[("node-b", 0)] > 0) != (counts[("node-b", 1)] > 0), counts


def test_search_finds_an_exec_across_both_shards(cl):
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    placed = {}
    tries = 0
    while len(placed) < 2 and tries < 8:
        tries += 1
        sb = cl.cc.create()
        if sb.node in placed:
            sb.close()
            continue
        r = sb.exec(["sh", "-c", f"printf '#!/bin/sh\\necho ok\\n' > {probe}; chmod +x {probe}; ./{probe}"])
        assert r.stdout == b"ok\n", r
        sb.close()
        placed[sb.node] = sb.id
    assert set(placed) == {"node-a", "node-b"}
    for sid in placed.values():
        _sandbox_events(cl, sid, lambda e: any(x["kind"] == "sandbox_exit" for x in e))
    shards_of = {}
    for i in (0, 1):
        client = cl.shards.client(i)
        try:
            for node, sid in placed.items():
                if client.execute(f"SELECT count() FROM {cl.shards.db}.events_local WHERE sandbox_id = %(s)s",
                                  {"s": sid})[0][0]:
                    shards_of.setdefault(i, []).append(node)
        finally:
            client.disconnect()
    r = dsec("search", "exec", "--path", probe, "--format", "json",
             env={"DSEC_AGENT": "off", "DSEC_CLICKHOUSE_URL": cl.shards.url(0)})
    assert r.returncode == 0, r.stderr.decode()
    hits = {json.loads(line)["sandbox_id"] for line in r.stdout.decode().splitlines() if line.strip()}
    assert hits == set(placed.values())
    if len(shards_of) == 2:      # the two records are on different shards (node-b's by hash of its id)
        assert sorted(n for v in shards_of.values() for n in v) == ["node-a", "node-b"]


# ---------------------------------------------------------------- node loss (last: they kill things)

def _wait_lost(cl, handles, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(h.lost for h in handles):
        cl.cc.check()
        time.sleep(0.2)
    return [h.lost for h in handles]


def test_an_agent_dies_its_sandboxes_are_lost_and_new_ones_go_to_the_other_node(cl):
    sbs = []
    while len([s for s in sbs if s.node == "node-a"]) < 2 and len(sbs) < 10:
        sbs.append(cl.cc.create())
    on_a = [s for s in sbs if s.node == "node-a"]
    on_b = [s for s in sbs if s.node == "node-b"]
    assert len(on_a) >= 2 and on_b
    t0 = time.monotonic()
    cl.agents["node-a"].kill9()
    reasons = _wait_lost(cl, on_a)
    detect_s = time.monotonic() - t0
    assert all(r and "dsec agent" in r and "node-a" in r for r in reasons), reasons
    assert detect_s < 10, detect_s
    with pytest.raises(SandboxLost, match="node-a"):
        on_a[0].exec(["true"])
    assert {sid for sid, _ in cl.lost_calls} >= {s.id for s in on_a}
    assert not any(s.lost for s in on_b)
    assert on_b[0].exec(["true"]).code == 0
    # the record says so (written by node-a's actor through its own spool)
    recs = _lost_records(cl, [s.id for s in on_a])
    assert set(recs) == {s.id for s in on_a}
    assert all(r["cause"] == "agent" and r["node"] == "node-a" and "dsec agent" in r["reason"] for r in recs.values())
    # new requests go to the live node
    new = [cl.cc.create() for _ in range(4)]
    try:
        assert {s.node for s in new} == {"node-b"}
    finally:
        for s in new + on_b:
            s.close()
        for s in on_a:
            assert s.close() is None
    # the agent comes back: node-a takes sandboxes again
    cl.agents["node-a"].start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(v.alive for v in cl.cc.nodes(refresh=True)):
            break
        time.sleep(0.3)
    assert {v.name for v in cl.cc.nodes(refresh=True) if v.alive} == {"node-a", "node-b"}


def test_a_raylet_dies_its_sandboxes_are_lost_and_a_new_registration_stops_them(cl):
    import ray
    sbs = []
    while not any(s.node == "node-a" for s in sbs) and len(sbs) < 10:
        sbs.append(cl.cc.create())
    on_a = [s for s in sbs if s.node == "node-a"]
    assert on_a
    cl.ray.remove_node(cl.rnodes["node-a"], allow_graceful=False)      # kills node-a's raylet (and its actor)
    reasons = _wait_lost(cl, on_a, timeout=30)
    assert all(r and ("raylet" in r or "node actor" in r) for r in reasons), reasons
    recs = _lost_records(cl, [s.id for s in on_a])       # recorded through node-b's actor
    assert set(recs) == {s.id for s in on_a} and all("node-b" in r["reported_by"] for r in recs.values())
    new = [cl.cc.create() for _ in range(3)]
    try:
        assert {s.node for s in new} == {"node-b"}
    finally:
        for s in new + [s for s in sbs if s.node == "node-b"]:
            s.close()
    # the agent never died: its sandboxes ran on; a new registration of the node stops them
    with cl.agents["node-a"].client() as c:
        assert all(c.get(s.id).state == "running" for s in on_a)
    cl.rnodes["node-a"] = add_ray_node(cl.ray, node_resources(cl.acfg["node-a"]))
    st = register_node(cl.acfg["node-a"], config_path=cl.agents["node-a"].config, address=None,
                       ray_node_id=cl.rnodes["node-a"].node_id)
    assert st["reconciled"] == len(on_a) and st["agent"]["alive"]
    with cl.agents["node-a"].client() as c:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(c.get(s.id).state in ENDED for s in on_a):
            time.sleep(0.2)
        infos = [c.get(s.id) for s in on_a]
    assert all(i.state == "killed" and "cluster registration" in i.reason for i in infos), infos
    assert ray.get(ray.get_actor("node:node-a", namespace="dsec").state.remote())["agent"]["alive"]
