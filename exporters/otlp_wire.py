"""An OTLP ExportLogsServiceRequest written as protobuf wire bytes (issue 15:
the OTLP sink batch-shaped).

The SDK's path (ReadableLogRecord per record, then its encoder building a
protobuf object per record, per attribute and per value) cost ~40 us a
record. This writes the same message directly: every attribute's KeyValue
is encoded once per distinct (key, value) and remembered (a workload's
attributes repeat: node, kind, comm, policy, pid ...), a record is its
fields' bytes joined, a request the records grouped by resource (in order
of first appearance, as the SDK groups them) under one scope. A request the
record path makes this way is parsed back into the SDK's
ExportLogsServiceRequest before it is sent (so the message is checked by
protobuf itself); one made from a read's columns (exporters/otlp_columns.py)
is sent as its bytes (exporters/otel.py log_request_bytes_of): its parse was
~2.5 us a record, and tests/test_otlp_columns.py checks those bytes against
the record path's and that they parse to the same request.
tests/test_exporters.py checks that the record path's request equals what
the SDK's encoder makes of the same records.

Field numbers (opentelemetry-proto, logs/v1 and common/v1):
  ExportLogsServiceRequest  resource_logs=1
  ResourceLogs              resource=1 scope_logs=2 schema_url=3
  Resource                  attributes=1
  ScopeLogs                 scope=1 log_records=2 schema_url=3
  InstrumentationScope      name=1 version=2 attributes=3
  LogRecord                 time_unix_nano=1 (fixed64) severity_number=2 severity_text=3 body=5
                            attributes=6 flags=8 (fixed32) trace_id=9 span_id=10
                            observed_time_unix_nano=11 (fixed64) event_name=12
  KeyValue                  key=1 value=2
  AnyValue                  string=1 bool=2 int=3 double=4 array=5 kvlist=6 bytes=7
  ArrayValue / KeyValueList values=1
"""
from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

_F64 = struct.Struct("<Q")
_F32 = struct.Struct("<I")
_D = struct.Struct("<d")
_CACHE_MAX = 200_000


def varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1                  # int64: two's complement, 10 bytes
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return bytes(((field << 3) | 2,)) + varint(len(payload)) + payload


_VT = [varint(i) for i in range(1 << 14)]      # the varints of lengths below 16384, looked up


def ld_many(field: int, payloads) -> bytes:
    """ld(field, p) of each payload, joined (a table lookup for a short length)."""
    tag, vt = bytes(((field << 3) | 2,)), _VT
    return b"".join([tag + (vt[len(p)] if len(p) < 16384 else varint(len(p))) + p for p in payloads])


def any_value(v) -> bytes:
    """An AnyValue's bytes, as the SDK's _encode_value chooses the member."""
    if v is None:
        return b""
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, str):
        return ld(1, v.encode("utf-8"))
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _D.pack(v)
    if isinstance(v, bytes):
        return ld(7, v)
    if isinstance(v, Sequence):
        return ld(5, b"".join(ld(1, any_value(x)) for x in v))
    if isinstance(v, Mapping):
        return ld(6, b"".join(ld(1, key_value(str(k), x)) for k, x in v.items()))
    raise TypeError(f"invalid attribute value type {type(v).__name__}")


def key_value(key: str, v) -> bytes:
    return ld(1, key.encode("utf-8")) + ld(2, any_value(v))


def attributes(attrs) -> bytes:
    """Resource.attributes (repeated KeyValue, field 1)."""
    return b"".join(ld(1, key_value(k, v)) for k, v in (attrs or {}).items())


class LogsEncoder:
    """Log records -> ExportLogsServiceRequest bytes, remembering encoded attributes."""

    def __init__(self):
        self._kv: dict = {}          # (key, value type, value) -> field-6 bytes of a KeyValue
        self._res: dict = {}         # Resource -> its encoded Resource message

    def attr(self, key: str, v) -> bytes:
        try:
            ck = (key, v.__class__, v)
            got = self._kv.get(ck)
        except TypeError:            # a list value: not hashable
            return ld(6, key_value(key, v))
        if got is None:
            if len(self._kv) >= _CACHE_MAX:
                self._kv.clear()
            got = self._kv[ck] = ld(6, key_value(key, v))
        return got

    def log_record(self, *, ts: int, observed: int, severity_number: int, severity_text: str, body: str,
                   attrs: dict, event_name: str, trace_id: int = 0, span_id: int = 0, flags: int = 0) -> bytes:
        a = self.attr
        parts = [b"\x09" + _F64.pack(ts) if ts else b"",
                 b"\x10" + varint(severity_number) if severity_number else b"",
                 ld(3, severity_text.encode("utf-8")) if severity_text else b"",
                 ld(5, any_value(body)),
                 b"".join([a(k, v) for k, v in attrs.items()]),
                 b"\x45" + _F32.pack(flags) if flags else b"",
                 ld(9, trace_id.to_bytes(16, "big")) if trace_id else b"",
                 ld(10, span_id.to_bytes(8, "big")) if span_id else b"",
                 b"\x59" + _F64.pack(observed) if observed else b"",
                 ld(12, event_name.encode("utf-8")) if event_name else b""]
        return b"".join(parts)

    def resource(self, res) -> bytes:
        got = self._res.get(res)
        if got is None:
            if len(self._res) >= 4096:
                self._res.clear()
            got = self._res[res] = attributes(res.attributes)
        return got

    def request(self, groups, scope) -> bytes:
        """groups: [(Resource, [LogRecord bytes])] in order; one scope for all."""
        sc = b""
        if scope is not None:
            sc = ld(1, scope.name.encode("utf-8")) if scope.name else b""
            if scope.version:
                sc += ld(2, scope.version.encode("utf-8"))
            sc += b"".join(ld(3, key_value(k, v)) for k, v in (getattr(scope, "attributes", None) or {}).items())
        out = []
        for res, recs in groups:
            scope_logs = ld(1, sc) + ld_many(2, recs)
            if scope is not None and scope.schema_url:
                scope_logs += ld(3, scope.schema_url.encode("utf-8"))
            body = ld(1, self.resource(res)) + ld(2, scope_logs)
            if res.schema_url:
                body += ld(3, res.schema_url.encode("utf-8"))
            out.append(ld(1, body))
        return b"".join(out)
