"""Exec enrichment (agent/sensors/elfinfo.py) on real files: system binaries, ELF files
built here byte by byte, scripts, and hostile inputs."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from agent.sensors.elfinfo import CHANGED, ElfInfoCache, Pending, inspect_fd, open_in_root
from agent.sensors.enrich import QUEUE_FULL, Enricher, EnrichJob
from audit_schema.events import to_bytes

PT_LOAD, PT_INTERP, PT_NOTE = 1, 3, 4


def make_elf(path, *, interp: bytes | None = None, build_id: bytes | None = None,
             extra_phdrs=(), phnum: int | None = None) -> str:
    """A minimal ELF64 x86-64 executable: program headers only, no sections
    (like a binary stripped with sstrip)."""
    blobs = []
    if interp is not None:
        blobs.append((PT_INTERP, interp + b"\0"))
    if build_id is not None:
        note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
        note += b"\0" * (-len(note) % 4)
        blobs.append((PT_NOTE, note))
    n = 1 + len(blobs) + len(extra_phdrs)
    data_off = 64 + 56 * n
    phdrs, data = [], b""
    phdrs.append(struct.pack("<IIQQQQQQ", PT_LOAD, 5, 0, 0x400000, 0x400000, 0, 0, 0x1000))
    for ptype, blob in blobs:
        phdrs.append(struct.pack("<IIQQQQQQ", ptype, 4, data_off + len(data), 0, 0, len(blob), len(blob), 1))
        data += blob
    for ptype, off, size in extra_phdrs:
        phdrs.append(struct.pack("<IIQQQQQQ", ptype, 4, off, 0, 0, size, size, 1))
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + b"\0" * 9, 2, 62, 1,
                       0x400000, 64, 0, 0, 64, 56, n if phnum is None else phnum, 64, 0, 0)
    with open(path, "wb") as f:
        f.write(ehdr + b"".join(phdrs) + data)
    os.chmod(path, 0o755)
    return str(path)


def oracle(path):
    """An independent reading of PT_INTERP and the GNU build-id note."""
    with open(path, "rb") as f:
        blob = f.read()
    phoff, = struct.unpack_from("<Q", blob, 32)
    phentsize, phnum = struct.unpack_from("<HH", blob, 54)
    interp, build_id = b"", ""
    for i in range(phnum):
        ptype, _, off, _, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", blob, phoff + i * phentsize)
        seg = blob[off: off + filesz]
        if ptype == PT_INTERP:
            interp = seg.rstrip(b"\0")
        elif ptype == PT_NOTE:
            pos = 0
            while pos + 12 <= len(seg):
                namesz, descsz, ntype = struct.unpack_from("<III", seg, pos)
                name = seg[pos + 12: pos + 12 + namesz]
                dpos = pos + 12 + namesz + (-namesz % 4)
                if ntype == 3 and name == b"GNU\0":
                    build_id = seg[dpos: dpos + descsz].hex()
                pos = dpos + descsz + (-descsz % 4)
    return interp, build_id


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def info(path, **kw):
    return ElfInfoCache(**kw).info_for_path(path)


# ---------------------------------------------------------------- real binaries

def test_dynamic_system_binary():
    path = os.path.realpath("/bin/true")
    i = info(path)
    interp, build_id = oracle(path)
    assert i.file_type == "elf" and i.sha256 == sha256(path)
    assert i.interp == interp and interp.startswith(b"/") and i.is_static == 0
    assert i.build_id == build_id and len(build_id) == 40
    assert not i.notes


def test_static_system_binary():
    path = os.path.realpath("/sbin/ldconfig")          # glibc's static-pie ldconfig
    i = info(path)
    assert i.file_type == "elf" and i.is_static == 1 and i.interp == b""
    assert i.build_id == oracle(path)[1]


# ---------------------------------------------------------------- built here

def test_handmade_elf_without_sections(tmp_path):
    bid = bytes(range(20))
    path = make_elf(tmp_path / "dyn", interp=b"/lib/ld-\xff.so", build_id=bid)
    i = info(path)
    assert (i.file_type, i.build_id, i.interp, i.is_static) == ("elf", bid.hex(), b"/lib/ld-\xff.so", 0)
    fields = i.record_fields()
    assert to_bytes(fields["interp"]) == b"/lib/ld-\xff.so"      # lossless
    static = make_elf(tmp_path / "static", build_id=b"\xab" * 8)
    s = info(static)
    assert (s.is_static, s.interp, s.build_id) == (1, b"", "ab" * 8)


def test_script_shebang(tmp_path):
    p = tmp_path / "s"
    p.write_bytes(b"#!/usr/bin/env python3 -u\nprint('x')\n")
    i = info(str(p))
    assert (i.file_type, i.shebang, i.sha256, i.build_id) == ("script", b"/usr/bin/env python3 -u",
                                                             sha256(p), "")
    long = tmp_path / "long"
    long.write_bytes(b"#!" + b"x" * 10000 + b"\n")
    assert len(info(str(long)).shebang) <= 254                 # bounded like the kernel's


# ---------------------------------------------------------------- hostile files

def test_hostile_elf_headers(tmp_path):
    trunc = tmp_path / "trunc"
    trunc.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 20)
    i = info(str(trunc))
    assert i.file_type == "elf" and "elf_error" in i.notes and i.sha256 == sha256(trunc)

    for phnum in (1000, 0xFFFF):                               # past the end; PN_XNUM
        many = make_elf(tmp_path / f"many{phnum}", phnum=phnum)
        assert "elf_error" in info(many).notes

    huge_note = make_elf(tmp_path / "note", extra_phdrs=[(PT_NOTE, 0, 1 << 40)])
    t = time.monotonic()
    i = info(huge_note)
    assert time.monotonic() - t < 5 and i.build_id == ""

    huge_interp = make_elf(tmp_path / "interp", extra_phdrs=[(PT_INTERP, 0, 1 << 40)])
    assert "interp_error" in info(huge_interp).notes


def test_fifo_is_not_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = time.monotonic()
    i = info(str(fifo))                                        # no writer: must not block
    assert time.monotonic() - t < 5
    assert i.notes["enrich_error"] == "not a regular file" and i.sha256 == ""


def test_huge_file_is_not_hashed(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(b"\x7fELF")
        f.truncate(4 << 30)                                    # sparse 4 GiB
    t = time.monotonic()
    i = info(str(big), max_hash_bytes=1 << 20)
    assert time.monotonic() - t < 5
    assert i.sha256 == "" and i.notes["sha256_skipped"] == f"size {4 << 30} bytes > cap {1 << 20} (max_hash_bytes)"


def test_cache_by_identity(tmp_path):
    p = tmp_path / "s"
    p.write_bytes(b"#!/bin/sh\n")
    cache = ElfInfoCache()
    first = cache.info_for_path(str(p))
    assert cache.info_for_path(str(p)) is first and cache.hits == 1
    p.write_bytes(b"#!/bin/bash\n")
    os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert cache.info_for_path(str(p)).shebang == b"/bin/bash" and cache.misses == 2
    small = ElfInfoCache(max_entries=2)
    for n in range(5):
        q = tmp_path / f"f{n}"
        q.write_bytes(b"#!/x\n")
        small.info_for_path(str(q))
    assert len(small._cache) == 2


# ---------------------------------------------------------------- one entry for every sandbox

@pytest.fixture
def overlays(tmp_path):
    """Two overlay mounts over one lower directory (as the launcher mounts /usr
    for each sandbox), each with an upper layer of its own."""
    lower = tmp_path / "lower"
    lower.mkdir()
    make_elf(lower / "tool", interp=b"/lib64/ld-linux-x86-64.so.2", build_id=bytes(range(20)))
    (lower / "other").write_bytes(b"#!/bin/sh\necho other\n")
    mounts = []
    try:
        for n in (1, 2):
            for d in (f"u{n}", f"w{n}", f"m{n}"):
                (tmp_path / d).mkdir()
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={lower},upperdir={tmp_path}/u{n},workdir={tmp_path}/w{n}",
                            str(tmp_path / f"m{n}")], check=True)
            mounts.append(tmp_path / f"m{n}")
        yield lower, mounts
    finally:
        for m in mounts:
            subprocess.run(["umount", str(m)], check=True)


def test_overlay_lower_file_is_read_once_for_every_mount(overlays):
    """Keyed by st_dev, every sandbox's overlay was a new file to the cache: the
    lower file is now read once, whichever mount (or the host path) shows it."""
    lower, (m1, m2) = overlays
    cache = ElfInfoCache()
    first = cache.info_for_path(str(m1 / "tool"))
    assert cache.reads == 1 and first.build_id == bytes(range(20)).hex()
    assert cache.info_for_path(str(m2 / "tool")) is first
    assert cache.info_for_path(str(lower / "tool")) is first
    assert cache.reads == 1 and cache.lower.decoded == 2
    # off the decode path too: a cached_only lookup in a mount not seen before is a hit
    fd = os.open(m2 / "other", os.O_RDONLY)
    try:
        with pytest.raises(Exception):
            cache.info_for_fd(fd, cached_only=True)              # not read yet: deferred
        assert cache.info_for_fd(fd).shebang == b"/bin/sh" and cache.reads == 2
    finally:
        os.close(fd)
    fd = os.open(m1 / "other", os.O_RDONLY)
    try:
        assert cache.info_for_fd(fd, cached_only=True).shebang == b"/bin/sh" and cache.reads == 2
    finally:
        os.close(fd)
    cache.lower.close()


def test_overlay_upper_files_never_share_the_lower_entry(overlays):
    """A copied-up file keeps its origin's file handle: with the same content,
    size and mtime it is still read on its own; changed to another content of the
    same size and mtime it carries its own sha256; a new upper file too."""
    lower, (m1, m2) = overlays
    cache = ElfInfoCache()
    orig = cache.info_for_path(str(m1 / "tool"))
    st = os.stat(lower / "tool")
    data = (lower / "tool").read_bytes()
    with open(m2 / "tool", "r+b") as f:                       # copy-up, same bytes
        f.write(data[:4])
    os.utime(m2 / "tool", ns=(st.st_atime_ns, st.st_mtime_ns))
    same = cache.info_for_path(str(m2 / "tool"))
    assert same is not orig and same.sha256 == orig.sha256 and cache.reads == 2
    changed = data[:-1] + bytes([data[-1] ^ 0xFF])
    with open(m2 / "tool", "r+b") as f:
        f.write(changed)
    os.utime(m2 / "tool", ns=(st.st_atime_ns, st.st_mtime_ns))
    got = cache.info_for_path(str(m2 / "tool"))
    assert got.sha256 == hashlib.sha256(changed).hexdigest() != orig.sha256
    assert cache.info_for_path(str(m1 / "tool")) is orig             # the other sandbox still sees the lower file
    (m1 / "new").write_bytes(data)
    assert cache.info_for_path(str(m1 / "new")) is not orig and cache.reads == 4
    cache.lower.close()


# ---------------------------------------------------------------- the sandbox's view

@pytest.fixture
def chrooted(tmp_path):
    """A process chrooted into tmp_path/root (stays alive until the test ends)."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "etc" / "hostname").write_bytes(b"inside the sandbox\n")
    os.symlink("/etc/hostname", root / "bin" / "evil")          # absolute: must stay inside
    os.symlink("/etc/shadow", root / "bin" / "dangling")        # nothing there inside
    code = "import os, sys, time; os.chroot(sys.argv[1]); os.chdir('/'); print(1, flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-I", "-c", code, str(root)], stdout=subprocess.PIPE)
    try:
        p.stdout.readline()
        yield p.pid, root
    finally:
        p.kill()
        p.wait(10)


