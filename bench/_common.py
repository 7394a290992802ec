"""What the benchmarks share: paths, statistics, ratio tables, the sensors'
fixed costs, clean-up of their ClickHouse databases, and the entry point that
turns a failure into one line.

    from _common import ROOT, DSEC, entry, med, pct, ratio, table, sensor_costs, cpu_times, steal_since
    ...
    if __name__ == "__main__":
        entry(main, "bench/launch.py")

Every benchmark runs its baselines in the same process and run as what it
measures, and prints ratios (bench/README.md).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
DSEC = os.path.join(ROOT, ".venv", "bin", "dsec")
# a benchmark's `dsec run` measures what it names: it never starts a node agent on first use
# (DSEC_AGENT=auto, the CLI's default); bench/launch.py measures that path on its own
os.environ.setdefault("DSEC_AGENT", "reuse")


def timed(fn) -> float:
    """Seconds one call of fn() took."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_times() -> tuple[int, int]:
    """(all CPU time, stolen CPU time) of the machine so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    return sum(v[:8]), v[7]


def steal_since(before: tuple[int, int]) -> str:
    """The share of the machine's CPU time the hypervisor took since cpu_times() returned
    `before` ("steal 12%"): on a shared VM a figure measured while neighbours stole a third
    of the CPUs is not the figure of a quiet hour (here: 40-83 sandboxes/s, the same tree)."""
    total, steal = cpu_times()
    dt = total - before[0]
    return f"steal {(steal - before[1]) / dt:.0%}" if dt > 0 else "steal -"


def pct(xs, p: float) -> float:
    """The p-th percentile (nearest rank) of xs."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def med(rs, k):
    """Median of field k over a list of result dicts."""
    return statistics.median(r[k] for r in rs)


def ratio(a: float, b: float) -> str:
    """a / b as '12.3x' ('-' when b is 0 or either is missing)."""
    if not a or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x" if a / b < 10 else f"{a / b:.1f}x"


def table(headers: list[str], rows: list[list], indent: str = "  ") -> str:
    """Rows as a fixed-width text table (first column left-aligned, the rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        out.append(indent + "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    return "\n".join(out)


def sensor_costs() -> str:
    """Compile, load and attach of each eBPF sensor (BCC), and its close."""
    try:
        from agent.sensors.audit import AuditSensor
        from agent.sensors.enforce import EnforcementSensor
        parts = []
        for name, cls in (("audit", AuditSensor), ("enforcement", EnforcementSensor)):
            t = time.perf_counter()
            sensor = cls(on_record=lambda r: None, node="bench")
            t1 = time.perf_counter()
            sensor.close()
            parts.append(f"{name} sensor compile+load+attach {t1 - t:.2f}s, close {time.perf_counter() - t1:.2f}s")
        return "; ".join(parts)
    except Exception as e:                       # the sensors' API moved: say so, keep the rest
        return f"not measured ({type(e).__name__}: {e})"


def drop_database(client, db: str) -> None:
    """The bench's scratch ClickHouse database, dropped (a warning if it cannot be)."""
    try:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
        client.disconnect()
    except Exception as e:  # noqa: BLE001
        print(f"warning: database {db} not dropped: {e}", file=sys.stderr)


def finish(t_start: float, ok: bool = True) -> None:
    print(f"total bench time {time.monotonic() - t_start:.0f}s, load average now {os.getloadavg()[0]:.2f}"
          + ("" if ok else "; some checks FAILED (see !!)"))


def entry(main, name: str) -> None:
    """Run main(); a failure is one line (BENCH_DEBUG=1 for a traceback)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("BENCH_DEBUG"):
            raise
        sys.exit(f"{name}: {type(e).__name__}: {e}")
