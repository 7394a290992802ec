"""The compiled-program cache (agent/sensors/bpfcache.py): a load from the cache
is the program the compile produced, and an entry nobody should trust is never
loaded. Real BCC compiles and real kernel loads, each test its own cache dir."""
from __future__ import annotations

import ctypes as ct
import logging
import os

import pytest

from agent.sensors import bpfcache, bpfsys, enforce


def _tag(fd: int) -> str:
    """The kernel's tag of a loaded program: a hash of its instructions with map fds zeroed."""
    return bpfsys.prog_info(fd)["tag"]


def _kind(b) -> str:
    return "cached" if type(b).__name__ == "CachedBPF" else "compiled"


def _load(cflags):
    """The enforcement sensor's programs (lpm tries, a ring buffer, a perf buffer,
    per-CPU arrays, hashes without prealloc) loaded as its loader loads them, with
    its cgroup programs too; {name: tag}, {map: shape}, "compiled" or "cached"."""
    b = enforce.compile_bpf(cflags)
    try:
        # every program loaded and verified, none attached (the sensor links or attaches its own)
        assert len(b.funcs) >= 16 and not b.tracepoint_fds and not b.raw_tracepoint_fds
        for name, attach_type in enforce.EGRESS_PROGS:
            b.load_func(name.encode(), b.CGROUP_SOCK_ADDR, attach_type=attach_type)
        tags = {n: _tag(f.fd) for n, f in b.funcs.items()}
        shapes = {}
        for m in (b"enf_events", b"egress4", b"exec_allow", b"enf_scratch", b"sys_counts", b"cwd_req"):
            t = b[m]
            shapes[m] = (t.ttype, t.flags, t.max_entries, ct.sizeof(t.Key) if hasattr(t, "Key") else 0,
                         ct.sizeof(t.Leaf) if hasattr(t, "Leaf") else 0)
        return tags, shapes, _kind(b)
    finally:
        b.cleanup()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "bpf"
    monkeypatch.setenv("DSEC_BPF_CACHE", str(d))
    return d


# a cflag of this file's own so that no other test's entry is ever this one's
CFLAGS = enforce.build_cflags(ring_bytes=enforce.DEFAULT_RING_BYTES) + ["-DDSEC_TEST_BPFCACHE=1"]


def test_a_cached_load_is_the_program_the_compile_made(cache):
    tags, shapes, kind = _load(CFLAGS)
    assert kind == "compiled"                         # a miss: compiled, then stored
    assert len(os.listdir(cache)) == 1
    tags2, shapes2, kind2 = _load(CFLAGS)
    assert kind2 == "cached"
    assert len(tags) >= 18 and tags2 == tags          # every program, instruction for instruction
    assert shapes2 == shapes
    _tags3, _shapes3, kind3 = _load(CFLAGS + ["-DDSEC_TEST_BPFCACHE_OTHER=1"])
    assert kind3 == "compiled"                        # other cflags: another text, another entry
    assert len(os.listdir(cache)) == 2


def test_a_torn_altered_or_foreign_entry_is_never_loaded(cache, caplog):
    caplog.set_level(logging.WARNING, logger="dsec")
    _load(CFLAGS)
    (entry,) = [cache / n for n in os.listdir(cache)]
    good = entry.read_bytes()
    for bad in (good[:len(good) // 2],                                  # torn
                good.replace(b'"max_entries":65536', b'"max_entries":65535', 1)):   # altered: loads, but wrong
        assert bad != good
        entry.write_bytes(bad)
        assert _load(CFLAGS)[2] == "compiled"
        assert entry.read_bytes() == good                               # compiled and stored again
    assert "torn or altered" in caplog.text
    caplog.clear()
    os.chmod(entry, 0o666)                                              # anyone could have written it
    assert _load(CFLAGS)[2] == "compiled"
    assert "is not uid 0's alone; ignored" in caplog.text
    os.chmod(entry, 0o600)
    os.chmod(cache, 0o777)                                              # anyone could plant an entry
    caplog.clear()
    assert _load(CFLAGS)[2] == "compiled"
    assert "program cache not used" in caplog.text and "writable by no one else" in caplog.text
    os.chmod(cache, 0o700)
    assert _load(CFLAGS)[2] == "cached"


def test_off_compiles_every_time(monkeypatch, tmp_path):
    monkeypatch.setenv("DSEC_BPF_CACHE", "off")
    assert bpfcache.cache_dir() is None
    assert _load(CFLAGS)[2] == "compiled"


def _map_id(fd: int) -> int:
    info = (ct.c_uint8 * 128)()
    attr = bpfsys._attr()
    bpfsys._put(attr, "<IIQ", 0, fd, ct.sizeof(info), ct.addressof(info))
    bpfsys._bpf(bpfsys.BPF_OBJ_GET_INFO_BY_FD, attr)
    return int.from_bytes(bytes(info)[4:8], "little")


def test_a_cached_audit_sensor_opens_the_pinned_maps_it_is_given(cache):
    """The audit text opens the enforcement sensor's cwd maps at pinned paths,
    another per agent: one entry serves every agent, and a load from it opens
    the maps pinned at this load's paths, not new ones."""
    from agent.sensors import audit
    root = f"/sys/fs/bpf/dsec-test-bpfcache-{os.getpid()}"
    cflags = audit.build_cflags(ring_bytes=audit.DEFAULT_RING_BYTES, argv_bytes=audit.DEFAULT_ARGV_BYTES,
                                max_args=audit.DEFAULT_MAX_ARGS, max_inflight=audit.DEFAULT_MAX_INFLIGHT)
    pinned = []
    try:
        kinds = []
        for run in ("a", "b", "a"):
            pins = {"gen": f"{root}/{run}/cwd_gen", "cwd": f"{root}/{run}/cwd"}
            os.makedirs(f"{root}/{run}", exist_ok=True)
            b = audit.compile_bpf(cflags + audit._cwd_cflags(pins), pins=audit._cwd_map_pins(pins))
            try:
                kinds.append(_kind(b))
                for m, path in (("enf_cwd_gen", pins["gen"]), ("enf_cwd", pins["cwd"])):
                    fd = bpfsys.obj_get(path)         # BCC pinned it there (first) or opened it there
                    pinned.append(path)
                    try:
                        assert _map_id(b[m.encode()].map_fd) == _map_id(fd), (run, m)
                    finally:
                        os.close(fd)
            finally:
                b.cleanup()
        assert kinds == ["compiled", "cached", "cached"]
        assert len(os.listdir(cache)) == 1
    finally:
        for p in set(pinned):
            os.unlink(p)
        for run in ("a", "b"):
            if os.path.isdir(f"{root}/{run}"):
                os.rmdir(f"{root}/{run}")
        if os.path.isdir(root):
            os.rmdir(root)
