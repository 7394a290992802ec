"""The warm pool: sandboxes started ahead of demand, per profile (agent config
`warm_pool`), handed to a matching CreateSandbox at once.

    pool = WarmPool(agent); pool.resolve()     # profiles from the config (policies loaded)
    pool.refill()                              # the tick thread: back to each profile's count
    pool.refill_soon()                         # the same at once (after a one-shot run's reply)
    rec = pool.try_claim_locked(key, fields)   # under the agent's lock: a ready sandbox, or None

A warm sandbox holds a scheduler slot of its profile's size; only capacity no
queued request waits for is used to refill, and a queued request that needs
the room drains warm sandboxes (the scheduler's drain_warm action). A claimed
sandbox takes the request's labels, priority and lifetime, and its
sandbox_start record is written then, with those labels (sensors/watch.py).
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

from agent.errors import DsecError, ReportedError
from agent.node.records import EXITED, QUEUED, RUNNING, WARM, ApiError, SandboxRecord, _bad

log = logging.getLogger("dsec.agent")


def profile_key(*, cpus_quota, memory, pids, policy, network, rootfs, user, workdir, env, image=None) -> tuple:
    """What a request must equal to take a warm sandbox. With an image: its manifest
    digest, and user/workdir as asked (None: the image's)."""
    return (cpus_quota, memory, pids, policy.identity()["policy_hash"] if policy else None,
            policy.mode if policy else None, network, rootfs or None, user, workdir,
            tuple(sorted(env.items())), image)


class _Profile:
    """A warm-pool profile resolved against the agent's defaults."""

    def __init__(self, cfg_profile, policy, key, cpus_acc):
        self.cfg = cfg_profile
        self.name = cfg_profile.name
        self.count = cfg_profile.count
        self.policy = policy
        self.key = key
        self.cpus = cpus_acc
        self.backoff_until = 0.0
        self.failures = 0
        self.image = None                  # agent/sandbox/images Image, for image profiles


class _WarmEntry:
    def __init__(self, slot, profile: _Profile, rec: SandboxRecord):
        self.slot = slot
        self.profile = profile
        self.rec = rec
        self.ready = False
        self.failed = False
        self.abandoned = False      # destroyed while its start was still under way: _start closes it


class WarmPool:
    def __init__(self, agent):
        self.agent = agent
        self.profiles: dict[str, _Profile] = {}
        self.entries: dict[str, _WarmEntry] = {}                  # slot -> warm sandbox
        self.slot_sid: OrderedDict[str, str] = OrderedDict()     # warm slot -> sandbox id (for audit)

    def resolve(self):
        from policies.model import PolicyError
        for p in self.agent.cfg.warm_pool:
            try:
                policy = self.agent.policies.load(p.policy, None, p.mode)
            except (ApiError, PolicyError) as e:
                raise DsecError(f"warm_pool profile {p.name!r}: policy {p.policy!r}: "
                                f"{getattr(e, 'message', e)}", 2)
            if p.rootfs and not os.path.isdir(p.rootfs):
                raise DsecError(f"warm_pool profile {p.name!r}: rootfs {p.rootfs}: no such directory", 2)
            img = None
            if p.image:
                try:
                    img = self.agent.images.resolve(p.image)
                except ReportedError as e:
                    raise DsecError(f"warm_pool profile {p.name!r}: {e.message}", 2)
                key = profile_key(cpus_quota=p.cpus, memory=p.memory, pids=p.pids, policy=policy,
                                  network=p.network, rootfs=None, user=p.user, workdir=p.workdir,
                                  env=dict(p.env), image=img.digest)
            else:
                key = profile_key(cpus_quota=p.cpus, memory=p.memory, pids=p.pids, policy=policy,
                                  network=p.network, rootfs=p.rootfs, user=p.user or "sandbox",
                                  workdir=p.workdir or "/workspace", env=dict(p.env))
            prof = self.profiles[p.name] = _Profile(p, policy, key, p.cpus or self.agent.cfg.defaults.cpus)
            prof.image = img

    def refill(self):
        """Keep each profile at its count (tick thread). Only capacity nobody waits for is used."""
        from agent.sandbox.launcher import SandboxSpec, new_sandbox_id
        a = self.agent
        if a._shutting:
            return
        now = time.monotonic()
        for prof in self.profiles.values():
            if prof.count == 0 or now < prof.backoff_until:
                continue
            while True:
                with a._lock:
                    have = sum(1 for w in self.entries.values() if w.profile is prof)
                    if have >= prof.count or a._shutting:
                        break
                    c = prof.cfg
                    slot = a.sched.reserve_warm(prof.name, prof.cpus, c.memory, c.pids)
                    if slot is None:
                        a._after_sched_locked(None)
                        break
                    sid = new_sandbox_id()
                    d = a.cfg.defaults
                    spec = SandboxSpec(argv=[], sandbox_id=sid, cpus=c.cpus, memory=c.memory, pids=c.pids,
                                       grace=d.grace_seconds, rootfs=c.rootfs, network=c.network,
                                       env=dict(c.env), workdir=c.workdir or "/workspace",
                                       user=c.user or "sandbox", policy=prof.policy)
                    if prof.image is not None:     # layers unpacked and config applied in _start (executor)
                        spec.image = prof.image.record()
                        spec.image_ref = prof.image
                        spec.image_args = {"user": c.user, "workdir": c.workdir, "env": dict(c.env)}
                    rec = SandboxRecord(sid, spec, labels={}, priority=d.priority, cpus=prof.cpus,
                                        memory=c.memory, pids=c.pids, audit=True,
                                        over_budget=a.cfg.audit.over_budget, lifetime=d.lifetime_seconds,
                                        grace=d.grace_seconds, warm_profile=prof.name, lock=a._lock)
                    rec.state = WARM
                    rec.warm_slot = slot
                    w = _WarmEntry(slot, prof, rec)
                    self.entries[slot] = w
                    self.slot_sid[slot] = sid
                    while len(self.slot_sid) > 10000:
                        self.slot_sid.popitem(last=False)
                    a._after_sched_locked(None)
                a._submit_work(self._start, w)

    def refill_soon(self):
        """refill() now on an executor thread, not at the next tick (scheduling.tick_seconds, 0.5 s
        by default): after a one-shot run that took a warm sandbox has been answered (`dsec run`,
        agent/node/runsock.py), so that runs one after another each find a ready one and the
        refill does not compete with the claiming run itself (measured: a refill at the claim made
        the claiming SDK request 1.2x slower on 2 cores)."""
        self.agent._submit_work(self.refill)

    def _start(self, w: _WarmEntry):
        try:
            sb = self.agent._start_sandbox(w.rec, defer_start=True)
        except Exception as e:  # noqa: BLE001
            msg = e.message if isinstance(e, ReportedError) else repr(e)
            prof = w.profile
            prof.failures += 1
            prof.backoff_until = time.monotonic() + min(60.0, 2.0 ** min(prof.failures, 6))
            log.error("warm pool %s: sandbox start failed: %s (retry in %.0fs)", prof.name, msg,
                      prof.backoff_until - time.monotonic())
            with self.agent._lock:
                w.failed = True
                w.rec.start_done.set()
                current = self.entries.get(w.slot) is w
                if current:
                    del self.entries[w.slot]
                self.agent._lifecycle(w.rec.id, "failed", reason=f"warm sandbox start failed: {msg}",
                                      profile=prof.name)
                self.agent._changed_locked(w.rec)
            self.agent._cleaned(w.rec.id, w.rec.failed_start, profile=prof.name)
            if not w.abandoned:         # else destroy() released the slot
                self.release_slot(w.slot, f"warm sandbox start failed: {msg}")
            return
        w.profile.failures = 0
        with self.agent._lock:
            abandoned = w.abandoned
            if not abandoned:
                w.rec.sandbox = sb
                w.ready = True
            w.rec.start_done.set()
            self.agent._changed_locked(w.rec)
        if abandoned:
            # destroy() gave up waiting for this start (and recorded the sandbox's end): what
            # started after all is closed here, never left running outside the books
            try:
                sb.close()
            except Exception:  # noqa: BLE001
                log.exception("warm sandbox %s: close of a start that outlived its destroy failed", w.rec.id)

    def release_slot(self, slot: str, reason: str):
        with self.agent._lock:
            try:
                acts = self.agent.sched.release_warm(slot, reason)
            except ReportedError as e:
                log.error("release_warm(%s): %s", slot, e)
                acts = None
            self.agent._after_sched_locked(acts)

    def destroy(self, w: _WarmEntry, reason: str):
        w.rec.start_done.wait(120)
        with self.agent._lock:
            sb = w.rec.sandbox
            if not w.rec.start_done.is_set():
                w.abandoned = True      # still starting after 120 s: its start closes it (_start)
        if sb is not None:
            try:
                sb.close()
            except Exception:  # noqa: BLE001
                log.exception("warm sandbox %s: close failed", w.rec.id)
        with self.agent._lock:
            w.rec.state = EXITED
            w.rec.reason = reason
            w.rec.ended_ns = time.time_ns()
            self.agent._changed_locked(w.rec)
        self.agent._cleaned(w.rec.id, sb, reason=reason, profile=w.profile.name)
        if not w.failed:
            self.release_slot(w.slot, reason)

    def _blocker_queued_locked(self) -> bool:
        for rid in self.agent.sched.queue():
            info = self.agent.sched.info(rid) or {}
            if info.get("waiting") == "capacity":
                return True
        return False

    def try_claim_locked(self, key, req_fields) -> SandboxRecord | None:
        """Hand a ready warm sandbox of a matching profile to the request, or None."""
        from agent.node.scheduler import Request
        prof = next((p for p in self.profiles.values() if p.key == key), None)
        if prof is None or self._blocker_queued_locked():
            return None
        ready = [w for w in self.entries.values() if w.profile is prof and w.ready and not w.failed]
        if not ready:
            return None
        w = min(ready, key=lambda w: w.rec.created_ns)
        rec = w.rec
        req = Request(id=rec.id, cpus=prof.cpus, memory=prof.cfg.memory, pids=prof.cfg.pids,
                      priority=req_fields["priority"], labels=req_fields["labels"])
        d = self.agent.sched.claim_warm(prof.name, req)
        if d.rejected:
            self.agent._after_sched_locked(d.actions)
            raise _bad(d.reason or "rejected")
        # the claimed record takes the caller's fields; its sandbox_start is written now, with them
        rec.labels = dict(req_fields["labels"])
        rec.priority = req_fields["priority"]
        if rec.watch is not None:
            rec.watch.claim(rec.labels, priority=rec.priority, warm_claimed_ns=time.time_ns())
        rec.lifetime = req_fields["lifetime"]
        rec.grace = req_fields["grace"]
        rec.spec.grace = req_fields["grace"]
        rec.warm = True
        rec.created_ns = time.time_ns()
        self.agent._records[rec.id] = rec
        self.agent._lifecycle(rec.id, "requested", **self.agent._request_extra(rec), warm_profile=prof.name)
        if d.warm_slot is not None:
            del self.entries[w.slot]
            if d.warm_slot != w.slot:
                # the scheduler took another slot of the same profile (equal resources): the
                # sandbox that slot stood for now stands for ours
                other = self.entries.pop(d.warm_slot, None)
                if other is not None:
                    other.slot = w.slot
                    other.rec.warm_slot = w.slot
                    self.entries[w.slot] = other
                    self.slot_sid[w.slot] = other.rec.id
                self.slot_sid[d.warm_slot] = rec.id
            rec.warm_slot = d.warm_slot
            rec.state = RUNNING
            rec.admitted_ns = rec.started_ns = time.time_ns()
            rec.deadline = time.monotonic() + rec.lifetime
            sb = rec.sandbox
            rec.oom_seen = sb.cg.oom_kills() if sb is not None and sb.cg else 0
            self.agent._lifecycle(rec.id, "started", launch_ms=0.0, warm=True, profile=prof.name,
                                  cgroup_id=rec.cgroup_id, queued_s=0.0)
            self.agent._after_sched_locked(d.actions)
            return rec
        # not expected (checked above): the request went through submit() under the warm
        # sandbox's id; the sandbox now belongs to that request, its slot is given back
        log.warning("warm claim for %s fell back to %s; handing the warm sandbox over", rec.id, d.outcome)
        del self.entries[w.slot]
        try:
            self.agent.sched.release_warm(w.slot, f"handed over to request {rec.id!r}")
        except ReportedError:
            pass
        rec.state = QUEUED
        if d.admitted:
            rec.state = QUEUED       # _after_sched_locked launches it (the sandbox exists: marked running)
        self.agent._after_sched_locked(d.actions)
        return rec
