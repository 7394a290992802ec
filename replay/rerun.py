"""Re-run a recorded sandbox's steps in a fresh sandbox and compare.

    plan = plan_rerun(trajectory, policy=None)      # recorded rootfs, resources, policy, steps
    new_id, results, summary = run_via_agent(plan, client)   # through the node agent's SDK
    # (or agent/sensors/inprocess.py rerun(plan): the same in this process, when no agent runs)
    new = reconstruct(new_id, store.events(new_id))
    diff = compare(trajectory, new, plan)           # per step: exit status, execs, connects, writes, denials
    print(render_diff(diff))

The fresh sandbox gets the recorded rootfs ("default" = dsec's base layer),
network, memory, cpus, pids, user and workdir (sandbox_start), and the
recorded policy unless one is given: a built-in named like the recorded one
whose content hash matches; anything else needs --policy (the record keeps the
policy's name, hash and mode, not its text). Each step runs with its recorded
argv, environment, workdir, timeout and stdin (step_start records). An
environment value that was redacted at record time (DSEC_SECRET_ENV patterns)
stays redacted: the step gets the literal "<redacted>" unless the caller
supplies the value (--env K=V). HOSTNAME is the new sandbox's id, as for any
sandbox. A stdin longer than the record's bound is re-sent truncated (said in
the notes).

Compared per step, as sets (pids, timestamps and order differ between runs):
  exit status
  execs      exec'd paths (successful execs)
  connects   family + destination (ipv4/ipv6 address:port, unix path)
  writes     open_write / unlink paths, rename "src -> dst"
  denials    (action, subject, decision) of every denied / would-deny action
"""
from __future__ import annotations

import os
import posixpath
import shlex
from dataclasses import dataclass, field

from replay.errors import ReplayError, USAGE as EXIT_USAGE
from audit_schema.errors import ReportedError
from replay.trajectory import REDACTED, Trajectory, dest

DEFAULT_STEP_TIMEOUT = 600.0


@dataclass
class PlannedStep:
    n: int
    argv: list
    env: dict | None
    workdir: str | None
    timeout: float | None
    stdin: bytes | None


@dataclass
class Plan:
    original: str
    sandbox: dict                 # SandboxSpec fields: network, memory, cpus, pids, user, workdir, rootfs
    policy: object                # policies.model.Policy or None
    policy_source: str            # "recorded built-in NAME" | "--policy FILE" | "none recorded"
    steps: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    sandbox_id: str | None = None
    first_step: int = 1            # --from-step K: the re-run starts at step K ...
    from_snapshot: str | None = None   # ... from the snapshot taken after step K-1, when there is one


def recorded_policy(t: Trajectory):
    """The policy the sandbox ran under, rebuilt from the record, or None when it ran
    without one. Raises ReplayError when the record names a policy this dsec cannot rebuild."""
    ident = t.policy
    if not ident:
        return None, "none recorded"
    text = (t.info or {}).get("policy_yaml")
    from policies.load import is_builtin_ref, load_policy, load_policy_text
    if text:
        p = load_policy_text(text, f"<recorded policy {ident['name']}>")
    elif is_builtin_ref(ident["name"]):
        try:
            p = load_policy(ident["name"])
        except ReportedError:
            p = None
        if p is not None and p.hash != ident["hash"]:
            raise ReplayError(f"sandbox {t.sandbox_id} ran policy {ident['name']} with hash {ident['hash'][:16]}, "
                            f"but the built-in {ident['name']} now hashes to {p.hash[:16]}: pass --policy FILE "
                            f"(the record keeps the policy's hash, not its text)", EXIT_USAGE)
    else:
        p = None
    if p is None:
        raise ReplayError(f"sandbox {t.sandbox_id} ran policy {ident['name']} (hash {ident['hash'][:16]}), which is "
                        f"not a built-in: pass --policy FILE to re-run it (the record keeps the policy's name "
                        f"and hash, not its text)", EXIT_USAGE)
    if ident.get("mode") and ident["mode"] != p.mode:
        p = p.with_mode(ident["mode"])
    return p, f"recorded ({ident['name']}, {p.mode})"


def snapshots_of(t: Trajectory) -> dict[int, str]:
    """step -> the last snapshot the record says was taken after it (lifecycle `snapshotted`)."""
    import json
    out = {}
    for r in t.records:
        if r.get("kind") != "lifecycle":
            continue
        try:
            x = json.loads(r.get("extra") or "{}")
        except ValueError:
            continue
        if x.get("state") == "snapshotted" and x.get("snapshot"):
            # the step the snapshot was taken after: the record's step (older agents: in extra)
            out[int(x.get("step") or r.get("step") or 0)] = x["snapshot"]
    return out


