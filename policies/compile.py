"""Pure compilation of a policy into what the agent applies. Nothing here loads
anything into the kernel: the launcher loads the seccomp filter, the eBPF loader
fills its maps from these values.

    filt = seccomp_filter(policy)        # seccomp.SyscallFilter, NOT loaded
    bits = syscall_bitmap(policy)        # 64 bytes: bit n set = x86_64 syscall n allowed
    egress_rules(policy)                 # EgressRules or None (no egress section: per --network)
    exec_rules(policy)                   # [(prefix bytes, exact)] or None (any binary)
    exec_allowed(policy, path, cwd=None) # canonical absolute path (or <cwd>/<name>) matched by the allowlist?
    writable_paths(policy)               # [abs path] or None (the launcher's layout)
    mount_layout(policy)                 # MountLayout: writable paths, noexec, exec dirs
    namespace_rules(policy)              # NamespaceRules (clone/unshare flags, setns)
    socket_rules(policy)                 # [(family, types, protocols)] or None (any socket)
    ebpf_concerns(policy)                # rule kinds only eBPF enforces ("egress", "exec")
    node_protected(addr)                 # is addr in the ranges --network egress refuses by default?

Seccomp filter, by mode (x86_64 only; see policies/README.md):
  enforce  denied calls get ERRNO(errno) (per-call `errnos` first) or KILL_PROCESS
           with action: kill; calls from another ABI (i386 int 0x80, x32) kill the
           process (the policy names x86_64 calls only).
  audit    denied calls get SCMP_ACT_LOG (allowed, logged by the kernel's audit
           subsystem; verified on this kernel) -- pass audit_log=False for plain
           ALLOW; other ABIs are LOG too. Nothing is blocked.
  learn    everything ALLOW (the launcher may skip loading it).
  In enforce and audit, clone3 returns ENOSYS whenever the policy does not allow
  it outright (namespaces: deny, or clone3 not allowed): glibc then falls back to
  clone, whose flags seccomp can inspect; with namespaces: deny, clone and unshare
  with any CLONE_NEW* flag and setns are denied (LOG in audit). socket() and
  socketpair() are allowed only with the arguments of syscalls.sockets (the
  default set when the policy names none): other families get EAFNOSUPPORT,
  other types or protocols EPROTONOSUPPORT (KILL_PROCESS with action: kill).
"""
from __future__ import annotations

import errno as _errno
import ipaddress
from dataclasses import dataclass, field

from policies import syscalls as sc
from policies.model import (CLONE_NS_FLAGS, SOCKET_FAMILY_MAX, SOCKET_PROTOCOL_MAX, UNSHARE_NS_FLAGS, Policy,
                            PolicyError, Syscalls, errno_number, port_range)
from policies.model import socket_rules as _model_socket_rules

BITMAP_BYTES = sc.NR_MAX // 8
ALL_PORTS = ((0, 65535),)


def _sm():
    try:
        import seccomp
    except ImportError:
        raise PolicyError("libseccomp's Python bindings are missing (apt-get install python3-seccomp)") from None
    return seccomp


def _syscalls(policy: Policy) -> Syscalls:
    return policy.spec.syscalls or Syscalls(default="allow")


def _nr(name: str) -> int:
    nr = sc.number(name)
    if nr is None:                       # the model validated names; this is a table mismatch
        raise PolicyError(f"syscall {name!r} is not in the x86_64 table")
    return nr


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(64) if mask & (1 << i)]


def _binary_tree(sm, f) -> None:
    """The same rules laid out as a binary search over the syscall numbers (libseccomp >= 2.5,
    SCMP_FLTATR_CTL_OPTIMIZE=2) instead of a linear chain: the kernel's load of the program
    (seccomp(2) emulates it for every syscall number to build its allow cache) takes ~85 us
    instead of ~200 us here, paid by every step's process (bench/launch.py agent-step; docs/
    launch-figures.md), and a syscall that reaches the filter walks ~log2(n) tests, not n.
    An older libseccomp without the attribute keeps the linear layout (the same decisions)."""
    try:
        f.set_attr(sm.Attr.CTL_OPTIMIZE, 2)
    except (AttributeError, OSError, RuntimeError, ValueError):
        pass


