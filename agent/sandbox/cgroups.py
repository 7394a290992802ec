"""Per-sandbox cgroups on hybrid (v1 controllers + cgroup2 "unified") and pure
cgroup v2 hosts.

The cgroup2 directory gives the sandbox its cgroup id (the directory's inode
number, what bpf_get_current_cgroup_id() returns): eBPF keys on it. Limits go
where the controllers are: the v1 memory/cpu/pids hierarchies on hybrid hosts,
the same cgroup2 directory on pure v2 hosts. /sys/fs/cgroup is never remounted.

Every cgroup dsec creates lives under a parent named "dsec" in each hierarchy,
so `dsec gc` can find what a crashed run left behind. Several agents on one
host each have a parent of their own (DSEC_CGROUP_PARENT, or the agent
config's host.cgroup_parent), so one never takes another's sandboxes for
orphans.
"""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from agent.errors import DsecError, EXIT_DSEC

CGROUP_ROOT = "/sys/fs/cgroup"
PARENT_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
PARENT = os.environ.get("DSEC_CGROUP_PARENT") or "dsec"
V1_CONTROLLERS = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000


class Layout:
    def __init__(self, mode: str, v2_root: str | None, v1_roots: dict | None = None):
        self.mode = mode                  # "hybrid" | "v2" | "v1"
        self.v2_root = v2_root            # cgroup2 mount (for ids and attach points)
        self.v1_roots = v1_roots or {}    # controller -> mount


def check_parent(name: str, what: str = "DSEC_CGROUP_PARENT") -> str:
    import re
    if not re.fullmatch(PARENT_RE, name):
        raise DsecError(f"{what}={name!r}: a cgroup name of 1-63 [A-Za-z0-9_.-], starting alphanumeric", 2)
    return name


_detected: dict = {}        # root -> its Layout (fixed at boot: looked at once per process)


def detect(root: str = CGROUP_ROOT) -> Layout:
    check_parent(PARENT)
    lay = _detected.get(root)
    if lay is None:
        lay = _detected[root] = _detect(root)
    return lay


def _detect(root: str) -> Layout:
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return Layout("v2", root)
    unified = os.path.join(root, "unified")
    v1 = {c: os.path.join(root, c) for c in V1_CONTROLLERS
          if os.path.exists(os.path.join(root, c, "cgroup.procs"))}
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        return Layout("hybrid", unified, v1)
    if v1:
        return Layout("v1", None, v1)
    raise DsecError(f"no cgroup hierarchy found under {root}", EXIT_DSEC)


def _write(path: str, value: str):
    # os.open/os.write: a Python file object adds an fstat, a TCGETS ioctl and an lseek to each
    # of the ~15 cgroup files a sandbox's start and end touch (each a release of the interpreter
    # lock, on a node whose agent threads contend for it)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str, default: str = "") -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return default
    try:
        out = b""
        while chunk := os.read(fd, 65536):
            out += chunk
        return out.decode()
    except OSError:
        return default
    finally:
        os.close(fd)


def _ensure_parent_v2(root: str):
    parent = os.path.join(root, PARENT)
    os.makedirs(parent, exist_ok=True)
    # Enable the controllers dsec limits with; needed on pure v2 hosts only.
    avail = _read(os.path.join(root, "cgroup.controllers")).split()
    want = [c for c in ("cpu", "memory", "pids") if c in avail]
    if want:
        for d in (root, parent):
            enabled = _read(os.path.join(d, "cgroup.subtree_control")).split()
            missing = [c for c in want if c not in enabled]
            if missing:
                try:
                    _write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in missing))
                except OSError as e:
                    raise DsecError(f"cannot enable cgroup controllers {missing} in {d}: {e.strerror}", EXIT_DSEC)
    return parent


def _mkdir_under_parent(path: str):
    """mkdir path, creating the "dsec" parent when it is missing (it is there but for a
    node's first sandbox: tried first, ~3 calls less a hierarchy); `dsec gc` may remove an
    empty parent between the two steps, so try again (bounded)."""
    for attempt in range(3):
        try:
            os.mkdir(path)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise
        os.makedirs(os.path.dirname(path), exist_ok=True)


def remove_empty_parents(layout: Layout) -> list[str]:
    """Remove the "dsec" parent cgroups that hold no sandbox (for `dsec gc`)."""
    removed = []
    roots = ([layout.v2_root] if layout.v2_root else []) + \
        (list(layout.v1_roots.values()) if layout.mode != "v2" else [])
    for r in roots:
        parent = os.path.join(r, PARENT)
        try:
            os.rmdir(parent)            # fails (EBUSY/ENOTEMPTY) while a sandbox cgroup is inside
            removed.append(parent)
        except OSError:
            pass
    return removed


