"""Render a Trajectory for a terminal: header, steps, denials, then per step its
process tree and timeline, then the file-change manifest.

Everything that comes from the sandbox (paths, argv, comm) goes through the
one describer (audit_schema/describe.py): undecodable bytes and control
characters are printed as escapes, so a hostile file name cannot drive the
terminal."""
from __future__ import annotations

from audit_schema.describe import argv_text, line, printable
from replay.trajectory import Proc, Trajectory

def _show(s, limit: int = 120) -> str:
    return printable(s, limit)


def _argv(argv, limit=100) -> str:
    return argv_text(argv, limit)


describe = line      # one timeline row per event: audit_schema/describe.py


MAX_INDENT = 40      # levels drawn as a tree; deeper ones stay at that indentation, their depth said


def _tree_lines(p: Proc, prefix: str, last: bool, root: bool, out: list[str], step=None):
    """p's process tree, one line each, depth first. Not recursive: a workload's fork chain
    can be thousands of levels deep (each process forks the next and exits)."""
    stack = [(p, prefix, last, root, 0)]
    while stack:
        p, prefix, last, root, depth = stack.pop()
        head = "" if root else ("└─ " if last else "├─ ")
        if p.execs:
            e = p.execs[-1]
            what = _argv(e.get("argv") or [e.get("path", "")], 80)
            extra = []
            if e.get("path") and (not e.get("argv") or e["argv"][0] != e["path"]):
                extra.append(_show(e["path"], 60))
            if e.get("sha256"):
                extra.append(f"sha256 {e['sha256'][:16]}")
            if e.get("build_id"):
                extra.append(f"build-id {e['build_id'][:16]}")
            if e.get("shebang"):
                extra.append(f"#!{_show(e['shebang'], 40)}")
            if len(p.execs) > 1:
                extra.append(f"{len(p.execs)} execs")
            what += ("  (" + ", ".join(extra) + ")") if extra else ""
        else:
            what = f"({_show(p.comm) or '?'})"
        end = ""
        if p.signal:
            end = f"  → signal {p.signal}"
        elif p.exit_code is not None:
            end = f"  → exit {p.exit_code}"
        deep = f"depth {depth}: " if depth > MAX_INDENT else ""
        out.append(f"{prefix}{head}{deep}[{p.pid}] {what}{end}")
        child_prefix = prefix if depth >= MAX_INDENT else prefix + ("" if root else ("   " if last else "│  "))
        kids = [c for c in p.children if step is None or c.step == step]
        for i in range(len(kids) - 1, -1, -1):
            stack.append((kids[i], child_prefix, i == len(kids) - 1, False, depth + 1))


def _mb(v) -> str:
    return f"{int(v) >> 20}M" if isinstance(v, int) and v else "-"


