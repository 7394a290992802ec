"""The node scheduler (agent/node/scheduler.py): admission, CPU oversubscription,
queue order with aging, head-of-line policy, preemption, warm-pool accounting,
transitions, bad requests, and a seeded randomized simulation checking the
invariants. Pure unit tests: the scheduler does no I/O, time is a fake clock.
The rules under test are documented in docs/scheduler.md.

Why this file is long: one module per component under test; the randomized
simulation and the worked example share its helpers."""
from __future__ import annotations

import heapq
import random
import threading

import pytest

from agent.node.scheduler import (ADMITTED, CANCELLED, PREEMPTED, PREEMPTING, QUEUED, REJECTED,
                             RELEASED, TERMINAL, WAIT_CAPACITY, WAIT_HEAD_OF_LINE, WAIT_PENDING,
                             WARM_CLAIMED, WARM_DRAINING, WARM_READY, WARM_RELEASED, Actions,
                             Request, Scheduler, SchedulerError, Window)

GiB = 1 << 30
MiB = 1 << 20
RANK = {"reserved": 0, "standard": 1, "preemptible": 2}


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t

    def at(self, t):
        self.t = t
        return self


def node(clock=None, **kw):
    """A small node: 6 CPUs and 10 GiB, 2 CPUs and 2 GiB reserved -> 4 CPUs and
    8 GiB allocatable; CPU oversubscribed 2x -> 8 CPUs committable."""
    args = dict(total_cpus=6, total_memory=10 * GiB, reserve_cpus=2, reserve_memory=2 * GiB,
                cpu_oversubscription=2.0, max_pids=1000, aging_seconds=10.0,
                clock=clock or Clock(0.0))
    args.update(kw)
    return Scheduler(**args)


def R(rid, mem=1, cpus=0.5, prio="standard", pids=10, **kw):
    return Request(rid, cpus, int(mem * GiB), pids=pids, priority=prio, **kw)


def states(s, *ids):
    return [s.state(i) for i in ids]


# ---- configuration and capacity ------------------------------------------------------------

@pytest.mark.parametrize("kw, fragment", [
    (dict(total_cpus=0), "total_cpus=0"),
    (dict(total_cpus=-4), "total_cpus=-4"),
    (dict(total_memory=0), "total_memory=0"),
    (dict(reserve_cpus=-1), "reserve_cpus=-1"),
    (dict(reserve_cpus=6), "leaves no CPU"),
    (dict(reserve_memory=10 * GiB), "leaves no memory"),
    (dict(cpu_oversubscription=0.5), "cpu_oversubscription=0.5"),
    (dict(cpu_oversubscription=float("inf")), "cpu_oversubscription=inf"),
    (dict(max_pids=0), "max_pids=0"),
    (dict(aging_seconds=0), "aging_seconds=0"),
    (dict(total_memory=1.5), "total_memory=1.5"),
])
def test_bad_configuration_is_one_clear_error(kw, fragment):
    with pytest.raises(SchedulerError) as ei:
        node(**kw)
    assert fragment in str(ei.value)
    assert str(ei.value).startswith("scheduler configuration:")


def test_capacity_is_total_minus_reserve_and_cpu_limit_is_ratio_times_allocatable():
    snap = node().snapshot()
    assert snap["cpu"]["allocatable"] == 4.0 and snap["cpu"]["limit"] == 8.0
    assert snap["memory"]["allocatable"] == 8 * GiB
    assert snap["cpu"]["used"] == 0 and snap["memory"]["used"] == 0
    assert snap["queue"] == {"length": 0, "by_class": {"reserved": 0, "standard": 0,
                                                       "preemptible": 0},
                             "oldest_wait": None, "head": None, "head_waiting": None}


def test_what_fits_is_admitted_at_once_what_does_not_is_queued():
    clock = Clock(0.0)
    s = node(clock)
    a = s.submit(R("a", mem=4))
    b = s.submit(R("b", mem=4))
    assert a.admitted and b.admitted and a.actions.admitted == ("a",)
    c = s.submit(R("c", mem=1, prio="reserved"))
    assert c.queued and not c.victims and "short of 1GiB memory" in c.reason
    assert s.info("c")["waiting"] == WAIT_CAPACITY
    clock.at(7.5)
    snap = s.snapshot()
    assert snap["memory"]["used"] == 8 * GiB and snap["cpu"]["used"] == 1.0
    assert snap["running"] == {"reserved": 0, "standard": 2, "preemptible": 0}
    assert snap["queue"]["length"] == 1 and snap["queue"]["by_class"]["reserved"] == 1
    assert snap["queue"]["oldest_wait"] == 7.5 and snap["queue"]["head"] == "c"
    assert s.release("a").admitted == ("c",)
    assert states(s, "a", "b", "c") == [RELEASED, ADMITTED, ADMITTED]
    assert s.info("c")["admitted_at"] == 7.5


def test_memory_is_never_oversubscribed_even_with_cpu_to_spare():
    s = node(cpu_oversubscription=4.0)
    assert s.submit(R("a", mem=3, cpus=0.25)).admitted
    assert s.submit(R("b", mem=3, cpus=0.25)).admitted
    d = s.submit(R("c", mem=3, cpus=0.25))
    assert d.queued
    snap = s.snapshot()
    assert snap["memory"]["used"] == 6 * GiB <= snap["memory"]["allocatable"]
    assert snap["cpu"]["free"] == 15.5       # plenty of CPU, still queued


@pytest.mark.parametrize("ratio, admitted", [(1.0, 8), (2.0, 16), (1.5, 12)])
def test_cpu_oversubscription_is_bounded_by_the_ratio(ratio, admitted):
    s = node(cpu_oversubscription=ratio, total_memory=100 * GiB)
    results = [s.submit(R(f"r{i}", mem=0.25, cpus=0.5)) for i in range(admitted + 3)]
    assert [d.outcome for d in results] == [ADMITTED] * admitted + [QUEUED] * 3
    snap = s.snapshot()
    assert snap["cpu"]["used"] == snap["cpu"]["limit"] == 4.0 * ratio


