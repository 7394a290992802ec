"""Versioned ClickHouse schema of the audit trail, generated from FIELDS.

    from audit_schema.migrations import migrate
    result = migrate(client, "dsec")     # idempotent; run at every start

MIGRATIONS is an ordered list of (version, name, statements(db, features)); a
statement is SQL text or an AddColumn (a new FIELDS column, added only when
the table lacks it: 18.16 has no ADD COLUMN IF NOT EXISTS).
Applied versions are recorded in `<db>.schema_migrations`; a database whose
recorded version is newer than LATEST is refused (an older dsec must not
write into a schema it does not know). Every statement is idempotent (IF NOT
EXISTS ...) because ClickHouse DDL is not transactional: a crash between a
statement and its record re-runs it harmlessly.

Columns come from audit_schema.events.FIELDS, never from a hand-kept list:
migration 1 creates `events` with the FIELDS of the running code, and after
the numbered migrations `sync_columns` adds every field FIELDS has and the
table lacks (ALTER TABLE ADD COLUMN, metadata only). A new field is still
given a numbered AddColumn step (migration 2 added `syscall` and `protocol`),
so the schema version says which columns a database has; sync_columns is the
safety net. Changing a type, the ORDER BY or dropping a column needs a real
migration (the check refuses a type that differs from FIELDS with a clear error).

Server dialects are detected, not assumed (see `detect_features`):
  18.16 (Debian 12)   LowCardinality only with allow_experimental_low_cardinality_type=1
                      (passed to the DDL statements only); no skip indexes usable here.
  current releases    LowCardinality native (the setting above is unknown and would
                      be rejected); bloom_filter skip indexes on sha256 and path.
Neither dialect gets CODEC, TTL, DateTime64 or Map: 18.16 has none of them.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

from audit_schema.errors import SchemaError
from audit_schema.events import FIELDS, Field

EVENTS_TABLE = "events"
SANDBOXES_VIEW = "sandboxes"
VERSION_TABLE = "schema_migrations"

# partition by month (UTC) of the event's wall-clock time
TS_EXPR = "toDateTime(intDiv(ts_ns, 1000000000), 'UTC')"
PARTITION_BY = f"toYYYYMM({TS_EXPR})"
# kind first (10 values: a kind filter is one contiguous range, a sandbox filter
# without kind is at most len(KINDS) ranges); then the sandbox and its time;
# event_id last makes the key unique per event, so ReplacingMergeTree collapses
# exactly the re-sent copies of one event and nothing else.
ORDER_BY = ("kind", "sandbox_id", "ts_ns", "event_id")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Features:
    """What the server's dialect allows."""
    version: str
    low_cardinality: bool = True    # LowCardinality(String) columns
    lc_setting: bool = False        # DDL needs allow_experimental_low_cardinality_type=1
    skip_indexes: bool = True       # INDEX ... TYPE bloom_filter

    @property
    def ddl_settings(self) -> dict:
        return {"allow_experimental_low_cardinality_type": 1} if self.lc_setting else {}


def parse_version(text: str) -> tuple:
    out = []
    for part in text.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def features_for(version: str, settings: dict) -> Features:
    """Features from `SELECT version()` and the server's settings
    (name -> value, at least the low-cardinality ones)."""
    v = parse_version(version)
    if v and v < (18, 12):
        raise SchemaError(f"ClickHouse {version} is too old for the dsec schema (need 18.16 or newer)")
    lc_flag = settings.get("allow_experimental_low_cardinality_type")
    return Features(
        version=version,
        low_cardinality=True,
        lc_setting=lc_flag is not None and str(lc_flag) in ("0", "false", "False"),
        # data skipping indexes: experimental in 19.x, general from 20.x; none in 18.16
        skip_indexes=bool(v) and v >= (20, 1),
    )


def detect_features(client) -> Features:
    version = client.execute("SELECT version()")[0][0]
    rows = client.execute("SELECT name, value FROM system.settings WHERE name LIKE '%low_cardinality%'")
    return features_for(version, dict(rows))


def quote_ident(name: str) -> str:
    if not _IDENT.match(name):
        raise SchemaError(f"ClickHouse database name {name!r}: use letters, digits and '_' "
                        "(starting with a letter or '_', at most 63 characters)")
    return name


def column_type(f: Field, feat: Features) -> str:
    if f.low_card and feat.low_cardinality and f.ch_type == "String":
        return "LowCardinality(String)"
    return f.ch_type


