"""Exec enrichment: what exactly ran.

For an exec'd file: sha256 (streamed), and for an ELF its build-id
(.note.gnu.build-id, read from the PT_NOTE segments so stripped binaries
work), PT_INTERP and static/dynamic (static = no PT_INTERP); for a script its
`#!` line. Read with pyelftools, cached by (device, inode, size, mtime,
ctime): a `touch` or a write changes the key, a rename or a hard link does not.

Off the decode path (agent/sensors/decoder.py, agent/sensors/enrich.py Enricher): the decoder
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

One entry for every sandbox (LowerFiles below). A sandbox sees its system
files through an overlay mount of its own, whose st_dev differs per mount: keyed
by it, every sandbox re-read /bin/true. An overlay file that is a lower-layer
file is keyed by that real lower file instead: its overlay file handle
(name_to_handle_at AT_HANDLE_FID, the same in every sandbox) is decoded on the
lower filesystem (open_by_handle_at) and used only if the real file's size,
mtime and ctime are the overlay file's: the key is then the real file's own
(device, inode, size, mtime, ctime), as if the host file had been read. A file
of the upper layer never shares it: a new one's handle is marked upper, and a
copied-up one (whose handle is still its origin's) carries the upper inode's
ctime, set by the kernel at copy-up, never the lower file's. The file is read
through the sandbox's fd either way, and the rule above holds: a file whose
identity changed between the exec and the read is not vouched for.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import itertools
import os
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from agent.sensors.procs import open_root
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
    root = open_root(pid, proc)
    try:
        return open_under(root, path)
    finally:
        os.close(root)


def open_under(root: int, path: bytes) -> int:
    """Open absolute `path` under the root descriptor `root`, symlinks resolved within it."""
    if not path.startswith(b"/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    rel = path.lstrip(b"/") or b"."
    return openat2(root, rel, _READ_FLAGS, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)


def open_exe(pid: int, proc: str = "/proc") -> int:
    pinned = getattr(pid, "dir", None)           # procs.PinnedPid: that process, not a reuse of its number
    if pinned is not None:
        return os.open("exe", _READ_FLAGS, dir_fd=pinned.fd)
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


OVERLAYFS_SUPER_MAGIC = 0x794C7630
AT_EMPTY_PATH = 0x1000
AT_HANDLE_FID = 0x200
MAX_HANDLE_SZ = 128
OVL_FH_MAGIC = 0xFB
OVL_FH_FLAG_PATH_UPPER = 1 << 2
LOWER_FS_MAX = 64                 # lower filesystems LowerFiles keeps a descriptor of
MOUNTS_SEEN_MAX = 4096
KNOWN_MAX = 4096                  # overlay files whose lower key LowerFiles remembers


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]


_libc.name_to_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_int), ctypes.c_int]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def fs_type(fd: int) -> int:
    """statfs f_type of the file's filesystem (0 when fstatfs fails)."""
    buf = ctypes.create_string_buffer(128)           # struct statfs is 120 bytes; f_type first
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def overlay_origin(fd: int):
    """(mount id, lower handle type, lower handle bytes) of an overlay file
    that is not an upper-layer-only file, or None. The overlay's handle is
    struct ovl_fh: 3 pad bytes, version, magic, len, flags, type, uuid[16],
    then the real filesystem's handle."""
    fh = _FileHandle(MAX_HANDLE_SZ, 0)
    mnt = ctypes.c_int(0)
    if _libc.name_to_handle_at(fd, b"", ctypes.byref(fh), ctypes.byref(mnt),
                               AT_EMPTY_PATH | AT_HANDLE_FID) != 0:
        return None
    raw = bytes(fh.f_handle[: fh.handle_bytes])
    if len(raw) < 25 or raw[3] != 0 or raw[4] != OVL_FH_MAGIC:
        return None
    flen, flags, ftype = raw[5], raw[6], raw[7]
    if flags & OVL_FH_FLAG_PATH_UPPER or flen <= 21 or 3 + flen > len(raw):
        return None                                  # an upper-layer file, or not a format known here
    return mnt.value, ftype, raw[24: 3 + flen]


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def overlay_lowerdirs(mount_id: int, pids=()) -> list[str]:
    """The lower directories of overlay mount `mount_id`, from the mountinfo
    of the first of `pids` ("self" when none) that can be read."""
    for pid in list(pids) or ["self"]:
        try:
            with open(f"/proc/{pid}/mountinfo", "rb") as f:
                lines = f.read().decode("utf-8", "surrogateescape").splitlines()
        except OSError:
            continue
        for line in lines:
            if not line.startswith(f"{mount_id} "):
                continue
            parts = line.split(" - ", 1)
            if len(parts) != 2:
                return []
            fields = parts[1].split(" ")
            if len(fields) < 3 or fields[0] != "overlay":
                return []
            dirs = []
            for opt in fields[2].split(","):
                name, _, value = opt.partition("=")
                if name == "lowerdir":
                    dirs += [_unescape(d).replace("\\:", ":")
                             for d in re.split(r"(?<!\\):+", value) if d]
                elif name in ("lowerdir+", "datadir+"):
                    dirs.append(_unescape(value))
            return dirs
        return []
    return []


