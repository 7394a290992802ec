"""Repeats counted in the kernel (bpf/common.h "repeats"), turned into summary records.

    reps = Repeats(bpf, decoder, consts)          # the audit sensor's
    reps.add(cgroup_id, kinds)                    # kinds whose repeats the kernel may count
    recs = reps.flush(states)                     # every flush period: summaries of what grew
    reps.next_gen(cgroup_id, cfg)                 # a step change: the generation is retired
    recs, missing = reps.finish(cgroup_id, state) # the sandbox's end: the last summaries, entries gone

The kernel emits the first occurrence of a file/connect record in full and keeps
it in `agg`; a later record of the same process that is identical byte for byte
but for its timestamp and thread id is counted there (count, last_ns) instead of
being copied into the ring. Userspace never writes a count: it reads them
(they only grow) and reports what grew since its last report as one summary
record per entry -- the first occurrence's record (decoded as the kernel
emitted it) with the shape of the recorder's denial summaries
(agent/sensors/denials.py): `count` = the occurrences since the last record of
that entry, extra.aggregated = true, extra.total (all occurrences of the
entry, the first included), first_ts_ns, last_ts_ns, pids (the one process)
and aggregated_by = "kernel". Lost per occurrence: its timestamp (between
first_ts_ns and last_ts_ns) and its thread id.

Entries are deleted only when no program can still count into them: a
generation is retired (dsec_sandbox.agg_gen bumped: at a step change, or when
the sandbox holds half its share of the table) and read a last time, then
deleted, once RETIRE_SETTLE_S has passed -- the programs that read the old
generation finish within microseconds, the same bound remove_sandbox's settle
relies on; at the sandbox's end every entry of it is read and deleted after
that settle, or, its cgroup empty, after the removal's fence (every task gone:
no program of it can count any more). What the summaries reported is then checked against the kernel's
own count of the occurrences it counted (dsec_state.aggregated): a difference
is reported as events_lost (reason aggregate_unreported), never silent.
"""
from __future__ import annotations

import threading
import time

from agent.sensors.common import lookup_batch
from agent.sensors.denials import summary_extra

KINDS = ("open_write", "unlink", "rename", "connect")    # what the kernel may count (bpf/common.h)
RETIRE_SETTLE_S = 0.05          # a retired generation is read for the last time this long after
ENV = "DSEC_AUDIT_AGGREGATE"    # on (default) | off: the node-wide switch of an in-process recorder


