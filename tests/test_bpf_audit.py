"""eBPF audit on the real kernel: completeness, isolation, loss accounting,
fair share. Needs root, BCC and the fixtures of tests/fixtures_bpf.py.

Why this file is long: it is the audit sensor's suite, one section per
property above; the sections share only tests/fixtures_bpf.py, so a section
that grows can move to a file of its own."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from agent.sensors.audit import (_budget, build_cflags, check_features, compile_bpf, require_features,
                               tracepoints_used)
from agent.sensors.common import ENDED
from agent.sensors.enrich import QUEUE_FULL
from agent.sensors.decoder import AT_FDCWD, decode_sockaddr, resolve_path, sandbox_view
from agent.errors import DsecError
from audit_schema.events import FIELD_NAMES, to_bytes
from fixtures_bpf import PYTHON, run_in_cgroup

ARGV_BYTES = 16384   # the default bound (agent.sensors.audit.DEFAULT_ARGV_BYTES)

WORKLOAD = r'''
import ctypes, json, os, socket, subprocess, sys, time
d, port, closed, unix_path, script = sys.argv[1:6]
port, closed = int(port), int(closed)
os.chdir(d)
libc = ctypes.CDLL(None, use_errno=True)
children = []

def run(argv):
    p = subprocess.Popen(argv)
    children.append(p.pid)
    p.wait()

def started(p, comm):
    for _ in range(500):                       # bounded: 5 s
        try:
            with open(f"/proc/{p.pid}/comm") as f:
                if f.read().strip() == comm:
                    return
        except OSError:
            return
        time.sleep(0.01)

# -- execs: 8 that succeed, 1 that fails
run(["/bin/true"])
run(["/bin/true"] + ["A" * 2047] * 100)        # a 200 KB argv
run(["/bin/sh", "-c", "exit 3"])
run([b"/bin/true", b"arg-\xff\xfe"])            # non-UTF-8 argv
run([script])                                  # a #! script
try:
    run(["/nonexistent/prog"])
except FileNotFoundError:
    pass
for sig in (15, 9):
    p = subprocess.Popen(["/bin/sleep", "30"])
    children.append(p.pid)
    started(p, "sleep")
    p.send_signal(sig)
    p.wait()

# -- connects: listener, closed port, IPv6 closed port, unix socket
def conn(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.connect(addr)
    except OSError:
        pass
    finally:
        s.close()
conn(socket.AF_INET, ("127.0.0.1", port))
conn(socket.AF_INET, ("127.0.0.1", closed))
conn(socket.AF_INET6, ("::1", closed))
conn(socket.AF_UNIX, unix_path)

# -- writes: 8 opens for writing (open, openat, openat2, creat), 2 read-only opens
fd = os.open("w.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.close(fd)
fd = os.open(os.fsencode(d) + b"/bad-\xff\xfe.txt", os.O_WRONLY | os.O_CREAT, 0o644); os.close(fd)
dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)                     # read-only: not reported
fd = os.open("via-dirfd.txt", os.O_RDWR | os.O_CREAT, 0o600, dir_fd=dfd); os.close(fd)
fd = os.open("w.txt", os.O_WRONLY | os.O_APPEND); os.close(fd)
fd = os.open("w.txt", os.O_RDONLY); os.close(fd)                     # read-only: not reported
try:
    os.open("/nonexistent-dir/x", os.O_WRONLY | os.O_CREAT, 0o644)
except OSError:
    pass
fd = libc.syscall(2, b"sys-open.txt", os.O_WRONLY | os.O_CREAT, 0o644); os.close(fd)   # open(2)
fd = libc.syscall(85, b"sys-creat.txt", 0o644); os.close(fd)                          # creat(2)
how = (ctypes.c_uint64 * 3)(os.O_WRONLY | os.O_CREAT, 0o644, 0)
fd = libc.syscall(437, -100, b"sys-openat2.txt", ctypes.byref(how), 24); os.close(fd)  # openat2(2)

# -- one rename, one unlink
os.rename("w.txt", "renamed.txt")
os.unlink("renamed.txt")

print(json.dumps({"pid": os.getpid(), "children": children}), flush=True)
sys.stdin.readline()
sys.exit(0)
'''

FLOOD = r'''
import os, sys, time
path, n, limit_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
done = 0
for i in range(n):
    fd = os.open(path, os.O_WRONLY)
    os.close(fd)
    done += 1
    if i == 1000:
        print("flooding", flush=True)
    if (i & 255) == 0 and time.monotonic() - t0 > limit_s:
        break
print(done, flush=True)
'''

QUIET = r'''
import os, subprocess, sys
d = sys.argv[1]
for i in range(50):
    fd = os.open(f"{d}/q{i}.txt", os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
for i in range(3):
    subprocess.run(["/bin/true"])
'''


def _write(path, text, mode=0o644):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _kinds(records) -> dict:
    out = {}
    for r in records:
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return out


def _extra(rec) -> dict:
    return json.loads(rec["extra"]) if rec["extra"] else {}


def _kill(p):
    if p.poll() is None:
        p.kill()
        p.wait(10)


# ---------------------------------------------------------------- completeness

def test_features_present():
    assert check_features() == []


def test_missing_tracepoints_are_named(tmp_path):
    tps = tracepoints_used()
    assert "sched/sched_process_exec" in tps and "syscalls/sys_enter_openat2" in tps
    for tp in tps[1:]:                                   # a tracefs without the first one
        (tmp_path / "events" / tp).mkdir(parents=True)
    with pytest.raises(DsecError) as e:
        require_features(tracefs_roots=(str(tmp_path),))
    assert str(e.value) == f"eBPF audit unavailable: tracepoints missing: {tps[0]}"
    with pytest.raises(DsecError, match="tracefs not mounted"):
        require_features(tracefs_roots=(str(tmp_path / "nowhere"),))


def test_compile_failure_is_one_clear_line():
    cflags = build_cflags(ring_bytes=1 << 20, argv_bytes=4096, max_args=8, max_inflight=8)
    with pytest.raises(DsecError) as e:
        compile_bpf(cflags + ["-DDSEC_RING_PAGES=)"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("eBPF audit: BPF compile/load failed")
    log = re.search(r"full log: (\S+)\)", msg).group(1)
    assert os.path.getsize(log) > 0
    os.unlink(log)


def test_completeness_and_isolation(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    d_in, d_out = tmp_path / "in", tmp_path / "out"
    d_in.mkdir()
    d_out.mkdir()
    workload = _write(tmp_path / "workload.py", WORKLOAD)
    script = _write(tmp_path / "script.sh", "#!/bin/sh\nexit 0\n", 0o755)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    closed = _free_port()
    unix_in, unix_out = str(tmp_path / "u-in.sock"), str(tmp_path / "u-out.sock")
    unix_listeners = []
    for path in (unix_in, unix_out):
        u = socket.socket(socket.AF_UNIX)
        u.bind(path)
        u.listen(16)
        unix_listeners.append(u)

    sbx = h.sandbox(audit_cgroups)
    unattributed = h.sensor.decoder.unattributed
    t_start = time.time_ns()
    args = [PYTHON, "-I", "-B", workload]
    inside = run_in_cgroup(sbx.cg, args + [str(d_in), str(port), str(closed), unix_in, script],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    outside = run_in_cgroup(None, args + [str(d_out), str(port), str(closed), unix_out, script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        info_in = json.loads(inside.stdout.readline())
        info_out = json.loads(outside.stdout.readline())
        pid = info_in["pid"]
        # the workload waits (cwd, dirfd still open) until its records are decoded
        assert h.poll_until(lambda: len(sbx.of_kind("unlink")) >= 1, 20)
        h.sensor.set_step(sbx.cg.id, 5)
        for p in (inside, outside):
            p.stdin.write(b"\n")
            p.stdin.close()
            assert p.wait(30) == 0
        assert h.poll_until(lambda: any(r["kind"] == "exit" and r["pid"] == pid for r in sbx.records), 20)
    finally:
        _kill(inside)
        _kill(outside)
        listener.close()
        for u in unix_listeners:
            u.close()
    stats = h.sensor.stats(sbx.cg.id)
    totals = sbx.remove()
    t_end = time.time_ns()
    recs = sorted(sbx.records, key=lambda r: r["ts_ns"])
    by = {k: [r for r in recs if r["kind"] == k] for k in ("exec", "fork", "exit", "connect",
                                                             "open_write", "unlink", "rename")}

    # -- exactly these counts; the kernel emitted nothing more, lost nothing
    assert _kinds(recs) == {"exec": 9, "fork": 8, "exit": 9, "connect": 4,
                            "open_write": 8, "unlink": 1, "rename": 1}, _kinds(recs)
    assert stats["emitted"] == _kinds(recs)
    assert totals["lost_total"] == 0 and not sbx.of_kind("events_lost")

    # -- common fields
    ids = [r["event_id"] for r in recs]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    for r in recs:
        assert set(r) == set(FIELD_NAMES)
        assert r["sandbox_id"] == sbx.sandbox_id and r["node"] == h.sensor.decoder.node
        assert t_start - 10**9 < r["ts_ns"] < t_end + 10**9
        assert r["uid"] == os.getuid()
        assert r["pid"] > 0 and r["ppid"] > 0
    children = set(info_in["children"])
    family = {pid} | {r["child_pid"] for r in by["fork"]}
    assert {r["pid"] for r in recs} <= family
    assert children <= family

    # -- execs
    execs = by["exec"]
    first = execs[0]
    assert first["pid"] == pid and first["path"] == PYTHON and first["ret"] == 0
    assert first["argv"][:4] == args and first["comm"] == "python3"
    assert first["sha256"] == _sha256(os.path.realpath(PYTHON))
    assert re.fullmatch(r"[0-9a-f]{40}", first["build_id"]) and first["interp"] and first["is_static"] == 0
    rest = {tuple(r["argv"][:2]): r for r in execs[1:]}
    for r in execs[1:]:
        assert r["ppid"] == pid, r
    big = next(r for r in execs if r["argv_truncated"])
    assert big["path"] == "/bin/true" and big["argv"][0] == "/bin/true"
    captured = big["argv"][1:]
    assert 1 <= len(captured) < 100
    assert all(a == "A" * 2047 for a in captured[:-1]) and "A" * 2047 >= captured[-1] > ""
    assert sum(len(to_bytes(a)) + 1 for a in big["argv"]) <= ARGV_BYTES
    assert all(not r["argv_truncated"] for r in execs if r is not big)
    odd = rest[("/bin/true", "arg-\udcff\udcfe")]
    assert to_bytes(odd["argv"][1]) == b"arg-\xff\xfe"
    sh = rest[("/bin/sh", "-c")]
    assert sh["argv"] == ["/bin/sh", "-c", "exit 3"]
    scr = next(r for r in execs if r["path"] == script)
    assert scr["shebang"] == "/bin/sh" and scr["sha256"] == _sha256(script) and scr["build_id"] == ""
    assert big["sha256"] == _sha256(os.path.realpath("/bin/true"))     # read through the sandbox
    assert all(r["sha256"] for r in execs if r["ret"] == 0)
    failed = [r for r in execs if r["ret"] != 0]
    assert len(failed) == 1 and failed[0]["path"] == "/nonexistent/prog" and failed[0]["ret"] == -2
    assert failed[0]["sha256"] == ""

    # -- forks and exits
    assert all(r["pid"] == pid for r in by["fork"])
    exits = {r["pid"]: r for r in by["exit"]}
    exec_of = {r["pid"]: r for r in execs}
    codes = sorted((tuple(exec_of[p]["argv"][:2]) if p in exec_of else None, x["exit_code"], x["signal"])
                   for p, x in exits.items() if p != pid)
    assert (("/bin/sh", "-c"), 3, 0) in codes
    assert (("/bin/sleep", "30"), -1, 15) in codes and (("/bin/sleep", "30"), -1, 9) in codes
    assert [c[1:] for c in codes].count((255, 0)) == 1           # the failed exec's child
    assert exits[pid]["exit_code"] == 0 and exits[pid]["step"] == 5
    assert all(r["step"] == 0 for r in recs if r is not exits[pid])

    # -- connects
    conns = by["connect"]
    assert [(r["family"], r["addr"], r["port"]) for r in conns] == [
        ("ipv4", "127.0.0.1", port), ("ipv4", "127.0.0.1", closed), ("ipv6", "::1", closed),
        ("unix", unix_in, 0)]
    assert conns[0]["ret"] == 0 and conns[1]["ret"] == -111 and conns[2]["ret"] < 0 and conns[3]["ret"] == 0

    # -- writes: paths resolved against cwd / dirfd, raw path kept
    din = str(d_in)
    opens = by["open_write"]
    assert [r["path"] for r in opens] == [
        f"{din}/w.txt", f"{din}/bad-\udcff\udcfe.txt", f"{din}/via-dirfd.txt", f"{din}/w.txt",
        "/nonexistent-dir/x", f"{din}/sys-open.txt", f"{din}/sys-creat.txt", f"{din}/sys-openat2.txt"]
    assert [r["path_raw"] for r in opens][:3] == ["w.txt", f"{din}/bad-\udcff\udcfe.txt", "via-dirfd.txt"]
    assert to_bytes(opens[1]["path"]) == os.fsencode(din) + b"/bad-\xff\xfe.txt"
    assert [_extra(r)["syscall"] for r in opens] == ["openat"] * 5 + ["open", "creat", "openat2"]
    assert opens[2]["dirfd"].isdigit() and opens[0]["dirfd"] == "AT_FDCWD"
    # relative names joined with the cwd / dirfd read after the fact: never more than best effort
    assert [r["path_resolution"] for r in opens] == ["best_effort", "exact", "best_effort", "best_effort",
                                                     "exact", "best_effort", "best_effort", "best_effort"]
    assert opens[3]["flags"] & os.O_APPEND and opens[0]["flags"] & os.O_TRUNC
    assert [r["ret"] >= 0 for r in opens] == [True] * 4 + [False] + [True] * 3
    assert opens[4]["ret"] == -2
    ren, unl = by["rename"][0], by["unlink"][0]
    assert (ren["path"], ren["path2"], ren["path_raw"]) == (f"{din}/w.txt", f"{din}/renamed.txt", "w.txt")
    assert _extra(ren)["path2_raw"] == "renamed.txt" and ren["ret"] == 0
    assert unl["path"] == f"{din}/renamed.txt" and unl["ret"] == 0

    # -- the same actions outside the sandbox: nothing
    outside_pids = {info_out["pid"], *info_out["children"]}
    for recs_of in h.records.values():
        for r in recs_of:
            assert r["pid"] not in outside_pids
            assert str(d_out) not in r["path"] + r["path2"]
            assert unix_out != r["addr"]
    assert h.sensor.decoder.unattributed == unattributed


EXIT_CASES = {
    "exit_group_from_thread": "import os, threading, time\n"
                              "threading.Thread(target=lambda: os._exit(7)).start(); time.sleep(30)",
    "sigterm_multithreaded": "import os, signal, threading, time\n"
                             "threading.Thread(target=time.sleep, args=(30,)).start()\n"
                             "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
    "segfault": "import ctypes; ctypes.string_at(0)",
    "abort": "import os; os.abort()",
    "handled_signal_then_exit": "import os, signal, sys\n"
                                "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
                                "os.kill(os.getpid(), signal.SIGUSR1); sys.exit(4)",
    "threads_exit_last_wins": "import ctypes, threading, time\nlibc = ctypes.CDLL(None)\n"
                              "threading.Thread(target=lambda: (time.sleep(0.3), libc.syscall(60, 9))).start()\n"
                              "libc.syscall(60, 5)",
    "exec_from_thread": "import os, threading, time\n"
                        "threading.Thread(target=os.execv, args=('/bin/true', ['/bin/true', 'from-thread'])).start()\n"
                        "time.sleep(30)",
}


@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_exit_status_matches_the_kernel(audit_sensor, audit_cgroups, case):
    """The recorded exit code or signal is what wait() reports."""
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", EXIT_CASES[case]], stderr=subprocess.DEVNULL)
    try:
        p.wait(30)
    finally:
        _kill(p)
    assert h.poll_until(lambda: any(r["kind"] == "exit" and r["pid"] == p.pid for r in sbx.records), 10)
    (ex,) = [r for r in sbx.records if r["kind"] == "exit"]
    rc = p.returncode
    assert (ex["exit_code"], ex["signal"]) == ((rc, 0) if rc >= 0 else (-1, -rc))
    if case == "exec_from_thread":
        last = sbx.of_kind("exec")[-1]
        assert last["argv"] == ["/bin/true", "from-thread"] and last["pid"] == p.pid
        assert _extra(last)["old_tid"] != p.pid


def test_sub_cgroup_is_audited(audit_sensor, audit_cgroups):
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    inner = sbx.cg.child("inner")
    p = run_in_cgroup(inner, ["/bin/true", "nested"])
    assert p.wait(30) == 0
    assert h.poll_until(lambda: any(r["kind"] == "exit" for r in sbx.records), 10)
    assert [r["argv"] for r in sbx.of_kind("exec")] == [["/bin/true", "nested"]]


def test_an_empty_cgroup_is_known_and_its_removal_fenced(audit_sensor, audit_cgroups):
    """cgroup_populated says False only when no task can run in the cgroup (or below it): its
    cgroup.events says populated 0, or it is gone; then remove_sandbox reads the ring up to its
    producer position (a fence) instead of sleeping REMOVAL_SETTLE_S, and has every record."""
    from agent.sandbox.cgroups import cgroup_populated
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    cg = sbx.cg
    assert not cgroup_populated(cg.path, cg.id)
    assert cgroup_populated(None, cg.id) and cgroup_populated(cg.path, cg.id + 1)   # unknown: may run
    p = run_in_cgroup(cg.child("inner"), ["/bin/sh", "-c", "/bin/true fenced; exec sleep 30"])
    assert h.poll_until(lambda: ["sleep", "30"] in [r["argv"] for r in sbx.of_kind("exec")], 10)
    assert cgroup_populated(cg.path, cg.id)                                         # through "inner"
    p.kill()
    p.wait(10)
    deadline = time.monotonic() + 10
    while cgroup_populated(cg.path, cg.id) and time.monotonic() < deadline:
        time.sleep(0.01)
    fences = h.sensor.fences
    sbx.totals = h.sensor.remove_sandbox(cg.id, cgroup_path=cg.path)
    assert h.sensor.fences == fences + 1
    assert sbx.totals["emitted"] == {k: len(sbx.of_kind(k)) for k in sbx.totals["emitted"]}
    assert ["/bin/true", "fenced"] in [r["argv"] for r in sbx.of_kind("exec")]
    os.rmdir(os.path.join(cg.path, "inner"))
    assert not cgroup_populated(os.path.join(cg.path, "inner"), 0)                 # gone


def test_a_drain_for_one_sandbox_reads_only_its_state(audit_sensor, audit_cgroups):
    """A sandbox's end drains the ring for it (Recorder.catch_up): its losses and repeats are
    read, not every live sandbox's (those come at the periodic flush). Reading them all made
    each close cost a map look-up per live sandbox: 7.5 ms a close beside 100 idle ones, 4.1
    without (docs/launch-figures.md)."""
    h = audit_sensor
    sbxs = [h.sandbox(audit_cgroups) for _ in range(3)]
    read = []
    real = h.sensor._read_state
    h.sensor._read_state = lambda cgid: read.append(cgid) or real(cgid)
    try:
        h.sensor.drain(sbxs[1].cg.id)
        assert read == [sbxs[1].cg.id]
        read.clear()
        h.sensor.drain()
        assert set(read) >= {s.cg.id for s in sbxs}
    finally:
        del h.sensor._read_state


# ---------------------------------------------------------------- losses

def _flood(cg, target, n=20000, limit_s=5.0, **kw):
    return run_in_cgroup(cg, [PYTHON, "-I", "-B", "-c", FLOOD, target, str(n), str(limit_s)],
                         stdout=subprocess.PIPE, **kw)


def _lost_records(sbx, reason):
    return [r for r in sbx.of_kind("events_lost") if _extra(r)["reason"] == reason]


def test_ring_buffer_overflow_is_counted(audit_sensor_small, audit_cgroups, tmp_path):
    h = audit_sensor_small
    target = tmp_path / "flood.txt"
    target.touch()
    sbx = h.sandbox(audit_cgroups)
    p = _flood(sbx.cg, str(target))          # nobody polls meanwhile: the ring fills up
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        _kill(p)
    done = int(out.split()[-1])
    totals = sbx.remove()
    delivered = len([r for r in sbx.of_kind("open_write") if r["path"] == str(target)])
    lost = totals["lost"]["ringbuf_full"]["open_write"]
    assert delivered + lost == done                        # every open accounted for, exactly
    capacity = (128 << 10) // 224                          # records of the fixed size alone
    assert delivered <= capacity and lost >= done - capacity
    assert lost > done // 2                                # the right order of magnitude
    reported = _lost_records(sbx, "ringbuf_full")
    assert sum(r["count"] for r in reported) == sum(totals["lost"]["ringbuf_full"].values())
    assert sum(r["count"] for r in sbx.of_kind("events_lost")) == totals["lost_total"]
    assert all(r["sandbox_id"] == sbx.sandbox_id for r in reported)


def test_over_budget_is_counted(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    target = tmp_path / "flood.txt"
    target.touch()
    sbx = h.sandbox(audit_cgroups, rate=1000, burst=100)
    t0 = time.monotonic()
    p = _flood(sbx.cg, str(target))
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        _kill(p)
    elapsed = time.monotonic() - t0
    done = int(out.split()[-1])
    h.sensor.drain()
    totals = sbx.remove()
    delivered = len([r for r in sbx.of_kind("open_write") if r["path"] == str(target)])
    over = totals["lost"]["over_budget"]["open_write"]
    assert delivered + over == done
    assert 90 <= delivered <= 100 + 1000 * elapsed + 5     # burst + rate x time bounds the admitted
    assert over > done // 2
    assert "ringbuf_full" not in totals["lost"]
    reported = _lost_records(sbx, "over_budget")
    assert sum(_extra(r)["kinds"].get("open_write", 0) for r in reported) == over


def test_the_periodic_flush_reads_what_changed(audit_sensor, audit_cgroups, tmp_path):
    """Every loss_interval_s the sensor reads all states in one batch read and flushes only
    the sandboxes whose state changed: a sandbox going over its budget has its losses
    reported while it runs; an idle one is flushed once (its first period), not again."""
    h = audit_sensor
    target = tmp_path / "flood.txt"
    target.touch()
    busy = h.sandbox(audit_cgroups, rate=1000, burst=100)
    idle = h.sandbox(audit_cgroups)
    flushed = []
    real = h.sensor._flush_losses
    h.sensor._flush_losses = lambda cgid, *a, **kw: flushed.append(cgid) or real(cgid, *a, **kw)
    p = _flood(busy.cg, str(target))
    try:
        assert h.poll_until(lambda: _lost_records(busy, "over_budget"), 10)     # while it runs
        p.communicate(timeout=60)
        h.poll_until(lambda: False, 4 * h.sensor.loss_interval_s)               # quiet periods
        after = flushed.count(busy.cg.id)
        h.poll_until(lambda: False, 4 * h.sensor.loss_interval_s)
        assert flushed.count(busy.cg.id) == after          # its state no longer changes
        assert flushed.count(idle.cg.id) <= 1              # its first period only
    finally:
        del h.sensor._flush_losses
        _kill(p)


def test_flooding_sandbox_leaves_quiet_one_complete(audit_sensor_small, audit_cgroups, tmp_path):
    """Nobody polls while both run, so the small ring holds everything: with
    the flooder held to its fair share the quiet sandbox loses nothing; with
    the flooder unlimited it does (the control)."""
    h = audit_sensor_small
    target = tmp_path / "flood.txt"
    target.touch()
    quiet_prog = _write(tmp_path / "quiet.py", QUIET)
    results = {}
    for limited in (True, False):
        qdir = tmp_path / f"quiet-{limited}"
        qdir.mkdir()
        flooder = h.sandbox(audit_cgroups, **({"rate": 50, "burst": 50} if limited else {"rate": 0}))
        quiet = h.sandbox(audit_cgroups)
        fp = _flood(flooder.cg, str(target), limit_s=3.0)
        qp = None
        try:
            assert fp.stdout.readline().strip() == b"flooding"
            qp = run_in_cgroup(quiet.cg, [PYTHON, "-I", "-B", quiet_prog, str(qdir)])
            assert qp.wait(60) == 0
            fp.communicate(timeout=60)
        finally:
            _kill(fp)
            if qp is not None:
                _kill(qp)
        q_totals = quiet.remove()
        f_totals = flooder.remove()
        results[limited] = (quiet, q_totals, f_totals)

    quiet, q_totals, f_totals = results[True]
    assert q_totals["lost_total"] == 0
    assert len([r for r in quiet.of_kind("open_write") if r["path"].startswith(str(tmp_path))]) == 50
    assert len(quiet.of_kind("exec")) == 4 and len(quiet.of_kind("exit")) == 4
    assert f_totals["lost"].get("over_budget", {}).get("open_write", 0) > 1000
    assert "ringbuf_full" not in f_totals["lost"]

    quiet, q_totals, f_totals = results[False]
    assert q_totals["lost"].get("ringbuf_full")            # the control: without a budget it loses
    assert sum(r["count"] for r in quiet.of_kind("events_lost")) == q_totals["lost_total"]


def test_stop_mode_kills_and_notifies(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    target = tmp_path / "flood.txt"
    target.touch()
    sbx = h.sandbox(audit_cgroups, rate=20, burst=10, over_budget="stop")
    calls = len(h.over_budget_calls)
    p = _flood(sbx.cg, str(target))
    try:
        p.communicate(timeout=60)
    finally:
        _kill(p)
    assert p.returncode == -signal.SIGKILL
    assert h.poll_until(lambda: len(h.over_budget_calls) > calls, 10)
    cgid, sid, lost = h.over_budget_calls[calls]
    assert (cgid, sid) == (sbx.cg.id, sbx.sandbox_id) and lost["over_budget"]
    assert h.sensor.stopped(sbx.cg.id)
    h.sensor.poll(10)
    assert len(h.over_budget_calls) == calls + 1              # once per sandbox


# ---------------------------------------------------------------- API errors

def test_a_removed_sandbox_stays_removed(audit_sensor, audit_cgroups):
    """set_step writes the configuration the sensor keeps, without reading the kernel's back:
    once remove_sandbox has taken the kernel's entry away, a step of that sandbox is refused
    and never puts the entry back (its tasks' events would be admitted again, unowned)."""
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    m = h.sensor._sandboxes_map
    h.sensor.set_step(sbx.cg.id, 3)
    assert m[m.Key(sbx.cg.id)].step == 3
    sbx.remove()
    with pytest.raises(DsecError, match="is not audited"):
        h.sensor.set_step(sbx.cg.id, 4)
    with pytest.raises(KeyError):
        m[m.Key(sbx.cg.id)]


def test_bad_configuration_is_a_clear_error(audit_sensor, audit_cgroups):
    s = audit_sensor.sensor
    with pytest.raises(DsecError, match="unknown label"):
        s.add_sandbox(12345, "x", colour="red")
    with pytest.raises(DsecError, match="over_budget must be one of"):
        s.add_sandbox(12345, "x", over_budget="explode")
    with pytest.raises(DsecError, match="not audited"):
        s.remove_sandbox(12345)
    with pytest.raises(DsecError, match="power-of-two"):
        build_cflags(ring_bytes=3 << 12, argv_bytes=16384, max_args=256, max_inflight=8)
    with pytest.raises(DsecError, match="argv bound"):
        build_cflags(ring_bytes=1 << 20, argv_bytes=1000, max_args=256, max_inflight=8)
    with pytest.raises(DsecError, match="rate must be"):
        _budget(-1, 10, "summarise")
    sbx = audit_sensor.sandbox(audit_cgroups)
    with pytest.raises(DsecError, match="already audited"):
        s.add_sandbox(sbx.cg.id, "again")


# ---------------------------------------------------------------- decoder pieces

def test_undecodable_records_are_not_silent(audit_sensor):
    d = audit_sensor.sensor.decoder
    before = d.undecodable
    assert d.decode(b"\0" * 10) is None and d.undecodable == before + 1
    ev = audit_sensor.sensor.bpf[b"exec_scratch"].Leaf()
    ev.h.cgroup_id, ev.h.kind, ev.h.step = 987654321, 99, 3
    raw = bytes(ev)[: d.fixed]
    from agent.sensors.decoder import SandboxInfo
    d.register(SandboxInfo(987654321, "sbx-decode"))
    try:
        rec = d.decode(raw)
    finally:
        d.forget(987654321)
    assert rec["kind"] == "events_lost" and rec["count"] == 1 and rec["step"] == 3
    assert _extra(rec)["reason"] == "decode_error" and _extra(rec)["kinds"] == {"99": 1}
    assert d.undecodable == before + 2


def test_sockaddr_decoding():
    import struct
    v4 = struct.pack("<H", 2) + struct.pack(">H", 8080) + bytes([10, 0, 0, 1]) + b"\0" * 8
    assert decode_sockaddr(v4, 16)[:3] == ("ipv4", "10.0.0.1", 8080)
    v6 = struct.pack("<H", 10) + struct.pack(">H", 443) + b"\0" * 4 + bytes(15) + b"\1" + struct.pack("<I", 0)
    assert decode_sockaddr(v6, 28)[:3] == ("ipv6", "::1", 443)
    un = struct.pack("<H", 1) + b"/run/x\xff.sock\0"
    assert decode_sockaddr(un, len(un))[:2] == ("unix", "/run/x\udcff.sock")
    abstract = struct.pack("<H", 1) + b"\0name"
    assert decode_sockaddr(abstract, len(abstract))[:2] == ("unix", "@name")
    assert decode_sockaddr(b"\x11\x00", 2)[0] == "other"
    assert decode_sockaddr(b"", 0)[0] == "other"


def test_paths_resolve_in_the_sandbox_view(tmp_path):
    """A chrooted process: its cwd and fds are reported as seen from its root."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    code = ("import os, sys, time; os.chroot(sys.argv[1]); os.chdir('/sub'); "
            "fd = os.open('/sub', os.O_RDONLY); print(fd, flush=True); time.sleep(60)")
    p = subprocess.Popen([PYTHON, "-I", "-c", code, str(root)], stdout=subprocess.PIPE)
    try:
        fd = int(p.stdout.readline())
        assert resolve_path(p.pid, b"x.txt", AT_FDCWD) == b"/sub/x.txt"
        assert resolve_path(p.pid, b"./a//b/../c", AT_FDCWD) == b"/sub/a/b/../c"
        assert resolve_path(p.pid, b"y", fd) == b"/sub/y"
        assert resolve_path(p.pid, b"/abs", AT_FDCWD) == b"/abs"
        assert resolve_path(p.pid, b"y", 999) is None
        assert sandbox_view(p.pid, os.fsencode(root)) == b"/"
    finally:
        _kill(p)
    assert resolve_path(p.pid, b"x", AT_FDCWD) is None        # gone: unresolved, not guessed


EXEC_FLOOD = r'''
import os, sys
n = int(sys.argv[1])
argv = ["x" * 1023] * 16                      # 16 KiB of argv: a ~20 KiB record each
for i in range(n):
    try:
        os.execv("/nonexistent-dsec-flood", argv)
    except OSError:
        pass
    if i == 100:
        print("flooding", flush=True)
print(n, flush=True)
'''

QUIET_WRITES = r'''
import os, sys
d = sys.argv[1]
for i in range(100):
    fd = os.open(f"{d}/w{i}.txt", os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
'''


def test_byte_heavy_flood_leaves_quiet_neighbour_complete(audit_sensor, audit_cgroups, tmp_path):
    """Issue 13 point 1: failing execve with 16 KiB of argv, 3,000 times, while
    nobody reads the ring: within the event budget (rate 5000, burst 25000) but
    ~60 MiB of records for a 32 MiB ring. The byte budget holds the flooder to its
    share; the quiet neighbour's 100 writes are all recorded, and the flooder's
    loss is accounted in its own record (over_bytes)."""
    h = audit_sensor
    quiet_prog = _write(tmp_path / "quiet.py", QUIET_WRITES)
    qdir = tmp_path / "quiet"
    qdir.mkdir()
    flooder = h.sandbox(audit_cgroups)
    quiet = h.sandbox(audit_cgroups)
    fp = run_in_cgroup(flooder.cg, [PYTHON, "-I", "-B", "-c", EXEC_FLOOD, "3000"], stdout=subprocess.PIPE)
    qp = None
    try:
        assert fp.stdout.readline().strip() == b"flooding"
        fp.communicate(timeout=120)
        qp = run_in_cgroup(quiet.cg, [PYTHON, "-I", "-B", quiet_prog, str(qdir)])
        assert qp.wait(60) == 0
    finally:
        _kill(fp)
        if qp is not None:
            _kill(qp)
    q_totals = quiet.remove()
    f_totals = flooder.remove()
    assert q_totals["lost_total"] == 0, q_totals
    writes = [r for r in quiet.of_kind("open_write") if r["path"].startswith(str(qdir))]
    assert len(writes) == 100
    over = f_totals["lost"].get("over_bytes", {}).get("exec", 0)
    assert over > 1000, f_totals
    assert "ringbuf_full" not in f_totals["lost"]
    failed = [r for r in flooder.of_kind("exec") if r["ret"] != 0]
    assert len(failed) + over == 3000                       # every failing exec accounted for
    reported = _lost_records(flooder, "over_bytes")
    assert sum(_extra(r)["kinds"].get("exec", 0) for r in reported) == over
    assert all(r["sandbox_id"] == flooder.sandbox_id for r in reported)


def test_enrichment_never_holds_up_decoding(audit_sensor, audit_cgroups, tmp_path):
    """Issue 13 point 3: sha256/build-id were computed on the decode path, so a
    sandbox exec'ing large files nobody has read yet stalled every sandbox's
    record. Now a neighbour's exec, emitted after the flooder's, is delivered
    before the flooder's earlier ones that wait to be hashed (strict FIFO
    before); the flooder's beyond its per-sandbox queue say why they were not
    hashed; a file over the cap is not hashed and says so; and removing a
    sandbox with files still queued returns every one of its exec records."""
    h = audit_sensor
    with open("/usr/bin/true", "rb") as f:
        body = f.read()

    def elf(name, size):                            # a valid ELF, sparse up to `size`: distinct inodes
        p = tmp_path / name
        with open(p, "wb") as f:
            f.write(body)
            f.truncate(size)
        os.chmod(p, 0o755)
        return str(p)
    bigs = [elf(f"big{i}", 32 << 20) for i in range(20)]   # under the 64 MiB cap: hashed off the decode path
    huge = elf("huge", 1 << 30)                            # 1 GiB: over the cap
    digest = _sha256(bigs[0])                              # all the same content
    flooder, quiet = h.sandbox(audit_cgroups), h.sandbox(audit_cgroups)
    roots = [run_in_cgroup(sb.cg, ["sleep", "120"]) for sb in (flooder, quiet)]
    order = []                                      # (sandbox id, record) in delivery order, all sandboxes
    route = h.sensor.on_record

    def spy(rec):
        route(rec)
        order.append(rec)
    procs = []
    h.sensor.on_record = spy
    try:
        h.sensor.drain()
        for sb, r in zip((flooder, quiet), roots):
            h.sensor.set_root_pid(sb.cg.id, r.pid)
        script = "; ".join(bigs[:12]) + f"; echo go; read x; {huge}; echo done"
        fp = run_in_cgroup(flooder.cg, ["/bin/sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(fp)
        assert fp.stdout.readline() == b"go\n"
        qp = run_in_cgroup(quiet.cg, ["/usr/bin/true"])
        procs.append(qp)
        assert qp.wait(30) == 0

        def quiet_exec():
            return [r for r in quiet.of_kind("exec") if r["path"] == "/usr/bin/true"]
        assert h.poll_until(quiet_exec, 60)
        q = quiet_exec()[0]
        assert q["sha256"] == _sha256("/usr/bin/true") and q["build_id"]

        h.sensor.drain()                              # the flooder's queue read: room for the huge file
        fp.stdin.write(b"\n")
        fp.stdin.flush()
        assert fp.stdout.readline() == b"done\n"
        assert fp.wait(60) == 0
        h.sensor.drain()
        at = next(i for i, r in enumerate(order) if r is q)
        earlier = [i for i, r in enumerate(order) if r["sandbox_id"] == flooder.sandbox_id
                   and r["path"] in bigs and r["ts_ns"] < q["ts_ns"]]
        # decoding did not wait for the flooder's files (before, every earlier record came first)
        assert len(earlier) == 12 and max(earlier) > at, (earlier, at)
        execs = [r for r in flooder.of_kind("exec") if r["path"] in bigs]
        assert sorted(r["path"] for r in execs) == sorted(bigs[:12])      # every exec recorded, once
        hashed = [r for r in execs if r["sha256"]]
        skipped = [_extra(r)["sha256_skipped"] for r in execs if not r["sha256"]]
        assert hashed and all(r["sha256"] == digest and r["build_id"] for r in hashed)
        assert skipped and set(skipped) == {QUEUE_FULL}, skipped          # 8 queued, the rest not
        (h1,) = [r for r in flooder.of_kind("exec") if r["path"] == huge]
        assert h1["sha256"] == "" and "> cap" in _extra(h1)["sha256_skipped"] and _extra(h1)["file_type"] == "elf"

        # removal with files still queued: bounded, and every record comes back
        p2 = run_in_cgroup(flooder.cg, ["/bin/sh", "-c", "; ".join(bigs[12:])])
        procs.append(p2)
        assert p2.wait(30) == 0
        totals = flooder.remove()
        late = [r for r in flooder.of_kind("exec") if r["path"] in bigs[12:]]
        assert sorted(r["path"] for r in late) == sorted(bigs[12:])
        assert all(r["sha256"] == digest or _extra(r)["sha256_skipped"].startswith(ENDED) for r in late)
        assert totals["lost_total"] == 0 and quiet.remove()["lost_total"] == 0
    finally:
        h.sensor.on_record = route
        for p in roots + procs:
            _kill(p)
