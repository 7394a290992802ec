"""Real-kernel eBPF audit fixtures, compiled once per test session.

Import into tests/conftest.py (pytest puts tests/ on sys.path):

    from fixtures_bpf import audit_sensor, audit_sensor_small, audit_cgroups  # noqa: F401

Fixtures
  audit_sensor        (session) Harness around the default build (32 MiB ring).
  audit_sensor_small  (session) Harness around a test build with a 128 KiB ring,
                      for loss accounting and fair-share tests.
  audit_cgroups       (function) CgroupFactory: cgroup2 children named
                      dsec-test-XXXX, killed and removed at teardown.

Harness.sandbox(...) creates a cgroup and registers it; records are routed
per sandbox_id into Harness.records. Everything created is removed, every
process started in a test cgroup is killed at teardown. SensorHarness and
cgroup_factory() serve the enforcement fixtures (fixtures_enforce.py) too.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time

import pytest

from agent.sensors.audit import AuditSensor, cgroup2_mount

PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------- cgroups

class Cgroup:
    def __init__(self, path: str):
        self.path = path
        os.mkdir(path)
        self.id = os.stat(path).st_ino

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as f:
                return [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return []

    def child(self, name: str) -> "Cgroup":
        return Cgroup(os.path.join(self.path, name))

    def kill(self) -> None:
        """SIGKILL everything inside (cgroup.kill when available)."""
        kill_file = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill_file):
            with open(kill_file, "w") as f:
                f.write("1")
        for _ in range(3):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not self.pids():
                break
            time.sleep(0.05)

    def remove(self) -> None:
        if not os.path.isdir(self.path):
            return
        for sub in sorted(os.listdir(self.path)):
            p = os.path.join(self.path, sub)
            if os.path.isdir(p):
                c = Cgroup.__new__(Cgroup)
                c.path, c.id = p, os.stat(p).st_ino
                c.remove()
        self.kill()
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                self.kill()
                time.sleep(0.05)


class CgroupFactory:
    def __init__(self):
        root = cgroup2_mount()
        if root is None:
            raise RuntimeError("no cgroup2 hierarchy mounted")
        self.root = root
        self.made: list[Cgroup] = []
        self.deferred = []          # run before the cgroups are removed

    def defer(self, fn) -> None:
        self.deferred.append(fn)

    def __call__(self) -> Cgroup:
        cg = Cgroup(os.path.join(self.root, f"dsec-test-{secrets.token_hex(4)}"))
        self.made.append(cg)
        return cg

    def cleanup(self) -> None:
        errors = []
        for cg in self.made:
            cg.kill()
        for fn in reversed(self.deferred):
            try:
                fn()
            except Exception as e:   # report all, keep cleaning
                errors.append(f"{fn}: {e}")
        self.deferred.clear()
        for cg in reversed(self.made):
            try:
                cg.remove()
            except OSError as e:
                errors.append(f"{cg.path}: {e}")
        self.made.clear()
        if errors:
            raise RuntimeError("cgroups left behind: " + "; ".join(errors))


def run_in_cgroup(cg: Cgroup | None, argv: list, **kw) -> subprocess.Popen:
    """Start argv with its first exec already inside cgroup `cg` (None: outside).
    The process writes its own pid to cgroup.procs, then execs argv."""
    if cg is None:
        return subprocess.Popen(argv, **kw)
    script = 'echo $$ > "$0" || exit 125; exec "$@"'
    return subprocess.Popen(["/bin/sh", "-c", script, cg.procs_file, *argv], **kw)


def listeners(tmp_path, backlog: int = 16):
    """A TCP listener on 127.0.0.1 and a unix one at tmp_path/u.sock for a
    workload to connect to: (tcp socket, unix path, unix socket); close both."""
    import socket
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(backlog)
    path = str(tmp_path / "u.sock")
    u = socket.socket(socket.AF_UNIX)
    u.bind(path)
    u.listen(backlog)
    return tcp, path, u


# ---------------------------------------------------------------- harness

class Sandbox:
    def __init__(self, harness: "SensorHarness", cg: Cgroup, sandbox_id: str):
        self.harness, self.cg, self.sandbox_id = harness, cg, sandbox_id
        self.totals = None

    @property
    def records(self) -> list[dict]:
        return self.harness.records.setdefault(self.sandbox_id, [])

    def of_kind(self, *kinds: str) -> list[dict]:
        return [r for r in self.records if r["kind"] in kinds]

    def remove(self) -> dict:
        if self.totals is None:
            self.totals = self.harness.sensor.remove_sandbox(self.cg.id)
        return self.totals


class SensorHarness:
    """One sensor (AuditSensor, EnforcementSensor) shared by the tests of a
    session; records by sandbox."""

    def __init__(self, sensor_class, **sensor_kw):
        self.records: dict[str, list[dict]] = {}
        self.sensor = sensor_class(on_record=self._route, **sensor_kw)

    def _route(self, rec: dict) -> None:
        self.records.setdefault(rec["sandbox_id"], []).append(rec)

    def _sandbox(self, cgroups: CgroupFactory, cg: Cgroup | None, register) -> Sandbox:
        """A new sandbox id registered (register(cg, sandbox_id)) on `cg` or a
        new cgroup; removed from the sensor before the cgroups are."""
        self.sensor.drain()
        cg = cg or cgroups()
        sid = "sbx-" + secrets.token_hex(4)
        register(cg, sid)
        sbx = Sandbox(self, cg, sid)
        cgroups.defer(sbx.remove)
        return sbx

    def poll_until(self, predicate, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sensor.poll(50)
            if predicate():
                return True
        return predicate()

    def close(self) -> None:
        self.sensor.close()


class Harness(SensorHarness):
    """The AuditSensor harness; on_over_budget calls land in over_budget_calls."""

    def __init__(self, **sensor_kw):
        super().__init__(AuditSensor, **sensor_kw)
        self.over_budget_calls: list[tuple] = []
        self.sensor.on_over_budget = lambda *a: self.over_budget_calls.append(a)

    def sandbox(self, cgroups: CgroupFactory, **labels) -> Sandbox:
        """A registered sandbox; one record per event (no repeats counted in the
        kernel) unless `aggregate` names the kinds (tests/test_repeats.py)."""
        labels.setdefault("aggregate", ())
        return self._sandbox(cgroups, None, lambda cg, sid: self.sensor.add_sandbox(cg.id, sid, **labels))


def cgroup_factory():
    """Body of the *_cgroups fixtures: a CgroupFactory, cleaned up afterwards."""
    f = CgroupFactory()
    yield f
    f.cleanup()


@pytest.fixture(scope="session")
def audit_sensor():
    h = Harness()
    yield h
    h.close()


@pytest.fixture(scope="session")
def audit_sensor_small():
    h = Harness(ring_bytes=128 << 10, byte_rate=0)   # ring overflow itself is what these test
    yield h
    h.close()


@pytest.fixture
def audit_cgroups():
    yield from cgroup_factory()
