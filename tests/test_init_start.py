"""dsec-init's own start is never the sandbox's (found by test_learn_fidelity,
intermittent on a loaded node). posix_spawn returns once dsec-init's exec has
begun, not ended; the launcher then moved it into the sandbox's cgroups, so an
exec that finished late was the sandbox's: recorded (an `exec` of dsec-init,
stamped "denied" by a learned exec allowlist that never ran it), and, once
on_started had exempted the init's pid, seen by the enforcement sensor's exec
hook, which ends the exemption at every exec and checks the new image against
the policy. Now the launcher waits for dsec-init's HELLO (sent after its exec
and set-up) before the join.

The race is made certain here: DSEC_INIT is a wrapper that sleeps, runs a
helper and only then execs the real dsec-init, as a starved init would."""
from __future__ import annotations

import json
import os
import textwrap
import uuid

from conftest import ROOT, dsec

INIT = os.path.join(ROOT, "agent", "sandbox", "init", "build", "dsec-init")

POLICY = textwrap.dedent("""\
    apiVersion: dsec/v1
    kind: SandboxPolicy
    metadata: {name: init-start}
    spec:
      mode: enforce
      exec: {allow: ["/usr/bin/true"]}
    """)


def test_a_late_init_exec_is_neither_recorded_nor_checked(tmp_path, clickhouse_url):
    wrapper = tmp_path / "slow-init"
    wrapper.write_text(f"#!/bin/sh\n/bin/sleep 0.3\nexec {INIT} \"$@\"\n")
    wrapper.chmod(0o755)
    pol = tmp_path / "p.yaml"
    pol.write_text(POLICY)
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool"),
           "DSEC_AGENT": "off", "DSEC_INIT": str(wrapper)}
    sid = "init-" + uuid.uuid4().hex[:8]
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--", "/usr/bin/true", env=env)
    # before the fix: the exec check killed dsec-init at its late exec (not in the allowlist)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    out = dsec("events", "--sandbox", sid, "--format", "json", env=env)
    assert out.returncode == 0, out.stderr
    recs = [json.loads(x) for x in out.stdout.decode().splitlines()]
    execs = [(e["path"], e["decision"]) for e in recs if e["kind"] in ("exec", "exec_denied", "exec_violation")]
    # the workload's exec only: not the wrapper's sleep, not dsec-init's own
    assert execs == [("/usr/bin/true", "allowed")], execs
    assert not [e for e in recs if e["decision"] in ("denied", "would-deny")], recs
