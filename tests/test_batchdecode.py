"""The batch decoder (agent/sensors/batchdecode.py) on the real kernel: every
chunk of the ring it decodes many records per call must give exactly what
Decoder.decode gives record by record, from the same state."""
from __future__ import annotations

import os
import socket
import struct
import subprocess

from fixtures_bpf import PYTHON, listeners, run_in_cgroup
from test_bpf_audit import _free_port, _kill, _write


BATCH_WORKLOAD = r'''
import ctypes, os, signal, socket, struct, subprocess, sys, threading, time
d, port, closed, unix_path = sys.argv[1:5]
for i in range(40):                                        # absolute: the fast path
    fd = os.open(f"{d}/a{i}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600 + i % 3); os.close(fd)
fd = os.open(os.fsencode(d) + b"/bad-\xff\xfe.txt", os.O_WRONLY | os.O_CREAT, 0o644); os.close(fd)
os.chdir(d)
fd = os.open("rel.txt", os.O_WRONLY | os.O_CREAT, 0o644); os.close(fd)      # relative: through decode()
def opener():
    for i in range(5):
        fd = os.open(f"{d}/t{i}.txt", os.O_WRONLY | os.O_CREAT); os.close(fd)
t = threading.Thread(target=opener); t.start(); t.join()           # tid != pid
try:
    os.open("/nonexistent-dir/x", os.O_WRONLY | os.O_CREAT, 0o644)
except OSError:
    pass
for i in range(40):
    os.unlink(f"{d}/a{i}.txt")
os.rename("rel.txt", "moved.txt")                                  # relative: through decode()
os.rename(f"{d}/moved.txt", f"{d}/abs-\xe9.txt")                   # absolute: the fast path
os.rename(os.fsencode(d) + b"/abs-\xc3\xa9.txt", os.fsencode(d) + b"/raw-\xff.txt")
for code in (0, 3, 4, 5, 6):                                      # forks and exits; the repeats in C
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    os.waitpid(pid, 0)
for sig in (signal.SIGKILL, signal.SIGTERM):                        # exits by a signal
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), sig)
        os._exit(9)
    os.waitpid(pid, 0)
def forker():                                                       # a fork from a thread: tid != pid
    for code in (0, 1):
        pid = os.fork()
        if pid == 0:
            os._exit(code)
        os.waitpid(pid, 0)
t = threading.Thread(target=forker); t.start(); t.join()
pid = os.fork()
if pid == 0:                                   # an exit whose last thread is not the main one (tid != pid)
    import ctypes
    def last():
        time.sleep(0.2)
        os._exit(7)
    threading.Thread(target=last).start()
    ctypes.CDLL(None).syscall(60, 0)           # SYS_exit: the main thread alone
pid2 = os.fork()
if pid2 == 0:
    os._exit(8)
os.waitpid(pid, 0); os.waitpid(pid2, 0)
subprocess.run(["/bin/true"])
subprocess.run(["/bin/sh", "-c", "exit 0", "arg\xe9", ""])            # argv with non-ASCII and empty items
subprocess.run([f"{d}/script.sh", "x"])                               # a script: shebang, interpreter
try:
    subprocess.run([f"{d}/missing-binary"])                           # a failed exec
except OSError:
    pass
os.chdir(d); subprocess.run(["./script.sh"])                          # a relative exec
for fam, addr in ((socket.AF_INET, ("127.0.0.1", int(port))), (socket.AF_INET, ("127.0.0.1", int(closed))),
                  (socket.AF_INET6, ("::1", int(closed))), (socket.AF_UNIX, unix_path)):
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.connect(addr)
    except OSError:
        pass
    s.close()
libc = ctypes.CDLL(None)
def raw_connect(data, alen=None, fam=socket.AF_INET):             # sockaddrs the socket module will not make
    s = socket.socket(fam, socket.SOCK_DGRAM)
    buf = ctypes.create_string_buffer(data, max(len(data), 1))
    libc.connect(s.fileno(), buf, len(data) if alen is None else alen)
    s.close()
for _ in range(2):                                                  # the second of each through C
    raw_connect(struct.pack("<H", 0) + bytes(14))                   # AF_UNSPEC: family "other"
    raw_connect(struct.pack("<H", 0x1234) + bytes(14))              # an unknown family
    raw_connect(b"\x02", 1)                                         # shorter than a family
    raw_connect(b"", 0)
    raw_connect(struct.pack("<HHI16sI", socket.AF_INET6, socket.htons(int(closed)), 0,
                            socket.inet_pton(socket.AF_INET6, "::1"), 1), fam=socket.AF_INET6)   # a scope id
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0dsec-batch-abstract")                          # abstract: "@..."
    except OSError:
        pass
    s.close()
    for addr in (("127.0.0.1", int(port)), ("127.0.0.1", int(closed))):
        s = socket.socket()
        try:
            s.connect(addr)
        except OSError:
            pass
        s.close()
print("done", flush=True)
sys.stdin.readline()
'''


