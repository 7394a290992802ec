"""How one step of a sandbox ended (agent/sandbox/launcher.py Sandbox.exec and its three
parts exec_begin / exec_poll / exec_end), and the decoding of dsec-init's STEP_EXIT into it.
Out of launcher.py, which was at the layout's length limit."""
from __future__ import annotations

import errno
import os
import signal

from agent.errors import EXIT_DSEC, EXIT_NOEXEC, EXIT_NOTFOUND


class StepResult:
    """How one step ended. `code` follows `dsec run`'s exit-status convention."""

    def __init__(self, step: int):
        self.step = step
        self.pid = 0
        self.status = None          # raw wait status
        self.exit_code = None       # CMD's exit status, or None when killed by a signal
        self.signal = None
        self.timed_out = False
        self.oom_killed = False     # killed by the memory cgroup's OOM killer during the step
        self.oom_kills = 0          # OOM kills in the sandbox's cgroup during the step (any process)
        self.error = None           # exec failure / setup failure text
        self.code = EXIT_DSEC
        self.cpu_ms = 0
        self.max_rss_bytes = 0
        self.wall_ms = 0
        self.started_ns = 0
        self.done = False
        self.on_done = None         # called (no lock held) when the step has ended or init died (exec_begin)
        # exec_begin .. exec_end: when it was sent (monotonic), its timeout's deadline, the grace
        # before SIGKILL, when the next SIGKILL is due, the sandbox's OOM kills before it
        self.sent_at = 0.0
        self.deadline = None
        self.grace = 0.0
        self.kill_at = None
        self.oom_before = 0

    def to_dict(self) -> dict:
        return {"step": self.step, "exit_code": self.exit_code, "signal": self.signal,
                "timed_out": self.timed_out, "oom_killed": self.oom_killed, "error": self.error,
                "code": self.code, "cpu_ms": self.cpu_ms, "max_rss_bytes": self.max_rss_bytes,
                "wall_ms": self.wall_ms}


def _finish_step(st: StepResult, m: dict):
    st.done = True
    st.cpu_ms = m.get("cpu_ms", 0)
    st.max_rss_bytes = m.get("max_rss_bytes", 0)
    if m.get("exec_errno") is not None:
        e = m["exec_errno"]
        st.error = f"{m.get('exec_stage')}: {m.get('exec_msg')}"
        if m.get("exec_stage") == "exec":
            st.code = EXIT_NOTFOUND if e == errno.ENOENT else EXIT_NOEXEC
            st.exit_code = st.code
        else:
            st.code = EXIT_DSEC
        return
    status = m.get("status")
    if status is None:
        status = signal.SIGKILL
    st.status = status
    if os.WIFSIGNALED(status):
        st.signal = os.WTERMSIG(status)
        st.code = 128 + st.signal
    else:
        st.exit_code = os.WEXITSTATUS(status)
        st.code = st.exit_code
