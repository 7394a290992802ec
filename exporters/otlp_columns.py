"""The OTLP log request of a batch given as columns (issue 15: the OTLP sink
works from what a spool read of batch frames hands it, no dict per record).

    ColumnLogs(sink).records(cols, n, now, extra_rows) -> [(Resource, [LogRecord bytes])]

The same bytes as OtlpSink._log_fields + LogsEncoder.log_record make of the
records, built column by column instead of record by record: each field's
attribute bytes come from a cache keyed by the value (a workload repeats its
values: node, comm, policy, pid, flags, ret, and a file's path), a record is
the join of its columns' pieces (one C-level zip and join), and a body is
audit_schema.describe.detail of a view of the record's columns, cached by the
columns it reads. Records this does not word itself (a kind without a
column formatter below, a unix-socket connect whose network.transport moves)
take the record path (_log_fields) one by one, so their bytes are the record
path's by construction. tests/test_otlp_columns.py checks that a batch's
request is byte for byte the record path's and the SDK encoder's, for
non-UTF-8 and huge values and mixed kinds.

A column may be a list or a Repeat (Batch.raw_columns: a batch frame's
{"r": value}, kept while a read's frames agree on it): a Repeat's attribute
is encoded once (once per kind for a kind-dependent name), its body worded
once when every column the body reads is one, and it is never made a list
or scanned (a sandbox's read: node, sandbox, kind, pid, comm, policy, flags
and every default are Repeats).

records() returns None when the columns are not the recorder's normalized
shape (every field of audit_schema, in order, no None, ints that are ints)
or none of the records is of a kind worded here: the caller then takes the
record path for the whole batch.
"""
from __future__ import annotations

import struct
from itertools import repeat

from audit_schema.describe import detail
from audit_schema.events import FIELDS
from exporters.otlp_mapping import ATTRIBUTES, _SAMPLED, _ZERO_MEANS, _severity, attr_items, span_id_of, trace_id_of
from exporters.otlp_wire import _F32, _F64, _VT, ld, key_value, varint
from exporters.spool import Repeat

_NAMES = [f.name for f in FIELDS]
_UNIQUE = ("event_id",)                        # a different value in every record
_CACHE_MAX = 20_000                # entries per cache, each at most _ENTRY_MAX bytes
_ENTRY_MAX = 512
_TS = struct.Struct("<BQ")


def _seq(col, n):
    """The column's values to iterate: a Repeat as itertools.repeat (C), a list as it is."""
    return repeat(col.value, n) if col.__class__ is Repeat else col


def _distinct(col) -> set:
    return {col.value} if col.__class__ is Repeat else set(col)


def _types(col) -> set:
    return {col.value.__class__} if col.__class__ is Repeat else set(map(type, col))


class _Row:
    """Record i of the columns, as audit_schema.describe.detail reads an event."""
    __slots__ = ("c", "i")

    def __init__(self, c, i):
        self.c, self.i = c, i

    def get(self, k, d=None):
        col = self.c.get(k)
        return d if col is None else col[self.i]

    def __getitem__(self, k):
        return self.c[k][self.i]


# kind -> the columns describe.detail reads for its body (the key of its body cache; None:
# argv, a list, is no key -- worded each time); other kinds take the record path
BODIES = {
    "open_write": ("path", "flags", "ret"),
    "unlink": ("path", "ret"),
    "rename": ("path", "path2", "ret"),
    "fork": ("child_pid",),
    "exit": ("signal", "exit_code"),
    "exec": None,
    "connect": ("family", "addr", "port", "ret"),
}
# per field: the kinds for which its 0 / "" is kept
_KEEP_ZERO = {}
for _k, _fs in _ZERO_MEANS.items():
    for _f in _fs:
        _KEEP_ZERO.setdefault(_f, set()).add(_k)
_ATTR_FIELDS = [(f.name, f.ch_type, ATTRIBUTES[f.name][1]) for f in FIELDS if ATTRIBUTES[f.name][0] == "attr"]


def _encoded(items) -> bytes:
    return b"".join([ld(6, key_value(k, x)) for k, x in items])


