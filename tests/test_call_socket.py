"""Calls over the agent's run socket (agent/node/callsock.py, docs/agent.md "Calls over the run
socket"): the SDK's CreateSandbox, RunOnce, Wait, Kill, CloseSandbox and Get go there as small
frames instead of gRPC when it talks to its node's agent over the unix socket, through the same
handlers as the gRPC calls (agent/node/calls.py). A real agent, real sandboxes, the SDK and the
raw frames: the same replies and records as gRPC's, bad frames and a wrong identity refused with
one clear error while the agent keeps serving, a caller gone mid-create leaves no sandbox, and
gRPC serves when the frames cannot (every connection taken, an agent that predates them)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import struct
import subprocess
import threading
import time

import pytest

from agent.node.client import AgentError, AsyncClient, Client, SandboxFailed
from agent.node.proto import pb
from agent.node.runclient import dumps, loads, read_frame
from agents import PY, module_agent
from test_agent import _events, _states
from test_step_socket import _norm

LABEL = "callsock"


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    yield from module_agent(tmp_path_factory, clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "8G", "reserve_memory": 0, "cpu_oversubscription": 8},
        "scheduling": {"tick_seconds": 0.2},
        "limits": {"max_concurrent_rpcs": 8},           # the run socket's connections too
        "warm_pool": [{"name": "w", "count": 1, "memory": "256M", "pids": 256}],
    })


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


def _frames_only(c):
    """c with its gRPC channel closed: whatever it still does went over the run socket's frames."""
    c._channel.close()
    return c


def _conn(agent) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(agent.socket + ".run")
    s.settimeout(60)
    return s


def _call(s, method: str, msg, **head):
    p = dumps(dict(method=method, **head)) + b"\0" + msg.SerializeToString()
    s.sendall(struct.pack(">cI", b"U", len(p)) + p)


def _answer(s):
    f = read_frame(s)
    assert f is not None, "the connection closed"
    return (f[0], loads(f[1]) if f[0] == "E" else f[1])


def _rec(e: dict, sid: str) -> dict:
    """A record as test_step_socket's _norm leaves it, less what else differs between two sandboxes."""
    r = _norm(e, sid)
    r.pop("child_pid", None)
    return _steady(r)


VARIES = r"(_ms|_ns|_s|_at|_id|pid|uid|gid|_bytes|_seconds)$"    # times, ids and sizes of one sandbox


def _steady(v):
    if isinstance(v, dict):
        return {k: _steady(x) for k, x in v.items() if not re.search(VARIES, k)}
    if isinstance(v, list):
        return [_steady(x) for x in v]
    return v


def _diff(x: dict, y: dict) -> dict:
    out = {}
    for k in set(x) | set(y):
        if isinstance(x.get(k), dict) and isinstance(y.get(k), dict):
            d = _diff(x[k], y[k])
            if d:
                out[k] = d
        elif x.get(k) != y.get(k):
            out[k] = (x.get(k), y.get(k))
    return out


def _live(client, label) -> list:
    return [i for i in client.list(labels={LABEL: label}) if not i.ended]


def _until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


_SAME = ("state", "reason", "priority", "cpus", "memory", "pids", "policy_name", "policy_hash", "mode", "network",
         "warm", "warm_profile", "steps", "node", "image", "window", "phase", "frozen", "timed_out")


def _same_info(a, b):
    for k in _SAME:
        assert getattr(a, k) == getattr(b, k), (k, a, b)
    assert {k: v for k, v in a.labels.items() if k != LABEL} == {k: v for k, v in b.labels.items() if k != LABEL}


