"""Relative execs under an exec allowlist (issue 21): learned resolved against
the process's cwd, matched the same way by the kernel's check in audit and
enforce mode -- against the cwd the agent read from /proc while the process was
stopped at its chdir (bpf/enforce.c "relative execs", agent/sensors/cwd.py).

Before issue 21 every relative exec was refused under enforce (the kernel check
matched "./true" itself, which no pattern names): test_relative_execs_by_mode
fails there on its first line."""
from __future__ import annotations

import ast
import json
import textwrap

import pytest

from conftest import dsec

POLICY = textwrap.dedent("""\
    apiVersion: dsec/v1
    kind: SandboxPolicy
    metadata: {name: rel-%(mode)s}
    spec:
      mode: %(mode)s
      syscalls: {default: allow}
      exec: {allow: [/usr/bin/python3, /usr/bin/sh, /usr/bin/dash, /usr/bin/true]}
    """)

PROBE = textwrap.dedent(r'''
    import ctypes, os, shutil, subprocess, sys
    def run(argv, **kw):
        try:
            return subprocess.run(argv, **kw).returncode
        except OSError as e:
            return f"E{e.errno}"
    print("cwd-arg", run(["./true"], cwd="/usr/bin"))          # subprocess's cwd=: chdir in the child
    print("not-allowed", run(["./id"], cwd="/usr/bin", stdout=subprocess.DEVNULL))
    os.chdir("/usr/bin")
    print("chdir", run(["./true"]))                              # chdir in the parent, fork copies it
    print("dotdot", run(["../bin/true"]))                        # not canonical: refused
    print("sh-cd", run(["sh", "-c", "cd /usr && bin/true"]))     # a shell's cd builtin
    os.chdir("/")
    print("subdir", run(["usr/bin/true"]))
    print("dot-inside", run(["usr/./bin/true"]))
    fd = os.open("/usr/bin", os.O_RDONLY | os.O_DIRECTORY)
    os.fchdir(fd)
    print("fchdir", run(["./true"]))
    # a copy of id named true in a directory of the sandbox's own: same name, other file
    os.makedirs("/tmp/x", exist_ok=True)
    shutil.copy("/usr/bin/id", "/tmp/x/true")
    print("copy", run(["./true"], cwd="/tmp/x", stdout=subprocess.DEVNULL))
    # unshare(CLONE_FS): its threads may have cwds of their own -- the process's cwd is
    # unknown to the check from now on; a child that chdirs itself is known again
    libc = ctypes.CDLL(None, use_errno=True)
    print("unshare", libc.unshare(0x200))
    print("split", run(["./true"]))
    print("split-child-cwd", run(["./true"], cwd="/usr/bin"))
    sys.stdout.flush()
''')

# the chdir argument raced by another thread: the check never reads it, so the
# race cannot make a file other than /usr/bin/true run as an allowed ./true
RACE = textwrap.dedent(r'''
    import ctypes, os, shutil, subprocess, threading
    # /opt/v/true: a copy of id on a read-only volume (prints uid=... if it ever runs)
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(b"/usr/bin\0\0\0", 16)
    stop = False
    def flip():
        while not stop:
            ctypes.memmove(buf, b"/opt/v\0", 7)
            ctypes.memmove(buf, b"/usr/bin\0", 9)
    t = threading.Thread(target=flip, daemon=True); t.start()
    codes = {}
    for i in range(60):
        libc.chdir(buf)
        r = subprocess.run(["./true"], capture_output=True)
        codes[r.returncode] = codes.get(r.returncode, 0) + 1
        if b"uid=" in r.stdout:
            print("RAN-THE-COPY", flush=True)
    stop = True; t.join()
    print("codes", sorted(codes.items()), flush=True)
''')


def _events(sid, env):
    out = dsec("events", "--sandbox", sid, "--format", "json", env=env).stdout.decode().splitlines()
    return [json.loads(x) for x in out]


def _trail(sid, env):
    """What else the record says of the relative execs, for a failure's message: the
    audit sensor's exec records (their status comes from the same cwd maps as the
    check's), losses and aggregated summaries."""
    out = []
    for e in _events(sid, env):
        if e["kind"] == "exec" and not e["path_raw"].startswith("/") or e["kind"] == "events_lost" \
                or '"aggregated"' in (e.get("extra") or ""):
            out.append((e["kind"], e["pid"], e["path_raw"], e["path"], e.get("decision"), e.get("extra")))
    return out


@pytest.fixture
def env(tmp_path, clickhouse_url):
    return {"DSEC_CLICKHOUSE_URL": clickhouse_url, "DSEC_SPOOL_DIR": str(tmp_path / "spool")}


