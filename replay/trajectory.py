"""Reconstruct what one sandbox did from its audit records.

    t = reconstruct(sandbox_id, records)     # records: dicts with the fields of audit_schema.events
    t.steps                                  # [Step]: argv, env, stdin, exit status, duration
    t.step_roots(2)                          # the process trees of step 2 (fork/exec/exit)
    t.timeline(step=2)                       # time-ordered records of step 2
    t.denial_rows()                          # one row per denied / would-deny action
    t.lost, t.lost_markers                   # holes in the record (events_lost)
    t.changes                                # the upper layer's change manifest (sandbox_exit summary)

Pure: no I/O. The record is trusted as far as it goes and holes are shown,
never hidden: every events_lost record is a marker in the timeline and is
counted in `lost`; a step whose start or end is missing from the record says
so (`Step.source`, `Step.missing`).

Steps come from the launcher's `step_start` / `step_end` records (argv, env
with secrets redacted, workdir, timeout, bounded stdin; exit status and
duration), else from the node agent's `lifecycle` step_started / step_ended
records (argv and exit status only), else from the sandbox_exit summary, else
they are inferred from the step numbers the events carry.
"""
from __future__ import annotations

import base64
import json

REDACTED = "<redacted>"
DENIED = ("denied", "would-deny")
# forbidden by the policy, but the kernel refused it on its own (ENOENT ...): not a policy denial
FAILED = ("failed",)
# sensor records that report a policy decision about an action another record describes
SENSOR_KINDS = ("exec_denied", "exec_violation", "egress_denied", "egress_violation",
                "syscall_denied", "syscall_violation")
WRITE_KINDS = ("open_write", "unlink", "rename")


def _extra(r: dict | None) -> dict:
    if not r or not r.get("extra"):
        return {}
    try:
        v = json.loads(r["extra"])
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


MAX_NEST = 100       # process levels nested in to_dict(); deeper ones are listed flat (see there)


class Proc:
    __slots__ = ("pid", "ppid", "comm", "execs", "exit_code", "signal", "children", "first_ts", "step",
                 "exit_ts", "fork_ts")

    def __init__(self, pid: int, ppid: int = 0):
        self.pid = pid
        self.ppid = ppid
        self.comm = ""
        self.execs: list[dict] = []     # successful exec records, in order
        self.exit_code = None
        self.signal = None
        self.children: list[Proc] = []
        self.first_ts = 0
        self.step = 0
        self.exit_ts = 0
        self.fork_ts = 0

    def argv_at(self, ts_ns: int) -> list[str]:
        """The command line this process ran at time ts_ns (its last exec before then)."""
        cur = None
        for e in self.execs:
            if e["ts_ns"] <= ts_ns:
                cur = e
        if cur is None:
            return [f"({self.comm})"] if self.comm else []
        return list(cur.get("argv") or [cur.get("path", "")])

    def to_dict(self, step: int | None = None) -> dict:
        """The process and its descendants (with step: only those first seen in that step),
        nested by `children`. Not recursive, and nested at most MAX_NEST levels (JSON encoders
        stop near the interpreter's recursion limit; a workload's fork chain can be thousands
        deep): a process at that depth lists all its descendants in its `children`, depth
        first, and says so (`flattened`); each one's `ppid` names its own parent."""
        def wanted(p):
            return [c for c in p.children if step is None or c.step == step]
        root = self._node()
        stack = [(self, root, 0)]
        while stack:
            p, d, depth = stack.pop()
            kids = wanted(p)
            if depth + 1 < MAX_NEST:
                for c in kids:
                    cd = c._node()
                    d["children"].append(cd)
                    stack.append((c, cd, depth + 1))
                continue
            todo = list(reversed(kids))
            if todo:
                d["flattened"] = True
            while todo:
                c = todo.pop()
                d["children"].append(c._node())
                todo.extend(reversed(wanted(c)))
        return root

    def _node(self) -> dict:
        return {"pid": self.pid, "ppid": self.ppid, "comm": self.comm, "step": self.step,
                "first_ts_ns": self.first_ts, "exit_ts_ns": self.exit_ts or None,
                "exit_code": self.exit_code, "signal": self.signal,
                "execs": [{"ts_ns": e["ts_ns"], "path": e.get("path", ""), "argv": list(e.get("argv") or []),
                           "argv_truncated": bool(e.get("argv_truncated")), "sha256": e.get("sha256", ""),
                           "build_id": e.get("build_id", ""), "interp": e.get("interp", ""),
                           "shebang": e.get("shebang", ""), "decision": e.get("decision", "")}
                          for e in self.execs],
                "children": []}


