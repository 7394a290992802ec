"""`dsec run`'s fast path through a running agent (agent/entry.py -> agent/commands/run.py fast):
the plain form `dsec run [--option VALUE ...] -- CMD` is parsed by hand and sent over the run
socket without importing argparse, re, json, socket, signal or threading; anything else goes the
ordinary way with argparse's parsing and run()'s messages. Pure checks that the hand-made parts
equal what they stand for, then a real agent with real sandboxes (a warm pool in `dsec run`'s
default shape, as the agent `dsec run` starts on first use has)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import time

import pytest

from conftest import DSEC
from agents import AgentProc

from agent.commands import run as run_cmd
from agent.node import runclient as rc
from agent.node import via_agent

# ---------------------------------------------------------------- the hand-made parts


def _run_parser():
    from agent.cli import build_parser
    top, _ = build_parser("run")
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def test_the_fast_options_are_registers_options():
    p = _run_parser()
    seen = set()
    for act in p._actions:
        if not act.option_strings or act.dest == "help":
            continue
        name = max(act.option_strings, key=len)
        seen.add(name)
        if name in run_cmd._SLOW_OPTIONS:
            continue
        assert name in run_cmd._OPTIONS, f"{name}: not in run._OPTIONS (nor _SLOW_OPTIONS)"
        dest, kind, default = run_cmd._OPTIONS[name]
        want = ("flag" if isinstance(act, argparse._StoreTrueAction) else
                "append" if isinstance(act, argparse._AppendAction) else
                tuple(act.choices) if act.choices else "value")
        assert (dest, kind) == (act.dest, want), name
        assert default == (None if want == "append" else act.default), name
    assert seen == set(run_cmd._OPTIONS) | set(run_cmd._SLOW_OPTIONS)


PLAIN = [
    ["--", "/bin/true"],
    ["--", "--", "x"],
    ["--memory", "256M", "--pids=64", "--env", "A=1", "--env=B=2", "--keep", "--", "sh", "-c", "echo $A"],
    ["--sandbox-id", "s1", "--cpus", "0.5", "--timeout", "3", "--grace", "1", "--network", "egress",
     "--workdir", "/w", "--user", "root", "--summary-json", "out.json", "--policy", "x.yaml", "--mode", "audit",
     "--audit", "off", "--over-budget", "stop", "--wait-export", "--volume", "/a:/b", "--", "cmd", "--keep"],
    ["--memory", "1G", "--memory", "2G", "--sandbox-id=", "--", "true"],
]
NOT_PLAIN = [
    [], ["true"], ["--"], ["--help", "--", "x"], ["-h"], ["--mem", "1G", "--", "x"], ["--memory", "--", "x"],
    ["--memory", "-1", "--", "x"], ["--mode", "nope", "--", "x"], ["--keep=1", "--", "x"], ["--image", "i", "--", "x"],
    ["--memory"], ["--keep", "true"], ["--bogus", "--", "x"],
]


def test_the_fast_parse_is_argparses_for_the_plain_form_and_declines_the_rest():
    p = _run_parser()
    dests = [d for d, _, _ in run_cmd._OPTIONS.values()] + ["image", "entrypoint", "cmd"]
    for argv in PLAIN:
        fast = run_cmd.fast_args(argv)
        assert fast is not None, argv
        ns = p.parse_args(argv)
        assert {d: getattr(fast, d) for d in dests} == {d: getattr(ns, d) for d in dests}, argv
    for argv in NOT_PLAIN:
        assert run_cmd.fast_args(argv) is None, argv


def test_frames_json_is_json():
    vals = [{"a": 1, "b": [1.5, None, True, False, "x\udcff\u00e9\n\x00"], "c": {"d": float("inf")},
             "e": 10 ** 30, "f": -0.0, "g": 1e-300, "h": object}, [], "s", 3, {1: 2}]
    for v in vals:
        b = json.dumps(v, ensure_ascii=True, default=str).encode()
        assert rc.dumps(v) == b
        assert repr(rc.loads(b)) == repr(json.loads(b))
    for bad in (b"", b"{", b"{} x", b"nope", b"[1,]"):
        with pytest.raises(ValueError):
            rc.loads(bad)


def test_sizes_and_ids_by_hand_are_the_patterns():
    alpha = ["1", "0", ".", "k", "M", "G", "t", "i", "I", "b", "B", " ", "\t", "\x0b", "x", "-", "\n", "\u0663"]
    for n in range(5):
        for combo in itertools.product(alpha, repeat=n):
            t = "".join(combo).strip()
            m = re.match(run_cmd._SIZE_PATTERN, t)
            assert run_cmd._size_parts(t) == ((m.group(1), m.group(2)) if m else None), repr(t)
    for sid in ["a", "A9_.-", "x" * 63, "x" * 64, "", "_a", "-a", ".a", "a b", "a\n", "é", "a/b", "0"]:
        assert via_agent._id_ok(sid) == bool(re.match(via_agent._ID_PATTERN, sid)), repr(sid)


# ---------------------------------------------------------------- through a real agent

TICK = 10.0
SLOW_MODULES = ("argparse", "re", "json", "socket", "signal", "threading", "enum", "selectors")


@pytest.fixture(scope="module")
def agent(tmp_path_factory, clickhouse_url):
    a = AgentProc(str(tmp_path_factory.mktemp("runfast")), clickhouse_url, {
        # the longest tick: the warm pool is filled by the first tick (10 s after the start) and,
        # after a claim, by the run socket's refill_soon long before the next one
        "scheduling": {"tick_seconds": TICK},
        "warm_pool": [{"name": "run", "count": 1}],            # dsec run's defaults (via_agent.WARM_POOL)
    }).start()
    yield a
    assert a.stop() == 0, a.read_log()[-3000:]


def _run(agent, *args, importtime=False, **kw):
    env = dict(agent.env, DSEC_AGENT_SOCKET=agent.socket, DSEC_AGENT="reuse")
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return subprocess.run([DSEC, "run", *args], env=env, capture_output=True, timeout=120, **kw)


def _imported(stderr: bytes) -> set:
    return {ln.split("|")[-1].strip() for ln in stderr.decode().splitlines() if "import time:" in ln}


def test_the_plain_form_imports_none_of_the_slow_modules_and_claims_a_warm_sandbox(agent, tmp_path):
    out = tmp_path / "s.json"

    def ready(c):
        return c.capabilities()["warm_profiles"][0]["ready"]

    with agent.client() as c:
        assert c.capabilities()["warm_profiles"][0]["name"] == "run"
        end = time.monotonic() + 60
        while ready(c) < 1 and time.monotonic() < end:       # the first tick fills it
            time.sleep(0.05)
        # a plain run claims it, and the pool is filled again after the reply, not at the next tick
        # (TICK after the one that filled it: refill_soon, agent/node/warm.py)
        r = _run(agent, "--summary-json", str(out), "--", "/bin/true")
        assert r.returncode == 0, r.stderr
        claimed = time.monotonic()
        sid = json.loads(out.read_text())["sandbox_id"]
        assert c.get(sid).warm, c.get(sid)
        while ready(c) < 1 and time.monotonic() < claimed + TICK / 2:
            time.sleep(0.05)
        assert ready(c) == 1, "the warm pool was not refilled after the run's reply"
        r = _run(agent, "--env", "A=b", "--", "sh", "-c", "echo $A; cat; exit 3", importtime=True, input=b"in\n")
        assert r.returncode == 3 and r.stdout == b"b\nin\n", r.stderr[-3000:]
        mods = _imported(r.stderr)
        assert "agent.node.runclient" in mods and not mods & set(SLOW_MODULES), sorted(mods)
        assert "dsec: sandbox sbx-" in r.stderr.decode()
        # --summary-json: written (json is imported for it, after the run)
        r = _run(agent, "--summary-json", str(out), "--env", "A=b", "--", "sh", "-c", "exit 3")
        assert r.returncode == 3, r.stderr[-3000:]
        s = json.loads(out.read_text())
        assert s["agent"] == agent.socket and s["exit_code"] == 3
        assert f"dsec: sandbox {s['sandbox_id']}" in r.stderr.decode()
        assert not c.get(s["sandbox_id"]).warm      # its env is not the profile's: a cold one
        # the next plain run takes the refilled one
        r = _run(agent, "--summary-json", str(out), "--", "/bin/true")
        assert r.returncode == 0, r.stderr
        assert c.get(json.loads(out.read_text())["sandbox_id"]).warm


def test_what_the_fast_path_declines_goes_the_ordinary_way(agent, tmp_path):
    # an abbreviation (argparse resolves it): the same run, through argparse
    r = _run(agent, "--mem", "256M", "--", "sh", "-c", "echo ok", importtime=True)
    assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr[-3000:]
    assert "argparse" in _imported(r.stderr)
    # bad values: run()'s own one-line messages and exit 125, never a traceback
    for args, msg in [(("--memory", "1X"), b"--memory '1X': not a size"),
                      (("--sandbox-id", "bad id"), b"invalid sandbox id 'bad id'"),
                      (("--policy", str(tmp_path / "none.yaml")), b"No such file or directory"),
                      (("--summary-json", str(tmp_path / "no" / "s.json")), b"does not exist")]:
        r = _run(agent, *args, "--", "true")
        assert r.returncode == 125 and msg in r.stderr and b"Traceback" not in r.stderr, (args, r.stderr)
    r = _run(agent, "--", "no-such-cmd")
    assert r.returncode == 127 and b"no-such-cmd" in r.stderr
    r = _run(agent, "--timeout", "0.5", "--", "sleep", "10")
    assert r.returncode == 124 and b"timed out" in r.stderr
