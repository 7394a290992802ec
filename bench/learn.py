#!/usr/bin/env python3
"""Learning mode: how tight the learned syscall allowlist is, and what learning costs.

usage:
  .venv/bin/python bench/learn.py --suites    # real third-party test suites (tests/suites.py), below
  .venv/bin/python bench/learn.py             # full run (about 3 min on 2 cores)
  .venv/bin/python bench/learn.py --quick     # short run (about 40 s)
  .venv/bin/python bench/learn.py --reps 5    # more repetitions
  .venv/bin/python bench/learn.py --chdir     # the cost of a chdir under an exec allowlist (below)

Three workloads, each timing itself (BENCH_ELAPSED_NS) and working in its
current directory (/workspace in a sandbox, a temp dir on the host):
  json-file   python3: json files written and read back, an sqlite3 database
              filled and queried
  pipeline    sh: a coreutils pipeline (seq | sort | head | tr | uniq | wc,
              cut, sha256sum, cp, rm) in a loop
  sub-socket  python3: subprocess children that connect to the parent's
              listener on 127.0.0.1 and exchange a line per connection
each run --reps times, interleaved, as:
  host        plain subprocess on the host, no dsec (as root)
  run-off     dsec run --audit off              (sandbox + default seccomp filter)
  run-learn   dsec run --mode learn             (audit on + in-kernel syscall counts)
  learn       dsec learn -o POLICY -- CMD       (the above + deriving, rendering
                                                and writing the policy)
Printed per workload: the size of the learned syscall allowlist (each
repetition; calls seen in some runs only are named), the number of syscalls
the containers-common default profile allows (policies.oci.import_oci of
/usr/share/containers/seccomp.json: x86_64, no capabilities), their ratio,
and the time learning added: whole command and self-timed workload, as
seconds and as ratios against host and against run-off (medians); then the split
of the command's cost (sensors + export = run-learn - run-off; derive + write
= learn - run-learn) and the eBPF sensors' fixed cost measured in-process.

--suites: the real test suites of tests/suites.py (CPython's regression tests
from Debian, tornado's and dill's from PyPI; installed by scripts/setup.sh).
For each: `dsec learn --until-stable 1 --max-runs 4` (runs to converge: the
runs it took until one added nothing), the learned allowlist sizes (syscalls vs
the containers-common default profile, exec paths and allow_written_under,
writable paths, egress rules), the wall time of one learn-mode run (learn s:
the `dsec learn` command's wall / its runs) and its ratio to one run of the
suite under the default policy (/dflt), then --reps runs each, interleaved, of the suite
under the default policy (`dsec run`) and under the learned policy in enforce
mode: wall-time medians and the enforce/default ratio, the suite's verdict
(equal in both) and the policy denials of the enforced runs (0 expected).

--chdir: the stop/verify round trip of relative execs (docs/enforcement.md
"Relative execs"): a python3 loop of N chdir calls between two directories,
self-timed, in a sandbox whose policy has no exec allowlist (no stop) and one
whose exec allowlist is enforced (each chdir stops the process until the
agent has read its cwd), the no-allowlist sandbox in learn mode (stopped and
verified too: learning places relative execs at the verified cwd), and on the
host; per-chdir microseconds, medians of --reps, and the ratios to the
no-allowlist sandbox (no stop).

Audit records go to a throw-away database on dsec's private ClickHouse server
(started if needed, left running) through a temporary spool; the database and
temp dirs (learned policies, host work dirs) are removed at the end, also on
Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DSEC, drop_database, entry, finish, med, sensor_costs  # noqa: E402
HOST_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"    # the sandbox's PATH
ELAPSED = re.compile(rb"BENCH_ELAPSED_NS=(\d+)")

JSON_FILE_PY = r'''
import json, os, sqlite3, sys, time
n = int(sys.argv[1])
t = time.perf_counter_ns()
os.makedirs("data", exist_ok=True)
for i in range(n):
    with open("data/r%d.json" % (i % 64), "w") as f:
        json.dump({"i": i, "v": [i, i * 2, str(i)], "ok": True}, f)
total = 0
for name in sorted(os.listdir("data")):
    with open(os.path.join("data", name)) as f:
        total += json.load(f)["i"]
db = sqlite3.connect("data/db.sqlite")
db.execute("CREATE TABLE IF NOT EXISTS t (i INTEGER, s TEXT)")
db.executemany("INSERT INTO t VALUES (?, ?)", ((i, json.dumps([i])) for i in range(n)))
db.commit()
(count,) = db.execute("SELECT count(*) FROM t WHERE i % 2 = 0").fetchone()
db.close()
assert total > 0 and count == (n + 1) // 2, (total, count)
print("BENCH_ELAPSED_NS=%d" % (time.perf_counter_ns() - t))
'''

PIPELINE_SH = r'''
t0=$(date +%s%N)
i=0
while [ $i -lt {k} ]; do
  seq 1 3000 | sort -rn | head -n 1000 | tr 0-9 a-j | uniq -c | wc -l > out.txt
  cut -c1-4 out.txt >> log.txt
  i=$((i+1))
done
sha256sum log.txt > sum.txt
mkdir -p d && cp sum.txt log.txt d/ && ls d > /dev/null && rm -r d
[ "$(wc -l < log.txt)" -eq {k} ] || exit 3
t1=$(date +%s%N)
echo BENCH_ELAPSED_NS=$((t1-t0))
'''

SUB_SOCKET_PY = r'''
import socket, subprocess, sys, time
kids, n = int(sys.argv[1]), int(sys.argv[2])
child = """
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"ping %d\\n" % i)
    assert s.recv(64) == b"pong %d\\n" % i
    s.close()