def _record_c_loop(bd) -> list:
    """Wrap the batch decoder's C loop (built by make setup) so that the records it
    decodes itself are also kept in the list returned."""
    real_c, c_recs = bd._cfn, []
    assert real_c is not None                     # the library is built (make setup)

    def c_loop(ctx, blob, spans, i, out):
        n = len(out)
        j = real_c(ctx, blob, spans, i, out)
        c_recs.extend(out[n:])
        return j
    bd._cfn = c_loop
    return c_recs


def test_batch_decode_gives_what_decode_gives(audit_sensor, audit_cgroups, tmp_path):
    """Every chunk of the ring the sensor decodes many records per call
    (agent/sensors/batchdecode.py) is first decoded record by record with
    Decoder.decode from the same state: the records must be the same, every
    field, in the same order, none dropped or added -- for real kernel records
    of every fast kind (absolute opens and unlinks, a thread's, fork, exit,
    IPv4/IPv6/unix connects) and the ones it hands to decode (relative paths,
    rename, exec). The C loop (batchdecode.c) must have decoded opens,
    unlinks, forks, exits and connects among them: forks from the main thread
    and from another, exits by a code and by a signal and one from a thread
    not the main one, connects of every family (unix abstract, AF_UNSPEC, an
    unknown one, an addrlen too short for a family, IPv6 with a scope id)."""
    h = audit_sensor
    dec = h.sensor.decoder
    bd = h.sensor._batch
    assert bd is not None and bd.enabled          # the fast path is the one in use (DSEC_DECODE unset)
    seen, mismatches = [], []
    real = bd.decode_many

    def state():
        return (dec.seq, dict(dec.parents), dict(dec.sys_reported), dec.unattributed, dec.undecodable,
                {cg: list(i.recent_pids) for cg, i in dec.sandboxes.items()})

    def restore(s):
        dec.seq, parents, sys_rep, dec.unattributed, dec.undecodable, recent = s
        dec.parents.clear(); dec.parents.update(parents)
        dec.sys_reported.clear(); dec.sys_reported.update(sys_rep)
        for cg, pids in recent.items():
            dec.sandboxes[cg].recent_pids[:] = pids

    def as_rec(item):
        return item if isinstance(item, dict) else dict(item.rec)

    def compared(blob, spans):
        before = state()
        ref = []
        for o, n in spans:
            rec = dec.decode(blob[o:o + n])
            job = dec.take_job()
            if job is not None:
                ref.append(dict(job.rec))
                job.pending.discard()
            elif rec is not None:
                ref.append(rec)
        after_ref = state()
        restore(before)
        got = real(blob, spans)
        if state() != after_ref:
            mismatches.append(("decoder state", after_ref, state()))
        got_recs = [as_rec(i) for i in got]
        if got_recs != ref:
            mismatches.append((ref, got_recs))
        seen.extend(got_recs)
        return got

    d = tmp_path / "w"
    d.mkdir()
    _write(d / "script.sh", "#!/bin/sh\nexit 0\n", 0o755)
    workload = _write(tmp_path / "batch.py", BATCH_WORKLOAD)
    assert {v[2] for v in bd._fast.values()} >= {"open_write", "unlink", "rename", "fork", "exit", "connect", "exec"}
    slow_kinds = []
    real_slow = bd._slow

    def slow(raw, out):
        n = len(out)
        real_slow(raw, out)
        slow_kinds.extend(as_rec(i) for i in out[n:])
    listener, unix_path, u = listeners(tmp_path)
    sbx = h.sandbox(audit_cgroups)
    bd.decode_many = compared
    bd._slow = slow
    real_c = bd._cfn
    c_recs = _record_c_loop(bd)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", workload, str(d), str(listener.getsockname()[1]),
                               str(_free_port()), unix_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"done"
        assert h.poll_until(lambda: len(sbx.of_kind("connect")) >= 4, 20)      # cwd still there: rel paths
        p.stdin.write(b"\n")
        p.stdin.close()
        assert p.wait(30) == 0
        assert h.poll_until(lambda: any(r["kind"] == "exit" and r["pid"] == p.pid for r in sbx.records), 20)
    finally:
        del bd.decode_many
        del bd._slow
        bd._cfn = real_c
        _kill(p)
        listener.close()
        u.close()
    sbx.remove()
    assert not mismatches, mismatches[:1]
    assert bd.c_decoded >= 45        # the absolute opens and unlinks went through batchdecode.c
    c_mine = [r for r in c_recs if r["sandbox_id"] == sbx.sandbox_id]
    c_kinds = {k: sum(1 for r in c_mine if r["kind"] == k) for k in ("open_write", "unlink", "fork", "exit", "connect")}
    assert c_kinds["open_write"] >= 40 and c_kinds["unlink"] >= 39 and all(c_kinds.values()), c_kinds
    c_exits = [r for r in c_mine if r["kind"] == "exit"]
    assert any(r["signal"] for r in c_exits) and any(r["exit_code"] > 0 for r in c_exits)
    assert any('"tid"' in r["extra"] for r in c_mine if r["kind"] == "fork")
    assert {r["family"] for r in c_mine if r["kind"] == "connect"} >= {"ipv4", "ipv6", "unix", "other"}
    mine = [r for r in seen if r["sandbox_id"] == sbx.sandbox_id]
    kinds = {r["kind"] for r in mine}
    assert {"open_write", "unlink", "rename", "fork", "exit", "exec", "connect"} <= kinds, kinds
    assert sum(1 for r in mine if r["kind"] == "open_write" and r["path_resolution"] == "exact") >= 45
    assert any(r["kind"] == "open_write" and r["path_resolution"] == "best_effort" for r in mine)
    assert any(r["path"].endswith("/bad-\udcff\udcfe.txt") for r in mine)
    assert any('"tid"' in r["extra"] for r in mine if r["kind"] == "open_write")
    connects = [r for r in mine if r["kind"] == "connect"]
    assert {r["family"] for r in connects} >= {"ipv4", "ipv6", "unix", "other"}
    assert any(r["addr"] == "@dsec-batch-abstract" and '"abstract": true' in r["extra"] for r in connects)
    for af in ('"af": 0', '"af": 4660', '"af": null'):                # AF_UNSPEC, 0x1234, too short
        assert any(af in r["extra"] for r in connects), af
    assert any('"scope_id": 1' in r["extra"] for r in connects)
    exits = [r for r in mine if r["kind"] == "exit"]
    assert {9, 15} <= {r["signal"] for r in exits} and any('"tid"' in r["extra"] for r in exits)
    renames = [r for r in mine if r["kind"] == "rename"]
    assert {r["path_resolution"] for r in renames} == {"exact", "best_effort"}
    assert any(r["path2"].endswith("/raw-\udcff.txt") for r in renames)
    execs = [r for r in mine if r["kind"] == "exec"]
    assert any(r["argv"] == ["/bin/sh", "-c", "exit 0", "arg\xe9", ""] for r in execs)
    assert any(r["ret"] < 0 for r in execs) and any(r["path"].endswith("/script.sh") and r["ret"] == 0
                                                    for r in execs)
    assert any(r["path_raw"] == "./script.sh" for r in execs)
    # the fast path took the absolute renames and every exec: decode() only the relative names
    mine_slow = [r for r in slow_kinds if r["sandbox_id"] == sbx.sandbox_id]
    assert not [r for r in mine_slow if r["kind"] in ("exec", "fork", "exit", "connect")], mine_slow[:1]
    assert all(r["path_resolution"] != "exact" for r in mine_slow if r["kind"] in ("rename", "open_write", "unlink"))
    # and the records the sensor delivered are exactly the ones compared (an exec's after its
    # enrichment, so compared as a set), with the same content
    delivered = {r["event_id"]: r for r in sbx.records if r["kind"] != "events_lost"}
    assert sorted(delivered) == sorted(r["event_id"] for r in mine)
    assert all(delivered[r["event_id"]] == r for r in mine if r["kind"] != "exec")


