"""Exec enrichment off the decode path: the Enricher's one worker thread.

    w = Enricher(cache)           # cache: elfinfo.ElfInfoCache
    w.warm()                      # start it (pyelftools imported before the first exec)
    w.submit(job)                 # job: EnrichJob(rec, extra, Pending, cgroup id); False: full
    w.take_done()                 # the jobs read, skipped or abandoned since, each once

The decoder (agent/sensors/decoder.py) opens an exec'd file and takes a
cached answer at once (agent/sensors/elfinfo.py); a miss becomes an EnrichJob
read here: sandboxes round-robin, a bounded queue per sandbox and per node,
an exec of a file already queued or being read follows that read, a sandbox
being removed served first (docs/audit.md "Exec enrichment").
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque

from agent.sensors.elfinfo import ElfInfoCache, Pending

QUEUE_FULL = "enrichment queue full for this sandbox (it exec'd uncached files faster than they could be read)"
NODE_FULL = "enrichment queue full on this node"


class EnrichJob:
    """An exec record waiting for its file's details: the record, its extra
    dict (the record's `extra` JSON is rebuilt from it) and the Pending fds.
    `abandoned`: given up by Enricher.finish() while being read (the record went
    out marked sha256_skipped; the worker only closes the fds then)."""

    def __init__(self, rec: dict, extra: dict, pending: Pending, cgroup_id: int):
        self.rec, self.extra, self.pending, self.cgroup_id = rec, extra, pending, cgroup_id
        self.abandoned = False
        self.followers: list = []       # jobs of the same sandbox and file, waiting for this one's read
        self.ident = None               # (cgroup id, Pending.identity()) while it leads

    def apply(self, found: dict) -> None:
        found = dict(found)
        self.extra.update(found.pop("extra", {}))
        self.rec.update(found)
        self.rec["extra"] = json.dumps(self.extra, sort_keys=True)

    def read(self) -> dict:
        """The file's details (on the worker; closes the fds)."""
        try:
            return self.pending.finish()
        except Exception as e:  # noqa: BLE001 - enrichment is best effort; the record is not
            self.pending.discard()
            return {"extra": {"enrich_error": f"{type(e).__name__}: {e}"[:200]}}

    def skip(self, why: str) -> None:
        """Not read (closes the fds): the record says why."""
        self.pending.discard()
        self.apply({"extra": {"sha256_skipped": why}})


class Enricher:
    """One worker thread that reads exec'd files for the decoder: sandboxes
    served round-robin (a sandbox being removed first), at most `per_sandbox`
    files queued per sandbox and `max_jobs` in all (each holds up to two fds).
    Records come back through take_done(); decoding never waits for them.
    Every submitted job comes back exactly once (read, skipped or abandoned).

    A job for the same file of the same sandbox as one queued or being read
    (the same fds, identities and problems: Pending.identity) follows it: its
    fds are closed at once, it takes no queue slot, and it gets the leader's
    answer (read, skipped or abandoned alike). A sandbox that runs one uncached
    binary in a tight loop (the first steps of a sandbox, before the first read
    is done) gets every record enriched instead of "queue full" past the
    eighth; at most `max_followers` follow one read (then: queue full)."""

    max_followers = 4096

    def __init__(self, cache: ElfInfoCache, per_sandbox: int = 8, max_jobs: int = 256):
        self.cache, self.per_sandbox, self.max_jobs = cache, per_sandbox, max_jobs
        self._queues: OrderedDict = OrderedDict()      # cgroup id -> deque of jobs (round-robin order)
        self._busy: dict = {}                          # cgroup id -> jobs queued or running
        self._total = 0                                # sum of _busy
        self._urgent: set = set()                      # cgroup ids being removed: served first
        self._running: EnrichJob | None = None
        self._done: deque = deque()
        self._cond = threading.Condition()
        self._thread = None
        self._closed = False
        self._leaders: dict = {}                       # (cgroup id, identity) -> job queued or running
        self.skipped = 0                               # jobs not read (queue full, removal, close)
        self.n_read = 0                                # jobs read
        self.n_followed = 0                            # jobs answered by another job's read

    def warm(self) -> None:
        """Start the worker now and let it import pyelftools (~50 ms) before
        the first exec needs it (the first steps of the first sandbox)."""
        with self._cond:
            self._start()

    def _start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="dsec-enrich", daemon=True)
            self._thread.start()

    def submit(self, job: EnrichJob) -> bool:
        """Queue `job`; False (nothing queued, job untouched) when its sandbox's
        queue or the node's is full or the Enricher is closed."""
        with self._cond:
            cg = job.cgroup_id
            if self._closed:
                return False
            ident = (cg, job.pending.identity())
            leader = self._leaders.get(ident)
            if leader is not None and len(leader.followers) < self.max_followers:
                job.pending.discard()             # the leader's fds are the same files
                leader.followers.append(job)
                return True
            if self._busy.get(cg, 0) >= self.per_sandbox or self._total >= self.max_jobs:
                return False
            if leader is None:
                job.ident = ident
                self._leaders[ident] = job
            self._queues.setdefault(cg, deque()).append(job)
            self._busy[cg] = self._busy.get(cg, 0) + 1
            self._total += 1
            self._start()
            self._cond.notify_all()
            return True

    def _settle(self, job: EnrichJob, found: dict | None = None, skip: str | None = None) -> None:
        """job's record is done (read: found; else skipped: why): it and its
        followers go to take_done(). Under _cond."""
        if job.ident is not None:
            self._leaders.pop(job.ident, None)
            job.ident = None
        for j in (job, *job.followers):
            if skip is not None:
                if j is job:
                    j.skip(skip)
                else:
                    j.apply({"extra": {"sha256_skipped": skip}})
            else:
                j.apply(found)
            self._done.append(j)
        self.n_followed += len(job.followers)
        job.followers = []

    def full_reason(self, cgroup_id: int) -> str:
        with self._cond:
            if self._closed:
                return "the sensor was closing"
            return QUEUE_FULL if self._busy.get(cgroup_id, 0) >= self.per_sandbox else NODE_FULL

    def _next(self) -> EnrichJob:
        cg = next((c for c in self._urgent if c in self._queues), None)
        if cg is None:
            cg = next(iter(self._queues))
        q = self._queues.pop(cg)
        job = q.popleft()
        if q:
            self._queues[cg] = q                  # to the back: the next sandbox goes first
        return job

    def _release(self, cg: int) -> None:
        self._busy[cg] -= 1
        self._total -= 1
        if not self._busy[cg]:
            del self._busy[cg]

    def _run(self) -> None:
        try:
            from elftools.elf.elffile import ELFFile  # noqa: F401 - imported once, before the first read
        except ImportError:
            pass                                      # elf_details reports it per file
        while True:
            with self._cond:
                while not self._queues and not self._closed:
                    self._cond.wait()
                if not self._queues:
                    return
                job = self._running = self._next()
            found = job.read()
            with self._cond:
                self._running = None
                if not job.abandoned:
                    self._settle(job, found)
                    self._release(job.cgroup_id)
                    self.n_read += 1
                self._cond.notify_all()

    def take_done(self) -> list:
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def outstanding(self, cgroup_id: int | None = None) -> int:
        with self._cond:
            return self._total if cgroup_id is None else self._busy.get(cgroup_id, 0)

    def wait_all(self, timeout: float) -> bool:
        """Wait up to `timeout` until nothing is queued or running; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._total and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(min(0.1, left))
            return not self._total

    def wait_for(self, cgroup_id: int, timeout: float) -> bool:
        """Wait up to `timeout` for the sandbox's jobs (served first meanwhile);
        True when none is left. Nothing is skipped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._busy.get(cgroup_id, 0):
                return True                  # (every close asks: most sandboxes have nothing left)
            # no wake-up: with a job of this sandbox queued or being read, the worker is not
            # waiting; it takes the urgent sandbox's jobs first at its next pick
            self._urgent.add(cgroup_id)
            try:
                while self._busy.get(cgroup_id, 0) and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(min(0.1, left))
                return not self._busy.get(cgroup_id, 0)
            finally:
                self._urgent.discard(cgroup_id)

    def finish(self, cgroup_id: int, timeout: float, why: str) -> int:
        """The sandbox is being removed: its jobs go first; wait up to `timeout`
        for them, then skip (`why`) what is still queued and abandon the one
        being read. All of its jobs are in take_done() when this returns.
        Returns how many were skipped."""
        skipped = 0
        self.wait_for(cgroup_id, timeout)
        with self._cond:
            for job in self._queues.pop(cgroup_id, ()):
                skipped += 1 + len(job.followers)
                self._settle(job, skip=why)
                self._release(cgroup_id)
            job = self._running
            if job is not None and job.cgroup_id == cgroup_id and not job.abandoned:
                job.abandoned = True                      # the worker closes its fds
                skipped += 1 + len(job.followers)
                why = why + " (while its file was being read)"
                job.apply({"extra": {"sha256_skipped": why}})
                for j in job.followers:
                    j.apply({"extra": {"sha256_skipped": why}})
                job.followers, followers = [], job.followers
                self._leaders.pop(job.ident, None)
                job.ident = None
                self._done.extend((job, *followers))
                self._release(cgroup_id)
            self.skipped += skipped
            return skipped

    def close(self, timeout: float = 5.0) -> None:
        """Skip what is queued (their records come out of take_done()), let
        the file being read finish, stop the worker."""
        with self._cond:
            self._closed = True
            for cg in list(self._queues):
                for job in self._queues.pop(cg):
                    self.skipped += 1 + len(job.followers)
                    self._settle(job, skip="the sensor was closing")
                    self._release(cg)
            self._cond.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout=timeout)
