"""The node agent (`dsec agent`): a real agent process per fixture (own socket
and run directory in tmp, spool in tmp, the session's ClickHouse database),
real sandboxes, the Python SDK (agent/node/client.py) as the caller.

Agents are started under a small reaper process (a child subreaper), as an init
system would: when a test SIGKILLs an agent, the sandbox supervisors it leaves
(which stop their sandbox when its control socket closes) are reaped there.

Why this file is long: its tests share a few module-scoped agents (each a
process with its sensors loaded, seconds to start); split, each part would
start its own."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import DSEC, ROOT, dsec
from hosts import NetHost, leftovers

from agent.node.client import (AgentError, AsyncClient, Client, InvalidArgument, NotFound, PermissionDenied, TLS,
                          SandboxPreempted)
from agents import PY, AgentProc, make_pki, module_agent  # noqa: F401 - PY is used by tests below

def _events(clickhouse_url, sid, kinds=None, want=None, timeout=30):
    """The sandbox's events from ClickHouse, once `want(events)` holds (bounded wait)."""
    from replay.store import AuditStore
    deadline = time.monotonic() + timeout
    evs = []
    while time.monotonic() < deadline:
        with AuditStore(clickhouse_url) as store:
            evs = list(store.events(sid, kinds))
        if want is None and evs or want is not None and want(evs):
            return evs
        time.sleep(0.5)
    return evs


def _states(evs):
    return [json.loads(e["extra"])["state"] for e in evs if e["kind"] == "lifecycle"]


def _mine(lo: dict, ids) -> list:
    """Leftover items (cgroups, mounts, links, state dirs) that belong to these sandboxes."""
    out = []
    for k in ("cgroups", "mounts", "state"):
        out += [x for x in lo[k] if any(i in x for i in ids)]
    return out


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    yield from module_agent(tmp_path_factory, clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "16G", "reserve_memory": 0, "cpu_oversubscription": 8},
        "warm_pool": [{"name": "small", "count": 2, "memory": "256M", "pids": 256}],
        "scheduling": {"tick_seconds": 0.2},
    })


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


# ---------------------------------------------------------------- generated code, config

def test_generated_grpc_code_is_current(tmp_path):
    """setup.sh generates agent/node/proto/*_pb2*.py; they must match the .proto."""
    r = subprocess.run([PY, "-m", "agent.node.proto.generate", "--check"], cwd=ROOT, capture_output=True)
    assert r.returncode == 0, r.stderr
    from agent.node.proto import generate as gen
    gen.generate(str(tmp_path))
    for o in gen.OUTPUTS:
        with open(os.path.join(tmp_path, "agent", "node", "proto", o), "rb") as f, \
                open(os.path.join(gen.HERE, o), "rb") as g:
            assert f.read() == g.read(), f"{o} differs from what the .proto generates: run scripts/setup.sh"


def test_config_errors_name_file_line_and_field(tmp_path):
    from agent.node.config import ConfigError, load_config
    p = tmp_path / "a.yaml"
    p.write_text("socket: /run/x.sock\ncapacity:\n  cpus: -2\n")
    with pytest.raises(ConfigError, match=r"a\.yaml:3: capacity\.cpus: must be > 0"):
        load_config(str(p), environ={})
    p.write_text("warm_pool:\n  - name: a\n    count: 1\n    colour: red\n")
    with pytest.raises(ConfigError, match=r"a\.yaml:4: warm_pool\[0\]\.colour: unknown field"):
        load_config(str(p), environ={})
    p.write_text("limits:\n  max_message_bytes: 16M\n")
    cfg = load_config(str(p), environ={"DSEC_AGENT__CAPACITY__RESERVE_CPUS": "1.5",
                                       "DSEC_AGENT_SOCKET": "/run/other/agent.sock"})
    assert cfg.capacity.reserve_cpus == 1.5 and cfg.socket == "/run/other/agent.sock"
    assert cfg.limits.max_message_bytes == 16 << 20
    with pytest.raises(ConfigError, match="DSEC_AGENT__CAPACITY__CPU_OVERSUBSCRIPTION"):
        load_config(None, environ={"DSEC_AGENT__CAPACITY__CPU_OVERSUBSCRIPTION": "0.5"})
    r = dsec("agent", "--check-config", "--config", str(p))
    assert r.returncode == 0, r.stderr
    p.write_text("scheduling: [1, 2]\n")
    r = dsec("agent", "--config", str(p))
    assert r.returncode == 2 and b"scheduling" in r.stderr and b"Traceback" not in r.stderr


# ---------------------------------------------------------------- access

def test_socket_is_root_only_and_second_agent_refused(agent, tmp_path, clickhouse_url):
    st = os.stat(agent.run_dir)
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
    st = os.stat(agent.socket)
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    probe = ("import socket, sys, os\n"
             "os.setgid(65534); os.setuid(65534)\n"
             "s = socket.socket(socket.AF_UNIX)\n"
             "try:\n    s.connect(sys.argv[1]); print('connected')\n"
             "except OSError as e:\n    print(type(e).__name__)\n")
    for sock in (agent.socket, agent.socket + ".run"):     # the gRPC socket and dsec run's own
        st = os.stat(sock)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600, sock
        r = subprocess.run([sys.executable, "-c", probe, sock], capture_output=True, text=True)
        assert r.stdout.strip() == "PermissionError", (sock, r)
    # a second agent on the same socket (so the same run directory) refuses to start, with one clear line
    cfg = tmp_path / "second.yaml"
    cfg.write_text(f"socket: {agent.socket}\n")
    r = subprocess.run([DSEC, "agent", "--config", str(cfg)], env=agent.env, capture_output=True, timeout=60)
    assert r.returncode == 1
    assert b"another dsec agent is running" in r.stderr and b"Traceback" not in r.stderr
    assert os.path.exists(agent.socket)


