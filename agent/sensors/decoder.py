"""Ring-buffer records -> audit records (dicts of audit_schema.events.FIELDS).

The C structs are declared once, in bpf/events.h. The ctypes types come from
BCC (the value type of the `exec_scratch` map is `struct dsec_event`); the
numeric constants (kinds, syscalls, status bits, loss reasons) are read from
the #defines of events.h. Nothing here mirrors the C layout by hand.

What the decoder adds to the kernel's facts:
  event_id   16 hex chars of blake2b(node, boot id, sensor instance) then the
             sequence number as 16 hex chars (32 in all): assigned once here,
             so a spool that retries re-sends the same id; one hash per sensor,
             not per event, and ids of one sensor sort (and compress) by time;
  ts_ns      wall clock: the kernel's CLOCK_MONOTONIC stamp plus an offset
             measured here (and re-measured periodically, see sync_clock);
  node, sandbox_id, policy labels (from add_sandbox), step (from the kernel,
             stamped when the syscall was admitted);
  ppid       the kernel's fork tracking, else the decoder's, else /proc;
  path       relative paths resolved against /proc/<pid>/cwd or
             /proc/<pid>/fd/<dirfd>, expressed in the sandbox's view (the
             prefix /proc/<pid>/root is stripped); path_raw keeps the bytes
             as given and dirfd what they were relative to ("AT_FDCWD" or the
             number). path_resolution says how far `path` is fact: "exact"
             (the name was absolute), "best_effort" (joined at decode time with
             what /proc shows then: the cwd may have changed, the dirfd been
             closed and its number reused), "verified" (a relative exec joined
             to the cwd the agent verified at the process's chdir, carried in the
             kernel's record: what the exec check matches; extra.cwd), "unresolved"
             (nothing to join with: `path` is the name as given). A rename's path2 has the same in
             extra (dirfd2, path2_raw, path2_resolution).
Byte strings are decoded with surrogateescape (audit_schema.events.from_bytes).
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import hashlib
import logging
import ipaddress
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field

from audit_schema.events import FIELDS, KINDS, default, from_bytes, normalize
from policies.compile import resolve_exec

log = logging.getLogger("dsec.audit")

AT_FDCWD = -100
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
PROTOCOLS = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmpv6", 136: "udplite", 132: "sctp"}
SOCK_TYPES = {1: "stream", 2: "dgram", 3: "raw", 5: "seqpacket"}
_TEMPLATE = {f.name: default(f) for f in FIELDS}
_NFIELDS = len(_TEMPLATE)


def complete(rec: dict) -> dict:
    """A record made from _TEMPLATE (every field, in FIELDS order), as normalize would give
    it: a record of as many fields holds no other, so only a None (enrichment may set one)
    needs normalize's default; a field not in the schema raises there."""
    return normalize(rec) if len(rec) != _NFIELDS or None in rec.values() else rec


EVENTS_H = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf", "events.h")


# ---------------------------------------------------------------- constants

@dataclass(frozen=True)
class Constants:
    """#define groups of bpf/events.h, by prefix."""
    kinds: dict          # number -> kind name ("exec", ...)
    syscalls: dict       # number -> syscall name
    status: dict         # bit -> name ("argv_trunc", ...)
    lost: dict           # reason index -> name ("ringbuf_full", ...)
    exit_how: dict       # number -> name
    over: dict           # name -> number ("summarise": 0, "stop": 1)
    values: dict         # every numeric #define, by full name

    hooks: dict = field(default_factory=dict)   # number -> cgroup hook name ("connect4", ...)
    modes: dict = field(default_factory=dict)   # name -> number ("off", "learn", "audit", "enforce")

    @property
    def kind_numbers(self) -> dict:
        return {name: num for num, name in self.kinds.items()}


_DEFINE = re.compile(r"^#define\s+(DSEC_[A-Z0-9_]+)\s+\(?(0x[0-9a-fA-F]+|\d+)\)?\s*(?:/\*.*)?$")