"""
t = time.perf_counter_ns()
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(64)
port = srv.getsockname()[1]
for k in range(kids):
    p = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", child, str(port), str(n)])
    for i in range(n):
        a, _ = srv.accept()
        a.sendall(a.recv(64).replace(b"ping", b"pong"))
        a.close()
    assert p.wait(timeout=60) == 0
srv.close()
print("BENCH_ELAPSED_NS=%d" % (time.perf_counter_ns() - t))
'''


def workloads(quick: bool) -> list[tuple[str, str, list[str]]]:
    nj, k, (kids, nc) = (2000, 10, (3, 100)) if quick else (10000, 30, (6, 200))
    return [
        ("json-file", f"{nj} json files, {nj} sqlite rows", ["python3", "-I", "-B", "-c", JSON_FILE_PY, str(nj)]),
        ("pipeline", f"{k} x 6-stage pipeline", ["/bin/sh", "-c", PIPELINE_SH.replace("{k}", str(k))]),
        ("sub-socket", f"{kids} children x {nc} connects",
         ["python3", "-I", "-B", "-c", SUB_SOCKET_PY, str(kids), str(nc)]),
    ]


CONFIGS = ("host", "run-off", "run-learn", "learn")


def run_one(ctx, wname, argv, config, i):
    sid = f"benl-{wname}-{config}-{i}-{uuid.uuid4().hex[:6]}"
    policy = None
    cwd = None
    if config == "host":
        cwd = tempfile.mkdtemp(prefix="host-", dir=ctx["tmp"])
        cmd = list(argv)
        if cmd[0] == "python3":
            cmd[0] = shutil.which("python3", path=HOST_PATH) or "/usr/bin/python3"
        env = {"PATH": HOST_PATH, "HOME": cwd, "LANG": "C.UTF-8"}
    elif config == "run-off":
        cmd, env = [DSEC, "run", "--audit", "off", "--sandbox-id", sid, "--", *argv], ctx["env"]
    elif config == "run-learn":
        cmd, env = [DSEC, "run", "--mode", "learn", "--sandbox-id", sid, "--", *argv], ctx["env"]
    else:
        policy = os.path.join(ctx["tmp"], f"{sid}.yaml")
        cmd, env = [DSEC, "learn", "--name", f"bench-{wname}", "-o", policy, "--", *argv], ctx["env"]
    try:
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
        wall = time.perf_counter() - t
    finally:
        if cwd:
            shutil.rmtree(cwd, ignore_errors=True)
    m = ELAPSED.search(r.stdout) or ELAPSED.search(r.stderr)     # dsec learn: the workload's output on stderr
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{wname} ({config}) failed, exit {r.returncode}: "
                           f"{r.stderr.decode(errors='replace').strip()[-400:]}")
    out = {"work": int(m.group(1)) / 1e9, "wall": wall}
    if policy:
        from policies.load import load_policy
        p = load_policy(policy)
        out["allow"] = set(p.spec.syscalls.allow)
        out["exec"] = len(p.spec.exec.allow) if p.spec.exec else None
        out["writable"] = len(p.spec.files.writable) if p.spec.files else None
        out["egress"] = len(p.spec.egress.allow) if p.spec.egress else 0
        os.unlink(policy)
    return out


def containers_default() -> tuple[int, int, int]:
    """(syscalls the containers-common profile allows an x86_64 process with no
    capabilities, x86_64 syscalls in dsec's table, syscalls dsec's `default` allows)."""
    from policies import oci
    from policies import syscalls as sc
    from policies.compile import allowed_numbers
    from policies.load import load_policy
    pol, _ = oci.import_oci(oci.load_oci_file(oci.CONTAINERS_PROFILE), oci.CONTAINERS_PROFILE)
    s = pol.spec.syscalls
    if s.default != "deny":
        raise RuntimeError(f"{oci.CONTAINERS_PROFILE}: expected an allowlist (defaultAction errno)")
    table = {sc.number(n) for n in sc.names()}
    dflt = len(allowed_numbers(load_policy("default")) & table)
    return len(s.allow), len(table), dflt


def suites_bench(ctx, reps: int, n_cc: int, client, db: str) -> bool:
    """The --suites part: learn, sizes, runs to converge, enforce-mode slowdown."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import yaml
    from suites import SUITES, env_args, result_of
    ok = True
    print(f"{'suite':8} {'runs':>4} {'syscalls':>9} {'/cc':>5} {'exec':>4} {'w-under':>7} {'writable':>8} "
          f"{'egress':>6} {'learn s':>7} {'/dflt':>5} {'default s':>9} {'enforce s':>9} {'ratio':>6}  "
          "verdict / policy denials")
    for name, su in SUITES.items():
        pol = os.path.join(ctx["tmp"], f"{name}.yaml")
        t_learn = time.monotonic()
        r = subprocess.run([DSEC, "learn", "--until-stable", "1", "--max-runs", "4", *env_args(name), "-o", pol,
                            "--", *su["argv"]], env=ctx["env"], capture_output=True, timeout=600)
        t_learn = time.monotonic() - t_learn
        if r.returncode != 0:
            print(f"!! {name}: dsec learn failed: {r.stderr.decode(errors='replace')[-300:]}")
            ok = False
            continue
        runs = len(re.findall(rb"dsec learn: run \d+ \(", r.stderr))
        learn_s = t_learn / max(1, runs)
        spec = yaml.safe_load(open(pol))["spec"]
        nsys = len(spec["syscalls"]["allow"])
        x = spec.get("exec") or {}
        times: dict = {"default": [], "enforce": []}
        verdicts, denials = set(), 0
        for i in range(reps):
            for cfg in ("default", "enforce"):
                sid = f"bench-{name}-{cfg}-{i}-{uuid.uuid4().hex[:6]}"
                extra = ["--policy", pol, "--mode", "enforce"] if cfg == "enforce" else []
                t = time.monotonic()
                rr = subprocess.run([DSEC, "run", "--sandbox-id", sid, *env_args(name), *extra, "--", *su["argv"]],
                                    env=ctx["env"], capture_output=True, timeout=600)
                times[cfg].append(time.monotonic() - t)
                verdicts.add(result_of(rr.returncode, rr.stdout.decode(errors="replace") + "\n"
                                       + rr.stderr.decode(errors="replace"), name))
                if cfg == "enforce":
                    ev = subprocess.run([DSEC, "events", "--sandbox", sid, "--format", "json"], env=ctx["env"],
                                        capture_output=True, timeout=120).stdout.decode().splitlines()
                    denials += sum(1 for e in ev if json.loads(e).get("decision") in ("denied", "would-deny"))
        d, e = statistics.median(times["default"]), statistics.median(times["enforce"])
        same = len(verdicts) == 1
        ok &= same and denials == 0
        print(f"{name:8} {runs:>4} {nsys:>9} {nsys / n_cc:>5.2f} {len(x.get('allow', [])):>4} "
              f"{len(x.get('allow_written_under', [])):>7} {len((spec.get('files') or {}).get('writable', [])):>8} "
              f"{len((spec.get('egress') or {}).get('allow', [])):>6} {learn_s:>7.2f} {learn_s / d:>5.2f} "
              f"{d:>9.2f} {e:>9.2f} {e / d:>6.2f}  "
              f"{'same' if same else '!! DIFFERENT: ' + str(verdicts)} / {denials}{'' if denials == 0 else ' !!'}")
    print(f"(syscalls vs containers-common's {n_cc}; runs = learn runs until one added nothing, cap 4; ratio = "
          "enforce-mode wall time / default-policy wall time, medians)")
    return ok


