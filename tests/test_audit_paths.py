"""Issue 13 point 6: a sandbox cannot blind or mislead its own audit.

Paths: the record keeps what the kernel was given (the dirfd, or AT_FDCWD, and
the name) and says how `path` was obtained: "exact" (the name was absolute),
"best_effort" (a relative name joined, after the fact, with what /proc shows
for the cwd or the dirfd: it may have changed since), "unresolved" (the base
is gone; `path` is the name as given). A guess is never presented as fact.

In flight: syscalls between enter and exit are bounded per sandbox and per
kind (512 threads blocked in open(fifo) hide the sandbox's opens, not its
connects, execs or unlinks), the node-wide table keeps a reserve for sandboxes
with few syscalls in flight (others filling it leave a quiet neighbour whole),
and every loss is in the sandbox's own record (events_lost, reason
inflight_full, by kind); over_budget: stop applies to it too.

Real kernel, real sensor (tests/fixtures_bpf.py), real ClickHouse (18.16) and
chdb (a current engine) for the schema.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid

import pytest

from agent.sensors.audit import AuditSensor
from audit_schema import migrations
from audit_schema.events import BY_NAME
from fixtures_bpf import PYTHON, Harness, run_in_cgroup
from test_bpf_audit import _extra, _kill

PATHS = r'''
import json, os, sys
d = sys.argv[1]
secret, decoy = os.path.join(d, "secret"), os.path.join(d, "decoy")
os.mkdir(secret); os.mkdir(decoy)
os.chdir(d)
W = os.O_WRONLY | os.O_CREAT
# A: openat(dirfd, "shadow"), then the dirfd closed and its number reused for another directory
dfd = os.open(secret, os.O_RDONLY | os.O_DIRECTORY)
os.close(os.open("shadow", W, 0o600, dir_fd=dfd))
os.close(dfd)
reused = os.open(decoy, os.O_RDONLY | os.O_DIRECTORY)
assert reused == dfd, (reused, dfd)
# B: openat(dirfd, "passwd"), then the dirfd closed (nothing reuses it)
gone = os.open(secret, os.O_RDONLY | os.O_DIRECTORY)
os.close(os.open("passwd", W, 0o600, dir_fd=gone))
os.close(gone)
# C: an absolute name
os.close(os.open(os.path.join(secret, "abs"), W, 0o600))
# D: relative to the cwd, then the cwd changed
os.close(os.open("cwd-rel", W, 0o600))
os.chdir(decoy)
print(json.dumps({"dirfd": dfd, "gone": gone}), flush=True)
sys.stdin.readline()
'''


def test_path_records_keep_dirfd_and_name_and_never_present_a_guess_as_fact(audit_sensor, audit_cgroups,
                                                                           tmp_path):
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    d = str(tmp_path)
    # nobody polls while the workload runs: its records are decoded after it has closed,
    # reused and changed what the relative names were relative to
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", PATHS, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        info = json.loads(p.stdout.readline())
        assert h.poll_until(lambda: len(sbx.of_kind("open_write")) >= 4, 20)
        p.stdin.write(b"\n")
        p.stdin.close()
        assert p.wait(30) == 0
    finally:
        _kill(p)
    sbx.remove()
    opens = {r["path_raw"]: r for r in sbx.of_kind("open_write")}
    a, b, c, dd = opens["shadow"], opens["passwd"], opens[f"{d}/secret/abs"], opens["cwd-rel"]
    # what the kernel was given: the dirfd (or AT_FDCWD) and the name
    assert (a["dirfd"], b["dirfd"]) == (str(info["dirfd"]), str(info["gone"]))
    assert c["dirfd"] == dd["dirfd"] == "AT_FDCWD"
    # A: /proc now shows the decoy behind that fd number: the join is marked best-effort,
    # never given as the path that was written
    assert a["path"] == f"{d}/decoy/shadow" and a["path_resolution"] == "best_effort", a
    # B: nothing behind the fd any more: the name as given, marked unresolved
    assert b["path"] == "passwd" and b["path_resolution"] == "unresolved", b
    # C: an absolute name is exact
    assert c["path"] == f"{d}/secret/abs" and c["path_resolution"] == "exact", c
    # D: the cwd changed before the record was read: best-effort
    assert dd["path"] == f"{d}/decoy/cwd-rel" and dd["path_resolution"] == "best_effort", dd
    # the exec of the workload itself: an absolute name
    ex = [r for r in sbx.of_kind("exec") if r["path"] == PYTHON]
    assert ex and all(r["path_resolution"] == "exact" and r["dirfd"] == "AT_FDCWD" for r in ex)
    # records without a path carry neither
    assert all(r["dirfd"] == "" and r["path_resolution"] == "" for r in sbx.of_kind("fork", "exit"))


RENAME = r'''
import os, sys
d = sys.argv[1]
os.chdir(d)
a = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
b = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
open("old", "w").close()
os.rename("old", "/" + d.strip("/") + "/new", src_dir_fd=a)
os.close(a)
os.unlink("new", dir_fd=b)
os.close(b)
'''


def test_rename_and_unlink_carry_both_names_and_their_resolution(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    d = str(tmp_path)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", RENAME, d])
    assert p.wait(30) == 0
    sbx.remove()
    ren = sbx.of_kind("rename")[0]
    ex = _extra(ren)
    assert ren["path_raw"] == "old" and ren["path_resolution"] == "unresolved" and ren["path"] == "old"
    assert ren["dirfd"].isdigit() and ex["path2_resolution"] == "exact" and ren["path2"] == f"{d}/new"
    assert ex["dirfd2"] == "AT_FDCWD"
    unl = sbx.of_kind("unlink")[0]
    assert unl["path"] == "new" and unl["path_resolution"] == "unresolved" and unl["dirfd"].isdigit()


# ---------------------------------------------------------------- in flight

BLOCKED = r'''
import os, socket, subprocess, sys, threading, time
fifo, n, port, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
threading.stack_size(256 << 10)
def block():
    try:
        os.close(os.open(fifo, os.O_WRONLY))     # blocks: nobody reads the fifo yet
    except OSError:
        pass
ts = [threading.Thread(target=block, daemon=True) for _ in range(n)]
for t in ts:
    t.start()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:               # bounded: until every thread is inside open()
    waiting = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                waiting += f.read().strip() == "wait_for_partner"
        except OSError:
            pass
    if waiting >= n:
        break
    time.sleep(0.05)
print(waiting, flush=True)
if len(sys.argv) > 5:                            # "gate": go on when told (several such processes)
    sys.stdin.readline()
# with the sandbox's opens all in flight: its other kinds of records
for i in range(5):
    s = socket.socket()
    s.connect(("127.0.0.1", port))
    s.close()
subprocess.run(["/bin/true"])
for i in range(3):
    os.close(os.open(f"{d}/after-{i}", os.O_WRONLY | os.O_CREAT, 0o600))
    os.unlink(f"{d}/after-{i}")
print("done", flush=True)
sys.stdin.readline()
'''


def _blocked(cg, fifo, n, port, d, gate=False, **kw):
    return run_in_cgroup(cg, [PYTHON, "-I", "-B", "-c", BLOCKED, fifo, str(n), str(port), d]
                         + (["gate"] if gate else []),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kw)


def _release(fifo):
    """Open the fifo for reading: every blocked writer gets through."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.close(fd)