def column_defs(feat: Features) -> list[str]:
    return [f"{f.name} {column_type(f, feat)}" for f in FIELDS]


def fields_hash() -> str:
    return hashlib.sha256("\n".join(f"{f.name} {f.ch_type} {f.low_card}" for f in FIELDS).encode()).hexdigest()[:16]


# --- the migrations ---------------------------------------------------------------

def _v1(db: str, feat: Features) -> list[str]:
    cols = column_defs(feat)
    cols.append(f"ts DateTime ALIAS {TS_EXPR}")  # for people writing queries by hand
    if feat.skip_indexes:
        cols.append("INDEX sha256_idx sha256 TYPE bloom_filter(0.01) GRANULARITY 4")
        cols.append("INDEX path_idx path TYPE bloom_filter(0.01) GRANULARITY 4")
    body = ",\n  ".join(cols)
    events = (f"CREATE TABLE IF NOT EXISTS {db}.{EVENTS_TABLE} (\n  {body}\n)\n"
              f"ENGINE = ReplacingMergeTree\n"
              f"PARTITION BY {PARTITION_BY}\n"
              f"ORDER BY ({', '.join(ORDER_BY)})\n"
              f"SETTINGS index_granularity = 8192")
    # One row per sandbox, from its lifecycle events: with `kind` first in the
    # sort key this reads two small ranges, not the whole table.
    sandboxes = (
        f"CREATE VIEW IF NOT EXISTS {db}.{SANDBOXES_VIEW} AS\n"
        "SELECT sandbox_id,\n"
        "  any(node) AS node,\n"
        "  minIf(ts_ns, kind = 'sandbox_start') AS started_ns,\n"
        "  maxIf(ts_ns, kind = 'sandbox_exit') AS ended_ns,\n"
        "  argMaxIf(exit_code, ts_ns, kind = 'sandbox_exit') AS exit_code,\n"
        "  argMaxIf(signal, ts_ns, kind = 'sandbox_exit') AS signal,\n"
        "  argMinIf(argv, ts_ns, kind = 'sandbox_start') AS argv,\n"
        "  toString(argMinIf(policy_name, ts_ns, kind = 'sandbox_start')) AS policy_name,\n"
        "  toString(argMinIf(mode, ts_ns, kind = 'sandbox_start')) AS mode,\n"
        "  sumIf(count, kind = 'events_lost') AS events_lost,\n"
        "  countIf(kind = 'sandbox_exit') > 0 AS exited\n"
        f"FROM {db}.{EVENTS_TABLE} FINAL\n"
        "WHERE kind IN ('sandbox_start', 'sandbox_exit', 'events_lost') AND sandbox_id != ''\n"
        "GROUP BY sandbox_id")
    return [events, sandboxes]


@dataclass(frozen=True)
class AddColumn:
    """A migration step that adds one FIELDS column to `events`.

    18.16 has no `ADD COLUMN IF NOT EXISTS`, so the step is made idempotent by
    a check: migrate() adds the column only when the table lacks it (a table
    created by migration 1 of this code already has every current field)."""
    db: str
    name: str

    def sql(self, feat: Features) -> str:
        from audit_schema.events import BY_NAME
        return f"ALTER TABLE {self.db}.{EVENTS_TABLE} ADD COLUMN {self.name} {column_type(BY_NAME[self.name], feat)}"


def _v2(db: str, feat: Features) -> list:
    # enforcement records (bpf/enforce.c): the denied/violating syscall's name,
    # the egress socket's protocol
    return [AddColumn(db, "syscall"), AddColumn(db, "protocol")]


def _v3(db: str, feat: Features) -> list:
    # images (agent/sandbox/images): the manifest digest of the sandbox's image on every
    # row, LowCardinality where the server supports it (few images, millions of rows)
    return [AddColumn(db, "image_digest")]


MIGRATIONS = [
    (1, "events table and sandboxes view", _v1),
    (2, "enforcement columns: syscall, protocol", _v2),
    (3, "image column: image_digest", _v3),
]
LATEST = MIGRATIONS[-1][0]


def version_table_sql(db: str) -> str:
    return (f"CREATE TABLE IF NOT EXISTS {db}.{VERSION_TABLE} (\n"
            "  version UInt32, name String, applied_ns UInt64, server_version String, fields_hash String\n"
            ") ENGINE = ReplacingMergeTree ORDER BY version")


