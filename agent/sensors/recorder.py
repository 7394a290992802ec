"""The audit recorder of one dsec process: eBPF sensors -> durable spool.

    rec = Recorder(node)                    # compiles and attaches the eBPF programs once
    rec.watch(sandbox_id, cgroup_id, policy=p, cgroup_path=path)   # before any process of the sandbox's
    rec.started(cgroup_id, supervisor_pid)  # enforcement starts here (the supervisor is exempt)
    rec.set_step(cgroup_id, 2)
    rec.record({...})                       # the launcher's own records (sandbox_start/exit ...):
                                            # spooled (durable, per DSEC_SPOOL_FSYNC) when it returns
    t = rec.record({...}, wait=False)       # queued only: returns a ticket at once
    rec.wait_durable(t, timeout=5)          # True once that record and every one before it is spooled
    rec.flush(timeout=5)                    # everything queued so far (same as waiting on the last ticket)
    stats = rec.unwatch(cgroup_id)          # after the sandbox is gone: drains, reports losses
    stats = rec.unwatch(cgroup_id, flush=False)   # ... queued only (t = rec.ticket()); then
    rec.append_with(agent_records)          # another writer's records and the queue in one append
    rec.make_durable(t, timeout=5)          # (or this, if that could not be done)
    rec.close()

Two sensors, one per concern (Tetragon style): the audit sensor (exec, fork,
exit, connect, file writes; agent/sensors/audit.py) and the enforcement sensor
(egress, exec allowlist, syscall violations and learn-mode counts;
agent/sensors/enforce.py). A background thread polls both and appends decoded
records to a queue, and appends the queue to the spool once 1,024 records
wait or the oldest has waited 10 ms (COALESCE_*; ~20 ms when idle: the
poll's wait) in one batch: one append_many, i.e. one write and one
fdatasync per batch (group commit). The spool is the durable hand-off to the
exporters. (A writer thread of its own was measured, bench/audit.py part 2:
no gain -- the fdatasync is ~1% of the poll thread's time, the rest is
Python work that holds the interpreter lock either way -- and the hand-offs
between the two threads cost ~15% more CPU per event.) The recorder knows no sink.
Taps (add_tap) see every record as it is spooled (live streams).

Tickets. Records are spooled in the order they were queued, one queue for the
kernel's records and the launcher's own. A ticket is the number of records
queued so far, taken when a record is queued; wait_durable(ticket) returns
True once the spool holds that record and every record queued before it
(durable as DSEC_SPOOL_FSYNC says: fsync "always", the default, survives a
power loss), False at the timeout (an append error is logged, counted in
append_errors, kept queued and retried; unwatch() raises it). So a step's end
record is durable before a later record simply by being queued first, and
before close by rec.wait_durable(t) or rec.flush(); record() with wait=True
(the default) does that wait itself, in the calling thread.

Every record is stamped with the policy's name, hash and mode and a decision
(policies/evaluate.py) unless the sensor set one itself.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from agent.errors import DsecError, EXIT_DSEC, EXIT_USAGE, ReportedError
from audit_schema.events import normalize
# per record, on the poll thread: imported once here
from policies.evaluate import aggregable_kinds, decision, layout_refusal, mark_refused_anyway
from agent.sensors.denials import AGGREGATED, SKIP_KINDS as AGGREGATE_SKIP, DenialAggregator
from agent.sensors.permcheck import SandboxRoots

log = logging.getLogger("dsec.audit")
# what dsec-init (PID 1) does on dsec's behalf and is not recorded as the sandbox's
INIT_OWN_KINDS = ("open_write", "unlink", "rename")
COALESCE_RECORDS = 1024     # the poll thread appends at this many records queued ...
COALESCE_S = 0.01           # ... or once the oldest has waited this long (group commit)


class Recorder:
    def __init__(self, node: str | None = None, spool=None, *, enforce: bool = True, **sensor_options):
        from agent.sensors.audit import AuditSensor
        from exporters.spool import Spool
        self.node = node or os.uname().nodename
        self.spool = spool or Spool()
        self._pending: list[dict] = []
        self._pending_since = 0.0                 # monotonic time the oldest pending record was queued
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()       # one append at a time: batches stay in order
        self._update_lock = threading.Lock()      # update_policy against unwatch's removal from _watched
        self._durable_cv = threading.Condition(self._lock)
        self._queued = 0                          # records ever queued (tickets count these)
        self._spooled = 0                         # of which appended to the spool, in order
        self._dropped: list[tuple[int, int]] = []  # ticket ranges (a, b] the spool dropped (disk budget)
        self.append_errors = 0
        self._seq = 0
        self._instance = os.urandom(8).hex()
        self._error: BaseException | None = None        # the last append failure, until one succeeds
        self._poll_error: BaseException | None = None   # the last poll failure, until one succeeds
        self.stopped: dict[int, int] = {}               # cgroup id -> losses that stopped it (while watched)
        self.policies: dict[str, object] = {}      # sandbox id -> Policy (decision stamping)
        self.images: dict[str, str] = {}           # sandbox id -> image manifest digest (every row)
        self.init_pids: dict[str, int] = {}        # sandbox id -> host pid of its dsec-init (PID 1)
        self.init_own: dict[str, int] = {}         # sandbox id -> kernel records of dsec-init's own, not recorded
        self._watched: dict[int, dict] = {}        # cgroup id -> {sandbox_id, policy, path, enforced}
        self._taps: list = []
        self.denials = DenialAggregator(self.new_event_id)    # identical denials: one record + a count
        self.roots = SandboxRoots()                 # enforce-mode sandboxes' roots: EROFS writes refused anyway?
        self.enforcer = None
        self.enforce_error = None
        # one after the other: BCC/LLVM crash when two modules compile at once. The
        # enforcement sensor first: the audit sensor opens its pinned cwd maps (a
        # relative exec's record carries the cwd the exec check uses, issue 21)
        if enforce:
            self._load_enforcer()
        if isinstance(self.enforce_error, BaseException):
            raise self.enforce_error
        pins = self.enforcer.cwd_pins if self.enforcer is not None else None
        try:
            self.sensor = AuditSensor(on_record=self._on_record, node=self.node,
                                      on_over_budget=self._on_over_budget, cwd_pins=pins, **sensor_options)
        except BaseException:
            if self.enforcer is not None:
                self.enforcer.close()
            raise
        self.sensor.on_records = self._on_records
        if self.enforcer is not None:
            self.enforcer.on_records = self._on_records
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsec-audit-poll", daemon=True)
        self._thread.start()

    def _load_enforcer(self):
        try:
            from agent.sensors.enforce import EnforcementSensor
            self.enforcer = EnforcementSensor(on_record=self._on_record, node=self.node)
        except ReportedError as e:
            # reported by watch(): enforce-mode sandboxes refuse to start; others run degraded
            self.enforce_error = e.message
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self.enforce_error = e

    # -- records ----------------------------------------------------------------------
    def _on_record(self, rec: dict):
        self._on_records([rec], [0])

    def _on_records(self, recs: list[dict], taken: list) -> None:
        """A sensor's backlog in one call (RingSensor.on_records), one queue
        operation for the lot; taken[0]: how many are done (queued at the end,
        also when one raises). Per record: a write of dsec-init's own (the
        sandbox's PID 1 is dsec-init, it never runs workload code: every step is
        a forked child that execs; its sysctls and its own oom_score_adj are
        dsec's doing, and recorded they would be learned and flagged as the
        workload's) is counted so that the kernel's emitted count still adds up
        (unwatch: "init_own"), not kept; the rest get the image digest, the
        policy's decision, and go through the denial aggregator."""
        out = []
        append = out.append
        init_pids, images, policies, offer = self.init_pids, self.images, self.policies, self.denials.offer
        last_sid = ent = None            # the sandbox's (init pid, image digest, policy): looked up once a run
        try:
            for rec in recs:
                sid = rec.get("sandbox_id")
                if sid != last_sid or ent is None:
                    last_sid, ent = sid, (init_pids.get(sid), images.get(sid), policies.get(sid))
                init_pid, img, pol = ent
                kind = rec.get("kind")
                if init_pid and kind in INIT_OWN_KINDS and rec.get("pid") == init_pid:
                    # occurrences: a summary of repeats counted in the kernel stands for `count`
                    self.init_own[sid] = self.init_own.get(sid, 0) + (rec.get("count") or 1)
                    taken[0] += 1
                    continue
                if img and not rec.get("image_digest"):
                    rec["image_digest"] = img
                if pol is not None and not rec.get("decision"):
                    if pol.mode == "enforce" and layout_refusal(rec):
                        mark_refused_anyway(rec, self.roots.refused_anyway(sid, rec))
                    rec["decision"] = decision(pol, rec)
                if rec.get("decision") in AGGREGATED and kind not in AGGREGATE_SKIP:
                    out.extend(offer(rec))      # identical denials: one record + counted summaries
                else:
                    append(rec)                 # what offer() returns for it, without the call
                taken[0] += 1
        finally:
            if out:
                self._queue(out)

    def _queue(self, recs: list[dict]) -> int:
        """Queue records for the next append; returns the ticket of the last."""
        with self._lock:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.extend(recs)
            self._queued += len(recs)
            return self._queued

    def _batch_ready(self) -> bool:
        """The poll thread appends once COALESCE_RECORDS records wait or the oldest
        has waited COALESCE_S: the decoder now keeps up in a few ms per poll, and
        an append per poll made batches of tens of records (more fdatasyncs, and
        frames under BATCH_MIN become frames of one record, which cost the
        exporters several times more to read). flush()/catch_up()/unwatch() and
        record(wait=True) append at once."""
        with self._lock:
            n = len(self._pending)
            return n >= COALESCE_RECORDS or (n and time.monotonic() - self._pending_since >= COALESCE_S)

    def _on_over_budget(self, cgroup_id, sandbox_id, lost):
        """over_budget="stop": the kernel killed the process that overflowed; stop the
        rest of the sandbox too, so its record ends instead of having holes."""
        w = self._watched.get(cgroup_id)
        if w is None:
            return              # unwatched meanwhile: nothing to stop, nothing to keep
        self.stopped[cgroup_id] = lost
        path = w and w.get("path")
        if path:
            try:
                with open(os.path.join(path, "cgroup.kill"), "w") as f:
                    f.write("1")
            except OSError:
                pass

    def add_tap(self, fn):
        """fn(records: list[dict]) is called with every batch as it is spooled."""
        with self._lock:
            self._taps.append(fn)

    def remove_tap(self, fn):
        with self._lock:
            if fn in self._taps:
                self._taps.remove(fn)

    def append_with(self, records: list[dict], on_locked=None) -> bool:
        """`records` (another writer's on the same spool, normalized: the node agent's
        lifecycle and sandbox records) and then every record queued here, in one durable
        append (one fdatasync): a closing sandbox's sandbox_exit and its last kernel
        records, queued by catch_up/unwatch(flush=False), durable together. Only when no
        append of this recorder is under way: never waits for one (the node agent calls
        it from its own append, which this recorder's appends may wait for at the spool's
        gate). Returns whether `records` were appended; False: nothing of them was (the
        lock was busy, nothing is queued here, or that append failed: then what is queued
        here went alone, or stays queued and is retried, as ever) -- the caller appends
        them itself. on_locked: the spool's (Spool.append_many)."""
        try:
            return bool(records) and self._flush_pending(before=records, on_locked=on_locked, wait=False)
        except BaseException:  # noqa: BLE001 - ours alone failed: kept queued, logged, retried
            return False

    def ticket(self) -> int:
        """The ticket of the last record queued so far (wait_durable, make_durable)."""
        with self._lock:
            return self._queued

    def make_durable(self, ticket: int, timeout: float | None = None) -> bool:
        """wait_durable(ticket), appending in this thread what is queued when no append
        has taken it yet (as unwatch() did before it returned)."""
        if self.wait_durable(ticket, 0):
            return True
        try:
            self._flush_pending()
        except BaseException:  # noqa: BLE001 - kept queued, logged, retried by the poll thread
            pass
        return self.wait_durable(ticket, timeout)

    def _flush_pending(self, before: list | None = None, on_locked=None, wait: bool = True) -> bool:
        """Append what is pending to the spool. A batch leaves the queue only once
        the spool has it: an append that fails puts it back in front (in order)
        and the poll thread retries; a record the spool finds invalid (a bug
        upstream) is replaced by an events_lost record (reason invalid_record)
        instead of blocking the others. The error flag clears at the next
        append that succeeds. `before` (append_with): records to append ahead of
        ours in the same append; returns whether they were (ours go alone if that
        append fails). wait=False: nothing is done while another append of ours
        is under way."""
        if not self._flush_lock.acquire(blocking=wait):
            return False
        try:
            with self._lock:
                batch, self._pending = self._pending, []
                taps = list(self._taps)
            if not batch:
                return False
            written = None
            if before:
                try:
                    both = before + batch
                    written = self.spool.append_many(both, on_locked) if on_locked else self.spool.append_many(both)
                except BaseException:  # noqa: BLE001 - ours alone below, with the handling of every append
                    before = None
            if written is None:
                try:
                    try:
                        written = self.spool.append_many(batch)
                    except ReportedError as e:
                        if e.code != EXIT_USAGE:
                            raise
                        batch = [self._valid_or_gap(r) for r in batch]
                        written = self.spool.append_many(batch)
                except BaseException as e:
                    with self._lock:
                        self._pending[:0] = batch
                    if self._error is None:
                        log.error("audit record spooling failed (%d record(s) kept queued, retried): %s",
                                  len(self._pending), e)
                    self._error = e
                    self.append_errors += 1
                    raise
            if self._error is not None:
                log.warning("audit record spooling works again (%d failed attempt(s))", self.append_errors)
            self._error = None
            with self._lock:
                start = self._spooled
                self._spooled += len(batch)         # the batch was the queue's head: order kept
                if not written:                     # dropped over the disk budget (recorded as events_lost)
                    self._dropped = self._dropped[-63:] + [(start, self._spooled)]
                self._durable_cv.notify_all()
            # under the flush lock: taps see batches in spool order, and a flush that returns
            # has had every batch before it tapped (learning reads a run's records once its
            # sandbox's end was flushed)
            for fn in taps:
                try:
                    fn(batch)
                except Exception:  # noqa: BLE001 - a slow or broken listener never stops recording
                    pass
        finally:
            self._flush_lock.release()
        return bool(before)

    def _valid_or_gap(self, rec: dict) -> dict:
        from exporters.spool import validate_record
        try:
            return validate_record(rec)
        except ReportedError as e:
            log.error("invalid audit record replaced by a gap marker: %s", e.message)
            return normalize({"event_id": self.new_event_id(), "ts_ns": time.time_ns(), "node": self.node,
                              "sandbox_id": str(rec.get("sandbox_id") or "") if isinstance(rec, dict) else "",
                              "kind": "events_lost", "count": 1,
                              "extra": json.dumps({"reason": "invalid_record", "error": e.message[:500],
                                                   "kinds": {str(rec.get("kind")): 1}})})

    def _loop(self):
        backoff = 0.05
        while not self._stop.is_set():
            failed = False
            try:
                self.sensor.poll(20)
                if self.enforcer is not None:
                    self.enforcer.poll(0)
                self._poll_error = None
                self._add_summaries(self.denials.due())
            except BaseException as e:  # noqa: BLE001 - surfaced by close()/unwatch()
                if self._poll_error is None:
                    log.error("audit sensor poll failed (retrying): %s", e)
                self._poll_error = e
                failed = True
            try:
                if failed or self._batch_ready():
                    self._flush_pending()
            except BaseException:  # noqa: BLE001 - kept queued, logged, retried here
                failed = True
            if failed:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            else:
                backoff = 0.05

    def wait_durable(self, ticket: int, timeout: float | None = None) -> bool:
        """True once the record of `ticket` (and every record queued before it) is
        in the spool; False if `timeout` seconds pass first (the append error, if
        any, is in the log and raised by the next unwatch()), or if the spool
        dropped the record's batch over its disk budget (the spool recorded the
        loss as events_lost: exporters/spool.py)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._spooled < ticket:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._durable_cv.wait(left if left is not None else 1.0)
            return not any(a < ticket <= b for a, b in self._dropped)

    def flush(self, timeout: float | None = None) -> bool:
        """wait_durable() for everything queued so far."""
        with self._lock:
            ticket = self._queued
        return self.wait_durable(ticket, timeout)

    def _add_summaries(self, recs: list[dict]):
        if recs:
            self._queue([normalize(r) for r in recs])

    def new_event_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self._instance}{self._seq:016x}"

    def record(self, rec: dict, wait: bool = True) -> int:
        """A record of the launcher's own (sandbox_start, sandbox_exit ...); returns
        its ticket. wait=True: appended in this thread before returning (an append
        error stays queued for the poll thread to retry; unwatch() reports it);
        wait=False: queued, the poll thread appends it within ~20 ms (wait_durable(ticket))."""
        rec = dict(rec)
        img = self.images.get(rec.get("sandbox_id"))
        if img:
            rec.setdefault("image_digest", img)
        pol = self.policies.get(rec.get("sandbox_id"))
        if pol is not None:
            for k, v in pol.identity().items():
                rec.setdefault(k, v)
            rec.setdefault("decision", "allowed")
        rec.setdefault("event_id", self.new_event_id())
        rec.setdefault("ts_ns", time.time_ns())
        rec.setdefault("node", self.node)
        ticket = self._queue([normalize(rec)])
        if wait:
            try:
                self._flush_pending()
            except BaseException:  # noqa: BLE001 - queued; the poll thread retries; unwatch() reports it
                pass
        return ticket

    # -- sandboxes ----------------------------------------------------------------------
    def check_enforceable(self, policy) -> None:
        """An enforce-mode policy whose eBPF programs cannot load is refused (exit 125)
        instead of running unconfined (watch() checks again)."""
        if self.enforcer is None and policy.mode == "enforce":
            raise DsecError(f"policy {policy.name} (enforce) needs eBPF enforcement, which is "
                            f"unavailable: {self.enforce_error or 'disabled'}", EXIT_DSEC)

    def watch(self, sandbox_id: str, cgroup_id: int, policy=None, cgroup_path: str | None = None,
              step: int = 0, image_digest: str = "", **labels):
        """Audit cgroup `cgroup_id` from now on (from its init's HELLO: the launcher's
        on_started). With a policy, its eBPF enforcement starts at started(); an
        enforce-mode policy whose programs cannot load refuses here (exit 125)
        instead of running unconfined."""
        if policy is not None:
            self.check_enforceable(policy)
            self.policies[sandbox_id] = policy
            labels.update(policy.identity())
        if image_digest:
            self.images[sandbox_id] = image_digest
        labels.setdefault("aggregate", aggregable_kinds(policy))
        labels.setdefault("aggregate_from_step", True)     # the init's set-up: none (AuditSensor.add_sandbox)
        self.sensor.add_sandbox(cgroup_id, sandbox_id, step=step, **labels)
        self._watched[cgroup_id] = {"sandbox_id": sandbox_id, "policy": policy, "path": cgroup_path,
                                    "enforced": False, "step": step}

    def started(self, cgroup_id: int, pid: int) -> bool:
        """The sandbox's init exists: name it for enrichment and start enforcement
        (init and its children until they exec are exempt). True when the eBPF
        enforcement sensor now enforces the sandbox's policy."""
        self.sensor.set_root_pid(cgroup_id, pid)
        w = self._watched.get(cgroup_id)
        if w:
            self.init_pids[w["sandbox_id"]] = pid
        if not w or w["policy"] is None or self.enforcer is None or not w["path"]:
            if w and w["policy"] is not None and self.enforcer is None:
                sys.stderr.write(f"dsec: warning: sandbox {w['sandbox_id']}: eBPF enforcement unavailable "
                                 f"({self.enforce_error}); {w['policy'].mode} mode runs without it\n")
            return False
        self.enforcer.add_sandbox(cgroup_id, w["path"], w["sandbox_id"], w["policy"],
                                  step=w["step"], exempt_pids=[pid])
        w["enforced"] = True
        return True

    def ready(self, cgroup_id: int, pid: int) -> None:
        """The sandbox's init has pivoted into the sandbox's root (READY, before GO): an
        enforce-mode sandbox's root is opened now for the "refused anyway" check of its
        EROFS writes (permcheck.SandboxRoots). Not at started(): before dsec-init's
        pivot_root its root is the host's (a copy of the agent's mount namespace). The audit
        sensor's decoder takes that root's identity now, for exec enrichment (procs.root_ready)."""
        self.sensor.root_ready(cgroup_id)
        w = self._watched.get(cgroup_id)
        if w and w["policy"] is not None and w["policy"].mode == "enforce":
            self.roots.add(w["sandbox_id"], pid)

    def set_step(self, cgroup_id: int, step: int):
        self.sensor.set_step(cgroup_id, step)
        w = self._watched.get(cgroup_id)
        if w:
            w["step"] = step
            if w["enforced"]:
                self.enforcer.set_step(cgroup_id, step)

    def update_policy(self, cgroup_id: int, policy) -> dict:
        """Change the egress rules of a running sandbox at once. Nothing else can
        change in place: exec, syscall and namespace rules and the mode are
        fixed when the sandbox starts (the seccomp filter, the exec check's rule
        set), so a policy that differs in them is refused (DsecError), never
        half-applied. Returns {"applied": ["egress"], "unchanged": [...]}."""
        with self._update_lock:         # an unwatch waits for it, or it finds the sandbox gone
            w = self._watched.get(cgroup_id)
            if not w:
                raise DsecError(f"cgroup {cgroup_id} is not watched (its sandbox ended)")
            if not w["enforced"]:
                raise DsecError(f"sandbox {w['sandbox_id']} has no eBPF enforcement to update")
            self.enforcer.update_egress(cgroup_id, policy)
            self.sensor.set_aggregate(cgroup_id, aggregable_kinds(policy))   # connects: per its egress rules
            w["policy"] = policy
            self.policies[w["sandbox_id"]] = policy
        return {"applied": ["egress"], "unchanged": ["exec", "syscalls", "namespaces", "mode"]}

    def syscall_counts(self, cgroup_id: int) -> dict:
        w = self._watched.get(cgroup_id)
        if not w or not w["enforced"]:
            return {}
        return self.enforcer.syscall_counts(cgroup_id)

    def catch_up(self, cgroup_id: int | None = None, flush: bool = True, ending: bool = False):
        """Decode (and enrich) everything the kernel has emitted so far; the
        wait for exec enrichment is for `cgroup_id`'s files only when given.
        flush=False: queued, not appended (the caller's next append takes them).
        ending: `cgroup_id`'s unwatch follows, which reads its repeats (AuditSensor.drain)."""
        self.sensor.drain(cgroup_id, ending=ending and cgroup_id is not None)
        if self.enforcer is not None:
            self.enforcer.drain(cgroup_id)
        if flush:
            self._flush_pending()

    def unwatch(self, cgroup_id: int, flush: bool = True) -> dict:
        """Stop watching: the sensors' last records and losses queued, their
        totals returned; appended (durable) before it returns unless flush=False
        (then the caller makes them durable: append_with, make_durable(ticket()))."""
        with self._update_lock:
            w = self._watched.pop(cgroup_id, None)
        stats = self.sensor.remove_sandbox(cgroup_id, cgroup_path=w and w["path"])
        if w:
            self.init_pids.pop(w["sandbox_id"], None)
            stats = dict(stats)
            stats["init_own"] = self.init_own.pop(w["sandbox_id"], 0)
        if w and w["enforced"]:
            est = self.enforcer.remove_sandbox(cgroup_id)
            stats = dict(stats)
            stats["lost_total"] = stats.get("lost_total", 0) + est.get("lost_total", 0)
            stats["enforcement"] = est
        self.stopped.pop(cgroup_id, None)
        if w:
            self._add_summaries(self.denials.flush(w["sandbox_id"]))
            self.roots.remove(w["sandbox_id"])
        if flush:
            try:
                self._flush_pending()
            except BaseException:  # noqa: BLE001 - reported just below; the records stay queued
                pass
        err = self._error or self._poll_error
        if err:
            raise DsecError(f"audit pipeline failed: {err} (records kept queued and retried)")
        return stats

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.roots.close()
        try:
            self.sensor.close()
            if self.enforcer is not None:
                self.enforcer.close()
        finally:
            try:
                self._flush_pending()
            except BaseException as e:  # noqa: BLE001
                log.error("audit records not spooled at close (%d): %s", len(self._pending), e)
                raise DsecError(f"{len(self._pending)} audit record(s) could not be spooled at close: {e}") from None
