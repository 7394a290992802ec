"""Which sinks a dsec process delivers its spool to, from the agent's config
file and the environment; and running them.

For the node agent (agent/node/daemon.py):

    from exporters.configure import sinks_from_config, start_sinks, stop_sinks
    specs = sinks_from_config(raw_sinks_section)        # validated; ExportError (exit 2) names the key
    threads = start_sinks(spool, specs, stop_event)     # one thread per sink; t.sink is the SpoolSink
    ...
    stop_sinks(threads)                                 # after stop_event.set(): join, final flush, close

For `dsec run` (agent/commands/run.py, _run_audited): run_sinks_begin() before
the sandbox, run_sinks_end(spool) after the ClickHouse flush. For
`dsec export`: env_sinks() / sinks_from_names().

The config section (YAML, in the agent's config file under `sinks:`): a
mapping of sink NAME -> settings; `type` defaults to NAME when NAME is one of
clickhouse, otlp, jsonl. NAME is also the sink's cursor in the spool
(cursors/NAME.json), so two sinks of one type need two names.

    sinks:
      clickhouse: {}                         # DSEC_CLICKHOUSE_URL or the private server
      otlp:
        endpoint: http://collector:4317      # else OTEL_EXPORTER_OTLP_[LOGS_]ENDPOINT
        headers: {authorization: "Bearer ..."}
      audit-file:
        type: jsonl
        path: /var/log/dsec/audit.jsonl
        required: true                       # never evicted by the disk budget

Settings of every sink: enabled (true), required (clickhouse: true, others:
false; a required sink's backlog is never evicted by the spool's disk budget),
batch_records, flush_interval (seconds), retry {initial, maximum, multiplier,
jitter}. clickhouse: url, connect_timeout. otlp: endpoint, headers, insecure,
timeout, compression (gzip|deflate|none), protocol (grpc), logs (true),
traces (default: OTEL_TRACES_EXPORTER != none), metrics (the agent's own
metrics over OTLP; default true in a config file), metrics_interval (60 s).
jsonl: path (a file, or - for stdout), fsync (true).

Without a `sinks:` section, or for `dsec run` / `dsec export`, the sinks come
from the environment (env_sinks):
  DSEC_SINKS=auto|LIST   auto (default): clickhouse; + otlp when
                         OTEL_LOGS_EXPORTER=otlp, or when it is unset and
                         OTEL_EXPORTER_OTLP_ENDPOINT or _LOGS_ENDPOINT is set;
                         + jsonl when DSEC_JSONL_PATH is set. LIST: e.g.
                         "clickhouse,jsonl" (exactly those).
  DSEC_JSONL_PATH        the JSON-lines file (or - for stdout)
  OTEL_*                 the OTLP sink's standard variables (exporters/otel.py);
                         OTEL_METRICS_EXPORTER=otlp (or an endpoint) adds the
                         agent's metrics
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from exporters.errors import ExportError, USAGE as EXIT_USAGE
from exporters.base import FlushResult, RetryPolicy, SpoolSink

log = logging.getLogger("dsec.exporter")

TYPES = ("clickhouse", "otlp", "jsonl")


# --- validation models -------------------------------------------------------------

class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetryConfig(_Base):
    initial: float = Field(0.1, gt=0, le=60)
    maximum: float = Field(5.0, gt=0, le=600)
    multiplier: float = Field(2.0, ge=1, le=10)
    jitter: float = Field(0.5, ge=0, le=1)


class _Common(_Base):
    type: Literal["clickhouse", "otlp", "jsonl"]
    enabled: bool = True
    required: Optional[bool] = None
    batch_records: Optional[int] = Field(None, ge=1, le=1_000_000)
    flush_interval: Optional[float] = Field(None, gt=0, le=3600)
    retry: Optional[RetryConfig] = None


class ClickHouseConfig(_Common):
    type: Literal["clickhouse"] = "clickhouse"
    url: Optional[str] = None
    connect_timeout: float = Field(3.0, gt=0, le=600)


class OtlpConfig(_Common):
    type: Literal["otlp"] = "otlp"
    endpoint: Optional[str] = None
    headers: Optional[dict[str, str]] = None
    insecure: Optional[bool] = None
    timeout: Optional[float] = Field(None, gt=0, le=600)
    compression: Optional[Literal["gzip", "deflate", "none"]] = None
    protocol: Optional[Literal["grpc"]] = None
    logs: bool = True
    traces: Optional[bool] = None
    metrics: Optional[bool] = None
    metrics_interval: float = Field(60.0, gt=0, le=3600)


class JsonlConfig(_Common):
    type: Literal["jsonl"] = "jsonl"
    path: str = Field(description="a file, or - for stdout")
    fsync: bool = True


_MODELS = {"clickhouse": ClickHouseConfig, "otlp": OtlpConfig, "jsonl": JsonlConfig}


class SinkSpec:
    """A validated sink configuration; build(spool) makes the SpoolSink."""

    def __init__(self, name: str, cfg):
        self.name = name
        self.cfg = cfg
        self.type = cfg.type

    def __repr__(self):
        return f"SinkSpec({self.name!r}, {self.type})"

    @property
    def metrics(self) -> bool:
        return self.type == "otlp" and bool(self.cfg.metrics)

    def build(self, spool) -> SpoolSink:
        c = self.cfg
        kw = {"sink": self.name}
        if c.batch_records:
            kw["batch_records"] = c.batch_records
        if c.flush_interval:
            kw["flush_interval"] = c.flush_interval
        if c.retry:
            kw["retry"] = RetryPolicy(c.retry.initial, c.retry.maximum, c.retry.multiplier, c.retry.jitter)
        if c.type == "clickhouse":
            from exporters.clickhouse import ClickHouseExporter
            if c.required is False:
                raise ExportError(f"sinks.{self.name}.required: the ClickHouse sink is always required "
                                f"(it is the audit store of record)", EXIT_USAGE)
            return ClickHouseExporter(spool, c.url, connect_timeout=c.connect_timeout, **kw)
        if c.required is not None:
            kw["evictable"] = not c.required
        if c.type == "otlp":
            from exporters.otel import OtlpSink
            return OtlpSink(spool, endpoint=c.endpoint, headers=c.headers, insecure=c.insecure, timeout=c.timeout,
                            compression=c.compression, protocol=c.protocol, logs=c.logs, traces=c.traces, **kw)
        from exporters.jsonl import JsonlSink
        return JsonlSink(spool, path=c.path, fsync=c.fsync, **kw)


def _validate(name: str, settings, where: str = "sinks") -> SinkSpec:
    from exporters.spool import _sink_name
    where = f"{where}." if where == "sinks" else f"{where} "
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise ExportError(f"{where}{name}: expected a mapping of settings, got {type(settings).__name__}", EXIT_USAGE)
    try:
        _sink_name(str(name))
    except ExportError as e:
        raise ExportError(f"{where}{name}: {e.message}", EXIT_USAGE) from None
    typ = settings.get("type") or (name if name in TYPES else None)
    if typ not in TYPES:
        raise ExportError(f"{where}{name}.type: {typ!r} is not one of {', '.join(TYPES)}"
                        if typ else f"{where}{name}: say which type (clickhouse, otlp, jsonl)", EXIT_USAGE)
    try:
        cfg = _MODELS[typ].model_validate({**settings, "type": typ})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc") or ())
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown setting (settings of a {typ} sink: {', '.join(_MODELS[typ].model_fields)})"
        raise ExportError(f"{where}{name}.{loc}: {msg}", EXIT_USAGE) from None
    if typ == "otlp":
        from exporters.otel import _check_protocol
        try:
            _check_protocol(cfg.protocol)
        except ExportError as e:
            raise ExportError(f"{where}{name}: {e.message}", EXIT_USAGE) from None
    return SinkSpec(str(name), cfg)


def sinks_from_config(section: dict | None, environ=None, *, include_clickhouse: bool = True) -> list[SinkSpec]:
    """The agent's sinks. `section` is the config file's `sinks:` mapping (or a
    dict holding one under "sinks"); None or {} means: from the environment
    (env_sinks). include_clickhouse=False leaves ClickHouse out (for an agent
    that runs its ClickHouse exporter itself). Raises ExportError (exit 2)
    naming sinks.NAME.SETTING."""
    environ = os.environ if environ is None else environ
    if isinstance(section, dict) and set(section) == {"sinks"}:
        section = section["sinks"]
    if section is not None and not isinstance(section, dict):
        raise ExportError(f"sinks: expected a mapping of sink name -> settings, got {type(section).__name__}",
                        EXIT_USAGE)
    if not section:
        specs = env_sinks(environ)
    else:
        specs = [_validate(n, s) for n, s in section.items()]
        specs = [s for s in specs if s.cfg.enabled]
        for s in specs:              # in a config file, an OTLP sink carries the agent's metrics unless told not to
            if s.type == "otlp" and s.cfg.metrics is None:
                s.cfg.metrics = True
    if not include_clickhouse:
        specs = [s for s in specs if s.type != "clickhouse"]
    return specs


def env_sinks(environ=None) -> list[SinkSpec]:
    """The sinks the environment asks for (DSEC_SINKS, OTEL_*, DSEC_JSONL_PATH)."""
    from exporters.otel import logs_enabled_by_env, metrics_enabled_by_env
    env = os.environ if environ is None else environ
    want = (env.get("DSEC_SINKS") or "auto").strip()
    jsonl_path = env.get("DSEC_JSONL_PATH") or ""
    if want == "auto":
        names = ["clickhouse"]
        if logs_enabled_by_env(env):
            names.append("otlp")
        if jsonl_path:
            names.append("jsonl")
    else:
        names = [n.strip() for n in want.split(",") if n.strip()]
        bad = [n for n in names if n not in TYPES]
        if bad or not names:
            raise ExportError(f"DSEC_SINKS={want!r}: use auto or a comma-separated list of {', '.join(TYPES)}",
                            EXIT_USAGE)
    specs = []
    for n in dict.fromkeys(names):
        settings = {}
        if n == "jsonl":
            if not jsonl_path:
                raise ExportError("DSEC_SINKS names jsonl but DSEC_JSONL_PATH (the file, or - for stdout) is not set",
                                EXIT_USAGE)
            settings["path"] = jsonl_path
        if n == "otlp":
            settings["metrics"] = metrics_enabled_by_env(env)
        specs.append(_validate(n, settings, where="environment sink"))
    return specs


def sinks_from_names(names: list[str], *, jsonl_path: str | None = None, otlp_endpoint: str | None = None,
                     environ=None) -> list[SinkSpec]:
    """`dsec export --sink NAME ...`."""
    from exporters.otel import metrics_enabled_by_env
    env = os.environ if environ is None else environ
    specs = []
    for n in dict.fromkeys(names):
        settings = {}
        if n == "jsonl":
            settings["path"] = jsonl_path or env.get("DSEC_JSONL_PATH") or "-"
        if n == "otlp":
            if otlp_endpoint:
                settings["endpoint"] = otlp_endpoint
            settings["metrics"] = metrics_enabled_by_env(env)
        specs.append(_validate(n, settings, where="--sink"))
    return specs


# --- running ---------------------------------------------------------------------------

def configure_metrics(specs: list[SinkSpec]) -> bool:
    """OTLP export of the agent's own metrics, if an OTLP sink asks for it."""
    from exporters.metrics import METRICS
    for s in specs:
        if s.metrics:
            c = s.cfg
            METRICS.configure(otlp=True, endpoint=c.endpoint, headers=c.headers, insecure=c.insecure,
                              interval_s=c.metrics_interval)
            return True
    return False


