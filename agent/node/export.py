"""The node agent's ClickHouse export: spool -> ClickHouse continuously, in a
thread of its own, with a barrier for callers that want their records
delivered (`dsec run --wait-export`, QueryEvents).

    ex = ClickHouseExport(spool, interval=1.0).start()
    pos = ex.head()                      # the spool's end, now
    ex.wait_exported(pos, timeout=10)    # True once the ClickHouse cursor passed it
    ex.close()

The other sinks (OTLP, JSON lines) run from exporters/configure.py, each with
its own cursor in the same spool.
"""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("dsec.agent")


class _Pokeable:
    """The exporter loop's stop event (is_set/wait/set), whose wait() also returns
    early when poked: a caller waiting for its records to reach ClickHouse
    (`dsec run`, QueryEvents) has them delivered now, not at the next interval."""

    def __init__(self):
        self._stop = False
        self._poked = False
        self._cond = threading.Condition()

    def is_set(self) -> bool:
        return self._stop

    def set(self):
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def poke(self):
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    def wait(self, timeout=None) -> bool:
        with self._cond:
            if not self._stop and not self._poked:
                self._cond.wait(timeout)
            self._poked = False
            return self._stop


RESTART_BACKOFF = (0.5, 30.0)     # first and longest wait before the exporter loop restarts


class ClickHouseExport:
    """The exporter loop in a thread that does not die: an unexpected error (a
    bug, a driver exception the sink does not classify) is logged with its
    traceback, counted in dsec.exporter.restarts{sink="clickhouse"} and the
    loop restarts after a backoff (0.5 s doubling to 30 s, reset once a pass
    has run for a minute); the records wait in the spool meanwhile."""

    def __init__(self, spool, interval: float, *, url: str | None = None, cluster: str | None = None,
                 insert: str = "local", ddl: str = "auto"):
        from exporters.clickhouse import ClickHouseExporter
        self.spool = spool                      # exporters.spool.Spool
        self.interval = interval
        self.exporter = ClickHouseExporter(spool, url, cluster=cluster, insert=insert, ddl=ddl)
        self._stop = _Pokeable()
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self.last_crash = ""

    @property
    def url(self) -> str:
        return self.exporter._url

    def start(self) -> "ClickHouseExport":
        self._thread = threading.Thread(target=self._run, name="dsec-agent-export", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        from exporters.metrics import METRICS
        backoff = RESTART_BACKOFF[0]
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.exporter.run(self._stop, interval=self.interval)
                return
            except Exception as e:  # noqa: BLE001 - the thread restarts; records wait in the spool
                self.restarts += 1
                self.last_crash = f"{type(e).__name__}: {e}"[:300]
                METRICS.add("dsec.exporter.restarts", 1, sink="clickhouse")
                if time.monotonic() - began > 60:
                    backoff = RESTART_BACKOFF[0]
                log.exception("ClickHouse exporter failed unexpectedly (restart %d in %.1fs); events stay "
                              "in the spool", self.restarts, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF[1])

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.exporter.close()

    def backlog(self) -> int:
        return self.exporter.reader.backlog()[0]

    def head(self):
        """The spool's end position now."""
        from exporters.spool import Position
        sp = self.spool
        segs = sp.segments()
        if not segs:
            return Position(1, 0)
        try:
            size = os.path.getsize(sp.seg_path(segs[-1]))
        except OSError:
            size = 0
        return Position(segs[-1], size)

    def wait_exported(self, pos, timeout: float) -> bool:
        """True once the ClickHouse sink's cursor is at or past `pos`."""
        from exporters.clickhouse import SINK
        deadline = time.monotonic() + timeout
        self._stop.poke()           # deliver now rather than at the next interval
        while True:
            cur = self.spool.load_cursor(SINK)
            if cur is not None and (cur.segment, cur.offset) >= (pos.segment, pos.offset):
                return True
            if cur is not None and cur.segment > pos.segment:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
