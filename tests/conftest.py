"""Shared fixtures. Tests run as root against the real kernel: real sandboxes,
real cgroups, namespaces, mounts and links. Nothing is mocked."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DSEC = os.path.join(ROOT, ".venv", "bin", "dsec")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the suite's `dsec run`s work in-process unless a test gives them an agent: none starts a node
# agent on first use (the CLI's default, DSEC_AGENT=auto), which would outlive the test;
# tests/test_run_agent.py tests that path with its own socket
os.environ.setdefault("DSEC_AGENT", "reuse")
# one eBPF program cache for the session (every agent and in-process sensor of the suite compiles
# each text once, as a node does), not the machine's /var/cache/dsec/bpf; removed at the end
_BPF_CACHE = None if "DSEC_BPF_CACHE" in os.environ else tempfile.mkdtemp(prefix="dsec-bpf-cache-")
if _BPF_CACHE:
    os.environ["DSEC_BPF_CACHE"] = _BPF_CACHE
    # also when no session runs (pytest --collect-only imports this file): removed at exit
    atexit.register(shutil.rmtree, _BPF_CACHE, True)

from hosts import leftovers  # noqa: E402
from fixtures_clickhouse import *  # noqa: E402,F401,F403 - clickhouse_server, clickhouse_url, ...
from fixtures_bpf import audit_sensor, audit_sensor_small, audit_cgroups  # noqa: E402,F401
from fixtures_enforce import enforce_sensor, enforce_cgroups, enforce_net  # noqa: E402,F401


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("the dsec test suite needs root (real namespaces, cgroups, eBPF)")


def dash_rootfs(dest):
    """A rootfs directory of a test's own at `dest` (a pathlib.Path): dash as /bin/sh and its
    libraries, an /etc/passwd with root and sandbox (1000)."""
    for d in ("bin", "lib", "lib64", "etc"):
        (dest / d).mkdir(parents=True)
    shutil.copy2("/bin/dash", dest / "bin" / "sh")
    libs = subprocess.run(["ldd", "/bin/dash"], capture_output=True, text=True).stdout
    for line in libs.splitlines():
        for tok in line.split():
            if tok.startswith("/"):
                lib = dest / tok.lstrip("/")
                lib.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tok, lib)
    (dest / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\nsandbox:x:1000:1000::/:/bin/sh\n")
    return dest


def dsec(*args, input=None, timeout=120, env=None, **kw):
    """Run the real dsec CLI; returns CompletedProcess with bytes stdout/stderr."""
    e = dict(os.environ)
    if env:
        e.update(env)
    return subprocess.run([DSEC, *[os.fsencode(a) if isinstance(a, str) else a for a in args]],
                          input=input, capture_output=True, timeout=timeout, env=e, **kw)


def dsec_each(*calls, env=None, timeout=120):
    """Independent dsec commands (each an argument tuple) side by side: an
    in-process `dsec run` spends seconds of one core compiling its eBPF
    programs, and the suite runs one test at a time on a 2-core machine.
    Returns their CompletedProcesses in order."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(calls)) as ex:
        return list(ex.map(lambda a: dsec(*a, env=env, timeout=timeout), calls))


@pytest.fixture
def sid():
    return "t-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session", autouse=True)
def no_leftovers_at_end():
    before = leftovers()
    yield
    after = leftovers()
    new = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()}
    new = {k: v for k, v in new.items() if v}
    if _BPF_CACHE:
        shutil.rmtree(_BPF_CACHE, ignore_errors=True)
    assert not new, f"the test session left things behind: {new}"
    dsec("gc")   # and the empty "dsec" parent cgroups the sandboxes were created under
