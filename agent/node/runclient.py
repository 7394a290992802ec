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
(the same as a cancelled Exec). This module imports only the standard library.
"""
from __future__ import annotations

import json
import socket
import struct
import threading

DEFAULT_SOCKET = "/run/dsec/agent.sock"       # the agent's gRPC socket (also agent/node/config.py's default)
ENV_SOCKET = "DSEC_AGENT_SOCKET"
MAX_FRAME = 8 << 20
_HEAD = struct.Struct(">cI")


def run_socket_path(agent_socket: str) -> str:
    return agent_socket + ".run"


class ProtocolError(Exception):
    pass


def connect(path: str) -> socket.socket | None:
    """A connection to the run socket at path, or None when nothing listens there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
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
        self.lock = threading.Lock()

    def send(self, kind: str, payload: bytes = b"") -> None:
        for i in range(0, max(1, len(payload)), MAX_FRAME):
            part = payload[i:i + MAX_FRAME]
            with self.lock:
                self.sock.sendall(_HEAD.pack(kind.encode("latin-1"), len(part)) + part)

    def send_json(self, kind: str, value) -> None:
        self.send(kind, json.dumps(value, ensure_ascii=True, default=str).encode())
