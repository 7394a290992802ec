"""A real OTLP/gRPC receiver on loopback, for tests and benchmarks: a grpcio
server implementing the collector's LogsService, TraceService and
MetricsService with opentelemetry-proto's generated stubs. It records every
request it accepts.

    rx = OtlpReceiver().start()          # 127.0.0.1:<free port>
    rx.endpoint                          # "http://127.0.0.1:PORT" (OTEL_EXPORTER_OTLP_ENDPOINT)
    rx.logs()                            # [(resource attrs dict, LogRecord pb, attrs dict)]
    rx.spans(); rx.metric_names()
    rx.stop(); rx.start()                # down, then up again on the same port
    rx.fail_with = grpc.StatusCode.UNAVAILABLE   # answer every call with an error
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(v):
    """opentelemetry.proto.common.v1.AnyValue -> Python."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(any_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def attrs(kvs) -> dict:
    return {kv.key: any_value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(self, port: int | None = None, delay: float = 0.0):
        self.port = port or _free_port()
        self.delay = delay                 # seconds each call takes (a slow collector)
        self.fail_with = None
        self.requests = {"logs": [], "traces": [], "metrics": []}
        self.calls = 0
        self.headers = []                  # the metadata of each accepted call
        self._lock = threading.Lock()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        rx = self

        def handle(kind, request, context, response):
            rx.calls += 1
            if rx.delay:
                time.sleep(rx.delay)
            if rx.fail_with is not None:
                context.abort(rx.fail_with, "receiver told to fail")
            with rx._lock:
                rx.requests[kind].append(request)
                rx.headers.append(dict(context.invocation_metadata()))
            return response

        class Logs(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request, context):
                return handle("logs", request, context, logs_service_pb2.ExportLogsServiceResponse())

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                return handle("traces", request, context, trace_service_pb2.ExportTraceServiceResponse())

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                return handle("metrics", request, context, metrics_service_pb2.ExportMetricsServiceResponse())

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        deadline = time.monotonic() + 10
        while True:
            try:
                if server.add_insecure_port(f"127.0.0.1:{self.port}") == self.port:
                    break
            except RuntimeError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"OTLP receiver: port {self.port} not available")
            time.sleep(0.1)
        server.start()
        self._server = server
        return self

    def stop(self):
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None

    def clear(self):
        with self._lock:
            for v in self.requests.values():
                v.clear()

    # -- what arrived
    def logs(self) -> list[tuple[dict, object, dict]]:
        out = []
        with self._lock:
            reqs = list(self.requests["logs"])
        for req in reqs:
            for rl in req.resource_logs:
                res = attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for lr in sl.log_records:
                        out.append((res, lr, attrs(lr.attributes)))
        return out

    def spans(self) -> list[tuple[dict, object, dict]]:
        out = []
        with self._lock:
            reqs = list(self.requests["traces"])
        for req in reqs:
            for rs in req.resource_spans:
                res = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        out.append((res, sp, attrs(sp.attributes)))
        return out

    def metrics(self) -> list[tuple[dict, object]]:
        out = []
        with self._lock:
            reqs = list(self.requests["metrics"])
        for req in reqs:
            for rm in req.resource_metrics:
                res = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.append((res, m))
        return out

    def metric_names(self) -> set[str]:
        return {m.name for _, m in self.metrics()}

    def event_ids(self) -> list[str]:
        return [a.get("log.record.uid") for _, _, a in self.logs()]

    def __enter__(self):
        return self.start()

    def __exit__(self, *a):
        self.stop()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- a receiver process (bench/audit.py): counts per container.id, written to a status file ----

def _serve(port: int, status: str):
    import json
    import os
    counts: dict = {}
    uids: dict = {}
    spans: dict = {}
    lock = threading.Lock()

    class Counting(OtlpReceiver):
        pass

    rx = Counting(port)
    orig = rx.requests

    class Sink(list):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind

        def append(self, req):                      # count instead of keeping
            with lock:
                if self.kind == "logs":
                    for rl in req.resource_logs:
                        cid = next((kv.value.string_value for kv in rl.resource.attributes
                                    if kv.key == "container.id"), "")
                        seen = uids.setdefault(cid, set())
                        for sl in rl.scope_logs:
                            for lr in sl.log_records:
                                counts[cid] = counts.get(cid, 0) + 1
                                for kv in lr.attributes:
                                    if kv.key == "log.record.uid":
                                        seen.add(kv.value.string_value)
                                        break
                elif self.kind == "traces":
                    for rs in req.resource_spans:
                        cid = next((kv.value.string_value for kv in rs.resource.attributes
                                    if kv.key == "container.id"), "")
                        spans[cid] = spans.get(cid, 0) + sum(len(ss.spans) for ss in rs.scope_spans)

    rx.requests = {k: Sink(k) for k in orig}
    rx.start()

    def dump():
        with lock:
            d = {"logs": counts, "unique": {k: len(v) for k, v in uids.items()}, "spans": spans}
        tmp = status + ".tmp"
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, status)
    print("listening", rx.port, flush=True)
    try:
        while True:
            time.sleep(0.1)
            dump()
    except KeyboardInterrupt:
        pass
    finally:
        rx.stop()


if __name__ == "__main__":
    import argparse
    import signal
    ap = argparse.ArgumentParser(description="OTLP/gRPC receiver that counts log records per container.id")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--status", required=True, help="JSON file rewritten every 0.1 s with the counts")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    _serve(a.port, a.status)
