"""The node agent's snapshots (docs/snapshots.md): Snapshot(sandbox) and the
forks of CreateSandbox(from_snapshot=...).

    snap = agent.snapshots.take(sandbox_id)      # lifecycle: snapshotting -> snapshotted | snapshot_failed
    agent.snapshots.restore(sandbox_id, snap_id) # lifecycle: restoring -> restored | restore_failed
    agent.snapshots.fork_spec(spec, snapshot_id) # a new sandbox's layers, context and lineage
    agent.snapshots.after_step(rec)              # automatic snapshots (config `snapshots`, or the request's)
    agent.snapshots.release(spec)                # the sandbox ended: its lease on its snapshots goes

"snapshotting" is a lifecycle state of the sandbox with its own timeout and
retries (agent/sandbox/snapshots.py: the cgroup freezer, FREEZE_TIMEOUT_S,
RETRIES); steps may run meanwhile (they are frozen for the copy), and one
snapshot of a sandbox is taken at a time.

Automatic snapshots are taken right after a step ends, before its reply and
while the step lock is held (so the snapshot is the state the step left);
retention then removes the sandbox's older automatic ones that nothing uses.
A fork or a restored sandbox holds a lease on its snapshots in the store
(SnapshotStore.lease), released when it ends.
"""
from __future__ import annotations

import logging
import threading

from audit_schema.errors import ReportedError
from agent.node.authz import ADMIN
from agent.node.records import ENDED, RUNNING, ApiError, _bad

log = logging.getLogger("dsec.agent")


