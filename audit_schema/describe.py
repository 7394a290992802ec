"""The one describer of audit events: each kind as one line of text, safe for a terminal.

    printable(s)       anything from a sandbox (paths, argv, comm, JSON) made safe: bytes
                       that are not UTF-8 (surrogateescape) as \\xHH, control and other
                       non-printable characters as \\xHH / \\uHHHH. Idempotent (a
                       backslash is kept as it is, so applying it twice changes
                       nothing); --format json carries the exact bytes
    detail(ev)         what happened, without the kind ("/etc/profile (O_WRONLY|O_CREAT) -> EACCES")
    line(ev)           a label and the detail, as replay's timeline shows it
                       ("write    /etc/profile (O_WRONLY|O_CREAT) -> EACCES"); a summary of
                       repeats adds "x20,000 between <first> and <last> (...)" (repeats_text)
    fmt_ts(ts_ns)      UTC wall-clock time with microseconds
    to_json_line(ev)   JSON, non-UTF-8 bytes kept as \\udcXX escapes (os.fsencode gives them back)

Used by `dsec events` (table), `dsec agent tail`, `dsec search`, `dsec replay`
(text and HTML) and the OTel sink's log bodies, so every reader of the record
words an event the same way. A hostile file name cannot drive a terminal
through any of them.
"""
from __future__ import annotations

import errno
import json
import re
import shlex
import time

_SURROGATE = re.compile("[\ud800-\udfff]")
O_FLAGS = ((0o1, "O_WRONLY"), (0o2, "O_RDWR"), (0o100, "O_CREAT"), (0o1000, "O_TRUNC"),
           (0o2000, "O_APPEND"), (0o200, "O_EXCL"))
# the timeline's label of each kind (others: the kind itself)
LABELS = {"open_write": "write", "events_lost": "!! LOST", "sandbox_start": "start", "sandbox_exit": "end",
          "file_changes": "changes", "step_start": "step", "step_end": "step", "lifecycle": "agent"}
WIDE = ("syscall_denied", "syscall_violation", "exec_denied", "exec_violation", "egress_denied",
        "egress_violation")


def printable(s, limit: int | None = None) -> str:
    """Terminal-safe text (see the module doc); cut at `limit` characters with an ellipsis."""
    out = []
    for ch in str(s):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif not ch.isprintable():
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
        else:
            out.append(ch)
    text = "".join(out)
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return text


def argv_text(argv, limit: int | None = None) -> str:
    """A command line as a shell would read it, terminal-safe."""
    return printable(" ".join(shlex.quote(str(a)) for a in argv or ()), limit)


def flags_text(flags: int) -> str:
    names = [n for bit, n in O_FLAGS if flags & bit]
    return "|".join(names) or "O_RDONLY"


def ret_text(ev: dict) -> str:
    """A syscall result: "ok", or the errno's name."""
    v = int(ev.get("ret") or 0)
    if v >= 0:
        return "ok"
    return errno.errorcode.get(-v, str(v))


def dest_text(ev: dict) -> str:
    addr = ev.get("addr") or ""
    if ev.get("family") == "ipv6":
        return f"[{printable(addr)}]:{ev.get('port')}"
    if ev.get("family") == "unix":
        return printable(addr)
    return f"{printable(addr)}:{ev.get('port')}"


def _status(ev: dict, word: str = "exit") -> str:
    return f"signal {ev['signal']}" if ev.get("signal") else f"{word} {ev.get('exit_code')}"


def detail(ev: dict, full: bool = False) -> str:
    """What one event says, without its kind. full=True adds the `extra` JSON of the
    records that carry their content there (sandbox_start/exit, steps, lifecycle)."""
    k = ev.get("kind")
    path = printable(ev.get("path") or "")
    if k == "exec":
        s = f"{path}  {argv_text(ev.get('argv'))}"
        if ev.get("argv_truncated"):
            s += " [argv truncated]"
        if int(ev.get("ret") or 0) < 0:
            s += f" -> {ret_text(ev)}"
        if full and ev.get("sha256"):
            s += f"  sha256 {ev['sha256'][:16]}"
        return s
    if k == "fork":
        return f"child {ev.get('child_pid')}"
    if k == "exit":
        return _status(ev, "code")
    if k == "connect":
        return f"{ev.get('family')} {dest_text(ev)} -> {ret_text(ev)}"
    if k == "open_write":
        return f"{path} ({flags_text(int(ev.get('flags') or 0))}) -> {ret_text(ev)}"
    if k == "unlink":
        return f"{path} -> {ret_text(ev)}"
    if k == "rename":
        return f"{path} -> {printable(ev.get('path2') or '')} : {ret_text(ev)}"
    if k in ("syscall_denied", "syscall_violation"):
        n = ev.get("count") or 1
        return f"{printable(ev.get('syscall') or '?')}" + (f" x{n}" if n > 1 else "")
    if k in ("exec_denied", "exec_violation"):
        return path
    if k in ("egress_denied", "egress_violation"):
        return f"{ev.get('protocol') or ev.get('family') or ''} {dest_text(ev)}"
    if k == "events_lost":
        return f"{ev.get('count')} events not recorded ({printable(ev.get('extra') or '', None if full else 80)})"
    extra = f"  {printable(ev['extra'])}" if full and ev.get("extra") else ""
    if k == "sandbox_start":
        return (argv_text(ev.get("argv")) if ev.get("argv") else "sandbox created") + extra
    if k == "sandbox_exit":
        return _status(ev) + extra
    if k == "file_changes":
        return f"{ev.get('count')} file changes (a page of the change manifest)" + extra
    if k == "step_start":
        return f"start: {argv_text(ev.get('argv'))}" + extra
    if k == "step_end":
        return f"end: {_status(ev)}" + extra
    if k == "lifecycle":
        return printable(ev.get("extra") or "", None if full else 100)
    if path:
        return path + extra
    return printable(ev.get("extra") or "", None if full else 100)


def repeats_text(ev: dict) -> str:
    """Of a summary record (extra.aggregated: repeats counted by the kernel or the
    recorder's denial aggregator): "x20,000 between <first> and <last> (1,249 since
    the last record)"; "" for any other record."""
    extra = ev.get("extra")
    if not extra or '"aggregated"' not in extra:
        return ""
    try:
        e = json.loads(extra)
        total, first, last = int(e["total"]), int(e["first_ts_ns"]), int(e["last_ts_ns"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return ""
    if not e.get("aggregated"):
        return ""
    return (f"x{total:,} between {fmt_ts(first)} and {fmt_ts(last)} "
            f"({int(ev.get('count') or 0):,} since the last record)")


def line(ev: dict) -> str:
    """The kind's label (padded) and the detail: one row of a timeline; a summary of
    repeats says how many and between when (repeats_text)."""
    k = ev.get("kind") or "?"
    label = LABELS.get(k, k)
    width = 17 if k in WIDE else 8
    reps = repeats_text(ev)
    return f"{label:{width}} {detail(ev)}" + (f"  {reps}" if reps else "")


def fmt_ts(ts_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts_ns // 10**9)) + f".{ts_ns % 10**9 // 1000:06d}"


def to_json_line(ev) -> str:
    """JSON with non-UTF-8 bytes (lone surrogates) as \\udcXX escapes; other text as is."""
    text = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