def test_cpu_is_accounted_exactly_in_millicores():
    s = Scheduler(1, 16 * GiB, clock=Clock(0.0))
    ds = [s.submit(Request(f"r{i}", 0.1, 1 * MiB)) for i in range(11)]
    assert [d.outcome for d in ds] == [ADMITTED] * 10 + [QUEUED]   # 10 x 0.1 == 1.0 exactly
    assert s.snapshot()["cpu"]["used"] == 1.0


def test_one_request_may_not_ask_for_more_than_the_allocatable_cpus():
    s = node()        # 4 allocatable, 8 committable
    d = s.submit(R("big", cpus=6))
    assert d.rejected and "cpus=6 is more than this node can ever give one sandbox" in d.reason
    assert "4 allocatable CPUs = 6 total - 2 reserved" in d.reason
    assert s.submit(R("ok", cpus=4)).admitted


# ---- bad requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("req, fragment", [
    (Request("x", -1, GiB), "cpus=-1 must be a positive number"),
    (Request("x", 0, GiB), "cpus=0 must be a positive number"),
    (Request("x", float("nan"), GiB), "cpus=nan"),
    (Request("x", True, GiB), "cpus=True"),
    (Request("x", "1", GiB), "cpus='1'"),
    (Request("x", 0.0001, GiB), "granularity of 0.001 CPU"),
    (Request("x", 1, 0), "memory=0 must be a positive number of bytes"),
    (Request("x", 1, -GiB), "memory=-1073741824"),
    (Request("x", 1, 1.5 * GiB), "memory=1610612736.0"),
    (Request("x", 1, 9 * GiB), "memory=9GiB is more than this node can ever give"),
    (Request("x", 1, GiB, pids=0), "pids=0 must be a positive integer"),
    (Request("x", 1, GiB, pids=5000), "pids=5000 is more than this node's max_pids=1000"),
    (Request("x", 1, GiB, priority="gold"), "priority class 'gold' is unknown"),
    (Request("x", 1, GiB, priority=["reserved"]), "priority class ['reserved'] is unknown"),
    (Request("", 1, GiB), "id='' must be a non-empty string"),
    (Request(None, 1, GiB), "id=None must be a non-empty string"),
    (Request("x" * 500, 1, GiB), "id is 500 characters long, at most 128"),
    (Request("a\nb", 1, GiB), "non-printable"),
    (Request("x", 1, GiB, submitted=5.0), "submitted=5.0 is in the future"),
    (Request("x", 1, GiB, labels={f"k{i}": "v" for i in range(100)}), "100 labels, at most 64"),
    (Request("x", 1, GiB, labels={"job": 7}), "label 'job' must have a string value"),
    (Request("x", 1, GiB, labels={"job": "v" * 5000}), "label 'job' must have a string value"),
    (Request("x", 1, GiB, labels="job=1"), "labels must be a mapping"),
    ({"id": "x", "cpus": 1}, "expected a Request, got dict"),
])
def test_bad_requests_are_rejected_with_a_reason_naming_the_field(req, fragment):
    s = node()
    d = s.submit(req)
    assert d.rejected and fragment in d.reason, d.reason
    assert not d.actions
    snap = s.snapshot()
    assert snap["memory"]["used"] == 0 and snap["queue"]["length"] == 0
    assert snap["counters"]["rejected"] == 1
    (t,) = s.drain_transitions()
    assert t.state == REJECTED and t.reason == d.reason
    if isinstance(getattr(req, "id", None), str) and req.id.isprintable() and 0 < len(req.id) <= 128:
        assert s.state(req.id) == REJECTED


def test_all_problems_of_a_request_are_named_at_once():
    d = node().submit(Request("x", -1, 0, priority="gold"))
    assert "cpus=-1" in d.reason and "memory=0" in d.reason and "'gold'" in d.reason


def test_a_live_id_cannot_be_submitted_twice_but_an_ended_one_can():
    s = node()
    assert s.submit(R("a")).admitted
    d = s.submit(R("a", mem=2))
    assert d.rejected and "id 'a' is already admitted" in d.reason
    assert s.state("a") == ADMITTED and s.snapshot()["memory"]["used"] == GiB
    s.release("a")
    assert s.submit(R("a")).admitted and s.state("a") == ADMITTED


# ---- queue order and aging ------------------------------------------------------------------

def fill(s, mem=8, rid="hold", prio="standard"):
    assert s.submit(R(rid, mem=mem, prio=prio)).admitted


def test_queue_order_is_class_first_then_submit_time():
    clock = Clock(0.0)
    s = node(clock, aging_seconds=1000.0)
    fill(s)
    for t, rid, prio in [(1, "p1", "preemptible"), (2, "s1", "standard"), (3, "r1", "reserved"),
                         (4, "s2", "standard"), (5, "r2", "reserved"), (6, "p2", "preemptible")]:
        clock.at(t)
        assert s.submit(R(rid, mem=8, prio=prio)).queued
    assert s.queue() == ["r1", "r2", "s1", "s2", "p1", "p2"]
    order, running = [], "hold"
    for _ in range(6):
        (nxt,) = s.release(running).admitted
        order.append(nxt)
        running = nxt
    assert order == ["r1", "r2", "s1", "s2", "p1", "p2"]


def test_explicit_submit_time_orders_ties_within_a_class():
    clock = Clock(50.0)
    s = node(clock)
    fill(s)
    s.submit(R("late", mem=8, submitted=40.0))
    s.submit(R("early", mem=8, submitted=30.0))
    assert s.queue() == ["early", "late"]


def run_stream(aging):
    """A standard request queued at t=0 on a full node; then one reserved request
    arrives every second and the running sandbox ends every second. Returns the
    admission order."""
    clock = Clock(0.0)
    s = node(clock, aging_seconds=aging)
    fill(s)
    s.submit(R("old", mem=8))
    order, running = [], "hold"
    for t in range(1, 25):
        clock.at(float(t))
        s.submit(R(f"r{t}", mem=8, prio="reserved"))
        (nxt,) = s.release(running).admitted
        order.append(nxt)
        running = nxt
    return order


