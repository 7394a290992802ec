"""Fidelity of learning, measured on real kernels and real workloads (issue 5,
"Fidelity, measured"): learn (a) a Python script using json, sqlite3 and a
child process, (b) a coreutils shell pipeline, (c) an HTTP client of a local
server; enforce the derived policy and run each workload 5 times with zero
violations; a variant doing one extra thing (a syscall, an exec, a write
outside the learned directories, a connect to another port) is blocked and
reported; the strace route gives the same syscall set as the eBPF route on
(b), up to an explained set of differences. The enforced runs go through a node
agent (as `dsec run` does by default); the connect variant runs in-process."""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import yaml

from agents import ROOMY, AgentProc
from conftest import ROOT, dsec
from hosts import NetHost

SUBNET = 47          # 10.200.47.0/24: not used by any other test
RUNS = 5

PY_WORKLOAD = ("import json, sqlite3, subprocess\n"
               "db = sqlite3.connect('/workspace/t.db')\n"
               "db.execute('create table if not exists t (k text, v text)')\n"
               "db.execute('insert into t values (?, ?)', ('a', json.dumps({'n': 1})))\n"
               "db.commit(); db.close()\n"
               "subprocess.run(['/usr/bin/ls', '/workspace'], check=True, stdout=subprocess.DEVNULL)\n")
PIPELINE = "seq 1 100 | sort -r | head -5 | wc -l > %s/out"
FETCH = ("import sys, urllib.request\n"
         "print(urllib.request.urlopen(sys.argv[1], timeout=10).status)\n")

# variants of (a): the workload, then exactly one extra thing; each prints what it saw
VARIANTS = {
    "syscall": ("import ctypes, errno\n"
                "libc = ctypes.CDLL(None, use_errno=True)\n"
                "r = libc.ptrace(0, 0, 0, 0)\n"       # PTRACE_TRACEME: never made while learning
                "print('RESULT', r, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))\n"),
    # the same call shape as the learned `ls` child (no pipes: those calls were never learned)
    "exec": ("r = subprocess.run(['/usr/bin/id'], stdout=subprocess.DEVNULL)\n"
             "print('RESULT', r.returncode)\n"),
    "write": ("import errno\n"
              "try:\n"
              "    open('/var/tmp/outside', 'w').write('x'); print('RESULT ok')\n"
              "except OSError as e:\n"
              "    print('RESULT', errno.errorcode[e.errno])\n"),
}


def _env(tmp):
    return {"DSEC_SPOOL_DIR": str(tmp / "spool")}


def _events(sid, env):
    out = dsec("events", "--sandbox", sid, "--format", "json", env=env).stdout.decode().splitlines()
    return [json.loads(x) for x in out]


def _violations(sid, env):
    return [e for e in _events(sid, env) if e["decision"] in ("denied", "would-deny")]


def _brief(records):
    """What a failure needs to name, short enough not to be cut off."""
    keep = ("kind", "decision", "syscall", "path", "addr", "port", "pid", "comm", "extra")
    return [{k: e[k] for k in keep if e.get(k) not in (None, "", 0)} for e in records]


def _syscalls(path) -> set:
    s = yaml.safe_load(open(path))["spec"]["syscalls"]
    assert s["default"] == "deny"
    return set(s["allow"])


def _learn_cli(out, argv, env):
    r = dsec("learn", "--runs", "2", "-o", str(out), "--", *argv, env=env)
    assert r.returncode == 0, r.stderr
    return out


