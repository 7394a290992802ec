"""The node agent: one long-lived process per node that launches, schedules and
audits sandboxes for many clients (docs/agent.md).

Why this file is long: the Agent is one object whose transitions all happen
under one lock; what could leave it has (the parts listed below), what is left
is the state machine they share.

    agent = Agent(load_config(path))
    agent.start()          # eBPF programs once, exporter process, cleanup of what a dead agent left
    ... agent.create(...), agent.exec_step(...), agent.kill(...) ...   (called by agent/node/api.py)
    agent.shutdown()

Why this file is long: the Agent is one state machine under one lock (records,
lifecycle, scheduler glue, create/stop/close); every part that stands alone is a
file beside it (below), and what is left reads each other's state.

The agent in parts, each a file of agent/node/:
  daemon.py    this file: the Agent (state, lock, lifecycle records, scheduler glue,
               create/kill/close/wait/list, policy updates, capabilities, the tick)
  records.py   SandboxRecord, StepRun, states, request limits, ApiError
  requests.py  request checks (CreateSandbox, Exec) and the policy cache
  warm.py      the warm pool
  images.py    the image store of the node: prewarm, image and volume requests, the report
  snapshots.py Snapshot and forks (CreateSandbox from_snapshot)
  steps.py     one Exec: streaming, timeouts, cancellation
  streams.py   live event streams (StreamEvents) and the spool tap
  export.py    the continuous ClickHouse export and its barrier
  host.py      the run directory (lock, pid file), the eBPF sensors, clean-up after a dead agent
  resources.py live limit changes, resource windows and phases, the circuit breaker
  api.py       gRPC <-> these Python values; client.py the SDK

Pieces, and who owns what:
  Recorder (agent/sensors/recorder.py)   the eBPF audit: one for the whole agent; each sandbox is
                                 recorded through its SandboxWatch (agent/sensors/watch.py), the
                                 same path `dsec run` takes
  TapSpool                       the recorder's spool, wrapped: every appended record also goes to
                                 the StreamEvents subscribers (a tail -f of the audit)
  ClickHouseExporter thread      spool -> ClickHouse, continuously
  Scheduler (agent/node/scheduler.py) admission, queue order with aging, preemption, warm-pool accounting;
                                 every call is made under the agent's lock and its Actions are carried
                                 out by the executor threads (launch, stop victims, drain warm sandboxes)
  Sandbox (agent/sandbox/launcher.py)    one per sandbox; steps are Sandbox.exec() calls, one at a time per
                                 sandbox so that every audit event carries the step it belongs to
  tick thread                    scheduler.tick() (aging), warm-pool refill, lifetimes, dead supervisors

Sandboxes die with the agent: a sandbox's supervisor kills everything inside
when its control socket to the agent closes. A restarted agent therefore does
not adopt anything: it removes what the previous one left (the same cleanup as
`dsec gc`) and records each removal as a `lifecycle` audit event.

Every lifecycle transition is an audit event of kind `lifecycle` whose `extra`
JSON holds {"state": ..., ...}: the scheduler's (queued, admitted, preempting,
preempted, released, rejected, cancelled, warm_ready, warm_claimed,
warm_draining, warm_released) and the agent's (started, step_started,
step_ended, stopping, exited, killed, failed, cleaned, policy_updated,
agent_started, agent_stopped, orphan_cleaned), resources.py's (resources_updated,
phase_waiting, phase_switched, phase_refused, breaker_tripped, thawed) and
runcode.py's run_code (one /run_code request's outcome).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from agent.errors import DsecError, ReportedError
from agent.node import steps
from agent.node.export import ClickHouseExport, ExporterProcess
from agent.node.host import RunDir, apply_host, clean_up_after, load_audit, release_scratch, use_scratch
from agent.node.images import NodeImages
from agent.node.snapshots import NodeSnapshots
from agent.node.records import (CANCELLED, ENDED, EXITED, FAILED, KILLED, MAX_ARG_BYTES, MAX_ARGV_ITEMS,
                                MAX_EXEC_BYTES, MAX_GRACE, MAX_LABELS, PREEMPTED, QUEUED, RUNNING, STARTING, STATES,
                                STOPPING, STREAM_POLL, VERSION, WARM, ApiError, SandboxRecord, _bad, _compact, _fs,
                                to_json)
from agent.node.requests import PolicyCache, check_create
from agent.node.resources import Breaker, on_actions, thaw_if_frozen, window_of
from agent.node.streams import EventStreams, TapSpool
from agent.node.warm import WarmPool, profile_key
from agent.node.authz import ADMIN, Authorizer
from agent.sensors.watch import SandboxWatch

log = logging.getLogger("dsec.agent")
# below this open-file limit the agent runs out of fds before limits.max_sandboxes (reported as degraded)
NOFILE_WANTED = 8192
# the emit writer's group-commit window: records queued without a waiter (a step's end, a create's
# start) go to the spool this long after the first kick, with whatever else came meanwhile, in one
# fdatasync'ed append. Back-to-back steps: 0.44 appends a step instead of 1.6 (~0.5 ms less of the
# agent's CPU a step), and the append no longer lands on the next step's start (docs/launch-figures.md).
# A flush someone waits for (a close, a kill, a one-shot run's reply, the recorder's gate) is made at
# once, by the waiting thread.
EMIT_COMMIT_WINDOW_S = 0.004
# ... and while a sandbox is ending (Agent._finish: a close, a kill, a stop) the writer waits for
# its end instead, up to this long after the first kick: that end's own durable append (made by
# the ending thread, at once) carries everything queued by then, so a step's end records and the
# close that follows them (a RunOnce, a trajectory's last step) share one fdatasync, and the
# close's append no longer waits behind the writer's (docs/agent.md "When a step's records are
# durable"). At most the audit poll's own delivery bound (20 ms) later than alone.
EMIT_HOLD_MAX_S = 0.02


class CallCounter:
    """API calls in flight and when the last one ended (an agent with --idle-exit)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n = 0
        self._last = time.monotonic()

    def begin(self):
        with self._lock:
            self._n += 1

    def end(self):
        with self._lock:
            self._n -= 1
            self._last = time.monotonic()

    def state(self) -> tuple[int, float]:
        with self._lock:
            return self._n, self._last


# ---------------------------------------------------------------- the agent