def _listener():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def test_opens_blocked_in_flight_hide_only_opens_and_are_accounted_by_kind(audit_sensor, audit_cgroups, tmp_path):
    """512 + 8 threads in open(fifo, O_WRONLY): the sandbox's open_write in-flight share
    is full; its 3 later opens and the 8 extra blocked ones are lost and accounted
    (inflight_full, open_write: 11) in its own record; its connects, exec, unlinks are
    still recorded (on main they all were lost: one in-flight count for every kind)."""
    h = audit_sensor
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    srv = _listener()
    sbx = h.sandbox(audit_cgroups)
    p = _blocked(sbx.cg, fifo, 520, srv.getsockname()[1], str(tmp_path))
    try:
        assert int(p.stdout.readline()) == 520
        assert p.stdout.readline().strip() == b"done"
        stats = h.sensor.stats(sbx.cg.id)
        _release(fifo)
        p.stdin.write(b"\n")
        p.stdin.close()
        assert p.wait(30) == 0
    finally:
        _kill(p)
        srv.close()
    totals = sbx.remove()
    assert stats["inflight"]["open_write"] == 512, stats
    lost = totals["lost"].get("inflight_full", {})
    assert lost == {"open_write": 8 + 3}, totals
    assert len(sbx.of_kind("connect")) == 5 and len(sbx.of_kind("unlink")) == 3
    assert [r for r in sbx.of_kind("exec") if r["path"] == "/bin/true"]
    assert len([r for r in sbx.of_kind("open_write") if r["path"] == fifo]) == 512
    reported = [r for r in sbx.of_kind("events_lost") if _extra(r)["reason"] == "inflight_full"]
    assert reported and all(r["sandbox_id"] == sbx.sandbox_id for r in reported)
    assert sum(_extra(r)["kinds"].get("open_write", 0) for r in reported) == 11
    assert not any("connect" in _extra(r)["kinds"] for r in reported)


