"""Sandboxes this process runs and records itself, when no node agent does it:
`dsec run` (run_audited), `dsec learn` (learn_runs) and `dsec replay --rerun`
(rerun). Each is the launcher's Sandbox watched by one Recorder through
SandboxWatch (the same path the node agent uses), then the record is flushed
to ClickHouse.

    result = run_audited(spec, over_budget="summarise")        # launcher.Result, summary["audit"]
    runs = learn_runs(["python3", "tool.py"], 3, base_policy)
    # [{"run_id": sandbox id, "records": [audit records], "syscall_counts": {name: n},
    #   "exit_code": ..., "signal": ...}, ...]
    sid, results, summary = rerun(plan)                        # a replay.rerun.Plan

Learn mode enforces nothing: seccomp is permissive and no eBPF rule denies.
Syscalls are counted in the kernel per sandbox (not one event per call); the
records are the same audit records every run produces, also spooled and
exported to ClickHouse. A learning run's own output goes to our stderr, so
stdout stays free for the caller.
"""
from __future__ import annotations

import os
import sys

from agent.errors import DsecError, EXIT_DSEC


def run_audited(spec, over_budget: str = "summarise"):
    """launch() with the eBPF recorder watching the sandbox, then export the record."""
    from agent.sandbox.launcher import launch
    from agent.sensors.recorder import Recorder
    from agent.sensors.watch import SandboxWatch
    from exporters.clickhouse import flush
    from exporters.configure import run_sinks_begin, run_sinks_end

    run_sinks_begin()          # OTLP / JSON-lines sinks from the environment: validated now, metrics started
    rec = Recorder(over_budget=over_budget)
    try:
        result = launch(spec, **SandboxWatch(rec, spec).launch_hooks())
    finally:
        rec.close()
    res = flush(rec.spool, timeout=10)
    result.summary["audit"]["exported"] = res.sent
    result.summary["audit"]["pending"] = res.pending
    result.summary["audit"]["export_error"] = res.error
    sinks = run_sinks_end(rec.spool)      # docs/exporters.md; never raises, says what is pending
    if sinks:
        result.summary["audit"]["sinks"] = sinks
    return result


def learn_runs(argv, runs: int, base=None, *, network: str = "none", timeout: float | None = None,
               memory: int | None = 1 << 30, pids: int | None = 1024, user: str = "sandbox",
               until=None, env: dict | None = None) -> list[dict]:
    """Up to `runs` learn-mode runs of argv; `until(runs_so_far)` -> True stops early
    (dsec learn --until-stable)."""
    from agent.sandbox.launcher import SandboxSpec, launch
    from agent.sensors.recorder import Recorder
    from agent.sensors.watch import SandboxWatch
    from exporters.clickhouse import flush
    from policies.load import load_policy

    policy = (base or load_policy("default")).with_mode("learn")
    rec = Recorder()
    out = []
    try:
        for i in range(runs):
            spec = SandboxSpec(argv=list(argv), policy=policy, network=network, timeout=timeout,
                               memory=memory, pids=pids, user=user, env=dict(env or {}),
                               sandbox_id=f"learn-{os.urandom(5).hex()}-{i + 1}")
            records: list[dict] = []

            def tap(batch, sid=spec.sandbox_id):
                records.extend(r for r in batch if r.get("sandbox_id") == sid)

            rec.add_tap(tap)
            watch = SandboxWatch(rec, spec, labels={"learn_run": i + 1})
            err = os.dup(2)
            try:
                result = launch(spec, stdio={"child": [0, err, err], "relay": {}, "close_after_fork": []},
                                **watch.launch_hooks())
            finally:
                os.close(err)
                rec.remove_tap(tap)
            s = result.summary
            sys.stderr.write(f"dsec learn: run {i + 1}/{runs} ({spec.sandbox_id}): "
                             f"exit {s.get('exit_code') if s.get('signal') is None else 'signal ' + str(s['signal'])}, "
                             f"{len(records)} events, {len(watch.syscall_counts())} distinct syscalls\n")
            out.append({"run_id": spec.sandbox_id, "records": records, "syscall_counts": watch.syscall_counts(),
                        "exit_code": s.get("exit_code"), "signal": s.get("signal")})
            if until is not None and until(out):
                break
    finally:
        rec.close()
    res = flush(rec.spool, timeout=10)
    if not res.ok:
        sys.stderr.write(f"dsec learn: {res.summary()}\n")
    if not any(r["syscall_counts"] for r in out):
        raise DsecError("no syscalls were counted: is eBPF enforcement available? "
                        f"({rec.enforce_error or 'unknown'})", EXIT_DSEC)
    return out


