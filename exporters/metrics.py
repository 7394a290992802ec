"""The agent's own telemetry: counters, gauges and histograms about the audit
pipeline, kept in-process and exported with opentelemetry-sdk metrics.

    from exporters.metrics import METRICS
    METRICS.add("dsec.events.exported", 500, sink="clickhouse")
    METRICS.record("dsec.export.duration", 0.012, sink="clickhouse")
    METRICS.snapshot()                       # {"dsec.events.exported": {(("sink", "clickhouse"),): 500}, ...}
    METRICS.configure(otlp=True)             # + an OTLP/gRPC metric exporter (OTEL_* environment)
    METRICS.force_flush(); METRICS.shutdown()

The values always live here (a lock and a few dicts: cheap enough to be
updated from the spool's append path); `configure()` builds an SDK
MeterProvider whose observable counters and gauges read them, and whose
histograms receive every recorded value from then on. Without configure()
nothing leaves the process (an InMemoryMetricReader is attached, so
`collect()` returns what an exporter would see).

Most figures need no call from the agent: the spool reports records
received/spooled/lost (exporters/spool.py calls observe_records/add), the sinks
report exports (exporters/base.py), and lifecycle records give the
sandboxes-by-state gauge and the launch latency histogram. A daemon that
knows its sandboxes better may replace the derived gauge with
`set_sandbox_source(fn)` (fn() -> {state: count}).

Instruments (INSTRUMENTS below is the list; docs/exporters.md has the table):
  dsec.events.received      counter   records handed to the spool, by kind
  dsec.events.spooled       counter   records durably appended, by kind
  dsec.events.exported      counter   records delivered, by sink
  dsec.events.lost          counter   events missing from the record, by reason (and sink
                                      for losses of one sink only)
  dsec.export.errors        counter   failed delivery attempts, by sink
  dsec.ringbuf.lag          histogram seconds from the kernel event to its append to the spool
  dsec.export.latency       histogram seconds from the event to its delivery (oldest record of
                                      each delivered batch), by sink
  dsec.export.duration      histogram seconds one delivery call took, by sink
  dsec.sandbox.launch.duration histogram seconds from request (or sandbox_start) to running
  dsec.scheduler.wait       histogram seconds an agent sandbox waited in the queue (on admission)
  dsec.steps                counter   steps ended, by outcome (ok, failed, timed_out, oom_killed)
  dsec.sandbox.starts       counter   sandbox inits started, by path (clone3 | posix_spawn: the fallback,
                                      agent/sandbox/spawn.py)
  dsec.sandbox.netns        counter   clone3 starts by where their network namespace came from (pool: made
                                      ahead, agent/sandbox/netpool.py | clone: made by the start's clone)
  dsec.sandboxes            gauge     live sandboxes, by state
  dsec.spool.usage          gauge     bytes of the spool's segments
  dsec.spool.backlog        gauge     bytes not yet delivered, by sink
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

log = logging.getLogger("dsec.metrics")

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# name -> (type, unit, description)
INSTRUMENTS: dict[str, tuple[str, str, str]] = {
    "dsec.events.received": (COUNTER, "{event}", "audit records handed to the spool"),
    "dsec.events.spooled": (COUNTER, "{event}", "audit records durably appended to the spool"),
    "dsec.events.exported": (COUNTER, "{event}", "audit records delivered to a sink"),
    "dsec.events.lost": (COUNTER, "{event}", "events missing from the audit record (ring buffer, budget, "
                                             "spool full, spool damage, sink eviction)"),
    "dsec.export.errors": (COUNTER, "{error}", "failed delivery attempts"),
    "dsec.ringbuf.lag": (HISTOGRAM, "s", "time from the kernel event to its append to the spool"),
    "dsec.export.latency": (HISTOGRAM, "s", "time from the event to its delivery (oldest record of a batch)"),
    "dsec.export.duration": (HISTOGRAM, "s", "duration of one delivery call"),
    "dsec.sandbox.launch.duration": (HISTOGRAM, "s", "time from a sandbox's request to running"),
    "dsec.scheduler.wait": (HISTOGRAM, "s", "time an agent sandbox waited in the scheduler's queue"),
    "dsec.steps": (COUNTER, "{step}", "steps ended, by outcome"),
    "dsec.sandbox.starts": (COUNTER, "{sandbox}", "sandbox inits started, by path (clone3: born in its cgroups; "
                                                  "posix_spawn: the fallback)"),
    "dsec.sandbox.netns": (COUNTER, "{sandbox}", "clone3 starts by where their network namespace came from "
                                                 "(pool: made ahead; clone: by the start's clone)"),
    "dsec.sandboxes": (GAUGE, "{sandbox}", "live sandboxes by state"),
    "dsec.spool.usage": (GAUGE, "By", "bytes of the spool's segment files"),
    "dsec.spool.backlog": (GAUGE, "By", "spool bytes not yet delivered, by sink"),
}

# local histogram buckets (seconds); the SDK uses its own default buckets
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))

# kinds the kernel produces (their ts_ns is the kernel's clock): ring-buffer lag
KERNEL_KINDS = frozenset({"exec", "fork", "exit", "connect", "open_write", "unlink", "rename",
                          "egress_denied", "egress_violation", "exec_denied", "exec_violation",
                          "syscall_denied", "syscall_violation"})

# lifecycle states (agent/node/daemon.py) -> the state a sandbox is in afterwards; None: it is gone
_STATE_OF = {
    "requested": "queued", "queued": "queued", "admitted": "starting", "warm_claimed": "starting",
    "started": "running", "step_started": "running", "step_ended": "running", "policy_updated": "running",
    "stopping": "stopping", "preempting": "stopping",
    "exited": None, "killed": None, "failed": None, "preempted": None, "cancelled": None, "cleaned": None,
    "rejected": None, "released": None,
}
_MAX_TRACKED = 100_000


def _key(attrs: dict) -> tuple:
    return tuple(sorted(attrs.items())) if attrs else ()


class _Hist:
    __slots__ = ("count", "sum", "max", "buckets")

    def __init__(self):
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self.buckets = [0] * len(BUCKETS)

    def add(self, v: float):
        self.count += 1
        self.sum += v
        if v > self.max:
            self.max = v
        for i, b in enumerate(BUCKETS):
            if v <= b:
                self.buckets[i] += 1
                break

    def as_dict(self) -> dict:
        return {"count": self.count, "sum": self.sum, "max": self.max,
                "buckets": dict(zip((str(b) for b in BUCKETS), self.buckets))}


class AgentMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, int]] = {}
        self._hists: dict[str, dict[tuple, _Hist]] = {}
        self._gauges: dict[str, dict[str, object]] = {}      # name -> {source id: fn() -> {attrs key: value}}
        self._sandboxes: dict[str, str] = {}                 # sandbox id -> state (derived from records)
        self._sandbox_t0: dict[str, int] = {}                # sandbox id -> ts_ns of its sandbox_start
        self._lifecycled: set = set()                        # sandboxes the agent reports lifecycles of
        self._sandbox_source = None
        self._provider = None
        self._otel_hists: dict = {}
        self._memory_reader = None
        self.add_gauge("dsec.sandboxes", "derived", self._sandbox_states)

    # -- updates ------------------------------------------------------------------------
    def add(self, name: str, value: int = 1, **attrs):
        if not value:
            return
        k = _key(attrs)
        with self._lock:
            c = self._counters.setdefault(name, {})
            c[k] = c.get(k, 0) + value

    def record(self, name: str, value: float, **attrs):
        k = _key(attrs)
        with self._lock:
            h = self._hists.setdefault(name, {}).get(k)
            if h is None:
                h = self._hists[name][k] = _Hist()
            h.add(value)
            inst = self._otel_hists.get(name)
        if inst is not None:
            try:
                inst.record(value, attrs or None)
            except Exception:  # noqa: BLE001 - telemetry never breaks the audit
                pass

    def add_gauge(self, name: str, source: str, fn):
        """fn() -> {attrs tuple or dict: value}; several sources may feed one gauge."""
        with self._lock:
            self._gauges.setdefault(name, {})[source] = fn

    def remove_gauge(self, name: str, source: str):
        with self._lock:
            self._gauges.get(name, {}).pop(source, None)

    def set_sandbox_source(self, fn):
        """The daemon's own view of its sandboxes: fn() -> {state: count}. Replaces
        the view derived from lifecycle records."""
        self._sandbox_source = fn

    # -- derived from the records the spool sees -----------------------------------------
    def observe_records(self, records, now_ns: int | None = None, columns: dict | None = None,
                        kinds=None):
        """Called by the spool with every batch it appended: received/spooled are
        counted by the spool itself; this derives lag, losses, lifecycle figures.
        `columns` ({field: values} of the records) and `kinds` (their count by
        kind): a batch of kernel records only (the usual one) is then read by
        column, with no Python step per record."""
        now = now_ns or time.time_ns()
        if columns is not None and kinds is not None and KERNEL_KINDS.issuperset(kinds) \
                and "ts_ns" in columns:
            oldest = min(filter(None, columns["ts_ns"]), default=0)
            if oldest:
                self.record("dsec.ringbuf.lag", max(0.0, (now - oldest) / 1e9))
            return
        oldest = 0
        lost: dict[str, int] = {}
        launches = []
        for r in records:
            kind = r.get("kind")
            if kind in KERNEL_KINDS:
                ts = r.get("ts_ns") or 0
                if ts and (not oldest or ts < oldest):
                    oldest = ts
            elif kind == "events_lost":
                reason = "unknown"
                try:
                    reason = json.loads(r.get("extra") or "{}").get("reason") or reason
                except (ValueError, AttributeError):
                    pass
                if reason not in ("spool_full",):   # the spool counts its own drops when they happen
                    lost[reason] = lost.get(reason, 0) + int(r.get("count") or 0)
            elif kind == "lifecycle":
                self._lifecycle(r, launches)
            elif kind == "sandbox_start":
                sid = r.get("sandbox_id") or ""
                with self._lock:
                    if sid not in self._sandboxes and len(self._sandboxes) < _MAX_TRACKED:
                        self._sandboxes[sid] = "running"
                    if len(self._sandbox_t0) < _MAX_TRACKED:
                        self._sandbox_t0[sid] = r.get("ts_ns") or now
            elif kind == "step_start":
                sid = r.get("sandbox_id") or ""
                with self._lock:
                    t0 = self._sandbox_t0.pop(sid, None)
                if t0 and r.get("ts_ns"):          # `dsec run`: launch = sandbox_start -> first step
                    launches.append(max(0.0, (r["ts_ns"] - t0) / 1e9))
            elif kind == "sandbox_exit":
                sid = r.get("sandbox_id") or ""
                with self._lock:
                    self._sandbox_t0.pop(sid, None)
                    if self._sandboxes.get(sid) == "running" and sid not in self._lifecycled:
                        self._sandboxes.pop(sid, None)
        if oldest:
            self.record("dsec.ringbuf.lag", max(0.0, (now - oldest) / 1e9))
        for reason, n in lost.items():
            self.add("dsec.events.lost", n, reason=reason)
        for s in launches:
            self.record("dsec.sandbox.launch.duration", s)

    def _lifecycle(self, r, launches):
        try:
            extra = json.loads(r.get("extra") or "{}")
        except ValueError:
            return
        state = extra.get("state")
        sid = r.get("sandbox_id") or ""
        if not sid or state not in _STATE_OF:
            return
        if state == "admitted" and isinstance(extra.get("waited_s"), (int, float)):
            self.record("dsec.scheduler.wait", max(0.0, float(extra["waited_s"])))
        elif state == "step_ended":
            outcome = ("oom_killed" if extra.get("oom_killed") else "timed_out" if extra.get("timed_out")
                       else "ok" if extra.get("code") == 0 else "failed")
            self.add("dsec.steps", 1, outcome=outcome)
        if state == "started" and not extra.get("warm") and extra.get("launch_ms") is not None:
            try:
                launches.append(float(extra["launch_ms"]) / 1000.0)
            except (TypeError, ValueError):
                pass
        with self._lock:
            new = _STATE_OF[state]
            if new is None:
                self._sandboxes.pop(sid, None)
                self._lifecycled.discard(sid)
                self._sandbox_t0.pop(sid, None)
            elif len(self._sandboxes) < _MAX_TRACKED or sid in self._sandboxes:
                self._sandboxes[sid] = new
                self._lifecycled.add(sid)
                if state == "started":
                    self._sandbox_t0.pop(sid, None)

    def _sandbox_states(self) -> dict:
        src = self._sandbox_source
        if src is not None:
            try:
                return {(("state", k),): v for k, v in (src() or {}).items()}
            except Exception:  # noqa: BLE001
                return {}
        out: dict = {}
        with self._lock:
            for st in self._sandboxes.values():
                out[st] = out.get(st, 0) + 1
        for st in ("queued", "starting", "running", "stopping"):
            out.setdefault(st, 0)
        return {(("state", k),): v for k, v in out.items()}

    # -- reading ----------------------------------------------------------------------------
    def counter(self, name: str, **attrs) -> int:
        """Sum of a counter over the series matching attrs."""
        with self._lock:
            series = dict(self._counters.get(name, {}))
        want = set(attrs.items())
        return sum(v for k, v in series.items() if want <= set(k))

    def counters(self, name: str) -> dict:
        """{attrs tuple: value} of one counter, every attribute set."""
        with self._lock:
            return dict(self._counters.get(name, {}))

    def histogram(self, name: str, **attrs) -> dict:
        with self._lock:
            series = dict(self._hists.get(name, {}))
        want = set(attrs.items())
        out = _Hist()
        for k, h in series.items():
            if want <= set(k):
                out.count += h.count
                out.sum += h.sum
                out.max = max(out.max, h.max)
                out.buckets = [a + b for a, b in zip(out.buckets, h.buckets)]
        return out.as_dict()

    def gauge(self, name: str) -> dict:
        with self._lock:
            sources = list(self._gauges.get(name, {}).values())
        out = {}
        for fn in sources:
            try:
                for k, v in (fn() or {}).items():
                    k = _key(k) if isinstance(k, dict) else k
                    out[k] = out.get(k, 0) + v
            except Exception:  # noqa: BLE001
                continue
        return out

    def snapshot(self) -> dict:
        """{name: {attrs tuple: value | histogram dict}} of everything."""
        with self._lock:
            out = {n: dict(s) for n, s in self._counters.items()}
            hists = {n: {k: h.as_dict() for k, h in s.items()} for n, s in self._hists.items()}
            gauges = list(self._gauges)
        out.update(hists)
        for g in gauges:
            out[g] = self.gauge(g)
        return out

    def reset(self):
        """Forget every value (tests, benchmarks)."""
        with self._lock:
            self._counters.clear()
            self._hists.clear()
            self._sandboxes.clear()
            self._sandbox_t0.clear()
            self._lifecycled = set()

    # -- OpenTelemetry ------------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        return self._provider is not None

    def configure(self, *, otlp: bool = False, endpoint: str | None = None, headers=None,
                  insecure: bool | None = None, interval_s: float | None = None, resource=None,
                  readers: list | None = None):
        """Build the MeterProvider (once; a second call replaces it). otlp=True adds
        a PeriodicExportingMetricReader with an OTLP/gRPC exporter configured from
        the arguments, else from the OTEL_EXPORTER_OTLP_[METRICS_]* environment."""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
        self.shutdown()
        rs = list(readers or [])
        self._memory_reader = InMemoryMetricReader()
        rs.append(self._memory_reader)
        if otlp:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            kw = {}
            if endpoint:
                kw["endpoint"] = endpoint
            if headers:
                kw["headers"] = headers
            if insecure is not None:
                kw["insecure"] = insecure
            exporter = OTLPMetricExporter(**kw)
            ms = interval_s * 1000 if interval_s else float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000)
            rs.append(PeriodicExportingMetricReader(exporter, export_interval_millis=ms))
        from exporters.resource import agent_resource, dsec_version
        if resource is None:
            resource = agent_resource()
        provider = MeterProvider(metric_readers=rs, resource=resource)
        meter = provider.get_meter("dsec.agent", version=dsec_version())
        hists = {}
        for name, (typ, unit, desc) in INSTRUMENTS.items():
            if typ == HISTOGRAM:
                hists[name] = meter.create_histogram(name, unit=unit, description=desc)
            elif typ == COUNTER:
                meter.create_observable_counter(name, callbacks=[self._counter_cb(name)], unit=unit,
                                                description=desc)
            else:
                meter.create_observable_gauge(name, callbacks=[self._gauge_cb(name)], unit=unit,
                                              description=desc)
        with self._lock:
            self._provider = provider
            self._otel_hists = hists

    def _counter_cb(self, name):
        from opentelemetry.metrics import Observation

        def cb(options):
            with self._lock:
                series = dict(self._counters.get(name, {}))
            return [Observation(v, dict(k)) for k, v in series.items()]
        return cb

    def _gauge_cb(self, name):
        from opentelemetry.metrics import Observation

        def cb(options):
            return [Observation(v, dict(k)) for k, v in self.gauge(name).items()]
        return cb

    def collect(self):
        """What an exporter would receive now (the SDK's MetricsData), or None."""
        if self._memory_reader is None:
            return None
        return self._memory_reader.get_metrics_data()

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        p = self._provider
        if p is None:
            return True
        try:
            return bool(p.force_flush(timeout_millis=int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001
            log.warning("metrics export failed: %s", e)
            return False

    def shutdown(self):
        with self._lock:
            p, self._provider, self._otel_hists = self._provider, None, {}
        if p is not None:
            try:
                p.shutdown(timeout_millis=5000)
            except Exception:  # noqa: BLE001
                pass


METRICS = AgentMetrics()

__all__ = ["AgentMetrics", "INSTRUMENTS", "METRICS"]
