"""Steps over the agent's run socket (agent/node/stepsock.py, docs/agent.md "Steps over the
run socket"): the SDK's steps in live sandboxes go there instead of gRPC when it talks to its
node's agent over the unix socket. A real agent, real sandboxes, the SDK and the raw frames:
the same results and records as a gRPC Exec, bad frames and a wrong identity refused with one
clear error while the agent keeps serving, a client that goes away ends its step."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import time

import pytest

from agent.node.client import AsyncClient, Client, InvalidArgument, NotFound
from agent.node.runclient import MAX_FRAME, dumps, loads, read_frame
from agents import PY, module_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    yield from module_agent(tmp_path_factory, clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "8G", "reserve_memory": 0, "cpu_oversubscription": 8},
        "scheduling": {"tick_seconds": 0.2},
        "limits": {"max_concurrent_rpcs": 8},           # the run socket's connections too
    })


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


def _conn(agent) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(agent.socket + ".run")
    s.settimeout(60)
    return s


def _send(s, kind: bytes, payload: bytes):
    s.sendall(struct.pack(">cI", kind, len(payload)) + payload)


def _step(s, req: dict, stdin: bytes | None = None):
    _send(s, b"X", dumps(req) + (b"\0" + stdin if stdin is not None else b""))


def _until_end(s) -> list:
    """Frames up to the step's x or E (decoded: JSON for S/x/E)."""
    got = []
    while True:
        f = read_frame(s)
        assert f is not None, ("the connection closed", got)
        k, p = f
        got.append((k, loads(p) if k in "SxE" else p))
        if k in "xE":
            return got


def _steps_of(client, sid, kinds, n):
    """The sandbox's records of these kinds from ClickHouse once there are n of them (bounded)."""
    deadline = time.monotonic() + 30
    evs = []
    while time.monotonic() < deadline:
        try:
            evs = list(client.query_events(sid, kinds=kinds, flush_timeout=5))
        except NotFound:                                # nothing delivered yet
            evs = []
        if len(evs) >= n:
            break
        time.sleep(0.5)
    return evs


def test_a_step_over_it_streams_and_keeps_its_connection(client):
    with client.create(warm=False) as sb:
        items = list(sb.exec_stream(["sh", "-c", "echo a; echo b >&2; exit 3"]))
        assert [k for k, _ in items] == ["started", "stdout", "stderr", "exit"], items
        r = items[-1][1]
        assert (r.code, r.exit_code, r.stdout, r.stderr, items[0][1]) == (3, 3, b"a\n", b"b\n", r.step)
        assert len(client._steps._idle) == 1            # it went over the step socket, which is kept
        conn = client._steps._idle[0]
        chunks = []
        r = sb.exec(["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x"], on_stdout=chunks.append)
        assert r.code == 0 and len(r.stdout) == 3_000_000 and len(chunks) > 1      # streamed
        assert client._steps._idle == [conn]            # the same connection, step after step
        r = sb.exec(["cat"], stdin=b"from stdin", env={"X": b"v\xfe"}, workdir="/tmp")
        assert r.stdout == b"from stdin"
        r = sb.exec(["sh", "-c", 'printf %s "$X"; pwd >&2'], env={"X": b"v\xfe"}, workdir="/tmp")
        assert (r.stdout, r.stderr) == (b"v\xfe", b"/tmp\n")
        weird = b"caf\xe9-\xff\x01"
        assert sb.exec([b"/bin/echo", weird]).stdout == weird + b"\n"
        r = sb.exec(["sleep", "30"], timeout=0.3, grace=0.3)
        assert r.code == 124 and r.timed_out
        r = sb.exec(["sh", "-c", "kill -9 $$"])
        assert (r.code, r.signal, r.exit_code) == (137, 9, None)
        r = sb.exec(["no-such-binary"])
        assert r.code == 127 and "No such file" in r.error
        with pytest.raises(InvalidArgument, match=r"argv\[0\]: contains a NUL byte"):
            sb.exec([b"ec\0ho"])
        with pytest.raises(NotFound, match="no sandbox 'nope'"):
            client.sandbox("nope").exec(["true"])
        assert sb.exec(["true"]).code == 0
        big = b"y" * (5 << 20)                          # more stdin than one frame takes: over gRPC
        assert sb.exec(["wc", "-c"], stdin=big).stdout.strip() == b"5242880"
        assert sb.exec(["sh", "-c", "cat | wc -c"], stdin=b"z" * 100_000).stdout.strip() == b"100000"
    once = client.create(warm=False)                    # close_after: the exit carries the summary
    r = client.exec(once.id, ["sh", "-c", "echo x > /workspace/f"], close_after=True)
    assert r.code == 0 and r.summary and any(c["path"] == "/workspace/f" for c in r.summary["changes"])
    assert client.get(once.id).state == "exited"