class Step:
    """One exec step of the sandbox: what it ran and how it ended."""

    def __init__(self, n: int):
        self.n = n
        self.argv: list[str] = []
        self.env: dict | None = None         # None: not recorded
        self.workdir: str | None = None
        self.timeout: float | None = None
        self.stdin: bytes | None = None      # None: no stdin recorded (or none given)
        self.stdin_bytes = 0                 # the size the step was given (stdin may be truncated)
        self.stdin_truncated = False
        self.start_ns = 0
        self.end_ns = 0
        self.exit_code = None
        self.signal = None
        self.code = None                     # dsec run's convention: exit | 128+sig | 124 | 125 | 126 | 127
        self.timed_out = False
        self.error = None
        self.wall_ms = None
        self.cpu_ms = None
        self.source = "inferred"             # step_start | lifecycle | summary | inferred
        self.ended = False

    @property
    def redacted(self) -> list[str]:
        return sorted(k for k, v in (self.env or {}).items() if v == REDACTED)

    @property
    def duration_ms(self) -> float | None:
        if self.wall_ms is not None:
            return float(self.wall_ms)
        if self.start_ns and self.end_ns and self.ended:
            return (self.end_ns - self.start_ns) / 1e6
        return None

    @property
    def missing(self) -> list[str]:
        """What the record lacks about this step, in words."""
        out = []
        if self.source == "inferred":
            out.append("no step_start record (argv inferred from the first exec)")
        elif self.source in ("lifecycle", "summary"):
            out.append(f"argv from the {self.source} record; env, workdir and stdin were not recorded")
        if not self.ended:
            out.append("no step_end record (exit status unknown)")
        if self.stdin_truncated:
            out.append(f"stdin truncated in the record ({self.stdin_bytes} bytes given)")
        return out

    def status(self) -> str:
        if not self.ended:
            return "unknown"
        if self.timed_out:
            return "timed out (124)"
        if self.error and self.code in (125, 126, 127):
            return f"{self.error} ({self.code})"
        if self.signal:
            return f"signal {self.signal}"
        return f"exit {self.exit_code if self.exit_code is not None else self.code}"

    def to_dict(self) -> dict:
        return {"step": self.n, "argv": list(self.argv), "env": self.env, "redacted_env": self.redacted,
                "workdir": self.workdir, "timeout": self.timeout,
                "stdin_b64": base64.b64encode(self.stdin).decode() if self.stdin is not None else None,
                "stdin_bytes": self.stdin_bytes, "stdin_truncated": self.stdin_truncated,
                "start_ns": self.start_ns, "end_ns": self.end_ns, "duration_ms": self.duration_ms,
                "exit_code": self.exit_code, "signal": self.signal, "code": self.code,
                "timed_out": self.timed_out, "error": self.error, "cpu_ms": self.cpu_ms,
                "status": self.status(), "source": self.source, "missing": self.missing}


def _aggregated(r: dict) -> dict:
    """extra of a record that stands for repeated identical records (denials: agent/sensors/denials.py;
    repeats counted in the kernel: agent/sensors/repeats.py), else {}."""
    e = r.get("extra")
    if not e or '"aggregated"' not in e:
        return {}
    try:
        d = json.loads(e)
    except ValueError:
        return {}
    return d if isinstance(d, dict) and d.get("aggregated") else {}