def start_sinks(spool, sinks: list, stop_event, *, metrics: bool = True) -> list[threading.Thread]:
    """One thread per sink, each delivering its own cursor until stop_event is
    set (threading.Event-like: is_set/wait; the agent's pokeable event works).
    `sinks` are SinkSpecs (built here) or SpoolSinks. Each returned thread has
    .sink (the SpoolSink). A sink that fails to build raises before any thread
    starts."""
    spool = getattr(spool, "_spool", spool)          # the agent's TapSpool wraps the real one
    built = [s.build(spool) if isinstance(s, SinkSpec) else s for s in sinks]
    if metrics:
        configure_metrics([s for s in sinks if isinstance(s, SinkSpec)])
    threads = []
    for sink in built:
        def loop(sink=sink):
            try:
                sink.run(stop_event)
            except Exception:  # noqa: BLE001 - logged; the records stay in the spool
                log.exception("%s sink %s: thread died; its records stay in the spool", sink.label, sink.sink)
        t = threading.Thread(target=loop, name=f"dsec-sink-{sink.sink}", daemon=True)
        t.sink = sink
        t.start()
        threads.append(t)
    return threads


def stop_sinks(threads, timeout: float = 15.0):
    """After stop_event.set(): wait for each sink's final flush, then close it."""
    import time
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    for t in threads:
        if t.is_alive():
            # still in its final flush (a stalled destination): closing its connection, file and
            # reader lock under it would break that delivery midway. It is a daemon thread: the
            # process's exit ends it; what it had not committed stays in the spool, re-sent later.
            log.warning("%s sink %s: still delivering after %.0fs; left to the process's exit, "
                        "its uncommitted records stay in the spool", t.sink.label, t.sink.sink, timeout)
            continue
        try:
            t.sink.close()
        except Exception:  # noqa: BLE001
            pass
    from exporters.metrics import METRICS
    METRICS.force_flush(2.0)


