#!/usr/bin/env bash
# dsec set-up: the one place where system and Python dependencies are installed
# and kernel prerequisites are checked. Idempotent; fast when everything is there.
#
#   scripts/setup.sh            # install what is missing, build .venv
#
# Needs root (apt-get, mounts). Exits non-zero with one clear line on failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs Debian packages, mounts tracefs)"

# --- Debian packages -------------------------------------------------------
PKGS=(
  python3 python3-venv python3-dev         # the venv is built on Debian's python (bcc, seccomp bindings live there)
  python3-bpfcc bpfcc-tools                # BCC (PyPI's "bcc" is unrelated)
  linux-headers-amd64                      # BCC compiles against these
  python3-seccomp                          # libseccomp's Python bindings
  clickhouse-server clickhouse-client      # the embedded audit store
  bubblewrap crun                          # baselines for bench/launch.py
  build-essential                          # cc for the sandbox init (agent/sandbox/init)
  nftables iproute2                        # NAT for --network egress; test hosts
  strace                                   # strace-style learning input
  golang-github-containers-common          # containers-common default seccomp profile (policy import tests)
  umoci skopeo                             # OCI image layouts and archives (dsec image import; test images)
  busybox-static                           # base layer of the test images (tests/images.py)
  criu                                     # process checkpoint for snapshots, behind feature detection
  procps psmisc curl ca-certificates
  g++ nodejs                               # toolchains of /run_code's cpp and nodejs (docs/trainers.md)
  chromium fonts-dejavu-core               # headless browser for tests/test_replay_browser.py (HTML incident report)
  zookeeper                                # distributed DDL (ON CLUSTER) of the two-shard ClickHouse in tests/test_cluster.py
  libpython3.11-testsuite                  # CPython's own test suite: a real workload for tests/test_learn_suites.py
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed"
  # clickhouse-server's postinst tries to start a system service; there is no init here.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/dsec-apt.log 2>&1 \
    || { tail -20 /tmp/dsec-apt.log >&2; die "apt-get install failed (log: /tmp/dsec-apt.log)"; }
fi

# --- kernel headers for BCC --------------------------------------------------
# The running kernel has no headers package here: link build/source to Debian's
# (build = arch-specific tree, source = the common tree, as Debian lays them out).
KREL="$(uname -r)"
HDR="$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1 || true)"
[ -n "$HDR" ] || die "no linux-headers-*-amd64 under /usr/src"
SRC="${HDR%-amd64}-common"
[ -d "$SRC" ] || SRC="$HDR"
mkdir -p "/lib/modules/$KREL"
[ "$(readlink "/lib/modules/$KREL/build" || true)" = "$HDR" ] || ln -sfn "$HDR" "/lib/modules/$KREL/build"
[ "$(readlink "/lib/modules/$KREL/source" || true)" = "$SRC" ] || ln -sfn "$SRC" "/lib/modules/$KREL/source"

# --- tracefs / bpffs ---------------------------------------------------------
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing \
  || die "cannot mount tracefs at /sys/kernel/tracing"
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf || die "cannot mount bpffs at /sys/fs/bpf"

# --- Python venv ---------------------------------------------------------------
PY=/usr/bin/python3
STAMP=.venv/.dsec-setup
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || [ ! -x .venv/bin/dsec ]; then
  say "building .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv || die "cannot create .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check --config-settings editable_mode=compat -e '.[test]' >/tmp/dsec-pip.log 2>&1 \
    || { tail -20 /tmp/dsec-pip.log >&2; die "pip install failed (log: /tmp/dsec-pip.log)"; }
  echo "$WANT" > "$STAMP"
fi
.venv/bin/python -c 'import bcc, seccomp' 2>/dev/null || die "bcc or seccomp bindings not importable from .venv"
# .venv/bin/dsec: pip's console script replaced by one that starts Python without `site`
# (agent/entry.py says why: ~23 ms of every `dsec run`; site runs at the first import
# that needs it)
ENTRY="$(printf '#!%s/.venv/bin/python -S\n# written by scripts/setup.sh (agent/entry.py)\nimport sys\nsys.path.insert(0, %s)\nfrom agent.entry import main\nsys.exit(main())\n' \
  "$ROOT" "'$ROOT'")"
if [ "$(cat .venv/bin/dsec 2>/dev/null || true)" != "$ENTRY" ]; then
  printf '%s\n' "$ENTRY" > .venv/bin/dsec.new && chmod 755 .venv/bin/dsec.new && mv .venv/bin/dsec.new .venv/bin/dsec
fi
.venv/bin/dsec --help >/dev/null || die ".venv/bin/dsec does not start"

# --- real third-party test suites (tests/suites.py: the learning fidelity matrix, bench/learn.py) ---
# Pinned PyPI packages that ship their own test suites, installed with --target
# under /usr/local: sandboxes see the host's /usr (read-only), not this .venv.
SUITES_DIR=/usr/local/lib/dsec-suites
for spec in tornado==6.4.2 dill==0.3.9; do
  name="${spec%%==*}"
  if [ ! -e "$SUITES_DIR/$name/.dsec-$spec" ]; then
    say "installing test suite $spec into $SUITES_DIR/$name"
    rm -rf "$SUITES_DIR/$name"
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$SUITES_DIR/$name" "$spec" \
      >/tmp/dsec-pip-suites.log 2>&1 || { tail -20 /tmp/dsec-pip-suites.log >&2; die "cannot install $spec"; }
    touch "$SUITES_DIR/$name/.dsec-$spec"
  fi
done
# --- the sandbox init ------------------------------------------------------------
# dsec-init (agent/sandbox/init/dsec-init.c) is PID 1 of every sandbox: a small static
# C program, rebuilt when its source is newer than the binary.
INIT_BIN=agent/sandbox/init/build/dsec-init
if [ ! -x "$INIT_BIN" ] || [ agent/sandbox/init/dsec-init.c -nt "$INIT_BIN" ] || [ agent/sandbox/init/proto.h -nt "$INIT_BIN" ]; then
  say "building $INIT_BIN"
  .venv/bin/python -c 'from agent.sandbox.plan import build_init; build_init()' || die "cannot build the sandbox init (agent/sandbox/init)"
fi
# exporters/build/libdsec_columns.so (exporters/columns.c): the spool append's records ->
# columns pass, loaded through ctypes; rebuilt when its source is newer (without it the
# spool does the same in Python, slower, and says so)
COLS_LIB=exporters/build/libdsec_columns.so
if [ ! -e "$COLS_LIB" ] || [ exporters/columns.c -nt "$COLS_LIB" ]; then
  say "building $COLS_LIB"
  .venv/bin/python -c 'from exporters.columns import build; build()' || die "cannot build $COLS_LIB (exporters/columns.c)"
fi
# agent/sensors/build/libdsec_batchdecode.so (agent/sensors/batchdecode.c): the batch decoder's
# loop for open_write/unlink records, loaded through ctypes (without it: the Python loop, slower)
BD_LIB=agent/sensors/build/libdsec_batchdecode.so
if [ ! -e "$BD_LIB" ] || [ agent/sensors/batchdecode.c -nt "$BD_LIB" ]; then
  say "building $BD_LIB"
  .venv/bin/python -c 'from agent.sensors.batchdecode import build_c; build_c()' || die "cannot build $BD_LIB (agent/sensors/batchdecode.c)"
fi
# agent/sandbox/build/libdsec_spawn.so (agent/sandbox/spawn.c): starts each sandbox's dsec-init
# with clone3 inside its cgroup (without it: posix_spawn and cgroup.procs writes, ~10 ms slower)
SPAWN_LIB=agent/sandbox/build/libdsec_spawn.so
if [ ! -e "$SPAWN_LIB" ] || [ agent/sandbox/spawn.c -nt "$SPAWN_LIB" ]; then
  say "building $SPAWN_LIB"
  .venv/bin/python -c 'from agent.sandbox.spawn import build; build()' || die "cannot build $SPAWN_LIB (agent/sandbox/spawn.c)"
fi
# agent/sandbox/build/libdsec_trees.so (agent/sandbox/trees.c): removes a closed sandbox's state
# directory in one call (without it: shutil.rmtree, a hand-off between the agent's threads per call)
TREES_LIB=agent/sandbox/build/libdsec_trees.so
if [ ! -e "$TREES_LIB" ] || [ agent/sandbox/trees.c -nt "$TREES_LIB" ]; then
  say "building $TREES_LIB"
  .venv/bin/python -c 'from agent.sandbox.trees import build; build()' || die "cannot build $TREES_LIB (agent/sandbox/trees.c)"
fi

# --- generated code -------------------------------------------------------------
# The agent's gRPC code is generated from agent/node/proto/*.proto (not kept in git);
# regenerated only when the .proto changed.
.venv/bin/python -m agent.node.proto.generate || die "cannot generate the agent's gRPC code (agent/node/proto)"
# byte-code for dsec's own modules: a CLI start (`dsec run`) then does not compile them from
# source, also where PYTHONDONTWRITEBYTECODE keeps Python from caching them (a stale .pyc is
# detected by its source's mtime and ignored)
.venv/bin/python -m compileall -q -j 0 agent audit_schema exporters policies replay >/dev/null \
  || die "python -m compileall failed"
say "ready: $ROOT/.venv/bin/dsec"