def test_aging_a_long_queued_standard_request_beats_a_stream_of_newer_reserved_ones():
    order = run_stream(aging=10.0)
    # one class step per 10 s: "old" (standard, t=0) ranks with a reserved request
    # submitted at t=10, and the tie goes to the earlier submit time
    assert order.index("old") == 9
    assert order[:9] == [f"r{t}" for t in range(1, 10)]
    assert order[10] == "r10"


def test_without_aging_the_same_stream_starves_the_standard_request():
    assert "old" not in run_stream(aging=None)


def test_an_aged_preemptible_request_beats_a_fresh_standard_one():
    clock = Clock(0.0)
    s = node(clock)
    fill(s)
    s.submit(R("p", mem=8, prio="preemptible"))          # ranks like a reserved one at t=20
    clock.at(9.0)
    s.submit(R("s_early", mem=8))                        # ... like a reserved one at t=19
    clock.at(11.0)
    s.submit(R("s_late", mem=8))                         # ... at t=21
    assert s.queue() == ["s_early", "p", "s_late"]
    info = s.info("p")
    assert info["effective_priority"] == pytest.approx(2 - 11 / 10)
    assert info["waited"] == 11.0 and info["position"] == 1


def test_waiting_never_reorders_the_queue_and_tick_alone_admits_nothing():
    clock = Clock(0.0)
    s = node(clock)
    fill(s)
    for t, rid, prio in [(0, "p", "preemptible"), (5, "s", "standard"), (14, "r", "reserved")]:
        clock.at(float(t))
        s.submit(R(rid, mem=8, prio=prio))
    before = s.queue()
    for t in (15.0, 30.0, 100.0, 1000.0):
        assert not s.tick(t)
        assert s.queue() == before == ["r", "s", "p"]     # virtual starts 14, 15, 20
    assert s.info("p")["effective_priority"] == pytest.approx(2 - 1000 / 10)


def test_the_clock_never_goes_backwards():
    clock = Clock(100.0)
    s = node(clock)
    s.submit(R("a"))
    clock.at(50.0)
    s.submit(R("b"))
    assert [t.at for t in s.drain_transitions()] == [100.0, 100.0]
    with pytest.raises(SchedulerError, match="not a finite number"):
        s.tick(float("nan"))


# ---- head of line ---------------------------------------------------------------------------

def test_strict_head_of_line_a_blocked_head_stops_smaller_requests_behind_it():
    clock = Clock(0.0)
    s = node(clock)
    fill(s, mem=6, rid="a")
    clock.at(1.0)
    assert s.submit(R("big", mem=4)).queued                  # 2 GiB free: does not fit
    clock.at(2.0)
    small = s.submit(R("small", mem=1))                      # would fit, but waits behind "big"
    assert small.queued and "behind 'big'" in small.reason
    assert s.info("small")["waiting"] == WAIT_HEAD_OF_LINE
    assert s.info("small")["blocked_by"] == "big"
    assert s.info("big")["waiting"] == WAIT_CAPACITY
    assert s.release("a").admitted == ("big", "small")


def test_backfill_only_into_what_a_pending_head_leaves():
    clock = Clock(0.0)
    s = node(clock)
    fill(s, mem=4, rid="std")
    clock.at(1.0)
    assert s.submit(R("p", mem=2, prio="preemptible")).admitted   # 2 GiB free left
    clock.at(2.0)
    big = s.submit(R("big", mem=3))           # needs 3: 2 free + preempt p (2) -> 1 to spare
    assert big.queued and big.victims == ("p",)
    assert s.info("big")["waiting"] == WAIT_PENDING
    clock.at(3.0)
    c = s.submit(R("c", mem=1))               # fits in what big leaves: admitted now
    assert c.admitted
    d = s.submit(R("d", mem=1))               # would take what big is waiting for: not admitted
    assert d.queued and s.info("d")["waiting"] == WAIT_CAPACITY and not d.victims
    assert s.release("p").admitted == ("big",)
    assert states(s, "p", "big", "c", "d") == [PREEMPTED, ADMITTED, ADMITTED, QUEUED]
    assert s.snapshot()["memory"]["used"] == 8 * GiB


def test_cancelling_the_blocked_head_lets_the_line_move():
    s = node()
    fill(s, mem=6, rid="a")
    s.submit(R("big", mem=4))
    s.submit(R("small", mem=1))
    assert s.cancel("big").admitted == ("small",)
    assert s.state("big") == CANCELLED


# ---- preemption -----------------------------------------------------------------------------

def preemption_node():
    """8 GiB: p1, p2, p3 preemptible (started at t=1, 2, 3), s standard (t=4): full."""
    clock = Clock(0.0)
    s = node(clock)
    for t, rid, prio in [(1, "p1", "preemptible"), (2, "p2", "preemptible"),
                         (3, "p3", "preemptible"), (4, "s", "standard")]:
        clock.at(float(t))
        assert s.submit(R(rid, mem=2, prio=prio)).admitted
    clock.at(5.0)
    return s, clock


