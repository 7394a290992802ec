"""The two-node cluster of tests/test_cluster.py, all real, all on loopback, built once:

    zookeeper      Debian's ZooKeeper (the distributed-DDL queue ON CLUSTER needs)
    TwoShards      two private ClickHouse 18.16 servers (own homes, free ports) that form the
                   cluster CLUSTER (two shards, one replica each) with distributed DDL
    two agents     `dsec agent` processes (tests/test_agent.py's AgentProc) with their own
                   socket, run dir, state dir, spool, cgroup parent, egress pool and node name;
                   node-a inserts into its shard, node-b through the Distributed table;
                   node-b has a warm pool ("py")
    Ray            ray.cluster_utils.Cluster: a head without dsec resources and one Ray node per
                   agent (its sandbox capacity as custom resources), each agent registered
                   (its node actor pinned to its Ray node)

Everything binds to 127.0.0.1 and is stopped and removed at the end; the agents'
cgroup parents and NAT tables are checked empty and removed (dsec gc with their
settings).
"""
from __future__ import annotations

import os
from xml.sax.saxutils import escape as xml_escape
import shutil
import signal
import socket
import subprocess
import time
import uuid

# Ray on loopback only: with clusters "disabled" Ray resolves this host to 127.0.0.1 instead of
# the machine's address (read when ray is first imported; nothing imported it before this module)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from exporters.clickhouse_server import PrivateServer, connect  # noqa: E402
from fixtures_clickhouse import free_ports

CLUSTER = "dsec_two"
ZK_JAR = "/usr/share/java/zookeeper.jar"


def _listening(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class ZooKeeper:
    def __init__(self, home: str):
        self.home = home
        self.port = free_ports(1)[0]
        self.proc = None

    def start(self):
        java = shutil.which("java")
        assert java and os.path.exists(ZK_JAR), "ZooKeeper (Debian's zookeeper package) is not installed: make setup"
        os.makedirs(os.path.join(self.home, "data"), exist_ok=True)
        log = open(os.path.join(self.home, "zk.log"), "ab")
        # ZooKeeperServerMain PORT DATADIR: standalone, no admin server, loopback only
        self.proc = subprocess.Popen(
            # -XX:-UsePerfData: no /tmp/hsperfdata_<user> left behind by the JVM
            [java, "-Xmx256m", "-XX:-UsePerfData", "-Dzookeeper.admin.enableServer=false",
             "-Dzookeeper.4lw.commands.whitelist=ruok",
             f"-Dzookeeper.clientPortAddress=127.0.0.1", "-cp", f"/etc/zookeeper/conf:{ZK_JAR}",
             "org.apache.zookeeper.server.ZooKeeperServerMain", str(self.port), os.path.join(self.home, "data")],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        assert _listening(self.port, 60), f"ZooKeeper did not listen on 127.0.0.1:{self.port}"
        return self

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class TwoShards:
    """Two ClickHouse servers forming CLUSTER, with ZooKeeper for ON CLUSTER."""

    def __init__(self, base: str, zk: ZooKeeper):
        self.base = base
        self.zk = zk
        ports = free_ports(4)
        self.servers = [PrivateServer(os.path.join(base, f"ch{i}"), ports[2 * i], ports[2 * i + 1]) for i in (0, 1)]
        self.db = f"dsec_cluster_{uuid.uuid4().hex[:6]}"

    def _config(self) -> str:
        # each server has only its own user dsec with a generated password (no default user):
        # the Distributed table reaches every shard with that shard's credentials
        shards = "".join(f"<shard><replica><host>127.0.0.1</host><port>{s.tcp_port}</port>"
                         f"<user>dsec</user><password>{xml_escape(s.password(create=True))}</password>"
                         f"</replica></shard>" for s in self.servers)
        return (f"<?xml version=\"1.0\"?>\n<yandex>\n"
                f"  <remote_servers><{CLUSTER}>{shards}</{CLUSTER}></remote_servers>\n"
                f"  <zookeeper><node><host>127.0.0.1</host><port>{self.zk.port}</port></node></zookeeper>\n"
                f"  <distributed_ddl><path>/clickhouse/{self.db}/ddl</path></distributed_ddl>\n"
                f"</yandex>\n")

    def start(self):
        # one dsec user and password on every shard, as a deployment has (host-by-host DDL and
        # the Distributed table reach each shard with the same credentials)
        pw = self.servers[0].password(create=True)
        for s in self.servers[1:]:
            if s.password() != pw:
                os.makedirs(s.home, mode=0o700, exist_ok=True)
                fd = os.open(s.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(pw + "\n")
        for s in self.servers:
            os.makedirs(os.path.join(s.home, "config.d"), exist_ok=True)
            with open(os.path.join(s.home, "config.d", "cluster.xml"), "w") as f:
                f.write(self._config())
        for s in self.servers:
            s.start()
        return self

    def url(self, i: int) -> str:
        return self.servers[i].url_for(self.db)

    def client(self, i: int):
        return connect(self.url(i))[0]

    def stop(self):
        for s in self.servers:
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass


def agent_config(base: str, name: str, shards: TwoShards, shard: int, insert: str, pool: str,
                 warm: list | None = None) -> dict:
    tag = uuid.uuid4().hex[:6]
    return {
        "log_level": "info",
        "host": {"node_name": name, "state_dir": os.path.join(base, "state"), "spool_dir": os.path.join(base, "spool"),
                 "cgroup_parent": f"dsec-t-{name}-{tag}", "egress_pool": pool},
        "clickhouse": {"url": shards.url(shard), "cluster": CLUSTER, "insert": insert},
        "capacity": {"cpus": 8, "memory": "8G", "cpu_oversubscription": 4},
        "defaults": {"cpus": 0.1, "memory": "64M", "pids": 256, "grace_seconds": 1},
        "scheduling": {"tick_seconds": 0.2, "max_parallel_starts": 4},
        "exporter": {"interval_seconds": 0.2},
        "warm_pool": warm or [],
    }


def host_gc(cfg: dict) -> subprocess.CompletedProcess:
    """`dsec gc` with one agent's host settings (its state dir, cgroup parent, pool)."""
    from conftest import dsec
    h = cfg["host"]
    return dsec("gc", env={"DSEC_STATE_DIR": h["state_dir"], "DSEC_CGROUP_PARENT": h["cgroup_parent"],
                           "DSEC_EGRESS_POOL": h["egress_pool"]})


def cgroups_under(parent: str) -> list[str]:
    out = []
    for r in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/pids",
              "/sys/fs/cgroup"):
        d = os.path.join(r, parent)
        if os.path.isdir(d):
            out.append(d)
            out += [os.path.join(d, n) for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))]
    return out


def ray_cluster(temp_dir: str | None = None):
    """A local Ray cluster (head only, no dsec resources), nodes fail fast; its
    session files under `temp_dir` (short: Ray's unix sockets live there), and
    so is Ray's "current cluster" address file (RAY_TMPDIR: else it is written
    to /tmp/ray, which need not exist and would be left behind)."""
    from ray.cluster_utils import Cluster
    if temp_dir:
        os.environ["RAY_TMPDIR"] = temp_dir
        os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)    # where that file goes
    return Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": temp_dir,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}})


def add_ray_node(cluster, resources: dict):
    """One more Ray node (a raylet of its own) with these custom resources, in the head's temp dir."""
    return cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources=resources,
                            temp_dir=cluster.head_node._ray_params.temp_dir)


__all__ = ["CLUSTER", "TwoShards", "ZooKeeper", "add_ray_node", "agent_config", "cgroups_under", "host_gc",
           "ray_cluster"]