class Agent:
    def __init__(self, cfg):
        self.cfg = cfg
        self.node = cfg.host.node_name or os.uname().nodename
        self.instance = os.urandom(6).hex()
        self._eid = 0
        self._lock = threading.RLock()
        # the agent's own condition: shutdown's wait for every sandbox to end (notified when one
        # ends); a wait for one sandbox waits on that record's `changed` (the same lock)
        self._cond = threading.Condition(self._lock)
        self._records: dict[str, SandboxRecord] = {}
        self._ended: OrderedDict[str, SandboxRecord] = OrderedDict()
        self.warm = WarmPool(self)
        self.streams = EventStreams(cfg.limits.max_stream_subscribers, cfg.limits.stream_buffer, self.labels_of)
        self.policies = PolicyCache(cfg)
        self.authz = Authorizer(cfg.authorization, cfg.rootfs_roots, self.audit_refusal)
        # the agent's own records, queued, then group-committed by _flush_emits: under _emit_cv
        # the queue, how many records were ever queued, how many of those are durable (or were
        # reported lost), and whether an append is in flight (one at a time: the records stay FIFO)
        self._emitq: deque = deque()
        self._emit_cv = threading.Condition(threading.Lock())
        self._emit_queued = 0
        self._emit_durable = 0
        self._emit_ordered = 0      # queued records up to here are durable or in an append holding the spool lock
        self._emit_reserved = 0     # queued records up to here go to the spool before any later append of others
        self._emit_thread = 0       # the thread whose append is in flight
        self._emit_busy = False
        self._emit_failures = 0
        self._emit_kick = threading.Event()     # _flush_emits_soon -> the emit writer thread
        self._ending = 0            # sandboxes in _finish (under _emit_cv): the writer holds (EMIT_HOLD_MAX_S)
        self._stop = threading.Event()
        self._shutting = False
        self._threads: list[threading.Thread] = []
        self.rec = None
        self.spool = None
        self.export: ClickHouseExport | ExporterProcess | None = None
        self.sched = None
        self.degraded: list[str] = []
        self.nofile = {"soft": 0, "hard": 0, "was": 0, "error": ""}
        self.audit_feature = {"available": False, "detail": "", "missing": []}
        self.enforce_feature = {"available": False, "detail": "", "missing": []}
        self.started_ns = 0
        self.run_dir = RunDir(cfg, VERSION)
        self.executor: ThreadPoolExecutor | None = None
        self.previous_agent: dict | None = None
        self.cleaned: list[dict] = []
        self.transports: list[str] = []
        self.images = None                  # the node's image store (agent/sandbox/images)
        self.node_images = NodeImages(self)  # images.prewarm, image requests, volumes (node/images.py)
        self.snapshots = NodeSnapshots(self)  # Snapshot, CreateSandbox(from_snapshot) (node/snapshots.py)
        self.calls = CallCounter()          # API calls in flight and the last one's time (--idle-exit)
        self.idle_exited = False
        self._last_ended = time.monotonic()

    # ================================================================ start / stop

    def start(self):
        from agent.sandbox import launcher
        from agent.node.scheduler import Scheduler
        from exporters.spool import Spool
        cfg = self.cfg
        from agent.sandbox import sysutil
        self.nofile = sysutil.raise_nofile()
        log.info("open-file limit (RLIMIT_NOFILE): %d (hard %d, was %d)", self.nofile["soft"], self.nofile["hard"],
                 self.nofile["was"])
        if self.nofile["error"]:
            log.warning("open-file limit not raised: %s", self.nofile["error"])
        if self.nofile["soft"] < NOFILE_WANTED:
            self.degraded.append(f"open-file limit (RLIMIT_NOFILE) is {self.nofile['soft']}: the agent holds a few "
                                 f"fds per sandbox and stops starting sandboxes when it runs out (raise the hard "
                                 f"limit, e.g. LimitNOFILE= in the systemd unit)")
        self.host = apply_host(cfg)
        launcher.preflight()
        from agent.sandbox import cgroups, uids
        uids.configure(cfg.sandbox_uids)
        self._layout = cgroups.detect()
        from agent.sandbox import netpool
        netpool.enable()        # network namespaces made ahead of cold starts (agent/sandbox/netpool.py)
        self.started_ns = time.time_ns()
        self.previous_agent = self.run_dir.take()
        self.spool = TapSpool(Spool(), self.streams.offer, self._emits_gate)
        setup = load_audit(cfg, self.node, self.spool)
        self.rec, self.audit_feature, self.enforce_feature = setup.rec, setup.audit, setup.enforcement
        self.degraded += setup.degraded
        if cfg.exporter.clickhouse:
            ch = cfg.clickhouse
            # in a child process: the poll thread and the inserts do not share one interpreter lock
            self.export = ExporterProcess(self.spool._spool, cfg.exporter.interval_seconds, url=cfg.clickhouse_url,
                                          cluster=ch.cluster, insert=ch.insert, ddl=ch.ddl).start()
        # the other sinks (OTLP, JSON lines), each with its own spool cursor
        from exporters.configure import sinks_from_config, start_sinks
        specs = sinks_from_config(cfg.sinks, include_clickhouse=False)
        self._sink_stop = threading.Event()
        self._sink_threads = start_sinks(self.spool, specs, self._sink_stop)
        total_cpus, total_mem = cfg.capacity.totals()
        try:
            self.sched = Scheduler(total_cpus, total_mem, reserve_cpus=cfg.capacity.reserve_cpus,
                                   reserve_memory=cfg.capacity.reserve_memory,
                                   cpu_oversubscription=cfg.capacity.cpu_oversubscription,
                                   max_pids=cfg.capacity.max_pids, concurrent_peaks=cfg.scheduling.concurrent_peaks,
                                   aging_seconds=cfg.scheduling.aging_seconds, history=cfg.limits.history)
        except ReportedError as e:
            raise DsecError(f"capacity: {e.message}", 2)
        self.images = self.node_images.open()
        self.snapshots.open()
        self.warm.resolve()
        self.cleaned = clean_up_after(self.previous_agent, self._lifecycle)
        # after the clean-up: what is left in the sandboxes' directory is live
        self.host["scratch"], why = use_scratch(cfg.host.scratch)
        if why:
            self.degraded.append(why)
        self._lifecycle("", "agent_started", pid=os.getpid(), version=VERSION, config={
            "socket": cfg.socket, "tcp": cfg.tcp.listen if cfg.tcp else None,
            "capacity": {"cpus": total_cpus, "memory": total_mem, "reserve_cpus": cfg.capacity.reserve_cpus,
                         "reserve_memory": cfg.capacity.reserve_memory,
                         "cpu_oversubscription": cfg.capacity.cpu_oversubscription},
            "warm_pool": {p.name: p.count for p in cfg.warm_pool}, "host": self.host,
            "clickhouse": {"cluster": cfg.clickhouse.cluster, "insert": cfg.clickhouse.insert},
            "open_files": self.nofile},
            degraded=self.degraded, previous_agent=self.previous_agent)
        self.run_dir.write_pidfile(self.instance, self.started_ns)
        self.executor = ThreadPoolExecutor(max_workers=max(32, cfg.scheduling.max_parallel_starts * 4),
                                           thread_name_prefix="dsec-agent-work")
        self._starts = threading.BoundedSemaphore(cfg.scheduling.max_parallel_starts)
        t = threading.Thread(target=self._tick_loop, name="dsec-agent-tick", daemon=True)
        t.start()
        self._threads.append(t)
        t = threading.Thread(target=self._emit_writer, name="dsec-agent-emit", daemon=True)
        t.start()
        self._threads.append(t)
        if cfg.images.prewarm:
            self._submit_work(self.node_images.prewarm, list(cfg.images.prewarm))
        self.breaker = Breaker(self).start()
        self._flush_emits()
        return self

    def shutdown(self, reason: str = "agent shutting down", timeout: float = 30.0):
        """Stop everything this agent runs (SIGTERM, grace, SIGKILL), then the audit."""
        with self._lock:
            if self._shutting:
                return
            self._shutting = True
            recs = list(self._records.values())
            for rec in recs:
                if rec.state == QUEUED:
                    self._cancel_locked(rec, reason)
                elif rec.state in (STARTING, RUNNING):
                    self._begin_stop_locked(rec, KILLED, reason, self.cfg.defaults.grace_seconds)
            warm = list(self.warm.entries.values())
            self.warm.entries.clear()
        for w in warm:
            self._submit_work(self.warm.destroy, w, "agent shutting down")
        self._flush_emits()
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(r.state not in ENDED for r in self._records.values()) and time.monotonic() < deadline:
                self._cond.wait(0.2)
        self._stop.set()
        self._emit_kick.set()
        if getattr(self, "breaker", None) is not None:
            self.breaker.stop()
        if self.executor:
            self.executor.shutdown(wait=True, cancel_futures=False)
        from agent.sandbox import netpool, trash
        netpool.close()
        if not trash.drain(timeout):        # the host links (and state dirs) of the last closes
            log.warning("background teardown not finished at shutdown: `dsec gc` removes what is left")
        release_scratch(self.host.get("scratch"))
        self.streams.close_all()
        self._lifecycle("", "agent_stopped", reason=reason)
        self._flush_emits()
        if self.rec is not None:
            try:
                self.rec.close()
            except Exception as e:  # noqa: BLE001
                log.error("closing the audit recorder: %s", e)
        if self.export is not None:
            self.export.close()
        if getattr(self, "_sink_threads", None):
            from exporters.configure import stop_sinks
            self._sink_stop.set()
            stop_sinks(self._sink_threads)

    def idle_seconds(self) -> float:
        """How long the agent has had no live sandbox (warm ones do not count) and no API
        call in flight; 0 while it has either."""
        busy, last = self.calls.state()
        if busy:
            return 0.0
        with self._lock:
            warm = {w.rec.id for w in self.warm.entries.values()}
            if any(r.state not in ENDED and r.id not in warm for r in self._records.values()):
                return 0.0
            last = max(last, self._last_ended)
        return time.monotonic() - last

    def release(self):
        """The last step of a shutdown (after the API server stopped and its socket is gone):
        remove the pid file and let another agent start."""
        self.run_dir.release()

    # ================================================================ audit records

    def _lifecycle(self, sid: str, state: str, *, step: int = 0, ts_ns: int | None = None, **extra):
        """Queue one lifecycle audit event (written by _flush_emits)."""
        rec = (self._records.get(sid) or self._ended.get(sid)) if sid else None
        payload = {"state": state}
        if rec is not None and rec.labels:
            payload["labels"] = rec.labels
        payload.update({k: v for k, v in extra.items() if v is not None})
        r = {"kind": "lifecycle", "sandbox_id": sid, "step": step, "ts_ns": ts_ns or time.time_ns(),
             "pid": os.getpid(), "extra": _compact(payload)}
        if rec is not None:
            r.update(rec.policy_identity())
        self._queue_emit(r)

    def _emit_record(self, r: dict):
        r.setdefault("ts_ns", time.time_ns())
        self._queue_emit(r)

    def _queue_emit(self, r: dict):
        with self._emit_cv:
            self._emitq.append(r)
            self._emit_queued += 1

    def _flush_emits(self, ordered: bool = False):
        """Return once every agent record queued before the call is durable in the spool (group
        commit). The flush that finds no append in flight takes everything queued, by any thread,
        into one durable append (one fdatasync); a flush whose records are in the append in flight
        waits for that append, and then returns; one that finds nothing left to write returns
        without taking a lock. ordered=True (the recorder's gate, _emits_gate): return once
        they are durable or in an append that holds the spool's writer lock: every later append
        (the recorder's events of what follows) is then written after them and, the spool's
        appends and their fdatasync being serialised under that lock, durable only after them."""
        target = self._emit_queued
        if (self._emit_ordered if ordered else self._emit_durable) >= target:
            return                   # all queued so far is durable (set only after the append returned)
        cv = self._emit_cv
        with cv:
            while self._emit_busy and (self._emit_ordered if ordered else self._emit_durable) < target:
                cv.wait()
            if (self._emit_ordered if ordered else self._emit_durable) >= target:
                return               # another thread's append carried ours
            self._emit_busy = True
            self._emit_thread = threading.get_ident()
            taken = list(self._emitq)
            self._emitq.clear()
            upto = self._emit_queued
        try:
            self._append_emits(taken, upto, combine=not ordered)    # ordered: in a recorder append's gate
        finally:
            with cv:
                self._emit_durable = upto
                self._emit_ordered = max(self._emit_ordered, upto)
                self._emit_busy = False
                self._emit_thread = 0
                cv.notify_all()

    def _reserve_emits(self):
        """A step's start (agent/node/steps.py) and a create (Agent.create): every agent record
        queued so far (the previous step's step_started/step_ended, the create's) goes to the
        spool before anything appended after this call: the recorder's appends wait for them at
        their gate (_emits_gate), so the call need not wait for their append (its Python work,
        the spool's lock, its fdatasync). Kicks the emit writer. The spool's appends and their
        fdatasync are serialised under its writer lock: what is appended after them is durable
        only after them."""
        if self._emit_reserved < self._emit_queued:
            self._emit_reserved = self._emit_queued
            self._emit_kick.set()

    def _emits_gate(self):
        """Before each append of the recorder (TapSpool's before_append): the agent records a
        step's start reserved are in the spool's append order first (durable, or in the append
        that holds its writer lock): the batch being appended may hold that step's events."""
        if self._emit_ordered < self._emit_reserved and self._emit_thread != threading.get_ident():
            self._flush_emits(ordered=True)         # (not for the emit append itself)

    def _emits_locked(self, upto: int):
        """The append of the records up to `upto` holds the spool's writer lock (spool.append_many's
        on_locked): the flushes waiting only for their order may go on."""
        with self._emit_cv:
            self._emit_ordered = max(self._emit_ordered, upto)
            self._emit_cv.notify_all()

    def _append_emits(self, taken: list, upto: int, combine: bool = False):
        """One durable append of `taken` (only the flush that set _emit_busy calls it)."""
        from audit_schema.events import normalize
        batch = []
        for r in taken:
            self._eid += 1
            r.setdefault("event_id", f"{self.instance}a{self._eid:015x}")
            r.setdefault("ts_ns", time.time_ns())
            r.setdefault("node", self.node)
            try:
                batch.append(normalize(r))
            except KeyError as e:
                log.error("dropping a malformed agent record (%s): %r", e, r)
        if not batch or self.spool is None:
            return
        try:
            locked = lambda: self._emits_locked(upto)     # noqa: E731
            # the close's records and the recorder's queue (its sandbox's last kernel records, queued
            # by its watch's end: SandboxWatch flush=False) in one append, the agent's first (a step's
            # start reserved their place ahead of the recorder's: _emits_gate), when the recorder has
            # no append under way; else ours alone (_finish makes the watch's records durable)
            if not (combine and self.rec is not None and self.rec.append_with(batch, on_locked=locked)):
                self.spool.append_many(batch, on_locked=locked)
        except ReportedError as e:
            self._emit_failures += len(batch)
            log.error("%d lifecycle audit record(s) could not be spooled: %s", len(batch), e.message)

    def _flush_emits_soon(self):
        """The queued agent records go to the spool in one durable append on the emit writer
        thread; returns at once. For a step's end only (agent/node/steps.py): the append is
        ordered before every later agent record (one queue, FIFO, one append at a time) and the
        next step of the sandbox waits for it (_flush_emits before it starts)."""
        self._emit_kick.set()

    def _emit_writer(self):
        cv = self._emit_cv
        while not self._stop.is_set():
            if self._emit_kick.wait(1.0):
                kicked = time.monotonic()
                self._stop.wait(EMIT_COMMIT_WINDOW_S)     # group commit (EMIT_COMMIT_WINDOW_S); none at a stop
                with cv:    # an ending sandbox's append will carry them (EMIT_HOLD_MAX_S)
                    cv.wait_for(lambda: not self._ending or self._stop.is_set(),
                                kicked + EMIT_HOLD_MAX_S - time.monotonic())
            self._emit_kick.clear()         # before the flush: a kick during it is another round
            try:
                self._flush_emits()
            except Exception:  # noqa: BLE001 - the writer must outlive one bad batch (it is logged)
                log.exception("writing the agent's audit records")

    def labels_of(self, sid: str) -> dict:
        rec = self._records.get(sid) or self._ended.get(sid)
        return rec.labels if rec is not None else {}

    # ================================================================ scheduler glue

    def _changed_locked(self, rec: SandboxRecord | None):
        """Under the lock: `rec` changed (state, stop, phase); wake the threads waiting for it."""
        if rec is not None:
            rec.changed.notify_all()

    def _after_sched_locked(self, actions):
        """Turn transitions into audit events and carry out Actions (under the lock)."""
        for t in self.sched.drain_transitions():
            if t.kind == "warm":
                sid = self.warm.slot_sid.get(t.id, "")
                self._lifecycle(sid, t.state, ts_ns=int(t.at * 1e9), slot=t.id, profile=t.profile,
                                previous=t.previous, reason=t.reason, cause=t.cause, source="scheduler")
            elif t.kind == "request":
                self._lifecycle(t.id, t.state, ts_ns=int(t.at * 1e9), previous=t.previous, priority=t.priority,
                                reason=t.reason, cause=t.cause,
                                waited_s=round(t.waited, 6) if t.waited is not None else None,
                                source="scheduler")
                self._changed_locked(self._records.get(t.id))
            else:
                self._lifecycle("", "scheduler_" + t.state, ts_ns=int(t.at * 1e9), reason=t.reason)
        if not actions:
            return
        on_actions(self, actions)                  # phase switches the scheduler granted
        now_ns = time.time_ns()
        for rid in actions.admitted:
            rec = self._records.get(rid)
            if rec is None or rec.state != QUEUED:
                continue
            rec.state = STARTING
            rec.admitted_ns = now_ns
            rec.queued_s = max(0.0, (now_ns - rec.created_ns) / 1e9)
            self._changed_locked(rec)
            self._submit_work(self._launch, rec)
        for rid in actions.preempt:
            rec = self._records.get(rid)
            if rec is None:
                continue
            info = self.sched.info(rid) or {}
            rec.preempted_for = info.get("preempted_for")
            self._begin_stop_locked(rec, PREEMPTED, f"preempted for request {rec.preempted_for!r}",
                                    self.cfg.scheduling.preemption_grace)
        for slot in actions.drain_warm:
            w = self.warm.entries.pop(slot, None)
            if w is not None:
                self._submit_work(self.warm.destroy, w, "drained for a queued request")

    def _submit_work(self, fn, *args):
        if self.executor is None:
            return
        try:
            self.executor.submit(self._guard, fn, *args)
        except RuntimeError:        # executor shut down: run inline (shutdown path)
            self._guard(fn, *args)

    def _guard(self, fn, *args):
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("internal error in %s", getattr(fn, "__name__", fn))
        finally:
            self._flush_emits()

    def _release(self, rec: SandboxRecord, reason: str | None = None):
        with self._lock:
            try:
                acts = self.sched.release(rec.id, reason)
            except ReportedError as e:
                log.error("scheduler release(%s): %s", rec.id, e)
                acts = None
            self._after_sched_locked(acts)

    # ================================================================ sandboxes: start

    def _hooks(self, rec: SandboxRecord, defer_start: bool = False) -> dict:
        """The launcher hooks of `rec`: its record through the one SandboxWatch
        (sensors/watch.py), plus the agent's own bookkeeping."""
        sensor_labels = {}
        if rec.over_budget != self.cfg.audit.over_budget:
            sensor_labels["over_budget"] = rec.over_budget
        rec.watch = SandboxWatch(self.rec if rec.audit else None, rec.spec, rec.labels, emit=self._emit_record,
                                 start_extra={"agent": self.instance, "warm_profile": rec.warm_profile,
                                              "priority": rec.priority},
                                 sensor_labels=sensor_labels, defer_start=defer_start, raise_errors=False,
                                 created_ns=rec.created_ns, flush=False)

        def on_cgroup(sid, cg):
            rec.cgroup_id = cg

        def on_step(sid, step):
            run = rec.run
            rec.steps = step
            argv = run.argv if run is not None else []
            self._lifecycle(sid, "step_started", step=step, argv=[_fs(a) for a in argv][:64])
            if run is not None:
                run.step = step
                run.started_ns = time.time_ns()
                run.wake()

        hooks = rec.watch.hooks(on_cgroup=on_cgroup, on_step=on_step)
        # close: the sensors' watch ends (the audit drained, its totals read: ~15 ms of lock waits
        # and map work) on a step thread alongside the manifest and teardown, once nothing of the
        # sandbox can run (the launcher's on_gone); sandbox_exit (on_exit) waits for it, so its
        # record, the reply and every total they carry are as before
        ending: dict = {}

        def on_gone(sid):
            if not rec.watch.watched or not rec.watch.started_recorded:
                return                  # an unclaimed warm sandbox: on_exit writes its start first, as before
            done = threading.Event()

            def unwatch():
                try:
                    rec.watch.unwatch()
                except BaseException as e:  # noqa: BLE001 - raised again by on_exit, in the closing thread
                    ending["error"] = e
                finally:
                    done.set()
            try:
                steps.STEP_THREADS.spawn(unwatch)
            except RuntimeError:
                return                  # no thread to be had: on_exit ends the watch itself
            ending["done"] = done

        watch_exit = hooks["on_exit"]

        def on_exit(summary):
            done = ending.pop("done", None)
            if done is not None:
                done.wait()
                if "error" in ending:
                    raise ending.pop("error")
            return watch_exit(summary)
        hooks.update(on_gone=on_gone, on_exit=on_exit)
        return hooks

    def _start_sandbox(self, rec: SandboxRecord, defer_start: bool = False):
        """Create and start the launcher Sandbox of `rec` (executor thread). Returns it or raises."""
        from agent.sandbox.launcher import Sandbox
        if rec.spec.image is not None and not rec.spec.layers:
            self.node_images.prepare(rec.spec)   # a warm sandbox of an image profile
        sb = Sandbox(rec.spec, **self._hooks(rec, defer_start))
        sb.next_step = getattr(rec.spec, "first_step", 1)      # a fork goes on from its snapshot's step
        sb.teardown_later = True        # an egress sandbox's host link: removed off the close's path (trash.py)
        with self._starts:
            try:
                sb.start()
            except BaseException:
                rec.watch.unwatch()      # start() tore the sandbox down without on_exit
                rec.failed_start = sb    # its `cleaned` waits for that teardown (_cleaned)
                raise
        return sb

    def _launch(self, rec: SandboxRecord):
        t0 = time.monotonic()
        if rec.sandbox is None:
            try:
                sb = self._start_sandbox(rec)
            except ReportedError as e:
                self._fail(rec, f"sandbox start failed: {e.message}")
                return
            except Exception as e:  # noqa: BLE001
                log.exception("sandbox %s: start failed", rec.id)
                self._fail(rec, f"sandbox start failed: internal error {e!r}")
                return
        else:
            sb = rec.sandbox           # a warm sandbox handed over through the queue
        with self._lock:
            rec.sandbox = sb
            rec.start_done.set()
            if rec.stop_kind is not None:          # killed or preempted while starting
                pending = True
            else:
                pending = False
                rec.state = RUNNING
                rec.started_ns = time.time_ns()
                rec.deadline = time.monotonic() + rec.lifetime
                rec.oom_seen = sb.cg.oom_kills() if sb.cg else 0
                self._lifecycle(rec.id, "started", launch_ms=round((time.monotonic() - t0) * 1000, 3),
                                warm=rec.warm, cgroup_id=rec.cgroup_id,
                                queued_s=round(rec.queued_s, 6))
            self._changed_locked(rec)
        if pending:
            self._stop_sandbox(rec)

    def _fail(self, rec: SandboxRecord, reason: str):
        log.warning("sandbox %s: %s", rec.id, reason)
        with self._lock:
            rec.state = FAILED
            rec.reason = reason
            rec.ended_ns = time.time_ns()
            rec.start_done.set()
            self._lifecycle(rec.id, "failed", reason=reason)
            self._changed_locked(rec)
        self._cleaned(rec.id, rec.failed_start)
        self._release(rec, reason)
        self._retire(rec)
        self._flush_emits()

    def _retire(self, rec: SandboxRecord):
        """Move an ended record to the bounded history (its snapshot lease released)."""
        self.snapshots.release(rec.spec)
        with self._lock:
            if self._records.get(rec.id) is rec:
                del self._records[rec.id]
            self._ended[rec.id] = rec
            self._ended.move_to_end(rec.id)
            while len(self._ended) > self.cfg.limits.history:
                self._ended.popitem(last=False)
            rec.sandbox = None if rec.state in ENDED else rec.sandbox
            rec.run = None
            if rec.summary and len(rec.summary.get("changes") or ()) > 100:
                # history is bounded in memory: keep the first changes only (the full
                # manifest went to the caller and into the sandbox_exit audit event)
                rec.summary = dict(rec.summary, changes=rec.summary["changes"][:100], changes_truncated=True)
            self._changed_locked(rec)
            self._cond.notify_all()          # one sandbox fewer for shutdown's wait

    # ================================================================ sandboxes: stop

    def _begin_stop_locked(self, rec: SandboxRecord, kind: str, reason: str, grace: float):
        """Decide to stop `rec` (kill / preempt / lifetime / shutdown); the work runs in the executor."""
        if rec.state in ENDED or rec.stop_kind is not None:
            return
        rec.stop_kind = kind
        rec.stop_reason = reason
        rec.stop_grace = grace
        if rec.state == RUNNING:
            rec.state = STOPPING
            self._submit_work(self._stop_sandbox, rec)
        # STARTING: _launch sees stop_kind once the sandbox exists and stops it
        self._changed_locked(rec)

    def _stop_sandbox(self, rec: SandboxRecord):
        """SIGTERM everything inside, grace, SIGKILL, close (executor thread)."""
        with self._lock:
            if rec.stop_started:
                return
            rec.stop_started = True
            rec.state = STOPPING
            self._changed_locked(rec)
            thaw_if_frozen(self, rec)              # the breaker froze it: its supervisor must run
            sb = rec.sandbox
            grace = getattr(rec, "stop_grace", self.cfg.defaults.grace_seconds)
            self._lifecycle(rec.id, "stopping", step=rec.steps, kind=rec.stop_kind, reason=rec.stop_reason,
                            grace_s=grace)
        self._flush_emits()
        killed_after_grace = False
        if sb is not None and not sb.supervisor_dead:
            sb.terminate()
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if not self._busy(sb):
                    break
                time.sleep(0.05)
            else:
                if self._busy(sb):
                    killed_after_grace = True
                    sb.kill()
        self._finish(rec, rec.stop_kind, rec.stop_reason, killed_after_grace=killed_after_grace)

    @staticmethod
    def _busy(sb) -> bool:
        """Anything but the supervisor still alive in the sandbox?"""
        if sb.cg is None:
            return False
        try:
            return bool(set(sb.cg.pids()) - {sb.sup_pid})
        except OSError:
            return False

    def _finish(self, rec: SandboxRecord, state: str, reason: str | None, **extra):
        """Close the sandbox (teardown, manifest), record the end, release its resources."""
        with self._emit_cv:
            self._ending += 1
        try:
            return self._end(rec, state, reason, **extra)
        finally:
            with self._emit_cv:
                self._ending -= 1
                self._emit_cv.notify_all()

    def _end(self, rec: SandboxRecord, state: str, reason: str | None, **extra):
        sb = rec.sandbox
        summary = None
        if sb is not None:
            try:
                summary = sb.close()
            except Exception as e:  # noqa: BLE001
                log.exception("sandbox %s: close failed", rec.id)
                summary = {"sandbox_id": rec.id, "error": f"close failed: {e}"}
        with self._lock:
            rec.summary = summary
            rec.state = state
            self._last_ended = time.monotonic()
            rec.reason = reason
            rec.ended_ns = time.time_ns()
            brief = {}
            if summary:
                brief = {k: summary.get(k) for k in ("exit_code", "signal", "oom_killed", "wall_ms", "cpu_ms",
                                                     "max_rss_bytes", "changes_total")}
                brief["audit"] = summary.get("audit")
            if state != PREEMPTED:      # the scheduler's "preempted" transition says it
                self._lifecycle(rec.id, state, step=rec.steps, reason=reason, steps=rec.steps, **brief, **extra)
            self._changed_locked(rec)
        self._cleaned(rec.id, sb, step=rec.steps, kept_upper=(summary or {}).get("kept_upper"))
        self._release(rec, reason if state != EXITED else None)
        self._retire(rec)
        self._flush_emits()          # durable before anyone is told it ended
        if self.rec is not None and rec.watch is not None and rec.watch.ticket:
            self.rec.make_durable(rec.watch.ticket, 10)     # the watch's end, if that append did not carry it
        return summary

    def _cleaned(self, sid: str, sb, **extra):
        """The `cleaned` record, once the sandbox is gone from the host: now, or (an egress
        sandbox's host link is removed off the close's path) when the trash thread has removed
        it (Sandbox.after_teardown), then written by the emit writer. It says what could not
        be removed (`teardown_error`), never more than was done."""
        def record(late: bool):
            with self._lock:
                self._lifecycle(sid, "cleaned", teardown_error=sb.teardown_error if sb is not None else None,
                                **extra)
            if late:
                self._flush_emits_soon()
        if sb is None:
            record(False)
        else:
            sb.after_teardown(lambda: record(sb.teardown_deferred))

    def _cancel_locked(self, rec: SandboxRecord, reason: str):
        try:
            acts = self.sched.cancel(rec.id, reason)
        except ReportedError as e:
            log.error("cancel %s: %s", rec.id, e)
            acts = None
        rec.state = CANCELLED
        rec.reason = reason
        rec.ended_ns = time.time_ns()
        rec.start_done.set()
        self._after_sched_locked(acts)
        self._retire(rec)

    # ================================================================ requests: create

    def create(self, req: dict, caller=ADMIN) -> SandboxRecord:
        """Validate, authorise (agent/node/authz.py), load the policy, queue (or take
        a warm sandbox). `req` holds the CreateSandboxRequest fields as Python values
        (see api.py). Does not wait for the durable append of the request's records
        (requested; a warm claim's sandbox_start): their place is reserved
        (_reserve_emits), as a step's start does, ahead of anything of the sandbox's in
        the spool; every later durable append carries them (docs/agent.md "When a
        step's records are durable")."""
        from agent.sandbox import launcher
        from agent.sandbox.launcher import SandboxSpec
        from policies.compile import ebpf_concerns
        d = self.cfg.defaults
        self.authz.check_create(caller, req)
        f = check_create(req, self.cfg)
        sid, cpus, memory, pids = f["sandbox_id"], f["cpus"], f["memory"], f["pids"]
        priority, network, rootfs, workdir, user = f["priority"], f["network"], f["rootfs"], f["workdir"], f["user"]
        labels, env, lifetime, grace, over_budget = f["labels"], f["env"], f["lifetime"], f["grace"], f["over_budget"]
        pol = req.get("policy") or {}
        policy = self.policies.load(pol.get("name"), pol.get("yaml"), pol.get("mode") or None,
                                    pol.get("source_name") or "")
        win = window_of(req.get("window"), cpus, memory)       # a resource window, or None
        if win is not None:
            cpus, memory = win.phases[win.phase]
        quota = float(cpus) if cpus else None
        acc_cpus = quota or d.cpus
        memory = memory or d.memory
        pids = pids or d.pids
        lifetime = lifetime or d.lifetime_seconds
        grace = grace or d.grace_seconds
        audit = not req.get("no_audit")
        need = ebpf_concerns(policy)
        if need:
            # one rule for every entry point: rules that live in eBPF are enforced by eBPF, or no sandbox
            why = ("no_audit was asked" if not audit else "the agent runs without its eBPF audit" if self.rec is None
                   else f"eBPF enforcement is unavailable ({self.rec.enforce_error})" if self.rec.enforcer is None
                   else None)
            if why:
                raise ApiError("FAILED_PRECONDITION", f"policy {policy.name} ({policy.mode}) has "
                                                      f"{' and '.join(need)} rules, which only eBPF enforces, and "
                                                      f"{why}: refused")
        fields = {"priority": priority, "labels": labels, "lifetime": lifetime, "grace": grace}
        img, vols = self.node_images.check_request(req, rootfs)
        # with an image, its defaults apply where the request names none
        key = profile_key(cpus_quota=quota, memory=memory, pids=pids, policy=policy, network=network,
                          rootfs=rootfs, env=env, image=img and img.digest,
                          user=req.get("user") or None if img else user,
                          workdir=req.get("workdir") or None if img else workdir)
        with self._lock:
            self._check_room_locked()
            if not sid and not req.get("no_warm") and not req.get("keep") and audit and not vols and win is None \
                    and not req.get("from_snapshot") and req.get("auto_snapshot") is None \
                    and over_budget == self.cfg.audit.over_budget and self.warm.profiles:
                rec = self.warm.try_claim_locked(key, fields)
                if rec is not None:
                    self._changed_locked(rec)
                    self._reserve_emits()
                    return rec
        spec = SandboxSpec(argv=[], sandbox_id=sid or launcher.new_sandbox_id(), cpus=quota, memory=memory,
                           pids=pids, grace=grace, rootfs=rootfs, network=network, env=env, workdir=workdir,
                           user=user, keep=bool(req.get("keep")), policy=policy, volumes=vols,
                           rootfs_roots=None if caller.local else self.cfg.rootfs_roots)
        spec.allow_root = caller.may("root")
        auto = req.get("auto_snapshot")
        if auto is not None:
            if auto.get("every_steps") and img is None and not rootfs and not req.get("from_snapshot"):
                raise _bad("auto_snapshot: snapshots need a sandbox on an image, a rootfs or a snapshot "
                           "(the default root is several overlays over host directories)")
            spec.auto_snapshot = dict(auto)
        if req.get("from_snapshot"):
            if img is not None or rootfs:
                raise _bad("from_snapshot: the snapshot names its own image or rootfs")
            self.snapshots.fork_spec(spec, req["from_snapshot"], req, caller)
        try:
            if img is not None:
                # unpacked before the request queues (outside the lock; concurrent requests for one
                # image wait for one unpack): a request whose image is cached never waits behind it
                try:
                    self.node_images.prepare(spec, img, user=req.get("user") or None,
                                             workdir=req.get("workdir") or None, env=env)
                except ReportedError as e:
                    raise _bad(e.message) from None
            return self._submit_created(spec, sid, labels, priority, acc_cpus, memory, pids, audit,
                                        over_budget, lifetime, grace, win)
        except BaseException:
            if getattr(spec, "lease", None) and os.path.exists(spec.lease):
                os.unlink(spec.lease)        # never created: its layers are not held
            self.snapshots.release(spec)
            raise

    def _check_room_locked(self):
        if self._shutting:
            raise ApiError("UNAVAILABLE", "the agent is shutting down")
        if len(self._records) < self.cfg.limits.max_sandboxes:
            return          # (the live ones are among them: no count of every record per create)
        live = sum(1 for r in self._records.values() if r.state not in ENDED)
        if live >= self.cfg.limits.max_sandboxes:
            raise ApiError("RESOURCE_EXHAUSTED", f"the agent already holds {live} sandboxes "
                                                 f"(limits.max_sandboxes)")

    def _submit_created(self, spec, sid, labels, priority, acc_cpus, memory, pids, audit, over_budget,
                        lifetime, grace, win=None):
        from agent.sandbox import launcher
        from agent.node.scheduler import Request
        with self._lock:
            self._check_room_locked()
            if sid:
                if sid in self._records or any(w.rec.id == sid for w in self.warm.entries.values()):
                    raise ApiError("ALREADY_EXISTS", f"sandbox id {sid} is in use")
                if os.path.exists(os.path.join(launcher.SANDBOX_DIR, sid)):
                    raise ApiError("ALREADY_EXISTS", f"sandbox id {sid} is in use on this node "
                                                     f"(state dir {launcher.SANDBOX_DIR}/{sid} exists)")
            else:
                sid = spec.sandbox_id
            rec = SandboxRecord(sid, spec, labels=labels, priority=priority, cpus=acc_cpus, memory=memory,
                                pids=pids, audit=audit and self.rec is not None, over_budget=over_budget,
                                lifetime=lifetime, grace=grace, lock=self._lock)
            rec.window = win
            self._records[sid] = rec
            self._lifecycle(sid, "requested", **self._request_extra(rec))
            dec = self.sched.submit(Request(id=sid, cpus=acc_cpus, memory=memory, pids=pids, priority=priority,
                                            labels=labels, window=win.sched_window() if win else None))
            if dec.rejected:
                del self._records[sid]
                self._after_sched_locked(dec.actions)
                reason = dec.reason or "rejected"
                if "already live" in reason or "is live" in reason:
                    raise ApiError("ALREADY_EXISTS", reason)
                raise _bad(reason)
            self._after_sched_locked(dec.actions)
        self._reserve_emits()
        return rec

    @staticmethod
    def _request_extra(rec: SandboxRecord) -> dict:
        sp = rec.spec
        img = sp.image or {}
        return {"priority": rec.priority, "cpus": rec.cpus, "cpu_quota": sp.cpus, "memory": rec.memory,
                "pids": rec.pids, "network": sp.network, "rootfs": sp.rootfs or "default", "user": sp.user,
                "workdir": sp.workdir, "lifetime_s": rec.lifetime, "audit": rec.audit,
                "image": img.get("name"), "image_digest": img.get("digest"),
                "volumes": [v.to_dict() for v in sp.volumes] or None,
                "window": rec.window.to_dict() if rec.window else None}

    # ================================================================ lookups

    def lookup(self, sid: str, caller=ADMIN, method: str = "Get") -> SandboxRecord:
        if not sid:
            raise _bad("sandbox_id: required")
        rec = self._records.get(sid) or self._ended.get(sid)
        if rec is None or rec.state == WARM:
            if not caller.admin:
                self.authz.check_sandbox(caller, {}, sid, method)
            raise ApiError("NOT_FOUND", f"no sandbox {sid[:80]!r} on this agent")
        self.authz.check_sandbox(caller, rec.labels, sid, method)
        return rec

    def info(self, rec: SandboxRecord, summary: bool = True) -> dict:
        with self._lock:
            out = {"sandbox_id": rec.id, "state": rec.state, "reason": rec.reason or rec.stop_reason or "",
                   "priority": rec.priority, "cpus": rec.spec.cpus or 0.0, "cpus_accounted": rec.cpus,
                   "memory": rec.memory, "pids": rec.pids, "labels": dict(rec.labels),
                   "network": rec.spec.network, "created_ns": rec.created_ns, "admitted_ns": rec.admitted_ns,
                   "started_ns": rec.started_ns, "ended_ns": rec.ended_ns, "queued_seconds": rec.queued_s,
                   "steps": rec.steps, "warm": rec.warm, "warm_profile": rec.warm_profile or "",
                   "preempted_for": rec.preempted_for or "", "node": self.node, "cgroup_id": rec.cgroup_id,
                   "waiting": "", "queue_position": -1, "summary": rec.summary if summary else None,
                   "image": (rec.spec.image or {}).get("name", ""), "image_digest": (rec.spec.image or {}).get("digest", ""),
                   "window": rec.window.to_dict() if rec.window else None, "frozen": rec.frozen}
            out.update(rec.policy_identity())
            if rec.state == QUEUED and self.sched is not None:
                i = self.sched.info(rec.id) or {}
                out["waiting"] = i.get("waiting") or ""
                out["queue_position"] = i.get("position", -1)
                out["queued_seconds"] = i.get("waited", 0.0)
                if i.get("reason"):
                    out["reason"] = i["reason"]
            return out

    def list(self, labels: dict, states: list, limit: int, caller=ADMIN) -> list[dict]:
        labels = self.authz.scope(caller, labels)
        for s in states:
            if s not in STATES:
                raise _bad(f"states: {s[:40]!r} is not a state ({', '.join(STATES)})")
        with self._lock:
            recs = [r for r in list(self._records.values()) + list(self._ended.values()) if r.state != WARM]
        out = []
        for r in sorted(recs, key=lambda r: r.created_ns):
            if states and r.state not in states:
                continue
            if any(r.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(self.info(r, summary=False))      # Get/Wait/Close carry the summary
            if limit and len(out) >= limit:
                break
        return out

    # ================================================================ waiting

    def wait(self, sid: str, until: str, timeout: float | None, is_active=lambda: True,
             caller=ADMIN) -> tuple[dict, bool]:
        if until not in ("", "ended", "running"):
            raise _bad(f"until {until[:40]!r}: expected running or ended")
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise _bad(f"timeout_seconds: must be >= 0, got {timeout}")
        rec = self.lookup(sid, caller, "Wait")
        want_running = until == "running"
        deadline = time.monotonic() + timeout if timeout else None
        with rec.changed:                   # the agent's lock; woken by this sandbox's changes only
            while True:
                if rec.state in ENDED or (want_running and rec.state in (RUNNING, STOPPING)):
                    return self.info(rec), False
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not is_active():
                    return self.info(rec), True
                rec.changed.wait(STREAM_POLL if left is None else min(left, STREAM_POLL))

    # ================================================================ kill / close

    def kill(self, sid: str, grace: float | None, reason: str, is_active=lambda: True, caller=ADMIN) -> dict:
        if grace is not None and (math.isnan(grace) or grace < 0 or grace > MAX_GRACE):
            raise _bad(f"grace_seconds: between 0 and {MAX_GRACE:g}, got {grace}")
        if len(reason) > 1024:
            raise _bad("reason: at most 1024 characters")
        rec = self.lookup(sid, caller, "Kill")
        reason = reason or "killed on request"
        with self._lock:
            if rec.state == QUEUED:
                self._cancel_locked(rec, reason)
            elif rec.state not in ENDED:
                self._begin_stop_locked(rec, KILLED, reason, rec.grace if grace is None else grace)
        self._flush_emits()
        info, _ = self.wait(sid, "ended", None, is_active)
        return info

    def close(self, sid: str, is_active=lambda: True, caller=ADMIN) -> dict:
        rec = self.lookup(sid, caller, "CloseSandbox")
        with self._lock:
            if rec.state == QUEUED:
                self._cancel_locked(rec, "closed while queued")
                self._flush_emits()
                return self.info(rec)
        rec.start_done.wait()
        with self._lock:
            if rec.state in ENDED or rec.stop_kind is not None:
                mine = False
            else:
                rec.stop_kind = "closed"
                rec.stop_reason = "closed by the client"
                rec.state = STOPPING
                thaw_if_frozen(self, rec)
                mine = True
        full = None
        if mine:
            self._lifecycle(rec.id, "stopping", step=rec.steps, kind="close")
            full = self._finish(rec, EXITED, None)
        info, _ = self.wait(sid, "ended", None, is_active)
        if full is not None:
            info["summary"] = full
        return info

    # ================================================================ exec

    def exec_step(self, start: dict, inputs, register_cancel, time_remaining, caller=ADMIN, hangup: int = -1):
        """One step; a generator of ("started", step, ts_ns) | ("stdout", bytes) |
        ("stderr", bytes) | ("exit", dict) (agent/node/steps.py)."""
        return steps.exec_step(self, start, inputs, register_cancel, time_remaining, caller, hangup)

    # ================================================================ policy update

    def update_policy(self, sid: str, pol: dict, caller=ADMIN) -> dict:
        rec = self.lookup(sid, caller, "UpdatePolicy")
        self.authz.check_policy_update(caller, pol)
        policy = self.policies.load(pol.get("name"), pol.get("yaml"), pol.get("mode") or None,
                                    pol.get("source_name") or "")
        with self._lock:
            if rec.state != RUNNING:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: only a running sandbox's "
                                                      f"policy can be updated")
            cg = rec.cgroup_id
        if self.rec is None or rec.watch is None or not rec.watch.watched:
            raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is not audited (eBPF unavailable or no_audit): "
                                                  f"no eBPF enforcement to update")
        fn = getattr(self.rec, "update_policy", None)
        if fn is None:
            raise ApiError("UNIMPLEMENTED", "this dsec's recorder cannot update eBPF enforcement of a running "
                                            "sandbox yet (Recorder.update_policy missing)")
        old = rec.policy_identity()
        try:
            result = fn(cg, policy)
        except ReportedError as e:
            raise ApiError("FAILED_PRECONDITION", f"policy update failed: {e.message}") from None
        with self._lock:
            rec.spec.policy = policy
        applied = list((result or {}).get("applied") or [])     # what the recorder says it applied, only
        syscalls = ("unchanged in the kernel filter: the seccomp filter is installed when a step starts from the "
                    "policy the sandbox was created with and cannot be replaced; syscalls the new policy denies can "
                    "only be tightened through eBPF (reported, and killed where the policy says so), never loosened")
        self._lifecycle(rec.id, "policy_updated", step=rec.steps, previous=old, applied=applied)
        self._flush_emits()
        ident = policy.identity()
        return {"sandbox_id": rec.id, "policy_name": ident.get("policy_name", ""),
                "policy_hash": ident.get("policy_hash", ""), "mode": ident.get("mode", ""),
                "applied": applied, "syscalls": syscalls}

    # ================================================================ events

    def stream_events(self, sandboxes, kinds, decisions, labels, is_active, caller=ADMIN):
        labels = self.authz.scope(caller, labels)
        if not caller.admin:
            for sid in sandboxes:
                self.lookup(sid, caller, "StreamEvents")
        return self.streams.subscribe(sandboxes, kinds, decisions, labels, is_active, self._stop.is_set)

    def query_events(self, sid: str, kinds, limit: int, flush_timeout: float, caller=ADMIN):
        from replay.store import AuditStore, check_kinds
        if not sid:
            raise _bad("sandbox_id: required")
        if not caller.admin:
            self.lookup(sid, caller, "QueryEvents")
        try:
            kinds = check_kinds(kinds)
        except ReportedError as e:
            raise _bad(f"kinds: {e.message}") from None
        if math.isnan(flush_timeout) or flush_timeout < 0 or flush_timeout > 600:
            raise _bad(f"flush_timeout_seconds: between 0 and 600, got {flush_timeout}")
        if self.export is None:
            raise ApiError("UNIMPLEMENTED", "this agent runs without its ClickHouse exporter (exporter.clickhouse)")
        self.export.wait_exported(self.export.head(), flush_timeout or 10.0)
        try:
            store = AuditStore(self.export.url)
            with store:
                n = 0
                for ev in store.events(sid, kinds, limit=limit or None):
                    n += 1
                    yield ev
                if n == 0 and store.count(sid) == 0:
                    raise ApiError("NOT_FOUND", f"no events recorded for sandbox {sid[:80]!r}")
        except ReportedError as e:
            raise ApiError("UNAVAILABLE", f"audit store: {e.message}") from None

    # ================================================================ access audit

    def audit_refusal(self, peer: str, identities: list, method: str, reason: str):
        """A caller the agent refused (a TCP client outside the allowlist, or asking
        for what its identity may not do): an access_denied event."""
        log.warning("refused %s (%s) calling %s: %s", peer, ", ".join(identities) or "no identity", method, reason)
        self._emit_record({"kind": "access_denied", "sandbox_id": "", "decision": "denied", "pid": os.getpid(),
                           "addr": peer[:256], "extra": _compact({"peer": peer, "identities": identities,
                                                                    "method": method, "reason": reason})})
        self._flush_emits()

    # ================================================================ capabilities

    def capabilities(self) -> dict:
        from agent.sandbox import cgroups
        try:
            mode = cgroups.detect().mode
        except ReportedError:
            mode = "none"
        with self._lock:
            snap = self.sched.snapshot()
            warm = []
            for p in self.warm.profiles.values():
                ready = sum(1 for w in self.warm.entries.values() if w.profile is p and w.ready)
                c = p.cfg
                warm.append({"name": p.name, "count": p.count, "ready": ready,
                             "spec": {"cpus": c.cpus, "memory": c.memory, "pids": c.pids, "policy": c.policy,
                                      "mode": c.mode, "network": c.network, "rootfs": c.rootfs, "user": c.user,
                                      "workdir": c.workdir, "env": c.env}})
        degraded = list(self.degraded)
        degraded.append("syscall rules: a running sandbox's seccomp filter is fixed; UpdatePolicy changes egress and "
                        "exec rules at once and can tighten syscalls only through eBPF (report/kill)")
        if self._emit_failures:
            degraded.append(f"{self._emit_failures} agent audit record(s) could not be spooled")
        limits = {"max_message_bytes": self.cfg.limits.max_message_bytes, "max_arg_bytes": MAX_ARG_BYTES - 1,
                  "max_exec_bytes": MAX_EXEC_BYTES, "max_argv_items": MAX_ARGV_ITEMS,
                  "max_labels": MAX_LABELS, "max_sandboxes": self.cfg.limits.max_sandboxes,
                  "max_lifetime_seconds": self.cfg.limits.max_lifetime_seconds,
                  "max_stream_subscribers": self.cfg.limits.max_stream_subscribers,
                  "open_files": self.nofile["soft"], "open_files_hard": self.nofile["hard"],
                  # where a sandbox's writes go: "memory" counts them against its memory limit
                  "scratch": self.host.get("scratch", "disk")}
        return {"node": self.node, "agent_version": VERSION, "kernel": os.uname().release, "cgroup_mode": mode,
                "images": self.node_images.report(warm), "snapshots": self.snapshots.report(),
                "audit": self.audit_feature, "enforcement": self.enforce_feature, "degraded": degraded,
                "capacity": snap, "warm_profiles": warm, "limits": limits, "transports": list(self.transports),
                "pid": os.getpid(), "started_ns": self.started_ns}

    # ================================================================ the tick

    def _tick_loop(self):
        period = self.cfg.scheduling.tick_seconds
        while not self._stop.wait(period):
            try:
                self._tick()
            except Exception:  # noqa: BLE001
                log.exception("agent tick failed")
            finally:
                self._flush_emits()

    def _tick(self):
        now = time.monotonic()
        with self._lock:
            acts = self.sched.tick()
            self._after_sched_locked(acts)
            for rec in list(self._records.values()):
                if rec.state != RUNNING or rec.stop_kind is not None:
                    continue
                if rec.deadline is not None and now > rec.deadline:
                    self._begin_stop_locked(rec, KILLED, f"lifetime of {rec.lifetime:g}s exceeded", rec.grace)
                elif rec.sandbox is not None and rec.sandbox.supervisor_dead:
                    self._begin_stop_locked(rec, FAILED, "the sandbox's supervisor died (out of memory?)", 0.0)
        if not self._shutting:
            self.warm.refill()


__all__ = ["Agent", "ApiError", "SandboxRecord", "STATES", "ENDED", "VERSION", "to_json"]
