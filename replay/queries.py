"""Cross-sandbox questions, answered from ClickHouse (what `dsec search` runs).

    sql = execs_sql(db, sha256="ab12...")                 # which sandboxes exec'd this binary
    sql = execs_sql(db, path="*/curl")                    # ... a path (exact, basename or glob)
    sql = connects_sql(db, "10.0.0.0/8", port=443)        # which connected (or tried) to a CIDR
    sql = writes_sql(db, "/etc")                          # which wrote, unlinked or renamed under a path
    sql = denials_sql(db, policy_hash, since_ns, until_ns)   # every denial / would-deny of a policy
    sql = images_sql(db, digest="sha256:...")             # which sandboxes ran an image (or name="app:1")
    rows = Search(store).run("execs", sha256="ab12...")   # dicts, with an AuditStore

Every builder takes `modern` (the server is a current release, not 18.16):
current releases throw on IPv4StringToNum('not an address') where 18.16
returned 0, so the OrDefault spellings are used there.

Why no FINAL: FINAL collapses re-sent copies by merging the whole selected
key range at read time; on 18.16 that reads every column of every row of the
kind range and is several times slower than the filter itself. These
questions never need a row to appear once: the per-sandbox ones GROUP BY
sandbox_id and count uniqExact(event_id), the denials listing keeps one row
per event_id (LIMIT 1 BY event_id). Same answers as FINAL, measured in
bench/replay.py.

The time window (since/until, ns) prunes the monthly partitions; `kind`
leads the sort key, so each question reads only its kinds' ranges.
"""
from __future__ import annotations

import fnmatch
import ipaddress
import re
import time
from datetime import datetime, timezone

from replay.errors import ReplayError, USAGE as EXIT_USAGE
from replay.store import sql_int, sql_string
from audit_schema.migrations import EVENTS_TABLE, parse_version, quote_ident

DENIED = ("denied", "would-deny")
EXEC_KINDS = ("exec", "exec_denied", "exec_violation")
CONNECT_KINDS = ("connect", "egress_denied", "egress_violation")
WRITE_KINDS = ("open_write", "unlink", "rename")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
HASH_PREFIX_RE = re.compile(r"^[0-9a-f]{8,64}$")
DEFAULT_LIMIT = 1000


def is_modern(version: str) -> bool:
    """OrDefault IP parsing (and throwing plain parsers) from 22.x on."""
    v = parse_version(version or "")
    return bool(v) and v >= (22, 1)


def _kinds(kinds) -> str:
    return "kind IN (" + ", ".join(sql_string(k) for k in kinds) + ")"


def _window(since_ns, until_ns) -> list[str]:
    out = []
    if since_ns is not None:
        out.append(f"ts_ns >= {sql_int(int(since_ns))}")
    if until_ns is not None:
        out.append(f"ts_ns < {sql_int(int(until_ns))}")
    return out


def _like_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def glob_to_like(pattern: str) -> str:
    """A shell glob (* ?) as a LIKE pattern; every other character literal."""
    out = []
    for c in pattern:
        if c == "*":
            out.append("%")
        elif c == "?":
            out.append("_")
        else:
            out.append(_like_escape(c))
    return "".join(out)


def path_condition(col: str, pattern: str) -> str:
    """exact absolute path | basename (no '/') | glob (* ?)."""
    if not pattern:
        raise ReplayError("empty path pattern", EXIT_USAGE)
    if any(c in pattern for c in "*?"):
        return f"{col} LIKE {sql_string(glob_to_like(pattern))}"
    if "/" not in pattern:
        return f"({col} = {sql_string(pattern)} OR endsWith({col}, {sql_string('/' + pattern)}))"
    return f"{col} = {sql_string(pattern)}"


def under_condition(col: str, root: str) -> str:
    """col is root or below it ('/etc' matches /etc and /etc/x, not /etcetera)."""
    if not root.startswith("/"):
        raise ReplayError(f"--under {root!r}: not an absolute path", EXIT_USAGE)
    root = root.rstrip("/") or "/"
    if root == "/":
        return f"startsWith({col}, '/')"
    return f"({col} = {sql_string(root)} OR startsWith({col}, {sql_string(root + '/')}))"


def parse_cidr(text: str):
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError as e:
        raise ReplayError(f"--cidr {text!r}: {e}", EXIT_USAGE)


