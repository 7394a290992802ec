"""Pure compilation of a policy into what the agent applies. Nothing here loads
anything into the kernel: the launcher loads the seccomp filter, the eBPF loader
fills its maps from these values.

    filt = seccomp_filter(policy)        # seccomp.SyscallFilter, NOT loaded
    bits = syscall_bitmap(policy)        # 64 bytes: bit n set = x86_64 syscall n allowed
    egress_rules(policy)                 # EgressRules or None (no egress section: per --network)
    exec_rules(policy)                   # [(prefix bytes, exact)] or None (any binary)
    writable_paths(policy)               # [abs path] or None (the launcher's layout)
    namespace_rules(policy)              # NamespaceRules (clone/unshare flags, setns)

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
  with any CLONE_NEW* flag and setns are denied (LOG in audit).
"""
from __future__ import annotations

import errno as _errno
import ipaddress
from dataclasses import dataclass, field

from policies import syscalls as sc
from policies.model import (CLONE_NS_FLAGS, UNSHARE_NS_FLAGS, Policy, PolicyError, Syscalls, errno_number,
                            port_range)

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

    def add(action, name, *args):
        if action == default:             # libseccomp refuses rules equal to the default action
            return
        f.add_rule(action, _nr(name), *args)

    clone3_done = False
    if s.default == "deny":
        allowed = set(s.allow)
        for n in sorted(allowed):
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
    return f


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
    out = bytearray(BITMAP_BYTES)
    for nr in allowed_numbers(policy):
        out[nr >> 3] |= 1 << (nr & 7)
    return bytes(out)


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
    ending in '*' is a prefix (exact=False, the '*' dropped); otherwise exact.
    Each `exec.allow_written_under` directory D is the prefix "D/".
    For a BPF LPM trie: an exact entry is the path plus its NUL terminator
    (prefix length (len+1)*8), a prefix entry the bytes without NUL (len*8)."""
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
        out.add(((d.rstrip("/") + "/").encode(), False))
    return sorted(out)


def written_under(policy: Policy) -> list[str]:
    """exec.allow_written_under: directories whose files may run (never mounted noexec)."""
    x = policy.spec.exec
    return sorted(set(x.allow_written_under)) if x is not None else []


def canonical_exec_path(path: bytes) -> bool:
    """Absolute, without '//', '/./' or '/../' (what a prefix rule may match)."""
    if not path.startswith(b"/"):
        return False
    parts = path.split(b"/")[1:]
    return not any(p in (b"", b".", b"..") for p in parts)


def resolve_exec(path: str | bytes, cwd: str | bytes | None) -> bytes:
    """A relative exec name resolved against the process's cwd (lexically, as
    learning records it); an absolute one unchanged."""
    p = path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")
    if p.startswith(b"/") or cwd is None:
        return p
    c = cwd if isinstance(cwd, bytes) else cwd.encode("utf-8", "surrogateescape")
    parts: list[bytes] = []
    for comp in (c.rstrip(b"/") + b"/" + p).split(b"/"):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            if parts:
                parts.pop()
            continue
        parts.append(comp)
    return b"/" + b"/".join(parts)


def exec_allowed(policy: Policy, path: str | bytes, cwd: str | bytes | None = None) -> bool:
    """Does the exec allowlist let this path run? A relative name is resolved
    against `cwd` first (none known: it matches nothing). Prefix rules only
    match canonical paths (no '..', '.', '//' components). For replay and tests."""
    rules = exec_rules(policy)
    if rules is None:
        return True
    p = resolve_exec(path, cwd)
    if not p.startswith(b"/"):
        return False
    canon = canonical_exec_path(p)
    return any(p == pre if exact else (canon and p.startswith(pre)) for pre, exact in rules)


def writable_paths(policy: Policy) -> list[str] | None:
    """Sorted absolute paths writable in the sandbox, or None (the launcher's default layout)."""
    f = policy.spec.files
    if f is None:
        return None
    return sorted(set(f.writable))
