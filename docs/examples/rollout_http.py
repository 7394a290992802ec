#!/usr/bin/env python3
"""The same rollout loop through the HTTP API a trainer already speaks
(SandboxFusion's POST /run_code on the node agent): N trajectories of M steps,
each step one request (SandboxFusion keeps no session, so each step is its own
sandbox: the trajectory's state travels in `files` and comes back through
`fetch_files`), every request labelled with the run, the trajectory and the
step (X-Dsec-Labels). Prints throughput and, per trajectory, its sandboxes'
audit records. Standard library only (what any trainer process has).

    python3 docs/examples/rollout_http.py --url http://trainer-1:TOKEN@127.0.0.1:8080/run_code -n 8 -m 4

Needs a `dsec agent` with an `http:` listener (docs/trainers.md).
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor


def post(url: str, payload: dict, labels: dict) -> dict:
    """One /run_code call; credentials in the URL become Basic auth (as `requests` does)."""
    u = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json",
               "X-Dsec-Labels": ",".join(f"{k}={v}" for k, v in labels.items())}
    if u.username:
        cred = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        url = urllib.parse.urlunsplit((u.scheme, u.hostname + (f":{u.port}" if u.port else ""), u.path,
                                       u.query, u.fragment))
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    for attempt in range(20):
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 429:                      # the node is full: back off, try again
                raise
            time.sleep(float(e.headers.get("Retry-After") or 1) * (1 + attempt / 4))
    raise RuntimeError("the node stayed over capacity")


STEP = ("import json, os\n"
        "st = json.load(open('state.json')) if os.path.exists('state.json') else {'total': 0}\n"
        "st['total'] += {inc}\n"
        "json.dump(st, open('state.json', 'w'))\n"
        "print(st['total'])\n")


def trajectory(url: str, run_id: str, t: int, steps: int) -> dict:
    state = None
    out = {"trajectory": f"t-{t}", "rewards": [], "sandboxes": []}
    for s in range(steps):
        payload = {"code": STEP.replace("{inc}", str(t * (s + 1))), "language": "python", "run_timeout": 30,
                   "files": {"state.json": state} if state else {}, "fetch_files": ["state.json"]}
        d = post(url, payload, {"run": run_id, "trajectory": f"t-{t}", "step": str(s)})
        out["sandboxes"].append(d["dsec"]["sandbox_id"])
        ok = d["status"] == "Success"
        out["rewards"].append(float(d["run_result"]["stdout"]) if ok else None)
        state = d["files"].get("state.json", state)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the /run_code URL (credentials in it, as a trainer's config has)")
    ap.add_argument("--trajectories", "-n", type=int, default=8)
    ap.add_argument("--steps", "-m", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="trajectories in flight")
    a = ap.parse_args()
    run_id = "rollout-" + uuid.uuid4().hex[:8]
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.concurrency) as ex:
        futs = [ex.submit(trajectory, a.url, run_id, t, a.steps) for t in range(a.trajectories)]
    results, failed = [], []
    for f in futs:
        try:
            results.append(f.result())
        except Exception as e:  # noqa: BLE001
            failed.append(e)
    wall = time.monotonic() - t0
    steps = sum(len(r["rewards"]) for r in results)
    print(f"run {run_id}: {len(results)} trajectories x {a.steps} steps in {wall:.1f}s: "
          f"{steps / wall:.1f} requests/s, {len(results) / wall:.2f} trajectories/s ({len(failed)} failed)")
    for r in results:
        print(f"  {r['trajectory']:6} rewards {r['rewards']}  audit: dsec replay {r['sandboxes'][0]} ... "
              f"(all: dsec agent ls --label run={run_id} --label trajectory={r['trajectory']})")
    for e in failed:
        print(f"  failed: {e!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
