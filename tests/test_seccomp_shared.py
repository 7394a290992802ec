"""A sandbox's seccomp program loaded once into dsec-init (PID 1) after its set-up, every step's
child inheriting it, instead of each child loading it before its execve (~0.1-0.2 ms a step):
only when the program allows every call PID 1 and a step's child make from READY on
(agent/sandbox/plan.py INIT_SYSCALLS, seccomp_shareable). Held here:
- the workload is exactly as filtered as before (the same one filter, still in force);
- INIT_SYSCALLS is complete: under a policy that kills on any other call, dsec-init runs steps
  that succeed, fail to exec, make their workdir, time out (its signals), and closes;
- a program that refuses PID 1 one of them is not shared: each step loads it as before."""
from __future__ import annotations

import os
import textwrap

from agent.sandbox import plan
from agent.sandbox.launcher import Sandbox, SandboxSpec
from policies.load import load_policy, load_policy_text
from test_init_steps import _out, _status

# what /bin/true and /bin/sleep call (glibc's start-up, sleep's nanosleep), beside INIT_SYSCALLS
WORKLOAD = ("arch_prctl", "getrandom", "mprotect", "pread64", "prlimit64", "rseq", "set_robust_list",
            "set_tid_address", "clock_nanosleep", "nanosleep", "futex", "fstat", "lseek", "ioctl")


def _seccomp(sb, path: str) -> tuple[str, str]:
    """Seccomp and Seccomp_filters of /proc/<path>/status, read by a step."""
    f = _status(sb, ["/bin/cat", f"/proc/{path}/status"])
    return f["Seccomp"][0], f["Seccomp_filters"][0]


def _sandbox(policy, tag):
    return Sandbox(SandboxSpec(argv=[], sandbox_id=f"scsh{tag}-" + os.urandom(4).hex(), network="none",
                               policy=policy)).start()


def test_the_default_policy_is_loaded_once_and_still_filters_every_step():
    pol = load_policy("default")
    assert plan.seccomp_shareable(pol)
    sb = _sandbox(pol, "d")
    try:
        assert _seccomp(sb, "1") == ("2", "1")                            # PID 1 holds it
        for _ in range(2):
            assert _seccomp(sb, "self") == ("2", "1")                     # inherited, not loaded again
        # still the policy's filter: namespaces denied
        st, _ = _out(sb, ["/usr/bin/unshare", "-n", "/bin/true"])
        assert st.code != 0
    finally:
        sb.close()


def test_init_calls_no_more_than_INIT_SYSCALLS():
    allow = sorted(set(plan.INIT_SYSCALLS) | set(WORKLOAD))
    pol = load_policy_text(textwrap.dedent(f"""\
        apiVersion: dsec/v1
        kind: SandboxPolicy
        metadata: {{name: init-calls-only}}
        spec:
          mode: enforce
          syscalls:
            default: deny
            action: kill
            allow: [{", ".join(allow)}]
        """))
    assert plan.seccomp_shareable(pol)
    sb = _sandbox(pol, "k")
    try:
        st = sb.exec(["/bin/true"])
        assert (st.code, st.exit_code, st.signal) == (0, 0, None), (st.code, st.error, st.signal)
        st = sb.exec(["/nonexistent"])                       # the exec-failure path: errno back to PID 1
        assert st.code == 127, (st.code, st.error)
        st = sb.exec(["true"], workdir="/workspace/new/dir")  # PATH search, the workdir made
        assert st.code == 0, (st.code, st.error, st.signal)
        st = sb.exec(["/bin/sleep", "5"], timeout=0.3, grace=0.2)   # PID 1 signals the step
        assert st.timed_out, (st.code, st.error, st.signal)
        st = sb.exec(["/bin/true"])                          # PID 1 lived through all of it
        assert st.code == 0, (st.code, st.error, st.signal)
    finally:
        summary = sb.close()
    assert summary.get("error") is None, summary


def test_a_program_that_refuses_init_a_call_is_loaded_by_each_step():
    pol = load_policy_text(textwrap.dedent("""\
        apiVersion: dsec/v1
        kind: SandboxPolicy
        metadata: {name: no-setsid}
        spec:
          mode: enforce
          syscalls: {default: allow, deny: [setsid]}
        """))
    assert not plan.seccomp_shareable(pol)
    sb = _sandbox(pol, "n")
    try:
        assert _seccomp(sb, "1") == ("0", "0")                            # PID 1 unfiltered
        assert _seccomp(sb, "self") == ("2", "1")                         # the step's own setsid ran first
        st, _ = _out(sb, ["/usr/bin/setsid", "-w", "/bin/true"])            # the workload's is refused
        assert st.code != 0
    finally:
        sb.close()