def cidr_condition(net, modern: bool) -> str:
    """addr (text) inside the network; IPv4 networks also match IPv4-mapped IPv6 (::ffff:a.b.c.d)."""
    v4 = "IPv4StringToNumOrDefault" if modern else "IPv4StringToNum"
    v6 = "IPv6StringToNumOrDefault" if modern else "IPv6StringToNum"
    lo, hi = int(net.network_address), int(net.broadcast_address)
    if net.version == 4:
        return (f"((family = 'ipv4' AND {v4}(addr) BETWEEN {lo} AND {hi}) OR "
                f"(family = 'ipv6' AND startsWith(addr, '::ffff:') AND position(addr, '.') > 0 AND "
                f"{v4}(substring(addr, 8)) BETWEEN {lo} AND {hi}))")
    return (f"(family = 'ipv6' AND {v6}(addr) BETWEEN unhex('{lo:032x}') AND unhex('{hi:032x}'))")


def execs_sql(db: str, *, sha256: str | None = None, path: str | None = None, since_ns=None, until_ns=None,
              limit: int = DEFAULT_LIMIT) -> str:
    """Sandboxes that exec'd a binary (sha256 of the file) or a path; exec_denied /
    exec_violation attempts count for a path (they name the path, not the hash)."""
    db = quote_ident(db)
    if sha256:
        s = sha256.strip().lower()
        if not SHA256_RE.match(s):
            raise ReplayError(f"--sha256 {sha256!r}: expected 64 hex digits", EXIT_USAGE)
        pre, where = f"sha256 = {sql_string(s)}", ["kind = 'exec'"]
    elif path:
        pre, where = path_condition("path", path), [_kinds(EXEC_KINDS)]
    else:
        raise ReplayError("give --sha256 or --path", EXIT_USAGE)
    where += _window(since_ns, until_ns)
    return (f"SELECT sandbox_id, any(node) AS node, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns,\n"
            f"  uniqExact(event_id) AS events, arraySort(groupUniqArray(step)) AS steps,\n"
            f"  arraySlice(groupUniqArray(path), 1, 5) AS paths, arraySlice(groupUniqArray(sha256), 1, 5) AS sha256s,\n"
            f"  arraySort(groupUniqArray(decision)) AS decisions\n"
            f"FROM {db}.{EVENTS_TABLE}\nPREWHERE {pre}\nWHERE {' AND '.join(where)}\n"
            f"GROUP BY sandbox_id\nORDER BY first_ns, sandbox_id\nLIMIT {sql_int(limit)}")


def connects_sql(db: str, cidr: str, *, port: int | None = None, since_ns=None, until_ns=None,
                 limit: int = DEFAULT_LIMIT, modern: bool = False) -> str:
    """Sandboxes that connected (connect records, whatever the result) or tried to and
    were denied / reported (egress_* records, also UDP sendmsg) to an address in cidr."""
    db = quote_ident(db)
    net = parse_cidr(cidr)
    pre = cidr_condition(net, modern)
    where = [_kinds(CONNECT_KINDS)]
    if port is not None:
        if not 0 < int(port) < 65536:
            raise ReplayError(f"--port {port}: not a port (1-65535)", EXIT_USAGE)
        where.append(f"port = {sql_int(int(port))}")
    where += _window(since_ns, until_ns)
    return (f"SELECT sandbox_id, any(node) AS node, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns,\n"
            f"  uniqExact(event_id) AS events, arraySort(groupUniqArray(step)) AS steps,\n"
            f"  arraySlice(arraySort(groupUniqArray(concat(addr, ':', toString(port)))), 1, 5) AS destinations,\n"
            f"  countIf(kind = 'connect' AND (ret >= 0 OR ret = -115)) AS connected,\n"
            f"  countIf(kind = 'connect' AND ret < 0 AND ret != -115) AS failed,\n"
            f"  arraySort(groupUniqArray(decision)) AS decisions\n"
            f"FROM {db}.{EVENTS_TABLE}\nPREWHERE {pre}\nWHERE {' AND '.join(where)}\n"
            f"GROUP BY sandbox_id\nORDER BY first_ns, sandbox_id\nLIMIT {sql_int(limit)}")


def writes_sql(db: str, under: str, *, since_ns=None, until_ns=None, limit: int = DEFAULT_LIMIT) -> str:
    """Sandboxes that opened for writing, unlinked or renamed (from or to) a path under `under`
    (attempts that failed included: see `failed`)."""
    db = quote_ident(db)
    pre = f"({under_condition('path', under)} OR {under_condition('path2', under)})"
    where = [_kinds(WRITE_KINDS)] + _window(since_ns, until_ns)
    return (f"SELECT sandbox_id, any(node) AS node, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns,\n"
            f"  uniqExact(event_id) AS events, arraySort(groupUniqArray(step)) AS steps,\n"
            f"  arraySlice(arraySort(groupUniqArray(path)), 1, 5) AS paths,\n"
            f"  countIf(ret < 0) AS failed, arraySort(groupUniqArray(decision)) AS decisions\n"
            f"FROM {db}.{EVENTS_TABLE}\nPREWHERE {pre}\nWHERE {' AND '.join(where)}\n"
            f"GROUP BY sandbox_id\nORDER BY first_ns, sandbox_id\nLIMIT {sql_int(limit)}")


