"""Sandbox networking, host side.

--network none:   the sandbox's own network namespace with loopback only.
--network egress: a veth pair ("dsv<hash>" on the host, "eth0" inside) with a
/30 from DSEC_EGRESS_POOL (default 10.213.0.0/16), a default route via the host
end, and NAT on the host. Links and addresses are made with pyroute2; the NAT
and isolation rules with nftables (the `nft` tool: pyroute2's nftables support
cannot yet express NAT rules).

The nftables table `inet dsec` (IPv4 and IPv6 alike; created once, kept;
`dsec gc` removes it when no sandbox is left):
  postrouting  masquerades sandbox traffic leaving through any other interface;
  forward      drops traffic between sandboxes and to the egress pool, drops
               every IPv6 packet of a sandbox (no IPv6 is routed for them),
               and refuses (ICMP admin-prohibited) the node-protected ranges
               (policies.compile.NODE_PROTECTED: link-local and the metadata
               service, private, CGNAT, ULA, loopback, multicast, reserved)
               unless the sandbox's policy has an egress section (its
               interface is then in the set policy_ifs, and the eBPF egress
               rules decide); DNS (port 53) to the node's resolvers stays open;
  input        drops new connections from a sandbox to the host itself, on
               any of its addresses (the agent's sockets, sshd, a kubelet).
Inside, IPv6 is disabled on eth0 unless the policy allows IPv6 egress
(launcher.ipv6_allowed); the host end of each veth has IPv6 disabled.

Several agents on one host (docs/cluster.md) each have their own pool
(DSEC_EGRESS_POOL, or the agent config's host.egress_pool): a pool other than
the default gets its own table, `inet dsec_<hash of the pool>`, so one agent
never rewrites or removes another's NAT, and gc removes only the host links
whose address is in its own pool (or that have none yet). The forward rules
match every dsec host link (dsv*), so each agent's table also refuses the
other agents' sandboxes the node-protected ranges (stricter, never looser).
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import socket
import subprocess
import threading

from agent.errors import DsecError, EXIT_DSEC

RUN_DIR = "/run/dsec"
DEFAULT_POOL = "10.213.0.0/16"


def parse_pool(text: str, what: str = "DSEC_EGRESS_POOL") -> ipaddress.IPv4Network:
    try:
        pool = ipaddress.ip_network(text.strip())
    except ValueError as e:
        raise DsecError(f"{what}={text!r}: not an IPv4 network ({e})", 2) from None
    if pool.version != 4 or pool.prefixlen > 30:
        raise DsecError(f"{what}={text!r}: an IPv4 network of at least a /30 is needed", 2)
    return pool


POOL = ipaddress.ip_network(os.environ.get("DSEC_EGRESS_POOL", DEFAULT_POOL))


def nat_table() -> str:
    """The nftables table of this pool: `dsec` for the default pool."""
    if POOL == ipaddress.ip_network(DEFAULT_POOL):
        return "dsec"
    return "dsec_" + hashlib.sha1(str(POOL).encode()).hexdigest()[:8]


def table() -> tuple[str, str]:
    """(family, name) of this pool's nftables table."""
    return ("inet", nat_table())


HOST_PREFIX = "dsv"
PEER_PREFIX = "dsp"

NFT_RULES = """table inet {table} {{
  set policy_ifs {{
    type ifname
{policy_elems}  }}
  set protect4 {{
    type ipv4_addr; flags interval
    elements = {{ {protect4} }}
  }}
  set protect6 {{
    type ipv6_addr; flags interval
    elements = {{ {protect6} }}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != "{pfx}*" masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{pfx}*" oifname "{pfx}*" drop
    iifname "{pfx}*" ip daddr {pool} drop
    iifname "{pfx}*" meta nfproto ipv6 drop
    iifname @policy_ifs accept
{dns}    iifname "{pfx}*" ip daddr @protect4 reject with icmpx type admin-prohibited
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{pfx}*" ct state established,related accept
    iifname "{pfx}*" drop
  }}
}}
"""


