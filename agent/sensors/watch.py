"""SandboxWatch: the one path that records a sandbox, wired to the launcher's hooks.

    w = SandboxWatch(rec, spec, labels={"job": "rl-7"})
    sb = Sandbox(spec, **w.hooks())                # or launch(spec, **w.launch_hooks())

Both `dsec run` (agent/sensors/inprocess.py) and the node agent
(agent/node/daemon.py) record their sandboxes through it, so every sandbox's
record has the same shape whoever launched it:

  sandbox_start  before any sandbox process exists: resources, user, workdir,
                 rootfs, labels, timeout and the policy's YAML (what replay
                 needs to re-run it), stamped with the policy's identity;
  step_start     each step's argv, redacted env (DSEC_SECRET_ENV), workdir,
                 timeout and bounded stdin;
  step_end       its exit, signal, timeout, wall and CPU time;
  sandbox_exit   the summary (file changes bounded), labels, audit totals.

It registers the sandbox with the Recorder (rec.watch) and starts
enforcement once the supervisor is in the cgroup and has said HELLO, moves the step counter with
each step, catches up on the record before the namespaces go, and reads the
sensors' totals at the end (`stats`; summary["audit"] says the same).

rec may be None (a sandbox the node agent runs unaudited): the lifecycle
records above are still written, through `emit`. A warm sandbox is created
with defer_start=True: its sandbox_start waits for claim(labels), so the
record carries the labels of the request that got it (or, never claimed,
it is written at the end with none).
"""
from __future__ import annotations

import base64
import fnmatch
import functools
import json
import os
import re
import sys
import time

from audit_schema.errors import ReportedError

STDIN_RECORD_MAX = 64 << 10
POLICY_RECORD_MAX = 256 << 10
CHANGES_RECORD_MAX = 1000          # changes kept inline in sandbox_exit (when they fit CHANGES_INLINE_BYTES)
CHANGES_INLINE_BYTES = 256 << 10
CHANGES_PAGE = 200                 # changes per file_changes record
CHANGES_PAGE_BYTES = 1 << 20       # ... and at most this much JSON


def change_pages(changes: list) -> list[list]:
    """The change manifest in pages of at most CHANGES_PAGE entries and
    ~CHANGES_PAGE_BYTES of JSON each (a 4 KiB non-UTF-8 path grows ~7x escaped)."""
    pages, page, size = [], [], 0
    for c in changes:
        n = len(json.dumps(c, separators=(",", ":"), default=str))
        if page and (len(page) >= CHANGES_PAGE or size + n > CHANGES_PAGE_BYTES):
            pages.append(page)
            page, size = [], 0
        page.append(c)
        size += n
    if page:
        pages.append(page)
    return pages
SECRET_ENV_PATTERNS = tuple(p for p in os.environ.get(
    "DSEC_SECRET_ENV", "*TOKEN*,*SECRET*,*PASSWORD*,*PASSWD*,*KEY*,*CREDENTIAL*,AWS_*,*AUTH*").split(",") if p)


def redact_env(env: dict, patterns=SECRET_ENV_PATTERNS) -> dict:
    """Environment for the record: values of variables whose name matches a
    secret pattern (fnmatch, case-insensitive; DSEC_SECRET_ENV) are replaced."""
    secret = _secret_names(tuple(patterns))
    return {k: "<redacted>" if secret(k) else v for k, v in env.items()}


@functools.lru_cache(maxsize=8)
def _secret_names(patterns: tuple):
    """name -> whether it matches one of the patterns: one regex of them all (fnmatch's own
    translation, upper-cased as fnmatch was called), each name's answer kept (a step's
    environment is mostly its sandbox's: ~6 names, 8 patterns, 48 fnmatch calls a step before)."""
    rx = re.compile("|".join(fnmatch.translate(p.upper()) for p in patterns)) if patterns else None

    @functools.lru_cache(maxsize=4096)
    def secret(name: str) -> bool:
        return rx is not None and rx.match(name.upper()) is not None
    return secret


def _compact(obj) -> str:
    """`extra` JSON: compact (ClickHouse's visitParam* functions expect "key":value
    without spaces), anything unknown as a string."""
    return json.dumps(obj, separators=(",", ":"), default=str)


def policy_text(policy) -> str | None:
    if policy is None:
        return None
    try:
        from policies.load import dump_yaml
        text = dump_yaml(policy)
    except Exception:  # noqa: BLE001 - the record goes on without it
        return None
    return text if len(text) <= POLICY_RECORD_MAX else None


