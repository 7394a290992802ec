"""The dsec policy model (apiVersion dsec/v1, kind SandboxPolicy).

    policy = load_policy("python-tool")          # policies.load
    policy.spec.mode, policy.name, policy.hash   # hash == content_hash(policy)
    policy.with_mode("audit")                     # same rules, same hash

Three layers:
  * pydantic models (extra="forbid") check types and each value on its own
    (syscall names, CIDRs, ports, hostnames, exec patterns, paths) and put it
    in canonical form (e.g. "10.0.0.1" -> "10.0.0.1/32", "ENOSYS" -> errno name);
  * `semantic_issues(policy)` checks the rules against each other (duplicates,
    conflicts, empty allowlists in enforce mode) and collects warnings; every
    issue carries the field path so policies.load can name file:line;
  * `normalize(policy)` sorts, de-duplicates and fills defaults, so two files
    that mean the same thing have the same `content_hash`.

Everything here is pure: no kernel access, no agent imports (errors are
policies.errors types).

Why this file is long: it is the one policy schema -- five rule kinds, each
model with its validators -- and the checks that relate them; split, each part
would need the others to check anything.
"""
from __future__ import annotations

import errno as _errno
import hashlib
import ipaddress
import json
import re
import weakref
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr,
                      ValidationInfo, model_validator)
from pydantic_core import PydanticCustomError

from policies.errors import PoliciesError, USAGE as EXIT_USAGE
from policies import syscalls as sc
from policies import sockets as sk
from policies.sockets import (SOCKET_FAMILIES, SOCKET_FAMILY_MAX, SOCKET_PROTOCOL_MAX, SOCKET_PROTOCOLS,  # noqa: F401
                              SOCKET_TYPES, number_name)

API_VERSION = "dsec/v1"
KIND = "SandboxPolicy"
MODES = ("learn", "audit", "enforce")

# clone/unshare flags that create namespaces
CLONE_NEWTIME = 0x00000080        # unshare and clone3 only (in clone, the low byte is the exit signal)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NS_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
                  | CLONE_NEWPID | CLONE_NEWNET)                  # 0x7E020000, as in Docker's profile
UNSHARE_NS_FLAGS = CLONE_NS_FLAGS | CLONE_NEWTIME

# Calls that let a process escape or weaken its confinement, or reach kernel
# attack surface a sandbox never needs: allowing one is a warning.
DANGEROUS = frozenset({
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "process_madvise",
    "bpf", "perf_event_open", "userfaultfd",
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "open_tree_attr", "fsopen", "fsconfig", "fsmount", "fspick",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd",
    "iopl", "ioperm", "settimeofday", "clock_settime",
    "lookup_dcookie", "uselib", "vhangup", "fanotify_init",
})
IO_URING = ("io_uring_setup", "io_uring_enter", "io_uring_register")
# calls the sandbox's command cannot start or end without (an enforce error when denied)
ESSENTIAL = ("execve", "exit_group")

NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,61}[a-z0-9])?$")
_LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_RANGE_RE = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")
EXEC_PATTERN_MAX = 255     # bytes: BPF LPM trie keys hold at most 256 bytes (exact paths + NUL)
PATH_MAX = 4095
ANNOTATIONS_MAX = 64
ANNOTATION_VALUE_MAX = 4096


class PolicyError(PoliciesError):
    """A policy that cannot be used. `message` is the first error (file:line: path: what);
    `errors` and `warnings` hold all of them."""

    def __init__(self, message: str, errors: list[str] | None = None, warnings: list[str] | None = None):
        super().__init__(message, EXIT_USAGE)
        self.errors = list(errors or [message])
        self.warnings = list(warnings or [])


def _fail(msg: str):
    # template "{msg}" so braces in the message are not taken as placeholders
    return PydanticCustomError("dsec", "{msg}", {"msg": msg})


# ---------------------------------------------------------------- value checks

def _check_name(v: str) -> str:
    if not NAME_RE.match(v):
        raise _fail(f"invalid name {v!r}: use 1-63 of [a-z0-9._-], starting and ending alphanumeric")
    return v


def _check_syscall(v: str) -> str:
    if not sc.is_syscall(v):
        raise _fail(sc.unknown_message(v))
    return v


