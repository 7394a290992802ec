"""The seccomp probes of tests/test_policy.py, run in a fresh interpreter:

    python3 tests/seccomp_probes.py PROBE DIR < POLICY.yaml     (empty stdin: no filter)

private mount namespace, no_new_privs, the policy's seccomp filter, then the
probe; prints the result as one JSON line ([0, 0] ok, [-1, "EPERM"] refused)
or dies of the signal the filter sent. A fresh process (not a fork of the
threaded test process), so no lock another thread held can hang it.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from policies import syscalls  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS = {n: syscalls.number(n) for n in ("ptrace", "bpf", "keyctl", "io_uring_setup", "clone", "clone3", "getpid")}
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17


def _call(fn):
    ctypes.set_errno(0)
    r = fn()
    return (0, 0) if r >= 0 else (-1, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))


def _clone_newuser():
    r = _libc.syscall(SYS["clone"], ctypes.c_ulong(CLONE_NEWUSER | SIGCHLD), 0, 0, 0, 0)
    if r == 0:
        os._exit(0)                                  # the new child: nothing else
    if r > 0:
        os.waitpid(r, 0)
        return (0, 0)
    return (-1, errno.errorcode.get(ctypes.get_errno()))


def _thread():
    import threading
    box = []
    t = threading.Thread(target=lambda: box.append(os.getpid()))
    t.start()
    t.join()
    return (0, 0) if box else (-1, "no thread")


PROBES = {
    "mount": lambda d: _call(lambda: _libc.mount(b"dsec-test", d.encode(), b"tmpfs", 0, None)),
    "unshare_user": lambda d: _call(lambda: _libc.unshare(CLONE_NEWUSER)),
    "clone_newuser": lambda d: _clone_newuser(),
    "ptrace": lambda d: _call(lambda: _libc.syscall(SYS["ptrace"], 0, 0, 0, 0)),          # PTRACE_TRACEME
    "bpf": lambda d: _call(lambda: _libc.syscall(SYS["bpf"], 0, None, 0)),
    "keyctl": lambda d: _call(lambda: _libc.syscall(SYS["keyctl"], 0, ctypes.c_long(-3), 0)),
    "io_uring_setup": lambda d: _call(lambda: _libc.syscall(SYS["io_uring_setup"], 1, None)),
    "setns": lambda d: _call(lambda: _libc.setns(0, CLONE_NEWUSER)),
    "clone3": lambda d: _call(lambda: _libc.syscall(SYS["clone3"], None, 0)),
    # ordinary work
    "getpid": lambda d: _call(lambda: _libc.syscall(SYS["getpid"])),
    "files": lambda d: (0, 0) if open("/proc/self/status").read(5) == "Name:" and os.listdir(d) == [] else (-1, "?"),
    "thread": lambda d: _thread(),
    "x32": lambda d: _call(lambda: _libc.syscall(0x40000000 | SYS["getpid"])),
}
DANGEROUS_PROBES = ["mount", "unshare_user", "clone_newuser", "ptrace", "bpf", "keyctl", "io_uring_setup", "setns"]


def main():
    probe, d = sys.argv[1], sys.argv[2]
    text = sys.stdin.read()
    filt = None
    if text.strip():
        from policies.compile import seccomp_filter
        from policies.load import load_policy_text
        filt = seccomp_filter(load_policy_text(text, "<probe policy>"))
    from agent.sandbox import sysutil as su
    su.unshare(su.CLONE_NEWNS)
    su.mount(None, "/", None, su.MS_REC | su.MS_PRIVATE)
    su.prctl(su.PR_SET_NO_NEW_PRIVS, 1)
    if filt is not None:
        filt.load()
    res = PROBES[probe](d)
    sys.stdout.write(json.dumps(list(res)) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
