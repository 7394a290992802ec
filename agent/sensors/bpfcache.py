"""Compiled eBPF programs cached per kernel, BCC and source text.

BCC compiles a sensor's C text on every load: clang over BCC's helpers, then
LLVM at -O3 over every program (audit 3.8 s, enforcement 1.9 s on a 2-core
machine: most of an agent's start), and it cannot load pre-built bytecode: its
bytecode carries the fds of the maps it created while compiling (iovisor/bcc#534).
So this cache keeps what one compile produced and rebuilds the BPF object from
it on the next load of the same text:

- stored: each program's instructions with every map fd (ld_imm64,
  BPF_PSEUDO_MAP_FD) turned back into the map's index, each map's shape (type,
  key and value sizes, entries, flags) and its key/value type descriptions, the
  module's licence and kernel version;
- loaded: BCC compiles a generated text of the map declarations alone (the
  cost of an empty BCC program, ~0.45 s here) and creates the maps; each map's
  shape is checked against the entry, the instructions get the new maps' fds,
  and each program is loaded through BCC's own bcc_func_load when its sensor
  asks for it (the kernel's verifier checks every one as before). Everything
  else (tables, ring buffers, attach, cleanup) is BCC's own code.

The key is a SHA-256 of everything that goes into a compile: this module's
format, the source text and cflags, every file under bpf/ (the text #includes
them), the kernel (release and /proc/version: tracepoint layouts come from the
running kernel) and BCC (version and its library file). An entry is written to
a temporary file and renamed into place, and carries the SHA-256 of its body:
a torn or altered entry is a miss (logged), never a load. Programs whose
instructions carry anything but map fds to relocate (global data, kfuncs, BTF
ids), map kinds the declarations cannot reproduce, or a compile with BTF
(DSEC_BPF_DEBUG=1) are not cached: they compile every time.

Where: $DSEC_BPF_CACHE, default /var/cache/dsec/bpf (root's, mode 0700: an
entry is loaded into the kernel, so it has the trust of the program files);
DSEC_BPF_CACHE=off compiles every time. At most KEEP entries are kept (the
least recently used go). docs/audit.md "Compiled programs" says the same.
"""
from __future__ import annotations

import base64
import ctypes as ct
import functools
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator

log = logging.getLogger("dsec.bpfcache")

FORMAT = 1
DEFAULT_DIR = "/var/cache/dsec/bpf"
KEEP = 64
MAGIC = b"dsec-bpf-cache"

# map types the generated declarations reproduce (BPF_F_TABLE's type names; two have their own macro)
TABLE_KINDS = {1: "hash", 2: "array", 5: "percpu_hash", 6: "percpu_array", 9: "lru_hash",
               10: "lru_percpu_hash", 11: "lpm_trie"}
PERF_EVENT_ARRAY, RINGBUF = 4, 27
SHAPE = ("type", "key_size", "leaf_size", "max_entries", "flags")     # what a declared map must match
# programs BPF._trace_autoload attaches by name that CachedBPF does not replay (it does tracepoint__, raw_tracepoint__)
NOT_AUTOLOADED = (b"kprobe__", b"kretprobe__", b"kfunc__", b"kretfunc__", b"lsm__")

LD_IMM64, PSEUDO_MAP_FD, CALL, PSEUDO_KFUNC_CALL = 0x18, 1, 0x85, 2


class NotCacheable(Exception):
    """A compile whose result this cache cannot reproduce (it compiles every time)."""


def cache_dir() -> str | None:
    d = os.environ.get("DSEC_BPF_CACHE", "") or DEFAULT_DIR
    return None if d == "off" else d