def test_preemption_takes_the_youngest_preemptible_sandboxes_only_as_many_as_needed():
    s, clock = preemption_node()
    s.drain_transitions()
    d = s.submit(R("r", mem=3, prio="reserved"))
    assert d.queued and d.victims == ("p3", "p2")
    assert states(s, "p1", "p2", "p3", "s") == [ADMITTED, PREEMPTING, PREEMPTING, ADMITTED]
    assert s.info("p3")["preempted_for"] == "r"
    # resources are freed only when the agent confirms the victims are gone
    snap = s.snapshot()
    assert snap["memory"]["used"] == 8 * GiB and snap["preempting"] == 2
    clock.at(6.0)
    assert not s.release("p3")                 # one victim gone: r still waits for the other
    assert s.state("p3") == PREEMPTED and s.state("r") == QUEUED
    clock.at(7.0)
    assert s.release("p2").admitted == ("r",)
    assert states(s, "p2", "r") == [PREEMPTED, ADMITTED]
    assert s.release("p2") == Actions()        # a late confirmation is harmless
    ts = [(t.id, t.previous, t.state, t.cause) for t in s.drain_transitions()]
    assert ts == [("r", None, QUEUED, None),
                  ("p3", ADMITTED, PREEMPTING, "r"), ("p2", ADMITTED, PREEMPTING, "r"),
                  ("p3", PREEMPTING, PREEMPTED, "r"),
                  ("p2", PREEMPTING, PREEMPTED, "r"), ("r", QUEUED, ADMITTED, None)]


def test_the_victim_set_is_irreducible():
    clock = Clock(0.0)
    s = node(clock)
    clock.at(1.0)
    s.submit(R("p_old", mem=4, prio="preemptible"))
    clock.at(2.0)
    s.submit(R("p_young", mem=1, prio="preemptible"))
    s.submit(R("s", mem=3))
    clock.at(3.0)
    # youngest first takes p_young (1) then p_old (4); p_old alone is enough: p_young is spared
    assert s.submit(R("r", mem=4)).victims == ("p_old",)
    assert s.state("p_young") == ADMITTED


def test_no_preemption_unless_it_makes_the_request_fit():
    s, clock = preemption_node()
    d = s.submit(R("huge", mem=7, prio="reserved"))    # 6 GiB preemptible in all: not enough
    assert d.queued and not d.victims
    assert states(s, "p1", "p2", "p3") == [ADMITTED] * 3


def test_reserved_and_standard_sandboxes_are_never_preempted():
    clock = Clock(0.0)
    s = node(clock)
    s.submit(R("res", mem=4, prio="reserved"))
    s.submit(R("std", mem=4))
    d = s.submit(R("r2", mem=1, prio="reserved"))
    assert d.queued and not d.victims
    assert states(s, "res", "std") == [ADMITTED, ADMITTED]


def test_a_preemptible_request_never_preempts():
    s, clock = preemption_node()
    d = s.submit(R("q", mem=1, prio="preemptible"))
    assert d.queued and not d.victims


def test_a_standard_request_preempts_too():
    s, clock = preemption_node()
    assert s.submit(R("s2", mem=2)).victims == ("p3",)


def test_preemption_follows_aged_priority():
    """A preemptible sandbox admitted ahead of a standard request thanks to aging
    is not preempted by it at once: a request may preempt only a sandbox whose
    effective priority at admission is worse than its own current one."""
    clock = Clock(0.0)
    s = node(clock)
    fill(s)
    s.submit(R("p", mem=4, prio="preemptible"))          # ranks like reserved at t=20
    clock.at(15.0)
    s.submit(R("std", mem=6))                            # ranks like reserved at t=25
    clock.at(16.0)
    assert s.release("hold").admitted == ("p",)          # p first; std does not fit beside it
    # p's standing: (20 - 16)/10 = 0.4; std's effective priority (25 - t)/10
    assert s.info("std")["waiting"] == WAIT_CAPACITY and s.state("p") == ADMITTED
    assert not s.tick(20.5)                              # std at 0.45: not better than 0.4
    assert s.tick(21.5).preempt == ("p",)                # std at 0.35: better
    assert s.release("p").admitted == ("std",)


def test_a_fresh_reserved_request_preempts_an_ordinary_preemptible_sandbox_at_once():
    clock = Clock(0.0)
    s = node(clock)
    s.submit(R("p", mem=8, prio="preemptible"))
    clock.at(100_000.0)                                  # running for a long time
    assert s.submit(R("r", mem=1, prio="reserved")).victims == ("p",)


def test_cancelling_a_request_whose_victims_are_stopping_passes_their_resources_on():
    s, clock = preemption_node()
    assert s.submit(R("r", mem=2, prio="reserved")).victims == ("p3",)
    s.submit(R("next", mem=2, prio="preemptible"))
    s.cancel("r")
    assert s.state("p3") == PREEMPTING                  # already signalled: cannot be undone
    assert s.release("p3").admitted == ("next",)


# ---- warm pool ------------------------------------------------------------------------------

def test_warm_slots_hold_resources_and_are_claimed_by_matching_requests():
    s = node()
    w = s.reserve_warm("small", 0.5, 1 * GiB, 10)
    assert w and s.state(w) == WARM_READY
    snap = s.snapshot()
    assert snap["memory"]["used"] == GiB and snap["warm"]["ready"] == 1
    assert snap["warm"]["by_profile"] == {"small": {"ready": 1, "draining": 0}}
    d = s.claim_warm("small", R("a", mem=1))
    assert d.admitted and d.warm_slot == w and d.actions.admitted == ("a",)
    assert s.state(w) == WARM_CLAIMED and s.snapshot()["memory"]["used"] == GiB
    assert s.info("a")["warm_slot"] == w
    # no slot of the shape left: a claim goes through submit and launches cold
    d = s.claim_warm("small", R("b", mem=2))
    assert d.admitted and d.warm_slot is None
    assert s.snapshot()["memory"]["used"] == 3 * GiB


def test_warm_slots_take_only_capacity_nobody_waits_for():
    s = node()
    fill(s, mem=7, rid="a")
    assert s.reserve_warm("small", 0.5, 2 * GiB, 10) is None          # does not fit
    s.submit(R("b", mem=4))
    assert s.reserve_warm("tiny", 0.5, 512 * MiB, 10) is None         # someone is queued
    with pytest.raises(SchedulerError, match=r"memory=-1 must be a positive"):
        s.reserve_warm("tiny", 0.5, -1, 10)
    with pytest.raises(SchedulerError, match=r"profile=''"):
        s.reserve_warm("", 0.5, MiB, 10)