def test_paths_open_inside_the_process_root(chrooted):
    pid, root = chrooted
    inside = sha256(root / "etc" / "hostname")
    for path in (b"/bin/evil", b"/../../etc/hostname", b"/etc/hostname"):
        fd = open_in_root(pid, path)
        try:
            assert inspect_fd(fd).sha256 == inside
        finally:
            os.close(fd)
    with pytest.raises(OSError):
        os.close(open_in_root(pid, b"/bin/dangling"))


def test_for_exec_prefers_the_sandbox_file(chrooted):
    pid, root = chrooted
    cache = ElfInfoCache()
    got = cache.for_exec(pid, b"/bin/evil")
    assert got["sha256"] == sha256(root / "etc" / "hostname")
    assert got["extra"]["enrich_source"] == "path"
    gone = cache.for_exec(pid, b"/bin/dangling")
    # not the host's /etc/shadow: the running image, flagged as unverified
    assert gone["extra"]["enrich_source"] == "exe_unverified"
    assert gone["sha256"] == sha256(os.path.realpath(sys.executable))
    nothing = cache.for_exec(2 ** 22 + 12345, b"/bin/true")     # no such process
    assert "enrich_error" in nothing["extra"] and "sha256" not in nothing


def test_for_exec_uses_exe_when_it_is_the_same_file():
    p = subprocess.Popen(["/bin/sleep", "30"])
    try:
        for _ in range(500):
            with open(f"/proc/{p.pid}/comm") as f:
                if f.read().strip() == "sleep":
                    break
            time.sleep(0.01)
        got = ElfInfoCache().for_exec(p.pid, b"/bin/sleep")
        assert got["extra"]["enrich_source"] == "exe"
        assert got["sha256"] == sha256(os.path.realpath("/bin/sleep")) and got["build_id"]
    finally:
        p.kill()
        p.wait(10)