def unsafe(directory: str) -> str | None:
    """Why the cache directory must not be used (None: it may): its entries are
    loaded into the kernel, so it must be the loader's own and writable by no one
    else; a missing one is made so."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except OSError as e:
        return f"{directory}: {e.strerror}"
    if not os.path.isdir(directory) or os.path.islink(directory):
        return f"{directory} is not a directory"
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return f"{directory} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o} (must be uid " \
               f"{os.geteuid()}'s and writable by no one else)"
    return None


def _lib():
    from bcc import lib                       # noqa: WPS433 (bcc only in the sensors)
    if not getattr(lib, "_dsec_cache_types", False):
        for name, res, args in (("bpf_num_tables", ct.c_ulonglong, [ct.c_void_p]),
                                ("bpf_table_name", ct.c_char_p, [ct.c_void_p, ct.c_ulonglong]),
                                ("bpf_table_key_size_id", ct.c_size_t, [ct.c_void_p, ct.c_ulonglong]),
                                ("bpf_table_leaf_size_id", ct.c_size_t, [ct.c_void_p, ct.c_ulonglong]),
                                ("bpf_table_fd_id", ct.c_int, [ct.c_void_p, ct.c_ulonglong])):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        lib._dsec_cache_types = True
    return lib


# ---------------------------------------------------------------- the key

def _bcc_identity() -> str:
    """BCC's version and the library file this process loaded (from /proc/self/maps)."""
    import bcc                                 # noqa: WPS433
    _lib()
    where = "libbcc.so.0"
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "/libbcc.so" in ln}
        for real in sorted(paths):
            st = os.stat(real)
            where = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        pass
    return f"{getattr(bcc, '__version__', '?')}|{where}"


def key(text: str, cflags: list[str], bpf_dir: str) -> str:
    h = hashlib.sha256()

    def put(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    put("format", str(FORMAT).encode())
    put("text", text.encode())
    put("cflags", "\0".join(cflags).encode())
    for name in sorted(os.listdir(bpf_dir)):
        p = os.path.join(bpf_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                put("file:" + name, f.read())
    u = os.uname()
    put("kernel", f"{u.release}|{u.version}|{u.machine}".encode())
    try:
        with open("/proc/version", "rb") as f:
            put("procversion", f.read())
    except OSError:
        pass
    put("bcc", _bcc_identity().encode())
    return h.hexdigest()


# ---------------------------------------------------------------- store

def _maps_of(module) -> list[dict]:
    lib = _lib()
    maps = []
    for i in range(lib.bpf_num_tables(module)):
        name = lib.bpf_table_name(module, i)
        m = {"name": name.decode(), "type": lib.bpf_table_type_id(module, i),
             "key_size": int(lib.bpf_table_key_size_id(module, i)),
             "leaf_size": int(lib.bpf_table_leaf_size_id(module, i)),
             "max_entries": int(lib.bpf_table_max_entries_id(module, i)),
             "flags": lib.bpf_table_flags_id(module, i),
             "key_desc": (lib.bpf_table_key_desc(module, name) or b"").decode(),
             "leaf_desc": (lib.bpf_table_leaf_desc(module, name) or b"").decode(),
             "fd": lib.bpf_table_fd_id(module, i)}
        if m["type"] not in TABLE_KINDS and m["type"] not in (PERF_EVENT_ARRAY, RINGBUF):
            raise NotCacheable(f"map {m['name']} of type {m['type']}")
        maps.append(m)
    return maps


def _insns(insns) -> Iterator[tuple[int, int, int, int]]:
    """(offset, opcode, source register, imm) of each instruction (an ld_imm64 is two slots)."""
    i = 0
    while i < len(insns):
        op, regs, _off, imm = struct.unpack_from("<BBhi", insns, i)
        yield i, op, regs >> 4, imm
        i += 16 if op == LD_IMM64 else 8


def _unrelocate(insns: bytes, index_of_fd: dict[int, int], what: str) -> bytes:
    """The instructions with each map fd replaced by the map's index."""
    out = bytearray(insns)
    for i, op, src, imm in _insns(insns):
        if op == LD_IMM64 and src == PSEUDO_MAP_FD:
            if imm not in index_of_fd:
                raise NotCacheable(f"{what}: a map fd {imm} that is no table's")
            struct.pack_into("<i", out, i + 4, index_of_fd[imm])
        elif op == LD_IMM64 and src != 0:
            raise NotCacheable(f"{what}: ld_imm64 with relocation kind {src}")
        elif op == CALL and src == PSEUDO_KFUNC_CALL:
            raise NotCacheable(f"{what}: kfunc call")
    return bytes(out)


def key_cflags(cflags: list[str], pins: dict[str, str] | None) -> list[str]:
    """The cflags as the key sees them: a pinned map's path (another per agent:
    the enforcement sensor pins its cwd maps under its own directory) is the
    map's name, the path being given again at each load (declarations())."""
    out = []
    longest_first = sorted((pins or {}).items(), key=lambda kv: -len(kv[1]))
    for f in cflags:
        for name, path in longest_first:
            f = f.replace(path, "@pinned:" + name)
        out.append(f)
    return out


def entry_of(module, pinned=()) -> dict:
    """What a compiled module's cache entry holds (NotCacheable if it cannot);
    pinned: the names of the maps the text opens at a pinned path."""
    lib = _lib()
    maps = _maps_of(module)
    for m in maps:
        m["pinned"] = m["name"] in pinned
    missing = set(pinned) - {m["name"] for m in maps}
    if missing:
        raise NotCacheable(f"pinned maps {sorted(missing)} not in the module")
    index_of_fd = {m["fd"]: i for i, m in enumerate(maps)}
    funcs = []
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        if name.startswith(NOT_AUTOLOADED):
            raise NotCacheable(f"program {name.decode()}: attached by a kind this cache does not replay")
        size = lib.bpf_function_size(module, name)
        insns = ct.string_at(lib.bpf_function_start(module, name), size)
        funcs.append({"name": name.decode(),
                      "insns": base64.b64encode(_unrelocate(insns, index_of_fd, name.decode())).decode()})
    for m in maps:
        del m["fd"]
    return {"license": lib.bpf_module_license(module).decode(),
            "kern_version": int(lib.bpf_module_kern_version(module)),
            "maps": maps, "funcs": funcs}


def store(directory: str, k: str, entry: dict) -> None:
    """Write an entry atomically (never half-written), then keep the newest KEEP."""
    body = json.dumps(entry, separators=(",", ":")).encode()
    head = MAGIC + b" %d %s\n" % (FORMAT, hashlib.sha256(body).hexdigest().encode())
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head + body)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(directory, k))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _trim(directory)