def seccomp_filter(policy: Policy, *, audit_log: bool = True):
    """A seccomp.SyscallFilter for the policy (not loaded; the caller sets
    no_new_privs and calls .load() right before execve)."""
    sm = _sm()
    if sm.system_arch() & 0xFFFFFFFF != sm.Arch.X86_64 & 0xFFFFFFFF:     # the binding mixes signedness
        raise PolicyError("dsec's syscall tables are x86_64-only; this machine is another architecture")
    s = _syscalls(policy)
    mode = policy.spec.mode
    if mode == "learn":
        f = sm.SyscallFilter(sm.ALLOW)
        f.set_attr(sm.Attr.ACT_BADARCH, sm.ALLOW)
        return f
    if mode == "enforce":
        deny = sm.KILL_PROCESS if s.action == "kill" else sm.ERRNO(errno_number(s.errno or "EPERM"))
        per_call = {n: sm.ERRNO(errno_number(e)) for n, e in s.errnos.items()}
        badarch = sm.KILL_PROCESS
    else:                                 # audit
        deny = sm.LOG if audit_log else sm.ALLOW
        per_call = {}
        badarch = deny
    enosys = sm.ERRNO(_errno.ENOSYS)
    ns_deny = s.namespaces == "deny"
    default = deny if s.default == "deny" else sm.ALLOW
    f = sm.SyscallFilter(default)
    f.set_attr(sm.Attr.ACT_BADARCH, badarch)
    _binary_tree(sm, f)

    def add(action, name, *args):
        if action == default:             # libseccomp refuses rules equal to the default action
            return
        f.add_rule(action, _nr(name), *args)

    clone3_done = False
    sock_args = socket_rules(policy) is not None
    if s.default == "deny":
        allowed = set(s.allow)
        for n in sorted(allowed):
            if sock_args and n in SOCKET_CALLS:
                continue                  # allowed with their arguments only (_socket_filter)
            if ns_deny and n == "clone":
                add(sm.ALLOW, n, sm.Arg(0, sm.MASKED_EQ, CLONE_NS_FLAGS, 0))
            elif ns_deny and n == "unshare":
                add(sm.ALLOW, n, sm.Arg(0, sm.MASKED_EQ, UNSHARE_NS_FLAGS, 0))
            elif n == "clone3" and ns_deny:
                continue
            elif n == "setns" and ns_deny:
                continue                  # rejected by validation; never allow it here
            else:
                add(sm.ALLOW, n)
        for n, act in sorted(per_call.items()):
            if n not in allowed:
                add(act, n)
                clone3_done |= n == "clone3"
        if not clone3_done and (ns_deny or "clone3" not in allowed):
            add(enosys, "clone3")
    else:
        denied = set(s.deny)
        for n in sorted(denied):
            if n == "clone3" and n not in per_call:
                continue                  # handled below: ENOSYS, so libc falls back to clone
            add(per_call.get(n, deny), n)
            clone3_done |= n == "clone3"
        if ns_deny:
            if "clone" not in denied:
                for bit in _bits(CLONE_NS_FLAGS):
                    add(deny, "clone", sm.Arg(0, sm.MASKED_EQ, bit, bit))
            if "unshare" not in denied:
                for bit in _bits(UNSHARE_NS_FLAGS):
                    add(deny, "unshare", sm.Arg(0, sm.MASKED_EQ, bit, bit))
            if "setns" not in denied:
                add(per_call.get("setns", deny), "setns")
        if not clone3_done and (ns_deny or "clone3" in denied):
            add(enosys, "clone3")
    _socket_filter(sm, f, policy, add, default, mode, s)
    return f


SOCK_TYPE_MASK = 0xF
SOCKET_CALLS = ("socket", "socketpair")
# calls whose rules look at their arguments (beside clone: socket rules, namespaces)
_ARG_CHECKED = frozenset(SOCKET_CALLS) | {"unshare", "setns", "clone3"}


