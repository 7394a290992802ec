"""One step (Exec) of a sandbox the node agent runs: wait until the sandbox runs,
take its step lock (steps never overlap, so every audit event carries the
step it belongs to), stream stdin in and stdout/stderr out, and report the
exit; a caller that goes away mid-step has the step stopped (SIGTERM, grace,
SIGKILL), and a one-shot run (close_after) its sandbox too.

    for item in exec_step(agent, start, inputs, register_cancel, time_remaining):
        ...   # ("started", step, ts_ns) | ("stdout", bytes) | ("stderr", bytes) | ("exit", dict)

Functions of the agent (agent/node/daemon.py), which owns the state and the lock.
"""
from __future__ import annotations

import _thread
import contextlib
import logging
import os
import select
import signal
import threading
import time

from agent.errors import ReportedError
from agent.node.records import (CANCELLED, EXITED, FAILED, KILLED, PREEMPTED, QUEUED, READ_CHUNK, RUNNING,
                                STARTING, STDIN_BUFFER, STREAM_POLL, ApiError, SandboxRecord, StepRun, _fs)
from agent.node.requests import check_exec

log = logging.getLogger("dsec.agent")


def exec_step(agent, start: dict, inputs, register_cancel, time_remaining, caller=None, hangup: int = -1):
    """One step; a generator of ("started", step, ts_ns) | ("stdout", bytes) |
    ("stderr", bytes) | ("exit", dict). Raises ApiError (also after "exit",
    when the sandbox was stopped under the step). hangup: the caller's connection
    (the step socket, agent/node/stepsock.py), watched while the step waits and runs:
    its hang-up cancels the step as a cancelled call does."""
    argv = start.get("argv") or []
    env, workdir, timeout, grace = check_exec(start)
    rec = agent.lookup(start["sandbox_id"], caller, "Exec") if caller is not None else \
        agent.lookup(start["sandbox_id"])
    run = StepRun(argv)
    close_after = bool(start.get("close_after"))

    def cancel():
        # called when the RPC terminates: only a call that ends while this
        # generator is still running was cancelled (client gone, deadline)
        if run.rpc_done or run.done:
            return
        run.cancelled = True
        run.wake()
        agent._submit_work(_cancelled_step, agent, rec, run, close_after)
    register_cancel(cancel)
    run.cancel = cancel
    run.hangup = hangup
    try:
        yield from _exec_step(agent, rec, run, start, env, workdir, timeout, grace, close_after, inputs,
                              time_remaining)
    finally:
        run.rpc_done = True
        if run.kick:
            # the step's end records go to the spool once its reply is sent, not while it is: the
            # emit writer's Python work held the GIL the reply's thread needed (~0.1 ms a step;
            # appending them on this thread after the reply measured slower than the hand-off)
            agent._flush_emits_soon()


def _exec_step(agent, rec, run, start, env, workdir, timeout, grace, close_after, inputs, time_remaining):
    deadline = None
    rem = time_remaining()
    if rem is not None:
        deadline = time.monotonic() + rem
    # wait until it runs
    with rec.changed:                  # the agent's lock; woken by this sandbox's changes only
        while rec.state in (QUEUED, STARTING):
            if run.cancelled or _hung_up(run):
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id} is still {rec.state}")
            rec.changed.wait(STREAM_POLL if left is None else min(left, STREAM_POLL))
        if rec.state != RUNNING or rec.stop_kind is not None:
            raise _gone(agent, rec)
    while not rec.step_lock.acquire(timeout=STREAM_POLL):
        if run.cancelled or _hung_up(run):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id}: the previous step is still running")
        if rec.state != RUNNING:
            raise _gone(agent, rec)
    try:
        if run.cancelled or _hung_up(run):
            return                  # its caller went away while it waited its turn: it never runs
        if rec.state != RUNNING or rec.stop_kind is not None:
            raise _gone(agent, rec)
        yield from _run_step(agent, rec, run, start, env, workdir, timeout, grace or None, inputs)
    finally:
        rec.step_lock.release()
    if run.cancelled:
        return
    if close_after:
        with agent._lock:
            gone = rec.stop_kind is not None and rec.stop_kind != "closed"
        closed = agent.close(rec.id) if not gone else agent.info(rec)
    ex = _exit_status(agent, rec, run)
    if close_after and closed.get("summary") is not None:
        summary = dict(closed["summary"])
        if run.result is not None:
            summary["wall_ms"] = run.result.wall_ms
            summary["timed_out"] = run.result.timed_out
        if start.get("wait_export") and agent.export is not None:
            ok = agent.export.wait_exported(agent.export.head(), 10.0)
            summary.setdefault("audit", {})
            summary["audit"]["exported"] = ok
            summary["audit"]["pending"] = 0 if ok else agent.export.backlog()
            if not ok:
                summary["audit"]["export_error"] = "not delivered to ClickHouse within 10s (the agent " \
                                                   "keeps delivering)"
        ex["summary"] = summary
    # how the call ends is known now: the exit message says it (`final`), so a client can stop
    # reading there instead of waiting for the status that follows (docs/agent.md "Steps")
    with agent._lock:
        stopped = rec.stop_kind not in (None, "closed") or (rec.stop_kind == "closed" and not close_after)
    gone = _gone(agent, rec, during_step=True) if stopped else None
    ex.update(final=True, error_code=gone.code if gone else "", error_message=gone.message if gone else "")
    yield ("exit", ex)
    if gone is not None:
        raise gone