def _rules(policy_ifs=()) -> str:
    from policies.compile import NODE_PROTECTED
    from agent.sandbox.rootfs import _host_nameservers
    v4 = ", ".join(str(n) for n in NODE_PROTECTED if n.version == 4)
    v6 = ", ".join(str(n) for n in NODE_PROTECTED if n.version == 6)
    dns = ""
    for ns in _host_nameservers():
        try:
            a = ipaddress.ip_address(ns)
        except ValueError:
            continue
        if a.version == 4:
            for proto in ("udp", "tcp"):
                dns += f'    iifname "{HOST_PREFIX}*" ip daddr {a} {proto} dport 53 accept\n'
    elems = f"    elements = {{ {', '.join(chr(34) + i + chr(34) for i in sorted(policy_ifs))} }}\n" if policy_ifs else ""
    return NFT_RULES.format(table=nat_table(), pool=POOL, pfx=HOST_PREFIX, protect4=v4, protect6=v6, dns=dns, policy_elems=elems)


def ifnames(sandbox_id: str) -> tuple[str, str]:
    h = hashlib.sha1(sandbox_id.encode()).hexdigest()[:11]
    return HOST_PREFIX + h, PEER_PREFIX + h


class _Lock:
    def __enter__(self):
        os.makedirs(RUN_DIR, exist_ok=True)
        self.fd = os.open(os.path.join(RUN_DIR, "net.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *a):
        os.close(self.fd)


def _nft(args, text=None):
    try:
        return subprocess.run(["nft", *args], input=text, capture_output=True, text=True)
    except OSError as e:
        raise DsecError(f"cannot run nft ({e.strerror}): install nftables", EXIT_DSEC)


def _live_policy_ifs() -> list[str]:
    r = _nft(["list", "set", *table(), "policy_ifs"])
    if r.returncode != 0:
        return []
    return [i for i in re.findall(r'"([^"]+)"', r.stdout) if i.startswith(HOST_PREFIX)]


def _ensure_nat():
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        if f.read().strip() != "1":
            with open("/proc/sys/net/ipv4/ip_forward", "w") as w:
                w.write("1")
    want = _rules()
    prefix = f"nft-{nat_table()}-"
    marker = os.path.join(RUN_DIR, prefix + hashlib.sha1(want.encode()).hexdigest()[:12])
    if os.path.exists(marker) and _nft(["list", "table", *table()]).returncode == 0:
        return
    # replace the table atomically (one nft transaction), keeping the live sandboxes' entries; an
    # older dsec's `table ip dsec` may still serve its sandboxes: it is left to `dsec gc`
    text = "".join(f"table {f} {n} {{}}\ndelete table {f} {n}\n" for f, n in (table(),))
    r = _nft(["-f", "-"], text + _rules(_live_policy_ifs()))
    if r.returncode != 0:
        raise DsecError(f"cannot install the sandbox firewall with nft: {r.stderr.strip().splitlines()[-1:]}",
                        EXIT_DSEC)
    for old in os.listdir(RUN_DIR):
        if old.startswith(prefix):
            try:
                os.unlink(os.path.join(RUN_DIR, old))
            except OSError:
                pass
    open(marker, "w").close()


def _disable_ipv6(ifname: str):
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass                                      # no IPv6 on this host: nothing to disable


def setup_egress(sandbox_id: str, netns_pid: int, policy_egress: bool = False) -> dict:
    """Create the veth pair into the sandbox's netns; return the inside config.
    policy_egress: the policy has an egress section (its eBPF rules decide, the
    node-protected ranges are not refused by the firewall for it)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    host_if, peer_if = ifnames(sandbox_id)
    subnets = POOL.subnets(new_prefix=30)
    n = POOL.num_addresses // 4
    start = int(hashlib.sha1(sandbox_id.encode()).hexdigest(), 16) % n
    with _Lock(), IPRoute() as ipr:
        used = set()
        for a in ipr.get_addr(family=2):
            addr = a.get_attr("IFA_ADDRESS")
            if addr and ipaddress.ip_address(addr) in POOL:
                used.add(int(ipaddress.ip_address(addr)) & ~3)
        base = int(POOL.network_address)
        chosen = None
        for i in range(n):
            cand = base + ((start + i) % n) * 4
            if cand not in used:
                chosen = cand
                break
        if chosen is None:
            raise DsecError(f"egress address pool {POOL} exhausted", EXIT_DSEC)
        host_addr = str(ipaddress.ip_address(chosen + 1))
        peer_addr = str(ipaddress.ip_address(chosen + 2))
        try:
            ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": peer_if, "net_ns_pid": netns_pid})
            idx = ipr.link_lookup(ifname=host_if)[0]
            _disable_ipv6(host_if)
            ipr.addr("add", index=idx, address=host_addr, prefixlen=30)
            ipr.link("set", index=idx, state="up")
        except NetlinkError as e:
            raise DsecError(f"cannot create veth {host_if}: {e}", EXIT_DSEC)
        _ensure_nat()
        if policy_egress:
            r = _nft(["add", "element", *table(), "policy_ifs", "{", f'"{host_if}"', "}"])
            if r.returncode != 0:
                raise DsecError(f"cannot open the firewall for {host_if}: {r.stderr.strip()}", EXIT_DSEC)
    del subnets
    inside = {"peer": peer_if, "addr": peer_addr, "prefixlen": 30, "gateway": host_addr, "host_if": host_if}
    _configure_inside(netns_pid, inside)
    return inside


def _netlink_socket_in(netns_pid: int) -> socket.socket:
    """A NETLINK_ROUTE socket living in another process's network namespace.

    setns() in a short-lived thread changes only that thread's namespace; a
    socket keeps the namespace it was created in."""
    from agent.sandbox import sysutil as su
    out = {}

    def work():
        try:
            fd = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                su.setns(fd, su.CLONE_NEWNET)
            finally:
                os.close(fd)
            out["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 0)
        except OSError as e:
            out["err"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "err" in out:
        raise DsecError(f"cannot enter the sandbox's network namespace: {out['err']}", EXIT_DSEC)
    return out["sock"]


def _configure_inside(netns_pid: int, net: dict):
    from pyroute2 import IPRoute
    sock = _netlink_socket_in(netns_pid)
    with IPRoute(fileno=sock.detach()) as ipr:
        idx = ipr.link_lookup(ifname=net["peer"])[0]
        ipr.link("set", index=idx, ifname="eth0")
        ipr.addr("add", index=idx, address=net["addr"], prefixlen=net["prefixlen"])
        ipr.link("set", index=idx, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=net["gateway"])


def teardown(sandbox_id: str, policy_egress: bool | None = None):
    """Delete the sandbox's host veth if it still exists (it normally dies with the netns),
    and its entry in the firewall's policy_ifs set (policy_egress None: look)."""
    host_if, _ = ifnames(sandbox_id)
    if policy_egress or (policy_egress is None and host_if in _live_policy_ifs()):
        _nft(["delete", "element", *table(), "policy_ifs", "{", f'"{host_if}"', "}"])
    if not os.path.exists(f"/sys/class/net/{host_if}"):
        return
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=host_if)
        if idx:
            try:
                ipr.link("del", index=idx[0])
            except Exception:  # noqa: BLE001 - gone in between
                pass


def list_host_links(own_pool_only: bool = False) -> list[str]:
    """dsec's host links; own_pool_only: leave out those whose address is in another
    pool (another agent's on this host)."""
    try:
        names = [n for n in os.listdir("/sys/class/net") if n.startswith((HOST_PREFIX, PEER_PREFIX))]
    except OSError:
        return []
    if not own_pool_only or not names:
        return names
    from pyroute2 import IPRoute
    addrs: dict[int, list] = {}
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=2):
            addrs.setdefault(a["index"], []).append(ipaddress.ip_address(a.get_attr("IFA_ADDRESS")))
        out = []
        for n in names:
            idx = ipr.link_lookup(ifname=n)
            mine = [a for i in idx for a in addrs.get(i, [])]
            if not mine or any(a in POOL for a in mine):
                out.append(n)
    return out


def remove_nat():
    for fam, name in (table(), ("ip", nat_table())):
        subprocess.run(["nft", "delete", "table", fam, name], capture_output=True)
