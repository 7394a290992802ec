"""What-if: would this policy have stopped what a recorded sandbox did?

    res = evaluate(trajectory, policy)        # offline: no sandbox, no kernel
    res.items                                 # every exec, connect, write the policy would deny
    res.syscalls                              # syscalls the run used that the policy lacks
    res.would_deny                            # bool: the CI gate (`dsec replay --against` exits 1)

Each item is in context: step, pid, the process's command line at that
moment, time, and what the policy in force decided back then.

What is evaluated, and from which records (policies/evaluate.py's rules):
  exec     every successful exec record (path) against spec.exec; exec_denied /
           exec_violation records only where no exec record of the same process
           and path exists (the same action is never counted twice)
  connect  connect records of family ipv4/ipv6 against spec.egress (port 53 is taken
           as UDP, others as TCP: connect records do not carry the socket type),
           and egress_* records (they carry the protocol) that no connect record
           explains (UDP sendmsg without connect)
  write    open_write, unlink, rename (both paths) against spec.files, attempts that
           failed for their own reasons (EACCES ...) included: the policy forbids the
           attempt
  syscalls syscall_denied / syscall_violation records (calls outside the recorded
           policy, with counts), plus learn-mode counts when the record has them
           (summary.audit.syscalls), against the policy's syscall rules

What it cannot see: syscalls the recorded policy allowed (audit and enforce
mode report only calls outside the policy in force; only a learn-mode record
lists every call), clone/unshare flags, and hostnames: hostname egress rules
are matched against addresses resolved by the agent at run time, which the
record does not keep, so offline they match nothing (each item says so).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policies.compile import egress_rules, exec_allowed, syscall_allowed
from policies.evaluate import path_writable
from replay.trajectory import Trajectory, _extra, dest


@dataclass
class WhatIf:
    sandbox_id: str
    policy: dict
    recorded_policy: dict
    items: list = field(default_factory=list)
    syscalls: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    checked: dict = field(default_factory=dict)        # how many actions of each kind were evaluated

    @property
    def would_deny(self) -> bool:
        return bool(self.items or self.syscalls)

    def keys(self) -> set:
        """(action, subject) of every would-deny item and syscall (for exact comparisons)."""
        return {(i["action"], i["subject"]) for i in self.items} | {("syscall", s["syscall"]) for s in self.syscalls}

    def to_dict(self) -> dict:
        return {"sandbox_id": self.sandbox_id, "policy": self.policy, "recorded_policy": self.recorded_policy,
                "would_deny": self.would_deny, "checked": self.checked, "items": self.items,
                "syscalls": self.syscalls, "notes": self.notes}


def _context(t: Trajectory, r: dict) -> dict:
    pid = int(r.get("pid") or 0)
    p = t.procs.get(pid)
    return {"ts_ns": r["ts_ns"], "t_s": round((r["ts_ns"] - t.t0) / 1e9, 6), "step": int(r.get("step") or 0),
            "pid": pid, "process": p.argv_at(r["ts_ns"]) if p else [], "recorded_decision": r.get("decision", ""),
            "kind": r["kind"], "ret": int(r.get("ret") or 0), "event_id": r.get("event_id", "")}


def _proto(r: dict) -> str:
    p = (r.get("protocol") or "").lower()
    if p in ("tcp", "udp"):
        return p
    return "udp" if int(r.get("port") or 0) == 53 else "tcp"


def evaluate(t: Trajectory, policy) -> WhatIf:
    res = WhatIf(t.sandbox_id, {"name": policy.name, "hash": policy.hash, "mode": policy.mode,
                                "source": policy.source}, t.policy)
    rules = egress_rules(policy)
    host_rules = rules is not None and bool(rules.allow_hosts or rules.deny_hosts)
    if host_rules:
        names = sorted({h.host for h in rules.allow_hosts + rules.deny_hosts})
        res.notes.append("hostname egress rules (" + ", ".join(names) + ") are not evaluated offline: the "
                         "record does not keep what the names resolved to; they match nothing here")
    exec_seen = set()
    connect_seen = set()
    for r in t.records:
        if r["kind"] == "exec" and int(r.get("ret") or 0) == 0:
            exec_seen.add((int(r.get("pid") or 0), r.get("path") or ""))
        elif r["kind"] == "connect":
            connect_seen.add((int(r.get("pid") or 0), r.get("addr") or "", int(r.get("port") or 0)))
    checked = {"exec": 0, "connect": 0, "write": 0, "syscall": 0}
    for r in t.records:
        k = r["kind"]
        item = None
        if k == "exec" and int(r.get("ret") or 0) == 0:
            checked["exec"] += 1
            path = r.get("path") or ""
            if not exec_allowed(policy, path):
                item = {"action": "exec", "subject": path, "why": "not in exec.allow",
                        "sha256": r.get("sha256", "")}
        elif k in ("exec_denied", "exec_violation"):
            if (int(r.get("pid") or 0), r.get("path") or "") in exec_seen:
                continue
            checked["exec"] += 1
            path = r.get("path") or ""
            if not exec_allowed(policy, path):
                item = {"action": "exec", "subject": path, "why": "not in exec.allow"}
        elif k == "connect" and r.get("family") in ("ipv4", "ipv6"):
            checked["connect"] += 1
            if rules is not None:
                try:
                    verdict = rules.decide(r.get("addr"), int(r.get("port") or 0), _proto(r))
                except ValueError:
                    verdict = "allow"
                if verdict == "deny":
                    item = {"action": "connect", "subject": dest(r), "why": f"egress ({_proto(r)}, "
                            f"default {rules.default})" + ("; hostname rules not evaluated" if host_rules else "")}
        elif k in ("egress_denied", "egress_violation"):
            if (int(r.get("pid") or 0), r.get("addr") or "", int(r.get("port") or 0)) in connect_seen:
                continue
            checked["connect"] += 1
            if rules is not None:
                try:
                    verdict = rules.decide(r.get("addr"), int(r.get("port") or 0), _proto(r))
                except ValueError:
                    verdict = "allow"
                if verdict == "deny":
                    hook = _extra(r).get("hook", "")
                    item = {"action": "connect", "subject": dest(r), "why": f"egress ({_proto(r)}"
                            + (f", {hook}" if hook else "") + f", default {rules.default})"}
        elif k in ("open_write", "unlink"):
            checked["write"] += 1
            if not path_writable(policy, r.get("path") or ""):
                item = {"action": "write", "subject": r.get("path") or "", "why": "not under files.writable"}
        elif k == "rename":
            checked["write"] += 1
            src, dst = r.get("path") or "", r.get("path2") or ""
            if not (path_writable(policy, src) and path_writable(policy, dst)):
                item = {"action": "write", "subject": f"{src} -> {dst}", "why": "not under files.writable"}
        if item is not None:
            item.update(_context(t, r))
            res.items.append(item)
    used = t.syscalls()
    checked["syscall"] = len(used)
    for name in sorted(used):
        d = used[name]
        if name.startswith("nr_") or not syscall_allowed(policy, name):
            res.syscalls.append({"syscall": name, "count": d["count"], "source": d["source"],
                                 "recorded_decision": d["decision"], "step": d["step"], "pid": d["pid"],
                                 "ts_ns": d["first_ts_ns"],
                                 "process": (t.procs[d["pid"]].argv_at(d["first_ts_ns"])
                                             if d["pid"] in t.procs and d["first_ts_ns"] else [])})
    res.checked = checked
    rec_mode = (t.policy or {}).get("mode")
    if not t.learn_counts_recorded:
        if rec_mode == "learn":
            res.notes.append("the run was recorded in learn mode but its syscall counts are not in the record: "
                             "syscalls are not evaluated")
        else:
            res.notes.append("syscalls: only calls outside the recorded policy"
                             + (f" ({t.policy['name']}, {rec_mode})" if t.policy else "")
                             + " are in the record; calls it allowed cannot be checked")
    if t.lost:
        res.notes.append(f"the record has holes: {t.lost} events were lost; actions among them are not evaluated")
    return res