def test_warm_sandboxes_are_given_back_before_anything_is_preempted():
    clock = Clock(0.0)
    s = node(clock)
    s.submit(R("p", mem=2, prio="preemptible"))
    s.submit(R("s", mem=2))
    clock.at(1.0)
    w1 = s.reserve_warm("small", 0.5, 2 * GiB, 10)
    clock.at(2.0)
    w2 = s.reserve_warm("small", 0.5, 2 * GiB, 10)
    d = s.submit(R("r", mem=2, prio="reserved"))
    assert d.queued and d.actions.drain_warm == (w2,) and not d.victims
    assert s.state(w2) == WARM_DRAINING and s.state(w1) == WARM_READY
    assert s.snapshot()["warm"]["draining"] == 1
    assert s.release_warm(w2).admitted == ("r",)
    assert s.state(w2) == WARM_RELEASED
    # a bigger request takes the other warm slot and then a preemptible sandbox
    d = s.submit(R("r2", mem=4, prio="reserved"))
    assert d.actions.drain_warm == (w1,) and d.victims == ("p",)
    assert s.release_warm(w1) == Actions()
    assert s.release("p").admitted == ("r2",)
    with pytest.raises(SchedulerError, match="no such warm slot"):
        s.release_warm("warm-nope-9")
    assert s.release_warm(w1) == Actions()          # twice: no-op


def test_a_preemptible_request_may_drain_warm_sandboxes_but_not_preempt():
    s = node()
    s.submit(R("p", mem=4, prio="preemptible"))
    w = s.reserve_warm("big", 1, 4 * GiB, 10)
    d = s.submit(R("q", mem=2, prio="preemptible"))
    assert d.actions.drain_warm == (w,) and not d.victims


def test_a_claim_does_not_jump_a_request_waiting_for_capacity():
    s = node(Clock(0.0))
    fill(s, mem=6, rid="a")
    w = s.reserve_warm("small", 0.5, 1 * GiB, 10)
    s.submit(R("big", mem=4))                  # standard, virtual start 10; 1 free + 1 warm < 4
    assert s.info("big")["waiting"] == WAIT_CAPACITY
    d = s.claim_warm("small", R("late", mem=1), now=30.0)      # virtual start 40: behind big
    assert d.queued and d.warm_slot is None and s.state(w) == WARM_READY
    assert s.info("late")["waiting"] == WAIT_HEAD_OF_LINE


def test_a_claim_by_a_request_ranking_ahead_of_the_blocked_one_takes_the_slot():
    clock = Clock(0.0)
    s = node(clock)
    fill(s, mem=6, rid="a")
    w = s.reserve_warm("small", 0.5, 1 * GiB, 10)
    s.submit(R("big", mem=4, prio="preemptible"))     # virtual start 20, waits for capacity
    clock.at(1.0)
    d = s.claim_warm("small", R("early", mem=1))     # standard, virtual start 11: ahead of big
    assert d.admitted and d.warm_slot == w and s.queue() == ["big"]
    assert s.snapshot()["memory"]["used"] == 7 * GiB


# ---- adoption, errors, transitions ----------------------------------------------------------

def test_adopting_sandboxes_left_by_a_previous_agent():
    s = node()
    d = s.adopt(R("old1", mem=6))
    assert d.admitted
    (t,) = s.drain_transitions()
    assert t.state == ADMITTED and t.previous is None and "adopted" in t.reason
    d = s.adopt(R("old2", mem=4))
    assert d.rejected and "does not fit the free capacity" in d.reason


def test_release_and_cancel_misuse_are_clear_errors():
    s = node()
    fill(s)
    s.submit(R("q", mem=1))
    with pytest.raises(SchedulerError, match=r"release\('nope'\): no such request"):
        s.release("nope")
    with pytest.raises(SchedulerError, match="queued, not running; use cancel"):
        s.release("q")
    with pytest.raises(SchedulerError, match="admitted, not queued; stop the sandbox"):
        s.cancel("hold")
    with pytest.raises(SchedulerError, match="no such request"):
        s.cancel("nope")
    s.cancel("q")
    assert s.cancel("q") == Actions()
    s.release("hold")
    assert s.release("hold") == Actions()


def test_every_transition_is_recorded_with_its_time_and_drained_once():
    clock = Clock(10.0)
    s = node(clock)
    s.submit(R("a", mem=8, labels={"job": "j1", "trajectory": "t7"}))
    clock.at(11.0)
    s.submit(R("b", mem=1))
    clock.at(12.0)
    s.submit(R("c", mem=1, prio="preemptible"))
    clock.at(13.0)
    s.cancel("c")
    s.submit(R("bad", mem=100))
    clock.at(15.0)
    s.release("a", reason="exited 0")
    ts = s.drain_transitions()
    assert [(t.id, t.state, t.at) for t in ts] == [
        ("a", ADMITTED, 10.0), ("b", QUEUED, 11.0), ("c", QUEUED, 12.0), ("c", CANCELLED, 13.0),
        ("bad", REJECTED, 13.0), ("a", RELEASED, 15.0), ("b", ADMITTED, 15.0)]
    assert [t.seq for t in ts] == list(range(1, 8))
    assert ts[0].labels == {"job": "j1", "trajectory": "t7"} and ts[0].waited == 0.0
    assert ts[5].reason == "exited 0" and ts[6].waited == 4.0
    assert s.drain_transitions() == []


def test_a_full_transition_buffer_is_reported_not_silent():
    s = node(max_transitions=3)
    for i in range(5):
        s.submit(R(f"r{i}", mem=0.5))
    ts = s.drain_transitions()
    assert ts[0].state == "lost" and "2 transitions dropped" in ts[0].reason
    assert [t.id for t in ts[1:]] == ["r2", "r3", "r4"]
    assert s.snapshot()["transitions"]["dropped"] == 2
    s.submit(R("r5", mem=0.5))
    assert [t.state for t in s.drain_transitions()] == [ADMITTED]


