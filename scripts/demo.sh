#!/usr/bin/env bash
# make demo: run a small untrusted-looking workload in a sandbox and show what it did.
set -euo pipefail
cd "$(dirname "$0")/.."
DSEC=.venv/bin/dsec
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "== dsec run: a workload that looks around, writes files and tries to escape"
set +e
$DSEC run --sandbox-id demo-$$ --memory 256M --pids 64 --timeout 30 --summary-json "$OUT/summary.json" -- sh -c '
  echo "hostname: $(hostname)   user: $(id -un)   pid of supervisor: $(cat /proc/1/comm)"
  echo "processes visible: $(ls /proc | grep -c "^[0-9]")"
  cat /etc/shadow 2>&1 | head -1
  ls /root 2>&1 | head -1
  echo "print(\"hello from python in the sandbox\")" > /workspace/hello.py
  python3 /workspace/hello.py
  mkdir -p /workspace/out && date > /workspace/out/stamp
  rm -f /workspace/hello.py.bak
  echo "tampering with /etc/hosts:"; echo "6.6.6.6 evil" >> /etc/hosts 2>&1 || true
  exit 3'
rc=$?
set -e
echo "== exit status: $rc"
echo "== summary ($OUT/summary.json):"
.venv/bin/python - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("sandbox_id", "exit_code", "signal", "timed_out", "oom_killed", "wall_ms", "cpu_ms", "max_rss_bytes")
for k in keys:
    print(f"  {k:14} {s[k]}")
print("  changes:")
for c in s["changes"]:
    print(f"    {c['change']:9} {c['kind']:8} {c['path']}" + (f"  ({c['size']} bytes, sha256 {c['sha256'][:16]}…)" if c.get("sha256") else ""))
PY
