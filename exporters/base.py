"""The loop every sink shares: spool cursor, batching, retry with backoff and
jitter, damage -> events_lost, metrics.

A sink subclasses SpoolSink and implements deliver(records) (raise on
failure; return only once the destination has the records). Everything else
is here:

    sink = JsonlSink(spool, path="/var/log/dsec/audit.jsonl")
    res = sink.flush(timeout=10)      # deliver everything now (end of `dsec run`); never raises
    sink.run(stop_event)              # a long-running agent thread
    sink.close()

Delivery contract (for every sink):
  * read a batch (at most `batch_records`) at this sink's own cursor, deliver
    it, and only then commit the cursor: at-least-once. A crash or an outage
    between delivery and commit re-sends the batch; each sink makes that
    harmless in its own way (ClickHouse: ReplacingMergeTree on event_id;
    JSON lines: the file is cut back to its committed size; OTLP: every log
    record carries log.record.uid = event_id, spans have deterministic ids).
  * a failed delivery is retried with exponential backoff and jitter
    (RetryPolicy); the records stay in the spool meanwhile. One sink's outage
    never delays another: each sink has its own cursor, its own thread (see
    exporters/configure.start_sinks) and its own reader lock.
  * damage the spool found (corrupt frames, torn writes, and segments the
    disk budget evicted before this sink read them) is delivered as
    `events_lost` records (damage_event) in the same batch, so the gap shows
    in the destination, and counted in dsec.events.lost.
  * ExportError from deliver() is fatal for this flush (a configuration
    problem: schema too new, bad URL ...): no retry until the next flush.

Batching and flushing: `batch_records` caps a batch; `flush_interval` is the
longest a record waits in the spool while the sink keeps up (run() delivers
what the spool held when the pass began, then waits flush_interval, or less
when poked).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import socket
import time
from dataclasses import dataclass

from exporters.errors import ExportError
from audit_schema.errors import ReportedError
from exporters.spool import Batch, Damage, Spool
from audit_schema.events import normalize as _normalize

log = logging.getLogger("dsec.exporter")


def normalize(rec: dict) -> dict:
    """audit_schema's normalize without the unknown-field check (spool records are validated)."""
    return _normalize(rec, check=False)


@dataclass
class RetryPolicy:
    """Exponential backoff with jitter: attempt k (1-based) waits
    min(maximum, initial * multiplier**(k-1)) scaled by a random factor in
    [1 - jitter, 1] ("equal jitter" when jitter = 0.5): many agents hitting one
    recovering server do not retry in lockstep, and waits never exceed
    `maximum`."""
    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * (self.multiplier ** max(0, attempt - 1)))
        return base * (1.0 - self.jitter * random.random())


@dataclass
class FlushResult:
    sent: int = 0               # records delivered by this call
    damaged: int = 0            # spool regions reported as lost
    pending: int = 0            # records still in the spool for this sink
    pending_bytes: int = 0
    error: str | None = None    # the last failure, when something is pending
    fatal: bool = False         # retrying will not help (e.g. schema too new)
    label: str = "ClickHouse"   # the destination, for summary()

    @property
    def ok(self) -> bool:
        return self.pending == 0 and self.error is None

    def summary(self) -> str:
        s = f"{self.sent} event(s) sent to {self.label}"
        if self.damaged:
            s += f", {self.damaged} damaged spool region(s) reported"
        if self.pending:
            s += f", {self.pending} still in the spool"
        if self.error:
            s += f" ({self.error})"
        return s

    def as_dict(self) -> dict:
        return {"sent": self.sent, "damaged": self.damaged, "pending": self.pending, "error": self.error}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    if "Stack trace" in text:
        text = text.split("Stack trace")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__


