#!/usr/bin/env python3
"""The kernel half of the audit's cost: what each BPF program costs per run,
and the hot-path workloads' slowdown with only the kernel side at work.

In this process: the enforcement sensor and the audit sensor loaded as the
agent loads them (agent/sensors/recorder.py: enforcement first, its cwd maps
shared), one cgroup2 of our own registered with the audit sensor as a
sandbox (budgets unlimited; no policy, so the enforcement sensor only looks
it up -- --policy NAME enforces one, e.g. `default`, which `dsec run` enforces
unless told otherwise, whose enforce-mode syscall programs then run on every syscall;
no seccomp filter is installed here), and a reader thread that empties
the ring buffer without decoding (RingReader.read: the kernel's records are
consumed, the Python pipeline is not measured here -- bench/audit.py is).
Kernel run-time statistics on (BPF_ENABLE_STATS while this runs: the kernel
stamps each program run, ~20-30 ns per run more for every program, the same
in every column but base; --no-stats leaves them off and prints ratios only).

Workloads (each a child process, N operations, timing itself):
  open     os.open(f, O_WRONLY|O_CREAT|O_APPEND) + os.close, 64 names
  append   open(f, "a") + write + close, 64 names (bench/audit.py part 1's open workload)
  connect  connect to a listener on 127.0.0.1 (accepted) + to a closed port (refused)
  exec     sh loop exec'ing /bin/true (fork + exec + exit)
each run --runs times in three places, interleaved: in the sandbox cgroup
(audited), in a cgroup that is not a sandbox (the cost for everything else
on the node), and -- the baseline -- with no BPF program loaded, measured
before the sensors are loaded and again after they are closed. Printed per
workload: the median per-operation time and the ratio to the baseline; per
program: runs and ns per run (run_time_ns / run_cnt) while the loop ran in
the sandbox, and while it ran outside any sandbox (the cost for the rest of
the node: those counts include every other process's runs meanwhile).

    .venv/bin/python bench/kcost.py [--runs 5] [--quick] [--compare REV|DIR ...] [--policy NAME] [--floor]

--floor adds a place: programs that return at once, attached at every tracepoint and
raw tracepoint the two sensors had attached (with --policy's programs), in place of
theirs -- what the hooks themselves cost a workload on this kernel (the syscall
tracepoints' slow path and perf frames), which no program at these hooks can go under.
The sensors' cgroup programs (egress) are not mirrored: they act in sandboxes only.

--compare (repeatable) loads another bpf/ tree too -- a git revision's or a
directory as it is (an experiment without a commit) -- each build in turn
within every round, so all of them see the same minute's load.

Nothing is left behind: the cgroups are removed, the sensors closed, the
stats fd closed (the kernel stops stamping).
"""
from __future__ import annotations

import argparse
import ctypes as ct
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
from statistics import median as med

from _common import entry

OPEN_PY = r'''
import os, sys, time
n, d = int(sys.argv[1]), sys.argv[2]
names = [f"{d}/f{i}" for i in range(64)]
fl = os.O_WRONLY | os.O_CREAT | os.O_APPEND
t = time.perf_counter_ns()
for i in range(n):
    os.close(os.open(names[i & 63], fl, 0o600))
print(time.perf_counter_ns() - t)
'''

# bench/audit.py part 1's open workload as it is: Python's open(.., "a"), write, close
# (openat, newfstatat, ioctl, 3 lseek, write, close: 8 syscalls an iteration)
APPEND_PY = r'''
import sys, time
n, d = int(sys.argv[1]), sys.argv[2]
names = [f"{d}/a{i}" for i in range(64)]
t = time.perf_counter_ns()
for i in range(n):
    with open(names[i & 63], "a") as f:
        f.write("x")
print(time.perf_counter_ns() - t)
'''

CONNECT_PY = r'''
import socket, sys, time
n = int(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(128)
addr = srv.getsockname()
closed = socket.socket(); closed.bind(("127.0.0.1", 0)); dead = closed.getsockname(); closed.close()
t = time.perf_counter_ns()
for i in range(n):
    c = socket.socket(); c.connect(addr); a, _ = srv.accept(); a.close(); c.close()
    c = socket.socket()
    try:
        c.connect(dead)
    except ConnectionRefusedError:
        pass
    c.close()
print(time.perf_counter_ns() - t)
'''