class ColumnLogs:
    """Columns -> log record bytes for one OtlpSink (its resources, ids, scope)."""

    def __init__(self, sink):
        self.sink = sink
        self._attr: dict = {}       # (field, attribute name, keep zero) -> {value: bytes}
        self._attr_k: dict = {}     # (field,) -> {(kind, value): bytes} for kind-dependent fields
        self._body: dict = {}       # kind -> {key: body field bytes}
        self._ids: dict = {}        # (node, sandbox_id, step) -> flags + trace_id + span_id bytes
        self._kind: dict = {}       # kind -> (dsec.kind attribute bytes, event_name bytes)
        self._sev: dict = {}        # (kind, decision) -> severity fields bytes

    @staticmethod
    def usable(cols) -> bool:
        return bool(cols) and list(cols) == _NAMES and \
            not any(c.value is None if c.__class__ is Repeat else None in c for c in cols.values())

    def _column(self, field, ch_type, spec, col, kinds, K):
        """The attribute bytes of one column, one per record (None: all empty;
        bytes: the same for every record). col: a list, or a Repeat (one value,
        encoded once)."""
        dep = isinstance(spec, dict)
        kz = _KEEP_ZERO.get(field, ())
        names = {(spec.get(k) or spec["*"]) if dep else spec for k in kinds}
        keeps = {k in kz for k in kinds}
        n = len(col)
        if len(names) == 1 and len(keeps) == 1:        # the same for every kind of the batch
            name, keep = names.pop(), keeps.pop()
            if col.__class__ is Repeat:                # one value: bytes, or nothing
                if not keep and not col.value:
                    return None
                return self._column(field, ch_type, spec, [col.value], kinds, K)[0]
            if not keep and not any(col):
                return None
            if field in _UNIQUE:                       # a value per record: nothing to remember
                return self._unique(field, name, col)
            if n > 1 and col.count(col[0]) == n and len(set(map(type, col))) == 1:
                return self._column(field, ch_type, spec, col[:1], kinds, K)[0]     # one value: bytes
            cache = self._attr.get((field, name, keep))
            if cache is None or len(cache) >= _CACHE_MAX:
                cache = self._attr[(field, name, keep)] = {}
            if ch_type == "Array(String)":
                out = []
                for v in col:
                    if not v and not keep:
                        out.append(b"")
                        continue
                    t = tuple(v)
                    got = cache.get(t)
                    if got is None:
                        got = _encoded(attr_items(field, ch_type, name, v))
                        if len(got) <= _ENTRY_MAX:
                            cache[t] = got
                    out.append(got)
                return out
            get = cache.get
            out = list(map(get, col))
            if None in out:
                for i, v in enumerate(col):
                    if out[i] is None:
                        got = get(v)
                        if got is None:
                            got = _encoded(attr_items(field, ch_type, name, v)) if v or keep else b""
                            if len(got) <= _ENTRY_MAX:
                                cache[v] = got
                        out[i] = got
            return out
        cache = self._attr_k.get(field)
        if cache is None or len(cache) >= _CACHE_MAX:
            cache = self._attr_k[field] = {}
        out = []
        for k, v in zip(_seq(K, n), _seq(col, n)):
            key = (k, tuple(v) if ch_type == "Array(String)" else v)
            got = cache.get(key)
            if got is None:
                name = (spec.get(k) or spec["*"]) if dep else spec
                got = _encoded(attr_items(field, ch_type, name, v)) if v or k in kz else b""
                if len(got) <= _ENTRY_MAX:
                    cache[key] = got
            out.append(got)
        return out

    @staticmethod
    def _unique(field, name, col):
        """A string attribute of ASCII values encoded directly (ld(6, key_value(name, v)))."""
        key = ld(1, name.encode("utf-8")) + b"\x12"
        vt = _VT
        lens = set(map(len, col))
        if len(lens) == 1 and 0 < min(lens) < 8000 and "".join(col).isascii():     # the usual case: one prefix
            n = lens.pop()
            inner = 1 + len(vt[n]) + n                       # AnyValue: string_value (field 1)
            kv = len(key) + len(vt[inner]) + inner          # KeyValue: key, value (field 2)
            prefix = b"\x32" + vt[kv] + key + vt[inner] + b"\x0a" + vt[n]
            return [prefix + v.encode() for v in col]
        out = []
        for v in col:
            if not v or not v.isascii() or len(v) > 8000:
                out.append(_encoded(attr_items(field, "String", name, v)) if v else b"")
                continue
            inner = b"\x0a" + vt[len(v)] + v.encode()
            kv = key + vt[len(inner)] + inner
            out.append(b"\x32" + vt[len(kv)] + kv)
        return out

    def _kind_bytes(self, kind):
        got = self._kind.get(kind)
        if got is None:
            got = self._kind[kind] = (ld(6, key_value("dsec.kind", kind)), ld(12, f"dsec.{kind}".encode("utf-8")))
        return got

    def _bodies(self, cols, K, kinds, n, slow):
        """The body field (5) of each record (bytes: the same for every record);
        records of kinds without a formatter: in slow."""
        out = [b""] * n
        for k in kinds:
            idx = range(n) if len(kinds) == 1 else [i for i, x in enumerate(K) if x == k]
            if k not in BODIES:
                slow.update(idx)
                continue
            keycols = BODIES[k]
            cache = self._body.get(k)
            if cache is None or len(cache) >= _CACHE_MAX:
                cache = self._body[k] = {}
            if len(kinds) == 1 and keycols is not None and all(cols[c].__class__ is Repeat for c in keycols):
                # the same body for every record (it reads only these columns): worded once
                key = tuple(cols[c].value for c in keycols)
                got = cache.get(key)
                if got is None:
                    try:
                        body = f"{k}: {detail(_Row(cols, 0))}".rstrip(": ")
                    except Exception:  # noqa: BLE001 - the record path's courtesy: the kind alone
                        slow.update(idx)
                        return out
                    got = ld(5, ld(1, body.encode("utf-8")))
                    if len(got) <= _ENTRY_MAX:
                        cache[key] = got
                return got
            if keycols is None:
                keys = [None] * len(idx)
            elif len(kinds) == 1:
                keys = list(zip(*[_seq(cols[c], n) for c in keycols]))
            else:
                keys = list(zip(*[[cols[c][i] for i in idx] for c in keycols]))
            vals = list(map(cache.get, keys)) if keycols is not None else keys
            if len(kinds) == 1 and None not in vals:
                out = vals                              # the usual case: every body known
                continue
            for i, key, got in zip(idx, keys, vals):
                if got is None and key is not None:
                    got = cache.get(key)                # worded for an earlier record of this read
                if got is None:
                    try:
                        body = f"{k}: {detail(_Row(cols, i))}".rstrip(": ")     # the record path's words
                    except Exception:  # noqa: BLE001 - the record path's courtesy: the kind alone
                        slow.add(i)
                        continue
                    got = ld(5, ld(1, body.encode("utf-8")))
                    if key is not None and len(got) <= _ENTRY_MAX:
                        cache[key] = got
                out[i] = got
        return out

    def records(self, cols, n: int, now: int, extra=None):
        """[(Resource, [LogRecord bytes])] of the n records in cols (FIELDS order) and
        the rows `extra` after them, grouped by resource; None: not columns this takes."""
        if not self.usable(cols):
            return None
        for field, ch_type, _ in _ATTR_FIELDS:
            if ch_type not in ("String", "Array(String)") and _types(cols[field]) != {int}:
                return None
        K = cols["kind"]
        kinds = _distinct(K)
        slow = set()
        fam = cols["family"]
        if fam.__class__ is Repeat:
            if fam.value == "unix":
                return None                             # every record moves network.transport: the record path
        elif "unix" in fam:
            slow.update(i for i, f in enumerate(fam) if f == "unix")
        bodies = self._bodies(cols, K, kinds, n, slow) if len(kinds) > 1 or K[0] in BODIES else None
        if bodies is None or len(slow) == n:
            return None                                 # no record this words itself: the record path
        kb = [self._kind_bytes(k) for k in kinds]
        kind_attr = {k: b[0] for k, b in zip(kinds, kb)}
        observed = b"\x59" + _F64.pack(now) if now else b""
        tail = {k: observed + b[1] for k, b in zip(kinds, kb)}
        sev = self._sev
        if len(sev) > 4096:
            sev.clear()
        dec = cols["decision"]
        sevs = {(K.value, dec.value)} if K.__class__ is Repeat and dec.__class__ is Repeat else \
            set(zip(_seq(K, n), _seq(dec, n)))
        for kd in sevs:
            if kd not in sev:
                s, text = _severity({"kind": kd[0], "decision": kd[1]})
                sev[kd] = (b"\x10" + varint(s.value) if s.value else b"") + (ld(3, text.encode()) if text else b"")
        ts = cols["ts_ns"]
        if ts.__class__ is Repeat:
            t = ts.value or now
            ts = _TS.pack(9, t) if t else b""
        else:
            ts = [_TS.pack(9, t) if t else b"\x09" + _F64.pack(now) for t in ts] if now else \
                [_TS.pack(9, t) if t else b"" for t in ts]
        pieces = [ts,
                  [sev[kd] for kd in zip(K, dec)] if len(sevs) > 1 else sev[sevs.pop()],
                  bodies,
                  [kind_attr[k] for k in K] if len(kinds) > 1 else kind_attr[K[0]]]
        for field, ch_type, spec in _ATTR_FIELDS:
            p = self._column(field, ch_type, spec, cols[field], kinds, K)
            if p is not None:
                pieces.append(p)
        # flags, trace_id, span_id: the sandbox's trace and its step's span
        ids = self._ids
        if len(ids) > 65536:
            ids.clear()
        idc = (cols["node"], cols["sandbox_id"], cols["step"])
        if all(c.__class__ is Repeat for c in idc):
            keys = [tuple(c.value for c in idc)]
        else:
            keys = list(zip(*[_seq(c, n) for c in idc]))
        ids_of = set(keys)
        for key in ids_of:
            if key not in ids:
                node, sid, step = key
                if sid:
                    tid = trace_id_of(node, sid)
                    spid = span_id_of(node, sid, "step", step) if step else span_id_of(node, sid)
                    ids[key] = (b"\x45" + _F32.pack(_SAMPLED) + ld(9, tid.to_bytes(16, "big"))
                                + ld(10, spid.to_bytes(8, "big")))
                else:
                    ids[key] = b""
        pieces.append([ids[k] for k in keys] if len(ids_of) > 1 else ids[keys[0]])
        pieces.append([tail[k] for k in K] if len(kinds) > 1 else tail[K[0]])
        # one join per record of its varying pieces and, between them, the constant ones
        args, const = [], b""
        for p in pieces:
            if p.__class__ is bytes:
                const += p
                continue
            if const:
                args.append(repeat(const, n))
                const = b""
            args.append(p)
        if const:
            args.append(repeat(const, n))
        recs = list(map(b"".join, zip(*args))) if args else [const] * n
        rc = (cols["node"], cols["sandbox_id"])
        one = tuple(c.value for c in rc) if all(c.__class__ is Repeat for c in rc) else None
        enc, fields = self.sink._wire, self.sink._log_fields
        if slow:
            order = sorted(slow)
            rows = [dict(zip(cols, [c[i] for c in cols.values()])) for i in order]
            for i, (_, f) in zip(order, fields(rows, now)):
                recs[i] = enc.log_record(**f)
        for r, f in fields(extra or (), now):        # events_lost rows of the batch's damage, at the end
            recs.append(enc.log_record(**f))
        more = [(r.get("node") or "", r.get("sandbox_id") or "") for r in extra or ()]
        # grouped by resource in order of first appearance (as the record path), keyed by
        # (node, sandbox_id): a Resource's hash is a JSON dump of its attributes
        res_of = self.sink._resource
        if one is not None:
            if all(k == one for k in more):
                return [(res_of(*one), recs)]
            keys = [one] * n + more
        else:
            keys = list(zip(*[_seq(c, n) for c in rc])) + more
        first = dict.fromkeys(keys)
        if len(first) == 1:
            return [(res_of(*keys[0]), recs)]
        slot, by_res = {}, {}
        for key in first:
            slot[key] = by_res.setdefault(res_of(*key), len(by_res))
        groups = [[] for _ in by_res]
        for key, r in zip(keys, recs):
            groups[slot[key]].append(r)
        return list(zip(by_res, groups))


__all__ = ["BODIES", "ColumnLogs"]