class Trajectory:
    def __init__(self, sandbox_id: str):
        self.sandbox_id = sandbox_id
        self.records: list[dict] = []
        self.procs: dict[int, Proc] = {}
        self.roots: list[Proc] = []
        self.lost = 0
        self.lost_markers: list[dict] = []
        self.start: dict | None = None
        self.exit: dict | None = None
        self.node = ""
        self.steps: list[Step] = []
        self.info: dict = {}                 # sandbox_start extra: resources, rootfs, user, labels ...
        self.summary: dict = {}              # sandbox_exit extra: the run summary
        self.change_pages: dict = {}         # file_changes records: page number -> changes

    @property
    def t0(self) -> int:
        return self.records[0]["ts_ns"] if self.records else 0

    @property
    def step_numbers(self) -> list[int]:
        return [s.n for s in self.steps]

    def step(self, n: int) -> Step | None:
        for s in self.steps:
            if s.n == n:
                return s
        return None

    @property
    def policy(self) -> dict:
        """The policy identity in force (from sandbox_start, else the first stamped record)."""
        for r in ([self.start] if self.start else []) + self.records:
            if r and r.get("policy_name"):
                return {"name": r["policy_name"], "hash": r.get("policy_hash", ""), "mode": r.get("mode", "")}
        return {}

    @property
    def changes(self) -> list[dict]:
        """The manifest: from its file_changes pages when recorded (complete),
        else the sandbox_exit summary's inline part."""
        if self.change_pages:
            return [c for _, page in sorted(self.change_pages.items()) for c in page]
        return list(self.summary.get("changes") or [])

    @property
    def changes_note(self) -> str:
        total = self.summary.get("changes_total")
        shown = len(self.changes)
        if total is not None and total > shown:
            return f"{shown} of {total} changes recorded (the record keeps at most 1000)"
        return ""

    def timeline(self, kinds=None, step=None) -> list[dict]:
        return [r for r in self.records
                if (kinds is None or r["kind"] in kinds) and (step is None or r.get("step") == step)]

    def denials(self, decisions=DENIED) -> list[dict]:
        return [r for r in self.records if r.get("decision") in decisions]

    def failed_rows(self, step=None) -> list[dict]:
        """Like denial_rows, for actions the policy forbids that failed on their own
        (decision "failed": a PATH search miss, a write under a missing directory)."""
        return self.denial_rows(step, FAILED)

    def denial_rows(self, step=None, decisions=DENIED) -> list[dict]:
        """One row per denied / would-deny action: the audit record of the action and the
        enforcement sensor's record of the same action are merged (same process, subject).
        Aggregated records (extra.aggregated: identical repeats counted by the recorder)
        add their count; `last_ts_ns` is the last occurrence. Denied rows come first."""
        rows: dict = {}
        for r in self.denials(decisions):
            if step is not None and r.get("step") != step:
                continue
            a = action_of(r)
            if a is None:
                continue
            key = (int(r.get("pid") or 0), a[0], a[1], r["decision"])
            row = rows.get(key)
            if row is None:
                p = self.procs.get(int(r.get("pid") or 0))
                row = rows[key] = {"ts_ns": r["ts_ns"], "step": r.get("step", 0), "pid": int(r.get("pid") or 0),
                                   "process": p.argv_at(r["ts_ns"]) if p else [], "action": a[0], "subject": a[1],
                                   "decision": r["decision"], "kinds": [], "audit": 0, "sensor": 0, "count": 0,
                                   "ret": None, "last_ts_ns": r["ts_ns"]}
            if r["kind"] not in row["kinds"]:
                row["kinds"].append(r["kind"])
            agg = _aggregated(r)
            n = int(r.get("count") or 0) if agg else 1
            row["last_ts_ns"] = max(row["last_ts_ns"], int(agg.get("last_ts_ns") or r["ts_ns"]) if agg else r["ts_ns"])
            if r["kind"] in SENSOR_KINDS:
                row["sensor"] += int(r.get("count") or 1) if r["kind"].startswith("syscall_") else n
            else:
                row["audit"] += n
                if row["ret"] is None:
                    row["ret"] = int(r.get("ret") or 0)
            row["count"] = max(row["audit"], row["sensor"])
        rank = {"denied": 0, "would-deny": 1}
        return sorted(rows.values(), key=lambda d: (rank.get(d["decision"], 2), d["ts_ns"], d["pid"], d["action"],
                                                    d["subject"]))

    def counts(self) -> dict[str, int]:
        """Occurrences by kind: a summary of repeats (extra.aggregated) counts for
        the `count` occurrences it stands for, any other record for one."""
        out: dict[str, int] = {}
        for r in self.records:
            n = int(r.get("count") or 0) if _aggregated(r) else 1
            out[r["kind"]] = out.get(r["kind"], 0) + n
        return out

    def step_roots(self, n: int) -> list[Proc]:
        """The roots of step n's process trees: processes first seen in step n whose
        parent is not (the supervisor, or a process of an earlier step)."""
        out = []
        for p in self.procs.values():
            if p.step != n:
                continue
            parent = self.procs.get(p.ppid)
            if parent is None or parent.step != n or parent is p:
                out.append(p)
        return sorted(out, key=lambda p: (p.first_ts, p.pid))

    def syscalls(self) -> dict[str, dict]:
        """Syscalls the record says the run used: syscall_denied / _violation records
        (calls outside the policy in force), and learn-mode counts when the summary has them
        (summary.audit.syscalls). {name: {count, decision, first_ts_ns, step, pid, source}}."""
        out: dict[str, dict] = {}
        for r in self.records:
            if r["kind"] not in ("syscall_denied", "syscall_violation"):
                continue
            name = r.get("syscall") or f"nr_{_extra(r).get('nr', '?')}"
            d = out.get(name)
            if d is None:
                d = out[name] = {"count": 0, "decision": r.get("decision", ""), "first_ts_ns": r["ts_ns"],
                                 "step": r.get("step", 0), "pid": int(r.get("pid") or 0), "source": r["kind"]}
            d["count"] += int(r.get("count") or 1)
        learned = ((self.summary.get("audit") or {}).get("syscalls")) or {}
        for name, n in learned.items():
            if name not in out:
                out[name] = {"count": int(n), "decision": "allowed", "first_ts_ns": None, "step": None,
                             "pid": None, "source": "learn"}
        return out

    @property
    def learn_counts_recorded(self) -> bool:
        return bool((self.summary.get("audit") or {}).get("syscalls"))


