"""Exec enrichment: what exactly ran.

For an exec'd file: sha256 (streamed), and for an ELF its build-id
(.note.gnu.build-id, read from the PT_NOTE segments so stripped binaries
work), PT_INTERP and static/dynamic (static = no PT_INTERP); for a script its
`#!` line. Read with pyelftools, cached by (device, inode, mtime, size).

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
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass, field

from audit_schema.events import from_bytes

SHEBANG_MAX = 256                 # the kernel's BINPRM_BUF_SIZE
MAX_HASH_BYTES = 1 << 30          # files larger than this are not hashed
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
        return "", f"not hashed: {size} bytes > limit {limit}"
    h = hashlib.sha256()
    off = 0
    while off <= limit:
        chunk = os.pread(fd, CHUNK, off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
    if off > limit:
        return "", f"not hashed: grew past limit {limit}"
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
        info.notes["hash_error"] = problem
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
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ElfInfoCache:
    """inspect_fd results by (dev, inode, mtime, size), LRU-bounded."""

    def __init__(self, max_entries: int = 4096, max_hash_bytes: int = MAX_HASH_BYTES,
                 proc: str = "/proc"):
        self.max_entries = max_entries
        self.max_hash_bytes = max_hash_bytes
        self.proc = proc
        self._cache: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def info_for_fd(self, fd: int) -> FileInfo:
        key = _key(os.fstat(fd))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        info = inspect_fd(fd, self.max_hash_bytes)
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

    def for_exec(self, pid: int, path: bytes, fallback_pids=(), use_exe: bool = True) -> dict:
        """Record fields (sha256, build_id, interp, is_static, shebang) and an
        "extra" dict for an exec by `pid` of `path` (sandbox view).

        fallback_pids: other processes of the same sandbox (its init, recently
        seen ones ...) whose root is used when `pid` cannot open the path.
        use_exe=False when `pid` is not the process that exec'd (its
        /proc/<pid>/exe is another binary)."""
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
            return self._choose(fds, problems)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _choose(self, fds: dict, problems: list) -> dict:
        exe = fds.get("exe")
        named = fds.get("path", fds.get("root_pid"))
        named_src = "path" if "path" in fds else "other_root"
        extra = {}
        if named is not None and exe is not None and _key(os.fstat(named))[:2] == _key(os.fstat(exe))[:2]:
            info, extra["enrich_source"] = self.info_for_fd(exe), "exe"
        elif named is not None:
            info, extra["enrich_source"] = self.info_for_fd(named), named_src
            if info.file_type == "script" and exe is not None:
                interp_info = self.info_for_fd(exe)
                extra["exe_sha256"] = interp_info.sha256
                if interp_info.build_id:
                    extra["exe_build_id"] = interp_info.build_id
        elif exe is not None:
            # the path is gone from view; the running image may be a later exec
            info, extra["enrich_source"] = self.info_for_fd(exe), "exe_unverified"
        else:
            return {"extra": {"enrich_error": "; ".join(problems) or "nothing to open"}}
        extra["file_type"] = info.file_type
        extra.update(info.notes)
        out = info.record_fields()
        out["extra"] = extra
        return out