def test_history_of_ended_requests_is_bounded():
    s = node(history=3)
    for i in range(6):
        s.submit(R(f"r{i}"))
        s.release(f"r{i}")
    assert [s.state(f"r{i}") for i in range(6)] == [None, None, None, RELEASED, RELEASED, RELEASED]


# ---- concurrency ----------------------------------------------------------------------------

def test_concurrent_callers_keep_the_books_balanced():
    s = Scheduler(8, 16 * GiB, cpu_oversubscription=1.5, max_pids=2000)
    errors = []

    def worker(w):
        rng = random.Random(w)
        mine = []
        try:
            for i in range(300):
                rid = f"w{w}-{i}"
                d = s.submit(Request(rid, rng.choice([0.5, 1, 2]), rng.choice([1, 2, 3]) * GiB,
                                     pids=50, priority=rng.choice(["reserved", "standard"])))
                mine.append(rid)
                if rng.random() < 0.5 and mine:
                    r = mine.pop(0)
                    st = s.state(r)
                    if st == QUEUED:
                        try:
                            s.cancel(r)
                        except SchedulerError:       # admitted meanwhile by another thread
                            s.release(r)
                    else:
                        s.release(r)
                s.verify()
            for r in mine:
                if s.state(r) == QUEUED:
                    try:
                        s.cancel(r)
                    except SchedulerError:
                        s.release(r)
                else:
                    s.release(r)
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s.verify()
    snap = s.snapshot()
    assert snap["memory"]["used"] == 0 and snap["queue"]["length"] == 0
    ts = s.drain_transitions()
    ended = [t for t in ts if t.state in TERMINAL]
    assert len(ended) == len({t.id for t in ended}) == 8 * 300


# ---- randomized simulation ------------------------------------------------------------------

LEGAL = {(None, QUEUED), (None, ADMITTED), (None, REJECTED), (QUEUED, ADMITTED),
         (QUEUED, CANCELLED), (ADMITTED, RELEASED), (ADMITTED, PREEMPTING),
         (PREEMPTING, PREEMPTED)}
DMAX = 8.0          # longest run of a sandbox
GRACE = 1.0         # longest time for a victim / drained warm sandbox to be gone
AGING = 5.0


def simulate(seed, horizon=150.0):
    """Discrete-event simulation of an agent driving the scheduler: random
    arrivals (some bad, some claiming warm sandboxes), runs up to DMAX, victims
    gone within GRACE, clients that give up, a warm pool refilled every 2 s, a
    tick every second. Checks the invariants after every call; returns the
    transitions and per-request records."""
    rng = random.Random(seed)
    clock = Clock(0.0)
    s = Scheduler(total_cpus=5, total_memory=17 * GiB, reserve_cpus=1, reserve_memory=1 * GiB,
                  cpu_oversubscription=1.5, max_pids=3000, aging_seconds=AGING, clock=clock)
    limit_cpu, alloc_mem = s.snapshot()["cpu"]["limit"], s.snapshot()["memory"]["allocatable"]
    ev, n = [], [0]

    def push(t, kind, arg=None):
        n[0] += 1
        heapq.heappush(ev, (t, n[0], kind, arg))

    reqs = {}          # id -> dict(key, submitted, admitted_at, ...)
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(3.0 if int(t / 20) % 2 == 0 else 0.3)     # busy and quiet phases
        if t > horizon:
            break
        i += 1
        push(t, "arrive", i)
    for k in range(int(horizon) + int(DMAX) * 50):
        push(float(k), "tick")
        if k % 2 == 0 and k < horizon:
            push(float(k) + 0.5, "refill")
    transitions = []
    heads = {"id": None, "since": 0.0}

    def act(actions, now):
        for rid in actions.admitted:
            reqs[rid]["admitted_at"] = now
            push(now + reqs[rid]["duration"], "end", rid)
        for rid in actions.preempt:
            push(now + rng.uniform(0, GRACE), "end", rid)
        for w in actions.drain_warm:
            push(now + rng.uniform(0, GRACE), "warm_gone", w)

    def check(actions, now):
        s.verify()
        snap = s.snapshot()
        assert snap["cpu"]["used"] <= limit_cpu + 1e-9
        assert snap["memory"]["used"] <= alloc_mem
        assert snap["pids"]["used"] <= 3000
        # nobody overtakes a request that waits for capacity (head-of-line rule)
        queued = [(reqs[q]["key"], q) for q in s.queue()]
        for c in actions.admitted:
            for key, q in queued:
                if key < reqs[c]["key"]:
                    assert s.info(q)["waiting"] == WAIT_PENDING, (c, q)
        # the head of the queue, as long as it stays the head, is admitted within
        # DMAX + GRACE: everything running when it became head has ended by then,
        # and nothing is admitted past it unless it is already covered
        head = queued[0][1] if queued else None
        if head != heads["id"]:
            heads["id"], heads["since"] = head, now
        elif head is not None:
            assert now - heads["since"] <= DMAX + GRACE + 1e-6, (head, heads, now)
        # starvation bound: record, for each request whose virtual start has passed,
        # how many are ahead of it (none can join them from now on)
        for pos, (key, q) in enumerate(queued):
            if "ahead" not in reqs[q] and key[0] <= now:
                reqs[q]["ahead"] = (now, pos)

    while ev:
        now, _, kind, arg = heapq.heappop(ev)
        clock.at(now)
        actions = Actions()
        if kind == "arrive":
            rid = f"q{arg}"
            roll = rng.random()
            prio = rng.choice(["reserved", "standard", "standard", "preemptible", "preemptible"])
            if roll < 0.03:
                req = Request(rid, 1, 40 * GiB, priority=prio)                 # too big
            elif roll < 0.3:
                req = Request(rid, 0.5, 1 * GiB, pids=64, priority=prio)       # the warm shape
            else:
                req = Request(rid, rng.choice([0.25, 0.5, 1, 2, 4]),
                              rng.choice([1, 2, 3, 4, 6, 8]) * GiB // rng.choice([1, 2]),
                              pids=rng.choice([16, 64, 256]), priority=prio)
            key = ((now + RANK[prio] * AGING), now, arg)
            reqs[rid] = dict(key=key, submitted=now, duration=rng.uniform(0.05, DMAX))
            d = (s.claim_warm("small", req) if roll < 0.3 and rng.random() < 0.7
                 else s.submit(req))
            actions = d.actions
            if d.queued and rng.random() < 0.1:
                push(now + rng.uniform(0, 20), "give_up", rid)
        elif kind == "end":
            actions = s.release(arg)          # also a victim that ended before its SIGTERM
        elif kind == "give_up":
            if s.state(arg) == QUEUED:
                actions = s.cancel(arg)
        elif kind == "warm_gone":
            actions = s.release_warm(arg)
        elif kind == "refill":
            while s.snapshot()["warm"]["ready"] < 3:
                if s.reserve_warm("small", 0.5, 1 * GiB, 64) is None:
                    break
        elif kind == "tick":
            if now > horizon and not s.queue() and not s.running():
                continue
            actions = s.tick()
        act(actions, now)
        check(actions, now)
        transitions += s.drain_transitions()
    # the pool is torn down at the end
    for w in list(s.warm_slots()):
        s.release_warm(w)
    transitions += s.drain_transitions()
    return s, reqs, transitions


