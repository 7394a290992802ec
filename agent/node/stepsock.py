"""Steps over the agent's run socket (`<socket>.run`, agent/node/runsock.py): the framed Exec
protocol the SDK uses for a step in a live sandbox when it talks to its node's agent over
the unix socket, without gRPC (docs/agent.md "Steps over the run socket"). A connection
that opens with an `X` frame carries steps, one after another, for as long as the client
keeps it; each step goes through the same agent call as a gRPC Exec (agent/node/steps.py
exec_step: the same checks, authorisation, audit records, result and cancellation).

    serve_steps(agent, conn, FrameWriter(conn), "X", first_payload, peer)   # runsock, on an X or U frame

Frames as runclient.py's (one byte kind, four bytes big-endian length, payload).
  client -> agent: X a step: a JSON object, then optionally a NUL byte and the step's whole
                   stdin (closed after it: a step that streams stdin uses gRPC's Exec).
                   Fields: sandbox_id, argv (strings; bytes that are not UTF-8 as \\udcXX
                   surrogate escapes), env ([name, value] pairs), workdir, timeout, grace
                   (seconds, 0 = none / the sandbox's), close_after, wait_export, started
                   (false: no S frame). Nothing else is sent until the step's x or E.
  agent -> client: S started (JSON: step, ts_ns), o stdout, e stderr (chunks as they come),
                   x exit (JSON: ExitStatus's fields, `final`, and `summary` for close_after),
                   E error (JSON: code, message) when the step was refused or failed before
                   its exit. After x or E the connection takes the next X (or a call, U:
                   agent/node/callsock.py); a request that
                   cannot be read (a frame over the limit or cut short, another kind of
                   frame) gets an E and the connection is closed.
The client going away (its connection hung up) while its step waits or runs cancels the
step (SIGTERM, grace, SIGKILL; close_after: its sandbox ends), as a cancelled Exec.
"""
from __future__ import annotations

import logging
import os

from agent.errors import ReportedError
from agent.node.records import ApiError, _bad
from agent.node.runclient import MAX_FRAME, ProtocolError, loads, read_frame

log = logging.getLogger("dsec.agent")

_FIELDS = {"sandbox_id": str, "argv": list, "env": list, "workdir": str, "timeout": (int, float),
           "grace": (int, float), "close_after": bool, "wait_export": bool, "started": bool}


def serve_steps(agent, c, w, kind: str, payload: bytes, peer: str) -> None:
    """Serve the steps (X) and calls (U, agent/node/callsock.py) of one connection, the first
    frame given; returns when the client closes it. Raises ProtocolError (the caller answers
    E and closes) and OSError."""
    from agent.node.callsock import serve_call
    caller = agent.authz.caller(peer, [])           # the root-only unix socket: as its gRPC callers
    limit = min(MAX_FRAME, agent.cfg.limits.max_message_bytes)
    hangup = c.fileno()
    while True:
        created = None
        agent.calls.begin()         # a step or call in flight (an idle connection is none: --idle-exit)
        try:
            if kind == "X":
                _step(agent, w, payload, caller, limit, hangup)
            else:
                created = serve_call(agent, w, payload, caller, limit, hangup)
        finally:
            agent.calls.end()
        try:
            f = read_frame(c)
        except ConnectionResetError:
            if created:             # the client closed with the create's reply unread: nobody holds it
                from agent.node.calls import close_quietly
                close_quietly(agent, created)
            raise
        if f is None:
            return
        kind, payload = f
        if kind not in ("X", "U"):
            raise ProtocolError(f"expected a step (X) or a call (U), got a frame of kind {kind!r}")


def parse_step(payload: bytes, limit: int) -> dict:
    """An X frame's payload as exec_step's `start` (the shape of api._start_dict), or
    ApiError naming what is wrong."""
    if len(payload) > limit:
        raise ApiError("RESOURCE_EXHAUSTED", f"step request of {len(payload)} bytes; at most {limit} "
                                             f"(limits.max_message_bytes; stream larger stdin with Exec)")
    head, sep, stdin = payload.partition(b"\0")
    try:
        req = loads(head)
    except (ValueError, RecursionError) as e:      # not JSON, not UTF-8, nested past the stack
        raise _bad(f"step request: {e}") from None
    if not isinstance(req, dict):
        raise _bad(f"step request: a JSON object, got {type(req).__name__}")
    problems = [f"{k}: unknown field" for k in req if k not in _FIELDS]
    for k, t in _FIELDS.items():
        v = req.get(k)
        if v is not None and (not isinstance(v, t) or (t is not bool and isinstance(v, bool))):
            problems.append(f"{k}: expected {_what(t)}, got {type(v).__name__}")
    if problems:
        raise _bad("step request: " + "; ".join(problems))
    argv = req.get("argv") or []
    env = req.get("env") or []
    if not all(isinstance(a, str) for a in argv):
        raise _bad("step request: argv: a list of strings")
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in env):
        raise _bad("step request: env: a list of [name, value] string pairs")
    for k in ("sandbox_id", "workdir"):
        try:
            (req.get(k) or "").encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(f"step request: {k}: not UTF-8") from None
    return {"sandbox_id": req.get("sandbox_id") or "", "argv": [os.fsencode(a) for a in argv],
            "env": [(os.fsencode(k), os.fsencode(v)) for k, v in env], "workdir": req.get("workdir") or "",
            "stdin": stdin if sep else b"", "close_stdin": True,
            "timeout_seconds": float(req.get("timeout") or 0), "grace_seconds": float(req.get("grace") or 0),
            "close_after": bool(req.get("close_after")), "wait_export": bool(req.get("wait_export")),
            "no_started": req.get("started") is False}


def _what(t) -> str:
    return {str: "a string", list: "a list", bool: "true or false"}.get(t, "a number")


def _step(agent, w, payload: bytes, caller, limit: int, hangup: int) -> None:
    try:
        start = parse_step(payload, limit)
    except ApiError as e:
        w.send_json("E", {"code": e.code, "message": e.message})
        return
    cancels = []
    exited = False
    gen = agent.exec_step(start, None, cancels.append, _no_deadline, caller, hangup)
    try:
        for item in gen:
            k = item[0]
            try:
                if k == "stdout":
                    w.send("o", item[1])
                elif k == "stderr":
                    w.send("e", item[1])
                elif k == "exit":
                    exited = True
                    w.send_json("x", item[1])
                elif k == "started":
                    w.send_json("S", {"step": item[1], "ts_ns": item[2]})
            except OSError as e:
                raise _Gone(e) from None
    except _Gone as e:
        for cb in cancels:          # the client went away mid-step: as a cancelled Exec, before the
            cb()                    # generator closes (exec_step's cancel checks that)
        raise e.err
    except ApiError as e:           # after the exit: its `final` said it already
        if not exited:
            w.send_json("E", {"code": e.code, "message": e.message})
    except ReportedError as e:
        if not exited:
            w.send_json("E", {"code": "FAILED_PRECONDITION", "message": e.message})
    except Exception as e:  # noqa: BLE001 - one step's internal error, never the connection's
        log.exception("step socket: internal error")
        if not exited:
            w.send_json("E", {"code": "INTERNAL", "message": f"internal error: {type(e).__name__}: {e}"})
    finally:
        gen.close()


class _Gone(Exception):
    """A frame could not be sent: the client is gone (the connection's error in `err`)."""

    def __init__(self, err: OSError):
        super().__init__(str(err))
        self.err = err


def _no_deadline():
    return None
