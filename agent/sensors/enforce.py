"""EnforcementSensor: policy enforcement and violation reporting in the kernel
(bpf/enforce.c), the second sensor next to the audit sensor (one per concern).

Why this file is long: one sensor is one class (Tetragon style, a userspace
sensor per concern); its per-sandbox registration, egress/exec tables, learn
counters and violation reporting share the kernel maps and one lock, and
splitting them would spread one state machine over files.

    sensor = EnforcementSensor(on_record=spool.put)       # compiles, loads, attaches
    sensor.add_sandbox(cgroup_id, cgroup_path, "sbx-1", policy, exempt_pids=[supervisor_pid])
    ... sensor.poll(100) in the agent's loop ...
    sensor.update_egress(cgroup_id, new_policy)            # at once, for a running sandbox
    sensor.syscall_counts(cgroup_id)                        # learn mode: {"read": 120, ...}
    totals = sensor.remove_sandbox(cgroup_id)
    sensor.close()

What is enforced where (docs/enforcement.md has the whole story):
  egress    cgroup connect4/6 + sendmsg4/6 programs attached to the sandbox's
            own cgroup2 directory (BPF_F_ALLOW_MULTI, legacy attach: the
            attachment lives as long as the cgroup, whether or not the agent
            does); rules in LPM tries keyed by the sandbox's rule-set index.
  exec      sched_process_exec, attached through a BPF link pinned in bpffs
            (<pin_root>/enf-<pid>-<start>/exec): it outlives the agent too.
  syscalls  the raw tracepoints sys_enter (learn counters, audit reports) and
            sys_exit (enforce reports), each attached only while a sandbox
            needs it (they run for every syscall on the host); seccomp,
            installed by the launcher, is what refuses the calls.

Records have the audit sensor's format (agent/sensors/decoder.py; schema in
audit_schema/events.py): egress_denied / egress_violation, exec_denied /
exec_violation, syscall_denied / syscall_violation, events_lost. Every record
carries the policy's name, hash and mode and the decision (denied |
would-deny).

One sensor per agent process; its methods are serialised by a lock, and poll()
holds it while it waits (keep timeouts short when other threads manage
sandboxes). Hostname rules are resolved with agent.sensors.resolver.HostResolver and
refreshed on their TTL from poll() (see refresh_hosts()).
"""
from __future__ import annotations

import ctypes as ct
import ipaddress
import logging
import os
import threading
import re
import socket
import time
import uuid
from dataclasses import dataclass, field

from agent.sensors import bpfsys
from agent.sensors.common import BPF_DIR, TRACEFS, RINGBUF_MISSING, RingSensor, base_missing
from agent.sandbox.cgroups import cgroup_populated
from agent.sensors.common import byte_bucket
from agent.sensors.common import (bpffs_mounted, cgroup2_mount, check_sandbox_ids, compile_text, describe, find_tracefs,
                              loss_totals, map_discard, ring_pages, ringbuf_supported, source_text, token_bucket,
                              tracepoint_program, tracepoints_in, unavailable)
from agent.sensors.decoder import PROTOCOLS, SandboxInfo, in_cgroup, load_constants
from agent.errors import EXIT_DSEC, DsecError, ReportedError
from agent.sensors.resolver import HostResolver, ResolveError

log = logging.getLogger("dsec.enforce")

SOURCE = "enforce.c"
PIN_ROOT = "/sys/fs/bpf/dsec"
DEFAULT_RING_BYTES = 4 << 20
DEFAULT_RATE = 1000            # egress/exec records per second per sandbox
DEFAULT_BURST = 5000
DEFAULT_BYTE_RATE = 1 << 20    # bytes of records per second per sandbox
BYTE_BURST_SHARE = 8           # default byte burst: the ring buffer's size / this
DEFAULT_REPORT_INTERVAL_S = 1.0

# cgroup hook programs (function name, attach type); names are the kernel's
# program names too, which is how a restarted agent recognises its predecessor's
EGRESS_PROGS = (
    ("dsec_enf_c4", bpfsys.BPF_CGROUP_INET4_CONNECT),
    ("dsec_enf_c6", bpfsys.BPF_CGROUP_INET6_CONNECT),
    ("dsec_enf_s4", bpfsys.BPF_CGROUP_UDP4_SENDMSG),
    ("dsec_enf_s6", bpfsys.BPF_CGROUP_UDP6_SENDMSG),
)
PROG_PREFIX = "dsec_enf_"
EXEC_FN = b"tracepoint__sched__sched_process_exec"
# the cwd tracking of relative execs (bpf/enforce.c "relative execs", agent/sensors/cwd.py)
# and the process tree it rides on: pinned with the exec link, so that after the agent is
# gone a chdir still makes the cwd unknown (relative execs refused, never matched stale)
PINNED_TPS = (("syscalls", "sys_enter_chdir"), ("syscalls", "sys_exit_chdir"),
              ("syscalls", "sys_enter_fchdir"), ("syscalls", "sys_exit_fchdir"),
              ("syscalls", "sys_enter_unshare"), ("syscalls", "sys_enter_setns"), ("syscalls", "sys_enter_chroot"),
              ("task", "task_newtask"), ("sched", "sched_process_exit"))
# the cwd maps, pinned beside the links so that the audit sensor can open them: its
# exec records carry the cwd the exec check joins a relative name to (bpf/process.c)
CWD_MAP_PINS = {"cwd_gen": ("gen", b"enf_cwd_gen"), "cwd": ("cwd", b"enf_cwd")}   # pin -> (role, map)
# the syscall programs run for every syscall of every process on the host, so
# they are attached only while a sandbox needs them: sys_enter for learn and
# audit mode, sys_exit for enforce mode (docs/enforcement.md, "Cost")
SYS_HOOK_LINGER_S = 10.0
# (a hook's programs, attached in this order and detached in the reverse)
SYS_HOOKS = {"enter": (("raw", b"sys_enter", b"raw_tracepoint__sys_enter"),),
             # enforce mode: refused calls, and the arguments of socket() calls seccomp refused
             "exit": (("raw", b"sys_exit", b"raw_tracepoint__sys_exit"),),
             # exec enforce mode: an executable mapping of a file refused with EPERM (a noexec
             # writable layer): these two cost every mmap of every process ~0.3 us (perf's
             # tracepoint frames, docs/enforcement.md "Cost"), so they too run only while a
             # sandbox needs them
             "mmap": (("tp", b"syscalls:sys_enter_mmap", b"tracepoint__syscalls__sys_enter_mmap"),
                      ("tp", b"syscalls:sys_exit_mmap", b"tracepoint__syscalls__sys_exit_mmap")),
             # audit mode: socket()/socketpair() outside the socket rules, clone() with namespace
             # flags under `namespaces: deny` (seccomp lets them run; unshare's program is pinned)
             "socket": (("tp", b"syscalls:sys_enter_socket", b"tracepoint__syscalls__sys_enter_socket"),
                        ("tp", b"syscalls:sys_enter_socketpair", b"tracepoint__syscalls__sys_enter_socketpair")),
             "clone": (("tp", b"syscalls:sys_enter_clone", b"tracepoint__syscalls__sys_enter_clone"),)}
PROTO_BITS = {"tcp": 1, "udp": 2, "any": 1 | 2 | 4}
MAPPED_V4 = ipaddress.ip_network("::ffff:0:0/96")


# ---------------------------------------------------------------- features

def _source_text() -> str:
    return source_text(("membership.h", SOURCE))     # membership.h: the lookup both sensors share


