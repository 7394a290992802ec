"""OpenTelemetry sink: audit events as OTel log records and sandbox lifecycles
as traces, exported over OTLP/gRPC with opentelemetry-sdk's exporters.

    sink = OtlpSink(spool)                    # endpoint etc. from OTEL_EXPORTER_OTLP_* (or arguments)
    sink.flush(timeout=5); sink.run(stop); sink.close()

Logs. One log record per audit record:
  time_unix_nano   ts_ns (the event's wall-clock time); observed: when exported
  event_name       "dsec.<kind>" (also the attribute dsec.kind)
  severity         ERROR for events_lost; WARN for a decision other than
                   "allowed" and for access_denied; INFO otherwise
  body             one human line (the `dsec events` table's detail column)
  attributes       ATTRIBUTES (exporters/otlp_mapping.py): every audit_schema field, named after the
                   OTel semantic conventions where one exists, else dsec.<field>;
                   fields at their default (0, "", []) are left out, except
                   the ones that mean something at 0 (exit codes, ret, pid)
  trace/span id    the sandbox's trace (see below) and the span of the
                   record's step (or the sandbox's root span for step 0), so a
                   backend links each event to its place in the lifecycle
  resource         service.name (OTEL_SERVICE_NAME, default "dsec"),
                   OTEL_RESOURCE_ATTRIBUTES, host.name = the record's node,
                   and for a sandbox's records container.id = dsec.sandbox.id
                   = the sandbox id and container.runtime.name = "dsec"
                   (decision: sandbox ids are RESOURCE attributes, because a
                   sandbox is the container that produced the telemetry; one
                   OTLP ResourceLogs per sandbox in each request)

Byte strings. OTLP strings must be UTF-8. A value that is valid UTF-8 is sent
as is. One that is not (a hostile file name) is sent as a string with U+FFFD
for each undecodable byte under the semconv name, AND with its exact bytes
under dsec.raw.<field> (bytes value; argv: an array of bytes): lossless, and
still readable by backends that only show strings.

Integers: OTLP int_value is int64; a UInt64 above 2**63-1 (count) is sent as
a decimal string.

Traces. Deterministic ids: trace_id = sha256("dsec-trace", node, sandbox_id),
span ids likewise from the sandbox, step or phase, so a re-sent span is the
same span. From the records:
  root span "sandbox <id>"   first record of the sandbox (lifecycle
                             `requested`, or sandbox_start) -> sandbox_exit
  "launch"                   `dsec run`: sandbox_start -> first step_start
  "phase <state>"            the agent: each lifecycle state before running
                             (requested, queued, admitted, warm_claimed) and
                             stopping/preempting, from that transition to the next
  "step <n>"                 step_start -> step_end (argv, exit code, timed out)
Spans are exported when they end; what a span needs from earlier batches
(start times, argv) is kept in the sink's cursor state, so an agent restart
between a step's start and its end still yields the span.

Delivery: the batch's log records, then its spans, each as one OTLP request
(ExportLogsServiceRequest / ExportTraceServiceRequest) built by the SDK's
encoders, on the SDK exporter's gRPC channel; the cursor is committed after
both succeeded. A re-send (crash or failure between them) repeats log
records: each carries log.record.uid = event_id, so a backend can dedup.
Retries, backoff and jitter are exporters/base.py's (the SDK exporter's own
retry loop is bypassed so one retry policy applies, and the gRPC status of a
failure is reported as is). UNAUTHENTICATED / PERMISSION_DENIED are fatal
(configuration) until the next flush; everything else is retried.

Environment (standard; arguments override): OTEL_EXPORTER_OTLP_ENDPOINT and
OTEL_EXPORTER_OTLP_{LOGS,TRACES}_ENDPOINT (http://host:4317 = plaintext,
https:// = TLS), OTEL_EXPORTER_OTLP_[LOGS_|TRACES_]HEADERS, _TIMEOUT,
_COMPRESSION, _CERTIFICATE, _INSECURE, OTEL_EXPORTER_OTLP_PROTOCOL (only
"grpc" is supported: anything else is a clear error), OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_EXPORTER=none (no spans). Which
processes use this sink at all: exporters/configure.py.
"""
from __future__ import annotations

import json
import logging
import os
import time

