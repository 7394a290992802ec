"""Promotion of a policy between modes, gated on audit evidence. Pure: the
evidence comes from replay/evidence.py (ClickHouse), the decision is made here.

    d = promotion_decision(policy, "enforce", evidence, min_runs=5, window="7d")
    d.allowed, d.policy (the promoted Policy), d.reasons, d.violations
    print(d.report())
    text = promoted_text(original_yaml_text, d.policy)      # the file, mode changed

Evidence: {"runs": [{sandbox_id, started (ns since the epoch), policy_hash, mode,
                     exited (default True), events_lost (default 0)}],
           "violations": [{sandbox_id, kind, what, count}]}

Rules:
  to audit    always allowed (it blocks nothing); the rules are unchanged.
  to enforce  needs at least `min_runs` audit-mode runs of this exact policy
              (by content hash) started within `window` before now that are
              complete -- they ended (their exit is recorded) and lost no audit
              events (a run with a hole in its record proves nothing) -- and
              zero violations (would-deny events of this policy hash in the
              window). Otherwise refused, listing every blocking violation
              (sandbox, kind, what: syscall / destination / binary / path, count)
              and the runs that did not count and why.
The promoted policy differs only in spec.mode: its content hash is the same by
design (policies/model.py hashed_content), so the evidence gathered for the
audit-mode policy applies to the enforced one.
"""
from __future__ import annotations

import datetime as _dt
import re
import time
from dataclasses import dataclass, field

import yaml

from policies.errors import PoliciesError, USAGE as EXIT_USAGE
from policies.model import Policy, PolicyError

DEFAULT_WINDOW_S = 7 * 86400
DEFAULT_MIN_RUNS = 5
TARGETS = ("audit", "enforce")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.I)


class PromoteError(PoliciesError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


def parse_duration(text) -> int:
    """'24h', '7d', '90m', '3600s', '2w' (or a number of seconds) -> seconds (> 0)."""
    if isinstance(text, _dt.timedelta):
        secs = int(text.total_seconds())
    elif isinstance(text, (int, float)) and not isinstance(text, bool):
        secs = int(text)
    elif isinstance(text, str):
        mm = _DUR.match(text)
        if not mm:
            raise PromoteError(f"invalid duration {text!r}: use a number and a unit, like 24h, 7d, 90m, 3600s, 2w")
        secs = int(float(mm.group(1)) * _UNITS[mm.group(2).lower()])
    else:
        raise PromoteError(f"invalid duration {text!r}")
    if secs <= 0:
        raise PromoteError(f"invalid duration {text!r}: must be longer than 0 seconds")
    if secs > 3650 * 86400:
        raise PromoteError(f"invalid duration {text!r}: at most 10 years")
    return secs


def format_duration(secs: int) -> str:
    for unit in ("w", "d", "h", "m"):
        if secs % _UNITS[unit] == 0:
            return f"{secs // _UNITS[unit]}{unit}"
    return f"{secs}s"


@dataclass
class Decision:
    allowed: bool
    target: str
    source: Policy
    policy: Policy | None                 # the promoted policy (None when refused)
    window_s: int
    min_runs: int
    runs: list = field(default_factory=list)           # audit runs that count
    ignored: list = field(default_factory=list)        # (run, reason)
    violations: list = field(default_factory=list)
    reasons: list = field(default_factory=list)        # why refused
    notes: list = field(default_factory=list)

    @property
    def from_mode(self) -> str:
        return self.source.mode

    @property
    def to_mode(self) -> str:
        return self.target

    @property
    def from_hash(self) -> str:
        return self.source.hash

    @property
    def to_hash(self) -> str:
        return self.policy.hash if self.policy is not None else self.source.hash

    def to_dict(self) -> dict:
        return {"allowed": self.allowed, "policy_name": self.source.name, "from_mode": self.from_mode,
                "to_mode": self.to_mode, "from_hash": self.from_hash, "to_hash": self.to_hash,
                "window_s": self.window_s, "min_runs": self.min_runs,
                "runs": [r.get("sandbox_id") for r in self.runs],
                "ignored_runs": [{"sandbox_id": r.get("sandbox_id"), "reason": why} for r, why in self.ignored],
                "violations": self.violations, "reasons": self.reasons, "notes": self.notes}

    def summary(self) -> str:
        s = f"{self.source.name} sha256:{self.source.hash[:16]} {self.from_mode} -> {self.to_mode}"
        if self.target == "enforce":
            s += (f" ({len(self.runs)} complete audit run{'s' if len(self.runs) != 1 else ''} in the last "
                  f"{format_duration(self.window_s)}, {sum(v['count'] for v in self.violations)} violations)")
        return s

    def report(self) -> str:
        """Why it was refused (or what it rests on), for people."""
        out = []
        if self.allowed:
            out.append(f"promotion allowed: {self.summary()}")
        else:
            out.append(f"promotion refused: {self.source.name} sha256:{self.source.hash[:16]} cannot go "
                       f"{self.from_mode} -> {self.to_mode}:")
            out += [f"  {r}" for r in self.reasons]
        if self.violations:
            rows = sorted(self.violations, key=lambda v: (-v["count"], v["sandbox_id"], v["kind"], v["what"]))
            w1 = max([len("SANDBOX")] + [len(v["sandbox_id"]) for v in rows])
            w2 = max([len("KIND")] + [len(v["kind"]) for v in rows])
            w3 = min(max([len("WHAT")] + [len(_show(v["what"])) for v in rows]), 60)
            out.append(f"  {'SANDBOX':<{w1}}  {'KIND':<{w2}}  {'WHAT':<{w3}}  COUNT")
            for v in rows:
                out.append(f"  {v['sandbox_id']:<{w1}}  {v['kind']:<{w2}}  {_show(v['what']):<{w3}}  {v['count']}")
        if self.ignored and self.target == "enforce":
            out.append(f"  runs that do not count ({len(self.ignored)}):")
            for r, why in self.ignored[:20]:
                out.append(f"    {r.get('sandbox_id', '?')}: {why}")
            if len(self.ignored) > 20:
                out.append(f"    ... and {len(self.ignored) - 20} more")
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def _show(s) -> str:
    t = str(s).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in t)