class LowerFiles:
    """Keys overlay files that are lower-layer files by the real lower file
    (see the module's opening comment). Holds a read-only descriptor of a
    directory on each lower filesystem met (at most LOWER_FS_MAX): the handle
    is decoded on each in turn. Which filesystems those are comes from an
    overlay mount's lowerdir option, read once per mount in the mountinfo of
    one of the sandbox's processes (never on the decode path: cached_only
    lookups only try the filesystems already known)."""

    UNKNOWN = object()             # might be a lower file of a filesystem not known yet

    def __init__(self):
        self._mu = threading.Lock()
        self._fs: OrderedDict = OrderedDict()       # st_dev -> O_PATH fd on that filesystem
        self._mounts_seen: OrderedDict = OrderedDict()   # (mount id, overlay st_dev): lowerdirs read
        self._known: OrderedDict = OrderedDict()    # an overlay file's own key -> what key() found
        self.decoded = 0                            # overlay files keyed by their lower file

    def key(self, fd: int, st: os.stat_result, pids=(), discover: bool = True):
        """The real lower file's key, None (key the overlay file itself), or
        UNKNOWN (discover=False and no known filesystem has it). An answer is kept
        by the overlay file's own identity (device, inode, size, mtime, ctime: a
        write, a copy-up or a replaced lower file changes it), so a binary exec'd
        again in the same sandbox costs no file-handle syscalls."""
        if not stat.S_ISREG(st.st_mode):
            return None
        own = _key(st)
        with self._mu:
            if own in self._known:
                self._known.move_to_end(own)
                return self._known[own]
        found = self._key(fd, st, pids, discover)
        if found is not self.UNKNOWN:
            with self._mu:
                self._known[own] = found
                if len(self._known) > KNOWN_MAX:
                    self._known.popitem(last=False)
        return found

    def _key(self, fd: int, st: os.stat_result, pids, discover: bool):
        if fs_type(fd) != OVERLAYFS_SUPER_MAGIC:
            return None
        origin = overlay_origin(fd)
        if origin is None:
            return None
        mount_id, ftype, fid = origin
        found = self._decode(ftype, fid, st)
        if found is not None:
            return found
        seen = (mount_id, st.st_dev)
        with self._mu:
            if seen in self._mounts_seen:
                return None                          # its lower filesystems are known: upper or changed
        if not discover:
            return self.UNKNOWN
        for d in overlay_lowerdirs(mount_id, pids):
            self._add_fs(d)
        with self._mu:
            self._mounts_seen[seen] = True
            if len(self._mounts_seen) > MOUNTS_SEEN_MAX:
                self._mounts_seen.popitem(last=False)
        found = self._decode(ftype, fid, st)
        return found

    def _add_fs(self, path: str) -> None:
        try:
            dev = os.stat(path).st_dev
        except OSError:
            return
        with self._mu:
            if dev in self._fs:
                return
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # not O_PATH: refused as a mount fd
        except OSError:
            return
        with self._mu:
            if dev in self._fs or os.fstat(dfd).st_dev != dev:
                os.close(dfd)
                return
            self._fs[dev] = dfd
            if len(self._fs) > LOWER_FS_MAX:
                os.close(self._fs.popitem(last=False)[1])

    def _decode(self, ftype: int, fid: bytes, st: os.stat_result):
        fh = _FileHandle(len(fid), ftype)
        ctypes.memmove(fh.f_handle, fid, len(fid))
        with self._mu:
            for dev, mfd in reversed(self._fs.items()):
                real = _libc.open_by_handle_at(mfd, ctypes.byref(fh), os.O_PATH | os.O_CLOEXEC)
                if real < 0:
                    continue
                try:
                    rst = os.fstat(real)
                finally:
                    os.close(real)
                if (stat.S_ISREG(rst.st_mode) and rst.st_size == st.st_size
                        and rst.st_mtime_ns == st.st_mtime_ns and rst.st_ctime_ns == st.st_ctime_ns):
                    self._fs.move_to_end(dev)
                    self.decoded += 1
                    return _key(rst)
        return None

    def close(self) -> None:
        with self._mu:
            for dfd in self._fs.values():
                os.close(dfd)
            self._fs.clear()


class _Pids:
    """`first`, then `rest` (an iterable that may do work when iterated: decoder.LivePids)
    without zeros or `first`: iterated only where a pid is needed (the mountinfo of an
    overlay not known yet), not per exec."""

    def __init__(self, first: int, rest=()):
        self.first, self.rest = first, rest

    def __iter__(self):
        yield self.first
        for p in self.rest:
            if p and p != self.first:
                yield p


class _Miss(Exception):
    """A file to be read off the decode path (for_exec(cached_only=True))."""


CHANGED = "the file changed after the exec, before it was read"


