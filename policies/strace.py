"""`strace -f` output -> a learning run (the structure policies.learn derives from).

Why this file is long: one parser for every strace output variant (see below),
with the argument decoding of each syscall family it learns from.

    run = parse_strace_file("trace.log")          # {run_id, records, syscall_counts, source, stats}
    runs = parse_strace_files(["a.log", "b.log"]) # one run per file; `-ff` outputs (LOG.PID) grouped
    run = parse_strace(lines, source="<text>")    # any iterable of lines (str or bytes)

Accepted output: `strace -f` written with `-o FILE` (lines start with the pid)
or to stderr (`[pid N]` prefixes), or without -f (no pid); with or without
`-t`/`-tt`/`-ttt`/`-r` timestamps, `-T` durations, `-y`/`-yy` fd annotations
(`3</path>`, `AT_FDCWD</cwd>`, `3<TCP:[...]>`), `-s N` truncated strings
(`"abc"...`), `-x`/`-xx` hex strings, `-X verbose` (`0x241 /* O_WRONLY|... */`),
`-k` stack lines and the `-C` summary table. `<unfinished ...>` /
`<... NAME resumed>` pairs are joined per pid (and for execve across the
thread that exec'd and the leader that resumes it). Signals (`--- SIG... ---`),
exit lines (`+++ exited with N +++`, `+++ killed by SIG +++`) and `strace:`
messages are understood. String escapes (`\\n`, `\\"`, `\\xNN`, octal `\\NNN`)
are decoded to the exact bytes, kept as str with surrogateescape (like every
byte string in audit records: `os.fsencode(path)` gives the bytes back).

What a run holds:
  syscall_counts  {name: count}: every call strace printed (counted at its start;
                  a resume whose start is not in the log counts at the resume);
                  `syscall_0x1c3` names are mapped to the x86_64 name.
  records         audit-record dicts (keys of audit_schema.events.FIELDS; `extra`
                  is a JSON string) for: exec (execve/execveat: path, argv, ret),
                  connect (connect, and sendto/sendmsg with a destination: family
                  ipv4/ipv6/unix/other, addr, port, ret; extra.protocol tcp/udp
                  when the socket's type is known), open_write (open/openat/
                  openat2/creat with O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND),
                  unlink (unlink/unlinkat/rmdir), rename (rename/renameat/
                  renameat2: path -> path2), mkdir (mkdir/mkdirat: not an audit
                  kind -- the eBPF audit does not see it -- but it needs a
                  writable parent), exit. `ret` is the result (negative errno on
                  failure), None when strace did not show one.
  stats           lines, syscalls, bad (count) and bad_samples [(line, reason,
                  text)], unfinished (never resumed), orphan resumes, signals,
                  info lines, summary_counts (the -C table, when present), notes.

Paths: relative paths are resolved with what the log shows -- the dirfd's
`-y` annotation, `AT_FDCWD</cwd>`, the returned fd's annotation, the cwd
followed through chdir/fchdir/getcwd and inherited by children at clone --
and the `cwd=` argument for the start. Unresolvable ones stay relative with
extra.path_unresolved (policies.learn reports them, never guesses).

Never raises on content: a line that cannot be parsed is counted (with a
sample) and skipped. Reading a file that does not exist or is not regular
raises StraceError (a PoliciesError, exit 2).
"""
from __future__ import annotations

import errno as _errno
import json
import os
import re
import stat
from collections import Counter

from policies.errors import PoliciesError, USAGE as EXIT_USAGE
from audit_schema.events import from_bytes
from policies import syscalls as sc

MAX_BAD_SAMPLES = 20
MAX_LINE = 1 << 20           # longer lines are cut (and counted as bad)

_O = {"O_RDONLY": 0, "O_WRONLY": 0o1, "O_RDWR": 0o2, "O_CREAT": 0o100, "O_EXCL": 0o200, "O_NOCTTY": 0o400,
      "O_TRUNC": 0o1000, "O_APPEND": 0o2000, "O_NONBLOCK": 0o4000, "O_NDELAY": 0o4000, "O_DSYNC": 0o10000,
      "O_ASYNC": 0o20000, "O_DIRECT": 0o40000, "O_LARGEFILE": 0o100000, "O_DIRECTORY": 0o200000,
      "O_NOFOLLOW": 0o400000, "O_NOATIME": 0o1000000, "O_CLOEXEC": 0o2000000, "O_SYNC": 0o4010000,
      "O_PATH": 0o10000000, "O_TMPFILE": 0o20200000}
WRITE_FLAGS = _O["O_WRONLY"] | _O["O_RDWR"] | _O["O_CREAT"] | _O["O_TRUNC"] | _O["O_APPEND"]

