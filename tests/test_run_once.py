"""RunOnce (issue 14): a one-shot create + step + close in one unary gRPC call,
from the blocking and the asyncio SDK (`run_once`), against a real agent with
the real eBPF audit; and the SDK's fallback to create + exec(close_after) when
the agent answers UNIMPLEMENTED (a real agent behind a proxy that does not
know the call, as an agent older than RunOnce)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from concurrent import futures

import grpc
import pytest

from agent.node.client import AsyncClient, Client, InvalidArgument, SandboxFailed
from agents import ROOMY, module_agent
from test_agent import _events, _states
from test_spool import read_all


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    yield from module_agent(tmp_path_factory, clickhouse_url, {
        **ROOMY,
        "warm_pool": [{"name": "small", "count": 1, "memory": "256M", "pids": 256}],
        "scheduling": {"tick_seconds": 0.2},
    })


@pytest.fixture(scope="module")
def client(agent):
    with agent.client() as c:
        yield c


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_run_once_is_one_recorded_sandbox(client, clickhouse_url):
    r = client.run_once(["sh", "-c", "cat; echo err >&2; echo x > /workspace/f; exit 3"], stdin=b"in put\n",
                        labels={"job": "once"}, warm=False)
    assert (r.code, r.exit_code, r.stdout, r.stderr) == (3, 3, b"in put\n", b"err\n")
    assert r.sandbox_id and r.stdout_dropped == r.stderr_dropped == 0 and not r.warm
    assert r.summary["exit_code"] == 3
    assert [c["path"] for c in r.summary["changes"] if c["path"].startswith("/workspace/")] == ["/workspace/f"]
    assert client.get(r.sandbox_id).state == "exited"
    evs = _events(clickhouse_url, r.sandbox_id, want=lambda e: any(x["kind"] == "sandbox_exit" for x in e))
    kinds = {e["kind"] for e in evs}
    assert {"sandbox_start", "step_start", "step_end", "exec", "sandbox_exit"} <= kinds
    st = _states(evs)
    assert st.index("requested") < st.index("started") < st.index("exited")
    (start,) = [e for e in evs if e["kind"] == "sandbox_start"]
    assert json.loads(start["extra"])["labels"] == {"job": "once"}
    execs = [e for e in evs if e["kind"] == "exec" and e["ret"] == 0 and e["path"].endswith("/sh")]
    assert execs and execs[0]["sha256"] == _sha(os.path.realpath("/bin/sh"))


def test_output_past_the_cap_is_counted_and_a_warm_sandbox_serves(client):
    r = client.run_once(["sh", "-c", "head -c 300000 /dev/zero; head -c 10 /dev/zero >&2"], max_output=100000,
                        memory="256M", pids=256)
    assert r.code == 0 and r.warm
    assert (len(r.stdout), r.stdout_dropped, len(r.stderr), r.stderr_dropped) == (100000, 200000, 10, 0)


def test_bad_requests_make_no_sandbox(client):
    before = len(client.list())
    with pytest.raises(InvalidArgument, match="argv"):
        client.run_once([b"a\0b"], warm=False)
    with pytest.raises(InvalidArgument, match="memory"):
        client.run_once(["true"], memory="-1", warm=False)
    from agent.node.proto import pb
    req = pb.RunOnceRequest(create=pb.CreateSandboxRequest(no_warm=True),
                            exec=pb.ExecStart(sandbox_id="other", argv=[b"true"]))
    with pytest.raises(grpc.RpcError) as e:
        client.stub.RunOnce(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exec.sandbox_id" in e.value.details()
    assert len(client.list()) == before
    with pytest.raises(SandboxFailed, match="no such user") as e:         # it could not start: as create()
        client.run_once(["true"], user="no-such-user", warm=False)
    sid = e.value.message.split()[1]
    assert client.get(sid).state == "failed"


def test_async_run_once_and_many_at_once(agent):
    async def main():
        async with AsyncClient(agent.socket) as c:
            rs = await asyncio.gather(*[c.run_once(["sh", "-c", f"echo {i}; exit {i % 3}"], warm=False)
                                        for i in range(6)])
        return rs
    rs = asyncio.run(main())
    assert [(r.code, r.stdout) for r in rs] == [(i % 3, f"{i}\n".encode()) for i in range(6)]
    assert len({r.sandbox_id for r in rs}) == 6 and all(r.summary for r in rs)


AGENT_KINDS = {"lifecycle", "sandbox_start", "step_start", "step_end", "sandbox_exit"}    # the rest: the kernel's


def test_a_creates_records_lead_its_sandbox_in_the_spool(agent, client):
    """CreateSandbox's reply does not wait for its records' durable append (Agent.create
    reserves their place, docs/agent.md "When a step's records are durable"): in the spool's
    append order a warm and a cold sandbox's `requested` and `sandbox_start` (and the cold
    one's `started`) come before its first step and its first kernel event, and all of them
    are in the spool when CloseSandbox returns. (Without a reservation, the create's or the
    step's, the records the recorder spooled during the step came first.)"""
    from exporters.spool import Spool
    spool = Spool(agent.spool)
    reader = spool.reader("test-create-order")        # from the oldest segment: keeps what follows
    try:
        read_all(reader)
        ids = []
        for warm in (True, False):
            deadline = time.monotonic() + 60                # the pool refills after the tests before
            while warm and client.capabilities()["warm_profiles"][0]["ready"] < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            sb = client.create(memory="256M", pids=256, warm=warm)
            assert sb.created.warm == warm
            # the step outlives the recorder's next appends: its exec is spooled before the step ends
            assert sb.exec(["sh", "-c", "/bin/true; sleep 0.5"]).code == 0
            sb.close()
            ids.append(sb.id)
        recs, _ = read_all(reader)                   # in the spool's append order
    finally:
        reader.close()
        os.unlink(spool.cursor_path("test-create-order"))
    for sid, warm in zip(ids, (True, False)):
        seq = [(r["kind"], json.loads(r["extra"] or "{}").get("state") if r["kind"] == "lifecycle" else None)
               for r in recs if r["sandbox_id"] == sid]
        names = [s or k for k, s in seq]
        first = min(names.index("step_start"), min(i for i, (k, _) in enumerate(seq) if k not in AGENT_KINDS))
        lead = ["requested", "sandbox_start"] + ([] if warm else ["started"])
        assert all(names.index(n) < first for n in lead), (warm, names)
        assert {"step_end", "exited", "cleaned"} <= set(names), (warm, names)


class _OldAgent(grpc.GenericRpcHandler):
    """Forwards every call but RunOnce to the real agent, byte for byte; RunOnce
    finds no handler (UNIMPLEMENTED), as on an agent that predates it."""

    def __init__(self, channel):
        self.channel = channel
        self.calls = []

    def service(self, details):
        m = details.method
        self.calls.append(m.rsplit("/", 1)[-1])
        if m.endswith("/RunOnce"):
            return None
        ident = (lambda b: b)
        if m.endswith("/ExecOnce"):
            up = self.channel.unary_stream(m, request_serializer=ident, response_deserializer=ident)
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: up(req), ident, ident)
        if m.endswith("/Exec") or m.endswith("/StreamEvents") or m.endswith("/QueryEvents"):
            return None
        up = self.channel.unary_unary(m, request_serializer=ident, response_deserializer=ident)
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: up(req), ident, ident)


