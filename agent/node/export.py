"""The node agent's ClickHouse export: spool -> ClickHouse continuously, with
a barrier for callers that want their records delivered (`dsec run
--wait-export`, QueryEvents). Two shapes, one interface:

    ex = ExporterProcess(spool, interval=1.0).start()   # the agent's: a child process
    ex = ClickHouseExport(spool, interval=1.0).start()  # a thread of this process
    pos = ex.head()                      # the spool's end, now
    ex.wait_exported(pos, timeout=10)    # True once the ClickHouse cursor passed it
    ex.backlog(), ex.restarts, ex.last_crash
    ex.close()

ExporterProcess (issue 15) runs the same ClickHouseExporter loop in a child
(`python -m agent.node.export`), so the agent's poll thread (ring read,
decode, spool append) and the exporter (spool read, columnar insert) do not
share one interpreter lock: bench/audit.py part 2 measures both shapes. The
child reads the spool with its own cursor ("clickhouse", the same one the
thread uses: one reader at a time, by the cursor's flock), and:
  - its stdin is the agent's control pipe: a byte = deliver now (the barrier
    pokes it), end of file = the agent is gone or stopping: a last pass, exit.
    So the child never outlives the agent, even one killed with SIGKILL;
  - it writes a status line (JSON) to stdout after every pass: its counters
    (events exported, delivery errors, spool damage) and delivery timings,
    which the agent adds to its own metrics (dsec.events.exported{sink=
    "clickhouse"} and the rest are the agent's figures, whichever shape);
  - its log (stderr) is forwarded line by line to the agent's log;
  - a child that exits while the agent runs (a crash, a kill, an unexpected
    error in the loop) is logged with its last lines, counted in
    dsec.exporter.restarts{sink="clickhouse"} and started again after a
    backoff (0.5 s doubling to 30 s, reset once a child has run a minute);
    the records wait in the spool meanwhile, nothing is lost.
The backlog (bytes of the spool behind the cursor) is the agent's
dsec.spool.backlog gauge, read from the cursor file.

The other sinks (OTLP, JSON lines) run from exporters/configure.py, each with
its own cursor in the same spool.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
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
            if self._thread.is_alive():
                # still in a delivery (a stalled server): not closed under it (its connection and
                # reader lock); a daemon thread, ended by the process's exit; uncommitted records
                # stay in the spool
                log.warning("ClickHouse exporter still delivering after 15s; left to the process's exit")
                return
        self.exporter.close()

    def backlog(self) -> int:
        return self.exporter.reader.backlog()[0]

    def head(self):
        """The spool's end position now."""
        return self.spool.head()

    def wait_exported(self, pos, timeout: float) -> bool:
        """True once the ClickHouse sink's cursor is at or past `pos`."""
        self._stop.poke()           # deliver now rather than at the next interval
        return cursor_reached(self.spool, pos, timeout)


def cursor_reached(spool, pos, timeout: float, step: float = 0.02) -> bool:
    """Wait up to `timeout` for the ClickHouse sink's cursor to be at or past `pos`."""
    from exporters.clickhouse import SINK
    deadline = time.monotonic() + timeout
    while True:
        cur = spool.load_cursor(SINK)
        if cur is not None and (cur.segment, cur.offset) >= (pos.segment, pos.offset):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


# ---------------------------------------------------------------- the exporter in a child process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the child's own figures the agent adds to its metrics (counters: deltas of cumulative totals)
FORWARDED_COUNTERS = ("dsec.events.exported", "dsec.export.errors", "dsec.events.lost")
FORWARDED_HISTOGRAMS = ("dsec.export.latency", "dsec.export.duration")
STOP_TIMEOUT = 15.0
URL_ENV = "DSEC_EXPORT_CHILD_URL"     # the child's ClickHouse URL (never on its command line)


