"""What the node agent holds on its host before it serves: its run directory
(lock and pid file: one agent per run directory, and the trace a crashed one
leaves for the next), and the eBPF sensors, with the features it has and lacks.

    run = RunDir(cfg); previous = run.take()     # DsecError if another agent holds it
    run.write_pidfile(instance, started_ns); ... run.release()
    audit = load_audit(cfg, node, spool)         # .rec (Recorder or None), .audit, .enforcement, .degraded
    clean_up_after(previous, lifecycle)          # what a dead agent left, each removal audited
    medium, why = use_scratch(cfg.host.scratch)  # host.scratch: the writable layers in memory or on disk
    ... release_scratch(medium)                  # at the stop
    apply_host(cfg)                              # the host section: state dir, spool, cgroup parent, pool
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os

from agent.errors import DsecError, ReportedError

log = logging.getLogger("dsec.agent")


def apply_host(cfg) -> dict:
    """Make this process use the config's `host` section (what two agents on one
    host must not share): the sandbox state directory, the spool, the cgroup
    parent, the egress pool. Sets the environment too (the variables these
    settings override, for child processes and modules that read them late).
    Call before anything is launched. Returns what is in force."""
    from agent.sandbox import cgroups, launcher, netns, rootfs
    h = cfg.host
    if h.node_name:
        launcher.NODE_NAME = h.node_name
    if h.state_dir:
        os.environ["DSEC_STATE_DIR"] = h.state_dir
        rootfs.STATE_ROOT = h.state_dir
        rootfs.BASE_ROOT = os.path.join(h.state_dir, "base")
        launcher.SANDBOX_DIR = os.path.join(h.state_dir, "sandboxes")
        launcher.KEPT_DIR = os.path.join(h.state_dir, "kept")
    if h.spool_dir:
        os.environ["DSEC_SPOOL_DIR"] = h.spool_dir
    if h.cgroup_parent:
        os.environ["DSEC_CGROUP_PARENT"] = h.cgroup_parent
        cgroups.PARENT = h.cgroup_parent
    if h.egress_pool:
        os.environ["DSEC_EGRESS_POOL"] = h.egress_pool
        netns.POOL = netns.parse_pool(h.egress_pool, "host.egress_pool")
    from exporters.spool import default_dir
    return {"node_name": h.node_name or os.uname().nodename, "state_dir": rootfs.STATE_ROOT,
            "spool_dir": default_dir(), "cgroup_parent": cgroups.PARENT, "egress_pool": str(netns.POOL),
            "nat_table": netns.nat_table()}


class RunDir:
    def __init__(self, cfg, version: str):
        self.cfg = cfg
        self.version = version
        self.path = os.path.join(cfg.run_dir, "agent.json")
        self._fd = -1

    def take(self) -> dict | None:
        """Lock the run directory (root-owned, 0700). Returns the pid file a previous
        agent left (it did not shut down cleanly), or None."""
        d = self.cfg.run_dir
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.stat(d)
        except OSError as e:
            raise DsecError(f"agent directory {d}: {e.strerror}")
        if st.st_uid != 0:
            raise DsecError(f"agent directory {d} is owned by uid {st.st_uid}, not root: refusing to put "
                            f"the agent's socket there")
        os.chmod(d, 0o700)
        sock_dir = os.path.dirname(self.cfg.socket)
        if sock_dir != d:
            os.makedirs(sock_dir, mode=0o700, exist_ok=True)
            if os.stat(sock_dir).st_uid != 0:
                raise DsecError(f"socket directory {sock_dir} is not owned by root")
            os.chmod(sock_dir, 0o700)
        self._fd = os.open(os.path.join(d, "agent.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                other = self.read_pidfile() or {}
                raise DsecError(f"another dsec agent is running (pid {other.get('pid', '?')}, "
                                f"socket {other.get('socket', self.cfg.socket)})")
            raise
        prev = self.read_pidfile()
        if prev and prev.get("pid") != os.getpid():
            log.warning("previous agent (pid %s, started %s) did not shut down cleanly: cleaning up after it",
                        prev.get("pid"), prev.get("started"))
            return prev
        return None

    def read_pidfile(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_pidfile(self, instance: str, started_ns: int):
        data = {"pid": os.getpid(), "started": started_ns / 1e9, "socket": self.cfg.socket,
                "instance": instance, "version": self.version}
        with open(self.path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(self.path + ".tmp", self.path)

    def release(self):
        """The last step of a shutdown: remove the pid file and let another agent start."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class AuditSetup:
    """The agent's eBPF sensors, or why it runs without them."""

    def __init__(self):
        self.rec = None                     # agent.sensors.recorder.Recorder, or None
        self.degraded: list[str] = []
        self.audit = {"available": False, "detail": "", "missing": []}
        self.enforcement = {"available": False, "detail": "", "missing": []}