def header(t: Trajectory) -> list[str]:
    out = []
    s = t.summary
    head = f"sandbox {t.sandbox_id}"
    if t.node:
        head += f" on {t.node}"
    out.append(head)
    pol = t.policy
    bits = []
    if pol:
        bits.append(f"policy {pol['name']} ({pol['mode']}, hash {pol['hash'][:12]})")
    else:
        bits.append("no policy")
    i = t.info
    if i:
        bits.append(f"network {i.get('network')}, memory {_mb(i.get('memory'))}, cpus {i.get('cpus') or '-'}, "
                    f"pids {i.get('pids') or '-'}, user {i.get('user')}, rootfs {i.get('rootfs')}")
        img = i.get("image") or {}
        if img:
            bits.append(f"image {img.get('name')} ({img.get('digest')}, {len(img.get('layers') or [])} layers)")
        for v in i.get("volumes") or []:
            bits.append(f"volume {v.get('host')}:{v.get('sandbox')}:{v.get('mode')}")
    out.append("  " + "; ".join(bits))
    if s:
        st = "timed out" if s.get("timed_out") else (f"signal {s['signal']}" if s.get("signal") else f"exit {s.get('exit_code')}")
        out.append(f"  {st}, wall {s.get('wall_ms')} ms, cpu {s.get('cpu_ms')} ms"
                   + (", OOM-killed" if s.get("oom_killed") else ""))
    elif t.start and not t.exit:
        out.append("  no sandbox_exit record: the sandbox was still running, or its end was not recorded")
    counts = t.counts()
    out.append("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if t.lost:
        out.append(f"  WARNING: the record has holes: {t.lost} events were lost (see !! LOST lines)")
    return out


def _denial_line(d: dict, t0: int) -> str:
    n = f" x{d['count']}" if d["count"] > 1 else ""
    if d["count"] > 1 and d.get("last_ts_ns", d["ts_ns"]) > d["ts_ns"]:
        n += f" (last +{(d['last_ts_ns'] - t0) / 1e9:.6f}s)"
    ret = f" {_errno_name(d['ret'])}" if d["decision"] == "failed" and d.get("ret") else ""
    return (f"  +{(d['ts_ns'] - t0) / 1e9:9.6f}s step {d['step']} [{d['pid']}] {d['decision']:<10} "
            f"{d['action']:<8} {_show(d['subject'], 80)}{ret}{n}   by {_argv(d['process'], 60)}")


def _errno_name(ret) -> str:
    import errno
    try:
        r = int(ret)
    except (TypeError, ValueError):
        return ""
    return errno.errorcode.get(-r, str(r)) if r < 0 else ""


def _step_line(s) -> str:
    d = s.duration_ms
    dur = f"{d:.0f} ms" if d is not None else "?"
    notes = []
    if s.stdin is not None:
        notes.append(f"stdin {s.stdin_bytes} bytes" + (" (truncated in the record)" if s.stdin_truncated else ""))
    if s.redacted:
        notes.append("env " + ", ".join(s.redacted) + " redacted")
    notes += [m for m in s.missing if not m.startswith("stdin")]
    line = f"  {s.n:>3}  {s.status():<16} {dur:>9}  {_argv(s.argv, 90)}"
    return line + (f"   [{'; '.join(notes)}]" if notes else "")


def render(t: Trajectory, step: int | None = None, unattributed_lost: list[dict] | None = None) -> str:
    out = header(t)
    for r in unattributed_lost or ():
        out.append(f"  WARNING: {r.get('count')} events of unknown sandboxes were lost while this sandbox ran "
                   f"({_show(r.get('extra', ''), 80)}): some of them may be this sandbox's")
    out.append("")
    out.append("steps:")
    if t.steps:
        out.extend(_step_line(s) for s in t.steps)
    else:
        out.append("  (no steps recorded)")
    rows = t.denial_rows(step=step)
    out.append("")
    out.append(f"denials ({len(rows)}):" if rows else "denials: none")
    t0 = t.t0
    for d in rows:
        out.append(_denial_line(d, t0))
    failed = t.failed_rows(step=step)
    if failed:
        out.append(f"failed on their own ({len(failed)}): forbidden, but the kernel refused them anyway "
                   "(ENOENT ...): not policy denials")
        out.extend(_denial_line(d, t0) for d in failed[:50])
        if len(failed) > 50:
            out.append(f"  ... and {len(failed) - 50} more")
    numbers = [0] + [s.n for s in t.steps]
    if step is not None:
        numbers = [step]
    for n in numbers:
        out.append("")
        s = t.step(n)
        if n == 0:
            out.append("launch (step 0):")
        else:
            out.append(f"step {n}: {_argv(s.argv, 100) if s else '?'}" + (f"  → {s.status()}" if s else ""))
        out.append("  process tree:")
        lines: list[str] = []
        for r in t.step_roots(n):
            _tree_lines(r, "    ", True, True, lines, step=n)
        out.extend(lines or ["    (no processes recorded)"])
        out.append("  timeline:")
        tl = [r for r in t.timeline(step=n) if r["kind"] != "fork"]
        if not tl:
            out.append("    (nothing recorded)")
        for r in tl:
            dec = r.get("decision")
            mark = f" [{dec}]" if dec in ("denied", "would-deny") else ""
            pid = f"[{r['pid']}]" if r.get("pid") else ""
            out.append(f"    +{(r['ts_ns'] - t0) / 1e9:9.6f}s {pid:>9} {describe(r)}{mark}")
    if step is None:
        out.append("")
        ch = t.changes
        out.append(f"files changed ({len(ch)}):" if ch else "files changed: none recorded")
        if t.changes_note:
            out.append(f"  ({t.changes_note})")
        for c in ch:
            detail = ""
            if c.get("kind") == "file" and c.get("change") != "deleted":
                detail = f"  {c.get('size')} bytes  sha256 {str(c.get('sha256') or '')[:16]}"
            elif c.get("kind") == "symlink":
                detail = f"  -> {_show(c.get('target', ''))}"
            out.append(f"  {c.get('change', '?'):<9} {c.get('kind', '?'):<9} {_show(c.get('path', ''))}{detail}")
    return "\n".join(out) + "\n"
