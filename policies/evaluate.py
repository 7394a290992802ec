"""Decide, for one recorded event, what a policy says about it.

    decision(policy, record) -> "allowed" | "denied" | "would-deny" | "failed"

"denied": the policy forbids it and the mode is enforce (the kernel refused or
killed it); "would-deny": the policy forbids it but the mode is audit (it went
through and is reported); "failed": the policy forbids it, but the action
failed on its own (an exec or write the kernel refused for a reason of its
own -- ENOENT, ENOTDIR, EACCES ...: a PATH search miss is not a policy
denial; in enforce mode also a write the read-only layout refused with EROFS
that the sandbox's user had no permission for anyway, as the agent found and
noted in extra.refused_anyway); "allowed" otherwise, including everything
in learn mode. Used to stamp audit events as they are recorded and by
replay's what-if evaluation against a policy other than the one in force.

Pure: no I/O. Hostname egress rules are evaluated only against the addresses
passed in `host_addrs` (what the agent resolved); without them a host rule
matches nothing.
"""
from __future__ import annotations

import errno as _errno
import json
import posixpath

from policies.compile import (egress_rules, exec_allowed, mount_layout, node_protected, relative_exec_canonical,
                              writable_paths)

# always writable scratch mounts, whatever files.writable says (see policies/README.md); a
# process's own /proc entries are its kernel state, not files (dsec-init itself writes
# /proc/self/oom_score_adj of every step before it execs the command)
SCRATCH = ("/tmp", "/dev", "/proc/self", "/proc/thread-self")


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
        raw = rec.get("path_raw") or ""
        path = rec.get("path") or ""
        if raw and not raw.startswith("/") and policy.spec.exec is not None:
            if not relative_exec_canonical(raw):
                return True    # a relative name the kernel's check refuses whatever its resolution
            if _has_status(rec, "cwd_unknown"):
                return True    # the kernel found no verified cwd to join it to: refused (issue 21)
            if not path.startswith("/"):
                # the cwd was gone before the record could place the name: the kernel's check
                # joined it to the cwd it verified and decided (its exec_denied record says so
                # if it refused); this record claims no denial it cannot show
                return False
        return not exec_allowed(policy, path)
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


POLICY_DECISIONS = ("denied", "would-deny")       # what the policy refused (or would have)
FAILED = "failed"                                 # forbidden, but the kernel refused it on its own
# what the read-only layout answers a write it refuses (the policy's own refusal in enforce mode)
LAYOUT_ERRNOS = (_errno.EROFS,)
ACTION_KINDS = ("exec", "open_write", "unlink", "rename")
WRITE_ACTIONS = ("open_write", "unlink", "rename")


def _ret(rec: dict):
    r = rec.get("ret")
    if r is None or isinstance(r, bool):
        return None
    try:
        return int(r)
    except (TypeError, ValueError):
        return None


def layout_refusal(rec: dict) -> bool:
    """A write the read-only layout refused (EROFS): the policy's own refusal in
    enforce mode -- unless the kernel would have refused it anyway."""
    ret = _ret(rec)
    return rec.get("kind") in WRITE_ACTIONS and ret is not None and -ret in LAYOUT_ERRNOS


def mark_refused_anyway(rec: dict, why: str | None):
    """Note in rec's extra that the agent found the write would have failed anyway
    (agent/sensors/permcheck.py: the sandbox's uid/gid lack the permission)."""
    if not why:
        return
    try:
        extra = json.loads(rec.get("extra") or "{}")
    except ValueError:
        extra = {}
    if not isinstance(extra, dict):
        extra = {}
    extra["refused_anyway"] = why.split(":", 1)[0]
    extra["refused_anyway_by"] = ("the agent's permission check, after the fact, best effort: "
                                  + why.split(":", 1)[1].strip())
    rec["extra"] = json.dumps(extra, sort_keys=True)


def _has_status(rec: dict, flag: str) -> bool:
    """`flag` is in the record's extra.status (the kernel's status bits by name; extra
    as a dict or its JSON). Parsed only when the text names it (a per-record path)."""
    extra = rec.get("extra")
    if not extra or flag not in (extra if isinstance(extra, str) else str(extra.get("status"))):
        return False
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return False
    return isinstance(extra, dict) and flag in (extra.get("status") or ())