def tracepoints_used(text: str | None = None) -> list[str]:
    return tracepoints_in(_source_text() if text is None else text)


def check_features(tracefs_roots=TRACEFS, pin_root: str | None = PIN_ROOT) -> list[str]:
    """What the enforcement sensor needs and does not have (empty: all there)."""
    missing = base_missing(tracefs_roots, tracepoints_used() + ["raw_syscalls/sys_enter"])
    if cgroup2_mount() is None:
        missing.append("no cgroup2 hierarchy mounted (egress programs attach to the sandbox's cgroup2)")
    if os.geteuid() == 0:
        if not ringbuf_supported():
            missing.append(RINGBUF_MISSING)
        for what, probe in (("cgroup sock_addr programs (connect4/6, sendmsg4/6)", bpfsys.probe_cgroup_sock_addr),
                            ("bpf_send_signal", bpfsys.probe_send_signal),
                            ("BPF LPM trie maps", bpfsys.probe_lpm_trie)):
            try:
                probe()
            except OSError as e:
                missing.append(f"{what} unavailable: {e.strerror}")
    if pin_root is not None and not bpffs_mounted(pin_root):
        missing.append(f"no bpf filesystem at {pin_root} (exec enforcement could not outlive the agent; "
                       "mount -t bpf bpf /sys/fs/bpf)")
    return missing


def require_features(tracefs_roots=TRACEFS, pin_root: str | None = PIN_ROOT) -> None:
    missing = check_features(tracefs_roots, pin_root)
    if missing:
        # exit status 125 (dsec failed): an enforce-mode sandbox must not start
        raise DsecError(unavailable("enforcement", missing), EXIT_DSEC)


def describe_features() -> str:
    return describe("enforcement", check_features())


# ---------------------------------------------------------------- compile

def build_cflags(*, ring_bytes: int) -> list[str]:
    return [f"-I{BPF_DIR}", f"-DDSEC_ENF_RING_PAGES={ring_pages(ring_bytes, 'enforcement')}",
            "-DDSEC_SBX_T=struct dsec_enf_sandbox"]


def compile_bpf(cflags: list[str]):
    """Every program loaded and verified, none attached: EnforcementSensor._load
    links the pinned ones and the syscall hooks are attached while a sandbox
    needs them (an attach BCC made at load would cost a detach, ~70 ms each)."""
    return compile_text(_source_text(), cflags, "enforcement", attach=False)


# ---------------------------------------------------------------- pins

def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return data[data.rindex(b")") + 2:].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def gc_stale_pins(pin_root: str = PIN_ROOT) -> list[str]:
    """Remove the pinned links of enforcement sensors whose process is gone.

    A SIGKILLed agent leaves its exec link pinned (exec enforcement of its
    sandboxes goes on). Call this after the restarted agent has re-adopted the
    running sandboxes (add_sandbox re-attaches their egress programs and takes
    over exec enforcement): from then on the old link only costs time."""
    removed = []
    try:
        names = os.listdir(pin_root)
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(r"enf-(\d+)-(\d+)(?:-\w+)?", name)
        if not m or _proc_start(int(m.group(1))) == m.group(2):
            continue
        d = os.path.join(pin_root, name)
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
        removed.append(d)
    return removed


# ---------------------------------------------------------------- rules -> kernel tables

def _merge_ranges(items) -> list[tuple[int, int, int]]:
    """[(lo, hi, protocol bits)] -> the same coverage as disjoint ranges, adjacent
    ranges with equal bits merged."""
    points = sorted({lo for lo, _, _ in items} | {hi + 1 for _, hi, _ in items})
    out: list[list[int]] = []
    for a, b in zip(points, points[1:]):
        bits = 0
        for lo, hi, pb in items:
            if lo <= a and b - 1 <= hi:
                bits |= pb
        if not bits:
            continue
        if out and out[-1][1] == a - 1 and out[-1][2] == bits:
            out[-1][1] = b - 1
        else:
            out.append([a, b - 1, bits])
    return [tuple(x) for x in out]


def _as_v4(net):
    """An IPv4-mapped IPv6 network as the IPv4 network the kernel checks it as."""
    if net.version == 6 and net.subnet_of(MAPPED_V4):
        return ipaddress.ip_network((int(net.network_address) & 0xFFFFFFFF, net.prefixlen - 96))
    return net


