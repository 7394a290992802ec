"""A step in three parts (agent/sandbox/launcher.py Sandbox.exec_begin / exec_poll /
exec_end): the agent's step is sent and waited for on the RPC's own thread, with no runner
thread (agent/node/steps.py). on_done is called when dsec-init reports the exit; exec_poll
sends a timeout's SIGTERM and, after the grace, SIGKILL; the result is exec()'s."""
from __future__ import annotations

import os
import signal
import threading
import time

from agent.sandbox.launcher import Sandbox, SandboxSpec


def _wait(sb, st, woke: threading.Event, limit: float = 20.0) -> None:
    end = time.monotonic() + limit
    while (left := sb.exec_poll(st)) is not None:
        assert time.monotonic() < end, "the step did not end"
        woke.wait(left)
        woke.clear()


def test_begin_poll_end_with_on_done_and_a_timeout():
    sb = Sandbox(SandboxSpec(argv=[], sandbox_id="stparts-" + os.urandom(4).hex(), network="none")).start()
    try:
        woke = threading.Event()
        r, w = os.pipe()
        try:
            st = sb.exec_begin(["/bin/sh", "-c", "echo hi; exit 3"], stdout=w, on_done=woke.set)
        finally:
            os.close(w)             # dsec-init holds its copy once exec_begin returns
        _wait(sb, st, woke)
        assert woke.is_set() or st.done
        assert sb.exec_end(st) is st and st.code == 3 and st.exit_code == 3 and st.wall_ms >= 0
        with os.fdopen(r, "rb") as f:
            assert f.read() == b"hi\n"

        # a timeout: exec_poll sends SIGTERM at it (the shell ignores it), SIGKILL after the grace
        woke = threading.Event()
        t0 = time.monotonic()
        st = sb.exec_begin(["/bin/sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"], timeout=0.3,
                           grace=0.3, on_done=woke.set)
        _wait(sb, st, woke)
        sb.exec_end(st)
        assert st.timed_out and st.signal == signal.SIGKILL, (st.timed_out, st.signal, st.error)
        assert 0.5 <= time.monotonic() - t0 < 10

        # exec() is the three parts: the same result
        st = sb.exec(["/bin/true"])
        assert st.code == 0 and not st.timed_out
    finally:
        sb.close()