def syscalls_allowed(policy: Policy, names) -> bool:
    """Does seccomp_filter(policy) let every call in `names` through, whatever its arguments
    (clone: without CLONE_NEW* flags, which a namespaces: deny rule looks at)? Learn mode: there
    is no filter. A call whose rules depend on its arguments (socket rules, namespaces) is not
    answered for: False."""
    if policy.spec.mode == "learn":
        return True
    names = set(names)
    if names & _ARG_CHECKED:
        return False
    s = _syscalls(policy)
    if s.default == "deny":
        return names <= set(s.allow)
    return not names & set(s.deny)


_NOTHING = object()


def _sealed_memo(policy: Policy, key: str, build):
    """build(), kept in the memo of a sealed policy (the agent's policy cache: one object for
    every sandbox of that policy, never changed again: model.Policy.seal); built each time
    for any other policy."""
    memo = policy.sealed() if isinstance(policy, Policy) else None
    if memo is None:
        return build()
    v = memo.get(key, _NOTHING)
    if v is _NOTHING:
        v = memo[key] = build()
    return v


def socket_rules(policy: Policy):
    """[(family, types, protocols)] the policy allows for socket()/socketpair()
    (an empty tuple: any), or None when any socket is allowed."""
    rules = _sealed_memo(policy, "socket_rules", lambda: _model_socket_rules(policy.spec.syscalls))
    return None if rules is None else list(rules)       # a list of the caller's own


def socket_allowed(policy: Policy, family: int, sock_type: int, protocol: int) -> bool:
    """Would the socket rules let socket(family, type, protocol) through? (type
    may carry SOCK_NONBLOCK/SOCK_CLOEXEC; they are masked off, as the kernel does)"""
    rules = socket_rules(policy)
    if rules is None:
        return True
    t = sock_type & SOCK_TYPE_MASK
    return any(f == family and (not ts or t in ts) and (not ps or protocol in ps) for f, ts, ps in rules)


def _complement(values, hi: int) -> tuple[list[int], int | None]:
    """The values in 0..hi not in `values`, as single values plus the first value
    from which every larger one is outside (None: none)."""
    vs = set(values)
    top = max(vs) + 1 if vs else 0
    return [v for v in range(top) if v not in vs], (top if top <= hi else None)


def _socket_filter(sm, f, policy, add, default, mode, s):
    """socket()/socketpair() argument rules (see the module doc). libseccomp ORs
    the rules of one call and ANDs the comparisons of one rule, and cannot say
    "not in", so a denylist filter gets one deny rule per value outside the
    allowed set, an allowlist filter one allow rule per allowed combination."""
    rules = socket_rules(policy)
    if rules is None or mode == "learn":
        return
    if mode == "enforce":
        kill = s.action == "kill"
        fam_deny = sm.KILL_PROCESS if kill else sm.ERRNO(_errno.EAFNOSUPPORT)
        arg_deny = sm.KILL_PROCESS if kill else sm.ERRNO(_errno.EPROTONOSUPPORT)
    else:
        fam_deny = arg_deny = sm.LOG
    by_family: dict[int, list] = {}
    for fam, ts, ps in rules:
        by_family.setdefault(fam, []).append((ts, ps))
    allowed_nrs = allowed_numbers(policy)
    for call in SOCKET_CALLS:
        if _nr(call) not in allowed_nrs:
            continue                      # denied outright by the call rules
        if s.default == "deny":
            for fam, combos in sorted(by_family.items()):
                for ts, ps in combos:
                    for t in (ts or (None,)):
                        for pr in (ps or (None,)):
                            args = [sm.Arg(0, sm.EQ, fam)]
                            if t is not None:
                                args.append(sm.Arg(1, sm.MASKED_EQ, SOCK_TYPE_MASK, t))
                            if pr is not None:
                                args.append(sm.Arg(2, sm.EQ, pr))
                            add(sm.ALLOW, call, *args)
            continue
        # default allow: deny what is outside the rules
        singles, tail = _complement(by_family, SOCKET_FAMILY_MAX - 1)
        for fam in singles:
            add(fam_deny, call, sm.Arg(0, sm.EQ, fam))
        add(fam_deny, call, sm.Arg(0, sm.GE, tail if tail is not None else SOCKET_FAMILY_MAX))
        for fam, combos in sorted(by_family.items()):
            if any(not ts and not ps for ts, ps in combos):
                continue                  # this family with any type and protocol
            if len(combos) > 1:
                raise PolicyError(f"syscalls.sockets: family {fam} is listed {len(combos)} times with "
                                  "different types/protocols; dsec can compile one rule per family in a "
                                  "default: allow policy (list the union)")
            ts, ps = combos[0]
            if ts:
                for t in range(SOCK_TYPE_MASK + 1):
                    if t not in ts:
                        add(arg_deny, call, sm.Arg(0, sm.EQ, fam), sm.Arg(1, sm.MASKED_EQ, SOCK_TYPE_MASK, t))
            if ps:
                psingles, ptail = _complement(ps, SOCKET_PROTOCOL_MAX)
                for pr in psingles:
                    add(arg_deny, call, sm.Arg(0, sm.EQ, fam), sm.Arg(2, sm.EQ, pr))
                add(arg_deny, call, sm.Arg(0, sm.EQ, fam),
                    sm.Arg(2, sm.GE, ptail if ptail is not None else SOCKET_PROTOCOL_MAX + 1))


