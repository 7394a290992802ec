"""The SDK's side of the run socket's frames: a step in a live sandbox (agent/node/stepsock.py
describes the frames) and the calls around it, CreateSandbox, RunOnce, Wait, Kill, CloseSandbox
and Get (agent/node/callsock.py), sent over the agent's run socket (`<socket>.run`) instead of
gRPC, when the SDK talks to its node's agent over the unix socket. Connections are kept and
reused, one step or call at a time each (a Client keeps at most KEEP idle ones); a connection
that is left mid-step or mid-call is closed, which the agent takes as a cancelled call.

    conns = StepConnections(run_socket_path(agent_socket))
    for kind, value in run_step(conns, step_request(sid, argv, ...)):
        ...   # ("started", step) | ("stdout", bytes) | ("stderr", bytes) | ("exit", dict)
    # StepError(code, message) for an E frame; Unsupported before anything ran (nothing answers
    # there, or an agent that predates steps on its run socket): the caller uses gRPC

    reply = run_call(conns, call_request("CreateSandbox", request.SerializeToString(), 60.0), 60.0)
    # the reply message's bytes; StepError(code, message) for an E frame (DEADLINE_EXCEEDED when no
    # answer came by the deadline and a margin); Unsupported before anything ran (gRPC then)

AsyncStepConnections / run_step_async / run_call_async: the same for asyncio (AsyncClient).
"""
from __future__ import annotations

import os
import select

from agent.node.runclient import _HEAD, MAX_FRAME, connect, dumps, loads, read_frame

KEEP = 8                        # idle connections a client keeps
MAX_STDIN = 4 << 20             # a step with more stdin than this goes over gRPC (one frame carries it)
_OLD_AGENT = "the first frame must be a request (R), got 'X'"
_FULL = "at once (limits.max_concurrent_rpcs)"           # runsock's refusal of one connection too many
MARGIN = 2.0                    # a call's reply is awaited this long past its deadline (the agent's own)


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


def call_request(method: str, message: bytes, timeout: float | None) -> bytes | None:
    """A U frame (header included) for a call of the agent's API (its request message serialised),
    or None when it is too large for one frame."""
    head = {"method": method}
    if timeout:
        head["timeout"] = float(timeout)
    payload = dumps(head) + b"\0" + message
    if len(payload) > MAX_FRAME:
        return None
    return _HEAD.pack(b"U", len(payload)) + payload


def _check_call_error(conns, err: StepError, fresh: bool):
    if err.code == "INVALID_ARGUMENT" and err.message.startswith("dsec run socket:") and "'U'" in err.message:
        conns.calls = False         # an agent without calls on its run socket refused the frame: nothing ran
        raise Unsupported(err.message)
    if err.code == "INVALID_ARGUMENT" and _NOT_HERE in err.message:
        raise Unsupported(err.message)      # a call this agent does not carry over frames: nothing ran
    if fresh and err.code == "RESOURCE_EXHAUSTED" and _FULL in err.message:
        raise Unsupported(err.message)      # the socket's connections are all taken: gRPC this time
    raise err


_NOT_HERE = "is not carried here"           # callsock's refusal of a method it does not serve
_NO_REPLY = "the agent closed the call's connection before its reply"
_DEADLINE = "Deadline Exceeded"             # what gRPC's client says at a call's deadline


class StepConnections:
    """Idle connections to one agent's run socket (thread-safe)."""

    def __init__(self, path: str):
        import _thread
        self.path = path
        self.supported = True           # steps (X frames)
        self.calls = True               # calls (U frames)
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