from exporters.errors import ExportError, USAGE as EXIT_USAGE
from exporters.spool import Repeat, Spool
from exporters.base import RetryPolicy, SpoolSink
from exporters.resource import agent_resource, base_resource, dsec_version as _version
from exporters.otlp_wire import LogsEncoder
# the mapping (ATTRIBUTES, defaults, UTF-8, severity, ids): one module both encoders use
from exporters.otlp_mapping import (ATTRIBUTES, _INT64_MAX, _SAMPLED, _ZERO_MEANS, _severity,  # noqa: F401
                                    _utf8, attr_items, attribute_name, attributes_for, span_id_of, trace_id_of)

log = logging.getLogger("dsec.exporter.otlp")

SINK = "otlp"

# --- traces from lifecycle records ----------------------------------------------------

_LIFECYCLE_KINDS = frozenset(("sandbox_start", "sandbox_exit", "step_start", "step_end", "lifecycle"))
PHASE_STATES = ("requested", "queued", "admitted", "warm_claimed", "stopping", "preempting")
_TERMINAL = ("cleaned", "failed", "cancelled", "rejected", "released")
_MAX_OPEN = 4096


class LifecycleTracer:
    """Turns lifecycle records into finished spans. process(records, state)
    returns (spans as plain dicts, new state); the state is JSON-able and
    committed with the cursor only after the spans were delivered."""

    def process(self, records, state: dict | None):
        st = json.loads(json.dumps(state)) if state else {}
        sbx = st.setdefault("sandboxes", {})
        spans = []
        for r in records:
            kind = r.get("kind")
            if kind not in ("sandbox_start", "sandbox_exit", "step_start", "step_end", "lifecycle"):
                continue
            sid = r.get("sandbox_id") or ""
            if not sid:
                continue
            node = r.get("node") or ""
            key = f"{node}\0{sid}"
            ts = int(r.get("ts_ns") or 0)
            s = sbx.get(key)
            if s is None and kind == "lifecycle" and _json(r.get("extra")).get("state") in _TERMINAL:
                continue                        # the end of a sandbox we no longer track
            if s is None:
                s = sbx[key] = {"t0": ts, "last": ts}
            s["last"] = max(s.get("last", 0), ts)
            if ts and (not s.get("t0") or ts < s["t0"]):
                s["t0"] = ts
            extra = _json(r.get("extra"))
            if kind == "sandbox_start":
                s["start"] = ts
                s["argv"] = [a[:256] for a in (r.get("argv") or [])[:16]]
                s["policy"] = r.get("policy_name") or ""
                s["mode"] = r.get("mode") or ""
            elif kind == "step_start":
                step = int(r.get("step") or 0)
                s.setdefault("steps", {})[str(step)] = [ts, [a[:256] for a in (r.get("argv") or [])[:16]]]
                if s.get("start") and not s.get("launched"):
                    s["launched"] = True
                    spans.append(self._span("launch", node, sid, ("launch",), s["start"], ts,
                                            {"dsec.sandbox.id": sid}))
            elif kind == "step_end":
                step = int(r.get("step") or 0)
                started = (s.get("steps") or {}).pop(str(step), None)
                wall = extra.get("wall_ms")
                t_start = started[0] if started else (ts - int(wall * 1e6) if isinstance(wall, (int, float)) else ts)
                attrs = {"dsec.sandbox.id": sid, "dsec.step": step, "process.exit.code": int(r.get("exit_code") or 0)}
                if started and started[1]:
                    attrs["process.command_args"] = tuple(_utf8(a)[0] for a in started[1])
                if r.get("signal"):
                    attrs["dsec.signal"] = int(r["signal"])
                if extra.get("timed_out"):
                    attrs["dsec.timed_out"] = True
                err = bool(r.get("signal") or r.get("exit_code") or extra.get("timed_out") or extra.get("error"))
                spans.append(self._span(f"step {step}", node, sid, ("step", step), t_start, ts, attrs,
                                        error=(extra.get("error") or "step failed") if err else None))
            elif kind == "lifecycle":
                state = extra.get("state")
                prev = s.get("phase")
                if prev and prev[0] in PHASE_STATES and ts >= prev[1] and (prev[0], prev[1]) != (state, ts):
                    spans.append(self._span(f"phase {prev[0]}", node, sid, ("phase", prev[0], prev[1]), prev[1], ts,
                                            {"dsec.sandbox.id": sid, "dsec.lifecycle.state": prev[0],
                                             "dsec.lifecycle.next": state or ""}))
                s["phase"] = [state, ts]
                if state in _TERMINAL and s.get("exited"):
                    sbx.pop(key, None)
            elif kind == "sandbox_exit":
                t0 = s.get("t0") or ts
                if not s.get("start") and extra.get("wall_ms") and t0 == ts:
                    t0 = ts - int(extra["wall_ms"] * 1e6)
                attrs = {"dsec.sandbox.id": sid, "process.exit.code": int(r.get("exit_code") or 0)}
                if s.get("argv"):
                    attrs["process.command_args"] = tuple(_utf8(a)[0] for a in s["argv"])
                if s.get("policy") or r.get("policy_name"):
                    attrs["security_rule.ruleset.name"] = s.get("policy") or r.get("policy_name")
                if s.get("mode") or r.get("mode"):
                    attrs["dsec.policy.mode"] = s.get("mode") or r.get("mode")
                for k in ("timed_out", "oom_killed"):
                    if extra.get(k):
                        attrs[f"dsec.{k}"] = True
                if r.get("signal"):
                    attrs["dsec.signal"] = int(r["signal"])
                err = bool(r.get("signal") or r.get("exit_code") or extra.get("timed_out") or extra.get("oom_killed"))
                spans.append(self._span(f"sandbox {sid}", node, sid, None, t0, ts, attrs,
                                        error="sandbox failed" if err else None))
                s["exited"] = True
                if not s.get("phase") or s["phase"][0] in _TERMINAL:
                    sbx.pop(key, None)          # later lifecycle transitions, if any, still make phase spans
        self._gc(sbx)
        return spans, st

    @staticmethod
    def _gc(sbx):
        now = time.time_ns()
        for key in [k for k, s in sbx.items()
                    if (s.get("exited") and now - s.get("last", 0) > 3600 * 10**9)
                    or now - s.get("last", 0) > 7 * 86400 * 10**9]:
            sbx.pop(key, None)
        if len(sbx) > _MAX_OPEN:
            for key in sorted(sbx, key=lambda k: sbx[k].get("last", 0))[:len(sbx) - _MAX_OPEN]:
                sbx.pop(key, None)

    @staticmethod
    def _span(name, node, sid, what, start, end, attrs, error=None):
        return {"name": name, "node": node, "sandbox_id": sid, "what": what, "start": int(start),
                "end": max(int(start), int(end)), "attrs": attrs, "error": error}


