"""The durable local spool between the event decoder and the exporters.

Why this file is long: the on-disk format, the writer and the reader live
together because they must agree byte for byte (frames, cursors, damage
recovery); every change to one is a change to the others.

Layout of a spool directory (default /var/lib/dsec/spool, env DSEC_SPOOL_DIR):

  0000000000000001.seg   append-only segment files, consecutive numbers
  0000000000000002.seg   (the highest number is the "head": the only one
  ...                     that is ever appended to)
  lock                   flock(2)ed by every writer for each append
  id                     random id of this spool (names its gap events)
  cursors/<sink>.json    one cursor per sink: {"segment": N, "offset": BYTES}
  cursors/<sink>.lock    held by the one process reading for that sink
  damage.log             JSON lines: every corrupt or invalid region found
  damaged/               the raw bytes of those regions, kept for forensics

A segment is a sequence of frames:

  magic b"\\xd5\\xec\\x01\\xfe" | u32 LE length | u32 LE crc32(length bytes +
  payload) | payload = the record as ASCII JSON (json.dumps ensure_ascii: the
  lone surrogates of surrogateescape fields travel as "\\udcXX" escapes and
  come back exactly)

or, for an append of BATCH_MIN (32) or more records that all have the same
fields (the recorder's: normalized records), batch frames of up to BATCH_MAX
(4096) records each (issue 15: one JSON document, one CRC and one parse per
batch instead of per record, and columns the ClickHouse sink inserts without
transposing dicts):

  magic b"\\xd5\\xec\\x02\\xfe" | u32 LE length | u32 LE crc32 | payload =
  u32 LE record count | ASCII JSON {"k": [field names], "c": [[the values of
  one field, one per record] or {"r": the value of that field in every
  record}, ...], "w": SCHEMA_MARK}

A column whose values are all the same (most of them in a batch of one
sandbox's records: node, sandbox, kind, policy, pid, comm, every default) is
{"r": value}: measured on 4,096 open_write records, 35 of 39 columns, the
payload 324 -> 93 bytes a record, its parse 1.3 -> 0.11 us a record. A read
keeps such a column as a Repeat (value, length) while its frames agree on
the value (Batch.raw_columns; Batch.columns makes lists), so the ClickHouse
sink neither builds nor scans a list for it. Readers from before it count
such a frame as damage (its bytes kept): downgrade dsec only with the
spool drained.

"w" (since issue 15's exporter work; readers before it ignore the key) is the
writer's promise that every record of the frame passed the spool's checks
(_column_lists_valid: fields, types, ranges, kinds, event ids) against the
schema SCHEMA_MARK names (a CRC of the fields, their types and the kinds).
A reader trusts a frame whose CRC checks and whose mark is its own, and
skips re-checking every value (~1 us a record in the exporter): the spool
directory is root-owned (0700) and written only by dsec's own writers, the
CRC proves the bytes are the ones that writer framed, and the same checks
on the same JSON give the same verdict. A frame without the mark (a writer
before it, a hand-made frame) or with another one (another schema: a
newer dsec's spool read by an older one, or the reverse) is checked value
by value as before, so an invalid record there is still damage of its own.

A batch frame is one unit of damage: bit rot in it loses its records (the
damage counts them by the count in its header, unverified once the CRC
fails; the bytes are kept under damaged/). A record of an intact batch frame
that fails validation is damage of its own (the others are delivered).
Spool(frames="record") (env DSEC_SPOOL_FRAMES=record) writes frames of one
record only; readers read both kinds.

Concurrency: any number of processes may append at once (several `dsec run`).
Each append takes an exclusive flock on `lock`, writes all its frames with
O_APPEND to the head segment and releases the lock, so frames never
interleave. A segment is "head" while segment N+1 does not exist; a writer
rotates (creates N+1 with O_EXCL) when the head reaches `segment_bytes`, and
a writer holding an older fd checks for N+1 under the lock before writing.
Readers never lock for reading; they only take the writer lock to decide
whether an incomplete frame at the end of the head is a write in progress
(then it completes once they hold the lock) or a writer's torn last write
(a crash: then it is reported as damage and skipped).

Durability (fsync policy, env DSEC_SPOOL_FSYNC):
  always    (default) fdatasync after every append call, before it returns:
            a returned append survives a power loss.
  interval  fdatasync at most every DSEC_SPOOL_FSYNC_INTERVAL seconds
            (default 1) and at close: a power loss may lose the records
            appended since the last sync.
  never     leave it to the kernel (tests, benchmarks).
  Whatever the policy, a process crash (SIGKILL included) loses nothing that
  append() returned: the bytes are in the kernel's page cache. New segment
  files and cursor files are made durable with an fsync of the directory.

Cursors: a sink reads from its cursor, delivers, then commits the new
position (write temp file, fsync, rename, fsync dir: a cursor is always
either the old or the new one). Delivery is therefore at-least-once; the
sinks make re-delivery harmless (ClickHouse dedups by event_id). A segment is
deleted once every sink's cursor is past it (never the head). A sink that
never reads again holds segments forever: drop it with Spool.drop_sink().

Damage: a frame whose magic, length or CRC is wrong is skipped up to the next
frame that checks out; a frame whose JSON or fields are invalid is skipped;
both are logged (warning + damage.log + the raw bytes under damaged/) and
handed to the sink as Damage so it can record a gap (an `events_lost` event).
Nothing is dropped silently, and no damage stops the records after it.

Disk budget (max_bytes, env DSEC_SPOOL_MAX_BYTES, default 8 GiB; checked at
every append). The policy is DROP WITH LOUD ACCOUNTING, never block: a
blocked producer would stall the recorder thread, the kernel's ring buffer
would overflow and lose events anyway (less precisely accounted), and the
launcher's own records (sandbox_start/exit) would hang `dsec run`. When an
append would go over the budget:
  1. segments needed only by best-effort sinks (cursor "evictable": OTLP and
     JSON lines by default) are evicted, oldest first: deleted, and each such
     sink is told how many records it missed (cursors/<sink>.evicted.json;
     its reader hands that to the sink as Damage with cause "sink_evicted",
     which becomes an events_lost record in that sink only; what the sink
     was delivering from that segment meanwhile is taken off at its commit).
     A dead best-effort sink therefore never costs the other sinks anything.
  2. if that frees too little (a required sink, e.g. ClickHouse, is behind),
     the batch is dropped (all or none, as with any append): counted per
     sandbox, logged (warning, at most every 5 s), added to the metric
     dsec.events.lost{reason="spool_full"}, and recorded as `events_lost`
     records (reason "spool_full", count, kinds, time window) written into a
     reserve above the budget (reserve_bytes) so that the gap marker itself
     always fits. Loss records of one episode are coalesced to at most one per
     sandbox per second; a crash loses at most that last second's count (the
     gap itself is already marked by the first record of the episode).
  ENOSPC/EDQUOT from the file system are handled the same way (step 2).
  Spool(on_full="error") restores the old behaviour: the append raises.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import json
import logging
import operator
import os
import struct
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field

from exporters.errors import ExportError, USAGE as EXIT_USAGE
try:
    import orjson       # pyproject.toml: several times json's speed on the spool's hot path
except ImportError:     # pragma: no cover - json alone is correct, only slower
    orjson = None
from audit_schema.events import BY_NAME, FIELDS, KINDS
from exporters.columns import CLS_INT, CLS_LIST, CLS_NONE, CLS_OTHER, CLS_STR, CLS_TUPLE, columns

log = logging.getLogger("dsec.spool")

MAGIC = b"\xd5\xec\x01\xfe"       # a frame of one record
MAGIC_BATCH = b"\xd5\xec\x02\xfe" # a frame of many records, by column (module doc)
_MAGICS = (MAGIC, MAGIC_BATCH)
_HDR = struct.Struct("<4sII")
_U32 = struct.Struct("<I")
FRAMES = ("batch", "record")        # Spool(frames=), env DSEC_SPOOL_FRAMES
BATCH_MIN = 32                      # an append of fewer records is framed record by record
BATCH_MAX = 4096                    # records per batch frame, at most
BATCH_MAX_BYTES = 4 << 20           # a batch frame's payload, at most (else: frames of one record)
HEADER_BYTES = _HDR.size            # 12
MAX_RECORD_BYTES = 16 << 20         # one record's JSON, at most
DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_MAX_BYTES = 8 << 30         # disk budget: past it, the drop policy (module doc)
LOSS_EMIT_INTERVAL = 1.0            # at most one spool_full events_lost per sandbox per second
ON_FULL = ("drop", "error")
_READ_CHUNK = MAX_RECORD_BYTES + HEADER_BYTES + (1 << 20)   # holds any frame
_SMALL_CHUNK = 4 << 20
FSYNC_POLICIES = ("always", "interval", "never")
_SEG_SUFFIX = ".seg"


def default_dir() -> str:
    return os.environ.get("DSEC_SPOOL_DIR") or os.path.join(
        os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"), "spool")


# --- records -------------------------------------------------------------------

_INT_RANGES = {
    "UInt8": (0, 2**8 - 1), "UInt16": (0, 2**16 - 1), "UInt32": (0, 2**32 - 1),
    "UInt64": (0, 2**64 - 1), "Int8": (-2**7, 2**7 - 1), "Int16": (-2**15, 2**15 - 1),
    "Int32": (-2**31, 2**31 - 1), "Int64": (-2**63, 2**63 - 1),
}


def _encodable(v: str) -> bool:
    if v.isascii():
        return True
    try:
        v.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False


# field name -> int (lo, hi) | "String" | "Array(String)", from FIELDS
_CHECKS = {f.name: _INT_RANGES.get(f.ch_type, f.ch_type) for f in FIELDS}


def validate_record(rec) -> dict:
    """Check a record against FIELDS; return it (unchanged) or raise ExportError
    naming the event and the field. Only non-default fields need be present."""
    if not isinstance(rec, dict):
        raise ExportError(f"audit record: expected a dict, got {type(rec).__name__}", EXIT_USAGE)
    eid = rec.get("event_id")
    where = f"audit record {eid!r}" if isinstance(eid, str) and eid else "audit record"
    if not isinstance(eid, str) or not eid or len(eid) > 128 or not eid.isprintable():
        raise ExportError(f"{where}: event_id must be a non-empty printable string of at most 128 chars", EXIT_USAGE)
    for name, v in rec.items():
        check = _CHECKS.get(name)
        if check is None:
            raise ExportError(f"{where}: unknown field {name!r}", EXIT_USAGE)
        if v is None:
            continue
        if check.__class__ is tuple:
            if v.__class__ is not int and (not isinstance(v, int) or isinstance(v, bool)):
                raise ExportError(f"{where}: field {name!r} must be an integer "
                                f"({BY_NAME[name].ch_type}), got {type(v).__name__}", EXIT_USAGE)
            if not check[0] <= v <= check[1]:
                raise ExportError(f"{where}: field {name!r} = {v} is out of range for {BY_NAME[name].ch_type}",
                                EXIT_USAGE)
        elif check == "String":
            if v.__class__ is not str or not _encodable(v):
                raise ExportError(f"{where}: field {name!r} must be a str (surrogateescape for raw bytes)", EXIT_USAGE)
        elif check == "Array(String)":
            if not isinstance(v, (list, tuple)) or not all(x.__class__ is str and _encodable(x) for x in v):
                raise ExportError(f"{where}: field {name!r} must be a list of str (surrogateescape for raw bytes)",
                                EXIT_USAGE)
        else:  # a type the schema added without teaching the spool
            raise ExportError(f"{where}: field {name!r} has type {check} the spool cannot check", EXIT_USAGE)
    kind = rec.get("kind")
    if kind not in KINDS:
        raise ExportError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}", EXIT_USAGE)
    return rec


_KIND_SET = frozenset(KINDS)
_NONE = type(None)
# A batch frame's "w" (module doc): this schema's fields, types and kinds, which the
# writer's _column_lists_valid checked; a frame with another mark (or none) is checked on read
SCHEMA_MARK = zlib.crc32(repr(([(f.name, f.ch_type) for f in FIELDS], list(KINDS))).encode())


def _column_ok(name: str, vals) -> bool:
    """validate_record's check of field `name` for a whole column of values:
    _column_types_ok (a set of classes, a min and a max) and one encode of
    the joined strings."""
    if not _column_types_ok(name, vals):
        return False
    check = _CHECKS[name]
    if check == "String":
        return _encodable("".join([v for v in vals if v is not None]))
    if check == "Array(String)":
        return _encodable("".join([x for v in vals if v for x in v]))
    return True


def _columns_valid(records: list) -> bool:
    """validate_record's checks for a whole batch, column by column (a set of
    classes, a min and a max, one encode of the joined strings per field
    instead of a Python branch per value). True: every record passes; False:
    some record may not (validate_record then names it)."""
    for r in records:
        if r.__class__ is not dict:
            return False
    if not records:
        return True
    keys = records[0].keys()
    if all(r.keys() == keys for r in records):
        # the usual case (normalized records: every field): one C-level pass makes the columns
        names = tuple(keys)
        if len(names) == 1:
            columns = zip(names, [tuple(r[names[0]] for r in records)])
        else:
            columns = zip(names, zip(*map(operator.itemgetter(*names), records)))
    else:
        names = tuple(set().union(*records))
        columns = ((name, [r.get(name) for r in records]) for name in names)
    if not _CHECKS.keys() >= set(names):
        return False
    if not all(_column_ok(name, vals) for name, vals in columns):
        return False
    for r in records:
        eid = r.get("event_id")
        if eid.__class__ is not str or not eid or len(eid) > 128 or r.get("kind") not in _KIND_SET:
            return False
    return "".join(r["event_id"] for r in records).isprintable()


def _column_lists_valid(names, cols) -> bool:
    """_columns_valid for records given as columns (a batch frame's): the same
    checks, without building the records first."""
    if not _CHECKS.keys() >= set(names):
        return False
    by = dict(zip(names, cols))
    if "event_id" not in by or "kind" not in by:
        return False
    if not all(_column_ok(name, vals) for name, vals in by.items()):
        return False
    eids = by["event_id"]
    if set(map(type, eids)) != {str} or min(map(len, eids)) < 1 or max(map(len, eids)) > 128:
        return False
    if not _KIND_SET.issuperset(by["kind"]):
        return False
    return "".join(eids).isprintable()


# up to this many records, validate_record one by one is cheaper than the columns (measured,
# lifecycle records: 1 / 3 / 8 records 4.5 / 13 / 35 us against 23 / 27 / 37 us; 16: 69 vs 54 us)
SMALL_BATCH = 8


def validate_records(records: list) -> list:
    """validate_record for each of `records` (a list), checked by column (a batch
    of more than SMALL_BATCH): the same verdict, the same error (naming the first
    bad record) when one fails."""
    if len(records) <= SMALL_BATCH:
        for r in records:
            validate_record(r)
        return records
    if not _columns_valid(records):
        for r in records:
            validate_record(r)
    return records


TRUNC_MARK = "...[dsec: truncated]"     # ends every value fit_record cut


def _dumps(rec) -> bytes:
    """A record as compact ASCII JSON. orjson where it gives exactly that (an
    ASCII record: its output is byte for byte json.dumps's); json.dumps with
    ensure_ascii for the rest (non-ASCII text, and the lone surrogates of
    surrogateescape fields, which orjson refuses: they travel as \\udcXX)."""
    if orjson is not None:
        try:
            out = orjson.dumps(rec)
        except (TypeError, ValueError):
            pass
        else:
            if out.isascii():
                return out
    return json.dumps(rec, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _loads(payload: bytes):
    """A frame's JSON: orjson, else json (\\udcXX escapes of raw bytes, which
    orjson refuses); json's ValueError/RecursionError when neither parses it."""
    if orjson is not None:
        try:
            return orjson.loads(payload)
        except ValueError:
            pass
    return json.loads(payload)


def _cut(v: str, keep: int) -> str:
    """v's first `keep` characters (never half a surrogate pair) + the marker."""
    return v[:max(0, keep)] + TRUNC_MARK


def fit_record(rec: dict, limit: int = MAX_RECORD_BYTES) -> tuple[dict, bytes]:
    """(record, its JSON) no larger than `limit`: a record is never refused for
    being large. Its largest fields are cut, each ending with TRUNC_MARK, until
    it fits; `extra` stays valid JSON (a cut extra's text moves under
    extra.extra_prefix) and extra.dsec_truncated names every field cut with its
    original length (characters, or items of argv). Most records fit at once
    and cost one json.dumps."""
    payload = _dumps(rec)
    if len(payload) <= limit:
        return rec, payload
    rec = dict(rec)
    cut: dict = {}
    try:
        note = json.loads(rec["extra"]) if rec.get("extra") else {}
    except ValueError:
        note = None
    if not isinstance(note, dict):
        note = None                       # not an object: kept (cut) as extra_prefix
    prefix = None if note is not None else (rec.get("extra") or "")
    fixed = {"event_id", "kind", "node", "sandbox_id"}
    for _ in range(64):                   # bounded: every round shrinks the largest field
        fields = {k: v for k, v in rec.items() if k not in fixed and k != "extra"
                  and (isinstance(v, str) or (isinstance(v, list) and v))}
        if prefix is not None:
            fields["extra"] = prefix
        elif note is not None and rec.get("extra"):
            fields["extra"] = rec["extra"]
        if not fields:
            break
        sizes = {k: len(_dumps({"": v})) for k, v in fields.items()}
        k = max(sizes, key=sizes.get)
        excess = len(payload) - limit + 4096          # room for the markers
        v = fields[k]
        if isinstance(v, list):
            cut.setdefault(k, len(v))
            keep = max(0, len(v) - 1 - int(len(v) * excess / max(1, sizes[k])))
            items = list(v[:keep])
            if not items and v and isinstance(v[0], str):
                items = [_cut(v[0], len(v[0]) - int(len(v[0]) * excess / max(1, sizes[k])) - 32)]
            rec[k] = items + [TRUNC_MARK]
        else:
            cut.setdefault(k, len(v))
            keep = len(v) - int(len(v) * excess / max(1, sizes[k])) - len(TRUNC_MARK)
            if k == "extra":
                prefix = _cut(prefix if prefix is not None else v, keep)
                note = None
            else:
                rec[k] = _cut(v, keep)
        d = dict(note) if note is not None else {"extra_prefix": prefix}
        d["dsec_truncated"] = cut
        rec["extra"] = json.dumps(d, separators=(",", ":"), sort_keys=True)
        payload = _dumps(rec)
        if len(payload) <= limit:
            _METRICS().add("dsec.records.truncated", 1, kind=str(rec.get("kind")))
            log.warning("audit record %r (%s) cut to fit the spool's %d-byte limit: %s",
                        rec.get("event_id"), rec.get("kind"), limit, ", ".join(sorted(cut)))
            return rec, payload
    raise ExportError(f"audit record {rec.get('event_id')!r}: cannot be cut to {limit} bytes", EXIT_USAGE)


def encode_frame(rec: dict) -> bytes:
    rec, payload = fit_record(rec)
    n = struct.pack("<I", len(payload))
    return MAGIC + n + struct.pack("<I", zlib.crc32(payload, zlib.crc32(n))) + payload


_TOO_BIG = object()


def _transposed(records: list, with_classes: bool = False):
    """(field names, one sequence of values per field) of records that all have the
    same fields, else None. with_classes: (names, columns, classes, ranges), the
    columns' class masks and int ranges (exporters/columns.py) when the C pass
    made them, else None."""
    if not records or records[0].__class__ is not dict:
        return None
    names = tuple(records[0])
    if not names:
        return None
    got = columns(records, names)         # the usual case: every record these fields in this order, in C
    if got is not None:
        return (names, *got) if with_classes else (names, got[0])
    if set(map(type, records)) != {dict} or set(map(len, records)) != {len(names)}:
        return None
    # the same number of fields and every one of the first record's present (else KeyError):
    # the same fields (another order) -- checked in C, not by a keys() comparison per record
    try:
        if len(names) == 1:
            cols = [tuple(map(operator.itemgetter(names[0]), records))]
        else:
            cols = list(zip(*map(operator.itemgetter(*names), records)))
    except KeyError:
        return None
    return (names, cols, None, None) if with_classes else (names, cols)


def _column_types_ok(name: str, vals, mask: int | None = None, rng=None) -> bool:
    """The classes of a column and its integer range: _column_ok without the
    encodability of strings (the append proves that by its dump, _encode_batch).
    mask, rng: the column's classes and (min, max) of its ints as
    exporters/columns.py gives them (else read here)."""
    if mask is not None:
        if mask & CLS_OTHER:
            return False                   # a class no field takes (bool, float, bytes, a subclass ...)
        if mask == CLS_NONE:
            return True
        m = mask & ~CLS_NONE
        check = _CHECKS[name]
        if check.__class__ is tuple and m == CLS_INT and rng is not None:
            return rng[0] >= check[0] and rng[1] <= check[1]
        if mask & CLS_NONE:
            vals = [v for v in vals if v is not None]
        if check.__class__ is tuple:
            return m == CLS_INT and min(vals) >= check[0] and max(vals) <= check[1]
        if check == "String":
            return m == CLS_STR
        if check == "Array(String)":
            if m & ~(CLS_LIST | CLS_TUPLE):
                return False
            if not any(vals):
                return True
            return not set(map(type, [x for v in vals for x in v])) - {str}
        return False
    classes = set(map(type, vals))
    if _NONE in classes:
        classes.discard(_NONE)
        if not classes:
            return True
        vals = [v for v in vals if v is not None]
    check = _CHECKS[name]
    if check.__class__ is tuple:
        return classes == {int} and min(vals) >= check[0] and max(vals) <= check[1]
    if check == "String":
        return classes == {str}
    if check == "Array(String)":
        if not classes <= {list, tuple}:
            return False
        if not any(vals):
            return True
        return not set(map(type, [x for v in vals for x in v])) - {str}
    return False


def _column_types_valid(names, cols, classes=None, ranges=None) -> bool:
    """_column_lists_valid but the encodability of the strings: every check
    that does not need the strings joined (_encode_batch proves the rest when
    its frames' JSON is ASCII; otherwise append_many runs the full check).
    classes, ranges: the columns' class masks and int ranges (exporters/columns.py),
    if at hand."""
    if not _CHECKS.keys() >= set(names):
        return False
    by = dict(zip(names, cols))
    if "event_id" not in by or "kind" not in by or len(by) != len(names):
        return False
    if classes is None:
        if not all(_column_types_ok(name, vals) for name, vals in by.items()):
            return False
    elif not all(map(_column_types_ok, names, cols, classes, ranges)):
        return False
    eids = by["event_id"]
    if (classes is None or classes[names.index("event_id")] != CLS_STR) and set(map(type, eids)) != {str}:
        return False
    if min(map(len, eids)) < 1 or max(map(len, eids)) > 128:
        return False
    if not _KIND_SET.issuperset(by["kind"]):
        return False
    return "".join(eids).isprintable()


def _batch_payload(names, cols) -> tuple[bytes, bool]:
    """(a batch frame's JSON, whether one orjson call made it ASCII). That one
    call is byte for byte the column-by-column form below; its ASCII output
    also proves every string of the frame ASCII (so encodable: what
    _column_ok's join checks). Else column by column: a column with raw bytes
    (surrogates, which orjson refuses) or other non-ASCII text costs
    json.dumps, the rest orjson. Every frame carries "w": SCHEMA_MARK (its
    columns passed this schema's checks before framing; module doc)."""
    cols = [_column_value(c) for c in cols]       # a constant column: {"r": value} (module doc)
    if orjson is not None:
        try:
            out = orjson.dumps({"k": names, "c": cols, "w": SCHEMA_MARK})
        except (TypeError, ValueError):
            pass
        else:
            if out.isascii():
                return out, True
    return (b'{"k":' + _dumps(names) + b',"c":[' + b",".join([_dumps(c) for c in cols])
            + b'],"w":%d}' % SCHEMA_MARK), False


def _column_value(c):
    """One column of a batch frame: {"r": v} when every value is v (module doc; validated
    values: an int is never a bool, a str never None), else the list of values."""
    if len(c) > 1 and c.count(c[0]) == len(c):
        return {"r": c[0]}
    return c


def _batch_frame(count: int, names, cols, proof: list | None = None):
    """One batch frame of `count` records given as columns; _TOO_BIG when the
    payload is over BATCH_MAX_BYTES. proof: [True], set False when the frame's
    strings were not proven ASCII by its dump (_batch_payload)."""
    payload, ascii_ = _batch_payload(names, cols)
    if len(payload) > BATCH_MAX_BYTES:
        return _TOO_BIG
    if not ascii_ and proof is not None:
        proof[0] = False
    body = _U32.pack(count) + payload
    n = _U32.pack(len(body))
    return MAGIC_BATCH + n + _U32.pack(zlib.crc32(body, zlib.crc32(n))) + body


def encode_frames(records: list, transposed=None) -> list:
    """Frames of validated records (batch frames carry SCHEMA_MARK: only records
    that passed _column_lists_valid, as append_many checks them, may come
    here): batch frames of up to BATCH_MAX records
    when they all have the same fields (see the module doc; a batch over
    BATCH_MAX_BYTES is halved until it fits, down to BATCH_MIN), else frames
    of one record. `transposed`: _transposed(records), if at hand."""
    return _encode_batch(records, transposed)[0]


def _encode_batch(records: list, transposed=None) -> tuple[list, bool]:
    """(encode_frames' frames, proven): proven when every record went into a
    batch frame whose dump was ASCII (so every string of the batch is)."""
    tr = transposed or _transposed(records)
    if tr is None or len(records) < BATCH_MIN:
        return [encode_frame(r) for r in records], False
    out: list = []
    proof = [True]
    for i in range(0, len(records), BATCH_MAX):
        _frames_of(records, tr, i, min(len(records), i + BATCH_MAX), out, proof)
    return out, proof[0]


def _frames_of(records, tr, a: int, b: int, out: list, proof: list | None = None) -> None:
    names, cols = tr
    frame = _batch_frame(b - a, names, [c[a:b] for c in cols], proof) if b - a >= BATCH_MIN else _TOO_BIG
    if frame is not _TOO_BIG:
        out.append(frame)
    elif b - a >= 2 * BATCH_MIN:
        half = (a + b) // 2
        _frames_of(records, tr, a, half, out, proof)
        _frames_of(records, tr, half, b, out, proof)
    else:
        if proof is not None:
            proof[0] = False
        out.extend(encode_frame(r) for r in records[a:b])     # fit_record cuts what is too large


def _batch_count(buf, p: int) -> int:
    """The record count in the header of the batch frame at p (0 if unreadable)."""
    if len(buf) - p < HEADER_BYTES + 4:
        return 0
    n = _U32.unpack_from(buf, p + HEADER_BYTES)[0]
    return n if 0 < n <= BATCH_MAX else 0


def _records_in(garbage) -> int:
    """How many records a damaged region held, at least: its frames, a batch
    frame's by its (unverified) count."""
    n, q = 0, 0
    while True:
        q = garbage.find(b"\xd5\xec", q)
        if q < 0:
            return max(1, n)
        m = garbage[q:q + 4]
        if m == MAGIC:
            n += 1
        elif m == MAGIC_BATCH:
            n += max(1, _batch_count(garbage, q))
        q += 2


def _find_magic(buf, q: int) -> int:
    """The first frame magic of either kind at or after q, -1 if none."""
    while True:
        q = buf.find(b"\xd5\xec", q)
        if q < 0 or buf[q + 2:q + 4] in (b"\x01\xfe", b"\x02\xfe") or len(buf) - q < 4:
            return q
        q += 1


class Repeat:
    """A column of one value: a batch frame's {"r": value}, `n` times. Batch keeps
    it so (no list of n references built, copied and scanned) until a sink asks
    for lists (Batch.columns); the ClickHouse sink takes it as it is
    (Batch.raw_columns: a default left to the server, another value repeated
    once encoded)."""

    __slots__ = ("value", "n")

    def __init__(self, value, n: int):
        self.value, self.n = value, n

    def __len__(self):
        return self.n

    def __getitem__(self, i: int):
        if not -self.n <= i < self.n:
            raise IndexError("Repeat index out of range")
        return self.value

    def tolist(self) -> list:
        """The column as a list; a list value (argv): a list of its own per record."""
        v = self.value
        return list(map(list, itertools.repeat(v, self.n))) if v.__class__ is list else [v] * self.n

    def __eq__(self, other):
        return other.__class__ is Repeat and self.n == other.n and self.value == other.value

    def __repr__(self):
        return f"Repeat({self.value!r}, {self.n})"


def _lists(cols) -> list:
    """cols with every Repeat made a list."""
    return [c.tolist() if c.__class__ is Repeat else c for c in cols]


def _decode_batch(payload, count: int):
    """(names, columns, checked) of a batch frame's JSON; ValueError when it is
    not one. checked: the frame carries this schema's mark (module doc: its
    writer validated every record against these fields, types and kinds)."""
    doc = _loads(payload)
    if not isinstance(doc, dict) or not isinstance(doc.get("k"), list) or not isinstance(doc.get("c"), list):
        raise ValueError("not a batch document")
    names, cols = doc["k"], doc["c"]
    for j, c in enumerate(cols):
        if c.__class__ is dict:                 # {"r": v}: v in every record (module doc)
            if len(c) != 1 or "r" not in c:
                raise ValueError(f"batch of {count} record(s): column {j} is neither a list nor a repeat")
            cols[j] = Repeat(c["r"], count)
    if len(names) != len(cols) or not names or not all(n.__class__ is str for n in names) \
            or len(set(names)) != len(names) \
            or not all((c.__class__ is list or c.__class__ is Repeat) and len(c) == count for c in cols):
        raise ValueError(f"batch of {count} record(s): fields and columns do not match")
    mark = doc.get("w")
    return names, cols, mark.__class__ is int and mark == SCHEMA_MARK


def _frame_at(buf, p: int):
    """Classify the bytes at p: ("ok", end) | ("incomplete", need) | ("bad", reason)."""
    if len(buf) - p < HEADER_BYTES:
        if not any(buf[p:p + 4] == m[:len(buf) - p] for m in _MAGICS):
            return "bad", "bad frame magic"
        return "incomplete", HEADER_BYTES
    magic, n, crc = _HDR.unpack_from(buf, p)
    if magic not in _MAGICS:
        return "bad", "bad frame magic"
    if n > MAX_RECORD_BYTES:
        return "bad", f"frame length {n} over the limit"
    end = p + HEADER_BYTES + n
    if end > len(buf):
        return "incomplete", HEADER_BYTES + n
    if zlib.crc32(buf[p + HEADER_BYTES:end], zlib.crc32(buf[p + 4:p + 8])) != crc:
        return "bad", "CRC mismatch"
    return "ok", end


# --- positions, batches, damage -----------------------------------------------

@dataclass(frozen=True, order=True)
class Position:
    segment: int
    offset: int


@dataclass
class Damage:
    """A region of a segment that could not be delivered as records."""
    segment: int
    offset: int
    length: int
    reason: str
    frames: int = 1                 # how many records it held, at least (estimate)
    payload: str | None = None      # for an intact frame with bad content: its JSON
    ts_ns: int = 0                  # when, roughly: ts_ns of the nearest good record (see read())
    cause: str = "spool_damage"     # or "sink_evicted": the disk budget evicted it before this sink read it
    index: int | None = None        # a record of a batch frame: which one (frames of one record: None)

    def describe(self) -> str:
        if self.cause == "sink_evicted":
            return (f"segment {self.segment:016d}{_SEG_SUFFIX} from offset {self.offset}: {self.frames} record(s) "
                    f"({self.length} bytes) {self.reason}")
        return (f"segment {self.segment:016d}{_SEG_SUFFIX} offset {self.offset}: {self.length} bytes, "
                f"{self.reason} (~{self.frames} record(s))")


class Batch:
    """One read of a sink: its records (dicts), the damage found, where it starts
    and ends. `columns`: {field: [values]} of exactly `records` when they all
    came from batch frames of the same fields (a sink may insert these columns
    as they are); None otherwise; {}: nothing yet. While the records came only
    from batch frames, their dicts are not built until `records` is first read
    (issue 15: a sink that takes the columns never pays ~3 us a record for a
    dict); `count` is their number either way."""

    __slots__ = ("start", "end", "_records", "damage", "positions", "_cols", "_n")

    def __init__(self, start: Position, end: Position, records: list | None = None, damage: list | None = None,
                 positions: list | None = None, columns: dict | None = None):
        self.start, self.end = start, end
        self._records = [] if records is None else records     # None: the columns' rows, not built yet
        self.damage = [] if damage is None else damage
        self.positions = [] if positions is None else positions  # (segment, offset) of each record
        self._cols = {} if columns is None else columns         # a column: a list, or a Repeat
        self._n = len(self._records)

    @property
    def columns(self) -> dict | None:
        """{field: [values]} (see the class doc); a column of one value (Repeat)
        is made a list here, once."""
        cols = self._cols
        if cols:
            for k, c in cols.items():
                if c.__class__ is Repeat:
                    cols[k] = c.tolist()
        return cols

    @property
    def raw_columns(self) -> dict | None:
        """columns as they are held: a column of one value is a Repeat (its value,
        its length), not a list (a sink that can use that: the ClickHouse one)."""
        return self._cols

    def oldest_ts(self) -> int:
        """The smallest non-zero ts_ns of the records (0: none), without building them."""
        cols = self._cols
        if cols and "ts_ns" in cols:
            c = cols["ts_ns"]
            if c.__class__ is Repeat:
                return c.value or 0
            return min(filter(None, c), default=0)
        return min((r.get("ts_ns") or 0 for r in self.records if r.get("ts_ns")), default=0)

    @property
    def records(self) -> list:
        if self._records is None:         # built once, from the columns (which stay as they are)
            cols = self.columns
            self._records = [dict(zip(cols, row)) for row in zip(*cols.values())] if cols else []
        return self._records

    @property
    def count(self) -> int:
        """How many records (without building them)."""
        return self._n if self._records is None else len(self._records)

    def _add_columns(self, names, cols, count: int) -> None:
        """Records of a batch frame, as columns: kept as columns while every
        record so far came from batch frames of the same fields (a column of
        one value stays a Repeat while the frames agree on that value)."""
        have = self._cols
        if have is not None and not have and not self.count:
            self._cols = dict(zip(names, cols))
            self._records, self._n = None, count
            return
        if have and list(have) == names:
            if self._records is None:
                for n, c in zip(names, cols):
                    h = have[n]
                    if h.__class__ is Repeat:
                        # the same value (validated: an int is never a bool, a str never None)
                        if c.__class__ is Repeat and c.value.__class__ is h.value.__class__ and c.value == h.value:
                            h.n += count
                            continue
                        h = have[n] = h.tolist()
                    h.extend(c.tolist() if c.__class__ is Repeat else c)
                self._n += count
                return
            cols = _lists(cols)
            for n, c in zip(names, cols):
                have[n].extend(c)
        else:
            self._no_columns()
            cols = _lists(cols)
        self._records.extend([dict(zip(names, row)) for row in zip(*cols)])

    def _no_columns(self) -> None:
        """From here on the records are dicts (a frame of one record, or of other fields)."""
        if self._records is None:
            self.records
        self._cols = None

    def ts_of(self, i: int):
        """ts_ns of record i (without building the records)."""
        if self._records is None:
            c = self._cols.get("ts_ns")
            return c[i] if c is not None else None
        return self._records[i].get("ts_ns")

    def __bool__(self):
        return bool(self.count or self.damage or self.end != self.start)

    def __repr__(self):
        return f"Batch({self.start}, {self.end}, {self.count} record(s), {len(self.damage)} damage)"


# --- the spool -----------------------------------------------------------------

def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes):
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _sink_name(sink: str) -> str:
    if not sink or not all(c.isalnum() or c in "-_." for c in sink) or sink.startswith(".") \
            or sink.endswith(".evicted") or len(sink) > 100:
        raise ExportError(f"spool sink name {sink!r}: use 1-100 letters, digits, '-', '_', '.' "
                        f"(not ending in .evicted)", EXIT_USAGE)
    return sink


