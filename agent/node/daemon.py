"""The node agent: one long-lived process per node that launches, schedules and
audits sandboxes for many clients (docs/agent.md).

    agent = Agent(load_config(path))
    agent.start()          # eBPF programs once, exporter thread, cleanup of what a dead agent left
    ... agent.create(...), agent.exec_step(...), agent.kill(...) ...   (called by agent/node/api.py)
    agent.shutdown()

Pieces, and who owns what:
  Recorder (agent/sensors/recorder.py)   the eBPF audit: one for the whole agent, watch()/unwatch() per sandbox
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
agent_started, agent_stopped, orphan_cleaned).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import select
import signal
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from agent.errors import DsecError

log = logging.getLogger("dsec.agent")

VERSION = "0.1.0"

# sandbox states
QUEUED, STARTING, RUNNING, STOPPING = "queued", "starting", "running", "stopping"
EXITED, KILLED, PREEMPTED, FAILED, CANCELLED = "exited", "killed", "preempted", "failed", "cancelled"
WARM = "warm"                      # in the warm pool (internal; never listed)
ENDED = frozenset({EXITED, KILLED, PREEMPTED, FAILED, CANCELLED})
STATES = (QUEUED, STARTING, RUNNING, STOPPING, EXITED, KILLED, PREEMPTED, FAILED, CANCELLED)

# request limits (docs/agent.md "Limits")
MAX_ARG_BYTES = 128 << 10          # one argument (Linux MAX_ARG_STRLEN)
MAX_ARGV_ITEMS = 4096
MAX_EXEC_BYTES = 160 << 10         # argv + env of one step, encoded for the supervisor's channel
MAX_ENV_ITEMS = 1024
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_LABEL_VALUE = 1024
MAX_GRACE = 600.0
READ_CHUNK = 64 << 10
STDIN_BUFFER = 8 << 20              # stdin bytes buffered per step before the caller is slowed down
STREAM_POLL = 0.25


class ApiError(Exception):
    """A refusal for the caller: a gRPC status code name and one clear line."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(msg: str) -> ApiError:
    return ApiError("INVALID_ARGUMENT", msg)


def _printable(s: str) -> bool:
    return all(c.isprintable() for c in s)


def _fs(b) -> str:
    """bytes (or str) -> str with surrogateescape: exact bytes survive the launcher's JSON."""
    if isinstance(b, bytes):
        return os.fsdecode(b)
    return b


def _compact(obj) -> str:
    """The `extra` JSON of the agent's events: compact (ClickHouse's visitParam* functions
    expect "key":value without spaces), ASCII, anything unknown as a string."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), default=str)


def to_json(rec: dict) -> str:
    """A record as JSON; non-UTF-8 bytes (lone surrogates) as \\udcXX escapes."""
    return json.dumps(rec, ensure_ascii=True, separators=(",", ":"), default=str)


# ---------------------------------------------------------------- the spool tap

class TapSpool:
    """The recorder's spool with a tap: records appended are also handed to
    `on_records` (the StreamEvents fan-out). Everything else is the Spool's."""

    def __init__(self, spool, on_records):
        self._spool = spool
        self._on_records = on_records

    def append_many(self, records) -> int:
        records = list(records)
        n = self._spool.append_many(records)
        try:
            self._on_records(records)
        except Exception:  # noqa: BLE001 - a subscriber must never break the audit
            log.exception("event stream tap failed")
        return n

    def append(self, record: dict) -> None:
        self.append_many([record])

    def __getattr__(self, name):
        return getattr(self._spool, name)


class Subscriber:
    """One StreamEvents caller: filters and a bounded buffer. Overflow is
    counted and reported to the subscriber (a `lost` message), never silent."""

    def __init__(self, sandboxes, kinds, decisions, labels, maxlen, labels_of):
        self.sandboxes = set(sandboxes)
        self.kinds = set(kinds)
        self.decisions = set(decisions)
        self.labels = dict(labels)
        self.maxlen = maxlen
        self.labels_of = labels_of
        self.q: deque = deque()
        self.dropped = 0
        self.cond = threading.Condition()
        self.closed = False

    def matches(self, r: dict) -> bool:
        if self.sandboxes and r.get("sandbox_id") not in self.sandboxes:
            return False
        if self.kinds and r.get("kind") not in self.kinds:
            return False
        if self.decisions and (r.get("decision") or "") not in self.decisions:
            return False
        if self.labels:
            have = self.labels_of(r.get("sandbox_id") or "")
            if any(have.get(k) != v for k, v in self.labels.items()):
                return False
        return True

    def offer(self, records):
        with self.cond:
            n = 0
            for r in records:
                if self.matches(r):
                    if len(self.q) >= self.maxlen:
                        self.dropped += 1
                    else:
                        self.q.append(r)
                        n += 1
            if n or self.dropped:
                self.cond.notify_all()

    def take(self, timeout: float):
        with self.cond:
            if not self.q and not self.dropped and not self.closed:
                self.cond.wait(timeout)
            items, self.q = list(self.q), deque()
            dropped, self.dropped = self.dropped, 0
            return items, dropped

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _Pokeable:
    """The exporter loop's stop event (is_set/wait/set), whose wait() also returns
    early when poked: a caller waiting for its records to reach ClickHouse
    (`dsec run`, QueryEvents) has them delivered now, not at the next interval."""

    def __init__(self):
        self._stop = False
        self._poked = False
        self._cond = threading.Condition()

    def is_set(self) -> bool:
        return self._stop

    def set(self):
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def poke(self):
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    def wait(self, timeout=None) -> bool:
        with self._cond:
            if not self._stop and not self._poked:
                self._cond.wait(timeout)
            self._poked = False
            return self._stop


# ---------------------------------------------------------------- records

class StepRun:
    """One Exec call in flight."""

    def __init__(self, argv):
        self.argv = argv
        self.step = 0
        self.started_ns = 0
        self.result = None
        self.error: str | None = None
        self.done = False
        self.cancelled = False
        self.lock = threading.Lock()
        self.wake_w = -1
        self.stdin_buf: deque = deque()
        self.stdin_eof = False
        self.stdin_bytes = 0
        self.oom = False
        self.rpc_done = False
        self.pending_signals: list[int] = []

    def wake(self):
        with self.lock:
            if self.wake_w >= 0:
                try:
                    os.write(self.wake_w, b"x")
                except OSError:
                    pass


class SandboxRecord:
    """What the agent knows about one sandbox, from request to teardown."""

    def __init__(self, sid, spec, *, labels, priority, cpus, memory, pids, audit, over_budget,
                 lifetime, grace, warm_profile=None):
        self.id = sid
        self.spec = spec                       # launcher.SandboxSpec (policy inside)
        self.labels = dict(labels)
        self.priority = priority
        self.cpus = cpus                       # accounted CPUs (the quota is spec.cpus, maybe None)
        self.memory = memory
        self.pids = pids
        self.audit = audit
        self.over_budget = over_budget
        self.lifetime = lifetime
        self.grace = grace
        self.warm_profile = warm_profile
        self.state = QUEUED
        self.reason: str | None = None
        self.created_ns = time.time_ns()
        self.admitted_ns = 0
        self.started_ns = 0
        self.ended_ns = 0
        self.queued_s = 0.0
        self.deadline: float | None = None     # monotonic end of lifetime
        self.sandbox = None                    # launcher.Sandbox once started
        self.cgroup_id = 0
        self.watched = False
        self.steps = 0
        self.step_lock = threading.Lock()
        self.run: StepRun | None = None
        self.stop_kind: str | None = None      # killed | preempted | closed | failed: why it is ending
        self.stop_reason: str | None = None
        self.preempted_for: str | None = None
        self.warm = False
        self.warm_slot: str | None = None
        self.summary: dict | None = None
        self.start_done = threading.Event()
        self.stop_started = False
        self.oom_seen = 0

    @property
    def policy(self):
        return self.spec.policy

    def policy_identity(self) -> dict:
        p = self.spec.policy
        return p.identity() if p is not None else {}


class _Profile:
    """A warm-pool profile resolved against the agent's defaults."""

    def __init__(self, cfg_profile, policy, key, cpus_acc):
        self.cfg = cfg_profile
        self.name = cfg_profile.name
        self.count = cfg_profile.count
        self.policy = policy
        self.key = key
        self.cpus = cpus_acc
        self.backoff_until = 0.0
        self.failures = 0


