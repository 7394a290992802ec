"""Exec records in flight (bpf/process.c dsec_exec_store / dsec_exec_take): a
record whose path and argv fit DSEC_EXEC_SMALL_BUF waits between
sys_enter_execve and sched_process_exec / sys_exit in a preallocated table of
small entries, a bigger one in the 48 KiB table; either way the decoder sees
the same record. Checked at the boundary (the largest record the small table
holds and one byte more), for execs that succeed and fail, from a thread, and
with the path read late (not resident at enter: read from the kernel's copy at
sched_process_exec, or from user memory at a failed exec's exit). And an
exec interrupted with a restart code (two threads exec'ing at once) is settled
like an interrupted file syscall: never recorded with the kernel-internal code.

Real kernel, real sensor (tests/fixtures_bpf.py).
"""
from __future__ import annotations

import ctypes
import json
import subprocess

from fixtures_bpf import PYTHON, run_in_cgroup
from test_bpf_audit import _extra

EXECS = r'''
import ctypes, json, os, sys, threading
plan = json.loads(sys.argv[1])
d = sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
env = (ctypes.c_char_p * 1)(None)

def execve(path, argv, late):
    args = (ctypes.c_char_p * (len(argv) + 1))(*[a.encode() for a in argv], None)
    if late:
        # the name in a page of a file mapping never touched: not resident at
        # sys_enter_execve (the kernel faults it in when it reads the name)
        f = os.path.join(d, "name-%d" % os.getpid())
        with open(f, "wb") as fh:
            fh.write(path.encode() + b"\0")
        fd = os.open(f, os.O_RDONLY)
        p = libc.mmap(None, 4096, 1, 2, fd, 0)          # PROT_READ, MAP_PRIVATE
        libc.execve(ctypes.c_void_p(p), args, env)
    else:
        libc.execve(path.encode(), args, env)

for path, argv, late, thread in plan:
    pid = os.fork()
    if pid == 0:
        if thread:
            t = threading.Thread(target=execve, args=(path, argv, late))
            t.start(); t.join()
        else:
            execve(path, argv, late)
        os._exit(0)                                     # the exec failed
    os.waitpid(pid, 0)
print("done", flush=True)
'''


def _room(sensor) -> int:
    """Bytes of path + argv (NULs included) the small in-flight table holds."""
    return ctypes.sizeof(sensor.bpf[b"pending_exec_small"].Leaf) - sensor.decoder.fixed


def test_exec_records_are_whole_whichever_table_they_waited_in(audit_sensor, audit_cgroups, tmp_path):
    room = _room(audit_sensor.sensor)
    assert room >= 1024
    true, missing = "/bin/true", "/nonexistent/prog"

    def argv_of(path, total):
        """[path, 'A' * k] whose path + argv take exactly `total` bytes of the string area"""
        k = total - 2 * (len(path) + 1) - 1
        return [path, "A" * k]

    plan = []
    for path in (true, missing):
        for late in (False, True):
            for total in (64, room, room + 1, 12000):
                plan.append((path, argv_of(path, total), late, False))
        plan.append((path, argv_of(path, room), False, True))
        plan.append((path, argv_of(path, room + 1), False, True))
    sbx = audit_sensor.sandbox(audit_cgroups)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-c", EXECS, json.dumps(plan), str(tmp_path)],
                      stdout=subprocess.PIPE, text=True)
    assert p.communicate(timeout=60)[0].strip() == "done"

    def ours(r):
        return r["argv"] and r["argv"][0] in (true, missing) and len(r["argv"]) == 2

    want = len(plan)
    assert audit_sensor.poll_until(lambda: len([r for r in sbx.of_kind("exec") if ours(r)]) >= want)
    got = [r for r in sbx.of_kind("exec") if ours(r)]
    assert len(got) == want, [(r["path"], len(r["argv"][1])) for r in got]
    for (path, argv, late, thread), r in zip(plan, got):
        where = (path, len(argv[1]), late, thread)
        assert r["argv"] == argv and r["argv_truncated"] == 0, where
        assert r["path"] == path and r["path_raw"] == path, where
        assert r["ret"] == (0 if path == true else -2), where
        status = _extra(r).get("status", [])
        assert ("late_read" in status) == late and "path_fault" not in status, (where, status)
        assert (_extra(r).get("old_tid") is not None) == (thread and path == true), where
    totals = sbx.remove()
    assert totals["lost_total"] == 0, totals



RACE = r'''
import ctypes, os, sys, threading
n = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
env = (ctypes.c_char_p * 1)(None)
for i in range(n):
    pid = os.fork()
    if pid == 0:
        go = threading.Barrier(2)
        def ex(tag):
            args = (ctypes.c_char_p * 3)(b"/bin/true", tag, None)
            go.wait()
            libc.execve(b"/bin/true", args, env)
        t = threading.Thread(target=ex, args=(b"race-thread",))
        t.start()
        ex(b"race-main")
        os._exit(1)
    os.waitpid(pid, 0)
print("done", flush=True)
'''


def test_execs_racing_in_one_process_never_record_a_restart_code(audit_sensor, audit_cgroups):
    """Two threads of a process execve at once: the one that waits for the other's
    exec (cred_guard_mutex, interruptibly) is killed by its de_thread and leaves
    execve with -ERESTARTNOINTR (or -ERESTARTNOHAND, killed while its strings
    were copied), kernel-internal codes. Its record is settled like an
    interrupted file syscall's (process.c dsec_exec_settle): emitted at the
    thread's exit with ret -EINTR, never with the restart code; each process has
    exactly one successful exec."""
    n = 60
    sbx = audit_sensor.sandbox(audit_cgroups)
    p = run_in_cgroup(sbx.cg, [PYTHON, "-c", RACE, str(n)], stdout=subprocess.PIPE, text=True)
    assert p.communicate(timeout=120)[0].strip() == "done"

    def ours(r):
        return r["argv"][:1] == ["/bin/true"] and r["argv"][1:] in (["race-thread"], ["race-main"])

    assert audit_sensor.poll_until(lambda: len([r for r in sbx.of_kind("exec") if ours(r) and r["ret"] == 0]) >= n)
    audit_sensor.poll_until(lambda: False, timeout_s=0.5)
    got = [r for r in sbx.of_kind("exec") if ours(r)]
    rets = sorted({r["ret"] for r in got})
    assert not {-512, -513, -514, -516} & set(rets), rets     # before: [-514, -513, -7, 0]
    assert all(r >= -133 for r in rets), rets                  # errnos only (-7: what the kernel returned)
    assert len([r for r in got if r["ret"] == 0]) == n
    totals = sbx.remove()
    assert totals["lost_total"] == 0, totals