def test_batch_decode_accounts_for_bad_records_as_decode_does(audit_sensor):
    """One chunk with a record too short for its header, one of an unknown kind,
    one of an unregistered cgroup and a good open_write between them: the bad
    ones are counted or become events_lost (decode_error) exactly as decode()
    makes them, and the good one still comes out."""
    from agent.sensors.batchdecode import BatchDecoder
    from agent.sensors.decoder import SandboxInfo
    d = audit_sensor.sensor.decoder
    bd = BatchDecoder(d)
    assert bd.enabled
    kinds = d.consts.kind_numbers

    def rec_bytes(kind, cg, path=b""):
        ev = audit_sensor.sensor.bpf[b"exec_scratch"].Leaf()
        ev.h.cgroup_id, ev.h.kind, ev.h.step, ev.h.pid, ev.h.tid, ev.h.ppid = cg, kind, 2, 4242, 4242, 1
        ev.h.comm = b"bad-test"
        ev.u.file.path_len, ev.u.file.dirfd, ev.u.file.flags = len(path), -100, 0o1101
        raw = bytearray(bytes(ev)[: d.fixed + len(path) + 1])
        raw[d.buf_off:d.buf_off + len(path)] = path
        return bytes(raw)

    parts = [b"\0" * 10, rec_bytes(99, 987654322), rec_bytes(kinds["open_write"], 987654322, b"/w/ok.txt"),
             rec_bytes(kinds["open_write"], 123456789, b"/w/nobody.txt")]
    blob, spans = b"", []
    for p in parts:
        spans.append((len(blob), len(p)))
        blob += p + b"\0" * (-len(p) % 8)
    d.register(SandboxInfo(987654322, "sbx-batch-bad", labels={"policy_name": "p", "mode": "audit"}))
    try:
        start = (d.seq, d.undecodable, d.unattributed)
        ref = [r for r in (d.decode(blob[o:o + n]) for o, n in spans) if r is not None]
        after_ref = (d.seq, d.undecodable, d.unattributed)
        d.seq, d.undecodable, d.unattributed = start
        got = bd.decode_many(blob, spans)
        assert (d.seq, d.undecodable, d.unattributed) == after_ref
    finally:
        d.forget(987654322)

    def same(a, b):       # events_lost records carry the wall clock of their making
        return {k: v for k, v in a.items() if k != "ts_ns"} == {k: v for k, v in b.items() if k != "ts_ns"}
    assert len(got) == len(ref) == 2 and all(same(a, b) for a, b in zip(got, ref))
    assert got[0]["kind"] == "events_lost" and '"decode_error"' in got[0]["extra"]
    assert got[1]["kind"] == "open_write" and got[1]["path"] == "/w/ok.txt" and got[1]["policy_name"] == "p"
    assert after_ref[1] == start[1] + 2 and after_ref[2] == start[2] + 1