def images_sql(db: str, *, digest: str | None = None, name: str | None = None, since_ns=None, until_ns=None,
               limit: int = DEFAULT_LIMIT) -> str:
    """Sandboxes that ran an image: by manifest digest (the image_digest column every row
    carries), or by the name the sandbox_start record gives (NAME:TAG as it was run)."""
    db = quote_ident(db)
    if digest:
        d = digest.strip().lower()
        if not d.startswith("sha256:"):
            d = "sha256:" + d
        if not SHA256_RE.match(d[7:]):
            raise ReplayError(f"--image {digest!r}: a digest is sha256: and 64 hex digits", EXIT_USAGE)
        pre = f"image_digest = {sql_string(d)}"
    elif name:
        pre = f"position(extra, {sql_string(chr(34) + 'name' + chr(34) + ':' + chr(34) + name + chr(34))}) > 0"
    else:
        raise ReplayError("give --image NAME[:TAG] or a digest", EXIT_USAGE)
    where = ["kind = 'sandbox_start'"] + _window(since_ns, until_ns)
    return (f"SELECT sandbox_id, any(node) AS node, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns,\n"
            f"  uniqExact(event_id) AS events, arraySort(groupUniqArray(step)) AS steps,\n"
            f"  arraySlice(groupUniqArray(image_digest), 1, 5) AS images,\n"
            f"  arraySort(groupUniqArray(decision)) AS decisions\n"
            f"FROM {db}.{EVENTS_TABLE}\nPREWHERE {pre}\nWHERE {' AND '.join(where)}\n"
            f"GROUP BY sandbox_id\nORDER BY first_ns, sandbox_id\nLIMIT {sql_int(limit)}")


DENIAL_COLUMNS = ("event_id", "ts_ns", "node", "sandbox_id", "step", "kind", "pid", "comm", "policy_name",
                  "policy_hash", "mode", "decision", "path", "path2", "family", "addr", "port", "protocol",
                  "syscall", "count", "ret")


def denials_sql(db: str, policy_hash: str, since_ns=None, until_ns=None, *, limit: int = DEFAULT_LIMIT) -> str:
    """Every denied / would-deny record stamped with a policy hash (or a unique prefix of
    at least 8 hex digits) in [since, until), one row per event: the policy's denials
    first, time-ordered, then the records of forbidden actions that failed on their own
    (decision 'failed': ENOENT ... -- not policy denials)."""
    db = quote_ident(db)
    h = (policy_hash or "").strip().lower()
    if not HASH_PREFIX_RE.match(h):
        raise ReplayError(f"--policy-hash {policy_hash!r}: expected 8 to 64 hex digits", EXIT_USAGE)
    cond = f"policy_hash = {sql_string(h)}" if len(h) == 64 else f"startsWith(policy_hash, {sql_string(h)})"
    # both filters in PREWHERE: the other 19 columns are read only for the denials themselves
    pre = f"{cond} AND decision IN ('denied', 'would-deny', 'failed')"
    where = _window(since_ns, until_ns) or ["1"]
    return (f"SELECT {', '.join(DENIAL_COLUMNS)}\nFROM {db}.{EVENTS_TABLE}\nPREWHERE {pre}\nWHERE {' AND '.join(where)}\n"
            f"ORDER BY decision = 'failed', ts_ns, event_id\nLIMIT 1 BY event_id\nLIMIT {sql_int(limit)}")


def denial_totals_sql(db: str, policy_hash: str, since_ns=None, until_ns=None) -> str:
    """How many denials of each kind (exact, whatever the listing's limit)."""
    inner = denials_sql(db, policy_hash, since_ns, until_ns, limit=1)
    filt = inner.split("\nPREWHERE ", 1)[1].split("\nORDER BY", 1)[0]
    return (f"SELECT kind, decision, uniqExact(event_id) AS events, uniqExact(sandbox_id) AS sandboxes\n"
            f"FROM {quote_ident(db)}.{EVENTS_TABLE}\nPREWHERE {filt}\nGROUP BY kind, decision ORDER BY kind, decision")


def sandbox_events_sql(db: str, sandbox_id: str) -> str:
    """One sandbox's events, each once, ordered by (ts_ns, event_id): what replay.store.events_sql
    returns, without FINAL (on 18.16 FINAL costs ~10x here, bench/replay.py); copies of an event
    that the exporter re-sent are dropped by LIMIT 1 BY event_id (they are identical)."""
    from audit_schema.events import FIELD_NAMES
    db = quote_ident(db)
    return (f"SELECT {', '.join(FIELD_NAMES)} FROM {db}.{EVENTS_TABLE}\n"
            f"WHERE sandbox_id = {sql_string(sandbox_id)}\nORDER BY ts_ns, event_id\nLIMIT 1 BY event_id")


