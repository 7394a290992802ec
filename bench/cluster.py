"""Scale-out costs, each against its baseline measured in the same run (docs/cluster.md).

    .venv/bin/python bench/cluster.py [--sandboxes 40] [--concurrency 8] [--rows 400000] [--runs 7]

Builds tests/test_cluster.py's two-node cluster (ZooKeeper, two ClickHouse
18.16 shards, two `dsec agent`s with their own host settings, a local Ray
cluster with a node per agent, each agent registered), then:

1. placements: N sandboxes (create, exec /bin/true, close) at concurrency C,
   through ClusterClient (Ray placement group + the node actor + the agent)
   against the node SDK straight to the agents' sockets (round-robin over the
   two nodes): sandboxes/s, and the median create latency, as ratios.
2. search: `dsec search exec --path NAME`'s query (replay/queries.py) over
   R synthetic exec events (2000 sandboxes), read through the Distributed
   table (two shards, sharded by sandbox id) against the same rows in one
   server's table (single-server schema) and against one shard's local half:
   median of `--runs` runs each, as ratios.
Everything it starts is stopped and removed at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from _common import ROOT, entry, ratio, table

sys.path.insert(0, os.path.join(ROOT, "tests"))     # the cluster fixtures
sys.path.insert(0, ROOT)         # before bench/ itself: bench/replay.py is not the replay package


def _build(base: str, st: dict):
    """Start everything, recording each part in `st` as it starts (teardown stops what exists)."""
    from fixtures_cluster import TwoShards, ZooKeeper, add_ray_node, agent_config, ray_cluster  # before ray
    import ray
    from test_agent import AgentProc
    from agent.node.cluster import register_node
    from agent.node.cluster.node import node_resources
    from agent.node.config import load_config
    st["zk"] = ZooKeeper(os.path.join(base, "zk"))
    st["shards"] = TwoShards(base, st["zk"])
    st["zk"].start()
    st["shards"].start()
    cfg = {"node-a": agent_config(os.path.join(base, "a"), "node-a", st["shards"], 0, "local", "10.233.0.0/16"),
           "node-b": agent_config(os.path.join(base, "b"), "node-b", st["shards"], 1, "local", "10.234.0.0/16")}
    for n in cfg:
        os.makedirs(os.path.join(base, n[-1]), exist_ok=True)
        cfg[n]["scheduling"]["max_parallel_starts"] = 8
    st["cfg"] = cfg
    st["agents"] = {n: AgentProc(os.path.join(base, n[-1]), st["shards"].url(i), cfg[n], name="agent")
                    for i, n in enumerate(cfg)}
    err = {}

    def agents():
        try:
            for a in st["agents"].values():
                a.start()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err["e"] = e
    t = threading.Thread(target=agents)
    t.start()
    try:
        st["ray"] = ray_cluster(os.path.join(base, "ray"))
    finally:
        t.join()
    if err:
        raise err["e"]
    acfg = {n: load_config(a.config) for n, a in st["agents"].items()}
    nodes = {n: add_ray_node(st["ray"], node_resources(acfg[n])) for n in acfg}
    ray.init(address=st["ray"].address, namespace="dsec", log_to_driver=False, _node_ip_address="127.0.0.1")
    for n, a in st["agents"].items():
        register_node(acfg[n], config_path=a.config, address=None, ray_node_id=nodes[n].node_id)


def _teardown(st):
    from fixtures_cluster import host_gc
    import ray
    if ray.is_initialized():
        ray.shutdown()
    if st.get("ray"):
        st["ray"].shutdown()
    for a in st.get("agents", {}).values():
        a.stop()
    for cfg in st.get("cfg", {}).values():
        host_gc(cfg)
    if st.get("shards"):
        st["shards"].stop()
    if st.get("zk"):
        st["zk"].stop()


def _placements(st, n: int, conc: int) -> list[list]:
    from agent.node.client import Client
    from agent.node.cluster import ClusterClient
    socks = [a.socket for a in st["agents"].values()]
    clients = [Client(s) for s in socks]
    cc = ClusterClient(None, default_cpus=0.1, default_memory="64M")

    def direct(i):
        t = time.perf_counter()
        sb = clients[i % 2].create(cpus=0.1, memory="64M", warm=False)
        dt = time.perf_counter() - t
        sb.exec(["/bin/true"])
        sb.close()
        return dt

    def via_ray(i):
        t = time.perf_counter()
        sb = cc.create(warm=False)
        dt = time.perf_counter() - t
        sb.exec(["/bin/true"])
        sb.close()
        return dt

    rows = {}
    for name, fn in (("node SDK, straight to the agents", direct), ("ClusterClient (Ray)", via_ray),
                     ("node SDK (again)", direct)):
        list(ThreadPoolExecutor(conc).map(fn, range(min(conc, n))))      # warm-up: connections, workers
        t = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            lat = list(ex.map(fn, range(n)))
        wall = time.perf_counter() - t
        rows[name] = (n / wall, statistics.median(lat) * 1000)
    cc.close()
    for c in clients:
        c.close()
    base = rows["node SDK, straight to the agents"]
    return [[k, f"{v[0]:.1f}/s", ratio(v[0], base[0]), f"{v[1]:.0f} ms", ratio(v[1], base[1])]
            for k, v in rows.items()]


def _rows(n: int, sandboxes: int) -> list[dict]:
    from audit_schema.events import normalize
    now = time.time_ns()
    paths = ["/usr/bin/python3", "/bin/sh", "/usr/bin/curl", "/usr/bin/git", "/usr/bin/make"]
    out = []
    for i in range(n):
        out.append(normalize({"kind": "exec", "event_id": f"b{i:012x}", "ts_ns": now - (n - i) * 1000,
                              "sandbox_id": f"sbx-bench-{i % sandboxes:05d}", "node": "bench", "pid": 100 + i % 50,
                              "path": paths[i % len(paths)] if i % 997 else "/workspace/needle",
                              "argv": ["x", str(i)], "step": 1 + i % 5}))
    return out


def _search(st, n: int, runs: int) -> list[list]:
    from exporters.clickhouse import columns_for
    from exporters.clickhouse_server import connect
    from audit_schema.events import FIELDS
    from audit_schema import migrations
    from replay.queries import execs_sql
    shards = st["shards"]
    db_c = f"bench_cluster_{uuid.uuid4().hex[:6]}"
    db_s = f"bench_single_{uuid.uuid4().hex[:6]}"
    c0 = connect(shards.servers[0].url_for(db_c))[0]
    cols = ", ".join(f.name for f in FIELDS)
    recs = _rows(n, 2000)
    try:
        migrations.migrate(c0, db_c, "dsec_two")
        migrations.migrate(c0, db_s)
        for i in range(0, n, 50000):
            data = columns_for(recs[i:i + 50000])
            c0.execute(f"INSERT INTO {db_c}.events ({cols}) VALUES", data, columnar=True, types_check=False,
                       settings={"strings_as_bytes": True, "insert_distributed_sync": 1})
            c0.execute(f"INSERT INTO {db_s}.events ({cols}) VALUES", data, columnar=True, types_check=False,
                       settings={"strings_as_bytes": True})
        for db in (db_c, db_s):
            c0.execute(f"OPTIMIZE TABLE {db}.{'events_local' if db == db_c else 'events'} FINAL")
        half = c0.execute(f"SELECT count() FROM {db_c}.events_local")[0][0]
        cases = [("one server, all rows (single-server schema)", execs_sql(db_s, path="needle"), n),
                 ("Distributed table, two shards", execs_sql(db_c, path="needle"), n),
                 ("one shard's local table (its half)",
                  execs_sql(db_c, path="needle").replace(f"{db_c}.events\n", f"{db_c}.events_local\n"), half)]
        res = {}
        for name, sql, rows in cases:
            c0.execute(sql)
            ts = []
            for _ in range(runs):
                t = time.perf_counter()
                got = c0.execute(sql)
                ts.append(time.perf_counter() - t)
            res[name] = (statistics.median(ts) * 1000, len(got), rows)
        base = res[cases[0][0]][0]
        return [[k, f"{v[2]}", f"{v[1]}", f"{v[0]:.1f} ms", ratio(v[0], base)] for k, v in res.items()]
    finally:
        c0.execute(f"DROP DATABASE IF EXISTS {db_c} ON CLUSTER dsec_two")
        c0.execute(f"DROP DATABASE IF EXISTS {db_s}")
        c0.disconnect()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rows", type=int, default=400000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="dsec-bench-cluster-")
    t0 = time.perf_counter()
    st = {}
    try:
        _build(base, st)
        print(f"cluster up in {time.perf_counter() - t0:.1f}s (ZooKeeper, 2 ClickHouse shards, 2 agents, Ray 2 nodes)")
        print(f"\n1. placements: {args.sandboxes} sandboxes (create + exec /bin/true + close), "
              f"concurrency {args.concurrency}")
        print(table(["path", "sandboxes/s", "/ SDK", "median create", "/ SDK"],
                    _placements(st, args.sandboxes, args.concurrency)))
        print(f"\n2. search: `dsec search exec --path needle` over {args.rows} exec events, 2000 sandboxes, "
              f"median of {args.runs}")
        print(table(["where", "rows", "hits", "median", "/ one server"], _search(st, args.rows, args.runs)))
    finally:
        _teardown(st)
        import shutil
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    entry(main, "bench/cluster.py")
