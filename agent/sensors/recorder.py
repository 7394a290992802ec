"""The audit recorder of one dsec process: eBPF sensors -> durable spool.

    rec = Recorder(node)                    # compiles and attaches the eBPF programs once
    rec.watch(sandbox_id, cgroup_id, policy=p, cgroup_path=path)   # before any sandbox process
    rec.started(cgroup_id, supervisor_pid)  # enforcement starts here (the supervisor is exempt)
    rec.set_step(cgroup_id, 2)
    rec.record({...})                       # the launcher's own records (sandbox_start/exit ...)
    stats = rec.unwatch(cgroup_id)          # after the sandbox is gone: drains, reports losses
    rec.close()

Two sensors, one per concern (Tetragon style): the audit sensor (exec, fork,
exit, connect, file writes; agent/sensors/audit.py) and the enforcement sensor
(egress, exec allowlist, syscall violations and learn-mode counts;
agent/sensors/enforce.py). A background thread polls both and appends decoded
records to the spool in batches; the spool is the durable hand-off to the
exporters. The recorder knows no sink. Taps (add_tap) see every record as it
is spooled (live streams).

Every record is stamped with the policy's name, hash and mode and a decision
(policies/evaluate.py) unless the sensor set one itself.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from agent.errors import DsecError, EXIT_DSEC
from audit_schema.events import normalize
from policies.evaluate import decision      # per record, on the poll thread: imported once here


class Recorder:
    def __init__(self, node: str | None = None, spool=None, *, enforce: bool = True, **sensor_options):
        from agent.sensors.audit import AuditSensor
        from exporters.spool import Spool
        self.node = node or os.uname().nodename
        self.spool = spool or Spool()
        self._pending: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._instance = os.urandom(8).hex()
        self.stopped: dict[int, int] = {}
        self.policies: dict[str, object] = {}      # sandbox id -> Policy (decision stamping)
        self._watched: dict[int, dict] = {}        # cgroup id -> {sandbox_id, policy, path, enforced}
        self._taps: list = []
        self.enforcer = None
        self.enforce_error = None
        # one after the other: BCC/LLVM crash when two modules compile at once
        self.sensor = AuditSensor(on_record=self._on_record, node=self.node,
                                  on_over_budget=self._on_over_budget, **sensor_options)
        if enforce:
            self._load_enforcer()
        if isinstance(self.enforce_error, BaseException):
            raise self.enforce_error
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dsec-audit-poll", daemon=True)
        self._thread.start()

    def _load_enforcer(self):
        try:
            from agent.sensors.enforce import EnforcementSensor
            self.enforcer = EnforcementSensor(on_record=self._on_record, node=self.node)
        except DsecError as e:
            # reported by watch(): enforce-mode sandboxes refuse to start; others run degraded
            self.enforce_error = e.message
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self.enforce_error = e

    # -- records ----------------------------------------------------------------------
    def _on_record(self, rec: dict):
        pol = self.policies.get(rec.get("sandbox_id"))
        if pol is not None and not rec.get("decision"):
            rec["decision"] = decision(pol, rec)
        with self._lock:
            self._pending.append(rec)

    def _on_over_budget(self, cgroup_id, sandbox_id, lost):
        """over_budget="stop": the kernel killed the process that overflowed; stop the
        rest of the sandbox too, so its record ends instead of having holes."""
        self.stopped[cgroup_id] = lost
        w = self._watched.get(cgroup_id)
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

    def _flush_pending(self):
        with self._lock:
            batch, self._pending = self._pending, []
            taps = list(self._taps)
        if batch:
            self.spool.append_many(batch)
            for fn in taps:
                try:
                    fn(batch)
                except Exception:  # noqa: BLE001 - a slow or broken listener never stops recording
                    pass

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.sensor.poll(20)
                if self.enforcer is not None:
                    self.enforcer.poll(0)
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
        rec = normalize(rec)
        with self._lock:
            self._pending.append(rec)
        self._flush_pending()

    # -- sandboxes ----------------------------------------------------------------------
    def watch(self, sandbox_id: str, cgroup_id: int, policy=None, cgroup_path: str | None = None,
              step: int = 0, **labels):
        """Audit cgroup `cgroup_id` from now on. With a policy, its eBPF enforcement
        starts at started(); an enforce-mode policy whose programs cannot load
        refuses here (exit 125) instead of running unconfined."""
        if policy is not None:
            if self.enforcer is None and policy.mode == "enforce":
                raise DsecError(f"policy {policy.name} (enforce) needs eBPF enforcement, which is "
                                f"unavailable: {self.enforce_error or 'disabled'}", EXIT_DSEC)
            self.policies[sandbox_id] = policy
            labels.update(policy.identity())
        self.sensor.add_sandbox(cgroup_id, sandbox_id, step=step, **labels)
        self._watched[cgroup_id] = {"sandbox_id": sandbox_id, "policy": policy, "path": cgroup_path,
                                    "enforced": False, "step": step}

    def started(self, cgroup_id: int, pid: int):
        """The supervisor exists: name it for enrichment and start enforcement
        (the supervisor and its children until they exec are exempt)."""
        self.sensor.set_root_pid(cgroup_id, pid)
        w = self._watched.get(cgroup_id)
        if not w or w["policy"] is None or self.enforcer is None or not w["path"]:
            if w and w["policy"] is not None and self.enforcer is None:
                sys.stderr.write(f"dsec: warning: sandbox {w['sandbox_id']}: eBPF enforcement unavailable "
                                 f"({self.enforce_error}); {w['policy'].mode} mode runs without it\n")
            return
        self.enforcer.add_sandbox(cgroup_id, w["path"], w["sandbox_id"], w["policy"],
                                  step=w["step"], exempt_pids=[pid])
        w["enforced"] = True

    def set_step(self, cgroup_id: int, step: int):
        self.sensor.set_step(cgroup_id, step)
        w = self._watched.get(cgroup_id)
        if w:
            w["step"] = step
            if w["enforced"]:
                self.enforcer.set_step(cgroup_id, step)

    def update_policy(self, cgroup_id: int, policy):
        """Egress and exec rules of a running sandbox change at once. Syscall rules
        are fixed by the seccomp filter loaded at exec; they can only be tightened."""
        w = self._watched.get(cgroup_id)
        if not w:
            raise DsecError(f"cgroup {cgroup_id} is not watched")
        if not w["enforced"]:
            raise DsecError(f"sandbox {w['sandbox_id']} has no eBPF enforcement to update")
        self.enforcer.update_egress(cgroup_id, policy)
        w["policy"] = policy
        self.policies[w["sandbox_id"]] = policy

    def syscall_counts(self, cgroup_id: int) -> dict:
        w = self._watched.get(cgroup_id)
        if not w or not w["enforced"]:
            return {}
        return self.enforcer.syscall_counts(cgroup_id)

    def catch_up(self):
        """Decode (and enrich) everything the kernel has emitted so far."""
        self.sensor.drain()
        if self.enforcer is not None:
            self.enforcer.drain()
        self._flush_pending()

    def unwatch(self, cgroup_id: int) -> dict:
        w = self._watched.pop(cgroup_id, None)
        stats = self.sensor.remove_sandbox(cgroup_id)
        if w and w["enforced"]:
            est = self.enforcer.remove_sandbox(cgroup_id)
            stats = dict(stats)
            stats["lost_total"] = stats.get("lost_total", 0) + est.get("lost_total", 0)
            stats["enforcement"] = est
        self._flush_pending()
        if self._error:
            raise DsecError(f"audit pipeline failed: {self._error}")
        return stats

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.sensor.close()
            if self.enforcer is not None:
                self.enforcer.close()
        finally:
            self._flush_pending()


STDIN_RECORD_MAX = 64 << 10
POLICY_RECORD_MAX = 256 << 10


def _policy_text(policy) -> str | None:
    if policy is None:
        return None
    try:
        from policies.load import dump_yaml
        text = dump_yaml(policy)
    except Exception:  # noqa: BLE001 - the record goes on without it
        return None
    return text if len(text) <= POLICY_RECORD_MAX else None
SECRET_ENV_PATTERNS = tuple(p for p in os.environ.get(
    "DSEC_SECRET_ENV", "*TOKEN*,*SECRET*,*PASSWORD*,*PASSWD*,*KEY*,*CREDENTIAL*,AWS_*,*AUTH*").split(",") if p)


def redact_env(env: dict, patterns=SECRET_ENV_PATTERNS) -> dict:
    """Environment for the record: values of variables whose name matches a
    secret pattern (fnmatch, case-insensitive; DSEC_SECRET_ENV) are replaced."""
    import fnmatch
    out = {}
    for k, v in env.items():
        if any(fnmatch.fnmatch(k.upper(), p.upper()) for p in patterns):
            out[k] = "<redacted>"
        else:
            out[k] = v
    return out


class SandboxWatch:
    """Wires one sandbox's launcher hooks to a Recorder.

        w = SandboxWatch(rec, spec)
        sb = Sandbox(spec, **w.hooks())        # or launch(spec, **w.launch_hooks())

    Records sandbox_start (with the resources asked for) before any process
    exists, starts enforcement once the supervisor exists, moves the step
    counter with each step, catches up on the record before the sandbox's
    namespaces go, and records sandbox_exit with the summary. After close,
    `stats` holds the sensors' totals (emitted, lost, syscalls in learn mode)
    and summary["audit"] says the same."""

    def __init__(self, rec: Recorder, spec, labels: dict | None = None):
        self.rec = rec
        self.spec = spec
        self.labels = labels or {}
        self.cgroup_id = 0
        self.stats: dict = {}
        self.step = 0
        self.t_start = time.time_ns()

    def hooks(self) -> dict:
        return {"on_cgroup": self.on_cgroup, "on_started": self.on_started, "on_step": self.on_step,
                "on_workload_exit": self.on_workload_exit, "on_exit": self.on_exit,
                "on_step_info": self.on_step_info, "on_step_end": self.on_step_end}

    def launch_hooks(self) -> dict:
        h = self.hooks()
        step = h.pop("on_step")
        h["on_go"] = lambda sid: step(sid, 1)
        return h

    def on_cgroup(self, sandbox_id, cgroup_id):
        import json
        from agent.sandbox import cgroups
        path = cgroups.SandboxCgroup(cgroups.detect(), sandbox_id).v2_path
        self.rec.watch(sandbox_id, cgroup_id, policy=self.spec.policy, cgroup_path=path, step=0)
        self.cgroup_id = cgroup_id
        s = self.spec
        self.rec.record({"kind": "sandbox_start", "sandbox_id": sandbox_id, "step": 0, "ts_ns": self.t_start,
                         "pid": os.getpid(), "argv": list(s.argv),
                         "extra": json.dumps({"network": s.network, "memory": s.memory, "cpus": s.cpus,
                                              "pids": s.pids, "user": s.user, "workdir": s.workdir,
                                              "rootfs": s.rootfs or "default", "labels": self.labels,
                                              "timeout": s.timeout,
                                              # the policy itself, so replay can re-run under it
                                              "policy_yaml": _policy_text(s.policy)},
                                             separators=(",", ":"))})

    def on_started(self, sandbox_id, pid):
        self.rec.started(self.cgroup_id, pid)

    def on_step(self, sandbox_id, step):
        self.step = step
        self.rec.set_step(self.cgroup_id, step)

    def on_step_info(self, sandbox_id, step, info):
        """Record what the step runs, so replay can re-run it (env secrets redacted,
        stdin bounded)."""
        import base64
        import json
        env = redact_env(info.get("env") or {})
        extra = {"env": env, "workdir": info.get("workdir"), "timeout": info.get("timeout")}
        stdin = info.get("stdin")
        if stdin is not None:
            extra["stdin_b64"] = base64.b64encode(stdin[:STDIN_RECORD_MAX]).decode()
            extra["stdin_bytes"] = len(stdin)
            extra["stdin_truncated"] = len(stdin) > STDIN_RECORD_MAX
        self.rec.record({"kind": "step_start", "sandbox_id": sandbox_id, "step": step, "argv": list(info["argv"]),
                         "argv_truncated": 0, "extra": json.dumps(extra, separators=(",", ":"))})

    def on_step_end(self, sandbox_id, st):
        import json
        self.rec.record({"kind": "step_end", "sandbox_id": sandbox_id, "step": st.step,
                         "exit_code": st.exit_code if st.exit_code is not None else -1, "signal": st.signal or 0,
                         "extra": json.dumps({"timed_out": st.timed_out, "wall_ms": st.wall_ms, "cpu_ms": st.cpu_ms,
                                              "error": st.error, "code": st.code}, separators=(",", ":"))})

    def on_workload_exit(self, sandbox_id):
        self.rec.catch_up()

    def on_exit(self, summary):
        import json
        self.stats = self.rec.unwatch(self.cgroup_id) if self.cgroup_id else {}
        summary["audit"] = {"events": self.stats.get("emitted", 0), "lost": self.stats.get("lost_total", 0),
                            "stopped_over_budget": bool(self.stats.get("stopped"))}
        if self.syscall_counts():
            summary["audit"]["syscalls"] = self.syscall_counts()     # learn mode: in-kernel counts
        self.rec.record({"kind": "sandbox_exit", "sandbox_id": summary["sandbox_id"], "step": self.step,
                         "exit_code": summary["exit_code"] if summary["exit_code"] is not None else -1,
                         "signal": summary["signal"] or 0,
                         "extra": json.dumps({k: v for k, v in summary.items() if k != "changes"}
                                             | {"changes": summary["changes"][:1000]}, separators=(",", ":"))})

    def syscall_counts(self) -> dict:
        return dict((self.stats.get("enforcement") or {}).get("syscalls") or {})