@pytest.mark.parametrize("mode", ["enforce", "audit"])
def test_relative_execs_by_mode(mode, tmp_path, env, sid):
    pol = tmp_path / "p.yaml"
    pol.write_text(POLICY % {"mode": mode})
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--", "python3", "-c", PROBE, env=env)
    assert r.returncode == 0, r.stderr
    res = dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())
    killed = "-9" if mode == "enforce" else "0"
    # the copy in /tmp: under enforce the writable layers are noexec (EACCES before the check)
    copy = "E13" if mode == "enforce" else "0"
    assert res == {"cwd-arg": "0", "not-allowed": killed, "chdir": "0", "dotdot": killed, "sh-cd": "0",
                   "subdir": "0", "dot-inside": killed, "fchdir": "0", "copy": copy, "unshare": "0",
                   "split": killed, "split-child-cwd": "0"}, (res, r.stderr[-2000:])
    kind = "exec_denied" if mode == "enforce" else "exec_violation"
    den = [e for e in _events(sid, env) if e["kind"] == kind]
    got = {}
    for e in den:
        ex = json.loads(e["extra"])
        got.setdefault(e["path_raw"], set()).update(s for s in ex["status"] if s != "not_absolute")
        assert ex["reason"].startswith("relative exec"), ex
    true = {"cwd_joined", "cwd_unknown"} if mode == "audit" else {"cwd_unknown"}
    assert got == {"./id": {"cwd_joined"}, "../bin/true": {"not_canonical"}, "usr/./bin/true": {"not_canonical"},
                   "./true": true}, (den, _trail(sid, env))
    by_reason = {json.loads(e["extra"])["status"][-1]: e for e in den if e["path_raw"] == "./true"}
    if mode == "audit":
        # the copy in /tmp/x: joined to the cwd the kernel knows, placed there in the record
        assert by_reason["cwd_joined"]["path"] == "/tmp/x/true", by_reason
    assert "does not know this process's cwd" in json.loads(by_reason["cwd_unknown"]["extra"])["reason"]
    ids = [e for e in den if e["path_raw"] == "./id"]
    assert ids[0]["path"] == "/usr/bin/id" and json.loads(ids[0]["extra"])["cwd"] == "/usr/bin"
    # the audit sensor's exec records agree: the allowed ones are allowed, the others are not
    execs = {(e["path_raw"], e["decision"]) for e in _events(sid, env) if e["kind"] == "exec"
             and e["path_raw"] in ("./true", "usr/bin/true", "usr/./bin/true")}
    # (a record whose name could not be placed -- the process gone -- claims no denial)
    assert ("./true", "allowed") in execs and ("usr/bin/true", "denied") not in execs, execs
    if mode == "audit":
        assert ("usr/./bin/true", "would-deny") in execs, execs


def _enforce_with_copies(tmp_path, env, sid, vol, script, ran_marker):
    """Run `script` under enforce with `vol` (copies of id) at /opt/v: the env used, its
    stdout, and the {exit code: count} it printed; nothing of a copy may have run."""
    pol = tmp_path / "p.yaml"
    pol.write_text(POLICY % {"mode": "enforce"})
    env = _volume_env(env, tmp_path)
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--volume", f"{vol}:/opt/v:ro", "--timeout", "120",
             "--", "python3", "-c", script, env=env, timeout=180)
    out = r.stdout.decode()
    assert r.returncode == 0 and ran_marker not in out, (out, r.stderr[-2000:])
    return env, out, dict(ast.literal_eval(out.split("codes ", 1)[1].strip()))


def test_racing_the_chdir_argument_runs_nothing_else(tmp_path, env, sid):
    vol = tmp_path / "v"
    _copy_of_id(vol)
    env, out, codes = _enforce_with_copies(tmp_path, env, sid, vol, RACE, "RAN-THE-COPY")   # {0: n, -9: m}
    assert set(codes) <= {0, -9} and sum(codes.values()) == 60, codes
    for e in _events(sid, env):
        if e["kind"] == "exec_denied":
            # every refusal: the copy, where it really was (or unplaced: killed before the
            # record could read its cwd) -- never /usr/bin/true
            assert e["path"] in ("/opt/v/true", "./true"), e