def test_c_loop_gives_what_python_gives_for_every_branch(audit_sensor):
    """Records made for every branch of the C loop's kinds (batchdecode.c), each
    twice (the first fills the caches in Python, the second is decoded in C),
    decoded three ways from the same state: record by record with
    Decoder.decode, by decode_many with the C loop, by decode_many without it.
    The same records, every field, and the same decoder state. Branches: a fork
    with the high half of clone_flags, from a thread, of a gid; a fork when the
    remembered parents are full (the Python loop evicts); a ppid given, one
    remembered from a fork, one neither (the /proc lookup finds nothing); an
    exit by a code and by a signal; sockaddrs of every family decode_sockaddr
    knows, an unknown one, an addrlen of 0, 1, short of IPv6's and past the
    array (hostile: clamped to it); a record running past the blob's end."""
    import ctypes as ct
    from agent.sensors.batchdecode import BatchDecoder
    from agent.sensors.decoder import SandboxInfo
    d = audit_sensor.sensor.decoder
    kinds = d.consts.kind_numbers
    cg, gone = 987654323, 4194404               # gone: above any pid_max, no /proc entry
    base_ts = 10**12

    def rec_bytes(kind, pid, tid=None, ppid=0, gid=0, **body):
        ev = audit_sensor.sensor.bpf[b"exec_scratch"].Leaf()
        ev.h.cgroup_id, ev.h.kind, ev.h.step, ev.h.pid, ev.h.tid, ev.h.ppid = cg, kinds[kind], 3, pid, tid or pid, ppid
        ev.h.gid, ev.h.uid, ev.h.ts_ns, ev.h.comm = gid, 1000, base_ts + len(parts), b"c-loop\xff"
        u = getattr(ev.u, "file" if kind == "open_write" else kind)
        for k, v in body.items():
            if k == "addr":
                ct.memmove(ct.addressof(u.addr), v, len(v))
            elif k == "path":
                raw = bytearray(bytes(ev)[: d.fixed + len(v) + 1])
                raw[d.buf_off:d.buf_off + len(v)] = v
                u.path_len = len(v)
            else:
                setattr(u, k, v)
        if "path" in body:
            raw[:d.buf_off] = bytes(ev)[:d.buf_off]
            return bytes(raw)
        return bytes(ev)[:d.fixed]

    def v4(port, a="10.1.2.3"):
        return struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + socket.inet_aton(a) + bytes(8)

    def v6(port, scope=0):
        return (struct.pack("<H", socket.AF_INET6) + struct.pack(">HI", port, 0) +
                socket.inet_pton(socket.AF_INET6, "2001:db8::7") + struct.pack("<I", scope))
    unix = struct.pack("<H", socket.AF_UNIX) + b"/run/x.sock\0junk"
    abstract = struct.pack("<H", socket.AF_UNIX) + b"\0abs\xffname"
    other = struct.pack("<H", 0x1234) + bytes(14)
    parts = []
    for pass_ in range(2):
        parts += [rec_bytes("fork", 500, ppid=1, clone_flags=17, child_pid=501),               # no extra
                  rec_bytes("fork", 500, tid=502, ppid=1, clone_flags=(1 << 32) | 17, child_pid=503),
                  rec_bytes("fork", 500, ppid=1, gid=7, clone_flags=17, child_pid=504),
                  rec_bytes("exit", 501, exit_code=3, how=1),                   # ppid remembered (500)
                  rec_bytes("exit", 503, tid=505, exit_code=-1, signal=9, how=3),
                  rec_bytes("exit", gone, exit_code=0, how=2),                  # ppid unknown: Python
                  rec_bytes("fork", gone, clone_flags=17, child_pid=506)]
        for addr, alen in ((v4(80), 16), (v4(443, "127.0.0.1"), 16), (v6(53), 28), (v6(53, scope=2), 28),
                           (v6(53), 20), (unix, len(unix)), (abstract, len(abstract)), (other, 16),
                           (b"", 0), (b"\x02", 1), (v4(80), 0xFFFFFFFF), (v4(80), 200)):
            parts.append(rec_bytes("connect", 600, ppid=500, ret=-111, fd=5, addrlen=alen, status=0, addr=addr))
        parts.append(rec_bytes("connect", 600, tid=601, ppid=500, gid=9, ret=0, fd=6, addrlen=16, addr=v4(8080)))
        parts.append(rec_bytes("open_write", 600, ppid=500, flags=0o101, dirfd=-100, path=b"/w/ok.txt"))
        parts += [rec_bytes("fork", 700, ppid=1, clone_flags=17, child_pid=800 + 10 * pass_ + i)   # fill parents
                  for i in range(6)]
    blob, spans = b"", []
    for p in parts:
        spans.append((len(blob), len(p)))
        blob += p + b"\0" * (-len(p) % 8)
    spans.insert(9, (spans[9][0], d.fixed - 1))                 # shorter than the fixed part: decode_error
    spans.append((spans[-1][0], len(blob) - spans[-1][0] + 64))   # past the blob's end: the Python loop's
    info = SandboxInfo(cg, "sbx-c-loop", labels={"policy_name": "p", "policy_hash": "h", "mode": "audit"})

    def state():
        return (d.seq, dict(d.parents), list(d.parents), d.unattributed, d.undecodable, list(info.recent_pids))
    d.register(info)
    saved_max = d.max_parents
    try:
        start, start_parents = (d.seq, d.unattributed, d.undecodable), dict(d.parents)
        d.max_parents = len(start_parents) + 10  # the second pass's forks reach it: _remember_parent evicts

        def reset():
            d.seq, d.unattributed, d.undecodable = start
            d.parents.clear(); d.parents.update(start_parents)
            info.recent_pids[:] = []
        ref = []
        for o, n in spans:
            r = d.decode(blob[o:o + n])
            if r is not None:
                ref.append(r)
        ref_state = state()
        results = {}
        for way in ("c", "python"):
            reset()
            bd = BatchDecoder(d)
            assert bd.enabled
            if way == "python":
                bd._cfn = None
            else:
                c_recs = _record_c_loop(bd)
            results[way] = (bd.decode_many(blob, spans), state(), bd.c_decoded)
    finally:
        d.max_parents = saved_max
        d.forget(cg)
        d.parents.clear()
        d.parents.update(start_parents)

    def same(a, b):       # events_lost records carry the wall clock of their making
        return {k: v for k, v in a.items() if k != "ts_ns"} == {k: v for k, v in b.items() if k != "ts_ns"}
    for way, (got, st, _n) in results.items():
        assert st == ref_state, way
        assert len(got) == len(ref) and all(same(a, b) for a, b in zip(got, ref)), way
        assert [r for r in got if r["kind"] != "events_lost"] == [r for r in ref if r["kind"] != "events_lost"]
    assert sum(1 for r in ref if r["kind"] == "events_lost" and '"decode_error"' in r["extra"]) == 1
    assert len(ref) == len(parts) + 2 and ref[-1]["kind"] == "fork"
    kept = set(start_parents) | {504, 506} | set(range(800, 806))      # all there without an eviction
    assert kept - set(ref_state[1])                                     # _remember_parent evicted the oldest
    # the C loop took the repeats of every kind, and left the records it must leave
    c_by = {}
    for r in c_recs:
        c_by.setdefault(r["kind"], []).append(r)
    assert results["c"][2] == len(c_recs) and set(c_by) == {"fork", "exit", "connect", "open_write"}, c_by.keys()
    assert {r["family"] for r in c_by["connect"]} == {"ipv4", "ipv6", "unix", "other"}
    assert len(c_by["connect"]) >= 13                  # every sockaddr's repeat
    assert not any(r is results["c"][0][-1] for r in c_recs)   # the span past the blob's end
    assert not [r for r in c_recs if r["pid"] == gone]          # ppid unknown: the Python loop's /proc lookup
    assert any(r["kind"] == "exit" and r["pid"] == 501 and r["ppid"] == 500 for r in c_recs)   # remembered
    assert any(r["kind"] == "fork" and r["child_pid"] == 503 and '"clone_flags": 4294967313' in r["extra"]
               for r in c_recs)
    assert any(r["kind"] == "exit" and r["signal"] == 9 and '"tid": 505' in r["extra"] for r in c_recs)
    long_v4 = [r for r in ref if r["kind"] == "connect" and r["addr"] == "10.1.2.3" and r["port"] == 80]
    assert len(long_v4) == 6                           # addrlen 16, 0xFFFFFFFF and 200: the same sockaddr