class ExporterProcess:
    """The ClickHouse exporter in a child process the agent supervises (see the
    module doc). Same interface as ClickHouseExport."""

    def __init__(self, spool, interval: float, *, url: str | None = None, cluster: str | None = None,
                 insert: str = "local", ddl: str = "auto", python: str | None = None):
        from exporters.clickhouse import SINK
        from exporters.errors import ExportError, USAGE
        if insert not in ("local", "distributed"):
            raise ExportError(f"clickhouse insert {insert!r}: expected local or distributed", USAGE)
        self.spool = spool
        self.interval = interval
        self._url = url
        self.argv = [python or sys.executable, "-m", "agent.node.export", "--spool", spool.path,
                     "--interval", repr(float(interval)), "--insert", insert, "--ddl", ddl]
        self._child_env = {}
        if url is not None:
            # in the environment, not argv: a URL may carry a password, and any user can read
            # /proc/<pid>/cmdline (environ is the owner's only)
            self._child_env[URL_ENV] = url
        if cluster:
            self.argv += ["--cluster", cluster]
        # the cursor exists from now on (as the thread's exporter registers it): records
        # appended before the child's first read are behind it, never skipped
        self.reader = spool.reader(SINK, False)
        self.sink = SINK
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.last_crash = ""
        self.starts = 0
        self.status: dict = {}                  # the child's last status line
        self._totals: dict = {}                 # (name, attrs key) -> the child's cumulative total seen
        self._tail: list[str] = []              # the child's last log lines
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        from exporters.metrics import METRICS
        self._gauge_source = f"{spool.path}\0{SINK}\0process"
        METRICS.add_gauge("dsec.spool.backlog", self._gauge_source, self._backlog_gauge)

    @property
    def url(self) -> str | None:
        return self._url

    @property
    def pid(self) -> int | None:
        p = self.proc
        return p.pid if p is not None and p.poll() is None else None

    def start(self) -> "ExporterProcess":
        self._spawn()
        self._thread = threading.Thread(target=self._supervise, name="dsec-agent-export", daemon=True)
        self._thread.start()
        return self

    def _spawn(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop(URL_ENV, None)
        env.update(self._child_env)
        with self._lock:                        # close() sets _stopping under it: no child after close
            if self._stopping.is_set():
                return
            p = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=env, cwd="/", close_fds=True, start_new_session=True)
            readers = [threading.Thread(target=self._read_status, args=(p,), name="dsec-export-status",
                                        daemon=True),
                       threading.Thread(target=self._read_log, args=(p,), name="dsec-export-log", daemon=True)]
            for t in readers:
                t.start()
            self.proc, self._readers = p, readers
            self._totals = {}                   # a new child counts from zero
            self.starts += 1
        log.info("ClickHouse exporter process started (pid %d)", p.pid)

    def _supervise(self):
        from exporters.metrics import METRICS
        backoff = RESTART_BACKOFF[0]
        while True:
            p, began = self.proc, time.monotonic()
            rc = p.wait()
            for t in self._readers:
                t.join(timeout=5)
            if self._stopping.is_set():
                return
            self.restarts += 1
            tail = " | ".join(self._tail[-3:])
            self.last_crash = f"exit status {rc}" + (f": {tail}" if tail else "")
            self.last_crash = self.last_crash[:300]
            METRICS.add("dsec.exporter.restarts", 1, sink=self.sink)
            if time.monotonic() - began > 60:
                backoff = RESTART_BACKOFF[0]
            log.error("ClickHouse exporter process %d exited unexpectedly (%s); restart %d in %.1fs; events "
                      "stay in the spool", p.pid, self.last_crash, self.restarts, backoff)
            if self._stopping.wait(backoff):
                return
            try:
                self._spawn()
            except OSError as e:
                self.last_crash = f"cannot start the exporter process: {e}"[:300]
                log.error("%s; retrying in %.1fs", self.last_crash, backoff)
                self.proc = _Exited()
                self._readers = []
            backoff = min(backoff * 2, RESTART_BACKOFF[1])

    def _read_status(self, p):
        from exporters.metrics import METRICS
        for line in p.stdout:
            try:
                st = json.loads(line)
            except ValueError:
                continue
            self.status = st
            for name, attrs, total in st.get("counters", ()):
                k = (name, tuple(sorted(attrs.items())))
                delta = total - self._totals.get(k, 0)
                self._totals[k] = total
                if delta > 0 and name in FORWARDED_COUNTERS:
                    METRICS.add(name, delta, **attrs)
            for name, attrs, value in st.get("timings", ()):
                if name in FORWARDED_HISTOGRAMS:
                    METRICS.record(name, value, **attrs)

    def _read_log(self, p):
        for raw in p.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            self._tail.append(line)
            del self._tail[:-20]
            log.warning("clickhouse exporter[%d]: %s", p.pid, line)

    def _poke(self):
        p = self.proc
        if p is None or p.stdin is None:
            return
        try:
            p.stdin.write(b"p")
            p.stdin.flush()
        except (OSError, ValueError):
            pass                                 # it is gone: the supervisor restarts it

    def close(self):
        from exporters.metrics import METRICS
        with self._lock:                        # a restart under way either finished or will not start
            self._stopping.set()
            p = self.proc
        if p is not None and p.stdin is not None:
            try:
                p.stdin.close()                  # end of file: a last pass, then exit
            except OSError:
                pass
            try:
                p.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.warning("ClickHouse exporter process %d did not stop in %.0fs: SIGTERM", p.pid, STOP_TIMEOUT)
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self._thread is not None:
            self._thread.join(timeout=10)
        METRICS.remove_gauge("dsec.spool.backlog", self._gauge_source)
        self.reader.close()

    def _backlog_gauge(self) -> dict:
        pos = self.spool.load_cursor(self.sink)
        return {(("sink", self.sink),): self.spool.bytes_behind(pos)} if pos else {}

    def backlog(self) -> int:
        return self.reader.backlog()[0]

    head = ClickHouseExport.head

    def wait_exported(self, pos, timeout: float) -> bool:
        """True once the ClickHouse sink's cursor is at or past `pos`."""
        self._poke()                # deliver now rather than at the next interval
        return cursor_reached(self.spool, pos, timeout)


