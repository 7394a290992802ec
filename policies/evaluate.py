"""Decide, for one recorded event, what a policy says about it.

    decision(policy, record) -> "allowed" | "denied" | "would-deny"

"denied": the policy forbids it and the mode is enforce (the kernel refused or
killed it); "would-deny": the policy forbids it but the mode is audit (it went
through and is reported); "allowed" otherwise, including everything in learn
mode. Used to stamp audit events as they are recorded and by replay's what-if
evaluation against a policy other than the one in force.

Pure: no I/O. Hostname egress rules are evaluated only against the addresses
passed in `host_addrs` (what the agent resolved); without them a host rule
matches nothing.
"""
from __future__ import annotations

import posixpath

from policies.compile import egress_rules, exec_allowed, node_protected, writable_paths

# always writable scratch mounts, whatever files.writable says (see policies/README.md)
SCRATCH = ("/tmp", "/dev", "/proc/self/fd")


def path_writable(policy, path: str) -> bool:
    w = writable_paths(policy)
    if w is None:
        return True
    path = posixpath.normpath(path) if path.startswith("/") else path   # "/ws/../x" is not under /ws
    for root in list(w) + list(SCRATCH):
        root = root.rstrip("/") or "/"
        if root == "/" or path == root or path.startswith(root + "/"):
            return True
    return False


def forbids(policy, rec: dict, host_addrs: dict | None = None) -> bool:
    """Would `policy` (whatever its mode) forbid the action this record describes?"""
    kind = rec.get("kind")
    if kind == "exec":
        return not exec_allowed(policy, rec.get("path") or "")
    if kind == "connect":
        if rec.get("family") not in ("ipv4", "ipv6"):
            return False
        rules = egress_rules(policy)
        if rules is None:
            return False
        proto = "udp" if rec.get("port") == 53 else "tcp"
        try:
            return rules.decide(rec.get("addr"), int(rec.get("port") or 0), proto, host_addrs) == "deny"
        except ValueError:
            return False
    if kind in ("open_write", "unlink"):
        return not path_writable(policy, rec.get("path") or "")
    if kind == "rename":
        return not (path_writable(policy, rec.get("path") or "") and path_writable(policy, rec.get("path2") or ""))
    if kind in ("syscall_denied", "exec_denied", "egress_denied"):
        return True
    return False


def layout_refuses(policy, rec: dict) -> bool:
    """Did the sandbox's layout (not a policy rule) refuse this, whatever the
    mode? A connect to a node-protected range under a policy without an egress
    section (the launcher's firewall refuses those: policies.compile.NODE_PROTECTED)."""
    return (rec.get("kind") == "connect" and policy.spec.egress is None
            and rec.get("family") in ("ipv4", "ipv6") and node_protected(rec.get("addr") or ""))


def decision(policy, rec: dict, host_addrs: dict | None = None) -> str:
    if policy is None:
        return "allowed"
    if layout_refuses(policy, rec):
        return "denied"
    if policy.mode == "learn":
        return "allowed"
    if not forbids(policy, rec, host_addrs):
        return "allowed"
    if policy.mode == "audit":
        return "would-deny"
    # enforce: the kernel refused it. A connect/write that failed for its own
    # reason (ECONNREFUSED ...) before enforcement could act is still "denied":
    # the policy would not have let it through.
    return "denied"