def _trim(directory: str) -> None:
    try:
        names = [n for n in os.listdir(directory) if not n.startswith(".")]
        if len(names) <= KEEP:
            return
        by_age = sorted(names, key=lambda n: os.stat(os.path.join(directory, n)).st_mtime_ns)
        for n in by_age[:len(names) - KEEP]:
            os.unlink(os.path.join(directory, n))
    except OSError:
        pass


def read(directory: str, k: str) -> dict | None:
    """The entry for key k, or None (absent; a torn or altered one is logged and removed)."""
    path = os.path.join(directory, k)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            log.warning("eBPF program cache: entry %s is not uid %d's alone; ignored", path, os.geteuid())
            return None
        data = f.read()
    head, _, body = data.partition(b"\n")
    parts = head.split(b" ")
    ok = (len(parts) == 3 and parts[0] == MAGIC and parts[1] == str(FORMAT).encode()
          and hashlib.sha256(body).hexdigest().encode() == parts[2])
    if ok:
        try:
            entry = json.loads(body)
        except ValueError:
            ok = False
    if not ok:
        log.warning("eBPF program cache: entry %s is torn or altered; compiling instead", path)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    try:
        os.utime(path)                         # least recently used go first
    except OSError:
        pass
    return entry


# ---------------------------------------------------------------- load

