"""Exec enrichment: what exactly ran.

For an exec'd file: sha256 (streamed), and for an ELF its build-id
(.note.gnu.build-id, read from the PT_NOTE segments so stripped binaries
work), PT_INTERP and static/dynamic (static = no PT_INTERP); for a script its
`#!` line. Read with pyelftools, cached by (device, inode, size, mtime,
ctime): a `touch` or a write changes the key, a rename or a hard link does not.

Off the decode path (agent/sensors/decoder.py, Enricher below): the decoder
opens the files (cheap) and takes a cached answer at once; a miss goes to
the Enricher's one worker thread, which serves sandboxes round-robin with at
most `per_sandbox` files queued per sandbox (the rest: `sha256_skipped`
"enrichment queue full"), so a sandbox exec'ing large files in a loop slows
only its own records' enrichment, and decoding never waits. Files over
`max_hash_bytes` (default 64 MiB) are not hashed: `extra.sha256_skipped`
says why (their ELF details are still read).

The sandbox's file is opened, never the host's file at the same path:
  - /proc/<pid>/exe when it is the same inode as the exec'd path (the mapped
    binary; it cannot be modified while it runs);
  - else the path inside the process's root, /proc/<pid>/root, opened with
    openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) so that a symlink planted
    in the sandbox cannot point the agent at a host file;
  - else the same inside the root of another live process of the sandbox
    (root_pid), for processes already gone.
Hostile files: only regular files are read (opened O_NONBLOCK, so a FIFO
cannot block); the shebang read is bounded (BINPRM_BUF_SIZE); sha256 streams
in 1 MiB chunks and stops at max_hash_bytes; ELF parsing touches headers,
PT_INTERP (<= 4 KiB) and PT_NOTE segments (<= 64 KiB, <= 64 notes) only; any
parse error becomes an `enrich_error` note instead of an exception.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import itertools
import json
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from audit_schema.events import from_bytes

SHEBANG_MAX = 256                 # the kernel's BINPRM_BUF_SIZE
MAX_HASH_BYTES = 64 << 20         # files larger than this are not hashed (sha256_skipped)
INTERP_MAX = 4096
NOTE_SEGMENT_MAX = 64 * 1024
NOTES_MAX = 64
SEGMENTS_MAX = 4096
CHUNK = 1 << 20

SYS_openat2 = 437                 # same number on every architecture
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


@dataclass
class FileInfo:
    file_type: str = "other"      # elf | script | other
    size: int = 0
    sha256: str = ""
    build_id: str = ""
    interp: bytes = b""
    is_static: int = 0
    shebang: bytes = b""
    notes: dict = field(default_factory=dict)   # problems met, for extra

    def record_fields(self) -> dict:
        return {
            "sha256": self.sha256,
            "build_id": self.build_id,
            "interp": from_bytes(self.interp),
            "is_static": self.is_static,
            "shebang": from_bytes(self.shebang),
        }


# ---------------------------------------------------------------- opening

class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: bytes, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(SYS_openat2, dirfd, ctypes.c_char_p(path), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_in_root(pid: int, path: bytes, proc: str = "/proc") -> int:
    """Open `path` (absolute, in the process's view) inside /proc/<pid>/root,
    symlinks resolved within that root."""
    if not path.startswith(b"/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    root = os.open(f"{proc}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rel = path.lstrip(b"/") or b"."
        return openat2(root, rel, _READ_FLAGS, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root)


def open_exe(pid: int, proc: str = "/proc") -> int:
    return os.open(f"{proc}/{pid}/exe", _READ_FLAGS)


# ---------------------------------------------------------------- reading

def read_shebang(fd: int) -> bytes:
    """The `#!` line (without "#!" and the newline), bounded like the kernel."""
    head = os.pread(fd, SHEBANG_MAX, 0)
    if not head.startswith(b"#!"):
        return b""
    return head[2:].split(b"\n", 1)[0].strip()


def sha256_fd(fd: int, size: int, limit: int) -> tuple[str, str]:
    """(hex digest, problem) streaming the file; ("", why) when over the limit."""
    if size > limit:
        return "", f"size {size} bytes > cap {limit} (max_hash_bytes)"
    h = hashlib.sha256()
    off = 0
    while off <= limit:
        chunk = os.pread(fd, CHUNK, off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
    if off > limit:
        return "", f"grew past the cap {limit} while being hashed"
    return h.hexdigest(), ""


class _FdReader(io.RawIOBase):
    """A seekable read-only file object on a borrowed fd (pread based)."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.pos = fd, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        self.pos = off if whence == 0 else (self.pos + off if whence == 1 else self.size + off)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        data = os.pread(self.fd, len(b), self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def elf_details(fd: int, size: int, info: FileInfo) -> None:
    """build_id, interp, is_static into `info` (problems into info.notes)."""
    from elftools.elf.elffile import ELFFile   # pyelftools

    f = io.BufferedReader(_FdReader(fd, size))
    elf = ELFFile(f)
    hdr = elf.header
    phnum = elf.num_segments()
    if hdr["e_phoff"] + phnum * hdr["e_phentsize"] > size:
        raise ValueError(f"{phnum} program headers at offset {hdr['e_phoff']} run past the end "
                         f"of the {size}-byte file")
    if phnum == 0:
        raise ValueError("no program headers: not an executable")
    if phnum > SEGMENTS_MAX:
        raise ValueError(f"{phnum} program headers (more than {SEGMENTS_MAX})")
    has_interp = False
    for seg in itertools.islice(elf.iter_segments(), SEGMENTS_MAX):
        ptype = seg["p_type"]
        if ptype == "PT_INTERP":
            has_interp = True
            n = seg["p_filesz"]
            if n > INTERP_MAX:
                info.notes["interp_error"] = f"PT_INTERP of {n} bytes"
                continue
            info.interp = os.pread(fd, n, seg["p_offset"]).split(b"\0", 1)[0]
        elif ptype == "PT_NOTE" and not info.build_id:
            if seg["p_filesz"] > NOTE_SEGMENT_MAX:
                continue
            for note in itertools.islice(seg.iter_notes(), NOTES_MAX):
                if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                    desc = note["n_desc"]
                    info.build_id = desc if isinstance(desc, str) else bytes(desc).hex()
                    break
    info.is_static = 0 if has_interp else 1


def inspect_fd(fd: int, max_hash_bytes: int = MAX_HASH_BYTES) -> FileInfo:
    st = os.fstat(fd)
    info = FileInfo(size=st.st_size)
    if not stat.S_ISREG(st.st_mode):
        info.notes["enrich_error"] = "not a regular file"
        return info
    info.sha256, problem = sha256_fd(fd, st.st_size, max_hash_bytes)
    if problem:
        info.notes["sha256_skipped"] = problem
    elif _key(os.fstat(fd)) != _key(st):
        info.sha256 = ""
        info.notes["sha256_skipped"] = "the file changed while it was hashed"
    head = os.pread(fd, 4, 0)
    if head == b"\x7fELF":
        info.file_type = "elf"
        try:
            elf_details(fd, st.st_size, info)
        except Exception as e:   # hostile input: any parse failure is a note, not a crash
            info.notes["elf_error"] = f"{type(e).__name__}: {e}"[:200]
    elif head[:2] == b"#!":
        info.file_type = "script"
        info.shebang = read_shebang(fd)
    return info


# ---------------------------------------------------------------- cache

def _key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Miss(Exception):
    """A file to be read off the decode path (for_exec(cached_only=True))."""


CHANGED = "the file changed after the exec, before it was read"


class Pending:
    """An exec whose file is not in the cache yet: its open fds (owned here
    until finish() or discard()), their identities when the exec was decoded,
    and what for_exec found so far."""

    def __init__(self, cache, fds: dict, problems: list):
        self.cache, self.fds, self.problems = cache, fds, problems
        self.keys = {name: _key(os.fstat(fd)) for name, fd in fds.items()}

    def finish(self) -> dict:
        """The record fields, read now; a file that changed since the exec was
        decoded is not vouched for (sha256_skipped)."""
        try:
            if any(_key(os.fstat(fd)) != self.keys[name] for name, fd in self.fds.items()):
                return {"extra": {"sha256_skipped": CHANGED}}
            return self.cache._choose(self.fds, self.problems)
        finally:
            self.discard()

    def discard(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)


class ElfInfoCache:
    """inspect_fd results by (dev, inode, size, mtime, ctime), LRU-bounded.
    Thread-safe: the decoder reads it, the Enricher's worker fills it."""

    def __init__(self, max_entries: int = 4096, max_hash_bytes: int = MAX_HASH_BYTES,
                 proc: str = "/proc"):
        self.max_entries = max_entries
        self.max_hash_bytes = max_hash_bytes
        self.proc = proc
        self._cache: OrderedDict = OrderedDict()
        self._mu = threading.Lock()
        self.hits = 0
        self.misses = 0

    def info_for_fd(self, fd: int, cached_only: bool = False) -> FileInfo:
        """cached_only: raise _Miss instead of reading a file that is not cached."""
        st = os.fstat(fd)
        key = _key(st)
        with self._mu:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            if cached_only:
                raise _Miss()
            self.misses += 1
        info = inspect_fd(fd, self.max_hash_bytes)
        if "changed while" in info.notes.get("sha256_skipped", ""):
            return info                 # not what the file is: not cached
        with self._mu:
            self._cache[key] = info
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return info

    def info_for_path(self, path: str | bytes) -> FileInfo:
        fd = os.open(path, _READ_FLAGS)
        try:
            return self.info_for_fd(fd)
        finally:
            os.close(fd)

    def for_exec(self, pid: int, path: bytes, fallback_pids=(), use_exe: bool = True,
                 cached_only: bool = False):
        """Record fields (sha256, build_id, interp, is_static, shebang) and an
        "extra" dict for an exec by `pid` of `path` (sandbox view).

        fallback_pids: other processes of the same sandbox (its init, recently
        seen ones ...) whose root is used when `pid` cannot open the path.
        use_exe=False when `pid` is not the process that exec'd (its
        /proc/<pid>/exe is another binary). cached_only: the files are opened
        but not read; when what is needed is not cached, a Pending (holding the
        fds) is returned, for Pending.finish() on another thread."""
        fds = {}
        problems = []
        try:
            try:
                fds["path" if use_exe else "root_pid"] = open_in_root(pid, path, self.proc)
            except OSError as e:
                problems.append(f"path: {e.strerror}")
                for other in fallback_pids:
                    if not other or other == pid:
                        continue
                    try:
                        fds["root_pid"] = open_in_root(other, path, self.proc)
                        break
                    except OSError as e2:
                        problems.append(f"root of {other}: {e2.strerror}")
            if use_exe:
                try:
                    fds["exe"] = open_exe(pid, self.proc)
                except OSError as e:
                    problems.append(f"exe: {e.strerror}")
            try:
                return self._choose(fds, problems, cached_only)
            except _Miss:
                pending, fds = Pending(self, fds, problems), {}     # the fds are the Pending's now
                return pending
        finally:
            for fd in fds.values():
                os.close(fd)

    def _choose(self, fds: dict, problems: list, cached_only: bool = False) -> dict:
        exe = fds.get("exe")
        named = fds.get("path", fds.get("root_pid"))
        named_src = "path" if "path" in fds else "other_root"
        extra = {}
        if named is not None and exe is not None and _key(os.fstat(named))[:2] == _key(os.fstat(exe))[:2]:
            info, extra["enrich_source"] = self.info_for_fd(exe, cached_only), "exe"
        elif named is not None:
            info, extra["enrich_source"] = self.info_for_fd(named, cached_only), named_src
            if info.file_type == "script" and exe is not None:
                interp_info = self.info_for_fd(exe, cached_only)
                extra["exe_sha256"] = interp_info.sha256
                if interp_info.build_id:
                    extra["exe_build_id"] = interp_info.build_id
        elif exe is not None:
            # the path is gone from view; the running image may be a later exec
            info, extra["enrich_source"] = self.info_for_fd(exe, cached_only), "exe_unverified"
        else:
            return {"extra": {"enrich_error": "; ".join(problems) or "nothing to open"}}
        extra["file_type"] = info.file_type
        extra.update(info.notes)
        out = info.record_fields()
        out["extra"] = extra
        return out


# ---------------------------------------------------------------- off the decode path

QUEUE_FULL = "enrichment queue full for this sandbox (it exec'd uncached files faster than they could be read)"
NODE_FULL = "enrichment queue full on this node"


class EnrichJob:
    """An exec record waiting for its file's details: the record, its extra
    dict (the record's `extra` JSON is rebuilt from it) and the Pending fds.
    `abandoned`: given up by Enricher.finish() while being read (the record went
    out marked sha256_skipped; the worker only closes the fds then)."""

    def __init__(self, rec: dict, extra: dict, pending: Pending, cgroup_id: int):
        self.rec, self.extra, self.pending, self.cgroup_id = rec, extra, pending, cgroup_id
        self.abandoned = False

    def apply(self, found: dict) -> None:
        found = dict(found)
        self.extra.update(found.pop("extra", {}))
        self.rec.update(found)
        self.rec["extra"] = json.dumps(self.extra, sort_keys=True)

    def read(self) -> dict:
        """The file's details (on the worker; closes the fds)."""
        try:
            return self.pending.finish()
        except Exception as e:  # noqa: BLE001 - enrichment is best effort; the record is not
            self.pending.discard()
            return {"extra": {"enrich_error": f"{type(e).__name__}: {e}"[:200]}}

    def skip(self, why: str) -> None:
        """Not read (closes the fds): the record says why."""
        self.pending.discard()
        self.apply({"extra": {"sha256_skipped": why}})


class Enricher:
    """One worker thread that reads exec'd files for the decoder: sandboxes
    served round-robin (a sandbox being removed first), at most `per_sandbox`
    files queued per sandbox and `max_jobs` in all (each holds up to two fds).
    Records come back through take_done(); decoding never waits for them.
    Every submitted job comes back exactly once (read, skipped or abandoned)."""

    def __init__(self, cache: ElfInfoCache, per_sandbox: int = 8, max_jobs: int = 256):
        self.cache, self.per_sandbox, self.max_jobs = cache, per_sandbox, max_jobs
        self._queues: OrderedDict = OrderedDict()      # cgroup id -> deque of jobs (round-robin order)
        self._busy: dict = {}                          # cgroup id -> jobs queued or running
        self._total = 0                                # sum of _busy
        self._urgent: set = set()                      # cgroup ids being removed: served first
        self._running: EnrichJob | None = None
        self._done: deque = deque()
        self._cond = threading.Condition()
        self._thread = None
        self._closed = False
        self.skipped = 0                               # jobs not read (queue full, removal, close)
        self.n_read = 0                                # jobs read

    def submit(self, job: EnrichJob) -> bool:
        """Queue `job`; False (nothing queued, job untouched) when its sandbox's
        queue or the node's is full or the Enricher is closed."""
        with self._cond:
            cg = job.cgroup_id
            if self._closed or self._busy.get(cg, 0) >= self.per_sandbox or self._total >= self.max_jobs:
                return False
            self._queues.setdefault(cg, deque()).append(job)
            self._busy[cg] = self._busy.get(cg, 0) + 1
            self._total += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dsec-enrich", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def full_reason(self, cgroup_id: int) -> str:
        with self._cond:
            if self._closed:
                return "the sensor was closing"
            return QUEUE_FULL if self._busy.get(cgroup_id, 0) >= self.per_sandbox else NODE_FULL

    def _next(self) -> EnrichJob:
        cg = next((c for c in self._urgent if c in self._queues), None)
        if cg is None:
            cg = next(iter(self._queues))
        q = self._queues.pop(cg)
        job = q.popleft()
        if q:
            self._queues[cg] = q                  # to the back: the next sandbox goes first
        return job

    def _release(self, cg: int) -> None:
        self._busy[cg] -= 1
        self._total -= 1
        if not self._busy[cg]:
            del self._busy[cg]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queues and not self._closed:
                    self._cond.wait()
                if not self._queues:
                    return
                job = self._running = self._next()
            found = job.read()
            with self._cond:
                self._running = None
                if not job.abandoned:
                    job.apply(found)
                    self._done.append(job)
                    self._release(job.cgroup_id)
                    self.n_read += 1
                self._cond.notify_all()

    def take_done(self) -> list:
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def outstanding(self, cgroup_id: int | None = None) -> int:
        with self._cond:
            return self._total if cgroup_id is None else self._busy.get(cgroup_id, 0)

    def wait_all(self, timeout: float) -> bool:
        """Wait up to `timeout` until nothing is queued or running; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._total and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(0.1, left))
            return not self._total

    def wait_for(self, cgroup_id: int, timeout: float) -> bool:
        """Wait up to `timeout` for the sandbox's jobs (served first meanwhile);
        True when none is left. Nothing is skipped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._urgent.add(cgroup_id)
            self._cond.notify_all()
            try:
                while self._busy.get(cgroup_id, 0) and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(min(0.1, left))
                return not self._busy.get(cgroup_id, 0)
            finally:
                self._urgent.discard(cgroup_id)

    def finish(self, cgroup_id: int, timeout: float, why: str) -> int:
        """The sandbox is being removed: its jobs go first; wait up to `timeout`
        for them, then skip (`why`) what is still queued and abandon the one
        being read. All of its jobs are in take_done() when this returns.
        Returns how many were skipped."""
        skipped = 0
        self.wait_for(cgroup_id, timeout)
        with self._cond:
            for job in self._queues.pop(cgroup_id, ()):
                job.skip(why)
                self._done.append(job)
                self._release(cgroup_id)
                skipped += 1
            job = self._running
            if job is not None and job.cgroup_id == cgroup_id and not job.abandoned:
                job.abandoned = True                      # the worker closes its fds
                job.apply({"extra": {"sha256_skipped": why + " (while its file was being read)"}})
                self._done.append(job)
                self._release(cgroup_id)
                skipped += 1
            self.skipped += skipped
            return skipped

    def close(self, timeout: float = 5.0) -> None:
        """Skip what is queued (their records come out of take_done()), let
        the file being read finish, stop the worker."""
        with self._cond:
            self._closed = True
            for cg in list(self._queues):
                for job in self._queues.pop(cg):
                    job.skip("the sensor was closing")
                    self._done.append(job)
                    self._release(cg)
                    self.skipped += 1
            self._cond.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout=timeout)