def test_a_forked_child_does_not_share_its_parents_connections(client):
    with client.create(warm=False) as sb:
        assert sb.exec(["true"]).code == 0 and len(client._steps._idle) == 1
        parent_conn = client._steps._idle[0]
        pid = os.fork()
        if pid == 0:                                    # the child: a step of its own, not on the parent's
            code = 1
            try:
                r = sb.exec(["echo", "child"])
                code = 0 if r.stdout == b"child\n" and client._steps._idle[0] is not parent_conn else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client._steps._idle == [parent_conn] and sb.exec(["echo", "parent"]).stdout == b"parent\n"


def _norm(e: dict, sid: str) -> dict:
    """A record without what differs between two runs of the same step (ids, times, pids, the
    sandbox's host uid, where the enrichment found the binary: /proc/PID/exe or the root)."""
    e = json.loads(json.dumps(e, default=str).replace(sid, "SID"))
    drop = {"event_id", "ts_ns", "sandbox_id", "pid", "ppid", "tid", "uid", "gid", "cgroup_id", "wall_ms", "cpu_ms",
            "max_rss_bytes", "node", "duration_ns", "start_ns", "inode", "mnt_ns", "pid_ns"}
    out = {k: v for k, v in e.items() if k not in drop}
    if out.get("extra"):
        x = json.loads(out["extra"])
        for k in ("wall_ms", "cpu_ms", "ts_ns", "labels", "uid", "gid", "enrich_source"):
            x.pop(k, None)
        out["extra"] = x
    return out


def test_records_and_results_are_a_grpc_steps(agent, client):
    steps = [(["sh", "-c", "echo out; echo err >&2; exit 3"], {}),
             (["cat"], {"stdin": b"in\xff", "env": {"K": "v"}, "workdir": "/tmp"}),
             (["sleep", "30"], {"timeout": 0.3, "grace": 0.3})]
    runs = {}
    with Client(agent.socket, step_socket=False) as grpc_client:
        for name, c in (("grpc", grpc_client), ("socket", client)):
            sb = c.create(warm=False)
            runs[name] = (sb.id, [sb.exec(argv, **kw) for argv, kw in steps])
            c.close_sandbox(sb.id)
    assert len(client._steps._idle) >= 1 and grpc_client._steps is None
    for a, b in zip(runs["grpc"][1], runs["socket"][1]):
        for k in ("step", "code", "exit_code", "signal", "timed_out", "oom_killed", "error", "stdout", "stderr",
                  "sandbox_state", "preempted"):
            assert getattr(a, k) == getattr(b, k), (k, a, b)
    kinds = ["step_start", "step_end", "lifecycle", "exec"]
    recs = {}
    for name, (sid, _) in runs.items():
        evs = _steps_of(client, sid, kinds, 1)
        assert any(json.loads(e["extra"]).get("state") == "released" for e in evs if e["kind"] == "lifecycle")
        recs[name] = [_norm(e, sid) for e in evs if e["kind"] != "lifecycle"
                      or json.loads(e["extra"])["state"] in ("step_started", "step_ended")]
    key = lambda r: (r["step"], r["kind"], json.dumps(r, sort_keys=True, default=str))  # noqa: E731
    a, b = sorted(recs["grpc"], key=key), sorted(recs["socket"], key=key)
    for x, y in zip(a, b):
        assert x == y, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
    assert len(a) == len(b)
    assert {(r["step"], r["kind"]) for r in recs["socket"]} >= {(s, k) for s in (1, 2, 3)
                                                                for k in ("step_start", "step_end", "exec")}


