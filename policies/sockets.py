"""socket(2) argument names for policies' syscalls.sockets rules (x86_64 and
asm-generic values, Linux 6.18): address families, types, protocols."""

SOCKET_FAMILIES = {"unspec": 0, "unix": 1, "inet": 2, "ax25": 3, "ipx": 4, "appletalk": 5, "netrom": 6,
                   "bridge": 7, "atmpvc": 8, "x25": 9, "inet6": 10, "rose": 11, "decnet": 12, "netbeui": 13,
                   "security": 14, "key": 15, "netlink": 16, "packet": 17, "ash": 18, "econet": 19,
                   "atmsvc": 20, "rds": 21, "sna": 22, "irda": 23, "pppox": 24, "wanpipe": 25, "llc": 26,
                   "ib": 27, "mpls": 28, "can": 29, "tipc": 30, "bluetooth": 31, "iucv": 32, "rxrpc": 33,
                   "isdn": 34, "phonet": 35, "ieee802154": 36, "caif": 37, "alg": 38, "nfc": 39, "vsock": 40,
                   "kcm": 41, "qipcrtr": 42, "smc": 43, "xdp": 44, "mctp": 45}
SOCKET_FAMILY_MAX = 46                 # AF_MAX on Linux 6.18
SOCKET_TYPES = {"stream": 1, "dgram": 2, "raw": 3, "rdm": 4, "seqpacket": 5, "dccp": 6, "packet": 10}
SOCKET_PROTOCOLS = {"default": 0, "icmp": 1, "igmp": 2, "tcp": 6, "udp": 17, "ipv6": 41, "gre": 47,
                    "icmpv6": 58, "sctp": 132, "udplite": 136, "raw": 255, "mptcp": 262}
SOCKET_PROTOCOL_MAX = 262


def _named_number(v, names: dict, what: str, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected a {what} name or number, got {type(v).__name__}")
    if isinstance(v, str):
        s = v.strip().lower()
        if s.isdigit():
            v = int(s)
        elif s in names:
            return names[s]
        else:
            import difflib
            close = difflib.get_close_matches(s, list(names), n=2, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ValueError(f"unknown {what} {v!r}{hint}; known: {', '.join(sorted(names))}")
    if not 0 <= v <= hi:
        raise ValueError(f"{what} {v} is out of range (0-{hi})")
    return v


def family(v) -> int:
    return _named_number(v, SOCKET_FAMILIES, "socket family", SOCKET_FAMILY_MAX - 1)


def socktype(v) -> int:
    return _named_number(v, SOCKET_TYPES, "socket type", 15)


def protocol(v) -> int:
    return _named_number(v, SOCKET_PROTOCOLS, "socket protocol", SOCKET_PROTOCOL_MAX)


def number_name(n: int, names: dict):
    for k, v in names.items():
        if v == n:
            return k
    return n
