"""Test helpers for the node agent: a real `dsec agent` process per fixture
(AgentProc) and a small PKI for its TCP + mutual TLS transport (make_pki)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import yaml

from conftest import DSEC, ROOT

from agent.node.client import AgentError, Client

PY = os.path.join(ROOT, ".venv", "bin", "python")

REAPER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)       # PR_SET_CHILD_SUBREAPER
log = open(sys.argv[1], "ab")
p = subprocess.Popen(sys.argv[2:], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
print(p.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *a: os.kill(p.pid, signal.SIGTERM))
status = 0
while True:
    try:
        pid, st = os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == p.pid:
        status = os.waitstatus_to_exitcode(st)
sys.exit(status if status >= 0 else 128 - status)
"""


# room for a test's sandboxes side by side on a 2-core machine (the learning matrices' runs)
ROOMY = {"capacity": {"cpus": 4, "memory": "16G", "reserve_memory": 0, "cpu_oversubscription": 8}}


class AgentProc:
    """One `dsec agent` process with its own socket, run dir and spool."""

    def __init__(self, base, clickhouse_url, config: dict, name="agent"):
        self.base = base
        self.run_dir = os.path.join(base, "run")
        self.socket = os.path.join(self.run_dir, "agent.sock")
        self.spool = os.path.join(base, "spool")
        self.log = os.path.join(base, f"{name}.log")
        cfg = {"socket": self.socket, "log_level": "info"}
        cfg.update(config)
        self.config = os.path.join(base, f"{name}.yaml")
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.env = dict(os.environ, DSEC_CLICKHOUSE_URL=clickhouse_url, DSEC_SPOOL_DIR=self.spool)
        self.env.pop("DSEC_AGENT_SOCKET", None)
        self.reaper = None
        self.pid = 0

    def start(self, timeout=90):
        self.reaper = subprocess.Popen([PY, "-c", REAPER, self.log, DSEC, "agent", "--config", self.config],
                                       env=self.env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.pid = int(self.reaper.stdout.readline())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.reaper.poll() is not None:
                raise AssertionError(f"agent exited {self.reaper.returncode}: {self.read_log()[-3000:]}")
            if os.path.exists(self.socket):
                try:
                    with self.client(connect_timeout=2) as c:
                        c.capabilities(timeout=5)
                    return self
                except AgentError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"agent did not come up: {self.read_log()[-3000:]}")

    def client(self, **kw) -> Client:
        return Client(self.socket, **kw)

    def cli_env(self) -> dict:
        """What makes `dsec run` go through this agent (as it does by default
        through the node's agent): one eBPF compile for every run."""
        return {"DSEC_AGENT": "reuse", "DSEC_AGENT_SOCKET": self.socket}

    def read_log(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self, timeout=60):
        if self.reaper is None or self.reaper.poll() is not None:
            return self.reaper.returncode if self.reaper else None
        self.reaper.send_signal(signal.SIGTERM)
        try:
            return self.reaper.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            return self.reaper.wait(30)

    def kill9(self):
        os.kill(self.pid, signal.SIGKILL)
        return self.reaper.wait(30)


def module_agent(tmp_path_factory, clickhouse_url, config: dict):
    """A test module's agent fixture body: `yield from module_agent(...)` starts one,
    yields it and, after the module, stops it and checks that it exited 0."""
    a = AgentProc(str(tmp_path_factory.mktemp("agent")), clickhouse_url, config).start()
    yield a
    rc = a.stop()
    assert rc == 0, a.read_log()[-3000:]




def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: str, clients=("trainer-1", "intruder")) -> str:
    """A CA, a server certificate (127.0.0.1, localhost), one client certificate per
    name (CN=name) and a rogue certificate from another CA (CN=trainer-1), in `d`."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=dsec-test-ca",
             cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in [("server", True)] + [(c, False) for c in clients]:
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", *(["-extfile", "san.ext"] if ext else []), cwd=d)
    _openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "1", "-subj", "/CN=trainer-1",
             cwd=d)
    return d