def spec_for(plan, sandbox_id: str):
    """The SandboxSpec of a re-run plan (replay.rerun.Plan)."""
    from agent.sandbox.launcher import SandboxSpec
    sb = plan.sandbox
    kw = {k: sb[k] for k in ("network", "user", "workdir", "rootfs") if sb.get(k) is not None}
    for k in ("memory", "cpus", "pids"):
        if sb.get(k) is not None:
            kw[k] = sb[k]
    spec = SandboxSpec(argv=[], sandbox_id=sandbox_id, policy=plan.policy, **kw)
    if sb.get("volumes"):
        from agent.sandbox import volumes
        spec.volumes = volumes.parse([f"{v['host']}:{v['sandbox']}:{v['mode']}" for v in sb["volumes"]],
                                     volumes.default_roots())
    if plan.from_snapshot:            # --from-step: the snapshot taken after the step before
        from agent.sandbox import images
        from agent.sandbox.snapshots import SnapshotStore, fork_spec
        st = SnapshotStore()
        fork_spec(spec, st.get(plan.from_snapshot), st, images.open_store())
    elif sb.get("image"):             # the recorded image, by digest, from this node's store
        from agent.sandbox import images
        img = images.open_store().resolve(sb["image"])
        spec.layers = images.open_store().prepare(img, sandbox_id)
        spec.image = img.record()
    return spec


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("dsec-replay-stdin", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def rerun(plan, *, spool=None, url: str | None = None, flush_timeout: float = 30.0, recorder=None):
    """A re-run plan's fresh sandbox in this process, then its record flushed to
    ClickHouse. Returns (sandbox id, [replay.rerun.StepRun], summary)."""
    from agent.sandbox.launcher import Sandbox
    from agent.sensors.recorder import Recorder
    from agent.sensors.watch import SandboxWatch
    from exporters.clickhouse import flush
    from replay.rerun import StepRun, new_replay_id
    sid = plan.sandbox_id or new_replay_id()
    own = recorder is None
    rec = recorder or Recorder(spool=spool)
    results: list = []
    try:
        spec = spec_for(plan, sid)
        watch = SandboxWatch(rec, spec, labels={"replay_of": plan.original})
        sb = Sandbox(spec, **watch.hooks())
        sb.next_step = getattr(spec, "first_step", 1)     # a fork goes on from its snapshot's step
        sb.start()
        try:
            for st in plan.steps:
                fd = _memfd(st.stdin) if st.stdin is not None else None
                try:
                    r = sb.exec(st.argv, env=st.env, workdir=st.workdir, stdin=fd, timeout=st.timeout,
                                stdin_bytes=st.stdin)
                finally:
                    if fd is not None:
                        os.close(fd)
                results.append(StepRun(st.n, r.code, r.exit_code, r.signal, r.timed_out, r.error, r.wall_ms))
        finally:
            summary = sb.close()
    finally:
        if own:
            rec.close()
    res = flush(rec.spool, url=url, timeout=flush_timeout)
    if not res.ok:
        raise DsecError(f"re-run {sid}: its record did not reach ClickHouse ({res.summary()}); "
                        "`dsec export` delivers it later", 1)
    return sid, results, summary
