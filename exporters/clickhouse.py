"""ClickHouse sink: spool -> batched native inserts into <db>.events.

    exp = ClickHouseExporter(Spool(), url)   # url: ensure_clickhouse() by default
    res = exp.flush(timeout=10)              # end of a short `dsec run`
    exp.run(stop_event)                      # long-running agent loop

Delivery: read a batch from the spool at this sink's cursor ("clickhouse"),
insert it (one columnar INSERT, String columns as the exact bytes), and only
then commit the cursor. A crash or an outage between the insert and the
commit re-sends the batch: delivery is at-least-once. Duplicates never show
in query results: the events table is a ReplacingMergeTree whose sort key
ends with event_id (an event's copies have the same key and collapse in
background merges), and every dsec query reads with FINAL, which collapses
the copies not merged yet. Raw `SELECT count() FROM events` without FINAL
may count a re-sent copy until the next merge.

If ClickHouse is unreachable the records stay in the spool; flush() retries
with backoff and jitter until its timeout and returns what is still pending. Damage the
spool reader found (corrupt or invalid frames) is inserted as `events_lost`
events (sandbox_id "", extra.reason "spool_damage", event_id derived from
the spool id, segment and offset, so it too is inserted once) and logged.

Cluster mode (`cluster=`, the agent's clickhouse.cluster; or found in the
database, see audit_schema/migrations.py): `insert="local"` (default) inserts
into the connected server's own shard (events_local: no second hop, and one
sandbox's record is on its node's shard); `insert="distributed"` inserts
through the Distributed table, sharded by sandbox id, synchronously
(insert_distributed_sync=1: the batch is acknowledged, and the cursor moves,
only once every shard it touched has it). Readers read the Distributed table.

The cursor, batching, retry and run loop are exporters/base.py's (shared by
every sink); this module is the ClickHouse part: connection, migrations at
first connection, columnar insert. ClickHouse is a required sink: the disk
budget never evicts its backlog (exporters/spool.py).

The insert's own cost (issue 15): a batch read from batch frames is inserted
from its columns (Batch.columns: no dict per record is built), an argv
column without any argv (every kind but exec) is one list, not a Python
loop. A column the spool read as one value throughout (exporters/spool.py
Repeat: a batch frame's {"r": value}) is taken as it is: left out when it
is the default, else its value encoded once and repeated. A String column
of few distinct values (a LowCardinality column, 1/8 distinct or fewer) is
encoded once per distinct value (_column). The driver's LowCardinality
writer (a Python loop of a dict get and a list append per value) is
replaced by one with the same bytes on the wire whose dictionary is built
in C (_write_low_cardinality; test_clickhouse compares the two byte for
byte): 60 -> 27 ns a value for a column of one value (a batch of one
sandbox), 52 -> 48 for three. Offline, 100,000 open_write records spool ->
ClickHouse, the exporter's CPU per record (spool read + columns + the
driver's block): main 7.0-10.1 us, with this, the spool's trusted frames
("w") and its repeats ("r") 2.1-2.5 us. Columns whose values are all the default in a batch
('' / 0 / no argv: ~20 of 39 for open_write) are left out of the INSERT
(insert_block): the schema declares no DEFAULT expression, so the server
stores the same value, and neither this process nor the driver encodes
them (measured: conversion 1.25 -> 0.9 us a record). A batch is up to
50,000 records (batch_records): each INSERT is one part on the server, and
its CPU per event (insert + background merges) measured 2.8-14 us with
10,000-row inserts, 1.4-2.6 us with 50,000-row ones (the same 400k rows).
"""
from __future__ import annotations

import itertools
import logging
import operator
import threading

from exporters.spool import Repeat, Spool
from audit_schema.events import FIELDS, default
from exporters.base import FlushResult, RetryPolicy, SpoolSink, damage_event  # noqa: F401 - re-exported

log = logging.getLogger("dsec.exporter.clickhouse")

SINK = "clickhouse"
_COLUMNS = ", ".join(f.name for f in FIELDS)
_MIGRATED: dict = {}         # (url, db, cluster, ddl) -> MigrationResult, migrated by this process


_NAMES = tuple(f.name for f in FIELDS)
_UTF8, _SURROGATEESCAPE = itertools.repeat("utf-8"), itertools.repeat("surrogateescape")
_ROW = operator.itemgetter(*_NAMES)


