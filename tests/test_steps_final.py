"""A step's reply says how its call ends (agent/node/steps.py, docs/agent.md "Steps"): the
`exit` message is `final`, carrying the error the call then ends with (ABORTED when the
sandbox was stopped under the step) so a client can stop reading there instead of waiting
for the status behind it; `no_started` drops the `started` message for callers that take
the step from the exit (the SDK's exec()). A real agent, real sandboxes, the raw gRPC stub
beside the SDK."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from agent.node.client import AgentError, SandboxStopped
from agent.node.proto import pb
from agents import module_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    yield from module_agent(tmp_path_factory, clickhouse_url, {
        "capacity": {"cpus": 4, "memory": "8G", "reserve_memory": 0, "cpu_oversubscription": 8},
        "scheduling": {"tick_seconds": 0.2},
    })


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


def _kinds(call) -> list:
    return [(m.WhichOneof("msg"), m) for m in call]


def test_exit_is_final_and_no_started_drops_started(client):
    with client.create(warm=False) as sb:
        start = pb.ExecStart(sandbox_id=sb.id, argv=[b"/bin/sh", b"-c", b"echo hi"], close_stdin=True)
        got = _kinds(client.stub.ExecOnce(start))
        assert [k for k, _ in got] == ["started", "stdout", "exit"], got
        ex = got[-1][1].exit
        assert ex.final and ex.error_code == "" and ex.error_message == "" and ex.code == 0
        assert got[0][1].started.step == ex.step
        start.no_started = True
        got = _kinds(client.stub.ExecOnce(start))
        assert [k for k, _ in got] == ["stdout", "exit"], got
        assert got[-1][1].exit.final and got[-1][1].exit.step == ex.step + 1
        # Exec (the bidi stream) too
        got = _kinds(client.stub.Exec(iter([pb.ExecInput(start=start)])))
        assert [k for k, _ in got] == ["stdout", "exit"] and got[-1][1].exit.final, got
        # the SDK: the exit's step, no ("started", ...) when asked for none
        items = list(sb.exec_stream(["/bin/true"], started=False))
        assert [k for k, _ in items] == ["exit"] and items[0][1].step == ex.step + 3
        items = list(sb.exec_stream(["/bin/true"]))
        assert [k for k, _ in items] == ["started", "exit"] and items[0][1] == items[1][1].step


def _kill_during(client, sb, fn):
    out = {}

    def step():
        try:
            out["r"] = fn()
        except (AgentError, grpc.RpcError) as e:
            out["err"] = e
    t = threading.Thread(target=step)
    t.start()
    deadline = time.monotonic() + 20
    while client.get(sb.id).steps < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    sb.kill(grace=0.5, reason="the test stops it")
    t.join(20)
    assert not t.is_alive()
    return out


def test_a_step_stopped_under_it_says_so_in_its_final_exit(client):
    # the raw stream: the exit message names the error, and the status behind it is that error
    sb = client.create(warm=False)
    msgs = []

    def raw():
        call = client.stub.ExecOnce(pb.ExecStart(sandbox_id=sb.id, argv=[b"sleep", b"60"], close_stdin=True,
                                                 no_started=True))
        for m in call:
            msgs.append(m)
    out = _kill_during(client, sb, raw)
    err = out["err"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.ABORTED, out
    assert [m.WhichOneof("msg") for m in msgs] == ["exit"], msgs
    ex = msgs[0].exit
    assert ex.final and ex.error_code == "ABORTED" and ex.error_message == err.details(), (ex, err.details())
    assert "was killed" in ex.error_message and "the test stops it" in ex.error_message
    # the SDK stops at that exit and raises what it says, with the step's result
    sb = client.create(warm=False)
    out = _kill_during(client, sb, lambda: sb.exec(["sleep", "60"]))
    err = out["err"]
    assert isinstance(err, SandboxStopped) and err.status == "ABORTED" and "was killed" in err.message, out
    assert err.result is not None and err.result.signal in (15, 9)
