"""The launcher's side of the dsec-init control protocol (agent/sandbox/init/proto.h,
the one declaration of its numbers; read here with a regex).

    data = encode(MSG.CONFIG, [(T.HOSTNAME, b"sbx-1"), (T.UID, 1000), (T.OP, [(T.KIND, OP.MOUNT), ...])])
    mtype, items = decode(data)            # items: [(tag, bytes)], nested items left as bytes
    fields(items)                          # {tag: [values]} with bytes values

Integers are 8 bytes little endian (negative ones in two's complement), str
values are encoded with surrogateescape (lossless for non-UTF-8 names), a list
value is a nested item.
"""
from __future__ import annotations

import os
import re
import select
import struct
import time

INIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init")
PROTO_H = os.path.join(INIT_DIR, "proto.h")


class _Names:
    def __init__(self, prefix: str, values: dict):
        self._prefix = prefix
        for k, v in values.items():
            if k.startswith(prefix):
                setattr(self, k[len(prefix):], v)


def _read_defines(path: str = PROTO_H) -> dict:
    with open(path) as f:
        text = f.read()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define\s+(DSEC_\w+)\s+(\d+)\b", text, re.M)}


DEFINES = _read_defines()
MSG = _Names("DSEC_MSG_", DEFINES)
T = _Names("DSEC_T_", DEFINES)
OP = _Names("DSEC_OP_", DEFINES)
MSG_NAMES = {v: k[len("DSEC_MSG_"):] for k, v in DEFINES.items() if k.startswith("DSEC_MSG_")}

_HDR = struct.Struct("<II")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _value(v) -> bytes:
    if isinstance(v, bool):
        return _U64.pack(int(v))
    if isinstance(v, int):
        return _U64.pack(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape")
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, (list, tuple)):
        return encode_items(v)
    raise TypeError(f"initproto: cannot encode {type(v).__name__}")


def encode_items(items) -> bytes:
    out = []
    for tag, v in items:
        b = _value(v)
        out.append(_HDR.pack(tag, len(b)))
        out.append(b)
    return b"".join(out)


def encode(mtype: int, items=()) -> bytes:
    return _U32.pack(mtype) + encode_items(items)


def decode_items(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    i, n = 0, len(data)
    while i < n:
        if n - i < 8:
            raise ValueError("torn item header")
        tag, ln = _HDR.unpack_from(data, i)
        i += 8
        if n - i < ln:
            raise ValueError("torn item")
        out.append((tag, data[i:i + ln]))
        i += ln
    return out


def decode(data: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    if len(data) < 4:
        raise ValueError("short message")
    return _U32.unpack_from(data)[0], decode_items(data[4:])


def u64(b: bytes) -> int:
    return _U64.unpack(b.ljust(8, b"\0")[:8])[0]


def i64(b: bytes) -> int:
    v = u64(b)
    return v - (1 << 64) if v >= 1 << 63 else v


def text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def fields(items) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for tag, v in items:
        out.setdefault(tag, []).append(v)
    return out


def await_hello(sock, timeout: float) -> str:
    """Wait for dsec-init's first message on `sock`, HELLO (its exec and its own
    set-up are done). Returns "" on HELLO, else why not (one line)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    deadline = time.monotonic() + timeout
    data = None
    while data is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"did not start within {timeout:.0f}s"
        try:
            data = sock.recv(1 << 16) if p.poll(left * 1000) else None
        except InterruptedError:
            continue
        except OSError as e:
            return f"did not start: {e.strerror or e}"
    try:
        mtype, items = decode(data)
    except ValueError:
        return "exited before it started" if not data else "sent a torn first message"
    if mtype == MSG.ERROR:
        return "failed to start: " + text((fields(items).get(T.MSG) or [b"unknown error"])[0])
    return "" if mtype == MSG.HELLO else f"sent message {mtype} before HELLO"