def columns_for(records: list[dict]) -> list[list]:
    """Records -> one list per FIELDS column, String columns as exact bytes."""
    enc = str.encode   # == audit_schema.events.to_bytes, inlined: this loop is hot
    try:
        # normalized records (what the spool holds): transposed in C, no dict lookups in Python
        columns = list(zip(*map(_ROW, records))) if records else [() for _ in FIELDS]
    except KeyError:
        columns = None
    if columns is not None:
        return _converted(columns)
    cols = []
    for f in FIELDS:
        name = f.name
        if f.ch_type == "String":
            vals = [enc(v, "utf-8", "surrogateescape") if v else b"" for v in (r.get(name) for r in records)]
        elif f.ch_type == "Array(String)":
            vals = [[enc(x, "utf-8", "surrogateescape") for x in v] if v else [] for v in (r.get(name) for r in records)]
        else:
            d = default(f)
            vals = [v if v is not None else d for v in (r.get(name) for r in records)]
        cols.append(vals)
    return cols


def columns_of(columns: dict, n: int) -> list[list]:
    """A batch's columns ({field: [values]}, exporters/spool.py Batch.columns, n
    records) -> one list per FIELDS column as columns_for gives: the spool's
    batch frames come as columns, so no dicts are transposed."""
    return _converted(_by_field(columns, n))


def _by_field(columns: dict, n: int) -> list:
    """One sequence per FIELDS column of a batch's columns (a list or a Repeat; a
    field the batch lacks: a Repeat of its default)."""
    return [columns[f.name] if f.name in columns else Repeat(d, n) for f, d in zip(FIELDS, _DEFAULT_OF)]


def _converted(columns) -> list[list]:
    """One sequence per FIELDS column -> what the insert takes (String columns as
    exact bytes, None as the field's default)."""
    return [_column(f, col) for f, col in zip(FIELDS, columns)]


def _column(f, col) -> list:
    """One column's values as the insert takes them (String as exact bytes, None
    as the field's default). A String column of few distinct values (one
    sandbox's node, comm, policy, kind ... in a batch; a LowCardinality
    column) encodes each distinct value once and repeats the bytes objects,
    which also makes the driver's dictionary of a LowCardinality column
    cheap (_write_low_cardinality: equal objects, cached hashes)."""
    enc = str.encode   # == audit_schema.events.to_bytes, inlined: this loop is hot
    if col.__class__ is Repeat:                     # one value throughout, as the spool read it
        v, n = col.value, col.n
        if f.ch_type == "String":
            return [enc(v, "utf-8", "surrogateescape") if v else b""] * n
        if f.ch_type == "Array(String)":
            return [tuple([enc(x, "utf-8", "surrogateescape") for x in v]) if v else ()] * n
        return [default(f) if v is None else v] * n
    if f.ch_type == "String":
        n = len(col)
        if n and col.count(col[0]) == n:            # one value throughout: one encode, one C-level repeat
            v = col[0]
            return [enc(v, "utf-8", "surrogateescape") if v else b""] * n
        if None in col:
            return [enc(v, "utf-8", "surrogateescape") if v else b"" for v in col]
        if f.low_card or len(set(col[:_SAMPLE])) * _FEW <= min(n, _SAMPLE):
            distinct = dict.fromkeys(col)
            if len(distinct) * _FEW <= n:
                as_bytes = {v: enc(v, "utf-8", "surrogateescape") for v in distinct}
                return list(map(as_bytes.__getitem__, col))        # C-level: one lookup a value
        return list(map(enc, col, _UTF8, _SURROGATEESCAPE))     # one C-level map, no Python loop
    if f.ch_type == "Array(String)":
        if any(col):
            return [[enc(x, "utf-8", "surrogateescape") for x in v] if v else [] for v in col]
        return [()] * len(col)          # no argv at all (every kind but exec): one C-level repeat
    d = default(f)
    return [d if v is None else v for v in col] if None in col else list(col)


_DEFAULT_OF = tuple(default(f) for f in FIELDS)
_SAMPLE, _FEW = 256, 8      # a String column whose first 256 values hold at most 1/8 distinct ones: by dictionary


def _write_low_cardinality(self, items, buf, _driver_own=None):
    """clickhouse-driver's LowCardinalityColumn._write_data, byte for byte the
    same output (the dictionary in order of first appearance, then the keys),
    with the dictionary built in C (dict.fromkeys, a map of dict lookups)
    instead of a Python loop of get/append per value: that loop was ~0.35 us
    a value, 2.8 us a record for the 8 LowCardinality columns of open_write.
    A nullable column (dsec has none) takes the driver's own path."""
    if self.nested_column.nullable:
        return _driver_own(self, items, buf)
    index = list(dict.fromkeys(items))
    if not index:                       # the driver writes nothing for an empty column
        return
    if len(index) == 1:
        keys = [0] * len(items)
    else:
        keys = list(map(dict(zip(index, range(len(index)))).__getitem__, items))
    from math import log
    from clickhouse_driver.writer import write_binary_int64
    int_type = int(log(len(index), 2) / 8)
    write_binary_int64(self.serialization_type | int_type, buf)
    write_binary_int64(len(index), buf)
    self.nested_column.write_data(index, buf)
    write_binary_int64(len(items), buf)
    self.int_types[int_type](**self.init_kwargs).write_items(keys, buf)


