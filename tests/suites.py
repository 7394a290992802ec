"""Real third-party test suites, run as sandbox workloads (issue 21): the
learning fidelity matrix (tests/test_learn_suites.py) and bench/learn.py.

None of them is written here; scripts/setup.sh installs them:
  cpython  CPython 3.11's own regression tests, Debian package
           libpython3.11-testsuite, run with its runner (python3 -m test):
           test_shutil but TestWhich (copies, trees, make_archive/unpack_archive for tar and
           zip, `tar`/`zip`/`unzip` subprocesses, symlinks, xattrs) and
           test_tempfile (mkstemp/mkdtemp/NamedTemporaryFile: random names).
  tornado  Tornado 6.4.2's test suite (PyPI, pip --target under
           /usr/local/lib/dsec-suites), run with tornado.test.runtests:
           process_test (fork, subprocesses, signals), autoreload_test (scripts
           written to a fresh temporary directory, run in subprocesses) and
           httpserver_test (servers on random loopback ports, clients).
  dill     dill 0.3.9's test suite (PyPI, same place), run with
           python3 -m dill.tests: one subprocess per test file, files and temp
           files written and read back.
Each is run small (a few modules) so the whole matrix stays fast.

The suite's own result is what its runner reports (exit status plus its
summary line: counts of tests run/skipped/failed), compared with a run of the
same suite in a sandbox without a policy.
"""
from __future__ import annotations

import re

SUITES_DIR = "/usr/local/lib/dsec-suites"

SUITES = {
    "cpython": {
        # TestWhich left out: shutil.which() asks access(X_OK) of executables it wrote to /tmp, and
        # under an exec allowlist every writable layer is noexec (docs/enforcement.md): "not executable"
        "argv": ["python3", "-m", "test", "test_shutil", "test_tempfile", "-i", "*TestWhich*"],
        "env": {},
        "source": "Debian libpython3.11-testsuite (CPython's regression tests), python3 -m test",
        # regrtest (3.11): "All 2 tests OK." / "1 test failed:" ... and "Tests result: SUCCESS"
        "result": [r"^All \d+ tests? OK\.$|^\d+ tests? failed:?$", r"^Tests result: [A-Z ,]+$"],
    },
    "tornado": {
        "argv": ["python3", "-m", "tornado.test.runtests", "tornado.test.process_test",
                 "tornado.test.autoreload_test", "tornado.test.httpserver_test"],
        "env": {"PYTHONPATH": f"{SUITES_DIR}/tornado"},
        "source": "PyPI tornado==6.4.2 (its own test suite), python3 -m tornado.test.runtests",
        # unittest: "Ran 70 tests in 3.1s" then "OK" / "OK (skipped=2)" / "FAILED (failures=1)"
        "result": [r"Ran \d+ tests?", r"^(?:OK|FAILED)(?: \([^)]*\))?$"],
    },
    "dill": {
        "argv": ["python3", "-m", "dill.tests"],
        "env": {"PYTHONPATH": f"{SUITES_DIR}/dill"},
        "source": "PyPI dill==0.3.9 (its own test suite), python3 -m dill.tests",
        # one '.' per test file that passed, 'F' per one that failed, on stdout (tests print
        # lines of their own in between): all of them, in order
        "result": [r"^[.F]+$"],
        "join": True,
    },
}


def result_of(code: int, output: str, name: str) -> tuple:
    """(exit status, the runner's summary lines) -- the suite's own verdict."""
    found = []
    for rx in SUITES[name]["result"]:
        m = [x.group(0) for x in re.finditer(rx, output, re.M)]
        if SUITES[name].get("join"):
            found.append("".join(m) or None)
        else:
            found.append(m[-1] if m else None)
    return (code, tuple(found))


def env_args(name: str) -> list[str]:
    out = []
    for k, v in SUITES[name]["env"].items():
        out += ["--env", f"{k}={v}"]
    return out
