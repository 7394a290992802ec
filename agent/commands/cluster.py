"""Scale-out with Ray: register this node's agent with the Ray cluster, and look at the cluster.

examples (on each node, after `dsec agent` runs):
  ray start --address=HEAD:6379 --resources="$(dsec cluster resources --config /etc/dsec/agent.yaml)"
  dsec cluster register --config /etc/dsec/agent.yaml --address HEAD:6379
  dsec cluster status --address HEAD:6379          # every registered node, its agent, warm pools
  dsec cluster deregister --node node-7 --address HEAD:6379

resources   prints the node's Ray custom resources (JSON) from the agent config: dsec_sandbox
            (slots), dsec_cpu (allocatable CPUs x oversubscription), dsec_memory_mb
register    starts (or replaces) this node's actor in the Ray cluster: a detached actor
            pinned to this Ray node (or --ray-node-id), holding the agent's client
deregister  kills a node's actor (its sandboxes' holders see them lost)
status      one line per registered node: agent up/down (and why), sandboxes placed, warm

Python: agent.node.cluster.ClusterClient (docs/cluster.md).
exit status: 0 ok; 1 failure (no Ray cluster, node not registrable, a node down for status);
2 bad usage or configuration.
"""
from __future__ import annotations

import json

HELP = "register this node with a Ray cluster; show the cluster's dsec nodes"


def register(p):
    p.add_argument("action", choices=("resources", "register", "deregister", "status"))
    p.add_argument("--config", metavar="FILE", help="the agent's configuration (resources, register)")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--ray-node-id", metavar="ID", help="register: the Ray node to pin the actor to "
                                                       "(default: the node this command runs on)")
    p.add_argument("--node", metavar="NAME", help="deregister: the node's name")
    p.add_argument("--timeout", type=float, default=60.0, help="register: seconds to wait for the actor")
    p.add_argument("--format", choices=("table", "json"), default="table")


def run(args) -> int:
    from agent.errors import DsecError, EXIT_USAGE
    from agent.node.config import load_config
    if args.action == "resources":
        from agent.node.cluster.node import node_resources
        print(json.dumps(node_resources(load_config(args.config))))
        return 0
    from agent.node.cluster import register as reg
    if args.action == "register":
        st = reg.register_node(load_config(args.config), config_path=args.config, address=args.address,
                               ray_node_id=args.ray_node_id, timeout=args.timeout)
        if args.format == "json":
            print(json.dumps(st, indent=2, default=str))
        else:
            print(f"registered node {st['node']} (Ray node {st['ray_node_id']}, actor {st['actor']}); agent "
                  + ("up" if st["agent"]["alive"] else f"DOWN: {st['agent']['reason']}"))
        return 0 if st["agent"]["alive"] else 1
    if args.action == "deregister":
        if not args.node:
            raise DsecError("deregister: --node NAME is required", EXIT_USAGE)
        reg.connect(args.address)
        if not reg.deregister_node(args.node):
            raise DsecError(f"no node {args.node!r} is registered")
        print(f"deregistered node {args.node}")
        return 0
    from agent.node.cluster.client import ClusterClient
    views = ClusterClient(args.address).nodes(refresh=True)
    if args.format == "json":
        print(json.dumps([{"node": v.name, "alive": v.alive, "reason": v.reason, "state": v.state} for v in views],
                         indent=2, default=str))
    else:
        if not views:
            print("no dsec node is registered")
        for v in sorted(views, key=lambda v: v.name):
            warm = ", ".join(f"{k} {n} ready" for k, n in sorted(v.warm.items())) or "no warm pool"
            state = "up" if v.alive else f"DOWN ({v.reason})"
            print(f"{v.name}: agent {state}; {v.state.get('sandboxes', 0)} sandboxes placed; {warm}")
    return 0 if views and all(v.alive for v in views) else 1
