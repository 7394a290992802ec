"""The node agent's snapshots (docs/snapshots.md): Snapshot(sandbox) and the
forks of CreateSandbox(from_snapshot=...).

    snap = agent.snapshots.take(sandbox_id)      # lifecycle: snapshotting -> snapshotted | snapshot_failed
    agent.snapshots.restore(sandbox_id, snap_id) # lifecycle: restoring -> restored | restore_failed
    agent.snapshots.fork_spec(spec, snapshot_id) # a new sandbox's layers, context and lineage

"snapshotting" is a lifecycle state of the sandbox with its own timeout and
retries (agent/sandbox/snapshots.py: the cgroup freezer, FREEZE_TIMEOUT_S,
RETRIES); steps may run meanwhile (they are frozen for the copy), and one
snapshot of a sandbox is taken at a time.
"""
from __future__ import annotations

import threading

from audit_schema.errors import ReportedError
from agent.node.authz import ADMIN
from agent.node.records import RUNNING, ApiError, _bad


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
        return {"store": self.store.root if self.store else None, "filesystem": True,
                "processes": self.criu if self.store else None}

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

    def take(self, sid: str, caller=ADMIN) -> dict:
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
        a._lifecycle(rec.id, "snapshotting", step=step)
        a._flush_emits()
        try:
            snap = self.store.take(sb, ctx)
        except ReportedError as e:
            a._lifecycle(rec.id, "snapshot_failed", step=step, reason=e.message)
            a._flush_emits()
            raise ApiError("FAILED_PRECONDITION" if e.code == 2 else "INTERNAL", e.message) from None
        finally:
            with self._lock:
                self._busy.discard(rec.id)
        a._lifecycle(rec.id, "snapshotted", step=step, snapshot=snap["id"], files=snap["files"],
                     bytes=snap["bytes"], frozen_ms=snap["frozen_ms"], total_ms=snap["total_ms"],
                     attempts=snap["attempts"], image_digest=(sp.image or {}).get("digest"))
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
        try:
            r = restore(self.store, sb, snap, a.images, force=force)
        except ReportedError as e:
            a._lifecycle(rec.id, "restore_failed", step=rec.steps, snapshot=snap["id"], reason=e.message)
            a._flush_emits()
            raise ApiError("FAILED_PRECONDITION" if e.code == 2 else "INTERNAL", e.message) from None
        finally:
            with self._lock:
                self._busy.discard(rec.id)
        a._lifecycle(rec.id, "restored", step=rec.steps, snapshot=snap["id"], snapshot_step=snap["step"],
                     total_ms=r["total_ms"])
        a._flush_emits()
        return r

    def fork_spec(self, spec, ref: str, req: dict, caller=ADMIN):
        """The spec of a sandbox forked from snapshot `ref` (agent/sandbox/snapshots.py fork_spec)."""
        from agent.sandbox.snapshots import fork_spec
        snap = self._snapshot(ref, caller, "CreateSandbox")
        try:
            fork_spec(spec, snap, self.store, self.agent.images, user=req.get("user"), workdir=req.get("workdir"))
        except ReportedError as e:
            raise _bad(e.message) from None
        return snap