def _gone(agent, rec: SandboxRecord, during_step: bool = False) -> ApiError:
    kind = rec.stop_kind or rec.state
    what = {PREEMPTED: "was preempted", KILLED: "was killed", "closed": "was closed",
            FAILED: "failed", CANCELLED: "was cancelled", EXITED: "has exited"}.get(kind, f"is {rec.state}")
    why = rec.stop_reason or rec.reason
    msg = f"sandbox {rec.id} {what}" + (f" ({why})" if why else "")
    if during_step:
        msg += "; the step was stopped"
    code = "ABORTED" if during_step or kind == PREEMPTED else "FAILED_PRECONDITION"
    return ApiError(code, msg)


def _cancelled_step(agent, rec: SandboxRecord, run: StepRun, close_after: bool):
    """The caller went away during a step, or while it waited for its sandbox: stop the
    step (SIGTERM, grace, SIGKILL); one-shot runs (close_after) also end their sandbox,
    whether it runs, is starting or is still queued."""
    sb = rec.sandbox                    # None: not started yet (no step ran), or ended
    if sb is not None:
        t_end = time.monotonic() + 30
        while not run.step and not run.done and not run.rpc_done and time.monotonic() < t_end:
            time.sleep(0.02)
        if not run.done and run.step:
            sb.signal(signal.SIGTERM, run.step)
            end = time.monotonic() + rec.grace
            while not run.done and time.monotonic() < end:
                time.sleep(0.05)
            if not run.done:
                sb.signal(signal.SIGKILL, run.step)
    if close_after:
        why = "the client of a one-shot run went away"
        with agent._lock:
            if rec.state == QUEUED:
                agent._cancel_locked(rec, why)
            elif rec.state in (STARTING, RUNNING) and rec.stop_kind is None:
                agent._begin_stop_locked(rec, KILLED, why, 0.0)     # STARTING: _launch stops it
        agent._flush_emits()