def _json(s):
    if not s:
        return {}
    try:
        v = json.loads(s)
        return v if isinstance(v, dict) else {}
    except ValueError:
        return {}


# --- the sink ------------------------------------------------------------------------

class OtlpError(Exception):
    pass


def _check_protocol(protocol: str | None):
    p = protocol or os.environ.get("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL") or \
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if p != "grpc":
        raise ExportError(f"OTLP protocol {p!r} (OTEL_EXPORTER_OTLP_PROTOCOL): dsec exports OTLP over gRPC only; "
                        f"set it to grpc (a collector's gRPC receiver, usually port 4317)", EXIT_USAGE)
    return p


_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000))


class OtlpSink(SpoolSink):
    kind = SINK
    label = "OTLP collector"
    evictable = True

    def __init__(self, spool: Spool | None = None, *, sink: str = SINK, endpoint: str | None = None,
                 headers: dict | None = None, insecure: bool | None = None, timeout: float | None = None,
                 compression: str | None = None, protocol: str | None = None,
                 logs: bool = True, traces: bool | None = None, batch_records: int = 2000,
                 flush_interval: float = 1.0, retry: RetryPolicy | None = None, evictable: bool | None = None):
        _check_protocol(protocol)
        super().__init__(spool, sink=sink, batch_records=batch_records, flush_interval=flush_interval,
                         retry=retry or RetryPolicy(initial=0.2, maximum=10.0), evictable=evictable)
        if traces is None:
            traces = (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower() != "none"
        self.logs = logs
        self.traces = traces
        self._opts = {"endpoint": endpoint, "headers": headers, "insecure": insecure, "timeout": timeout,
                      "compression": compression}
        self.timeout = timeout or float(os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") or 10)
        self._log_exp = None
        self._span_exp = None
        self._resources: dict = {}
        self._tracer = LifecycleTracer()
        self._span_state = (self.reader.state or {}).get("spans") if isinstance(self.reader.state, dict) else None
        self._pending_state = None
        self.total_spans = 0
        self._scope = None
        self._ids: dict = {}
        self._wire = LogsEncoder()
        self._columns = None          # exporters/otlp_columns.ColumnLogs, made on first use

    # -- exporters (the SDK's: env handling, headers, TLS, compression, channel)
    def _kw(self):
        from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression
        kw = {k: v for k, v in self._opts.items() if v is not None and k != "compression"}
        if self._opts.get("compression"):
            c = self._opts["compression"].lower()
            kw["compression"] = {"gzip": Compression.Gzip, "none": Compression.NoCompression,
                                 "deflate": Compression.Deflate}.get(c)
            if kw["compression"] is None:
                raise ExportError(f"OTLP compression {c!r}: use gzip, deflate or none", EXIT_USAGE)
        kw["channel_options"] = _CHANNEL_OPTIONS
        return kw

    def _logs_exporter(self):
        if self._log_exp is None:
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
            self._log_exp = OTLPLogExporter(**self._kw())
        return self._log_exp

    def _spans_exporter(self):
        if self._span_exp is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            self._span_exp = OTLPSpanExporter(**self._kw())
        return self._span_exp

    @property
    def endpoint(self) -> str:
        exp = self._log_exp or self._span_exp
        return getattr(exp, "_endpoint", None) or self._opts.get("endpoint") or \
            os.environ.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT") or \
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4317"

    def reset_connection(self):
        for exp in (self._log_exp, self._span_exp):
            if exp is not None:
                try:
                    exp._shutdown = True
                    if getattr(exp, "_channel", None) is not None:
                        exp._channel.close()
                except Exception:  # noqa: BLE001
                    pass
        self._log_exp = self._span_exp = None

    def close(self):
        self.reset_connection()
        super().close()

    def _rpc(self, exp, items, what: str, request=None):
        """One Export call on the exporter's stub; raises with the gRPC status.
        request: the request already made (log_request), else the SDK's
        translation of items (SDK objects). For logs, items() gives the rows."""
        import grpc
        client = getattr(exp, "_client", None)
        translate = getattr(exp, "_translate_data", None)
        if client is None or translate is None:       # an SDK without these internals: its own export()
            if request is not None:
                items = self.log_records(items())
            result = exp.export(items)
            if getattr(result, "name", "") != "SUCCESS":
                raise OtlpError(f"OTLP {what} export to {self.endpoint} failed")
            return None
        if request.__class__ is bytes:                # log_request_bytes_of: sent as they are
            client = self._raw_logs_client(exp)
            if client is None:
                from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
                client, request = exp._client, ExportLogsServiceRequest.FromString(request)
        try:
            resp = client.Export(request=translate(items) if request is None else request,
                                 metadata=getattr(exp, "_headers", ()) or (), timeout=self.timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            name = code.name if code is not None else "ERROR"
            msg = f"OTLP {what} export to {self.endpoint}: {name}: {(e.details() or '').strip()[:200]}"
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise ExportError(msg + " (check OTEL_EXPORTER_OTLP_HEADERS)")
            raise OtlpError(msg) from None
        return resp

    @staticmethod
    def _raw_logs_client(exp):
        """A LogsService stub on the exporter's own channel (its TLS, compression,
        options) whose Export takes the request's wire bytes as they are (no
        serializer): the bytes log_request_bytes_of wrote are the message, and
        parsing them into protobuf objects only to serialize them again cost
        ~2.5 us a record (issue 15). None: no channel to make it on."""
        channel = getattr(exp, "_channel", None)
        if channel is None:
            return None
        got = getattr(exp, "_dsec_raw_client", None)
        if got is None or got[0] is not channel:      # (the SDK may make a new channel on a reconnect)
            from types import SimpleNamespace
            from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
            got = exp._dsec_raw_client = (channel, SimpleNamespace(Export=channel.unary_unary(
                "/opentelemetry.proto.collector.logs.v1.LogsService/Export", request_serializer=None,
                response_deserializer=ExportLogsServiceResponse.FromString)))
        return got[1]

    # -- records -> SDK objects
    def _resource(self, node: str, sandbox_id: str):
        key = (node, sandbox_id)
        r = self._resources.get(key)
        if r is None:
            from opentelemetry.sdk.resources import Resource
            attrs = {"host.name": node or os.uname().nodename}
            if sandbox_id:
                attrs.update({"container.id": sandbox_id, "dsec.sandbox.id": sandbox_id,
                              "container.runtime.name": "dsec"})
            r = base_resource().merge(Resource(attrs))
            if len(self._resources) > 4096:
                self._resources.clear()
            self._resources[key] = r
        return r

    def _log_fields(self, rows: list[dict], now: int):
        """Per record (the one mapping both encodings use): (resource, kwargs of a
        log record: ts, observed, severity_number, severity_text, body, attrs,
        event_name, trace_id, span_id, flags)."""
        from audit_schema.describe import detail
        ids = self._ids
        for rec in rows:
            kind = rec.get("kind") or ""
            sev, sev_text = _severity(rec)
            node, sid = rec.get("node") or "", rec.get("sandbox_id") or ""
            try:
                body = f"{kind}: {detail(rec)}".rstrip(": ")
            except Exception:  # noqa: BLE001 - a body is a courtesy
                body = kind
            trace_id = span_id = flags = 0
            if sid:
                step = rec.get("step") or 0
                key = (node, sid, step)
                tid_sid = ids.get(key)
                if tid_sid is None:
                    if len(ids) > 65536:
                        ids.clear()
                    tid_sid = ids[key] = (trace_id_of(node, sid), span_id_of(node, sid, "step", step)
                                          if step else span_id_of(node, sid))
                trace_id, span_id = tid_sid
                flags = _SAMPLED
            yield self._resource(node, sid), dict(
                ts=rec.get("ts_ns") or now, observed=now, severity_number=sev.value, severity_text=sev_text,
                body=body, attrs=attributes_for(rec), event_name=f"dsec.{kind}", trace_id=trace_id,
                span_id=span_id, flags=flags)

    def _scope_of(self):
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        self._scope = self._scope or InstrumentationScope("dsec.audit", _version())
        return self._scope

    def log_records(self, rows: list[dict], now: int | None = None):
        """The SDK's ReadableLogRecords of rows (the reference encoding: the
        sink sends log_request's bytes, which tests compare with these)."""
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.context import Context
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.trace import TraceFlags
        scope = self._scope_of()
        now = time.time_ns() if now is None else now
        empty = Context()
        out = []
        for res, f in self._log_fields(rows, now):
            lr = LogRecord(timestamp=f["ts"], observed_timestamp=now, context=empty,
                           severity_text=f["severity_text"], severity_number=SeverityNumber(f["severity_number"]),
                           body=f["body"], attributes=f["attrs"], event_name=f["event_name"])
            if f["trace_id"]:
                lr.trace_id, lr.span_id = f["trace_id"], f["span_id"]
                lr.trace_flags = TraceFlags(f["flags"])
            out.append(ReadableLogRecord(lr, resource=res, instrumentation_scope=scope))
        return out

    def log_request(self, rows: list[dict], now: int | None = None):
        """The ExportLogsServiceRequest of rows, written as wire bytes
        (exporters/otlp_wire.py: no SDK object per record) and parsed once."""
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        now = time.time_ns() if now is None else now
        enc = self._wire
        groups: dict = {}
        for res, f in self._log_fields(rows, now):
            g = groups.get(res)
            if g is None:
                g = groups[res] = []
            g.append(enc.log_record(**f))
        return ExportLogsServiceRequest.FromString(enc.request(list(groups.items()), self._scope_of()))

    def spans(self, span_dicts):
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
        scope = InstrumentationScope("dsec.lifecycle", _version())
        out = []
        for s in span_dicts:
            node, sid = s["node"], s["sandbox_id"]
            tid = trace_id_of(node, sid)
            root = span_id_of(node, sid)
            flags = TraceFlags(TraceFlags.SAMPLED)
            if s["what"] is None:
                ctx, parent = SpanContext(tid, root, False, flags), None
            else:
                ctx = SpanContext(tid, span_id_of(node, sid, *s["what"]), False, flags)
                parent = SpanContext(tid, root, False, flags)
            status = Status(StatusCode.ERROR, s["error"]) if s["error"] else Status(StatusCode.OK)
            out.append(ReadableSpan(name=s["name"], context=ctx, parent=parent, resource=self._resource(node, sid),
                                    attributes=s["attrs"], kind=SpanKind.INTERNAL, status=status,
                                    start_time=s["start"], end_time=s["end"], instrumentation_scope=scope))
        return out

    def log_request_of(self, batch, now: int | None = None):
        """log_request of the batch's records and damage rows, made from its
        columns when it has them (exporters/otlp_columns.py: the same bytes, no
        dict per record; a column of one value stays a Repeat, encoded once),
        else from its records."""
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        got = self.log_request_bytes_of(batch, now)
        return got if got.__class__ is not bytes else ExportLogsServiceRequest.FromString(got)

    def log_request_bytes_of(self, batch, now: int | None = None):
        """What the sink sends for a batch: the wire bytes of log_request_of's
        request when its columns make it (no protobuf object built), else the
        record path's ExportLogsServiceRequest."""
        from exporters.otlp_columns import ColumnLogs
        now = time.time_ns() if now is None else now
        if self._columns is None:
            self._columns = ColumnLogs(self)
        groups = self._columns.records(batch.raw_columns, batch.count, now, self.damage_rows(batch)) \
            if batch.count else None
        if groups is None:
            return self.log_request(self.rows_of(batch), now)
        return self._wire.request(groups, self._scope_of())

    # -- delivery
    def deliver_batch(self, batch) -> None:
        if not (batch.count and batch.raw_columns):
            return self.deliver(self.rows_of(batch))
        cols, life = batch.raw_columns, []         # a column of one value: a Repeat (not made a list)
        kind = cols.get("kind", ())
        one = kind.__class__ is Repeat
        if self.traces and not _LIFECYCLE_KINDS.isdisjoint((kind.value,) if one else kind):
            # the few records spans are made of, as dicts (not the whole batch's)
            life = [dict(zip(cols, [c[i] for c in cols.values()]))
                    for i in (range(len(kind)) if one else [i for i, k in enumerate(kind) if k in _LIFECYCLE_KINDS])]
        self._deliver(life, lambda: self.rows_of(batch), lambda: self.log_request_bytes_of(batch))

    def deliver(self, rows: list[dict]) -> None:
        self._deliver(rows, lambda: rows, lambda: self.log_request(rows))

    def _deliver(self, span_rows, rows, request) -> None:
        """span_rows: the records spans are made of; rows(): every row (the
        SDK's own export, when its internals are not there); request(): the
        log request."""
        spans, new_state = ([], self._span_state)
        if self.traces:
            spans, new_state = self._tracer.process(span_rows, self._span_state)
        if self.logs:
            req = request()                           # a request, or its wire bytes (b"": no records)
            if req if req.__class__ is bytes else req.resource_logs:
                resp = self._rpc(self._logs_exporter(), rows, "logs", request=req)
                self._partial(resp, "log records")
        if spans:
            resp = self._rpc(self._spans_exporter(), self.spans(spans), "traces")
            self._partial(resp, "spans")
            self.total_spans += len(spans)
        self._pending_state = new_state

    def _partial(self, resp, what):
        ps = getattr(resp, "partial_success", None)
        rejected = getattr(ps, "rejected_log_records", 0) or getattr(ps, "rejected_spans", 0) if ps else 0
        if rejected:
            from exporters.metrics import METRICS
            log.warning("OTLP collector %s rejected %d %s: %s", self.endpoint, rejected, what,
                        getattr(ps, "error_message", ""))
            METRICS.add("dsec.events.lost", rejected, reason="otlp_rejected", sink=self.sink)

    def committed_state(self):
        if self._pending_state is None and self._span_state is None:
            return Spool._KEEP
        self._span_state = self._pending_state if self._pending_state is not None else self._span_state
        self._pending_state = None
        return {"spans": self._span_state}


def logs_enabled_by_env(environ=None) -> bool:
    """Should a dsec process export audit logs over OTLP, from the environment
    alone? OTEL_LOGS_EXPORTER=otlp: yes; =none (or anything else): no; unset:
    yes when an OTLP endpoint variable is set."""
    env = os.environ if environ is None else environ
    v = (env.get("OTEL_LOGS_EXPORTER") or "").strip().lower()
    if v:
        return "otlp" in [x.strip() for x in v.split(",")]
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"))


def metrics_enabled_by_env(environ=None) -> bool:
    env = os.environ if environ is None else environ
    v = (env.get("OTEL_METRICS_EXPORTER") or "").strip().lower()
    if v:
        return "otlp" in [x.strip() for x in v.split(",")]
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))


def semconv_names() -> set[str]:
    """Every attribute name the installed opentelemetry-semantic-conventions defines."""
    import importlib
    import pkgutil
    names = set()
    for pkg_name in ("opentelemetry.semconv.attributes", "opentelemetry.semconv._incubating.attributes"):
        pkg = importlib.import_module(pkg_name)
        for m in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg_name}.{m.name}")
            for k, v in vars(mod).items():
                if k.isupper() and isinstance(v, str) and "." in v:
                    names.add(v)
    return names


__all__ = ["ATTRIBUTES", "LifecycleTracer", "OtlpSink", "SINK", "agent_resource", "attribute_name",
           "attributes_for", "base_resource", "logs_enabled_by_env", "metrics_enabled_by_env", "semconv_names",
           "span_id_of", "trace_id_of"]
