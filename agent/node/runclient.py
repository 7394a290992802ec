"""`dsec run`'s own small protocol to the node agent, without gRPC on the client
side: importing grpc and protobuf cost the CLI ~170-200 ms of its ~350 ms (py-spy,
-X importtime). The agent serves it on a second root-only unix socket beside its
gRPC one (run_socket_path: `<socket>.run`, agent/node/runsock.py); one connection
is one sandbox with one step, closed after it (CreateSandbox + Exec(close_after)).

    sock = connect(run_socket_path(path))            # None when nothing answers there
    w = FrameWriter(sock)
    w.send("R", json.dumps({"create": {...}, "exec": {...}}).encode())
    kind, payload = read_frame(sock)                 # ("C", sandbox) | ("E", error) ...

Frames both ways: one byte kind, four bytes big-endian length, payload (at most
MAX_FRAME bytes).
  client -> agent: R request (JSON: create = the SDK's create() keywords, exec = argv, stdin
                   open, timeout, grace, wait_export); then i stdin chunk, c stdin closed,
                   s signal (JSON number)
  agent -> client: C created (JSON: sandbox_id), S started (JSON: step), o stdout, e stderr,
                   x exit (JSON: the ExitStatus fields and summary), E error (JSON: code,
                   message, reason), after which the agent closes the connection
Strings that are not UTF-8 travel as surrogate escapes (JSON's \\udcXX). A client
that goes away mid-step has its step stopped and, as a one-shot run, its sandbox
(the same as a cancelled Exec). This module imports only the standard library, and of
it only C modules beside struct (_socket, _thread, _json: not socket, threading, json, whose
imports of enum, re and selectors were ~40% of `dsec run`'s start-up before it connects;
dumps/loads are json.dumps(ensure_ascii=True, default=str) and json.loads, a test keeps them so).
"""
from __future__ import annotations

import _socket
import _thread
import struct

try:
    import _json                # CPython's JSON accelerator: json without json.decoder's `re` import
except ImportError:             # pragma: no cover - another interpreter: the json package
    _json = None

DEFAULT_SOCKET = "/run/dsec/agent.sock"       # the agent's gRPC socket (also agent/node/config.py's default)
ENV_SOCKET = "DSEC_AGENT_SOCKET"
MAX_FRAME = 8 << 20
_HEAD = struct.Struct(">cI")


def run_socket_path(agent_socket: str) -> str:
    return agent_socket + ".run"


class ProtocolError(Exception):
    pass


def connect(path: str) -> "_socket.socket | None":
    """A connection to the run socket at path, or None when nothing listens there."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def _recv_exact(sock, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock) -> tuple[str, bytes] | None:
    """The next frame (kind, payload), or None at the end of the stream. Raises ProtocolError
    on a frame over MAX_FRAME or a stream cut inside a frame; OSError as the socket raises."""
    head = _recv_exact(sock, _HEAD.size)
    if head is None:
        return None
    kind, n = _HEAD.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes (at most {MAX_FRAME})")
    payload = _recv_exact(sock, n) if n else b""
    if payload is None:
        raise ProtocolError("the stream ended inside a frame")
    return kind.decode("latin-1"), payload


class FrameWriter:
    """Frames onto a socket from several threads (and signal handlers of the main thread)."""

    def __init__(self, sock):
        self.sock = sock
        self.lock = _thread.allocate_lock()

    def send(self, kind: str, payload: bytes = b"") -> None:
        for i in range(0, max(1, len(payload)), MAX_FRAME):
            part = payload[i:i + MAX_FRAME]
            with self.lock:
                self.sock.sendall(_HEAD.pack(kind.encode("latin-1"), len(part)) + part)

    def send_json(self, kind: str, value) -> None:
        self.send(kind, dumps(value))


def dumps(value) -> bytes:
    """json.dumps(value, ensure_ascii=True, default=str).encode(), through _json's encoder."""
    if _json is None:
        import json
        return json.dumps(value, ensure_ascii=True, default=str).encode()
    enc = _json.make_encoder({}, str, _json.encode_basestring_ascii, None, ": ", ", ", False, False, True)
    return "".join(enc(value, 0)).encode()


class _Scan:
    """What _json's scanner reads of a json.JSONDecoder: json.loads' defaults."""
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
    memo: dict = {}


_WS = " \t\n\r"


def loads(data: bytes):
    """json.loads(data) of a frame's payload (ValueError when it is not one JSON value)."""
    if _json is None:
        import json
        return json.loads(data)
    s = data.decode("utf-8", "surrogatepass")
    scan = _json.make_scanner(_Scan)
    i = len(s) - len(s.lstrip(_WS))
    try:
        value, end = scan(s, i)
    except StopIteration as e:
        raise ValueError(f"not JSON: expecting a value at {e.value}") from None
    if s[end:].strip(_WS):
        raise ValueError(f"not JSON: extra data at {end}")
    return value
