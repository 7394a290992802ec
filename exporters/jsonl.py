"""JSON-lines sink: one audit event per line, to a file or stdout.

    JsonlSink(spool, path="/var/log/dsec/audit.jsonl").flush(timeout=5)
    JsonlSink(spool, path="-")            # stdout

Each line is exactly what `dsec events --format json` prints for the event:
every field of audit_schema/events.py (defaults filled in), UTF-8 JSON,
undecodable bytes of paths/argv as "\\udcXX" escapes (os.fsencode(value)
gives the exact bytes back), no spaces, FIELDS order. Gaps (spool damage,
and records the disk budget evicted before this sink wrote them) appear as
`events_lost` lines.

Exactly once for a regular file. The cursor's state holds the file's
identity (device, inode) and its size after the last committed write. A
delivery appends and (fsync=True, the default) fsyncs the lines, then
commits cursor + size in one atomic cursor write. If the process dies in
between, the next start finds the file longer than the committed size and
cuts it back before writing the same records again: no line is lost or
doubled. A file rotated away (renamed or deleted, e.g. by logrotate) is
reopened at the path; the old file is never cut. Only one sink may write a
given file. stdout (and pipes, ttys) are at-least-once: nothing can be taken
back there.

A best-effort sink by default (evictable: the disk budget may evict its
backlog, which then shows as an events_lost line); `required: true` in the
configuration makes it required, like ClickHouse.
"""
from __future__ import annotations

import logging
import os
import stat
import sys
from itertools import repeat

from exporters.errors import ExportError, USAGE as EXIT_USAGE
from exporters.spool import Batch, Repeat, Spool, orjson
from exporters.base import RetryPolicy, SpoolSink, normalize
from audit_schema.events import FIELDS

log = logging.getLogger("dsec.exporter.jsonl")

SINK = "jsonl"


_NAMES = [f.name for f in FIELDS]


def json_line(rec: dict) -> str:
    """The `dsec events --format json` line of a record (no newline)."""
    from audit_schema.describe import to_json_line
    return to_json_line(normalize(rec))


def json_lines(rows: list[dict], normalized: bool = False) -> bytes:
    """json_line of each row, one per line (newline-terminated), as UTF-8.

    Batch-shaped (issue 15): orjson's output for a record is byte for byte
    json_line's (compact, UTF-8 kept, the same escapes; tests/test_exporters.py
    checks the characters a writer gets wrong), so a batch is one orjson call
    (split at the record boundaries) or one per row; a row orjson refuses (the lone surrogates of raw bytes, which must
    come out as \\udcXX escapes) takes json_line. normalized=True: the rows
    already have every field in FIELDS order and no None (a batch of batch
    frames, checked by column), so normalize is skipped."""
    if orjson is None:
        return "".join(json_line(r) + "\n" for r in rows).encode("utf-8")
    dumps = orjson.dumps
    if normalized and rows:
        # the whole batch in one call, split into lines at the records' boundaries: every
        # record starts with event_id (FIELDS order) and inside a JSON string a '"' is
        # always escaped, so '},{"event_id":' occurs only between two records (counted)
        try:
            data = dumps(rows)[1:-1].replace(b'},{"event_id":', b'}\n{"event_id":')
        except TypeError:
            pass                        # raw bytes somewhere: record by record below
        else:
            if data.count(b"\n") == len(rows) - 1:
                return data + b"\n"
    out = []
    for r in rows:
        if not normalized:
            r = normalize(r)
        try:
            out.append(dumps(r))
        except TypeError:
            out.append(json_line(r).encode("utf-8"))
    out.append(b"")
    return b"\n".join(out)


_STRING = {f.name: f.ch_type == "String" for f in FIELDS}
_NAME_JSON = {f.name: orjson.dumps(f.name) if orjson is not None else b'"%s"' % f.name.encode() for f in FIELDS}
_ARRAY = {f.name: f.ch_type == "Array(String)" for f in FIELDS}


def _one(v) -> bytes:
    """One value's JSON: orjson's, or json_line's where orjson refuses (lone surrogates)."""
    try:
        return orjson.dumps(v)
    except TypeError:
        from audit_schema.describe import to_json_line
        return to_json_line(v).encode("utf-8")


def _string_contents(col) -> list:
    """The JSON of each string of col without its quotes: one orjson call for
    the column, split at '","' when no backslash is in it (so no escaped quote
    can fake a boundary), else one call per value."""
    try:
        data = orjson.dumps(col)
    except TypeError:
        data = None
    if data is not None and b"\\" not in data:
        parts = data[2:-2].split(b'","')
        if len(parts) == len(col):
            return parts
    return [_one(v)[1:-1] for v in col]


def _values(name, col) -> list:
    """The JSON of each value of a column that is not String."""
    if _ARRAY.get(name):
        return [_one(v) if v else b"[]" for v in col]
    try:
        data = orjson.dumps(col)
    except TypeError:
        data = None
    inner = data[1:-1] if data is not None else b'"'
    if not any(c in inner for c in b'"[{'):                         # numbers only: split at the commas
        parts = inner.split(b",")
        if len(parts) == len(col):
            return parts
    return [_one(v) for v in col]