def _METRICS():
    from exporters.metrics import METRICS
    return METRICS


def _count(records, spooled: bool, lost_markers: bool = True, columns: dict | None = None):
    """Metrics of one append: received (and spooled) by kind; the records'
    own figures (ring-buffer lag, losses they report, lifecycles). `columns`:
    the records by field (an append framed by column), counted from them."""
    m = _METRICS()
    if columns is not None and "kind" in columns:
        from collections import Counter
        kinds = Counter(columns["kind"])        # one C-level pass, not a dict lookup per record
    else:
        kinds = {}
        for r in records:
            k = r.get("kind")
            kinds[k] = kinds.get(k, 0) + 1
    for k, n in kinds.items():
        m.add("dsec.events.received", n, kind=k)
        if spooled:
            m.add("dsec.events.spooled", n, kind=k)
    if spooled and lost_markers:
        try:
            m.observe_records(records, columns=columns if columns is not None and "kind" in columns else None,
                              kinds=kinds)
        except Exception:  # noqa: BLE001 - telemetry never breaks the audit
            log.debug("metrics: observe_records failed", exc_info=True)


def _frame_records(f, off: int) -> tuple[int, int | None]:
    """(records, length) of the frame at `off` of open segment f, from its
    header (a batch frame's count unverified); length None at a bad magic."""
    f.seek(off)
    hdr = f.read(HEADER_BYTES + 4)
    magic, length, _ = _HDR.unpack(hdr[:HEADER_BYTES])
    if magic == MAGIC:
        return 1, length
    if magic == MAGIC_BATCH:
        return max(1, _batch_count(hdr, 0)), length
    return 1, None


