"""Real-kernel enforcement fixtures (agent/sensors/enforce.py), compiled once per
test session.

Import into tests/conftest.py (pytest puts tests/ on sys.path):

    from fixtures_enforce import enforce_sensor, enforce_cgroups, enforce_net  # noqa: F401

Fixtures
  enforce_sensor   (session) EnforceHarness: one EnforcementSensor (exec link pinned
                   under TEST_PIN_ROOT), records routed per sandbox id.
  enforce_cgroups  (function) fixtures_bpf.CgroupFactory: cgroup2 children named
                   dsec-test-XXXX, killed and removed at teardown.
  enforce_net      (function) TestNet: two network namespaces of the test's own
                   joined by a veth pair and nothing else, so that no packet can
                   leave the machine whatever the enforcement does:
                     client  10.200.N.1/24, a host route to 169.254.169.254 via .2,
                             no default route (workloads run here);
                     server  10.200.N.2/24 plus .3, .5, .6 and 169.254.169.254/32,
                             a server answering TCP 53, 80, 443 and UDP 53 (echo).
Helpers
  run_workload(cg, argv, netns=None, **popen_kw)  start argv inside cgroup `cg`
                   (and network namespace `netns`): the child joins both before
                   its exec, so the exec itself is checked.
  DnsServer        a DNS server on 127.0.0.1 answering A queries from a dict,
                   with the TTLs given (for hostname rules).
"""
from __future__ import annotations

import ctypes
import os
import secrets
import select
import socket
import struct
import signal
import subprocess
import threading
import time

import pytest

from agent.sensors.enforce import EnforcementSensor
from fixtures_bpf import CgroupFactory, Sandbox, SensorHarness, cgroup_factory

PYTHON = "/usr/bin/python3"
TEST_PIN_ROOT = "/sys/fs/bpf/dsec-test"
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------- workloads

def run_workload(cg, argv, netns: str | None = None, **kw) -> subprocess.Popen:
    """Start argv with its exec already inside cgroup `cg` (and netns)."""
    procs = os.path.join(cg.path, "cgroup.procs")

    def enter():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        if netns:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                os._exit(125)
            os.close(fd)

    return subprocess.Popen(argv, preexec_fn=enter, **kw)


# ---------------------------------------------------------------- the test network

SERVER = r'''
import select, socket, sys
socks = []
for p in (53, 80, 443):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", p))
    s.listen(128)
    socks.append(s)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("0.0.0.0", 53))
socks.append(u)
print("ready", flush=True)
while True:
    for s in select.select(socks, [], [], 1)[0]:
        if s is u:
            data, peer = u.recvfrom(4096)
            u.sendto(data, peer)
        else:
            c, _ = s.accept()
            c.close()
'''