# ---------------------------------------------------------------- steps

def test_five_step_trajectory_steps_and_state(client, clickhouse_url):
    with client.create(labels={"job": "traj-test", "trajectory": "t-1"}, warm=False) as sb:
        results = [
            sb.exec(["sh", "-c", "echo one > /workspace/state"]),
            sb.exec(["sh", "-c", "echo two > /workspace/two"]),
            sb.exec(["cat", "/workspace/state"]),
            sb.exec(["sh", "-c", "exit 7"]),
            sb.exec(["sleep", "30"], timeout=0.5, grace=0.5),
        ]
        info = sb.info()
        assert info.state == "running" and info.steps == 5 and info.labels["trajectory"] == "t-1"
    assert results[2].stdout == b"one\n"              # written in step 1, read in step 3
    assert [r.code for r in results] == [0, 0, 0, 7, 124]
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    assert results[4].timed_out
    assert sb.summary["steps"][-1]["step"] == 5
    assert {c["path"] for c in sb.summary["changes"]} >= {"/workspace/state", "/workspace/two"}

    def complete(evs):
        return "cleaned" in _states(evs) and sum(1 for e in evs if e["kind"] == "exec") >= 5
    evs = _events(clickhouse_url, sb.id, want=complete)
    execs = [(e["step"], os.path.basename(e["path"])) for e in evs if e["kind"] == "exec" and e["ret"] == 0]
    assert execs == [(1, "sh"), (2, "sh"), (3, "cat"), (4, "sh"), (5, "sleep")]
    writes = {e["path"]: e["step"] for e in evs if e["kind"] == "open_write" and e["path"].startswith("/workspace")}
    assert writes == {"/workspace/state": 1, "/workspace/two": 2}
    states = _states(evs)
    assert states[:3] == ["requested", "admitted", "started"], states    # admitted at once: never queued
    for s in ("step_started", "step_ended", "exited", "cleaned", "released"):
        assert s in states, (s, states)
    steps = [(e["step"], json.loads(e["extra"])["state"]) for e in evs
             if e["kind"] == "lifecycle" and json.loads(e["extra"])["state"] in ("step_started", "step_ended")]
    assert steps == [(i, s) for i in range(1, 6) for s in ("step_started", "step_ended")]
    lc = [json.loads(e["extra"]) for e in evs if e["kind"] == "lifecycle"]
    assert all(x.get("labels", {}).get("job") == "traj-test" for x in lc if x["state"] != "queued")
    assert all(e["ts_ns"] > 0 for e in evs)


def test_exec_streams_output_stdin_and_exact_bytes(client):
    with client.create(warm=False) as sb:
        chunks = []
        r = sb.exec(["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo done >&2"],
                    on_stdout=chunks.append)
        assert r.code == 0 and len(r.stdout) == 3_000_000 and r.stderr == b"done\n"
        assert len(chunks) > 1                         # streamed, not one blob
        r = sb.exec(["sh", "-c", "wc -c"], stdin_stream=(b"ab" * 50000 for _ in range(20)))
        assert r.stdout.strip() == b"2000000"
        weird = b"caf\xe9-\xff\x01"
        r = sb.exec([b"/bin/echo", weird], env={"X": b"v\xfe"})
        assert r.stdout == weird + b"\n"
        r = sb.exec(["sh", "-c", "printf %s \"$X\""], env={"X": b"v\xfe"})
        assert r.stdout == b"v\xfe"
        r = sb.exec(["no-such-binary"])
        assert r.code == 127 and "No such file" in r.error
        r = sb.exec(["sh", "-c", "kill -9 $$"])
        assert r.code == 137 and r.signal == 9 and r.exit_code is None


def test_warm_pool_claim_and_refill(client, agent):
    def ready():
        return client.capabilities()["warm_profiles"][0]["ready"]
    deadline = time.monotonic() + 30
    while ready() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready() == 2
    sb = client.create(memory="256M", pids=256, labels={"k": "warm"})
    assert sb.created.warm and sb.created.warm_profile == "small"
    r = sb.exec(["hostname"])
    assert r.stdout.decode().strip() == sb.id
    sb.close()
    cold = client.create(memory="256M", pids=128)            # another shape: started cold
    assert not cold.created.warm
    cold.close()
    deadline = time.monotonic() + 30
    while ready() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready() == 2                                    # refilled in the background
    cap = client.capabilities()["capacity"]
    assert cap["warm"]["ready"] == 2 and cap["memory"]["warm"] == 2 * (256 << 20)   # counted against capacity