def unattributed_lost_sql(db: str, since_ns: int, until_ns: int) -> str:
    """events_lost records no sandbox could be named for (spool damage) in a window."""
    db = quote_ident(db)
    return (f"SELECT event_id, ts_ns, node, count, extra FROM {db}.{EVENTS_TABLE}\n"
            f"WHERE kind = 'events_lost' AND sandbox_id = '' AND ts_ns >= {sql_int(int(since_ns))} "
            f"AND ts_ns < {sql_int(int(until_ns))}\nORDER BY ts_ns LIMIT 1 BY event_id")


SUMMARY_COLUMNS = {
    "execs": ("sandbox_id", "node", "first_ns", "last_ns", "events", "steps", "paths", "sha256s", "decisions"),
    "connects": ("sandbox_id", "node", "first_ns", "last_ns", "events", "steps", "destinations", "connected",
                 "failed", "decisions"),
    "writes": ("sandbox_id", "node", "first_ns", "last_ns", "events", "steps", "paths", "failed", "decisions"),
    "images": ("sandbox_id", "node", "first_ns", "last_ns", "events", "steps", "images", "decisions"),
}


class Search:
    """Runs the questions above on an AuditStore's server."""

    def __init__(self, store):
        self.store = store
        self._modern = None

    @property
    def modern(self) -> bool:
        if self._modern is None:
            client = self.store.client()
            self._modern = is_modern(client.execute("SELECT version()")[0][0])
        return self._modern

    def sql(self, question: str, **kw) -> tuple[str, tuple]:
        db = self._db()
        if question == "execs":
            return execs_sql(db, **kw), SUMMARY_COLUMNS["execs"]
        if question == "connects":
            cidr = kw.pop("cidr")
            return connects_sql(db, cidr, modern=self.modern, **kw), SUMMARY_COLUMNS["connects"]
        if question == "writes":
            under = kw.pop("under")
            return writes_sql(db, under, **kw), SUMMARY_COLUMNS["writes"]
        if question == "images":
            return images_sql(db, **kw), SUMMARY_COLUMNS["images"]
        if question == "denials":
            h = kw.pop("policy_hash")
            return denials_sql(db, h, **kw), DENIAL_COLUMNS
        if question == "denial_totals":
            h = kw.pop("policy_hash")
            kw.pop("limit", None)
            return denial_totals_sql(db, h, **kw), ("kind", "decision", "events", "sandboxes")
        raise ReplayError(f"unknown question {question!r}", EXIT_USAGE)

    def _db(self) -> str:
        self.store.client()
        return self.store.db

    def run(self, question: str, **kw) -> list[dict]:
        sql, cols = self.sql(question, **kw)
        self.store.client()
        if not self.store.version:        # no schema yet: nothing recorded
            return []
        return list(self.store._iter(sql, cols))

    def sandbox_events(self, sandbox_id: str) -> list[dict]:
        """One sandbox's events (see sandbox_events_sql)."""
        from audit_schema.events import FIELD_NAMES
        self.store.client()
        if not self.store.version:
            return []
        return list(self.store._iter(sandbox_events_sql(self._db(), sandbox_id), FIELD_NAMES))

    def unattributed_lost(self, since_ns: int, until_ns: int) -> list[dict]:
        self.store.client()
        if not self.store.version:
            return []
        return list(self.store._iter(unattributed_lost_sql(self._db(), since_ns, until_ns),
                                     ("event_id", "ts_ns", "node", "count", "extra")))


# --- times ------------------------------------------------------------------------

_REL = re.compile(r"^-?(\d+(?:\.\d+)?)\s*(s|m|h|d|w)(?:\s*ago)?$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, what: str = "--since", now: float | None = None) -> int:
    """ns since the epoch from: 2026-11-29T22:00:00Z | '2026-11-29 22:00' (UTC unless an offset
    is given) | 2026-11-29 | 2h / 30m / 7d (ago) | epoch seconds | epoch ns."""
    s = (text or "").strip()
    if not s:
        raise ReplayError(f"{what}: empty time", EXIT_USAGE)
    now = time.time() if now is None else now
    m = _REL.match(s)
    if m:
        return int((now - float(m.group(1)) * _UNIT[m.group(2)]) * 1e9)
    if re.fullmatch(r"\d+(\.\d+)?", s):
        v = float(s)
        return int(v) if v > 1e15 else int(v * 1e9)
    iso = s.replace("Z", "+00:00")
    try:
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise ReplayError(f"{what} {text!r}: not a time (examples: 2026-11-29T22:00:00Z, '2026-11-29 22:00', "
                        "2h, 7d, epoch seconds)", EXIT_USAGE) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1e9)
