"""The status of every sandbox of this process, read by one thread.

    from agent.sandbox.status import STATUS
    loop = STATUS.add(sandbox)      # sandbox.ctl (socket), sandbox.pidfd
    ...
    STATUS.remove(sandbox)          # before its fds are closed

A sandbox (agent/sandbox/launcher.py Sandbox) offers two handlers, run on the
loop's thread: `_status_readable()` (its control socket is readable: one
message dispatched; False at EOF) and `_status_exited(ctl_open)` (its init
exited: drain, reap, supervisor_dead). Both only decode and update state
under the sandbox's condition, so one slow sandbox cannot hold up another.
"""
from __future__ import annotations

import logging
import select
import threading

log = logging.getLogger("dsec.launcher")


class StatusLoop:
    """One thread, one epoll set, for the status of every sandbox of this process:
    each dsec-init's control socket (its messages: ready, step started/exited,
    closed) and its pidfd (it exited: drained, reaped, supervisor_dead). A
    thread per sandbox cost ~1,000 threads on a node with 1,000 sandboxes.
    The handlers only decode and update state under the sandbox's condition
    (no blocking work), so one slow sandbox cannot hold up the others."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ep = None
        self._thread: threading.Thread | None = None
        self._fds: dict[int, tuple] = {}        # fd -> (sandbox, "ctl" | "exit")

    def add(self, sb) -> "StatusLoop":
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._ep is None:
                if self._ep is not None:
                    self._ep.close()
                self._ep, self._fds = select.epoll(), {}
                self._thread = threading.Thread(target=self._run, args=(self._ep,), name="dsec-sbx-status",
                                                daemon=True)
                self._thread.start()
            for fd, what in ((sb.ctl.fileno(), "ctl"), (sb.pidfd, "exit")):
                self._fds[fd] = (sb, what)
                self._ep.register(fd, select.EPOLLIN)
        return self

    def _drop(self, fd: int, sb) -> bool:
        """With the lock: fd of sandbox sb out of the set; False if it was not in it."""
        if self._fds.get(fd, (None,))[0] is not sb:
            return False
        del self._fds[fd]
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        return True

    def remove(self, sb) -> None:
        """The sandbox's fds out of the set (idempotent; before they are closed)."""
        with self._lock:
            self._drop(sb.pidfd, sb)
            self._drop(sb.ctl.fileno(), sb)

    def _run(self, ep) -> None:
        while True:
            try:
                events = ep.poll()
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return                          # closed: replaced by a new loop
            for fd, _ in events:
                with self._lock:
                    sb, what = self._fds.get(fd, (None, None))
                if sb is None:
                    continue
                if what == "exit" and not _readable(fd):
                    # a stale event: that pidfd was removed and closed after this poll returned,
                    # and its number now belongs to another sandbox whose init still runs (handled
                    # as an exit, it would be reaped with a blocking wait: every status stalls)
                    continue
                try:
                    if what == "ctl":
                        if not sb._status_readable():
                            with self._lock:
                                self._drop(fd, sb)
                        continue
                    with self._lock:
                        self._drop(fd, sb)
                        ctl_open = self._drop(sb.ctl.fileno(), sb)
                    sb._status_exited(ctl_open)
                except Exception:   # noqa: BLE001 - one sandbox's fault never stops the others' status
                    log.exception("sandbox %s: reading its status", sb.sid)
                    with self._lock:
                        self._drop(fd, sb)
                    if what == "exit":
                        with sb._cond:
                            sb.supervisor_dead = True
                            sb._cond.notify_all()


def _readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    try:
        return bool(p.poll(0))
    except OSError:
        return False


STATUS = StatusLoop()
