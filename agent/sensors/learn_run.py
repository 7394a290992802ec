"""Live learning: run a command N times in learn-mode sandboxes and return
what each run did, for policies.learn.derive_policy.

    runs = learn_runs(["python3", "tool.py"], 3, base_policy)
    # [{"run_id": sandbox id, "records": [audit records], "syscall_counts": {name: n},
    #   "exit_code": ..., "signal": ...}, ...]

Learn mode enforces nothing: seccomp is permissive and no eBPF rule denies.
Syscalls are counted in the kernel per sandbox (not one event per call); the
records are the same audit records every run produces, also spooled and
exported to ClickHouse. The workload's own output goes to our stderr, so
stdout stays free for the caller.
"""
from __future__ import annotations

import os
import sys

from agent.errors import DsecError, EXIT_DSEC


def learn_runs(argv, runs: int, base=None, *, network: str = "none", timeout: float | None = None,
               memory: int | None = 1 << 30, pids: int | None = 1024, user: str = "sandbox") -> list[dict]:
    from agent.sandbox.launcher import SandboxSpec, launch
    from agent.sensors.recorder import Recorder, SandboxWatch
    from exporters.clickhouse import flush
    from policies.load import load_policy

    policy = (base or load_policy("default")).with_mode("learn")
    rec = Recorder()
    out = []
    try:
        for i in range(runs):
            spec = SandboxSpec(argv=list(argv), policy=policy, network=network, timeout=timeout,
                               memory=memory, pids=pids, user=user,
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
    finally:
        rec.close()
    res = flush(rec.spool, timeout=10)
    if not res.ok:
        sys.stderr.write(f"dsec learn: {res.summary()}\n")
    if not any(r["syscall_counts"] for r in out):
        raise DsecError("no syscalls were counted: is eBPF enforcement available? "
                        f"({rec.enforce_error or 'unknown'})", EXIT_DSEC)
    return out