INTERRUPTED = r"""
import os, signal, sys, threading, time
fifo, n, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
class Stop(Exception):
    pass
def stop(*a):
    raise Stop()
signal.signal(signal.SIGUSR1, stop)      # a handler without SA_RESTART: open() returns EINTR
def block():
    os.close(os.open(fifo, os.O_WRONLY))
def waiting():
    w = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                w += f.read().strip() == "wait_for_partner"
        except OSError:
            pass
    return w
def until(k):
    deadline = time.monotonic() + 20
    while waiting() < k and time.monotonic() < deadline:
        time.sleep(0.02)
    return waiting()
ts = [threading.Thread(target=block, daemon=True) for _ in range(n)]
for t in ts:
    t.start()
print(until(n), flush=True)
sys.stdin.readline()                      # the test stops and continues us (SIGSTOP, SIGCONT)
print(until(n), flush=True)               # the opens were restarted: blocked again
try:
    os.open(fifo, os.O_WRONLY)            # blocked too, until SIGUSR1 interrupts it
except Stop:
    pass
os.close(os.open(f"{d}/after", os.O_WRONLY | os.O_CREAT, 0o600))
print("interrupted", flush=True)
for t in ts:
    t.join(30)
print("done", flush=True)
"""


def _tgkill(tgid: int, tid: int, sig: int) -> None:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).syscall(234, tgid, tid, sig) != 0:     # SYS_tgkill (x86-64)
        raise OSError(ctypes.get_errno(), "tgkill")


def test_an_interrupted_syscall_is_one_record_restarted_or_not(audit_sensor, audit_cgroups, tmp_path):
    """A signal wakes a blocked open(fifo) with -ERESTARTSYS at sys_exit; the kernel
    then restarts it (a stop and a continue, a freeze, a handler with SA_RESTART,
    a signal with no handler) or returns EINTR. One syscall of the process, one
    record: the restart's with the final result, not a second one with -512 (seen
    as one fifo record too many in test_opens_blocked_in_flight_... when a SIGCHLD
    woke a blocked thread); an open that really returned EINTR is recorded with
    ret -4 (EINTR), before the thread's next syscall's record."""
    h = audit_sensor
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    sbx = h.sandbox(audit_cgroups)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", INTERRUPTED, fifo, "4", str(tmp_path)],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert int(p.stdout.readline()) == 4
        os.kill(p.pid, signal.SIGSTOP)
        assert h.poll_until(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10)
        os.kill(p.pid, signal.SIGCONT)
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert int(p.stdout.readline()) == 4
        assert h.poll_until(lambda: open(f"/proc/{p.pid}/wchan").read() == "wait_for_partner", 20)
        _tgkill(p.pid, p.pid, signal.SIGUSR1)         # the main thread's open, not a worker's
        assert p.stdout.readline().strip() == b"interrupted"
        _release(fifo)
        assert p.stdout.readline().strip() == b"done"
        assert p.wait(30) == 0
    finally:
        _kill(p)
    totals = sbx.remove()
    assert totals["lost_total"] == 0, totals
    opens = [r for r in sbx.of_kind("open_write") if r["path"] == fifo]
    rets = sorted(r["ret"] for r in opens)
    assert len(opens) == 5 and rets[0] == -4 and all(r >= 0 for r in rets[1:]), rets
    main = [r for r in sbx.of_kind("open_write") if "tid" not in _extra(r)]
    assert [r["path"] for r in main][-2:] == [fifo, str(tmp_path / "after")], [(r["path"], r["ret"]) for r in main]


SWAPPED = r"""
import ctypes, os, sys, threading, time
a, b = sys.argv[1].encode(), sys.argv[2].encode()
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(a, max(len(a), len(b)) + 1)
fds = []
t = threading.Thread(target=lambda: fds.append(libc.open(buf, os.O_WRONLY)), daemon=True)
t.start()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not os.path.exists(f"/proc/self/task/{t.native_id}/wchan"):
    time.sleep(0.01)
while time.monotonic() < deadline and open(f"/proc/self/task/{t.native_id}/wchan").read() != "wait_for_partner":
    time.sleep(0.01)
ctypes.memmove(buf, b, len(b))         # blocked on a; its restart reads b
print(t.native_id, flush=True)
t.join(30)
print(fds[0] >= 0, flush=True)
"""


