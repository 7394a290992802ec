"""The cluster client: sandboxes placed across nodes by Ray (docs/cluster.md).

    from agent.node.cluster import ClusterClient, SandboxLost

    cc = ClusterClient("auto")                    # a Ray address; inside a Ray task: already connected
    sb = cc.create(memory="512M", cpus=0.5, profile="py", labels={"job": "rl-7"})
    print(sb.node)                                # the node it was placed on
    r = sb.exec(["python3", "-c", "print(6*7)"])  # the node SDK's ExecResult
    sb.close()                                    # the summary, as the node SDK returns it

    @ray.remote
    def rollout(sb):                              # a handle is a plain value: pass it to a Ray task
        return sb.exec(["python3", "step.py"]).stdout

Placement: create() asks every registered node's actor for its state (cached
for `state_ttl`), ranks the live nodes by the preferences (placement.py:
snapshot local, warm sandbox of the profile ready, image cached; then the
least loaded), and asks
Ray for a placement group of one bundle of the node's sandbox resources
({dsec_sandbox: 1, dsec_cpu: cpus, dsec_memory_mb: memory}) with the best
node as its soft target: Ray places it there if that node has the capacity,
elsewhere if not, and holds the reservation until the sandbox is closed or
lost. The sandbox is then created by the actor of the node Ray chose. A
bundle that lands on a node whose agent is down is kept aside while another
is placed (so Ray does not pick the same node again), then released.

Node loss: a call on a sandbox whose node lost its agent or its raylet
raises SandboxLost (with the reason) and so does every later call; the
client's monitor thread notices it without a call too (every
`monitor_interval`): it marks the handle lost, releases its reservation,
calls `on_lost(handle, reason)`, and, when a raylet died (the node's actor
with it), records the loss in ClickHouse through another node's actor (an
agent's death is recorded by its node's own actor). Every wait is bounded:
create() by `timeout`; a step by its own timeout plus a margin, and without
one by the node's liveness, checked every two seconds.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from agent.node.cluster.node import RESOURCE_CPU, RESOURCE_MEMORY, RESOURCE_SLOTS
from agent.node.cluster.placement import DEFAULT_PREFERENCES, NodeView, Request, rank
from agent.node.cluster.register import ClusterError, connect, node_actors

log = logging.getLogger("dsec.cluster")

STATE_TIMEOUT = 3.0      # seconds a node actor has to report its state
LIVENESS_EVERY = 2.0     # seconds between liveness checks of a handle's node during a long call
CALL_MARGIN = 30.0       # added to a step's own timeout (and grace) for the answer to arrive


class SandboxLost(ClusterError):
    """The sandbox's node lost its agent or its raylet: the sandbox is gone."""

    def __init__(self, sandbox_id: str, node: str, reason: str):
        super().__init__(f"sandbox {sandbox_id} on node {node} is {reason}" if reason.startswith("lost")
                         else f"sandbox {sandbox_id} on node {node} is lost: {reason}")
        self.sandbox_id, self.node, self.reason = sandbox_id, node, reason


class NoCapacity(ClusterError):
    """No live node could take the sandbox within the timeout."""


class Unsupported(ClusterError):
    """The nodes' agents do not have this yet (snapshot, fork, images)."""


def _raise(out, sb: "ClusterSandbox | None" = None):
    """The value of a node actor's answer, or the exception it stands for."""
    from agent.node import client as sdk
    kind = out[0]
    if kind == "ok":
        return out[1]
    if kind in ("lost", "unavailable"):
        if sb is not None:
            sb._mark_lost(out[1])
            raise SandboxLost(sb.id, sb.node, out[1])
        raise ClusterError(out[1])
    _, cls_name, status, message, extra = out
    if cls_name == "Unsupported":
        raise Unsupported(message)
    cls = getattr(sdk, cls_name, None)
    if isinstance(cls, type) and issubclass(cls, sdk.AgentError):
        if issubclass(cls, sdk.SandboxStopped):
            raise cls(status, message, (extra or {}).get("result"))
        if issubclass(cls, sdk.SandboxFailed):
            raise cls(status, message, (extra or {}).get("reason") or "")
        raise cls(status, message)
    raise ClusterError(message)


