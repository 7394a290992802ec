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
with backoff until its timeout and returns what is still pending. Damage the
spool reader found (corrupt or invalid frames) is inserted as `events_lost`
events (sandbox_id "", extra.reason "spool_damage", event_id derived from
the spool id, segment and offset, so it too is inserted once) and logged.
"""
from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

from agent.errors import DsecError
from agent.spool import Batch, Damage, Spool
from audit_schema.events import FIELDS, default

log = logging.getLogger("dsec.exporter.clickhouse")

SINK = "clickhouse"
_COLUMNS = ", ".join(f.name for f in FIELDS)
_MIGRATED: set = set()       # (url, db) migrated by this process


@dataclass
class FlushResult:
    sent: int = 0               # records inserted by this call
    damaged: int = 0            # spool regions reported as lost
    pending: int = 0            # records still in the spool for this sink
    pending_bytes: int = 0
    error: str | None = None    # the last failure, when something is pending
    fatal: bool = False         # retrying will not help (e.g. schema too new)

    @property
    def ok(self) -> bool:
        return self.pending == 0 and self.error is None

    def summary(self) -> str:
        s = f"{self.sent} event(s) sent to ClickHouse"
        if self.damaged:
            s += f", {self.damaged} damaged spool region(s) reported"
        if self.pending:
            s += f", {self.pending} still in the spool"
        if self.error:
            s += f" ({self.error})"
        return s


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if "Stack trace" in text:
        text = text.split("Stack trace")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__


def columns_for(records: list[dict]) -> list[list]:
    """Records -> one list per FIELDS column, String columns as exact bytes."""
    cols = []
    enc = str.encode   # == audit_schema.events.to_bytes, inlined: this loop is hot
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


def damage_event(d: Damage, spool: Spool) -> dict:
    """An events_lost record marking a gap the spool could not deliver."""
    node = socket.gethostname()
    eid = hashlib.sha256(f"spool-damage\0{spool.id}\0{d.segment}\0{d.offset}".encode()).hexdigest()[:32]
    extra = {"reason": "spool_damage", "detail": d.reason, "spool": spool.path, "segment": d.segment,
             "offset": d.offset, "bytes": d.length}
    if d.payload is not None:
        extra["payload"] = d.payload[:65536]
    return {"event_id": eid, "ts_ns": d.ts_ns or time.time_ns(), "node": node, "kind": "events_lost",
            "count": d.frames, "extra": json.dumps(extra, ensure_ascii=True)}


class ClickHouseExporter:
    def __init__(self, spool: Spool | None = None, url: str | None = None, *, sink: str = SINK,
                 batch_records: int = 10000, connect_timeout: float = 3.0):
        self.spool = spool or Spool()
        self._url = url
        self.sink = sink
        self.batch_records = batch_records
        self.connect_timeout = connect_timeout
        self.reader = self.spool.reader(sink)
        self._client = None
        self._db = None
        self._key = None
        self.total_sent = 0
        self.total_damaged = 0

    @property
    def url(self) -> str:
        """The given URL, else DSEC_CLICKHOUSE_URL or the private server's. In
        the default case every reconnect re-checks the private server and
        restarts it if it died (costs a pid check when it is up)."""
        if self._url is not None:
            return self._url
        from agent.clickhouse_server import ensure_clickhouse
        return ensure_clickhouse()

    def _connected(self):
        if self._client is None:
            from agent.clickhouse_server import connect
            from audit_schema.migrations import migrate
            url = self.url
            client, db = connect(url, connect_timeout=self.connect_timeout)
            key = (url, db)
            if key not in _MIGRATED:
                migrate(client, db)
                _MIGRATED.add(key)
            self._client, self._db, self._key = client, db, key
        return self._client

    def _drop_client(self):
        if self._client is not None:
            try:
                self._client.disconnect()
            except Exception:
                pass
        self._client = None

    def close(self):
        self._drop_client()
        self.reader.close()

    def insert(self, records: list[dict]) -> None:
        """One batched native INSERT (raises on failure)."""
        client = self._connected()
        try:
            client.execute(f"INSERT INTO {self._db}.events ({_COLUMNS}) VALUES", columns_for(records),
                           columnar=True, types_check=False, settings={"strings_as_bytes": True})
        except Exception as e:
            if getattr(e, "code", None) in (60, 81):  # table / database gone: migrate on the next try
                _MIGRATED.discard(self._key)
            raise

    def _send(self, batch: Batch) -> int:
        rows = list(batch.records) + [damage_event(d, self.spool) for d in batch.damage]
        if rows:
            self.insert(rows)
        self.reader.commit(batch)
        return len(batch.records)

    def flush(self, timeout: float = 30.0) -> FlushResult:
        """Deliver everything in the spool now, retrying until `timeout` seconds
        have passed. Never raises for an outage: the result says what is pending."""
        deadline = time.monotonic() + timeout
        res = FlushResult()
        if not self.reader.lock(timeout):
            res.error = f"another process is delivering spool {self.spool.path} to ClickHouse"
            res.pending, res.pending_bytes = self.reader.backlog()
            return res
        try:
            backoff = 0.1
            while True:
                try:
                    batch = self.reader.read(self.batch_records)
                    if not batch:
                        res.error = None
                        break
                    n = self._send(batch)
                    res.sent += n
                    res.damaged += len(batch.damage)
                    self.total_sent += n
                    self.total_damaged += len(batch.damage)
                    backoff = 0.1
                except DsecError as e:   # configuration: schema newer, bad URL ...
                    self._drop_client()
                    res.error, res.fatal = e.message, True
                    break
                except Exception as e:   # outage, network, server-side error: retry
                    self._drop_client()
                    res.error = _first_line(e)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    time.sleep(min(backoff, left))
                    backoff = min(backoff * 2, 2.0)
        finally:
            self.reader.unlock()
        res.pending, res.pending_bytes = self.reader.backlog()
        if res.pending == 0 and res.error and not res.fatal:
            res.error = None
        return res

    def run(self, stop: threading.Event, interval: float = 0.5, on_result=None):
        """Deliver until `stop` is set; logs outages (once per change)."""
        last_error = None
        while not stop.is_set():
            res = self.flush(timeout=min(5.0, max(interval, 0.1) * 4))
            if on_result:
                on_result(res)
            if res.error != last_error:
                if res.error:
                    log.warning("ClickHouse export stalled, %d event(s) waiting in %s: %s",
                                res.pending, self.spool.path, res.error)
                elif last_error:
                    log.warning("ClickHouse export resumed")
                last_error = res.error
            stop.wait(interval if not res.error else min(10.0, interval * 4))
        self.flush(timeout=min(5.0, interval * 4))


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


__all__ = ["ClickHouseExporter", "FlushResult", "SINK", "columns_for", "damage_event", "export_forever", "flush"]