@pytest.mark.parametrize("b_name", ["fifoB", "fifoB" + "b" * 240])
def test_a_restarted_syscall_is_recorded_with_what_its_restart_read(audit_sensor, audit_cgroups, tmp_path,
                                                                   b_name):
    """The kernel reads a restarted syscall's arguments from user memory again: a
    thread of the process can change them while the call is blocked (here: open(A)
    blocked, the name swapped to B, a stop and a continue). The one record names B,
    what the kernel opened, not A (which it would, read only at the first enter).
    A long B: the record waited in the small in-flight table and its restart's
    strings no longer fit it (bpf/common.h dsec_pending_store: into the big one)."""
    h = audit_sensor
    fa, fb = str(tmp_path / "fifoA"), str(tmp_path / b_name)
    os.mkfifo(fa)
    os.mkfifo(fb)
    sbx = h.sandbox(audit_cgroups)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", SWAPPED, fa, fb], stdout=subprocess.PIPE)
    try:
        tid = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGSTOP)
        assert h.poll_until(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10)
        os.kill(p.pid, signal.SIGCONT)
        assert h.poll_until(lambda: open(f"/proc/{p.pid}/task/{tid}/wchan").read() == "wait_for_partner", 20)
        _release(fb)
        assert p.stdout.readline().strip() == b"True"
        assert p.wait(30) == 0
    finally:
        _kill(p)
    sbx.remove()
    opens = [(r["path"], r["ret"] >= 0) for r in sbx.of_kind("open_write") if r["path"] in (fa, fb)]
    assert opens == [(fb, True)], opens


def test_a_mixed_membership_slot_never_answers(audit_sensor, audit_cgroups, tmp_path):
    """bpf/membership.h's per-CPU slot in front of the sandbox lookup can be seen
    half-written on a preemptible kernel (the egress programs run with migration,
    not preemption, disabled). Forged here on every CPU: this sandbox's cgroup id
    and the current generation with "no sandbox" and no valid check, as two
    interleaved writers could leave it. Before the check word, the sandbox's
    process was nobody's: its open went unrecorded (egress unenforced, the same way)."""
    h = audit_sensor
    sbx = h.sandbox(audit_cgroups)
    b = h.sensor.bpf
    gen = b[b"sbx_gen"][b[b"sbx_gen"].Key(0)].value
    l1 = b[b"sbx_l1"]
    slots = l1.Leaf()
    for i in range(len(slots)):
        slots[i].id, slots[i].gen, slots[i].sandbox = sbx.cg.id, gen, 0
    l1[l1.Key(sbx.cg.id & 255)] = slots
    target = str(tmp_path / "seen")
    p = run_in_cgroup(sbx.cg, [PYTHON, "-I", "-B", "-c", f"open({target!r}, 'w').close()"])
    assert p.wait(30) == 0
    assert h.poll_until(lambda: any(r["path"] == target for r in sbx.of_kind("open_write")), 10), sbx.records
    sbx.remove()


@pytest.fixture(scope="module")
def small_table():
    """A sensor whose node-wide in-flight table holds 256 entries (64 of them the
    reserve), 128 per sandbox and kind: two hostile sandboxes fill it."""
    h = Harness(max_inflight=128, pending_entries=256)
    yield h
    h.close()


QUIET = r'''
import os, socket, sys
d, port = sys.argv[1], int(sys.argv[2])
for i in range(100):
    os.close(os.open(f"{d}/q{i}.txt", os.O_WRONLY | os.O_CREAT, 0o644))
for i in range(10):
    s = socket.socket(); s.connect(("127.0.0.1", port)); s.close()
'''