# learned, then enforced: a system binary by ./name after a relative cd (short-lived:
# it exits at once, before its record is decoded), one exec'd by a shell that is gone
# before the decode (the shell becomes ./test), one after subprocess's cwd=, and a
# script the run wrote to a fresh temporary directory. With SPLIT=1 (learning only) a
# process whose cwd the check cannot know (unshare(CLONE_FS)) runs ./sleep: alive long
# enough for /proc to show a cwd, and still never learned as an allow of that guess.
LEARNED_WORK = textwrap.dedent(r'''
    import ctypes, os, subprocess, tempfile
    r = subprocess.run(["sh", "-c", "cd /usr; cd bin && ./true && echo forked"], stdout=subprocess.PIPE)
    assert r.returncode == 0 and r.stdout == b"forked\n", r
    assert subprocess.run(["sh", "-c", "cd /usr && cd bin && exec ./test -n x"]).returncode == 0
    assert subprocess.run(["./uname"], cwd="/usr/bin", stdout=subprocess.DEVNULL).returncode == 0
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "run.sh"), "w") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(os.path.join(d, "run.sh"), 0o755)
    os.chdir(d)
    assert subprocess.run(["./run.sh"]).returncode == 0
    if os.environ.get("SPLIT"):
        os.chdir("/usr/bin")
        assert ctypes.CDLL(None, use_errno=True).unshare(0x200) == 0     # CLONE_FS: cwd unknown now
        assert subprocess.run(["./sleep", "0.5"]).returncode == 0
    print("done")
''')


def test_learned_relative_execs_run_clean_under_enforce(tmp_path, env, sid):
    """Learned at <verified cwd>/<name> -- whether or not the process (or its parent)
    is still there when the record is decoded -- then enforced: nothing refused. On
    main before the fix, learning read /proc/<pid>/cwd at decode time: ./true and
    ./test were left out (the processes were gone) and the enforced run was killed;
    ./sleep of the split process was learned as /usr/bin/sleep (a guess)."""
    pol = tmp_path / "learned.yaml"
    r = dsec("learn", "-o", str(pol), "--env", "SPLIT=1", "--", "python3", "-c", LEARNED_WORK, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    text = pol.read_text()
    head, spec = text.split("\nspec:", 1)
    allow = spec.split("allow_written_under:", 1)[0]
    for name in ("true", "test", "uname"):
        assert f"- /usr/bin/{name}" in allow, (name, spec)
        assert f"run by its relative name ./{name} (placed at the cwd the agent verified" in text, (name, text)
    assert "allow_written_under:\n    - /tmp" in spec, spec
    # the boundary: a relative exec whose cwd was not verified is left out, and said so
    assert "/usr/bin/sleep" not in spec, spec
    assert "relative execs whose cwd was not verified" in head and "./sleep" in head, head
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--mode", "enforce", "--", "python3", "-c",
             LEARNED_WORK, env=env, timeout=180)
    assert r.returncode == 0 and r.stdout.strip() == b"done", r.stderr[-2000:]
    evs = _events(sid, env)
    bad = [e for e in evs if e["decision"] in ("denied", "would-deny")]
    assert bad == [], bad
    # the enforced run's records place the relative execs the same way
    placed = {e["path_raw"]: (e["path"], e["path_resolution"]) for e in evs if e["kind"] == "exec"
              and e["path_raw"] in ("./true", "./test", "./uname")}
    assert placed == {f"./{n}": (f"/usr/bin/{n}", "verified") for n in ("true", "test", "uname")}, placed


# --- early SIGCONT (docs/enforcement.md "Early SIGCONT") --------------------------------
# /opt/v is a read-only volume (exec allowed) holding `true`, a copy of id: same name as
# the allowed /usr/bin/true, another file. A process whose verified cwd is /usr/bin
# chdirs to /opt/v and is stopped there until the agent has read its cwd; a sibling
# continues it at once and it execs ./true: the check must find the cwd unknown (or,
# if the agent won the race, /opt/v) -- never match the stale /usr/bin and run the copy.
SIGCONT = textwrap.dedent(r"""
    import os, signal, sys, time
    N = 30
    codes, ran = {}, 0
    for i in range(N):
        rd, wr = os.pipe()
        c = os.fork()
        if c == 0:
            os.close(rd)
            os.chdir("/usr/bin")
            time.sleep(0.05)                     # verified: /usr/bin counts
            os.write(wr, b"x")                   # the sibling starts continuing us now
            os.close(wr)
            time.sleep(0.01)
            os.chdir(f"/opt/v/d{i}")             # stopped here until the agent has read the cwd ...
            os.execv("./true", ["./true"])       # ... and continued early by the sibling
            os._exit(99)
        os.close(wr)
        s = os.fork()
        if s == 0:                               # the sibling: SIGCONT, as fast as it can (bounded)
            os.read(rd, 1)
            end = time.monotonic() + 5
            while time.monotonic() < end:
                try:
                    os.kill(c, signal.SIGCONT)
                except ProcessLookupError:
                    break
            os._exit(0)
        os.close(rd)
        _, st = os.waitpid(c, 0)
        os.waitpid(s, 0)
        code = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
        codes[code] = codes.get(code, 0) + 1
    print("codes", sorted(codes.items()), flush=True)
""")


