"""The trajectory as plain data: what `dsec replay --format json` prints and what the
HTML report embeds.

    d = to_dict(trajectory, step=None, unattributed_lost=[])

{"sandbox_id", "node", "policy": {name, hash, mode}, "sandbox": sandbox_start extra
(resources, rootfs, user, network, labels), "summary": {exit_code, signal, timed_out,
oom_killed, wall_ms, cpu_ms, ...}, "t0_ns", "counts": {kind: n}, "lost": n, "lost_markers",
"unattributed_lost", "steps": [{step, argv, env, redacted_env, workdir, timeout, stdin_b64,
status, code, duration_ms, missing, ..., "processes": [tree], "timeline": [records]}],
"launch": {"processes", "timeline"} (step 0), "denials": [rows], "changes": [manifest],
"changes_note"}. Records keep every field of audit_schema/events.py; byte strings that are
not UTF-8 carry \\udcXX escapes (as `dsec events --format json`)."""
from __future__ import annotations

from replay.trajectory import Trajectory


def _rec(r: dict) -> dict:
    return dict(r)


def to_dict(t: Trajectory, step: int | None = None, unattributed_lost: list | None = None) -> dict:
    summary = {k: v for k, v in t.summary.items() if k not in ("changes", "steps")}
    steps = []
    for s in t.steps:
        if step is not None and s.n != step:
            continue
        d = s.to_dict()
        d["processes"] = [p.to_dict(s.n) for p in t.step_roots(s.n)]
        d["timeline"] = [_rec(r) for r in t.timeline(step=s.n) if r["kind"] != "fork"]
        steps.append(d)
    out = {"sandbox_id": t.sandbox_id, "node": t.node, "policy": t.policy, "sandbox": t.info, "summary": summary,
           "t0_ns": t.t0, "counts": t.counts(), "lost": t.lost, "lost_markers": [_rec(r) for r in t.lost_markers],
           "unattributed_lost": list(unattributed_lost or []), "steps": steps,
           "denials": t.denial_rows(step=step), "changes": t.changes, "changes_note": t.changes_note}
    if step is None or step == 0:
        out["launch"] = {"processes": [p.to_dict(0) for p in t.step_roots(0)],
                         "timeline": [_rec(r) for r in t.timeline(step=0) if r["kind"] != "fork"]}
    return out
