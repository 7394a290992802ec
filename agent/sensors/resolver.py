"""Hostname rules of egress policies: resolved by the agent, with TTLs.

    r = HostResolver()                     # nameservers of /etc/resolv.conf
    res = r.resolve("pypi.internal")       # Resolution(addresses, ttl, source)

Order, as the system resolver with the usual nsswitch `hosts: files dns`:
  1. /etc/hosts (static: `default_ttl`);
  2. DNS: A and AAAA queries over UDP (TCP when the answer is truncated) to
     each nameserver in turn, TTL = the smallest TTL of the answer's records
     (CNAME chain included), clamped to [min_ttl, max_ttl]; an answer with no
     address (NXDOMAIN, NODATA) is an empty list with min_ttl;
  3. when no nameserver answers at all: getaddrinfo (NSS: whatever else the
     host configured), TTL `default_ttl`.
A failure of all three raises ResolveError.

The sandbox resolves the name itself through the policy's `dns` resolvers;
the agent resolves it through the host's. When the two see different
answers (split horizon, load balancers), the sandbox's connection to an
address the agent did not see is refused: point both at the same resolver.
How addresses age and what happens on failure is the enforcement sensor's
business (docs/enforcement.md, "Hostname rules").
"""
from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

TYPE_A, TYPE_AAAA, TYPE_CNAME = 1, 28, 5
CLASS_IN = 1


class ResolveError(Exception):
    pass


@dataclass(frozen=True)
class Resolution:
    addresses: tuple          # text addresses, sorted, IPv4 first
    ttl: int                  # seconds until it should be asked again
    source: str               # hosts | dns | getaddrinfo


def read_resolv_conf(path: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        ipaddress.ip_address(parts[1].split("%")[0])
                    except ValueError:
                        continue
                    out.append((parts[1], 53))
    except OSError:
        pass
    return out[:3]


def read_hosts(host: str, path: str = "/etc/hosts") -> list[str]:
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 2 and host in (p.lower() for p in parts[1:]):
                    try:
                        out.append(str(ipaddress.ip_address(parts[0])))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


# ---------------------------------------------------------------- DNS wire format

def build_query(host: str, qtype: int, qid: int) -> bytes:
    name = b""
    for label in host.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ResolveError(f"invalid DNS name {host!r}")
        name += bytes([len(raw)]) + raw
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + name + b"\0" + struct.pack(">HH", qtype, CLASS_IN)


def _skip_name(msg: bytes, off: int) -> int:
    for _ in range(128):
        if off >= len(msg):
            raise ResolveError("truncated DNS name")
        n = msg[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:
            return off + 2
        off += 1 + n
    raise ResolveError("DNS name too long")


def parse_response(msg: bytes, qid: int, qtype: int) -> tuple[list[str], int | None, bool]:
    """(addresses of type qtype, smallest TTL of the answer records or None, truncated)."""
    if len(msg) < 12:
        raise ResolveError("short DNS response")
    rid, flags, qd, an, _, _ = struct.unpack_from(">HHHHHH", msg, 0)
    if rid != qid or not flags & 0x8000:
        raise ResolveError("DNS response does not match the query")
    if flags & 0x0200:
        return [], None, True
    rcode = flags & 0xF
    if rcode == 3:          # NXDOMAIN
        return [], None, False
    if rcode != 0:
        raise ResolveError(f"DNS server answered rcode {rcode}")
    off = 12
    for _ in range(qd):
        off = _skip_name(msg, off) + 4
    addrs, ttl = [], None
    for _ in range(an):
        off = _skip_name(msg, off)
        if off + 10 > len(msg):
            raise ResolveError("truncated DNS record")
        rtype, rclass, rttl, rdlen = struct.unpack_from(">HHIH", msg, off)
        off += 10
        rdata = msg[off: off + rdlen]
        off += rdlen
        if rclass != CLASS_IN or rtype not in (TYPE_A, TYPE_AAAA, TYPE_CNAME):
            continue
        ttl = rttl if ttl is None else min(ttl, rttl)
        if rtype == qtype == TYPE_A and rdlen == 4:
            addrs.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == qtype == TYPE_AAAA and rdlen == 16:
            addrs.append(str(ipaddress.IPv6Address(rdata)))
    return addrs, ttl, False


def _exchange_udp(server: tuple[str, int], q: bytes, timeout: float) -> bytes:
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.connect(server)
        s.send(q)
        return s.recv(65535)


def _exchange_tcp(server: tuple[str, int], q: bytes, timeout: float) -> bytes:
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(server)
        s.sendall(struct.pack(">H", len(q)) + q)
        data = b""
        while len(data) < 2 or len(data) < 2 + struct.unpack_from(">H", data)[0]:
            chunk = s.recv(65535)
            if not chunk:
                raise ResolveError("DNS TCP connection closed early")
            data += chunk
        return data[2: 2 + struct.unpack_from(">H", data)[0]]


# ---------------------------------------------------------------- the resolver

class HostResolver:
    def __init__(self, nameservers=None, *, timeout: float = 1.0, default_ttl: int = 60,
                 min_ttl: int = 5, max_ttl: int = 3600, hosts_file: str = "/etc/hosts",
                 resolv_conf: str = "/etc/resolv.conf", system_fallback: bool = True):
        self.nameservers = [tuple(ns) if not isinstance(ns, str) else (ns, 53)
                            for ns in (nameservers if nameservers is not None else read_resolv_conf(resolv_conf))]
        self.timeout = timeout
        self.default_ttl = default_ttl
        self.min_ttl = min_ttl
        self.max_ttl = max_ttl
        self.hosts_file = hosts_file
        self.system_fallback = system_fallback

    def _clamp(self, ttl: int) -> int:
        return max(self.min_ttl, min(self.max_ttl, int(ttl)))

    def _query(self, server, host: str, qtype: int) -> tuple[list[str], int | None]:
        qid = secrets.randbelow(65536)
        q = build_query(host, qtype, qid)
        addrs, ttl, truncated = parse_response(_exchange_udp(server, q, self.timeout), qid, qtype)
        if truncated:
            addrs, ttl, _ = parse_response(_exchange_tcp(server, q, self.timeout), qid, qtype)
        return addrs, ttl

    def resolve(self, host: str) -> Resolution:
        host = host.lower().rstrip(".")
        static = read_hosts(host, self.hosts_file)
        if static:
            return Resolution(_sorted(static), self._clamp(self.default_ttl), "hosts")
        errors = []
        for server in self.nameservers:
            try:
                a, ta = self._query(server, host, TYPE_A)
                aaaa, t6 = self._query(server, host, TYPE_AAAA)
            except (OSError, ResolveError) as e:
                errors.append(f"{server[0]}:{server[1]}: {e}")
                continue
            ttls = [t for t in (ta, t6) if t is not None]
            ttl = min(ttls) if ttls and (a or aaaa) else self.min_ttl
            return Resolution(_sorted(a + aaaa), self._clamp(ttl), "dns")
        if self.system_fallback:
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
                return Resolution(_sorted({i[4][0].split("%")[0] for i in infos}),
                                  self._clamp(self.default_ttl), "getaddrinfo")
            except OSError as e:
                errors.append(f"getaddrinfo: {e}")
        raise ResolveError(f"cannot resolve {host!r}: " + ("; ".join(errors) or "no nameserver configured"))


def _sorted(addrs) -> tuple:
    return tuple(sorted(set(addrs), key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a))))


__all__ = ["HostResolver", "Resolution", "ResolveError", "read_resolv_conf"]