def _volume_env(env, tmp_path):
    return dict(env, DSEC_VOLUME_ROOTS=str(tmp_path))


def _copy_of_id(vol):
    import shutil
    vol.mkdir(parents=True, exist_ok=True)
    shutil.copy("/usr/bin/id", vol / "true")       # prints uid=... if it ever runs
    (vol / "true").chmod(0o755)


def test_early_sigcont_leaves_the_cwd_unknown(tmp_path, env, sid):
    vol = tmp_path / "v"
    for i in range(30):          # a directory per round: no two refusals aggregated into one record
        _copy_of_id(vol / f"d{i}")
    e, out, codes = _enforce_with_copies(tmp_path, env, sid, vol, SIGCONT, "uid=")
    assert codes == {-9: 30}, codes                        # every ./true refused, none ran
    den = [x for x in _events(sid, e) if x["kind"] == "exec_denied" and x["path_raw"] == "./true"]
    # identical refusals (unplaced ones: the same path) are aggregated into summary records
    assert sum(x.get("count") or 1 for x in den) == 30, den
    unknown = 0
    for x in den:
        assert x["path"] != "/usr/bin/true", x             # never the stale cwd
        ex = json.loads(x["extra"])
        if ex.get("aggregated"):
            continue
        if "cwd_unknown" in ex["status"]:
            unknown += 1
        else:     # the agent read the cwd before the exec: the new one, where it really was
            assert "cwd_joined" in ex["status"] and ex.get("cwd", "").startswith("/opt/v/d"), x
            assert x["path"] == ex["cwd"] + "/true", x
    assert unknown > 0, den                                # the early SIGCONT did win the race


# --- a thread with a cwd of its own (clone CLONE_THREAD without CLONE_FS) ---------------
# The main thread's cwd is /opt/v (true = a copy of id); a thread created without
# CLONE_FS chdirs to /usr/bin, and the agent reads that thread's cwd. The main
# thread then execs ./true: the kernel runs /opt/v/true, so the check must not
# match /usr/bin/true (the process's cwd is not one: cwd_unknown).
SPLIT_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static volatile int done;
static int thr(void *a) { (void)a; if (chdir("/usr/bin") == 0) done = 1; else done = 2; for (;;) pause(); return 0; }
int main(void) {
    struct timespec ts = {0, 100000000};
    if (chdir("/opt/v")) return 3;
    nanosleep(&ts, 0);
    char *stk = malloc(1 << 16);
    if (clone(thr, stk + (1 << 16), CLONE_VM | CLONE_THREAD | CLONE_SIGHAND | CLONE_SYSVSEM, 0) < 0) return 4;
    for (int i = 0; i < 500 && !done; i++) nanosleep(&ts, 0);
    if (done != 1) return 5;
    nanosleep(&ts, 0);                   /* the thread's chdir verified */
    execl("./true", "./true", (char *)0);
    return 6;
}
"""


def test_thread_without_clone_fs_makes_the_cwd_unknown(tmp_path, env, sid):
    import subprocess
    vol = tmp_path / "v"
    _copy_of_id(vol)
    (tmp_path / "split.c").write_text(SPLIT_C)
    subprocess.run(["gcc", "-O1", "-o", str(vol / "split"), str(tmp_path / "split.c")], check=True)
    pol = tmp_path / "p.yaml"
    pol.write_text((POLICY % {"mode": "enforce"}).replace("/usr/bin/true]", "/usr/bin/true, /opt/v/split]"))
    e = _volume_env(env, tmp_path)
    r = dsec("run", "--sandbox-id", sid, "--policy", str(pol), "--volume", f"{vol}:/opt/v:ro", "--timeout", "60",
             "--", "/opt/v/split", env=e, timeout=120)
    assert b"uid=" not in r.stdout, r.stdout                # the copy never ran
    assert r.returncode == 128 + 9, (r.returncode, r.stdout, r.stderr[-2000:])
    den = [x for x in _events(sid, e) if x["kind"] == "exec_denied" and x["path_raw"] == "./true"]
    assert len(den) == 1 and "cwd_unknown" in json.loads(den[0]["extra"])["status"], den
