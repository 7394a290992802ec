"""eBPF compile + load time of the two sensors (BCC), against a trivial BCC program.

Each sensor's source text is compiled, loaded and attached the way its loader
does it (agent/sensors/audit.py / enforce.py compile_bpf: the same cflags, -g0,
the DSEC_ATTACH_ALSO tracepoints; for the enforcement sensor also its four
cgroup sock_addr programs, which EnforcementSensor loads itself) --runs times,
interleaved with the baseline: one empty tracepoint program, which costs what
BCC costs before our code (three clang passes over the kernel headers and
BCC's helpers). Each sensor twice: compiled (DSEC_BPF_CACHE=off) and loaded
from the program cache (agent/sensors/bpfcache.py; a temporary cache filled
before the timed runs, removed after). Printed: median and minimum seconds, the
ratio to the baseline's median, programs, BPF instructions and the verifier's
processed instructions (bpf_prog_info.verified_insns). Then --agent-starts
times a node agent's start (`dsec agent`, no warm pool: from the spawn to its
first answer) with the cache off and from the warm cache, alternating.

    .venv/bin/python bench/compile.py [--runs 5] [--agent-starts 3]

Nothing is left behind (each BPF object is cleaned up at once).
"""
from __future__ import annotations

import argparse
import ctypes as ct
import os
import shutil
import struct
import tempfile
import time

from statistics import median as med

from _common import entry

TRIVIAL = b"TRACEPOINT_PROBE(sched, sched_process_exit) { return 0; }"


def _prog_counts(fd: int) -> tuple[int, int]:
    """(instructions as loaded, instructions the verifier processed) of a program fd."""
    from agent.sensors import bpfsys
    info = (ct.c_uint8 * 256)()
    attr = bpfsys._attr()
    bpfsys._put(attr, "<IIQ", 0, fd, ct.sizeof(info), ct.addressof(info))
    bpfsys._bpf(bpfsys.BPF_OBJ_GET_INFO_BY_FD, attr)
    raw = bytes(info)
    return struct.unpack_from("<I", raw, 20)[0] // 8, struct.unpack_from("<I", raw, 216)[0]


def _audit():
    from agent.sensors import audit
    return audit.compile_bpf(audit.build_cflags(ring_bytes=audit.DEFAULT_RING_BYTES, argv_bytes=audit.DEFAULT_ARGV_BYTES,
                                                max_args=audit.DEFAULT_MAX_ARGS, max_inflight=audit.DEFAULT_MAX_INFLIGHT))


def _enforce():
    from bcc import BPF
    from agent.sensors import enforce
    b = enforce.compile_bpf(enforce.build_cflags(ring_bytes=enforce.DEFAULT_RING_BYTES))
    for name, attach_type in enforce.EGRESS_PROGS:
        b.load_func(name.encode(), BPF.CGROUP_SOCK_ADDR, attach_type=attach_type)
    return b


def _trivial():
    from bcc import BPF
    return BPF(text=TRIVIAL)


def _agent_start(where: str) -> float:
    """Seconds from spawning a node agent (no warm pool) to its first answer, with DSEC_BPF_CACHE=where."""
    from launch import BenchAgent
    os.environ["DSEC_BPF_CACHE"] = where
    t = time.perf_counter()
    a = BenchAgent(0)
    took = time.perf_counter() - t
    a.stop()
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--agent-starts", type=int, default=3, help="node agent starts each way (0: none)")
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="dsec-bench-bpf-")
    cases = {"trivial": (_trivial, "off"), "audit": (_audit, "off"), "enforcement": (_enforce, "off"),
             "audit cached": (_audit, cache), "enforce cached": (_enforce, cache)}
    times = {k: [] for k in cases}
    counts = {}
    try:
        os.environ["DSEC_BPF_CACHE"] = cache
        _audit().cleanup()
        _enforce().cleanup()
        starts = {"off": [], cache: []}
        if args.agent_starts:
            _agent_start(cache)              # its audit text (with the cwd pins) differs from the one above
        for _ in range(args.agent_starts):
            for where in starts:
                starts[where].append(_agent_start(where))
        for _ in range(args.runs):
            for name, (build, where) in cases.items():
                os.environ["DSEC_BPF_CACHE"] = where
                t = time.perf_counter()
                b = build()
                times[name].append(time.perf_counter() - t)
                if where != "off" and type(b).__name__ != "CachedBPF":
                    raise SystemExit(f"bench/compile.py: {name} was compiled, not loaded from the cache")
                per = [_prog_counts(f.fd) for f in b.funcs.values()]
                counts[name] = (len(per), sum(p[0] for p in per), sum(p[1] for p in per))
                b.cleanup()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    base = med(times["trivial"])
    print(f"eBPF compile + load + attach, {args.runs} runs (BCC; baseline: a trivial BCC program)")
    print(f"{'':14s} {'median s':>9s} {'min s':>7s} {'x trivial':>10s} {'programs':>9s} {'insns':>7s} {'verified':>9s}")
    for name in cases:
        n, insns, verified = counts[name]
        print(f"{name:14s} {med(times[name]):9.2f} {min(times[name]):7.2f} {med(times[name]) / base:10.1f} "
              f"{n:9d} {insns:7d} {verified:9d}")
    if args.agent_starts:
        off, on = med(starts["off"]), med(starts[cache])
        print(f"node agent start to its first answer, {args.agent_starts} each (median s): cache off {off:.2f}, "
              f"from the cache {on:.2f} ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    entry(main, "bench/compile.py")
