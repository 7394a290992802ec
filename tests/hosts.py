"""Test helpers: what dsec leaves on the host, and test hosts in network
namespaces of the test's own (never any address beyond this machine)."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import time
import uuid

CG_ROOTS = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/cpu",
            "/sys/fs/cgroup/pids", "/sys/fs/cgroup"]


def leftovers() -> dict:
    """Everything sandbox-related that exists on the host right now."""
    cgs = []
    for r in CG_ROOTS:
        d = os.path.join(r, "dsec")
        if os.path.isdir(d):
            cgs += [os.path.join(d, n) for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))]
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if "/var/lib/dsec" in line.split()[4]]
    links = [n for n in os.listdir("/sys/class/net") if n.startswith(("dsv", "dsp"))]
    sdir = "/var/lib/dsec/sandboxes"
    states = os.listdir(sdir) if os.path.isdir(sdir) else []
    netns = [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])]
    procs = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/comm") as f:
                    if f.read().strip() == "dsec-init":
                        procs.append(p)
            except OSError:
                pass
    pins = []                           # the enforcement sensor's pins (agent/sensors/enforce.py)
    for r in glob.glob("/sys/fs/bpf/dsec*"):
        if os.path.isdir(r):
            pins += [os.path.join(r, n) for n in os.listdir(r)]
    return {"cgroups": cgs, "mounts": mounts, "links": links, "state": states,
            "netns": netns, "supervisors": procs, "pins": pins,
            "bpf_logs": glob.glob(os.path.join(tempfile.gettempdir(), "dsec-bpf-*.log"))}


def wait_clean(timeout=5.0, prefix: str = "") -> dict:
    """Wait until nothing (named with `prefix`, when given) is left; return what is."""
    deadline = time.monotonic() + timeout
    keys = ("cgroups", "mounts", "state") if prefix else ("cgroups", "mounts", "links", "state", "supervisors")
    while True:
        lo = leftovers()
        if not any(x for k in keys for x in lo[k] if prefix in x) or time.monotonic() > deadline:
            return lo
        time.sleep(0.05)


class NetHost:
    """A host of the test's own: a network namespace joined to the host by a veth,
    with address 10.200.N.2/24 (host side 10.200.N.1), optionally extra addresses.
    `world` (198.51.100.N, TEST-NET-2: documentation, never routed beyond this
    machine) is "the outside": --network egress refuses the private 10.200.N.2
    by default (node protection), not it."""

    def __init__(self, subnet: int, extra_addrs=()):
        self.name = "dsectest-" + uuid.uuid4().hex[:6]
        self.host_if = "dtv" + uuid.uuid4().hex[:8]
        self.addr = f"10.200.{subnet}.2"
        self.gw = f"10.200.{subnet}.1"
        self.world = f"198.51.100.{subnet}"
        self.extra = list(extra_addrs) + ([self.world] if self.world not in extra_addrs else [])
        self.procs = []

    def __enter__(self):
        try:
            self._setup()
        except BaseException:
            self.__exit__(None, None, None)          # nothing half-made left behind
            raise
        return self

    def _setup(self):
        sh = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
        sh("ip", "netns", "add", self.name)
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        sh("ip", "addr", "add", f"{self.gw}/24", "dev", self.host_if)
        sh("ip", "link", "set", self.host_if, "up")
        n = ["ip", "-n", self.name]
        sh(*n, "addr", "add", f"{self.addr}/24", "dev", "eth0")
        for a in self.extra:
            sh(*n, "addr", "add", f"{a}/32", "dev", "eth0")
            sh("ip", "route", "replace", f"{a}/32", "via", self.addr)   # another module's host of this subnet
        sh(*n, "link", "set", "eth0", "up")
        sh(*n, "link", "set", "lo", "up")
        sh(*n, "route", "add", "default", "via", self.gw)

    def serve_http(self, addr=None, port=8080):
        """Start a bounded HTTP server inside the test host; returns the URL."""
        addr = addr or self.addr
        p = subprocess.Popen(["ip", "netns", "exec", self.name, "timeout", "300", "python3", "-m",
                              "http.server", "--bind", addr, str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = subprocess.run(["ip", "netns", "exec", self.name, "python3", "-c",
                                f"import socket; socket.create_connection(('{addr}', {port}), 1)"],
                               capture_output=True)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        return f"http://{addr}:{port}/"

    def __exit__(self, *a):
        for p in self.procs:
            try:   # the whole group: `timeout` and the python server it runs
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for a in self.extra:
            subprocess.run(["ip", "route", "del", f"{a}/32"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