def _wire_bytes(write, items) -> bytes:
    """What a LowCardinality(String) writer `write` puts on the wire for items."""
    from clickhouse_driver.bufferedwriter import BufferedSocketWriter
    from clickhouse_driver.columns.lowcardinalitycolumn import LowCardinalityColumn
    from clickhouse_driver.columns.stringcolumn import ByteString
    from clickhouse_driver.context import Context

    class Wire:                     # the driver's socket writer sends here
        def __init__(self):
            self.out = bytearray()

        def sendall(self, data):
            self.out += data
    ctx = Context()
    ctx.client_settings = {"strings_as_bytes": True}
    wire = Wire()
    buf = BufferedSocketWriter(wire, 1 << 16)
    write(LowCardinalityColumn(ByteString(context=ctx), context=ctx), list(items), buf)
    buf.flush()
    return bytes(wire.out)


_WIRE_SAMPLES = ([b"node-a"] * 5, [b"allowed", b"", b"allowed", b"\xff\x00x"], [b"h%d" % i for i in range(300)], [])


def _install_low_cardinality_writer() -> None:
    """Put _write_low_cardinality in the driver's LowCardinalityColumn, once, and
    only where it writes the driver's own bytes for a few samples (the driver is
    not pinned: a version that changed its LowCardinality wire format or its
    column's attributes keeps its own writer, logged)."""
    from clickhouse_driver.columns.lowcardinalitycolumn import LowCardinalityColumn as C
    own = C.__dict__.get("_write_data")
    if own is None or getattr(own, "_dsec", False) or getattr(C, "_dsec_kept", False):
        return
    try:
        same = all(_wire_bytes(_write_low_cardinality, s) == _wire_bytes(own, s) for s in _WIRE_SAMPLES)
    except Exception:  # noqa: BLE001 - another driver's internals: keep its own writer
        same = False
    if not same:
        C._dsec_kept = True
        log.warning("clickhouse-driver's LowCardinality writer differs from the one dsec knows: kept as it is")
        return

    def _write_data(self, items, buf):
        return _write_low_cardinality(self, items, buf, own)
    _write_data._dsec = True
    _write_data._driver_own = own
    C._write_data = _write_data


def _all_default(f, d, col) -> bool:
    """Every value of the column is the field's default ('' / 0; an Array column:
    every list empty), so the server's DEFAULT (the type's: the schema declares
    no DEFAULT expression) stores exactly what the insert would send. None
    (also the default) is not counted: such a column is sent."""
    if col.__class__ is Repeat:
        return not col.value if f.ch_type == "Array(String)" else col.value == d   # None != 0, None != ''
    if f.ch_type == "Array(String)":
        return not any(col)
    return col.count(d) == len(col)     # validated: ints are ints (no True == 1), strs are strs


def insert_block(raw) -> tuple[list, list]:
    """(column names, columns) to insert for one sequence per FIELDS column:
    the columns whose values are all the default are left out (issue 15: an
    open_write batch has ~20 of its 39 -- argv, addr, sha256 ...; the server
    fills the same default, and neither this process nor the driver encodes
    them); the others converted as _converted does."""
    names, cols = [], []
    for f, d, col in zip(FIELDS, _DEFAULT_OF, raw):
        if col and _all_default(f, d, col) and f.name != "event_id":
            continue
        names.append(f.name)
        cols.append(_column(f, col))
    return names, cols


