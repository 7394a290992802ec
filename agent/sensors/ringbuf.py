"""Bulk reader of a BPF ring buffer map: the records between the consumer and
producer positions, copied out in one piece, without a Python call per record.

BCC's open_ring_buffer/ring_buffer_poll run libbpf's loop, which calls a
ctypes callback per record: a Python frame, a ctypes conversion and a copy
for each event; past ~40k events/s that loop alone falls behind the kernel
(iovisor/bcc#3476). RingReader maps the ring itself, as libbpf does:

  map fd offset 0             consumer page   (read-write: consumer_pos, u64)
  map fd offset 1 page        producer page   (read-only:  producer_pos, u64)
  map fd offset 2 pages       data pages, size bytes, mapped twice in a row
                              by the kernel so that a record that wraps the
                              end of the ring is contiguous in memory

and walks the records of [consumer_pos, producer_pos): each starts with an
8-byte header (u32 length with BPF_RINGBUF_BUSY_BIT = still being written and
BPF_RINGBUF_DISCARD_BIT = reserved then discarded, u32 page offset), then the
sample, the whole rounded up to 8 bytes. The walk stops at the first busy
record (everything after it waits for it, as the kernel orders commits by
reservation). The committed region is copied in one bytes object, the
consumer position then advanced past it (the kernel may reuse the space from
that moment), and the records handed out as (blob, offsets) for a decoder
that reads many records per call, or as bytes slices.

Memory ordering. The kernel publishes producer_pos and each header's length
with release stores; a consumer must read them with acquire loads and store
consumer_pos with a release store after its last read of the data. This
reader does plain loads/stores through ctypes (single aligned 8/4-byte
moves). On x86-64 (TSO: loads are not reordered with loads, stores are not
reordered with earlier loads) plain moves have exactly those semantics, so
this is what libbpf's smp_load_acquire/smp_store_release compile to there.
On other architectures they do not: supported() is False off x86-64 and the
sensor keeps BCC's callback reader (slower, but correct).

Wake-ups: epoll on the map fd (level-triggered: ready while consumer_pos !=
producer_pos). The BPF side asks for a wake-up at most every 20 ms while
records flow (bpf/common.h DSEC_WAKE_NS: BPF_RB_FORCE_WAKEUP on the first
record after that, BPF_RB_NO_WAKEUP otherwise), so a reader must empty the
ring before it sleeps and read after a wait() that timed out too (the
sensor's _ring_poll, agent/sensors/common.py, does both).
"""
from __future__ import annotations

import ctypes as ct
import mmap
import os
import platform
import select
import struct

BUSY_BIT = 1 << 31            # BPF_RINGBUF_BUSY_BIT (include/uapi/linux/bpf.h)
DISCARD_BIT = 1 << 30         # BPF_RINGBUF_DISCARD_BIT
HDR_SZ = 8                    # BPF_RINGBUF_HDR_SZ
LEN_MASK = ~(BUSY_BIT | DISCARD_BIT) & 0xFFFFFFFF
PAGE = mmap.PAGESIZE
DEFAULT_MAX_BYTES = 8 << 20   # bytes copied out per read() call (many records; bounded memory)

_u32 = struct.Struct("<I")

_libc = ct.CDLL(None, use_errno=True)
_libc.mmap.restype = ct.c_void_p
_libc.mmap.argtypes = (ct.c_void_p, ct.c_size_t, ct.c_int, ct.c_int, ct.c_int, ct.c_long)
_libc.munmap.restype = ct.c_int
_libc.munmap.argtypes = (ct.c_void_p, ct.c_size_t)
_MAP_FAILED = ct.c_void_p(-1).value


def supported() -> bool:
    """Plain loads/stores are acquire/release only on x86-64 (see the module doc)."""
    return platform.machine() in ("x86_64", "AMD64")


def _map(fd: int, length: int, prot: int, offset: int) -> int:
    addr = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        e = ct.get_errno()
        raise OSError(e, f"mmap of the BPF ring buffer ({length} bytes at {offset}): {os.strerror(e)}")
    return addr