def damage_event(d: Damage, spool: Spool, sink: str | None = None) -> dict:
    """An events_lost record marking a gap the spool could not deliver. Its
    event_id and ts_ns are derived from the damage alone, so a re-send is the
    same event."""
    node = socket.gethostname()
    if d.cause == "sink_evicted":
        eid = hashlib.sha256(f"sink-evicted\0{spool.id}\0{sink}\0{d.segment}\0{d.offset}".encode()).hexdigest()[:32]
    elif d.index is not None:       # one record of a batch frame: the frame's offset and its index
        eid = hashlib.sha256(f"spool-damage\0{spool.id}\0{d.segment}\0{d.offset}\0{d.index}".encode()).hexdigest()[:32]
    else:
        eid = hashlib.sha256(f"spool-damage\0{spool.id}\0{d.segment}\0{d.offset}".encode()).hexdigest()[:32]
    extra = {"reason": d.cause, "detail": d.reason, "spool": spool.path, "segment": d.segment,
             "offset": d.offset, "bytes": d.length}
    if d.cause == "sink_evicted":
        extra["sink"] = sink
    if d.index is not None:
        extra["index"] = d.index
    if d.payload is not None:
        extra["payload"] = d.payload[:65536]
    return {"event_id": eid, "ts_ns": d.ts_ns or time.time_ns(), "node": node, "kind": "events_lost",
            "count": d.frames, "extra": json.dumps(extra, ensure_ascii=True)}


def _metrics():
    from exporters.metrics import METRICS
    return METRICS


