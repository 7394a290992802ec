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

from exporters.errors import ExportError, USAGE as EXIT_USAGE
from exporters.spool import Spool
from exporters.base import RetryPolicy, SpoolSink, normalize

log = logging.getLogger("dsec.exporter.jsonl")

SINK = "jsonl"


def json_line(rec: dict) -> str:
    """The `dsec events --format json` line of a record (no newline)."""
    from audit_schema.describe import to_json_line
    return to_json_line(normalize(rec))


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

    def deliver(self, rows: list[dict]) -> None:
        fd = self._open()
        data = ("\n".join(json_line(r) for r in rows) + "\n").encode("utf-8")
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


__all__ = ["JsonlSink", "SINK", "json_line"]