# ---------------------------------------------------------------- off the decode path

def _fds(under) -> int:
    """This process's open fds on files under `under` (not every fd: another
    test's leftovers may close theirs meanwhile)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(under) + "/")
        except OSError:
            pass
    return n


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_cached_only_defers_the_read_and_refuses_a_changed_file(tmp_path):
    """The decoder's side (for_exec(cached_only=True)) opens but never reads an
    uncached file: a Pending reads it later, and says so instead of vouching
    for a file that changed since the exec (a touch between exec and read)."""
    f = tmp_path / "prog"
    f.write_bytes(open("/bin/true", "rb").read())
    path = os.fsencode(str(f))
    cache = ElfInfoCache()
    n = _fds(tmp_path)
    p = cache.for_exec(os.getpid(), path, use_exe=False, cached_only=True)
    assert isinstance(p, Pending) and cache.misses == 0 and _fds(tmp_path) == n + 1
    got = p.finish()
    assert got["sha256"] == _sha(f) and got["build_id"] and _fds(tmp_path) == n
    again = cache.for_exec(os.getpid(), path, use_exe=False, cached_only=True)
    assert again["sha256"] == got["sha256"] and cache.hits == 1           # cached: answered at once
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))              # a touch: a new key
    p = cache.for_exec(os.getpid(), path, use_exe=False, cached_only=True)
    assert isinstance(p, Pending)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))          # changed after the "exec"
    assert p.finish() == {"extra": {"sha256_skipped": CHANGED}} and _fds(tmp_path) == n


def test_enricher_bounds_each_sandbox_and_returns_every_job(tmp_path):
    """Per-sandbox bound (submit refuses, the job untouched), every submitted job
    back exactly once from take_done(), finish() bounded (queued ones skipped,
    the one being read abandoned) and no fd left open after close()."""
    body = open("/bin/true", "rb").read()
    files = []
    for i in range(8):
        p = tmp_path / f"f{i}"
        with open(p, "wb") as f:
            f.write(body)
            f.truncate(40 << 20)                       # sparse: reading it takes a while
        files.append(os.fsencode(str(p)))
    cache = ElfInfoCache()
    n = _fds(tmp_path)

    def job(i, cg):
        pending = cache.for_exec(os.getpid(), files[i], use_exe=False, cached_only=True)
        assert isinstance(pending, Pending)
        rec = {"sha256": "", "extra": "{}"}
        return EnrichJob(rec, {"tid": i}, pending, cg)
    w = Enricher(cache, per_sandbox=2)
    a, b, extra = [job(0, 10), job(1, 10)], [job(2, 20)], job(3, 10)
    assert all(w.submit(j) for j in a + b)
    assert not w.submit(extra) and w.full_reason(10) == QUEUE_FULL and w.outstanding(10) == 2
    extra.skip(w.full_reason(10))
    assert extra.rec["sha256"] == "" and json.loads(extra.rec["extra"]) == {"sha256_skipped": QUEUE_FULL, "tid": 3}
    assert w.wait_all(60)
    done = w.take_done()
    assert sorted(id(j) for j in done) == sorted(id(j) for j in a + b)
    assert all(j.rec["sha256"] == _sha(files[0]) and json.loads(j.rec["extra"])["file_type"] == "elf" for j in done)
    # removal at once: nothing waited for; every job back, read or skipped
    c = [job(4, 30), job(5, 30)]
    assert all(w.submit(j) for j in c)
    t = time.monotonic()
    w.finish(30, 0.0, "gone")
    assert time.monotonic() - t < 1 and w.outstanding(30) == 0
    back = w.take_done()
    assert sorted(id(j) for j in back) == sorted(id(j) for j in c)
    for j in back:
        assert j.rec["sha256"] or json.loads(j.rec["extra"])["sha256_skipped"].startswith("gone"), j.rec
    # drain(cgroup_id): that sandbox's files read first, waited for, nothing skipped
    d, e = job(6, 40), job(7, 50)
    assert w.submit(d) and w.submit(e)
    assert w.wait_for(50, 60) and w.outstanding(50) == 0
    assert w.wait_all(60) and all(j.rec["sha256"] for j in w.take_done())
    w.close()
    assert w.take_done() == [] and _fds(tmp_path) == n


def test_enricher_reads_one_file_once_for_the_jobs_that_wait_for_it(tmp_path):
    """A sandbox that runs one uncached binary in a tight loop (the first
    steps of a sandbox, before the first read is done): every exec is a job
    for the same file; they follow the first one's read (no queue slot, their
    fds closed at once) and all get its answer, where past per_sandbox they
    went out "queue full". Another sandbox's job, or the file after a touch,
    is not the same job. Followers of a read abandoned at removal are
    skipped with it."""
    p = tmp_path / "prog"
    with open(p, "wb") as f:
        f.write(open("/bin/true", "rb").read())
        f.truncate(48 << 20)                           # sparse: reading it takes a while
    path = os.fsencode(str(p))
    cache = ElfInfoCache()
    n = _fds(tmp_path)

    def job(i, cg):
        pending = cache.for_exec(os.getpid(), path, use_exe=False, cached_only=True)
        assert isinstance(pending, Pending)
        return EnrichJob({"sha256": "", "extra": "{}"}, {"tid": i}, pending, cg)
    w = Enricher(cache, per_sandbox=2)
    same = [job(i, 10) for i in range(12)]
    other = job(99, 20)
    assert all(w.submit(j) for j in same) and w.submit(other)
    assert w.outstanding(10) == 1 and _fds(tmp_path) == n + 2          # one read each sandbox; the followers' fds closed
    assert w.wait_all(60)
    done = w.take_done()
    assert sorted(id(j) for j in done) == sorted(id(j) for j in same + [other])
    want = _sha(p)
    assert all(j.rec["sha256"] == want and json.loads(j.rec["extra"])["tid"] == j.extra["tid"] for j in done)
    assert w.n_followed == 11 and _fds(tmp_path) == n
    # a touch: a new identity (and, cached now, the old one is not asked for again)
    os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    lead, follow = job(1, 30), job(2, 30)
    assert w.submit(lead) and w.submit(follow) and w.outstanding(30) == 1
    time.sleep(0.01)                                            # the read has begun (or not: both ways end alike)
    w.finish(30, 0.0, "gone")
    back = w.take_done()
    assert sorted(id(j) for j in back) == sorted(id(j) for j in (lead, follow))
    for j in back:
        got = json.loads(j.rec["extra"])
        assert j.rec["sha256"] == "" and got["sha256_skipped"].startswith("gone"), j.rec
    w.close()
    assert w.take_done() == [] and _fds(tmp_path) == n


def test_an_exec_is_read_through_its_own_process_only_when_its_root_is_the_sandboxs(tmp_path):
    """An exec'ing process still alive at its decode is read through its own root and exe,
    pinned by its /proc descriptor, when its root is the sandbox's (procs.in_sandbox_root
    against the identity root_ready took from the init after READY), with no cgroup read; a
    process whose root is another -- the host's (a reused pid), or a process of the sandbox
    that chroot'ed -- is not taken by it (in_cgroup decides, as before), a gone one is GONE,
    and before READY nothing is. An init's root opened once (a batch's) reads the same file."""
    from conftest import dash_rootfs
    from fixtures_bpf import CgroupFactory, run_in_cgroup
    import agent.sensors.procs as P
    from agent.sensors.decoder import SandboxInfo
    root = dash_rootfs(tmp_path / "root")
    dash_rootfs(root / "sub")
    cgroups = CgroupFactory()
    procs = []
    try:
        cg = cgroups()
        hold = [str(root), "/bin/sh", "-c", "read x"]
        init = run_in_cgroup(cg, ["chroot"] + hold, stdin=subprocess.PIPE)
        worker = run_in_cgroup(cg, ["chroot"] + hold, stdin=subprocess.PIPE)
        chrooted = run_in_cgroup(cg, ["chroot", str(root / "sub")] + hold[1:], stdin=subprocess.PIPE)
        host = subprocess.Popen(["sleep", "60"])
        gone = subprocess.Popen(["true"])
        gone.wait()
        procs += [init, worker, chrooted, host]
        deadline = time.monotonic() + 10
        while not all(os.readlink(f"/proc/{p.pid}/exe").endswith("/sh") for p in (init, worker, chrooted)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        info = SandboxInfo(cgroup_id=cg.id, sandbox_id="s")
        P.set_root_pid(info, init.pid, cgroups.root)
        assert isinstance(info.root_pid, P.PinnedPid) and info.root_id is None
        assert P.in_sandbox_root(worker.pid, info) is None                  # before READY: not known
        P.root_ready(info)
        st = os.stat(root)
        assert info.root_id == (st.st_dev, st.st_ino)
        calls = []
        real = P.in_cgroup
        P.in_cgroup = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
        try:
            live = P.in_sandbox_root(worker.pid, info)
            assert isinstance(live, P.PinnedPid) and live == worker.pid
            got = ElfInfoCache().for_exec(live, b"/bin/sh", ())
        finally:
            P.in_cgroup = real
        assert calls == [] and got["extra"]["enrich_source"] == "exe", got
        assert got["sha256"] == _sha("/bin/dash")
        assert P.in_sandbox_root(host.pid, info) is None                   # the host's root: never taken
        assert P.in_sandbox_root(chrooted.pid, info) is None               # in the cgroup, another root
        assert P.in_sandbox_root(gone.pid, info) is P.GONE
        fd = P.open_root(info.root_pid)
        try:
            once = ElfInfoCache().for_exec(info.root_pid, b"/bin/sh", (), use_exe=False, root=fd)
        finally:
            os.close(fd)
        assert once["extra"]["enrich_source"] == "other_root" and once["sha256"] == _sha("/bin/dash"), once
        init.kill()                    # the init gone: its root's device may be another's soon
        init.wait()
        assert P.in_sandbox_root(worker.pid, info) is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cgroups.cleanup()


def test_live_pids_are_checked_when_used_and_exclude_a_process_that_left():
    """An exec's enrichment reads files only through processes still in the sandbox
    (decoder.LivePids, in_cgroup): its init and recent pids are checked when for_exec needs
    them, not per exec; one that has left the cgroup (or a reused pid outside it) is never
    used, and the exec'ing process itself is checked first."""
    from fixtures_bpf import CgroupFactory, run_in_cgroup
    from agent.sensors.decoder import LivePids, SandboxInfo, in_cgroup
    cgroups = CgroupFactory()
    procs = []
    try:
        cg = cgroups()
        inside = run_in_cgroup(cg, ["sleep", "60"])
        leaver = run_in_cgroup(cg, ["sleep", "60"])
        outside = subprocess.Popen(["sleep", "60"])
        procs += [inside, leaver, outside]
        deadline = time.monotonic() + 10
        while len(cg.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(os.path.join(cgroups.root, "cgroup.procs"), "w") as f:   # leaver leaves the sandbox
            f.write(str(leaver.pid))
        root = cgroups.root
        assert in_cgroup(inside.pid, cg.id, root)
        assert not in_cgroup(leaver.pid, cg.id, root) and not in_cgroup(outside.pid, cg.id, root)
        assert not in_cgroup(2 ** 22 + 4321, cg.id, root)             # no such process

        class Dec:
            cgroup2_root, proc = root, "/proc"
        info = SandboxInfo(cgroup_id=cg.id, sandbox_id="s", root_pid=leaver.pid)
        for p in (outside.pid, inside.pid):
            info.saw(p)
        calls = []
        import agent.sensors.procs as D
        real = D.in_cgroup
        D.in_cgroup = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
        try:
            lp = LivePids(Dec, info, exclude=(4242,))
            assert calls == []                                        # nothing read until iterated
            assert list(lp) == [inside.pid] and list(lp) == [inside.pid]
            assert sorted(calls) == sorted([leaver.pid, inside.pid, outside.pid])   # each checked once
        finally:
            D.in_cgroup = real
        # a file that does not open through the exec'ing pid is read through a live one only
        cache = ElfInfoCache()
        got = cache.for_exec(2 ** 22 + 12345, b"/bin/true", LivePids(Dec, info))
        assert got["extra"]["enrich_source"] == "other_root" and got.get("sha256"), got
        info.root_pid, info.recent_pids = leaver.pid, [outside.pid]
        got = cache.for_exec(2 ** 22 + 12345, b"/bin/true", LivePids(Dec, info))
        assert "sha256" not in got and "root of" not in got["extra"]["enrich_error"], got
        # the sandbox's init pinned (checked once, then read through its /proc descriptor): no
        # per-exec check, and once it has exited it is never read through (not even if its
        # number is reused)
        from agent.sensors.decoder import PinnedPid, set_root_pid
        set_root_pid(info, leaver.pid, root)
        assert not isinstance(info.root_pid, PinnedPid)                # not in the cgroup: plain
        set_root_pid(info, inside.pid, root)
        assert isinstance(info.root_pid, PinnedPid)
        calls.clear()
        D.in_cgroup = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
        try:
            got = cache.for_exec(2 ** 22 + 12345, b"/bin/true", LivePids(Dec, info))
        finally:
            D.in_cgroup = real
        assert got["extra"]["enrich_source"] == "other_root" and got.get("sha256") and calls == [], (got, calls)
        pinned = info.root_pid
        inside.kill()
        inside.wait()
        got = cache.for_exec(2 ** 22 + 12345, b"/bin/true", [pinned])
        assert "sha256" not in got and "No such process" in got["extra"]["enrich_error"], got
        fd = pinned.dir.fd
        del pinned, info.root_pid
        with pytest.raises(OSError):
            os.fstat(fd)                                                 # closed with its last reference
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cgroups.cleanup()