def test_each_call_over_frames_answers_as_grpc(agent):
    spec = dict(memory="128M", pids=64, warm=False, env={"A": "1"}, labels={"job": "j"})
    got = {}
    with Client(agent.socket, step_socket=False) as g, _frames_only(agent.client()) as f:
        for name, c in (("grpc", g), ("frames", f)):
            out = got[name] = {}
            sb = c.create(**dict(spec, labels={"job": "j", LABEL: name}))
            out["create"] = sb.created
            out["get"] = c.get(sb.id)
            out["wait"] = c.wait(sb.id, "running", timeout=10)
            out["wait_timed_out"] = c.wait(sb.id, "ended", timeout=0.2)
            out["exec"] = sb.exec(["sh", "-c", "echo x > /workspace/f; echo hi"])
            out["close"] = c.close_sandbox(sb.id)
            out["close_again"] = c.close_sandbox(sb.id)
            k = c.create(**spec)
            out["kill"] = c.kill(k.id, grace=0.5, reason="enough")
            w = c.create(memory="256M", pids=256)               # the pool's profile: a warm claim
            out["warm"] = w.created
            c.close_sandbox(w.id)
            out["once"] = c.run_once(["sh", "-c", "cat; echo e >&2; exit 3"], stdin=b"in", **spec)
            errors = []
            for fn in (lambda: c.get("nope"), lambda: c.close_sandbox("nope"), lambda: c.kill("nope"),
                       lambda: c.wait("nope"), lambda: c.wait(sb.id, until="later"),
                       lambda: c.create(memory="64G"), lambda: c.create(policy="no-such-policy"),
                       lambda: c.run_once([b"a\0b"]), lambda: c.create(sandbox_id=sb.id + "/x")):
                with pytest.raises(AgentError) as e:
                    fn()
                errors.append((type(e.value).__name__, e.value.status, re.sub(r"sbx-[0-9a-f]+", "SID", str(e.value))))
            out["errors"] = errors
            out["failed"] = pytest.raises(SandboxFailed, c.create, user="no-such-user", warm=False).value.reason
        assert f._steps._idle and f._steps.calls
    a, b = got["grpc"], got["frames"]
    for k in ("create", "get", "wait", "wait_timed_out", "close", "close_again", "kill", "warm"):
        _same_info(a[k], b[k])
    assert b["wait"].state == "running" and b["wait_timed_out"].timed_out and b["warm"].warm
    assert b["kill"].state == "killed" and b["close"].state == "exited"
    assert [c["path"] for c in b["close"].summary["changes"]] == [c["path"] for c in a["close"].summary["changes"]]
    assert any(c["path"] == "/workspace/f" for c in b["close"].summary["changes"])
    for k in ("code", "exit_code", "stdout", "stderr", "signal", "timed_out", "error", "sandbox_state", "warm",
              "stdout_dropped"):
        assert getattr(a["once"], k) == getattr(b["once"], k), k
    assert (b["once"].code, b["once"].stdout, b["once"].stderr) == (3, b"in", b"e\n") and b["once"].summary
    assert a["errors"] == b["errors"], (a["errors"], b["errors"])
    assert [e[0] for e in b["errors"]] == ["NotFound", "NotFound", "NotFound", "NotFound", "InvalidArgument",
                                           "InvalidArgument", "InvalidArgument", "InvalidArgument",
                                           "InvalidArgument"], b["errors"]
    assert a["failed"] == b["failed"] and "no-such-user" in b["failed"]


def test_the_records_are_a_grpc_calls(agent, client, clickhouse_url):
    ids = {}
    with Client(agent.socket, step_socket=False) as g, _frames_only(agent.client()) as f:
        for name, c in (("grpc", g), ("frames", f)):
            sb = c.create(memory="128M", pids=64, warm=False, labels={"job": "rec"})
            sb.exec(["sh", "-c", "echo x > /workspace/f"])
            sb.close()
            ids[name] = [sb.id, c.run_once(["true"], memory="128M", pids=64, warm=False, labels={"job": "rec"}).sandbox_id]
    for i in range(2):
        recs = {}
        for name, sids in ids.items():
            sid = sids[i]
            evs = _events(clickhouse_url, sid, want=lambda e: "released" in _states(e))
            recs[name] = sorted((_rec(e, sid) for e in evs), key=lambda r: (r["kind"], json.dumps(r, sort_keys=True,
                                                                                                   default=str)))
        a, b = recs["grpc"], recs["frames"]
        assert [(r["kind"], (r.get("extra") or {}).get("state")) for r in a] == \
               [(r["kind"], (r.get("extra") or {}).get("state")) for r in b]
        for x, y in zip(a, b):
            assert x == y, _diff(x, y)
        assert {"sandbox_start", "sandbox_exit", "step_start", "step_end"} <= {r["kind"] for r in b}