def action_of(r: dict) -> tuple[str, str] | None:
    """(action, subject) of a record: what was done, to what. None for records that are
    not actions (lifecycle, fork, exit ...)."""
    k = r["kind"]
    if k in ("exec", "exec_denied", "exec_violation"):
        return ("exec", r.get("path") or "")
    if k == "connect":
        return ("connect", dest(r))
    if k in ("egress_denied", "egress_violation"):
        return ("connect", dest(r))
    if k in ("open_write", "unlink"):
        return ("write", r.get("path") or "")
    if k == "rename":
        return ("write", f"{r.get('path') or ''} -> {r.get('path2') or ''}")
    if k in ("syscall_denied", "syscall_violation"):
        return ("syscall", r.get("syscall") or f"nr_{_extra(r).get('nr', '?')}")
    return None


def dest(r: dict) -> str:
    fam = r.get("family") or ""
    addr = r.get("addr") or ""
    if fam == "ipv6":
        return f"[{addr}]:{r.get('port', 0)}"
    if fam == "unix":
        return f"unix:{addr}"
    return f"{addr}:{r.get('port', 0)}"


def _proc(t: Trajectory, pid: int, ppid: int = 0) -> Proc:
    p = t.procs.get(pid)
    if p is None:
        p = t.procs[pid] = Proc(pid, ppid)
    elif ppid and not p.ppid:
        p.ppid = ppid
    return p


def reconstruct(sandbox_id: str, records: list[dict]) -> Trajectory:
    t = Trajectory(sandbox_id)
    seen = set()
    recs = []
    for r in records:                       # defensive dedup by event id
        eid = r.get("event_id")
        if eid and eid in seen:
            continue
        seen.add(eid)
        recs.append(r)
    recs.sort(key=lambda r: (r.get("ts_ns", 0), r.get("event_id", "")))
    t.records = recs
    step_nums = set()
    steps: dict[int, Step] = {}

    def step_of(n: int) -> Step:
        s = steps.get(n)
        if s is None:
            s = steps[n] = Step(n)
        return s

    for r in recs:
        kind = r["kind"]
        t.node = t.node or r.get("node", "")
        n = int(r.get("step") or 0)
        if n:
            step_nums.add(n)
        if kind == "sandbox_start":
            t.start = t.start or r
            t.info = _extra(r)
            continue
        if kind == "sandbox_exit":
            t.exit = r
            t.summary = _extra(r)
            continue
        if kind == "file_changes":
            ex = _extra(r)
            t.change_pages[int(ex.get("page") or 0)] = list(ex.get("changes") or [])
            continue
        if kind == "events_lost":
            t.lost += int(r.get("count") or 0)
            t.lost_markers.append(r)
            continue
        if kind == "step_start":
            _step_start(step_of(n), r)
            continue
        if kind == "step_end":
            _step_end(step_of(n), r)
            continue
        if kind == "lifecycle":
            ex = _extra(r)
            if ex.get("state") == "step_started" and n:
                s = step_of(n)
                if s.source in ("inferred", "summary"):
                    s.source = "lifecycle"
                    s.argv = [str(a) for a in ex.get("argv") or []]
                    s.start_ns = s.start_ns or r["ts_ns"]
            elif ex.get("state") == "step_ended" and n:
                s = step_of(n)
                if not s.ended:
                    _end_from(s, r["ts_ns"], ex.get("exit_code"), ex.get("signal"), ex)
            continue
        pid = int(r.get("pid") or 0)
        if not pid:
            continue
        p = _proc(t, pid, int(r.get("ppid") or 0))
        if not p.first_ts:
            p.first_ts = r.get("ts_ns", 0)
            p.step = n
        if r.get("comm"):
            p.comm = r["comm"]
        if kind == "fork":
            c = _proc(t, int(r["child_pid"]), pid)
            c.ppid = pid
            c.comm = c.comm or p.comm
            c.fork_ts = c.fork_ts or r.get("ts_ns", 0)
            if not c.first_ts:
                c.first_ts = r.get("ts_ns", 0)
                c.step = n
        elif kind == "exec" and int(r.get("ret") or 0) == 0:
            p.execs.append(r)
        elif kind == "exit":
            p.exit_code = r.get("exit_code")
            p.signal = r.get("signal") or None
            p.exit_ts = r.get("ts_ns", 0)
    for p in t.procs.values():
        parent = t.procs.get(p.ppid)
        if parent is not None and parent is not p:
            parent.children.append(p)
        else:
            t.roots.append(p)
    for p in t.procs.values():
        p.children.sort(key=lambda c: (c.first_ts, c.pid))
    t.roots.sort(key=lambda c: (c.first_ts, c.pid))
    _complete_steps(t, steps, step_nums)
    return t


