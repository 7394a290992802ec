"""Render a Trajectory for a terminal: header, process tree, timeline."""
from __future__ import annotations

import shlex

from replay.trajectory import Proc, Trajectory, summary_of

O_FLAGS = ((0o1, "O_WRONLY"), (0o2, "O_RDWR"), (0o100, "O_CREAT"), (0o1000, "O_TRUNC"),
           (0o2000, "O_APPEND"), (0o200, "O_EXCL"))


def _show(s: str, limit: int = 120) -> str:
    """Printable form of a surrogateescape string: bad bytes as \\xHH, control chars escaped."""
    b = s.encode("utf-8", "surrogateescape")
    text = b.decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _argv(argv, limit=100) -> str:
    return _show(" ".join(shlex.quote(a) for a in argv), limit)


def _flags(f: int) -> str:
    names = [n for bit, n in O_FLAGS if f & bit]
    return "|".join(names) or "O_RDONLY"


def _ret(r: dict) -> str:
    v = int(r.get("ret") or 0)
    if v >= 0:
        return "ok"
    import errno
    return errno.errorcode.get(-v, str(v))


def describe(r: dict) -> str:
    k = r["kind"]
    if k == "exec":
        s = f"exec     {_show(r.get('path', ''))}  {_argv(r.get('argv') or [])}"
        if r.get("argv_truncated"):
            s += " [argv truncated]"
        if int(r.get("ret") or 0) < 0:
            s += f" -> {_ret(r)}"
        return s
    if k == "fork":
        return f"fork     child {r.get('child_pid')}"
    if k == "exit":
        return f"exit     " + (f"signal {r['signal']}" if r.get("signal") else f"code {r.get('exit_code')}")
    if k == "connect":
        addr = r.get("addr", "")
        dest = f"[{addr}]:{r.get('port')}" if r.get("family") == "ipv6" else \
            (_show(addr) if r.get("family") == "unix" else f"{addr}:{r.get('port')}")
        return f"connect  {r.get('family')} {dest} -> {_ret(r)}"
    if k == "open_write":
        return f"write    {_show(r.get('path', ''))} ({_flags(int(r.get('flags') or 0))}) -> {_ret(r)}"
    if k == "unlink":
        return f"unlink   {_show(r.get('path', ''))} -> {_ret(r)}"
    if k == "rename":
        return f"rename   {_show(r.get('path', ''))} -> {_show(r.get('path2', ''))} : {_ret(r)}"
    if k in ("syscall_denied", "syscall_violation"):
        n = r.get("count") or 1
        return f"{k:17} {r.get('syscall') or '?'}" + (f" x{n}" if n > 1 else "")
    if k in ("exec_denied", "exec_violation"):
        return f"{k:17} {_show(r.get('path', ''))}"
    if k in ("egress_denied", "egress_violation"):
        addr = r.get("addr", "")
        dest = f"[{addr}]:{r.get('port')}" if r.get("family") == "ipv6" else f"{addr}:{r.get('port')}"
        return f"{k:17} {r.get('protocol') or r.get('family') or ''} {dest}"
    if k == "events_lost":
        return f"!! LOST  {r.get('count')} events not recorded ({_show(r.get('extra', ''), 80)})"
    if k == "sandbox_start":
        return f"start    {_argv(r.get('argv') or [])}"
    if k == "sandbox_exit":
        return "end      " + (f"signal {r['signal']}" if r.get("signal") else f"exit {r.get('exit_code')}")
    return f"{k:8} {_show(r.get('path', ''))}"


def _tree_lines(p: Proc, prefix: str, last: bool, root: bool, out: list[str]):
    head = "" if root else ("└─ " if last else "├─ ")
    if p.execs:
        e = p.execs[-1]
        what = _argv(e.get("argv") or [e.get("path", "")], 80)
        extra = []
        if e.get("sha256"):
            extra.append(f"sha256 {e['sha256'][:12]}")
        if e.get("build_id"):
            extra.append(f"build-id {e['build_id'][:12]}")
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
    out.append(f"{prefix}{head}[{p.pid}] {what}{end}")
    child_prefix = prefix + ("" if root else ("   " if last else "│  "))
    for i, c in enumerate(p.children):
        _tree_lines(c, child_prefix, i == len(p.children) - 1, False, out)


def render(t: Trajectory, step: int | None = None) -> str:
    out = []
    s = summary_of(t)
    counts = t.counts()
    head = f"sandbox {t.sandbox_id}"
    if t.node:
        head += f" on {t.node}"
    out.append(head)
    if s:
        st = "timed out" if s.get("timed_out") else (f"signal {s['signal']}" if s.get("signal") else f"exit {s.get('exit_code')}")
        out.append(f"  {st}, wall {s.get('wall_ms')} ms, cpu {s.get('cpu_ms')} ms"
                   + (", OOM-killed" if s.get("oom_killed") else ""))
    out.append("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if t.lost:
        out.append(f"  WARNING: the record has holes: {t.lost} events were lost (see !! LOST lines)")
    out.append("")
    out.append("process tree:")
    lines: list[str] = []
    for r in t.roots:
        _tree_lines(r, "  ", True, True, lines)
    out.extend(lines or ["  (no processes recorded)"])
    out.append("")
    out.append("timeline:" if step is None else f"timeline (step {step}):")
    t0 = t.t0
    for r in t.timeline(step=step):
        if r["kind"] in ("fork",):
            continue
        dec = r.get("decision")
        mark = f" [{dec}]" if dec in ("denied", "would-deny") else ""
        pid = f"[{r['pid']}]" if r.get("pid") else ""
        out.append(f"  +{(r['ts_ns'] - t0) / 1e9:9.6f}s {pid:>9} {describe(r)}{mark}")
    return "\n".join(out) + "\n"