class SandboxWatch:
    def __init__(self, rec, spec, labels: dict | None = None, *, emit=None, start_extra: dict | None = None,
                 sensor_labels: dict | None = None, defer_start: bool = False, raise_errors: bool = True,
                 created_ns: int | None = None, flush: bool = True):
        self.rec = rec                      # agent.sensors.recorder.Recorder, or None: not audited
        self.spec = spec
        self.labels = dict(labels or {})
        self.emit = emit or rec.record       # how a record of ours is written (durably)
        self.start_extra = dict(start_extra or {})
        self.sensor_labels = dict(sensor_labels or {})
        self.defer_start = defer_start
        self.raise_errors = raise_errors
        # False: the catch-up's and the watch end's records are queued, not appended; the caller
        # makes them durable (the node agent: with its close's records, Recorder.append_with, or
        # make_durable(self.ticket))
        self.flush = flush
        self.ticket = 0                     # the recorder's ticket once the watch has ended
        self.sandbox_id = spec.sandbox_id
        self.cgroup_id = 0
        self.watched = False
        self.started_recorded = False
        self.stats: dict = {}
        self.step = 0
        self.t_start = created_ns or time.time_ns()

    # -- wiring --------------------------------------------------------------------
    def hooks(self, **after) -> dict:
        """The launcher's hooks; `after` adds the caller's own hook functions, each
        called after the watch's (on_cgroup=fn, on_step=fn, ...)."""
        own = {"on_cgroup": self.on_cgroup, "on_started": self.on_started, "on_ready": self.on_ready,
               "on_step": self.on_step,
               "on_workload_exit": self.on_workload_exit, "on_exit": self.on_exit,
               "on_step_info": self.on_step_info, "on_step_end": self.on_step_end}
        for name, fn in after.items():
            if fn is None:
                continue
            if name not in own:
                raise TypeError(f"SandboxWatch.hooks: unknown hook {name}")
            own[name] = _chain(own[name], fn)
        return own

    def launch_hooks(self) -> dict:
        h = self.hooks()
        step = h.pop("on_step")
        h["on_go"] = lambda sid: step(sid, 1)
        return h

    # -- records --------------------------------------------------------------------
    def _record(self, r: dict):
        img = getattr(self.spec, "image", None)
        if img:
            r.setdefault("image_digest", img["digest"])
        pol = self.spec.policy
        if pol is not None:
            for k, v in pol.identity().items():
                r.setdefault(k, v)
            r.setdefault("decision", "allowed")
        self.emit(r)

    def _record_start(self):
        s = self.spec
        extra = {"network": s.network, "memory": s.memory, "cpus": s.cpus, "pids": s.pids, "user": s.user,
                 "workdir": s.workdir, "rootfs": s.rootfs or "default", "labels": self.labels,
                 "timeout": s.timeout,
                 # the image (name, manifest and layer digests) and data volumes, if any
                 "image": getattr(s, "image", None),
                 "volumes": [v.to_dict() for v in getattr(s, "volumes", ())],
                 # a fork: the sandbox and snapshot it started from, and that snapshot's step
                 "lineage": getattr(s, "lineage", None),
                 # the policy itself, so replay can re-run under it
                 "policy_yaml": policy_text(s.policy)}
        extra.update(self.start_extra)
        self.started_recorded = True
        self._record({"kind": "sandbox_start", "sandbox_id": self.sandbox_id, "step": 0, "ts_ns": self.t_start,
                      "pid": os.getpid(), "argv": list(s.argv), "extra": _compact(extra)})

    def claim(self, labels: dict, **start_extra):
        """A deferred (warm) sandbox is handed to a request: its sandbox_start, now,
        with the request's labels (timestamped at the sandbox's creation)."""
        self.labels = dict(labels)
        self.start_extra.update(start_extra)
        if not self.started_recorded:
            self._record_start()

    # -- the launcher's hooks -----------------------------------------------------------
    def on_cgroup(self, sandbox_id, cgroup_id):
        self.sandbox_id = sandbox_id
        self.cgroup_id = cgroup_id
        if self.rec is not None and self.spec.policy is not None:
            self.rec.check_enforceable(self.spec.policy)     # refused before any process exists
        if not self.defer_start:
            self._record_start()

    def on_started(self, sandbox_id, pid):
        """dsec-init is in the cgroups and its own start is done (HELLO): the
        sensors watch the cgroup from here (dsec-init is born inside it: a watch
        begun earlier would record its exec), then enforcement starts. Nothing of
        the sandbox's has run yet. Returns the rule kinds the eBPF enforcement
        sensor now enforces for the sandbox (the launcher refuses a policy whose
        eBPF rules nobody enforces)."""
        if self.rec is not None and not self.watched:
            from agent.sandbox import cgroups
            path = cgroups.SandboxCgroup(cgroups.detect(), sandbox_id).v2_path
            self.rec.watch(sandbox_id, self.cgroup_id, policy=self.spec.policy, cgroup_path=path,
                           step=0, image_digest=(getattr(self.spec, "image", None) or {}).get("digest", ""),
                           **self.sensor_labels)
            self.watched = True
        if self.watched and self.rec.started(self.cgroup_id, pid):
            from policies.compile import ebpf_concerns
            return ebpf_concerns(self.spec.policy)
        return []

    def on_ready(self, sandbox_id, pid):
        """dsec-init has made the sandbox's mounts and pivoted into its root (READY); nothing
        of the workload has run: what is read through that root from now on is the sandbox's."""
        if self.watched:
            self.rec.ready(self.cgroup_id, pid)

    def on_step(self, sandbox_id, step):
        self.step = step
        if self.watched:
            try:
                self.rec.set_step(self.cgroup_id, step)
            except ReportedError:
                if self.watched:
                    raise
                # unwatched between the check and the call (the sandbox's close): no step to stamp

    def on_step_info(self, sandbox_id, step, info):
        """Record what the step runs, so replay can re-run it (env secrets redacted,
        stdin bounded)."""
        env = redact_env(info.get("env") or {})
        extra = {"env": env, "workdir": info.get("workdir"), "timeout": info.get("timeout")}
        stdin = info.get("stdin")
        if stdin is not None:
            extra["stdin_b64"] = base64.b64encode(stdin[:STDIN_RECORD_MAX]).decode()
            extra["stdin_bytes"] = len(stdin)
            extra["stdin_truncated"] = len(stdin) > STDIN_RECORD_MAX
        r = {"kind": "step_start", "sandbox_id": sandbox_id, "step": step, "argv": list(info["argv"]),
             "argv_truncated": 0, "extra": _compact(extra)}
        if info.get("ts_ns"):
            r["ts_ns"] = info["ts_ns"]          # taken before dsec-init was told to run it
        self._record(r)

    def on_step_end(self, sandbox_id, st):
        self._record({"kind": "step_end", "sandbox_id": sandbox_id, "step": st.step,
                      "exit_code": st.exit_code if st.exit_code is not None else -1, "signal": st.signal or 0,
                      "extra": _compact({"timed_out": st.timed_out, "wall_ms": st.wall_ms, "cpu_ms": st.cpu_ms,
                                         "error": st.error, "code": st.code})})

    def on_workload_exit(self, sandbox_id):
        if self.watched:
            self.rec.catch_up(self.cgroup_id, flush=self.flush, ending=True)    # unwatch() follows

    def unwatch(self) -> dict:
        """Stop watching (the sandbox is gone, or never started): the sensors' totals."""
        if not self.watched:
            return self.stats
        self.watched = False
        try:
            self.stats = self.rec.unwatch(self.cgroup_id, flush=self.flush)
            self.ticket = self.rec.ticket()
        except ReportedError as e:
            if self.raise_errors:
                raise
            sys.stderr.write(f"dsec: sandbox {self.sandbox_id}: {e.message}\n")
            self.stats = {"error": e.message}
        finally:
            # the recorder keeps policies for decision stamping; a long-lived process forgets them
            self.rec.policies.pop(self.sandbox_id, None)
            self.rec.images.pop(self.sandbox_id, None)
        return self.stats

    def on_exit(self, summary):
        if not self.started_recorded:
            self._record_start()           # a warm sandbox that nobody claimed
        stats = self.unwatch()
        summary["audit"] = {"events": stats.get("emitted", 0), "lost": stats.get("lost_total", 0),
                            "stopped_over_budget": bool(stats.get("stopped")), "enabled": self.rec is not None,
                            # of the events, dsec-init's own writes (its oom_score_adj...): not the sandbox's record
                            "init_own": stats.get("init_own", 0),
                            # occurrences the kernel counted as repeats (in summary records, not one each)
                            "aggregated": stats.get("aggregated", {}), "summaries": stats.get("summaries", 0)}
        if stats.get("error"):
            summary["audit"]["error"] = stats["error"]
        if self.syscall_counts():
            summary["audit"]["syscalls"] = self.syscall_counts()     # learn mode: in-kernel counts
        changes = list(summary.get("changes") or [])
        pages = change_pages(changes)
        # the whole manifest in its own records, paged: no record is ever too large for it
        for i, page in enumerate(pages):
            self._record({"kind": "file_changes", "sandbox_id": summary["sandbox_id"], "step": self.step,
                          "count": len(page),
                          "extra": _compact({"page": i + 1, "pages": len(pages), "changes": page,
                                             "changes_total": summary.get("changes_total", len(changes))})})
        extra = {k: v for k, v in summary.items() if k != "changes"}
        inline = changes[:CHANGES_RECORD_MAX]
        while inline and len(_compact(inline)) > CHANGES_INLINE_BYTES:
            inline = inline[:len(inline) // 2]
        extra["changes"] = inline
        extra["changes_pages"] = len(pages)
        extra["labels"] = self.labels
        self._record({"kind": "sandbox_exit", "sandbox_id": summary["sandbox_id"], "step": self.step,
                      "exit_code": summary["exit_code"] if summary.get("exit_code") is not None else -1,
                      "signal": summary.get("signal") or 0, "extra": _compact(extra)})

    def syscall_counts(self) -> dict:
        return dict((self.stats.get("enforcement") or {}).get("syscalls") or {})


def _chain(first, then):
    def both(*args):
        r = first(*args)
        then(*args)
        return r
    return both