def declarations(entry: dict, pins: dict[str, str] | None = None) -> str:
    """A BCC text declaring the entry's maps alone, with their shapes; a pinned
    one opened at its path in pins."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = []
    for i, m in enumerate(entry["maps"]):
        name, t = m["name"], m["type"]
        if t == RINGBUF and not m.get("pinned"):
            out.append(f"BPF_RINGBUF_OUTPUT({name}, {m['max_entries'] // page});")
            continue
        if t == PERF_EVENT_ARRAY and not m.get("pinned"):
            out.append(f"BPF_PERF_OUTPUT({name});")
            continue
        types = (f"struct dsec_k{i} {{ unsigned char b[{m['key_size']}]; }};\n"
                 f"struct dsec_v{i} {{ unsigned char b[{m['leaf_size']}]; }};\n")
        shape = f'"{TABLE_KINDS.get(t)}", struct dsec_k{i}, struct dsec_v{i}, {name}, {m["max_entries"]}'
        if not m.get("pinned"):
            out.append(f"{types}BPF_F_TABLE({shape}, {m['flags']});")
            continue
        path = (pins or {}).get(name)
        if path is None or '"' in path or "\\" in path or t not in TABLE_KINDS:
            raise NotCacheable(f"map {name}: pinned, and no plain path given for it")
        out.append(f'{types}BPF_TABLE_PINNED7({shape}, "{path}", {m["flags"]});')
    return "\n".join(out) + "\n"


@functools.lru_cache(maxsize=None)
def _bpf_class():
    from bcc import BPF                        # noqa: WPS433

    class CachedBPF(BPF):
        """A BPF object whose maps come from the entry's declarations and whose
        programs come from the entry's instructions; otherwise BCC's BPF."""

        def __init__(self, entry: dict, cflags: list[str], pins: dict[str, str] | None, attach: bool = True):
            self._entry = entry
            self._insns = {}
            self._attach = attach
            text = declarations(entry, pins).encode()
            try:
                super().__init__(text=text, cflags=cflags)
            except BaseException:
                self.cleanup()
                raise

        def _trace_autoload(self):             # BPF.__init__ calls it once the maps exist
            declared = {m["name"]: m for m in _maps_of(self.module)}
            fds = []
            for m in self._entry["maps"]:
                d = declared[m["name"]]
                if any(d[f] != m[f] for f in SHAPE):
                    raise NotCacheable(f"map {m['name']} declared as {[d[f] for f in SHAPE]}, "
                                       f"the entry says {[m[f] for f in SHAPE]}")
                fds.append(d["fd"])
            for f in self._entry["funcs"]:
                raw = base64.b64decode(f["insns"])
                insns = bytearray(raw)
                for i, op, src, idx in _insns(raw):
                    if op == LD_IMM64 and src == PSEUDO_MAP_FD:
                        struct.pack_into("<i", insns, i + 4, fds[idx])
                self._insns[f["name"].encode()] = bytes(insns)
            autoload(self, list(self._insns), self._attach)

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            func_name = func_name if isinstance(func_name, bytes) else func_name.encode()
            if func_name in self.funcs:
                return self.funcs[func_name]
            insns = self._insns.get(func_name)
            if insns is None:
                raise Exception("Unknown program %s" % func_name)
            lib = _lib()
            buf = ct.create_string_buffer(insns, len(insns))
            fd = lib.bcc_func_load(self.module, prog_type, func_name, buf, len(insns),
                                   self._entry["license"].encode(), self._entry["kern_version"],
                                   0, None, 0, device, attach_type)
            if fd < 0:
                raise Exception("Failed to load BPF program %s: %s" % (func_name, os.strerror(ct.get_errno())))
            fn = BPF.Function(self, func_name, fd)
            self.funcs[func_name] = fn
            return fn

        def dump_func(self, func_name):
            return self._insns[func_name if isinstance(func_name, bytes) else func_name.encode()]

        def get_table(self, name, keytype=None, leaftype=None, reducer=None):
            name = name if isinstance(name, bytes) else name.encode()
            for m in self._entry["maps"]:
                if m["name"].encode() == name:
                    if keytype is None and m["key_desc"]:
                        keytype = BPF._decode_table_type(json.loads(m["key_desc"]))
                    if leaftype is None and m["leaf_desc"]:
                        leaftype = BPF._decode_table_type(json.loads(m["leaf_desc"]))
                    break
            return super().get_table(name, keytype, leaftype, reducer)

    return CachedBPF


def from_entry(entry: dict, cflags: list[str], pins: dict[str, str] | None = None, attach: bool = True):
    return _bpf_class()(entry, cflags, pins, attach)


def autoload(bpf, names: list[bytes], attach: bool) -> None:
    """What BPF._trace_autoload does for our programs: each tracepoint and raw
    tracepoint program loaded, and attached by its name unless attach is False
    (a sensor that attaches them itself, through links or on demand: a detach
    costs the kernel's tracepoint grace periods, ~70 ms each)."""
    from bcc import BPF                        # noqa: WPS433
    for name in names:
        if name.startswith(b"tracepoint__"):
            fn = bpf.load_func(name, BPF.TRACEPOINT)
            if attach:
                bpf.attach_tracepoint(tp=name[len(b"tracepoint__"):].replace(b"__", b":"), fn_name=fn.name)
        elif name.startswith(b"raw_tracepoint__"):
            fn = bpf.load_func(name, BPF.RAW_TRACEPOINT)
            if attach:
                bpf.attach_raw_tracepoint(tp=name[len(b"raw_tracepoint__"):], fn_name=fn.name)
        elif name.startswith(NOT_AUTOLOADED):
            raise NotCacheable(f"program {name.decode()}: attached by a kind this loader does not replay")


@functools.lru_cache(maxsize=None)
def unattached_class():
    """BCC's BPF, its programs loaded at compile but none attached (autoload(attach=False))."""
    from bcc import BPF, lib                   # noqa: WPS433

    class UnattachedBPF(BPF):
        def _trace_autoload(self):
            autoload(self, [lib.bpf_function_name(self.module, i) for i in range(lib.bpf_num_functions(self.module))],
                         False)

    return UnattachedBPF