def _run_step(agent, rec, run: StepRun, start, env, workdir, timeout, grace, inputs):
    sb = rec.sandbox                    # read once: a stop that began after the caller's check drops it
    if sb is None:
        raise _gone(agent, rec)
    # the previous step's end record was queued, not yet known durable (its reply did not wait:
    # _flush_emits_soon in exec_step): it goes to the spool before anything of this step is recorded
    # (the recorder's appends wait for it at their gate), and is durable before it (the spool's
    # appends and their fdatasync are serialised): this step need not wait for that append
    agent._reserve_emits()
    if inputs is None and start.get("close_stdin") and not start.get("stdin"):
        in_r = in_w = -1                # no stdin at all: the step reads /dev/null, no pipe
    else:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(in_w, False)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
    run.wake_w = wake_w
    run.owner = _thread.get_ident()     # its own wake-ups are not needed (StepRun.wake)
    if start.get("stdin"):
        run.stdin_buf.append(start["stdin"])
        run.stdin_bytes = len(start["stdin"])
    if start.get("close_stdin"):
        run.stdin_eof = True
    rec.run = run
    argv = [_fs(a) for a in run.argv]
    # the whole stdin is known up front: the step_start record carries it (bounded), so replay re-sends it
    known_stdin = bytes(start.get("stdin") or b"") if start.get("close_stdin") else None

    def finish(lst):
        # the step is over (exec_poll said so, or exec_wait returned): its result and its
        # on_step_end record, then run.done
        try:
            with _step_failure(run, rec):
                run.result = sb.exec_end(lst)
        finally:
            run.done = True
            run.wake()

    def reader():
        try:
            for kind, value in inputs:
                if kind == "stdin":
                    while run.stdin_bytes > STDIN_BUFFER and not run.done and not run.cancelled:
                        time.sleep(0.01)         # backpressure: the step is not reading
                    with run.lock:
                        if not run.stdin_eof and not run.done:
                            run.stdin_buf.append(value)
                            run.stdin_bytes += len(value)
                elif kind == "close_stdin":
                    run.stdin_eof = True
                elif kind == "signal":
                    if run.step and not run.done:
                        sb.signal(value, run.step)
                    else:
                        run.pending_signals.append(value)
                run.wake()
        except Exception:  # noqa: BLE001 - the call ended (cancelled or completed)
            pass
        finally:
            run.stdin_eof = True
            run.wake()

    # the step is sent and waited for on this thread (no runner thread: one hand-off less each way;
    # the status thread's on_done wakes the poll below when dsec-init reports the exit)
    lst = None
    try:
        with _step_failure(run, rec):
            lst = sb.exec_begin(argv, env=env or None, workdir=workdir, stdin=in_r if in_r >= 0 else None,
                                stdout=out_w, stderr=err_w, timeout=timeout or None, grace=grace,
                                stdin_bytes=known_stdin, on_done=run.wake)
    finally:
        for fd in (in_r, out_w, err_w):     # dsec-init has its copies (or the step never ran)
            if fd >= 0:
                os.close(fd)
    if lst is None:
        run.done = True
    elif timeout:
        # a step with a timeout: a step thread sends its signals on time even while this thread
        # is held in a yield (a caller slow to read the output); off the step's path
        def timer():
            try:
                sb.exec_wait(lst)
            except Exception:  # noqa: BLE001
                log.exception("sandbox %s: step %s's timeout", rec.id, lst.step)
        try:
            _spawn(timer)
        except RuntimeError:        # no thread to be had: this thread's polls send them
            log.error("sandbox %s: no thread for step %s's timeout", rec.id, lst.step)
    if inputs is not None:
        _spawn(reader)
    readers = {out_r: "stdout", err_r: "stderr"}
    started_sent = False
    done_at = None
    left = STREAM_POLL
    if lst is not None:
        # an on_done that came already (a step that ended at once) would cost the loop a round:
        # drained, then the step's end checked once (the on_done drained had set done first)
        _drain(wake_r)
        left = sb.exec_poll(lst)
        if left is None:
            finish(lst)
            left = STREAM_POLL

    no_started = bool(start.get("no_started"))

    def started():
        # ("started", ...) once the launcher named the step (on_step: before dsec-init is told to run
        # it, so before any of its output exists); pending signals go to it then. A caller that
        # asked for no `started` (no_started) takes the step from the exit.
        nonlocal started_sent
        if not run.step or started_sent:
            return None
        started_sent = True
        for s in run.pending_signals:
            sb.signal(s, run.step)
        run.pending_signals.clear()
        return None if no_started else ("started", run.step, run.started_ns)

    try:
        while True:
            item = started()
            if item:
                yield item
            if in_w >= 0 and (run.done or run.cancelled or (run.stdin_eof and not run.stdin_buf)):
                os.close(in_w)
                in_w = -1
            tmo = STREAM_POLL if done_at is None else 0.05
            if not run.done:
                tmo = min(tmo, left)
            r, w = _wait(readers, wake_r, in_w if in_w >= 0 and run.stdin_buf else -1, tmo, run.hangup)
            if run.hangup >= 0 and run.hangup in r:
                run.hangup = -1             # the caller went away mid-step: as a cancelled call
                run.cancel()
            got = False
            item = started()
            if item:                    # it started and wrote while this thread waited: "started" first
                yield item
            if wake_r in r:
                _drain(wake_r)
            if not run.done:
                left = sb.exec_poll(lst)        # the step's end, or its timeout's signals
                if left is None:
                    finish(lst)
            for fd in r:
                if fd not in readers:
                    continue
                try:
                    data = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if data:
                    got = True
                    if not run.cancelled:
                        yield (readers[fd], data)
                else:
                    os.close(fd)
                    del readers[fd]
            if w and in_w >= 0:
                with run.lock:
                    while run.stdin_buf:
                        chunk = run.stdin_buf[0]
                        try:
                            n = os.write(in_w, chunk)
                        except BlockingIOError:
                            break
                        except BrokenPipeError:
                            run.stdin_buf.clear()
                            run.stdin_bytes = 0
                            break
                        run.stdin_bytes -= n
                        if n < len(chunk):
                            run.stdin_buf[0] = chunk[n:]
                            break
                        run.stdin_buf.popleft()
            if run.done:
                # after the step: read what is left; background processes that keep
                # the pipes open do not hold the reply (their later output is dropped)
                if done_at is None:
                    done_at = time.monotonic()
                    if readers:
                        continue
                if not readers or not got or time.monotonic() - done_at > 2.0:
                    break
    finally:
        if not run.done:
            # the call went away mid-step (generator closed): keep the step lock until the
            # step is over (the cancellation stops it), so steps never overlap
            _wait_out(sb, lst, run, wake_r, rec.grace + 10, finish)
        with run.lock:
            run.wake_w = -1
        for fd in list(readers) + [wake_r, wake_w] + ([in_w] if in_w >= 0 else []):
            try:
                os.close(fd)
            except OSError:
                pass
    st = run.result
    oom = bool(st is not None and st.oom_kills)       # counted by Sandbox.exec (one read of memory.events)
    run.oom = oom
    if st is not None:
        agent._lifecycle(rec.id, "step_ended", step=st.step, code=st.code, exit_code=st.exit_code,
                        signal=st.signal, timed_out=st.timed_out, wall_ms=st.wall_ms, cpu_ms=st.cpu_ms,
                        oom_killed=oom or None, error=st.error)
    elif run.error:
        agent._lifecycle(rec.id, "step_ended", step=run.step, error=run.error)
    # the reply does not wait for the durable append of step_started/step_ended (~1-10 ms of
    # spool lock and fdatasync on a busy node): the emit writer appends them at once, before any
    # later agent record (FIFO), before this sandbox's next step starts (above) and before its
    # close returns (close flushes, and waits for an append under way). docs/agent.md "Steps".
    run.kick = True                 # exec_step kicks the emit writer once the reply is sent
    if st is not None and not run.cancelled:
        agent.snapshots.after_step(rec)      # automatic snapshots: the state this step left, before its reply


