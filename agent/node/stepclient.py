"""The SDK's side of the framed Exec protocol (agent/node/stepsock.py describes it): a step in
a live sandbox sent over the agent's run socket (`<socket>.run`) instead of gRPC, when the SDK
talks to its node's agent over the unix socket. Connections are kept and reused, one step at
a time each (a Client keeps at most KEEP idle ones); a connection that is left mid-step is
closed, which the agent takes as a cancelled step.

    conns = StepConnections(run_socket_path(agent_socket))
    for kind, value in run_step(conns, step_request(sid, argv, ...)):
        ...   # ("started", step) | ("stdout", bytes) | ("stderr", bytes) | ("exit", dict)
    # StepError(code, message) for an E frame; Unsupported before anything ran (nothing answers
    # there, or an agent that predates steps on its run socket): the caller uses gRPC

AsyncStepConnections / run_step_async: the same for asyncio (AsyncClient).
"""
from __future__ import annotations

import os
import select

from agent.node.runclient import _HEAD, MAX_FRAME, connect, dumps, loads, read_frame

KEEP = 8                        # idle connections a client keeps
MAX_STDIN = 4 << 20             # a step with more stdin than this goes over gRPC (one frame carries it)
_OLD_AGENT = "the first frame must be a request (R), got 'X'"
_FULL = "at once (limits.max_concurrent_rpcs)"           # runsock's refusal of one connection too many


class StepError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Unsupported(Exception):
    """Nothing was sent or run: use gRPC."""


def _s(v) -> str:
    if isinstance(v, str):
        return v
    return os.fsdecode(v if isinstance(v, bytes) else os.fspath(v) if isinstance(v, os.PathLike) else str(v))


def step_request(sandbox_id, argv, *, env=None, workdir=None, stdin=None, timeout=None, grace=None,
                 close_after=False, wait_export=False, started=True) -> bytes | None:
    """An X frame (header included), or None when the step's stdin is too large for one."""
    req = {"sandbox_id": sandbox_id, "argv": [_s(a) for a in argv]}
    if env:
        req["env"] = [[_s(k), _s(v)] for k, v in env.items()]
    if workdir:
        req["workdir"] = workdir
    if timeout:
        req["timeout"] = float(timeout)
    if grace:
        req["grace"] = float(grace)
    if close_after:
        req["close_after"] = True
    if wait_export:
        req["wait_export"] = True
    if not started:
        req["started"] = False
    payload = dumps(req)
    if stdin is not None and len(stdin):
        if len(stdin) > MAX_STDIN:
            return None
        payload += b"\0" + stdin
    if len(payload) > MAX_FRAME:
        return None
    return _HEAD.pack(b"X", len(payload)) + payload


