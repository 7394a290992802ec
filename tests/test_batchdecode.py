"""The batch decoder (agent/sensors/batchdecode.py) on the real kernel: every
chunk of the ring it decodes many records per call must give exactly what
Decoder.decode gives record by record, from the same state."""
from __future__ import annotations

import os
import socket
import subprocess

from fixtures_bpf import PYTHON, run_in_cgroup
from test_bpf_audit import _free_port, _kill, _write


BATCH_WORKLOAD = r'''
import os, socket, subprocess, sys, threading
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
for code in (0, 3):
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    os.waitpid(pid, 0)
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
print("done", flush=True)
sys.stdin.readline()
'''


def test_batch_decode_gives_what_decode_gives(audit_sensor, audit_cgroups, tmp_path):
    """Every chunk of the ring the sensor decodes many records per call
    (agent/sensors/batchdecode.py) is first decoded record by record with
    Decoder.decode from the same state: the records must be the same, every
    field, in the same order, none dropped or added -- for real kernel records
    of every fast kind (absolute opens and unlinks, a thread's, fork, exit,
    IPv4/IPv6/unix connects) and the ones it hands to decode (relative paths,
    rename, exec)."""
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
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    unix_path = str(tmp_path / "u.sock")
    u = socket.socket(socket.AF_UNIX)
    u.bind(unix_path)
    u.listen(4)
    sbx = h.sandbox(audit_cgroups)
    bd.decode_many = compared
    bd._slow = slow
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
        _kill(p)
        listener.close()
        u.close()
    sbx.remove()
    assert not mismatches, mismatches[:1]
    assert bd.c_decoded >= 45        # the absolute opens and unlinks went through batchdecode.c
    mine = [r for r in seen if r["sandbox_id"] == sbx.sandbox_id]
    kinds = {r["kind"] for r in mine}
    assert {"open_write", "unlink", "rename", "fork", "exit", "exec", "connect"} <= kinds, kinds
    assert sum(1 for r in mine if r["kind"] == "open_write" and r["path_resolution"] == "exact") >= 45
    assert any(r["kind"] == "open_write" and r["path_resolution"] == "best_effort" for r in mine)
    assert any(r["path"].endswith("/bad-\udcff\udcfe.txt") for r in mine)
    assert any('"tid"' in r["extra"] for r in mine if r["kind"] == "open_write")
    assert {r["family"] for r in mine if r["kind"] == "connect"} >= {"ipv4", "ipv6", "unix"}
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
