"""Many ring-buffer records per call -> audit records (issue 15: decode).

    bd = BatchDecoder(decoder)              # decoder: agent/sensors/decoder.py Decoder
    out = bd.decode_many(blob, spans)       # RingReader.read()'s (blob, [(offset, length)])

decoder.py holds the one definition of what a record becomes; this is its
fast path for the kinds a busy sandbox makes by the ten thousand (open_write,
unlink, rename, fork, exit, connect, exec) and must give exactly the same
records. An exec's own fields and enrichment are Decoder.exec_fields itself
(the one definition), called with the body already unpacked; an exec whose
file is read off the decode path comes out as its EnrichJob, as decode() +
take_job() give it. Per
record: one struct unpack of the header and one of the kind's fixed part
(formats built from BCC's ctypes layout, as decoder.fast_view: nothing here
mirrors bpf/events.h; the field names are checked at start and the fast path
is off when they differ), the record made from a per-(sandbox, kind) template
(node, sandbox, policy labels already set), comm, dirfd, extra's JSON and
sockaddrs remembered by their bytes (the usual few repeat), no namedtuple,
no union object, no normalize (the template has every field).

Everything else goes through Decoder.decode, unchanged, in order: other
kinds (the enforcement sensor's), a relative open, unlink or rename path
(resolved through /proc at decode time), a record shorter than
the fixed part or of an unknown kind, one whose fast decoding raised (decode
makes it an events_lost record or counts it: never silent, and a chunk is
never lost to one bad record). tests/test_batchdecode.py decodes the same kernel
records both ways and compares every field.

Open_write and unlink records with an absolute path, fork, exit and connect
records are decoded in C (batchdecode.c through ctypes, built by `make
setup`; DSEC_DECODE_C=0 turns it off): from such a record on, the same
records from the same templates, caches and decoder state, until a record it
leaves to the Python loop below (which then decodes it as before: the first
of its extra or sockaddr, a ppid not known yet ...). The meaning of each field
is this file's (_fork, _exit, _connect, the open_write/unlink code inline in
decode_many); batchdecode.c mirrors it, and reads only the caches these fill.
Without the library the Python loop does all of it (a warning says so once).

decode_many returns a list of records (dicts) and EnrichJobs (an exec whose
file is read off the decode path: Decoder.take_job), in ring order; records
of an unregistered cgroup are left out and counted (Decoder.unattributed),
as decode does.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import struct
import sys
import threading

from agent.sensors.decoder import _TEMPLATE, AT_FDCWD, complete, decode_sockaddr, dirfd_name

_HDR = ("ts_ns", "cgroup_id", "kind", "size", "pid", "tid", "ppid", "uid", "gid", "step", "comm")
_BODIES = {
    "file": ("ret", "flags", "mode", "resolve", "dirfd", "dirfd2", "sys", "status", "path_len",
             "path2_off", "path2_len", "_pad", "upath", "upath2"),
    "fork": ("clone_flags", "child_pid", "_pad"),
    "exit": ("exit_code", "signal", "how", "_pad"),
    "connect": ("ret", "fd", "addrlen", "sys", "status", "uaddr", "addr"),
    "exec": ("ret", "dirfd", "at_flags", "sys", "status", "path_len", "argv_off", "argv_len", "argc", "old_tid",
             "late_len", "late_off", "cwd_len", "upath"),
}
_CACHE_MAX = 4096                   # batchdecode.c's CACHE_MAX
log = logging.getLogger("dsec.audit")


_C_KEYS = ("ret", "flags", "path", "path_raw", "dirfd", "extra", "event_id", "ts_ns", "step", "pid", "ppid", "uid",
           "comm", "child_pid", "exit_code", "signal", "family", "addr", "port")   # batchdecode.c's K_* order
_C_KINDS = ("open_write", "unlink", "fork", "exit", "connect")                      # batchdecode.c's KIND_* order
HERE = os.path.dirname(os.path.abspath(__file__))
C_SRC = os.path.join(HERE, "batchdecode.c")
C_LIB = os.path.join(HERE, "build", "libdsec_batchdecode.so")
_c = [False, None]                  # loaded?, the function
_c_lock = threading.Lock()


def build_c(out: str = C_LIB) -> str:
    """Compile batchdecode.c for this Python (scripts/setup.sh)."""
    from exporters.columns import build_extension
    return build_extension(C_SRC, out)


def _load_c():
    """batchdecode.c's (prepare, decode) builtin functions, or None (not built, or older than its
    source: the Python loop decodes everything, and a warning says so once)."""
    with _c_lock:
        if _c[0]:
            return _c[1]
        _c[0] = True
        why = None
        try:
            if os.stat(C_LIB).st_mtime < os.stat(C_SRC).st_mtime:
                why = "older than agent/sensors/batchdecode.c"
            elif sys.byteorder != "little":
                why = "not for a big-endian machine"
            else:
                # one ctypes call here; the functions it gives are called as builtins (a ctypes
                # call per run of records cost about a microsecond: a run between two execs is 1-2)
                fns = ctypes.PyDLL(C_LIB).dsec_batchdecode_functions
                fns.restype = ctypes.py_object
                fns.argtypes = ()
                _c[1] = tuple(fns())
        except FileNotFoundError:
            why = "not built"
        except (OSError, AttributeError) as e:        # AttributeError: a library without the function
            why = str(e)
        if why:
            log.warning("audit: %s %s (run `make setup`); open_write/unlink/fork/exit/connect records are "
                        "decoded in Python (slower)", C_LIB, why)
        return _c[1]


def _offsets(fmt: str, names) -> dict:
    """field name -> (offset, size, signed) in a "<"-less struct format of one
    code per field (e.g. "16s" for comm); None for any other shape."""
    codes = re.findall(r"\d*[a-zA-Z?]", fmt)
    if "".join(codes) != fmt or len(codes) != len(names) or any(c in "xP?efd" for c in fmt):
        return None
    out, off = {}, 0
    for name, code in zip(names, codes):
        size = struct.calcsize("<" + code)
        out[name] = (off, size, int(code[-1] in "bhilq"))
        off += size
    return out if off == struct.calcsize("<" + fmt) else None


def _fmt(ctype) -> tuple[str, list[str]] | None:
    """(struct format without byte order, field names) of a ctypes struct, as decoder.fast_view reads it."""
    from agent.sensors.decoder import fast_view
    v = fast_view(ctype)
    if v is None:
        return None
    return v[0].format.lstrip("<"), [fd[0] for fd in ctype._fields_]


class BatchDecoder:
    def __init__(self, dec):
        self.dec = dec
        self.enabled = False
        self._tmpl: dict = {}        # (cgroup id, kind number) -> (SandboxInfo, template record)
        self._comm: dict = {}        # comm bytes -> str
        self._extra: dict = {}       # (kind, the extra's inputs) -> its JSON
        self._sock: dict = {}        # sockaddr bytes -> decode_sockaddr's result
        h = _fmt(dec.hdr_t)
        if h is None or h[1] != list(_HDR):
            return
        self._hdr = struct.Struct("<" + h[0])
        bodies = dict(dec.body_t._fields_)
        self._body = {}
        for name, want in _BODIES.items():
            b = _fmt(bodies[name]) if name in bodies else None
            if b is None or b[1] != list(want):
                if name == "exec":
                    continue             # exec records go through decode(); the rest stays fast
                return
            self._body[name] = struct.Struct("<" + b[0]).unpack_from
        if dec.hdr_off + self._hdr.size > dec.body_off:
            return
        if "exec" in self._body:
            from agent.sensors.decoder import fast_view
            self._exec_view = fast_view(bodies["exec"])[1]._make     # exec_fields reads it by name
        nums = dec.consts.kind_numbers
        self._fast = {}              # kind number -> (handler, body unpack, kind name, open_write/unlink: inline)
        for kind, body, fn in (("open_write", "file", None), ("unlink", "file", None),     # inline in the loop
                               ("rename", "file", self._rename), ("fork", "fork", self._fork),
                               ("exit", "exit", self._exit), ("connect", "connect", self._connect),
                               ("exec", "exec", self._exec)):
            if kind in nums and body in self._body:
                self._fast[nums[kind]] = (fn, self._body[body], kind, kind in ("open_write", "unlink"))
        self._exec_job = None        # (Pending, extra) of the exec just decoded (Decoder._pending's)
        self.enabled = True
        self.c_decoded = 0           # records batchdecode.c decoded (tests: the C loop is the one in use)
        self._cfn = None
        self._c_kinds = frozenset()
        self._c_static = None
        hdr_f = _offsets(h[0], h[1])
        body_f = {}
        for name in ("file", "fork", "exit", "connect"):
            b = _fmt(bodies[name])
            body_f[name] = _offsets(b[0], b[1])
        if os.environ.get("DSEC_DECODE_C", "1") != "0" and hdr_f and all(body_f.values()) and \
                _load_c() is not None:
            file_f, fork_f, exit_f, conn_f = (body_f[k] for k in ("file", "fork", "exit", "connect"))
            ints = (tuple(hdr_f[k] for k in ("ts_ns", "cgroup_id", "kind", "pid", "tid", "ppid", "uid", "gid", "step")),
                    tuple(file_f[k] for k in ("ret", "flags", "mode", "resolve", "dirfd", "sys", "status", "path_len")),
                    tuple(fork_f[k] for k in ("clone_flags", "child_pid")),
                    tuple(exit_f[k] for k in ("exit_code", "signal", "how")),
                    tuple(conn_f[k] for k in ("ret", "fd", "addrlen", "status")))
            self._c_static = (
                (dec.hdr_off, dec.body_off, dec.buf_off, dec.fixed, hdr_f["comm"][0]), ints,
                {num: (f[2], _C_KINDS.index(f[2])) for num, f in self._fast.items() if f[2] in _C_KINDS},
                conn_f["addr"][:2])
            if hdr_f["comm"][1] == 16 and all(v[1] in (1, 2, 4, 8) for t in ints for v in t):
                self._cprep, self._cfn = _load_c()
                self._c_kinds = frozenset(self._c_static[2])

    # -- the loop -------------------------------------------------------------------------
    def decode_many(self, blob: bytes, spans) -> list:
        with self.dec.batch_roots():       # an init's root opened once a call (Decoder.batch_roots)
            return self._decode_many(blob, spans)

    def _decode_many(self, blob: bytes, spans) -> list:
        dec = self.dec
        out = []
        if not self.enabled:
            for o, n in spans:
                self._slow(blob[o:o + n], out)
            return out
        hdr = self._hdr.unpack_from
        hdr_off, body_off, buf_off, fixed = dec.hdr_off, dec.body_off, dec.buf_off, dec.fixed
        fast = self._fast
        sandboxes = dec.sandboxes
        tmpl = self._tmpl
        comms = self._comm
        extras = self._extra
        parents = dec.parents
        prefix = dec._id_prefix
        append = out.append
        cfn = self._cfn if spans.__class__ is list and blob.__class__ is bytes else None
        if cfn is not None:
            ctx = self._c_context()
            state = ctx[10]
            ctx = self._cprep(ctx)      # parsed once per call
            ckinds = self._c_kinds
        i, count = 0, len(spans)
        while i < count:
            o, n = spans[i]
            i += 1
            if n < fixed:
                self._slow(blob[o:o + n], out)
                continue
            ts, cg, kind, _size, pid, tid, ppid, uid, gid, step, comm = hdr(blob, o + hdr_off)
            f = fast.get(kind)
            if f is None:
                self._slow(blob[o:o + n], out)
                continue
            info = sandboxes.get(cg)
            if info is None:
                dec.unattributed += 1
                continue
            fn, body, kname, file_kind = f
            ent = tmpl.get((cg, kind))
            if ent is None or ent[0] is not info:
                ent = self._template(cg, kind, kname, info)
            if cfn is not None and kind in ckinds:
                # a run of open_write/unlink/fork/exit/connect records in C (batchdecode.c: the same
                # records, the same state); it leaves what it does not take (the first record of
                # another kind, an extra not cached yet ...) here
                state[0], state[1] = dec.seq, dec.offset_ns
                try:
                    j = cfn(ctx, blob, spans, i - 1, out)
                finally:
                    dec.seq = state[0]
                if j >= i:
                    self.c_decoded += j - i + 1
                    i = j
                    continue
            try:
                if file_kind:
                    # open_write and unlink (the C loop's when built): _file + the extra, cached by its key
                    rec = self._file(ent[1], blob, body(blob, o + body_off), o + buf_off, o + n)
                    if rec is not None:
                        rec, _ret, _flags, mode, resolve, sys_, status = rec
                        if kname == "unlink":
                            mode = resolve = 0
                        j = extras.get((kname, tid if tid != pid else None, gid, sys_, status, mode, resolve))
                        rec["extra"] = j if j is not None else \
                            self._file_extra(kname, pid, tid, gid, sys_, status, mode, resolve)
                else:
                    rec = fn(ent[1], blob, o, n, body(blob, o + body_off), o + buf_off, pid, tid, gid, info)
            except Exception:                     # noqa: BLE001 - decode() accounts for it (events_lost)
                rec = None
                self._drop_exec_job()
            if rec is None:                       # not for the fast path (a relative path ...), or failed
                self._slow(blob[o:o + n], out)
                continue
            # what Decoder._decode sets for every record, in its order of effects
            dec.seq += 1
            rec["event_id"] = f"{prefix}{dec.seq:016x}"
            rec["ts_ns"] = ts + dec.offset_ns
            rec["step"] = step
            rec["pid"] = pid
            rec["ppid"] = ppid or parents.get(pid) or dec._ppid(pid, 0)
            rec["uid"] = uid
            c = comms.get(comm)
            if c is None:
                if len(comms) >= _CACHE_MAX:
                    comms.clear()
                c = comms[comm] = comm.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            rec["comm"] = c
            if file_kind:
                rp = info.recent_pids
                if not rp or rp[-1] != pid:
                    info.saw(pid)
                append(rec)
                continue
            if kname == "fork":
                dec._remember_parent(rec["child_pid"], pid)
            elif kname == "exit":
                parents.pop(pid, None)
            if kname != "exit":
                rp = info.recent_pids
                if not rp or rp[-1] != pid:
                    info.saw(pid)
            if kname == "exec" and self._exec_job is not None:
                from agent.sensors.enrich import EnrichJob
                (pending, ex), self._exec_job = self._exec_job, None
                append(EnrichJob(rec, ex, pending, info.cgroup_id))   # as decode() + take_job()
                continue
            append(rec)
        return out

    def _c_context(self) -> tuple:
        """batchdecode.c's view of this decoder (the same dicts the Python loop uses)."""
        dec = self.dec
        layout, (hdr_f, file_f, fork_f, exit_f, conn_f), kinds, addr = self._c_static
        return (layout, hdr_f, file_f, kinds, dec.sandboxes, self._tmpl, self._comm, self._extra, dec.parents,
                _C_KEYS, [dec.seq, dec.offset_ns, dec._id_prefix, "AT_FDCWD", dec.max_parents],
                ("recent_pids", "saw", AT_FDCWD), fork_f, exit_f, conn_f, addr, self._sock)

    def _drop_exec_job(self) -> None:
        if self._exec_job is not None:
            self._exec_job[0].discard()           # its fds closed; decode() starts it again
            self._exec_job = None

    def _slow(self, raw: bytes, out: list) -> None:
        dec = self.dec
        rec = dec.decode(raw)
        job = dec.take_job()
        if job is not None:
            out.append(job)
        elif rec is not None:
            out.append(rec)

    def forget(self, cg: int) -> None:
        """A removed sandbox's templates: they hold its SandboxInfo (and through it the
        pinned init's /proc descriptor), so they go with it (a look-up per kind, not a walk
        of the whole cache per removal)."""
        for kind in self.dec.consts.kind_numbers.values():
            self._tmpl.pop((cg, kind), None)

    def _template(self, cg, kind, kname, info):
        if len(self._tmpl) >= _CACHE_MAX:
            self._tmpl.clear()
        t = _TEMPLATE.copy()
        t["node"] = self.dec.node
        t["sandbox_id"] = info.sandbox_id
        t["kind"] = kname
        for k in ("policy_name", "policy_hash", "mode"):
            if k in info.labels:
                t[k] = info.labels[k]
        if kname in ("open_write", "unlink", "rename"):
            t["path_resolution"] = "exact"       # the fast path takes absolute paths only
        ent = self._tmpl[(cg, kind)] = (info, t)
        return ent

    def _extra_json(self, key, build) -> str:
        j = self._extra.get(key)
        if j is None:
            if len(self._extra) >= _CACHE_MAX:
                self._extra.clear()
            j = self._extra[key] = json.dumps(build(), sort_keys=True)
        return j

    def _common_extra(self, extra: dict, pid: int, tid: int, gid: int) -> dict:
        if tid != pid:
            extra["tid"] = tid
        if gid:
            extra["gid"] = gid
        return extra

    # -- the kinds (each as decoder.py's _<kind>; None: not on the fast path; open_write and
    #    unlink: _file and _file_extra, called from decode_many's loop) ---------------------------
    def _file(self, t, blob, b, bo, end):
        ret, flags, mode, resolve, dirfd, _d2, sys_, status, plen = b[:9]
        raw = blob[bo:min(bo + plen, end)]          # within the record, as decode's buf[:path_len]
        if raw[:1] != b"/":
            return None                  # relative: resolved through /proc by Decoder.decode
        rec = t.copy()
        rec["ret"] = ret
        rec["flags"] = flags & 0xFFFFFFFF
        p = raw.decode("utf-8", "surrogateescape")
        rec["path"] = p
        rec["path_raw"] = p
        rec["dirfd"] = "AT_FDCWD" if dirfd == AT_FDCWD else dirfd_name(dirfd)
        return rec, ret, flags, mode, resolve, sys_, status     # path_resolution "exact": the template's

    def _file_extra(self, kname, pid, tid, gid, sys_, status, mode, resolve):
        dec = self.dec

        def build():
            extra = self._common_extra({}, pid, tid, gid)
            extra["syscall"] = dec.consts.syscalls.get(sys_, str(sys_))
            st = dec._status(status)
            if st:
                extra["status"] = st
            if kname == "open_write":
                if mode:
                    extra["mode"] = mode
                if resolve:
                    extra["resolve"] = resolve
            return extra
        return self._extra_json((kname, tid if tid != pid else None, gid, sys_, status, mode, resolve), build)

    def _rename(self, t, blob, o, n, b, bo, pid, tid, gid, info):
        end = o + n
        p2o, p2n = b[9], b[10]
        a = min(bo + p2o, end)
        raw2 = blob[a:min(a + p2n, end)]             # as decode's buf[path2_off:path2_off + path2_len]
        if raw2[:1] != b"/":
            return None                  # relative (or empty): resolved through /proc by Decoder.decode
        got = self._file(t, blob, b, bo, end)
        if got is None:
            return None
        rec, _ret, _flags, _mode, _resolve, sys_, status = got
        p2 = raw2.decode("utf-8", "surrogateescape")
        rec["path2"] = p2
        extra = self._common_extra({}, pid, tid, gid)
        extra["syscall"] = self.dec.consts.syscalls.get(sys_, str(sys_))
        st = self.dec._status(status)
        if st:
            extra["status"] = st
        extra["path2_raw"] = p2
        extra["dirfd2"] = dirfd_name(b[5])
        extra["path2_resolution"] = "exact"
        rec["extra"] = json.dumps(extra, sort_keys=True)
        return rec

    def _exec(self, t, blob, o, n, b, bo, pid, tid, gid, info):
        """decode()'s exec: the same Decoder.exec_fields (paths, argv, enrichment or
        its Pending), from the body already unpacked and the record's string area."""
        dec = self.dec
        rec = t.copy()
        extra = self._common_extra({}, pid, tid, gid)
        dec._pending = None
        try:
            dec.exec_fields(rec, extra, pid, self._exec_view(b), blob[bo:o + n], info)
        finally:
            self._exec_job, dec._pending = dec._pending, None     # a raise below: the loop discards it
        if extra:
            rec["extra"] = dec._dump_extra(extra)
        return complete(rec)         # as decode(): enrichment may set None

    def _fork(self, t, blob, o, n, b, bo, pid, tid, gid, info):
        clone_flags, child, _pad = b
        rec = t.copy()
        rec["child_pid"] = child
        rec["flags"] = clone_flags & 0xFFFFFFFF
        hi = clone_flags >> 32

        def build():
            extra = self._common_extra({}, pid, tid, gid)
            if hi:
                extra["clone_flags"] = clone_flags
            return extra
        if tid != pid or gid or hi:
            rec["extra"] = self._extra_json(("fork", tid if tid != pid else None, gid, clone_flags if hi else 0),
                                            build)
        return rec

    def _exit(self, t, blob, o, n, b, bo, pid, tid, gid, info):
        code, sig, how, _pad = b
        rec = t.copy()
        rec["exit_code"] = code
        rec["signal"] = sig
        dec = self.dec

        def build():
            extra = self._common_extra({}, pid, tid, gid)
            extra["how"] = dec.consts.exit_how.get(how, str(how))
            return extra
        rec["extra"] = self._extra_json(("exit", tid if tid != pid else None, gid, how), build)
        return rec

    def _connect(self, t, blob, o, n, b, bo, pid, tid, gid, info):
        ret, fd, addrlen, _sys, status, _uaddr, addr = b
        key = addr[:max(0, min(addrlen, len(addr)))]
        s = self._sock.get(key)
        if s is None:
            if len(self._sock) >= _CACHE_MAX:
                self._sock.clear()
            s = self._sock[key] = decode_sockaddr(addr, addrlen)
        family, a, port, more = s
        rec = t.copy()
        rec["family"] = family
        rec["addr"] = a
        rec["port"] = port
        rec["ret"] = ret
        dec = self.dec

        def build():
            extra = self._common_extra({}, pid, tid, gid)
            extra.update(more)
            extra["fd"] = fd
            st = dec._status(status)
            if st:
                extra["status"] = st
            return extra
        rec["extra"] = self._extra_json(("connect", tid if tid != pid else None, gid, key, fd, status), build)
        return rec
