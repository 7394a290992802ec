"""Denial records a reviewer can read: identical denials aggregated.

    agg = DenialAggregator()
    for rec in agg.offer(rec): emit(rec)      # the first of a kind passes at once
    for rec in agg.due(): emit(rec)           # summaries of repeats, at most every SUMMARY_S per key
    for rec in agg.flush(sandbox_id): emit(rec)   # at the sandbox's end: every pending summary

The decision itself (allowed | denied | would-deny | failed) is policies.evaluate's;
this module only keeps the record short. A record whose decision is denied,
would-deny or failed passes the first time its key is seen -- (sandbox, step,
kind, decision, path, path2, addr, port, protocol, the name as given (path_raw)
and the kernel's status bits (extra.status: why it was refused); a path placed
best-effort can make two different refusals one path) -- and later identical ones
are counted instead of recorded: one summary record per key then carries
`count` (the occurrences since the last record of that key, as syscall records
do), and in `extra` aggregated=true, total (all occurrences so far, the first
included), first_ts_ns, last_ts_ns and up to 16 pids.
Syscall records are already aggregated by the enforcement sensor (running totals)
and pass untouched; so does every allowed record (learning needs them all).

Bounded: at most MAX_KEYS keys are tracked; past that, records pass unaggregated
(never dropped).
"""
from __future__ import annotations

import json
import threading
import time

AGGREGATED = ("denied", "would-deny", "failed")
SKIP_KINDS = ("syscall_denied", "syscall_violation", "events_lost")
KEY_FIELDS = ("sandbox_id", "step", "kind", "decision", "path", "path2", "addr", "port", "protocol", "path_raw")
SUMMARY_S = 10.0
MAX_KEYS = 100_000
MAX_PIDS = 16


class DenialAggregator:
    def __init__(self, new_event_id, *, summary_s: float = SUMMARY_S, max_keys: int = MAX_KEYS):
        self.new_event_id = new_event_id
        self.summary_s = summary_s
        self.max_keys = max_keys
        self._keys: dict[tuple, dict] = {}     # key -> {first, total, n (since last summary), first_ts, last_ts, pids, at}
        self._lock = threading.Lock()          # offer() runs on the poll thread, flush() on the caller's

    def offer(self, rec: dict) -> list[dict]:
        if rec.get("decision") not in AGGREGATED or rec.get("kind") in SKIP_KINDS:
            return [rec]
        with self._lock:
            return self._offer(rec)

    def _offer(self, rec: dict) -> list[dict]:
        key = tuple(rec.get(k) for k in KEY_FIELDS) + (_status(rec.get("extra")),)
        st = self._keys.get(key)
        ts = int(rec.get("ts_ns") or time.time_ns())
        if st is None:
            if len(self._keys) >= self.max_keys:
                return [rec]
            self._keys[key] = {"first": rec, "total": 1, "n": 0, "first_ts": ts, "last_ts": ts,
                               "pids": [rec.get("pid")] if rec.get("pid") else [], "at": time.monotonic()}
            return [rec]
        st["total"] += 1
        st["n"] += 1
        st["last_ts"] = max(st["last_ts"], ts)
        pid = rec.get("pid")
        if pid and pid not in st["pids"] and len(st["pids"]) < MAX_PIDS:
            st["pids"].append(pid)
        return []

    def _summary(self, st: dict) -> dict:
        first = st["first"]
        out = {k: v for k, v in first.items() if k not in ("event_id", "extra", "count")}
        out["extra"] = summary_extra(first.get("extra"), st["total"], st["first_ts"], st["last_ts"], st["pids"])
        out["event_id"] = self.new_event_id()
        out["count"] = st["n"]
        out["ts_ns"] = st["last_ts"]
        st["n"] = 0
        st["at"] = time.monotonic()
        return out

    def due(self) -> list[dict]:
        """Summaries of keys with repeats not reported for summary_s seconds."""
        now = time.monotonic()
        with self._lock:
            return [self._summary(st) for st in self._keys.values() if st["n"] and now - st["at"] >= self.summary_s]

    def flush(self, sandbox_id: str | None = None) -> list[dict]:
        """Every pending summary (of one sandbox, or all); forgets those keys."""
        out = []
        with self._lock:
            for key in [k for k in self._keys if sandbox_id is None or k[0] == sandbox_id]:
                st = self._keys.pop(key)
                if st["n"]:
                    out.append(self._summary(st))
        return out


def summary_extra(extra: str | None, total: int, first_ts: int, last_ts: int, pids, **more) -> str:
    """The extra of a summary record: the first occurrence's extra (JSON) with
    aggregated=true, total (occurrences so far, the first included),
    first_ts_ns, last_ts_ns, pids and `more` -- the one shape of the denial
    summaries here and of the repeats the kernel counts (repeats.py)."""
    try:
        d = json.loads(extra or "{}")
    except ValueError:
        d = {}
    if not isinstance(d, dict):
        d = {}
    d.update(aggregated=True, total=total, first_ts_ns=first_ts, last_ts_ns=last_ts, pids=list(pids), **more)
    return json.dumps(d, sort_keys=True)


def _status(extra) -> tuple | str | None:
    """extra.status (the kernel's reasons), for the key: refusals for different
    reasons are different refusals."""
    if not extra or '"status"' not in extra:
        return None
    try:
        st = json.loads(extra).get("status")
    except (ValueError, AttributeError):
        return extra            # not an object: the whole text keys it
    return tuple(st) if isinstance(st, list) else str(st)
