"""Learn -> audit -> promote -> enforce, end to end through real sandboxes, the
kernel's syscall counters and ClickHouse evidence."""
from __future__ import annotations

import json

from conftest import dsec, dsec_each

WORKLOAD = ("import json, os, subprocess\n"
            "open('/workspace/out.json', 'w').write(json.dumps({'a': 1}))\n"
            "subprocess.run(['/usr/bin/ls', '/workspace'], check=True)\n")
EXTRA = "import os; os.mkdir('/workspace/newdir'); print('mkdir ok')"
# the learned workload, then a sleep the learning runs never made: a timing call,
# allowed by every learned policy (before, a wait that happened to be over when
# learned made a later run fail under enforce)
SLEEPS = WORKLOAD + "import time; time.sleep(0.01); print('slept')\n"


def _nondefault(sid, env):
    out = dsec("events", "--sandbox", sid, "--format", "json", env=env).stdout.decode().splitlines()
    return [e for e in map(json.loads, out) if e["decision"] not in ("allowed", "")]


def test_learn_then_audit_then_promote_then_enforce(tmp_path, clickhouse_url):
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}
    pol = tmp_path / "learned.yaml"
    r = dsec("learn", "--runs", "2", "-o", str(pol), "--", "python3", "-c", WORKLOAD, env=env)
    assert r.returncode == 0, r.stderr
    text = pol.read_text()
    assert "mode: audit" in text and "/usr/bin/ls" in text and "/workspace" in text
    assert "runtime" in text                       # execve/exit_group marked as the runtime's own

    # two clean audit runs of exactly this policy (side by side): promotion is allowed
    sids = [f"aud-{i}-{tmp_path.name[-6:]}" for i in range(2)]
    runs = dsec_each(*[("run", "--sandbox-id", sid, "--policy", str(pol), "--", "python3", "-c", WORKLOAD)
                       for sid in sids], env=env)
    for sid, r in zip(sids, runs):
        assert r.returncode == 0, r.stderr
        assert _nondefault(sid, env) == []
    enforced = tmp_path / "enforced.yaml"
    r = dsec("policy", "promote", str(pol), "--to", "enforce", "--min-runs", "2", "--window", "1h",
             "-o", str(enforced), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mode: enforce" in enforced.read_text()

    # under enforce: the learned workload runs clean (also when it sleeps), anything new is refused
    sid, sid3 = f"enf-{tmp_path.name[-6:]}", f"enf3-{tmp_path.name[-6:]}"
    r, r2, r3 = dsec_each(("run", "--sandbox-id", sid, "--policy", str(enforced), "--", "python3", "-c", WORKLOAD),
                          ("run", "--policy", str(enforced), "--", "python3", "-c", EXTRA),
                          ("run", "--sandbox-id", sid3, "--policy", str(enforced), "--", "python3", "-c", SLEEPS),
                          env=env)
    assert r.returncode == 0, r.stderr
    assert _nondefault(sid, env) == []
    assert r2.returncode == 1 and b"mkdir ok" not in r2.stdout
    assert r3.returncode == 0 and b"slept" in r3.stdout, r3.stderr
    assert _nondefault(sid3, env) == []


def test_promotion_refused_on_violations(tmp_path, clickhouse_url):
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}
    pol = tmp_path / "learned.yaml"
    assert dsec("learn", "-o", str(pol), "--", "python3", "-c", WORKLOAD, env=env).returncode == 0
    sid = f"viol-{tmp_path.name[-6:]}"
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--", "python3", "-c", EXTRA, env=env)
    assert r.returncode == 0 and b"mkdir ok" in r.stdout          # audit mode lets it through
    assert any(e["kind"] == "syscall_violation" and e["syscall"] == "mkdir" for e in _nondefault(sid, env))
    r = dsec("policy", "promote", str(pol), "--to", "enforce", "--min-runs", "1", "--window", "1h",
             "-o", str(tmp_path / "no.yaml"), env=env)
    assert r.returncode == 1
    assert b"mkdir" in r.stdout + r.stderr and sid.encode() in r.stdout + r.stderr
    assert not (tmp_path / "no.yaml").exists()