class NodeSnapshots:
    def __init__(self, agent):
        self.agent = agent
        self._busy: set[str] = set()
        self.criu: dict = {}
        self._lock = threading.Lock()
        self.store = None

    def open(self):
        from agent.sandbox.snapshots import SnapshotStore, criu_feature
        self.store = SnapshotStore()
        self.criu = criu_feature()
        return self.store

    def report(self) -> dict:
        """For Capabilities: where snapshots live, and whether they can hold processes."""
        c = self.agent.cfg.snapshots
        return {"store": self.store.root if self.store else None, "filesystem": True,
                "processes": self.criu if self.store else None,
                "auto": {"every_steps": c.every_steps, "retention": c.retention}, "disk_budget": c.disk_budget}

    def _snapshot(self, ref: str, caller, method: str) -> dict:
        """A snapshot the caller may use: of a sandbox of its own tenant (the labels
        the snapshot recorded); unknown and foreign ones are refused alike."""
        try:
            snap = self.store.get(ref)
        except ReportedError as e:
            if not caller.admin:
                self.agent.authz.check_sandbox(caller, {}, f"snapshot {ref}", method)
            raise _bad(e.message) from None
        labels = (snap.get("context") or {}).get("labels") or {}
        self.agent.authz.check_sandbox(caller, labels, f"snapshot {ref}", method)
        return snap

    def policy(self, rec) -> tuple[int, int]:
        """(every_steps, retention) of a sandbox: its request's auto_snapshot, else the config's."""
        own = getattr(rec.spec, "auto_snapshot", None)
        c = self.agent.cfg.snapshots
        if own is not None:
            return int(own.get("every_steps") or 0), int(own.get("retention") or 0)
        return c.every_steps, c.retention

    def after_step(self, rec) -> None:
        """After a step of `rec` ended (steps.py, under its step lock): the automatic snapshot
        the policy asks for. A failure is recorded (snapshot_failed) and logged; the step's
        result stands."""
        every, _ = self.policy(rec)
        sp = rec.spec
        if every <= 0 or self.store is None or rec.steps <= 0 or rec.steps % every or \
                not (sp.layers or sp.rootfs) or getattr(rec, "frozen", False) or \
                rec.state != RUNNING or rec.stop_kind is not None:
            return
        try:
            self.take(rec.id, auto=True)
        except ApiError as e:
            log.warning("sandbox %s: automatic snapshot after step %d: %s", rec.id, rec.steps, e.message)

    def _retention(self, rec, keep: int, new_id: str | None = None) -> list[dict]:
        """The sandbox's automatic snapshots retention removes once `new_id` exists: all but
        the newest `keep` (0: none removed), those nothing uses (no lease, no child snapshot)."""
        if keep <= 0:
            return []
        mine = [s for s in self.store.list() if s.get("auto") and s["sandbox_id"] == rec.id and s["id"] != new_id]
        old = mine[:max(0, len(mine) - (keep - 1))]
        parents = {c for s in self.store.list() for c in s.get("chain", [])}
        used = {x for lease in self.store.leases() for x in lease.get("snapshots", [])}
        return [s for s in old if s["id"] not in parents and s["id"] not in used]

    def take(self, sid: str, caller=ADMIN, auto: bool = False) -> dict:
        a = self.agent
        rec = a.lookup(sid, caller, "Snapshot")
        with a._lock:
            if rec.state != RUNNING or rec.sandbox is None:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: only a running sandbox "
                                                      f"can be snapshotted")
            sb = rec.sandbox
            step = rec.steps
        with self._lock:
            if rec.id in self._busy:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is already snapshotting")
            self._busy.add(rec.id)
        sp = sb.spec
        ctx = {"step": step, "env": dict(sb.env), "workdir": sp.workdir, "user": sp.user,
               "uid": sb.uid, "gid": sb.gid, "labels": dict(rec.labels)}
        a._lifecycle(rec.id, "snapshotting", step=step, auto=auto or None)
        a._flush_emits()
        keep = self.policy(rec)[1] if auto else 0
        try:
            freed = [s["id"] for s in self._retention(rec, keep)] if keep else []
            snap = self.store.take(sb, ctx, budget=a.cfg.snapshots.disk_budget, freed=freed, auto=auto)
        except ReportedError as e:
            a._lifecycle(rec.id, "snapshot_failed", step=step, reason=e.message)
            a._flush_emits()
            raise ApiError("FAILED_PRECONDITION" if e.code == 2 else "INTERNAL", e.message) from None
        finally:
            with self._lock:
                self._busy.discard(rec.id)
        a._lifecycle(rec.id, "snapshotted", step=step, snapshot=snap["id"], files=snap["files"],
                     bytes=snap["bytes"], frozen_ms=snap["frozen_ms"], total_ms=snap["total_ms"],
                     attempts=snap["attempts"], image_digest=(sp.image or {}).get("digest"), auto=auto or None)
        for old in self._retention(rec, keep, snap["id"]) if keep else []:
            try:
                self.store.remove(old["id"])
            except ReportedError as e:            # taken into use meanwhile: kept
                log.info("sandbox %s: retention keeps snapshot %s: %s", rec.id, old["id"][:12], e.message)
                continue
            a._lifecycle(rec.id, "snapshot_removed", step=step, snapshot=old["id"], snapshot_step=old["step"],
                         reason=f"retention {keep}")
        a._flush_emits()
        return snap

    def restore(self, sid: str, ref: str, force: bool = False, caller=ADMIN) -> dict:
        from agent.sandbox.snapshots import restore
        a = self.agent
        rec = a.lookup(sid, caller, "Restore")
        snap = self._snapshot(ref, caller, "Restore")
        with a._lock:
            if rec.state != RUNNING or rec.sandbox is None:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: only a running sandbox "
                                                      f"can be restored")
            sb = rec.sandbox
        with self._lock:
            if rec.id in self._busy:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is snapshotting or restoring")
            self._busy.add(rec.id)
        a._lifecycle(rec.id, "restoring", step=rec.steps, snapshot=snap["id"], force=force)
        a._flush_emits()
        lease = None
        try:
            # leased first: `snapshot rm` cannot take it away meanwhile (the old lease stays
            # until the switch: a failed restore leaves the sandbox on its old layers)
            lease = self.store.lease(rec.id, [snap], "restore")
            snap = self.store.get(snap["id"])
            r = restore(self.store, sb, snap, a.images, force=force)
        except (ReportedError, OSError) as e:       # OSError: the sandbox's dir went under it (an end)
            self.store.release(lease)
            msg = e.message if isinstance(e, ReportedError) else \
                f"sandbox {rec.id} ended during the restore ({e.strerror or e})"
            a._lifecycle(rec.id, "restore_failed", step=rec.steps, snapshot=snap["id"], reason=msg)
            a._flush_emits()
            code = "FAILED_PRECONDITION" if isinstance(e, OSError) or e.code == 2 else "INTERNAL"
            raise ApiError(code, msg) from None
        finally:
            with self._lock:
                self._busy.discard(rec.id)
        # the lease switch under the agent's lock, where the sandbox's end releases its lease
        # (_retire -> release): a sandbox that ended meanwhile does not keep the new one
        with a._lock:
            ended = rec.state in ENDED
            old_lease = None if ended else getattr(sb.spec, "snapshot_lease", None)
            if not ended:
                sb.spec.snapshot_lease = lease
        self.store.release(lease if ended else old_lease)
        a._lifecycle(rec.id, "restored", step=rec.steps, snapshot=snap["id"], snapshot_step=snap["step"],
                     total_ms=r["total_ms"])
        a._flush_emits()
        return r

    def fork_spec(self, spec, ref: str, req: dict, caller=ADMIN):
        """The spec of a sandbox forked from snapshot `ref` (agent/sandbox/snapshots.py fork_spec)."""
        from agent.sandbox.snapshots import fork_spec
        snap = self._snapshot(ref, caller, "CreateSandbox")
        lease = self.store.lease(spec.sandbox_id, [snap], "fork")
        try:
            snap = self.store.get(snap["id"])       # not removed before the lease was taken
            fork_spec(spec, snap, self.store, self.agent.images, user=req.get("user"), workdir=req.get("workdir"))
        except ReportedError as e:
            self.store.release(lease)
            raise _bad(e.message) from None
        spec.snapshot_lease = lease
        return snap

    def release(self, spec) -> None:
        """A sandbox ended (or was never created): its lease on its snapshots goes."""
        lease = getattr(spec, "snapshot_lease", None)
        if self.store is None or not lease:
            return
        try:
            self.store.release(lease)
            spec.snapshot_lease = None
        except OSError as e:
            log.error("sandbox %s: releasing its snapshot lease: %s", spec.sandbox_id, e)
