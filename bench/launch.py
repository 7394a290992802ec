#!/usr/bin/env python3
"""Sandbox launch latency: dsec vs bubblewrap vs plain fork+exec, in one run.

usage:
  .venv/bin/python bench/launch.py            # 200 runs of each
  .venv/bin/python bench/launch.py --runs 50

Measures, N times each, interleaved so that machine noise hits all alike:
  fork+exec     posix_spawn of /bin/true, waited (the floor)
  bwrap         bubblewrap with the same namespaces (pid, mount, ipc, uts, net),
                read-only /usr with the merged-usr symlinks, /proc, /dev, tmpfs /tmp
  dsec-cli      `dsec run -- /bin/true` (a new Python process each time)
  dsec-inproc   launcher.launch() called from this process: the sandbox cost
                without the interpreter start-up of the CLI
Prints min / median / p90 / p99 in ms and the ratios against bwrap and fork+exec.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DSEC = os.path.join(ROOT, ".venv", "bin", "dsec")


def bwrap_cmd():
    cmd = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + d
        if os.path.islink(p):
            cmd += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            cmd += ["--ro-bind", p, p]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "/bin/true"]
    return cmd


def timed(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    from agent.launcher import SandboxSpec, launch

    devnull = open(os.devnull, "wb")
    bw = bwrap_cmd()

    def fork_exec():
        pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
        os.waitpid(pid, 0)

    def bwrap():
        subprocess.run(bw, check=True, stdout=devnull, stderr=devnull)

    def dsec_cli():
        subprocess.run([DSEC, "run", "--sandbox-id", f"bench-{os.getpid()}", "--", "/bin/true"],
                       check=True, stdout=devnull, stderr=devnull)

    def dsec_inproc():
        r = launch(SandboxSpec(argv=["/bin/true"], sandbox_id=f"benchp-{os.getpid()}"),
                   stdio={"child": [0, 1, 2], "relay": {}, "close_after_fork": []})
        assert r.exit_code == 0

    cases = {"fork+exec": fork_exec, "bwrap": bwrap, "dsec-cli": dsec_cli, "dsec-inproc": dsec_inproc}
    for fn in cases.values():   # warm caches (base rootfs, page cache)
        fn()
    res = {k: [] for k in cases}
    for i in range(a.runs):
        for k, fn in cases.items():
            res[k].append(timed(fn))
    print(f"launch latency of /bin/true, {a.runs} runs each (ms)")
    print(f"{'':12} {'min':>8} {'median':>8} {'p90':>8} {'p99':>8}")
    for k, xs in res.items():
        print(f"{k:12} {min(xs):8.2f} {statistics.median(xs):8.2f} {pct(xs, 90):8.2f} {pct(xs, 99):8.2f}")
    med = {k: statistics.median(v) for k, v in res.items()}
    print("ratios of medians:")
    for k in ("dsec-cli", "dsec-inproc"):
        print(f"  {k}/bwrap      {med[k] / med['bwrap']:7.2f}")
        print(f"  {k}/fork+exec  {med[k] / med['fork+exec']:7.2f}")


if __name__ == "__main__":
    main()