def json_lines_columns(cols: dict, n: int) -> bytes:
    """json_lines of the n records given as columns (a batch of batch frames,
    normalized: every field in FIELDS order, no None), without a dict per
    record: each column's values as JSON (one orjson call per column), then a
    record is one join of its fields' names and values (issue 15). A column
    may be a list or a Repeat (Batch.raw_columns: a frame's {"r": value}):
    a Repeat's value is written once, into the constant text between the
    varying columns, never made a list or scanned. The same bytes as
    json_lines(records); tests/test_jsonl_columns.py checks it."""
    args = []
    const = b""                 # the JSON since the last varying column (names, and columns of one value)
    prev_string = False
    for j, (name, col) in enumerate(cols.items()):
        string = _STRING.get(name, False)
        key = _NAME_JSON.get(name) or orjson.dumps(name)
        const += (b'"' if prev_string else b"") + (b"{" if j == 0 else b",") + key + b":" + (b'"' if string else b"")
        prev_string = string
        if col.__class__ is Repeat:
            one = [col.value]
        elif col.count(col[0]) == n and len(set(map(type, col))) == 1:     # one value: part of the constant
            one = col[:1]
        else:
            args.append(repeat(const, n))
            args.append(_string_contents(col) if string else _values(name, col))
            const = b""
            continue
        const += (_string_contents(one) if string else _values(name, one))[0]
    const += (b'"' if prev_string else b"") + b"}\n"
    if not args:                # every column one value: n copies of one line
        return const * n
    args.append(repeat(const, n))
    return b"".join(map(b"".join, zip(*args)))


def _normalized(batch: Batch) -> bool:
    """Every record of the batch has every field in FIELDS order and no None
    (what the recorder spools), judged from its columns (batch frames; a
    Repeat by its one value)."""
    cols = batch.raw_columns
    return bool(cols) and list(cols) == _NAMES and \
        not any(c.value is None if c.__class__ is Repeat else None in c for c in cols.values())


class JsonlSink(SpoolSink):
    kind = SINK
    label = "JSON lines"
    evictable = True

    def __init__(self, spool: Spool | None = None, *, path: str = "-", sink: str = SINK, fsync: bool = True,
                 batch_records: int = 5000, flush_interval: float = 0.5, retry: RetryPolicy | None = None,
                 evictable: bool | None = None):
        if not path:
            raise ExportError("JSON lines sink: no path (a file, or - for stdout)", EXIT_USAGE)
        self.path = path if path == "-" else os.path.abspath(path)
        if self.path != "-":
            d = os.path.dirname(self.path)
            if not os.path.isdir(d):
                raise ExportError(f"JSON lines sink: directory {d} does not exist (path {path})", EXIT_USAGE)
        super().__init__(spool, sink=sink, batch_records=batch_records, flush_interval=flush_interval,
                         retry=retry or RetryPolicy(initial=0.1, maximum=5.0), evictable=evictable)
        self.fsync = fsync
        self._fd = None
        self._regular = False
        self._ident = None

    # -- the file
    def _open(self):
        """Open (or reopen after a rotation) and restore the committed size."""
        if self._fd is not None and (self.path == "-" or not self._regular):
            return self._fd
        if self._fd is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._ident:
                    return self._fd
            except FileNotFoundError:
                pass
            log.info("JSON lines sink %s: %s was rotated or removed; reopening", self.sink, self.path)
            os.close(self._fd)
            self._fd = None
        if self._fd is not None:
            return self._fd
        if self.path == "-":
            self._fd = sys.stdout.fileno()
            self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
            sys.stdout.flush()
            if not self._regular:
                return self._fd
            fd = self._fd
        else:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
            except OSError as e:
                raise ExportError(f"JSON lines sink: cannot open {self.path}: {e.strerror}")
            st = os.fstat(fd)
            self._regular = stat.S_ISREG(st.st_mode)
            self._fd = fd
            if not self._regular:
                return fd
        st = os.fstat(fd)
        self._ident = (st.st_dev, st.st_ino)
        state = self.reader.load_state() if self.path != "-" else None
        if isinstance(state, dict) and state.get("path") == self.path and \
                (state.get("dev"), state.get("ino")) == self._ident:
            size = int(state.get("size") or 0)
            if st.st_size > size:
                log.warning("JSON lines sink %s: %s has %d byte(s) past the last committed write (a delivery "
                            "whose commit did not happen); cut back, those records are written again",
                            self.sink, self.path, st.st_size - size)
                os.ftruncate(fd, size)
        elif self.path != "-":
            # a new file: commit its current size as the baseline, so that a crash in
            # the very first delivery is undone too
            self.reader.commit(self.spool.load_cursor(self.sink) or self.reader.position,
                               state=self._state(fd))
        return fd

    def _state(self, fd):
        st = os.fstat(fd)
        return {"path": self.path, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size}

    def deliver_batch(self, batch: Batch) -> None:
        if batch.count and _normalized(batch) and orjson is not None:
            self._write(json_lines_columns(batch.raw_columns, batch.count) + json_lines(self.damage_rows(batch)))
        else:
            self._write(json_lines(self.rows_of(batch)))

    def deliver(self, rows: list[dict]) -> None:
        self._write(json_lines(rows))

    def _write(self, data: bytes) -> None:
        fd = self._open()
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync and self._regular:
                os.fdatasync(fd)
        except OSError as e:
            if self._regular and self.path != "-":
                self._close_fd()          # reopened (and cut back to the committed size) next time
            raise OSError(e.errno, f"JSON lines sink: writing {self.path}: {e.strerror}") from None

    def committed_state(self):
        if self.path == "-" or self._fd is None or not self._regular:
            return Spool._KEEP
        return self._state(self._fd)

    def _close_fd(self):
        if self._fd is not None and self.path != "-":
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def close(self):
        self._close_fd()
        super().close()


__all__ = ["JsonlSink", "SINK", "json_line", "json_lines", "json_lines_columns"]