def plan(db: str, feat: Features, after: int = 0) -> list[tuple[int, str, list[str]]]:
    """The statements that bring a database at version `after` to LATEST."""
    db = quote_ident(db)
    return [(v, name, fn(db, feat)) for v, name, fn in MIGRATIONS if v > after]


def all_statements(db: str, feat: Features) -> list[str]:
    """Every DDL statement of a fresh install, in order (for dialect checks)."""
    db = quote_ident(db)
    out = [f"CREATE DATABASE IF NOT EXISTS {db}", version_table_sql(db)]
    for _, _, stmts in plan(db, feat):
        # AddColumn steps are no-ops on a fresh install (migration 1 creates
        # every current field): migrate() skips them, and so does this list
        out += [s for s in stmts if isinstance(s, str)]
    return out


# --- applying them ---------------------------------------------------------------

@dataclass
class MigrationResult:
    database: str
    before: int
    after: int
    applied: list = field(default_factory=list)
    added_columns: list = field(default_factory=list)
    features: Features | None = None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def current_version(client, db: str) -> int:
    """Recorded schema version; 0 when the database or the table does not exist."""
    db = quote_ident(db)
    rows = client.execute("SELECT count() FROM system.tables WHERE database = %(db)s AND name = %(t)s",
                          {"db": db, "t": VERSION_TABLE})
    if not rows[0][0]:
        return 0
    return int(client.execute(f"SELECT max(version) FROM {db}.{VERSION_TABLE}")[0][0] or 0)


def check_version(client, db: str) -> int:
    v = current_version(client, db)
    if v > LATEST:
        raise SchemaError(f"ClickHouse database {db!r} has dsec schema version {v}, newer than this dsec "
                        f"knows ({LATEST}): upgrade dsec, or point DSEC_CLICKHOUSE_URL at another database")
    return v


def migrate(client, db: str) -> MigrationResult:
    """Bring `db` to LATEST (creating it), then add FIELDS columns it lacks."""
    db = quote_ident(db)
    feat = detect_features(client)
    client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
    client.execute(version_table_sql(db))
    before = check_version(client, db)
    res = MigrationResult(db, before, before, features=feat)
    start = before
    if before and not table_columns(client, db):
        start = 0   # recorded but the events table is gone (dropped by hand): re-apply, all idempotent
    for version, name, stmts in plan(db, feat, start):
        for sql in stmts:
            if isinstance(sql, AddColumn):
                if sql.name in table_columns(client, db):
                    continue
                sql = sql.sql(feat)
            try:
                client.execute(sql, settings=feat.ddl_settings)
            except SchemaError:
                raise
            except Exception as e:
                raise SchemaError(f"schema migration {version} ({name}) failed on ClickHouse {feat.version}: "
                                f"{_first_line(e)}")
        client.execute(f"INSERT INTO {db}.{VERSION_TABLE} (version, name, applied_ns, server_version, fields_hash) VALUES",
                       [(version, name, time.time_ns(), feat.version, fields_hash())])
        res.applied.append(version)
        res.after = version
    res.added_columns = sync_columns(client, db, feat)
    return res


def _strip_lc(t: str) -> str:
    m = re.fullmatch(r"LowCardinality\((.*)\)", t)
    return m.group(1) if m else t


def table_columns(client, db: str, table: str = EVENTS_TABLE) -> dict:
    rows = client.execute("SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                          {"db": db, "t": table})
    return dict(rows)


def sync_columns(client, db: str, feat: Features) -> list[str]:
    """Add the FIELDS columns `events` lacks; refuse type differences."""
    have = table_columns(client, db)
    added = []
    for f in FIELDS:
        t = have.get(f.name)
        if t is None:
            try:
                client.execute(f"ALTER TABLE {db}.{EVENTS_TABLE} ADD COLUMN {f.name} {column_type(f, feat)}",
                               settings=feat.ddl_settings)
                added.append(f.name)
            except Exception as e:  # another agent may have added it a moment ago
                if f.name not in table_columns(client, db):
                    raise SchemaError(f"cannot add column {db}.{EVENTS_TABLE}.{f.name}: {_first_line(e)}")
        elif _strip_lc(t) != f.ch_type:
            raise SchemaError(f"column {db}.{EVENTS_TABLE}.{f.name} is {t} in ClickHouse but {f.ch_type} in "
                            "audit_schema/events.py: a type change needs a numbered migration")
    return added
