"""Calls over the agent's run socket (`<socket>.run`, agent/node/runsock.py): the SDK's
CreateSandbox, RunOnce, Wait, Kill, CloseSandbox and Get as small frames instead of gRPC
when it talks to its node's agent over the unix socket (docs/agent.md "Calls over the run
socket"). A frame carries the very request message of the gRPC call and its answer the very
reply message, and the agent runs the same handler as its gRPC servicer
(agent/node/calls.py): the same checks, authorisation, scheduling, warm claims, records,
replies and errors. Only gRPC's machinery is left out: HTTP/2, the server's poll thread and
executor hand-off, the call's set-up and status.

    serve_call(agent, conn, FrameWriter(conn), payload, caller, limit)   # stepsock, on a U frame

Frames as runclient.py's (one byte kind, four bytes big-endian length, payload).
  client -> agent: U a call: a JSON object {"method": NAME, "timeout": SECONDS (optional: the
                   call's deadline, as gRPC's)}, a NUL byte, then the request message
                   (protobuf, serialised). Nothing else is sent until its answer.
  agent -> client: u the reply message (protobuf, serialised), or E (JSON: code, message) for
                   what gRPC answers with a status (INVALID_ARGUMENT, NOT_FOUND ...).
After the answer the connection takes the next U or X (agent/node/stepsock.py). A call whose
caller goes away (its connection hung up or shut for writing) before its reply is as a gRPC
call whose client went away: a CreateSandbox still waiting for its sandbox to run closes it,
a RunOnce's step is stopped and its sandbox ended. A CreateSandbox reply that could not be sent
(EPIPE), or that the caller never read (it closed the connection with the reply unread: the
kernel reports ECONNRESET at the agent's next read instead of the end of the stream), closes
the sandbox too: nobody holds its id.
"""
from __future__ import annotations

import select
import time

from agent.node.records import ApiError, _bad
from agent.node.runclient import loads

_FIELDS = {"method": str, "timeout": (int, float)}


class FrameCall:
    """A call over a frame socket as agent/node/calls.py's handlers see it."""
    __slots__ = ("caller", "hangup", "deadline", "callbacks")

    def __init__(self, caller, hangup: int, timeout: float | None):
        self.caller = caller
        self.hangup = hangup
        self.deadline = time.monotonic() + timeout if timeout else None
        self.callbacks: list = []

    def is_active(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return False
        p = select.poll()
        p.register(self.hangup, select.POLLRDHUP)
        try:
            return not p.poll(0)
        except OSError:
            return False

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add_callback(self, cb) -> bool:
        # what gRPC calls when a call ends early: a step's cancel (RunOnce). Here the step watches
        # the connection itself (exec_step's hangup), and nothing is sent before the reply
        self.callbacks.append(cb)
        return True


def parse_call(payload: bytes, limit: int):
    """A U frame's payload as (handler, request message, timeout), or ApiError naming what is wrong."""
    from agent.node.calls import HANDLERS
    from agent.node.proto import pb
    if len(payload) > limit:
        raise ApiError("RESOURCE_EXHAUSTED", f"call of {len(payload)} bytes; at most {limit} "
                                             f"(limits.max_message_bytes)")
    head, sep, body = payload.partition(b"\0")
    if not sep:
        raise _bad("call: a JSON head, a NUL byte, then the request message")
    try:
        req = loads(head)
    except (ValueError, RecursionError) as e:
        raise _bad(f"call: {e}") from None
    if not isinstance(req, dict):
        raise _bad(f"call: a JSON object, got {type(req).__name__}")
    problems = [f"{k}: unknown field" for k in req if k not in _FIELDS]
    for k, t in _FIELDS.items():
        v = req.get(k)
        if v is not None and (not isinstance(v, t) or isinstance(v, bool)):
            problems.append(f"{k}: expected {'a string' if t is str else 'a number'}, got {type(v).__name__}")
    if problems:
        raise _bad("call: " + "; ".join(problems))
    h = HANDLERS.get(req.get("method") or "")
    if h is None:
        raise _bad(f"call: method {str(req.get('method'))[:40]!r} is not carried here "
                   f"({', '.join(HANDLERS)}; the others are gRPC's)")
    timeout = req.get("timeout")
    if timeout is not None and not 0 < timeout < 1e9:
        raise _bad(f"call: timeout: a number of seconds > 0, got {timeout}")
    try:
        msg = getattr(pb, h.request).FromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError (and its kin on bad input)
        raise _bad(f"call: {req['method']}: not a {h.request} message ({type(e).__name__})") from None
    return h, msg, timeout


def serve_call(agent, w, payload: bytes, caller, limit: int, hangup: int) -> str | None:
    """One U frame: its answer sent (u or E); returns the sandbox a CreateSandbox reply named
    (the connection's next read tells whether the caller read it: serve_steps). Raises OSError
    when the answer cannot be sent."""
    from agent.node.calls import close_quietly, create_sandbox, invoke
    try:
        h, msg, timeout = parse_call(payload, limit)
    except ApiError as e:
        w.send_json("E", {"code": e.code, "message": e.message})
        return None
    call = FrameCall(caller, hangup, timeout)
    try:
        reply = invoke(h.fn, agent, msg, call)
    except ApiError as e:
        w.send_json("E", {"code": e.code, "message": e.message})
        return None
    created = reply.sandbox_id if h.fn is create_sandbox else None
    try:
        w.send("u", reply.SerializeToString())
    except OSError:
        if created:                 # nobody learnt its id: it would be left running (a gRPC reply
            close_quietly(agent, created)       # lost so is not seen)
        raise
    return created