def walk(data, mask: int, cons: int, end: int) -> tuple[int, list[tuple[int, int]], int]:
    """Walk the records of ring positions [cons, end) in `data` (the data
    pages mapped twice: len(data) == 2 * (mask + 1)). Returns (the position
    after the last committed record, [(offset from cons of a sample, its
    length)] of those not discarded, how many were discarded). Stops at the
    first busy record; a record that would end past `end` is not taken
    unless the producer has committed it (then end was a read limit, not the
    producer position: callers pass min(prod, cons + limit) and every
    record before prod is complete, so one record past a limit is fine)."""
    size = mask + 1
    unpack = _u32.unpack_from
    spans = []
    discarded = 0
    p = cons
    while p < end:
        ln = unpack(data, p & mask)[0]
        if ln & BUSY_BIT:
            break                              # not committed yet: it and what follows wait
        n = ln & LEN_MASK
        nxt = p + ((n + HDR_SZ + 7) & ~7)
        if nxt - cons > size:                  # a corrupt length: never walk off the mapping
            raise ValueError(f"BPF ring buffer record of {n} bytes at position {p} exceeds the ring")
        if ln & DISCARD_BIT:
            discarded += 1
        else:
            spans.append((p - cons + HDR_SZ, n))
        p = nxt
    return p, spans, discarded


class RingReader:
    """One BPF_MAP_TYPE_RINGBUF map (its fd and data size), read in bulk.

    read() -> (blob, [(offset, length), ...]): the committed records copied
    in one bytes object (discarded ones skipped), the consumer position
    already advanced past them. records() -> [bytes]: the same as slices."""

    def __init__(self, map_fd: int, size: int, *, max_bytes: int = DEFAULT_MAX_BYTES):
        if size < PAGE or size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power-of-two number of pages")
        self.fd = os.dup(map_fd)          # ours: BCC may close its own at cleanup
        self.size = size
        self.mask = size - 1
        self.max_bytes = max(PAGE, min(max_bytes, size))
        self._cons_addr = self._prod_addr = None
        try:
            self._cons_addr = _map(self.fd, PAGE, mmap.PROT_READ | mmap.PROT_WRITE, 0)
            self._prod_len = PAGE + 2 * size
            self._prod_addr = _map(self.fd, self._prod_len, mmap.PROT_READ, PAGE)
        except OSError:
            self.close()
            raise
        self._cons = ct.c_uint64.from_address(self._cons_addr)
        self._prod = ct.c_uint64.from_address(self._prod_addr)
        self._data_addr = self._prod_addr + PAGE
        # the data pages, twice: a record (or a whole batch) that wraps is contiguous here
        self.data = memoryview((ct.c_ubyte * (2 * size)).from_address(self._data_addr)).cast("B")
        self.epoll = select.epoll()
        self.epoll.register(self.fd, select.EPOLLIN)
        self.records_read = 0
        self.bytes_read = 0
        self.discarded = 0
        self.reads = 0

    # -- positions ------------------------------------------------------------------

    @property
    def consumer_pos(self) -> int:
        return self._cons.value

    @property
    def producer_pos(self) -> int:
        return self._prod.value        # a plain aligned load: acquire on x86-64 (module doc)

    def pending_bytes(self) -> int:
        return self._prod.value - self._cons.value

    # -- reading --------------------------------------------------------------------

    def read(self, max_bytes: int | None = None) -> tuple[bytes, list[tuple[int, int]]]:
        """The committed records from consumer_pos (at most ~max_bytes of ring),
        copied out; consumer_pos advanced past them (and past discarded ones)."""
        limit = self.max_bytes if max_bytes is None else max(HDR_SZ, min(max_bytes, self.size))
        cons = self._cons.value
        prod = self._prod.value
        if cons >= prod:
            return b"", []
        start = cons & self.mask
        p, spans, discarded = walk(self.data, self.mask, cons, cons + min(prod - cons, limit))
        if p == cons:
            return b"", []
        blob = bytes(self.data[start:start + (p - cons)])   # the data pages are mapped twice: contiguous
        self._cons.value = p                           # after the copy: a release store on x86-64
        self.reads += 1
        self.records_read += len(spans)
        self.bytes_read += p - cons
        self.discarded += discarded
        return blob, spans

    def records(self, max_bytes: int | None = None) -> list[bytes]:
        blob, spans = self.read(max_bytes)
        return [blob[o:o + n] for o, n in spans]

    def wait(self, timeout_ms: int) -> bool:
        """Sleep until the ring has data (True) or timeout_ms passes (False)."""
        if self._prod.value != self._cons.value:
            return True
        try:
            return bool(self.epoll.poll(max(0, timeout_ms) / 1000.0))
        except InterruptedError:
            return False

    def close(self) -> None:
        if getattr(self, "epoll", None) is not None:
            self.epoll.close()
            self.epoll = None
        self.data = None
        self._cons = self._prod = None
        if self._prod_addr is not None:
            _libc.munmap(self._prod_addr, self._prod_len)
            self._prod_addr = None
        if self._cons_addr is not None:
            _libc.munmap(self._cons_addr, PAGE)
            self._cons_addr = None
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