def load_constants(path: str = EVENTS_H) -> Constants:
    values = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = _DEFINE.match(line.strip())
            if m:
                values[m.group(1)] = int(m.group(2), 0)

    def group(prefix, skip=()):
        return {v: k[len(prefix):].lower() for k, v in values.items()
                if k.startswith(prefix) and k not in skip}

    kinds = group("DSEC_KIND_")
    unknown = set(kinds.values()) - set(KINDS)
    if unknown:
        raise ValueError(f"{path}: kinds {sorted(unknown)} are not in audit_schema.events.KINDS")
    return Constants(
        kinds=kinds,
        syscalls=group("DSEC_SYS_"),
        status=group("DSEC_ST_"),
        lost=group("DSEC_LOST_"),
        exit_how=group("DSEC_EXIT_"),
        over={k[len("DSEC_OVER_"):].lower(): v for k, v in values.items() if k.startswith("DSEC_OVER_")},
        values=values,
        hooks=group("DSEC_HOOK_"),
        modes={k[len("DSEC_MODE_"):].lower(): v for k, v in values.items() if k.startswith("DSEC_MODE_")},
    )


# ---------------------------------------------------------------- sandboxes

@dataclass
class SandboxInfo:
    cgroup_id: int
    sandbox_id: str
    labels: dict = field(default_factory=dict)   # policy_name, policy_hash, mode
    root_pid: int | None = None                  # a live process of the sandbox, for its root
    recent_pids: list = field(default_factory=list)   # pids seen lately (enrichment fallback)
    root_id: tuple | None = None                 # (device, inode) of its root, once READY (procs.root_ready)

    def saw(self, pid: int) -> None:
        if pid and (not self.recent_pids or self.recent_pids[-1] != pid):
            if pid in self.recent_pids:
                self.recent_pids.remove(pid)
            self.recent_pids.append(pid)
            del self.recent_pids[:-8]


# ---------------------------------------------------------------- /proc helpers

def _readlink(path: str) -> bytes | None:
    try:
        return os.readlink(os.fsencode(path))
    except OSError:
        return None


def sandbox_view(pid: int, host_path: bytes, proc: str = "/proc") -> bytes:
    """A path read from /proc/<pid>/{cwd,fd/N,exe}, seen from the process's root.

    readlink gives the path from our root when it is reachable (a chroot:
    /srv/sbx/work) and from the root of the process's mount namespace when it
    is not (a pivot_root'd sandbox: /work). Stripping the readlink of
    /proc/<pid>/root covers both.
    """
    root = _readlink(f"{proc}/{pid}/root")
    if not root or root == b"/":
        return host_path
    if host_path == root:
        return b"/"
    if host_path.startswith(root.rstrip(b"/") + b"/"):
        return host_path[len(root.rstrip(b"/")):]
    return host_path


def _clean_join(base: bytes, rel: bytes) -> bytes:
    """base/rel with "." and empty components dropped (".." is kept: symlinks)."""
    parts = [p for p in (base.rstrip(b"/") + b"/" + rel).split(b"/") if p not in (b"", b".")]
    return b"/" + b"/".join(parts)


def dirfd_name(dirfd: int) -> str:
    """The dirfd a name was given with, as the record column holds it."""
    return "AT_FDCWD" if dirfd == AT_FDCWD else str(dirfd)


def resolve_path(pid: int, raw: bytes, dirfd: int, proc: str = "/proc") -> bytes | None:
    """The absolute sandbox-view path of `raw` as process `pid` would resolve its
    start (cwd or dirfd); None when that can no longer be known."""
    if raw.startswith(b"/"):
        return raw
    if dirfd == AT_FDCWD:
        base = _readlink(f"{proc}/{pid}/cwd")
    else:
        base = _readlink(f"{proc}/{pid}/fd/{dirfd}")
    if base is None or not base.startswith(b"/"):
        return None          # gone, or not a directory path (socket:[..], anon_inode:..)
    base = sandbox_view(pid, base, proc)
    if raw == b"":
        return base          # AT_EMPTY_PATH: the dirfd itself
    return _clean_join(base, raw)