class ClickHouseExporter(SpoolSink):
    kind = SINK
    label = "ClickHouse"
    evictable = False

    def __init__(self, spool: Spool | None = None, url: str | None = None, *, sink: str = SINK,
                 batch_records: int = 50000, connect_timeout: float = 3.0, flush_interval: float = 0.5,
                 retry: RetryPolicy | None = None, cluster: str | None = None, insert: str = "local",
                 ddl: str = "auto"):
        super().__init__(spool, sink=sink, batch_records=batch_records, flush_interval=flush_interval,
                         retry=retry or RetryPolicy(initial=0.1, maximum=2.0))
        if insert not in ("local", "distributed"):
            from exporters.errors import ExportError, USAGE
            raise ExportError(f"clickhouse insert {insert!r}: expected local or distributed", USAGE)
        self._url = url
        self.connect_timeout = connect_timeout
        self.cluster = cluster
        self.insert_mode = insert
        self.ddl = ddl
        self._client = None
        self._db = None
        self._key = None
        self._table = "events"
        self._settings: dict = {"strings_as_bytes": True}
        self.migration = None

    @property
    def url(self) -> str:
        """The given URL, else DSEC_CLICKHOUSE_URL or the private server's. In
        the default case every reconnect re-checks the private server and
        restarts it if it died (costs a pid check when it is up)."""
        if self._url is not None:
            return self._url
        from exporters.clickhouse_server import ensure_clickhouse
        return ensure_clickhouse()

    def _connected(self):
        if self._client is None:
            from exporters.clickhouse_server import connect
            from audit_schema.migrations import migrate
            _install_low_cardinality_writer()
            url = self.url
            client, db = connect(url, connect_timeout=self.connect_timeout)
            key = (url, db, self.cluster, self.ddl)
            res = _MIGRATED.get(key)
            if res is None:
                res = _MIGRATED[key] = migrate(client, db, self.cluster, ddl=self.ddl)
            self._table, self._settings = insert_target(res, self.insert_mode)
            self.migration = res
            self._client, self._db, self._key = client, db, key
        return self._client

    def _drop_client(self):
        if self._client is not None:
            try:
                self._client.disconnect()
            except Exception:
                pass
        self._client = None

    reset_connection = _drop_client

    def close(self):
        self._drop_client()
        super().close()

    def insert(self, records: list[dict], columns: list[list] | None = None, names=None) -> None:
        """One batched native INSERT (raises on failure); `columns`: the records
        already as columns_for gives them (or, with `names`, those columns only)."""
        client = self._connected()
        cols = ", ".join(names) if names is not None else _COLUMNS
        try:
            client.execute(f"INSERT INTO {self._db}.{self._table} ({cols}) VALUES",
                           columns if columns is not None else columns_for(records),
                           columnar=True, types_check=False, settings=self._settings)
        except Exception as e:
            if getattr(e, "code", None) in (60, 81):  # table / database gone: migrate on the next try
                _MIGRATED.pop(self._key, None)
            raise

    def deliver(self, records: list[dict]) -> None:
        self.insert(records)

    def deliver_batch(self, batch) -> None:
        """The batch's columns as they came from the spool's batch frames when it
        has them (no dict per record is built; damage rows are appended to the
        columns), the all-default ones left out (insert_block); else
        columns_for(its rows)."""
        if batch.raw_columns:               # a column of one value: a Repeat, never made a list
            raw = _by_field(batch.raw_columns, batch.count)
            lost = self.damage_rows(batch)
            if lost:
                raw = [(c.tolist() if c.__class__ is Repeat else list(c)) + [r.get(f.name) for r in lost]
                       for f, c in zip(FIELDS, raw)]
            names, cols = insert_block(raw)
            self.insert([], cols, names)
        else:
            self.insert(self.rows_of(batch))


def insert_target(res, insert: str = "local") -> tuple[str, dict]:
    """(table, insert settings) for a migrated database (a MigrationResult)."""
    from audit_schema.errors import SchemaError
    settings = {"strings_as_bytes": True}
    if not res.cluster:
        return "events", settings
    if insert == "local" and not any(loc for _, _, _, loc in res.hosts):
        raise SchemaError(f"clickhouse insert local: the server is not a host of cluster {res.cluster} (its "
                          f"system.clusters has no local host): point the URL at a shard, or use insert: distributed")
    if insert == "distributed":
        settings["insert_distributed_sync"] = 1
    return res.insert_table(insert), settings


def flush(spool: Spool | None = None, url: str | None = None, timeout: float = 10.0) -> FlushResult:
    """One-shot delivery for a short-lived process (the end of `dsec run`):
    never raises for an outage; print res.summary() when not res.ok."""
    exp = ClickHouseExporter(spool or Spool(), url)
    try:
        return exp.flush(timeout)
    finally:
        exp.close()


def export_forever(spool_dir: str | None = None, url: str | None = None, stop: threading.Event | None = None):
    """Convenience for an agent thread: run the ClickHouse sink on a spool."""
    exp = ClickHouseExporter(Spool(spool_dir), url)
    try:
        exp.run(stop or threading.Event())
    finally:
        exp.close()


__all__ = ["ClickHouseExporter", "FlushResult", "SINK", "columns_for", "columns_of", "damage_event", "insert_block", "export_forever", "flush",
           "insert_target"]