def _count_frames(path: str, offset: int) -> int:
    """Records from offset to the end of a segment (walking frame headers; a
    damaged region counts as one)."""
    n = 0
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            off = offset
            while off + HEADER_BYTES <= size:
                k, length = _frame_records(f, off)
                n += k
                if length is None:
                    break
                off += HEADER_BYTES + length
    except FileNotFoundError:
        pass
    return n


class Spool:
    """Append side of the spool (any number of processes) and factory of readers."""

    def __init__(self, path: str | None = None, *, segment_bytes: int | None = None,
                 fsync: str | None = None, fsync_interval: float | None = None,
                 max_bytes: int | None = None, on_full: str = "drop", reserve_bytes: int | None = None,
                 frames: str | None = None):
        self.path = os.path.abspath(path or default_dir())
        self.frames = frames or os.environ.get("DSEC_SPOOL_FRAMES") or "batch"
        if self.frames not in FRAMES:
            raise ExportError(f"spool frames {self.frames!r} (DSEC_SPOOL_FRAMES): use one of {', '.join(FRAMES)}",
                              EXIT_USAGE)
        self.fsync = fsync or os.environ.get("DSEC_SPOOL_FSYNC") or "always"
        if self.fsync not in FSYNC_POLICIES:
            raise ExportError(f"spool fsync policy {self.fsync!r} (DSEC_SPOOL_FSYNC): use one of "
                            f"{', '.join(FSYNC_POLICIES)}", EXIT_USAGE)
        self.fsync_interval = fsync_interval if fsync_interval is not None else \
            _env_float("DSEC_SPOOL_FSYNC_INTERVAL", 1.0)
        self.max_bytes = max_bytes if max_bytes is not None else \
            int(_env_float("DSEC_SPOOL_MAX_BYTES", DEFAULT_MAX_BYTES))
        if self.max_bytes < 4096:
            raise ExportError(f"spool disk budget {self.max_bytes} bytes (DSEC_SPOOL_MAX_BYTES): at least 4096",
                            EXIT_USAGE)
        # segments small enough that eviction and deletion can act within the budget
        self.segment_bytes = segment_bytes or min(DEFAULT_SEGMENT_BYTES, max(4096, self.max_bytes // 8))
        # room above the budget kept for the events_lost records of the drop policy
        self.reserve_bytes = reserve_bytes if reserve_bytes is not None else \
            max(4096, min(self.max_bytes // 16, 16 << 20))
        if on_full not in ON_FULL:
            raise ExportError(f"spool on_full={on_full!r}: use one of {', '.join(ON_FULL)}", EXIT_USAGE)
        self.on_full = on_full
        self.dropped_total = 0           # records this object dropped (disk budget / ENOSPC)
        self._lost: dict = {}            # (sandbox_id, node) -> pending spool_full loss accounting
        self._last_loss_emit = 0.0
        self._last_drop_log = 0.0
        self._used = None                # bytes of the segments, cached (see _used_bytes)
        self._used_at = 0.0
        self.cursor_dir = os.path.join(self.path, "cursors")
        self._tlock = threading.Lock()   # not reentrant: locked() never nests
        try:
            os.makedirs(self.cursor_dir, mode=0o700, exist_ok=True)
            if os.stat(self.path).st_mode & 0o077:
                os.chmod(self.path, 0o700)     # the audit trail: readable by its owner (root) only
            self._lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ExportError(f"spool {self.path}: {e.strerror}")
        self.id = self._spool_id()
        self._fd = None           # head segment fd (O_APPEND)
        self._seq = 0
        self._last_sync = time.monotonic()
        self._dirty = False
        import weakref
        ref = weakref.ref(self)
        _METRICS().add_gauge("dsec.spool.usage", self.path,
                             lambda: {(("spool", s.path),): s.size_bytes()} if (s := ref()) is not None else {})

    def __repr__(self):
        return f"Spool({self.path!r})"

    # -- housekeeping
    def _spool_id(self) -> str:
        p = os.path.join(self.path, "id")
        try:
            with open(p) as f:
                v = f.read().strip()
            if v:
                return v
        except FileNotFoundError:
            pass
        with self.locked():
            try:
                with open(p) as f:
                    v = f.read().strip()
                if v:
                    return v
            except FileNotFoundError:
                pass
            v = uuid.uuid4().hex
            _write_atomic(p, v.encode() + b"\n")
            return v

    @contextmanager
    def locked(self):
        """The writer lock (also serialises rotation and segment deletion):
        a thread lock for this object's threads, flock for other processes
        (flock alone does not exclude threads sharing one open file)."""
        with self._tlock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def seg_path(self, seq: int) -> str:
        return os.path.join(self.path, f"{seq:016d}{_SEG_SUFFIX}")

    def segments(self) -> list[int]:
        out = []
        for n in os.listdir(self.path):
            if n.endswith(_SEG_SUFFIX) and n[:-len(_SEG_SUFFIX)].isdigit():
                out.append(int(n[:-len(_SEG_SUFFIX)]))
        out.sort()
        return out

    def head(self) -> Position:
        """The spool's end now: where the next append goes (a sink whose cursor is
        here has delivered everything appended so far)."""
        segs = self.segments()
        if not segs:
            return Position(1, 0)
        try:
            size = os.path.getsize(self.seg_path(segs[-1]))
        except OSError:
            size = 0
        return Position(segs[-1], size)

    def is_head(self, seq: int) -> bool:
        return not os.path.exists(self.seg_path(seq + 1))

    def size_bytes(self) -> int:
        total = 0
        for s in self.segments():
            try:
                total += os.stat(self.seg_path(s)).st_size
            except FileNotFoundError:
                pass
        return total

    # -- append
    def _head_fd(self, incoming: int) -> tuple[int, int]:
        """Called under the lock: an fd on the head segment with room (rotating if needed),
        and the segment's size (where this append starts: no other writer appends while
        the lock is held)."""
        if self._fd is not None:
            st = os.fstat(self._fd)
            if st.st_nlink and st.st_size < self.segment_bytes and self.is_head(self._seq):
                return self._fd, st.st_size
            os.close(self._fd)
            self._fd = None
        segs = self.segments()
        if segs:
            head = segs[-1]
            if os.stat(self.seg_path(head)).st_size < self.segment_bytes:
                self._fd = os.open(self.seg_path(head), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                self._seq = head
                return self._fd, os.fstat(self._fd).st_size
        seq = (segs[-1] + 1) if segs else 1
        self._fd = os.open(self.seg_path(seq), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._seq = seq
        _fsync_dir(self.path)
        return self._fd, 0

    def append(self, record: dict) -> None:
        self.append_many([record])

    def append_many(self, records, on_locked=None) -> int:
        """Validate, frame and append records (all or none); returns how many were
        written: len(records), or 0 when the disk budget made the spool drop them
        (the drop policy, module doc; the loss is recorded, never silent).
        Raises ExportError naming the bad record, or an I/O failure. on_locked():
        called once the writer lock is held, before the write: every append that
        starts later (any writer of this spool) comes after these records, and with
        fsync "always" is durable only after they are (appends and their fdatasync
        are serialised under the lock)."""
        records = records if isinstance(records, list) else list(records)
        tr3 = _transposed(records, True) if self.frames == "batch" and len(records) >= BATCH_MIN else None
        tr = tr3[:2] if tr3 is not None else None
        by = data = None
        if tr is not None and _column_types_valid(*tr3):
            # validated as columns, framed as columns; the strings' encodability is proven by the
            # frames' ASCII JSON (one orjson call a frame), else checked by column as before
            frames, proven = _encode_batch(records, tr)
            if proven or _column_lists_valid(*tr):
                by = dict(zip(*tr))
                data = b"".join(frames)
        if data is None:
            validate_records(records)
            data = b"".join([encode_frame(r) for r in records])
        if not data:
            return 0
        dropped = None
        with self.locked():
            if on_locked is not None:
                on_locked()
            if not self._room(len(data)):
                if self.on_full == "error":
                    used = self._used_bytes(exact=True)
                    raise ExportError(f"spool {self.path} is full ({used} bytes, limit {self.max_bytes}, "
                                    f"DSEC_SPOOL_MAX_BYTES): a sink is not draining it; records refused")
                dropped = "disk budget exhausted"
            else:
                try:
                    self._write(data)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT) and self.on_full == "drop":
                        dropped = f"file system full ({e.strerror})"
                    else:
                        raise ExportError(f"spool {self.path}: append failed: {e.strerror}; "
                                        f"{len(records)} record(s) not spooled")
            if dropped:
                self._drop(records, dropped)
            if self._lost:
                self._emit_losses()
        _count(records, dropped is None, columns=by)
        return 0 if dropped else len(records)

    def _write(self, data: bytes):
        """Under the lock: append data to the head segment (all or nothing)."""
        try:
            fd, start = self._head_fd(len(data))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ExportError(f"spool {self.path}: cannot open a segment: {e.strerror}")
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            self._sync(fd)
        except OSError:
            try:  # leave no torn frame behind
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
        if self._used is not None:
            self._used += len(data)

    # -- the disk budget
    def _used_bytes(self, exact: bool = False) -> int:
        """Bytes of all segments: exact, or cached for up to a second plus what
        this object appended since (other processes' appends within that second
        may overshoot the budget by that much)."""
        now = time.monotonic()
        if exact or self._used is None or now - self._used_at > 1.0:
            self._used = self.size_bytes()
            self._used_at = now
        return self._used

    def _room(self, incoming: int, limit: int | None = None) -> bool:
        """Under the lock: can `incoming` bytes be appended within the budget
        (evicting best-effort sinks' segments if that makes room)?"""
        limit = self.max_bytes if limit is None else limit
        if self._used_bytes() + incoming <= limit:
            return True
        used = self._used_bytes(exact=True)
        if used + incoming <= limit:
            return True
        if limit == self.max_bytes:
            self._evict(used + incoming - limit)
            used = self._used_bytes(exact=True)
        return used + incoming <= limit

    def _evict(self, need: int) -> int:
        """Under the lock: delete the oldest segments that only evictable
        (best-effort) sinks still need, until `need` bytes are freed. Each such
        sink is told what it missed (cursors/<sink>.evicted.json)."""
        docs = {}
        for sink in self.sinks():
            d = self.load_cursor_doc(sink)
            if d is not None:
                docs[sink] = d
        segs = self.segments()
        freed = 0
        removed = []
        for seq in segs[:-1]:                       # never the head
            if freed >= need:
                break
            try:
                size = os.stat(self.seg_path(seq)).st_size
            except FileNotFoundError:
                continue
            needers = {s: d for s, d in docs.items()
                       if d["segment"] < seq or (d["segment"] == seq and d["offset"] < size)}
            if any(not d.get("evictable") for d in needers.values()):
                break                               # a required sink needs it (and every later one)
            for sink, d in needers.items():
                off = d["offset"] if d["segment"] == seq else 0
                n = _count_frames(self.seg_path(seq), off)
                self._note_evicted(sink, seq, off, n, size - off)
            os.unlink(self.seg_path(seq))
            removed.append(seq)
            freed += size
        if removed:
            _fsync_dir(self.path)
            self._used = None
        return freed

    def evicted_path(self, sink: str) -> str:
        return os.path.join(self.cursor_dir, f"{sink}.evicted.json")

    def load_evicted(self, sink: str) -> list:
        try:
            with open(self.evicted_path(sink)) as f:
                return json.load(f).get("segments") or []
        except FileNotFoundError:
            return []
        except (ValueError, AttributeError) as e:
            log.warning("spool %s: %s unreadable (%s); evictions it recorded are reported as one",
                        self.path, self.evicted_path(sink), e)
            return [{"segment": 0, "offset": 0, "records": 1, "bytes": 0, "ts_ns": time.time_ns(),
                     "note": "eviction record unreadable"}]

    def save_evicted(self, sink: str, entries: list) -> None:
        """Under the writer lock: the evictions `sink` has yet to report (none: the file goes)."""
        p = self.evicted_path(sink)
        if entries:
            _write_atomic(p, json.dumps({"sink": sink, "segments": entries[-10000:]}).encode())
            return
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass

    def _note_evicted(self, sink, seq, offset, records, nbytes):
        entries = self.load_evicted(sink)
        entries.append({"segment": seq, "offset": offset, "records": records, "bytes": nbytes,
                        "ts_ns": time.time_ns()})
        self.save_evicted(sink, entries)
        log.warning("spool %s: disk budget (%d bytes) exhausted; evicted segment %d: %d record(s) that "
                    "best-effort sink %r had not delivered are lost for it (other sinks unaffected)",
                    self.path, self.max_bytes, seq, records, sink)
        _METRICS().add("dsec.events.lost", records, reason="sink_evicted", sink=sink)

    def _drop(self, records, why: str):
        """Under the lock: account for a batch the budget refused."""
        n = 0
        for r in records:
            key = (r.get("sandbox_id") or "", r.get("node") or "")
            acc = self._lost.get(key)
            if acc is None:
                acc = self._lost[key] = {"count": 0, "kinds": {}, "first": 0, "last": 0,
                                         "step": r.get("step") or 0}
            kind = r.get("kind") or "?"
            c = int(r.get("count") or 0) if kind == "events_lost" else 1   # a dropped gap marker: its gap
            acc["count"] += c
            acc["kinds"][kind] = acc["kinds"].get(kind, 0) + c
            ts = r.get("ts_ns") or 0
            if ts and (not acc["first"] or ts < acc["first"]):
                acc["first"] = ts
            acc["last"] = max(acc["last"], ts)
            n += c
        self.dropped_total += n
        _METRICS().add("dsec.events.lost", n, reason="spool_full")
        now = time.monotonic()
        if now - self._last_drop_log >= 5.0:
            self._last_drop_log = now
            log.warning("spool %s: %s (budget %d bytes, DSEC_SPOOL_MAX_BYTES): a required sink is not "
                        "draining it; %d event(s) DROPPED so far by this process (recorded as events_lost)",
                        self.path, why, self.max_bytes, self.dropped_total)

    def _emit_losses(self, force: bool = False):
        """Under the lock: write the pending spool_full events_lost records into
        the reserve above the budget (coalesced: at most every LOSS_EMIT_INTERVAL)."""
        now = time.monotonic()
        if not self._lost or (not force and now - self._last_loss_emit < LOSS_EMIT_INTERVAL):
            return
        import socket
        recs = []
        for (sid, node), acc in self._lost.items():
            recs.append({"event_id": "spoolfull-" + uuid.uuid4().hex, "ts_ns": acc["first"] or time.time_ns(),
                         "node": node or socket.gethostname(), "sandbox_id": sid, "step": acc["step"],
                         "kind": "events_lost", "count": acc["count"],
                         "extra": json.dumps({"reason": "spool_full", "policy": "drop", "spool": self.path,
                                              "budget_bytes": self.max_bytes, "kinds": acc["kinds"],
                                              "window_start_ns": acc["first"], "window_end_ns": acc["last"]},
                                             sort_keys=True, separators=(",", ":"))})
        data = b"".join(encode_frame(r) for r in recs)
        if not self._room(len(data), self.max_bytes + self.reserve_bytes):
            return                                   # even the reserve is full: kept, retried later
        try:
            self._write(data)
        except OSError as e:
            log.warning("spool %s: cannot write the events_lost record(s) yet: %s", self.path, e.strerror)
            return
        self._lost.clear()
        self._last_loss_emit = now
        _count(recs, True, lost_markers=False)

    def _sync(self, fd):
        if self.fsync == "always":
            os.fdatasync(fd)
        elif self.fsync == "interval":
            self._dirty = True
            if time.monotonic() - self._last_sync >= self.fsync_interval:
                os.fdatasync(fd)
                self._dirty = False
                self._last_sync = time.monotonic()

    def close(self):
        if self._lost and self._lock_fd is not None:
            try:
                with self.locked():
                    self._emit_losses(force=True)
            except Exception as e:  # noqa: BLE001 - close must not fail; the metric has the count
                log.warning("spool %s: events_lost record not written at close: %s", self.path, e)
        if self._fd is not None:
            try:
                if self._dirty:
                    os.fdatasync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # -- sinks
    def reader(self, sink: str, evictable: bool | None = None) -> "SpoolReader":
        """The reader of one sink. evictable=True marks a best-effort sink whose
        backlog the disk budget may evict (module doc); None keeps what the
        cursor says (False for a new sink)."""
        return SpoolReader(self, _sink_name(sink), evictable)

    def sinks(self) -> list[str]:
        return sorted(n[:-5] for n in os.listdir(self.cursor_dir)
                      if n.endswith(".json") and not n.endswith(".evicted.json"))

    def cursor_path(self, sink: str) -> str:
        return os.path.join(self.cursor_dir, f"{sink}.json")

    def load_cursor(self, sink: str) -> Position | None:
        d = self.load_cursor_doc(sink)
        return None if d is None else Position(d["segment"], d["offset"])

    def load_cursor_doc(self, sink: str) -> dict | None:
        """The cursor file: {"segment", "offset", "sink", "updated_ns", "evictable", "state"}
        (state: what the sink keeps with its position, e.g. the JSON-lines file's
        committed size)."""
        p = self.cursor_path(sink)
        try:
            with open(p) as f:
                d = json.load(f)
            d["segment"], d["offset"] = int(d["segment"]), int(d["offset"])
            return d
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            raise ExportError(f"spool cursor {p} is unreadable ({e}); delete it to re-deliver everything "
                            f"still in the spool to sink {sink!r}")

    _KEEP = object()

    def save_cursor(self, sink: str, pos: Position, *, state=_KEEP, evictable=_KEEP):
        """Atomically replace a sink's cursor; state/evictable not given are kept."""
        if state is Spool._KEEP or evictable is Spool._KEEP:
            try:
                old = self.load_cursor_doc(sink) or {}
            except ExportError:
                old = {}
            if state is Spool._KEEP:
                state = old.get("state")
            if evictable is Spool._KEEP:
                evictable = bool(old.get("evictable"))
        doc = {"segment": pos.segment, "offset": pos.offset, "sink": sink, "updated_ns": time.time_ns(),
               "evictable": bool(evictable)}
        if state is not None:
            doc["state"] = state
        _write_atomic(self.cursor_path(sink), json.dumps(doc, ensure_ascii=True).encode())

    def drop_sink(self, sink: str):
        with self.locked():
            for p in (self.cursor_path(_sink_name(sink)), self.evicted_path(sink)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        self.collect()

    def collect(self) -> list[int]:
        """Delete the segments every sink's cursor is past (never the head)."""
        removed = []
        with self.locked():
            cursors = [self.load_cursor(s) for s in self.sinks()]
            if not cursors or any(c is None for c in cursors):
                return removed
            segs = self.segments()
            for seq in segs[:-1]:
                try:
                    size = os.stat(self.seg_path(seq)).st_size
                except FileNotFoundError:
                    continue
                if all(c.segment > seq or (c.segment == seq and c.offset >= size) for c in cursors):
                    os.unlink(self.seg_path(seq))
                    removed.append(seq)
            if removed:
                _fsync_dir(self.path)
        return removed

    def stats(self) -> dict:
        segs = self.segments()
        out = {"path": self.path, "segments": len(segs), "bytes": self.size_bytes(), "sinks": {}}
        for s in self.sinks():
            c = self.load_cursor(s)
            out["sinks"][s] = {"segment": c.segment, "offset": c.offset, "behind_bytes": self.bytes_behind(c)}
        return out

    def bytes_behind(self, pos: Position) -> int:
        total = 0
        for seq in self.segments():
            try:
                size = os.stat(self.seg_path(seq)).st_size
            except FileNotFoundError:
                continue
            if seq > pos.segment:
                total += size
            elif seq == pos.segment:
                total += max(0, size - pos.offset)
        return total


def _env_float(name, default):
    v = os.environ.get(name)
    if not v:
        return default
    try:
        return float(v)
    except ValueError:
        raise ExportError(f"{name}={v!r}: not a number", EXIT_USAGE)


class SpoolReader:
    """Reads one sink's records from its cursor. read() always starts at the
    committed cursor: a batch that could not be delivered is read again."""

    def __init__(self, spool: Spool, sink: str, evictable: bool | None = None):
        self.spool = spool
        self.sink = sink
        self._lock_fd = None
        with spool.locked():  # registration must not race segment deletion
            doc = spool.load_cursor_doc(sink)
            if doc is None:
                segs = spool.segments()
                pos = Position(segs[0] if segs else 1, 0)
                self.evictable = bool(evictable)
                self.state = None
                spool.save_cursor(sink, pos, state=None, evictable=self.evictable)
            else:
                pos = Position(doc["segment"], doc["offset"])
                self.state = doc.get("state")
                self.evictable = bool(doc.get("evictable")) if evictable is None else bool(evictable)
                if self.evictable != bool(doc.get("evictable")):
                    spool.save_cursor(sink, pos, state=self.state, evictable=self.evictable)
        self.position = pos

    def load_state(self):
        """The state committed with the cursor (None if none)."""
        doc = self.spool.load_cursor_doc(self.sink)
        self.state = doc.get("state") if doc else None
        return self.state

    # -- one reader per sink at a time
    def lock(self, timeout: float | None = None) -> bool:
        """Take the sink's reader lock (waits up to timeout; None = forever)."""
        if self._lock_fd is None:
            self._lock_fd = os.open(os.path.join(self.spool.cursor_dir, f"{self.sink}.lock"),
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if timeout is None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            return True
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)

    def unlock(self):
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def close(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- reading
    def read(self, max_records: int = 10000, max_bytes: int = 32 << 20) -> Batch:
        """The records from the committed cursor: at most max_records, except that
        a batch frame is never split (one of more records than max_records comes
        alone)."""
        self.position = self.spool.load_cursor(self.sink) or self.position
        start = pos = self.position
        batch = Batch(start, start)
        nbytes = 0
        chunk = _SMALL_CHUNK
        while batch.count < max_records and nbytes < max_bytes:
            segs = self.spool.segments()
            later = [s for s in segs if s > pos.segment]
            if pos.segment not in segs:
                if not later:
                    break
                pos = Position(later[0], 0)
                continue
            path = self.spool.seg_path(pos.segment)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if pos.offset > size:
                        batch.damage.append(self._damage(pos.segment, size, 0, "cursor beyond the segment's end "
                                                         f"(segment truncated from {pos.offset} bytes)", frames=1))
                        pos = Position(pos.segment, size)
                    f.seek(pos.offset)
                    buf = f.read(min(size - pos.offset, chunk))
            except FileNotFoundError:
                continue
            at_eof = pos.offset + len(buf) >= size
            self._held = False
            new_off, nb, tail = self._parse(buf, pos, at_eof, batch, max_records)
            nbytes += nb
            pos = Position(pos.segment, new_off)
            if self._held:
                break                    # a batch frame that would go over max_records: the next read's
            if tail is None:
                if new_off < size:
                    if nb == 0:  # a frame larger than the chunk
                        chunk = _READ_CHUNK
                    continue  # hit max_records or the chunk limit
            else:  # an incomplete frame at the end of the file
                if later or not self.spool.is_head(pos.segment):
                    # the segment is closed: nobody will finish that frame
                    if self._final_size(pos.segment) == size:
                        batch.damage.append(self._damage(pos.segment, new_off, size - new_off, tail))
                        pos = Position(pos.segment, size)
                    continue
                with self.spool.locked():  # no writer is mid-write while we hold this
                    if self._final_size(pos.segment) == size and self.spool.is_head(pos.segment):
                        batch.damage.append(self._damage(pos.segment, new_off, size - new_off,
                                                         tail + " (torn write of a crashed writer)"))
                        pos = Position(pos.segment, size)
                        break
                continue  # it grew (or rotated): read on
            # at the end of this segment: move on only if it is closed
            if not later:
                break
            if self._final_size(pos.segment) != pos.offset:
                continue  # written to before the rotation; read the rest
            pos = Position(later[0], 0)
        batch.end = pos
        if batch.damage:
            batch.damage.sort(key=lambda d: (d.segment, d.offset))    # in the order of the segments
            self._date_damage(batch)
        if self.evictable and os.path.exists(self.spool.evicted_path(self.sink)):
            ev = [Damage(e["segment"], e["offset"], e.get("bytes", 0),
                         "evicted by the spool's disk budget before this sink delivered it",
                         frames=max(1, int(e.get("records") or 0)), ts_ns=int(e.get("ts_ns") or 0),
                         cause="sink_evicted")
                  for e in self.spool.load_evicted(self.sink)]
            batch.damage[:0] = ev
        return batch

    def _date_damage(self, batch: Batch):
        """Give each damage a deterministic time: the ts_ns of the good record
        just before it (else just after it) in the segment, else the segment's
        mtime. A re-read from the same cursor dates it the same, so the gap
        event a sink derives from it is the same event when re-sent."""
        import bisect
        for d in batch.damage:
            if d.ts_ns:
                continue
            i = bisect.bisect_left(batch.positions, (d.segment, d.offset))
            near = [j for j in (i - 1, i) if 0 <= j < len(batch.positions)
                    and batch.positions[j][0] == d.segment]
            ts = next((t for j in near if (t := batch.ts_of(j))), None)
            if ts is None:
                try:
                    ts = os.stat(self.spool.seg_path(d.segment)).st_mtime_ns
                except FileNotFoundError:
                    ts = time.time_ns()
            d.ts_ns = ts

    def _final_size(self, seq):
        try:
            return os.stat(self.spool.seg_path(seq)).st_size
        except FileNotFoundError:
            return -1

    def _parse(self, buf, pos: Position, at_eof: bool, batch: Batch, max_records: int):
        """Parse frames of buf (bytes of segment pos.segment from pos.offset).
        Returns (offset reached, bytes consumed, tail reason or None)."""
        p = 0
        n = len(buf)
        base = pos.offset
        parsed = []            # (record, offset, frame end): validated together at the end (by column)
        room = max_records - batch.count
        taken = 0              # records parsed (a batch frame counts its records)
        try:
            while p < n and taken < room:
                kind, val = _frame_at(buf, p)
                if kind == "ok":
                    payload = bytes(buf[p + HEADER_BYTES:val])
                    try:
                        if buf[p + 2] == 2:             # MAGIC_BATCH: (count, names, columns)
                            count = _U32.unpack_from(payload)[0]
                            if taken + batch.count and taken + count > room:
                                self._held = True           # not split: it starts the next read
                                return base + p, p, None
                            parsed.append(((count, *_decode_batch(payload[4:], count)), p, val))
                            taken += count
                        else:
                            parsed.append((_loads(payload), p, val))
                            taken += 1
                    except (ValueError, RecursionError, struct.error) as e:
                        batch.damage.append(self._damage(pos.segment, base + p, val - p,
                                                         f"invalid record: invalid JSON ({e})",
                                                         payload=payload.decode("ascii", "backslashreplace")))
                    p = val
                    continue
                if kind == "incomplete":
                    if at_eof:
                        return base + p, p, "incomplete frame at the end"
                    return base + p, p, None  # the chunk ended inside a frame: read again from here
                # bad: find the next frame that checks out
                q = p + 1
                while True:
                    q = _find_magic(buf, q)
                    # a frame that checks out, or a plausible one cut by the end of the chunk
                    if q < 0 or _frame_at(buf, q)[0] != "bad":
                        break
                    q += 1
                if q < 0:
                    if at_eof:
                        return base + p, p, f"{val}, no valid frame after it"
                    q = max(p + 1, n - len(MAGIC) + 1)  # a magic may straddle the chunk's end
                garbage = buf[p:q]
                batch.damage.append(self._damage(pos.segment, base + p, q - p, val,
                                                 frames=_records_in(garbage)))
                p = q
            return base + p, p, None
        finally:
            self._take_parsed(parsed, buf, pos, batch)

    def _take_parsed(self, parsed, buf, pos: Position, batch: Batch):
        """The parsed records into the batch, in order; one that fails
        validate_record becomes damage (its frame's bytes kept)."""
        if not parsed:
            return
        if any(r.__class__ is tuple for r, _, _ in parsed):
            return self._take_mixed(parsed, buf, pos, batch)
        batch._no_columns()
        recs = [r for r, _, _ in parsed]
        ok = _columns_valid(recs)
        base = pos.offset
        for rec, p, end in parsed:
            if not ok:
                try:
                    validate_record(rec)
                except ExportError as e:
                    payload = bytes(buf[p + HEADER_BYTES:end])
                    batch.damage.append(self._damage(pos.segment, base + p, end - p,
                                                     f"invalid record: {e.message}",
                                                     payload=payload.decode("ascii", "backslashreplace")))
                    continue
            batch.records.append(rec)
            batch.positions.append((pos.segment, base + p))

    def _take_mixed(self, parsed, buf, pos: Position, batch: Batch):
        """_take_parsed with batch frames among the frames: each batch frame's
        columns are checked as columns (no dicts to transpose); the batch keeps
        the columns for a sink that inserts them (Batch.columns) while every
        record so far came from batch frames of the same fields, and builds
        their dicts only when a sink reads Batch.records (or a frame of one
        record or of other fields follows). Frames of one record go through
        _take_parsed."""
        base = pos.offset
        singles = []
        for item in parsed:
            obj, p, end = item
            if obj.__class__ is not tuple:
                singles.append(item)
                continue
            if singles:
                self._take_parsed(singles, buf, pos, batch)
                singles = []
            count, names, cols, checked = obj
            if not (checked and _CHECKS.keys() >= set(names)):
                cols = _lists(cols)              # checked value by value, as lists
                checked = _column_lists_valid(names, cols)
            if checked:
                batch._add_columns(names, cols, count)
                batch.positions.extend([(pos.segment, base + p)] * count)
                continue
            batch._no_columns()
            for i, row in enumerate(zip(*cols)):
                rec = dict(zip(names, row))
                try:
                    validate_record(rec)
                except ExportError as e:
                    batch.damage.append(self._damage(pos.segment, base + p, end - p,
                                                     f"invalid record (record {i} of a batch frame of {count}): "
                                                     f"{e.message}", payload=_dumps(rec).decode("ascii", "replace"),
                                                     index=i))
                    continue
                batch.records.append(rec)
                batch.positions.append((pos.segment, base + p))
        if singles:
            self._take_parsed(singles, buf, pos, batch)

    @staticmethod
    def _damage(seq, offset, length, reason, frames=1, payload=None, index=None) -> Damage:
        if index is not None:
            return Damage(seq, offset, length, reason, frames, payload, index=index)
        return Damage(seq, offset, length, reason, frames, payload)

    def commit(self, batch_or_pos, state=Spool._KEEP) -> None:
        """Record delivery up to the batch's end; report its damage (once).
        `state` (JSON-able) is stored with the position, atomically."""
        evicted = []
        if isinstance(batch_or_pos, Batch):
            for d in batch_or_pos.damage:
                if d.cause == "sink_evicted":
                    evicted.append(d)
                else:
                    self._report(d)
            pos = batch_or_pos.end
        else:
            pos = batch_or_pos
        if state is not Spool._KEEP:
            self.state = state
        self.spool.save_cursor(self.sink, pos, state=self.state, evictable=self.evictable)
        self.position = pos
        if evicted:
            self._clear_evicted(evicted)
        if self.evictable and isinstance(batch_or_pos, Batch) and batch_or_pos.positions and \
                os.path.exists(self.spool.evicted_path(self.sink)):
            self._trim_evicted(batch_or_pos)
        self.spool.collect()

    def _trim_evicted(self, batch: "Batch"):
        """An eviction recorded while this batch was being delivered counted from the
        cursor before it: what the batch delivered is taken off (under the writer lock),
        so the gap reported later counts only what this sink never delivered. (The
        dsec.events.lost{sink_evicted} counter, added at the eviction, cannot be lowered.)"""
        delivered: dict[int, list[int]] = {}
        for seg, off in batch.positions:
            delivered.setdefault(seg, []).append(off)
        end = batch.end
        with self.spool.locked():
            entries = self.spool.load_evicted(self.sink)
            rest, changed = [], False
            for e in entries:
                seg, off = e.get("segment"), e.get("offset", 0)
                offs = [o for o in delivered.get(seg, ()) if o >= off]
                if not offs:
                    rest.append(e)
                    continue
                changed = True
                left = int(e.get("records") or 0) - len(offs)
                if end.segment == seg and left > 0:   # the rest of the segment after the batch's end
                    rest.append(dict(e, offset=end.offset, records=left,
                                     bytes=max(0, int(e.get("bytes") or 0) - (end.offset - off))))
            if changed:
                self.spool.save_evicted(self.sink, rest)

    def _clear_evicted(self, reported):
        """The evictions this sink has now recorded as gaps are forgotten (under the
        writer lock: an eviction in between is kept)."""
        done = {(d.segment, d.offset) for d in reported}
        with self.spool.locked():
            self.spool.save_evicted(self.sink, [e for e in self.spool.load_evicted(self.sink)
                                                if (e["segment"], e["offset"]) not in done])
        for d in reported:
            log.warning("spool %s, sink %s: %s", self.spool.path, self.sink, d.describe())
            with open(os.path.join(self.spool.path, "damage.log"), "a") as f:
                f.write(json.dumps({"ts_ns": time.time_ns(), "sink": self.sink, "segment": d.segment,
                                    "offset": d.offset, "length": d.length, "reason": d.reason,
                                    "frames": d.frames, "cause": d.cause}, ensure_ascii=True) + "\n")

    def _report(self, d: Damage):
        log.warning("spool %s, sink %s: %s", self.spool.path, self.sink, d.describe())
        entry = {"ts_ns": time.time_ns(), "sink": self.sink, "segment": d.segment, "offset": d.offset,
                 "length": d.length, "reason": d.reason, "frames": d.frames}
        if d.payload is not None:
            entry["payload"] = d.payload
        elif d.length:
            keep = os.path.join(self.spool.path, "damaged", f"{d.segment:016d}-{d.offset}.bin")
            entry["bytes_file"] = keep
            if not os.path.exists(keep):
                try:
                    os.makedirs(os.path.dirname(keep), mode=0o700, exist_ok=True)
                    with open(self.spool.seg_path(d.segment), "rb") as f:
                        f.seek(d.offset)
                        data = f.read(min(d.length, MAX_RECORD_BYTES))
                    _write_atomic(keep, data)
                except OSError as e:
                    entry["bytes_file"] = None
                    log.warning("spool %s: could not keep the damaged bytes: %s", self.spool.path, e)
        with open(os.path.join(self.spool.path, "damage.log"), "a") as f:
            f.write(json.dumps(entry, ensure_ascii=True) + "\n")

    def backlog(self, max_frames: int = 100_000) -> tuple[int, int]:
        """(records, bytes) not yet committed. Walks frame headers; past
        max_frames the rest is estimated from the average frame size."""
        pos = self.spool.load_cursor(self.sink) or self.position
        records = walked = total = 0
        for seq in self.spool.segments():
            if seq < pos.segment:
                continue
            off = pos.offset if seq == pos.segment else 0
            try:
                with open(self.spool.seg_path(seq), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    total += max(0, size - off)
                    while off + HEADER_BYTES <= size and records < max_frames:
                        k, n = _frame_records(f, off)
                        records += k          # a damaged region counts as (at least) one record
                        if n is None:
                            off = size
                            break
                        off += HEADER_BYTES + n
                    walked += min(off, size) - (pos.offset if seq == pos.segment else 0)
            except FileNotFoundError:
                continue
        if records >= max_frames and walked and total > walked:
            records += int((total - walked) * records / walked)
        return records, total


__all__ = ["Spool", "SpoolReader", "Batch", "Damage", "Position", "validate_record", "encode_frame",
           "default_dir", "MAX_RECORD_BYTES"]