def test_others_filling_the_in_flight_table_leave_a_quiet_neighbour_whole(small_table, audit_cgroups, tmp_path):
    h = small_table
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    srv = _listener()
    port = srv.getsockname()[1]
    qdir = tmp_path / "quiet"
    qdir.mkdir()
    hostile = [h.sandbox(audit_cgroups) for _ in range(2)]
    quiet = h.sandbox(audit_cgroups)
    procs = []
    try:
        for i, s in enumerate(hostile):
            d = tmp_path / f"h{i}"
            d.mkdir()
            procs.append(_blocked(s.cg, fifo, 128, port, str(d), gate=True))
        for pr in procs:
            assert int(pr.stdout.readline()) == 128
        # only now, with both sandboxes' opens in flight (the table full), their other
        # records: without the gate the first one's connects could find room left
        for pr in procs:
            pr.stdin.write(b"\n")
            pr.stdin.flush()
        for pr in procs:
            assert pr.stdout.readline().strip() == b"done"
        q = run_in_cgroup(quiet.cg, [PYTHON, "-I", "-B", "-c", QUIET, str(qdir), str(port)])
        assert q.wait(60) == 0
        _release(fifo)
        for pr in procs:
            pr.stdin.write(b"\n")
            pr.stdin.close()
            assert pr.wait(30) == 0
    finally:
        for pr in procs:
            _kill(pr)
        srv.close()
    q_totals = quiet.remove()
    assert q_totals["lost_total"] == 0, q_totals
    assert len([r for r in quiet.of_kind("open_write") if r["path"].startswith(str(qdir))]) == 100
    assert len(quiet.of_kind("connect")) == 10
    lost = {}
    for s in hostile:
        for kind, n in s.remove()["lost"].get("inflight_full", {}).items():
            lost[kind] = lost.get(kind, 0) + n
        assert all(r["sandbox_id"] == s.sandbox_id for r in s.of_kind("events_lost"))
    # the hostile two took exactly the table less the reserve (192 of 256): the other 64
    # blocked opens are lost, and so is everything they did while those stayed blocked
    # (2 x 3 opens, 3 unlinks, 5 connects), each in its own sandbox's record
    assert lost == {"open_write": 64 + 6, "unlink": 6, "connect": 10}, lost


def test_in_flight_loss_under_over_budget_stop_kills_and_notifies(audit_sensor, audit_cgroups, tmp_path):
    h = audit_sensor
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    srv = _listener()
    sbx = h.sandbox(audit_cgroups, over_budget="stop")
    calls = len(h.over_budget_calls)
    p = _blocked(sbx.cg, fifo, 513, srv.getsockname()[1], str(tmp_path))
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        _kill(p)
        srv.close()
    assert p.returncode == -signal.SIGKILL, out
    assert h.poll_until(lambda: len(h.over_budget_calls) > calls, 10)
    cgid, sid, lost = h.over_budget_calls[calls]
    assert (cgid, sid) == (sbx.cg.id, sbx.sandbox_id) and lost["inflight_full"] == {"open_write": 1}, lost
    sbx.remove()


# ---------------------------------------------------------------- schema

def test_migration_4_adds_dirfd_and_path_resolution_on_18_16_and_a_current_engine(clickhouse_url, tmp_path):
    from fixtures_clickhouse import SESSION_DB, chdb_events_without, connect
    assert BY_NAME["dirfd"].ch_type == BY_NAME["path_resolution"].ch_type == "String"
    client, _ = connect(clickhouse_url)
    db = f"{SESSION_DB}_p{uuid.uuid4().hex[:6]}"
    try:
        migrations.migrate(client, db)
        for col in ("dirfd", "path_resolution"):
            client.execute(f"ALTER TABLE {db}.events DROP COLUMN {col}")
        client.execute(f"DROP TABLE {db}.schema_migrations")
        client.execute(migrations.version_table_sql(db))
        client.execute(f"INSERT INTO {db}.schema_migrations (version, name) VALUES", [(1, "v1"), (2, "v2"), (3, "v3")])
        r = migrations.migrate(client, db)
        assert r.before == 3 and r.applied == list(range(4, migrations.LATEST + 1)) and r.added_columns == []
        cols = migrations.table_columns(client, db)
        assert cols["dirfd"] == cols["path_resolution"] == "LowCardinality(String)"
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
        client.disconnect()
    import chdb.session as chdb_session
    s = chdb_session.Session(str(tmp_path / "chdb"))
    try:
        modern = chdb_events_without(s, ("dirfd", "path_resolution"))
        for step in migrations.MIGRATIONS[3][2]("m", modern):
            s.query(step.sql(modern))
        t = s.query("SELECT name, type FROM system.columns WHERE database = 'm' AND table = 'events' "
                    "AND name IN ('dirfd', 'path_resolution') ORDER BY name", "CSV").bytes().decode().split()
        assert t == ['"dirfd","LowCardinality(String)"', '"path_resolution","LowCardinality(String)"']
    finally:
        s.close()


def test_pending_entries_bound_is_checked():
    from agent.errors import DsecError
    with pytest.raises(DsecError, match="in-flight table"):
        AuditSensor(pending_entries=8, max_inflight=512)