EXEC_CALLS = {"execve": 0, "execveat": 1}                    # name -> index of the path argument
OPEN_CALLS = {"open": (None, 0, 1), "openat": (0, 1, 2), "openat2": (0, 1, 2), "creat": (None, 0, None)}
UNLINK_CALLS = {"unlink": (None, 0), "unlinkat": (0, 1), "rmdir": (None, 0)}
RENAME_CALLS = {"rename": (None, 0, None, 1), "renameat": (0, 1, 2, 3), "renameat2": (0, 1, 2, 3)}
MKDIR_CALLS = {"mkdir": (None, 0), "mkdirat": (0, 1)}
FORK_CALLS = ("clone", "clone3", "fork", "vfork")


class StraceError(PoliciesError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


# ---------------------------------------------------------------- strings

_SIMPLE_ESC = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, "a": 7, "b": 8, "e": 27, "\\": 92, '"': 34,
               "'": 39, "?": 63}


def unescape(s: str) -> bytes:
    """The bytes of a strace string body (C escapes: \\n \\" \\\\ \\xNN \\NNN octal)."""
    out = bytearray()
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c != "\\" or i + 1 >= n:
            out += c.encode("utf-8", "surrogateescape")
            i += 1
            continue
        d = s[i + 1]
        if d in "xX" and i + 2 < n and s[i + 2] in "0123456789abcdefABCDEF":
            j = i + 2
            while j < n and j < i + 4 and s[j] in "0123456789abcdefABCDEF":
                j += 1
            out.append(int(s[i + 2:j], 16))
            i = j
        elif d in "01234567":
            j = i + 1
            while j < n and j < i + 4 and s[j] in "01234567":
                j += 1
            out.append(int(s[i + 1:j], 8) & 0xFF)
            i = j
        elif d in _SIMPLE_ESC:
            out.append(_SIMPLE_ESC[d])
            i += 2
        else:                               # unknown escape: keep it as written
            out += ("\\" + d).encode("utf-8", "surrogateescape")
            i += 2
    return bytes(out)


def parse_string(arg: str) -> tuple[bytes, bool] | None:
    """`"abc"` / `"abc"...` -> (bytes, truncated); None when the argument is not a string."""
    a = arg.strip()
    if not a.startswith('"'):
        return None
    i, n = 1, len(a)
    while i < n:
        if a[i] == "\\":
            i += 2
            continue
        if a[i] == '"':
            break
        i += 1
    if i >= n:
        return unescape(a[1:]), True        # cut off
    rest = a[i + 1:].strip()
    return unescape(a[1:i]), rest.startswith("...")


def _annotation_end(s: str, i: int) -> int:
    """Index of the '>' closing the annotation that starts at s[i] == '<' (-1 if none).
    Paths in annotations escape '>' (as \\76); socket annotations (-yy) contain '->'
    inside, so the closing '>' is the one followed by a separator or the end."""
    j = i + 1
    n = len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == ">" and (j + 1 >= n or s[j + 1] in " ,)]}\t"):
            return j
        j += 1
    return -1


