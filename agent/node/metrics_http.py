"""The agent's Prometheus endpoint: GET /metrics in the text format, off unless
`metrics:` is configured (docs/agent.md "Metrics").

    svc = MetricsService(agent, cfg.metrics).start()    # the same listener and access control as http:

What it serves: every instrument of exporters/metrics.py (events received /
spooled / exported / lost by kind, sink and reason; export latency and spool
backlog per sink; sandbox launch latency; steps by outcome; queue wait times),
the scheduler's books (capacity, use, queue depth by class, running by class,
its counters, waiting phase switches), the circuit breaker's trips, and per
running sandbox its CPU seconds, throttled seconds and memory, for at most
`max_sandbox_series` sandboxes (the largest by memory; how many were left out
is `dsec_sandbox_series_dropped`).

Access control is http:'s (agent/node/httpapi.py): a client certificate or a
token in `allowed_clients`, or `unauthenticated: true` on loopback only.
"""
from __future__ import annotations

import logging

from agent.node.httpapi import HTTPService
from agent.node.records import RUNNING
from exporters.metrics import METRICS
from exporters.prometheus import CONTENT_TYPE, Family, metric_families, render

log = logging.getLogger("dsec.agent.metrics")


class MetricsService(HTTPService):
    section = "metrics"
    what = "Prometheus /metrics"

    def make_routes(self) -> dict:
        return {("GET", "/metrics"): self._metrics}

    def _metrics(self, h, identity):
        h.reply_raw(200, render(self.families()).encode("utf-8", "replace"), CONTENT_TYPE)

    def families(self) -> list[Family]:
        fams = metric_families(METRICS.snapshot())
        a = self.agent
        if a.sched is not None:
            fams += _scheduler_families(a.sched.snapshot())
        br = getattr(a, "breaker", None)
        trips = Family("dsec_breaker_trips_total", "counter", "circuit breaker trips, by trigger and action")
        for (trigger, action), n in sorted(dict(getattr(br, "trips", {}) or {}).items()):
            trips.samples.append(({"trigger": trigger, "action": action}, n))
        fams.append(trips)
        fams += self._sandbox_families()
        return fams

    def _sandbox_families(self) -> list[Family]:
        a = self.agent
        with a._lock:
            live = [(r.id, r.cg) for r in a._records.values() if r.state == RUNNING and r.cg is not None]
        rows = []
        for sid, cg in live:
            try:
                rows.append((sid, cg.memory_current(), cg.cpu_stat()))
            except OSError:                          # it ended under us
                continue
        rows.sort(key=lambda x: -x[1])
        cap = self.cfg.max_sandbox_series
        kept, dropped = rows[:cap], max(0, len(rows) - cap)
        mem = Family("dsec_sandbox_memory_bytes", "gauge", "memory charged to a running sandbox's cgroup")
        cpu = Family("dsec_sandbox_cpu_seconds_total", "counter", "CPU time of a running sandbox")
        thr = Family("dsec_sandbox_cpu_throttled_seconds_total", "counter",
                     "time a running sandbox's CPU quota held it back")
        for sid, m, st in kept:
            lab = {"sandbox_id": sid}
            mem.samples.append((lab, m))
            cpu.samples.append((lab, st["usage_usec"] / 1e6))
            thr.samples.append((lab, st["throttled_usec"] / 1e6))
        drop = Family("dsec_sandbox_series_dropped", "gauge", "running sandboxes left out of the per-sandbox "
                                                               "series (metrics.max_sandbox_series)",
                      [({}, dropped)])
        return [mem, cpu, thr, drop]


def _scheduler_families(s: dict) -> list[Family]:
    def g(name, help_, samples):
        return Family(name, "gauge", help_, samples)
    out = [
        g("dsec_scheduler_cpus", "the scheduler's CPUs (total, reserve, allocatable, limit, used, free, warm)",
          [({"kind": k}, v) for k, v in s["cpu"].items() if isinstance(v, (int, float)) and k != "oversubscription"]),
        g("dsec_scheduler_memory_bytes", "the scheduler's memory (total, reserve, allocatable, used, free, warm)",
          [({"kind": k}, v) for k, v in s["memory"].items() if isinstance(v, (int, float))]),
        g("dsec_scheduler_running", "sandboxes holding resources, by priority class",
          [({"class": c}, n) for c, n in s["running"].items()]),
        g("dsec_scheduler_preempting", "sandboxes being preempted", [({}, s["preempting"])]),
        g("dsec_scheduler_queue_depth", "requests waiting, by priority class",
          [({"class": c}, n) for c, n in s["queue"]["by_class"].items()]),
        g("dsec_scheduler_queue_oldest_wait_seconds", "how long the oldest queued request has waited",
          [({}, s["queue"]["oldest_wait"] or 0.0)]),
        g("dsec_scheduler_warm_ready", "warm sandboxes ready, by profile",
          [({"profile": p}, v["ready"]) for p, v in s["warm"]["by_profile"].items()]),
        g("dsec_scheduler_phase_switches_waiting", "resource-window phase switches waiting for room",
          [({}, s.get("windows", {}).get("phase_switches_waiting", 0))]),
        Family("dsec_scheduler_decisions_total", "counter", "the scheduler's decisions, by kind",
               [({"kind": k}, v) for k, v in sorted(s["counters"].items())]),
        Family("dsec_scheduler_transitions_dropped_total", "counter", "transitions the scheduler's buffer dropped",
               [({}, s["transitions"]["dropped"])]),
    ]
    return out


__all__ = ["MetricsService"]
