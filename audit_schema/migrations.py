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

Cluster mode (`migrate(client, db, cluster="NAME")`, the agent's
`clickhouse.cluster`): the same migrations, each statement run for a
ClickHouse cluster (a <remote_servers> name) instead of one server:

    <db>.events_local   the ReplacingMergeTree, a local table on every host of the cluster
    <db>.events         Distributed(NAME, <db>, events_local, cityHash64(sandbox_id)) on
                        every host: every reader (dsec events, replay, search, policy
                        promote) reads it, unchanged, and sees every shard
    <db>.sandboxes      the view, over the Distributed table, on every host

DDL goes `ON CLUSTER NAME` (ClickHouse's distributed DDL: needs ZooKeeper or
ClickHouse Keeper and <distributed_ddl> in the servers' config), or, where
the cluster has no distributed DDL (`ddl="auto"` finds out, `"each_host"`
forces it), to every host of system.clusters directly with the connecting
client's credentials. The dialect is the connecting server's. Distributed DDL
runs with the servers' default settings, not the client's, so on 18.16 the
cluster's columns are plain String where LowCardinality would need the
session setting (same values, same queries). A database created in cluster
mode says so itself (`events` is Distributed): migrate() without a cluster
finds the cluster there, so `dsec run` and every reader need no cluster
setting. The migration record (schema_migrations) stays per server.
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

LOCAL_SUFFIX = "_local"
SHARDING_KEY = "cityHash64(sandbox_id)"   # one sandbox's record on one shard


@dataclass(frozen=True)
class Target:
    """Where the statements of a migration run: one server (cluster None), or
    every host of a ClickHouse cluster, through `ON CLUSTER` (on_cluster) or
    host by host (each_host: the statements carry no ON CLUSTER clause)."""
    cluster: str | None = None
    ddl: str = "on_cluster"          # on_cluster | each_host

    @property
    def clause(self) -> str:
        return f" ON CLUSTER {self.cluster}" if self.cluster and self.ddl == "on_cluster" else ""

    @property
    def events_local(self) -> str:
        return EVENTS_TABLE + LOCAL_SUFFIX if self.cluster else EVENTS_TABLE


SINGLE = Target()


def events_table_sql(db: str, feat: Features, name: str = EVENTS_TABLE, clause: str = "") -> str:
    cols = column_defs(feat)
    cols.append(f"ts DateTime ALIAS {TS_EXPR}")  # for people writing queries by hand
    if feat.skip_indexes:
        cols.append("INDEX sha256_idx sha256 TYPE bloom_filter(0.01) GRANULARITY 4")
        cols.append("INDEX path_idx path TYPE bloom_filter(0.01) GRANULARITY 4")
    body = ",\n  ".join(cols)
    return (f"CREATE TABLE IF NOT EXISTS {db}.{name}{clause} (\n  {body}\n)\n"
            f"ENGINE = ReplacingMergeTree\n"
            f"PARTITION BY {PARTITION_BY}\n"
            f"ORDER BY ({', '.join(ORDER_BY)})\n"
            f"SETTINGS index_granularity = 8192")


def distributed_table_sql(db: str, feat: Features, cluster: str, clause: str = "") -> str:
    """The Distributed table over every shard's events_local (no indexes: the shards have them)."""
    cols = column_defs(feat) + [f"ts DateTime ALIAS {TS_EXPR}"]
    body = ",\n  ".join(cols)
    return (f"CREATE TABLE IF NOT EXISTS {db}.{EVENTS_TABLE}{clause} (\n  {body}\n)\n"
            f"ENGINE = Distributed({cluster}, {db}, {EVENTS_TABLE}{LOCAL_SUFFIX}, {SHARDING_KEY})")


@dataclass(frozen=True)
class EventsTable:
    """Migration 1's events table: one ReplacingMergeTree on a single server;
    in cluster mode the local table on every host plus the Distributed table."""
    db: str

    def sql(self, feat: Features, target: Target = SINGLE) -> list[str]:
        if not target.cluster:
            return [events_table_sql(self.db, feat)]
        return [events_table_sql(self.db, feat, target.events_local, target.clause),
                distributed_table_sql(self.db, feat, target.cluster, target.clause)]


def _v1(db: str, feat: Features) -> list:
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
    return [EventsTable(db), sandboxes]


@dataclass(frozen=True)
class AddColumn:
    """A migration step that adds one FIELDS column to `events`.

    18.16 has no `ADD COLUMN IF NOT EXISTS`, so the step is made idempotent by
    a check: migrate() adds the column only when the table lacks it (a table
    created by migration 1 of this code already has every current field)."""
    db: str
    name: str

    def sql(self, feat: Features, target: Target = SINGLE) -> str:
        """The ALTER of the table the rows live in (events_local in cluster mode)."""
        return add_column_sql(self.db, target.events_local, self.name, feat, target.clause)


def add_column_sql(db: str, table: str, name: str, feat: Features, clause: str = "") -> str:
    from audit_schema.events import BY_NAME
    return f"ALTER TABLE {db}.{table}{clause} ADD COLUMN {name} {column_type(BY_NAME[name], feat)}"


def _v2(db: str, feat: Features) -> list:
    # enforcement records (bpf/enforce.c): the denied/violating syscall's name,
    # the egress socket's protocol
    return [AddColumn(db, "syscall"), AddColumn(db, "protocol")]


def _v3(db: str, feat: Features) -> list:
    # images (agent/sandbox/images): the manifest digest of the sandbox's image on every
    # row, LowCardinality where the server supports it (few images, millions of rows)
    return [AddColumn(db, "image_digest")]


def _v4(db: str, feat: Features) -> list:
    # paths (issue 13): the dirfd the kernel was given with a relative name, and whether
    # `path` is exact, a best-effort resolution after the fact, or unresolved
    return [AddColumn(db, "dirfd"), AddColumn(db, "path_resolution")]


MIGRATIONS = [
    (1, "events table and sandboxes view", _v1),
    (2, "enforcement columns: syscall, protocol", _v2),
    (3, "image column: image_digest", _v3),
    (4, "path columns: dirfd, path_resolution", _v4),
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


def statement_sql(stmt, feat: Features, target: Target = SINGLE) -> list[str]:
    """The SQL text of one migration statement for `target` (AddColumn excluded:
    it is conditional, see migrate)."""
    if isinstance(stmt, EventsTable):
        return stmt.sql(feat, target)
    if isinstance(stmt, str):
        return [on_cluster(stmt, target)]
    raise SchemaError(f"not a migration statement: {stmt!r}")


_DDL_HEAD = re.compile(r"^(CREATE (?:TABLE|VIEW|DATABASE) IF NOT EXISTS [A-Za-z0-9_.]+|ALTER TABLE [A-Za-z0-9_.]+)")


def on_cluster(sql: str, target: Target) -> str:
    """`sql` with the target's ON CLUSTER clause after the object's name. A
    statement of another shape cannot be run on a cluster as it is: refused
    (a new migration must say how)."""
    if not target.clause:
        return sql
    m = _DDL_HEAD.match(sql)
    if not m:
        raise SchemaError(f"migration statement cannot run ON CLUSTER: {sql.splitlines()[0][:120]}")
    return m.group(1) + target.clause + sql[m.end():]


def all_statements(db: str, feat: Features, target: Target = SINGLE) -> list[str]:
    """Every DDL statement of a fresh install, in order (for dialect checks)."""
    db = quote_ident(db)
    out = [on_cluster(f"CREATE DATABASE IF NOT EXISTS {db}", target), version_table_sql(db)]
    for _, _, stmts in plan(db, feat):
        # AddColumn steps are no-ops on a fresh install (migration 1 creates
        # every current field): migrate() skips them, and so does this list
        for st in stmts:
            if not isinstance(st, AddColumn):
                out += statement_sql(st, feat, target)
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
    cluster: str | None = None          # cluster mode: the ClickHouse cluster's name
    ddl: str = ""                       # cluster mode: on_cluster | each_host
    hosts: list = field(default_factory=list)   # cluster mode: [(shard, host, port, is_local)]

    @property
    def local_table(self) -> str:
        """The table holding the rows on the connected server."""
        return EVENTS_TABLE + LOCAL_SUFFIX if self.cluster else EVENTS_TABLE

    def insert_table(self, insert: str = "local") -> str:
        """Where an agent inserts: its own shard's local table, or the Distributed table."""
        if insert not in ("local", "distributed"):
            raise SchemaError(f"clickhouse insert {insert!r}: expected local or distributed")
        return self.local_table if insert == "local" else EVENTS_TABLE


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _ddl_error(e: Exception) -> str:
    """The useful part of a (distributed) DDL error: 18.16 puts the host's message after 'There was an error on'."""
    text = str(e).strip()
    m = re.search(r"There was an error on \[([^\]]+)\]: (?:Code: \d+, e.displayText\(\) = )?(?:DB::Exception: )?([^\n]*)",
                  text)
    if m:
        return f"on {m.group(1)}: {m.group(2).split(', e.what()')[0][:300]}"
    return _first_line(e)


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


def table_engine(client, db: str, table: str = EVENTS_TABLE) -> tuple[str, str] | None:
    """(engine, engine_full) of db.table, None when it does not exist."""
    rows = client.execute("SELECT engine, engine_full FROM system.tables WHERE database = %(db)s AND name = %(t)s",
                          {"db": db, "t": table})
    return (rows[0][0], rows[0][1]) if rows else None


def cluster_of(client, db: str) -> str | None:
    """The cluster a database was created for (its events table is Distributed), else None."""
    eng = table_engine(client, db)
    if eng is None or eng[0] != "Distributed":
        return None
    m = re.match(r"\s*Distributed\(\s*'?([A-Za-z0-9_.-]+)'?", eng[1])
    return m.group(1) if m else None


def cluster_hosts(client, cluster: str) -> list[tuple[int, str, int, bool]]:
    """(shard, host address, port, is_local) of every host of `cluster`, as the server knows them."""
    rows = client.execute("SELECT shard_num, host_address, port, is_local FROM system.clusters "
                          "WHERE cluster = %(c)s ORDER BY shard_num, replica_num", {"c": cluster})
    if not rows:
        known = sorted({r[0] for r in client.execute("SELECT cluster FROM system.clusters")})
        raise SchemaError(f"ClickHouse cluster {cluster!r} is not defined on the server (<remote_servers> in its "
                          f"config; it knows: {', '.join(known) or 'none'})")
    return [(int(s), h, int(p), bool(loc)) for s, h, p, loc in rows]


def _host_client(client, host: str, port: int):
    """A client for another host of the cluster, with the connecting client's credentials."""
    from clickhouse_driver import Client
    c = client.connection
    return Client(host=host, port=port, user=c.user, password=c.password, secure=c.secure_socket,
                  database="", connect_timeout=c.connect_timeout, send_receive_timeout=c.send_receive_timeout,
                  client_name="dsec-migrate")


_NO_DDL_QUEUE = re.compile(r"DistributedDDL|distributed_ddl|ZooKeeper|zookeeper|Keeper", re.I)
DDL_TIMEOUT = 60     # seconds a distributed DDL statement waits for every host


class _Runner:
    """Runs migration DDL on the target: the one server, ON CLUSTER, or each host."""

    def __init__(self, client, db: str, cluster: str | None, ddl: str, host_client):
        self.client = client
        self.db = db
        self.cluster = cluster
        self.ddl = ddl
        self.hosts: list = []
        self._clients: dict = {}
        self._host_client = host_client or _host_client
        if cluster:
            self.hosts = cluster_hosts(client, cluster)

    @property
    def target(self) -> Target:
        return Target(self.cluster, self.ddl) if self.cluster else SINGLE

    def close(self):
        for c in self._clients.values():
            try:
                c.disconnect()
            except Exception:  # noqa: BLE001
                pass

    def _each(self):
        for _, host, port, _ in self.hosts:
            key = (host, port)
            if key not in self._clients:
                self._clients[key] = self._host_client(self.client, host, port)
            yield key, self._clients[key]

    def create_database(self):
        db = self.db
        if not self.cluster:
            self.client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
            return
        if self.ddl in ("auto", "on_cluster"):
            try:
                self.client.execute(f"CREATE DATABASE IF NOT EXISTS {db} ON CLUSTER {self.cluster}",
                                    settings={"distributed_ddl_task_timeout": DDL_TIMEOUT})
                self.ddl = "on_cluster"
                return
            except Exception as e:  # noqa: BLE001
                if self.ddl == "on_cluster" or not _NO_DDL_QUEUE.search(str(e)):
                    raise SchemaError(f"CREATE DATABASE {db} ON CLUSTER {self.cluster} failed: {_ddl_error(e)}")
                self.ddl = "each_host"      # no distributed DDL on this cluster: host by host
        self.execute(f"CREATE DATABASE IF NOT EXISTS {db}")

    def execute(self, sql: str, settings: dict | None = None, what: str = "schema statement failed"):
        """One statement (already carrying the target's clause) everywhere it must run;
        SchemaError("<what>: <the server's message>") when it fails."""
        settings = dict(settings or {})
        if not self.cluster or self.ddl == "on_cluster":
            if self.cluster:
                settings["distributed_ddl_task_timeout"] = DDL_TIMEOUT
            try:
                self.client.execute(sql, settings=settings)
            except Exception as e:  # noqa: BLE001
                raise SchemaError(f"{what}: {_ddl_error(e)}")
            return
        for (host, port), c in self._each():
            try:
                c.execute(sql, settings=settings)
            except Exception as e:  # noqa: BLE001
                raise SchemaError(f"{what} (on {host}:{port} of cluster {self.cluster}): {_first_line(e)}")

    def columns(self) -> list[tuple[str, str, dict]]:
        """(where, table, columns) of every table whose columns migrations keep in step."""
        tables = [self.target.events_local] + ([EVENTS_TABLE] if self.cluster else [])
        if not self.cluster or self.ddl == "on_cluster":
            return [(f"{self.db}.{t}", t, table_columns(self.client, self.db, t)) for t in tables]
        return [(f"{self.db}.{t} on {h}:{p}", t, table_columns(c, self.db, t))
                for (h, p), c in self._each() for t in tables]

    def add_column(self, table: str, name: str, feat: Features):
        sql = add_column_sql(self.db, table, name, feat, self.target.clause)
        try:
            self.execute(sql, feat.ddl_settings, what=f"cannot add column {self.db}.{table}.{name}")
        except SchemaError as e:
            # another agent added it a moment ago, or (ON CLUSTER) some hosts had it already
            if "already exists" not in e.message:
                raise


def migrate(client, db: str, cluster: str | None = None, *, ddl: str = "auto", host_client=None) -> MigrationResult:
    """Bring `db` to LATEST (creating it), then add FIELDS columns it lacks.
    cluster: a ClickHouse cluster name (cluster mode, see the module doc); None:
    the mode the database was created in. ddl: auto | on_cluster | each_host."""
    db = quote_ident(db)
    if ddl not in ("auto", "on_cluster", "each_host"):
        raise SchemaError(f"clickhouse ddl {ddl!r}: expected auto, on_cluster or each_host")
    feat = detect_features(client)
    found = cluster_of(client, db)
    if cluster is None:
        cluster = found
    elif found is None and table_engine(client, db) is not None:
        raise SchemaError(f"ClickHouse database {db!r} holds a single-server events table, not cluster {cluster!r}'s "
                          f"Distributed one: on every shard RENAME TABLE {db}.events TO {db}.events_local, then "
                          f"start again (the migration adds the Distributed table), or use another database")
    elif found is not None and found != cluster:
        raise SchemaError(f"ClickHouse database {db!r} is set up for cluster {found!r}, not {cluster!r}")
    if cluster:
        quote_ident(cluster.replace("-", "_").replace(".", "_"))
    runner = _Runner(client, db, cluster, ddl, host_client)
    try:
        return _migrate(client, db, feat, runner)
    finally:
        runner.close()


def _migrate(client, db: str, feat: Features, runner: _Runner) -> MigrationResult:
    runner.create_database()
    if runner.cluster and runner.ddl == "on_cluster" and feat.lc_setting:
        # distributed DDL runs with the servers' settings, where 18.16 refuses LowCardinality
        feat = Features(feat.version, low_cardinality=False, lc_setting=False, skip_indexes=feat.skip_indexes)
    client.execute(version_table_sql(db))
    before = check_version(client, db)
    res = MigrationResult(db, before, before, features=feat, cluster=runner.cluster,
                          ddl=runner.ddl if runner.cluster else "", hosts=runner.hosts)
    target = runner.target
    start = before
    if before and not table_columns(client, db, target.events_local):
        start = 0   # recorded but the events table is gone (dropped by hand): re-apply, all idempotent
    for version, name, stmts in plan(db, feat, start):
        for st in stmts:
            if isinstance(st, AddColumn):
                for _, table, cols in runner.columns():
                    if st.name not in cols:
                        runner.add_column(table, st.name, feat)
                continue
            for sql in statement_sql(st, feat, target):
                runner.execute(sql, feat.ddl_settings,
                               what=f"schema migration {version} ({name}) failed on ClickHouse {feat.version}")
        client.execute(f"INSERT INTO {db}.{VERSION_TABLE} (version, name, applied_ns, server_version, fields_hash) VALUES",
                       [(version, name, time.time_ns(), feat.version, fields_hash())])
        res.applied.append(version)
        res.after = version
    res.added_columns = sync_columns(client, db, feat, runner)
    return res


def _strip_lc(t: str) -> str:
    m = re.fullmatch(r"LowCardinality\((.*)\)", t)
    return m.group(1) if m else t


def table_columns(client, db: str, table: str = EVENTS_TABLE) -> dict:
    rows = client.execute("SELECT name, type FROM system.columns WHERE database = %(db)s AND table = %(t)s",
                          {"db": db, "t": table})
    return dict(rows)


def sync_columns(client, db: str, feat: Features, runner: _Runner | None = None) -> list[str]:
    """Add the FIELDS columns the events table(s) lack; refuse type differences."""
    runner = runner or _Runner(client, db, None, "auto", None)
    added = []
    for where, table, have in runner.columns():
        for f in FIELDS:
            t = have.get(f.name)
            if t is None:
                runner.add_column(table, f.name, feat)
                if f.name not in added:
                    added.append(f.name)
            elif _strip_lc(t) != f.ch_type:
                raise SchemaError(f"column {where}.{f.name} is {t} in ClickHouse but {f.ch_type} in "
                                  "audit_schema/events.py: a type change needs a numbered migration")
    return added
