#!/usr/bin/env python3
"""Enforce-mode overhead and the per-syscall cost of the seccomp filter, in one run.

usage:
  .venv/bin/python bench/enforce.py              # full run (about 5 min on 2 cores, more under load)
  .venv/bin/python bench/enforce.py --quick      # short run (about 1.5-2 min)
  .venv/bin/python bench/enforce.py --reps 5     # more repetitions of part 1
  .venv/bin/python bench/enforce.py --skip-syscall   # part 1 only (--skip-workloads: part 2 only)

Part 1, workloads. bench/audit.py's three workloads (exec: sh loop exec'ing
/bin/true; open: python open-for-append/write/close loop; connect: python
loopback connects, accepted and refused), each timing itself
(BENCH_ELAPSED_NS), run --reps times, interleaved, under:
  host       plain subprocess on the host, no dsec (the files the open workload
             writes go to a temp dir instead of /workspace; runs as root)
  sandbox    dsec run --audit off --mode learn   (sandbox only; learn mode loads
             an allow-everything seccomp filter)
  default    dsec run --audit off --policy default   (the built-in enforce policy:
             seccomp default-allow with the containers-common denials)
  tight      dsec run --audit off --policy T --mode enforce, T learned from the
             workload in this run (`dsec learn`, allowlist of ~30-40 calls), its
             loopback egress rule widened to 127.0.0.0/8 any port (the learned
             rule names the run's ephemeral port, which the next run does not
             reuse). With --audit off only seccomp and the mount layout enforce:
             egress and exec rules are eBPF programs, loaded with audit on.
  default+a, tight+a   the same policies with audit on (full dsec: seccomp, eBPF
             egress/exec/syscall-report programs, eBPF audit -> ClickHouse); each
             such run is checked for zero denials and zero lost events.
Medians; slowdown ratios of the self-timed workload and of the whole command
against host and against sandbox.

Part 2, per-syscall cost. A C program (compiled here with gcc) times N calls
of getppid (allowed by every filter here; the kernel's seccomp action cache
lets an always-allowed call skip the filter) and then of syscall(1000) (no
such call: unfiltered an immediate ENOSYS; above the cache's range, so the
whole filter runs: ENOSYS under default-allow filters, EPERM under
python-tool's default deny), ROUNDS times each, in:
  a forked child on the host: no filter | default filter | python-tool filter
    (policies.compile.seccomp_filter(policy).load() after no_new_privs, then exec);
  the same unfiltered child while 1, then 3, audit-on enforce sandboxes are
    alive (`dsec run` without a node agent: each loads its own sensors, and
    each sensor's raw_syscalls:sys_exit program runs for every system call on
    the node);
  sandboxes: learn --audit off | default --audit off | default (audit on) |
    learn (audit on: in-kernel syscall counting).
Every row runs once per pass, passes interleaved; ns per call = min (and
median) over all rounds, +ns and ratio of the min against the unfiltered host
child (min: the estimate least disturbed by other load). Each row checks its
own claim (syscall 1000: EPERM where the filter is default-deny, else
ENOSYS). The BPF tracing programs in the kernel (anyone's) are counted at
each pass: other dsec processes' raw_syscalls programs tax every call.
Then the fixed cost of audit-on commands: each eBPF sensor's compile + attach
and close, measured in this process.

Audit-on runs use a throw-away database on dsec's private ClickHouse server
(started if needed, left running) and a temporary spool; the database, temp
dirs (learned policies, the compiled program) and any background sandbox are
removed at the end, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import importlib.util
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
from _common import ROOT, DSEC, drop_database, entry, finish, med, sensor_costs  # noqa: E402
HOST_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"    # the sandbox's PATH

# ---------------------------------------------------------------- workloads (from bench/audit.py)


def audit_workloads(quick: bool) -> list[tuple[str, int, list[str]]]:
    """bench/audit.py's workloads(quick); minimal copies if it cannot be imported."""
    try:
        spec = importlib.util.spec_from_file_location("dsec_bench_audit", os.path.join(ROOT, "bench", "audit.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        wls = mod.workloads(quick)
        if all(isinstance(w, tuple) and len(w) == 3 for w in wls):
            return wls
    except Exception as e:       # another engineer may be mid-edit: fall back, say so
        print(f"note: bench/audit.py workloads not importable ({type(e).__name__}: {e}); using copies")
    ne, no, nc = (500, 5000, 1500) if quick else (2000, 20000, 5000)
    exec_sh = ('t0=$(date +%s%N); i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done; '
               't1=$(date +%s%N); echo BENCH_ELAPSED_NS=$((t1-t0))')
    open_py = ('import sys, time\nn = int(sys.argv[1])\nnames = ["/workspace/f%d" % i for i in range(64)]\n'
               't = time.perf_counter_ns()\nfor i in range(n):\n    with open(names[i & 63], "a") as f:\n'
               '        f.write("x")\nprint("BENCH_ELAPSED_NS=%d" % (time.perf_counter_ns() - t))\n')
    connect_py = ('import socket, sys, time\nn = int(sys.argv[1])\nsrv = socket.socket(); '
                  'srv.bind(("127.0.0.1", 0)); srv.listen(128)\naddr = srv.getsockname()\n'
                  'closed = socket.socket(); closed.bind(("127.0.0.1", 0)); dead = closed.getsockname(); '
                  'closed.close()\nt = time.perf_counter_ns()\nfor i in range(n):\n'
                  '    c = socket.socket(); c.connect(addr); a, _ = srv.accept(); a.close(); c.close()\n'
                  '    c = socket.socket()\n    try:\n        c.connect(dead)\n'
                  '    except ConnectionRefusedError:\n        pass\n    c.close()\n'
                  'print("BENCH_ELAPSED_NS=%d" % (time.perf_counter_ns() - t))\n')
    return [("exec", ne, ["/bin/sh", "-c", exec_sh.format(n=ne)]),
            ("open", no, ["python3", "-I", "-S", "-B", "-c", open_py, str(no)]),
            ("connect", nc, ["python3", "-I", "-S", "-B", "-c", connect_py, str(nc)])]


def host_argv(argv: list[str], workdir: str) -> list[str]:
    """The workload for the host: /workspace -> a temp dir, python3 from the sandbox's PATH."""
    out = [a.replace("/workspace/", workdir.rstrip("/") + "/") for a in argv]
    if out[0] == "python3":
        out[0] = shutil.which("python3", path=HOST_PATH) or "/usr/bin/python3"
    return out


CONFIGS = [  # name, dsec run options (None: host), audit on?
    ("host", None, False),
    ("sandbox", ["--audit", "off", "--mode", "learn"], False),
    ("default", ["--audit", "off", "--policy", "default"], False),
    ("tight", ["--audit", "off", "--policy", "{tight}"], False),
    ("default+a", ["--policy", "default"], True),
    ("tight+a", ["--policy", "{tight}"], True),
]
ELAPSED = re.compile(rb"BENCH_ELAPSED_NS=(\d+)")


def run_cmd(cmd, env, what, *, cwd=None, stdin=None, timeout=600):
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                       capture_output=True, timeout=timeout)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed, exit {r.returncode}: "
                           f"{(r.stderr or r.stdout).decode(errors='replace').strip()[-400:]}")
    return r, wall