def cgroup_populated(path: str | None, cgroup_id: int = 0) -> bool:
    """Whether a task may still run in cgroup2 directory `path` (or below it):
    False only when that is known not to be so -- its cgroup.events says
    "populated 0", or the directory is gone (only an empty cgroup can be
    removed); True otherwise (unreadable, no path, or another cgroup than
    `cgroup_id` there now). An empty cgroup stays empty: nothing of the
    sandbox's can run again, every task of it has passed cgroup_exit() in
    do_exit(), and with it its last BPF program (sched_process_exit runs
    before cgroup_exit; every program runs to its end in its task's context)."""
    if not path:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if cgroup_id and os.fstat(fd).st_ino != cgroup_id:
            return True
        efd = os.open("cgroup.events", os.O_RDONLY, dir_fd=fd)
        try:
            data = os.read(efd, 4096)
        finally:
            os.close(efd)
    except OSError as e:
        # ENOENT, or ENODEV from a node the kernel is removing: removed since it was opened
        # (it is the sandbox's: its id was checked), and only an empty cgroup is removed
        return e.errno not in (errno.ENOENT, errno.ENODEV)
    finally:
        os.close(fd)
    return b"populated 0\n" not in data


class SandboxCgroup:
    """The cgroups of one sandbox. Create, join (from the child), read stats, remove."""

    def __init__(self, layout: Layout, sandbox_id: str):
        self.layout = layout
        self.sandbox_id = sandbox_id
        self.v2_path = os.path.join(layout.v2_root, PARENT, sandbox_id) if layout.v2_root else None
        self.v1_paths = {c: os.path.join(r, PARENT, sandbox_id) for c, r in layout.v1_roots.items()} \
            if layout.mode != "v2" else {}
        self._oom_fd = -1               # the OOM-kill counter's file, opened at the first read (oom_kills)
        self._oom_lock = threading.Lock()

    def __del__(self):
        try:
            self.close_files()
        except Exception:  # noqa: BLE001 - a half-made object, or the interpreter's exit
            pass

    def close_files(self) -> None:
        """Close the files kept open (remove() does, before the rmdirs)."""
        with self._oom_lock:
            if self._oom_fd >= 0:
                os.close(self._oom_fd)
                self._oom_fd = -1

    @property
    def paths(self) -> list[str]:
        return ([self.v2_path] if self.v2_path else []) + list(self.v1_paths.values())

    @property
    def cgroup_id(self) -> int:
        """The cgroup2 id eBPF sees (0 when the host has no cgroup2)."""
        return os.stat(self.v2_path).st_ino if self.v2_path else 0

    def create(self, cpus: float | None, memory: int | None, pids: int | None):
        made = []
        try:
            if self.v2_path:
                if self.layout.mode == "v2":
                    _ensure_parent_v2(self.layout.v2_root)
                _mkdir_under_parent(self.v2_path)
                made.append(self.v2_path)
            for c, p in self.v1_paths.items():
                _mkdir_under_parent(p)
                made.append(p)
            self._set_limits(cpus, memory, pids)
        except FileExistsError as e:
            self._rmdirs(made)
            raise DsecError(f"cgroup {e.filename} already exists (sandbox id in use? try `dsec gc`)", EXIT_DSEC)
        except OSError as e:
            self._rmdirs(made)
            raise DsecError(f"cannot create cgroup {e.filename or ''}: {e.strerror}", EXIT_DSEC)

    def _set_limits(self, cpus, memory, pids):
        if self.layout.mode == "v2":
            d = self.v2_path
            if memory:
                _write(f"{d}/memory.max", str(memory))
                if os.path.exists(f"{d}/memory.swap.max"):
                    _write(f"{d}/memory.swap.max", "0")
            if cpus:
                _write(f"{d}/cpu.max", f"{int(cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")
            if pids:
                _write(f"{d}/pids.max", str(pids))
            return
        if memory and "memory" in self.v1_paths:
            d = self.v1_paths["memory"]
            _write(f"{d}/memory.limit_in_bytes", str(memory))
            try:
                _write(f"{d}/memory.memsw.limit_in_bytes", str(memory))
            except FileNotFoundError:       # a kernel without swap accounting
                pass
        if cpus and "cpu" in self.v1_paths:
            d = self.v1_paths["cpu"]
            _write(f"{d}/cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(f"{d}/cpu.cfs_quota_us", str(int(cpus * CFS_PERIOD_US)))
        if pids and "pids" in self.v1_paths:
            _write(f"{self.v1_paths['pids']}/pids.max", str(pids))

    def update_limits(self, cpus: float | None = None, memory: int | None = None, pids: int | None = None):
        """Change the limits of a live cgroup (None: unchanged; cpus 0: no CPU quota).
        v1's memsw limit must stay >= the memory limit, so the order depends on the direction.
        Raises OSError (e.g. EBUSY: v1 memory below current usage)."""
        if self.layout.mode == "v2":
            d = self.v2_path
            if memory is not None:
                _write(f"{d}/memory.max", str(memory))
            if cpus is not None:
                _write(f"{d}/cpu.max", f"{int(cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}" if cpus else
                       f"max {CFS_PERIOD_US}")
            if pids is not None:
                _write(f"{d}/pids.max", str(pids))
            return
        if memory is not None and "memory" in self.v1_paths:
            d = self.v1_paths["memory"]
            memsw = f"{d}/memory.memsw.limit_in_bytes"
            has_sw = os.path.exists(memsw)
            cur = int(_read(f"{d}/memory.limit_in_bytes", "0").strip() or 0)
            if has_sw and memory > cur:
                _write(memsw, str(memory))
            _write(f"{d}/memory.limit_in_bytes", str(memory))
            if has_sw and memory <= cur:
                _write(memsw, str(memory))
        if cpus is not None and "cpu" in self.v1_paths:
            d = self.v1_paths["cpu"]
            _write(f"{d}/cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(f"{d}/cpu.cfs_quota_us", str(int(cpus * CFS_PERIOD_US)) if cpus else "-1")
        if pids is not None and "pids" in self.v1_paths:
            _write(f"{self.v1_paths['pids']}/pids.max", str(pids))

    def limits(self) -> dict:
        """The limits in force: {"cpus": float|None, "memory": int|None, "pids": int|None}."""
        out = {"cpus": None, "memory": None, "pids": None}
        if self.layout.mode == "v2":
            d = self.v2_path
            q, _, per = _read(f"{d}/cpu.max").strip().partition(" ")
            mem = _read(f"{d}/memory.max").strip()
            pids = _read(f"{d}/pids.max").strip()
        else:
            c = self.v1_paths.get("cpu", "/nonexistent")
            q, per = _read(f"{c}/cpu.cfs_quota_us").strip(), _read(f"{c}/cpu.cfs_period_us").strip()
            mem = _read(f"{self.v1_paths.get('memory', '/nonexistent')}/memory.limit_in_bytes").strip()
            pids = _read(f"{self.v1_paths.get('pids', '/nonexistent')}/pids.max").strip()
        if q.lstrip("-").isdigit() and int(q) > 0 and per.isdigit() and int(per) > 0:
            out["cpus"] = int(q) / int(per)
        if mem.isdigit() and int(mem) < (1 << 62):
            out["memory"] = int(mem)
        if pids.isdigit():
            out["pids"] = int(pids)
        return out

    def join(self, pid: int = 0):
        """Move `pid` (0 = the calling process) into every cgroup of the sandbox.

        The cgroup2 directory comes last: the moment the process enters it,
        eBPF audits it, and dsec's own set-up writes should not be in the record."""
        for p in list(self.v1_paths.values()) + ([self.v2_path] if self.v2_path else []):
            _write(os.path.join(p, "cgroup.procs"), str(pid))

    # --- stats -----------------------------------------------------------------
    def oom_kills(self) -> int:
        """The sandbox's OOM kills so far (read twice per step: a pread of the file, opened once
        and kept until remove(); the lock keeps a closing thread from freeing the fd number under
        a read, which could then read another file's)."""
        with self._oom_lock:
            if self._oom_fd < 0:
                if self.layout.mode == "v2":
                    path = f"{self.v2_path}/memory.events"
                else:
                    path = f"{self.v1_paths.get('memory', '/nonexistent')}/memory.oom_control"
                try:
                    self._oom_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    return 0
            try:
                data = os.pread(self._oom_fd, 8192, 0)     # a cgroup file's offset 0: read afresh
            except OSError:
                return 0
        for line in data.splitlines():
            k, _, v = line.partition(b" ")
            if k == b"oom_kill":
                return int(v)
        return 0

    def memory_peak(self) -> int:
        if self.layout.mode == "v2":
            v = _read(f"{self.v2_path}/memory.peak").strip()
        else:
            v = _read(f"{self.v1_paths.get('memory', '/nonexistent')}/memory.max_usage_in_bytes").strip()
        return int(v) if v.isdigit() else 0

    def memory_current(self) -> int:
        """Bytes charged to the sandbox now (memory.current / memory.usage_in_bytes)."""
        if self.layout.mode == "v2":
            v = _read(f"{self.v2_path}/memory.current").strip()
        else:
            v = _read(f"{self.v1_paths.get('memory', '/nonexistent')}/memory.usage_in_bytes").strip()
        return int(v) if v.isdigit() else 0

    def cpu_stat(self) -> dict:
        """{"usage_usec", "nr_periods", "nr_throttled", "throttled_usec"} (0 where unknown):
        usage from cgroup2's cpu.stat (core accounting, present without the cpu controller),
        throttling from the cpu controller (cgroup2, or v1 cpu.stat on hybrid hosts)."""
        out = {"usage_usec": 0, "nr_periods": 0, "nr_throttled": 0, "throttled_usec": 0}
        if self.v2_path:
            for line in _read(f"{self.v2_path}/cpu.stat").splitlines():
                k, _, v = line.partition(" ")
                if k in out and v.strip().isdigit():
                    out[k] = int(v)
        if self.layout.mode != "v2" and "cpu" in self.v1_paths:
            for line in _read(f"{self.v1_paths['cpu']}/cpu.stat").splitlines():
                k, _, v = line.partition(" ")
                if not v.strip().isdigit():
                    continue
                if k in ("nr_periods", "nr_throttled"):
                    out[k] = int(v)
                elif k == "throttled_time":
                    out["throttled_usec"] = int(v) // 1000
        return out

    def can_freeze(self) -> bool:
        return bool(self.v2_path) and os.path.exists(f"{self.v2_path}/cgroup.freeze")

    def freeze(self, frozen: bool = True):
        """cgroup2's freezer (also on hybrid hosts: the unified hierarchy has it without
        controllers). Raises OSError where it is missing."""
        _write(f"{self.v2_path}/cgroup.freeze", "1" if frozen else "0")

    def frozen(self) -> bool:
        if not self.v2_path:
            return False
        for line in _read(f"{self.v2_path}/cgroup.events").splitlines():
            if line.startswith("frozen "):
                return line.split()[1] == "1"
        return False

    def pids(self) -> list[int]:
        out = set()
        for p in self.paths:
            for line in _read(os.path.join(p, "cgroup.procs")).split():
                out.add(int(line))
        return sorted(out)

    # --- teardown --------------------------------------------------------------
    def kill_all(self, timeout: float = 5.0):
        """SIGKILL every process left in the sandbox's cgroups and wait until empty.

        Never by a pid read from cgroup.procs alone (the pid may have been
        reused by then): cgroup.kill where the cgroup2 directory has it (the
        kernel kills the members, atomically against forks), else each listed
        pid through a pidfd opened first and signalled only if that pid is
        still a member after the pidfd pins the process."""
        kill_file = f"{self.v2_path}/cgroup.kill" if self.v2_path else None
        has_kill = kill_file is not None          # a kernel without it: the write below fails (ENOENT)
        deadline = time.monotonic() + timeout
        while True:
            if has_kill:
                try:
                    _write(kill_file, "1")
                except OSError:
                    has_kill = False
            if has_kill and not cgroup_populated(self.v2_path):
                # no task left anywhere in the cgroup2 subtree, which every process of the
                # sandbox is in (dsec-init is born in it; a process cannot leave it): one read
                # where the members of each hierarchy were four (v1's cgroup.procs also
                # costs the kernel a pid list destroyed a second later)
                return True
            left = self.pids()
            if not left:
                return True
            for pid in left:            # no cgroup.kill, or members of the v1 hierarchies only
                self._kill_member(pid)
            if time.monotonic() >= deadline:
                return not self.pids()
            time.sleep(0.01)

    def _kill_member(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return                      # gone
        try:
            if pid in self.pids():      # the pidfd's process is the member: the pid cannot be reused now
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)

    def remove(self, timeout: float = 5.0, kill: bool = True) -> list[str]:
        """Remove the sandbox's cgroups; returns the paths that could not be removed.
        kill=False: the caller's kill_all() found them empty (saves its second pass)."""
        self.close_files()
        if kill:
            self.kill_all(timeout)
        return self._rmdirs(self.paths, timeout)

    @staticmethod
    def _rmdirs(paths, timeout: float = 5.0) -> list[str]:
        left = []
        for p in paths:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    os.rmdir(p)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno == errno.EBUSY and time.monotonic() < deadline:
                        time.sleep(0.005)
                        continue
                    left.append(p)
                    break
        return left


def list_sandbox_cgroups(layout: Layout) -> dict[str, list[str]]:
    """sandbox id -> cgroup paths, for every dsec cgroup on this host."""
    out: dict[str, list[str]] = {}
    roots = ([layout.v2_root] if layout.v2_root else []) + \
        (list(layout.v1_roots.values()) if layout.mode != "v2" else [])
    for r in roots:
        parent = os.path.join(r, PARENT)
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for n in names:
            p = os.path.join(parent, n)
            if os.path.isdir(p):
                out.setdefault(n, []).append(p)
    return out