EXEC_SH = ('t0=$(date +%s%N); i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done; '
           't1=$(date +%s%N); echo $((t1-t0))')

SYS_BPF = 321
BPF_ENABLE_STATS = 32
BPF_OBJ_GET_INFO_BY_FD = 15


def enable_stats() -> int:
    """BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): an fd; the kernel stamps program runs while it is open."""
    libc = ct.CDLL(None, use_errno=True)
    attr = (ct.c_uint8 * 16)()
    fd = libc.syscall(SYS_BPF, BPF_ENABLE_STATS, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        raise OSError(ct.get_errno(), "BPF_ENABLE_STATS")
    return fd


def prog_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program fd (struct bpf_prog_info offsets 192, 200)."""
    from agent.sensors import bpfsys
    info = (ct.c_uint8 * 256)()
    attr = bpfsys._attr()
    bpfsys._put(attr, "<IIQ", 0, fd, ct.sizeof(info), ct.addressof(info))
    bpfsys._bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    return struct.unpack_from("<QQ", bytes(info), 192)


class Progs:
    """The loaded programs of some BCC objects: name -> fd."""

    def __init__(self, *named_bpfs):
        self.fds = {}
        for tag, b in named_bpfs:
            for name, fn in b.funcs.items():
                if getattr(fn, "fd", -1) >= 0:
                    self.fds[f"{tag}:{name.decode()}"] = fn.fd

    def snap(self) -> dict:
        return {n: prog_stats(fd) for n, fd in self.fds.items()}

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {n: (b[n][0] - a[n][0], b[n][1] - a[n][1]) for n in a}


def workloads(quick: bool, d: str):
    no, nc, ne = (5000, 1000, 300) if quick else (20000, 3000, 1000)
    py = "/usr/bin/python3"
    return [
        ("open", no, [py, "-I", "-S", "-B", "-c", OPEN_PY, str(no), d]),
        ("append", no, [py, "-I", "-S", "-B", "-c", APPEND_PY, str(no), d]),
        ("connect", nc, [py, "-I", "-S", "-B", "-c", CONNECT_PY, str(nc)]),
        ("exec", ne, ["/bin/sh", "-c", EXEC_SH.format(n=ne)]),
    ]


def run_in(cg_procs: str, argv) -> float:
    script = 'echo $$ > "$0" || exit 125; exec "$@"'
    out = subprocess.run(["/bin/sh", "-c", script, cg_procs, *argv], capture_output=True, timeout=600, check=True)
    return int(out.stdout.split()[-1]) / 1e9


def use_bpf_dir(path: str) -> None:
    """Load the sensors' BPF sources from `path` (a bpf/ directory)."""
    from agent.sensors import audit, common, enforce
    for m in (common, audit, enforce):
        m.BPF_DIR = path


class Loaded:
    """Both sensors loaded as the agent loads them, a sandbox registered, a
    reader thread emptying the ring without decoding."""

    def __init__(self, sbx_cg: str, sid: str, policy=None):
        from agent.sensors.audit import AuditSensor
        from agent.sensors.enforce import EnforcementSensor
        t = time.perf_counter()
        self.enf = EnforcementSensor(on_record=None)
        try:
            self.aud = AuditSensor(on_record=None, cwd_pins=self.enf.cwd_pins, enrich=False)
        except BaseException:
            self.enf.close()
            raise
        self.load_s = time.perf_counter() - t
        self.cgid = os.stat(sbx_cg).st_ino
        self.aud.add_sandbox(self.cgid, sid, rate=0, byte_rate=0)
        self.policy = policy
        if policy is not None:          # its enforcement too (the syscall programs of its mode)
            self.enf.add_sandbox(self.cgid, sbx_cg, sid, policy)
        self.progs = Progs(("audit", self.aud.bpf), ("enforce", self.enf.bpf))
        self.stop = threading.Event()
        reader = self.aud._reader

        def drain():
            while not self.stop.is_set() and not os.environ.get("KCOST_NO_DRAIN"):
                if reader.wait(50):
                    reader.read()
        self.th = threading.Thread(target=drain, daemon=True)
        self.th.start()

    def close(self) -> dict:
        self.stop.set()
        self.th.join(5)
        totals = self.aud.remove_sandbox(self.cgid)
        if self.policy is not None:
            self.enf.remove_sandbox(self.cgid)
        self.aud.close()
        self.enf.close()
        return totals


class Floor:
    """Programs that return at once, attached at the given tracepoints and raw tracepoints."""

    def __init__(self, tps, raws):
        from bcc import BPF
        self.bpf = BPF(text=b"int floor_tp(void *ctx) { return 0; }\nint floor_raw(void *ctx) { return 0; }\n")
        try:
            for tp in tps:
                self.bpf.attach_tracepoint(tp=tp, fn_name=b"floor_tp")
            for tp in raws:
                self.bpf.attach_raw_tracepoint(tp=tp, fn_name=b"floor_raw")
        except BaseException:
            self.bpf.cleanup()
            raise
        self.progs = Progs(("floor", self.bpf))

    def close(self) -> None:
        self.bpf.cleanup()


def attach_points(loaded: "Loaded") -> tuple[list, list]:
    """The tracepoints and raw tracepoints both sensors have attached now."""
    tps, raws = set(), set()
    for b in (loaded.aud.bpf, loaded.enf.bpf):
        tps |= set(b.tracepoint_fds)
        raws |= set(b.raw_tracepoint_fds)
    return sorted(tps), sorted(raws)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer operations per run")
    ap.add_argument("--compare", metavar="REV", action="append", default=[],
                    help="also load the sensors from REV's bpf/ (git; or a bpf/ directory), alternately; repeatable")
    ap.add_argument("--policy", metavar="NAME|FILE",
                    help="also enforce this policy on the sandbox cgroup (its syscall programs run; no seccomp "
                         "filter is installed here); default: none (`dsec run` enforces `default` unless told otherwise: "
                         "--policy default is what it runs)")
    ap.add_argument("--no-stats", action="store_true",
                    help="leave the kernel's run-time statistics off (~20-30 ns a program run less in every column "
                         "but base; no per-program figures)")
    ap.add_argument("--floor", action="store_true",
                    help="also run the workloads with empty programs at the sensors' hooks (the hooks' own cost)")
    a = ap.parse_args(argv)
    policy = None
    if a.policy:
        from policies.load import load_policy
        policy = load_policy(a.policy)
    from agent.sensors.audit import cgroup2_mount
    from agent.sensors import common
    root = cgroup2_mount()
    tag = uuid.uuid4().hex[:8]
    cgs = {k: os.path.join(root, f"dsec-kcost-{k}-{tag}") for k in ("sandbox", "other")}
    d = f"/tmp/dsec-kcost-{tag}"
    os.mkdir(d)
    builds = [("head", common.BPF_DIR)]
    try:        # the builds first: a revision that cannot be read leaves no cgroup behind
        for i, rev in enumerate(a.compare):
            if os.path.isdir(rev):
                builds.insert(i, (f"dir{i}" if len(a.compare) > 1 else "dir", os.path.abspath(rev)))  # as it is
                continue
            rd = f"{d}-rev{i}"
            os.mkdir(rd)
            got = subprocess.run(["git", "-C", os.path.dirname(common.BPF_DIR), "archive", rev, "bpf"],
                                 capture_output=True)
            if got.returncode != 0:
                raise SystemExit(f"bench/kcost.py: --compare {rev}: neither a directory nor a git revision "
                                 f"with a bpf/ tree")
            arch = got.stdout
            subprocess.run(["tar", "-x", "-C", rd], input=arch, check=True)
            builds.insert(i, (rev, os.path.join(rd, "bpf")))
    except BaseException:
        subprocess.run(["rm", "-rf", d] + [f"{d}-rev{i}" for i in range(len(a.compare))], check=False)
        raise
    for p in cgs.values():
        os.mkdir(p)
    wls = workloads(a.quick, d)
    places = ["base"] + [f"{b}:{w}" for b, _ in builds for w in ("sandbox", "other")] + (["floor"] if a.floor else [])
    hooks = None                    # (tracepoints, raw tracepoints) of the first build, for --floor
    times = {(w, pl): [] for w, _, _ in wls for pl in places}
    prog_delta: dict = {}
    lost = {}
    stats_fd = -1 if a.no_stats else enable_stats()
    loaded = None

    def base_round():
        for w, n, argv_ in wls:
            times[(w, "base")].append(run_in(cgs["other"] + "/cgroup.procs", argv_) / n)
    try:
        print(f"== kernel cost: {a.runs} round(s); ops per run: " + ", ".join(f"{w} {n}" for w, n, _ in wls)
              + "; builds: " + ", ".join(b for b, _ in builds), flush=True)
        for w, n, argv_ in wls:           # warm-up
            run_in(cgs["other"] + "/cgroup.procs", argv_)
        for r in range(a.runs):
            base_round()
            for b, bdir in builds:
                use_bpf_dir(bdir)
                loaded = Loaded(cgs["sandbox"], f"kcost-{tag}-{b}-{r}", policy)
                if r == 0:
                    print(f"   {b}: sensors loaded in {loaded.load_s:.1f} s", flush=True)
                for w, n, argv_ in wls:
                    for where in ("sandbox", "other"):
                        s0 = loaded.progs.snap()
                        times[(w, f"{b}:{where}")].append(run_in(cgs[where] + "/cgroup.procs", argv_) / n)
                        for name, v in Progs.delta(s0, loaded.progs.snap()).items():
                            prog_delta.setdefault((b, w, where, name), []).append(v)
                if hooks is None:
                    hooks = attach_points(loaded)
                t = loaded.close()
                loaded = None
                lost[b] = lost.get(b, 0) + t["lost_total"]
            if a.floor:
                floor = Floor(*hooks)
                try:
                    if r == 0:
                        print(f"   floor: empty programs at {len(hooks[0])} tracepoints and {len(hooks[1])} raw "
                              f"tracepoints", flush=True)
                    for w, n, argv_ in wls:
                        s0 = floor.progs.snap()
                        times[(w, "floor")].append(run_in(cgs["sandbox"] + "/cgroup.procs", argv_) / n)
                        for name, v in Progs.delta(s0, floor.progs.snap()).items():
                            prog_delta.setdefault(("floor", w, "sandbox", name), []).append(v)
                finally:
                    floor.close()
        base_round()
    finally:
        if loaded is not None:
            loaded.close()
        if stats_fd >= 0:
            os.close(stats_fd)
        for p in cgs.values():
            for _ in range(100):
                try:
                    os.rmdir(p)
                    break
                except OSError:
                    time.sleep(0.05)
        subprocess.run(["rm", "-rf", d] + [f"{d}-rev{i}" for i in range(len(a.compare))], check=False)

    hdr = "".join(f"{pl:>16}{'ratio':>7}" for pl in places[1:])
    print(f"\nus per operation, medians; ratio = to base (no BPF program loaded), same run")
    print(f"{'workload':9}{'base':>9}{hdr}")
    for w, n, _ in wls:
        b = med(times[(w, "base")]) * 1e6
        cells = "".join(f"{med(times[(w, pl)]) * 1e6:>16.2f}{med(times[(w, pl)]) * 1e6 / b:>6.2f}x"
                        for pl in places[1:])
        print(f"{w:9}{b:>9.2f}{cells}")
    print("kernel lost in the sandbox: " + ", ".join(f"{b} {n}" for b, n in lost.items()))
    if a.no_stats:
        print("per program: not measured (--no-stats)")
        return 0
    for where, title in (("sandbox", "in the sandbox"),
                         ("other", "outside any sandbox (all programs that ran meanwhile, any process)")):
        print_progs(prog_delta, wls, builds + ([("floor", None)] if a.floor and where == "sandbox" else []),
                    where, title)
    return 0


def print_progs(prog_delta: dict, wls, builds, where: str, title: str) -> None:
    print(f"\nper program {title} (medians over runs): runs per op, ns per run, ns per op")
    for w, n, _ in wls:
        for b, _ in builds:
            rows = []
            for (bb, ww, wh, name), xs in prog_delta.items():
                if (bb, ww, wh) != (b, w, where):
                    continue
                cnt = med(c for _, c in xs)
                if cnt == 0:
                    continue
                nsr = med(ns / c for ns, c in xs if c)
                rows.append((nsr * cnt / n, name, cnt / n, nsr))
            rows.sort(reverse=True)
            print(f"  {w} [{b}]: BPF total {sum(r[0] for r in rows):.0f} ns per op")
            for per_op, name, rpo, nsr in rows[:10]:
                print(f"    {name:52}{rpo:>7.2f}{nsr:>9.0f}{per_op:>9.0f}")


if __name__ == "__main__":
    entry(main, "bench/kcost.py")
