"""Scale-out: dsec agents on many nodes, sandboxes placed across them by Ray (docs/cluster.md).

    node.py       the node actor (one per node, holds that node's agent client), its Ray resources
    register.py   registering a node with the Ray cluster, finding the registered nodes
    placement.py  the placement preferences (warm profile ready, image cached, snapshot local)
    client.py     ClusterClient / ClusterSandbox: create, exec, close across the cluster; node loss
"""
from agent.node.cluster.client import ClusterClient, ClusterSandbox, NoCapacity, SandboxLost, Unsupported
from agent.node.cluster.register import ClusterError, deregister_node, node_actors, register_node

__all__ = ["ClusterClient", "ClusterError", "ClusterSandbox", "NoCapacity", "SandboxLost", "Unsupported",
           "deregister_node", "node_actors", "register_node"]