def flush_sinks(spool, sinks: list, timeout: float) -> dict[str, FlushResult]:
    """Deliver everything pending to each sink, all at once (a dead sink costs
    `timeout`, not `timeout` per sink). {name: FlushResult}."""
    spool = getattr(spool, "_spool", spool)
    results: dict[str, FlushResult] = {}
    built = []
    for s in sinks:
        try:
            built.append(s.build(spool) if isinstance(s, SinkSpec) else s)
        except ExportError as e:
            results[s.name] = FlushResult(error=e.message, fatal=True, label=s.name)

    def one(sink):
        try:
            results[sink.sink] = sink.flush(timeout)
        except Exception as e:  # noqa: BLE001
            results[sink.sink] = FlushResult(error=str(e), label=sink.label)
        finally:
            sink.close()
    threads = [threading.Thread(target=one, args=(b,), daemon=True) for b in built]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


# --- `dsec run` ----------------------------------------------------------------------------

def run_sinks_begin(environ=None) -> list[SinkSpec]:
    """Before a `dsec run` sandbox: validate the environment's sinks (a bad
    setting is one clear line before anything runs; `dsec run` exits 125) and start the
    OTel metrics pipeline when OTEL_* asks for it."""
    specs = [s for s in env_sinks(environ) if s.type != "clickhouse"]
    for s in specs:
        if s.type == "jsonl" and s.cfg.path == "-":
            raise ExportError("DSEC_JSONL_PATH=-: in `dsec run` stdout belongs to the command; give a file "
                            "(or use `dsec export --sink jsonl` for stdout)")
    if specs:
        configure_metrics(specs)
    return specs


