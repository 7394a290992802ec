"""The caller's stdio for a one-shot sandbox (launcher.launch): which fds the
step gets, the relays for terminals, and signals forwarded to the step."""
from __future__ import annotations

import os
import select
import signal
import threading


def forward_signals(sb) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        old[s] = signal.signal(s, lambda sig, _f: sb.signal(sig))
    return old


def restore_signals(old: dict):
    for s, h in old.items():
        signal.signal(s, h)


def relay(rfd: int, wfd: int):
    while True:
        try:
            data = os.read(rfd, 65536)
        except OSError:
            break
        if not data:
            break
        _write_all(wfd, data)
    os.close(rfd)


def default_stdio() -> dict:
    """Wire the sandbox's stdin/stdout/stderr.

    A terminal is never handed to untrusted code (TIOCSTI and friends): stdin
    becomes /dev/null and output is relayed through pipes. Files and pipes are
    passed through as they are."""
    child, relay, close_after = [], {}, []
    for fd in (0, 1, 2):
        try:
            tty = os.isatty(fd)
            os.fstat(fd)
            valid = True
        except OSError:
            tty, valid = False, False
        if not valid:
            n = os.open(os.devnull, os.O_RDWR)
            child.append(n)
            close_after.append(n)
        elif tty and fd == 0:
            n = os.open(os.devnull, os.O_RDONLY)
            child.append(n)
            close_after.append(n)
        elif tty:
            r, w = os.pipe()
            child.append(w)
            close_after.append(w)
            relay[r] = fd
        else:
            child.append(fd)
    return {"child": child, "relay": relay, "close_after_fork": close_after}


def _write_all(fd, data):
    while data:
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            _wait_writable(fd)
            continue
        except OSError:
            return
        data = data[n:]


def _wait_writable(fd: int):
    p = select.poll()
    p.register(fd, select.POLLOUT)
    p.poll(1000)