class TestNet:
    __test__ = False

    def __init__(self):
        tag = secrets.token_hex(3)
        self.n = 100 + secrets.randbelow(100)
        self.client = f"dsecte-{tag}-c"
        self.server = f"dsecte-{tag}-s"
        self.prefix = f"10.200.{self.n}."
        self.client_addr = self.prefix + "1"
        self.server_addr = self.prefix + "2"
        self.extra = [self.prefix + "3", self.prefix + "5", self.prefix + "6", "169.254.169.254"]
        self.proc = None

    def addr(self, host: int) -> str:
        return f"{self.prefix}{host}"

    def __enter__(self):
        def sh(*a):
            subprocess.run(a, check=True, capture_output=True)
        try:
            sh("ip", "netns", "add", self.client)
            sh("ip", "netns", "add", self.server)
            sh("ip", "-n", self.client, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
               "netns", self.server)
            c, s = ("ip", "-n", self.client), ("ip", "-n", self.server)
            sh(*c, "addr", "add", f"{self.client_addr}/24", "dev", "eth0")
            sh(*s, "addr", "add", f"{self.server_addr}/24", "dev", "eth0")
            for a in self.extra:
                sh(*s, "addr", "add", f"{a}/32", "dev", "eth0")
            for ns in (c, s):
                sh(*ns, "link", "set", "eth0", "up")
                sh(*ns, "link", "set", "lo", "up")
            sh(*c, "route", "add", "169.254.169.254/32", "via", self.server_addr)
            # the client can reach the server and nothing else: no default route, no other link
            routes = subprocess.run([*c, "route", "show"], capture_output=True, text=True, check=True).stdout
            assert "default" not in routes, routes
            links = subprocess.run([*c, "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
            assert sorted(ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()) == ["eth0", "lo"]
            self.proc = subprocess.Popen(["ip", "netns", "exec", self.server, "timeout", "600", PYTHON, "-c",
                                          SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            assert self.proc.stdout.readline().strip() == b"ready"
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            try:   # the whole group: `timeout` and the python it runs
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc.stdout.close()
        for ns in (self.client, self.server):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# ---------------------------------------------------------------- DNS server

class DnsServer:
    """Answers A queries for the names in `answers` ({name: ([addr], ttl)});
    NXDOMAIN otherwise. On 127.0.0.1 (this machine only)."""

    def __init__(self, answers: dict):
        self.answers = dict(answers)
        self.queries = 0
        self.gate = threading.Event()       # cleared: queries are held unanswered until set
        self.gate.set()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            if not select.select([self.sock], [], [], 0.1)[0]:
                continue
            q, peer = self.sock.recvfrom(4096)
            self.queries += 1
            while not self.gate.wait(0.1) and not self._stop:
                pass
            try:
                self.sock.sendto(self._answer(q), peer)
            except Exception:   # noqa: BLE001 - a malformed query gets no answer
                pass

    def _answer(self, q: bytes) -> bytes:
        qid = struct.unpack_from(">H", q)[0]
        off, labels = 12, []
        while q[off]:
            labels.append(q[off + 1: off + 1 + q[off]].decode())
            off += 1 + q[off]
        qtype = struct.unpack_from(">H", q, off + 1)[0]
        question = q[12: off + 5]
        name = ".".join(labels).lower()
        if name not in self.answers:
            return struct.pack(">HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
        addrs, ttl = self.answers[name]
        rrs = b""
        n = 0
        for a in addrs:
            if qtype == 1 and ":" not in a:
                rrs += struct.pack(">HHHIH", 0xC00C, 1, 1, ttl, 4) + socket.inet_aton(a)
                n += 1
        return struct.pack(">HHHHHH", qid, 0x8180, 1, n, 0, 0) + question + rrs

    def close(self):
        self._stop = True
        self._t.join(2)
        self.sock.close()


# ---------------------------------------------------------------- the sensor harness

EnforceSandbox = Sandbox


class EnforceHarness(SensorHarness):
    """One EnforcementSensor shared by the tests of a session (exec link pinned
    under TEST_PIN_ROOT); records by sandbox."""

    def __init__(self, **kw):
        super().__init__(EnforcementSensor, pin_root=TEST_PIN_ROOT, **kw)

    def sandbox(self, cgroups: CgroupFactory, policy, cg=None, **kw) -> EnforceSandbox:
        return self._sandbox(cgroups, cg,
                             lambda cg, sid: self.sensor.add_sandbox(cg.id, cg.path, sid, policy, **kw))

    def settle(self, seconds: float = 0.3) -> None:
        """Poll for a while (records of actions that already happened)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sensor.poll(50)
        self.sensor.drain()

    def close(self) -> None:
        super().close()
        try:
            os.rmdir(TEST_PIN_ROOT)
        except OSError:
            pass


@pytest.fixture(scope="session")
def enforce_sensor():
    h = EnforceHarness()
    yield h
    h.close()


@pytest.fixture
def enforce_cgroups():
    yield from cgroup_factory()


@pytest.fixture
def enforce_net():
    with TestNet() as net:
        yield net
