#!/usr/bin/env python3
"""What a trainer gets from one node: requests per second and latency (median, p99)
of a one-line Python program through SandboxFusion's POST /run_code on the node
agent, against the same program through the blocking Python SDK, and against the
program without dsec, in one run, at concurrency 1, 16 and 64.

usage:
  .venv/bin/python bench/trainer.py                  # 15 s per case
  .venv/bin/python bench/trainer.py --seconds 5      # quicker
  .venv/bin/python bench/trainer.py --concurrency 1,8

One `dsec agent` started by this script (own socket, spool in a temp dir, eBPF
audit on, exporting to ClickHouse), with a warm pool of --warm sandboxes of
256 MiB and its HTTP listener on a free loopback port (unauthenticated:
loopback only). The cases, each run by C client threads for --seconds:

  http        POST /run_code {"code": "print(1)", "language": "python"}, a new
              connection per request (what verl's requests.post does); one
              request = one sandbox from the warm pool: dsec's writer puts the
              code in a file, python3 runs it, the sandbox is closed after the
              answer
  sdk         the blocking SDK: create (warm) + exec ["python3", "-c", "print(1)"]
              + close, one sandbox per request too
  no-dsec     the program as a plain host process (subprocess.run of /usr/bin/python3,
              the interpreter the sandbox runs): the floor

Prints requests/s, median and p99 latency per case and concurrency, the ratios
http/sdk and http/no-dsec, and the requests answered 429 or failed (none
expected: --max-inflight defaults to the largest concurrency). No timing is
asserted anywhere; the numbers are for reading.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import entry, finish, pct, ratio, table  # noqa: E402
from launch import BenchAgent  # noqa: E402

CODE = "print(1)"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_case(fn, concurrency: int, seconds: float) -> dict:
    """fn() -> True (ok) | "429" | False, called by `concurrency` threads for `seconds`."""
    stop_at = time.monotonic() + seconds
    lat, busy, failed = [], [0], [0]
    lock = threading.Lock()

    def worker():
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            try:
                r = fn()
            except Exception as e:  # noqa: BLE001
                r = False
                print(f"  !! {type(e).__name__}: {e}", file=sys.stderr)
            dt = time.perf_counter() - t
            with lock:
                if r is True:
                    lat.append(dt)
                elif r == "429":
                    busy[0] += 1
                else:
                    failed[0] += 1
    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    return {"n": len(lat), "rps": len(lat) / wall, "median": pct(lat, 50), "p99": pct(lat, 99),
            "busy": busy[0], "failed": failed[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="per case and concurrency")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--warm", type=int, default=8, help="warm sandboxes kept ready")
    ap.add_argument("--max-inflight", type=int, default=0, help="http.max_inflight (default: the largest concurrency)")
    a = ap.parse_args()
    t_start = time.monotonic()
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    port = _free_port()
    agent = BenchAgent(a.warm, extra={
        "warm_pool": [{"name": "bench", "count": a.warm, "memory": "256M", "pids": 256}],
        "http": {"listen": f"127.0.0.1:{port}", "unauthenticated": True, "profile": "bench",
                 "max_inflight": a.max_inflight or max(levels), "queue_timeout_seconds": 30}})
    url = f"http://127.0.0.1:{port}/run_code"
    body = json.dumps({"code": CODE, "language": "python"}).encode()
    warm_hits = [0, 0]
    hits_lock = threading.Lock()

    def http():
        req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                d = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return "429" if e.code == 429 else False
        with hits_lock:
            warm_hits[0] += bool(d["dsec"].get("warm"))
            warm_hits[1] += 1
        return d["status"] == "Success" and d["run_result"]["stdout"] == "1\n"

    def sdk():
        sb = agent.client.create(memory="256M", pids=256)
        try:
            r = sb.exec(["python3", "-c", CODE], timeout=30)
        finally:
            sb.close()
        return r.code == 0 and r.stdout == b"1\n"

    def plain():
        r = subprocess.run(["/usr/bin/python3", "-c", CODE], capture_output=True)     # the sandbox's python3
        return r.returncode == 0 and r.stdout == b"1\n"

    results = {}
    ok = True
    try:
        agent.wait_warm(a.warm)
        print(f"agent up ({a.warm} warm sandboxes of 256 MiB); {a.seconds:g}s per case\n")
        for c in levels:
            for name, fn in (("no-dsec", plain), ("sdk", sdk), ("http", http)):
                agent.wait_warm(a.warm, timeout=30)
                results[(name, c)] = r = run_case(fn, c, a.seconds)
                print(f"  {name:8} c={c:<3} {r['rps']:7.1f} req/s  median {r['median'] * 1000:7.1f} ms  "
                      f"p99 {r['p99'] * 1000:7.1f} ms  ({r['n']} ok, {r['busy']} x 429, {r['failed']} failed)")
                ok = ok and r["failed"] == 0
    finally:
        agent.stop()
    rows = []
    for c in levels:
        h, s, p = results[("http", c)], results[("sdk", c)], results[("no-dsec", c)]
        rows.append([f"c={c}", f"{h['rps']:.1f}", f"{s['rps']:.1f}", f"{p['rps']:.1f}",
                     f"{h['median'] * 1000:.0f} / {h['p99'] * 1000:.0f}", f"{s['median'] * 1000:.0f} / {s['p99'] * 1000:.0f}",
                     ratio(h["rps"], s["rps"]), ratio(h["median"], s["median"]), ratio(h["median"], p["median"]),
                     h["busy"] + s["busy"]])
    print("\nrequests/s and latency (ms, median / p99) of print(1), one sandbox per request:")
    print(table(["", "http rps", "sdk rps", "no-dsec rps", "http ms", "sdk ms", "http/sdk rps",
                 "http/sdk median", "http/no-dsec median", "429s"], rows))
    if warm_hits[1]:
        print(f"\nhttp: {warm_hits[0]} of {warm_hits[1]} requests ran on a warm sandbox")
    finish(t_start, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    entry(main, "bench/trainer.py")
