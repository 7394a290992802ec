"""The node's side of the cluster: one long-lived Ray actor per node that holds
the node's dsec agent client (docs/cluster.md).

    reg = registration(load_config("/etc/dsec/agent.yaml"))      # what the actor needs to know
    resources = node_resources(cfg)      # for `ray start --resources`: the node's sandbox capacity

The actor (NodeActor, made a Ray actor by agent/node/cluster/register.py) is
pinned to its Ray node (hard node affinity) and lives as long as that node's
raylet. It
  - forwards create / exec / close / kill / get (and snapshot / fork once the
    node SDK has them) to the agent over the agent's unix socket;
  - watches the agent: a pidfd on the agent's process (its death is seen at
    once) and a Capabilities call every couple of seconds (a hung agent);
  - when the agent dies, marks every sandbox it placed there lost, with the
    reason, records a `lifecycle` event {"state": "lost", ...} per sandbox in
    ClickHouse (through a spool of its own, so an outage loses nothing), and
    answers every later call on those sandboxes with that reason;
  - when it starts, stops what an earlier registration of this node left
    running on the agent (sandboxes whose cluster holder is gone).

Every method returns a plain tuple, ("ok", value) or ("error", kind, status,
message, extra): exceptions are rebuilt on the caller's side (client.py), so
nothing depends on pickling the SDK's exception classes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import select
import threading
import time
from collections import OrderedDict

log = logging.getLogger("dsec.cluster")

NAMESPACE = "dsec"
ACTOR_PREFIX = "node:"
LABEL_NODE = "dsec-cluster-node"          # labels the cluster puts on every sandbox it places
LABEL_ACTOR = "dsec-cluster-actor"
LABEL_HOLDER = "dsec-cluster-holder"
RESOURCE_SLOTS = "dsec_sandbox"           # the custom Ray resources of a node's sandbox capacity
RESOURCE_CPU = "dsec_cpu"
RESOURCE_MEMORY = "dsec_memory_mb"
HEALTH_INTERVAL = 2.0                     # seconds between Capabilities checks of the agent
HEALTH_TIMEOUT = 3.0
LOST_KEPT = 10000                         # lost sandboxes remembered per actor


def actor_name(node_name: str) -> str:
    return ACTOR_PREFIX + node_name


def node_resources(cfg) -> dict:
    """The Ray custom resources that describe a node's sandbox capacity, from its
    agent config: slots (limits.max_sandboxes), CPUs as the agent admits them
    (allocatable x cpu_oversubscription) and memory in MiB (never oversubscribed)."""
    cpus, mem = cfg.capacity.totals()
    alloc_cpu = max(0.0, cpus - cfg.capacity.reserve_cpus) * cfg.capacity.cpu_oversubscription
    alloc_mem = max(0, mem - int(cfg.capacity.reserve_memory)) >> 20
    return {RESOURCE_SLOTS: float(cfg.limits.max_sandboxes), RESOURCE_CPU: round(alloc_cpu, 4),
            RESOURCE_MEMORY: float(alloc_mem)}


def registration(cfg, config_path: str | None = None) -> dict:
    """What a node actor needs to know about its agent (plain values: sent to Ray)."""
    node = cfg.host.node_name or os.uname().nodename
    return {"node": node, "socket": cfg.socket, "run_dir": cfg.run_dir, "config": config_path,
            "clickhouse_url": cfg.clickhouse_url, "cluster": cfg.clickhouse.cluster,
            "insert": cfg.clickhouse.insert, "ddl": cfg.clickhouse.ddl,
            "spool_dir": os.path.join(cfg.run_dir, "cluster-spool"), "resources": node_resources(cfg),
            "registered_ns": time.time_ns()}


def _ok(value=None):
    return ("ok", value)


def _err(e) -> tuple:
    """An exception as a tuple the caller turns back into one."""
    from agent.node.client import AgentError
    if isinstance(e, AgentError):
        extra = {"result": getattr(e, "result", None), "reason": getattr(e, "reason", None)}
        return ("error", type(e).__name__, e.status, e.message, extra)
    from agent.errors import ReportedError
    if isinstance(e, ReportedError):
        return ("error", "ClusterError", "FAILED_PRECONDITION", e.message, {})
    return ("error", "ClusterError", "INTERNAL", f"node actor: {type(e).__name__}: {e}", {})


class NodeActor:
    """One node's registration in the Ray cluster (a threaded Ray actor)."""

    def __init__(self, reg: dict):
        from agent.node.client import Client
        self.reg = reg
        self.node = reg["node"]
        self.instance = os.urandom(6).hex()
        self.client = Client(reg["socket"], timeout=60.0, connect_timeout=5.0)
        self._lock = threading.Lock()
        self._sandboxes: dict[str, dict] = {}          # placed here: sid -> {"agent": agent pid, "holder": ...}
        self._lost: OrderedDict[str, str] = OrderedDict()
        self._seq = 0                                    # bumps on every loss (status() polling)
        self._agent = {"alive": False, "pid": 0, "started_ns": 0, "reason": "", "since_ns": 0}
        self._caps: dict = {}
        self._caps_at = 0.0
        self._stop = threading.Event()
        self._pidfd = -1
        self._ray_node_id = ""
        try:
            import ray
            self._ray_node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - used outside Ray in unit checks
            pass
        self._check_agent()
        self.reconciled = self._reconcile()
        self._monitor = threading.Thread(target=self._watch, name="dsec-cluster-watch", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------ the agent's health

    def _check_agent(self) -> bool:
        """Ask the agent (Capabilities); update the health record. True when it answers."""
        from agent.node.client import AgentError, Client
        if not self._agent["alive"] and self._agent["reason"]:
            # a fresh channel: gRPC's reconnect backoff on the old one grows to minutes
            old, self.client = self.client, Client(self.reg["socket"], timeout=60.0, connect_timeout=2.0)
            old.close()
        try:
            caps = self.client.capabilities(timeout=HEALTH_TIMEOUT)
        except AgentError as e:
            self._agent_down(f"the dsec agent of node {self.node} ({self.reg['socket']}) does not answer: "
                             f"{e.message.removeprefix('dsec agent unavailable: ')}")
            return False
        with self._lock:
            self._caps, self._caps_at = caps, time.monotonic()
            pid, started = caps.get("pid", 0), caps.get("started_ns", 0)
            was = dict(self._agent)
            self._agent = {"alive": True, "pid": pid, "started_ns": started, "reason": "",
                           "since_ns": was["since_ns"] if was["alive"] and was["pid"] == pid else time.time_ns()}
        if not was["alive"] or was["pid"] != pid:
            self._watch_pid(pid)
            if was["pid"] and was["pid"] != pid:     # restarted under us: the old sandboxes died with it
                self._lose_agent_sandboxes(was["pid"], f"the dsec agent (pid {was['pid']}) on node {self.node} "
                                                       f"was replaced by pid {pid}")
        return True

    def _watch_pid(self, pid: int):
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = -1         # not on this host's pid namespace: the periodic check still runs

    def _agent_down(self, reason: str):
        with self._lock:
            was = self._agent
            if not was["alive"] and was["reason"]:
                return
            self._agent = {"alive": False, "pid": was["pid"], "started_ns": was["started_ns"], "reason": reason,
                           "since_ns": time.time_ns()}
        log.warning("node %s: %s", self.node, reason)
        self._lose_agent_sandboxes(was["pid"], reason)

    def _watch(self):
        last = time.monotonic()
        while not self._stop.is_set():
            fd = self._pidfd
            if fd >= 0:
                try:
                    p = select.poll()       # poll, not select: the fd may be past 1023
                    p.register(fd, select.POLLIN)
                    ready = p.poll(250)
                except (OSError, ValueError):
                    ready = []
                if ready and self._pidfd == fd:
                    pid = self._agent["pid"]
                    self._pidfd = -1
                    os.close(fd)
                    self._agent_down(f"the dsec agent (pid {pid}) on node {self.node} died")
                    continue
            else:
                self._stop.wait(0.25)
            if time.monotonic() - last >= (HEALTH_INTERVAL if self._agent["alive"] else 0.5):
                last = time.monotonic()
                try:
                    self._check_agent()
                except Exception:  # noqa: BLE001
                    log.exception("node %s: agent health check failed", self.node)

    # ------------------------------------------------------------ lost sandboxes

    def _lose_agent_sandboxes(self, agent_pid: int, reason: str):
        with self._lock:
            gone = [sid for sid, s in self._sandboxes.items() if s["agent"] == agent_pid]
            for sid in gone:
                self._sandboxes.pop(sid, None)
            full = f"lost: {reason}; a sandbox stops with its agent"
        self._mark_lost(gone, full, "agent")

    def _mark_lost(self, sids: list[str], reason: str, cause: str):
        if not sids:
            return
        with self._lock:
            for sid in sids:
                self._lost[sid] = reason
                self._lost.move_to_end(sid)
            while len(self._lost) > LOST_KEPT:
                self._lost.popitem(last=False)
            self._seq += 1
        self.record_lost([{"sandbox_id": sid, "reason": reason, "cause": cause, "node": self.node} for sid in sids])

    def record_lost(self, items: list[dict]):
        """Record `lifecycle` {"state": "lost"} events (for this node's sandboxes, or, asked by a
        cluster client, another node's whose raylet died) in ClickHouse through this actor's spool."""
        try:
            from audit_schema.events import normalize
            from exporters.spool import Spool
            now = time.time_ns()
            recs = []
            for it in items:
                sid = it["sandbox_id"]
                extra = {"state": "lost", "reason": it["reason"], "cause": it.get("cause", ""),
                         "node": it.get("node", ""), "reported_by": f"{self.node} (cluster node actor "
                                                                     f"{self.instance})"}
                import json
                recs.append(normalize({
                    "kind": "lifecycle", "sandbox_id": sid, "ts_ns": now, "node": it.get("node") or self.node,
                    "pid": os.getpid(), "event_id": "L" + hashlib.sha1(f"lost:{sid}".encode()).hexdigest()[:23],
                    "extra": json.dumps(extra, separators=(",", ":"), sort_keys=True)}))
            os.makedirs(self.reg["spool_dir"], mode=0o700, exist_ok=True)
            spool = Spool(self.reg["spool_dir"])
            spool.append_many(recs)
            threading.Thread(target=self._deliver, args=(spool,), name="dsec-cluster-deliver", daemon=True).start()
            return _ok(len(recs))
        except Exception as e:  # noqa: BLE001 - reported to the caller and logged, never silent
            log.error("node %s: cannot record %d lost sandbox(es): %s", self.node, len(items), e)
            return _err(e)

    def _deliver(self, spool):
        from exporters.clickhouse import ClickHouseExporter
        exp = ClickHouseExporter(spool, self.reg.get("clickhouse_url"), cluster=self.reg.get("cluster"),
                                 insert=self.reg.get("insert") or "local", ddl=self.reg.get("ddl") or "auto")
        try:
            res = exp.flush(30.0)
            if not res.ok:
                log.error("node %s: lost-sandbox records not delivered yet: %s", self.node, res.summary())
        finally:
            exp.close()

    def _reconcile(self) -> list[str]:
        """Stop sandboxes an earlier registration of this node placed (their holders
        were told they are lost when that registration died)."""
        from agent.node.client import AgentError
        if not self._agent["alive"]:
            return []
        stopped = []
        try:
            for info in self.client.list(labels={LABEL_NODE: self.node}, states=["queued", "starting", "running"]):
                if info.labels.get(LABEL_ACTOR) not in (None, self.instance):
                    self.client.kill(info.sandbox_id, grace=1.0,
                                     reason=f"its cluster registration (actor {info.labels.get(LABEL_ACTOR)}) is "
                                            f"gone: the node's Ray actor or raylet died and its holder was told "
                                            f"the sandbox is lost")
                    stopped.append(info.sandbox_id)
        except AgentError as e:
            log.warning("node %s: reconcile with the agent failed: %s", self.node, e.message)
        return stopped

    # ------------------------------------------------------------ what the cluster client asks

    def ready(self):
        return _ok(self.state())

    def state(self) -> dict:
        """The node as the placement sees it: agent health, warm profiles, capacity,
        and whatever the agent reports about images and snapshots (for the preferences)."""
        if self._agent["alive"] and time.monotonic() - self._caps_at > 0.3:
            self._check_agent()
        with self._lock:
            caps = self._caps
            return {"node": self.node, "ray_node_id": self._ray_node_id, "actor": self.instance,
                    "agent": dict(self._agent), "sandboxes": len(self._sandboxes),
                    "warm": {w["name"]: w["ready"] for w in caps.get("warm_profiles", [])},
                    "warm_specs": {w["name"]: w["spec"] for w in caps.get("warm_profiles", [])},
                    "images": list(caps.get("images") or ()), "snapshots": list(caps.get("snapshots") or ()),
                    "capacity": caps.get("capacity", {}), "resources": self.reg.get("resources", {}),
                    "lost_seq": self._seq, "reconciled": len(self.reconciled)}

    def status(self, sids: list[str]) -> tuple:
        """Health of the agent and which of `sids` are lost (and why)."""
        with self._lock:
            return _ok({"agent": dict(self._agent), "lost_seq": self._seq,
                        "lost": {s: self._lost[s] for s in sids if s in self._lost}})

    def _gone(self, sid: str):
        with self._lock:
            reason = self._lost.get(sid)
        if reason is not None:
            return ("lost", reason)
        if not self._agent["alive"]:
            return ("lost", f"lost: {self._agent['reason']}")
        return None

    def create(self, spec: dict, holder: str = "") -> tuple:
        from agent.node.client import AgentError
        if not self._agent["alive"]:
            return ("unavailable", self._agent["reason"] or f"the dsec agent on node {self.node} is down")
        labels = dict(spec.pop("labels", None) or {})
        labels.update({LABEL_NODE: self.node, LABEL_ACTOR: self.instance})
        if holder:
            labels[LABEL_HOLDER] = holder[:1024]
        agent_pid = self._agent["pid"]
        try:
            sb = self.client.create(labels=labels, **spec)
        except AgentError as e:
            if e.status == "UNAVAILABLE":
                self._check_agent()
            return _err(e)
        except TypeError as e:
            return ("error", "InvalidArgument", "INVALID_ARGUMENT", f"create: {e}", {})
        with self._lock:
            self._sandboxes[sb.id] = {"agent": agent_pid, "holder": holder, "created_ns": time.time_ns()}
        return _ok(sb.created)

    def _call(self, sid: str, fn):
        from agent.node.client import AgentError
        gone = self._gone(sid)
        if gone:
            return gone
        try:
            return _ok(fn())
        except AgentError as e:
            if e.status == "UNAVAILABLE" and not self._check_agent():
                return self._gone(sid) or _err(e)
            return _err(e)

    def exec(self, sid: str, argv, kw: dict) -> tuple:
        return self._call(sid, lambda: self.client.exec(sid, argv, **kw))

    def get(self, sid: str) -> tuple:
        return self._call(sid, lambda: self.client.get(sid))

    def kill(self, sid: str, grace=None, reason: str = "") -> tuple:
        out = self._call(sid, lambda: self.client.kill(sid, grace, reason))
        self._forget(sid)
        return out

    def close(self, sid: str) -> tuple:
        out = self._call(sid, lambda: self.client.close_sandbox(sid))
        self._forget(sid)
        return out

    def invoke(self, sid: str, method: str, kw: dict) -> tuple:
        """A sandbox method of the node SDK that the cluster passes through as it is
        (snapshot, fork, ...): UNIMPLEMENTED while the node SDK has no such method."""
        from agent.node.client import Sandbox
        fn = getattr(Sandbox(self.client, sid), method, None)
        if fn is None or method.startswith("_"):
            return ("error", "Unsupported", "UNIMPLEMENTED",
                    f"{method}: this dsec's node agents have no {method} yet", {})
        out = self._call(sid, lambda: fn(**kw))
        if out[0] == "ok":           # new sandboxes (a fork): plain values, and placed here
            value = out[1]
            many = value if isinstance(value, (list, tuple)) else [value]
            if many and all(hasattr(v, "id") and hasattr(v, "created") for v in many):
                with self._lock:
                    for v in many:
                        self._sandboxes[v.id] = {"agent": self._agent["pid"], "holder": "", "created_ns": time.time_ns()}
                value = [{"sandbox_id": v.id, "info": v.created} for v in many]
                out = _ok(value if isinstance(out[1], (list, tuple)) else value[0])
        return out

    def _forget(self, sid: str):
        with self._lock:
            self._sandboxes.pop(sid, None)

    def shutdown(self):
        self._stop.set()
        self.client.close()
        return _ok()


__all__ = ["ACTOR_PREFIX", "LABEL_ACTOR", "LABEL_HOLDER", "LABEL_NODE", "NAMESPACE", "NodeActor", "RESOURCE_CPU",
           "RESOURCE_MEMORY", "RESOURCE_SLOTS", "actor_name", "node_resources", "registration"]