def _learn_egress(out, argv, env):
    """`dsec learn` has no --network: learn with egress through the same library call."""
    script = ("import sys\n"
              "from agent.sensors.inprocess import learn_runs\n"
              "from policies.learn import derive_policy, render\n"
              "runs = learn_runs(sys.argv[2:], 2, None, network='egress')\n"
              "p = derive_policy(runs, name='fetch')\n"
              "open(sys.argv[1], 'w').write(render(p, ['learned with --network egress by the fidelity test']))\n")
    e = dict(os.environ)
    e.update(env)
    r = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-c", script, str(out), *argv],
                       cwd=ROOT, env=e, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory, clickhouse_url):
    tmp = tmp_path_factory.mktemp("fidelity")
    return {**_env(tmp), "DSEC_CLICKHOUSE_URL": clickhouse_url, "TMP": str(tmp)}


@pytest.fixture(scope="module")
def testhost():
    with NetHost(subnet=SUBNET) as th:
        th.serve_http(addr="0.0.0.0", port=8080)
        th.serve_http(addr="0.0.0.0", port=8081)      # a second, reachable port: the connect variant's target
        yield th


@pytest.fixture(scope="module")
def workloads(env, testhost):
    """name -> (argv, extra `dsec run` args, learned policy)."""
    tmp = env["TMP"]
    url = f"http://{testhost.world}:8080/"
    w = {"python": (["python3", "-c", PY_WORKLOAD], []),
         "pipeline": (["sh", "-c", PIPELINE % "/workspace"], []),
         "fetch": (["python3", "-c", FETCH, url], ["--network", "egress"])}
    def one(item):
        name, (argv, extra) = item
        pol = os.path.join(tmp, f"{name}.yaml")
        (_learn_egress if extra else _learn_cli)(pol, argv, env)
        return name, (argv, extra, pol)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(w)) as ex:               # the three workloads learn side by side
        return dict(ex.map(one, w.items()))


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    """The node agent the enforced runs go through (as `dsec run` goes by default):
    its eBPF programs compile once (in-process, every run compiles its own)."""
    a = AgentProc(str(tmp_path_factory.mktemp("fidelity-agent")), clickhouse_url, ROOMY).start()
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def _run(env, pol, argv, extra=(), sid=None, agent=None):
    """`dsec run` under enforce, through `agent` (its record in ClickHouse when it
    returns) or in-process."""
    sid = sid or "fid-" + uuid.uuid4().hex[:8]
    if agent is not None:
        env = {**env, **agent.cli_env()}
        extra = [*extra, "--wait-export"]
    r = dsec("run", "--sandbox-id", sid, *extra, "--policy", pol, "--mode", "enforce", "--", *argv, env=env)
    return sid, r


@pytest.mark.parametrize("name", ["python", "pipeline", "fetch"])
def test_learned_workload_runs_clean_under_enforce(name, workloads, env, agent):
    argv, extra, pol = workloads[name]
    text = open(pol).read()
    if name == "fetch":
        assert f"198.51.100.{SUBNET}" in text and "8080" in text
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(RUNS) as ex:               # independent sandboxes: run side by side
        runs = list(ex.map(lambda _: _run(env, pol, argv, extra, agent=agent), range(RUNS)))
    for i, (sid, r) in enumerate(runs):
        assert r.returncode == 0, (i, r.stderr)
        viol = _violations(sid, env)
        assert viol == [], (i, sid, _brief(viol))
    if name == "fetch":
        assert r.stdout.strip() == b"200"


@pytest.mark.parametrize("variant", ["syscall", "exec", "write"])
def test_variant_blocked_and_reported(variant, workloads, env, agent):
    argv, extra, pol = workloads["python"]
    sid, r = _run(env, pol, ["python3", "-c", PY_WORKLOAD + VARIANTS[variant]], extra, agent=agent)
    res = [line.split()[1:] for line in r.stdout.decode().splitlines() if line.startswith("RESULT")]
    assert r.returncode == 0 and len(res) == 1, (r.stdout, r.stderr)
    viol = _violations(sid, env)
    if variant == "syscall":
        assert res[0] == ["-1", "EPERM"]
        assert [(e["kind"], e["syscall"]) for e in viol] == [("syscall_denied", "ptrace")], viol
    elif variant == "exec":
        assert res[0] == ["-9"]           # killed at exec, before id ran any of its code
        assert [(e["kind"], e["path"]) for e in viol if e["kind"] == "exec_denied"] == [("exec_denied", "/usr/bin/id")]
        assert {e["kind"] for e in viol} <= {"exec_denied", "exec"}, viol
    else:
        assert res[0] == ["EROFS"]
        w = [e for e in viol if e["kind"] == "open_write"]
        assert w and all(e["path"] == "/var/tmp/outside" for e in w), viol
        assert {e["kind"] for e in viol} == {"open_write"}, viol