def test_bad_frames_are_refused_clearly_and_the_agent_keeps_serving(agent, client):
    sb = client.create(warm=False)
    s = _conn(agent)
    cases = [(b"not json", "INVALID_ARGUMENT", "step request: not JSON"),
             (b"[" * 100_000, "INVALID_ARGUMENT", "step request:"),
             (dumps([1, 2]), "INVALID_ARGUMENT", "step request: a JSON object, got list"),
             (dumps({"sandbox_id": sb.id, "argv": "true"}), "INVALID_ARGUMENT", "argv: expected a list, got str"),
             (dumps({"sandbox_id": sb.id, "argv": [1]}), "INVALID_ARGUMENT", "argv: a list of strings"),
             (dumps({"sandbox_id": sb.id, "argv": ["true"], "stdn": "x"}), "INVALID_ARGUMENT",
              "stdn: unknown field"),
             (dumps({"sandbox_id": sb.id, "argv": ["true"], "env": [["A"]]}), "INVALID_ARGUMENT",
              "env: a list of [name, value] string pairs"),
             (dumps({"sandbox_id": sb.id, "argv": ["true"], "timeout": -1}), "INVALID_ARGUMENT",
              "timeout_seconds: must be >= 0"),
             (dumps({"sandbox_id": sb.id, "argv": ["true"], "close_after": 1}), "INVALID_ARGUMENT",
              "close_after: expected true or false, got int"),
             (dumps({"sandbox_id": sb.id, "argv": ["a\0b"]}), "INVALID_ARGUMENT", "argv[0]: contains a NUL byte"),
             (dumps({"sandbox_id": "nope", "argv": ["true"]}), "NOT_FOUND", "no sandbox 'nope'")]
    for payload, code, needle in cases:
        _send(s, b"X", payload)
        got = _until_end(s)
        assert got[-1][0] == "E" and got[-1][1]["code"] == code and needle in got[-1][1]["message"], (needle, got)
        assert "Traceback" not in got[-1][1]["message"]
    _step(s, {"sandbox_id": sb.id, "argv": ["echo", "still"], "started": False})    # the same connection
    got = _until_end(s)
    assert [k for k, _ in got] == ["o", "x"] and got[0][1] == b"still\n" and got[1][1]["final"], got
    # a frame over the limit, or of another kind: one error, then the connection is closed
    for head in (struct.pack(">cI", b"X", MAX_FRAME + 1), struct.pack(">cI", b"i", 0)):
        s.sendall(head)
        f = read_frame(s)
        assert f is not None and f[0] == "E", f
        err = loads(f[1])
        assert err["code"] == "INVALID_ARGUMENT" and ("frame of" in err["message"] or "expected a step (X) or a "
                                                      "call (U)" in err["message"]), err
        assert read_frame(s) is None
        s.close()
        s = _conn(agent)
        _step(s, {"sandbox_id": sb.id, "argv": ["true"]})
        assert [k for k, _ in _until_end(s)] == ["S", "x"]
    s.close()
    s = _conn(agent)
    _send(s, b"Z", b"")                                 # a first frame neither R nor X
    f = read_frame(s)
    assert f[0] == "E" and "a request (R), a step (X) or a call (U), got 'Z'" in loads(f[1])["message"]
    s.close()
    assert sb.exec(["true"]).code == 0                  # the SDK's own connection still serves
    sb.close()
    assert "Traceback" not in agent.read_log()


CHILD = r"""
import os, socket, struct, sys
dfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.fchdir(dfd)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("agent.sock.run")
p = b'{"sandbox_id": "' + sys.argv[2].encode() + b'", "argv": ["true"]}'
s.sendall(struct.pack(">cI", b"X", len(p)) + p)
head = s.recv(5, socket.MSG_WAITALL)
kind, n = struct.unpack(">cI", head)
sys.stdout.write(kind.decode() + " " + s.recv(n, socket.MSG_WAITALL).decode())
"""


