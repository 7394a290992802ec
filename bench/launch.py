#!/usr/bin/env python3
"""Sandbox launch latency: dsec vs bubblewrap, crun and plain fork+exec, in one run;
then sandboxes per second sustained through the node agent.

usage:
  .venv/bin/python bench/launch.py            # 200 runs of each
  .venv/bin/python bench/launch.py --runs 50
  .venv/bin/python bench/launch.py --runs 50 --no-agent    # only the in-process cases
  .venv/bin/python bench/launch.py --runs 500 --only fork+exec,agent-step --sustain 0 --burst 0 --idle 0
                                              # the step figure alone
  .venv/bin/python bench/launch.py --scratch memory        # the agents' writable layers in memory

Measures, N times each, interleaved so that machine noise hits all alike:
  fork+exec     posix_spawn of /bin/true, waited (the floor)
  bwrap         bubblewrap with the same namespaces (pid, mount, ipc, uts, net),
                read-only /usr with the merged-usr symlinks, /proc, /dev, tmpfs /tmp
  crun          Debian's crun with a config.json generated for the same namespaces, a read-only
                root with /usr bound read-only, /proc, /dev, tmpfs /tmp, no cgroup manager
                (`crun run`: create + start + wait + delete). On a hybrid-cgroup host crun 1.8
                refuses ("cgroups in hybrid mode not supported"): it then runs in a private mount
                namespace of this benchmark's own with cgroup2 mounted at /sys/fs/cgroup (the
                host's layout unchanged), or is printed as unavailable with the reason
  py-start      the CLI's interpreter start-up alone (`python -S -c pass`, the same venv: the CLI
                runs without site, agent/entry.py)
  py-imports    start-up + what `dsec run` imports on its way to the agent (its fast path:
                agent/entry.py, agent/commands/run.py, the run socket's client; an older tree's CLI,
                argparse and agent/cli.py, where it has no run.fast)
  dsec-cli      `dsec run -- /bin/true` (a new Python process each time, in-process: DSEC_AGENT=off)
  dsec-inproc   launcher.launch() called from this process: the sandbox cost
                without the interpreter start-up of the CLI
  agent-cold    through a `dsec agent` started by this script (own socket, spool in a temp dir,
                eBPF audit on, exporting to ClickHouse): CreateSandbox (no warm sandbox) +
                Exec /bin/true + CloseSandbox, from the Python SDK
  agent-warm    the same, the request matching the agent's warm-pool profile (4 sandboxes kept
                ready, refilled in the background); the share of requests served warm is printed
  agent-once-cold, agent-once-warm  the same two as one RunOnce call (Client.run_once: create +
                exec + close in one unary call), against the same agent in the same run
  agent-step    one more step (Exec /bin/true) in a live sandbox of that agent, from the SDK (over
                the agent's run socket: docs/agent.md "Steps over the run socket")
  agent-step-grpc  the same step over gRPC (Client(step_socket=False)), in a sandbox of its own
  dsec-cli-agent `dsec run -- /bin/true` with the agent running (the CLI's start-up + the agent;
                it returns once the run's audit record is durable in the agent's spool); this is
                also `dsec run` with no agent of the user's (DSEC_AGENT=auto starts one on first use
                and later runs reuse it)
  dsec-cli-agent-export  the same with --wait-export (returns once ClickHouse has the record)
  dsec-cli-agent-warm  `dsec run --memory 128M --pids 256 -- /bin/true`: the request in the agent's
                warm-pool profile shape (as a plain `dsec run` is for the agent `dsec run` starts on
                first use: agent/node/via_agent.py WARM_POOL); the share served warm is printed
Prints min / median / p90 / p99 in ms and the ratios against bwrap and fork+exec.

Then sandboxes per second through the agent (create + exec /bin/true + close,
64 MiB each, no CPU quota, cold) at concurrency 1, 8 and 32 (--levels), each for
--sustain seconds (default 15), with the agent's CPU per sandbox (utime + stime, and
the two apart: its Python and its system calls) and its threads' context switches per
sandbox (each a hand-off between threads: a wake-up paid on both sides; a lower bound, as
the switches of threads that ended meanwhile are not counted): three calls
(CreateSandbox, Exec, CloseSandbox) and one RunOnce, alternating at each level, so the
ratio once / calls comes from the same minute.

Then, each with an agent of its own:
  burst         --burst requests (default 1,000; create + exec /bin/true + close in the warm
                profile's shape, one RunOnce each), 32 in flight, from a warm pool of
                --burst-pool (default 100) that refills as it drains: wall time, how many were
                served warm, failures,
                agent CPU per request; requests not started within 120 s are not sent
  idle          --idle idle live sandboxes (default 500; 32 MiB, 16 pids, 0.1 CPU): memory per
                sandbox = PSS of its dsec-init + the agent's PSS growth / N; 50 sequential cold
                create + exec + close and 200 steps in one more sandbox, before the idle ones are
                created and beside them (what a close or a step pays for every other live
                sandbox); then all closed

Each phase (the latency runs, each sustained level, the burst) also prints the share of the
machine's CPU time the hypervisor stole meanwhile (/proc/stat "steal"): on these shared VMs it
ran from 1% to 38% within one minute, and the same tree's sustained rate from 83/s to 41/s with
it; a figure is only comparable with one measured at a like steal.
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import cpu_times, entry, pct, steal_since, timed  # noqa: E402

DSEC = _common.DSEC         # --cli: another tree's CLI (and agent), measured by this bench's code
PARALLEL_STARTS = None      # --parallel-starts: the bench agent's scheduling.max_parallel_starts (None: its default)
SCRATCH = "disk"            # --scratch: the bench agents' host.scratch (memory: writable layers on a tmpfs)


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


class Crun:
    """crun with a generated bundle (see the module doc). .why is set when it cannot run."""

    def __init__(self):
        import json
        import shutil
        import tempfile
        self.why, self.note, self._ns, self._holder, self.n = "", "", -1, None, 0
        if not shutil.which("crun"):
            self.why = "crun is not installed (Debian package crun)"
            return
        self.dir = tempfile.mkdtemp(prefix="dsec-bench-crun-")
        root = os.path.join(self.dir, "rootfs")
        for d in ("usr", "proc", "dev", "tmp"):
            os.makedirs(os.path.join(root, d))
        for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            if os.path.islink("/" + d):
                os.symlink(os.readlink("/" + d), os.path.join(root, d))
        r = subprocess.run(["crun", "spec"], cwd=self.dir, capture_output=True, text=True)
        if r.returncode != 0:
            self.why = f"crun spec failed: {r.stderr.strip()}"
            return
        path = os.path.join(self.dir, "config.json")
        with open(path) as f:
            c = json.load(f)
        c["process"].update(args=["/bin/true"], terminal=False)
        c["root"] = {"path": "rootfs", "readonly": True}
        c["mounts"] = [m for m in c["mounts"] if m["destination"] in ("/proc", "/dev")] + [
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro", "nosuid", "nodev"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}]
        c["linux"].pop("resources", None)
        c["linux"]["namespaces"] = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]
        with open(path, "w") as f:
            json.dump(c, f)
        err = self._try()
        if err and "hybrid mode" in err:
            first = err
            err = self._private_cgroup2()
            if err:
                self.why = f"{first} (and in a private mount namespace with its own cgroup2 mount: {err})"
            else:
                self.note = ("crun runs in a private mount namespace with cgroup2 mounted at /sys/fs/cgroup: "
                             f"on this hybrid-cgroup host it refuses otherwise ({first})")
        elif err:
            self.why = err

    def _try(self) -> str:
        self.n += 1
        r = subprocess.run(["crun", "--cgroup-manager=disabled", "run", "-b", self.dir, f"dsec-bench-{os.getpid()}-"
                            f"{self.n}"], capture_output=True, text=True, preexec_fn=self._enter)
        return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]

    def _enter(self):
        if self._ns >= 0:
            import ctypes
            if ctypes.CDLL(None, use_errno=True).setns(self._ns, 0x00020000) != 0:   # CLONE_NEWNS
                os._exit(121)

    def _private_cgroup2(self) -> str:
        """A child that holds a mount namespace of its own: / private, cgroup2 at /sys/fs/cgroup."""
        script = ("import ctypes,os,sys\n"
                  "libc=ctypes.CDLL(None,use_errno=True)\n"
                  "assert libc.unshare(0x00020000)==0, 'unshare'\n"
                  "assert libc.mount(b'none',b'/',None,(1<<18)|(1<<14),None)==0, 'make-rprivate'\n"
                  "assert libc.mount(b'cgroup2',b'/sys/fs/cgroup',b'cgroup2',0,None)==0, 'mount cgroup2'\n"
                  "print('ok',flush=True)\nsys.stdin.read()\n")
        self._holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._holder.stdout.readline().strip()
        if line != "ok":
            err = self._holder.stderr.read().strip().splitlines()
            self._holder.wait()
            self._holder = None
            return f"cannot set it up: {err[-1] if err else 'exited'}"
        self._ns = os.open(f"/proc/{self._holder.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        return self._try()

    def run(self):
        err = self._try()
        if err:
            raise RuntimeError(f"crun: {err}")

    def close(self):
        """Idempotent: also run at exit (a bench that ends early, e.g. its agent not coming up)."""
        import shutil
        if self._ns >= 0:
            os.close(self._ns)
            self._ns = -1
        if self._holder is not None:
            self._holder.stdin.close()
            self._holder.wait(10)
            self._holder = None
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class BenchAgent:
    """A `dsec agent` of this benchmark's own: socket, run dir and spool in a temp dir."""

    def __init__(self, warm_count: int, extra: dict | None = None):
        import tempfile
        import yaml
        self.dir = tempfile.mkdtemp(prefix="dsec-bench-agent-")
        self.socket = os.path.join(self.dir, "run", "agent.sock")
        cfg = {"socket": self.socket, "log_level": "warning",
               "capacity": {"cpu_oversubscription": 64, "reserve_memory": "1G"},
               "scheduling": {"tick_seconds": 0.1},
               "warm_pool": [{"name": "bench", "count": warm_count, "memory": "128M", "pids": 256}]}
        if PARALLEL_STARTS:
            cfg["scheduling"]["max_parallel_starts"] = PARALLEL_STARTS
        if SCRATCH != "disk":
            cfg["host"] = {"scratch": SCRATCH}
        cfg.update(extra or {})         # other benches' additions (bench/trainer.py: the http listener)
        with open(os.path.join(self.dir, "agent.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)
        env = dict(os.environ, DSEC_SPOOL_DIR=os.path.join(self.dir, "spool"))
        env.pop("DSEC_AGENT_SOCKET", None)
        self.log = open(os.path.join(self.dir, "agent.log"), "wb")
        try:
            self.proc = subprocess.Popen([DSEC, "agent", "--config", os.path.join(self.dir, "agent.yaml")],
                                         env=env, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        except OSError as e:        # no such CLI (--cli): nothing of ours is left behind
            import shutil
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise SystemExit(f"bench: cannot start the agent {DSEC}: {e.strerror or e}")
        from agent.node.client import AgentError, Client
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self._give_up(f"bench: the agent exited ({self.proc.returncode})")
            if os.path.exists(self.socket):
                try:
                    self.client = Client(self.socket, connect_timeout=2)
                    caps = self.client.capabilities(timeout=5)
                    scratch = [d for d in caps.get("degraded", []) if "scratch" in d]
                    if scratch:
                        self.stop()
                        raise SystemExit(f"bench: {scratch[0]}")
                    break
                except AgentError:
                    self.client.close()
            if time.monotonic() > deadline:
                self._give_up("bench: the agent did not come up")
            time.sleep(0.2)

    def _give_up(self, why: str):
        """The agent did not come up: its process stopped, its temp dir removed, its log's tail said."""
        import shutil
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        with open(self.log.name, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace").strip().splitlines()[-3:]
        shutil.rmtree(self.dir, ignore_errors=True)
        raise SystemExit(why + (": " + " / ".join(tail) if tail else ""))

    def wait_warm(self, n, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.client.capabilities()["warm_profiles"][0]["ready"] >= n:
                return True
            time.sleep(0.1)
        return False

    def stop(self):
        """Idempotent: also run at exit (a bench that ends before its own stop)."""
        import shutil
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def sustained(agent, concurrency: int, seconds: float, once: bool = False) -> tuple[int, float, int]:
    """Sandboxes (create + exec /bin/true + close; once: one RunOnce call) completed per second
    by `concurrency` SDK threads for `seconds`. Returns (completed, rate, failures)."""
    import threading
    from agent.node.client import AgentError
    stop_at = time.monotonic() + seconds
    done, failed = [0], [0]
    lock = threading.Lock()

    def worker():
        while time.monotonic() < stop_at:
            try:
                if once:
                    r = agent.client.run_once(["/bin/true"], memory="64M", pids=64, warm=False)
                else:
                    sb = agent.client.create(memory="64M", pids=64, warm=False)   # no CPU quota
                    r = sb.exec(["/bin/true"])
                    sb.close()
                ok = r.code == 0
            except AgentError:
                ok = False
            with lock:
                if ok:
                    done[0] += 1
                else:
                    failed[0] += 1
    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return done[0], done[0] / (time.monotonic() - t0), failed[0]


def usage(pid: int) -> tuple[float, float, int]:
    """(utime s, stime s, context switches) of process pid, all its threads: the user part is
    the agent's Python (and libraries), the kernel part its syscalls, and the switches (voluntary
    and not, of every thread alive now: an ended thread's are lost with it, so a difference
    is a lower bound, and a low one where connection threads came and went) its hand-offs
    between threads, each a wake-up paid on both sides (~20-40 us of CPU on this VM)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    switches = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:        # voluntary_... and nonvoluntary_...
                        switches += int(line.split()[1])
        except OSError:
            continue
    return int(fields[11]) / tick, int(fields[12]) / tick, switches


def usage_since(pid: int, before: tuple, n: int, unit: str = "sandbox") -> tuple[float, str]:
    """The agent's CPU per `unit` since `before` (usage()) in ms, and that figure said: split,
    with its switches per `unit`."""
    u, k, sw = (a - b for a, b in zip(usage(pid), before))
    n = max(1, n)
    cpu = (u + k) * 1000 / n
    return cpu, (f"agent CPU {cpu:.1f} ms per {unit} (user {u * 1000 / n:.1f}, kernel "
                 f"{k * 1000 / n:.1f}; >= {max(0, sw) / n:.0f} context switches)")


def pss_kib(pid: int) -> int:
    """Proportional set size of process pid (KiB): shared pages split among their users."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def inits_of(agent_pid: int) -> list[int]:
    """The dsec-init processes (sandbox PID 1s, seen from the host) under the agent."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        comm = st[st.index("(") + 1:st.rindex(")")]
        ppid = int(st.rpartition(")")[2].split()[1])
        if comm == "dsec-init" and ppid == agent_pid:
            out.append(int(d))
    return out


def burst(n: int, pool: int, concurrency: int, limit_s: float = 120.0) -> dict:
    """n requests (create + exec /bin/true + close, the warm profile's shape) from `concurrency`
    SDK threads against an agent with a warm pool of `pool` (refilled as it drains), all
    submitted at once. Bounded: requests not started within limit_s are not sent."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from agent.node.client import AgentError
    agent = BenchAgent(warm_count=pool)
    try:
        ready = agent.wait_warm(pool, timeout=180)
        hits, failed, lock = [0], [], threading.Lock()
        give_up = [0.0]

        def one(i):
            if time.monotonic() > give_up[0]:
                return
            try:
                if hasattr(agent.client, "run_once"):
                    r = agent.client.run_once(["/bin/true"], memory="128M", pids=256)
                    warm = r.warm
                else:                               # an older SDK: three calls
                    sb = agent.client.create(memory="128M", pids=256)
                    r = sb.exec(["/bin/true"])
                    sb.close()
                    warm = sb.created.warm
                with lock:
                    hits[0] += warm
                    if r.code != 0:
                        failed.append(f"exit {r.code}")
            except AgentError as e:
                with lock:
                    failed.append(str(e)[:200])
        use0, t0 = usage(agent.proc.pid), time.monotonic()
        give_up[0] = t0 + limit_s
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(one, range(n)))
        wall = time.monotonic() - t0
        _, said = usage_since(agent.proc.pid, use0, n, "request")
        return {"n": n, "once": hasattr(agent.client, "run_once"), "pool": pool, "pool_ready": ready, "wall_s": wall, "warm": hits[0], "failed": failed,
                "agent_usage": said}
    finally:
        agent.stop()


def sequence(client, n: int = 50, steps: int = 200) -> dict:
    """n sequential cold create + exec /bin/true + close (after 5 not counted), then `steps` steps
    in one more live sandbox: medians in ms, and the steps' p99."""
    t = {"create": [], "exec": [], "close": []}
    for i in range(n + 5):
        t0 = time.perf_counter()
        sb = client.create(memory="64M", pids=64, warm=False)
        t1 = time.perf_counter()
        assert sb.exec(["/bin/true"]).code == 0
        t2 = time.perf_counter()
        sb.close()
        if i >= 5:
            for k, d in zip(t, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                t[k].append(d)
    sb = client.create(memory="64M", pids=64, warm=False)
    st = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            assert sb.exec(["/bin/true"]).code == 0
            st.append(time.perf_counter() - t0)
    finally:
        sb.close()
    out = {k: 1000 * statistics.median(v) for k, v in t.items()}
    out.update(step=1000 * statistics.median(st), step_p99=1000 * pct(st, 99))
    return out


def idle_memory(n: int, concurrency: int = 16) -> dict:
    """n idle live sandboxes (32 MiB, 16 pids, 0.1 CPU, not from a warm pool): the PSS of each
    sandbox's init plus the agent's growth (PSS) per sandbox; the same sequence of sandboxes and
    steps (sequence()) before they are created and beside them; then all closed."""
    from concurrent.futures import ThreadPoolExecutor
    from agent.node.client import AgentError
    agent = BenchAgent(warm_count=0)
    sbs, errors = [], []
    try:
        alone = sequence(agent.client)
        time.sleep(1.0)
        base = pss_kib(agent.proc.pid)

        def create(i):
            try:
                return agent.client.create(memory="32M", pids=16, cpus=0.1, warm=False)
            except AgentError as e:
                errors.append(str(e)[:200])
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as ex:
            sbs = [s for s in ex.map(create, range(n)) if s is not None]
        create_s = time.monotonic() - t0
        time.sleep(2.0)                     # the background work of the last starts settles
        agent_kib = pss_kib(agent.proc.pid) - base
        inits = inits_of(agent.proc.pid)
        init_kib = sum(pss_kib(p) for p in inits)
        live = len(sbs)
        beside = sequence(agent.client)
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(lambda sb: sb.close(), sbs))
        sbs = []
        per = (agent_kib + init_kib) / max(1, live)
        return {"n": n, "live": live, "inits": len(inits), "create_s": create_s, "errors": errors[:3],
                "agent_kib": agent_kib / max(1, live), "init_kib": init_kib / max(1, len(inits) or 1),
                "per_kib": per, "alone": alone, "beside": beside}
    finally:
        for sb in sbs:
            try:
                sb.close()
            except AgentError:
                pass
        agent.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--no-agent", action="store_true", help="skip the node agent cases")
    ap.add_argument("--sustain", type=float, default=15.0, help="seconds per concurrency level (agent)")
    ap.add_argument("--levels", default="1,8,32", help="the concurrency levels of the sustained rate, "
                                                       "comma-separated (the first is the ratios' base)")
    ap.add_argument("--burst", type=int, default=1000, help="requests of the warm-pool burst (0: skip)")
    ap.add_argument("--burst-pool", type=int, default=100, help="the warm pool the burst is served from")
    ap.add_argument("--idle", type=int, default=500, help="idle live sandboxes for the memory figure (0: skip)")
    ap.add_argument("--skip", default="", help="latency cases to leave out, comma-separated (e.g. dsec-cli: "
                                               "~6 s a run in-process)")
    ap.add_argument("--only", default="", help="latency cases to keep, comma-separated, e.g. fork+exec,agent-step "
                                               "(the others are left out)")
    ap.add_argument("--cli", metavar="PATH", help="the dsec CLI (and agent) to measure, e.g. another tree's "
                                                  ".venv/bin/dsec for a before/after pair with this bench's code "
                                                  "(default: this tree's)")
    ap.add_argument("--parallel-starts", type=int, metavar="N",
                    help="the bench agent's scheduling.max_parallel_starts (default: the agent's own, 8; "
                         "this bench set 16 until 2026-12-04, which cost the burst ~40%%: docs/launch-figures.md)")
    ap.add_argument("--scratch", choices=("disk", "memory"), default="disk",
                    help="the bench agents' host.scratch: where the sandboxes' writable layers live "
                         "(memory: a tmpfs on the state dir's sandboxes directory; docs/launcher.md)")
    a = ap.parse_args()
    global DSEC, PARALLEL_STARTS, SCRATCH
    SCRATCH = a.scratch
    if a.cli:
        DSEC = os.path.abspath(a.cli)
    PARALLEL_STARTS = a.parallel_starts
    from agent.sandbox.launcher import SandboxSpec, launch

    devnull = open(os.devnull, "wb")
    bw = bwrap_cmd()

    def fork_exec():
        pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
        os.waitpid(pid, 0)

    def bwrap():
        subprocess.run(bw, check=True, stdout=devnull, stderr=devnull)

    cli_env = dict(os.environ, DSEC_AGENT="off")

    def dsec_cli():
        subprocess.run([DSEC, "run", "--sandbox-id", f"bench-{os.getpid()}", "--", "/bin/true"],
                       check=True, stdout=devnull, stderr=devnull, env=cli_env)

    def dsec_inproc():
        r = launch(SandboxSpec(argv=["/bin/true"], sandbox_id=f"benchp-{os.getpid()}"),
                   stdio={"child": [0, 1, 2], "relay": {}, "close_after_fork": []})
        assert r.exit_code == 0

    crun = Crun()
    atexit.register(crun.close)     # its bundle is removed however the bench ends (closed below as well)
    py = os.path.join(os.path.dirname(DSEC), "python")
    tree = os.path.dirname(os.path.dirname(os.path.dirname(DSEC)))
    old_cli = not open(os.path.join(tree, "agent", "commands", "run.py")).read().count("def fast(")
    fast_imports = (f"import sys; sys.path.insert(0, {tree!r}); "
                    + ("import agent.cli; agent.cli.build_parser('run'); " if old_cli else "import agent.entry; ")
                    + "import agent.commands.run, agent.node.via_agent, agent.node.runclient")

    def py_start():
        subprocess.run([py, "-S", "-c", "pass"], check=True)

    def py_imports():
        subprocess.run([py, "-S", "-c", fast_imports], check=True)

    cases = {"fork+exec": fork_exec, "bwrap": bwrap}
    if not crun.why:
        cases["crun"] = crun.run
    cases.update({"py-start": py_start, "py-imports": py_imports, "dsec-cli": dsec_cli, "dsec-inproc": dsec_inproc})
    agent = None
    live = []
    grpc_live = []                  # agent-step-grpc's client and sandbox
    warm_hits = [0, 0, 0, 0]
    cli_warm_ids = []               # dsec-cli-agent-warm's sandboxes
    if not a.no_agent:
        agent = BenchAgent(warm_count=4)
        atexit.register(agent.stop)
        agent_env = dict(os.environ, DSEC_AGENT_SOCKET=agent.socket)
        agent.wait_warm(4)

        def agent_cold():
            sb = agent.client.create(memory="128M", pids=256, warm=False)
            assert sb.exec(["/bin/true"]).code == 0
            sb.close()

        def agent_warm():
            sb = agent.client.create(memory="128M", pids=256)
            warm_hits[0] += sb.created.warm
            warm_hits[1] += 1
            assert sb.exec(["/bin/true"]).code == 0
            sb.close()

        def agent_once_cold():
            assert agent.client.run_once(["/bin/true"], memory="128M", pids=256, warm=False).code == 0

        def agent_once_warm():
            r = agent.client.run_once(["/bin/true"], memory="128M", pids=256)
            warm_hits[2] += r.warm
            warm_hits[3] += 1
            assert r.code == 0

        def agent_step():
            if not live:
                live.append(agent.client.create(memory="128M", pids=256, warm=False))
            assert live[0].exec(["/bin/true"]).code == 0

        def agent_step_grpc():
            if not grpc_live:
                from agent.node.client import Client
                c = Client(agent.socket, step_socket=False)
                grpc_live[:] = [c, c.create(memory="128M", pids=256, warm=False)]
            assert grpc_live[1].exec(["/bin/true"]).code == 0

        def dsec_cli_agent():
            subprocess.run([DSEC, "run", "--", "/bin/true"], check=True, stdout=devnull, stderr=devnull,
                           env=agent_env)

        def dsec_cli_agent_export():
            subprocess.run([DSEC, "run", "--wait-export", "--", "/bin/true"], check=True, stdout=devnull,
                           stderr=devnull, env=agent_env)

        def dsec_cli_agent_warm():
            r = subprocess.run([DSEC, "run", "--memory", "128M", "--pids", "256", "--", "/bin/true"], check=True,
                               stdout=devnull, stderr=subprocess.PIPE, env=agent_env)
            cli_warm_ids.append(r.stderr.split(b"dsec: sandbox ", 1)[1].split()[0].decode())
        cases.update({"agent-cold": agent_cold, "agent-warm": agent_warm, "agent-once-cold": agent_once_cold,
                      "agent-once-warm": agent_once_warm, "agent-step": agent_step,
                      "agent-step-grpc": agent_step_grpc,
                      "dsec-cli-agent": dsec_cli_agent, "dsec-cli-agent-export": dsec_cli_agent_export,
                      "dsec-cli-agent-warm": dsec_cli_agent_warm})
        if not hasattr(agent.client, "run_once"):     # an older SDK (this bench run against an older tree)
            del cases["agent-once-cold"], cases["agent-once-warm"]
        if not hasattr(agent.client, "_steps"):       # an SDK without the step socket: agent-step is gRPC
            del cases["agent-step-grpc"]
    only = set(filter(None, a.only.split(",")))
    for k in only - set(cases):
        raise SystemExit(f"bench: --only {k}: no such case ({', '.join(cases)})")
    for k in [k for k in cases if only and k not in only] + list(filter(None, a.skip.split(","))):
        if k not in cases:
            raise SystemExit(f"bench: --skip {k}: no such case ({', '.join(cases)})")
        del cases[k]
    try:
        for fn in cases.values():   # warm caches (base rootfs, page cache)
            fn()
        warm_hits[:] = [0, 0, 0, 0]
        del cli_warm_ids[:]
        res = {k: [] for k in cases}
        machine0 = cpu_times()
        for i in range(a.runs):
            for k, fn in cases.items():
                res[k].append(timed(fn) * 1000)
        print(f"launch latency of /bin/true, {a.runs} runs each (ms; the machine: {steal_since(machine0)}"
              f"{'; the agents: host.scratch memory' if SCRATCH != 'disk' else ''})")
        print(f"{'':22} {'min':>8} {'median':>8} {'p90':>8} {'p99':>8}")
        for k, xs in res.items():
            print(f"{k:22} {min(xs):8.2f} {statistics.median(xs):8.2f} {pct(xs, 90):8.2f} {pct(xs, 99):8.2f}")
        if crun.why:
            print(f"crun: unavailable: {crun.why}")
        elif crun.note:
            print(f"crun: {crun.note}")
        med = {k: statistics.median(v) for k, v in res.items()}
        print("ratios of medians:")
        anchors = [b for b in ("bwrap", "crun", "fork+exec") if b in med]
        for k in ("dsec-cli", "dsec-inproc", "agent-cold", "agent-warm", "agent-once-cold", "agent-once-warm",
                  "agent-step", "agent-step-grpc", "dsec-cli-agent", "dsec-cli-agent-export",
                  "dsec-cli-agent-warm"):
            if k in med:
                print(f"  {k:22} " + "  ".join(f"{med[k] / med[b]:7.2f}x {b}" for b in anchors))
        for k in ("cold", "warm"):
            if f"agent-once-{k}" in med:
                print(f"  agent-once-{k} / agent-{k}: {med[f'agent-once-{k}'] / med[f'agent-{k}']:.2f}x "
                      f"(one RunOnce call vs three calls; p99 {pct(res[f'agent-once-{k}'], 99):.1f} vs "
                      f"{pct(res[f'agent-{k}'], 99):.1f} ms)")
        if "agent-step" in med and "fork+exec" in med:
            print(f"  agent-step - fork+exec: {med['agent-step'] - med['fork+exec']:.2f} ms "
                  f"(target <= 1 ms); p99 {pct(res['agent-step'], 99):.2f} ms (target <= 5 ms)")
        for k in ("dsec-cli-agent", "dsec-cli-agent-warm"):
            if k in med and "py-start" in med and "py-imports" in med:
                print(f"  {k} {med[k]:.1f} ms, of which interpreter start-up "
                      f"{med['py-start']:.1f} ms and imports {med['py-imports'] - med['py-start']:.1f} ms")
        if cli_warm_ids:
            n_warm = sum(agent.client.get(i).warm for i in cli_warm_ids)
            print(f"dsec-cli-agent-warm: {n_warm} of {len(cli_warm_ids)} runs took a warm sandbox")
        if agent is not None:
            print(f"agent-warm: {warm_hits[0]} of {warm_hits[1]} requests took a warm sandbox, agent-once-warm "
                  f"{warm_hits[2]} of {warm_hits[3]} (the pool of 4 refills in the background)")
            if a.sustain > 0:
                print(f"\nsandboxes per second through the agent (create + exec /bin/true + close, cold, "
                      f"{a.sustain:g} s each; three calls, then one RunOnce):")
            base = None
            for conc in [int(x) for x in a.levels.split(",") if x] if a.sustain > 0 else ():
                got = {}
                for once in (False, True) if hasattr(agent.client, "run_once") else (False,):
                    use0, machine0 = usage(agent.proc.pid), cpu_times()
                    n, rate, failed = sustained(agent, conc, a.sustain, once=once)
                    cpu, said = usage_since(agent.proc.pid, use0, n)
                    got[once] = (rate, cpu)
                    base = base or rate
                    print(f"  concurrency {conc:2d} {'RunOnce' if once else '3 calls'}: {rate:6.1f}/s ({n} sandboxes, "
                          f"{failed} failed, {rate / base:4.2f}x the first level; {said}; "
                          f"{steal_since(machine0)}) (target >= 100/s)")
                if True in got:
                    print(f"  concurrency {conc:2d} RunOnce / 3 calls: {got[True][0] / got[False][0]:.2f}x "
                          f"sandboxes/s, {got[True][1] / max(got[False][1], 1e-9):.2f}x agent CPU per sandbox")
    finally:
        for sb in live + grpc_live[1:]:
            sb.close()
        if grpc_live:
            grpc_live[0].close()
        if agent is not None:
            agent.stop()
        crun.close()
    if agent is not None and a.burst:
        machine0 = cpu_times()
        b = burst(a.burst, a.burst_pool, 32)
        how = "one RunOnce" if b["once"] else "three calls"
        print(f"\nburst: {b['n']} requests (create + exec /bin/true + close: {how}), 32 at a time, from a warm pool of "
              f"{b['pool']} ({'ready' if b['pool_ready'] else 'NOT fully ready'} at the start, refilled as it "
              f"drains): {b['wall_s']:.1f} s (target <= 15 s), {b['warm']} served warm, {len(b['failed'])} failed"
              f"{' ' + repr(b['failed'][:2]) if b['failed'] else ''}; {b['agent_usage']}; {steal_since(machine0)}")
    if agent is not None and a.idle:
        m = idle_memory(a.idle)
        print(f"\nidle: {m['live']} of {m['n']} idle live sandboxes (created in {m['create_s']:.1f} s"
              f"{', errors ' + repr(m['errors']) if m['errors'] else ''}): per sandbox {m['per_kib'] / 1024:.2f} MiB "
              f"(target <= 5 MiB) = init PSS {m['init_kib'] / 1024:.2f} MiB ({m['inits']} inits) + agent PSS growth "
              f"{m['agent_kib'] / 1024:.2f} MiB")
        for what, label in (("alone", "no other sandbox"), ("beside", f"beside the {m['live']} idle")):
            q = m[what]
            print(f"  {label}: create {q['create']:.2f} exec {q['exec']:.2f} close {q['close']:.2f} ms (medians of 50, cold), "
                  f"step {q['step']:.2f} p99 {q['step_p99']:.2f} ms (200 steps)")


if __name__ == "__main__":
    entry(main, "bench/launch.py")
