"""Which node a sandbox should go to: preferences, each a small class (docs/cluster.md).

    prefs = (SnapshotLocal(), WarmProfile(), ImageCached())          # DEFAULT_PREFERENCES
    ranked = rank(Request(profile="py"), views, prefs)               # [(score, NodeView, reasons)]

Ray's scheduler does the placement (a placement group of one bundle of the
node resources, agent/node/cluster/client.py); the best-ranked node is handed
to it as the soft target, so Ray places there when the node has the capacity
and elsewhere when it has not. A preference only ranks: it never makes a
node eligible that Ray would not choose, and a node whose agent is down is
never a candidate.

Writing one: subclass Preference, give it a `name` and a `weight`, and make
score(request, node) return 0..1 from `node.state` (what the node actor
reports: its agent's Capabilities, summarised in NodeActor.state()). The
image and snapshot preferences read `images` / `snapshots` from the agent's
Capabilities; agents that do not report them yet (before image and snapshot
support) simply score 0 there.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    """What a placement is asked for: the node SDK's create() fields, plus the hints."""
    spec: dict = field(default_factory=dict)
    profile: str | None = None         # a warm-pool profile name (agent config warm_pool[].name)
    image: str | None = None           # an image reference or digest the sandbox starts from
    snapshot: str | None = None        # a snapshot id the sandbox is restored from


@dataclass
class NodeView:
    """One registered node as the cluster client sees it right now."""
    name: str
    actor: object                      # the node actor's handle
    state: dict = field(default_factory=dict)
    error: str = ""                    # why the node actor did not answer

    @property
    def ray_node_id(self) -> str:
        return self.state.get("ray_node_id", "")

    @property
    def alive(self) -> bool:
        return not self.error and bool(self.state.get("agent", {}).get("alive"))

    @property
    def reason(self) -> str:
        return self.error or self.state.get("agent", {}).get("reason", "")

    @property
    def warm(self) -> dict:
        return self.state.get("warm") or {}


def _names(items) -> set:
    out = set()
    for it in items or ():
        if isinstance(it, str):
            out.add(it)
        elif isinstance(it, dict):
            out.update(str(it[k]) for k in ("id", "digest", "ref", "name", "reference") if it.get(k))
    return out


class Preference:
    name = "preference"
    weight = 1.0

    def score(self, req: Request, node: NodeView) -> float:   # noqa: ARG002 - the hook's signature
        return 0.0


class WarmProfile(Preference):
    """A node with a ready warm sandbox of the requested profile: the sandbox is
    handed over at once instead of being built."""
    name = "warm"
    weight = 100.0

    def score(self, req: Request, node: NodeView) -> float:
        return 1.0 if req.profile and node.warm.get(req.profile, 0) > 0 else 0.0


class ImageCached(Preference):
    """A node that has the requested image in its layer cache (no pull, no unpack)."""
    name = "image"
    weight = 10.0

    def score(self, req: Request, node: NodeView) -> float:
        return 1.0 if req.image and req.image in _names(node.state.get("images")) else 0.0


class SnapshotLocal(Preference):
    """A node that holds the requested snapshot (no export/import across nodes)."""
    name = "snapshot"
    weight = 1000.0

    def score(self, req: Request, node: NodeView) -> float:
        return 1.0 if req.snapshot and req.snapshot in _names(node.state.get("snapshots")) else 0.0


DEFAULT_PREFERENCES = (SnapshotLocal(), WarmProfile(), ImageCached())


def load(node: NodeView) -> float:
    cpu = float((node.state.get("resources") or {}).get("dsec_cpu") or 1.0)
    return node.state.get("sandboxes", 0) / max(cpu, 1e-3)


def rank(req: Request, nodes: list[NodeView], prefs=DEFAULT_PREFERENCES) -> list[tuple[float, NodeView, list[str]]]:
    """The live nodes, best first: (score, node, names of the preferences it meets).
    Ties go to the less loaded node (sandboxes placed per CPU of its capacity):
    without a preference, sandboxes spread over the nodes."""
    out = []
    for n in nodes:
        if not n.alive:
            continue
        score, why = 0.0, []
        for p in prefs:
            s = float(p.score(req, n))
            if s > 0:
                score += p.weight * s
                why.append(p.name)
        out.append((score, n, why))
    out.sort(key=lambda t: (-t[0], load(t[1]), t[1].name))
    return out


__all__ = ["DEFAULT_PREFERENCES", "ImageCached", "NodeView", "Preference", "Request", "SnapshotLocal", "WarmProfile",
           "rank"]