def _wait_out(sb, lst, run, wake_r: int, limit: float, finish) -> None:
    """Wait up to `limit` s for a step whose call went away; past it, a step thread waits the
    rest, so its end is still recorded (the step lock is let go, as before)."""
    end = time.monotonic() + limit
    while not run.done:
        left = sb.exec_poll(lst)
        if left is None:
            finish(lst)
            return
        now = time.monotonic()
        if now >= end:
            def rest():
                sb.exec_wait(lst)
                finish(lst)
            try:
                _spawn(rest)
            except RuntimeError:
                log.error("sandbox %s: no thread to wait out step %s", sb.sid, lst.step)
            return
        r, _ = _wait({}, wake_r, -1, min(left, end - now))
        if r:
            _drain(wake_r)


class StepThreads:
    """Reusable threads for the per-step work (the runner that waits out the step, the reader
    of the caller's stdin stream): a step takes an idle thread or starts one; a thread whose
    job is done waits IDLE_SECONDS for another, then exits; never more than IDLE_KEPT wait,
    so an agent that ran 1,000 steps at once goes back to its base thread count.
    A new thread is started without waiting until it has been scheduled (threading.Thread.start()
    waits for that handshake, ~2 ms per thread on a busy node, measured)."""

    IDLE_KEPT = 4
    IDLE_SECONDS = 2.0

    class _Worker:
        __slots__ = ("wake", "fn")

        def __init__(self, fn):
            self.wake = threading.Event()
            self.fn = fn

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list = []

    def spawn(self, fn):
        """Run fn() on a pool thread; fn catches its own errors and signals its end itself.
        Raises RuntimeError when no thread can be started."""
        with self._lock:
            if self._idle:
                w = self._idle.pop()
                w.fn = fn
                w.wake.set()
                return
        _thread.start_new_thread(self._run, (self._Worker(fn),))

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _run(self, w):
        while True:
            fn, w.fn = w.fn, None
            try:
                fn()
            except BaseException:  # noqa: BLE001 - fn handles its own; a pool thread never dies of one
                log.exception("step thread")
            with self._lock:
                if len(self._idle) >= self.IDLE_KEPT:
                    return
                w.wake.clear()
                self._idle.append(w)
            if not w.wake.wait(self.IDLE_SECONDS):
                with self._lock:
                    if any(x is w for x in self._idle):
                        self._idle[:] = [x for x in self._idle if x is not w]
                        return
                w.wake.wait()               # handed a job as the wait timed out