def test_agent_sandbox_is_recorded_like_dsec_run_and_reruns_from_clickhouse_alone(client, clickhouse_url):
    """The agent records through the same SandboxWatch as `dsec run`: step_start /
    step_end records and the policy YAML in sandbox_start, so replay --rerun can
    rebuild the sandbox from its ClickHouse record without the agent."""
    with client.create(warm=False, labels={"job": "rerun-me"}) as sb:
        r1 = sb.exec(["sh", "-c", "echo hello > /workspace/note; exit 3"])
        r2 = sb.exec(["sh", "-c", "test \"$(cat /workspace/note)\" = hello && exit 5"])
    assert (r1.code, r2.code) == (3, 5)
    evs = _events(clickhouse_url, sb.id, want=lambda e: any(x["kind"] == "sandbox_exit" for x in e)
                  and sum(1 for x in e if x["kind"] == "step_end") == 2)
    assert [e["step"] for e in evs if e["kind"] == "step_start"] == [1, 2]
    assert [(e["step"], e["exit_code"]) for e in evs if e["kind"] == "step_end"] == [(1, 3), (2, 5)]
    (start,) = [e for e in evs if e["kind"] == "sandbox_start"]
    extra = json.loads(start["extra"])
    assert extra["labels"] == {"job": "rerun-me"} and "kind: SandboxPolicy" in (extra["policy_yaml"] or "")
    r = dsec("replay", sb.id, "--rerun", "--format", "json",
             env={"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_AGENT": "off"}, timeout=240)
    assert b"Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    assert d["how"] == "in-process"
    assert [(s["original"]["code"], s["rerun"]["code"]) for s in d["steps"]] == [(3, 3), (5, 5)]
    assert not any(s["exit_changed"] for s in d["steps"])