def test_connect_variant_blocked_and_reported(workloads, env, testhost):
    argv, extra, pol = workloads["fetch"]
    # create_connection, as urllib connects, and it closes the socket on failure (an unclosed
    # socket's repr at exit would call getsockname/getpeername: calls the fetch never made)
    probe = (FETCH + "import errno, socket\n"
             "try:\n    socket.create_connection((sys.argv[2], 8081), timeout=5).close(); print('RESULT ok')\n"
             "except OSError as e:\n    print('RESULT', errno.errorcode.get(e.errno, e.errno))\n")
    sid, r = _run(env, pol, ["python3", "-c", probe, argv[-1], testhost.world], extra)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines() == ["200", "RESULT EPERM"]
    viol = _violations(sid, env)
    denied = [e for e in viol if e["kind"] == "egress_denied"]
    assert [(e["addr"], e["port"]) for e in denied] == [(testhost.world, 8081)], viol
    assert {e["kind"] for e in viol} <= {"egress_denied", "connect"}, [(e["kind"], e.get("syscall")) for e in viol]


# strace vs eBPF on (b). Both routes see the same pipeline; the explained differences:
#  - EXPLAINED_ONLY_EBPF: calls the eBPF route counts that strace of the host run does not show.
#  - EXPLAINED_ONLY_STRACE: calls strace shows that the eBPF route does not count.
# (filled in from measurement; each entry explained below)
EXPLAINED_ONLY_EBPF: dict[str, str] = {
    # dash finds its working directory from $PWD when that names ".", else calls getcwd(2).
    # `dsec run` starts CMD in /workspace with no PWD in its environment; the host run under
    # strace inherits the caller's PWD, so the host's sh never calls getcwd.
    # (`env -u PWD strace -f sh -c true` shows the call; `PWD=$PWD strace ...` does not.)
    "getcwd": "sh resolves its cwd with getcwd(2) when PWD is not in the environment (the sandbox's case)",
}
EXPLAINED_ONLY_STRACE: dict[str, str] = {}


def test_strace_route_matches_ebpf_route(workloads, env, tmp_path):
    _, _, ebpf_pol = workloads["pipeline"]
    log = tmp_path / "trace.log"
    subprocess.run(["strace", "-f", "-o", str(log), "sh", "-c", PIPELINE % tmp_path],
                   check=True, capture_output=True, timeout=60)
    assert (tmp_path / "out").read_text().strip() == "5"
    spol = tmp_path / "strace.yaml"
    r = dsec("learn", "--from-strace", str(log), "-o", str(spol), env=env)
    assert r.returncode == 0, r.stderr
    ebpf, strace = _syscalls(ebpf_pol), _syscalls(spol)
    only_ebpf, only_strace = ebpf - strace, strace - ebpf
    print("only eBPF:", sorted(only_ebpf), "only strace:", sorted(only_strace))
    assert only_ebpf <= set(EXPLAINED_ONLY_EBPF), sorted(only_ebpf - set(EXPLAINED_ONLY_EBPF))
    assert only_strace <= set(EXPLAINED_ONLY_STRACE), sorted(only_strace - set(EXPLAINED_ONLY_STRACE))
    assert ebpf - set(EXPLAINED_ONLY_EBPF) == strace - set(EXPLAINED_ONLY_STRACE)