STEP_THREADS = StepThreads()


def _spawn(fn):
    STEP_THREADS.spawn(fn)


@contextlib.contextmanager
def _step_failure(run: StepRun, rec):
    """A failure of the step's launcher call becomes the step's error (run.error), never the call's."""
    try:
        yield
    except ReportedError as e:
        run.error = e.message
    except Exception as e:  # noqa: BLE001
        log.exception("sandbox %s: exec failed", rec.id)
        run.error = f"internal error: {e!r}"


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _hung_up(run: StepRun) -> bool:
    """While a step waits its turn: the step socket's caller went away (a hang-up of
    run.hangup), then the step is cancelled as a cancelled call's is."""
    if run.hangup < 0:
        return False
    p = select.poll()
    p.register(run.hangup, select.POLLRDHUP)
    if not p.poll(0):
        return False
    run.hangup = -1
    run.cancel()
    return True


def _wait(readers, wake_r: int, in_w: int, timeout: float, hangup: int = -1) -> tuple[list[int], bool]:
    """poll(2), not select(2): an agent holding many sandboxes has fds past 1023,
    which select() cannot watch. Returns (readable fds, whether in_w is writable);
    a hung-up or errored fd counts as readable (its read returns EOF or the error),
    and so does `hangup` (a caller's connection) once its peer has gone (POLLRDHUP: data
    it sent meanwhile is not looked at)."""
    p = select.poll()
    for fd in list(readers) + [wake_r]:
        p.register(fd, select.POLLIN)
    if in_w >= 0:
        p.register(in_w, select.POLLOUT)
    if hangup >= 0:
        p.register(hangup, select.POLLRDHUP)
    try:
        ready = p.poll(int(timeout * 1000))
    except InterruptedError:
        return [], False
    r = [fd for fd, ev in ready if fd != in_w]
    return r, any(fd == in_w for fd, _ in ready)


def _exit_status(agent, rec: SandboxRecord, run: StepRun) -> dict:
    from agent.errors import EXIT_DSEC
    st = run.result
    ex = {"step": run.step, "sandbox_state": rec.state, "sandbox_reason": rec.stop_reason or rec.reason or "",
          "preempted": rec.stop_kind == PREEMPTED, "oom_killed": getattr(run, "oom", False)}
    if st is None:
        ex.update(code=EXIT_DSEC, exit_code=None, signal=0, timed_out=False, error=run.error or "step failed",
                  wall_ms=0, cpu_ms=0, max_rss_bytes=0)
    else:
        ex.update(code=st.code, exit_code=st.exit_code, signal=st.signal or 0, timed_out=st.timed_out,
                  error=st.error or "", wall_ms=st.wall_ms, cpu_ms=st.cpu_ms, max_rss_bytes=st.max_rss_bytes)
    return ex
