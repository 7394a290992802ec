#!/usr/bin/env bash
# make demo: run a small untrusted-looking workload in an audited sandbox, then
# show what it did, read back from ClickHouse.
set -euo pipefail
cd "$(dirname "$0")/.."
DSEC=.venv/bin/dsec
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
SID="demo-$(date +%H%M%S)-$$"
echo "== dsec run --sandbox-id $SID: a workload that execs, connects, writes and tries to escape"
set +e
$DSEC run --sandbox-id "$SID" --memory 256M --pids 64 --timeout 60 --summary-json "$OUT/summary.json" -- sh -c '
  echo "hostname: $(hostname)   user: $(id -un)   PID 1: $(cat /proc/1/comm)"
  cat /etc/shadow 2>&1 | head -1
  unshare -U true 2>&1 | head -1
  cat > /workspace/fetch.py <<PY
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 8080)); srv.listen(1)
c = socket.socket(); c.connect(("127.0.0.1", 8080)); print("connected to a local listener")
try:
    socket.create_connection(("127.0.0.1", 9), 1)
except OSError as e:
    print("closed port:", e.strerror)
PY
  python3 /workspace/fetch.py
  mkdir -p /workspace/out && date > /workspace/out/stamp && mv /workspace/out/stamp /workspace/out/stamp.txt
  rm /workspace/fetch.py
  echo "6.6.6.6 evil" >> /etc/hosts 2>&1 | head -1
  exit 3'
rc=$?
set -e
echo "== exit status: $rc"
echo "== summary ($OUT/summary.json):"
.venv/bin/python - "$OUT/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
for k in ("sandbox_id", "exit_code", "signal", "timed_out", "oom_killed", "wall_ms", "cpu_ms", "max_rss_bytes"):
    print(f"  {k:14} {s[k]}")
a = s.get("audit") or {}
print(f"  audit          {a.get('events')} events, {a.get('lost')} lost, {a.get('exported')} exported to ClickHouse")
print("  changes:")
for c in s["changes"]:
    print(f"    {c['change']:9} {c['kind']:8} {c['path']}" + (f"  ({c['size']} bytes, sha256 {c['sha256'][:16]}…)" if c.get("sha256") else ""))
PY
echo
echo "== dsec replay $SID   (read back from ClickHouse)"
$DSEC replay "$SID"