def run_call(conns: StepConnections, frame: bytes, timeout: float | None) -> bytes:
    """One call's reply message (serialised). Raises StepError for the agent's E (or a lost
    connection, or no answer by the deadline + MARGIN: the connection is closed, which the agent
    takes as the caller gone), Unsupported when nothing ran."""
    s, fresh = conns.take()
    if s is None:
        raise Unsupported(f"nothing answers at {conns.path}")
    reuse = False
    try:
        if timeout:
            s.settimeout(timeout + MARGIN)
        try:
            s.sendall(frame)
        except OSError:
            if fresh:               # refused as it was accepted (too many connections): its E says so
                f = read_frame(s)
                if f is not None and f[0] == "E":
                    _check_call_error(conns, _item(*f)[1], fresh)
            raise
        f = read_frame(s)
        if f is None:
            raise StepError("UNAVAILABLE", _NO_REPLY)
        if f[0] == "u":
            if timeout:
                s.settimeout(None)
            reuse = True
            return f[1]
        err = _item(*f)[1] if f[0] == "E" else StepError("INTERNAL", f"the agent answered a call with a "
                                                                     f"frame of kind {f[0]!r}")
        _check_call_error(conns, err, fresh)
    except TimeoutError:
        raise StepError("DEADLINE_EXCEEDED", _DEADLINE) from None
    except OSError as e:
        raise StepError("UNAVAILABLE", f"the call's connection to the agent failed: {e}") from None
    finally:
        if reuse:
            conns.give(s)
        else:
            s.close()               # an error, or left mid-call: the agent takes the caller as gone


class AsyncStepConnections:
    """The same for one asyncio event loop."""

    def __init__(self, path: str):
        self.path = path
        self.supported = True
        self.calls = True
        self._idle: list = []
        self._reapers: set = set()      # tasks reading the reply of a cancelled create (run_call_async)

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


async def _read_frame_async(r):
    import asyncio
    try:
        head = await r.readexactly(_HEAD.size)
        kind, n = _HEAD.unpack(head)
        if n > MAX_FRAME:
            raise StepError("INTERNAL", f"the agent sent a frame of {n} bytes")
        return kind.decode("latin-1"), (await r.readexactly(n) if n else b"")
    except asyncio.IncompleteReadError:
        return None


async def run_call_async(conns: AsyncStepConnections, frame: bytes, timeout: float | None, orphan=None) -> bytes:
    """As run_call. orphan: a coroutine function called with the reply when the task awaiting it
    is cancelled after the call was sent and its reply comes anyway (CreateSandbox: the SDK closes
    the sandbox nobody will hold); the cancelled call's connection is shut for writing, which the
    agent takes as its caller gone, and read to its answer in the background."""
    import asyncio
    r, w, fresh = await conns.take()
    if r is None:
        raise Unsupported(f"nothing answers at {conns.path}")
    reuse = sent = False
    try:
        try:
            w.write(frame)
            await w.drain()
            sent = True
        except OSError:
            if fresh:               # refused as it was accepted: its E says so
                f = await _read_frame_async(r)
                if f is not None and f[0] == "E":
                    _check_call_error(conns, _item(*f)[1], fresh)
            raise
        try:
            f = await asyncio.wait_for(_read_frame_async(r), timeout + MARGIN if timeout else None)
        except asyncio.TimeoutError:
            raise StepError("DEADLINE_EXCEEDED", _DEADLINE) from None
        if f is None:
            raise StepError("UNAVAILABLE", _NO_REPLY)
        if f[0] == "u":
            reuse = True
            return f[1]
        err = _item(*f)[1] if f[0] == "E" else StepError("INTERNAL", f"the agent answered a call with a "
                                                                     f"frame of kind {f[0]!r}")
        _check_call_error(conns, err, fresh)
    except asyncio.CancelledError:
        if sent and orphan is not None and not w.is_closing():
            try:
                w.write_eof()       # the agent sees its caller gone; its answer can still be read
            except OSError:
                pass
            else:
                t = asyncio.ensure_future(_reap(r, w, orphan))
                conns._reapers.add(t)
                t.add_done_callback(conns._reapers.discard)
                w = None
        raise
    except OSError as e:
        raise StepError("UNAVAILABLE", f"the call's connection to the agent failed: {e}") from None
    finally:
        if w is not None:
            if reuse:
                conns.give(r, w)
            else:
                w.close()


async def _reap(r, w, orphan):
    import asyncio
    try:
        f = await asyncio.wait_for(_read_frame_async(r), 120)
        if f is not None and f[0] == "u":
            await orphan(f[1])
    except Exception:  # noqa: BLE001 - best effort: the agent closed it already if it saw the hang-up
        pass
    finally:
        w.close()