def _int(v, default=0) -> int:
    if v is None or isinstance(v, bool):
        return default
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def promotion_decision(policy: Policy, target: str, evidence: dict | None, *, min_runs: int = DEFAULT_MIN_RUNS,
                       window=DEFAULT_WINDOW_S, now_ns: int | None = None) -> Decision:
    """Decide whether `policy` may go to `target` (see the module docstring)."""
    if target not in TARGETS:
        raise PromoteError(f"cannot promote to {target!r}: use one of {', '.join(TARGETS)}")
    if isinstance(min_runs, bool) or not isinstance(min_runs, int) or min_runs < 1:
        raise PromoteError(f"--min-runs must be a whole number of at least 1, got {min_runs!r}")
    window_s = parse_duration(window)
    now_ns = time.time_ns() if now_ns is None else now_ns
    d = Decision(allowed=False, target=target, source=policy, policy=None, window_s=window_s, min_runs=min_runs)
    if policy.mode == target:
        d.notes.append(f"the policy is already in {target} mode")
    if target == "enforce":
        ev = evidence or {}
        since = now_ns - window_s * 1_000_000_000
        seen = set()
        for r in ev.get("runs") or []:
            if not isinstance(r, dict):
                continue
            sid = str(r.get("sandbox_id", ""))
            started = _int(r.get("started"))
            why = None
            if r.get("policy_hash") != policy.hash:
                why = f"ran another policy (sha256:{str(r.get('policy_hash'))[:16]})"
            elif r.get("mode") != "audit":
                why = f"ran in {r.get('mode')} mode, not audit"
            elif not since <= started <= now_ns:
                why = "started outside the window"
            elif not r.get("exited", True):
                why = "has not ended (or its exit was not recorded): its record may be incomplete"
            elif _int(r.get("events_lost")) > 0:
                why = f"lost {_int(r.get('events_lost'))} audit event(s): its record is incomplete"
            elif sid in seen:
                continue
            if why:
                d.ignored.append((r, why))
                continue
            seen.add(sid)
            d.runs.append(r)
        for v in ev.get("violations") or []:
            if not isinstance(v, dict):
                continue
            n = _int(v.get("count"), 1)
            if n <= 0:
                continue
            d.violations.append({"sandbox_id": str(v.get("sandbox_id", "")), "kind": str(v.get("kind", "")),
                                 "what": str(v.get("what", "")), "count": n})
        if len(d.runs) < min_runs:
            d.reasons.append(f"only {len(d.runs)} complete audit-mode run{'s' if len(d.runs) != 1 else ''} of "
                             f"this policy (sha256:{policy.hash[:16]}) in the last {format_duration(window_s)}; "
                             f"need {min_runs}")
        if d.violations:
            total = sum(v["count"] for v in d.violations)
            sbs = len({v["sandbox_id"] for v in d.violations})
            d.reasons.append(f"{total} violation{'s' if total != 1 else ''} (would-deny) in {sbs} "
                             f"sandbox{'es' if sbs != 1 else ''} in the last {format_duration(window_s)} block it:")
    try:
        promoted = policy.with_mode(target)
    except PolicyError as e:
        d.reasons.append(f"the rules are not valid in {target} mode: {e.message}")
        promoted = None
    if not d.reasons:
        d.allowed = True
        d.policy = promoted
    return d


# ---------------------------------------------------------------- the file

def set_mode_text(text: str, mode: str) -> str | None:
    """The YAML text with spec.mode set to `mode`, changing nothing else (comments,
    order and layout stay); None when the layout is not one this can edit."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if not isinstance(root, yaml.MappingNode):
        return None
    spec = next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "spec"), None)
    if not isinstance(spec, yaml.MappingNode) or spec.flow_style or not spec.value:
        return None
    for k, v in spec.value:
        if isinstance(k, yaml.ScalarNode) and k.value == "mode":
            if not isinstance(v, yaml.ScalarNode):
                return None
            return text[:v.start_mark.index] + mode + text[v.end_mark.index:]
    first = spec.value[0][0]
    line_start = text.rfind("\n", 0, first.start_mark.index) + 1
    if text[line_start:first.start_mark.index].strip():
        return None
    indent = first.start_mark.column
    return text[:line_start] + " " * indent + f"mode: {mode}\n" + text[line_start:]


def promoted_text(original: str | None, promoted: Policy, header: list[str] | None = None) -> str:
    """The promoted policy as a file: the original text with only its mode changed
    when that can be done (and gives exactly `promoted`), else a fresh rendering."""
    from policies.load import load_policy_text
    from policies.model import canonical
    if original is not None:
        edited = set_mode_text(original, promoted.mode)
        if edited is not None:
            try:
                again = load_policy_text(edited, "<promoted>")
                if canonical(again) == canonical(promoted):
                    return edited
            except PoliciesError:
                pass
    from policies.learn import render
    return render(promoted, header)


__all__ = ["promotion_decision", "Decision", "parse_duration", "format_duration", "set_mode_text",
           "promoted_text", "PromoteError", "DEFAULT_WINDOW_S", "DEFAULT_MIN_RUNS", "TARGETS"]