def _check_errno(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise _fail(f"expected an errno name like EPERM or a number, got {_type_name(v)}")
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    if isinstance(v, int):
        if not 1 <= v <= 4095 or v not in _errno.errorcode:
            raise _fail(f"errno {v} is not a known errno number (1..133 on Linux; 0 would fake success)")
        return _errno.errorcode[v]
    name = v.strip().upper()
    if not hasattr(_errno, name) or not name.startswith("E") or not isinstance(getattr(_errno, name), int):
        import difflib
        close = difflib.get_close_matches(name, list(_errno.errorcode.values()), n=2, cutoff=0.7)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise _fail(f"unknown errno {v!r}{hint}")
    return _errno.errorcode[getattr(_errno, name)]       # canonical spelling (EAGAIN, not EWOULDBLOCK)


def errno_number(name: str) -> int:
    return getattr(_errno, name)


def _check_port(v: Any) -> Union[int, str]:
    """443 | "443" | "8000-8100" -> 443 | "8000-8100" (a one-port range becomes an int)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise _fail(f"expected a port (1-65535) or a range like \"8000-8100\", got {_type_name(v)}")
    if isinstance(v, str):
        s = v.strip()
        m = _RANGE_RE.match(s)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            for p in (lo, hi):
                if not 1 <= p <= 65535:
                    raise _fail(f"port {p} in range {v!r} is out of range (1-65535)")
            if lo > hi:
                raise _fail(f"port range {v!r} is reversed (did you mean \"{hi}-{lo}\"?)")
            return lo if lo == hi else f"{lo}-{hi}"
        if not s.isdigit():
            raise _fail(f"invalid port {v!r}: use a number (1-65535) or a range like \"8000-8100\"")
        v = int(s)
    if not 1 <= v <= 65535:
        raise _fail(f"port {v} is out of range (1-65535)")
    return v


def port_range(p: Union[int, str]) -> tuple[int, int]:
    if isinstance(p, int):
        return (p, p)
    lo, hi = p.split("-")
    return (int(lo), int(hi))


def _check_cidr(v: str) -> str:
    s = v.strip()
    try:
        net = ipaddress.ip_network(s, strict=True)
    except ValueError as e:
        try:
            loose = ipaddress.ip_network(s, strict=False)
        except ValueError:
            raise _fail(f"invalid CIDR {v!r}: {e}") from None
        raise _fail(f"invalid CIDR {v!r}: host bits are set (did you mean {str(loose)!r}?)") from None
    return str(net)


def _check_ip(v: str) -> str:
    try:
        return str(ipaddress.ip_address(v.strip()))
    except ValueError:
        raise _fail(f"invalid IP address {v!r}") from None


def _check_host(v: str) -> str:
    h = v.strip()
    if h != v or not h:
        raise _fail(f"invalid hostname {v!r}: empty or surrounded by spaces")
    try:
        ipaddress.ip_address(h)
        raise _fail(f"{v!r} is an IP address: write it as cidr: {v}")
    except ValueError:
        pass
    if "*" in h:
        raise _fail(f"invalid hostname {v!r}: wildcards are not supported (the agent resolves each name)")
    if not h.isascii():
        raise _fail(f"invalid hostname {v!r}: write internationalized names in their xn-- (punycode) form")
    if h.endswith("."):
        h = h[:-1]
    h = h.lower()
    labels = h.split(".")
    if len(h) > 253 or not all(_LABEL_RE.match(lab) for lab in labels) or labels[-1].isdigit():
        raise _fail(f"invalid hostname {v!r}: not a valid DNS name "
                    "(labels of 1-63 letters, digits and inner hyphens, at most 253 characters)")
    return h


def _check_path_common(v: str, what: str) -> None:
    if not v.startswith("/"):
        raise _fail(f"{what} {v!r} is not an absolute path")
    if any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise _fail(f"{what} {v!r} contains a control character")
    if len(v.encode()) > PATH_MAX:
        raise _fail(f"{what} is longer than {PATH_MAX} bytes")
    parts = v.split("/")[1:]          # "/a/b" -> ["a", "b"]; a trailing "/" gives a last ""
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise _fail(f"{what} {v!r} is not normalized (no '//', '.' or '..' components)")


def _check_exec_pattern(v: str) -> str:
    _check_path_common(v, "exec pattern")
    body = v[:-1] if v.endswith("*") else v
    if any(c in body for c in "*?["):
        raise _fail(f"exec pattern {v!r}: only one trailing '*' is supported (a prefix match, "
                    "e.g. /usr/bin/python3*); no other globbing")
    if v.endswith("/"):
        raise _fail(f"exec pattern {v!r} names a directory (did you mean {v + '*'!r}?)")
    if len(body.encode()) > EXEC_PATTERN_MAX:
        raise _fail(f"exec pattern is longer than {EXEC_PATTERN_MAX} bytes (the kernel matcher's limit)")
    return v


def _check_writable(v: str) -> str:
    _check_path_common(v, "writable path")
    if any(c in v for c in "*?["):
        raise _fail(f"writable path {v!r}: patterns are not supported, name a directory or a file")
    if v != "/" and v.endswith("/"):
        v = v.rstrip("/")
    return v


def _check_written_dir(v: str) -> str:
    _check_path_common(v, "exec.allow_written_under path")
    if any(c in v for c in "*?["):
        raise _fail(f"exec.allow_written_under path {v!r}: patterns are not supported, name a directory")
    if v != "/" and v.endswith("/"):
        v = v.rstrip("/")
    if v == "/":
        raise _fail("exec.allow_written_under '/' would let anything written anywhere run: name the directories "
                    "(e.g. /tmp, /workspace)")
    if len(v.encode()) + 1 > EXEC_PATTERN_MAX:
        raise _fail(f"exec.allow_written_under path is longer than {EXEC_PATTERN_MAX - 1} bytes "
                    "(the kernel matcher's limit)")
    return v


def _check_family(v: Any) -> int:
    return _sock(sk.family, v)


def _check_socktype(v: Any) -> int:
    return _sock(sk.socktype, v)


def _check_sockproto(v: Any) -> int:
    return _sock(sk.protocol, v)


def _sock(fn, v):
    try:
        return fn(v)
    except ValueError as e:
        raise _fail(str(e)) from None


def _check_annotation_key(v: str) -> str:
    if not v or len(v) > 253 or any(ord(c) < 33 for c in v):
        raise _fail(f"invalid annotation key {v!r}: 1-253 characters, no spaces")
    return v


def _check_annotation_value(v: str) -> str:
    if len(v) > ANNOTATION_VALUE_MAX:
        raise _fail(f"annotation value longer than {ANNOTATION_VALUE_MAX} characters")
    return v


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(v), type(v).__name__)


Name = Annotated[str, AfterValidator(_check_name)]
SyscallName = Annotated[str, AfterValidator(_check_syscall)]
Errno = Annotated[str, BeforeValidator(_check_errno)]
Port = Annotated[Union[int, str], BeforeValidator(_check_port)]
Cidr = Annotated[str, AfterValidator(_check_cidr)]
IPAddr = Annotated[str, AfterValidator(_check_ip)]
Host = Annotated[str, AfterValidator(_check_host)]
ExecPattern = Annotated[str, AfterValidator(_check_exec_pattern)]
WritablePath = Annotated[str, AfterValidator(_check_writable)]
WrittenDir = Annotated[str, AfterValidator(_check_written_dir)]
SocketFamily = Annotated[int, BeforeValidator(_check_family)]
SocketType = Annotated[int, BeforeValidator(_check_socktype)]
SocketProtocol = Annotated[int, BeforeValidator(_check_sockproto)]
AnnotationKey = Annotated[str, AfterValidator(_check_annotation_key)]
AnnotationValue = Annotated[str, AfterValidator(_check_annotation_value)]


# ---------------------------------------------------------------- models

class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Metadata(_Base):
    name: Name = Field(description="policy name: 1-63 of [a-z0-9._-]; carried by every audit event")
    annotations: dict[AnnotationKey, AnnotationValue] = Field(
        default_factory=dict, max_length=ANNOTATIONS_MAX,
        description="free-form notes (description, owner, ...); not part of the content hash")


class SocketRule(_Base):
    family: SocketFamily = Field(description="address family: unix, inet, inet6, netlink, packet, vsock ... "
                                             "or a number")
    types: list[SocketType] = Field(default_factory=list,
                                    description="socket types (stream, dgram, raw, seqpacket ...); empty = any")
    protocols: list[SocketProtocol] = Field(
        default_factory=list, description="protocols (default = 0, tcp, udp, icmp, sctp ... or a number; "
                                          "for netlink the netlink protocol number); empty = any")


# the socket rules when a policy names none (docs/enforcement.md "Sockets")
DEFAULT_SOCKETS = (
    {"family": "unix"},
    {"family": "inet", "types": ["stream", "dgram"], "protocols": ["default", "tcp", "udp"]},
    {"family": "inet6", "types": ["stream", "dgram"], "protocols": ["default", "tcp", "udp"]},
)


class Syscalls(_Base):
    default: Literal["allow", "deny"] = Field(
        description="what happens to a call not listed: deny (an allowlist) or allow (a denylist)")
    action: Literal["errno", "kill"] = Field(
        "errno", description="what a denied call gets in enforce mode: an errno, or the process is killed")
    errno: Optional[Errno] = Field(
        None, description="errno a denied call returns with action: errno (name or number; default EPERM)")
    allow: list[SyscallName] = Field(default_factory=list, description="allowed calls (with default: deny)")
    deny: list[SyscallName] = Field(default_factory=list, description="denied calls (with default: allow)")
    errnos: dict[SyscallName, Errno] = Field(
        default_factory=dict,
        description="per-call errno for denied calls (e.g. ENOSYS for calls libc falls back from); "
                    "also applies with action: kill")
    namespaces: Literal["allow", "deny"] = Field(
        "deny", description="deny: clone/unshare with CLONE_NEW* flags and setns are denied, clone3 "
                            "returns ENOSYS (so libc falls back to clone, whose flags seccomp can check)")
    sockets: Optional[Union[Literal["any"], list[SocketRule]]] = Field(
        None, description="which socket()/socketpair() calls are allowed, by their arguments: omitted = "
                          "the default set (unix; inet and inet6 with stream or dgram and protocol 0, tcp or "
                          "udp); 'any' = no argument rule; a list = exactly these (denied ones fail with "
                          "EAFNOSUPPORT -- the policy's errno under default: deny -- or kill with action: kill)")


class EgressRule(_Base):
    cidr: Optional[Cidr] = Field(None, description="an IPv4/IPv6 network (a bare address means /32 or /128)")
    host: Optional[Host] = Field(None, description="a DNS name, resolved by the agent and refreshed on TTL")
    ports: list[Port] = Field(default_factory=list,
                              description="destination ports: numbers or \"lo-hi\" ranges; empty = all ports")
    protocol: Literal["tcp", "udp", "any"] = Field("any", description="tcp, udp or any")

    @model_validator(mode="after")
    def _one_target(self):
        if (self.cidr is None) == (self.host is None):
            raise _fail("a rule needs exactly one of cidr: or host:")
        return self


class Egress(_Base):
    default: Literal["allow", "deny"] = Field(description="what happens to a connection no rule matches")
    allow: list[EgressRule] = Field(default_factory=list, description="allowed destinations (with default: deny)")
    deny: list[EgressRule] = Field(default_factory=list, description="denied destinations (with default: allow)")
    dns: list[IPAddr] = Field(default_factory=list,
                              description="resolvers the sandbox may query (UDP and TCP port 53), in order")


class Exec(_Base):
    allow: list[ExecPattern] = Field(
        description="absolute paths, or a prefix ending in a single '*' (/usr/bin/python3*)")
    allow_written_under: list[WrittenDir] = Field(
        default_factory=list,
        description="writable directories whose files (the sandbox's own, written there) may be executed: "
                    "exec under them is allowed by the exec allowlist and they are not mounted noexec")


class Files(_Base):
    writable: list[WritablePath] = Field(
        description="absolute paths writable in the sandbox; everything else is read-only")


class Spec(_Base):
    mode: Literal["learn", "audit", "enforce"] = Field(
        "enforce", description="learn: record only; audit: report would-deny, block nothing; enforce: block")
    syscalls: Optional[Syscalls] = Field(None, description="seccomp rules; omitted = allow every call "
                                                           "(namespace creation is still denied)")
    egress: Optional[Egress] = Field(None, description="outbound network rules; omitted = as dsec run --network")
    exec: Optional[Exec] = Field(None, description="binaries that may be executed; omitted = any")
    files: Optional[Files] = Field(None, description="writable paths; omitted = the launcher's layout")


_SEALED: dict[int, dict] = {}      # Policy.seal()'s memos: id(policy) -> {"hash", "yaml"}, dropped with it


class Policy(_Base):
    apiVersion: Literal["dsec/v1"] = Field(description="always dsec/v1")
    kind: Literal["SandboxPolicy"] = Field(description="always SandboxPolicy")
    metadata: Metadata
    spec: Spec

    _source: str = PrivateAttr(default="<policy>")
    _warnings: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo):
        if info.context and info.context.get("raw"):
            return self                         # policies.load runs the checks itself, with line numbers
        errs = [i for i in semantic_issues(self) if i.severity == "error"]
        if errs:
            raise _fail(str(errs[0]))
        return self

    # -- convenience
    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def hash(self) -> str:
        return (_SEALED.get(id(self)) or {}).get("hash") or content_hash(self)

    def seal(self) -> "Policy":
        """Keep the hash (and dump_yaml's YAML) of a policy shared and never changed again (the agent's
        policy cache). Copies are not sealed; the memo is by id, dropped with it: equality unchanged."""
        if id(self) not in _SEALED:
            _SEALED[id(self)] = {"hash": content_hash(self)}
            weakref.finalize(self, _SEALED.pop, id(self), None)
        return self

    def sealed(self) -> Optional[dict]:   # seal()'s memo (hash, and yaml once dumped), or None
        return _SEALED.get(id(self))

    @property
    def source(self) -> str:
        return self._source

    @property
    def warnings(self) -> list[str]:
        return list(self._warnings)

    def identity(self) -> dict:
        """The labels every audit event carries: policy_name, policy_hash, mode."""
        return {"policy_name": self.name, "policy_hash": self.hash, "mode": self.mode}

    def to_dict(self) -> dict:
        """Canonical plain data (normalized); what `dsec policy show` prints."""
        return canonical(self)

    def with_mode(self, mode: str) -> "Policy":
        """The same rules in another mode (the content hash does not change).
        Raises PolicyError when the rules are invalid in that mode (e.g. an
        empty exec allowlist in enforce mode)."""
        if mode not in MODES:
            raise PolicyError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        d = canonical(self)
        d["spec"]["mode"] = mode
        raw = Policy.model_validate(d, context={"raw": True})
        issues = semantic_issues(raw)
        errs = [f"{self._source}: {i}" for i in issues if i.severity == "error"]
        if errs:
            raise PolicyError(errs[0], errs)
        out = normalize(raw)
        out._source = self._source
        out._warnings = [f"{self._source}: {i}" for i in issues if i.severity == "warning"]
        return out


# ---------------------------------------------------------------- semantic checks

@dataclass(frozen=True)
class Issue:
    path: tuple
    message: str
    severity: str = "error"          # error | warning

    def __str__(self) -> str:
        p = format_path(self.path)
        return f"{p}: {self.message}" if p else self.message


def format_path(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _dups(items: list, base: tuple, what: str, key=lambda x: x) -> list[Issue]:
    seen: dict = {}
    out = []
    for i, it in enumerate(items):
        k = key(it)
        if k in seen:
            out.append(Issue(base + (i,), f"duplicate {what} {_show(it)} (also at {format_path(base)}[{seen[k]}])"))
        else:
            seen[k] = i
    return out


def _show(x) -> str:
    if isinstance(x, EgressRule):
        return repr(x.cidr or x.host)
    return repr(x)


def semantic_issues(p: Policy) -> list[Issue]:
    """Cross-field checks on a validated (not necessarily normalized) policy.
    Errors make the policy unusable; warnings are printed by `dsec policy check`."""
    out: list[Issue] = []
    spec = p.spec
    enforce = spec.mode == "enforce"
    S = ("spec", "syscalls")
    s = spec.syscalls
    if s is None:
        if enforce:
            out.append(Issue(("spec",), "no syscalls section: every call is allowed "
                                        "(creating namespaces is still denied)", "warning"))
    else:
        out += _dups(s.allow, S + ("allow",), "syscall")
        out += _dups(s.deny, S + ("deny",), "syscall")
        allowed_at = {n: i for i, n in reversed(list(enumerate(s.allow)))}
        for i, n in enumerate(s.deny):
            if n in allowed_at:
                out.append(Issue(S + ("deny", i), f"{n!r} is both allowed (spec.syscalls.allow[{allowed_at[n]}]) "
                                                  "and denied"))
        if s.default == "deny" and s.deny:
            out.append(Issue(S + ("deny",), "deny is only used with default: allow "
                                            "(with default: deny, every call not in allow is denied)"))
        if s.default == "allow" and s.allow:
            out.append(Issue(S + ("allow",), "allow is only used with default: deny "
                                             "(with default: allow, every call not in deny is allowed)"))
        if s.action == "kill" and s.errno is not None:
            out.append(Issue(S + ("errno",), "errno only applies with action: errno (this policy kills)"))
        if s.default == "deny":
            allowed = set(s.allow)
            denied = lambda n: n not in allowed          # noqa: E731
        else:
            deny = set(s.deny)
            denied = lambda n: n in deny or (n in ("setns", "clone3") and s.namespaces == "deny")   # noqa: E731
        for n in s.errnos:
            if not denied(n):
                out.append(Issue(S + ("errnos", n), f"{n!r} is not denied by this policy: "
                                                    "errnos only sets what a denied call returns"))
        if s.namespaces == "deny":
            if "setns" in allowed_at:
                out.append(Issue(S + ("allow", allowed_at["setns"]),
                                 "'setns' is allowed but namespaces: deny denies joining namespaces"))
            if "clone3" in allowed_at:
                out.append(Issue(S + ("allow", allowed_at["clone3"]),
                                 "clone3 returns ENOSYS while namespaces: deny (so libc falls back to "
                                 "clone, whose flags seccomp can check)", "warning"))
        if enforce and s.default == "deny" and not s.allow:
            out.append(Issue(S + ("allow",) if "allow" in s.model_fields_set else S,
                             "enforce mode with default: deny needs a non-empty allow list "
                             "(every call would be denied, execve included)"))
        if enforce and not (s.default == "deny" and not s.allow):
            for n in ESSENTIAL:
                if denied(n):
                    where = S + (("deny", s.deny.index(n)) if n in s.deny else ("allow",))
                    out.append(Issue(where, f"{n} must be allowed in enforce mode (the filter is loaded "
                                            "before the command is executed, and processes must be able to exit)"))
        # warnings: io_uring, dangerous calls
        if s.default == "deny":
            where = {n: S + ("allow", i) for n, i in allowed_at.items()}
            allowed_names = list(allowed_at)
        else:
            allowed_names = [n for n in sc.names() if not denied(n)]
            where = {n: S + ("default",) for n in allowed_names}
        ur = [n for n in IO_URING if n in allowed_names]
        if ur:
            out.append(Issue(where[ur[0]], f"allows {', '.join(ur)}: io_uring lets a process do I/O that syscall "
                                           "tracing never sees (the built-in policies deny it)", "warning"))
        bad = [n for n in allowed_names if n in DANGEROUS
               and not (s.namespaces == "deny" and n == "setns")]
        if bad:
            first = min(bad, key=lambda n: where[n])
            note = " (with namespaces: deny, unshare may not create namespaces)" if (
                "unshare" in bad and s.namespaces == "deny") else ""
            out.append(Issue(where[first], f"allows calls a sandbox should not need: {', '.join(sorted(bad))}{note}",
                             "warning"))
    e = spec.egress
    E = ("spec", "egress")
    if e is not None:
        key = lambda r: (r.cidr, r.host, r.protocol, tuple(sorted(port_range(x) for x in r.ports)))  # noqa: E731
        for lst in ("allow", "deny"):
            rules = getattr(e, lst)
            out += _dups(rules, E + (lst,), "rule", key)
            for i, r in enumerate(rules):
                ranges = sorted((port_range(x), j) for j, x in enumerate(r.ports))
                for (a, ja), (b, jb) in zip(ranges, ranges[1:]):
                    if b[0] <= a[1]:
                        j = max(ja, jb)
                        out.append(Issue(E + (lst, i, "ports", j),
                                         f"port {r.ports[j]!r} overlaps {r.ports[min(ja, jb)]!r} in the same rule"))
        if e.default == "deny" and e.deny:
            out.append(Issue(E + ("deny",), "deny is only used with default: allow"))
        if e.default == "allow" and e.allow:
            out.append(Issue(E + ("allow",), "allow is only used with default: deny"))
        out += _dups(e.dns, E + ("dns",), "resolver")
        if e.default == "deny" and not e.dns:
            hosts = [(i, r.host) for i, r in enumerate(e.allow) if r.host]
            if hosts:
                out.append(Issue(E + ("allow", hosts[0][0], "host"),
                                 f"no dns resolvers: the sandbox cannot resolve {hosts[0][1]!r} itself "
                                 "(add egress.dns)", "warning"))
    x = spec.exec
    if x is not None:
        out += _dups(x.allow, ("spec", "exec", "allow"), "pattern")
        out += _dups(x.allow_written_under, ("spec", "exec", "allow_written_under"), "directory")
        writable = None if spec.files is None else list(spec.files.writable)
        for i, d in enumerate(x.allow_written_under):
            X = ("spec", "exec", "allow_written_under", i)
            if d == "/":
                out.append(Issue(X, "'/' would let every file run: name the writable directories"))
                continue
            scratch = any(d == s_ or d.startswith(s_ + "/") for s_ in ("/tmp", "/dev/shm"))
            if writable is not None and not scratch and not any(
                    w == "/" or d == w or d.startswith(w.rstrip("/") + "/") for w in writable):
                out.append(Issue(X, f"{d!r} is not writable (files.writable): nothing the sandbox writes "
                                    "can be there", "warning"))
        if enforce and not x.allow:
            out.append(Issue(("spec", "exec", "allow"), "enforce mode needs a non-empty exec allowlist "
                                                        "(no command could run)"))
        prefixes = [(i, pat[:-1]) for i, pat in enumerate(x.allow) if pat.endswith("*")]
        for i, pat in enumerate(x.allow):
            for j, pre in prefixes:
                if j != i and pat != x.allow[j] and pat.startswith(pre):
                    out.append(Issue(("spec", "exec", "allow", i),
                                     f"{pat!r} is already matched by {x.allow[j]!r}", "warning"))
                    break
        if enforce and x.allow and spec.files is not None and "/" in spec.files.writable:
            out.append(Issue(("spec", "files", "writable", spec.files.writable.index("/")),
                             "'/' writable with an exec allowlist: a file written under an allowed path could be "
                             "executed; list the writable directories (and exec.allow_written_under for those "
                             "whose files may run)"))
    if s is not None and isinstance(s.sockets, list):
        out += _dups(s.sockets, S + ("sockets",), "socket rule",
                     key=lambda r: (r.family, tuple(sorted(r.types)), tuple(sorted(r.protocols))))
    f = spec.files
    if f is not None:
        out += _dups(f.writable, ("spec", "files", "writable"), "path")
        for i, pth in enumerate(f.writable):
            if pth == "/":
                out.append(Issue(("spec", "files", "writable", i), "'/' makes the whole filesystem writable",
                                 "warning"))
                continue
            for q in f.writable:
                if q != pth and (q == "/" or pth.startswith(q + "/")):
                    out.append(Issue(("spec", "files", "writable", i), f"{pth!r} is inside {q!r}", "warning"))
                    break
    return out


# ---------------------------------------------------------------- normalization and hash

def _merge_ports(ports: list) -> list:
    ranges = sorted(port_range(x) for x in ports)
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [lo if lo == hi else f"{lo}-{hi}" for lo, hi in merged]


def _rule_dict(r: EgressRule) -> dict:
    d: dict = {"cidr": r.cidr} if r.cidr else {"host": r.host}
    ports = _merge_ports(r.ports)
    if ports:
        d["ports"] = ports
    d["protocol"] = r.protocol
    return d


def _rule_sort_key(d: dict):
    if "cidr" in d:
        net = ipaddress.ip_network(d["cidr"])
        k = (0, net.version, int(net.network_address), net.prefixlen, "")
    else:
        k = (1, 0, 0, 0, d["host"])
    return k + (d["protocol"], [port_range(x) for x in d.get("ports", [])])


def _uniq(seq):
    seen = set()
    return [x for x in seq if not (x in seen or seen.add(x))]


def canonical(p: Policy) -> dict:
    """The normalized policy as plain data: defaults filled in, lists sorted and
    de-duplicated (egress.dns keeps its order: resolvers are tried in order)."""
    md: dict = {"name": p.metadata.name}
    if p.metadata.annotations:
        md["annotations"] = dict(sorted(p.metadata.annotations.items()))
    s = p.spec.syscalls or Syscalls(default="allow")
    sd: dict = {"default": s.default, "action": s.action}
    if s.action == "errno":
        sd["errno"] = s.errno or "EPERM"
    sd["namespaces"] = s.namespaces
    # with namespaces: deny, clone3 (ENOSYS) and setns (denied) are decided by that
    # rule whatever the lists say: they are left out of the canonical lists
    implied = {"clone3", "setns"} if s.namespaces == "deny" else set()
    if s.default == "deny":
        sd["allow"] = sorted(set(s.allow) - implied)
    else:
        sd["deny"] = sorted(set(s.deny) - implied)
    if s.errnos:
        sd["errnos"] = dict(sorted(s.errnos.items()))
    socks = canonical_sockets(s)
    if socks is not None:
        sd["sockets"] = socks
    spec: dict = {"mode": p.spec.mode, "syscalls": sd}
    e = p.spec.egress
    if e is not None:
        lst = "allow" if e.default == "deny" else "deny"
        rules = {json.dumps(d, sort_keys=True): d for d in map(_rule_dict, getattr(e, lst))}
        ed: dict = {"default": e.default, lst: sorted(rules.values(), key=_rule_sort_key)}
        if e.dns:
            ed["dns"] = _uniq(e.dns)
        spec["egress"] = ed
    if p.spec.exec is not None:
        spec["exec"] = {"allow": sorted(set(p.spec.exec.allow))}
        if p.spec.exec.allow_written_under:       # omitted when empty: older policies keep their hash
            spec["exec"]["allow_written_under"] = sorted(set(p.spec.exec.allow_written_under))
    if p.spec.files is not None:
        spec["files"] = {"writable": sorted(set(p.spec.files.writable))}
    return {"apiVersion": p.apiVersion, "kind": p.kind, "metadata": md, "spec": spec}


def _socket_dict(r: SocketRule) -> dict:
    d: dict = {"family": number_name(r.family, SOCKET_FAMILIES)}
    if r.types:
        d["types"] = [number_name(t, SOCKET_TYPES) for t in sorted(set(r.types))]
    if r.protocols:
        d["protocols"] = [number_name(x, SOCKET_PROTOCOLS) for x in sorted(set(r.protocols))]
    return d


def _default_socket_dicts() -> list[dict]:
    return [_socket_dict(SocketRule.model_validate(r)) for r in DEFAULT_SOCKETS]


def canonical_sockets(s: Syscalls):
    """The socket rules as written in the canonical form: None when they are the
    default set (omitted, so the content hash of a policy that names none does
    not change), "any", or the sorted list."""
    if s.sockets is None:
        return None
    if s.sockets == "any":
        return "any"
    rules = {json.dumps(d, sort_keys=True): d for d in map(_socket_dict, s.sockets)}
    out = sorted(rules.values(), key=lambda d: (SOCKET_FAMILIES.get(d["family"], d["family"])
                                                if isinstance(d["family"], str) else d["family"],
                                                json.dumps(d, sort_keys=True)))
    if out == sorted(_default_socket_dicts(), key=lambda d: SOCKET_FAMILIES[d["family"]]):
        return None
    return out


def socket_rules(s: Syscalls | None) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]] | None:
    """(family, types, protocols) the policy allows (empty tuple = any), or None for any socket."""
    s = s or Syscalls(default="allow")
    if s.sockets == "any":
        return None
    rules = s.sockets if s.sockets is not None else [SocketRule.model_validate(r) for r in DEFAULT_SOCKETS]
    return [(r.family, tuple(sorted(set(r.types))), tuple(sorted(set(r.protocols)))) for r in rules]


def normalize(p: Policy) -> Policy:
    """A normalized copy (see canonical()); keeps source and warnings."""
    out = Policy.model_validate(canonical(p), context={"raw": True})
    out._source = p._source
    out._warnings = list(p._warnings)
    return out


def hashed_content(p: Policy) -> dict:
    """What content_hash covers: apiVersion, kind and the normalized spec without
    its mode. Not covered: metadata (name, annotations) and spec.mode, so a policy
    keeps its hash when it is renamed, annotated, or promoted audit -> enforce."""
    d = canonical(p)
    spec = dict(d["spec"])
    spec.pop("mode", None)
    return {"apiVersion": d["apiVersion"], "kind": d["kind"], "spec": spec}


def content_hash(p: Policy) -> str:
    """sha256 (64 hex digits) of the canonical JSON (sorted keys, no spaces, UTF-8)
    of hashed_content(p)."""
    blob = json.dumps(hashed_content(p), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- schema

SCHEMA_ID = "https://dsec.dev/schemas/policy-v1.json"


def json_schema() -> dict:
    """The JSON Schema of a policy file, generated from the models (policies/schema.json)."""
    s = Policy.model_json_schema()
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
           "title": "dsec SandboxPolicy (apiVersion dsec/v1)",
           "description": "See policies/README.md. Beyond this schema, dsec checks syscall names against "
                          "the x86_64 table, CIDRs, ports, hostnames, exec patterns and cross-field rules."}
    out.update({k: v for k, v in s.items() if k != "title"})
    return out


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def write_schema(path: str | None = None) -> str:
    """Regenerate policies/schema.json: .venv/bin/python -c 'import policies.model as m; m.write_schema()'"""
    import os
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.json")
    with open(path, "w") as f:
        f.write(schema_text())
    return path