def _refused_anyway(rec: dict) -> bool:
    extra = rec.get("extra")
    if not extra or "refused_anyway" not in extra:
        return False
    try:
        return bool(json.loads(extra).get("refused_anyway"))
    except (ValueError, AttributeError):
        return False


def failed_on_its_own(policy, rec: dict) -> bool:
    """Did this exec/write fail for a reason of the kernel's own (not the policy's)?
    An exec that returned an error never ran (the exec check acts on execs that
    succeed); a write that failed with anything but the layout's EROFS (enforce
    mode) failed whatever the policy says; an EROFS write failed on its own when
    the agent found the sandbox's user lacks the permission it needs
    (extra.refused_anyway)."""
    if rec.get("kind") not in ACTION_KINDS:
        return False
    ret = _ret(rec)
    if ret is None or ret >= 0:
        return False
    if rec.get("kind") != "exec" and policy.mode == "enforce" and -ret in LAYOUT_ERRNOS:
        return _refused_anyway(rec)
    if rec.get("kind") == "exec" and -ret == _errno.EACCES and mount_layout(policy).noexec:
        # under an exec allowlist every writable layer is noexec: the layout's (the policy's)
        # refusal of a file the sandbox wrote (or could not have run anyway: mode bits say
        # EACCES too; the policy forbids it in either case)
        return False
    return True


def _unresolved_write_let_through(policy, rec: dict) -> bool:
    """A write to a relative path the record could not place, that the kernel let
    through in enforce mode: the read-only layout allowed it (it is in a writable
    place); claiming a denial would claim more than was enforced."""
    if policy.mode != "enforce" or rec.get("kind") not in ("open_write", "unlink", "rename"):
        return False
    ret = _ret(rec)
    if ret is None or ret < 0:
        return False
    paths = [rec.get("path") or ""] + ([rec.get("path2") or ""] if rec.get("kind") == "rename" else [])
    raw = rec.get("path_raw") or ""
    # relative as given and placed by the agent only after the fact (cwd/dirfd may be gone or reused)
    return any(p and not p.startswith("/") for p in paths) or bool(raw and not raw.startswith("/"))


def layout_refuses(policy, rec: dict) -> bool:
    """Did the sandbox's layout (not a policy rule) refuse this, whatever the
    mode? A connect to a node-protected range under a policy without an egress
    section (the launcher's firewall refuses those: policies.compile.NODE_PROTECTED)."""
    return (rec.get("kind") == "connect" and policy.spec.egress is None
            and rec.get("family") in ("ipv4", "ipv6") and node_protected(rec.get("addr") or ""))


# what the kernel may count as repeats (agent/sensors/repeats.py KINDS), and of a
# connect only a loopback or unix destination (bpf/common.h dsec_agg_wanted)
AGGREGABLE = ("open_write", "unlink", "rename", "connect")


def aggregable_kinds(policy) -> tuple[str, ...]:
    """The kinds whose repeats the kernel may count under `policy`: those whose every
    record it would count -- a file write that succeeded, to an absolute path; a
    connect to loopback or a unix socket -- decision() says "allowed" for whatever
    the path or address: no policy, learn mode, no files rules (writes), no egress
    rules (connects: loopback is never node-protected). Never a kind a record of
    which could be denied, would-deny or failed."""
    if policy is None or policy.mode == "learn":
        return AGGREGABLE
    out = []
    if writable_paths(policy) is None:
        out += ["open_write", "unlink", "rename"]
    if policy.spec.egress is None:
        out.append("connect")
    return tuple(out)


def decision(policy, rec: dict, host_addrs: dict | None = None) -> str:
    if policy is None:
        return "allowed"
    if layout_refuses(policy, rec):
        return "denied"
    if policy.mode == "learn":
        return "allowed"
    if not forbids(policy, rec, host_addrs):
        return "allowed"
    if failed_on_its_own(policy, rec):
        return FAILED
    if _unresolved_write_let_through(policy, rec):
        return "allowed"
    if policy.mode == "audit":
        return "would-deny"
    if rec.get("kind") in ("open_write", "unlink", "rename") and (_ret(rec) or 0) >= 0 \
            and rec.get("ret") is not None:
        # enforce mode, yet the write went through: the layout did not refuse it.
        # Reported, but never as a denial the kernel did not make.
        return "would-deny"
    # enforce: the kernel refused it. A connect/write that failed for its own
    # reason (ECONNREFUSED ...) before enforcement could act is still "denied":
    # the policy would not have let it through.
    return "denied"