def allowed_numbers(policy: Policy) -> set[int]:
    """x86_64 numbers (0..NR_MAX-1) the policy allows, as the eBPF violation check
    sees them: clone and unshare count as allowed when their flags are checked
    by seccomp (namespace_rules() has the flags); clone3 counts as allowed when
    clone is (its ENOSYS is a libc compatibility shim, not a violation)."""
    s = _syscalls(policy)
    if s.default == "deny":
        nrs = {_nr(n) for n in s.allow}
        if s.namespaces == "deny":
            nrs.discard(_nr("setns"))
    else:
        nrs = set(range(sc.NR_MAX)) - {_nr(n) for n in s.deny}
        if s.namespaces == "deny":
            nrs.discard(_nr("setns"))
    clone, clone3 = _nr("clone"), _nr("clone3")
    if clone in nrs:
        nrs.add(clone3)
    return nrs


def syscall_bitmap(policy: Policy) -> bytes:
    """BITMAP_BYTES bytes; bit n (byte n // 8, bit n % 8) set = syscall n allowed."""
    def build():
        out = bytearray(BITMAP_BYTES)
        for nr in allowed_numbers(policy):
            out[nr >> 3] |= 1 << (nr & 7)
        return bytes(out)
    return _sealed_memo(policy, "syscall_bitmap", build)


def syscall_allowed(policy: Policy, name_or_nr, flags: int | None = None) -> bool:
    """Would the policy allow this call (in enforce mode)? `flags` is clone/unshare's
    first argument when known. For replay's what-if evaluation."""
    nr = name_or_nr if isinstance(name_or_nr, int) else sc.number(name_or_nr)
    if nr is None:
        return False
    s = _syscalls(policy)
    if flags is not None and s.namespaces == "deny":
        if nr == _nr("clone") and flags & CLONE_NS_FLAGS:
            return False
        if nr == _nr("unshare") and flags & UNSHARE_NS_FLAGS:
            return False
    if nr == _nr("clone3") and (s.namespaces == "deny" or not _in_allow(s, "clone3")):
        return False
    return nr in allowed_numbers(policy)


def _in_allow(s: Syscalls, name: str) -> bool:
    return name in s.allow if s.default == "deny" else name not in s.deny


@dataclass(frozen=True)
class NamespaceRules:
    deny: bool                 # namespaces: deny
    clone_flags: int           # clone with any of these flags is denied
    unshare_flags: int         # unshare with any of these flags is denied
    setns_denied: bool


