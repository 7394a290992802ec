"""The agent's own records (lifecycle, step, access) reach the spool by group commit
(agent/node/daemon.py _flush_emits): records queued by several threads go into one
durable append, a flush returns only once the records queued before it are in the
spool, and it waits for the append that carries them, not for later ones.

A real Spool in a temp dir behind a gate that holds each append until the test lets
it go; no sandbox, no eBPF: the Agent object is made, not started.
"""
from __future__ import annotations

import itertools
import json
import sys
import threading

import pytest

from agent.node.config import load_config
from agent.node.daemon import Agent
from exporters.spool import Spool

WAIT = 30.0            # a bound on every wait of the test (a hang fails, never a timing)
_reads = itertools.count()


class GatedSpool:
    """Spool.append_many, each call held at its start until released; the calls counted."""

    def __init__(self, path):
        self.spool = Spool(path)
        self.calls: list[list[str]] = []          # the states of each append, in order
        self.entered = [threading.Event() for _ in range(8)]
        self.release = [threading.Event() for _ in range(8)]

    def append_many(self, records, on_locked=None):
        i = len(self.calls)
        self.calls.append([json.loads(r["extra"])["state"] for r in records])
        self.entered[i].set()
        assert self.release[i].wait(WAIT), f"append {i} never released"
        return self.spool.append_many(records, on_locked)


def spooled_states(path) -> set[str]:
    """The states of the lifecycle records in the spool, read back by a reader of its own."""
    r = Spool(path).reader(f"check{next(_reads)}")
    try:
        out = set()
        while True:
            b = r.read()
            if not b.records:
                return out
            out.update(json.loads(x["extra"])["state"] for x in b.records if x["kind"] == "lifecycle")
            r.commit(b)
    finally:
        r.close()


@pytest.fixture
def agent(tmp_path):
    a = Agent(load_config(None, environ={}))
    a.spool = GatedSpool(str(tmp_path / "spool"))
    return a


class Flusher(threading.Thread):
    """Queue one record (its state), then flush; after the flush, read the spool."""

    def __init__(self, agent, state, go=None):
        super().__init__(daemon=True)
        self.agent, self.state, self.go = agent, state, go
        self.queued = threading.Event()
        self.seen: set[str] | None = None

    def run(self):
        self.agent._lifecycle("", self.state)
        self.queued.set()
        if self.go is not None:
            assert self.go.wait(WAIT)
        self.agent._flush_emits()
        self.seen = spooled_states(self.agent.spool.spool.path)


def _blocked_in_flush(t: threading.Thread) -> bool:
    """t is inside _flush_emits, waiting (a frame of threading's wait on top)."""
    f = sys._current_frames().get(t.ident)
    names = []
    while f is not None:
        names.append(f.f_code.co_name)
        f = f.f_back
    return "_flush_emits" in names and names[0] == "wait"


def test_group_commit_one_append_for_many_threads(agent):
    first = Flusher(agent, "first")
    first.start()
    assert agent.spool.entered[0].wait(WAIT)            # append 0 in flight: "first" only
    go = threading.Event()
    others = [Flusher(agent, f"t{i}", go) for i in range(6)]
    for t in others:
        t.start()
        assert t.queued.wait(WAIT)
    go.set()                                            # six threads flush while append 0 is held
    agent.spool.release[0].set()
    first.join(WAIT)
    assert not first.is_alive() and "first" in first.seen
    assert agent.spool.entered[1].wait(WAIT)            # the next append: every record queued meanwhile
    assert sorted(agent.spool.calls[1]) == sorted(t.state for t in others)
    assert all(t.is_alive() for t in others)            # none returned before its record is durable
    assert spooled_states(agent.spool.spool.path) == {"first"}
    agent.spool.release[1].set()
    for t in others:
        t.join(WAIT)
        assert not t.is_alive()
        assert t.state in t.seen                        # durable when its flush returned
    assert len(agent.spool.calls) == 2                  # 7 records from 7 threads, 2 durable appends
    agent._flush_emits()                                # nothing queued: no append
    assert len(agent.spool.calls) == 2


def test_flush_waits_for_the_append_of_its_records_only(agent):
    """A flush whose records another thread's append took returns once that append is
    durable, not behind an append of records queued after it (the old single lock made it
    wait for the next append, or do it)."""
    go = threading.Event()
    rider = Flusher(agent, "rider", go)                 # queued now, flushed while append 0 runs
    rider.start()
    assert rider.queued.wait(WAIT)
    leader = Flusher(agent, "leader")
    leader.start()
    assert agent.spool.entered[0].wait(WAIT)
    assert sorted(agent.spool.calls[0]) == ["leader", "rider"]
    go.set()
    for _ in range(500):                                # the rider waits in its flush (5 s at most)
        if _blocked_in_flush(rider):
            break
        threading.Event().wait(0.01)
    late = Flusher(agent, "late")                       # queued after the rider's flush began
    late.start()
    assert late.queued.wait(WAIT)
    agent.spool.release[0].set()
    assert agent.spool.entered[1].wait(WAIT)            # the late record's append, held
    rider.join(WAIT)
    assert not rider.is_alive(), "the rider's flush waited for an append that does not carry its record"
    assert {"leader", "rider"} <= rider.seen and "late" not in rider.seen
    assert late.is_alive()
    agent.spool.release[1].set()
    for t in (leader, late):
        t.join(WAIT)
        assert not t.is_alive() and t.state in t.seen
    assert len(agent.spool.calls) == 2