def test_bad_frames_are_refused_clearly_and_the_agent_keeps_serving(agent, client):
    sb = client.create(warm=False)
    s = _conn(agent)

    def raw(payload):
        s.sendall(struct.pack(">cI", b"U", len(payload)) + payload)
        return _answer(s)
    get = pb.GetRequest(sandbox_id=sb.id).SerializeToString()
    cases = [(b"no nul byte", "a JSON head, a NUL byte, then the request message"),
             (b"not json\0", "call: not JSON"),
             (dumps([1]) + b"\0", "call: a JSON object, got list"),
             (dumps({"method": "Get", "x": 1}) + b"\0" + get, "x: unknown field"),
             (dumps({"method": 7}) + b"\0", "method: expected a string, got int"),
             (dumps({"method": "Get", "timeout": -1}) + b"\0" + get, "timeout: a number of seconds > 0"),
             (dumps({"method": "Get", "timeout": True}) + b"\0" + get, "timeout: expected a number, got bool"),
             (dumps({"method": "Snapshot"}) + b"\0", "method 'Snapshot' is not carried here"),
             (dumps({"method": "Get"}) + b"\0\xff\xff\xff", "Get: not a GetRequest message"),
             (dumps({"method": "CreateSandbox"}) + b"\0" + pb.CreateSandboxRequest(
                 resources=pb.Resources(memory_bytes=1 << 50)).SerializeToString(), "memory")]
    for payload, needle in cases:
        kind, err = raw(payload)
        assert kind == "E" and err["code"] == "INVALID_ARGUMENT" and needle in err["message"], (needle, err)
        assert "Traceback" not in err["message"]
    _call(s, "Get", pb.GetRequest(sandbox_id="nope"))
    kind, err = _answer(s)
    assert kind == "E" and err["code"] == "NOT_FOUND" and "no sandbox 'nope'" in err["message"]
    _call(s, "Get", pb.GetRequest(sandbox_id=sb.id))            # the same connection still serves
    kind, body = _answer(s)
    assert kind == "u" and pb.SandboxInfo.FromString(body).state == "running"
    _call(s, "Get", pb.GetRequest(sandbox_id=sb.id))            # a frame of another kind: E, then closed
    s.sendall(struct.pack(">cI", b"i", 0))
    assert _answer(s)[0] == "u"
    kind, err = _answer(s)
    assert kind == "E" and "expected a step (X) or a call (U), got a frame of kind 'i'" in err["message"]
    assert read_frame(s) is None
    s.close()
    assert client.get(sb.id).state == "running" and sb.exec(["true"]).code == 0
    sb.close()
    assert "Traceback" not in agent.read_log()


CHILD = r"""
import os, socket, struct, sys
dfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.fchdir(dfd)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("agent.sock.run")
p = b'{"method": "CreateSandbox"}\0' + bytes.fromhex(sys.argv[2])
s.sendall(struct.pack(">cI", b"U", len(p)) + p)
head = s.recv(5, socket.MSG_WAITALL)
kind, n = struct.unpack(">cI", head)
sys.stdout.write(kind.decode() + " " + s.recv(n, socket.MSG_WAITALL).decode())
"""


def test_a_caller_not_root_is_refused_by_its_peer_credentials(agent, client):
    req = pb.CreateSandboxRequest(no_warm=True, labels={LABEL: "uid"}, wait_running=True)
    path = agent.socket + ".run"
    modes = os.stat(agent.run_dir).st_mode & 0o777, os.stat(path).st_mode & 0o777
    try:
        os.chmod(agent.run_dir, 0o711)                  # as if the socket's mode were ever loosened
        os.chmod(path, 0o666)
        out = subprocess.run([PY, "-c", CHILD, agent.run_dir, req.SerializeToString().hex()], capture_output=True,
                             text=True, timeout=60)
    finally:
        os.chmod(agent.run_dir, modes[0])
        os.chmod(path, modes[1])
    kind, _, body = out.stdout.partition(" ")
    assert kind == "E", (out.stdout, out.stderr)
    err = json.loads(body)
    assert err["code"] == "PERMISSION_DENIED" and "uid 65534" in err["message"] and "only root" in err["message"]
    assert client.list(labels={LABEL: "uid"}) == []      # nothing was created
    with _frames_only(agent.client()) as c:             # and the agent still serves calls there
        with c.create(warm=False, labels={LABEL: "root"}) as sb:
            assert sb.exec(["true"]).code == 0 and c.get(sb.id).state == "running"