def namespace_rules(policy: Policy) -> NamespaceRules:
    s = _syscalls(policy)
    deny = s.namespaces == "deny"
    setns_denied = deny or (s.default == "deny" and "setns" not in s.allow) or (
        s.default == "allow" and "setns" in s.deny)
    return NamespaceRules(deny, CLONE_NS_FLAGS if deny else 0, UNSHARE_NS_FLAGS if deny else 0, setns_denied)


# ---------------------------------------------------------------- egress

@dataclass(frozen=True)
class NetRule:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    ports: tuple[tuple[int, int], ...]       # inclusive ranges; ALL_PORTS when the rule names none
    protocol: str                            # tcp | udp | any
    source: str = "policy"                   # policy | dns (implicit rule for a resolver) | host:NAME

    def matches(self, addr, port: int, protocol: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return (ip.version == self.network.version and ip in self.network
                and any(lo <= port <= hi for lo, hi in self.ports)
                and (self.protocol == "any" or self.protocol == protocol))


@dataclass(frozen=True)
class HostRule:
    host: str
    ports: tuple[tuple[int, int], ...]
    protocol: str

    def resolved(self, addresses) -> list[NetRule]:
        """NetRules for the addresses the agent resolved the name to."""
        out = []
        for a in addresses:
            ip = ipaddress.ip_address(a)
            out.append(NetRule(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}"), self.ports, self.protocol,
                               f"host:{self.host}"))
        return out


@dataclass(frozen=True)
class EgressRules:
    default: str                                   # allow | deny
    allow: list[NetRule] = field(default_factory=list)     # includes resolvers (source "dns") with default deny
    deny: list[NetRule] = field(default_factory=list)
    allow_hosts: list[HostRule] = field(default_factory=list)
    deny_hosts: list[HostRule] = field(default_factory=list)
    dns: list = field(default_factory=list)        # ipaddress objects, in order

    def decide(self, addr, port: int, protocol: str, host_addrs: dict | None = None) -> str:
        """'allow' or 'deny' for a connection (host_addrs: {host: [addresses]} as resolved)."""
        host_addrs = host_addrs or {}
        def rules(nets, hosts):
            out = list(nets)
            for h in hosts:
                out += h.resolved(host_addrs.get(h.host, []))
            return out
        if self.default == "deny":
            hit = any(r.matches(addr, port, protocol) for r in rules(self.allow, self.allow_hosts))
            return "allow" if hit else "deny"
        hit = any(r.matches(addr, port, protocol) for r in rules(self.deny, self.deny_hosts))
        return "deny" if hit else "allow"


def _ports(rule: dict) -> tuple[tuple[int, int], ...]:
    ps = rule.get("ports") or []
    return tuple(port_range(p) for p in ps) or ALL_PORTS


def egress_rules(policy: Policy) -> EgressRules | None:
    """Normalized egress rules, or None when the policy has no egress section
    (egress is then whatever `dsec run --network` sets up)."""
    e = policy.spec.egress
    if e is None:
        return None
    from policies.model import canonical
    ed = canonical(policy)["spec"]["egress"]
    lists: dict = {"allow": ([], []), "deny": ([], [])}
    for lst in ("allow", "deny"):
        nets, hosts = lists[lst]
        for r in ed.get(lst, []):
            if "cidr" in r:
                nets.append(NetRule(ipaddress.ip_network(r["cidr"]), _ports(r), r["protocol"]))
            else:
                hosts.append(HostRule(r["host"], _ports(r), r["protocol"]))
    dns = [ipaddress.ip_address(a) for a in ed.get("dns", [])]
    if e.default == "deny":
        for a in dns:
            lists["allow"][0].append(NetRule(ipaddress.ip_network(f"{a}/{a.max_prefixlen}"), ((53, 53),),
                                             "any", "dns"))
    return EgressRules(e.default, lists["allow"][0], lists["deny"][0], lists["allow"][1], lists["deny"][1], dns)


