"""What the node agent knows about each sandbox and each step in flight, and
the shapes its API answers in: states, request limits, ApiError.

    rec = SandboxRecord(sid, spec, labels=..., priority=..., ...)   # from request to teardown
    run = StepRun(argv)                                             # one Exec call

Plain classes with explicit state; the agent (agent/node/daemon.py) changes
them under its lock. Each SandboxRecord has its own condition on that lock
(`changed`): a change of one sandbox wakes only the threads that wait for it.
"""
from __future__ import annotations

import _thread
import json
import os
import threading
import time
from collections import deque

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
        self.cancel = None                  # steps.exec_step's: stop the step as a cancelled call
        self.hangup = -1                    # the step socket's connection, watched for the caller's going
        self.kick = False                   # the step's end records wait to be appended (after the reply)
        self.owner = 0                      # the thread that runs the step's loop (agent/node/steps.py)

    def wake(self):
        if self.owner == _thread.get_ident():
            return              # the step's own thread: it looks at the step's state before it waits
        with self.lock:
            if self.wake_w >= 0:
                try:
                    os.write(self.wake_w, b"x")
                except OSError:
                    pass


class SandboxRecord:
    """What the agent knows about one sandbox, from request to teardown."""

    def __init__(self, sid, spec, *, labels, priority, cpus, memory, pids, audit, over_budget,
                 lifetime, grace, warm_profile=None, lock=None):
        self.id = sid
        # waits for this sandbox's state (Wait, an Exec before it runs, a phase switch) on the agent's
        # lock (`lock`): notified by the agent when this record changes, never by another sandbox's change
        self.changed = threading.Condition(lock)
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
        self.failed_start = None               # the launcher.Sandbox whose start failed (torn down by it)
        self.watch = None                      # its sensors.watch.SandboxWatch (the record)
        self.cgroup_id = 0
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
        self.window = None                     # resources.WindowSpec: a resource window and its phase
        self.frozen = False                    # the circuit breaker froze it (cgroup2 freezer)

    @property
    def policy(self):
        return self.spec.policy

    @property
    def cg(self):
        """Its launcher's cgroups (cgroups.SandboxCgroup) or None, `sandbox` read once:
        a sandbox that ends on another thread has it dropped (Agent._retire, under the
        agent's lock) between two reads."""
        sb = self.sandbox
        return sb.cg if sb is not None else None

    def policy_identity(self) -> dict:
        p = self.spec.policy
        return p.identity() if p is not None else {}