class Repeats:
    def __init__(self, bpf, decoder, consts):
        try:
            self.table = bpf[b"agg"]
        except KeyError:        # a bpf/ tree without it (DSEC_BPF_DIR: bench/kcost.py --compare)
            self.table = None
        self.decoder = decoder
        self.numbers = consts.kind_numbers
        self.per_sandbox = int(consts.values.get("DSEC_AGG_PER_SANDBOX", 1024))
        self._reported: dict[bytes, int] = {}          # entry key bytes -> count already reported
        self._sbx: dict[int, dict] = {}                # cgroup id -> its bookkeeping (see add)
        self._retiring: set[int] = set()               # cgroup ids of _sbx whose "retiring" is not empty
        self._bufs = None                              # (keys, values): the batch read's, made once
        self._bufs_lock = threading.Lock()

    def mask(self, kinds) -> int:
        """dsec_sandbox.agg_kinds of these kind names."""
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            from agent.errors import DsecError
            raise DsecError(f"aggregate: kind(s) {', '.join(bad)} cannot be counted in the kernel "
                            f"(these can: {', '.join(KINDS)})")
        m = 0
        for k in kinds:
            m |= 1 << self.numbers[k]
        return m

    def add(self, cgroup_id: int, kinds) -> None:
        self._sbx[cgroup_id] = {"kinds": tuple(kinds) if self.table is not None else (), "gen": 0, "retiring": {}, "released": 0,
                                "reported": {}, "summaries": 0, "seen": 0}
        self._retiring.discard(cgroup_id)

    def forget(self, cgroup_id: int) -> None:
        self._sbx.pop(cgroup_id, None)
        self._retiring.discard(cgroup_id)

    def on(self, cgroup_id: int) -> bool:
        s = self._sbx.get(cgroup_id)
        return bool(s and s["kinds"])

    def next_gen(self, cgroup_id: int, cfg) -> None:
        """Retire the sandbox's current generation: cfg (its configuration, about to
        be written by the caller; None: the caller sets agg_gen = gen()) counts into
        a new one from now on."""
        s = self._sbx.get(cgroup_id)
        if not s or not s["kinds"]:
            return
        s["retiring"][s["gen"]] = time.monotonic()
        self._retiring.add(cgroup_id)
        s["gen"] = (s["gen"] + 1) & 0xFFFFFFFF
        if cfg is not None:
            cfg.agg_gen = s["gen"]

    def retiring(self) -> list[int]:
        """The sandboxes with a retired generation not yet read a last time and deleted."""
        return list(self._retiring)

    def retire_due(self) -> list[int]:
        """The sandboxes with a retired generation that can be read a last time and deleted
        (its settle passed). Asked at every poll: it looks at the sandboxes with one only
        (self._retiring)."""
        now = time.monotonic()
        return [c for c in self._retiring
                if any(now - t >= RETIRE_SETTLE_S for t in self._sbx[c]["retiring"].values())]

    def gen(self, cgroup_id: int) -> int:
        s = self._sbx.get(cgroup_id)
        return s["gen"] if s else 0

    def kinds(self, cgroup_id: int) -> tuple:
        s = self._sbx.get(cgroup_id)
        return s["kinds"] if s else ()

    def set_kinds(self, cgroup_id: int, kinds) -> None:
        s = self._sbx.get(cgroup_id)
        if s is not None:
            s["kinds"] = tuple(kinds)

    # -- reading ----------------------------------------------------------------

    def _entries(self, scope=None):
        """Every entry of `agg` (one batch read), as (key, value) ctypes; only those of the
        cgroup ids in `scope` when given (the others are not copied out)."""
        try:
            return self._batch(scope)
        except OSError:         # batch ops unsupported: one by one
            return [(k, v) for k, v in self.table.items() if scope is None or k.cgroup_id in scope]

    def _batch(self, scope=None):
        """BPF_MAP_LOOKUP_BATCH into buffers made once (common.lookup_batch), the entries
        copied out. BCC's items_lookup_batch allocates and zeroes max_entries keys and values
        on every call (~5 MiB: ~1 ms of memset, which was each sandbox's end)."""
        t = self.table
        K, V, n = t.Key, t.Leaf, t.max_entries
        with self._bufs_lock:
            if self._bufs is None:
                self._bufs = ((K * n)(), (V * n)())
            keys, vals = self._bufs
            total = lookup_batch(t, keys, vals)
            return [(K.from_buffer_copy(keys[i]), V.from_buffer_copy(vals[i])) for i in range(total)
                    if scope is None or keys[i].cgroup_id in scope]

    def _summary(self, key, val, delta: int) -> dict | None:
        size = min(int(val.rec.h.size), len(bytes(val.rec)))
        rec = self.decoder.decode(bytes(val.rec)[:size])
        if rec is None or rec.get("kind") == "events_lost":
            return None
        wall = self.decoder.wall_ns
        last = wall(int(val.last_ns))
        rec["extra"] = summary_extra(rec.get("extra"), int(val.count) + 1, wall(int(val.rec.h.ts_ns)), last,
                                     [int(key.tgid)], aggregated_by="kernel")
        rec["count"] = delta
        rec["ts_ns"] = last
        return rec

    def _report(self, key, val, out: list, final: bool) -> None:
        """A summary of what entry (key, val) counted since its last report."""
        kb = bytes(key)
        s = self._sbx.get(int(key.cgroup_id))
        n = int(val.count)
        before = self._reported.pop(kb, 0) if final else self._reported.get(kb, 0)
        if n > before:
            rec = self._summary(key, val, n - before)
            if rec is not None:
                out.append(rec)
                if s is not None:
                    s["summaries"] += 1
                    kind = rec["kind"]
                    s["reported"][kind] = s["reported"].get(kind, 0) + n - before
        if not final and n > before:
            self._reported[kb] = n

    def _delete(self, key) -> None:
        try:
            del self.table[key]
        except KeyError:
            pass

    def flush(self, states: dict, cfgs, scoped: bool = False) -> list[dict]:
        """Summaries of the entries whose counts grew; retired generations read a
        last time and deleted. states: cgroup id -> its state (AuditSensor._read_state); cfgs:
        a callable(cgroup_id, fn) that applies fn to the sandbox's configuration and
        writes it back. scoped: only the entries of the sandboxes in `states` (one
        sandbox's end; the others' at the next periodic flush)."""
        if self.table is None:
            return []
        now = time.monotonic()
        due = False
        for cgid, st in states.items():
            s = self._sbx.get(cgid)
            if s is None or st is None or not (s["kinds"] or s["retiring"]):
                continue
            seen = sum(st["aggregated"].values())
            held = st["agg_held"] - s["released"]
            if seen != s["seen"] or s["retiring"]:
                due = True
            if held >= self.per_sandbox // 2 and not s["retiring"]:     # (one retired generation at a time)
                cfgs(cgid, lambda cfg, cgid=cgid: self.next_gen(cgid, cfg))
                due = True
            s["seen"] = seen
        if not due:
            return []
        out: list[dict] = []
        released: dict[int, int] = {}
        scope = set(states) if scoped else None
        for key, val in self._entries(scope):
            cgid = int(key.cgroup_id)
            s = self._sbx.get(cgid)
            if s is None:
                continue
            t = s["retiring"].get(int(key.gen))
            final = t is not None and now - t >= RETIRE_SETTLE_S
            self._report(key, val, out, final)
            if final:
                self._delete(key)
                released[cgid] = released.get(cgid, 0) + 1
        for cgid in list(self._retiring):
            if scope is not None and cgid not in scope:
                continue                # its entries were not read
            s = self._sbx[cgid]
            for g in [g for g, t in s["retiring"].items() if now - t >= RETIRE_SETTLE_S]:
                del s["retiring"][g]
            if not s["retiring"]:
                self._retiring.discard(cgid)
        for cgid, n in released.items():
            s = self._sbx[cgid]
            s["released"] += n
            total = s["released"]
            cfgs(cgid, lambda cfg, total=total: setattr(cfg, "agg_released", total))
        return out

    def finish(self, cgroup_id: int, state: dict | None) -> tuple[list[dict], dict]:
        """The sandbox is removed (no program counts for it any more): its last
        summaries, its entries deleted, and {kind: n} of the occurrences the kernel
        counted that no summary reported (empty unless something went wrong)."""
        s = self._sbx.get(cgroup_id)
        out: list[dict] = []
        if s is None or self.table is None:
            return out, {}
        held = None if state is None else int(state.get("agg_held", 0)) - s["released"]
        for key, val in (self._entries({cgroup_id}) if held is None or held > 0 else ()):   # none held: no read
            self._report(key, val, out, final=True)
            self._delete(key)
        counted = state["aggregated"] if state is not None else {}
        missing = {k: n - s["reported"].get(k, 0) for k, n in counted.items() if n > s["reported"].get(k, 0)}
        return out, missing

    def summaries(self, cgroup_id: int) -> int:
        s = self._sbx.get(cgroup_id)
        return s["summaries"] if s else 0