class _WarmEntry:
    def __init__(self, slot, profile: _Profile, rec: SandboxRecord):
        self.slot = slot
        self.profile = profile
        self.rec = rec
        self.ready = False
        self.failed = False


# ---------------------------------------------------------------- the agent

class Agent:
    def __init__(self, cfg):
        self.cfg = cfg
        self.node = os.uname().nodename
        self.instance = os.urandom(6).hex()
        self._eid = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._records: dict[str, SandboxRecord] = {}
        self._ended: OrderedDict[str, SandboxRecord] = OrderedDict()
        self._warm: dict[str, _WarmEntry] = {}
        self._slot_sid: OrderedDict[str, str] = OrderedDict()   # warm slot -> sandbox id (for audit)
        self._profiles: dict[str, _Profile] = {}
        self._subs: list[Subscriber] = []
        self._subs_lock = threading.Lock()
        self._emitq: deque = deque()
        self._emit_lock = threading.Lock()
        self._emit_failures = 0
        self._stop = threading.Event()
        self._shutting = False
        self._threads: list[threading.Thread] = []
        self.rec = None
        self.spool = None
        self.exporter = None
        self.sched = None
        self.degraded: list[str] = []
        self.audit_feature = {"available": False, "detail": "", "missing": []}
        self.enforce_feature = {"available": False, "detail": "", "missing": []}
        self.started_ns = 0
        self._lock_fd = -1
        self.executor: ThreadPoolExecutor | None = None
        self.previous_agent: dict | None = None
        self.cleaned: list[dict] = []
        self.transports: list[str] = []

    # ================================================================ start / stop

    def start(self):
        from agent.sandbox import launcher
        from agent.node.scheduler import Scheduler
        from exporters.spool import Spool
        cfg = self.cfg
        launcher.preflight()
        from agent.sandbox import cgroups
        self._layout = cgroups.detect()
        self.started_ns = time.time_ns()
        self._take_lock()
        self.spool = TapSpool(Spool(), self._on_records)
        self._load_audit()
        if cfg.exporter.clickhouse:
            self._start_exporter()
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
                                   max_pids=cfg.capacity.max_pids,
                                   aging_seconds=cfg.scheduling.aging_seconds, history=cfg.limits.history)
        except DsecError as e:
            raise DsecError(f"capacity: {e.message}", 2)
        self._resolve_profiles()
        self._lifecycle("", "agent_started", pid=os.getpid(), version=VERSION, config={
            "socket": cfg.socket, "tcp": cfg.tcp.listen if cfg.tcp else None,
            "capacity": {"cpus": total_cpus, "memory": total_mem, "reserve_cpus": cfg.capacity.reserve_cpus,
                         "reserve_memory": cfg.capacity.reserve_memory,
                         "cpu_oversubscription": cfg.capacity.cpu_oversubscription},
            "warm_pool": {p.name: p.count for p in cfg.warm_pool}},
            degraded=self.degraded, previous_agent=self.previous_agent)
        self._cleanup_orphans()
        self._write_pidfile()
        self.executor = ThreadPoolExecutor(max_workers=max(32, cfg.scheduling.max_parallel_starts * 4),
                                           thread_name_prefix="dsec-agent-work")
        self._starts = threading.BoundedSemaphore(cfg.scheduling.max_parallel_starts)
        t = threading.Thread(target=self._tick_loop, name="dsec-agent-tick", daemon=True)
        t.start()
        self._threads.append(t)
        self._flush_emits()
        return self

    def _take_lock(self):
        d = self.cfg.run_dir
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.stat(d)
        except OSError as e:
            raise DsecError(f"agent directory {d}: {e.strerror}")
        if st.st_uid != 0:
            raise DsecError(f"agent directory {d} is owned by uid {st.st_uid}, not root: refusing to put "
                            f"the agent's socket there")
        os.chmod(d, 0o700)
        sock_dir = os.path.dirname(self.cfg.socket)
        if sock_dir != d:
            os.makedirs(sock_dir, mode=0o700, exist_ok=True)
            if os.stat(sock_dir).st_uid != 0:
                raise DsecError(f"socket directory {sock_dir} is not owned by root")
            os.chmod(sock_dir, 0o700)
        path = os.path.join(d, "agent.lock")
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                other = self._read_pidfile() or {}
                raise DsecError(f"another dsec agent is running (pid {other.get('pid', '?')}, "
                                f"socket {other.get('socket', self.cfg.socket)})")
            raise
        prev = self._read_pidfile()
        if prev and prev.get("pid") != os.getpid():
            self.previous_agent = prev
            log.warning("previous agent (pid %s, started %s) did not shut down cleanly: cleaning up after it",
                        prev.get("pid"), prev.get("started"))

    def _pidfile(self) -> str:
        return os.path.join(self.cfg.run_dir, "agent.json")

    def _read_pidfile(self) -> dict | None:
        try:
            with open(self._pidfile()) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _write_pidfile(self):
        data = {"pid": os.getpid(), "started": self.started_ns / 1e9, "socket": self.cfg.socket,
                "instance": self.instance, "version": VERSION}
        tmp = self._pidfile() + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self._pidfile())

    def _load_audit(self):
        from agent.sensors import audit as bpf_loader
        missing = bpf_loader.check_features()
        try:
            from agent.sensors import enforce as enforce_loader
            emissing = enforce_loader.check_features()
            self.enforce_feature = {"available": not emissing, "missing": emissing,
                                    "detail": "eBPF enforcement: available" if not emissing else
                                    "eBPF enforcement unavailable: " + "; ".join(emissing)}
            if emissing:
                self.degraded.append("egress/exec enforcement by eBPF unavailable: " + "; ".join(emissing))
        except ImportError:
            self.enforce_feature = {"available": False, "missing": ["agent/sensors/enforce.py not present"],
                                    "detail": "eBPF enforcement not built"}
            self.degraded.append("egress/exec enforcement by eBPF not built into this dsec")
        err = None
        if not missing:
            from agent.sensors.recorder import Recorder
            try:
                self.rec = Recorder(node=self.node, spool=self.spool, over_budget=self.cfg.audit.over_budget)
            except DsecError as e:
                err = e.message
        else:
            err = "; ".join(missing)
        if err:
            if self.cfg.audit.required:
                raise DsecError(f"eBPF audit unavailable: {err} (set audit.required: false to run the agent "
                                f"without it, degraded)")
            self.degraded.append(f"eBPF audit unavailable: {err}: sandboxes run unaudited "
                                 f"(lifecycle events are still recorded)")
            log.error("eBPF audit unavailable: %s; running DEGRADED (audit.required is false)", err)
        if self.rec is not None and getattr(self.rec, "enforcer", True) is None:
            why = getattr(self.rec, "enforce_error", None) or "disabled"
            self.enforce_feature = {"available": False, "missing": self.enforce_feature.get("missing") or [why],
                                    "detail": f"eBPF enforcement unavailable: {why}"}
            msg = (f"eBPF egress/exec enforcement unavailable ({why}): enforce-mode sandboxes are refused, "
                   f"audit/learn-mode ones run without it")
            if msg not in self.degraded:
                self.degraded.append(msg)
        self.audit_feature = {"available": self.rec is not None, "missing": missing if err else [],
                              "detail": "eBPF audit: available" if self.rec is not None
                              else f"eBPF audit unavailable: {err}"}

    def _start_exporter(self):
        from exporters.clickhouse import ClickHouseExporter
        self.exporter = ClickHouseExporter(self.spool._spool)
        self._export_stop = _Pokeable()

        def run():
            try:
                self.exporter.run(self._export_stop, interval=self.cfg.exporter.interval_seconds)
            except Exception:  # noqa: BLE001
                log.exception("ClickHouse exporter thread died; events stay in the spool")
        t = threading.Thread(target=run, name="dsec-agent-export", daemon=True)
        t.start()
        self._export_thread = t

    def _cleanup_orphans(self):
        """What a previous agent (or a killed `dsec run`) left: the same removal
        as `dsec gc`, each audited. Live sandboxes of other processes are never touched."""
        import shutil
        from agent.sandbox import cgroups
        from agent.sandbox import launcher
        from agent.sandbox import netns
        from agent.commands import gc
        found = gc.collect()
        prev_pid = (self.previous_agent or {}).get("pid")
        for sid in found["orphans"]:
            sd = os.path.join(launcher.SANDBOX_DIR, sid)
            owner = sup = None
            try:
                with open(os.path.join(sd, "state.json")) as f:
                    st = json.load(f)
                owner, sup = st.get("owner_pid"), st.get("supervisor_pid")
            except (OSError, ValueError):
                pass
            cg = cgroups.SandboxCgroup(found["layout"], sid)
            left = cg.remove()
            netns.teardown(sid)
            if os.path.isdir(sd) and not left:
                shutil.rmtree(sd, ignore_errors=True)
            why = ("left by the previous agent (pid %s), which died: its supervisor stopped the sandbox when "
                   "the agent's control socket closed" % prev_pid) if prev_pid and owner == prev_pid else \
                "orphan of a dsec process that is gone"
            item = {"sandbox_id": sid, "owner_pid": owner, "supervisor_pid": sup, "reason": why,
                    "cgroups_left": left}
            self.cleaned.append(item)
            self._lifecycle(sid, "orphan_cleaned", **{k: v for k, v in item.items() if k != "sandbox_id"})
            log.warning("cleaned up sandbox %s (%s)%s", sid, why, f"; could not remove {left}" if left else "")
        from pyroute2 import IPRoute
        for link in found["links"]:
            try:
                with IPRoute() as ipr:
                    idx = ipr.link_lookup(ifname=link)
                    if idx:
                        ipr.link("del", index=idx[0])
                self._lifecycle("", "orphan_cleaned", link=link)
            except Exception as e:  # noqa: BLE001
                log.warning("could not remove orphaned link %s: %s", link, e)
        try:
            from agent.sensors import enforce as enforce_loader
            for d in enforce_loader.gc_stale_pins():
                self._lifecycle("", "orphan_cleaned", bpf_pin=d)
        except (ImportError, OSError, AttributeError):
            pass

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
            warm = list(self._warm.values())
            self._warm.clear()
        for w in warm:
            self._submit_work(self._destroy_warm, w, "agent shutting down")
        self._flush_emits()
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(r.state not in ENDED for r in self._records.values()) and time.monotonic() < deadline:
                self._cond.wait(0.2)
        self._stop.set()
        if self.executor:
            self.executor.shutdown(wait=True, cancel_futures=False)
        with self._subs_lock:
            for s in self._subs:
                s.close()
        self._lifecycle("", "agent_stopped", reason=reason)
        self._flush_emits()
        if self.rec is not None:
            try:
                self.rec.close()
            except Exception as e:  # noqa: BLE001
                log.error("closing the audit recorder: %s", e)
        if self.exporter is not None:
            self._export_stop.set()
            self._export_thread.join(timeout=15)
            self.exporter.close()
        if getattr(self, "_sink_threads", None):
            from exporters.configure import stop_sinks
            self._sink_stop.set()
            stop_sinks(self._sink_threads)

    def release(self):
        """The last step of a shutdown (after the API server stopped and its socket is gone):
        remove the pid file and let another agent start."""
        try:
            os.unlink(self._pidfile())
        except OSError:
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

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
        self._emitq.append(r)

    def _emit_record(self, r: dict):
        r.setdefault("ts_ns", time.time_ns())
        self._emitq.append(r)

    def _flush_emits(self):
        """Write the queued agent records to the spool (one durable append)."""
        from audit_schema.events import normalize
        with self._emit_lock:
            batch = []
            while self._emitq:
                r = self._emitq.popleft()
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
                self.spool.append_many(batch)
            except DsecError as e:
                self._emit_failures += len(batch)
                log.error("%d lifecycle audit record(s) could not be spooled: %s", len(batch), e.message)

    def _on_records(self, records):
        with self._subs_lock:
            subs = list(self._subs)
        for s in subs:
            s.offer(records)

    def labels_of(self, sid: str) -> dict:
        rec = self._records.get(sid) or self._ended.get(sid)
        return rec.labels if rec is not None else {}

    # ================================================================ scheduler glue

    def _after_sched_locked(self, actions):
        """Turn transitions into audit events and carry out Actions (under the lock)."""
        for t in self.sched.drain_transitions():
            if t.kind == "warm":
                sid = self._slot_sid.get(t.id, "")
                self._lifecycle(sid, t.state, ts_ns=int(t.at * 1e9), slot=t.id, profile=t.profile,
                                previous=t.previous, reason=t.reason, cause=t.cause, source="scheduler")
            elif t.kind == "request":
                self._lifecycle(t.id, t.state, ts_ns=int(t.at * 1e9), previous=t.previous, priority=t.priority,
                                reason=t.reason, cause=t.cause,
                                waited_s=round(t.waited, 6) if t.waited is not None else None,
                                source="scheduler")
            else:
                self._lifecycle("", "scheduler_" + t.state, ts_ns=int(t.at * 1e9), reason=t.reason)
        if not actions:
            return
        now_ns = time.time_ns()
        for rid in actions.admitted:
            rec = self._records.get(rid)
            if rec is None or rec.state != QUEUED:
                continue
            rec.state = STARTING
            rec.admitted_ns = now_ns
            rec.queued_s = max(0.0, (now_ns - rec.created_ns) / 1e9)
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
            w = self._warm.pop(slot, None)
            if w is not None:
                self._submit_work(self._destroy_warm, w, "drained for a queued request")
        self._cond.notify_all()

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
            except DsecError as e:
                log.error("scheduler release(%s): %s", rec.id, e)
                acts = None
            self._after_sched_locked(acts)

    # ================================================================ sandboxes: start

    def _hooks(self, rec: SandboxRecord) -> dict:
        def on_cgroup(sid, cg):
            rec.cgroup_id = cg
            if rec.audit and self.rec is not None:
                from agent.sandbox import cgroups
                labels = {}
                if rec.over_budget != self.cfg.audit.over_budget:
                    labels["over_budget"] = rec.over_budget
                path = cgroups.SandboxCgroup(self._layout, sid).v2_path
                self.rec.watch(sid, cg, policy=rec.spec.policy, cgroup_path=path, step=0, **labels)
                rec.watched = True
            spec = rec.spec
            r = {"kind": "sandbox_start", "sandbox_id": sid, "step": 0, "ts_ns": rec.created_ns,
                 "pid": os.getpid(), "argv": [],
                 "extra": _compact({"network": spec.network, "memory": spec.memory, "cpus": spec.cpus,
                                    "pids": spec.pids, "user": spec.user, "workdir": spec.workdir,
                                    "rootfs": spec.rootfs or "default", "agent": self.instance,
                                    "warm_profile": rec.warm_profile, "labels": rec.labels,
                                    "priority": rec.priority})}
            r.update(rec.policy_identity())
            if r.get("policy_name"):
                r["decision"] = "allowed"
            self._emit_record(r)

        def on_started(sid, pid):
            if rec.watched:
                self.rec.started(rec.cgroup_id, pid)

        def on_step(sid, step):
            if rec.watched:
                self.rec.set_step(rec.cgroup_id, step)
            run = rec.run
            rec.steps = step
            argv = run.argv if run is not None else []
            self._lifecycle(sid, "step_started", step=step, argv=[_fs(a) for a in argv][:64])
            if run is not None:
                run.step = step
                run.started_ns = time.time_ns()
                run.wake()

        def on_workload_exit(sid):
            if rec.watched:
                self.rec.catch_up()

        def on_exit(summary):
            stats = {}
            if rec.watched:
                try:
                    stats = self.rec.unwatch(rec.cgroup_id)
                except DsecError as e:
                    log.error("sandbox %s: %s", rec.id, e.message)
                    stats = {"error": e.message}
                rec.watched = False
                # the recorder keeps policies for decision stamping; a long-lived agent must forget them
                getattr(self.rec, "policies", {}).pop(rec.id, None)
            summary["audit"] = {"events": stats.get("emitted", 0), "lost": stats.get("lost_total", 0),
                                "stopped_over_budget": bool(stats.get("stopped")), "enabled": rec.audit}
            r = {"kind": "sandbox_exit", "sandbox_id": summary["sandbox_id"], "step": rec.steps,
                 "exit_code": summary["exit_code"] if summary["exit_code"] is not None else -1,
                 "signal": summary["signal"] or 0,
                 "extra": _compact({k: v for k, v in summary.items() if k != "changes"}
                                   | {"changes": summary.get("changes", [])[:1000], "labels": rec.labels})}
            r.update(rec.policy_identity())
            if r.get("policy_name"):
                r["decision"] = "allowed"
            self._emit_record(r)

        return {"on_cgroup": on_cgroup, "on_started": on_started, "on_step": on_step,
                "on_workload_exit": on_workload_exit, "on_exit": on_exit}

    def _start_sandbox(self, rec: SandboxRecord):
        """Create and start the launcher Sandbox of `rec` (executor thread). Returns it or raises."""
        from agent.sandbox.launcher import Sandbox
        sb = Sandbox(rec.spec, **self._hooks(rec))
        with self._starts:
            try:
                sb.start()
            except BaseException:
                if rec.watched:          # start() tore the sandbox down without on_exit
                    try:
                        self.rec.unwatch(rec.cgroup_id)
                    except DsecError:
                        pass
                    rec.watched = False
                    getattr(self.rec, "policies", {}).pop(rec.id, None)
                raise
        return sb

    def _launch(self, rec: SandboxRecord):
        t0 = time.monotonic()
        if rec.sandbox is None:
            try:
                sb = self._start_sandbox(rec)
            except DsecError as e:
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
            self._cond.notify_all()
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
            self._lifecycle(rec.id, "cleaned")
            self._cond.notify_all()
        self._release(rec, reason)
        self._retire(rec)
        self._flush_emits()

    def _retire(self, rec: SandboxRecord):
        """Move an ended record to the bounded history."""
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
            self._cond.notify_all()

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
        self._cond.notify_all()

    def _stop_sandbox(self, rec: SandboxRecord):
        """SIGTERM everything inside, grace, SIGKILL, close (executor thread)."""
        with self._lock:
            if rec.stop_started:
                return
            rec.stop_started = True
            rec.state = STOPPING
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
            rec.reason = reason
            rec.ended_ns = time.time_ns()
            brief = {}
            if summary:
                brief = {k: summary.get(k) for k in ("exit_code", "signal", "oom_killed", "wall_ms", "cpu_ms",
                                                     "max_rss_bytes", "changes_total")}
                brief["audit"] = summary.get("audit")
            if state != PREEMPTED:      # the scheduler's "preempted" transition says it
                self._lifecycle(rec.id, state, step=rec.steps, reason=reason, steps=rec.steps, **brief, **extra)
            self._lifecycle(rec.id, "cleaned", step=rec.steps,
                            kept_upper=(summary or {}).get("kept_upper"))
            self._cond.notify_all()
        self._release(rec, reason if state != EXITED else None)
        self._retire(rec)
        self._flush_emits()          # durable before anyone is told it ended
        return summary

    def _cancel_locked(self, rec: SandboxRecord, reason: str):
        try:
            acts = self.sched.cancel(rec.id, reason)
        except DsecError as e:
            log.error("cancel %s: %s", rec.id, e)
            acts = None
        rec.state = CANCELLED
        rec.reason = reason
        rec.ended_ns = time.time_ns()
        rec.start_done.set()
        self._after_sched_locked(acts)
        self._retire(rec)

    # ================================================================ warm pool

    def _profile_key(self, *, cpus_quota, memory, pids, policy, network, rootfs, user, workdir, env) -> tuple:
        return (cpus_quota, memory, pids, policy.identity()["policy_hash"] if policy else None,
                policy.mode if policy else None, network, rootfs or None, user, workdir,
                tuple(sorted(env.items())))

    def _resolve_profiles(self):
        from policies.model import PolicyError
        for p in self.cfg.warm_pool:
            try:
                policy = self._load_policy(p.policy, None, p.mode)
            except (ApiError, PolicyError) as e:
                raise DsecError(f"warm_pool profile {p.name!r}: policy {p.policy!r}: "
                                f"{getattr(e, 'message', e)}", 2)
            if p.rootfs and not os.path.isdir(p.rootfs):
                raise DsecError(f"warm_pool profile {p.name!r}: rootfs {p.rootfs}: no such directory", 2)
            key = self._profile_key(cpus_quota=p.cpus, memory=p.memory, pids=p.pids, policy=policy,
                                    network=p.network, rootfs=p.rootfs, user=p.user, workdir=p.workdir,
                                    env=dict(p.env))
            self._profiles[p.name] = _Profile(p, policy, key, p.cpus or self.cfg.defaults.cpus)

    def _refill_warm(self):
        """Keep each profile at its count (tick thread). Only capacity nobody waits for is used."""
        from agent.sandbox.launcher import SandboxSpec, new_sandbox_id
        if self._shutting:
            return
        now = time.monotonic()
        for prof in self._profiles.values():
            if prof.count == 0 or now < prof.backoff_until:
                continue
            while True:
                with self._lock:
                    have = sum(1 for w in self._warm.values() if w.profile is prof)
                    if have >= prof.count or self._shutting:
                        break
                    c = prof.cfg
                    slot = self.sched.reserve_warm(prof.name, prof.cpus, c.memory, c.pids)
                    if slot is None:
                        self._after_sched_locked(None)
                        break
                    sid = new_sandbox_id()
                    spec = SandboxSpec(argv=[], sandbox_id=sid, cpus=c.cpus, memory=c.memory, pids=c.pids,
                                       grace=self.cfg.defaults.grace_seconds, rootfs=c.rootfs, network=c.network,
                                       env=dict(c.env), workdir=c.workdir, user=c.user, policy=prof.policy)
                    rec = SandboxRecord(sid, spec, labels={}, priority=self.cfg.defaults.priority, cpus=prof.cpus,
                                        memory=c.memory, pids=c.pids, audit=True,
                                        over_budget=self.cfg.audit.over_budget,
                                        lifetime=self.cfg.defaults.lifetime_seconds,
                                        grace=self.cfg.defaults.grace_seconds, warm_profile=prof.name)
                    rec.state = WARM
                    rec.warm_slot = slot
                    w = _WarmEntry(slot, prof, rec)
                    self._warm[slot] = w
                    self._slot_sid[slot] = sid
                    while len(self._slot_sid) > 10000:
                        self._slot_sid.popitem(last=False)
                    self._after_sched_locked(None)
                self._submit_work(self._start_warm, w)

    def _start_warm(self, w: _WarmEntry):
        try:
            sb = self._start_sandbox(w.rec)
        except Exception as e:  # noqa: BLE001
            msg = e.message if isinstance(e, DsecError) else repr(e)
            prof = w.profile
            prof.failures += 1
            prof.backoff_until = time.monotonic() + min(60.0, 2.0 ** min(prof.failures, 6))
            log.error("warm pool %s: sandbox start failed: %s (retry in %.0fs)", prof.name, msg,
                      prof.backoff_until - time.monotonic())
            with self._lock:
                w.failed = True
                w.rec.start_done.set()
                current = self._warm.get(w.slot) is w
                if current:
                    del self._warm[w.slot]
                self._lifecycle(w.rec.id, "failed", reason=f"warm sandbox start failed: {msg}",
                                profile=prof.name)
                self._cond.notify_all()
            self._release_slot(w.slot, f"warm sandbox start failed: {msg}")
            return
        w.profile.failures = 0
        with self._lock:
            w.rec.sandbox = sb
            w.rec.start_done.set()
            w.ready = True
            self._cond.notify_all()

    def _release_slot(self, slot: str, reason: str):
        with self._lock:
            try:
                acts = self.sched.release_warm(slot, reason)
            except DsecError as e:
                log.error("release_warm(%s): %s", slot, e)
                acts = None
            self._after_sched_locked(acts)

    def _destroy_warm(self, w: _WarmEntry, reason: str):
        w.rec.start_done.wait(120)
        sb = w.rec.sandbox
        if sb is not None:
            try:
                sb.close()
            except Exception:  # noqa: BLE001
                log.exception("warm sandbox %s: close failed", w.rec.id)
        with self._lock:
            w.rec.state = EXITED
            w.rec.reason = reason
            w.rec.ended_ns = time.time_ns()
            self._lifecycle(w.rec.id, "cleaned", reason=reason, profile=w.profile.name)
        if not w.failed:
            self._release_slot(w.slot, reason)

    def _blocker_queued_locked(self) -> bool:
        for rid in self.sched.queue():
            info = self.sched.info(rid) or {}
            if info.get("waiting") == "capacity":
                return True
        return False

    def _try_warm_locked(self, key, req_fields) -> SandboxRecord | None:
        """Hand a ready warm sandbox of a matching profile to the request, or None."""
        from agent.node.scheduler import Request
        prof = next((p for p in self._profiles.values() if p.key == key), None)
        if prof is None or self._blocker_queued_locked():
            return None
        ready = [w for w in self._warm.values() if w.profile is prof and w.ready and not w.failed]
        if not ready:
            return None
        w = min(ready, key=lambda w: w.rec.created_ns)
        rec = w.rec
        req = Request(id=rec.id, cpus=prof.cpus, memory=prof.cfg.memory, pids=prof.cfg.pids,
                      priority=req_fields["priority"], labels=req_fields["labels"])
        d = self.sched.claim_warm(prof.name, req)
        if d.rejected:
            self._after_sched_locked(d.actions)
            raise _bad(d.reason or "rejected")
        # the claimed record takes the caller's fields
        rec.labels = dict(req_fields["labels"])
        rec.priority = req_fields["priority"]
        rec.lifetime = req_fields["lifetime"]
        rec.grace = req_fields["grace"]
        rec.spec.grace = req_fields["grace"]
        rec.warm = True
        rec.created_ns = time.time_ns()
        self._records[rec.id] = rec
        self._lifecycle(rec.id, "requested", **self._request_extra(rec), warm_profile=prof.name)
        if d.warm_slot is not None:
            del self._warm[w.slot]
            if d.warm_slot != w.slot:
                # the scheduler took another slot of the same profile (equal resources): the
                # sandbox that slot stood for now stands for ours
                other = self._warm.pop(d.warm_slot, None)
                if other is not None:
                    other.slot = w.slot
                    other.rec.warm_slot = w.slot
                    self._warm[w.slot] = other
                    self._slot_sid[w.slot] = other.rec.id
                self._slot_sid[d.warm_slot] = rec.id
            rec.warm_slot = d.warm_slot
            rec.state = RUNNING
            rec.admitted_ns = rec.started_ns = time.time_ns()
            rec.deadline = time.monotonic() + rec.lifetime
            sb = rec.sandbox
            rec.oom_seen = sb.cg.oom_kills() if sb is not None and sb.cg else 0
            self._lifecycle(rec.id, "started", launch_ms=0.0, warm=True, profile=prof.name,
                            cgroup_id=rec.cgroup_id, queued_s=0.0)
            self._after_sched_locked(d.actions)
            return rec
        # not expected (checked above): the request went through submit() under the warm
        # sandbox's id; the sandbox now belongs to that request, its slot is given back
        log.warning("warm claim for %s fell back to %s; handing the warm sandbox over", rec.id, d.outcome)
        del self._warm[w.slot]
        try:
            self.sched.release_warm(w.slot, f"handed over to request {rec.id!r}")
        except DsecError:
            pass
        rec.state = QUEUED
        if d.admitted:
            rec.state = QUEUED       # _after_sched_locked launches it (the sandbox exists: marked running)
        self._after_sched_locked(d.actions)
        return rec

    # ================================================================ requests: create

    def _load_policy(self, name: str | None, yaml_text: str | None, mode: str | None, source: str = ""):
        """A Policy from a name (built-in / policy_dirs) or YAML text, with an optional mode
        override. Loaded policies are cached (by file and mtime, or by text): thousands of
        sandboxes of one policy share one object."""
        import hashlib
        from policies.load import builtin_path
        if yaml_text is not None:
            key = ("yaml", hashlib.sha256(yaml_text.encode("utf-8", "surrogateescape")).hexdigest(), source, mode)
        else:
            n = name or self.cfg.defaults.policy
            path = next((os.path.join(d, n + sfx) for d in self.cfg.policy_dirs for sfx in (".yaml", ".yml")
                         if os.path.isfile(os.path.join(d, n + sfx))), None) if "/" not in n else None
            path = path or (builtin_path(n) if "/" not in n else None)
            try:
                mtime = os.stat(path).st_mtime_ns if path else None
            except OSError:
                mtime = None
            key = ("name", n, path, mtime, mode)
        cache = self.__dict__.setdefault("_policy_cache", OrderedDict())
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        policy = self._load_policy_uncached(name, yaml_text, mode, source)
        cache[key] = policy
        while len(cache) > 256:
            cache.popitem(last=False)
        return policy

    def _load_policy_uncached(self, name, yaml_text, mode, source):
        from policies.load import load_policy, load_policy_text
        from policies.model import PolicyError
        try:
            if yaml_text is not None:
                if len(yaml_text.encode("utf-8", "surrogateescape")) > (1 << 20):
                    raise _bad("policy.yaml: larger than 1 MiB")
                policy = load_policy_text(yaml_text, source or "<request policy>")
            else:
                name = name or self.cfg.defaults.policy
                if "/" in name or name.startswith(".") or not _printable(name) or len(name) > 128:
                    raise _bad(f"policy.name {name!r}: a built-in name or a NAME.yaml of the agent's policy_dirs "
                               f"(send a file's contents as policy.yaml)")
                path = None
                for d in self.cfg.policy_dirs:
                    for suffix in (".yaml", ".yml"):
                        cand = os.path.join(d, name + suffix)
                        if os.path.isfile(cand):
                            path = cand
                            break
                    if path:
                        break
                policy = load_policy(path or name)
            if mode:
                if mode not in ("learn", "audit", "enforce"):
                    raise _bad(f"policy.mode {mode!r}: expected learn, audit or enforce")
                policy = policy.with_mode(mode)
        except PolicyError as e:
            raise _bad(f"policy: {e.message}") from None
        return policy

    def create(self, req: dict) -> SandboxRecord:
        """Validate, load the policy, queue (or take a warm sandbox). `req` holds the
        CreateSandboxRequest fields as Python values (see api.py)."""
        from agent.sandbox import launcher
        from agent.sandbox.launcher import SandboxSpec
        from agent.node.scheduler import CLASSES, Request
        d = self.cfg.defaults
        problems = []
        sid = req.get("sandbox_id") or ""
        if sid:
            try:
                launcher.validate_id(sid)
            except DsecError:
                problems.append(f"sandbox_id {sid[:80]!r}: use 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
        res = req.get("resources") or {}
        cpus, memory, pids = res.get("cpus", 0.0), res.get("memory_bytes", 0), res.get("pids", 0)
        if not isinstance(cpus, (int, float)) or math.isnan(cpus) or math.isinf(cpus) or cpus < 0:
            problems.append(f"resources.cpus: must be a number >= 0 (0 = the agent's default), got {cpus!r}")
        if memory < 0:
            problems.append(f"resources.memory_bytes: must be >= 0 (0 = the default), got {memory}")
        elif 0 < memory < (4 << 20):
            problems.append(f"resources.memory_bytes: at least 4 MiB (4194304), got {memory}")
        if pids < 0:
            problems.append(f"resources.pids: must be >= 0 (0 = the default), got {pids}")
        elif pids > (1 << 22):
            problems.append(f"resources.pids: at most {1 << 22}, got {pids}")
        priority = req.get("priority") or d.priority
        if priority not in CLASSES:
            problems.append(f"priority {priority[:40]!r}: expected one of {', '.join(CLASSES)}")
        network = req.get("network") or "none"
        if network not in ("none", "egress"):
            problems.append(f"network {network[:40]!r}: expected none or egress")
        rootfs = req.get("rootfs") or None
        if rootfs is not None:
            if not rootfs.startswith("/") or not os.path.isdir(rootfs):
                problems.append(f"rootfs {rootfs[:200]!r}: not an absolute path of a directory on the agent's host")
            elif any(c in rootfs for c in ",:\\"):
                problems.append(f"rootfs {rootfs[:200]!r}: must not contain ',', ':' or '\\'")
        workdir = req.get("workdir") or "/workspace"
        if not workdir.startswith("/") or "\0" in workdir or len(workdir) > 4096:
            problems.append(f"workdir {workdir[:200]!r}: must be an absolute path")
        user = req.get("user") or "sandbox"
        if len(user) > 64 or not _printable(user) or any(c.isspace() for c in user):
            problems.append(f"user {user[:80]!r}: expected NAME, UID or UID:GID")
        labels = req.get("labels") or {}
        if len(labels) > MAX_LABELS:
            problems.append(f"labels: at most {MAX_LABELS}, got {len(labels)}")
        for k, v in list(labels.items())[:MAX_LABELS + 1]:
            if not k or len(k) > MAX_LABEL_KEY or not _printable(k):
                problems.append(f"labels: key {k[:80]!r}: 1-{MAX_LABEL_KEY} printable characters")
            if len(v) > MAX_LABEL_VALUE or not _printable(v):
                problems.append(f"labels[{k[:40]!r}]: value of at most {MAX_LABEL_VALUE} printable characters")
        env = {}
        try:
            env = self._env(req.get("env") or [], "env")
        except ApiError as e:
            problems.append(e.message)
        lifetime = req.get("lifetime_seconds") or 0.0
        if math.isnan(lifetime) or lifetime < 0 or lifetime > self.cfg.limits.max_lifetime_seconds:
            problems.append(f"lifetime_seconds: between 0 (default) and {self.cfg.limits.max_lifetime_seconds:g}, "
                            f"got {lifetime}")
        grace = req.get("grace_seconds") or 0.0
        if math.isnan(grace) or grace < 0 or grace > MAX_GRACE:
            problems.append(f"grace_seconds: between 0 (default) and {MAX_GRACE:g}, got {grace}")
        over_budget = req.get("over_budget") or self.cfg.audit.over_budget
        if over_budget not in ("summarise", "stop"):
            problems.append(f"over_budget {over_budget[:40]!r}: expected summarise or stop")
        if problems:
            raise _bad("; ".join(problems))
        pol = req.get("policy") or {}
        policy = self._load_policy(pol.get("name"), pol.get("yaml"), pol.get("mode") or None,
                                   pol.get("source_name") or "")
        quota = float(cpus) if cpus else None
        acc_cpus = quota or d.cpus
        memory = memory or d.memory
        pids = pids or d.pids
        lifetime = lifetime or d.lifetime_seconds
        grace = grace or d.grace_seconds
        audit = not req.get("no_audit")
        fields = {"priority": priority, "labels": labels, "lifetime": lifetime, "grace": grace}
        with self._lock:
            if self._shutting:
                raise ApiError("UNAVAILABLE", "the agent is shutting down")
            live = sum(1 for r in self._records.values() if r.state not in ENDED)
            if live >= self.cfg.limits.max_sandboxes:
                raise ApiError("RESOURCE_EXHAUSTED", f"the agent already holds {live} sandboxes "
                                                     f"(limits.max_sandboxes)")
            if not sid and not req.get("no_warm") and not req.get("keep") and audit \
                    and over_budget == self.cfg.audit.over_budget and self._profiles:
                key = self._profile_key(cpus_quota=quota, memory=memory, pids=pids, policy=policy, network=network,
                                        rootfs=rootfs, user=user, workdir=workdir, env=env)
                rec = self._try_warm_locked(key, fields)
                if rec is not None:
                    self._cond.notify_all()
                    return self._created(rec)
            if sid:
                if sid in self._records or any(w.rec.id == sid for w in self._warm.values()):
                    raise ApiError("ALREADY_EXISTS", f"sandbox id {sid} is in use")
                if os.path.exists(os.path.join(launcher.SANDBOX_DIR, sid)):
                    raise ApiError("ALREADY_EXISTS", f"sandbox id {sid} is in use on this node "
                                                     f"(state dir {launcher.SANDBOX_DIR}/{sid} exists)")
            else:
                sid = launcher.new_sandbox_id()
            spec = SandboxSpec(argv=[], sandbox_id=sid, cpus=quota, memory=memory, pids=pids, grace=grace,
                               rootfs=rootfs, network=network, env=env, workdir=workdir, user=user,
                               keep=bool(req.get("keep")), policy=policy)
            rec = SandboxRecord(sid, spec, labels=labels, priority=priority, cpus=acc_cpus, memory=memory,
                                pids=pids, audit=audit and self.rec is not None, over_budget=over_budget,
                                lifetime=lifetime, grace=grace)
            self._records[sid] = rec
            self._lifecycle(sid, "requested", **self._request_extra(rec))
            dec = self.sched.submit(Request(id=sid, cpus=acc_cpus, memory=memory, pids=pids, priority=priority,
                                            labels=labels))
            if dec.rejected:
                del self._records[sid]
                self._after_sched_locked(dec.actions)
                reason = dec.reason or "rejected"
                if "already live" in reason or "is live" in reason:
                    raise ApiError("ALREADY_EXISTS", reason)
                raise _bad(reason)
            self._after_sched_locked(dec.actions)
        return self._created(rec)

    @staticmethod
    def _request_extra(rec: SandboxRecord) -> dict:
        sp = rec.spec
        return {"priority": rec.priority, "cpus": rec.cpus, "cpu_quota": sp.cpus, "memory": rec.memory,
                "pids": rec.pids, "network": sp.network, "rootfs": sp.rootfs or "default", "user": sp.user,
                "workdir": sp.workdir, "lifetime_s": rec.lifetime, "audit": rec.audit}

    def _created(self, rec):
        self._flush_emits()
        return rec

    def _env(self, items, what: str) -> dict:
        env = {}
        if len(items) > MAX_ENV_ITEMS:
            raise _bad(f"{what}: at most {MAX_ENV_ITEMS} variables, got {len(items)}")
        for i, (k, v) in enumerate(items):
            if not k or b"=" in k or b"\0" in k:
                raise _bad(f"{what}[{i}]: name {k[:60]!r}: must be non-empty without '=' or NUL")
            if b"\0" in v:
                raise _bad(f"{what}[{i}] ({k[:60]!r}): value contains a NUL byte")
            if len(k) + len(v) > MAX_ARG_BYTES:
                raise _bad(f"{what}[{i}] ({k[:60]!r}): longer than {MAX_ARG_BYTES} bytes")
            env[_fs(k)] = _fs(v)
        return env

    # ================================================================ lookups

    def lookup(self, sid: str) -> SandboxRecord:
        if not sid:
            raise _bad("sandbox_id: required")
        rec = self._records.get(sid) or self._ended.get(sid)
        if rec is None or rec.state == WARM:
            raise ApiError("NOT_FOUND", f"no sandbox {sid[:80]!r} on this agent")
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
                   "waiting": "", "queue_position": -1, "summary": rec.summary if summary else None}
            out.update(rec.policy_identity())
            if rec.state == QUEUED and self.sched is not None:
                i = self.sched.info(rec.id) or {}
                out["waiting"] = i.get("waiting") or ""
                out["queue_position"] = i.get("position", -1)
                out["queued_seconds"] = i.get("waited", 0.0)
                if i.get("reason"):
                    out["reason"] = i["reason"]
            return out

    def list(self, labels: dict, states: list, limit: int) -> list[dict]:
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

    def wait(self, sid: str, until: str, timeout: float | None, is_active=lambda: True) -> tuple[dict, bool]:
        if until not in ("", "ended", "running"):
            raise _bad(f"until {until[:40]!r}: expected running or ended")
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise _bad(f"timeout_seconds: must be >= 0, got {timeout}")
        rec = self.lookup(sid)
        want_running = until == "running"
        deadline = time.monotonic() + timeout if timeout else None
        with self._cond:
            while True:
                if rec.state in ENDED or (want_running and rec.state in (RUNNING, STOPPING)):
                    return self.info(rec), False
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not is_active():
                    return self.info(rec), True
                self._cond.wait(STREAM_POLL if left is None else min(left, STREAM_POLL))

    # ================================================================ kill / close

    def kill(self, sid: str, grace: float | None, reason: str, is_active=lambda: True) -> dict:
        if grace is not None and (math.isnan(grace) or grace < 0 or grace > MAX_GRACE):
            raise _bad(f"grace_seconds: between 0 and {MAX_GRACE:g}, got {grace}")
        if len(reason) > 1024:
            raise _bad("reason: at most 1024 characters")
        rec = self.lookup(sid)
        reason = reason or "killed on request"
        with self._lock:
            if rec.state == QUEUED:
                self._cancel_locked(rec, reason)
            elif rec.state not in ENDED:
                self._begin_stop_locked(rec, KILLED, reason, rec.grace if grace is None else grace)
        self._flush_emits()
        info, _ = self.wait(sid, "ended", None, is_active)
        return info

    def close(self, sid: str, is_active=lambda: True) -> dict:
        rec = self.lookup(sid)
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

    def exec_step(self, start: dict, inputs, register_cancel, time_remaining):
        """One step; a generator of ("started", step, ts_ns) | ("stdout", bytes) |
        ("stderr", bytes) | ("exit", dict). Raises ApiError (also after "exit",
        when the sandbox was stopped under the step)."""
        argv = start.get("argv") or []
        problems = []
        if not start.get("sandbox_id"):
            problems.append("sandbox_id: required")
        if not argv:
            problems.append("argv: at least the command is required")
        if len(argv) > MAX_ARGV_ITEMS:
            problems.append(f"argv: at most {MAX_ARGV_ITEMS} arguments, got {len(argv)}")
        for i, a in enumerate(argv[:MAX_ARGV_ITEMS + 1]):
            if b"\0" in a:
                problems.append(f"argv[{i}]: contains a NUL byte")
                break
            if len(a) >= MAX_ARG_BYTES:
                problems.append(f"argv[{i}]: {len(a)} bytes; one argument may have at most {MAX_ARG_BYTES - 1} "
                                f"(Linux MAX_ARG_STRLEN)")
                break
        timeout = start.get("timeout_seconds") or 0.0
        grace = start.get("grace_seconds") or 0.0
        if math.isnan(timeout) or timeout < 0:
            problems.append(f"timeout_seconds: must be >= 0 (0 = none), got {timeout}")
        if math.isnan(grace) or grace < 0 or grace > MAX_GRACE:
            problems.append(f"grace_seconds: between 0 (default) and {MAX_GRACE:g}, got {grace}")
        workdir = start.get("workdir") or None
        if workdir is not None and (not workdir.startswith("/") or "\0" in workdir):
            problems.append(f"workdir {workdir[:200]!r}: must be an absolute path")
        env = {}
        try:
            env = self._env(start.get("env") or [], "env")
        except ApiError as e:
            problems.append(e.message)
        if not problems:
            enc = len(json.dumps({"argv": [_fs(a) for a in argv], "env": env}))
            if enc > MAX_EXEC_BYTES:
                problems.append(f"argv and env: {enc} bytes once encoded; a step may carry at most "
                                f"{MAX_EXEC_BYTES} (put large inputs in stdin or files)")
        if problems:
            raise _bad("; ".join(problems))
        rec = self.lookup(start["sandbox_id"])
        run = StepRun(argv)
        close_after = bool(start.get("close_after"))

        def cancel():
            # called when the RPC terminates: only a call that ends while this
            # generator is still running was cancelled (client gone, deadline)
            if run.rpc_done or run.done:
                return
            run.cancelled = True
            run.wake()
            self._submit_work(self._cancelled_step, rec, run, close_after)
        register_cancel(cancel)
        try:
            yield from self._exec_step(rec, run, start, env, workdir, timeout, grace, close_after, inputs,
                                       time_remaining)
        finally:
            run.rpc_done = True

    def _exec_step(self, rec, run, start, env, workdir, timeout, grace, close_after, inputs, time_remaining):
        deadline = None
        rem = time_remaining()
        if rem is not None:
            deadline = time.monotonic() + rem
        # wait until it runs
        with self._cond:
            while rec.state in (QUEUED, STARTING):
                if run.cancelled:
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id} is still {rec.state}")
                self._cond.wait(STREAM_POLL if left is None else min(left, STREAM_POLL))
            if rec.state != RUNNING or rec.stop_kind is not None:
                raise self._gone(rec)
        while not rec.step_lock.acquire(timeout=STREAM_POLL):
            if run.cancelled:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id}: the previous step is still running")
            if rec.state != RUNNING:
                raise self._gone(rec)
        try:
            if rec.state != RUNNING or rec.stop_kind is not None:
                raise self._gone(rec)
            yield from self._run_step(rec, run, start, env, workdir, timeout, grace or None, inputs)
        finally:
            rec.step_lock.release()
        if run.cancelled:
            return
        if close_after:
            with self._lock:
                gone = rec.stop_kind is not None and rec.stop_kind != "closed"
            closed = self.close(rec.id) if not gone else self.info(rec)
        ex = self._exit_status(rec, run)
        if close_after and closed.get("summary") is not None:
            summary = dict(closed["summary"])
            if run.result is not None:
                summary["wall_ms"] = run.result.wall_ms
                summary["timed_out"] = run.result.timed_out
            if start.get("wait_export") and self.exporter is not None:
                pos = self._spool_head()
                ok = self._wait_exported(pos, 10.0)
                summary.setdefault("audit", {})
                summary["audit"]["exported"] = ok
                summary["audit"]["pending"] = 0 if ok else self.exporter.reader.backlog()[0]
                if not ok:
                    summary["audit"]["export_error"] = "not delivered to ClickHouse within 10s (the agent " \
                                                       "keeps delivering)"
            ex["summary"] = summary
        yield ("exit", ex)
        with self._lock:
            stopped = rec.stop_kind not in (None, "closed") or (rec.stop_kind == "closed" and not close_after)
        if stopped:
            raise self._gone(rec, during_step=True)

    def _gone(self, rec: SandboxRecord, during_step: bool = False) -> ApiError:
        kind = rec.stop_kind or rec.state
        what = {PREEMPTED: "was preempted", KILLED: "was killed", "closed": "was closed",
                FAILED: "failed", CANCELLED: "was cancelled", EXITED: "has exited"}.get(kind, f"is {rec.state}")
        why = rec.stop_reason or rec.reason
        msg = f"sandbox {rec.id} {what}" + (f" ({why})" if why else "")
        if during_step:
            msg += "; the step was stopped"
        code = "ABORTED" if during_step or kind == PREEMPTED else "FAILED_PRECONDITION"
        return ApiError(code, msg)

    def _cancelled_step(self, rec: SandboxRecord, run: StepRun, close_after: bool):
        """The caller went away during a step: stop the step (SIGTERM, grace, SIGKILL);
        one-shot runs (close_after) also end their sandbox."""
        sb = rec.sandbox
        if sb is None:
            return
        t_end = time.monotonic() + 30
        while not run.step and not run.done and not run.rpc_done and time.monotonic() < t_end:
            time.sleep(0.02)
        if not run.done and run.step:
            sb.signal(signal.SIGTERM, run.step)
            end = time.monotonic() + rec.grace
            while not run.done and time.monotonic() < end:
                time.sleep(0.05)
            if not run.done:
                sb.signal(signal.SIGKILL, run.step)
        if close_after:
            with self._lock:
                if rec.state == RUNNING and rec.stop_kind is None:
                    self._begin_stop_locked(rec, KILLED, "the client of a one-shot run went away", 0.0)

    def _run_step(self, rec, run: StepRun, start, env, workdir, timeout, grace, inputs):
        sb = rec.sandbox
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        run.wake_w = wake_w
        if start.get("stdin"):
            run.stdin_buf.append(start["stdin"])
            run.stdin_bytes = len(start["stdin"])
        if start.get("close_stdin"):
            run.stdin_eof = True
        rec.run = run
        argv = [_fs(a) for a in run.argv]
        oom_before = sb.cg.oom_kills() if sb.cg else 0

        def runner():
            try:
                run.result = sb.exec(argv, env=env or None, workdir=workdir, stdin=in_r, stdout=out_w, stderr=err_w,
                                     timeout=timeout or None, grace=grace)
            except DsecError as e:
                run.error = e.message
            except Exception as e:  # noqa: BLE001
                log.exception("sandbox %s: exec failed", rec.id)
                run.error = f"internal error: {e!r}"
            finally:
                for fd in (in_r, out_w, err_w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                run.done = True
                run.wake()

        def reader():
            try:
                for kind, value in inputs:
                    if kind == "stdin":
                        while run.stdin_bytes > STDIN_BUFFER and not run.done and not run.cancelled:
                            time.sleep(0.01)         # backpressure: the step is not reading
                        with run.lock:
                            if not run.stdin_eof and not run.done:
                                run.stdin_buf.append(value)
                                run.stdin_bytes += len(value)
                    elif kind == "close_stdin":
                        run.stdin_eof = True
                    elif kind == "signal":
                        if run.step and not run.done:
                            sb.signal(value, run.step)
                        else:
                            run.pending_signals.append(value)
                    run.wake()
            except Exception:  # noqa: BLE001 - the call ended (cancelled or completed)
                pass
            finally:
                run.stdin_eof = True
                run.wake()

        t = threading.Thread(target=runner, name=f"dsec-step-{rec.id}", daemon=True)
        t.start()
        if inputs is not None:
            threading.Thread(target=reader, name=f"dsec-stdin-{rec.id}", daemon=True).start()
        readers = {out_r: "stdout", err_r: "stderr"}
        started_sent = False
        done_at = None
        try:
            while True:
                if run.step and not started_sent:
                    started_sent = True
                    for s in run.pending_signals:
                        sb.signal(s, run.step)
                    run.pending_signals.clear()
                    yield ("started", run.step, run.started_ns)
                if in_w >= 0 and (run.done or run.cancelled or (run.stdin_eof and not run.stdin_buf)):
                    os.close(in_w)
                    in_w = -1
                wfds = [in_w] if in_w >= 0 and run.stdin_buf else []
                tmo = STREAM_POLL if done_at is None else 0.05
                try:
                    r, w, _ = select.select(list(readers) + [wake_r], wfds, [], tmo)
                except InterruptedError:
                    continue
                got = False
                if wake_r in r:
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                for fd in r:
                    if fd == wake_r:
                        continue
                    try:
                        data = os.read(fd, READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if data:
                        got = True
                        if not run.cancelled:
                            yield (readers[fd], data)
                    else:
                        os.close(fd)
                        del readers[fd]
                if w and in_w >= 0:
                    with run.lock:
                        while run.stdin_buf:
                            chunk = run.stdin_buf[0]
                            try:
                                n = os.write(in_w, chunk)
                            except BlockingIOError:
                                break
                            except BrokenPipeError:
                                run.stdin_buf.clear()
                                run.stdin_bytes = 0
                                break
                            run.stdin_bytes -= n
                            if n < len(chunk):
                                run.stdin_buf[0] = chunk[n:]
                                break
                            run.stdin_buf.popleft()
                if run.done:
                    # after the step: read what is left; background processes that keep
                    # the pipes open do not hold the reply (their later output is dropped)
                    if done_at is None:
                        done_at = time.monotonic()
                        if readers:
                            continue
                    if not readers or not got or time.monotonic() - done_at > 2.0:
                        break
            t.join()
        finally:
            if not run.done:
                # the call went away mid-step (generator closed): keep the step lock until the
                # step is over (the cancellation stops it), so steps never overlap
                t.join(timeout=rec.grace + 10)
            with run.lock:
                run.wake_w = -1
            for fd in list(readers) + [wake_r, wake_w] + ([in_w] if in_w >= 0 else []):
                try:
                    os.close(fd)
                except OSError:
                    pass
        st = run.result
        oom = bool(sb.cg and sb.cg.oom_kills() > oom_before)
        run.oom = oom
        if st is not None:
            self._lifecycle(rec.id, "step_ended", step=st.step, code=st.code, exit_code=st.exit_code,
                            signal=st.signal, timed_out=st.timed_out, wall_ms=st.wall_ms, cpu_ms=st.cpu_ms,
                            oom_killed=oom or None, error=st.error)
        elif run.error:
            self._lifecycle(rec.id, "step_ended", step=run.step, error=run.error)
        self._flush_emits()

    def _exit_status(self, rec: SandboxRecord, run: StepRun) -> dict:
        from agent.errors import EXIT_DSEC
        st = run.result
        ex = {"step": run.step, "sandbox_state": rec.state, "sandbox_reason": rec.stop_reason or rec.reason or "",
              "preempted": rec.stop_kind == PREEMPTED, "oom_killed": getattr(run, "oom", False)}
        if st is None:
            ex.update(code=EXIT_DSEC, exit_code=None, signal=0, timed_out=False, error=run.error or "step failed",
                      wall_ms=0, cpu_ms=0, max_rss_bytes=0)
        else:
            ex.update(code=st.code, exit_code=st.exit_code, signal=st.signal or 0, timed_out=st.timed_out,
                      error=st.error or "", wall_ms=st.wall_ms, cpu_ms=st.cpu_ms, max_rss_bytes=st.max_rss_bytes)
        return ex

    # ================================================================ export barrier

    def _spool_head(self):
        from exporters.spool import Position
        sp = self.spool._spool
        segs = sp.segments()
        if not segs:
            return Position(1, 0)
        try:
            size = os.path.getsize(sp.seg_path(segs[-1]))
        except OSError:
            size = 0
        return Position(segs[-1], size)

    def _wait_exported(self, pos, timeout: float) -> bool:
        """True once the ClickHouse sink's cursor is at or past `pos`."""
        from exporters.clickhouse import SINK
        sp = self.spool._spool
        deadline = time.monotonic() + timeout
        if self.exporter is not None:
            self._export_stop.poke()           # deliver now rather than at the next interval
        while True:
            cur = sp.load_cursor(SINK)
            if cur is not None and (cur.segment, cur.offset) >= (pos.segment, pos.offset):
                return True
            if cur is not None and cur.segment > pos.segment:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    # ================================================================ policy update

    def update_policy(self, sid: str, pol: dict) -> dict:
        rec = self.lookup(sid)
        policy = self._load_policy(pol.get("name"), pol.get("yaml"), pol.get("mode") or None,
                                   pol.get("source_name") or "")
        with self._lock:
            if rec.state != RUNNING:
                raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is {rec.state}: only a running sandbox's "
                                                      f"policy can be updated")
            cg = rec.cgroup_id
        if self.rec is None or not rec.watched:
            raise ApiError("FAILED_PRECONDITION", f"sandbox {rec.id} is not audited (eBPF unavailable or no_audit): "
                                                  f"no eBPF enforcement to update")
        fn = getattr(self.rec, "update_policy", None)
        if fn is None:
            raise ApiError("UNIMPLEMENTED", "this dsec's recorder cannot update eBPF enforcement of a running "
                                            "sandbox yet (Recorder.update_policy missing)")
        old = rec.policy_identity()
        try:
            result = fn(cg, policy)
        except DsecError as e:
            raise ApiError("FAILED_PRECONDITION", f"policy update failed: {e.message}") from None
        with self._lock:
            rec.spec.policy = policy
        applied = ["egress", "exec"]
        if isinstance(result, dict) and result.get("applied"):
            applied = list(result["applied"])
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

    def stream_events(self, sandboxes, kinds, decisions, labels, is_active):
        from audit_schema.events import KINDS
        for k in kinds:
            if k not in KINDS:
                raise _bad(f"kinds: {k[:40]!r} is not an event kind ({', '.join(KINDS)})")
        for d in decisions:
            if d not in ("allowed", "denied", "would-deny"):
                raise _bad(f"decisions: {d[:40]!r}: expected allowed, denied or would-deny")
        sub = Subscriber(sandboxes, kinds, decisions, labels, self.cfg.limits.stream_buffer, self.labels_of)
        with self._subs_lock:
            if len(self._subs) >= self.cfg.limits.max_stream_subscribers:
                raise ApiError("RESOURCE_EXHAUSTED", f"{len(self._subs)} event streams are open "
                                                     f"(limits.max_stream_subscribers)")
            self._subs.append(sub)
        try:
            while is_active() and not self._stop.is_set():
                items, dropped = sub.take(STREAM_POLL)
                if dropped:
                    yield ("lost", dropped, f"this stream fell behind: {dropped} event(s) were not delivered to it "
                                            f"(they are in the spool and ClickHouse)")
                for r in items:
                    yield ("event", r)
                if sub.closed:
                    return
        finally:
            with self._subs_lock:
                if sub in self._subs:
                    self._subs.remove(sub)

    def query_events(self, sid: str, kinds, limit: int, flush_timeout: float):
        from replay.store import AuditStore, check_kinds
        if not sid:
            raise _bad("sandbox_id: required")
        try:
            kinds = check_kinds(kinds)
        except DsecError as e:
            raise _bad(f"kinds: {e.message}") from None
        if math.isnan(flush_timeout) or flush_timeout < 0 or flush_timeout > 600:
            raise _bad(f"flush_timeout_seconds: between 0 and 600, got {flush_timeout}")
        if self.exporter is None:
            raise ApiError("UNIMPLEMENTED", "this agent runs without its ClickHouse exporter (exporter.clickhouse)")
        self._wait_exported(self._spool_head(), flush_timeout or 10.0)
        try:
            store = AuditStore(self.exporter._url)
            with store:
                n = 0
                for ev in store.events(sid, kinds, limit=limit or None):
                    n += 1
                    yield ev
                if n == 0 and store.count(sid) == 0:
                    raise ApiError("NOT_FOUND", f"no events recorded for sandbox {sid[:80]!r}")
        except DsecError as e:
            raise ApiError("UNAVAILABLE", f"audit store: {e.message}") from None

    # ================================================================ access audit

    def audit_refusal(self, peer: str, identities: list, method: str, reason: str):
        """A caller the agent refused (TCP client outside the allowlist): an access_denied event."""
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
        except DsecError:
            mode = "none"
        with self._lock:
            snap = self.sched.snapshot()
            warm = []
            for p in self._profiles.values():
                ready = sum(1 for w in self._warm.values() if w.profile is p and w.ready)
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
                  "max_stream_subscribers": self.cfg.limits.max_stream_subscribers}
        return {"node": self.node, "agent_version": VERSION, "kernel": os.uname().release, "cgroup_mode": mode,
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
            self._refill_warm()


__all__ = ["Agent", "ApiError", "SandboxRecord", "STATES", "ENDED", "VERSION", "to_json"]