class _Exited:
    """Stands for a child that could not be started (wait() returns at once)."""
    pid = 0
    stdin = None

    def wait(self, timeout=None):
        return -1

    def poll(self):
        return -1


def _child_main(argv=None) -> int:
    """The exporter process: ClickHouseExporter.run on the agent's spool until its
    stdin ends (see the module doc)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m agent.node.export")
    ap.add_argument("--spool", required=True)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--cluster")
    ap.add_argument("--insert", default="local")
    ap.add_argument("--ddl", default="auto")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the agent stops it (stdin), not the terminal
    from exporters.clickhouse import ClickHouseExporter
    from exporters.metrics import METRICS
    from exporters.spool import Spool
    stop = _Pokeable()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    timings: list = []
    real_record = METRICS.record

    def record(name, value, **attrs):                # delivery timings: to the agent too
        real_record(name, value, **attrs)
        if name in FORWARDED_HISTOGRAMS and len(timings) < 1000:
            timings.append((name, attrs, value))
    METRICS.record = record

    def control():
        fd = sys.stdin.buffer.fileno()
        while True:
            try:
                b = os.read(fd, 4096)
            except InterruptedError:
                continue
            except OSError:
                b = b""
            if not b:
                stop.set()
                return
            stop.poke()
    threading.Thread(target=control, name="control", daemon=True).start()
    out = sys.stdout

    def report(res):
        counters = [(name, dict(k), v) for name in FORWARDED_COUNTERS
                    for k, v in METRICS.counters(name).items()]
        st = {"sent": res.sent, "pending": res.pending, "error": res.error, "counters": counters,
              "timings": timings[:]}
        timings.clear()
        try:
            out.write(json.dumps(st) + "\n")
            out.flush()
        except (OSError, ValueError):
            stop.set()                               # the agent is gone

    spool = Spool(a.spool)
    exp = ClickHouseExporter(spool, os.environ.pop(URL_ENV, None), cluster=a.cluster, insert=a.insert, ddl=a.ddl)
    prof = _profiler()
    try:
        exp.run(stop, interval=a.interval, on_result=report)
    finally:
        exp.close()
        spool.close()
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ[PROFILE_ENV])
    return 0


PROFILE_ENV = "DSEC_EXPORT_PROFILE"     # a file: the child runs under cProfile and writes its stats there at exit


def _profiler():
    """A running cProfile.Profile when PROFILE_ENV names a file (benchmarks: where
    the exporter child's CPU goes, end to end; `python -m pstats FILE`), else None."""
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    return prof


if __name__ == "__main__":
    sys.exit(_child_main())