@pytest.mark.parametrize("seed", range(12))
def test_randomized_invariants(seed):
    s, reqs, transitions = simulate(seed)
    snap = s.snapshot()
    assert snap["memory"]["used"] == 0 and snap["cpu"]["used"] == 0 and snap["pids"]["used"] == 0
    assert snap["queue"]["length"] == 0 and not s.running() and not s.warm_slots()
    # every request ends in exactly one terminal state, through legal transitions only
    per_id = {}
    for t in transitions:
        if t.kind == "request":
            per_id.setdefault(t.id, []).append(t)
    assert set(per_id) == set(reqs)
    for rid, ts in per_id.items():
        terminal = [t for t in ts if t.state in TERMINAL]
        assert len(terminal) == 1 and ts[-1] is terminal[0], (rid, ts)
        assert s.state(rid) == ts[-1].state
        prev = None
        for t in ts:
            assert (prev, t.state) in LEGAL and t.previous == prev, (rid, prev, t)
            prev = t.state
        assert [t.at for t in ts] == sorted(t.at for t in ts)
    assert [t.seq for t in transitions] == list(range(1, len(transitions) + 1))
    # no starvation beyond the bound: once its virtual start has passed, a request
    # has a fixed number Q of requests ahead; each head waits at most DMAX + GRACE
    checked = 0
    for rid, r in reqs.items():
        if "ahead" in r and s.state(rid) != CANCELLED:
            t0, q = r["ahead"]
            assert r["admitted_at"] <= t0 + (q + 1) * (DMAX + GRACE) + 1e-6, (rid, r)
            checked += 1
    assert checked > 0
    assert {QUEUED, ADMITTED, RELEASED} <= {t.state for t in transitions}


def test_the_randomized_runs_exercise_every_path():
    seen = set()
    for seed in range(12):
        seen |= {t.state for t in simulate(seed)[2]}
    assert {QUEUED, ADMITTED, PREEMPTING, PREEMPTED, RELEASED, REJECTED, CANCELLED, WARM_READY,
            WARM_CLAIMED, WARM_DRAINING, WARM_RELEASED} <= seen, seen


def test_the_scheduler_is_deterministic():
    def trace(seed):
        _, _, ts = simulate(seed, horizon=60.0)
        return [(t.seq, t.at, t.kind, t.id, t.state, t.previous, t.cause, t.reason) for t in ts]
    assert trace(3) == trace(3)
    assert trace(3) != trace(4)


# ---- the worked example of docs/scheduler.md ------------------------------------------------

def test_the_worked_example_in_docs():
    clock = Clock(0.0)
    s = node(clock)

    def held():
        snap = s.snapshot()
        return snap["cpu"]["used"], snap["memory"]["used"] / GiB

    def at(t):
        clock.at(float(t))

    at(0)
    assert s.submit(R("A", cpus=2, mem=4)).admitted and held() == (2, 4)
    at(1)
    assert s.submit(R("P1", cpus=2, mem=2, prio="preemptible")).admitted and held() == (4, 6)
    at(2)
    assert s.submit(R("P2", cpus=2, mem=1, prio="preemptible")).admitted and held() == (6, 7)
    at(3)
    d = s.submit(R("S", cpus=1, mem=1.5))
    assert d.queued and d.victims == ("P2",) and s.info("S")["waiting"] == WAIT_PENDING
    assert held() == (6, 7)
    at(4)
    assert s.submit(R("B", cpus=0.5, mem=0.5, prio="preemptible")).admitted
    assert held() == (6.5, 7.5)
    at(5)
    d = s.submit(R("C", cpus=1, mem=1, prio="preemptible"))
    assert d.queued and not d.victims and "short of 1GiB memory" in d.reason
    at(6)
    assert s.release("P2").admitted == ("S",) and s.state("P2") == PREEMPTED
    assert held() == (5.5, 8)
    at(7)
    d = s.submit(R("D", cpus=3, mem=2))
    assert d.queued and d.victims == ("P1",) and s.queue() == ["D", "C"]
    assert s.info("C")["waiting"] == WAIT_CAPACITY and held() == (5.5, 8)
    at(8)
    assert s.release("A").admitted == ("D", "C") and held() == (7.5, 7)
    assert s.state("P1") == PREEMPTING
    at(9)
    assert s.release("P1") == Actions() and s.state("P1") == PREEMPTED and held() == (5.5, 5)
    assert sorted(s.running()) == ["B", "C", "D", "S"]


# ---- resource windows, phase switches, resize (issue 20) -----------------------------------