def test_a_caller_gone_mid_create_leaves_no_sandbox(agent, client):
    # queued: the node's memory is held by another sandbox, so the request waits its turn
    big = client.create(memory="6G", warm=False, labels={LABEL: "holder"})
    s = _conn(agent)
    _call(s, "CreateSandbox", pb.CreateSandboxRequest(resources=pb.Resources(memory_bytes=4 << 30), no_warm=True,
                                                      labels={LABEL: "queued"}, wait_running=True), timeout=60)
    assert _until(lambda: [i.state for i in client.list(labels={LABEL: "queued"})] == ["queued"])
    s.close()                                           # gone while it waits
    assert _until(lambda: [i.state for i in client.list(labels={LABEL: "queued"})] == ["cancelled"])
    # starting: a cold sandbox, the caller gone at once, a moment later, and once its reply came
    # (closed unread: the agent's next read fails with ECONNRESET, not the end of the stream)
    for i in range(3):
        s = _conn(agent)
        _call(s, "CreateSandbox", pb.CreateSandboxRequest(no_warm=True, labels={LABEL: f"cold{i}"},
                                                          wait_running=True))
        if i == 1:
            time.sleep(0.01)
        elif i == 2:
            assert select.select([s], [], [], 30)[0]
            assert _live(client, "cold2")               # it ran, and its reply is here, unread
        s.close()
    # a RunOnce's caller gone mid-step: its step stopped, its sandbox ended
    s = _conn(agent)
    _call(s, "RunOnce", pb.RunOnceRequest(create=pb.CreateSandboxRequest(no_warm=True, labels={LABEL: "once"}),
                                          exec=pb.ExecStart(argv=[b"sleep", b"60"])))
    assert _until(lambda: any(i.steps == 1 for i in client.list(labels={LABEL: "once"})))
    s.close()
    # the asyncio SDK: a task cancelled while it awaits its sandbox
    async def cancelled(n):
        async with AsyncClient(agent.socket) as c:
            for i in range(n):
                t = asyncio.ensure_future(c.create(warm=False, labels={LABEL: f"task{i}"}))
                await asyncio.sleep(0.005 * i)
                t.cancel()
                try:
                    sb = await t
                except asyncio.CancelledError:
                    continue
                await sb.close()                        # it won the race: its own to close
            while c._steps._reapers:
                await asyncio.sleep(0.05)
    asyncio.run(cancelled(4))
    for label in ["cold0", "cold1", "cold2", "once"] + [f"task{i}" for i in range(4)]:
        assert _until(lambda: not _live(client, label)), (label, client.list(labels={LABEL: label}))
    client.close_sandbox(big.id)
    time.sleep(1.0)                                     # room now: the cancelled request never runs
    assert [i.state for i in client.list(labels={LABEL: "queued"})] == ["cancelled"]
    assert not [i for i in client.list() if LABEL in i.labels and not i.ended]


def test_with_every_connection_taken_the_calls_go_over_grpc(agent, client):
    client._steps.close()                               # its idle connections give their slots back
    held = []
    try:
        while True:                                     # until one is refused: every slot is taken
            assert len(held) <= 8                       # limits.max_concurrent_rpcs: 8
            s = _conn(agent)
            s.settimeout(1.0)
            try:
                f = read_frame(s)                       # refused at once, or accepted and waiting
            except (socket.timeout, TimeoutError):
                held.append(s)
                continue
            s.close()
            assert f[0] == "E" and "too many connections to the run socket" in loads(f[1])["message"], f
            break
        sb = client.create(warm=False)                  # refused there: gRPC, not an error
        assert client.wait(sb.id, "running").state == "running" and client.get(sb.id).state == "running"
        assert client.close_sandbox(sb.id).state == "exited"
        assert client.run_once(["echo", "grpc"], warm=False).stdout == b"grpc\n"
        assert client._steps.calls and not client._steps._idle
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while not client._steps._idle and time.monotonic() < deadline:
        client.get(sb.id)                               # the slots come back: the frames again
    assert client._steps._idle


OLD_REFUSAL = "dsec run socket: the first frame must be a request (R) or a step (X), got 'U'"


def test_an_agent_without_calls_on_its_run_socket_is_served_over_grpc(agent, tmp_path):
    """An agent that predates the calls (main before them) answers the U frame with its refusal and
    closes: the SDK uses gRPC for its calls from then on. Here a run socket that answers as such
    an agent's does, beside a link to the real agent's gRPC socket."""
    d = tmp_path / "old"
    d.mkdir()
    os.symlink(agent.socket, d / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(d / "agent.sock.run"))
    srv.listen(8)
    seen = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            f = read_frame(c)
            seen.append(f[0] if f else None)
            body = dumps({"code": "INVALID_ARGUMENT", "message": OLD_REFUSAL})
            c.sendall(struct.pack(">cI", b"E", len(body)) + body)
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    try:
        with Client(str(d / "agent.sock")) as c:
            sb = c.create(warm=False)
            assert c.get(sb.id).state == "running" and not c._steps.calls
            assert c.close_sandbox(sb.id).state == "exited"
            assert c.run_once(["echo", "old"], warm=False).stdout == b"old\n"
    finally:
        srv.close()
    assert seen == ["U"], seen                          # asked once, then gRPC


def test_a_deadline_passed_in_the_queue_closes_the_sandbox(agent, client):
    big = client.create(memory="6G", warm=False, labels={LABEL: "holder2"})
    try:
        for name, c in (("grpc", Client(agent.socket, step_socket=False)), ("frames", agent.client())):
            with c:
                with pytest.raises(AgentError) as e:
                    c.create(memory="4G", warm=False, labels={LABEL: f"late-{name}"}, timeout=1.0)
                assert e.value.status == "DEADLINE_EXCEEDED", e.value
            assert _until(lambda: [i.state for i in client.list(labels={LABEL: f"late-{name}"})] == ["cancelled"])
    finally:
        client.close_sandbox(big.id)