def load_audit(cfg, node: str, spool) -> AuditSetup:
    """Load the audit and enforcement sensors once. With audit.required (the
    default), an agent whose audit cannot load refuses to start."""
    from agent.sensors import audit as audit_sensor
    out = AuditSetup()
    missing = audit_sensor.check_features()
    try:
        from agent.sensors import enforce as enforce_sensor
        emissing = enforce_sensor.check_features()
        out.enforcement = {"available": not emissing, "missing": emissing,
                           "detail": "eBPF enforcement: available" if not emissing else
                           "eBPF enforcement unavailable: " + "; ".join(emissing)}
        if emissing:
            out.degraded.append("egress/exec enforcement by eBPF unavailable: " + "; ".join(emissing))
    except ImportError:
        out.enforcement = {"available": False, "missing": ["agent/sensors/enforce.py not present"],
                           "detail": "eBPF enforcement not built"}
        out.degraded.append("egress/exec enforcement by eBPF not built into this dsec")
    err = None
    if not missing:
        from agent.sensors.recorder import Recorder
        try:
            out.rec = Recorder(node=node, spool=spool, over_budget=cfg.audit.over_budget,
                               aggregate=cfg.audit.aggregate_repeats)
        except ReportedError as e:
            err = e.message
    else:
        err = "; ".join(missing)
    if err:
        if cfg.audit.required:
            raise DsecError(f"eBPF audit unavailable: {err} (set audit.required: false to run the agent "
                            f"without it, degraded)")
        out.degraded.append(f"eBPF audit unavailable: {err}: sandboxes run unaudited "
                            f"(lifecycle events are still recorded)")
        log.error("eBPF audit unavailable: %s; running DEGRADED (audit.required is false)", err)
    if out.rec is not None and getattr(out.rec, "enforcer", True) is None:
        why = getattr(out.rec, "enforce_error", None) or "disabled"
        out.enforcement = {"available": False, "missing": out.enforcement.get("missing") or [why],
                           "detail": f"eBPF enforcement unavailable: {why}"}
        msg = (f"eBPF egress/exec enforcement unavailable ({why}): enforce-mode sandboxes are refused, "
               f"audit/learn-mode ones run without it")
        if msg not in out.degraded:
            out.degraded.append(msg)
    out.audit = {"available": out.rec is not None, "missing": missing if err else [],
                 "detail": "eBPF audit: available" if out.rec is not None else f"eBPF audit unavailable: {err}"}
    return out


def use_scratch(wanted: str) -> tuple[str, str | None]:
    """host.scratch (agent/sandbox/scratch.py): the sandboxes' writable layers in memory (a
    tmpfs on their directory) or on disk. Run after the start's clean-up (what is left in
    that directory then is live). Returns (the medium in force, why it is not the one asked
    for: the agent's degraded entry, also logged; None when it is)."""
    from agent.sandbox import launcher, scratch
    sdir = launcher.SANDBOX_DIR
    if wanted != "memory":
        if scratch.fs_type(sdir) != "tmpfs":
            return "disk", None
        done, left = scratch.release(sdir)          # an earlier agent's, left mounted
        if done:
            log.info("unmounted the sandboxes' tmpfs an earlier agent left on %s", sdir)
            return "disk", None
        why = (f"host.scratch: disk not in force, the sandboxes' writable layers are in memory: {sdir} is a "
               f"tmpfs an earlier agent left, {left}")
        log.warning("%s", why)
        return "memory", why
    got = scratch.use_memory(sdir)
    if got["scratch"] == "memory":
        log.info("sandboxes' writable layers in memory: a tmpfs on %s (%s)", sdir,
                 "mounted" if got["mounted"] else "a previous agent's")
        return "memory", None
    why = f"host.scratch: memory not in force, the sandboxes' writable layers are on disk: {got['reason']}"
    log.warning("%s", why)
    return "disk", why


def release_scratch(in_force: str | None) -> None:
    """At the agent's stop: its tmpfs unmounted when nothing is left in it (else logged)."""
    if in_force != "memory":
        return
    from agent.sandbox import launcher, scratch
    _, why = scratch.release(launcher.SANDBOX_DIR)
    if why:
        log.warning("the sandboxes' tmpfs %s stays mounted: %s (`dsec gc` unmounts it once empty)",
                    launcher.SANDBOX_DIR, why)


def clean_up_after(previous_agent: dict | None, lifecycle) -> list[dict]:
    """What a previous agent (or a killed `dsec run`) left: the same removal as
    `dsec gc` (agent/sandbox/gc.py), each audited through lifecycle(sid, state,
    **extra). Live sandboxes of other processes are never touched. Returns the
    sandboxes cleaned."""
    from agent.sandbox import gc
    rep = gc.remove(final=False)
    prev_pid = (previous_agent or {}).get("pid")
    cleaned = []
    for it in rep["sandboxes"]:
        sid, owner, left = it["sandbox_id"], it["owner_pid"], it["cgroups_left"]
        why = ("left by the previous agent (pid %s), which died: its supervisor stopped the sandbox when "
               "the agent's control socket closed" % prev_pid) if prev_pid and owner == prev_pid else \
            "orphan of a dsec process that is gone"
        item = {"sandbox_id": sid, "owner_pid": owner, "supervisor_pid": it["supervisor_pid"], "reason": why,
                "cgroups_left": left}
        cleaned.append(item)
        lifecycle(sid, "orphan_cleaned", **{k: v for k, v in item.items() if k != "sandbox_id"})
        log.warning("cleaned up sandbox %s (%s)%s", sid, why, f"; could not remove {left}" if left else "")
    for it in rep["links"]:
        if it["error"]:
            log.warning("could not remove orphaned link %s: %s", it["link"], it["error"])
        else:
            lifecycle("", "orphan_cleaned", link=it["link"])
    try:
        from agent.sensors import enforce
        for d in enforce.gc_stale_pins():
            lifecycle("", "orphan_cleaned", bpf_pin=d)
    except (ImportError, OSError, AttributeError):
        pass
    return cleaned
