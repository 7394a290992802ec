"""Registering a node's dsec agent with the Ray cluster (docs/cluster.md).

    register_node(load_config("/etc/dsec/agent.yaml"), address="auto")   # on the node, after `ray start`
    deregister_node("node-7")
    node_actors()          # {node name: actor handle} of every registered node

`dsec cluster resources` prints the node's Ray resources for `ray start
--resources`; `dsec cluster register` runs register_node. The actor is
detached (it outlives the process that registered it) and pinned to the Ray
node it was registered from, or to `ray_node_id`.
"""
from __future__ import annotations

import logging
import time

from agent.errors import DsecError
from agent.node.cluster.node import NAMESPACE, ACTOR_PREFIX, RESOURCE_SLOTS, NodeActor, actor_name, registration

log = logging.getLogger("dsec.cluster")


class ClusterError(DsecError):
    """The cluster client or a registration cannot do what was asked (one line, exit 1)."""


def connect(address: str | None = "auto"):
    """ray.init() unless this process is already connected (a Ray task or actor is)."""
    import ray
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=False)
    except ConnectionError as e:
        raise ClusterError(f"no Ray cluster at {address!r}: {e}") from None


def _ray_node(node_id: str) -> dict | None:
    import ray
    for n in ray.nodes():
        if n.get("NodeID") == node_id:
            return n
    return None


def register_node(cfg, *, config_path: str | None = None, address: str | None = "auto",
                  ray_node_id: str | None = None, timeout: float = 60.0) -> dict:
    """Start (or replace) this node's actor; returns its first state."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    reg = registration(cfg, config_path)
    connect(address)
    node_id = ray_node_id or ray.get_runtime_context().get_node_id()
    n = _ray_node(node_id)
    if n is None or not n.get("Alive"):
        raise ClusterError(f"Ray node {node_id} is not a live node of this cluster")
    if RESOURCE_SLOTS not in (n.get("Resources") or {}):
        import json
        raise ClusterError(f"Ray node {node_id} has no {RESOURCE_SLOTS} resource: start Ray on this node with "
                           f"--resources='{json.dumps(reg['resources'])}' (dsec cluster resources prints it)")
    name = actor_name(reg["node"])
    deregister_node(reg["node"])
    actor_cls = ray.remote(NodeActor).options(
        name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=256, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    actor = actor_cls.remote(reg)
    try:
        status, state = ray.get(actor.ready.remote(), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - Ray's errors are many; one line here
        raise ClusterError(f"the node actor of {reg['node']} did not start within {timeout:g}s: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return state


def deregister_node(node: str, timeout: float = 30.0) -> bool:
    """Kill node `node`'s actor (its holders see their sandboxes lost). True if there was one."""
    import ray
    name = actor_name(node)
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:     # the name is released once the GCS saw the actor die
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.05)
    raise ClusterError(f"the old actor of node {node} did not go away within {timeout:g}s")


def node_actors() -> dict:
    """{node name: actor handle} of every registered node."""
    import ray
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a.get("name", "").startswith(ACTOR_PREFIX):
            try:
                out[a["name"][len(ACTOR_PREFIX):]] = ray.get_actor(a["name"], namespace=NAMESPACE)
            except ValueError:
                continue            # gone in between
    return out


__all__ = ["ClusterError", "connect", "deregister_node", "node_actors", "register_node"]
