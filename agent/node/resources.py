"""Changing a live sandbox's resources (its cgroup limits) and recording it.

    err = limit_memory_of_fresh(agent, rec, memory, reason)    # run_code's memory_limit_MB

A sandbox the agent just handed to a request (nothing of the caller's ran yet)
can always be given a lower memory limit than its profile's: the scheduler keeps
accounting the profile's size (more than it uses: never over-commits), the new
limit is written to the cgroup (v1 or v2) and a `resources_updated` lifecycle
event records before/after and why.
"""
from __future__ import annotations

import logging

log = logging.getLogger("dsec.agent")


def limit_memory_of_fresh(agent, rec, memory: int, reason: str) -> str | None:
    """Lower `rec`'s memory limit to `memory` bytes; None, or why it could not be done."""
    sb = rec.sandbox
    if sb is None or sb.cg is None:
        return f"sandbox {rec.id}: no cgroup to limit"
    before = sb.cg.limits().get("memory")
    try:
        sb.cg.update_limits(memory=memory)
    except OSError as e:
        return f"sandbox {rec.id}: cannot set its memory limit to {memory} bytes: {e.strerror}"
    with agent._lock:
        agent._lifecycle(rec.id, "resources_updated", step=rec.steps, memory=memory, previous={"memory": before},
                         accounted={"memory": rec.memory}, reason=reason)
    agent._flush_emits()
    return None