def test_sdk_falls_back_when_the_agent_does_not_know_run_once(agent, tmp_path):
    upstream = grpc.insecure_channel(f"unix:{agent.socket}")
    handler = _OldAgent(upstream)
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler])
    sock = str(tmp_path / "old.sock")
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        with Client(sock) as c:
            r1 = c.run_once(["sh", "-c", "echo one"], warm=False, max_output=2)
            r2 = c.run_once(["sh", "-c", "echo two; exit 4"], warm=False)
        assert (r1.code, r1.stdout, r1.stdout_dropped) == (0, b"on", 2)
        assert (r2.code, r2.stdout) == (4, b"two\n") and r2.summary["exit_code"] == 4
        assert handler.calls.count("RunOnce") == 1          # asked once, then remembered
        assert handler.calls.count("CreateSandbox") == 2 and handler.calls.count("ExecOnce") == 2

        async def main():
            async with AsyncClient(sock) as c:
                return await c.run_once(["sh", "-c", "echo three"], warm=False)
        r3 = asyncio.run(main())
        assert (r3.code, r3.stdout) == (0, b"three\n")
        with Client(agent.socket) as c:
            assert c.get(r3.sandbox_id).state == "exited"
    finally:
        server.stop(0)
        upstream.close()


def _at_cleaned(reader, sid: str, look, limit_s: float = 30.0):
    """Reads the spool until `sid`'s `cleaned` lifecycle record is there: (its lifecycle
    states so far, look() called the moment that record was read; None if it never came)."""
    deadline, states = time.monotonic() + limit_s, []
    while time.monotonic() < deadline:
        recs, _ = read_all(reader)
        states += [json.loads(r["extra"])["state"] for r in recs
                   if r["sandbox_id"] == sid and r["kind"] == "lifecycle"]
        if "cleaned" in states:
            return states, look()
        time.sleep(0.002)
    return states, None


def test_an_egress_sandboxs_cleaned_record_waits_for_its_host_link(agent, client):
    """`cleaned` says the sandbox is gone from the host (docs/agent.md). An egress sandbox's
    host link is removed off the close's path (agent/sandbox/trash.py), so its `cleaned`
    record is written once that is done, not when CloseSandbox returns: whenever the record
    can be read in the spool, its state directory, the host end of its veth and the veth's
    entry in the firewall's set are gone. (Before, the record was durable when the close
    returned, with that teardown still under way.)"""
    from agent.sandbox.launcher import SANDBOX_DIR
    from agent.sandbox.netns import _live_policy_ifs, ifnames
    from exporters.spool import Spool
    spool = Spool(agent.spool)
    reader = spool.reader("test-cleaned-late")
    try:
        read_all(reader)
        for _ in range(3):
            sb = client.create(warm=False, network="egress", policy="no-network")     # has egress rules
            host_if, state = ifnames(sb.id)[0], os.path.join(SANDBOX_DIR, sb.id)
            assert os.path.isdir(state) and os.path.exists(f"/sys/class/net/{host_if}") \
                and host_if in _live_policy_ifs()
            sb.close()
            _, link_then = _at_cleaned(reader, sb.id, lambda: os.path.exists(state) or os.path.exists(
                f"/sys/class/net/{host_if}") or host_if in _live_policy_ifs())
            assert link_then is False, (sb.id, "cleaned" if link_then else "no cleaned record in 30 s")
        # a start that fails after its state dir was made (no such user in the image): torn down by
        # start() itself, the egress part off its path too, and `cleaned` after that, as above
        sid = "sbx-cleanedlate-failed"
        with pytest.raises(SandboxFailed):
            client.create(sandbox_id=sid, warm=False, network="egress", user="no-such-user-here")
        state = os.path.join(SANDBOX_DIR, sid)
        states, then = _at_cleaned(reader, sid, lambda: os.path.exists(state))
        assert then is False and states.index("failed") < states.index("cleaned"), (states, then)
    finally:
        reader.close()
        os.unlink(spool.cursor_path("test-cleaned-late"))
