"""Reading the audit trail back from ClickHouse (dsec events, dsec replay).

    store = AuditStore()                         # DSEC_CLICKHOUSE_URL or the private server
    for ev in store.events("sb-123", kinds=["exec", "connect"]):
        ...                                      # dicts keyed by FIELDS, time-ordered
    store.sandbox("sb-123")                      # lifecycle summary (the sandboxes view)

Every query reads `events FINAL`: copies of an event that the at-least-once
exporter re-sent collapse there (same sort key, ending in event_id), so each
event is returned once. Events come ordered by (ts_ns, event_id): a stable
order even for equal timestamps.

The SQL is built by plain functions (events_sql, sandbox_sql, ...) so tests
can run the very same statements on another engine (tests/test_schema_modern.py
runs them on a current ClickHouse via chdb). Values are inlined as literals
that escape every byte outside printable ASCII as \\xHH: byte-exact for
non-UTF-8 paths and the same on 18.16 and current releases.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from replay.errors import ReplayError, USAGE as EXIT_USAGE
from audit_schema.errors import ReportedError
from audit_schema.events import FIELD_NAMES, KINDS, from_bytes, to_bytes
from audit_schema.migrations import EVENTS_TABLE, SANDBOXES_VIEW, quote_ident

SANDBOX_COLUMNS = ("sandbox_id", "node", "started_ns", "ended_ns", "exit_code", "signal", "argv",
                   "policy_name", "mode", "events_lost", "exited")


# --- SQL -----------------------------------------------------------------------------

def sql_string(value: str | bytes) -> str:
    """A ClickHouse string literal holding exactly these bytes."""
    raw = value if isinstance(value, bytes) else to_bytes(value)
    out = []
    for c in raw:
        if c == 0x27:
            out.append("\\'")
        elif c == 0x5C:
            out.append("\\\\")
        elif 0x20 <= c < 0x7F:
            out.append(chr(c))
        else:
            out.append(f"\\x{c:02x}")
    return "'" + "".join(out) + "'"


def sql_int(value) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplayError(f"expected an integer, got {value!r}", EXIT_USAGE)
    return str(value)


def check_kinds(kinds: Iterable[str] | None) -> list[str]:
    out = []
    for k in kinds or ():
        if k not in KINDS:
            raise ReplayError(f"unknown event kind {k!r} (kinds: {', '.join(KINDS)})", EXIT_USAGE)
        if k not in out:
            out.append(k)
    return out


def events_sql(db: str, sandbox_id: str, kinds: Iterable[str] | None = None, *,
               since_ns: int | None = None, until_ns: int | None = None, limit: int | None = None,
               columns: Iterable[str] = FIELD_NAMES) -> str:
    """One sandbox's events, deduplicated, ordered by (ts_ns, event_id)."""
    db = quote_ident(db)
    cols = list(columns)
    for c in cols:
        if c not in FIELD_NAMES:
            raise ReplayError(f"unknown audit field {c!r}", EXIT_USAGE)
    where = [f"sandbox_id = {sql_string(sandbox_id)}"]
    kinds = check_kinds(kinds)
    if kinds:
        where.append("kind IN (" + ", ".join(sql_string(k) for k in kinds) + ")")
    if since_ns is not None:
        where.append(f"ts_ns >= {sql_int(since_ns)}")
    if until_ns is not None:
        where.append(f"ts_ns < {sql_int(until_ns)}")
    sql = (f"SELECT {', '.join(cols)} FROM {db}.{EVENTS_TABLE} FINAL\n"
           f"WHERE {' AND '.join(where)}\n"
           f"ORDER BY ts_ns, event_id")
    if limit is not None:
        sql += f"\nLIMIT {sql_int(limit)}"
    return sql


def count_sql(db: str, sandbox_id: str) -> str:
    db = quote_ident(db)
    return f"SELECT count() FROM {db}.{EVENTS_TABLE} FINAL WHERE sandbox_id = {sql_string(sandbox_id)}"


def sandbox_sql(db: str, sandbox_id: str | None = None, limit: int | None = None) -> str:
    """Lifecycle summaries from the sandboxes view (one sandbox, or the latest)."""
    db = quote_ident(db)
    sql = f"SELECT {', '.join(SANDBOX_COLUMNS)} FROM {db}.{SANDBOXES_VIEW}"
    if sandbox_id is not None:
        sql += f" WHERE sandbox_id = {sql_string(sandbox_id)}"
    sql += " ORDER BY started_ns DESC, sandbox_id"
    if limit is not None:
        sql += f" LIMIT {sql_int(limit)}"
    return sql


# --- rows ----------------------------------------------------------------------------

def decode_value(v):
    if isinstance(v, bytes):
        return from_bytes(v)
    if isinstance(v, (list, tuple)):
        return [decode_value(x) for x in v]
    return v


def decode_row(names, row) -> dict:
    return {n: decode_value(v) for n, v in zip(names, row)}


# --- the store -------------------------------------------------------------------------

class AuditStore:
    """Read side of the audit trail. Reads only: no DDL; a database whose schema
    is newer than this dsec is refused, one not created yet reads as empty."""

    def __init__(self, url: str | None = None, *, connect_timeout: float = 3.0):
        self._url = url
        self.connect_timeout = connect_timeout
        self._client = None
        self.db = None
        self.version = None

    @property
    def url(self) -> str:
        if self._url is None:
            from exporters.clickhouse_server import ensure_clickhouse
            self._url = ensure_clickhouse()
        return self._url

    def client(self):
        if self._client is None:
            from exporters.clickhouse_server import connect, parse_url
            from audit_schema.migrations import check_version
            client, db = connect(self.url, connect_timeout=self.connect_timeout)
            try:
                self.version = check_version(client, db)
            except ReportedError:
                raise
            except Exception as e:
                raise ReplayError(f"cannot query ClickHouse at {parse_url(self.url).url}: {_first_line(e)}")
            self._client, self.db = client, db
        return self._client

    def close(self):
        if self._client is not None:
            self._client.disconnect()
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def _iter(self, sql: str, names) -> Iterator[dict]:
        client = self.client()
        if not self.version:
            return
        try:
            for row in client.execute_iter(sql, settings={"strings_as_bytes": True, "max_block_size": 8192}):
                yield decode_row(names, row)
        except ReplayError:
            raise
        except Exception as e:
            raise ReplayError(f"ClickHouse query failed: {_first_line(e)}")

    def events(self, sandbox_id: str, kinds: Iterable[str] | None = None, *, since_ns: int | None = None,
               until_ns: int | None = None, limit: int | None = None,
               columns: Iterable[str] = FIELD_NAMES) -> Iterator[dict]:
        """One sandbox's events, each once, ordered by (ts_ns, event_id)."""
        cols = list(columns)
        self.client()
        sql = events_sql(self.db, sandbox_id, kinds, since_ns=since_ns, until_ns=until_ns, limit=limit, columns=cols)
        return self._iter(sql, cols)

    def count(self, sandbox_id: str) -> int:
        client = self.client()
        if not self.version:
            return 0
        return int(client.execute(count_sql(self.db, sandbox_id))[0][0])

    def sandbox(self, sandbox_id: str) -> dict | None:
        self.client()
        rows = list(self._iter(sandbox_sql(self.db, sandbox_id), SANDBOX_COLUMNS))
        return rows[0] if rows else None

    def sandboxes(self, limit: int = 100) -> list[dict]:
        self.client()
        return list(self._iter(sandbox_sql(self.db, limit=limit), SANDBOX_COLUMNS))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("Stack trace")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__
