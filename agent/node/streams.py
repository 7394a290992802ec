"""Live audit streams (StreamEvents, `dsec agent tail`): every record the agent
spools also goes to the subscribers whose filters it matches.

    streams = EventStreams(max_subscribers=16, buffer=10000, labels_of=agent.labels_of)
    spool = TapSpool(Spool(), streams.offer)           # the recorder writes through the tap
    for item in streams.subscribe(sandboxes, kinds, decisions, labels, is_active, stopped):
        ...                                            # ("event", rec) | ("lost", n, why)

A subscriber that falls behind loses records from its own stream only (a
bounded buffer); that is counted and told to it, never silent, and the
records are in the spool and ClickHouse anyway.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

from agent.node.records import STREAM_POLL, ApiError, _bad

log = logging.getLogger("dsec.agent")


class TapSpool:
    """The recorder's spool with a tap: records appended are also handed to
    `on_records` (the StreamEvents fan-out), and `before_append()` is called before
    each append (agent/node/daemon.py _emits_gate). Everything else is the Spool's."""

    def __init__(self, spool, on_records, before_append=None):
        self._spool = spool
        self._on_records = on_records
        self._before_append = before_append

    def append_many(self, records, on_locked=None) -> int:
        records = list(records)
        if self._before_append is not None:
            self._before_append()
        n = self._spool.append_many(records, on_locked)
        try:
            self._on_records(records)
        except Exception:  # noqa: BLE001 - a subscriber must never break the audit
            log.exception("event stream tap failed")
        return n

    def append(self, record: dict) -> None:
        self.append_many([record])

    def __getattr__(self, name):
        return getattr(self._spool, name)


class Subscriber:
    """One StreamEvents caller: filters and a bounded buffer. Overflow is
    counted and reported to the subscriber (a `lost` message), never silent."""

    def __init__(self, sandboxes, kinds, decisions, labels, maxlen, labels_of):
        self.sandboxes = set(sandboxes)
        self.kinds = set(kinds)
        self.decisions = set(decisions)
        self.labels = dict(labels)
        self.maxlen = maxlen
        self.labels_of = labels_of
        self.q: deque = deque()
        self.dropped = 0
        self.cond = threading.Condition()
        self.closed = False

    def matches(self, r: dict) -> bool:
        if self.sandboxes and r.get("sandbox_id") not in self.sandboxes:
            return False
        if self.kinds and r.get("kind") not in self.kinds:
            return False
        if self.decisions and (r.get("decision") or "") not in self.decisions:
            return False
        if self.labels:
            have = self.labels_of(r.get("sandbox_id") or "")
            if any(have.get(k) != v for k, v in self.labels.items()):
                return False
        return True

    def offer(self, records):
        with self.cond:
            n = 0
            for r in records:
                if self.matches(r):
                    if len(self.q) >= self.maxlen:
                        self.dropped += 1
                    else:
                        self.q.append(r)
                        n += 1
            if n or self.dropped:
                self.cond.notify_all()

    def take(self, timeout: float):
        with self.cond:
            if not self.q and not self.dropped and not self.closed:
                self.cond.wait(timeout)
            items, self.q = list(self.q), deque()
            dropped, self.dropped = self.dropped, 0
            return items, dropped

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class EventStreams:
    def __init__(self, max_subscribers: int, buffer: int, labels_of):
        self.max_subscribers = max_subscribers
        self.buffer = buffer
        self.labels_of = labels_of
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()

    def offer(self, records):
        with self._lock:
            subs = list(self._subs)
        for s in subs:
            s.offer(records)

    def close_all(self):
        with self._lock:
            for s in self._subs:
                s.close()

    def subscribe(self, sandboxes, kinds, decisions, labels, is_active, stopped):
        """A generator of ("event", record) and ("lost", n, why) until is_active()
        or stopped() says otherwise. Bad filters raise ApiError before anything."""
        from audit_schema.events import KINDS
        for k in kinds:
            if k not in KINDS:
                raise _bad(f"kinds: {k[:40]!r} is not an event kind ({', '.join(KINDS)})")
        for d in decisions:
            if d not in ("allowed", "denied", "would-deny"):
                raise _bad(f"decisions: {d[:40]!r}: expected allowed, denied or would-deny")
        return self._stream(Subscriber(sandboxes, kinds, decisions, labels, self.buffer, self.labels_of),
                            is_active, stopped)

    def _stream(self, sub, is_active, stopped):
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                raise ApiError("RESOURCE_EXHAUSTED", f"{len(self._subs)} event streams are open "
                                                     f"(limits.max_stream_subscribers)")
            self._subs.append(sub)
        try:
            while is_active() and not stopped():
                items, dropped = sub.take(STREAM_POLL)
                if dropped:
                    yield ("lost", dropped, f"this stream fell behind: {dropped} event(s) were not delivered to it "
                                            f"(they are in the spool and ClickHouse)")
                for r in items:
                    yield ("event", r)
                if sub.closed:
                    return
        finally:
            with self._lock:
                if sub in self._subs:
                    self._subs.remove(sub)