def test_a_caller_not_root_is_refused_by_its_peer_credentials(agent, client, clickhouse_url):
    sb = client.create(warm=False)
    path = agent.socket + ".run"
    modes = os.stat(agent.run_dir).st_mode & 0o777, os.stat(path).st_mode & 0o777
    try:
        os.chmod(agent.run_dir, 0o711)                  # as if the socket's mode were ever loosened
        os.chmod(path, 0o666)
        out = subprocess.run([PY, "-c", CHILD, agent.run_dir, sb.id], capture_output=True, text=True, timeout=60)
    finally:
        os.chmod(agent.run_dir, modes[0])
        os.chmod(path, modes[1])
    kind, _, body = out.stdout.partition(" ")
    assert kind == "E", (out.stdout, out.stderr)
    err = json.loads(body)
    assert err["code"] == "PERMISSION_DENIED" and "uid 65534" in err["message"] and "only root" in err["message"]
    assert client.get(sb.id).steps == 0                  # nothing ran
    from replay.store import AuditStore
    deadline = time.monotonic() + 30
    denied = []
    while not denied and time.monotonic() < deadline:
        with AuditStore(clickhouse_url) as store:
            denied = [json.loads(e["extra"]) for e in store.events("", ["access_denied"])
                      if "uid 65534" in e["extra"] and agent.socket in e["extra"]]
        time.sleep(0.5)
    assert denied and denied[0]["method"] == "run socket" and denied[0]["identities"] == ["uid:65534"], denied
    assert sb.exec(["true"]).code == 0
    sb.close()


def test_a_client_that_goes_away_ends_its_step_and_a_waiting_one_never_runs(agent, client):
    sb = client.create(warm=False)
    a = _conn(agent)
    _step(a, {"sandbox_id": sb.id, "argv": ["sh", "-c", "echo up; exec sleep 60"]})
    assert read_frame(a)[0] == "S" and read_frame(a) == ("o", b"up\n")
    b = _conn(agent)                                    # a second step waits for the first's lock
    _step(b, {"sandbox_id": sb.id, "argv": ["echo", "never"]})
    deadline = time.monotonic() + 10
    while client.get(sb.id).steps < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)                                     # b is waiting for the step lock by now
    b.close()
    a.close()                                           # mid-step: the step is stopped (SIGTERM)
    r = sb.exec(["echo", "next"])                       # runs once the stopped step has ended
    assert r.stdout == b"next\n" and r.step == 2, r     # b's step never ran
    c = _conn(agent)                                    # gone while the agent sends its output
    _step(c, {"sandbox_id": sb.id, "argv": ["yes"], "started": False})
    assert read_frame(c)[0] == "o"
    c.close()
    assert sb.exec(["echo", "after"]).step == 4
    ends = _steps_of(client, sb.id, ["step_end"], 4)
    assert {e["step"]: e["signal"] for e in ends if e["step"] in (1, 3)} == {1: 15, 3: 15}, ends
    sb.close()


def test_the_async_sdk_uses_it_and_a_cancelled_task_ends_its_step(agent, client):
    async def main():
        async with AsyncClient(agent.socket) as c:
            sb = await c.create(warm=False)
            r = await sb.exec(["echo", "hi"])
            assert r.stdout == b"hi\n" and len(c._steps._idle) == 1
            items = [k async for k, _ in sb.exec_stream(["sh", "-c", "echo a; echo b >&2"])]
            assert items == ["started", "stdout", "stderr", "exit"], items
            task = asyncio.ensure_future(sb.exec(["sleep", "60"]))
            deadline = time.monotonic() + 10
            while (await c.get(sb.id)).steps < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            r = await sb.exec(["true"])
            assert r.code == 0 and r.step == 4
            await sb.close()
            return sb.id
    sid = asyncio.run(main())
    ends = _steps_of(client, sid, ["step_end"], 4)
    third = [e for e in ends if e["step"] == 3]
    assert third and third[0]["signal"] == 15, ends


def test_with_every_connection_taken_a_step_goes_over_grpc(agent, client):
    sb = client.create(warm=False)
    client._steps.close()                               # its idle connection gives its slot back
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
        r = sb.exec(["echo", "over grpc"])              # its connection is refused: gRPC, not an error
        assert r.stdout == b"over grpc\n" and client._steps.supported and not client._steps._idle
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while not client._steps._idle and time.monotonic() < deadline:
        assert sb.exec(["true"]).code == 0              # the slots come back: the step socket again
    assert client._steps._idle
    sb.close()