def W(rid, base=(0.5, 1), peak=(3, 2), start=None, prio="standard"):
    """A windowed request starting in its base phase (or `start`): (cpus, GiB) pairs."""
    c, m = start or base
    return Request(rid, c, int(m * GiB), pids=10, priority=prio,
                   window=Window(base[0], int(base[1] * GiB), peak[0], int(peak[1] * GiB)))


def test_windows_are_admitted_on_bases_plus_the_largest_peaks():
    s = node(cpu_oversubscription=1.0)                    # 4 CPUs, 8 GiB
    for i in range(3):                                    # bases 1.5 + one burst 2.5 = 4 CPUs
        assert s.submit(W(f"w{i}")).outcome == ADMITTED
    d = s.submit(W("w3"))                                 # bases 2 + 2.5 > 4: waits
    assert d.outcome == QUEUED and s.info("w3")["waiting"] == WAIT_CAPACITY
    assert "largest peak" in d.reason and "4 CPUs" in d.reason, d.reason
    s.verify()
    fixed = node(cpu_oversubscription=1.0)                # the same tasks with their peak locked
    assert [fixed.submit(R(f"f{i}", mem=2, cpus=3)).outcome for i in range(2)] == [ADMITTED, QUEUED]
    two = node(cpu_oversubscription=1.0, concurrent_peaks=2)
    assert [two.submit(W(f"w{i}")).outcome for i in range(2)] == [ADMITTED, QUEUED]


def test_a_phase_switch_up_that_does_not_fit_waits_reserves_and_is_granted_in_order():
    s = node(cpu_oversubscription=1.0)
    for i in range(3):
        s.submit(W(f"w{i}"))
    assert s.set_phase("w0", 3, 2 * GiB).outcome == "applied"          # 4 of 4 CPUs held now
    d = s.set_phase("w1", 3, 2 * GiB, wait=False)
    assert d.outcome == REJECTED and "needs 2.5 CPUs" in d.reason, d.reason
    d = s.set_phase("w1", 3, 2 * GiB, wait=True)
    assert d.outcome == QUEUED and s.phase_waiting("w1")
    assert s.submit(R("small", mem=0.5, cpus=0.25)).outcome == QUEUED  # cannot take the reserved room
    s.verify()
    acts = s.set_phase("w0", 0.5, 1 * GiB).actions                     # w0's peak passes
    assert acts.phases == ("w1",) and not s.phase_waiting("w1")
    assert s.snapshot()["cpu"]["used"] == 4.0
    assert s.set_phase("w2", 3.5, 1 * GiB).outcome == REJECTED          # outside the window
    s.verify()
    s.release("w1")
    assert "small" in s.running()
    s.verify()


def test_resize_of_a_fixed_sandbox_is_re_admitted():
    s = node(cpu_oversubscription=1.0)
    s.submit(R("a", mem=2, cpus=1))
    s.submit(R("b", mem=2, cpus=2))
    assert s.resize("a", 2, 2 * GiB, 10).outcome == "applied"
    d = s.resize("a", 3, 2 * GiB, 10)
    assert d.outcome == REJECTED and "short of 1 CPUs" in d.reason, d.reason
    assert s.submit(R("q", mem=1, cpus=1)).outcome == QUEUED
    acts = s.resize("b", 1, 2 * GiB, 10).actions                       # shrinking admits the queue
    assert acts.admitted == ("q",)
    with pytest.raises(SchedulerError):
        s.resize("nope", 1, GiB, 10)
    s.verify()


@pytest.mark.parametrize("seed", range(6))
def test_randomized_windows_keep_room_for_the_peaks(seed):
    """Windowed and fixed sandboxes arrive, switch phases (waiting or not), resize and
    end at random: the books balance after every call, what is held never exceeds the
    limit, the bases plus the largest burst always fit (so one peak is always possible),
    and once everything ends nothing is left queued, held or waiting."""
    rng = random.Random(seed)
    s = node(cpu_oversubscription=1.0)                    # 4 CPUs, 8 GiB
    limit = (4.0, 8 * GiB)
    live, n = {}, 0

    def check():
        s.verify()
        snap = s.snapshot()
        assert snap["cpu"]["used"] <= limit[0] + 1e-9 and snap["memory"]["used"] <= limit[1]
        w = snap["windows"]
        assert w["bound_cpus"] <= limit[0] + 1e-9 and w["bound_memory"] <= limit[1], w

    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            n += 1
            rid = f"r{n}"
            if rng.random() < 0.6:
                base = (rng.choice([0.25, 0.5]), rng.choice([0.5, 1]))
                peak = (base[0] + rng.choice([0.5, 1, 2]), base[1] + rng.choice([0, 0.5, 1]))
                live[rid] = ("w", base, peak)
                s.submit(W(rid, base=base, peak=peak))
            else:
                live[rid] = ("f", None, None)
                s.submit(R(rid, mem=rng.choice([0.5, 1, 2]), cpus=rng.choice([0.5, 1])))
        else:
            rid = rng.choice(sorted(live))
            kind, base, peak = live[rid]
            running = s.state(rid) == ADMITTED
            if op < 0.55 and kind == "w" and running:
                c, m = (peak if rng.random() < 0.5 else base)
                s.set_phase(rid, c, int(m * GiB), wait=rng.random() < 0.5)
            elif op < 0.65 and kind == "f" and running:
                s.resize(rid, rng.choice([0.25, 0.5, 1, 2]), int(rng.choice([0.5, 1, 2]) * GiB), 10)
            elif op < 0.95:
                if running:
                    s.release(rid)
                else:
                    s.cancel(rid)
                del live[rid]
        check()
    for rid in sorted(live):
        if s.state(rid) == ADMITTED:
            s.release(rid)
        else:
            s.cancel(rid)
        check()
    snap = s.snapshot()
    assert snap["cpu"]["used"] == 0 and snap["queue"]["length"] == 0 and not s.running()
    assert snap["windows"]["phase_switches_waiting"] == 0
    assert snap["counters"]["phase_switches"] > 0, snap["counters"]