def _ray_errors():
    import ray.exceptions as rx
    return (rx.RayActorError, rx.RaySystemError)


def _node_alive(ray_node_id: str) -> bool:
    import ray
    for n in ray.nodes():
        if n.get("NodeID") == ray_node_id:
            return bool(n.get("Alive"))
    return False


class ClusterSandbox:
    """A sandbox on one node of the cluster; every call goes to that node's actor,
    and from there to its agent. Picklable: hand it to a Ray task."""

    def __init__(self, sandbox_id: str, node: str, ray_node_id: str, actor, pg, info=None, owner=None):
        self.id = sandbox_id
        self.node = node
        self.ray_node_id = ray_node_id
        self.created = info
        self.summary: dict | None = None
        self.lost: str | None = None            # the reason, once the sandbox is lost
        self.closed = False
        self._unrecorded = False                # lost through a call, the loss not recorded yet
        self._actor = actor
        self._pg = pg
        self._owner = owner

    def __repr__(self):
        return f"ClusterSandbox({self.id!r}, node={self.node!r}{', lost' if self.lost else ''})"

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_owner"] = None                      # the monitor stays with the client that placed it
        return d

    # -------------------------------------------------------------- plumbing

    def _mark_lost(self, reason: str) -> bool:
        """True the first time (the caller reports it)."""
        if self.lost is not None or self.closed:
            return False
        self.lost = reason
        self._release()
        return True

    def _release(self):
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                from ray.util import remove_placement_group
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - the node (and the reservation with it) may be gone
                pass

    def _check(self):
        if self.lost is not None:
            raise SandboxLost(self.id, self.node, self.lost)

    def _wait(self, ref, timeout: float | None):
        """ray.get(ref) that ends when the node is lost, and at `timeout` (None: never, while alive)."""
        import ray
        start = time.monotonic()
        checked = start
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                try:
                    return _raise(ray.get(ready[0]), self)
                except _ray_errors() as e:
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    reason = f"lost: the node actor of {self.node} died ({why[:300]})"
                    if not _node_alive(self.ray_node_id):
                        reason = f"lost: node {self.node}'s raylet died (Ray node {self.ray_node_id[:12]} is dead)"
                    if self._mark_lost(reason):
                        self._unrecorded = True      # the owner's monitor records it (the node's actor is gone)
                    raise SandboxLost(self.id, self.node, self.lost) from None
            now = time.monotonic()
            if self.lost is not None:           # the owner's monitor saw the node go
                raise SandboxLost(self.id, self.node, self.lost)
            if now - checked >= LIVENESS_EVERY:
                checked = now
                if not _node_alive(self.ray_node_id):
                    if self._mark_lost(f"lost: node {self.node}'s raylet died (Ray node {self.ray_node_id[:12]} "
                                       f"is dead)"):
                        self._unrecorded = True
                    raise SandboxLost(self.id, self.node, self.lost)
            if timeout is not None and now - start > timeout:
                raise ClusterError(f"sandbox {self.id}: node {self.node} did not answer within {timeout:g}s")

    # -------------------------------------------------------------- the node SDK's calls

    def exec(self, argv, **kw):
        """One step (the node SDK's Sandbox.exec keywords: stdin, env, workdir, timeout, grace).
        Returns its ExecResult; raises SandboxLost when the node is lost under it."""
        self._check()
        kw = {k: v for k, v in kw.items() if k not in ("on_stdout", "on_stderr")}
        t = kw.get("timeout")
        budget = None if not t else float(t) + float(kw.get("grace") or 0) + CALL_MARGIN
        return self._wait(self._actor.exec.remote(self.id, list(argv), kw), budget)

    def info(self):
        self._check()
        return self._wait(self._actor.get.remote(self.id), CALL_MARGIN)

    def kill(self, grace: float | None = None, reason: str = ""):
        self._check()
        try:
            return self._wait(self._actor.kill.remote(self.id, grace, reason), (grace or 0) + CALL_MARGIN + 600)
        finally:
            self.closed = True
            self._release()

    def close(self):
        """Close it on its node (teardown, change manifest in .summary). A lost sandbox
        has nothing left to close: returns None."""
        if self.closed:
            return None
        if self.lost is not None:
            self.closed = True
            self._release()
            return None
        try:
            info = self._wait(self._actor.close.remote(self.id), CALL_MARGIN + 600)
            self.summary = getattr(info, "summary", None)
            return info
        finally:
            self.closed = True
            self._release()

    def snapshot(self, **kw):
        """The node SDK's Sandbox.snapshot, on the sandbox's node (Unsupported before the agents have it)."""
        self._check()
        return self._wait(self._actor.invoke.remote(self.id, "snapshot", kw), CALL_MARGIN + 600)

    def fork(self, **kw):
        """The node SDK's Sandbox.fork, on the sandbox's node: handles on the new sandboxes
        (same node; they hold no Ray reservation of their own)."""
        self._check()
        out = self._wait(self._actor.invoke.remote(self.id, "fork", kw), CALL_MARGIN + 600)
        many = out if isinstance(out, list) else [out]
        hs = [ClusterSandbox(o["sandbox_id"], self.node, self.ray_node_id, self._actor, None, o.get("info"),
                             self._owner) for o in many]
        if self._owner is not None:
            for h in hs:
                self._owner._watch(h)
        return hs if isinstance(out, list) else hs[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except ClusterError:
            if exc[0] is None:
                raise
        return False


class ClusterClient:
    """Places sandboxes on the nodes registered with a Ray cluster."""

    def __init__(self, address: str | None = "auto", *, preferences=DEFAULT_PREFERENCES, default_cpus: float = 1.0,
                 default_memory="1G", state_ttl: float = 0.5, monitor_interval: float = 0.5, on_lost=None):
        from agent.node.client import _size
        connect(address)
        self.preferences = tuple(preferences)
        self.default_cpus = float(default_cpus)
        self.default_memory = _size(default_memory)
        self.state_ttl = state_ttl
        self.monitor_interval = monitor_interval
        self.on_lost = on_lost
        self.holder = f"{os.uname().nodename}:{os.getpid()}"
        self._lock = threading.Lock()
        self._views: list[NodeView] = []
        self._views_at = 0.0
        self._handles: dict[str, ClusterSandbox] = {}
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -------------------------------------------------------------- nodes

    def nodes(self, refresh: bool = False) -> list[NodeView]:
        """Every registered node with its state (agent health, warm profiles, capacity)."""
        import ray
        with self._lock:
            if not refresh and self._views and time.monotonic() - self._views_at < self.state_ttl:
                return list(self._views)
        actors = node_actors()
        refs = {name: a.state.remote() for name, a in actors.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATE_TIMEOUT) if refs else ([], [])
        views = []
        for name, ref in refs.items():
            v = NodeView(name, actors[name])
            if ref in ready:
                try:
                    v.state = ray.get(ref)
                except _ray_errors() as e:
                    v.error = f"the node actor died: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            else:
                v.error = f"the node actor did not answer within {STATE_TIMEOUT:g}s"
            views.append(v)
        with self._lock:
            self._views, self._views_at = views, time.monotonic()
        return list(views)

    # -------------------------------------------------------------- create

    def create(self, *, profile: str | None = None, image: str | None = None, snapshot: str | None = None,
               timeout: float = 60.0, **spec) -> ClusterSandbox:
        """Place a sandbox and create it: the node SDK's create() keywords (cpus, memory,
        pids, priority, policy, policy_yaml, mode, rootfs, network, labels, env, workdir,
        user, lifetime, grace, keep, over_budget, audit, warm), plus `profile` (a warm
        pool profile: its spec is used, and a node with one ready is preferred),
        `image` / `snapshot` (placement preferences; passed to the agent once it takes
        them). Returns once the sandbox runs; NoCapacity after `timeout`."""
        import ray
        from agent.node.client import _size
        deadline = time.monotonic() + timeout
        views = self.nodes()
        if profile:
            spec = dict(self._profile_spec(profile, views), **spec)
        for k, v in (("image", image), ("snapshot", snapshot)):
            if v is not None:
                spec[k] = v          # the agent refuses it (InvalidArgument) until it knows the field
        req = Request(spec=dict(spec), profile=profile, image=image, snapshot=snapshot)
        cpus = float(spec.get("cpus") or self.default_cpus)
        mem = _size(spec.get("memory")) or self.default_memory
        bundle = {RESOURCE_SLOTS: 1.0, RESOURCE_CPU: cpus, RESOURCE_MEMORY: float(max(1, mem >> 20))}
        tried: set = set()
        rejected = []
        try:
            while True:
                ranked = rank(req, views, self.preferences)
                live = {v.ray_node_id: v for _, v, _ in ranked}
                if not live:
                    down = "; ".join(f"{v.name}: {v.reason}" for v in views) or "no node is registered"
                    raise NoCapacity(f"no live dsec node to place the sandbox on ({down})")
                target = next((v for _, v, _ in ranked if v.ray_node_id not in tried), None)
                pg, node_id = self._reserve(bundle, target.ray_node_id if target else None, deadline, views)
                view = live.get(node_id)
                if view is None:
                    rejected.append(pg)             # a node without a live agent: hold it, try elsewhere
                    tried.add(node_id)
                    if len(rejected) > len(views) + 1:
                        raise NoCapacity("only nodes without a live dsec agent had the capacity")
                    continue
                if profile and view.warm.get(profile, 0) > 0:
                    view.warm[profile] -= 1         # until the next refresh: spread the warm claims
                left = max(1.0, deadline - time.monotonic())
                try:
                    out = ray.get(view.actor.create.remote(dict(spec, wait=True, timeout=left), self.holder),
                                  timeout=left + 10)
                except (ray.exceptions.GetTimeoutError, *_ray_errors()) as e:
                    self._release(pg)
                    raise ClusterError(f"node {view.name} did not create the sandbox: "
                                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
                if out[0] == "unavailable":        # the agent went down since the state was read
                    self._release(pg)
                    views = self.nodes(refresh=True)
                    tried.add(node_id)
                    continue
                try:
                    info = _raise(out)
                except BaseException:
                    self._release(pg)
                    raise
                sb = ClusterSandbox(info.sandbox_id, view.name, node_id, view.actor, pg, info, self)
                with self._lock:
                    view.state["sandboxes"] = view.state.get("sandboxes", 0) + 1
                self._watch(sb)
                return sb
        finally:
            for pg in rejected:
                self._release(pg)

    def _profile_spec(self, profile: str, views: list[NodeView]) -> dict:
        for v in views:
            sp = (v.state.get("warm_specs") or {}).get(profile)
            if sp is not None:
                keys = ("cpus", "memory", "pids", "policy", "mode", "network", "rootfs", "user", "workdir", "env")
                return {k: sp[k] for k in keys if sp.get(k) not in (None, {}, "")}
        raise ClusterError(f"no registered node has a warm-pool profile {profile!r} "
                           f"(nodes: {', '.join(v.name for v in views) or 'none'})")

    def _reserve(self, bundle: dict, target: str | None, deadline: float, views) -> tuple:
        from ray.util import placement_group, placement_group_table
        pg = placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=target)
        if not pg.wait(max(0.0, deadline - time.monotonic())):
            self._release(pg)
            avail = "; ".join(f"{v.name}: {v.state.get('sandboxes', '?')} placed"
                              + ("" if v.alive else f" (down: {v.reason})") for v in views)
            raise NoCapacity(f"no node had {bundle} free in time ({avail})")
        node_id = placement_group_table(pg)["bundles_to_node_id"][0]
        return pg, node_id

    @staticmethod
    def _release(pg):
        try:
            from ray.util import remove_placement_group
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass

    # -------------------------------------------------------------- node loss

    def _watch(self, sb: ClusterSandbox):
        with self._lock:
            self._handles[sb.id] = sb
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._monitor_loop, name="dsec-cluster-monitor", daemon=True)
                self._monitor.start()

    def sandboxes(self) -> list[ClusterSandbox]:
        """The handles this client placed that are neither closed nor lost."""
        with self._lock:
            return [h for h in self._handles.values() if not h.closed and h.lost is None]

    def _monitor_loop(self):
        while not self._stop.wait(self.monitor_interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the monitor never dies of one bad round
                log.exception("cluster monitor round failed")

    def check(self) -> list[ClusterSandbox]:
        """One monitor round (also called by the thread): which handles were lost. Returns them."""
        import ray
        with self._lock:
            unrecorded = [h for h in self._handles.values() if h.lost is not None and h._unrecorded]
            for sid in [s for s, h in self._handles.items() if h.closed or h.lost is not None]:
                del self._handles[sid]
            open_ = list(self._handles.values())
        for h in unrecorded:
            h._unrecorded = False
        self._record([(h, h.lost) for h in unrecorded])
        if not open_:
            return []
        by_node: dict[str, list[ClusterSandbox]] = {}
        for h in open_:
            by_node.setdefault(h.ray_node_id, []).append(h)
        dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
        lost: list[tuple[ClusterSandbox, str, bool]] = []      # (handle, reason, record it here)
        refs = {}
        for node_id, hs in by_node.items():
            if node_id in dead:
                why = f"lost: node {hs[0].node}'s raylet died (Ray node {node_id[:12]} is dead)"
                lost += [(h, why, True) for h in hs]
            else:
                refs[hs[0]._actor.status.remote([h.id for h in hs])] = hs
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STATE_TIMEOUT)
            for ref in ready:
                hs = refs[ref]
                try:
                    st = _raise(ray.get(ref))
                except _ray_errors() as e:
                    why = f"lost: the node actor of {hs[0].node} died ({str(e).splitlines()[0][:200] if str(e) else ''})"
                    lost += [(h, why, True) for h in hs]
                    continue
                except ClusterError:
                    continue
                lost += [(h, st["lost"][h.id], False) for h in hs if h.id in st["lost"]]
        lost = [(h, why, here) for h, why, here in lost if h._mark_lost(why)]
        self._record([(h, why) for h, why, here in lost if here])
        for h, why, _ in lost:
            if self.on_lost is not None:
                try:
                    self.on_lost(h, why)
                except Exception:  # noqa: BLE001
                    log.exception("on_lost callback failed for %s", h.id)
        return [h for h, _, _ in lost]

    def _record(self, items: list[tuple[ClusterSandbox, str]]):
        """Record raylet-death losses through a live node's actor (the dead node's is gone)."""
        if not items:
            return
        nodes = {h.node for h, _ in items}
        live = [v for v in self.nodes(refresh=True) if v.alive and v.name not in nodes]
        if not live:
            log.error("%d lost sandbox(es) cannot be recorded: no live node actor", len(items))
            return
        live[0].actor.record_lost.remote([{"sandbox_id": h.id, "reason": why, "cause": "raylet", "node": h.node}
                                          for h, why in items])

    def close(self):
        """Stop the monitor (sandboxes stay as they are: close them first)."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


__all__ = ["ClusterClient", "ClusterSandbox", "NoCapacity", "SandboxLost", "Unsupported"]