class Pending:
    """An exec whose file is not in the cache yet: its open fds (owned here
    until finish() or discard()), their identities when the exec was decoded,
    and what for_exec found so far."""

    def __init__(self, cache, fds: dict, problems: list, pids=()):
        self.cache, self.fds, self.problems, self.pids = cache, fds, problems, pids
        self.keys = {name: _key(os.fstat(fd)) for name, fd in fds.items()}

    def finish(self) -> dict:
        """The record fields, read now; a file that changed since the exec was
        decoded is not vouched for (sha256_skipped)."""
        try:
            if any(_key(os.fstat(fd)) != self.keys[name] for name, fd in self.fds.items()):
                return {"extra": {"sha256_skipped": CHANGED}}
            return self.cache._choose(self.fds, self.problems, pids=self.pids)
        finally:
            self.discard()

    def discard(self) -> None:
        fds, self.fds = self.fds, {}
        self.pids = ()                  # a pinned init's /proc descriptor goes with its last holder
        for fd in fds.values():
            os.close(fd)

    def identity(self) -> tuple:
        """What finish() reads and says depends on: which files were opened,
        their identities (device, inode, size, mtime, ctime) and the problems
        met. Two Pendings with the same identity give the same answer."""
        return tuple(sorted(self.keys.items())), tuple(self.problems)


class ElfInfoCache:
    """inspect_fd results by (dev, inode, size, mtime, ctime), LRU-bounded; an
    overlay's lower-layer file by the real lower file's (LowerFiles).
    Thread-safe: the decoder reads it, the Enricher's worker fills it.
    `reads`: files read (hashed and parsed)."""

    def __init__(self, max_entries: int = 4096, max_hash_bytes: int = MAX_HASH_BYTES,
                 proc: str = "/proc"):
        self.max_entries = max_entries
        self.max_hash_bytes = max_hash_bytes
        self.proc = proc
        self._cache: OrderedDict = OrderedDict()
        self._mu = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.reads = 0
        self.lower = LowerFiles()

    def info_for_fd(self, fd: int, cached_only: bool = False, pids=()) -> FileInfo:
        """cached_only: raise _Miss instead of reading a file that is not cached
        (or whose lower filesystem is not known yet). pids: processes in whose
        mount namespace the file was opened (for an overlay's lowerdir)."""
        st = os.fstat(fd)
        key = self.lower.key(fd, st, pids, discover=not cached_only)
        if key is LowerFiles.UNKNOWN:
            raise _Miss()
        if key is None:
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
            self.reads += 1
        info = inspect_fd(fd, self.max_hash_bytes)
        if "changed while" in info.notes.get("sha256_skipped", ""):
            return info                 # not what the file is: not cached
        if _key(os.fstat(fd)) != _key(st):
            return info                 # changed after the key was taken (e.g. copied up): not cached
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
                 cached_only: bool = False, root: int = -1):
        """Record fields (sha256, build_id, interp, is_static, shebang) and an
        "extra" dict for an exec by `pid` of `path` (sandbox view).

        fallback_pids: other processes of the same sandbox (its init, recently
        seen ones ...) whose root is used when `pid` cannot open the path.
        use_exe=False when `pid` is not the process that exec'd (its
        /proc/<pid>/exe is another binary). cached_only: the files are opened
        but not read; when what is needed is not cached, a Pending (holding the
        fds) is returned, for Pending.finish() on another thread. root: `pid`'s
        root already open (O_PATH; the caller's, still open when this returns)."""
        fds = {}
        problems = []
        try:
            try:
                fds["path" if use_exe else "root_pid"] = open_in_root(pid, path, self.proc) if root < 0 \
                    else open_under(root, path)
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
            pids = _Pids(pid, fallback_pids)
            try:
                return self._choose(fds, problems, cached_only, pids)
            except _Miss:
                pending, fds = Pending(self, fds, problems, pids), {}     # the fds are the Pending's now
                return pending
        finally:
            for fd in fds.values():
                os.close(fd)

    def _choose(self, fds: dict, problems: list, cached_only: bool = False, pids=()) -> dict:
        exe = fds.get("exe")
        named = fds.get("path", fds.get("root_pid"))
        named_src = "path" if "path" in fds else "other_root"
        extra = {}
        if named is not None and exe is not None and _key(os.fstat(named))[:2] == _key(os.fstat(exe))[:2]:
            info, extra["enrich_source"] = self.info_for_fd(exe, cached_only, pids), "exe"
        elif named is not None:
            info, extra["enrich_source"] = self.info_for_fd(named, cached_only, pids), named_src
            if info.file_type == "script" and exe is not None:
                interp_info = self.info_for_fd(exe, cached_only, pids)
                extra["exe_sha256"] = interp_info.sha256
                if interp_info.build_id:
                    extra["exe_build_id"] = interp_info.build_id
        elif exe is not None:
            # the path is gone from view; the running image may be a later exec
            info, extra["enrich_source"] = self.info_for_fd(exe, cached_only, pids), "exe_unverified"
        else:
            return {"extra": {"enrich_error": "; ".join(problems) or "nothing to open"}}
        extra["file_type"] = info.file_type
        extra.update(info.notes)
        out = info.record_fields()
        out["extra"] = extra
        return out