def test_a_steps_start_reserves_the_order_of_the_last_records_the_recorder_waits_for_it(agent):
    """A step's start does not wait for the previous step's records (agent/node/steps.py:
    _reserve_emits): the recorder's next append, which may hold the new step's events, waits at
    its gate (TapSpool, Agent._emits_gate) until they are in the spool's append order (in the
    append that holds the spool's writer lock), and lands after them; appends and their
    fdatasync being serialised under that lock, it is durable only after them."""
    from agent.node.streams import TapSpool
    gated = agent.spool
    agent.spool = TapSpool(gated, lambda records: None, agent._emits_gate)
    writer = Flusher(agent, "step_ended")               # the emit writer's append, held before the lock
    writer.start()
    assert gated.entered[0].wait(WAIT)
    agent._reserve_emits()                              # the next step starts: no wait
    recorder = threading.Thread(target=lambda: agent.spool.append_many(
        [agent_record(agent, "next_step_event")]), daemon=True)
    recorder.start()                                    # the recorder's next append: at its gate
    recorder.join(0.2)
    assert recorder.is_alive() and writer.is_alive() and len(gated.calls) == 1
    gated.release[0].set()
    assert gated.entered[1].wait(WAIT)                  # the recorder's append, after the step's records
    assert gated.calls[1] == ["next_step_event"]
    gated.release[1].set()
    for t in (writer, recorder):
        t.join(WAIT)
        assert not t.is_alive()
    assert "step_ended" in writer.seen
    order = []
    r = Spool(gated.spool.path).reader("order")
    while True:
        b = r.read()
        if not b.records:
            break
        order += [json.loads(x["extra"])["state"] for x in b.records]
        r.commit(b)
    r.close()
    assert order == ["step_ended", "next_step_event"], order
    gated.release[2].set()
    agent._reserve_emits()                              # nothing queued since: the gate lets it by
    agent.spool.append_many([agent_record(agent, "later")])
    assert gated.calls[2:] == [["later"]]


def agent_record(agent, state: str) -> dict:
    """A normalized lifecycle record as the agent's emit path spools them."""
    from audit_schema.events import normalize
    return normalize({"kind": "lifecycle", "sandbox_id": "", "step": 0, "ts_ns": 1, "pid": 1,
                      "event_id": f"test-{state}", "node": agent.node,
                      "extra": json.dumps({"state": state})})


def test_an_ending_sandbox_holds_the_emit_writer_its_append_carries_the_queue(agent, monkeypatch):
    """While a sandbox is ending (Agent._finish), the emit writer does not append what a step's
    end queued: the end's own durable append carries it (one fdatasync for a RunOnce's or a
    last step's records and the close's, and the close no longer waits behind the writer's
    append); the hold is bounded (EMIT_HOLD_MAX_S), after which the writer appends as before."""
    from agent.node import daemon
    monkeypatch.setattr(daemon, "EMIT_HOLD_MAX_S", 0.05)
    writer = threading.Thread(target=agent._emit_writer, daemon=True)
    writer.start()
    try:
        with agent._emit_cv:
            agent._ending += 1                          # a close under way (and staying so)
        # the bound: a sandbox that stays ending does not hold the writer past EMIT_HOLD_MAX_S
        agent._lifecycle("", "step_started")
        agent._flush_emits_soon()
        assert agent.spool.entered[0].wait(WAIT)
        assert agent.spool.calls[0] == ["step_started"]
        agent.spool.release[0].set()
        # the hold: the next round waits for the ending sandbox's own append
        monkeypatch.setattr(daemon, "EMIT_HOLD_MAX_S", WAIT)
        agent._lifecycle("", "step_ended")
        agent._flush_emits_soon()
        # well past the commit window (4 ms): without the hold the writer has appended by now
        assert not agent.spool.entered[1].wait(0.2), "the writer appended while a sandbox was ending"
        closing = Flusher(agent, "exited")              # the ending's own flush
        closing.start()
        assert agent.spool.entered[1].wait(WAIT)
        assert agent.spool.calls[1] == ["step_ended", "exited"]
        agent.spool.release[1].set()
        closing.join(WAIT)
        assert not closing.is_alive() and {"step_ended", "exited"} <= closing.seen
    finally:
        with agent._emit_cv:
            agent._ending = 0
            agent._emit_cv.notify_all()
        agent._stop.set()
        agent._emit_kick.set()
        for e in agent.spool.release:
            e.set()
        writer.join(WAIT)
    assert not writer.is_alive()
    assert len(agent.spool.calls) == 2                  # the writer's held round found nothing left