# ---------------------------------------------------------------- exec and files

def exec_rules(policy: Policy) -> list[tuple[bytes, bool]] | None:
    """[(prefix, exact)] sorted, or None when any binary may run. A pattern
    ending in '*' is a prefix (exact=False, the '*' dropped); otherwise exact;
    each exec.allow_written_under directory is the prefix "DIR/".
    For a BPF LPM trie: an exact entry is the path plus its NUL terminator
    (prefix length (len+1)*8), a prefix entry the bytes without NUL (len*8).
    The kernel matches only canonical absolute paths (canonical_exec_path)."""
    x = policy.spec.exec
    if x is None:
        return None
    out = set()
    for pat in x.allow:
        if pat.endswith("*"):
            out.add((pat[:-1].encode(), False))
        else:
            out.add((pat.encode(), True))
    for d in x.allow_written_under:
        out.add((d.encode() + b"/", False))
    return sorted(out)


EXEC_KEY_PATH = 252    # bpf/events.h DSEC_EXEC_KEY_PATH: longer names match no pattern in the kernel


def canonical_exec_path(p: bytes) -> bool:
    """Is this the kind of name the exec allowlist matches: absolute, without
    '//', '/./', '/../' (or a trailing '/.', '/..'), and not a /dev/fd/N name
    (what the kernel reports for execveat with a dirfd or fexecve)? The kernel
    side (bpf/enforce.c) refuses every other name, whatever the patterns."""
    if not p.startswith(b"/") or b"\0" in p or len(p) >= EXEC_KEY_PATH:
        return False
    if b"//" in p or b"/./" in p or b"/../" in p or p.endswith((b"/.", b"/..")):
        return False
    return not p.startswith(b"/dev/fd/")


def _strip_dot_slash(n: bytes) -> bytes:
    for _ in range(8):             # as many as the kernel's check drops (bpf/enforce.c enf_exec_relative)
        if not n.startswith(b"./"):
            break
        n = n[2:]
    return n