class SpoolSink:
    """Base of every sink (see the module doc). Subclasses set `kind`/`label`
    and implement deliver(); they may override prepare_batch() (records ->
    what deliver() takes), committed_state() (stored with the cursor) and
    close()."""

    kind = "sink"               # clickhouse | otlp | jsonl
    label = "sink"              # for messages: "ClickHouse", "OTLP collector", "JSON lines"
    evictable = False           # a best-effort sink: the disk budget may evict its backlog

    def __init__(self, spool: Spool | None = None, *, sink: str | None = None, batch_records: int = 10000,
                 flush_interval: float = 0.5, retry: RetryPolicy | None = None, evictable: bool | None = None):
        if batch_records < 1:
            raise ExportError(f"{self.label}: batch_records must be >= 1, got {batch_records}")
        self.spool = spool or Spool()
        self.sink = sink or self.kind
        self.name = self.sink
        self.batch_records = batch_records
        self.flush_interval = flush_interval
        self.retry = retry or RetryPolicy()
        self.reader = self.spool.reader(self.sink, self.evictable if evictable is None else evictable)
        self.total_sent = 0
        self.total_damaged = 0
        self.attempts = 0           # consecutive failed attempts (backoff state)
        self.last_error: str | None = None
        import weakref
        ref = weakref.ref(self)
        _metrics().add_gauge("dsec.spool.backlog", f"{self.spool.path}\0{self.sink}",
                             lambda: s._backlog_gauge() if (s := ref()) is not None else {})

    # -- to implement -----------------------------------------------------------------
    def deliver(self, records: list[dict]) -> None:
        raise NotImplementedError

    def deliver_batch(self, batch: Batch) -> None:
        """Deliver one batch: its records and an events_lost row per damage. A sink
        that can use the batch's columns (Batch.columns, no dict per record)
        overrides this; the default is deliver(self.rows_of(batch))."""
        self.deliver(self.rows_of(batch))

    def committed_state(self):
        """JSON-able state committed with the cursor after a delivery (Spool._KEEP: unchanged)."""
        return Spool._KEEP

    def close(self):
        self.reader.close()

    # -- the shared machinery -----------------------------------------------------------
    def _backlog_gauge(self) -> dict:
        pos = self.spool.load_cursor(self.sink)
        return {(("sink", self.sink),): self.spool.bytes_behind(pos)} if pos else {}

    def rows_of(self, batch: Batch) -> list[dict]:
        """The batch's records plus an events_lost record per damage."""
        return list(batch.records) + self.damage_rows(batch)

    def damage_rows(self, batch: Batch) -> list[dict]:
        """An events_lost record per damage of the batch."""
        return [normalize(damage_event(d, self.spool, self.sink)) for d in batch.damage]

    def _send(self, batch: Batch) -> int:
        n = batch.count
        if n or batch.damage:
            t = time.monotonic()
            self.deliver_batch(batch)
            m = _metrics()
            m.record("dsec.export.duration", time.monotonic() - t, sink=self.sink)
            oldest = batch.oldest_ts()       # batch frames: from the columns, no dicts to walk
            if oldest:
                m.record("dsec.export.latency", max(0.0, (time.time_ns() - oldest) / 1e9), sink=self.sink)
        self.reader.commit(batch, self.committed_state())
        m = _metrics()
        m.add("dsec.events.exported", n, sink=self.sink)
        for d in batch.damage:
            if d.cause == "spool_damage":      # evictions were counted when they happened
                m.add("dsec.events.lost", d.frames, reason=d.cause, sink=self.sink)
        return n

    def flush(self, timeout: float = 30.0) -> FlushResult:
        """Deliver everything in the spool now, retrying until `timeout` seconds
        have passed. Never raises for an outage: the result says what is pending.
        What is appended while it delivers waits for the next flush: under a steady
        stream of records, run() would otherwise send one small batch after another
        with no pause (each as long as the last insert took), and a ClickHouse insert
        costs the server a new part (a file per column) to write and merge whatever
        its size: 1 pass each flush_interval keeps the batches large."""
        deadline = time.monotonic() + timeout
        res = FlushResult(label=self.label)
        if not self.reader.lock(timeout):
            res.error = f"another process is delivering spool {self.spool.path} to {self.label} (sink {self.sink})"
            res.pending, res.pending_bytes = self.reader.backlog()
            return res
        try:
            head = self.spool.head()
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
                    self.attempts = 0
                    if batch.end >= head:
                        res.error = None
                        break               # the rest came after this flush began
                except ReportedError as e:   # configuration: schema newer (SchemaError), bad URL ...
                    self._on_failure(e)
                    res.error, res.fatal = e.message, True
                    break
                except Exception as e:   # outage, network, server-side error: retry
                    self._on_failure(e)
                    res.error = first_line(e)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    time.sleep(min(self.retry.delay(self.attempts), left))
        finally:
            self.reader.unlock()
        res.pending, res.pending_bytes = self.reader.backlog()
        if res.pending == 0 and res.error and not res.fatal:
            res.error = None
        self.last_error = res.error
        return res

    def _on_failure(self, e: BaseException):
        self.attempts += 1
        _metrics().add("dsec.export.errors", 1, sink=self.sink)
        self.reset_connection()

    def reset_connection(self):
        """Called after a failed delivery: drop connections so the next try reconnects."""

    def run(self, stop, interval: float | None = None, on_result=None):
        """Deliver until `stop` (threading.Event-like: is_set/wait) is set; logs an
        outage once and its end once. Waits `interval` (default flush_interval)
        between passes while healthy, the retry backoff while failing."""
        interval = self.flush_interval if interval is None else interval
        last_error = None
        while not stop.is_set():
            res = self.flush(timeout=min(5.0, max(interval, 0.1) * 4))
            if on_result:
                on_result(res)
            if res.error != last_error:
                if res.error:
                    log.warning("%s export (sink %s) stalled, %d event(s) waiting in %s: %s",
                                self.label, self.sink, res.pending, self.spool.path, res.error)
                elif last_error:
                    log.warning("%s export (sink %s) resumed", self.label, self.sink)
                last_error = res.error
            if res.error:
                wait = 30.0 if res.fatal else max(interval, self.retry.delay(max(1, self.attempts)))
            else:
                wait = interval
            stop.wait(wait)
        self.flush(timeout=min(5.0, max(interval, 0.1) * 4))


__all__ = ["FlushResult", "RetryPolicy", "SpoolSink", "damage_event", "first_line", "normalize"]