def egress_table(rules, host_addrs: dict | None = None, max_ranges: int = 16) -> dict:
    """{network: ((lo, hi, protocol bits), ...)} for the LPM tries: every network
    named by a rule (or resolved from a host rule), valued with the port ranges
    of every rule whose network covers it (the kernel takes only the longest
    match). Holds the allow rules with `default: deny`, the deny rules with
    `default: allow`."""
    host_addrs = host_addrs or {}
    deny_default = rules.default == "deny"
    nets = rules.allow if deny_default else rules.deny
    hosts = rules.allow_hosts if deny_default else rules.deny_hosts
    flat = [(_as_v4(r.network), r.ports, r.protocol) for r in nets]
    for h in hosts:
        for a in host_addrs.get(h.host, ()):
            ip = ipaddress.ip_address(a)
            flat.append((_as_v4(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}")), h.ports, h.protocol))
    table = {}
    for net in {n for n, _, _ in flat}:
        items = [(lo, hi, PROTO_BITS[proto]) for m, ports, proto in flat
                 if m.version == net.version and net.subnet_of(m) for lo, hi in ports]
        ranges = _merge_ranges(items)
        if len(ranges) > max_ranges:
            raise DsecError(f"egress rules for {net}: {len(ranges)} distinct port ranges after merging the rules "
                            f"that cover it; the kernel table holds at most {max_ranges}")
        table[net] = tuple(ranges)
    return table


# ---------------------------------------------------------------- per-sandbox state

@dataclass
class _Host:
    host: str
    deny: bool                                      # a deny rule (default: allow)
    addrs: dict = field(default_factory=dict)       # address -> expiry (monotonic s)
    next_refresh: float = 0.0
    failures: int = 0
    last_error: str = ""
    ttl: int = 0


@dataclass
class _Sandbox:
    cgroup_id: int
    path: str
    sandbox_id: str
    policy: object
    idx: int
    modes: dict                     # egress, exec, sys -> "off" | "learn" | "audit" | "enforce"
    egress_rules: object = None     # policies.compile.EgressRules | None
    hosts: dict = field(default_factory=dict)          # host -> _Host
    egress_entries: dict = field(default_factory=dict)  # network -> ranges (what the tries hold)
    exec_keys: list = field(default_factory=list)       # (prefixlen, data) in exec_allow
    attached: bool = False
    step: int = 0
    exempt: set = field(default_factory=set)
    adopted: int = 0                # programs of a previous agent detached from the cgroup
    sys_hooks: list = field(default_factory=list)   # "enter" | "exit": syscall programs it needs
    sock_keys: list = field(default_factory=list)   # (family, type) keys in sock_rules
    sys_allow: int | None = None    # its syscall bitmap as an int (bit n = syscall n), once registered
    cfg: object = None              # its `sandboxes` value as last written (this sensor is its only writer)


def _mode_name(policy_mode: str, present: bool, learn_when_absent: bool = False) -> str:
    if policy_mode == "learn":
        return "learn" if (present or learn_when_absent) else "off"
    return policy_mode if present else "off"


class EnforcementSensor(RingSensor):
    WHAT = "enforcement"
    VERB = "enforced"

    def __init__(self, on_record=None, *, node: str | None = None, ring_bytes: int = DEFAULT_RING_BYTES,
                 rate: float = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 byte_rate: float = DEFAULT_BYTE_RATE, byte_burst: int | None = None,
                 report_interval_s: float = DEFAULT_REPORT_INTERVAL_S, resolver: HostResolver | None = None,
                 pin_root: str | None = PIN_ROOT, loss_interval_s: float = 0.5, tracefs_roots=TRACEFS):
        require_features(tracefs_roots, pin_root)
        self.on_record = on_record
        if byte_burst is None:
            byte_burst = max(65536, ring_bytes // BYTE_BURST_SHARE)
        self.defaults = {"rate": rate, "burst": burst}
        _budget(rate, burst)
        self.byte_budget = byte_bucket(byte_rate, byte_burst, "enforcement byte budget")
        if not report_interval_s > 0:
            raise DsecError(f"report_interval_s must be > 0, got {report_interval_s!r}")
        self.report_ns = int(report_interval_s * 1e9)
        self.loss_interval_s = loss_interval_s
        self.sys_hook_linger_s = SYS_HOOK_LINGER_S
        self.resolver = resolver or HostResolver()
        self.consts = load_constants()
        self.tracefs = find_tracefs(tracefs_roots)
        self.bpf = compile_bpf(build_cflags(ring_bytes=ring_bytes))
        self._closed = False
        self.pin_dir = None
        self._exec_link = None
        self._links: dict[str, int] = {}      # pin name -> link fd (the exec check's and PINNED_TPS)
        self.cwd = None
        self.cwd_pins: dict[str, str] = {}    # "gen" | "cwd" -> the cwd maps' pins (AuditSensor(cwd_pins=))
        try:
            self._load(pin_root)
        except BaseException:
            self._teardown()
            raise
        try:     # anything failing past the load: unpinned and unloaded, nothing left behind
            b = self.bpf
            self._cfg = b[b"sandboxes"]
            self._state_map = b[b"enf_state"]
            self._gen = b[b"sbx_gen"]
            self._e4 = b[b"egress4"]
            self._e6 = b[b"egress6"]
            self._exec = b[b"exec_allow"]
            self._viol = b[b"sys_viol"]
            self._counts = b[b"sys_counts"]
            self._dest = b[b"egress_dest"]
            self._exempt = b[b"enf_exempt"]
            self._sock = b[b"sock_rules"]
            self._sys_common = {"enforce": b[b"sys_common"], "audit": b[b"sys_common_audit"]}
            self._sys_common_bits: dict = {}
            self._sys_bitmaps: dict[tuple, int] = {}    # (mode, bitmap) -> registered sandboxes with it
            self.max_sandboxes = self.consts.values["DSEC_MAX_SANDBOXES"]
            self._sbx: dict[int, _Sandbox] = {}
            self._sys_common_set()      # every call common: no enforce-mode sandbox yet
            self._free_idx: list[int] = []
            self._next_idx = 1
            self.warnings: list[str] = []
            self._init_records(b[b"enf_events"], b[b"enf_scratch"].sLeaf, node=node, enricher=None)
            from agent.sensors.cwd import CwdVerifier
            self.cwd = CwdVerifier(b, self.decoder.cgroup2_root, self.decoder.proc)
        except BaseException:
            self._teardown()
            raise

    # -- loading --------------------------------------------------------------------

    def _load(self, pin_root):
        from bcc import BPF
        self._progs = {}
        for name, attach_type in EGRESS_PROGS:
            fn = self.bpf.load_func(name.encode(), BPF.CGROUP_SOCK_ADDR, attach_type=attach_type)
            self._progs[name] = (fn.fd, attach_type, bpfsys.prog_info(fn.fd)["id"])
        # the syscall programs' attachment state, under _hook_lock only (taken inside the
        # sensor's lock, never the other way): an idle detach (~80 ms of RCU grace
        # periods) runs without the sensor's lock
        self._hook_lock = threading.Lock()
        self._sys_users = {h: 0 for h in SYS_HOOKS}
        self._sys_attached = {h: 0 for h in SYS_HOOKS}       # how many of the hook's programs
        self._sys_idle_since = {h: 0.0 for h in SYS_HOOKS}     # loaded, none attached (compile_bpf)
        # exec: attached through a BPF link pinned in bpffs, which outlives the process
        exec_fd = self.bpf.funcs[EXEC_FN].fd
        try:
            self._exec_link = bpfsys.tracepoint_link(exec_fd, self.tracefs, "sched", "sched_process_exec")
            self._links["exec"] = self._exec_link
            for cat, event in PINNED_TPS:
                fn = tracepoint_program(_source_text(), cat, event)   # DSEC_ATTACH_ALSO: shared
                fd = self.bpf.funcs[fn].fd
                self._links[event] = bpfsys.tracepoint_link(fd, self.tracefs, cat, event)
        except OSError as e:
            raise DsecError(f"eBPF enforcement unavailable: cannot attach the exec check through a BPF link "
                            f"(needs Linux >= 5.15): {e.strerror}") from None
        if pin_root is not None:
            start = _proc_start(os.getpid())
            self.pin_dir = os.path.join(pin_root, f"enf-{os.getpid()}-{start}-{uuid.uuid4().hex[:6]}")
            try:
                os.makedirs(self.pin_dir, 0o700)
                for name, fd in self._links.items():
                    bpfsys.obj_pin(fd, os.path.join(self.pin_dir, name))
                # the cwd maps, for the audit sensor's exec records (bpf/process.c dsec_exec_cwd)
                for name, (role, m) in CWD_MAP_PINS.items():
                    path = os.path.join(self.pin_dir, name)
                    bpfsys.obj_pin(self.bpf[m].map_fd, path)
                    self.cwd_pins[role] = path
            except OSError as e:
                raise DsecError(f"eBPF enforcement: cannot pin the exec link in {self.pin_dir}: "
                                f"{e.strerror}") from None

    def _teardown(self):
        if self.cwd is not None:
            self.cwd.close()          # first: no process may be left stopped at a chdir
        if self.pin_dir:
            for name in list(self._links) + list(CWD_MAP_PINS):
                try:
                    os.unlink(os.path.join(self.pin_dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self.pin_dir)
            except OSError:
                pass
        for fd in self._links.values():
            os.close(fd)
        self._links = {}
        self._exec_link = None
        bpfsys.fast_detach(self.bpf)

    # -- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Remove every sandbox (detaching its programs), unpin, unload."""
        self._close()

    def _sandbox_ids(self) -> list[int]:
        return list(self._sbx)

    @property
    def _state(self):
        """The enf_state map (RingSensor's _state_map), by its earlier name."""
        return self._state_map

    # -- sandboxes ------------------------------------------------------------------

    def add_sandbox(self, cgroup_id: int, cgroup_path: str, sandbox_id: str, policy, *, step: int = 0,
                    exempt_pids=(), rate: float | None = None, burst: int | None = None,
                    adopt: bool = True) -> None:
        """Enforce `policy` (a policies.model.Policy, in its own mode) on cgroup2
        `cgroup_path` (inode `cgroup_id`) and its sub-cgroups.

        exempt_pids: processes already in the cgroup that are not the workload
        (the supervisor): they and their children are not syscall-checked until
        they exec. adopt: detach the egress programs a previous (dead) agent left
        attached to this cgroup, after this sensor's are attached (no gap).
        Register the cgroup before the workload runs in it."""
        from policies.compile import egress_rules, exec_rules, namespace_rules, socket_rules, syscall_bitmap
        check_sandbox_ids(cgroup_id, sandbox_id)
        try:
            st = os.stat(cgroup_path)
        except OSError as e:
            raise DsecError(f"add_sandbox: cgroup {cgroup_path}: {e.strerror}") from None
        if st.st_ino != cgroup_id:
            raise DsecError(f"add_sandbox: {cgroup_path} is cgroup {st.st_ino}, not {cgroup_id}")
        interval, tolerance = _budget(self.defaults["rate"] if rate is None else rate,
                                      self.defaults["burst"] if burst is None else burst)
        mode = policy.mode
        erules = egress_rules(policy)
        xrules = exec_rules(policy)
        modes = {"egress": _mode_name(mode, erules is not None, learn_when_absent=True),
                 "exec": _mode_name(mode, xrules is not None),
                 "sys": mode}
        limit = self.consts.values["DSEC_EXEC_PATTERN_MAX"]
        for prefix, exact in xrules or ():
            if len(prefix) > limit:
                raise DsecError(f"add_sandbox: exec pattern {prefix.decode(errors='replace')!r} is {len(prefix)} "
                                f"bytes; the kernel matcher takes at most {limit}")
        answers = self._prefetch(h.host for h in (erules.allow_hosts + erules.deny_hosts)) if erules else {}
        with self._lock:
            self._check_open()
            if cgroup_id in self._sbx:
                raise DsecError(f"add_sandbox: cgroup {cgroup_id} is already enforced as "
                                f"{self._sbx[cgroup_id].sandbox_id}")
            if len(self._sbx) >= self.max_sandboxes:
                raise DsecError(f"add_sandbox: at most {self.max_sandboxes} sandboxes")
            idx = self._alloc_idx()
            sb = _Sandbox(cgroup_id, cgroup_path, sandbox_id, policy, idx, modes, erules, step=step)
            self._sbx[cgroup_id] = sb
            try:
                for pid in exempt_pids:
                    self._exempt_pid(sb, pid)
                if erules is not None:
                    for h in erules.allow_hosts + erules.deny_hosts:
                        sb.hosts[h.host] = _Host(h.host, deny=h in erules.deny_hosts)
                self._resolve_hosts(sb, initial=True, answers=answers)
                self._apply_egress(sb)
                self._apply_exec(sb, xrules or [])
                srules = socket_rules(policy) if modes["sys"] in ("audit", "enforce") else None
                self._apply_sockets(sb, srules)
                if modes["sys"] == "learn":
                    self._counts[self._counts.Key(cgroup_id)] = self._counts.Leaf()
                self._state_map[self._state_map.Key(cgroup_id)] = self._state_map.Leaf()
                cfg = self._cfg.Leaf()
                cfg.interval_ns, cfg.tolerance_ns, cfg.report_ns = interval, tolerance, self.report_ns
                cfg.byte_ps, cfg.byte_tol_ns = self.byte_budget
                cfg.idx, cfg.step = idx, step
                self._set_modes(cfg, sb)
                bitmap = syscall_bitmap(policy)
                ct.memmove(cfg.sys_allow, bitmap, len(cfg.sys_allow))
                cfg.ns_deny = 1 if namespace_rules(policy).deny else 0
                sb.sys_allow = int.from_bytes(bitmap, "little")
                self._sys_common_count(sb, +1)      # narrowed before the sandbox is visible
                self._sys_hook_get(sb, "enter" if modes["sys"] in ("learn", "audit") else "exit")
                if modes["exec"] == "enforce":
                    self._sys_hook_get(sb, "mmap")
                if modes["sys"] == "audit" and srules is not None:
                    self._sys_hook_get(sb, "socket")
                if modes["sys"] == "audit" and cfg.ns_deny:
                    self._sys_hook_get(sb, "clone")
                self._cfg[self._cfg.Key(cgroup_id)] = cfg
                sb.cfg = cfg
                self._bump_gen()
                if modes["egress"] != "off":
                    self._attach(sb, adopt)
            except BaseException as e:
                self._forget(sb)
                if isinstance(e, ReportedError):
                    raise
                if isinstance(e, Exception):
                    raise DsecError(f"add_sandbox: cannot register cgroup {cgroup_id} in the kernel: {e}") from None
                raise
            self.decoder.register(SandboxInfo(cgroup_id, sandbox_id, policy.identity()))
            self._track(cgroup_id)

    def update_egress(self, cgroup_id: int, policy) -> None:
        """Replace the egress rules (and the egress mode) of a running sandbox
        with those of `policy`, at once. Its other rules must be the same as
        the policy in force (they are applied by seccomp and at exec, and every
        record names one policy): otherwise DsecError."""
        from policies.compile import egress_rules, exec_rules, namespace_rules, socket_rules, syscall_bitmap
        erules = egress_rules(policy)
        answers = self._prefetch(h.host for h in (erules.allow_hosts + erules.deny_hosts)) if erules else {}
        with self._lock:
            self._check_open()
            sb = self._get(cgroup_id, "update_egress")
            old = sb.policy
            differ = [what for what, same in (
                ("mode", policy.mode == old.mode), ("exec", exec_rules(policy) == exec_rules(old)),
                ("syscalls", syscall_bitmap(policy) == syscall_bitmap(old)),
                ("namespaces", namespace_rules(policy) == namespace_rules(old))) if not same]
            if differ:
                raise DsecError(f"update_egress: policy {policy.name!r} changes more than egress rules "
                                f"({', '.join(differ)} differ from {old.name!r}: fixed when the sandbox started; "
                                f"nothing was applied); start a new sandbox")
            hosts = {}
            if erules is not None:
                for h in erules.allow_hosts + erules.deny_hosts:
                    x = sb.hosts.get(h.host) or _Host(h.host, deny=False)
                    x.deny = h in erules.deny_hosts
                    hosts[h.host] = x
            new = _Sandbox(sb.cgroup_id, sb.path, sb.sandbox_id, policy, self._alloc_idx(),
                           dict(sb.modes, egress=_mode_name(policy.mode, erules is not None, learn_when_absent=True)),
                           erules, hosts=hosts)
            old_idx, old_entries, old_exec = sb.idx, sb.egress_entries, sb.exec_keys
            try:
                self._resolve_hosts(new, initial=True, only_new=True, answers=answers)
                # the new rules go in under a new rule-set index, then one update of the
                # sandbox's entry switches index, mode and default together: a connection
                # is checked against the old rules or the new ones, never a mix
                self._apply_egress(new)
                self._apply_exec(new, exec_rules(policy) or [])
                self._apply_sockets(new, socket_rules(policy) if sb.modes["sys"] in ("audit", "enforce") else None)
                def switch(cfg):
                    cfg.idx = new.idx
                    self._set_modes(cfg, new)
                self._write_cfg(sb, switch)
            except BaseException:
                self._drop_sockets(new.idx, new.sock_keys)
                self._drop_rules(new.idx, new.egress_entries, new.exec_keys)
                raise
            old_sock = sb.sock_keys
            sb.policy, sb.idx, sb.modes, sb.egress_rules, sb.hosts = policy, new.idx, new.modes, erules, hosts
            sb.egress_entries, sb.exec_keys, sb.sock_keys = new.egress_entries, new.exec_keys, new.sock_keys
            self._drop_sockets(old_idx, old_sock)
            self._drop_rules(old_idx, old_entries, old_exec)
            if sb.modes["egress"] != "off" and not sb.attached:
                self._attach(sb, adopt=True)
            self.decoder.sandboxes[cgroup_id].labels = policy.identity()

    def exempt(self, cgroup_id: int, pid: int) -> None:
        """Stop syscall-checking process `pid` (and its children until they exec)."""
        with self._lock:
            self._exempt_pid(self._get(cgroup_id, "exempt"), pid)

    def set_step(self, cgroup_id: int, step: int) -> None:
        with self._lock:
            sb = self._get(cgroup_id, "set_step")
            self._write_cfg(sb, lambda cfg: setattr(cfg, "step", step))
            sb.step = step

    def _write_cfg(self, sb: _Sandbox, fn) -> None:
        """fn(configuration) of a registered sandbox, written (with the lock): a copy of sb.cfg,
        which is what the kernel has (no read back), kept once the kernel has the new one."""
        cfg = type(sb.cfg).from_buffer_copy(sb.cfg)
        fn(cfg)
        self._cfg[self._cfg.Key(sb.cgroup_id)] = cfg
        sb.cfg = cfg

    def remove_sandbox(self, cgroup_id: int) -> dict:
        """Stop enforcing: detach the egress programs, drain and report what is
        pending (syscall counts not yet reported, losses) and return the totals:
        {"emitted", "lost", "lost_total", "killed", "violations": {syscall: n},
         "syscalls": {name: n} (learn), "destinations": [...] (learn)}.
        Once the sandbox's cgroup is empty (or gone), every record of it is read
        (a fence: the ring's producer position read after that check)."""
        with self._lock:
            self._check_open()
            sb = self._sbx.get(cgroup_id)
            if sb is None:
                return self._final(cgroup_id, "remove_sandbox")
            exited = not cgroup_populated(sb.path, cgroup_id)
            fence = self._ring_fence() if exited else None
            self._detach(sb)
            if fence is None:
                self._consume()
            else:
                self._consume_past(fence)
            self._decode_raw()
            self._flush_syscalls(cgroup_id, final=True)
            state = self._read_state(cgroup_id)
            self._flush_losses(cgroup_id, state)
            totals = self._totals(state)
            totals["violations"] = self._violations(cgroup_id)
            if sb.modes["sys"] == "learn":
                totals["syscalls"] = self.syscall_counts(cgroup_id)
            if sb.modes["egress"] == "learn":
                totals["destinations"] = self.egress_destinations(cgroup_id)
            self._forget(sb)
            self._keep_final(cgroup_id, totals)
            self._deliver()
            return totals

    # -- reading ------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to timeout_ms for records; deliver them to on_record; every
        loss_interval_s also report losses and rate-limited syscall counts, and
        re-resolve hostname rules whose TTL ran out. Returns records delivered."""
        return self._poll(timeout_ms)

    def drain(self, cgroup_id: int | None = None) -> int:
        """Consume what is in the ring buffer now, report syscall counts (also
        those still inside their rate-limit window) and losses, deliver: of every
        sandbox, or of `cgroup_id` only (its end; the others' at the periodic flush)."""
        return self._drain(cgroup_id)

    def _after_periodic(self) -> None:
        if not self._closed:
            self._sys_hooks_idle(time.monotonic())
        self.refresh_hosts()

    def _flush_all(self, final: bool, only: int | None = None, ending: bool = False) -> None:
        self._flush_syscalls(only, final=final)
        super()._flush_all(final, only, ending)

    def stats(self, cgroup_id: int) -> dict:
        with self._lock:
            if cgroup_id not in self._sbx:
                return self._final(cgroup_id, "stats")
            totals = self._totals(self._read_state(cgroup_id))
            totals["violations"] = self._violations(cgroup_id)
            totals["adopted"] = self._sbx[cgroup_id].adopted
            return totals

    def syscall_counts(self, cgroup_id: int) -> dict:
        """Learn mode: {syscall name: calls} counted in the kernel (the sandbox's
        exempt processes excluded)."""
        from policies.syscalls import name_of
        with self._lock:
            sb = self._get(cgroup_id, "syscall_counts")
            if sb.modes["sys"] != "learn":
                raise DsecError(f"syscall_counts: sandbox {sb.sandbox_id} is in {sb.modes['sys']} mode, not learn")
            try:
                c = self._counts[self._counts.Key(cgroup_id)]
            except KeyError:
                return {}
            return {name_of(nr) or f"nr_{nr}": n for nr, n in enumerate(c.n) if n}

    def egress_destinations(self, cgroup_id: int) -> list[dict]:
        """Learn mode: every destination the sandbox connected / sent to, with counts."""
        with self._lock:
            self._get(cgroup_id, "egress_destinations")
            out = []
            offset = self.decoder.offset_ns
            for k, v in self._dest.items():
                if k.cgroup_id != cgroup_id:
                    continue
                raw = bytes(k.addr)
                fam = "ipv4" if k.family == socket.AF_INET else "ipv6"
                addr = str(ipaddress.IPv4Address(raw[:4]) if fam == "ipv4" else ipaddress.IPv6Address(raw))
                out.append({"family": fam, "addr": addr, "port": k.port,
                            "protocol": PROTOCOLS.get(k.protocol, str(k.protocol)),
                            "hook": self.consts.hooks.get(k.hook, str(k.hook)), "count": v.count,
                            "first_ts_ns": v.first_ns + offset, "last_ts_ns": v.last_ns + offset})
            return sorted(out, key=lambda d: (d["family"], d["addr"], d["port"], d["protocol"]))

    def egress_addresses(self, cgroup_id: int) -> dict:
        """Hostname rules: {host: [addresses in the kernel tables now]}."""
        with self._lock:
            sb = self._get(cgroup_id, "egress_addresses")
            return {h: sorted(x.addrs) for h, x in sb.hosts.items()}

    # -- hostname rules ------------------------------------------------------------------

    def refresh_hosts(self, force: bool = False) -> int:
        """Re-resolve the hostname rules whose TTL ran out (all with force) and
        apply the changes at once. Resolution runs without the sensor's lock.
        Returns how many sandboxes' tables changed."""
        with self._lock:
            if self._closed:
                return 0
            now = time.monotonic()
            due = sorted({h for sb in self._sbx.values() for h, x in sb.hosts.items()
                          if force or now >= x.next_refresh})
        if not due:
            return 0
        results = {}
        for host in due:
            try:
                results[host] = self.resolver.resolve(host)
            except ResolveError as e:
                results[host] = e
        changed = 0
        with self._lock:
            if self._closed:
                return 0
            for sb in self._sbx.values():
                hit = False
                for host, res in results.items():
                    x = sb.hosts.get(host)
                    if x is not None:
                        hit |= self._apply_resolution(sb, x, res)
                hit |= self._expire(sb)
                if hit:
                    self._apply_egress(sb)
                    changed += 1
        return changed

    def _prefetch(self, hosts) -> dict:
        """Resolve hostnames without the sensor's lock (DNS may take seconds): {host: answer | ResolveError}."""
        out = {}
        for host in dict.fromkeys(hosts):
            try:
                out[host] = self.resolver.resolve(host)
            except ResolveError as e:
                out[host] = e
        return out

    def _resolve_hosts(self, sb: _Sandbox, initial: bool = False, only_new: bool = False,
                       answers: dict | None = None) -> None:
        for x in sb.hosts.values():
            if only_new and x.next_refresh:
                continue
            if answers is not None and x.host in answers:
                res = answers[x.host]
            else:
                try:
                    res = self.resolver.resolve(x.host)
                except ResolveError as e:
                    res = e
            self._apply_resolution(sb, x, res)
            if isinstance(res, ResolveError) and x.deny and sb.modes["egress"] == "enforce" and initial:
                raise DsecError(f"egress deny rule for host {x.host!r}: {res} (the rule cannot be enforced)")

    def _apply_resolution(self, sb: _Sandbox, x: _Host, res) -> bool:
        now = time.monotonic()
        if isinstance(res, ResolveError):
            x.failures += 1
            x.last_error = str(res)
            x.next_refresh = now + min(60, 2 ** min(x.failures, 6))
            msg = f"sandbox {sb.sandbox_id}: {res}; keeping {len(x.addrs)} known address(es), retrying"
            log.warning("%s", msg)
            self.warnings.append(msg)
            del self.warnings[:-100]
            return False
        x.failures, x.last_error, x.ttl = 0, "", res.ttl
        x.next_refresh = now + res.ttl
        before = set(x.addrs)
        for a in res.addresses:
            # kept one more TTL: a client that resolved just before still connects
            x.addrs[a] = now + 2 * res.ttl
        return set(x.addrs) != before

    @staticmethod
    def _expire(sb: _Sandbox) -> bool:
        now = time.monotonic()
        hit = False
        for x in sb.hosts.values():
            if x.failures:
                continue        # while the resolver fails, keep the last known answer
            for a in [a for a, t in x.addrs.items() if t <= now]:
                del x.addrs[a]
                hit = True
        return hit

    # -- kernel tables ---------------------------------------------------------------------

    def _set_modes(self, cfg, sb: _Sandbox) -> None:
        m = self.consts.modes
        cfg.egress = m[sb.modes["egress"]]
        cfg.exec = m[sb.modes["exec"]]
        cfg.sys = m[sb.modes["sys"]]
        er = sb.egress_rules
        # no rules (learn mode without an egress section): nothing in the tries, all allowed
        deny_default = er is not None and er.default == "deny"
        cfg.egress_default = self.consts.values["DSEC_EGRESS_DEFAULT_DENY" if deny_default
                                                else "DSEC_EGRESS_DEFAULT_ALLOW"]

    def _lpm_key(self, table, idx: int, net):
        k = table.Key()
        k.prefixlen = 32 + net.prefixlen
        k.idx = idx
        packed = net.network_address.packed
        ct.memmove(k.addr, packed, len(packed))
        return k

    def _apply_egress(self, sb: _Sandbox) -> None:
        """Bring the tries to the sandbox's rules: new and changed entries first,
        then the stale ones deleted (each entry is replaced atomically)."""
        if sb.egress_rules is None:
            new = {}
        else:
            addrs = {h: list(x.addrs) for h, x in sb.hosts.items()}
            new = egress_table(sb.egress_rules, addrs, self.consts.values["DSEC_EGRESS_RANGES"])
        old = sb.egress_entries
        for net, ranges in new.items():
            if old.get(net) == ranges:
                continue
            table = self._e4 if net.version == 4 else self._e6
            leaf = table.Leaf()
            leaf.n = len(ranges)
            for i, (lo, hi, bits) in enumerate(ranges):
                leaf.r[i].lo, leaf.r[i].hi, leaf.r[i].protos = lo, hi, bits
            table[self._lpm_key(table, sb.idx, net)] = leaf
            old[net] = ranges
        for net in [n for n in old if n not in new]:
            table = self._e4 if net.version == 4 else self._e6
            map_discard(table, self._lpm_key(table, sb.idx, net))
            del old[net]

    def _apply_exec(self, sb: _Sandbox, rules) -> None:
        for prefix, exact in rules:
            data = prefix + (b"\0" if exact else b"")
            k = self._exec_key(sb.idx, (4 + len(data)) * 8, data)
            self._exec[k] = ct.c_uint8(1)
            sb.exec_keys.append((k.prefixlen, data))

    def _apply_sockets(self, sb: _Sandbox, rules) -> None:
        """The policy's socket rules as (rule set, family, type) -> protocols
        entries, plus the marker saying the rule set has socket rules."""
        if rules is None:
            return
        v = self.consts.values
        nmax = v["DSEC_SOCK_PROTOS"]
        entries: dict = {}
        for fam, types, protos in rules:
            for t in (types or (v["DSEC_SOCK_ANY_TYPE"],)):
                cur = entries.get((fam, t))
                if cur == () or not protos:
                    entries[(fam, t)] = ()          # any protocol wins
                else:
                    entries[(fam, t)] = tuple(sorted(set((cur or ()) + tuple(protos))))
        entries[(v["DSEC_SOCK_RULES_ON"], v["DSEC_SOCK_ANY_TYPE"])] = ()
        for (fam, t), protos in sorted(entries.items()):
            if len(protos) > nmax:
                raise DsecError(f"add_sandbox: socket rule for family {fam} lists {len(protos)} protocols; the "
                                f"kernel side takes at most {nmax}")
            k = self._sock.Key(sb.idx, fam, t)
            leaf = self._sock.Leaf()
            leaf.nproto = len(protos)
            for i, pr in enumerate(protos):
                leaf.proto[i] = pr
            self._sock[k] = leaf
            sb.sock_keys.append((fam, t))

    def _drop_sockets(self, idx: int, keys: list) -> None:
        for fam, t in keys:
            map_discard(self._sock, self._sock.Key(idx, fam, t))
        keys.clear()

    def _alloc_idx(self) -> int:
        if self._free_idx:
            return self._free_idx.pop()
        self._next_idx += 1
        return self._next_idx - 1

    def _drop_rules(self, idx: int, egress_entries: dict, exec_keys: list) -> None:
        """Delete the LPM entries of rule set `idx` and free the index."""
        for net in list(egress_entries):
            table = self._e4 if net.version == 4 else self._e6
            map_discard(table, self._lpm_key(table, idx, net))
        egress_entries.clear()
        for plen, data in exec_keys:
            map_discard(self._exec, self._exec_key(idx, plen, data))
        exec_keys.clear()
        self._free_idx.append(idx)

    def _sys_common_count(self, sb: _Sandbox, delta: int) -> None:
        """A sandbox's bitmap registered (+1) or removed (-1), then sys_common written: the
        sandboxes of one policy share one (mode, bitmap), so the intersection walks the
        distinct ones, not every sandbox (at 500 sandboxes that walk was ~8% of the agent's
        Python time)."""
        k = (sb.modes["sys"], sb.sys_allow)        # both fixed once it is registered
        n = self._sys_bitmaps.get(k, 0) + delta
        if n > 0:
            self._sys_bitmaps[k] = n
        else:
            self._sys_bitmaps.pop(k, None)
        self._sys_common_set()

    def _sys_common_set(self) -> None:
        """bpf/enforce.c sys_common: the syscalls every enforce-mode sandbox's
        bitmap allows (all, with none), less
        DSEC_NR_* (clone, unshare: namespace flags; socket, socketpair: the
        socket rules), whose exits are checked whatever the number allows;
        sys_common_audit: those every audit-mode sandbox's allows, none while a
        learn-mode sandbox is registered. Written word by word, only where
        they changed."""
        v = self.consts.values
        nr_max = v["DSEC_SYSCALL_NR_MAX"]
        bits = {"enforce": (1 << nr_max) - 1, "audit": (1 << nr_max) - 1}
        for mode, allow in self._sys_bitmaps:
            if mode == "learn":
                bits["audit"] = 0
            elif mode in bits:
                bits[mode] &= allow
        for name in ("DSEC_NR_CLONE", "DSEC_NR_UNSHARE", "DSEC_NR_SOCKET", "DSEC_NR_SOCKETPAIR"):
            bits["enforce"] &= ~(1 << v[name])
        for hook, table in self._sys_common.items():
            old = self._sys_common_bits.get(hook)
            for w in range(nr_max // 64):
                word = (bits[hook] >> (64 * w)) & 0xFFFFFFFFFFFFFFFF
                if old is None or (old >> (64 * w)) & 0xFFFFFFFFFFFFFFFF != word:
                    table[table.Key(w)] = table.Leaf(word)
            self._sys_common_bits[hook] = bits[hook]

    def _exec_key(self, idx: int, prefixlen: int, data: bytes):
        k = self._exec.Key()
        k.prefixlen, k.idx = prefixlen, idx
        # not ct.memmove(k.path, ...): ctypes hands out a bytes copy of a char array field
        ct.memmove(ct.addressof(k) + type(k).path.offset, data, len(data))
        return k

    def _sys_hook_get(self, sb: _Sandbox, hook: str) -> None:
        with self._hook_lock:
            self._sys_hook_get_locked(sb, hook)

    def _sys_attach_one(self, kind: str, tp: bytes, fn: bytes) -> None:
        if kind == "raw":
            self.bpf.attach_raw_tracepoint(tp=tp, fn_name=fn)
        else:
            self.bpf.attach_tracepoint(tp=tp, fn_name=fn)

    def _sys_detach_one(self, kind: str, tp: bytes) -> None:
        if kind == "raw":
            self.bpf.detach_raw_tracepoint(tp=tp)
        else:
            self.bpf.detach_tracepoint(tp=tp)

    def _sys_hook_get_locked(self, sb: _Sandbox, hook: str) -> None:
        parts = SYS_HOOKS[hook]
        if hook == "mmap" and self._sys_attached[hook] == 0:
            self._mmap_clear()      # nothing of an earlier attachment's calls is taken for a new one's
        while self._sys_attached[hook] < len(parts):
            kind, tp, fn = parts[self._sys_attached[hook]]
            try:
                self._sys_attach_one(kind, tp, fn)
            except Exception as e:   # BCC raises bare Exception
                raise DsecError(f"cannot attach the syscall program ({tp.decode()}): {e}") from None
            self._sys_attached[hook] += 1
        self._sys_users[hook] += 1
        sb.sys_hooks.append(hook)

    def _mmap_clear(self) -> None:
        """The executable mappings in flight (bpf/enforce.c mmap_pending), forgotten:
        their programs are detached, no entry is anyone's now."""
        pending = self.bpf[b"mmap_pending"]
        for k in list(pending.keys()):
            map_discard(pending, k)
        inflight = self.bpf[b"mmap_inflight"]
        inflight[inflight.Key(0)] = inflight.Leaf(0)

    def _sys_hook_put(self, sb: _Sandbox) -> None:
        hooks, sb.sys_hooks = sb.sys_hooks, []
        with self._hook_lock:
            for hook in hooks:
                self._sys_users[hook] -= 1
                if self._sys_users[hook] == 0:
                    self._sys_idle_since[hook] = time.monotonic()

    def _sys_hooks_idle(self, now: float) -> None:
        """Detach a syscall program nobody has needed for sys_hook_linger_s (from
        poll(): detaching costs ~80 ms of RCU grace periods, not to be paid by
        every remove_sandbox of a busy node), after the sensor's lock is released:
        only _hook_lock is held, so launches go on unless one needs that very
        program at that moment."""
        with self._hook_lock:
            self._sys_hooks_idle_locked(now)

    def _sys_hooks_idle_locked(self, now: float) -> None:
        for hook, attached in self._sys_attached.items():
            if attached and self._sys_users[hook] == 0 and now - self._sys_idle_since[hook] >= self.sys_hook_linger_s:
                parts = SYS_HOOKS[hook]
                while self._sys_attached[hook] > 0:
                    kind, tp, _ = parts[self._sys_attached[hook] - 1]
                    try:
                        self._sys_detach_one(kind, tp)
                    except Exception as e:   # noqa: BLE001 - still attached: only costs time
                        log.warning("cannot detach %s: %s", tp.decode(), e)
                        break
                    self._sys_attached[hook] -= 1

    def syscall_hooks(self) -> dict:
        """The syscall programs: {"enter"|"exit"|"mmap": {"attached": bool, "sandboxes": n}}."""
        with self._hook_lock:
            return {h: {"attached": self._sys_attached[h] == len(SYS_HOOKS[h]), "sandboxes": self._sys_users[h]}
                    for h in self._sys_users}

    def _exempt_pid(self, sb: _Sandbox, pid: int) -> None:
        self._exempt[self._exempt.Key(pid)] = self._exempt.Leaf(sb.cgroup_id)
        sb.exempt.add(pid)

    def _bump_gen(self) -> None:
        k = self._gen.Key(0)
        self._gen[k] = self._gen.Leaf(self._gen[k].value + 1)

    def _attach(self, sb: _Sandbox, adopt: bool) -> None:
        try:
            fd = os.open(sb.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise DsecError(f"cannot open cgroup {sb.path}: {e.strerror}") from None
        done = []
        try:
            for name, (pfd, atype, _) in self._progs.items():
                try:
                    bpfsys.prog_attach(pfd, fd, atype, bpfsys.BPF_F_ALLOW_MULTI)
                except OSError as e:
                    for dfd, dtype in done:
                        bpfsys.prog_detach(dfd, fd, dtype)
                    raise DsecError(f"cannot attach egress program {name} to cgroup {sb.path}: "
                                    f"{e.strerror}") from None
                done.append((pfd, atype))
            sb.attached = True
            if adopt:
                sb.adopted = self._detach_foreign(fd)
        finally:
            os.close(fd)

    def _detach_foreign(self, cg_fd: int) -> int:
        """Detach programs of a previous dsec agent from this cgroup (ours stay)."""
        ours = {pid for _, _, pid in self._progs.values()}
        n = 0
        for _, atype in EGRESS_PROGS:
            for prog_id in bpfsys.prog_query(cg_fd, atype):
                if prog_id in ours:
                    continue
                try:
                    pfd = bpfsys.prog_get_fd_by_id(prog_id)
                except OSError:
                    continue
                try:
                    if bpfsys.prog_info(pfd)["name"].startswith(PROG_PREFIX):
                        bpfsys.prog_detach(pfd, cg_fd, atype)
                        n += 1
                        log.info("detached %s program %d of a previous agent", PROG_PREFIX, prog_id)
                finally:
                    os.close(pfd)
        return n

    def _detach(self, sb: _Sandbox) -> None:
        if not sb.attached:
            return
        sb.attached = False
        try:
            fd = os.open(sb.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return      # the cgroup is gone, and its attachments with it
        try:
            for pfd, atype, _ in self._progs.values():
                try:
                    bpfsys.prog_detach(pfd, fd, atype)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def _forget(self, sb: _Sandbox) -> None:
        """Every kernel entry of the sandbox, and its index, released."""
        cgid = sb.cgroup_id
        self._detach(sb)
        self._sys_hook_put(sb)
        for m in (self._cfg, self._counts):
            map_discard(m, m.Key(cgid))
        self._bump_gen()
        if sb.sys_allow is not None:
            self._sys_common_count(sb, -1)     # widened once it is gone
        self._drop_sockets(sb.idx, sb.sock_keys)
        self._drop_rules(sb.idx, sb.egress_entries, sb.exec_keys)
        if cgroup_populated(sb.path, sb.cgroup_id):
            # processes of the sandbox may still run (and fork, and count violations): every
            # entry of the sandbox is found by a walk of the whole tables (two syscalls a key)
            for k, v in list(self._exempt.items()):     # the exempt processes and their children
                if v.value == cgid:
                    map_discard(self._exempt, k)
            for m in (self._viol, self._dest):
                for k in [k for k in list(m.keys()) if k.cgroup_id == cgid]:
                    map_discard(m, k)
        else:
            # nothing of the sandbox runs any more (its cgroups are empty, as at every close):
            # the kernel removed each exempt process's entry at its exit (sched_process_exit),
            # and no entry can appear now. What is left is known without a walk: the exempt
            # pids registered here (if another sandbox's by now, left alone), violation
            # counters only if the kernel counted some (enf_state.sys_entries), learned
            # destinations only in egress learn mode (a sandbox's mode never changes)
            for pid in sb.exempt:
                k = self._exempt.Key(pid)
                try:
                    if self._exempt[k].value == cgid:
                        map_discard(self._exempt, k)
                except KeyError:
                    pass
            st = self._state_entry(cgid)
            for m, wanted in ((self._viol, st is None or st.sys_entries > 0),
                              (self._dest, sb.modes["egress"] == "learn")):
                if wanted:
                    for k in [k for k in list(m.keys()) if k.cgroup_id == cgid]:
                        map_discard(m, k)
        map_discard(self._state_map, self._state_map.Key(cgid))
        self._sbx.pop(cgid, None)
        self._untrack(cgid)

    def _get(self, cgroup_id: int, what: str) -> _Sandbox:
        self._check_open()
        sb = self._sbx.get(cgroup_id)
        if sb is None:
            raise DsecError(f"{what}: cgroup {cgroup_id} is not enforced")
        return sb

    # -- records ------------------------------------------------------------------------

    def _accept(self, rec: dict) -> None:
        if rec["kind"] == "exec_denied" and rec["extra"] and '"signal_ret"' in rec["extra"]:
            self._kill_late(rec)
        if rec["kind"] in ("exec_denied", "exec_violation") and rec["extra"] \
                and ('"cwd_' in rec["extra"] or '"not_canonical"' in rec["extra"]):
            self._relative_reason(rec)
        self._backlog.append(rec)

    def _relative_reason(self, rec: dict) -> None:
        """A relative exec the check refused: say why, and where it was looked for."""
        import json
        from audit_schema.events import from_bytes
        extra = json.loads(rec["extra"])
        st = extra.get("status", [])
        cwd = self.cwd.known_cwd(rec["pid"]) if self.cwd is not None else None
        if "cwd_unknown" in st:
            extra["reason"] = ("relative exec: the exec check does not know this process's cwd (not "
                               "verified since its last chdir, a chdir in flight, or shared with another "
                               "process through CLONE_FS/unshare); run it by its absolute path")
        elif "not_canonical" in st:
            extra["reason"] = ("relative exec with '.', '..' or empty components after its leading './', or "
                               "too long once joined to the cwd (exec allowlists match canonical paths)")
        elif "cwd_joined" in st:
            extra["reason"] = "relative exec: <cwd>/<name> is not in the exec allowlist"
        if cwd is not None:
            extra["cwd"] = from_bytes(cwd)
            if rec.get("path_resolution") in ("unresolved", "best_effort") and "cwd_unknown" not in st:
                # placed with the cwd the check used (verified at the chdir), not /proc read later
                # (the process may be gone, killed): still after the fact, so best-effort
                name = rec["path_raw"]
                while name.startswith("./"):
                    name = name[2:]
                rec["path"] = from_bytes(cwd.rstrip(b"/") + b"/") + name
                rec["path_resolution"] = "best_effort"
        rec["extra"] = json.dumps(extra, sort_keys=True)

    def _kill_late(self, rec: dict) -> None:
        """bpf_send_signal failed for a denied exec: kill the process from here
        (late: it may have run), if it is still in the sandbox."""
        pid = rec["pid"]
        cgid = next((c for c, i in self.decoder.sandboxes.items() if i.sandbox_id == rec["sandbox_id"]), None)
        done = False
        if cgid is not None and in_cgroup(pid, cgid, self.decoder.cgroup2_root):
            try:
                os.kill(pid, 9)
                done = True
            except ProcessLookupError:
                pass
        log.error("sandbox %s: the kernel could not SIGKILL denied exec %s (pid %d); %s", rec["sandbox_id"],
                  rec["path"], pid, "killed from userspace" if done else "the process is gone")

    def _violations(self, cgroup_id: int) -> dict:
        from policies.syscalls import name_of
        from agent.sensors.decoder import syscall_name
        st = self._state_entry(cgroup_id)
        if st is not None and not st.sys_entries:
            # the kernel counts a sandbox's sys_viol keys before inserting one: none is there
            # now, which a walk of the whole table (two syscalls a key) would have found too
            return {}
        return {syscall_name(k.nr): v.count for k, v in self._viol.items() if k.cgroup_id == cgroup_id}

    def _flush_syscalls(self, cgroup_id: int | None = None, final: bool = False) -> None:
        """Report violations the kernel counted but did not report (its per-syscall
        rate limit): once their window is over, or all of them with final. One
        pass over the counters, for one sandbox or all."""
        now = time.monotonic_ns()
        # only sandboxes with counters in the table (dsec_enf_state.sys_entries): an
        # idle node never walks it, a busy one walks at most 64 entries per such sandbox
        wanted = [c for c in ([cgroup_id] if cgroup_id is not None else list(self._sbx))
                  if self._sbx.get(c) is not None and self._sbx[c].modes["sys"] in ("audit", "enforce")
                  and (self._state_entry(c) is not None and self._state_entry(c).sys_entries)]
        if not wanted:
            return
        for k, v in list(self._viol.items()):
            cgid = k.cgroup_id
            if cgroup_id is not None and cgid != cgroup_id:
                continue
            sb = self._sbx.get(cgid)
            info = self.decoder.sandboxes.get(cgid)
            if sb is None or info is None or sb.modes["sys"] not in ("audit", "enforce"):
                continue
            if not final and now - v.last_ns < self.report_ns:
                continue            # the kernel may still report them itself
            kind = "syscall_denied" if sb.modes["sys"] == "enforce" else "syscall_violation"
            rec = self.decoder.syscall_summary(info, kind, k.nr, v.count, pid=v.last_pid, ret=v.last_ret,
                                               step=sb.step)
            if rec is not None:
                self._backlog.append(rec)

    def _read_state(self, cgroup_id: int) -> dict | None:
        st = self._state_entry(cgroup_id)
        if st is None:
            return None
        emitted, lost = self._state_counts(st)
        if st.learn_lost:
            lost.setdefault("table_full", {})["egress_destination"] = st.learn_lost
        return {"emitted": emitted, "lost": lost, "killed": st.killed,
                "sys_out_of_range": st.sys_out_of_range, "sys_overflow": st.sys_overflow}

    @staticmethod
    def _totals(state: dict | None) -> dict:
        out = loss_totals(state)
        out["killed"] = state["killed"] if state else 0
        if state and state["sys_out_of_range"]:
            out["sys_out_of_range"] = state["sys_out_of_range"]   # learn: numbers >= 512 (x32 ABI)
        if state and state["sys_overflow"]:
            out["sys_overflow"] = state["sys_overflow"]   # violations past the sandbox's 64 counters
        return out

    def _flush_losses(self, cgroup_id: int, state: dict | None) -> None:
        info = self.decoder.sandboxes.get(cgroup_id)
        sb = self._sbx.get(cgroup_id)
        if info is None or state is None or sb is None:
            return
        self._report_losses(cgroup_id, info, sb.step, state["lost"])


def _budget(rate, burst) -> tuple[int, int]:
    return token_bucket(rate, burst, "event budget", "records")


__all__ = ["EnforcementSensor", "check_features", "require_features", "describe_features", "egress_table",
           "gc_stale_pins", "PIN_ROOT"]