def _step_start(s: Step, r: dict):
    ex = _extra(r)
    s.source = "step_start"
    s.argv = list(r.get("argv") or [])
    s.env = ex.get("env") if isinstance(ex.get("env"), dict) else None
    s.workdir = ex.get("workdir")
    s.timeout = ex.get("timeout")
    if ex.get("stdin_b64") is not None:
        try:
            s.stdin = base64.b64decode(ex["stdin_b64"])
        except ValueError:
            s.stdin = None
        s.stdin_bytes = int(ex.get("stdin_bytes") or len(s.stdin or b""))
        s.stdin_truncated = bool(ex.get("stdin_truncated"))
    s.start_ns = r["ts_ns"]


def _step_end(s: Step, r: dict):
    ex = _extra(r)
    code = r.get("exit_code")
    _end_from(s, r["ts_ns"], None if code == -1 and r.get("signal") else code, r.get("signal") or None, ex)


def _end_from(s: Step, ts: int, exit_code, sig, ex: dict):
    s.ended = True
    s.end_ns = ts
    s.exit_code = exit_code
    s.signal = sig or None
    s.timed_out = bool(ex.get("timed_out"))
    s.error = ex.get("error")
    s.wall_ms = ex.get("wall_ms")
    s.cpu_ms = ex.get("cpu_ms")
    code = ex.get("code")
    if code is None:
        code = 124 if s.timed_out else (128 + s.signal if s.signal else s.exit_code)
    s.code = code


def _complete_steps(t: Trajectory, steps: dict, step_nums: set):
    by_summary = {int(d.get("step") or 0): d for d in (t.summary.get("steps") or []) if isinstance(d, dict)}
    for n in sorted(step_nums | set(by_summary)):
        s = steps.get(n) or Step(n)
        steps[n] = s
        d = by_summary.get(n)
        if not s.ended and d is not None:
            s.ended = True
            s.exit_code = d.get("exit_code")
            s.signal = d.get("signal") or None
            s.timed_out = bool(d.get("timed_out"))
            s.error = d.get("error")
            s.code = d.get("code")
            s.wall_ms = d.get("wall_ms")
            s.cpu_ms = d.get("cpu_ms")
            if s.source == "inferred" and not s.argv:
                s.source = "summary" if n == 1 and t.summary.get("argv") else s.source
                if s.source == "summary":
                    s.argv = list(t.summary.get("argv") or [])
        recs = [r for r in t.records if r.get("step") == n and r["kind"] not in ("sandbox_exit",)]
        if recs:
            s.start_ns = s.start_ns or recs[0]["ts_ns"]
            if not s.end_ns:
                s.end_ns = recs[-1]["ts_ns"]
        if not s.argv:
            # the step's main process: the first exec of a root process of the step
            for p in t.step_roots(n):
                if p.execs:
                    s.argv = list(p.execs[0].get("argv") or [p.execs[0].get("path", "")])
                    break
    t.steps = [steps[n] for n in sorted(steps) if n > 0]


def summary_of(t: Trajectory) -> dict:
    """The sandbox_exit record's summary, if the record has one."""
    return dict(t.summary)