def relative_exec_canonical(name: str | bytes) -> bool:
    """A relative exec name the kernel's check can join to the cwd: after its
    leading "./", no empty, "." or ".." component (bpf/enforce.c enf_exec_relative)."""
    n = _strip_dot_slash(name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape"))
    return bool(n) and not n.startswith(b"/") and all(c not in (b"", b".", b"..") for c in n.split(b"/"))


def resolve_exec(path: str | bytes, cwd: str | bytes | None) -> bytes:
    """A relative exec name joined to the process's cwd the way the kernel's
    exec check joins it (bpf/enforce.c enf_exec_relative): leading "./" dropped,
    then <cwd>/<name>, with no other normalisation (a '.', '..' or empty
    component makes the result non-canonical: it matches nothing, as in the
    kernel). An absolute name, or one with no cwd known, is unchanged."""
    p = path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")
    if p.startswith(b"/") or cwd is None:
        return p
    c = cwd if isinstance(cwd, bytes) else cwd.encode("utf-8", "surrogateescape")
    return c.rstrip(b"/") + b"/" + _strip_dot_slash(p)


def exec_allowed(policy: Policy, path: str | bytes, cwd: str | bytes | None = None) -> bool:
    """Does the exec allowlist let this path run, as the kernel decides it (for
    replay's what-if and the decision on audit records)? A relative name is
    joined to `cwd` first, as the kernel's check does (no cwd: it matches
    nothing)."""
    rules = exec_rules(policy)
    if rules is None:
        return True
    p = resolve_exec(path, cwd)
    if not canonical_exec_path(p):
        return False
    return any(p == pre if exact else p.startswith(pre) for pre, exact in rules)


def writable_paths(policy: Policy) -> list[str] | None:
    """Sorted absolute paths writable in the sandbox, or None (the launcher's default layout)."""
    f = policy.spec.files
    if f is None:
        return None
    return sorted(set(f.writable))


# writable under an exec allowlist when the policy lists no files.writable (besides
# the scratch tmpfs mounts /tmp and /dev/shm): the usual places a tool writes
EXEC_DEFAULT_WRITABLE = ("/workspace", "/var/tmp", "/root", "/home")


@dataclass(frozen=True)
class MountLayout:
    writable: list[str] | None       # writable paths (None: everything, the launcher's default layout)
    implied: bool                    # writable is EXEC_DEFAULT_WRITABLE (the policy lists none)
    noexec: bool                     # every writable layer is mounted noexec ...
    exec_dirs: list[str]             # ... except these (exec.allow_written_under)


def mount_layout(policy: Policy | None) -> MountLayout:
    """What the launcher mounts for a policy (docs/enforcement.md "Exec").

    Under an exec allowlist in enforce mode, nothing the sandbox writes may run
    unless it is under exec.allow_written_under: every writable layer (/tmp,
    /dev/shm, the writable paths) is mounted noexec and the image's own layers
    are read-only (so a binary written under an allowed path cannot exist)."""
    if policy is None:
        return MountLayout(None, False, False, [])
    enforce = policy.mode == "enforce"
    w = writable_paths(policy) if enforce else None
    x = policy.spec.exec
    if not (enforce and x is not None):
        return MountLayout(w, False, False, [])
    implied = w is None
    if implied:
        w = list(EXEC_DEFAULT_WRITABLE)
    return MountLayout(w, implied, True, sorted(set(x.allow_written_under)))


def ebpf_concerns(policy: Policy | None) -> list[str]:
    """The rule kinds of this policy that only eBPF enforces (or, in audit mode,
    reports): "egress" (cgroup connect/sendmsg hooks) and "exec" (the exec
    allowlist). A sandbox whose policy has any of them runs with the eBPF
    enforcement sensor or not at all (agent/sandbox/launcher.py)."""
    if policy is None or policy.mode == "learn":
        return []
    out = []
    if egress_rules(policy) is not None:
        out.append("egress")
    if exec_rules(policy) is not None:
        out.append("exec")
    return out


# ---------------------------------------------------------------- node protection

# What `--network egress` refuses when the policy has no egress section (no
# explicit rules): the node's metadata service, link-local, loopback, private,
# shared (CGNAT), ULA, multicast and reserved ranges. The node's own addresses
# are refused for every sandbox (the firewall's input chain). A policy opens any
# of them with an explicit egress section.
NODE_PROTECTED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b:1::/48", "fc00::/7", "fe80::/10", "ff00::/8"))


def node_protected(addr) -> bool:
    """Is this destination one --network egress refuses by default? (The
    sandbox's own loopback is not: it never leaves the sandbox.)"""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    if ip.is_loopback:
        return False
    return any(ip.version == n.version and ip in n for n in NODE_PROTECTED)


def implied_defaults(policy: Policy) -> list[str]:
    """What the launcher adds to a policy that leaves a section out, in words
    (`dsec policy show` prints them as comments)."""
    out = []
    if policy.spec.egress is None:
        ranges = ", ".join(str(n) for n in NODE_PROTECTED)
        out.append("egress: no egress section: with --network egress the node is protected: connections to "
                   f"{ranges} are refused (DNS to the node's resolvers stays open; an egress section opens "
                   "these ranges explicitly); connections to the node's own addresses are always refused; IPv6 "
                   "is disabled in the sandbox")
    s = policy.spec.syscalls
    if s is None or s.sockets is None:
        out.append("syscalls.sockets: the default set: unix; inet and inet6 with stream or dgram and protocol "
                   "default, tcp or udp; other families EAFNOSUPPORT, other types/protocols EPROTONOSUPPORT (under "
                   "a default: deny syscall allowlist: the policy's errno)")
    lay = mount_layout(policy)
    if lay.noexec:
        where = ", ".join(lay.exec_dirs) or "none"
        out.append(f"exec: every writable layer is mounted noexec (exec.allow_written_under: {where}) and the "
                   "image is read-only" + (f"; writable: {', '.join(lay.writable)} (no files section)"
                                           if lay.implied else ""))
    return out
