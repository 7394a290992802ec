"""The few bpf(2) and perf_event_open(2) commands BCC's Python API lacks.

Used by the sensors (agent/sensors/enforce.py, agent/sensors/common.py):
  - cgroup attachments with explicit flags (BPF_F_ALLOW_MULTI), their query
    and detach by program fd (re-adopting a sandbox from a dead agent);
  - perf-event BPF links for tracepoints (BPF_LINK_CREATE, Linux >= 5.15),
    pinned in bpffs (BPF_OBJ_PIN) so that the attachment outlives the agent;
  - feature probes: load a two-instruction program of a given type, create a
    map of a given type (ring buffers, LPM tries).

x86_64 only (syscall numbers below), as the rest of dsec. Every function
raises OSError with the errno of the failing call.
"""
from __future__ import annotations

import ctypes as ct
import os
import struct

SYS_BPF = 321
SYS_PERF_EVENT_OPEN = 298

# bpf(2) commands
BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
BPF_LINK_CREATE = 28

# program / map / attach types used here
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_PROG_TYPE_CGROUP_SOCK_ADDR = 18
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_LPM_TRIE = 11
BPF_MAP_TYPE_RINGBUF = 27
BPF_CGROUP_INET4_CONNECT = 10
BPF_CGROUP_INET6_CONNECT = 11
BPF_CGROUP_UDP4_SENDMSG = 14
BPF_CGROUP_UDP6_SENDMSG = 15
BPF_PERF_EVENT = 41
BPF_F_NO_PREALLOC = 1
BPF_F_ALLOW_MULTI = 2

BPF_FUNC_send_signal = 109
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 8

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


def _bpf(cmd: int, attr: ct.Array) -> int:
    r = _libc.syscall(SYS_BPF, cmd, ct.byref(attr), ct.sizeof(attr))
    if r < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def _attr(size: int = 128) -> ct.Array:
    return (ct.c_uint8 * size)()


def _put(attr, fmt: str, offset: int, *values) -> None:
    struct.pack_into(fmt, attr, offset, *values)


# ---------------------------------------------------------------- objects

def obj_pin(fd: int, path: str) -> None:
    attr = _attr()
    p = ct.create_string_buffer(os.fsencode(path))
    _put(attr, "<QI", 0, ct.addressof(p), fd)
    _bpf(BPF_OBJ_PIN, attr)


def obj_get(path: str) -> int:
    attr = _attr()
    p = ct.create_string_buffer(os.fsencode(path))
    _put(attr, "<Q", 0, ct.addressof(p))
    return _bpf(BPF_OBJ_GET, attr)


def prog_get_fd_by_id(prog_id: int) -> int:
    attr = _attr()
    _put(attr, "<I", 0, prog_id)
    return _bpf(BPF_PROG_GET_FD_BY_ID, attr)


def prog_info(fd: int) -> dict:
    """{"type", "id", "tag", "name"} of a program fd (struct bpf_prog_info)."""
    info = (ct.c_uint8 * 256)()
    attr = _attr()
    _put(attr, "<IIQ", 0, fd, ct.sizeof(info), ct.addressof(info))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    raw = bytes(info)
    ptype, pid = struct.unpack_from("<II", raw, 0)
    return {"type": ptype, "id": pid, "tag": raw[8:16].hex(),
            "name": raw[64:80].split(b"\0", 1)[0].decode("ascii", "replace")}


# ---------------------------------------------------------------- cgroup attachments

def prog_attach(prog_fd: int, target_fd: int, attach_type: int, flags: int = 0) -> None:
    attr = _attr()
    _put(attr, "<IIII", 0, target_fd, prog_fd, attach_type, flags)
    _bpf(BPF_PROG_ATTACH, attr)


def prog_detach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    attr = _attr()
    _put(attr, "<III", 0, target_fd, prog_fd, attach_type)
    _bpf(BPF_PROG_DETACH, attr)


def prog_query(target_fd: int, attach_type: int, max_progs: int = 64) -> list[int]:
    """Ids of the programs attached to a cgroup at attach_type (this cgroup only)."""
    ids = (ct.c_uint32 * max_progs)()
    attr = _attr()
    _put(attr, "<IIIIQI", 0, target_fd, attach_type, 0, 0, ct.addressof(ids), max_progs)
    _bpf(BPF_PROG_QUERY, attr)
    cnt = struct.unpack_from("<I", attr, 24)[0]
    return list(ids[:min(cnt, max_progs)])


# ---------------------------------------------------------------- tracepoint links

def tracepoint_id(tracefs: str, category: str, event: str) -> int:
    with open(os.path.join(tracefs, "events", category, event, "id")) as f:
        return int(f.read())


