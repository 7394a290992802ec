"""Sandbox networking, host side.

--network none:   the sandbox's own network namespace with loopback only.
--network egress: a veth pair ("dsv<hash>" on the host, "eth0" inside) with a
/30 from DSEC_EGRESS_POOL (default 10.213.0.0/16), a default route via the host
end, and NAT on the host. Links and addresses are made with pyroute2; the NAT
and isolation rules with nftables (the `nft` tool: pyroute2's nftables support
cannot yet express NAT rules).

The nftables table `ip dsec` (created once, kept; `dsec gc` removes it when
no sandbox is left) masquerades sandbox traffic leaving through any other
interface, drops traffic between sandboxes, and drops new connections from a
sandbox to the host itself (the agent's sockets, host services).

Several agents on one host (docs/cluster.md) each have their own pool
(DSEC_EGRESS_POOL, or the agent config's host.egress_pool): a pool other than
the default gets its own table, `ip dsec_<hash of the pool>`, so one agent
never rewrites or removes another's NAT, and gc removes only the host links
whose address is in its own pool (or that have none yet).
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
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
HOST_PREFIX = "dsv"
PEER_PREFIX = "dsp"

NFT_RULES = """table ip {table} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != "{pfx}*" masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{pfx}*" oifname "{pfx}*" drop
    iifname "{pfx}*" ip daddr {pool} drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{pfx}*" ct state established,related accept
    iifname "{pfx}*" drop
  }}
}}
"""


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


def _ensure_nat():
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        if f.read().strip() != "1":
            with open("/proc/sys/net/ipv4/ip_forward", "w") as w:
                w.write("1")
    table = nat_table()
    rules = NFT_RULES.format(pool=POOL, pfx=HOST_PREFIX, table=table)
    marker = os.path.join(RUN_DIR, "nft-" + hashlib.sha1(rules.encode()).hexdigest()[:12])
    if os.path.exists(marker) and \
            subprocess.run(["nft", "list", "table", "ip", table], capture_output=True).returncode == 0:
        return
    # replace the table atomically (one nft transaction)
    r = subprocess.run(["nft", "-f", "-"], input=f"table ip {table} {{}}\ndelete table ip {table}\n" + rules,
                       capture_output=True, text=True)
    if r.returncode == 0:
        open(marker, "w").close()
    if r.returncode != 0:
        raise DsecError(f"cannot install NAT rules with nft: {r.stderr.strip().splitlines()[-1:]}", EXIT_DSEC)


def setup_egress(sandbox_id: str, netns_pid: int) -> dict:
    """Create the veth pair into the sandbox's netns; return the inside config."""
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
            ipr.addr("add", index=idx, address=host_addr, prefixlen=30)
            ipr.link("set", index=idx, state="up")
        except NetlinkError as e:
            raise DsecError(f"cannot create veth {host_if}: {e}", EXIT_DSEC)
        _ensure_nat()
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


def teardown(sandbox_id: str):
    """Delete the sandbox's host veth if it still exists (it normally dies with the netns)."""
    host_if, _ = ifnames(sandbox_id)
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
    subprocess.run(["nft", "delete", "table", "ip", nat_table()], capture_output=True)
