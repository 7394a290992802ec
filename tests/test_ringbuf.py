"""The bulk ring-buffer reader (agent/sensors/ringbuf.py) against a real BPF
ring buffer: a small BCC program whose records the test orders through a
syscall argument (size, discard, sequence number), so the cases where a bulk
reader can go wrong happen on purpose: records that span the wrap point of
the ring, a discarded record in the middle of a batch, a burst larger than
the ring (every record then either read or counted as failed by the kernel,
never both, never neither). Plus the walk over a hand-made ring for the busy
bit, which no test can make the kernel hold still for."""
from __future__ import annotations

import os
import struct

import pytest

from agent.sensors import ringbuf

RING = 4096          # one page: wraps every few records

PROG = r"""
struct rec_buf { u8 b[1028]; };            /* room for a u32 at any offset <= 1023 */
BPF_RINGBUF_OUTPUT(rb, 1);
BPF_ARRAY(ctl, u32, 1);              /* [0] = the tgid whose getpgid calls produce */
BPF_ARRAY(failed, u64, 1);           /* records the kernel could not reserve */
BPF_PERCPU_ARRAY(scratch, struct rec_buf, 1);

/* getpgid(x): x = seq << 12 | discard << 11 | size (12..1023 bytes: seq at both ends) */
TRACEPOINT_PROBE(syscalls, sys_enter_getpgid) {
    u32 k = 0;
    u32 *t = ctl.lookup(&k);
    if (!t || (bpf_get_current_pid_tgid() >> 32) != *t)
        return 0;
    u64 x = args->pid;
    u32 size = x & 1023;
    u32 seq = x >> 12;
    if (x & 2048) {                      /* reserve, then discard */
        u64 *e = rb.ringbuf_reserve(16);
        if (!e) { u64 *f = failed.lookup(&k); if (f) __sync_fetch_and_add(f, 1); return 0; }
        e[0] = seq; e[1] = seq;
        rb.ringbuf_discard(e, 0);
        return 0;
    }
    struct rec_buf *s = scratch.lookup(&k);
    if (!s || size < 12)
        return 0;
    *(u32 *)&s->b[0] = seq;
    *(u32 *)&s->b[4] = size;
    u32 tail = (size - 4) & 1023;
    *(u32 *)&s->b[tail] = seq ^ 0xffffffff;
    if (rb.ringbuf_output(s, size, 0) != 0) {
        u64 *f = failed.lookup(&k);
        if (f) __sync_fetch_and_add(f, 1);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def ring():
    from bcc import BPF
    b = BPF(text=PROG.encode())
    b[b"ctl"][b[b"ctl"].Key(0)] = b[b"ctl"].Leaf(os.getpid())
    r = ringbuf.RingReader(b[b"rb"].map_fd, int(b[b"rb"].max_entries))
    assert r.size == RING
    yield b, r
    r.close()
    b.cleanup()


def emit(seq: int, size: int, discard: bool = False) -> None:
    try:
        os.getpgid(seq << 12 | (2048 if discard else 0) | size)
    except OSError:
        pass                                      # no such process: the tracepoint ran anyway


def failed(b) -> int:
    return b[b"failed"][b[b"failed"].Key(0)].value


def check(rec: bytes, seq: int, size: int) -> None:
    assert len(rec) == size
    assert struct.unpack_from("<II", rec) == (seq, size)
    assert struct.unpack_from("<I", rec, size - 4)[0] == seq ^ 0xffffffff   # the end came through whole


def drain(r) -> list[bytes]:
    out = []
    while True:
        got = r.records()
        if not got and r.pending_bytes() == 0:
            return out
        out += got


def test_records_across_the_wrap_point_arrive_whole(ring):
    b, r = ring
    drain(r)
    sizes = [12, 100, 1000, 333, 804, 17, 640, 999, 24, 512]
    seq, spanning = 0, 0
    for rnd in range(60):                          # ~40 trips round a one-page ring
        batch = []
        for i in range(3):                         # several records per read: the batch itself wraps too
            size = sizes[(rnd * 3 + i) % len(sizes)]
            pos = r.producer_pos
            emit(seq, size)
            if (pos & (RING - 1)) + ringbuf.HDR_SZ + size > RING:
                spanning += 1                      # this record's bytes cross the end of the ring
            batch.append((seq, size))
            seq += 1
        got = drain(r)
        assert len(got) == len(batch)
        for rec, (s, size) in zip(got, batch):
            check(rec, s, size)
    assert spanning >= 10                          # the case happened, many times
    assert failed(b) == 0


def test_a_discarded_record_in_the_middle_of_a_batch(ring):
    b, r = ring
    drain(r)
    d0 = r.discarded
    emit(1, 200)
    emit(2, 0, discard=True)
    emit(3, 300)
    emit(4, 0, discard=True)
    emit(5, 40)
    blob, spans = r.read()                         # one read: the whole batch
    assert [n for _, n in spans] == [200, 300, 40]
    for (o, n), s in zip(spans, (1, 3, 5)):
        check(blob[o:o + n], s, n)
    assert r.discarded - d0 == 2
    assert r.pending_bytes() == 0                  # the consumer moved past the discarded ones too


def test_a_burst_larger_than_the_ring_is_read_or_counted_never_both(ring):
    b, r = ring
    drain(r)
    f0 = failed(b)
    n = 200                                        # 200 x 208 bytes: ten rings' worth, nobody reading
    for i in range(n):
        emit(i, 200)
    got = drain(r)
    lost = failed(b) - f0
    assert lost > 0 and len(got) + lost == n       # each record either delivered or counted lost
    seqs = [struct.unpack_from("<I", g)[0] for g in got]
    assert seqs == sorted(seqs) and seqs[0] == 0   # what fitted came first, in order
    for g, s in zip(got, seqs):
        check(g, s, 200)
    for i in range(5):                             # and the ring works on after overflowing
        emit(1000 + i, 64)
    assert [struct.unpack_from("<I", g)[0] for g in drain(r)] == list(range(1000, 1005))


def _hand_ring(records, size=256):
    """A ring of `size` data bytes holding records [(length, flags, payload)]
    from position 0, data mapped "twice" as the kernel does."""
    data = bytearray(size)
    p = 0
    for n, flags, payload in records:
        struct.pack_into("<II", data, p % size, n | flags, 0)
        for i, c in enumerate(payload):
            data[(p + 8 + i) % size] = c
        p += (n + 8 + 7) & ~7
    return bytes(data) * 2, p


def test_walk_stops_at_a_busy_record_and_skips_discarded_ones():
    recs = [(5, 0, b"aaaaa"), (3, ringbuf.DISCARD_BIT, b"xxx"), (4, 0, b"bbbb"),
            (6, ringbuf.BUSY_BIT, b"cccccc"), (2, 0, b"dd")]
    data, end = _hand_ring(recs)
    p, spans, discarded = ringbuf.walk(data, 255, 0, end)
    assert [data[o:o + n] for o, n in spans] == [b"aaaaa", b"bbbb"]
    assert discarded == 1 and p == 16 + 16 + 16     # stopped before the busy one: it and what follows wait


def test_walk_refuses_a_length_past_the_ring():
    data, end = _hand_ring([(4000, 0, b"")])
    with pytest.raises(ValueError, match="exceeds the ring"):
        ringbuf.walk(data, 255, 0, 8)


def _field_values(obj, ctype) -> dict:
    """Field name -> value of a ctypes struct, byte arrays as bytes (as the struct views give them)."""
    out = {}
    for fd in ctype._fields_:
        v = getattr(obj, fd[0])
        out[fd[0]] = bytes(v) if not isinstance(v, (int, bytes)) else v
    return out


def test_struct_views_read_what_ctypes_reads(audit_sensor):
    """The decoder's struct views (decoder.fast_view, built from BCC's ctypes
    layout of struct dsec_event) give every field of the header and of each
    union member exactly as ctypes does, over random bytes."""
    dec = audit_sensor.sensor.decoder
    assert dec._hdr_view is not None and dec._body_views is not None     # the fast path is the one in use
    raw = os.urandom(dec.fixed + 64)
    st, nt = dec._hdr_view
    h_fast = nt._make(st.unpack_from(raw, dec.hdr_off))._asdict()
    h_ct = _field_values(dec.hdr_t.from_buffer_copy(raw, dec.hdr_off), dec.hdr_t)
    h_ct["comm"] = raw[dec.hdr_off + dec.hdr_t.comm.offset:][:dec.hdr_t.comm.size]   # ctypes stops at a NUL
    assert h_fast == h_ct
    body = dec.body_t.from_buffer_copy(raw, dec.body_off)
    for name, t in dec.body_t._fields_:
        st, nt = dec._body_views[name]
        fast = st.unpack_from(raw, dec.body_off)           # (a view names _pad fields _N: compare in order)
        assert list(fast) == list(_field_values(getattr(body, name), t).values()), name
        assert [n for n in nt._fields if not n.startswith("_")] == \
               [fd[0] for fd in t._fields_ if not fd[0].startswith("_")], name