def run_workload(ctx, wname, argv, cfg, i):
    name, opts, audit = cfg
    if opts is None:
        d = tempfile.mkdtemp(prefix="host-", dir=ctx["tmp"])
        try:
            env = {"PATH": HOST_PATH, "HOME": d, "LANG": "C.UTF-8"}
            r, wall = run_cmd(host_argv(argv, d), env, f"{wname} on the host", cwd=d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        summ = None
    else:
        sid = f"benf-{wname}-{name.replace('+', '-')}-{i}-{uuid.uuid4().hex[:6]}"
        sfile = os.path.join(ctx["tmp"], sid + ".json")
        opts = [o.format(tight=ctx["tight"].get(wname, "")) for o in opts]
        r, wall = run_cmd([DSEC, "run", *opts, "--sandbox-id", sid, "--summary-json", sfile, "--", *argv],
                          ctx["env"], f"{wname} ({name})")
        with open(sfile) as f:
            summ = json.load(f)
        os.unlink(sfile)
    m = ELAPSED.search(r.stdout)
    if not m:
        raise RuntimeError(f"{wname} ({name}): no BENCH_ELAPSED_NS in its output")
    out = {"work": int(m.group(1)) / 1e9, "wall": wall, "events": 0, "denials": {}, "lost": 0}
    if audit and summ:
        a = summ.get("audit") or {}
        ev = a.get("events") or {}
        out["events"] = sum(ev.values())
        out["denials"] = {k: v for k, v in ev.items() if k.endswith(("_denied", "_violation"))}
        out["lost"] = a.get("lost", 0)
    return out


def learn_tight(ctx, wname, argv):
    """`dsec learn` the workload, then: mode enforce, loopback egress widened to
    127.0.0.0/8 (any port). Returns (path, allowlist size, seconds)."""
    import yaml
    from policies.load import load_policy
    learned = os.path.join(ctx["tmp"], f"learned-{wname}.yaml")
    _, wall = run_cmd([DSEC, "learn", "--name", f"bench-{wname}", "-o", learned, "--", *argv], ctx["env"],
                      f"dsec learn of {wname}")
    with open(learned) as f:
        d = yaml.safe_load(f)
    spec = d["spec"]
    spec["mode"] = "enforce"
    eg = spec.get("egress") or {}
    loop = [r for r in eg.get("allow", []) if str(r.get("cidr", "")).startswith("127.")]
    if loop:
        eg["allow"] = [r for r in eg["allow"] if r not in loop] + [{"cidr": "127.0.0.0/8"}]
    path = os.path.join(ctx["tmp"], f"tight-{wname}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f, sort_keys=False)
    pol = load_policy(path)                # validates; a clear error if the edit broke it
    return path, len(pol.spec.syscalls.allow), wall, len(loop)


def part_workloads(ctx, reps, quick):
    wls = audit_workloads(quick)
    print(f"== part 1: workloads, {reps} run(s) of each x {len(CONFIGS)} configurations, interleaved",
          flush=True)
    for w, n, argv in wls:
        path, size, wall, nloop = learn_tight(ctx, w, argv)
        ctx["tight"][w] = path
        print(f"   tight policy for {w}: dsec learn -> {size} syscalls allowed"
              + (f", {nloop} loopback egress rule(s) widened to 127.0.0.0/8" if nloop else "")
              + f" (learning took {wall:.1f}s)", flush=True)
    for w, n, argv in wls:                                   # warm-up: rootfs, page cache, server
        run_workload(ctx, w, argv, CONFIGS[1], 0)
    res = {(w, c[0]): [] for w, _, _ in wls for c in CONFIGS}
    for i in range(1, reps + 1):
        for w, n, argv in wls:
            line = []
            for cfg in CONFIGS:
                r = run_workload(ctx, w, argv, cfg, i)
                res[(w, cfg[0])].append(r)
                line.append(f"{cfg[0]} {r['work'] * 1e3:.0f}/{r['wall'] * 1e3:.0f}")
            print(f"   run {i} {w:8} (workload/command ms): " + ", ".join(line), flush=True)
    ok = True
    print()
    for w, n, _ in wls:
        host, sbx = res[(w, "host")], res[(w, "sandbox")]
        hw, hc, sw, sc = med(host, "work"), med(host, "wall"), med(sbx, "work"), med(sbx, "wall")
        print(f"{w} (N={n})   {'workload ms':>11} {'/host':>6} {'/sandbox':>8} | {'command ms':>10} "
              f"{'/host':>6} {'/sandbox':>8}")
        for c, _, audit in CONFIGS:
            rs = res[(w, c)]
            cw, cc = med(rs, "work"), med(rs, "wall")
            extra = ""
            if audit:
                den = {}
                for r in rs:
                    for k, v in r["denials"].items():
                        den[k] = den.get(k, 0) + v
                lost = sum(r["lost"] for r in rs)
                extra = f"   {med(rs, 'events'):.0f} events"
                if den or lost:
                    ok = False
                    extra += f"  !! denials {den}, lost {lost}"
            print(f"   {c:10} {cw * 1e3:11.1f} {cw / hw:5.2f}x {cw / sw:7.2f}x | {cc * 1e3:10.1f} "
                  f"{cc / hc:5.2f}x {cc / sc:7.2f}x{extra}")
    print("ratios, self-timed workload (medians): " + "; ".join(
        f"{w}: " + ", ".join(f"{c} {med(res[(w, c)], 'work') / med(res[(w, 'host')], 'work'):.2f}x host / "
                             f"{med(res[(w, c)], 'work') / med(res[(w, 'sandbox')], 'work'):.2f}x sandbox"
                             for c, _, _ in CONFIGS[2:]) for w, _, _ in wls))
    print(flush=True)
    return ok


# ---------------------------------------------------------------- part 2: per-syscall cost

SYSBENCH_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);          /* vDSO: no system call */
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: sysbench N ROUNDS\n");
        return 2;
    }
    long n = atol(argv[1]);
    int rounds = atoi(argv[2]);
    if (n < 1 || n > 100000000L || rounds < 1 || rounds > 100)
        return 2;
    for (int bad = 0; bad < 2; bad++) {
        const char *probe = bad ? "nr1000" : "getppid";
        long ret = 0;
        int err = 0;
        for (int r = -1; r < rounds; r++) {      /* r = -1: warm-up */
            long m = r < 0 ? n / 10 + 1 : n;
            long long t0 = now_ns();
            if (bad)                             /* no such call: ENOSYS, unless a filter says EPERM */
                for (long i = 0; i < m; i++)
                    ret = syscall(1000);
            else
                for (long i = 0; i < m; i++)
                    ret = syscall(SYS_getppid);
            long long t1 = now_ns();
            err = ret < 0 ? errno : 0;
            if (r >= 0)
                printf("%s ns=%.3f\n", probe, (double)(t1 - t0) / m);
        }
        printf("%s ret=%ld errno=%d\n", probe, ret, err);
    }
    return 0;
}
"""
PROBES = ("getppid", "nr1000")
IN_SANDBOX = 'cat > /tmp/sysbench && chmod 755 /tmp/sysbench && exec /tmp/sysbench "$@"'


def parse_sysbench(out: bytes, what: str, eperm: bool) -> dict[str, list[float]]:
    """{probe: [ns per call, one per round]}; checks the filter is what the row claims:
    getppid succeeded, syscall 1000 got EPERM (a default-deny filter) or ENOSYS."""
    res = {}
    for p in PROBES:
        ns = [float(x) for x in re.findall(rb"^%s ns=([0-9.]+)$" % p.encode(), out, re.M)]
        m = re.search(rb"^%s ret=(-?\d+) errno=(\d+)$" % p.encode(), out, re.M)
        if not ns or not m:
            raise RuntimeError(f"sysbench ({what}): unexpected output {out[-200:]!r}")
        ret, err = int(m.group(1)), int(m.group(2))
        if (p == "getppid" and ret <= 0) or (p == "nr1000" and err != (1 if eperm else 38)):
            raise RuntimeError(f"sysbench ({what}): {p} returned {ret} errno {err}: the filter is not "
                               "what this row claims")
        res[p] = ns
    return res


def host_child(binary, n, rounds, filt):
    """A forked child: no_new_privs + filter.load(), then exec the C program."""
    from agent.sandbox import sysutil as su

    def pre():
        su.prctl(su.PR_SET_NO_NEW_PRIVS, 1)
        filt.load()
    r = subprocess.run([binary, str(n), str(rounds)], preexec_fn=pre if filt is not None else None,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"sysbench child exit {r.returncode}: {r.stderr.decode(errors='replace')[-200:]}")
    return r.stdout


def sandbox_child(ctx, binary, n, rounds, opts):
    with open(binary, "rb") as f:
        r, _ = run_cmd([DSEC, "run", *opts, "--", "/bin/sh", "-c", IN_SANDBOX, "sh", str(n), str(rounds)],
                       ctx["env"], f"sysbench in dsec run {' '.join(opts)}", stdin=f)
    return r.stdout


class AliveSandboxes:
    """k concurrent `dsec run --policy default` (audit on, enforce), each with its own
    eBPF sensors (no node agent), kept alive until close()."""

    def __init__(self, ctx, k: int):
        self.ps = []
        for _ in range(k):
            p = subprocess.Popen([DSEC, "run", "--policy", "default", "--", "/bin/sh", "-c",
                                  "echo dsec-bench-ready; exec cat > /dev/null"],
                                 env=ctx["env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
            ctx["procs"].append(p)
            self.ps.append(p)
        for p in self.ps:
            if b"dsec-bench-ready" not in p.stdout.readline():
                err = p.stderr.read(4096).decode(errors="replace")
                self.close(ctx)
                raise RuntimeError(f"a background enforce sandbox did not start: {err[-300:]}")

    def close(self, ctx):
        for p in self.ps:
            p.stdin.close()                        # EOF: cat exits, the sandbox ends normally
        for p in self.ps:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdout, p.stderr):
                f.close()
            if p in ctx["procs"]:
                ctx["procs"].remove(p)


def _bpf_ids(next_cmd: int, limit: int = 100000):
    """Every id of one kind of BPF object in the kernel (BPF_*_GET_NEXT_ID), bounded."""
    import struct
    from agent.sensors import bpfsys
    oid = 0
    for _ in range(limit):
        attr = bpfsys._attr()
        bpfsys._put(attr, "<I", 0, oid)
        try:
            bpfsys._bpf(next_cmd, attr)
        except OSError:
            return
        oid = struct.unpack_from("<I", attr, 4)[0]
        yield oid


def _link_info(fd: int, name_buf=None) -> bytes:
    import ctypes as ct
    import struct
    from agent.sensors import bpfsys
    info = (ct.c_uint8 * 128)()
    if name_buf is not None:                        # raw_tracepoint: {tp_name ptr, tp_name_len} at 16
        struct.pack_into("<QI", info, 16, ct.addressof(name_buf), len(name_buf))
    attr = bpfsys._attr()
    bpfsys._put(attr, "<IIQ", 0, fd, ct.sizeof(info), ct.addressof(info))
    bpfsys._bpf(15, attr)                           # BPF_OBJ_GET_INFO_BY_FD
    return bytes(info)


def tracing_programs() -> str:
    """Anyone's BPF tracing programs in the kernel now: loaded tracepoint / raw
    tracepoint programs, and the raw tracepoints they are attached to. One attached
    to sys_enter/sys_exit (raw_syscalls) runs for every system call of every process."""
    import ctypes as ct
    import struct
    from collections import Counter
    from agent.sensors import bpfsys
    kinds = {5: "tracepoint", 17: "raw_tracepoint"}
    progs: Counter = Counter()
    for pid in _bpf_ids(11):                        # BPF_PROG_GET_NEXT_ID
        try:
            fd = bpfsys.prog_get_fd_by_id(pid)
        except OSError:
            continue
        try:
            t = bpfsys.prog_info(fd)["type"]
        except OSError:
            continue
        finally:
            os.close(fd)
        if t in kinds:
            progs[kinds[t]] += 1
    raw: Counter = Counter()
    for lid in _bpf_ids(31):                        # BPF_LINK_GET_NEXT_ID
        attr = bpfsys._attr()
        bpfsys._put(attr, "<I", 0, lid)
        try:
            fd = bpfsys._bpf(30, attr)              # BPF_LINK_GET_FD_BY_ID
        except OSError:
            continue
        try:
            if struct.unpack_from("<I", _link_info(fd), 0)[0] == 1:     # BPF_LINK_TYPE_RAW_TRACEPOINT
                name = ct.create_string_buffer(64)
                _link_info(fd, name)
                raw[name.value.decode(errors="replace")] += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    out = ", ".join(f"{v} {k}" for k, v in sorted(progs.items())) or "none"
    return out + "; raw tracepoints attached: " + (", ".join(f"{k} x{v}" for k, v in sorted(raw.items()))
                                                   or "none")


def part_syscall(ctx, quick):
    from policies.compile import seccomp_filter
    from policies.load import load_policy
    gcc = shutil.which("gcc")
    if not gcc:
        print("== part 2 skipped: gcc not found (apt-get install gcc)")
        return True
    src, binary = os.path.join(ctx["tmp"], "sysbench.c"), os.path.join(ctx["tmp"], "sysbench")
    with open(src, "w") as f:
        f.write(SYSBENCH_C)
    subprocess.run([gcc, "-O2", "-Wall", "-o", binary, src], check=True, capture_output=True)
    passes, rounds, n = (2, 4, 100_000) if quick else (4, 6, 200_000)
    filt = {p: seccomp_filter(load_policy(p)) for p in ("default", "python-tool")}
    print(f"== part 2: per-syscall cost, {passes} passes x {rounds} rounds x {n} calls per row and probe; "
          f"BPF tracing programs loaded in the kernel now: {tracing_programs()}", flush=True)
    # label, (where, filter or dsec run options), syscall 1000 refused (EPERM) by the filter?
    rows = [("host, no filter", ("host", None), False),
            ("host, default filter", ("host", "default"), False),
            ("host, python-tool filter", ("host", "python-tool"), True),
            ("host, no filter, 1 enforce sbx alive", ("alive", 1), False),
            ("host, no filter, 3 enforce sbx alive", ("alive", 3), False),
            ("sandbox learn --audit off", ("sbx", ["--audit", "off", "--mode", "learn"]), False),
            ("sandbox default --audit off", ("sbx", ["--audit", "off", "--policy", "default"]), False),
            ("sandbox default, audit on", ("sbx", ["--policy", "default"]), False),
            ("sandbox learn, audit on", ("sbx", ["--mode", "learn"]), False)]
    res = {(r[0], p): [] for r in rows for p in PROBES}
    for i in range(passes):                         # interleaved: drifting machine load hits every row
        for label, (kind, arg), eperm in rows:
            alive = AliveSandboxes(ctx, arg) if kind == "alive" else None
            try:
                if kind in ("host", "alive"):
                    out = host_child(binary, n, rounds, filt[arg] if kind == "host" and arg else None)
                else:
                    out = sandbox_child(ctx, binary, n, rounds, arg)
            finally:
                if alive:
                    alive.close(ctx)
            for p, v in parse_sysbench(out, label, eperm).items():
                res[(label, p)] += v
        print(f"   pass {i + 1}/{passes}: host getppid min "
              f"{min(res[('host, no filter', 'getppid')][-rounds:]):.0f} ns; BPF tracing programs in the kernel: "
              f"{tracing_programs()}", flush=True)
    base = {p: min(res[("host, no filter", p)]) for p in PROBES}
    print()
    print(f"{'ns per call: min (median) | +ns, ratio of min':42} {'getppid':>14} {'+ns':>6} {'ratio':>6} | "
          f"{'syscall 1000':>14} {'+ns':>6} {'ratio':>6}")
    for label, _, eperm in rows:
        cells = []
        for p in PROBES:
            v, lo = statistics.median(res[(label, p)]), min(res[(label, p)])
            cells.append(f"{lo:>5.0f} ({v:>6.0f}) {lo - base[p]:>+6.0f} {lo / base[p]:>5.2f}x")
        print(f"   {label:39} {cells[0]} | {cells[1]}" + ("   1000: EPERM (filter)" if eperm else ""))
    print("getppid: allowed by every filter (the kernel's seccomp action cache may skip the filter); "
          "syscall 1000: no such call, never cached, so the whole filter runs (ENOSYS, or EPERM from a "
          "default-deny filter); min is the estimate least disturbed by other load")
    print(f"fixed costs of audit-on commands, measured in this process: {sensor_costs()}")
    print(flush=True)
    return True


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts, 1 repetition, fewer syscall rounds")
    ap.add_argument("--reps", type=int, help="runs of each workload x configuration (default 3, --quick 1)")
    ap.add_argument("--skip-workloads", action="store_true", help="skip part 1")
    ap.add_argument("--skip-syscall", action="store_true", help="skip part 2")
    a = ap.parse_args()
    reps = a.reps or (1 if a.quick else 3)
    if not 1 <= reps <= 20:
        ap.error("--reps: 1..20")
    if os.geteuid() != 0:
        sys.exit("bench/enforce.py: must run as root (sandboxes, cgroups, eBPF, seccomp)")
    if not os.access(DSEC, os.X_OK):
        sys.exit(f"bench/enforce.py: {DSEC} missing (run `make setup`)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from exporters.clickhouse_server import PrivateServer, connect
    t_start = time.monotonic()
    server = PrivateServer()
    server.start()
    db = f"dsec_bench_enf_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = server.url_for(db)
    tmp = tempfile.mkdtemp(prefix="dsec-bench-enforce-")
    ctx = {"tmp": tmp, "tight": {}, "procs": [],
           "env": dict(os.environ, DSEC_CLICKHOUSE_URL=url, DSEC_SPOOL_DIR=os.path.join(tmp, "spool"))}
    client, _ = connect(url)
    with open("/sys/devices/system/cpu/vulnerabilities/spec_store_bypass") as f:
        ssb = f.read().strip()
    print(f"dsec enforce benchmark: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, kernel "
          f"{os.uname().release}, spec_store_bypass: {ssb}; ClickHouse {server.url} database {db}", flush=True)
    ok = True
    try:
        client.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
        if not a.skip_workloads:
            ok &= part_workloads(ctx, reps, a.quick)
        if not a.skip_syscall:
            ok &= part_syscall(ctx, a.quick)
    finally:
        for p in list(ctx["procs"]):                       # only what we started, by handle
            try:
                p.terminate()                              # dsec run forwards it to the sandbox
                p.wait(15)
            except Exception:
                p.kill()
                p.wait()
        drop_database(client, db)
        shutil.rmtree(tmp, ignore_errors=True)
    finish(t_start, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    entry(main, "bench/enforce.py")
