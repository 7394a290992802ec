"""Durability under faults, for real: real eBPF (the Recorder on a cgroup of
our own), real ClickHouse servers on loopback, a real OTLP/gRPC receiver,
real SIGKILLs. Loads are modest, and the producer kills run beside the 60 s
ClickHouse outage (fixture producer_kills), so that the whole file stays
around 1.5 minutes; the outage is the floor.

  * ClickHouse SIGKILLed for 60 s under a steady kernel event load: every
    event arrives after it returns, none twice (by event_id); the JSON-lines
    sink beside it keeps up the whole time.
  * the producer process (Recorder + ClickHouse exporter) SIGKILLed at random
    points 20 times: each restart replays the spool; at the end ClickHouse
    holds exactly what was spooled (count and ids), each once.
  * disk budget exhausted: the documented policy (evict best-effort sinks'
    backlog, else drop with accounting) happens, the loss is an events_lost
    record and a metric.
  * a corrupt / torn spool segment: the records around it are delivered to
    every sink, the damage is an events_lost record in each, nothing crashes.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from exporters.clickhouse_server import connect
from exporters.metrics import METRICS
from exporters.spool import HEADER_BYTES, Spool, encode_frame
from exporters.clickhouse import ClickHouseExporter
from exporters.configure import start_sinks, stop_sinks
from exporters.jsonl import JsonlSink
from exporters.otel import OtlpSink

from fixtures_clickhouse import free_ports
from otlp_receiver import OtlpReceiver
from test_spool import read_all as read_everything     # every record (and damage) not committed yet; commits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = "/usr/bin/python3"
KERNEL_KINDS = ("exec", "fork", "exit", "connect", "open_write", "unlink", "rename")

# a paced generator of open_write events (one per open), run inside a cgroup; every open names
# a file of its own: a repeat of an identical record would be counted in the kernel
# (agent/sensors/repeats.py), and these tests count records, one per open
GEN = r'''
import os, sys, time
rate, dur, d = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
n, t0 = 0, time.monotonic()
while True:
    now = time.monotonic() - t0
    if now >= dur:
        break
    while n < int(now * rate) + 1:
        os.close(os.open(os.path.join(d, "f%d" % n), flags, 0o644))
        n += 1
    time.sleep(0.005)
print(n, flush=True)
'''


def start_generator(cg, rate, duration, workdir):
    return subprocess.Popen(["/bin/sh", "-c", 'echo $$ > "$0" || exit 125; exec "$@"', cg.procs_file,
                             PYTHON, "-I", "-S", "-c", GEN, str(rate), str(duration), str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ch_ids(client, db, sid):
    rows = client.execute(f"SELECT event_id, count() FROM {db}.events FINAL WHERE sandbox_id = %(s)s "
                          f"GROUP BY event_id", {"s": sid})
    return {e: c for e, c in rows}


def readline(p, timeout) -> str:
    import select
    if select.select([p.stdout], [], [], timeout)[0]:
        return p.stdout.readline().strip()
    return ""


def wait_until(pred, timeout, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# --- ClickHouse down for 60 s under load ----------------------------------------------------

def test_clickhouse_killed_for_60s_under_steady_load_loses_and_doubles_nothing(
        producer_kills, scratch_clickhouse, audit_cgroups, tmp_path):
    from agent.sensors.recorder import Recorder
    server = scratch_clickhouse
    url = server.url_for("outage60")
    spool = Spool(str(tmp_path / "sp"), fsync="never")
    verify = spool.reader("verify")                 # a required cursor that keeps every record for the check
    jsonl = str(tmp_path / "audit.jsonl")
    rec = Recorder(node="faults", spool=spool, enforce=False)
    cg = audit_cgroups()
    sid = "outage-" + uuid.uuid4().hex[:8]
    stop = threading.Event()
    threads = []
    gen = None
    try:
        rec.watch(sid, cg.id, rate=0)
        ch = ClickHouseExporter(spool, url, flush_interval=0.2)
        fl = JsonlSink(spool, path=jsonl, flush_interval=0.2)
        threads = start_sinks(spool, [ch, fl], stop, metrics=False)
        (tmp_path / "w").mkdir()
        gen = start_generator(cg, rate=200, duration=68, workdir=tmp_path / "w")
        assert wait_until(lambda: ch.total_sent > 100, 10)           # flowing into ClickHouse
        os.kill(server.pid(), signal.SIGKILL)                         # ClickHouse dies
        t_kill = time.monotonic()
        jsonl_lag = []
        while time.monotonic() - t_kill < 60:                        # 60 s outage under load
            time.sleep(5)
            spooled = rec.spool.reader("verify").backlog()[0]
            jsonl_lag.append(spooled - (fl.total_sent + fl.total_damaged))
        assert ch.last_error, "the outage was not noticed"
        sent_during = ch.total_sent
        server.start()                                                # ... and comes back
        assert gen.wait(30) == 0, gen.stderr.read()
        totals = rec.unwatch(cg.id)                                   # drain the kernel's last events
        assert wait_until(lambda: ch.reader.backlog()[0] == 0 and fl.reader.backlog()[0] == 0, 60)
    finally:
        stop.set()
        stop_sinks(threads)
        if gen is not None and gen.poll() is None:
            gen.kill()
        rec.close()
    emitted = sum(totals["emitted"].values())
    assert totals["lost_total"] == 0 and emitted > 60 * 200 * 0.9
    # JSON lines kept up during the outage (a few seconds behind at most at each check, where
    # a sink blocked by ClickHouse's outage would be up to 60 s = 12 000 records behind)
    assert max(jsonl_lag) < 1000, jsonl_lag
    spooled, damage = read_everything(verify)
    assert not damage
    ids = {r["event_id"] for r in spooled if r["sandbox_id"] == sid}
    kernel = {r["event_id"] for r in spooled if r["sandbox_id"] == sid and r["kind"] in KERNEL_KINDS}
    assert len(kernel) == emitted                                     # the spool holds what the kernel reported
    client, db = connect(url)
    try:
        got = ch_ids(client, db, sid)
        assert set(got) == ids and all(c == 1 for c in got.values())  # every event, once (FINAL, by event_id)
        n, u = client.execute(f"SELECT count(), uniqExact(event_id) FROM {db}.events FINAL "
                              f"WHERE sandbox_id = %(s)s", {"s": sid})[0]
        assert n == u == len(ids)
    finally:
        client.disconnect()
    lines = [json.loads(x)["event_id"] for x in open(jsonl)]
    assert len(lines) == len(set(lines)) and set(lines) == ids
    assert sent_during < len(ids)                                      # some really waited for ClickHouse


# --- the producer SIGKILLed 20 times ---------------------------------------------------------

PRODUCER = r'''
import sys, threading, time
sys.path.insert(0, {root!r})
from exporters.spool import Spool
from exporters.clickhouse import ClickHouseExporter
spool_dir, url, sid, cgid, export = sys.argv[1:6]
spool = Spool(spool_dir, fsync="never")
exp = ClickHouseExporter(spool, url, flush_interval=0.05)
res = exp.flush(timeout=60)                      # a restart first replays what the last one spooled
print("replayed", res.sent, res.pending, res.error, flush=True)
from agent.sensors.recorder import Recorder
rec = Recorder(node="faults", spool=spool, enforce=False)
rec.watch(sid, int(cgid), rate=0)
if export == "export":
    threading.Thread(target=exp.run, args=(threading.Event(),), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
'''


@pytest.fixture(scope="module")
def producer_kills(clickhouse_url, clickhouse_client, tmp_path_factory):
    """The 20 producer SIGKILLs run in a thread beside the 60 s outage (another server, cgroup
    and spool; the outage test mostly waits): the file costs the longer of the two, not their
    sum. The producer test joins it and raises what it raised; if only the outage test ran,
    the teardown does."""
    from fixtures_bpf import CgroupFactory
    cgroups = CgroupFactory()
    box: dict = {}
    kills_dir = tmp_path_factory.mktemp("kills")     # here: pytest's first basetemp set-up is not thread-safe

    def run():
        try:
            producer_kill_scenario(clickhouse_url, clickhouse_client, cgroups(), kills_dir)
        except BaseException as e:      # noqa: B902 - handed to the test that joins
            box["error"] = e
    t = threading.Thread(target=run, name="producer-kills", daemon=True)
    t.start()
    box["thread"] = t
    yield box
    t.join(240)
    cgroups.cleanup()
    if not box.get("joined"):
        assert not t.is_alive(), "the producer-kill scenario did not end"
        if "error" in box:
            raise box["error"]


def test_producer_sigkilled_20_times_final_clickhouse_equals_what_was_spooled(producer_kills):
    t = producer_kills["thread"]
    t.join(240)
    producer_kills["joined"] = True
    assert not t.is_alive(), "the producer-kill scenario did not end in 240 s"
    if "error" in producer_kills:
        raise producer_kills["error"]


def producer_kill_scenario(clickhouse_url, clickhouse_client, cg, tmp_path):
    from audit_schema.migrations import migrate
    client, db = clickhouse_client
    migrate(client, db)
    path = str(tmp_path / "sp")
    spool = Spool(path, fsync="never")
    verify = spool.reader("verify")
    sid = "kill-" + uuid.uuid4().hex[:8]
    (tmp_path / "w").mkdir()
    gen = start_generator(cg, rate=300, duration=600, workdir=tmp_path / "w")   # runs across the restarts
    script = PRODUCER.format(root=ROOT)
    rnd = random.Random(os.getpid())
    spooled: set = set()
    damage = []
    replays = []
    try:
        for i in range(20):
            # SIGKILL at a random point: during the replay (the exporter mid-INSERT or mid-commit),
            # while the sensor compiles and attaches, or while recording, appending and exporting
            where = ("recording", "replay", "recording", "compile")[i % 4]
            # every fourth producer records without exporting (ClickHouse behind): the next
            # restart must replay what it spooled, however far an exporter that keeps up
            # (within ~50 ms) got before the other kills
            export = "no-export" if i % 4 == 2 else "export"
            p = subprocess.Popen([sys.executable, "-c", script, path, clickhouse_url, sid, str(cg.id), export],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                if where == "replay":
                    time.sleep(rnd.uniform(0.3, 0.9))
                    continue
                line = readline(p, 60).split()
                assert line and line[0] == "replayed", p.stderr.read() if p.poll() is not None else line
                replays.append(int(line[1]))
                # the replay delivered everything the killed producers had spooled: nothing else writes now
                recs, dmg = read_everything(verify)
                spooled |= {r["event_id"] for r in recs if r["sandbox_id"] == sid}
                damage += dmg
                got = ch_ids(client, db, sid)
                assert set(got) == spooled, f"restart {i}: {len(spooled - set(got))} spooled event(s) missing"
                assert all(c == 1 for c in got.values())
                if where == "compile":
                    time.sleep(rnd.uniform(0.05, 1.0))
                else:
                    assert readline(p, 60) == "ready", p.stderr.read() if p.poll() is not None else "no ready"
                    time.sleep(rnd.uniform(0.1, 1.5))
            finally:
                p.send_signal(signal.SIGKILL)
                p.wait()
        # the last restart
        exp = ClickHouseExporter(Spool(path, fsync="never"), clickhouse_url)
        res = exp.flush(timeout=60)
        exp.close()
        assert res.ok, res.summary()
    finally:
        gen.kill()
        gen.wait()
    recs, dmg = read_everything(verify)
    spooled |= {r["event_id"] for r in recs if r["sandbox_id"] == sid}
    damage += dmg
    assert len(spooled) > 1000 and sum(1 for n in replays if n) >= 5   # real work, really replayed
    got = ch_ids(client, db, sid)
    assert set(got) == spooled and all(c == 1 for c in got.values())
    n, u = client.execute(f"SELECT count(), uniqExact(event_id) FROM {db}.events FINAL WHERE sandbox_id = %(s)s",
                          {"s": sid})[0]
    assert n == u == len(spooled)
    # a torn write of a killed producer is a reported gap, not silence (and not a crash)
    assert all("torn" in d.reason or "CRC" in d.reason or "magic" in d.reason for d in damage), damage
    if damage:
        gaps = client.execute(f"SELECT count() FROM {db}.events FINAL WHERE kind = 'events_lost' AND sandbox_id = '' "
                              f"AND extra LIKE %(p)s", {"p": f"%{path}%"})[0][0]
        assert gaps >= 1
    spool.close()


# --- the disk budget ----------------------------------------------------------------------------

def evs(sid, n, start=0):
    t0 = 1_800_000_000_000_000_000
    return [{"event_id": f"{sid}-{i}", "ts_ns": t0 + i, "node": "n", "sandbox_id": sid, "step": 1,
             "kind": "open_write", "pid": 10, "path": f"/workspace/some/longer/path/file-{i:06d}", "flags": 0o101,
             "ret": 3} for i in range(start, start + n)]


def test_disk_budget_exhausted_drops_with_loud_accounting(tmp_path, clickhouse_url, clickhouse_client, caplog):
    """ClickHouse (required) unreachable: past the budget, batches are dropped,
    counted, logged, recorded as events_lost (reason spool_full) and in the
    metric; what was kept and the gap markers reach ClickHouse later."""
    client, db = clickhouse_client
    METRICS.reset()
    budget = 64 << 10
    path = str(tmp_path / "sp")
    sp = Spool(path, fsync="never", max_bytes=budget)
    sp.reader("verify")                                      # a required cursor: keeps every record for the check
    dead = ClickHouseExporter(sp, f"clickhouse://default@127.0.0.1:{free_ports(1)[0]}/{db}")   # registers its cursor
    sid = "budget-" + uuid.uuid4().hex[:8]
    kept = dropped = 0
    for i in range(0, 2000, 20):
        n = sp.append_many(evs(sid, 20, start=i))
        assert n in (0, 20)                                  # all or none
        kept += n
        dropped += 20 - n
        assert sp.size_bytes() <= budget + sp.reserve_bytes
    assert kept > 100 and dropped > 500 and sp.dropped_total == dropped
    assert METRICS.counter("dsec.events.lost", reason="spool_full") == dropped
    assert any("DROPPED" in r.getMessage() for r in caplog.records)
    assert not dead.flush(timeout=0.2).ok
    dead.close()
    sp.close()                                               # writes the last coalesced events_lost record
    sp2 = Spool(path, fsync="never", max_bytes=budget)
    recs, damage = read_everything(sp2.reader("verify"))
    assert not damage
    lost = [r for r in recs if r["kind"] == "events_lost"]
    assert lost and all(json.loads(r["extra"])["reason"] == "spool_full" for r in lost)
    assert sum(r["count"] for r in lost) == dropped and {r["sandbox_id"] for r in lost} == {sid}
    assert len([r for r in recs if r["kind"] == "open_write"]) == kept
    # ClickHouse returns: the kept events and the gap markers arrive
    exp = ClickHouseExporter(sp2, clickhouse_url)
    res = exp.flush(timeout=60)
    exp.close()
    sp2.close()
    assert res.ok, res.summary()
    n_ok, n_lost = client.execute(
        f"SELECT countIf(kind = 'open_write'), sumIf(count, kind = 'events_lost') FROM {db}.events FINAL "
        f"WHERE sandbox_id = %(s)s", {"s": sid})[0]
    assert (n_ok, n_lost) == (kept, dropped)


def test_disk_budget_evicts_a_dead_best_effort_sink_not_the_others(tmp_path):
    """OTLP (best effort) down, JSON lines (required here) up: nothing is
    dropped; the OTLP backlog is evicted, and when the collector returns it
    gets the rest plus an events_lost record for exactly what it missed."""
    METRICS.reset()
    sp = Spool(str(tmp_path / "sp"), fsync="never", max_bytes=64 << 10)
    rx = OtlpReceiver()                                      # down
    otlp = OtlpSink(sp, endpoint=rx.endpoint)
    fl = JsonlSink(sp, path=str(tmp_path / "a.jsonl"), evictable=False)
    sid = "evict-" + uuid.uuid4().hex[:8]
    for i in range(0, 3000, 50):
        assert sp.append_many(evs(sid, 50, start=i)) == 50   # never dropped
        assert fl.flush(5).ok
    assert sp.dropped_total == 0
    assert not otlp.flush(timeout=0.2).ok
    evicted = METRICS.counter("dsec.events.lost", reason="sink_evicted", sink="otlp")
    assert evicted > 1000
    assert os.path.exists(sp.evicted_path("otlp"))
    rx.start()
    try:
        res = otlp.flush(timeout=30)
        assert res.ok, res.summary()
        logs = rx.logs()
    finally:
        rx.stop()
        otlp.close()
    gaps = [a for _, lr, a in logs if lr.event_name == "dsec.events_lost"]
    delivered = [a for _, lr, a in logs if lr.event_name == "dsec.open_write"]
    assert gaps and all(json.loads(a["dsec.extra"])["reason"] == "sink_evicted" for a in gaps)
    assert sum(a["dsec.count"] for a in gaps) == evicted
    assert len(delivered) + evicted == 3000                  # everything accounted for, nothing twice
    assert len({a["log.record.uid"] for a in delivered}) == len(delivered)
    assert not os.path.exists(sp.evicted_path("otlp"))      # reported once
    lines = [json.loads(x)["event_id"] for x in open(tmp_path / "a.jsonl")]
    assert lines == [f"{sid}-{i}" for i in range(3000)]      # the other sink lost nothing
    fl.close()
    sp.close()


def test_an_eviction_under_a_delivery_counts_only_what_the_sink_did_not_deliver(tmp_path):
    """A best-effort sink reads a batch; while it delivers it, the disk budget evicts the
    segment under it; it commits the batch. The gap it then reports counts only the
    evicted records after what it delivered: before, the eviction counted from its old
    cursor, so the delivered records were also reported lost."""
    sp = Spool(str(tmp_path / "sp"), fsync="never", max_bytes=64 << 10)
    r = sp.reader("otlp", evictable=True)
    sid = "evd-" + uuid.uuid4().hex[:8]
    for i in range(0, 50, 10):
        assert sp.append_many(evs(sid, 10, start=i)) == 10       # frames of 10
    sp.save_cursor("otlp", r.read(1).start, evictable=True)      # a cursor: a best-effort sink
    b = r.read(30)                                               # in delivery: 30 records
    assert len(b.records) == 30
    n = 50
    while os.path.exists(sp.seg_path(b.end.segment)) and n < 20000:
        assert sp.append_many(evs(sid, 50, start=n)) == 50       # the budget evicts under the delivery
        n += 50
    assert not os.path.exists(sp.seg_path(b.end.segment))
    r.commit(b)                                                  # delivered: the 30
    got, lost = 30, 0
    for _ in range(1000):
        b2 = r.read(5000)
        if not b2.records and not b2.damage:
            break
        got += len(b2.records)
        lost += sum(d.frames for d in b2.damage if d.cause == "sink_evicted")
        r.commit(b2)
    assert got + lost == n, (got, lost, n)                       # each record once: delivered or lost
    r.close()
    sp.close()


# --- a corrupt / torn segment ----------------------------------------------------------------------

def test_corrupt_and_torn_segment_every_sink_keeps_the_rest_and_reports_the_gap(tmp_path):
    METRICS.reset()
    sp = Spool(str(tmp_path / "sp"), fsync="never", frames="record")   # bit rot in one record's frame
    sid = "dmg-" + uuid.uuid4().hex[:8]
    recs = evs(sid, 60)
    sp.append_many(recs)
    seg = sp.seg_path(sp.segments()[-1])
    data = bytearray(open(seg, "rb").read())
    off = sum(len(encode_frame(r)) for r in recs[:30])
    data[off + HEADER_BYTES + 7] ^= 0x40                      # bit rot inside record 30
    data += encode_frame(evs(sid, 1, start=60)[0])[:40]       # a torn last write
    open(seg, "wb").write(bytes(data))
    rx = OtlpReceiver().start()
    try:
        otlp = OtlpSink(sp, endpoint=rx.endpoint)
        fl = JsonlSink(sp, path=str(tmp_path / "d.jsonl"))
        r1, r2 = otlp.flush(10), fl.flush(10)
        assert r1.ok and r2.ok and r1.sent == r2.sent == 59 and r1.damaged == r2.damaged == 2
        sp.append_many(evs(sid, 5, start=61))                 # writing goes on after the damage
        assert otlp.flush(10).sent == 5 and fl.flush(10).sent == 5
        logs = rx.logs()
    finally:
        rx.stop()
    want = {r["event_id"] for r in recs} - {f"{sid}-30"} | {f"{sid}-{i}" for i in range(61, 66)}
    assert {a["log.record.uid"] for _, lr, a in logs if lr.event_name == "dsec.open_write"} == want
    lines = [json.loads(x) for x in open(tmp_path / "d.jsonl")]
    assert {x["event_id"] for x in lines if x["kind"] == "open_write"} == want
    for gaps in ([json.loads(a["dsec.extra"]) for _, lr, a in logs if lr.event_name == "dsec.events_lost"],
                 [json.loads(x["extra"]) for x in lines if x["kind"] == "events_lost"]):
        assert len(gaps) == 2 and {g["reason"] for g in gaps} == {"spool_damage"}
        assert any("CRC" in g["detail"] for g in gaps) and any("torn" in g["detail"] for g in gaps)
    assert METRICS.counter("dsec.events.lost", reason="spool_damage") == 4     # 2 regions x 2 sinks
    assert os.path.getsize(os.path.join(sp.path, "damage.log")) > 0
    otlp.close()
    fl.close()
    sp.close()


# --- the recorder's append failures ------------------------------------------------------

class _FailingAppends:
    """The spool, with its next `n` appends failing as a disk error would (EIO)."""

    def __init__(self, spool, n):
        self.spool, self.n, self.calls = spool, n, 0

    def __getattr__(self, name):
        return getattr(self.spool, name)

    def append_many(self, records, on_locked=None):
        self.calls += 1
        if self.n > 0:
            self.n -= 1
            raise OSError(5, "Input/output error (injected)")
        return self.spool.append_many(records, on_locked)


def _spooled_states(spool, sid):
    out = []
    reader = spool.reader("check-" + uuid.uuid4().hex[:6])
    while True:
        b = reader.read(1000)
        if not b:
            break
        out += b.records
        reader.commit(b)
    return [json.loads(r["extra"])["state"] for r in out if r["sandbox_id"] == sid]


def test_append_errors_retry_and_leave_the_batch_queued(audit_cgroups, tmp_path):
    """Issue 13 point 4: Recorder._flush_pending took its batch before appending, so
    an append error lost it, and the error flag never reset (every later unwatch
    failed). Now the batch stays queued in order, is retried, and the flag clears."""
    from agent.sensors.recorder import Recorder
    spool = Spool(str(tmp_path / "sp"), fsync="never")
    failing = _FailingAppends(spool, 3)
    rec = Recorder(node="faults", spool=failing, enforce=False)
    try:
        sid = "retry-" + uuid.uuid4().hex[:8]
        for i in range(5):
            rec.record({"kind": "lifecycle", "sandbox_id": sid, "extra": json.dumps({"state": f"s{i}"})})
        assert wait_until(lambda: failing.n == 0 and not rec._pending, 10)
        assert rec.flush(timeout=10)             # the last batch taken is also appended
        assert _spooled_states(spool, sid) == [f"s{i}" for i in range(5)]    # nothing lost, in order
        assert rec.append_errors == 3 and rec._error is None     # healthy again: the flag is reset
        cg = audit_cgroups()
        rec.watch(sid, cg.id)
        assert "lost_total" in rec.unwatch(cg.id)               # no stale "audit pipeline failed"
    finally:
        rec.close()
        spool.close()


def test_tickets_wait_for_the_record_and_every_one_before_it(tmp_path):
    """Issue 15: record(wait=False) returns a ticket at once (the poll thread appends it); wait_durable(ticket) is True only once that record and every
    one queued before it are in the spool -- False while the disk fails (the records stay
    queued, in order), True once it works again."""
    from agent.sensors.recorder import Recorder
    spool = Spool(str(tmp_path / "sp"), fsync="always")
    failing = _FailingAppends(spool, 10**9)          # the disk fails until told otherwise
    rec = Recorder(node="faults", spool=failing, enforce=False)
    try:
        sid = "ticket-" + uuid.uuid4().hex[:8]
        tickets = [rec.record({"kind": "lifecycle", "sandbox_id": sid,
                               "extra": json.dumps({"state": f"s{i}"})}, wait=False) for i in range(5)]
        assert tickets == sorted(set(tickets)) and len(tickets) == 5
        assert not rec.wait_durable(tickets[0], timeout=0.5)      # nothing durable while the disk fails
        assert not rec.flush(timeout=0.2)
        assert wait_until(lambda: failing.calls >= 2, 10)           # the poll thread retries
        assert _spooled_states(spool, sid) == []
        failing.n = 0
        assert rec.wait_durable(tickets[2], timeout=10)
        assert _spooled_states(spool, sid)[:3] == ["s0", "s1", "s2"]   # the ticket's record and all before
        t = rec.record({"kind": "lifecycle", "sandbox_id": sid, "extra": json.dumps({"state": "end"})})
        assert t > tickets[-1] and rec.wait_durable(t, timeout=0)   # wait=True: spooled on return
        assert _spooled_states(spool, sid) == [f"s{i}" for i in range(5)] + ["end"]
        assert rec.append_errors >= 2 and rec._error is None
    finally:
        rec.close()
        spool.close()


def test_append_with_one_append_the_callers_records_then_the_queue(tmp_path):
    """The node agent's close (Recorder.append_with): its records (sandbox_exit, lifecycle) and
    the recorder's queue (the sandbox's last kernel records, queued by unwatch(flush=False)) in
    one durable append, the agent's first. Never while an append of the recorder is under way
    (the agent's append may be what that one waits for at the spool's gate): then nothing is
    done, and make_durable(ticket) appends the queue. When the joint append fails, the queue
    goes alone (kept queued and retried if that fails too) and the caller appends its own."""
    from agent.sensors.recorder import Recorder
    from audit_schema.events import normalize
    spool = Spool(str(tmp_path / "sp"), fsync="always")
    counting = _FailingAppends(spool, 0)
    rec = Recorder(node="faults", spool=counting, enforce=False)
    rec._stop.set()                 # the poll thread stopped: the queue is what the test puts there
    rec._thread.join(10)
    sid = "with-" + uuid.uuid4().hex[:8]

    def queue(*states):
        return [rec.record({"kind": "lifecycle", "sandbox_id": sid, "extra": json.dumps({"state": s})}, wait=False)
                for s in states][-1]

    def theirs(state):
        return [normalize({"kind": "lifecycle", "sandbox_id": sid, "event_id": uuid.uuid4().hex, "node": "faults",
                           "ts_ns": time.time_ns(), "extra": json.dumps({"state": state})})]
    try:
        t = queue("k0", "k1")
        calls = counting.calls
        assert rec.append_with(theirs("exit0"))
        assert counting.calls == calls + 1 and rec.wait_durable(t, timeout=0) and rec.ticket() == t
        assert _spooled_states(spool, sid) == ["exit0", "k0", "k1"]
        t = queue("k2")
        with rec._flush_lock:                           # an append of the recorder under way
            assert not rec.append_with(theirs("exit1"))
        assert counting.calls == calls + 1 and not rec.wait_durable(t, timeout=0)
        assert rec.make_durable(t, timeout=0) and counting.calls == calls + 2
        assert _spooled_states(spool, sid)[3:] == ["k2"]
        t = queue("k3")
        counting.n = 1                                  # the joint append fails: ours alone, theirs not
        assert not rec.append_with(theirs("exit2"))
        assert counting.calls == calls + 4 and rec.wait_durable(t, timeout=0) and rec._error is None
        assert _spooled_states(spool, sid)[4:] == ["k3"]
        t = queue("k4")
        counting.n = 2                                  # the disk fails: ours stay queued
        assert not rec.append_with(theirs("exit3"))
        assert not rec.wait_durable(t, timeout=0) and rec._error is not None
        assert rec.make_durable(t, timeout=0)           # the poll thread's retry, or the close's
        assert _spooled_states(spool, sid)[5:] == ["k4"]
    finally:
        rec.close()
        spool.close()


def test_a_ticket_whose_batch_the_spool_dropped_is_not_durable(tmp_path):
    """Issue 15: over the spool's disk budget a batch is dropped (recorded as events_lost,
    exporters/spool.py); wait_durable says so for its ticket instead of True."""
    from agent.sensors.recorder import Recorder
    spool = Spool(str(tmp_path / "sp"), fsync="never", segment_bytes=1024, max_bytes=4096)
    rec = Recorder(node="faults", spool=spool, enforce=False)
    try:
        sid = "dropped-" + uuid.uuid4().hex[:8]
        small = rec.record({"kind": "lifecycle", "sandbox_id": sid, "extra": json.dumps({"state": "s0"})})
        big = rec.record({"kind": "lifecycle", "sandbox_id": sid,
                          "extra": json.dumps({"state": "big", "pad": "x" * 20000})})
        assert rec.wait_durable(small, timeout=5)
        assert not rec.wait_durable(big, timeout=5)           # dropped, not durable
        assert rec.flush(timeout=5) is False                   # the last queued is the dropped one
        out = []
        reader = spool.reader("check")
        while (b := reader.read(1000)):
            out += b.records
            reader.commit(b)
        assert [r["kind"] for r in out if r["sandbox_id"] == sid] == ["lifecycle", "events_lost"]
    finally:
        rec.close()
        spool.close()