def plan_rerun(t: Trajectory, policy=None, *, mode: str | None = None, env: dict | None = None,
               step_timeout: float = DEFAULT_STEP_TIMEOUT, sandbox_id: str | None = None,
               from_step: int | None = None) -> Plan:
    if policy is None:
        policy, source = recorded_policy(t)
    else:
        source = f"given ({policy.name}, {policy.mode})"
    if mode and policy is not None and mode != policy.mode:
        policy = policy.with_mode(mode)
        source += f", mode {mode}"
    i = t.info or {}
    if not t.start:
        raise ReplayError(f"sandbox {t.sandbox_id}: no sandbox_start record, so its rootfs and resources are "
                        "unknown: cannot re-run it", 1)
    rootfs = i.get("rootfs")
    sb = {"network": i.get("network") or "none", "memory": i.get("memory"), "cpus": i.get("cpus"),
          "pids": i.get("pids"), "user": i.get("user") or "sandbox", "workdir": i.get("workdir") or "/workspace",
          "rootfs": None if rootfs in (None, "", "default") else rootfs,
          "image": (i.get("image") or {}).get("digest"), "volumes": i.get("volumes") or []}
    plan = Plan(t.sandbox_id, sb, policy, source, sandbox_id=sandbox_id)
    if sb["rootfs"] and not os.path.isdir(sb["rootfs"]):
        raise ReplayError(f"the recorded rootfs {sb['rootfs']} does not exist on this node", 1)
    given = dict(env or {})
    if not t.steps:
        raise ReplayError(f"sandbox {t.sandbox_id}: no steps recorded, nothing to re-run", 1)
    for s in t.steps:
        if not s.argv:
            raise ReplayError(f"sandbox {t.sandbox_id} step {s.n}: its command is not in the record "
                            f"({'; '.join(s.missing) or 'no argv'})", 1)
        step_env = None
        if s.env is not None:
            step_env = {k: v for k, v in s.env.items() if k != "HOSTNAME"}
            still = []
            for k in s.redacted:
                if k in given:
                    step_env[k] = given[k]
                else:
                    still.append(k)
            if still:
                plan.notes.append(f"step {s.n}: {', '.join(still)} redacted in the record: re-run with the "
                                  f"literal value {REDACTED!r} (supply it with --env K=V)")
        if given:
            step_env = dict(step_env or {})
            step_env.update({k: v for k, v in given.items() if s.env is None or k not in s.env or k in s.redacted})
        for m in s.missing:
            plan.notes.append(f"step {s.n}: {m}")
        timeout = s.timeout
        if timeout is None and step_timeout:
            timeout = step_timeout
        plan.steps.append(PlannedStep(s.n, list(s.argv), step_env, s.workdir, timeout, s.stdin))
    if from_step is not None and from_step > 1:
        if from_step > max(s.n for s in plan.steps):
            raise ReplayError(f"sandbox {t.sandbox_id} has no step {from_step}", EXIT_USAGE)
        snap = snapshots_of(t).get(from_step - 1)
        if snap is None:
            plan.notes.append(f"no snapshot was taken after step {from_step - 1}: steps 1..{from_step - 1} are "
                              f"re-run first")
        else:
            plan.from_snapshot = snap
            plan.first_step = from_step
            plan.steps = [s for s in plan.steps if s.n >= from_step]
            plan.notes.append(f"started from snapshot {snap[:12]} (taken after step {from_step - 1}): steps "
                              f"1..{from_step - 1} are not re-run")
    return plan


# ---------------------------------------------------------------- running it

@dataclass
class StepRun:
    n: int
    code: int
    exit_code: int | None
    signal: int | None
    timed_out: bool
    error: str | None
    wall_ms: int


def new_replay_id() -> str:
    """Re-run sandboxes are named replay-<hex> (and labelled replay_of=<original id>)."""
    return "replay-" + os.urandom(6).hex()


def run_via_agent(plan: Plan, client) -> tuple[str, list[StepRun], dict]:
    """The fresh sandbox through the running node agent (agent/node/client.py): the agent
    records and exports it. Returns (sandbox id, step results, summary)."""
    from agent.node.client import SandboxStopped
    from policies.load import dump_yaml
    sb_spec = plan.sandbox
    kw = {"sandbox_id": plan.sandbox_id or new_replay_id(), "network": sb_spec.get("network"), "memory": sb_spec.get("memory"),
          "cpus": sb_spec.get("cpus"), "pids": sb_spec.get("pids"), "user": sb_spec.get("user"),
          "workdir": sb_spec.get("workdir"), "rootfs": sb_spec.get("rootfs"), "image": sb_spec.get("image"),
          "from_snapshot": plan.from_snapshot,
          "volumes": [f"{v['host']}:{v['sandbox']}:{v['mode']}" for v in sb_spec.get("volumes") or []],
          "labels": {"replay_of": plan.original}, "warm": False}
    if plan.policy is not None:
        kw["policy_yaml"] = dump_yaml(plan.policy)
        kw["policy_source"] = plan.policy.source
    if plan.from_snapshot:           # the snapshot names its own image or rootfs
        kw.pop("image", None)
        kw.pop("rootfs", None)
    sb = client.create(**kw)
    results = []
    try:
        for st in plan.steps:
            try:
                r = sb.exec(st.argv, env=st.env, workdir=st.workdir, stdin=st.stdin, timeout=st.timeout,
                            wait_export=True)
            except SandboxStopped as e:
                r = e.result
                if r is None:
                    raise ReplayError(f"re-run {sb.id}: {e.message}", 1)
            results.append(StepRun(st.n, r.code, r.exit_code, r.signal or None, r.timed_out, r.error or None,
                                   r.wall_ms))
    finally:
        info = sb.close()
    return sb.id, results, info.summary or {}