def run_sinks_end(spool, timeout: float | None = None, environ=None) -> dict:
    """After `dsec run`'s ClickHouse flush: deliver to the other sinks the
    environment asks for (OTLP, JSON lines). Never raises; pending records stay
    in the spool (a stderr line says so). Returns {name: {sent, pending, error}}
    for the run summary."""
    env = os.environ if environ is None else environ
    try:
        specs = [s for s in env_sinks(env) if s.type != "clickhouse"]
    except ExportError as e:
        sys.stderr.write(f"dsec run: export: {e.message}\n")
        return {}
    if not specs:
        return {}
    if timeout is None:
        try:
            timeout = float(env.get("DSEC_EXPORT_TIMEOUT") or 5.0)
        except ValueError:
            timeout = 5.0
    results = flush_sinks(spool, specs, timeout)
    out = {}
    for name, r in results.items():
        out[name] = r.as_dict()
        if not r.ok:
            sys.stderr.write(f"dsec run: {r.pending} audit events wait in the spool for sink {name} "
                             f"({r.error or 'not yet exported'}); the next export delivers them\n")
    from exporters.metrics import METRICS
    if METRICS.configured:
        METRICS.force_flush(min(timeout, 5.0))
        METRICS.shutdown()
    return out


__all__ = ["SinkSpec", "TYPES", "configure_metrics", "env_sinks", "flush_sinks", "run_sinks_begin",
           "run_sinks_end", "sinks_from_config", "sinks_from_names", "start_sinks", "stop_sinks"]
