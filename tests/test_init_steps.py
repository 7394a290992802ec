"""What a step starts with, now that dsec-init does part of each step's set-up once for all
of them (agent/sandbox/init/dsec-init.c): PID 1 empties its capability bounding set after
CONFIG and puts every signal at its default action at its start, and a step's child resets
only the few signals PID 1 handles. A step must be exactly as confined as before: an empty
bounding set, no capabilities, no signal ignored, caught or blocked (a workload that ignored
SIGPIPE or SIGTERM because its init did would behave differently from a plain exec). Also
fixed here: signals 32 and 33 (libc's own, which its sigaction refuses to reset) reached
every step ignored, as the agent had them."""
from __future__ import annotations

import os
import signal

from agent.sandbox.launcher import Sandbox, SandboxSpec


def _out(sb, argv, **kw):
    """(the step's result, its stdout)."""
    r, w = os.pipe()
    try:
        st = sb.exec(argv, stdout=w, **kw)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        return st, f.read().decode()


def _status(sb, argv, **kw) -> dict:
    st, out = _out(sb, argv, **kw)
    assert st.code == 0, (st.code, st.error, out)
    fields = {}
    for line in out.splitlines():
        k, _, v = line.partition(":")
        fields.setdefault(k, []).append(v.strip())
    return fields


def test_pid1_bounding_set_is_empty_and_every_step_starts_clean():
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id="initst-" + os.urandom(4).hex(), network="none")).start()
    try:
        # PID 1 after its set-up: nothing left in its bounding set for a step to inherit
        # (before: every step dropped it on its own, PID 1 kept the full set)
        one = _status(sb, ["/bin/cat", "/proc/1/status"])
        assert one["CapBnd"] == ["0000000000000000"], one["CapBnd"]
        # PID 1 still handles what it forwards (and ignores SIGPIPE): the steps must not
        caught = int(one["SigCgt"][0], 16)
        for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1):
            assert caught & (1 << (s - 1)), (s, one["SigCgt"])
        assert int(one["SigIgn"][0], 16) & (1 << (signal.SIGPIPE - 1))
        for _ in range(3):              # every step, not only the first
            me = _status(sb, ["/bin/cat", "/proc/self/status"])
            assert me["CapBnd"] == ["0000000000000000"], me
            assert me["CapEff"] == ["0000000000000000"] and me["CapPrm"] == ["0000000000000000"], me
            assert me["CapAmb"] == ["0000000000000000"], me
            assert me["NoNewPrivs"] == ["1"], me
            assert me["SigIgn"] == ["0000000000000000"], me      # SIGPIPE too
            assert me["SigCgt"] == ["0000000000000000"], me
            assert me["SigBlk"] == ["0000000000000000"], me
    finally:
        sb.close()


def test_a_root_step_has_no_capabilities_either():
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id="initrt-" + os.urandom(4).hex(), network="none",
                             user="root")).start()
    try:
        me = _status(sb, ["/bin/cat", "/proc/self/status"])
        assert me["Uid"][0].split()[0] == "0", me["Uid"]
        for k in ("CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb"):
            assert me[k] == ["0000000000000000"], (k, me[k])
        assert me["SigIgn"] == ["0000000000000000"] and me["SigCgt"] == ["0000000000000000"], me
    finally:
        sb.close()