def perf_event_open_tracepoint(tp_id: int) -> int:
    attr = (ct.c_uint8 * 128)()
    # struct perf_event_attr: type, size, config, sample_period, sample_type,
    # read_format, flags (u64), wakeup_events
    _put(attr, "<IIQQQQQI", 0, PERF_TYPE_TRACEPOINT, 128, tp_id, 1, 0, 0, 0, 1)
    fd = _libc.syscall(SYS_PERF_EVENT_OPEN, ct.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        e = ct.get_errno()
        raise OSError(e, f"perf_event_open(tracepoint {tp_id}): {os.strerror(e)}")
    return fd


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    attr = _attr()
    _put(attr, "<IIII", 0, prog_fd, target_fd, attach_type, 0)
    return _bpf(BPF_LINK_CREATE, attr)


def tracepoint_link(prog_fd: int, tracefs: str, category: str, event: str) -> int:
    """Attach a loaded tracepoint program through a BPF link (pinnable); the
    link holds the perf event, so only the link fd is returned."""
    pfd = perf_event_open_tracepoint(tracepoint_id(tracefs, category, event))
    try:
        return link_create(prog_fd, pfd, BPF_PERF_EVENT)
    finally:
        os.close(pfd)


# ---------------------------------------------------------------- probes

def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_MOV64_IMM, _CALL, _EXIT = 0xB7, 0x85, 0x95


def prog_load_probe(prog_type: int, insns: bytes, expected_attach_type: int = 0) -> None:
    """Load (and close) a tiny program; raises OSError when the kernel refuses it."""
    buf = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(b"GPL")
    log = ct.create_string_buffer(4096)
    attr = _attr()
    _put(attr, "<IIQQIIQ", 0, prog_type, len(insns) // 8, ct.addressof(buf), ct.addressof(lic),
         1, ct.sizeof(log), ct.addressof(log))
    _put(attr, "<I", 68, expected_attach_type)
    try:
        fd = _bpf(BPF_PROG_LOAD, attr)
    except OSError as e:
        lines = [ln for ln in log.value.decode("utf-8", "replace").strip().splitlines()
                 if ln and not ln.startswith(("processed ", "verification time"))]
        raise OSError(e.errno, f"{e.strerror}" + (f" (verifier: {lines[-1]})" if lines else "")) from None
    os.close(fd)


def probe_cgroup_sock_addr() -> None:
    """A cgroup/connect4 program that allows everything."""
    prog_load_probe(BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
                    _insn(_MOV64_IMM, 0, imm=1) + _insn(_EXIT), BPF_CGROUP_INET4_CONNECT)


def probe_send_signal() -> None:
    """A tracepoint program calling bpf_send_signal (the verifier checks the helper exists)."""
    prog_load_probe(BPF_PROG_TYPE_TRACEPOINT,
                    _insn(_MOV64_IMM, 1, imm=0) + _insn(_CALL, imm=BPF_FUNC_send_signal)
                    + _insn(_MOV64_IMM, 0, imm=0) + _insn(_EXIT))


def probe_map(map_type: int, key_size: int, value_size: int, flags: int = 0, max_entries: int = 1) -> None:
    """Create (and close) a map; raises OSError when the kernel refuses it."""
    attr = _attr()
    _put(attr, "<IIIII", 0, map_type, key_size, value_size, max_entries, flags)
    os.close(_bpf(BPF_MAP_CREATE, attr))


def probe_lpm_trie() -> None:
    probe_map(BPF_MAP_TYPE_LPM_TRIE, 8, 4, BPF_F_NO_PREALLOC)


def fast_detach(bpf, workers: int = 16) -> None:
    """Detach every tracepoint of a BCC module in parallel, then clean up.

    Each perf-event close waits for an RCU grace period in the kernel (tens of
    ms); one at a time, 40 tracepoints took ~2.6 s to detach. Closing them from
    several threads overlaps those waits (ctypes releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    tps = list(getattr(bpf, "tracepoint_fds", {}).keys())
    raws = list(getattr(bpf, "raw_tracepoint_fds", {}).keys())

    def one(tp):
        try:
            bpf.detach_tracepoint(tp)
        except Exception:  # noqa: BLE001 - cleanup() below retries what is left
            pass

    def one_raw(tp):
        try:
            bpf.detach_raw_tracepoint(tp)
        except Exception:  # noqa: BLE001
            pass

    if tps or raws:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(tps) + len(raws)))) as ex:
            list(ex.map(one, tps))
            list(ex.map(one_raw, raws))
    bpf.cleanup()