CHDIR_PY = r'''
import os, sys, time
n = int(sys.argv[1])
t = time.perf_counter_ns()
for i in range(n):
    os.chdir("/usr/bin" if i % 2 else "/usr/lib")
print("BENCH_ELAPSED_NS=%d" % (time.perf_counter_ns() - t))
'''

CHDIR_POLICY = """apiVersion: dsec/v1
kind: SandboxPolicy
metadata: {{name: bench-chdir-{name}}}
spec:
  mode: enforce
  syscalls: {{default: allow}}
{exec}"""


def chdir_bench(ctx, reps: int, n: int = 2000) -> bool:
    """--chdir: per-chdir cost without and with the stop/verify (exec check enforced; learn mode)."""
    pols = {}
    for name, ex in (("no-allowlist", ""), ("exec-enforced", "  exec: {allow: [/usr/bin/python3*]}\n")):
        pols[name] = os.path.join(ctx["tmp"], f"chdir-{name}.yaml")
        with open(pols[name], "w") as f:
            f.write(CHDIR_POLICY.format(name=name, exec=ex))
    res = {c: [] for c in ("host", "no-allowlist", "exec-enforced", "learn")}
    argv = ["python3", "-c", CHDIR_PY, str(n)]
    for i in range(reps + 1):                  # the first round warms up
        for c in res:
            if c == "host":
                cmd = ["/usr/bin/python3", "-c", CHDIR_PY, str(n)]
            elif c == "learn":                 # learn mode: every chdir stopped and verified too
                cmd = [DSEC, "run", "--policy", pols["no-allowlist"], "--mode", "learn", "--timeout", "120",
                       "--", *argv]
            else:
                cmd = [DSEC, "run", "--policy", pols[c], "--timeout", "120", "--", *argv]
            p = subprocess.run(cmd, env=ctx["env"], capture_output=True, timeout=180)
            m = ELAPSED.search(p.stdout)
            if p.returncode != 0 or not m:
                print(f"chdir bench: {c} failed (exit {p.returncode}): {p.stderr[-500:]!r}")
                return False
            if i:
                res[c].append(int(m.group(1)) / n / 1e3)
    h, off, on = (statistics.median(res[c]) for c in ("host", "no-allowlist", "exec-enforced"))
    print(f"chdir x {n} (us per chdir, median of {reps}): host {h:.2f}, sandbox without exec allowlist "
          f"{off:.2f}, with an enforced exec allowlist (stop + verify) {on:.2f}: {on / off:.1f}x the "
          f"sandbox without, {on / h:.1f}x the host; +{on - off:.1f} us per chdir")
    lr = statistics.median(res["learn"])
    print(f"  learn mode (stop + verify, so that a relative exec is learned at the verified cwd): {lr:.2f} us "
          f"per chdir: {lr / off:.1f}x the sandbox without a stop (what a chdir cost in learn mode before "
          f"issue 21's last point), {lr / h:.1f}x the host")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", action="store_true", help="real third-party test suites (tests/suites.py)")
    ap.add_argument("--chdir", action="store_true", help="chdir cost under an enforced exec allowlist")
    ap.add_argument("--quick", action="store_true", help="smaller workloads, 1 repetition")
    ap.add_argument("--reps", type=int, help="runs of each workload x configuration (default 3, --quick 1)")
    a = ap.parse_args()
    reps = a.reps or (1 if a.quick else 3)
    if not 1 <= reps <= 20:
        ap.error("--reps: 1..20")
    if os.geteuid() != 0:
        sys.exit("bench/learn.py: must run as root (sandboxes, cgroups, eBPF)")
    if not os.access(DSEC, os.X_OK):
        sys.exit(f"bench/learn.py: {DSEC} missing (run `make setup`)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from exporters.clickhouse_server import PrivateServer, connect
    t_start = time.monotonic()
    n_cc, n_table, n_default = containers_default()
    server = PrivateServer()
    server.start()
    db = f"dsec_bench_learn_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = server.url_for(db)
    tmp = tempfile.mkdtemp(prefix="dsec-bench-learn-")
    ctx = {"tmp": tmp, "env": dict(os.environ, DSEC_CLICKHOUSE_URL=url, DSEC_SPOOL_DIR=os.path.join(tmp, "spool"))}
    client, _ = connect(url)
    print(f"dsec learn benchmark: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, kernel "
          f"{os.uname().release}; ClickHouse {server.url} database {db}")
    print(f"containers-common default profile (x86_64, no capabilities) allows {n_cc} of the {n_table} x86_64 "
          f"syscalls; dsec's built-in `default` allows {n_default}", flush=True)
    try:
        client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
        if a.chdir:
            ok = chdir_bench(ctx, reps)
            finish(t_start, ok)
            return 0 if ok else 1
        if a.suites:
            ok = suites_bench(ctx, reps, n_cc, client, db)
            finish(t_start, ok)
            return 0 if ok else 1
        wls = workloads(a.quick)
        for w, _, argv in wls:                                 # warm-up: rootfs, page cache, server
            run_one(ctx, w, argv, "run-off", 0)
        res = {(w, c): [] for w, _, _ in wls for c in CONFIGS}
        for i in range(1, reps + 1):
            for w, _, argv in wls:
                line = []
                for c in CONFIGS:
                    r = run_one(ctx, w, argv, c, i)
                    res[(w, c)].append(r)
                    line.append(f"{c} {r['work'] * 1e3:.0f}/{r['wall'] * 1e3:.0f}"
                                + (f" ({len(r['allow'])} syscalls)" if "allow" in r else ""))
                print(f"   run {i} {w:10} (workload/command ms): " + ", ".join(line), flush=True)
        print()
        print(f"{'workload':11} {'learned':>8} {'cc-default':>10} {'ratio':>6} | {'command s: host':>15} "
              f"{'run-off':>8} {'run-learn':>9} {'learn':>6} {'+s vs host':>10} {'x host':>7} {'x run-off':>9}")
        summary = []
        for w, desc, _ in wls:
            ls = res[(w, "learn")]
            sizes = [len(r["allow"]) for r in ls]
            union = set().union(*(r["allow"] for r in ls))
            common = set.intersection(*(r["allow"] for r in ls))
            size = statistics.median(sizes)
            h, off, rl, le = (med(res[(w, c)], "wall") for c in CONFIGS)
            print(f"{w:11} {size:>8.0f} {n_cc:>10} {size / n_cc:>5.2f}x | {h:>15.2f} {off:>8.2f} {rl:>9.2f} "
                  f"{le:>6.2f} {le - h:>+10.2f} {le / h:>6.1f}x {le / off:>8.1f}x")
            hw, ow, rw, lw = (med(res[(w, c)], "work") for c in CONFIGS)
            print(f"{'':11} ({desc}; sizes {'/'.join(map(str, sizes))}"
                  + (f"; in some runs only: {', '.join(sorted(union - common)[:8])}" if union != common else "")
                  + f"; also learned: {ls[-1]['exec']} exec paths, {ls[-1]['writable']} writable dirs, "
                    f"{ls[-1]['egress']} egress rules)")
            print(f"{'':11} self-timed workload ms: host {hw * 1e3:.1f}, run-off {ow * 1e3:.1f}, run-learn "
                  f"{rw * 1e3:.1f}, learn {lw * 1e3:.1f} -> learn {lw / hw:.2f}x host, {lw / ow:.2f}x run-off")
            summary.append((w, size, le - h, le / h, le / off, lw / hw, lw / ow, rl - off, le - rl))
        print("cost of learning, by part (medians): " + "; ".join(
            f"{w}: sensors+export (run-learn - run-off) {a_:.2f}s, derive+write (learn - run-learn) {b_:+.2f}s"
            for w, *_, a_, b_ in summary))
        print(f"fixed costs, measured in this process: {sensor_costs()}")
        print("ratios: " + "; ".join(
            f"{w}: allowlist {s:.0f}/{n_cc} = {s / n_cc:.2f} of containers-common, learn command "
            f"{lh:.1f}x host / {lo:.1f}x run-off (+{d:.1f}s), workload {wh:.2f}x host / {wo:.2f}x run-off"
            for w, s, d, lh, lo, wh, wo, _, _ in summary))
    finally:
        drop_database(client, db)
        shutil.rmtree(tmp, ignore_errors=True)
    finish(t_start)
    return 0


if __name__ == "__main__":
    entry(main, "bench/learn.py")
