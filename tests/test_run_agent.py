"""`dsec run` with no agent running starts one on first use (DSEC_AGENT=auto,
the CLI's default), later runs reuse it, and it goes away: `dsec agent stop`,
or its idle exit. Real agents, real sandboxes, the real eBPF audit."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from conftest import DSEC, dsec


def _env(tmp_path, clickhouse_url, **extra):
    e = {"DSEC_AGENT": "auto", "DSEC_AGENT_SOCKET": str(tmp_path / "run" / "agent.sock"),
         "DSEC_SPOOL_DIR": str(tmp_path / "spool"), "DSEC_CLICKHOUSE_URL": clickhouse_url,
         "DSEC_AGENT_IDLE_EXIT": "300"}
    e.update(extra)
    return e


def _started_pid(stderr: bytes) -> int | None:
    m = re.search(rb"started a node agent \(pid (\d+)\)", stderr)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pid):
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.1)


def test_run_starts_an_agent_once_reuses_it_and_agent_stop_stops_it(tmp_path, clickhouse_url):
    env = _env(tmp_path, clickhouse_url)
    sock = env["DSEC_AGENT_SOCKET"]
    full = dict(os.environ, **env)
    pid = None
    try:
        # two first runs at once: one agent is started, both run through it
        ps = [subprocess.Popen([DSEC, "run", "--", "sh", "-c", f"echo run{i}; exit {i + 3}"], env=full,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
        outs = [p.communicate(timeout=240) for p in ps]
        assert [p.returncode for p in ps] == [3, 4], outs
        assert [o[0] for o in outs] == [b"run0\n", b"run1\n"]
        pids = [_started_pid(o[1]) for o in outs]
        assert len([p for p in pids if p]) == 1, outs          # exactly one started it
        pid = next(p for p in pids if p)
        assert _alive(pid)
        assert b"dsec agent stop" in next(o[1] for o in outs if _started_pid(o[1]))
        # it keeps a warm pool in dsec run's default shape (via_agent.WARM_POOL)
        from agent.node.client import Client
        with Client(sock) as c:
            end = time.monotonic() + 60
            while not [p for p in c.capabilities()["warm_profiles"] if p["name"] == "run" and p["ready"]] \
                    and time.monotonic() < end:
                time.sleep(0.2)
            assert [(p["name"], p["count"]) for p in c.capabilities()["warm_profiles"]] == [("run", 2)]
            # a later run reuses it: no new agent, the summary names the agent, the audit is on,
            # and it took a sandbox of the warm pool
            summ = tmp_path / "s.json"
            r = dsec("run", "--summary-json", str(summ), "--", "/bin/true", env=env, timeout=120)
            assert r.returncode == 0, r.stderr
            assert _started_pid(r.stderr) is None, r.stderr
            s = json.loads(summ.read_text())
            assert s["agent"] == sock and s["exit_code"] == 0
            assert c.get(s["sandbox_id"]).warm
        # its record is durable in the agent's spool when the CLI returns: the agent shows its exec
        ev = dsec("events", "--sandbox", s["sandbox_id"], "--format", "json", env=env, timeout=120)
        assert ev.returncode == 0, ev.stderr
        kinds = [(json.loads(line)["kind"], json.loads(line).get("path")) for line in ev.stdout.splitlines()]
        assert ("exec", "/bin/true") in kinds, kinds
        st = dsec("agent", "stop", env=env, timeout=120)
        assert st.returncode == 0, st.stderr
        assert f"stopped the agent (pid {pid})".encode() in st.stdout
        assert not _alive(pid) and not os.path.exists(sock)
        again = dsec("agent", "stop", env=env, timeout=60)
        assert again.returncode == 0 and b"nothing to stop" in again.stdout
        # DSEC_AGENT=reuse (the old default) never starts one: in-process
        r = dsec("run", "--summary-json", str(summ), "--", "/bin/true", env=dict(env, DSEC_AGENT="reuse"),
                 timeout=120)
        assert r.returncode == 0 and _started_pid(r.stderr) is None, r.stderr
        assert "agent" not in json.loads(summ.read_text())
        assert not os.path.exists(sock)
    finally:
        _kill(pid)


def test_agent_started_on_first_use_exits_when_idle(tmp_path, clickhouse_url):
    env = _env(tmp_path, clickhouse_url, DSEC_AGENT_IDLE_EXIT="2")
    pid = None
    try:
        r = dsec("run", "--", "/bin/true", env=env, timeout=240)
        assert r.returncode == 0, r.stderr
        pid = _started_pid(r.stderr)
        assert pid and b"exits after 2s without work" in r.stderr, r.stderr
        end = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _alive(pid), "the agent did not exit when idle"
        assert not os.path.exists(env["DSEC_AGENT_SOCKET"])
        log = (tmp_path / "run" / "agent.log").read_text(errors="replace")
        assert "idle for 2 s" in log, log[-2000:]
        bad = dsec("agent", "--idle-exit", "0", env=env, timeout=60)
        assert bad.returncode == 2 and b"--idle-exit" in bad.stderr and b"Traceback" not in bad.stderr
    finally:
        _kill(pid)