# ---------------------------------------------------------------- comparing

def _abs(path: str, workdir: str | None) -> str:
    """A path the recorder could not resolve (relative, the process gone by decode time),
    taken relative to the step's workdir, so that two runs compare alike whichever of them
    the recorder resolved."""
    if path and not path.startswith("/") and workdir:
        return posixpath.normpath(posixpath.join(workdir, path))
    return path


def step_sets(t: Trajectory, n: int) -> dict[str, set]:
    execs, connects, writes, denials = set(), set(), set(), set()
    st = t.step(n)
    wd = getattr(st, "workdir", None) if st is not None else None
    for r in t.timeline(step=n):
        k = r["kind"]
        if k == "exec" and int(r.get("ret") or 0) == 0:
            execs.add(r.get("path") or "")
        elif k == "connect":
            connects.add(f"{r.get('family')} {dest(r)}")
        elif k in ("open_write", "unlink"):
            writes.add(f"{k} {_abs(r.get('path') or '', wd)}")
        elif k == "rename":
            writes.add(f"rename {_abs(r.get('path') or '', wd)} -> {_abs(r.get('path2') or '', wd)}")
    for d in t.denial_rows(step=n) + t.failed_rows(step=n):
        denials.add(f"{d['decision']} {d['action']} {d['subject']}")
    return {"execs": execs, "connects": connects, "writes": writes, "denials": denials}


SETS = ("execs", "connects", "writes", "denials")


def compare(orig: Trajectory, new: Trajectory, plan: Plan | None = None, results=None, how: str = "") -> dict:
    """The diff, as plain data (what --format json prints)."""
    steps = []
    first = plan.first_step if plan else 1
    numbers = sorted(n for n in set(orig.step_numbers) | set(new.step_numbers) if n >= first)
    changed = False
    for n in numbers:
        a, b = orig.step(n), new.step(n)
        sa, sb = step_sets(orig, n), step_sets(new, n)
        d = {"step": n, "argv": (a or b).argv if (a or b) else [],
             "original": {"status": a.status() if a else "absent", "code": a.code if a else None},
             "rerun": {"status": b.status() if b else "absent", "code": b.code if b else None}}
        d["exit_changed"] = d["original"]["code"] != d["rerun"]["code"]
        changed |= d["exit_changed"]
        for key in SETS:
            added, removed = sorted(sb[key] - sa[key]), sorted(sa[key] - sb[key])
            d[key] = {"added": added, "removed": removed, "same": sorted(sa[key] & sb[key])}
            changed |= bool(added or removed)
        steps.append(d)
    out = {"original": orig.sandbox_id, "rerun": new.sandbox_id, "how": how, "changed": changed,
           "policy": {"original": orig.policy, "rerun": new.policy},
           "notes": list(plan.notes) if plan else [], "steps": steps,
           "lost": {"original": orig.lost, "rerun": new.lost}}
    if orig.lost or new.lost:
        out["notes"].append(f"the record has holes (lost events: original {orig.lost}, re-run {new.lost}): "
                            "the sets below may be incomplete")
    return out


def render_diff(d: dict) -> str:
    out = [f"replay of {d['original']} as {d['rerun']}" + (f" ({d['how']})" if d.get("how") else "")]
    po, pr = d["policy"]["original"], d["policy"]["rerun"]

    def pol(p):
        return f"{p['name']} ({p['mode']}, {p['hash'][:12]})" if p else "none"
    out.append(f"  policy: {pol(po)} -> {pol(pr)}")
    for n in d["notes"]:
        out.append(f"  note: {n}")
    out.append("")
    for s in d["steps"]:
        argv = " ".join(shlex.quote(str(a)) for a in s["argv"])
        arrow = "==" if not s["exit_changed"] else "!="
        out.append(f"step {s['step']}: {argv[:100]}")
        out.append(f"  {'=' if not s['exit_changed'] else '~'} exit  {s['original']['status']}  {arrow}  "
                   f"{s['rerun']['status']}")
        for key in SETS:
            part = s[key]
            for x in part["removed"]:
                out.append(f"  - {key[:-1]:<8} {x}")
            for x in part["added"]:
                out.append(f"  + {key[:-1]:<8} {x}")
            if part["same"] and not part["added"] and not part["removed"]:
                out.append(f"  = {key:<8} {len(part['same'])} the same")
            elif part["same"]:
                out.append(f"  = {key:<8} {len(part['same'])} others the same")
        out.append("")
    out.append("result: " + ("the re-run differs (lines marked + / - / ~)" if d["changed"]
                             else "the re-run did the same"))
    return "\n".join(out) + "\n"


__all__ = ["plan_rerun", "run_via_agent", "compare", "render_diff", "recorded_policy", "new_replay_id",
           "Plan", "PlannedStep", "StepRun"]