def split_args(s: str) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of `s` (the text after NAME( ), up to the
    closing parenthesis. Returns (args, index of the ')' or -1 when there is none)."""
    args: list[str] = []
    depth = 0
    start = 0
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            i += 1
            while i < n and s[i] != '"':
                i += 2 if s[i] == "\\" else 1
            i += 1
            continue
        if c == "/" and s.startswith("/*", i):
            j = s.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if c == "<" and i > 0 and (s[i - 1].isalnum() or s[i - 1] in "_]"):
            j = _annotation_end(s, i)
            if j > 0:
                i = j + 1
                continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c == ")":
                    tail = s[start:i].strip()
                    if tail or args:
                        args.append(tail)
                    return args, i
            else:
                depth -= 1
        elif c == "," and depth == 0:
            args.append(s[start:i].strip())
            start = i + 1
        i += 1
    tail = s[start:].strip()
    if tail or args:
        args.append(tail)
    return args, -1


def split_annotation(arg: str) -> tuple[str, str | None]:
    """`3</path>` -> ("3", "/path" decoded as str); `3` -> ("3", None)."""
    a = arg.strip()
    i = a.find("<")
    if i > 0 and a.endswith(">"):
        return a[:i], from_bytes(unescape(a[i + 1:-1]))
    return a, None


def _int(tok: str) -> int | None:
    tok = tok.strip()
    try:
        return int(tok, 0)
    except ValueError:
        m = re.match(r"^-?\d+", tok)
        return int(m.group()) if m else None


# ---------------------------------------------------------------- lines

_PID = re.compile(r"^(?:\[pid\s+(\d+)\]|(\d+))\s+")
_TS = re.compile(r"^(?:\d{1,2}:\d{2}:\d{2}(?:\.\d+)?|\d+\.\d+)\s+")
_DUR = re.compile(r"\s+<\d+\.\d+>\s*$")
_CALL = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*|\?\?\?\?)\((.*)$", re.S)
_RESUMED = re.compile(r"^<\.\.\.\s+([A-Za-z_][A-Za-z0-9_]*|\?\?\?\?)\s+resumed>\s?(.*)$", re.S)
_EXIT = re.compile(r"^\+\+\+\s+(?:exited with (-?\d+)|killed by (SIG[A-Z0-9+-]+)(?: \(core dumped\))?"
                   r"|superseded by execve in pid (\d+))\s+\+\+\+$")
_SIGNAL = re.compile(r"^---\s+(SIG[A-Z0-9+-]+|stopped by SIG[A-Z0-9]+)\b.*---$")
_PERSONALITY = re.compile(r"^\[\s*Process PID=(\d+) runs in (\d+) bit mode\.?\s*\]$")
_RET = re.compile(r"^=\s*(-?\d+|0x[0-9a-fA-F]+|\?)")
_ERRNAME = re.compile(r"^\s*(E[A-Z0-9]+)\b")
_SUMMARY = re.compile(r"^\s*(\d+\.\d+)\s+(\d+\.\d+)\s+(?:(\d+)\s+)?(\d+)\s+(?:(\d+)\s+)?([A-Za-z_][A-Za-z0-9_]*)$")
_SIGNUMS = {f"SIG{n}": int(v) for n, v in
            (("HUP", 1), ("INT", 2), ("QUIT", 3), ("ILL", 4), ("TRAP", 5), ("ABRT", 6), ("BUS", 7), ("FPE", 8),
             ("KILL", 9), ("USR1", 10), ("SEGV", 11), ("USR2", 12), ("PIPE", 13), ("ALRM", 14), ("TERM", 15),
             ("STKFLT", 16), ("CHLD", 17), ("CONT", 18), ("STOP", 19), ("TSTP", 20), ("TTIN", 21), ("TTOU", 22),
             ("URG", 23), ("XCPU", 24), ("XFSZ", 25), ("VTALRM", 26), ("PROF", 27), ("WINCH", 28), ("IO", 29),
             ("PWR", 30), ("SYS", 31))}


def _errno_number(name: str) -> int:
    v = getattr(_errno, name, None)
    if isinstance(v, int):
        return v
    return {"ERESTARTSYS": 512, "ERESTARTNOINTR": 513, "ERESTARTNOHAND": 514, "ENOIOCTLCMD": 515,
            "ERESTART_RESTARTBLOCK": 516}.get(name, 0)


def _clean_join(base: str, rel: str) -> str:
    """base/rel with '.' and empty components dropped ('..' is kept: symlinks)."""
    parts = [p for p in (base.rstrip("/") + "/" + rel).split("/") if p not in ("", ".")]
    return "/" + "/".join(parts)


def _flags_value(arg: str) -> int | None:
    """O_WRONLY|O_CREAT -> int; 0x241 /* ... */ -> 0x241; flags=... inside openat2's struct."""
    a = arg.strip()
    m = re.search(r"flags=([^,}]+)", a) if a.startswith("{") else None
    if m:
        a = m.group(1).strip()
    m = re.match(r"^(0x[0-9a-fA-F]+|0[0-7]*|[1-9]\d*)\s*(?:/\*.*\*/)?$", a)
    if m:
        tok = m.group(1)
        return int(tok, 16) if tok.startswith("0x") else int(tok, 8) if tok.startswith("0") else int(tok)
    value = 0
    known = False
    for part in re.split(r"\s*\|\s*", a):
        if part in _O:
            value |= _O[part]
            known = True
        else:
            v = _int(part)
            if v is not None:
                value |= v
                known = True
    return value if known else None


def parse_sockaddr(arg: str) -> tuple[str, str, int] | None:
    """strace's sockaddr text -> (family, addr, port); None when there is none."""
    m = re.search(r"sa_family=(?:0x[0-9a-fA-F]+\s*/\*\s*|\d+\s*/\*\s*)?(AF_[A-Z0-9_]+)", arg)
    if not m:
        return None
    af = m.group(1)
    if af == "AF_INET":                 # -X verbose: sin_port="\x00\x50" /* htons(80) */ ...
        a = re.search(r'inet_addr\("([^"]*)"\)', arg)
        p = re.search(r"sin_port=[^,}]*?htons\((\d+)\)", arg)
        return "ipv4", from_bytes(unescape(a.group(1))) if a else "", int(p.group(1)) if p else 0
    if af == "AF_INET6":
        a = re.search(r'inet_pton\(AF_INET6,\s*"([^"]*)"', arg)
        p = re.search(r"sin6_port=[^,}]*?htons\((\d+)\)", arg)
        return "ipv6", from_bytes(unescape(a.group(1))) if a else "", int(p.group(1)) if p else 0
    if af in ("AF_UNIX", "AF_LOCAL"):
        u = re.search(r'sun_path=(@?)"((?:[^"\\]|\\.)*)"', arg)
        if not u:
            return "unix", "", 0
        return "unix", ("@" if u.group(1) else "") + from_bytes(unescape(u.group(2))), 0
    return "other", af, 0


def _sock_proto(domain: str, typ: str, proto: str) -> str | None:
    if "AF_INET" not in domain and "PF_INET" not in domain:
        return None
    default = "IPPROTO_IP" in proto or _int(proto.split("/*")[0]) == 0
    if "IPPROTO_TCP" in proto or ("SOCK_STREAM" in typ and default):
        return "tcp"
    if "IPPROTO_UDP" in proto or ("SOCK_DGRAM" in typ and default):
        return "udp"
    return None


def _annotation_proto(ann: str | None) -> str | None:
    if not ann:
        return None
    m = re.match(r"^(TCP|UDP)(?:v6)?:", ann)
    return m.group(1).lower() if m else None


# ---------------------------------------------------------------- the parser

class StraceParser:
    """Feed lines, then finish() -> run dict. Keeps per-pid state: pending
    unfinished calls, cwd, socket protocols."""

    def __init__(self, source: str = "<strace>", *, run_id: str | None = None, cwd: str | None = None):
        self.source = source
        self.run_id = run_id or source
        self.counts: Counter = Counter()
        self.other_abi: Counter = Counter()
        self.records: list[dict] = []
        self.pending: dict[int, tuple[str, str, int]] = {}   # pid -> (name, args so far, line)
        self.cwd: dict[int, str] = {}
        self.start_cwd = cwd
        self.socks: dict[tuple[int, int], str] = {}           # (pid, fd) -> tcp|udp
        self.abi32: set[int] = set()
        self.lines = 0
        self.bad = 0
        self.bad_samples: list[tuple[int, str, str]] = []
        self.orphans = 0
        self.signals: Counter = Counter()
        self.info: list[str] = []
        self.summary: dict[str, int] = {}
        self.in_summary = False
        self.default_pid = 0
        self.notes: list[str] = []
        self.unknown_names: Counter = Counter()
        self.known: set[int] = set()        # pids seen with a prefix or created by a fork
        self.unprefixed = False             # lines without a pid (strace -f to stderr, first process)
        self.alias0: int | None = None      # the pid those lines turned out to be

    def _alias(self, pid: int):
        """strace -f to stderr prints the first process without a prefix until a
        second one exists, then as [pid N]: N is the same process."""
        self.alias0 = pid
        d = self.default_pid
        for table in (self.cwd, self.pending):
            if d in table:
                table[pid] = table.pop(d)
        for (p, fd), proto in list(self.socks.items()):
            if p == d:
                self.socks[(pid, fd)] = self.socks.pop((p, fd))
        if d in self.abi32:
            self.abi32.add(pid)

    def _attached(self, child: int):
        self.known.add(child)
        forks = [p for p, (name, _, _) in self.pending.items() if name in FORK_CALLS]
        if len(forks) == 1 and child not in self.cwd:
            cwd = self._cwd_of(forks[0])
            if cwd is not None:
                self.cwd[child] = cwd

    # -- helpers ------------------------------------------------------------
    def _bad(self, lineno: int, reason: str, text: str):
        self.bad += 1
        if len(self.bad_samples) < MAX_BAD_SAMPLES:
            shown = text if len(text) <= 160 else text[:157] + "..."
            self.bad_samples.append((lineno, reason, shown))

    def _cwd_of(self, pid: int) -> str | None:
        return self.cwd.get(pid, self.start_cwd)

    def _resolve(self, pid: int, raw: str, dirfd_arg: str | None) -> tuple[str, bool]:
        """(path, resolved?) for a path argument."""
        if raw.startswith("/"):
            return _clean_join("/", raw), True
        base = None
        if dirfd_arg is not None:
            fd, ann = split_annotation(dirfd_arg)
            if "AT_FDCWD" in fd or _int(fd.split("/*")[0]) in (-100, 0xFFFFFF9C):
                if ann and ann.startswith("/"):
                    self.cwd[pid] = ann
                    base = ann
                else:
                    base = self._cwd_of(pid)
            elif ann and ann.startswith("/"):
                base = ann
        else:
            base = self._cwd_of(pid)
        if base is None:
            return raw, False
        return _clean_join(base, raw) if raw else base, True

    def _record(self, rec: dict, extra: dict):
        rec["extra"] = json.dumps(extra, sort_keys=True, ensure_ascii=True)
        self.records.append(rec)

    # -- lines ----------------------------------------------------------------
    def feed(self, line, lineno: int | None = None):
        self.lines += 1
        lineno = lineno or self.lines
        if isinstance(line, bytes):
            line = line.decode("utf-8", "surrogateescape")
        if len(line) > MAX_LINE:
            self._bad(lineno, f"line longer than {MAX_LINE} characters (cut)", line[:200])
            line = line[:MAX_LINE]
        line = line.rstrip("\r\n")
        try:
            self._line(line, lineno)
        except Exception as e:     # never crash on content
            self._bad(lineno, f"unparsable ({type(e).__name__}: {e})", line)

    def _line(self, line: str, lineno: int):
        text = line.strip()
        if not text:
            return
        if text == "<unfinished ...>":   # the rest of a call cut by "strace: Process N attached"
            return
        cut = text.find("strace: Process ")
        if cut > 0:                     # stderr mode: "vfork(strace: Process 12 attached"
            self._line(text[:cut] + " <unfinished ...>", lineno)
            self._line(text[cut:], lineno)
            return
        if text.startswith("strace: "):
            if len(self.info) < 50:
                self.info.append(text)
            m = re.match(r"^strace: Process (\d+) attached", text)
            if m:
                self._attached(int(m.group(1)))
            return
        if text.startswith("% time") or (self.in_summary and (text.startswith("------") or _SUMMARY.match(text))):
            self.in_summary = True
            m = _SUMMARY.match(text)
            if m and m.group(6) != "total":
                self.summary[m.group(6)] = self.summary.get(m.group(6), 0) + int(m.group(4))
            return
        self.in_summary = False
        if text.startswith(">") or text.startswith("> "):       # -k stack frame
            return
        pid = self.default_pid if self.alias0 is None else self.alias0
        m = _PID.match(text)
        if m:
            pid = int(m.group(1) or m.group(2))
            text = text[m.end():]
            if pid not in self.known and self.unprefixed and self.alias0 is None:
                self._alias(pid)
            self.known.add(pid)
        elif not text.startswith("[ Process"):
            self.unprefixed = True
        m = _TS.match(text)
        if m:
            text = text[m.end():]
        m = _PERSONALITY.match(text)
        if m:
            p, bits = int(m.group(1)), m.group(2)
            if bits == "64":
                self.abi32.discard(p)
            else:
                self.abi32.add(p)
                self.notes.append(f"process {p} switched to {bits}-bit mode: its calls are not x86_64 calls "
                                  "(counted separately, not learned)")
            return
        if text.startswith("+++"):
            m = _EXIT.match(text)
            if not m:
                self._bad(lineno, "unrecognised exit line", line)
                return
            if m.group(3):
                return                      # superseded by execve: the leader carries on
            rec = {"kind": "exit", "pid": pid}
            if m.group(1) is not None:
                rec.update(exit_code=int(m.group(1)), signal=0)
            else:
                rec.update(exit_code=-1, signal=_SIGNUMS.get(m.group(2), 0))
            self._record(rec, {"line": lineno})
            self.pending.pop(pid, None)
            return
        if text.startswith("---"):
            m = _SIGNAL.match(text)
            if not m:
                self._bad(lineno, "unrecognised signal line", line)
                return
            self.signals[m.group(1)] += 1
            return
        text = _DUR.sub("", text)
        m = _RESUMED.match(text)
        if m:
            name, rest = m.group(1), m.group(2)
            pend = self.pending.pop(pid, None)
            if pend is None or pend[0] != name:
                if pend is not None:
                    self.pending[pid] = pend
                    pend = None
                if name in EXEC_CALLS:         # a thread exec'd; the leader resumes it
                    for other, (oname, _, _) in list(self.pending.items()):
                        if oname == name:
                            pend = self.pending.pop(other)
                            break
            if pend is None:
                self.orphans += 1
                self._count(pid, name)
                self._bad(lineno, f"'{name}' resumed without its start (the log begins mid-call?)", line)
                return
            self._call(pid, name, pend[1] + rest, lineno, line)
            return
        m = _CALL.match(text)
        if not m:
            self._bad(lineno, "not a strace line", line)
            return
        name, rest = m.group(1), m.group(2)
        name = self._name(name)
        self._count(pid, name)
        for marker in ("<unfinished ...>", "<detached ...>"):
            if rest.endswith(marker):
                if pid in self.pending:
                    self.notes.append(f"pid {pid}: '{self.pending[pid][0]}' unfinished at line "
                                      f"{self.pending[pid][2]} was never resumed")
                self.pending[pid] = (name, rest[: -len(marker)], lineno)
                return
        self._call(pid, name, rest, lineno, line)

    def _name(self, name: str) -> str:
        m = re.match(r"^syscall_(0x[0-9a-fA-F]+|\d+)$", name)
        if m:
            nr = int(m.group(1), 0)
            return sc.name_of(nr) or name
        return name

    def _count(self, pid: int, name: str):
        if pid in self.abi32:
            self.other_abi[name] += 1
        else:
            self.counts[name] += 1

    # -- one complete call ------------------------------------------------------
    def _call(self, pid: int, name: str, body: str, lineno: int, line: str):
        args, close = split_args(body)
        if close < 0:
            self._bad(lineno, "incomplete call (no closing parenthesis)", line)
            return
        result = body[close + 1:].strip()
        ret, ret_ann, err = None, None, None
        m = _RET.match(result)
        if m:
            tok = m.group(1)
            if tok != "?":
                ret = int(tok, 0)
            after = result[m.end():]
            if after.startswith("<"):
                j = _annotation_end(after, 0)
                if j > 0:
                    ret_ann = from_bytes(unescape(after[1:j]))
                    after = after[j + 1:]
            e = _ERRNAME.match(after)
            if e:
                err = e.group(1)
                if ret is not None and ret < 0:
                    ret = -_errno_number(err) if _errno_number(err) else ret
                elif ret is None:
                    ret = -_errno_number(err) if _errno_number(err) else None
        elif result:
            self._bad(lineno, "no '= result' after the call", line)
        if pid in self.abi32:
            return
        handler = _HANDLERS.get(name)
        if handler is not None:
            handler(self, pid, name, args, ret, ret_ann, err, lineno)

    # -- handlers -----------------------------------------------------------------
    def _h_exec(self, pid, name, args, ret, ret_ann, err, lineno):
        i = EXEC_CALLS[name]
        if len(args) <= i:
            return
        s = parse_string(args[i])
        extra = {"syscall": name, "line": lineno}
        if s is None:
            raw, trunc = "", False
            extra["path_unreadable"] = args[i][:100]
        else:
            raw, trunc = from_bytes(s[0]), s[1]
        path, ok = self._resolve(pid, raw, args[0] if name == "execveat" else None) if raw else (raw, False)
        if not ok:
            extra["path_unresolved"] = ["path"]
        argv, argv_trunc = [], False
        if len(args) > i + 1:
            argv, argv_trunc = _parse_argv(args[i + 1])
        if trunc:
            extra["path_truncated"] = True
        if err:
            extra["errno"] = err
        self._record({"kind": "exec", "pid": pid, "path": path, "path_raw": raw, "argv": argv,
                      "argv_truncated": 1 if argv_trunc else 0, "ret": ret}, extra)

    def _path_arg(self, pid, args, dirfd_i, path_i, extra, key="path"):
        if path_i is None or len(args) <= path_i:
            return None, None
        s = parse_string(args[path_i])
        if s is None:
            extra[f"{key}_unreadable"] = args[path_i][:100]
            return None, None
        raw = from_bytes(s[0])
        path, ok = self._resolve(pid, raw, args[dirfd_i] if dirfd_i is not None and len(args) > dirfd_i else None)
        if not ok:
            extra.setdefault("path_unresolved", []).append(key)
        if s[1]:
            extra[f"{key}_truncated"] = True
        return path, raw

    def _h_open(self, pid, name, args, ret, ret_ann, err, lineno):
        dirfd_i, path_i, flags_i = OPEN_CALLS[name]
        if name == "creat":
            flags = _O["O_CREAT"] | _O["O_WRONLY"] | _O["O_TRUNC"]
        else:
            flags = _flags_value(args[flags_i]) if flags_i is not None and len(args) > flags_i else None
            if flags is None or not flags & WRITE_FLAGS:
                return
        extra = {"syscall": name, "line": lineno}
        path, raw = self._path_arg(pid, args, dirfd_i, path_i, extra)
        if path is None:
            return
        if ret_ann and ret_ann.startswith("/") and ret is not None and ret >= 0 and ret_ann != path:
            path = ret_ann                 # -y: the opened file's own path (.. and symlinks resolved)
            extra["path_unresolved"] = [k for k in extra.get("path_unresolved", []) if k != "path"]
            if not extra["path_unresolved"]:
                del extra["path_unresolved"]
            extra["resolved_from"] = "fd"
        if err:
            extra["errno"] = err
        self._record({"kind": "open_write", "pid": pid, "path": path, "path_raw": raw, "flags": flags,
                      "ret": ret}, extra)

    def _h_unlink(self, pid, name, args, ret, ret_ann, err, lineno):
        dirfd_i, path_i = UNLINK_CALLS[name]
        extra = {"syscall": name, "line": lineno}
        path, raw = self._path_arg(pid, args, dirfd_i, path_i, extra)
        if path is None:
            return
        flags = 0
        if name == "unlinkat" and len(args) > 2 and "AT_REMOVEDIR" in args[2]:
            flags = 0x200
        if name == "rmdir":
            flags = 0x200
        if err:
            extra["errno"] = err
        self._record({"kind": "unlink", "pid": pid, "path": path, "path_raw": raw, "flags": flags,
                      "ret": ret}, extra)

    def _h_rename(self, pid, name, args, ret, ret_ann, err, lineno):
        d1, p1, d2, p2 = RENAME_CALLS[name]
        extra = {"syscall": name, "line": lineno}
        path, raw = self._path_arg(pid, args, d1, p1, extra)
        path2, raw2 = self._path_arg(pid, args, d2, p2, extra, key="path2")
        if path is None and path2 is None:
            return
        if raw2 is not None:
            extra["path2_raw"] = raw2
        if err:
            extra["errno"] = err
        self._record({"kind": "rename", "pid": pid, "path": path or "", "path_raw": raw or "",
                      "path2": path2 or "", "ret": ret}, extra)

    def _h_mkdir(self, pid, name, args, ret, ret_ann, err, lineno):
        dirfd_i, path_i = MKDIR_CALLS[name]
        extra = {"syscall": name, "line": lineno}
        path, raw = self._path_arg(pid, args, dirfd_i, path_i, extra)
        if path is None:
            return
        if err:
            extra["errno"] = err
        self._record({"kind": "mkdir", "pid": pid, "path": path, "path_raw": raw, "ret": ret}, extra)

    def _fd(self, arg: str) -> tuple[int | None, str | None]:
        fd, ann = split_annotation(arg)
        return _int(fd), ann

    def _h_socket(self, pid, name, args, ret, ret_ann, err, lineno):
        if ret is None or ret < 0 or len(args) < 3:
            return
        proto = _sock_proto(args[0], args[1], args[2]) or _annotation_proto(ret_ann)
        if proto:
            self.socks[(pid, ret)] = proto
        else:
            self.socks.pop((pid, ret), None)

    def _h_close(self, pid, name, args, ret, ret_ann, err, lineno):
        if args:
            fd, _ = self._fd(args[0])
            if fd is not None:
                self.socks.pop((pid, fd), None)

    def _proto(self, pid: int, fd: int | None, ann: str | None) -> str | None:
        p = _annotation_proto(ann)
        if p:
            return p
        if fd is None:
            return None
        if (pid, fd) in self.socks:
            return self.socks[(pid, fd)]
        # threads share fds: the latest socket() of that number in any pid
        for (p2, f2), proto in reversed(list(self.socks.items())):
            if f2 == fd:
                return proto
        return None

    def _h_connect(self, pid, name, args, ret, ret_ann, err, lineno):
        if not args:
            return
        if name == "connect":
            sa_arg = args[1] if len(args) > 1 else ""
        elif name == "sendto":
            sa_arg = args[4] if len(args) > 4 else ""
        else:                                   # sendmsg: msg_name={...}
            sa_arg = args[1] if len(args) > 1 else ""
            if "msg_name=" not in sa_arg:
                return
        sa = parse_sockaddr(sa_arg)
        if sa is None:
            return
        family, addr, port = sa
        if name != "connect" and family not in ("ipv4", "ipv6"):
            return
        fd, ann = self._fd(args[0])
        extra = {"syscall": name, "line": lineno}
        if fd is not None:
            extra["fd"] = fd
        proto = self._proto(pid, fd, ann)
        if proto:
            extra["protocol"] = proto
        if family == "other":
            extra["af"] = addr
            addr = ""
        if err:
            extra["errno"] = err
        rret = ret
        if name != "connect" and ret is not None and ret >= 0:
            rret = 0                            # bytes sent: the destination was reached
        self._record({"kind": "connect", "pid": pid, "family": family, "addr": addr, "port": port,
                      "ret": rret}, extra)

    def _h_chdir(self, pid, name, args, ret, ret_ann, err, lineno):
        if ret != 0 or not args:
            return
        if name == "chdir":
            s = parse_string(args[0])
            if s is None:
                return
            raw = from_bytes(s[0])
            path, ok = self._resolve(pid, raw, None)
            self.cwd[pid] = path if ok else None
        else:                                       # fchdir(3</dir>)
            _, ann = split_annotation(args[0])
            if ann and ann.startswith("/"):
                self.cwd[pid] = ann
            else:
                self.cwd[pid] = None

    def _h_getcwd(self, pid, name, args, ret, ret_ann, err, lineno):
        if ret is None or ret <= 0 or not args:
            return
        s = parse_string(args[0])
        if s is not None and s[0].startswith(b"/") and not s[1]:
            self.cwd[pid] = from_bytes(s[0])

    def _h_fork(self, pid, name, args, ret, ret_ann, err, lineno):
        if ret is None or ret <= 0:
            return
        self.known.add(ret)
        cwd = self._cwd_of(pid)
        if cwd is not None:
            self.cwd[ret] = cwd
        for (p, fd), proto in list(self.socks.items()):
            if p == pid:
                self.socks[(ret, fd)] = proto

    # -- the end ----------------------------------------------------------------------
    def finish(self) -> dict:
        for pid, (name, _, lineno) in sorted(self.pending.items()):
            if name in EXEC_CALLS:
                self.notes.append(f"pid {pid}: {name} at line {lineno} never returned (result unknown)")
        unknown = sorted(n for n in self.counts if not sc.is_syscall(n))
        stats = {
            "lines": self.lines,
            "syscalls": sum(self.counts.values()),
            "records": len(self.records),
            "bad": self.bad,
            "bad_samples": [list(s) for s in self.bad_samples],
            "unfinished": len(self.pending),
            "orphan_resumes": self.orphans,
            "signals": dict(self.signals),
            "info": self.info[:20],
            "other_abi_counts": dict(self.other_abi),
            "unknown_names": unknown,
            "notes": self.notes[:50],
        }
        if self.summary:
            stats["summary_counts"] = dict(self.summary)
        return {"run_id": self.run_id, "source": f"strace:{self.source}", "records": self.records,
                "syscall_counts": dict(self.counts), "stats": stats}


def _parse_argv(arg: str) -> tuple[list[str], bool]:
    a = arg.strip()
    if not a.startswith("["):
        return [], True                          # an address: unreadable
    inner, _ = split_args(a[1:].rstrip("]") + ")")
    out, trunc = [], False
    for item in inner:
        if item in ("...", ""):
            trunc = trunc or item == "..."
            continue
        s = parse_string(item)
        if s is None:
            if item.startswith("/*"):
                continue
            trunc = True
            continue
        out.append(from_bytes(s[0]))
        trunc = trunc or s[1]
    if a.rstrip().endswith("...]"):
        trunc = True
    return out, trunc


_HANDLERS = {}
for _n in EXEC_CALLS:
    _HANDLERS[_n] = StraceParser._h_exec
for _n in OPEN_CALLS:
    _HANDLERS[_n] = StraceParser._h_open
for _n in UNLINK_CALLS:
    _HANDLERS[_n] = StraceParser._h_unlink
for _n in RENAME_CALLS:
    _HANDLERS[_n] = StraceParser._h_rename
for _n in MKDIR_CALLS:
    _HANDLERS[_n] = StraceParser._h_mkdir
for _n in FORK_CALLS:
    _HANDLERS[_n] = StraceParser._h_fork
_HANDLERS.update(socket=StraceParser._h_socket, close=StraceParser._h_close, connect=StraceParser._h_connect,
                 sendto=StraceParser._h_connect, sendmsg=StraceParser._h_connect, chdir=StraceParser._h_chdir,
                 fchdir=StraceParser._h_chdir, getcwd=StraceParser._h_getcwd)


# ---------------------------------------------------------------- entry points

def parse_strace(lines, *, source: str = "<strace>", run_id: str | None = None, cwd: str | None = None,
                 pid: int = 0) -> dict:
    """A run from strace output lines (str or bytes; a whole text is split)."""
    if isinstance(lines, (str, bytes)):
        lines = lines.splitlines()
    p = StraceParser(source, run_id=run_id, cwd=cwd)
    p.default_pid = pid
    for i, line in enumerate(lines, 1):
        p.feed(line, i)
    return p.finish()


def _display(path: str) -> str:
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _open_log(path: str):
    try:
        f = open(path, "rb")
    except IsADirectoryError:
        raise StraceError(f"{_display(path)}: is a directory, not a strace log") from None
    except OSError as e:
        raise StraceError(f"{_display(path)}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(f.fileno())
    except OSError as e:
        f.close()
        raise StraceError(f"{_display(path)}: cannot read: {e.strerror}") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        f.close()
        raise StraceError(f"{_display(path)}: not a regular file")
    return f


def _feed_file(p: StraceParser, path: str):
    with _open_log(path) as f:
        try:
            for i, line in enumerate(f, 1):
                p.feed(line, i)
        except OSError as e:
            raise StraceError(f"{_display(path)}: cannot read: {e.strerror}") from None


def parse_strace_file(path: str, *, run_id: str | None = None, cwd: str | None = None) -> dict:
    """A run from one strace log file (run_id defaults to the file's name)."""
    p = StraceParser(_display(path), run_id=run_id or _display(os.path.basename(path) or path), cwd=cwd)
    _feed_file(p, path)
    return p.finish()


_FF = re.compile(r"^(.*)\.(\d+)$")


def parse_strace_files(paths: list[str], *, cwd: str | None = None) -> list[dict]:
    """One run per log file; files written by `strace -ff -o PREFIX` (PREFIX.PID, two
    or more with the same PREFIX) form one run together, pids from the suffixes."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for path in paths:
        m = _FF.match(path)
        if m:
            groups.setdefault(m.group(1), []).append((int(m.group(2)), path))
    runs: list[dict] = []
    done: set[str] = set()
    for path in paths:
        if path in done:
            continue
        m = _FF.match(path)
        if m and len(groups.get(m.group(1), [])) > 1:
            prefix = m.group(1)
            members = sorted(groups[prefix])
            p = StraceParser(_display(prefix) + ".*", run_id=_display(os.path.basename(prefix) or prefix), cwd=cwd)
            for pid, member in members:
                p.default_pid = pid
                p.in_summary = False
                _feed_file(p, member)
                done.add(member)
            runs.append(p.finish())
        else:
            runs.append(parse_strace_file(path, cwd=cwd))
            done.add(path)
    return runs


__all__ = ["parse_strace", "parse_strace_file", "parse_strace_files", "StraceParser", "StraceError",
           "parse_sockaddr", "split_args", "unescape", "parse_string", "WRITE_FLAGS"]
