"""The audit recorder of one dsec process: eBPF sensor -> durable spool.

    rec = Recorder(node)                 # compiles and attaches the eBPF programs once
    rec.watch(sandbox_id, cgroup_id)     # before the sandbox's first process exists
    rec.started(cgroup_id, supervisor_pid)
    rec.record({...})                    # the launcher's own records (sandbox_start/exit)
    stats = rec.unwatch(cgroup_id)       # after the sandbox is gone: drains, reports losses
    rec.close()

A background thread polls the ring buffer and appends decoded records to the
spool in batches; the spool is the durable hand-off to the exporters. The
recorder knows no sink.
"""
from __future__ import annotations

import os
import threading
import time

from agent.errors import DsecError
from audit_schema.events import normalize


class Recorder:
    def __init__(self, node: str | None = None, spool=None, **sensor_options):
        from agent.bpf_loader import AuditSensor
        from agent.spool import Spool
        self.node = node or os.uname().nodename
        self.spool = spool or Spool()
        self._pending: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._instance = os.urandom(8).hex()
        self.stopped: dict[int, int] = {}
        self.policies: dict[str, object] = {}      # sandbox id -> Policy (decision stamping)
        self.sensor = AuditSensor(on_record=self._on_record, node=self.node,
                                  on_over_budget=self._on_over_budget, **sensor_options)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dsec-audit-poll", daemon=True)
        self._thread.start()

    # -- records ----------------------------------------------------------------------
    def _on_record(self, rec: dict):
        pol = self.policies.get(rec.get("sandbox_id"))
        if pol is not None and not rec.get("decision"):
            from policies.evaluate import decision
            rec["decision"] = decision(pol, rec)
        with self._lock:
            self._pending.append(rec)

    def _on_over_budget(self, cgroup_id, sandbox_id, lost):
        self.stopped[cgroup_id] = lost

    def _flush_pending(self):
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self.spool.append_many(batch)

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.sensor.poll(20)
                self._flush_pending()
            except BaseException as e:  # noqa: BLE001 - surfaced by close()/unwatch()
                self._error = e
                time.sleep(0.1)

    def new_event_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self._instance}{self._seq:016x}"

    def record(self, rec: dict):
        """A record of the launcher's own (sandbox_start, sandbox_exit ...)."""
        rec = dict(rec)
        pol = self.policies.get(rec.get("sandbox_id"))
        if pol is not None:
            for k, v in pol.identity().items():
                rec.setdefault(k, v)
            rec.setdefault("decision", "allowed")
        rec.setdefault("event_id", self.new_event_id())
        rec.setdefault("ts_ns", time.time_ns())
        rec.setdefault("node", self.node)
        self.spool.append_many([normalize(rec)])

    # -- sandboxes ----------------------------------------------------------------------
    def watch(self, sandbox_id: str, cgroup_id: int, policy=None, **labels):
        if policy is not None:
            self.policies[sandbox_id] = policy
            labels.update(policy.identity())
        self.sensor.add_sandbox(cgroup_id, sandbox_id, **labels)

    def started(self, cgroup_id: int, pid: int):
        self.sensor.set_root_pid(cgroup_id, pid)

    def catch_up(self):
        """Decode (and enrich) everything the kernel has emitted so far."""
        self.sensor.drain()
        self._flush_pending()

    def unwatch(self, cgroup_id: int) -> dict:
        stats = self.sensor.remove_sandbox(cgroup_id)
        self._flush_pending()
        if self._error:
            raise DsecError(f"audit pipeline failed: {self._error}")
        return stats

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.sensor.close()
        finally:
            self._flush_pending()
