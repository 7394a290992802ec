"""What a durable spool append waits for on this machine: fdatasync of a small append, back
to back and after the machine was idle for a while, beside what the host's block device and
idle states are.

usage:
  .venv/bin/python bench/fsync.py                 # in the spool's directory (DSEC_SPOOL_DIR)
  .venv/bin/python bench/fsync.py --dir /tmp --runs 300

Each case appends 600 bytes (an agent record's size) to a scratch file and times the
fdatasync, --runs times:
  back-to-back   the next append right after the last fdatasync returned
  sleep G ms     the thread sleeps G ms between them (the machine idles, as a node agent does
                 between requests)
  spin G ms      the thread spins G ms between them (its vCPU does not halt)
  sleep 5 ms, a spinner on CPU n   the same as "sleep 5 ms", this process on another CPU and a
                 busy child process pinned to the CPU the block interrupt is bound to (that
                 vCPU never halts), when there is one to name
A durable append of the agent (a CreateSandbox's records, a close's) is one such append and
fdatasync; bubblewrap and crun write nothing durable. Also printed: the guest's cpuidle driver
(`none`: an idle vCPU halts at once and the hypervisor must wake it) and the CPUs the block
device's interrupts are bound to. Measured on the 2-vCPU VM (docs/launch-figures.md): 0.05 ms
back to back, 0.7-1.2 ms after 5 ms idle, 0.1 ms with a busy loop on the interrupt's vCPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _common import entry, pct


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def block_irqs() -> list[tuple[str, str]]:
    """(name, cpus) of each block-device interrupt (virtio ...-req, nvme, ...)."""
    out = []
    for line in _read("/proc/interrupts").splitlines()[1:]:
        head, _, rest = line.partition(":")
        name = rest.split()[-1] if rest.split() else ""
        if head.strip().isdigit() and ("req" in name or "nvme" in name or "blk" in name):
            out.append((name, _read(f"/proc/irq/{head.strip()}/effective_affinity_list")))
    return out


def spinner(cpu: int) -> int:
    """A child process spinning on `cpu` (bounded: it exits after 60 s); its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {cpu})
            end = time.monotonic() + 60
            while time.monotonic() < end:
                pass
        finally:
            os._exit(0)
    return pid


def case(fd: int, runs: int, gap: float, spin: bool) -> list[float]:
    ts = []
    for _ in range(runs):
        os.write(fd, b"x" * 600)
        t = time.perf_counter()
        os.fdatasync(fd)
        ts.append(time.perf_counter() - t)
        if spin:
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
        elif gap:
            time.sleep(gap)
    return ts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.environ.get("DSEC_SPOOL_DIR") or "/var/lib/dsec",
                    help="a directory on the file system to measure (default: the spool's)")
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    if not os.path.isdir(a.dir):
        raise SystemExit(f"bench/fsync.py: --dir {a.dir}: not a directory")
    irqs = block_irqs()
    print(f"fdatasync of a 600-byte append in {a.dir}, {a.runs} runs each (ms); cpuidle driver: "
          f"{_read('/sys/devices/system/cpu/cpuidle/current_driver')}; block interrupts: "
          f"{', '.join(f'{n} on CPU {c}' for n, c in irqs) or 'none found'}")
    fd, path = tempfile.mkstemp(prefix="dsec-bench-fsync-", dir=a.dir)
    try:
        base = None
        print(f"  {'case':16s} {'median':>7s} {'p90':>7s} {'p99':>7s}")
        for label, gap, spin in [("back-to-back", 0.0, False), ("sleep 1 ms", 0.001, False),
                                 ("sleep 5 ms", 0.005, False), ("sleep 20 ms", 0.02, False),
                                 ("spin 5 ms", 0.005, True)]:
            ts = case(fd, a.runs, gap, spin)
            m = statistics.median(ts)
            base = base or m
            print(f"  {label:16s} {1e3 * m:7.3f} {1e3 * pct(ts, 90):7.3f} {1e3 * pct(ts, 99):7.3f}"
                  f"   {m / base:5.1f}x back-to-back")
        cpus = sorted(os.sched_getaffinity(0))
        irq_cpu = irqs[0][1] if len(irqs) == 1 and irqs[0][1].isdigit() else None
        if irq_cpu is not None and int(irq_cpu) in cpus and len(cpus) > 1:
            mine = os.sched_getaffinity(0)
            pid = spinner(int(irq_cpu))
            try:
                os.sched_setaffinity(0, set(cpus) - {int(irq_cpu)})
                ts = case(fd, a.runs, 0.005, False)
            finally:
                os.sched_setaffinity(0, mine)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            m = statistics.median(ts)
            print(f"  sleep 5 ms, a spinner on CPU {irq_cpu} (the interrupt's; this process on the others): "
                  f"{1e3 * m:.3f} {1e3 * pct(ts, 90):.3f} {1e3 * pct(ts, 99):.3f}   {m / base:5.1f}x back-to-back")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    entry(main, "bench/fsync.py")