def proc_ppid(pid: int, proc: str = "/proc") -> int:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return int(data[data.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


def clock_offset_ns(samples: int = 5) -> int:
    """wall clock - CLOCK_MONOTONIC, from the tightest of a few bracketed reads."""
    best = None
    for _ in range(samples):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    return best[1]


def syscall_name(nr: int) -> str:
    """A syscall number of the enforcement sensor's counters as a name; every
    number >= 512 (DSEC_SYSCALL_NR_OTHER, one counter) is "out_of_range"."""
    from policies.syscalls import name_of
    if nr >= 512:
        return "out_of_range"
    return name_of(nr) or f"nr_{nr}"


# ---------------------------------------------------------------- sockaddr

def decode_sockaddr(raw: bytes, addrlen: int) -> tuple[str, str, int, dict]:
    """(family, addr, port, extra) of the first bytes of a struct sockaddr."""
    n = max(0, min(addrlen, len(raw)))
    raw = raw[:n]
    if n < 2:
        return "other", "", 0, {"af": None}
    af = struct.unpack_from("<H", raw)[0]
    if af == AF_INET and n >= 8:
        port = struct.unpack_from(">H", raw, 2)[0]
        return "ipv4", str(ipaddress.IPv4Address(raw[4:8])), port, {}
    if af == AF_INET6 and n >= 24:
        port = struct.unpack_from(">H", raw, 2)[0]
        extra = {}
        if n >= 28:
            scope = struct.unpack_from("<I", raw, 24)[0]
            if scope:
                extra["scope_id"] = scope
        return "ipv6", str(ipaddress.IPv6Address(raw[8:24])), port, extra
    if af == AF_UNIX:
        p = raw[2:]
        if p.startswith(b"\0"):
            return "unix", "@" + from_bytes(p[1:]), 0, {"abstract": True}
        return "unix", from_bytes(p.split(b"\0", 1)[0]), 0, {}
    return "other", "", 0, {"af": af}


# ---------------------------------------------------------------- fast views of the C structs

def _code(t) -> str | None:
    """The struct-module code (standard sizes, little endian) of a ctypes field type."""
    if isinstance(t, type) and issubclass(t, ct.Array):
        if t._type_ in (ct.c_char, ct.c_ubyte, ct.c_byte, ct.c_uint8, ct.c_int8):
            return f"{t._length_}s"              # bytes; c_char arrays keep their NULs (callers strip)
        return None
    if isinstance(t, type) and issubclass(t, (ct.Structure, ct.Union)):
        return None
    letter = getattr(t, "_type_", None)
    size = ct.sizeof(t)
    if not isinstance(letter, str) or letter not in "bBhHiIlLqQ" or size not in (1, 2, 4, 8):
        return None
    code = {1: "b", 2: "h", 4: "i", 8: "q"}[size]
    return code.upper() if letter.isupper() else code


def fast_view(ctype):
    """(struct.Struct, namedtuple class) reading a ctypes Structure of simple
    fields and byte arrays at an offset, about twice as fast as
    from_buffer_copy plus attribute reads; None when a field is of another
    kind (nested struct, array of wider ints): the caller keeps ctypes.
    Built from the ctypes layout BCC gives, so nothing mirrors events.h."""
    from collections import namedtuple
    fmt, names, at = ["<"], [], 0
    for fd in ctype._fields_:
        name, t = fd[0], fd[1]
        if len(fd) > 2:
            return None                           # bit fields
        code = _code(t)
        off = getattr(ctype, name).offset
        if code is None or off < at:
            return None
        if off > at:
            fmt.append(f"{off - at}x")
        fmt.append(code)
        names.append(name)
        at = off + ct.sizeof(t)
    st = struct.Struct("".join(fmt))
    if st.size != at or at > ct.sizeof(ctype):
        return None
    return st, namedtuple(ctype.__name__ or "view", names, rename=True)


class _Body:
    """The union of a record, each member read (struct.unpack_from) when asked for."""
    __slots__ = ("_raw", "_off", "_views")

    def __init__(self, raw, off, views):
        self._raw, self._off, self._views = raw, off, views

    def __getattr__(self, name):
        st, nt = self._views[name]
        return nt._make(st.unpack_from(self._raw, self._off))


# ---------------------------------------------------------------- decoder

from agent.sensors.procs import (LivePids, PinnedPid, ProcDir, in_cgroup, in_sandbox_root,  # noqa: E402,F401
                                 open_root, set_root_pid)


class Decoder:
    """Stateless about the kernel; keeps the sandbox table, parents, sequence."""

    def __init__(self, event_type, consts: Constants, *, node: str, instance: str,
                 enricher=None, cgroup2_root: str | None = None, proc: str = "/proc",
                 max_parents: int = 65536):
        self.consts = consts
        self.node = node
        self.boot_id = boot_id()
        self.instance = instance
        self.enricher = enricher
        self.cgroup2_root = cgroup2_root
        self.proc = proc
        self.sandboxes: dict[int, SandboxInfo] = {}
        self.parents: dict[int, int] = {}
        # (cgroup id, syscall nr) -> violations already reported (enforcement records
        # carry the kernel's running total; `count` is the part not reported yet)
        self.sys_reported: dict[tuple[int, int], int] = {}
        self.max_parents = max_parents
        # RingSensor with an Enricher: an exec whose file is not cached comes out of
        # take_job() (its file to be read off the decode path) instead of being read here
        self.enrich_async = False
        self._pending = None        # (Pending, extra) of the exec being decoded
        self._roots = None          # within a batch (batch_roots): cgroup id -> its init's root (O_PATH) or -1
        self._job = None            # the EnrichJob of the record decode() just returned
        self.seq = 0
        self.unattributed = 0       # records of a cgroup no longer registered
        self.undecodable = 0        # records that could not be decoded
        self.last_error = ""
        self.offset_ns = clock_offset_ns()
        self._id_prefix = hashlib.blake2b(f"{node}\0{self.boot_id}\0{instance}".encode(),
                                          digest_size=8).hexdigest()
        fields = dict(event_type._fields_)
        self.hdr_t = fields["h"]
        self.body_t = fields["u"]
        self.hdr_off = event_type.h.offset
        self.body_off = event_type.u.offset
        self.buf_off = event_type.buf.offset
        self.fixed = self.buf_off
        # struct views of the header and of each union member (ctypes when a layout has no such view)
        self._hdr_view = fast_view(self.hdr_t)
        views = {name: fast_view(t) for name, t in self.body_t._fields_}
        self._body_views = views if all(views.values()) else None
        self._extra_json: dict = {}        # extra's JSON by its items (the usual few shapes repeat)
        v = consts.values
        self._st_argv_incomplete = v["DSEC_ST_ARGV_TRUNC"] | v["DSEC_ST_ARGV_FAULT"] | v["DSEC_ST_NO_ARGV"]
        self._st_cwd_joined = v["DSEC_ST_CWD_JOINED"]

    # -- bookkeeping ---------------------------------------------------------

    def sync_clock(self) -> None:
        self.offset_ns = clock_offset_ns()

    def wall_ns(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    def next_event_id(self) -> str:
        self.seq += 1
        return f"{self._id_prefix}{self.seq:016x}"

    def register(self, info: SandboxInfo) -> None:
        self.sandboxes[info.cgroup_id] = info
        if info.root_pid:
            self.set_root_pid(info, info.root_pid)

    def set_root_pid(self, info: SandboxInfo, pid: int) -> None:
        set_root_pid(info, pid, self.cgroup2_root, self.proc)

    def forget(self, cgroup_id: int) -> None:
        self.sandboxes.pop(cgroup_id, None)
        for k in [k for k in self.sys_reported if k[0] == cgroup_id]:
            del self.sys_reported[k]

    def _ppid(self, pid: int, kernel_ppid: int) -> int:
        if kernel_ppid:
            return kernel_ppid
        p = self.parents.get(pid)
        if p:
            return p
        p = proc_ppid(pid, self.proc)
        if p:
            self._remember_parent(pid, p)
        return p

    def _remember_parent(self, child: int, parent: int) -> None:
        if len(self.parents) >= self.max_parents:
            # oldest first (dicts keep insertion order)
            for k in list(self.parents)[: self.max_parents // 8]:
                del self.parents[k]
        self.parents[child] = parent

    def _base(self, info: SandboxInfo, kind: str, ts_mono: int, step: int) -> dict:
        rec = _TEMPLATE.copy()          # every field, defaults, in FIELDS order (what normalize gives)
        rec["event_id"] = self.next_event_id()
        rec["ts_ns"] = self.wall_ns(ts_mono)
        rec["node"] = self.node
        rec["sandbox_id"] = info.sandbox_id
        rec["step"] = step
        rec["kind"] = kind
        for k in ("policy_name", "policy_hash", "mode"):
            if k in info.labels:
                rec[k] = info.labels[k]
        return rec

    # -- records ----------------------------------------------------------------

    def lost_record(self, info: SandboxInfo, step: int, reason: str, count: int,
                    kinds: dict, window: tuple[int, int] | None = None) -> dict:
        """An events_lost record: `count` events of this sandbox are missing."""
        rec = self._base(info, "events_lost", time.monotonic_ns(), step)
        rec["ts_ns"] = time.time_ns()
        rec["count"] = count
        extra = {"reason": reason, "kinds": kinds}
        if window:
            extra["window_start_ns"], extra["window_end_ns"] = window
        rec["extra"] = json.dumps(extra, sort_keys=True)
        return normalize(rec)

    def decode(self, raw: bytes) -> dict | None:
        """One ring-buffer record -> a normalized audit record (None when the
        sandbox is no longer registered; counted in self.unattributed).

        A record that cannot be decoded is not dropped silently: it becomes an
        events_lost record (reason decode_error) of its sandbox, or counts in
        self.undecodable when even its header is unreadable."""
        self._drop_job()
        try:
            return self._decode(raw)
        except Exception as e:
            self._drop_job()
            return self._undecodable(raw, e)

    def take_job(self):
        """The EnrichJob of the record decode() just returned, if its file is to
        be read off the decode path (enrich_async), else None. The record is
        the job's: deliver it once the job is done (or skipped)."""
        job, self._job = self._job, None
        return job

    def _drop_job(self) -> None:
        """A job nobody took (or of a record that failed to decode): its fds closed."""
        for p in (self._pending and self._pending[0], self._job and self._job.pending):
            if p is not None:
                p.discard()
        self._pending = self._job = None

    def _undecodable(self, raw: bytes, err: Exception) -> dict | None:
        self.undecodable += 1
        self.last_error = f"{type(err).__name__}: {err}"[:300]
        log.warning("undecodable audit record (%d bytes): %s", len(raw), self.last_error)
        if len(raw) < self.hdr_off + ct.sizeof(self.hdr_t):
            return None
        h = self.hdr_t.from_buffer_copy(raw, self.hdr_off)
        info = self.sandboxes.get(h.cgroup_id)
        if info is None:
            return None
        kind = self.consts.kinds.get(h.kind, str(h.kind))
        rec = self.lost_record(info, h.step, "decode_error", 1, {kind: 1})
        return rec

    def _decode(self, raw: bytes) -> dict | None:
        if len(raw) < self.fixed:
            raise ValueError(f"ring record of {len(raw)} bytes is shorter than the fixed part ({self.fixed})")
        if self._hdr_view is not None:
            st, nt = self._hdr_view
            h = nt._make(st.unpack_from(raw, self.hdr_off))
        else:
            h = self.hdr_t.from_buffer_copy(raw, self.hdr_off)
        if self._body_views is not None:
            u = _Body(raw, self.body_off, self._body_views)
        else:
            u = self.body_t.from_buffer_copy(raw, self.body_off)
        buf = raw[self.buf_off:]
        info = self.sandboxes.get(h.cgroup_id)
        if info is None:
            self.unattributed += 1
            return None
        kind = self.consts.kinds.get(h.kind)
        if kind is None:
            raise ValueError(f"ring record with unknown kind {h.kind}")
        rec = self._base(info, kind, h.ts_ns, h.step)
        rec.update(pid=h.pid, ppid=self._ppid(h.pid, h.ppid), uid=h.uid,
                   comm=from_bytes(bytes(h.comm).split(b"\0", 1)[0]))
        extra = {}
        if h.tid != h.pid:
            extra["tid"] = h.tid
        if h.gid:
            extra["gid"] = h.gid
        getattr(self, "_" + kind)(rec, extra, h, u, buf, info)
        if kind != "exit":
            info.saw(h.pid)
        if extra:
            rec["extra"] = self._dump_extra(extra)
        if kind == "exec" or len(rec) != _NFIELDS:
            rec = complete(rec)         # enrichment may set None; a field not in the schema raises
        if self._pending is not None:
            from agent.sensors.enrich import EnrichJob
            (pending, ex), self._pending = self._pending, None
            self._job = EnrichJob(rec, ex, pending, info.cgroup_id)
        return rec

    def _dump_extra(self, extra: dict) -> str:
        """json.dumps(extra, sort_keys=True), remembered for extras of scalar
        values (most records of a workload share a few: syscall, mode, dirfd)."""
        try:
            key = tuple((k, v, v.__class__) for k, v in extra.items())    # the class: True != 1 here
            hit = self._extra_json.get(key)
        except TypeError:                       # a list or dict value: not hashable
            return json.dumps(extra, sort_keys=True)
        if hit is None:
            hit = json.dumps(extra, sort_keys=True)
            if len(self._extra_json) >= 4096:
                self._extra_json.clear()
            self._extra_json[key] = hit
        return hit

    def _status(self, bits: int) -> list:
        if not bits:
            return []
        return [name for bit, name in sorted(self.consts.status.items()) if bits & bit]

    def _path(self, rec: dict, extra: dict, pid: int, raw: bytes, dirfd: int, second: bool = False) -> None:
        """path (or path2), what the kernel was given (the name, its dirfd) and how
        far the path is fact (path_resolution); the rename target's go to extra."""
        resolved = resolve_path(pid, raw, dirfd, self.proc)
        how = "exact" if raw.startswith(b"/") else "unresolved" if resolved is None else "best_effort"
        name = from_bytes(raw)
        rec["path2" if second else "path"] = name if resolved is None or resolved == raw else from_bytes(resolved)
        given = extra if second else rec
        given["path2_raw" if second else "path_raw"] = name
        given["dirfd2" if second else "dirfd"] = dirfd_name(dirfd)
        given["path2_resolution" if second else "path_resolution"] = how

    def _exec(self, rec, extra, h, u, buf, info):
        self.exec_fields(rec, extra, h.pid, u.exec, buf, info)

    def exec_fields(self, rec, extra, pid: int, e, buf: bytes, info) -> None:
        """An exec record's own fields from its body `e` (the exec member, as
        fast_view reads it) and string area `buf`, its enrichment (or the
        Pending of one read off the decode path, in self._pending): the one
        definition, shared by decode() and the batch decoder."""
        raw_path = buf[: e.path_len]
        if e.status & self.consts.values["DSEC_ST_LATE_READ"]:
            raw_path = buf[e.late_off: e.late_off + e.late_len]
        args = buf[e.argv_off: e.argv_off + e.argv_len].split(b"\0")[: e.argc]
        rec["argv"] = [from_bytes(a) for a in args]
        # incomplete argv, whether over the bound or unreadable (extra.status says which)
        rec["argv_truncated"] = 1 if e.status & self._st_argv_incomplete else 0
        rec["ret"] = e.ret
        if e.cwd_len and e.status & self._st_cwd_joined:
            self._verified_cwd(rec, extra, e, buf, raw_path)
        else:
            self._path(rec, extra, pid, raw_path, e.dirfd)
        if e.sys:
            extra["syscall"] = self.consts.syscalls.get(e.sys, str(e.sys))
        if e.at_flags:
            extra["at_flags"] = e.at_flags
        if e.old_tid and e.old_tid != pid:
            extra["old_tid"] = e.old_tid
        status = self._status(e.status)
        if status:
            extra["status"] = status
        if e.ret == 0 and self.enricher is not None:
            path = rec["path"]      # str.encode: os.fsencode's, without its Python-level checks
            exe_path = path.encode("utf-8", "surrogateescape") if path.startswith("/") else raw_path
            # only processes still in this sandbox: never the host's view of a path. The exec'ing
            # one is checked now (its root is the sandbox's, else in its cgroup); the others only
            # if for_exec needs them (its open failed, or a file not cached yet: then when they
            # are used), each checked then
            lazy = self.enrich_async
            try:
                live = in_sandbox_root(pid, info, self.proc)
                if live is None and in_cgroup(pid, info.cgroup_id, self.cgroup2_root, self.proc):
                    live = pid
                if live:
                    found = self.enricher.for_exec(live, exe_path, LivePids(self, info, (pid,)), cached_only=lazy)
                else:                              # gone (or not ours): through another one
                    others = LivePids(self, info, (pid,), limit=3)
                    first = next(iter(others), None)
                    if first:
                        found = self.enricher.for_exec(first, exe_path, others, use_exe=False, cached_only=lazy,
                                                       root=self._batch_root(info, first))
                    else:
                        found = {"extra": {"enrich_error": "no process of the sandbox left to read it through"}}
            except Exception as e:   # enrichment is best effort; the record is not
                found = {"extra": {"enrich_error": f"{type(e).__name__}: {e}"[:200]}}
            if not isinstance(found, dict):
                self._pending = (found, extra)     # a Pending: read off the decode path (take_job)
                return
            extra.update(found.pop("extra", {}))
            rec.update(found)

    @contextlib.contextmanager
    def batch_roots(self):
        """Within it, the root of a sandbox's init is opened once for the execs whose process
        is gone by their decode (the batch decoder's call: an exec loop's records come by the
        dozen), and closed at its end, while the sandbox's mounts are still there (a root kept
        longer could be the last reference to them: permcheck.SandboxRoots). Only after READY
        (root_id set: before its pivot_root the init's root is the host's)."""
        self._roots = {}
        try:
            yield
        finally:
            roots, self._roots = self._roots, None
            for fd in roots.values():
                if fd >= 0:
                    os.close(fd)

    def _batch_root(self, info: SandboxInfo, pid) -> int:
        roots = self._roots
        if roots is None or info.root_id is None or pid is not info.root_pid or not isinstance(pid, PinnedPid):
            return -1
        fd = roots.get(info.cgroup_id)
        if fd is None:
            try:
                fd = open_root(pid, self.proc)
            except OSError:
                fd = -1                 # gone: for_exec opens through it as before and says why
            roots[info.cgroup_id] = fd
        return fd

    def _verified_cwd(self, rec, extra, e, buf, raw_path):
        """A relative exec whose record carries the cwd the exec check joins it to
        (bpf/process.c dsec_exec_cwd): placed there, as the check does -- not at
        what /proc shows now (the process may be gone, or elsewhere)."""
        end = (e.late_off + e.late_len + 1) if e.status & self.consts.values["DSEC_ST_LATE_READ"] \
            else e.argv_off + e.argv_len
        cwd = buf[end: end + e.cwd_len]
        rec["path"] = from_bytes(resolve_exec(raw_path, cwd))
        rec["path_raw"] = from_bytes(raw_path)
        rec["dirfd"] = dirfd_name(e.dirfd)
        rec["path_resolution"] = "verified"
        extra["cwd"] = from_bytes(cwd)

    def _fork(self, rec, extra, h, u, buf, info):
        f = u.fork
        rec["child_pid"] = f.child_pid
        rec["flags"] = f.clone_flags & 0xFFFFFFFF
        if f.clone_flags >> 32:
            extra["clone_flags"] = f.clone_flags
        self._remember_parent(f.child_pid, h.pid)

    def _exit(self, rec, extra, h, u, buf, info):
        x = u.exit
        rec["exit_code"] = x.exit_code
        rec["signal"] = x.signal
        extra["how"] = self.consts.exit_how.get(x.how, str(x.how))
        self.parents.pop(h.pid, None)

    def _connect(self, rec, extra, h, u, buf, info):
        c = u.connect
        family, addr, port, more = decode_sockaddr(bytes(c.addr), c.addrlen)
        rec.update(family=family, addr=addr, port=port, ret=c.ret)
        extra.update(more)
        extra["fd"] = c.fd
        status = self._status(c.status)
        if status:
            extra["status"] = status

    def _file_common(self, rec, extra, h, f, buf):
        rec["ret"] = f.ret
        rec["flags"] = f.flags & 0xFFFFFFFF
        extra["syscall"] = self.consts.syscalls.get(f.sys, str(f.sys))
        status = self._status(f.status)
        if status:
            extra["status"] = status
        self._path(rec, extra, h.pid, buf[: f.path_len], f.dirfd)

    def _open_write(self, rec, extra, h, u, buf, info):
        f = u.file
        self._file_common(rec, extra, h, f, buf)
        if f.mode:
            extra["mode"] = f.mode
        if f.resolve:
            extra["resolve"] = f.resolve

    def _unlink(self, rec, extra, h, u, buf, info):
        self._file_common(rec, extra, h, u.file, buf)

    def _rename(self, rec, extra, h, u, buf, info):
        f = u.file
        self._file_common(rec, extra, h, f, buf)
        raw2 = buf[f.path2_off: f.path2_off + f.path2_len]
        self._path(rec, extra, h.pid, raw2, f.dirfd2, second=True)

    # -- enforcement records (bpf/enforce.c; the sensor is agent/sensors/enforce.py) ---------

    def _egress(self, rec, extra, h, u, decision):
        g = u.egress
        raw = bytes(g.addr)
        if g.family == AF_INET:
            rec["family"], rec["addr"] = "ipv4", str(ipaddress.IPv4Address(raw[:4]))
        else:
            rec["family"], rec["addr"] = "ipv6", str(ipaddress.IPv6Address(raw))
        rec["port"] = g.port
        rec["protocol"] = PROTOCOLS.get(g.protocol, str(g.protocol))
        rec["decision"] = decision
        if decision == "denied":
            rec["ret"] = -1          # EPERM: what connect/sendmsg returned to the process
        extra["hook"] = self.consts.hooks.get(g.hook, str(g.hook))
        extra["sock_type"] = SOCK_TYPES.get(g.sock_type & 0xFF, g.sock_type)
        status = self._status(g.status)
        if status:
            extra["status"] = status

    def _egress_denied(self, rec, extra, h, u, buf, info):
        self._egress(rec, extra, h, u, "denied")

    def _egress_violation(self, rec, extra, h, u, buf, info):
        self._egress(rec, extra, h, u, "would-deny")

    def _exec_check(self, rec, extra, h, u, buf, decision):
        x = u.exec_check
        mmap = bool(x.status & self.consts.values["DSEC_ST_MMAP_NOEXEC"])
        if mmap:
            # a refused executable mapping (noexec layer): the kernel gave the fd only
            extra["fd"] = x.fd
            extra["refused"] = "mmap PROT_EXEC of a file on a noexec layer (EPERM)"
            try:
                target = os.readlink(f"/proc/{h.pid}/fd/{x.fd}")
            except OSError:
                target = ""
            rec["path"] = target
            rec["path_resolution"] = "best_effort" if target else "unresolved"   # read after the fact
        else:
            self._path(rec, extra, h.pid, buf[: x.path_len], AT_FDCWD)
        rec["decision"] = decision
        if decision == "denied" and not mmap:
            rec["signal"] = 9        # SIGKILL, sent before the new image ran
            if x.signal_ret:
                extra["signal_ret"] = x.signal_ret
        if x.old_tid and x.old_tid != h.pid:
            extra["old_tid"] = x.old_tid
        status = self._status(x.status)
        if status:
            extra["status"] = status

    def _exec_denied(self, rec, extra, h, u, buf, info):
        self._exec_check(rec, extra, h, u, buf, "denied")

    def _exec_violation(self, rec, extra, h, u, buf, info):
        self._exec_check(rec, extra, h, u, buf, "would-deny")

    def syscall_fields(self, rec: dict, extra: dict, cgroup_id: int, kind: str, nr: int, total: int,
                       ret: int, status: int = 0) -> None:
        """Fields of a syscall_denied / syscall_violation record. `total` is the
        kernel's running count for (sandbox, syscall); `count` is the part no
        earlier record reported (0 when a userspace summary got there first)."""
        key = (cgroup_id, nr)
        before = self.sys_reported.get(key, 0)
        if total > before:
            self.sys_reported[key] = total
        rec["syscall"] = syscall_name(nr)
        rec["count"] = max(0, total - before)
        rec["ret"] = ret
        rec["decision"] = "denied" if kind == "syscall_denied" else "would-deny"
        extra["nr"] = nr
        extra["total"] = total
        if kind == "syscall_denied":
            # -errno: seccomp's ERRNO; the number itself: seccomp killed (it rolls the
            # registers back); anything else: the call ran, no filter refused it
            extra["action"] = "errno" if ret < 0 else "kill" if ret == nr else "ran"
            if extra["action"] == "ran":
                extra["warning"] = "the call was not refused: is the sandbox's seccomp filter installed?"
        if status:
            extra["status"] = self._status(status)

    def _syscall(self, rec, extra, h, u, kind):
        s = u.syscall
        self.syscall_fields(rec, extra, h.cgroup_id, kind, s.nr, s.total, s.ret, s.status)
        if s.status & self.consts.values["DSEC_ST_SOCKET"]:
            from policies.sockets import SOCKET_FAMILIES, SOCKET_TYPES, number_name
            extra["socket"] = {"family": number_name(s.sock_family & 0xFFFFFFFF, SOCKET_FAMILIES),
                               "type": number_name(s.sock_type & 0xF, SOCKET_TYPES),
                               "flags": s.sock_type & ~0xF & 0xFFFFFFFF, "protocol": s.sock_protocol}

    def _syscall_denied(self, rec, extra, h, u, buf, info):
        self._syscall(rec, extra, h, u, "syscall_denied")

    def _syscall_violation(self, rec, extra, h, u, buf, info):
        self._syscall(rec, extra, h, u, "syscall_violation")

    def syscall_summary(self, info: SandboxInfo, kind: str, nr: int, total: int, *, pid: int, ret: int,
                        step: int) -> dict | None:
        """A record for violations the kernel counted but did not report (its
        per-syscall rate limit), built by the agent; None when nothing is new."""
        if total <= self.sys_reported.get((info.cgroup_id, nr), 0):
            return None
        rec = self._base(info, kind, time.monotonic_ns(), step)
        rec["ts_ns"] = time.time_ns()
        rec["pid"] = pid
        rec["ppid"] = self._ppid(pid, 0) if pid else 0
        extra = {"aggregated": True}
        self.syscall_fields(rec, extra, info.cgroup_id, kind, nr, total, ret)
        rec["extra"] = json.dumps(extra, sort_keys=True)
        return normalize(rec)