def test_warm_claim_records_the_requesters_labels(client, clickhouse_url):
    deadline = time.monotonic() + 30
    while client.capabilities()["warm_profiles"][0]["ready"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    sb = client.create(memory="256M", pids=256, labels={"job": "warm-labels", "trajectory": "w-1"})
    assert sb.created.warm
    sb.exec(["true"])
    sb.close()
    evs = _events(clickhouse_url, sb.id, want=lambda e: any(x["kind"] == "sandbox_exit" for x in e))
    starts = [e for e in evs if e["kind"] == "sandbox_start"]
    assert len(starts) == 1, starts
    extra = json.loads(starts[0]["extra"])
    assert extra["labels"] == {"job": "warm-labels", "trajectory": "w-1"} and extra["warm_profile"] == "small"
    assert starts[0]["ts_ns"] <= min(e["ts_ns"] for e in evs if e["kind"] != "lifecycle")
    (end,) = [e for e in evs if e["kind"] == "sandbox_exit"]
    assert json.loads(end["extra"])["labels"] == {"job": "warm-labels", "trajectory": "w-1"}


def test_stream_events_live_with_filters(client):
    got, stop = [], threading.Event()
    with client.create(warm=False, labels={"job": "stream"}) as sb:
        def tail():
            seen = set()
            for ev in client.events(sandbox=sb.id, kinds=["exec", "lifecycle"]):
                got.append(ev)
                if ev.get("kind") == "lifecycle":
                    seen.add((ev["step"], json.loads(ev["extra"])["state"]))
                else:
                    seen.add((ev["step"], os.path.basename(ev["path"])))
                if {(2, "step_ended"), (2, "ls")} <= seen or stop.is_set():
                    return
        t = threading.Thread(target=tail, daemon=True)
        t.start()
        time.sleep(0.5)
        sb.exec(["true"])
        sb.exec(["sh", "-c", "ls /"])
        t.join(20)
        stop.set()
    assert not t.is_alive()
    assert all(e["sandbox_id"] == sb.id and e["kind"] in ("exec", "lifecycle") for e in got)
    execs = [(e["step"], os.path.basename(e["path"])) for e in got if e["kind"] == "exec"]
    assert (1, "true") in execs and (2, "sh") in execs and (2, "ls") in execs
    with pytest.raises(InvalidArgument, match="not an event kind"):
        next(iter(client.events(kinds=["bogus"])))


CONNECT = ("import errno, socket, sys\n"
           "s = socket.socket()\n"
           "s.settimeout(5)\n"
           "try:\n"
           "    s.connect((sys.argv[1], 8080)); print('ok')\n"
           "except OSError as e:\n"
           "    print(errno.errorcode.get(e.errno, e.errno))\n")


@pytest.fixture(scope="module")
def update_host():
    with NetHost(subnet=43) as th:          # 10.200.43.0/24: not used by any other test
        p = subprocess.Popen(["ip", "netns", "exec", th.name, "timeout", "600", "python3", "-m", "http.server",
                              "--bind", "0.0.0.0", "8080"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        th.procs.append(p)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and subprocess.run(
                ["ip", "netns", "exec", th.name, "python3", "-c",
                 f"import socket; socket.create_connection(('{th.addr}', 8080), 1)"], capture_output=True).returncode:
            time.sleep(0.1)
        yield th


def test_update_policy(client, update_host):
    """Issue 13 points 8-9: the update takes effect (a connect that worked is now
    refused) and the answer says what was applied, nothing more: exec rules are
    not changed by an update (one that changes them is refused)."""
    addr = update_host.world            # the outside (the private link address is node-protected)
    with client.create(warm=False, network="egress", policy="default") as sb:
        r = sb.exec(["python3", "-I", "-c", CONNECT, addr], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() == b"ok", r.stderr
        u = sb.update_policy("no-network")
        assert u["policy_name"] == "no-network" and u["applied"] == ["egress"]
        assert "seccomp" in u["syscalls"] and "tightened" in u["syscalls"]
        assert sb.info().policy_name == "no-network"
        r = sb.exec(["python3", "-I", "-c", CONNECT, addr], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() == b"EPERM", r.stdout
        exec_rules = ("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: execs}\nspec:\n"
                      "  mode: enforce\n  exec: {allow: [/usr/bin/*]}\n  egress: {default: deny}\n")
        with pytest.raises(AgentError) as e:
            sb.update_policy(policy_yaml=exec_rules)
        assert e.value.status == "FAILED_PRECONDITION" and "exec" in e.value.message
        assert sb.info().policy_name == "no-network"
        with pytest.raises(InvalidArgument, match="no built-in policy"):
            sb.update_policy("no-such-policy")


def test_bad_requests_invalid_argument_and_agent_keeps_serving(client):
    cases = [
        (dict(memory=-5), "resources.memory_bytes: must be >= 0"),
        (dict(cpus=-1), "resources.cpus: must be a number >= 0"),
        (dict(pids=-3), "resources.pids: must be >= 0"),
        (dict(cpus=1000), "more than"),
        (dict(priority="urgent"), "priority 'urgent'"),
        (dict(network="bridge"), "network 'bridge'"),
        (dict(policy="no-such-policy"), "no built-in policy 'no-such-policy'"),
        (dict(policy_yaml="apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n  mode: enforce\n"
                          "  syscalls: {default: deny, allow: [opne]}\n", policy_source="mine.yaml"), "mine.yaml:6"),
        (dict(sandbox_id="bad id!"), "sandbox_id"),
        (dict(labels={"k" * 200: "v"}), "labels: key"),
        (dict(workdir="relative"), "workdir 'relative'"),
        (dict(rootfs="/no/such/dir"), "rootfs '/no/such/dir'"),
        (dict(env={"A=B": "x"}), "env[0]"),
        (dict(lifetime=-1), "lifetime_seconds"),
    ]
    for kw, needle in cases:
        with pytest.raises(InvalidArgument) as e:
            client.create(**kw)
        assert needle in e.value.message, (kw, e.value.message)
        assert "Traceback" not in e.value.message
    with client.create(warm=False) as sb:
        for argv, needle in (([], "argv: at least the command"),
                             (["echo", "x" * (10 << 20)], "one argument may have at most"),
                             (["echo"] + ["y" * 1000] * 10_000, "at most 4096 arguments"),
                             (["echo"] + ["y" * 100_000] * 3, "a step may carry at most"),
                             ([b"ec\0ho"], "argv[0]: contains a NUL byte")):
            with pytest.raises(InvalidArgument) as e:
                sb.exec(argv)
            assert needle in e.value.message, (needle, e.value.message)
        with pytest.raises(InvalidArgument, match="timeout_seconds"):
            sb.exec(["true"], timeout=-1)
        assert sb.exec(["true"]).code == 0                 # still serving, same sandbox usable
    with pytest.raises(NotFound, match="no sandbox 'nope'"):
        client.get("nope")
    with pytest.raises(NotFound):
        client.sandbox("nope").exec(["true"])
    with pytest.raises(InvalidArgument, match="states"):
        client.list(states=["sleeping"])
    assert client.capabilities()["audit"]["available"]


def test_kill_and_list_by_label(client):
    a = client.create(warm=False, labels={"job": "kill-test", "n": "a"})
    b = client.create(warm=False, labels={"job": "kill-test", "n": "b"})
    out = {}

    def step():
        try:
            a.exec(["sleep", "60"])
        except AgentError as e:
            out["err"] = e
    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.5)
    info = a.kill(grace=0.5, reason="test says stop")
    t.join(10)
    assert info.state == "killed" and "test says stop" in info.reason
    assert out["err"].status == "ABORTED" and "was killed" in out["err"].message
    assert out["err"].result is not None and out["err"].result.signal in (15, 9)
    listed = {i.sandbox_id: i.state for i in client.list(labels={"job": "kill-test"})}
    assert listed == {a.id: "killed", b.id: "running"}
    assert [i.sandbox_id for i in client.list(labels={"job": "kill-test"}, states=["running"])] == [b.id]
    b.close()
    with pytest.raises(AgentError) as e:
        a.exec(["true"])
    assert e.value.status == "FAILED_PRECONDITION" and "was killed" in e.value.message


def test_dsec_run_and_events_through_the_agent(agent, tmp_path):
    env = {"DSEC_AGENT_SOCKET": agent.socket}
    out = tmp_path / "s.json"
    r = dsec("run", "--summary-json", str(out), "--", "sh", "-c", "cat; echo to-err >&2; exit 5",
             input=b"piped in\n", env=env)
    assert r.returncode == 5, r.stderr
    assert r.stdout == b"piped in\n" and b"to-err\n" in r.stderr
    s = json.loads(out.read_text())
    # it returned once the record was durable in the agent's spool (not waiting for ClickHouse) ...
    assert s["agent"] == agent.socket and s["exit_code"] == 5 and "exported" not in s["audit"]
    sid = s["sandbox_id"]
    assert f"dsec: sandbox {sid}".encode() in r.stderr
    # ... and with --wait-export once ClickHouse has it
    r = dsec("run", "--wait-export", "--summary-json", str(out), "--", "true", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["audit"]["exported"] is True
    assert dsec("run", "--timeout", "0.5", "--", "sleep", "10", env=env).returncode == 124
    r = dsec("run", "--", "no-such-cmd", env=env)
    assert r.returncode == 127 and b"no-such-cmd" in r.stderr
    r = dsec("run", "--policy", "nope", "--", "true", env=env)
    assert r.returncode == 125 and b"no built-in policy" in r.stderr
    r = dsec("events", "--sandbox", sid, "--format", "json", env=env)
    assert r.returncode == 0, r.stderr
    evs = [json.loads(x) for x in r.stdout.splitlines()]
    assert any(e["kind"] == "exec" and e["path"].endswith("/cat") and e["step"] == 1 for e in evs)
    r = dsec("events", "--sandbox", "never-was", env=env)
    assert r.returncode == 1 and b"no events recorded" in r.stderr
    # no agent: the same command works in-process
    r = dsec("run", "--audit", "off", "--", "sh", "-c", "exit 3", env={"DSEC_AGENT": "off"})
    assert r.returncode == 3


def test_dsec_run_through_the_agent_imports_no_grpc_and_a_killed_client_ends_its_run(agent, client):
    """`dsec run` talks to the agent over its own socket (agent/node/runclient.py): neither gRPC
    nor protobuf is imported, nor `site` (the entry starts Python with -S, agent/entry.py: the
    standard library only); a client killed mid-step has its step and its sandbox ended."""
    env = dict(agent.env)
    env.update(DSEC_AGENT_SOCKET=agent.socket, DSEC_AGENT="reuse", PYTHONPROFILEIMPORTTIME="1")
    r = subprocess.run([DSEC, "run", "--", "sh", "-c", "echo ok"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr[-2000:]
    mods = {line.split("|")[-1].strip() for line in r.stderr.decode().splitlines() if "import time:" in line}
    assert "dsec: sandbox" in r.stderr.decode()
    assert "agent.node.runclient" in mods, sorted(mods)
    assert not [m for m in mods if m.startswith(("grpc", "google.protobuf")) or m in ("site", "yaml")], sorted(mods)
    # a command that needs third-party packages still finds them (site runs at its first such import)
    r = subprocess.run([DSEC, "policy", "show", "default"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0 and b"apiVersion" in r.stdout, r.stderr[-2000:]
    env.pop("PYTHONPROFILEIMPORTTIME")
    p = subprocess.Popen([DSEC, "run", "--", "sh", "-c", "echo started; exec sleep 60"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"started\n"
        sid = next(sb.sandbox_id for sb in client.list(labels={"client": "dsec-run"}) if sb.state == "running")
    finally:
        p.kill()
        p.wait()
    end = time.monotonic() + 60         # running, then stopping (its close under way), then ended
    while client.get(sid).state in ("running", "stopping") and time.monotonic() < end:
        time.sleep(0.2)
    info = client.get(sid)
    assert info.state in ("killed", "exited"), info


# ---------------------------------------------------------------- scale

def test_300_sandboxes_at_concurrency_20(agent, tmp_path):
    n, conc = 300, 20
    figures = {}

    async def main():
        sem = asyncio.Semaphore(conc)
        async with AsyncClient(agent.socket) as c:
            async def one(i):
                async with sem:
                    sb = await c.create(memory="64M", pids=64, labels={"job": "bulk"}, warm=False)
                    r = await sb.exec(["sh", "-c", f"echo {i}; echo {i} > /workspace/out"])
                    info = await sb.close()
                    return i, r, info
            warm = await asyncio.gather(*(one(i) for i in range(20)))
            figures["rss_after_20"] = agent.rss()
            t0 = time.monotonic()
            rest = await asyncio.gather(*(one(i) for i in range(20, n)), return_exceptions=True)
            figures["seconds_for_280"] = round(time.monotonic() - t0, 2)
            return warm + rest
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for i, r, info in results:
        assert r.code == 0 and r.stdout == f"{i}\n".encode(), (i, r)
        assert info.state == "exited"
    time.sleep(1.0)
    figures["rss_after_300"] = agent.rss()
    figures["sandboxes_per_second"] = round(280 / figures["seconds_for_280"], 1)
    ids = [info.sandbox_id for _, _, info in results]
    after = leftovers()
    assert not _mine(after, ids), _mine(after, ids)
    from agent.sandbox import netns
    mine_links = {n for i in ids for n in netns.ifnames(i)}
    assert not mine_links & set(after["links"])
    assert not [n for n in after["netns"] if any(i in n for i in ids)]
    growth = figures["rss_after_300"] - figures["rss_after_20"]
    figures["rss_growth_mib"] = round(growth / (1 << 20), 1)
    print(f"\nagent: 300 sandboxes at concurrency 20: {figures}")
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    assert growth < 64 << 20, figures       # a leak of even 200 KiB per sandbox would show


# ---------------------------------------------------------------- scheduling

@pytest.fixture(scope="module")
def sched_agent(tmp_path_factory, clickhouse_url):
    # one agent for the scheduling tests: each closes or kills everything it made
    a = AgentProc(str(tmp_path_factory.mktemp("sched")), clickhouse_url, {
        "capacity": {"cpus": 2, "memory": "2G", "reserve_memory": 0, "cpu_oversubscription": 1},
        "scheduling": {"aging_seconds": 1.0, "preemption_grace": 1.0, "tick_seconds": 0.1},
    }).start()
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def test_a_one_shot_step_whose_caller_leaves_while_queued_ends_its_sandbox(sched_agent):
    """Exec(close_after) on a sandbox still queued, then its caller goes away: the one-shot
    run's sandbox ends (cancelled), as it does when the caller leaves during the step. Before,
    the cancellation saw no sandbox yet, returned, and the queued request stayed, to run
    later owned by nobody until its lifetime ended."""
    with sched_agent.client() as c:
        big = c.create(priority="standard", cpus=2, memory="256M")          # the node's 2 CPUs
        q = c.create(priority="preemptible", cpus=1, memory="256M", wait=False)
        try:
            assert c.get(q.id).state == "queued"
            g = sched_agent.client(step_socket=False)
            out = []

            def one_shot():
                try:
                    out.append(g.exec(q.id, ["true"], close_after=True))
                except Exception as e:  # noqa: BLE001 (the call is cancelled under it)
                    out.append(e)
            t = threading.Thread(target=one_shot)
            t.start()
            time.sleep(0.5)                         # the Exec waits for the queued sandbox
            g.close()                               # its caller goes away
            t.join(10)
            deadline = time.monotonic() + 10
            while c.get(q.id).state == "queued" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get(q.id).state == "cancelled", (c.get(q.id), out)
        finally:
            if c.get(q.id).state not in ("cancelled", "exited", "killed"):
                c.kill(q.id)
            big.close()


def _admission_order(c, ids):
    infos = {i: c.get(i) for i in ids}
    return [i for i in sorted(ids, key=lambda i: infos[i].admitted_ns)]


def test_preemption_youngest_preemptible_victim_told(sched_agent, clickhouse_url):
    with sched_agent.client() as c:
        p1 = c.create(priority="preemptible", cpus=1, memory="256M", labels={"who": "p1"})
        p2 = c.create(priority="preemptible", cpus=1, memory="256M", labels={"who": "p2"})
        out = {}

        def step(sb, argv, key):
            try:
                out[key] = sb.exec(argv)
            except AgentError as e:
                out[key] = e
        threads = [threading.Thread(target=step, args=(p1, ["sleep", "30"], "p1")),
                   threading.Thread(target=step, args=(p2, ["sh", "-c", "trap '' TERM; sleep 30"], "p2"))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        # a preemptible request does not preempt: it queues
        q = c.create(priority="preemptible", cpus=1, memory="256M", wait=False)
        assert c.get(q.id).state == "queued" and c.get(q.id).waiting == "capacity"
        s = c.create(priority="standard", cpus=1, memory="256M")     # must preempt p2 (the youngest)
        assert s.created.state == "running"
        threads[1].join(15)
        i2 = c.wait(p2.id, timeout=10)                              # Wait tells the victim too
        assert i2.state == "preempted" and i2.preempted_for == s.id and s.id in i2.reason
        err = out["p2"]
        assert isinstance(err, SandboxPreempted), err
        assert f"sandbox {p2.id} was preempted" in err.message and s.id in err.message
        assert err.result is not None and err.result.signal == 9    # ignored SIGTERM: SIGKILL after grace
        assert c.get(p1.id).state == "running"                      # the older one is spared
        assert c.get(q.id).state == "queued"
        c.kill(q.id)
        assert c.get(q.id).state == "cancelled"
        p1.kill(grace=0)
        threads[0].join(10)
        assert isinstance(out["p1"], AgentError) and out["p1"].status == "ABORTED"
        s.close()
    evs = _events(clickhouse_url, p2.id, want=lambda e: "cleaned" in _states(e) and "preempted" in _states(e))
    st = _states(evs)
    assert st.index("preempting") < st.index("stopping") < st.index("preempted")
    assert "exited" not in st


def test_priority_order_when_capacity_frees(sched_agent):
    with sched_agent.client() as c:
        h = c.create(priority="reserved", cpus=2, memory="256M")
        a = c.create(priority="preemptible", cpus=2, memory="256M", wait=False)
        b = c.create(priority="standard", cpus=2, memory="256M", wait=False)
        r = c.create(priority="reserved", cpus=2, memory="256M", wait=False)
        infos = {x.id: c.get(x.id) for x in (a, b, r)}
        assert all(i.state == "queued" for i in infos.values())
        assert infos[r.id].queue_position == 0 and infos[r.id].waiting == "capacity"
        assert infos[b.id].waiting == "head_of_line" and infos[a.id].queue_position == 2
        order = []
        cur = h
        for _ in range(3):
            cur.close()
            nxt = None
            deadline = time.monotonic() + 10
            while nxt is None and time.monotonic() < deadline:
                for x in (a, b, r):
                    if x.id not in order and c.get(x.id).state == "running":
                        nxt = x
                time.sleep(0.05)
            assert nxt is not None
            order.append(nxt.id)
            cur = nxt
        cur.close()
    assert order == [r.id, b.id, a.id]           # reserved, standard, preemptible


def test_aging_lets_a_long_waiting_preemptible_go_first(sched_agent):
    with sched_agent.client() as c:
        h = c.create(priority="reserved", cpus=2, memory="256M")
        a = c.create(priority="preemptible", cpus=2, memory="256M", wait=False)
        time.sleep(2.5)                                   # aging 1 s: worth 2.5 class steps
        b = c.create(priority="standard", cpus=2, memory="256M", wait=False)
        r = c.create(priority="reserved", cpus=2, memory="256M", wait=False)
        assert [c.get(x.id).queue_position for x in (a, r, b)] == [0, 1, 2]
        h.close()
        assert c.wait(a.id, "running", 10).state == "running"
        a.close()
        assert c.wait(r.id, "running", 10).state == "running"
        assert c.get(b.id).state == "queued"
        r.close()
        assert c.wait(b.id, "running", 10).state == "running"
        b.close()
        order = _admission_order(c, [a.id, b.id, r.id])
    assert order == [a.id, r.id, b.id]


# ---------------------------------------------------------------- TCP + mTLS, reachability

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")), ("trainer-1", "intruder"))


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory, clickhouse_url, pki):
    from fixtures_clickhouse import free_ports
    port = free_ports(1)[0]
    a = AgentProc(str(tmp_path_factory.mktemp("tlsagent")), clickhouse_url, {
        "tcp": {"listen": f"[::]:{port}", "cert": f"{pki}/server.pem", "key": f"{pki}/server.key",
                "client_ca": f"{pki}/ca.pem", "allowed_clients": ["trainer-1"]},
        "authorization": {"identities": {"trainer-1": {"allow": ["root", "policy_yaml"]}}},
    }).start()
    a.port = port
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def test_mtls_allowlist_refusal_is_clear_and_audited(tls_agent, pki, clickhouse_url):
    target = f"127.0.0.1:{tls_agent.port}"
    ok = TLS(ca=f"{pki}/ca.pem", cert=f"{pki}/trainer-1.pem", key=f"{pki}/trainer-1.key")
    with Client(target, tls=ok) as c:
        assert "tcp+mtls:" in " ".join(c.capabilities()["transports"])
        with c.create(warm=False) as sb:
            assert sb.exec(["echo", "over tls"]).stdout == b"over tls\n"
    bad = TLS(ca=f"{pki}/ca.pem", cert=f"{pki}/intruder.pem", key=f"{pki}/intruder.key")
    with Client(target, tls=bad) as c:
        with pytest.raises(PermissionDenied) as e:
            c.create()
        assert "'intruder' is not in the agent's allowlist" in e.value.message
        with pytest.raises(PermissionDenied):
            list(c.events())
    rogue = TLS(ca=f"{pki}/ca.pem", cert=f"{pki}/rogue.pem", key=f"{pki}/rogue.key")
    with Client(target, tls=rogue, connect_timeout=3) as c:
        with pytest.raises(AgentError) as e:           # refused in the TLS handshake
            c.capabilities()
        assert e.value.status == "UNAVAILABLE"
    with pytest.raises(AgentError, match="only reachable with mutual TLS"):
        Client(target)
    from replay.store import AuditStore

    def refused():
        with AuditStore(clickhouse_url) as store:
            return [json.loads(e["extra"]) for e in store.events("", ["access_denied"])]
    deadline = time.monotonic() + 20
    while not refused() and time.monotonic() < deadline:
        time.sleep(0.5)
    recs = refused()
    assert any(r["identities"] == ["intruder"] and r["method"].endswith("/CreateSandbox") for r in recs), recs


def _host_ipv4() -> list[str]:
    """This host's own IPv4 addresses (not the host ends of sandbox or test-host veths)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()
            if not line.split()[1].startswith(("dsv", "dsp", "dtv"))]


def _host_ipv6() -> list[str]:
    """This host's own global IPv6 addresses (not on sandbox or test-host veths)."""
    out = subprocess.run(["ip", "-o", "-6", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()
            if not line.split()[1].startswith(("dsv", "dsp", "dtv"))]


REACH_PROBE = """import json, os, socket, sys
res = {}
try:
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(sys.argv[1]); res['unix'] = 'connected'
except OSError as e:
    res['unix'] = type(e).__name__
port = int(sys.argv[2])
gws = []
for line in open('/proc/net/route').read().splitlines()[1:]:
    f = line.split()
    if f[1] == '00000000':
        gws.append(socket.inet_ntoa(int(f[2], 16).to_bytes(4, 'little')))
res['gateways'] = gws
v6 = [a for a in sys.argv[3:] if ':' in a]
for a in [a for a in sys.argv[3:] if ':' not in a] + gws:
    try:
        socket.create_connection((a, port), timeout=1.5).close(); res[a] = 'connected'
    except OSError as e:
        res[a] = type(e).__name__
# IPv6: the host's addresses, and the link-local address the host end of eth0 would have
# (EUI-64 of the gateway's MAC, learnt by ARP above) were IPv6 left on there
res['eth0_ipv6'] = os.path.exists('/proc/sys/net/ipv6/conf/eth0') and \
    open('/proc/sys/net/ipv6/conf/eth0/disable_ipv6').read().strip() == '0'
targets = [(a, 0) for a in v6]
for line in open('/proc/net/arp').read().splitlines()[1:]:
    f = line.split()
    if f[0] in gws and f[5] == 'eth0':
        m = bytes.fromhex(f[3].replace(':', ''))
        eui = bytes([m[0] ^ 2]) + m[1:3] + b'\\xff\\xfe' + m[3:]
        ll = 'fe80::' + ':'.join(eui[i:i + 2].hex() for i in range(0, 8, 2))
        targets.append((ll, socket.if_nametoindex('eth0')))
        res['link_local'] = ll
for a, scope in targets:
    key = a if not scope else a + '%eth0'
    try:
        s = socket.socket(socket.AF_INET6); s.settimeout(1.5)
        s.connect((a, port, 0, scope)); s.close(); res[key] = 'connected'
    except OSError as e:
        res[key] = type(e).__name__
print(json.dumps(res))
"""

V6_OPEN = """apiVersion: dsec/v1
kind: SandboxPolicy
metadata: {name: v6-open}
spec:
  mode: enforce
  egress: {default: allow}
"""


def test_sandboxed_process_cannot_reach_the_agent(tls_agent, pki):
    """Over IPv4 and IPv6, from a sandbox with egress, without network, and with a policy
    that opens egress (IPv6 kept on its eth0): never the agent's port on any host address."""
    from agent.sandbox.netns import ifnames
    ok = TLS(ca=f"{pki}/ca.pem", cert=f"{pki}/trainer-1.pem", key=f"{pki}/trainer-1.key")
    addrs = _host_ipv4()
    addrs6 = _host_ipv6() + ["::1"]
    assert "127.0.0.1" in addrs and len(addrs) >= 2 and len(addrs6) >= 2, (addrs, addrs6)
    for a in addrs + addrs6:            # positive control: from the host every address answers
        socket.create_connection((a, tls_agent.port), timeout=3).close()
    with Client(f"127.0.0.1:{tls_agent.port}", tls=ok) as c:
        for network, policy in (("egress", None), ("none", None), ("egress", V6_OPEN)):
            extra = {"policy_yaml": policy} if policy else {}
            with c.create(network=network, warm=False, user="root", **extra) as sb:
                what = (network, bool(policy))
                r = sb.exec(["python3", "-c", REACH_PROBE, tls_agent.socket, str(tls_agent.port), *addrs, *addrs6],
                            timeout=90)
                res = json.loads(r.stdout)
                gws = res.pop("gateways")
                assert len(gws) == (1 if network == "egress" else 0), res   # the host end of its veth
                for g in gws:                                                # is the host too
                    socket.create_connection((g, tls_agent.port), timeout=3).close()
                assert res.pop("unix") == "FileNotFoundError", (what, res)   # the socket is not in its world
                # IPv6 on the sandbox's side only where the policy opens IPv6 egress
                assert res.pop("eth0_ipv6") == (policy is not None), (what, res)
                ll = res.pop("link_local", None)
                assert (ll is not None) == (network == "egress"), (what, res)
                if ll is not None:
                    # the host end of the veth has no IPv6 address at all: nothing there to reach
                    host_if = ifnames(sb.id)[0]
                    out = subprocess.run(["ip", "-o", "-6", "addr", "show", "dev", host_if],
                                         capture_output=True, text=True)
                    assert out.returncode == 0 and out.stdout.strip() == "", (host_if, out.stdout)
                v6_keys = set(addrs6) | ({ll + "%eth0"} if ll else set())
                assert set(res) == set(addrs) | set(gws) | v6_keys, res
                assert all(v != "connected" for v in res.values()), (what, res)


# ---------------------------------------------------------------- crash and restart

def test_agent_sigkilled_then_restarted_cleans_up_and_audit_continues(tmp_path, clickhouse_url):
    a = AgentProc(str(tmp_path), clickhouse_url, {"warm_pool": [{"name": "w", "count": 1, "memory": "128M"}]})
    a.start()
    ids, sups, started = [], [], threading.Event()
    with a.client() as c:
        sbs = [c.create(warm=False, labels={"crash": "yes"}, network=n) for n in ("none", "egress")]
        ids = [sb.id for sb in sbs]
        deadline = time.monotonic() + 30
        while c.capabilities()["warm_profiles"][0]["ready"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        for sb in sbs:
            with open(f"/var/lib/dsec/sandboxes/{sb.id}/state.json") as f:
                sups.append(json.load(f)["supervisor_pid"])
        errs = []
        count = [0]

        def step(sb):
            try:
                for kind, _ in sb.exec_stream(["sh", "-c", "echo up; sleep 300"]):
                    if kind == "stdout":
                        count[0] += 1
                        if count[0] == 2:
                            started.set()
            except AgentError as e:
                errs.append(e)
        ts = [threading.Thread(target=step, args=(sb,), daemon=True) for sb in sbs]
        for t in ts:
            t.start()
        assert started.wait(20)
        time.sleep(1.0)                              # the exporter had time: and then a crash
        a.kill9()
        for t in ts:
            t.join(20)
        assert len(errs) == 2 and all(e.status in ("UNAVAILABLE", "CANCELLED", "UNKNOWN") for e in errs), errs
    # the supervisors saw their control socket close and stopped their sandboxes
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{p}") for p in sups) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in sups)
    left = leftovers()
    assert any(i in x for x in left["state"] for i in ids)          # still there: nobody cleaned yet
    b = AgentProc(str(tmp_path), clickhouse_url, {}, name="restarted")
    b.start()
    try:
        left = leftovers()
        assert not _mine(left, ids), _mine(left, ids)
        assert not [x for x in left["supervisors"] if int(x) in sups]
        with b.client() as c:
            with c.create(warm=False) as sb:
                assert sb.exec(["echo", "after restart"]).stdout == b"after restart\n"
        for sid in ids:
            evs = _events(clickhouse_url, sid, want=lambda e: "orphan_cleaned" in _states(e))
            st = _states(evs)
            assert "orphan_cleaned" in st and "step_started" in st, st         # audit recorded before the crash
            extra = [json.loads(e["extra"]) for e in evs if e["kind"] == "lifecycle"
                     and json.loads(e["extra"])["state"] == "orphan_cleaned"][0]
            assert f"previous agent (pid {a.pid})" in extra["reason"]
            assert any(e["kind"] == "exec" and e["path"].endswith("/sleep") for e in evs)
    finally:
        assert b.stop() == 0, b.read_log()[-3000:]
    left = leftovers()
    assert not _mine(left, ids)
