"""Reconstruct what one sandbox did from its audit records.

Pure: takes records (dicts with the fields of audit_schema.events) and builds
the process tree and the time-ordered timeline. The record is trusted as far
as it goes and holes are shown, never hidden: every events_lost record becomes
a marker in the timeline and is counted in `lost`.
"""
from __future__ import annotations

import json


class Proc:
    __slots__ = ("pid", "ppid", "comm", "execs", "exit_code", "signal", "children", "first_ts", "step")

    def __init__(self, pid: int, ppid: int = 0):
        self.pid = pid
        self.ppid = ppid
        self.comm = ""
        self.execs: list[dict] = []     # exec records, in order
        self.exit_code = None
        self.signal = None
        self.children: list[Proc] = []
        self.first_ts = 0
        self.step = 0


class Trajectory:
    def __init__(self, sandbox_id: str):
        self.sandbox_id = sandbox_id
        self.records: list[dict] = []
        self.procs: dict[int, Proc] = {}
        self.roots: list[Proc] = []
        self.lost = 0
        self.start: dict | None = None
        self.exit: dict | None = None
        self.node = ""
        self.steps: list[int] = []

    @property
    def t0(self) -> int:
        return self.records[0]["ts_ns"] if self.records else 0

    def timeline(self, kinds=None, step=None) -> list[dict]:
        return [r for r in self.records
                if (kinds is None or r["kind"] in kinds) and (step is None or r.get("step") == step)]

    def denials(self) -> list[dict]:
        return [r for r in self.records if r.get("decision") in ("denied", "would-deny")]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r["kind"]] = out.get(r["kind"], 0) + 1
        return out


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
    steps = set()
    for r in recs:
        kind = r["kind"]
        t.node = t.node or r.get("node", "")
        steps.add(r.get("step", 0))
        if kind == "sandbox_start":
            t.start = r
            continue
        if kind == "sandbox_exit":
            t.exit = r
            continue
        if kind == "events_lost":
            t.lost += int(r.get("count") or 0)
            continue
        pid = int(r.get("pid") or 0)
        if not pid:
            continue
        p = _proc(t, pid, int(r.get("ppid") or 0))
        if not p.first_ts:
            p.first_ts = r.get("ts_ns", 0)
            p.step = r.get("step", 0)
        if r.get("comm"):
            p.comm = r["comm"]
        if kind == "fork":
            c = _proc(t, int(r["child_pid"]), pid)
            c.ppid = pid
            c.comm = c.comm or p.comm
            if not c.first_ts:
                c.first_ts = r.get("ts_ns", 0)
                c.step = r.get("step", 0)
        elif kind == "exec" and int(r.get("ret") or 0) == 0:
            p.execs.append(r)
        elif kind == "exit":
            p.exit_code = r.get("exit_code")
            p.signal = r.get("signal") or None
    for p in t.procs.values():
        parent = t.procs.get(p.ppid)
        if parent is not None and parent is not p:
            parent.children.append(p)
        else:
            t.roots.append(p)
    for p in t.procs.values():
        p.children.sort(key=lambda c: (c.first_ts, c.pid))
    t.roots.sort(key=lambda c: (c.first_ts, c.pid))
    t.steps = sorted(steps)
    return t


def summary_of(t: Trajectory) -> dict:
    """The sandbox_exit record's summary, if the record has one."""
    if not t.exit or not t.exit.get("extra"):
        return {}
    try:
        return json.loads(t.exit["extra"])
    except ValueError:
        return {}