def _quiet(sock) -> bool:
    """An idle connection still open, with nothing sent by the agent since its last step."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    try:
        return not p.poll(0)
    except OSError:
        return False


def _item(kind: str, payload: bytes):
    if kind == "o":
        return ("stdout", payload)
    if kind == "e":
        return ("stderr", payload)
    if kind == "x":
        return ("exit", loads(payload))
    if kind == "S":
        return ("started", loads(payload)["step"])
    if kind == "E":
        err = loads(payload)
        return ("error", StepError(err.get("code") or "UNKNOWN", err.get("message") or "step failed"))
    return ("error", StepError("INTERNAL", f"the agent sent a frame of kind {kind!r} during a step"))


def _check_error(conns, err: StepError, fresh: bool):
    if fresh and err.code == "INVALID_ARGUMENT" and _OLD_AGENT in err.message:
        conns.supported = False     # an agent without steps on its run socket: nothing ran
        raise Unsupported(err.message)
    if fresh and err.code == "RESOURCE_EXHAUSTED" and _FULL in err.message:
        raise Unsupported(err.message)      # the socket's connections are all taken: gRPC this time
    raise err


_LOST = "the agent closed the step's connection before the step's exit"


class StepConnections:
    """Idle connections to one agent's run socket (thread-safe)."""

    def __init__(self, path: str):
        import _thread
        self.path = path
        self.supported = True
        self._idle: list = []
        self._lock = _thread.allocate_lock()
        self._pid = os.getpid()

    def take(self):
        """(socket, fresh) or (None, True) when nothing answers."""
        if os.getpid() != self._pid:        # a forked child: the idle connections are the parent's
            with self._lock:
                self._idle, self._pid = [], os.getpid()
        while True:
            with self._lock:
                s = self._idle.pop() if self._idle else None
            if s is None:
                break
            if _quiet(s):
                return s, False
            s.close()
        return connect(self.path), True

    def give(self, s) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(s)
                return
        s.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def run_step(conns: StepConnections, frame: bytes):
    s, fresh = conns.take()
    if s is None:
        raise Unsupported(f"nothing answers at {conns.path}")
    reuse = False
    try:
        try:
            s.sendall(frame)
        except OSError:
            if fresh:               # refused as it was accepted (too many connections): its E says so
                f = read_frame(s)
                if f is not None and f[0] == "E":
                    _check_error(conns, _item(*f)[1], fresh)
            raise
        while True:
            f = read_frame(s)
            if f is None:
                raise StepError("UNAVAILABLE", _LOST)
            item = _item(*f)
            if item[0] == "error":
                _check_error(conns, item[1], fresh)
            if item[0] == "exit":
                reuse = True
                yield item
                return
            yield item
    except OSError as e:
        raise StepError("UNAVAILABLE", f"the step's connection to the agent failed: {e}") from None
    finally:
        if reuse:
            conns.give(s)
        else:
            s.close()               # left mid-step (or an error): the agent stops the step


class AsyncStepConnections:
    """The same for one asyncio event loop."""

    def __init__(self, path: str):
        self.path = path
        self.supported = True
        self._idle: list = []

    async def take(self):
        import asyncio
        while self._idle:
            r, w = self._idle.pop()
            if not r.at_eof() and not w.is_closing() and _quiet(w.get_extra_info("socket")):
                return r, w, False
            w.close()
        try:
            r, w = await asyncio.open_unix_connection(self.path)
        except OSError:
            return None, None, True
        return r, w, True

    def give(self, r, w) -> None:
        if len(self._idle) < KEEP:
            self._idle.append((r, w))
        else:
            w.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, w in idle:
            w.close()


async def run_step_async(conns: AsyncStepConnections, frame: bytes):
    import asyncio
    r, w, fresh = await conns.take()
    if r is None:
        raise Unsupported(f"nothing answers at {conns.path}")
    reuse = False
    try:
        try:
            w.write(frame)
            await w.drain()
        except OSError:
            if fresh:               # refused as it was accepted: its E says so
                head = await r.read(_HEAD.size)
                if len(head) == _HEAD.size and head[:1] == b"E":
                    _check_error(conns, _item("E", await r.readexactly(_HEAD.unpack(head)[1]))[1], fresh)
            raise
        while True:
            try:
                head = await r.readexactly(_HEAD.size)
                kind, n = _HEAD.unpack(head)
                if n > MAX_FRAME:
                    raise StepError("INTERNAL", f"the agent sent a frame of {n} bytes")
                payload = await r.readexactly(n) if n else b""
            except asyncio.IncompleteReadError:
                raise StepError("UNAVAILABLE", _LOST) from None
            item = _item(kind.decode("latin-1"), payload)
            if item[0] == "error":
                _check_error(conns, item[1], fresh)
            if item[0] == "exit":
                reuse = True
                yield item
                return
            yield item
    except OSError as e:
        raise StepError("UNAVAILABLE", f"the step's connection to the agent failed: {e}") from None
    finally:
        if reuse:
            conns.give(r, w)
        else:
            w.close()               # left mid-step, cancelled, or an error: the agent stops the step
