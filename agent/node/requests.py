"""Requests to the node agent, checked before anything happens: CreateSandbox
and Exec fields against the agent's limits (docs/agent.md "Limits"), and the
policies they name, loaded once and shared.

    fields = check_create(req, cfg)             # ApiError(INVALID_ARGUMENT) naming every problem
    env, workdir, timeout, grace = check_exec(start)
    policy = PolicyCache(cfg).load(name, yaml_text, mode, source)
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict

from audit_schema.errors import ReportedError
from agent.node.records import (MAX_ARG_BYTES, MAX_ARGV_ITEMS, MAX_ENV_ITEMS, MAX_EXEC_BYTES, MAX_GRACE,
                                MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, ApiError, _bad, _fs, _printable)


class PolicyCache:
    """Policies by name (built-in or a NAME.yaml of the agent's policy_dirs) or by
    YAML text, with an optional mode override."""

    def __init__(self, cfg):
        self.default = cfg.defaults.policy
        self.dirs = list(cfg.policy_dirs)
        self._cache: OrderedDict = OrderedDict()

    def load(self, name: str | None, yaml_text: str | None, mode: str | None, source: str = ""):
        """A Policy from a name (built-in / policy_dirs) or YAML text, with an optional mode
        override. Loaded policies are cached (by file and mtime, or by text): thousands of
        sandboxes of one policy share one object."""
        import hashlib
        from policies.load import builtin_path
        if yaml_text is not None:
            key = ("yaml", hashlib.sha256(yaml_text.encode("utf-8", "surrogateescape")).hexdigest(), source, mode)
        else:
            n = name or self.default
            path = next((os.path.join(d, n + sfx) for d in self.dirs for sfx in (".yaml", ".yml")
                         if os.path.isfile(os.path.join(d, n + sfx))), None) if "/" not in n else None
            path = path or (builtin_path(n) if "/" not in n else None)
            try:
                mtime = os.stat(path).st_mtime_ns if path else None
            except OSError:
                mtime = None
            key = ("name", n, path, mtime, mode)
        cache = self._cache
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
        # sealed: its hash and YAML, named by several records of every sandbox, computed once
        policy = self._load(name, yaml_text, mode, source).seal()
        cache[key] = policy
        while len(cache) > 256:
            cache.popitem(last=False)
        return policy

    def _load(self, name, yaml_text, mode, source):
        from policies.load import load_policy, load_policy_text
        from policies.model import PolicyError
        try:
            if yaml_text is not None:
                if len(yaml_text.encode("utf-8", "surrogateescape")) > (1 << 20):
                    raise _bad("policy.yaml: larger than 1 MiB")
                policy = load_policy_text(yaml_text, source or "<request policy>")
            else:
                name = name or self.default
                if "/" in name or name.startswith(".") or not _printable(name) or len(name) > 128:
                    raise _bad(f"policy.name {name!r}: a built-in name or a NAME.yaml of the agent's policy_dirs "
                               f"(send a file's contents as policy.yaml)")
                path = None
                for d in self.dirs:
                    for suffix in (".yaml", ".yml"):
                        cand = os.path.join(d, name + suffix)
                        if os.path.isfile(cand):
                            path = cand
                            break
                    if path:
                        break
                policy = load_policy(path or name)
            if mode:
                if mode not in ("learn", "audit", "enforce"):
                    raise _bad(f"policy.mode {mode!r}: expected learn, audit or enforce")
                policy = policy.with_mode(mode)
        except PolicyError as e:
            raise _bad(f"policy: {e.message}") from None
        return policy


def check_create(req: dict, cfg) -> dict:
    """The CreateSandboxRequest fields (Python values, see api.py) checked against
    the agent's limits: every problem in one ApiError (INVALID_ARGUMENT), or the
    fields with the defaults of `cfg` (AgentConfig) filled in."""
    from agent.sandbox import launcher
    from agent.node.scheduler import CLASSES
    d = cfg.defaults
    problems = []
    sid = req.get("sandbox_id") or ""
    if sid:
        try:
            launcher.validate_id(sid)
        except ReportedError:
            problems.append(f"sandbox_id {sid[:80]!r}: use 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
    res = req.get("resources") or {}
    cpus, memory, pids = res.get("cpus", 0.0), res.get("memory_bytes", 0), res.get("pids", 0)
    if not isinstance(cpus, (int, float)) or math.isnan(cpus) or math.isinf(cpus) or cpus < 0:
        problems.append(f"resources.cpus: must be a number >= 0 (0 = the agent's default), got {cpus!r}")
    if memory < 0:
        problems.append(f"resources.memory_bytes: must be >= 0 (0 = the default), got {memory}")
    elif 0 < memory < (4 << 20):
        problems.append(f"resources.memory_bytes: at least 4 MiB (4194304), got {memory}")
    if pids < 0:
        problems.append(f"resources.pids: must be >= 0 (0 = the default), got {pids}")
    elif pids > (1 << 22):
        problems.append(f"resources.pids: at most {1 << 22}, got {pids}")
    priority = req.get("priority") or d.priority
    if priority not in CLASSES:
        problems.append(f"priority {priority[:40]!r}: expected one of {', '.join(CLASSES)}")
    network = req.get("network") or "none"
    if network not in ("none", "egress"):
        problems.append(f"network {network[:40]!r}: expected none or egress")
    rootfs = req.get("rootfs") or None
    if rootfs is not None:
        from agent.sandbox.rootfs import check_rootfs
        if not rootfs.startswith("/") or not os.path.isdir(rootfs):
            problems.append(f"rootfs {rootfs[:200]!r}: not an absolute path of a directory on the agent's host")
        else:
            try:
                check_rootfs(rootfs)
            except ValueError as e:
                problems.append(f"rootfs {rootfs[:200]!r}: {e}")
    workdir = req.get("workdir") or "/workspace"
    if not workdir.startswith("/") or "\0" in workdir or len(workdir) > 4096:
        problems.append(f"workdir {workdir[:200]!r}: must be an absolute path")
    user = req.get("user") or "sandbox"
    if len(user) > 64 or not _printable(user) or any(c.isspace() for c in user):
        problems.append(f"user {user[:80]!r}: expected NAME, UID or UID:GID")
    labels = req.get("labels") or {}
    if len(labels) > MAX_LABELS:
        problems.append(f"labels: at most {MAX_LABELS}, got {len(labels)}")
    for k, v in list(labels.items())[:MAX_LABELS + 1]:
        if not k or len(k) > MAX_LABEL_KEY or not _printable(k):
            problems.append(f"labels: key {k[:80]!r}: 1-{MAX_LABEL_KEY} printable characters")
        if len(v) > MAX_LABEL_VALUE or not _printable(v):
            problems.append(f"labels[{k[:40]!r}]: value of at most {MAX_LABEL_VALUE} printable characters")
    env = {}
    try:
        env = parse_env(req.get("env") or [], "env")
    except ApiError as e:
        problems.append(e.message)
    lifetime = req.get("lifetime_seconds") or 0.0
    if math.isnan(lifetime) or lifetime < 0 or lifetime > cfg.limits.max_lifetime_seconds:
        problems.append(f"lifetime_seconds: between 0 (default) and {cfg.limits.max_lifetime_seconds:g}, "
                        f"got {lifetime}")
    grace = req.get("grace_seconds") or 0.0
    if math.isnan(grace) or grace < 0 or grace > MAX_GRACE:
        problems.append(f"grace_seconds: between 0 (default) and {MAX_GRACE:g}, got {grace}")
    over_budget = req.get("over_budget") or cfg.audit.over_budget
    if over_budget not in ("summarise", "stop"):
        problems.append(f"over_budget {over_budget[:40]!r}: expected summarise or stop")
    if problems:
        raise _bad("; ".join(problems))
    return {"sandbox_id": sid, "cpus": cpus, "memory": memory, "pids": pids, "priority": priority,
            "network": network, "rootfs": rootfs, "workdir": workdir, "user": user, "labels": labels, "env": env,
            "lifetime": lifetime, "grace": grace, "over_budget": over_budget}


def parse_env(items, what: str) -> dict:
    env = {}
    if len(items) > MAX_ENV_ITEMS:
        raise _bad(f"{what}: at most {MAX_ENV_ITEMS} variables, got {len(items)}")
    for i, (k, v) in enumerate(items):
        if not k or b"=" in k or b"\0" in k:
            raise _bad(f"{what}[{i}]: name {k[:60]!r}: must be non-empty without '=' or NUL")
        if b"\0" in v:
            raise _bad(f"{what}[{i}] ({k[:60]!r}): value contains a NUL byte")
        if len(k) + len(v) > MAX_ARG_BYTES:
            raise _bad(f"{what}[{i}] ({k[:60]!r}): longer than {MAX_ARG_BYTES} bytes")
        env[_fs(k)] = _fs(v)
    return env


def check_exec(start: dict) -> tuple[dict, str | None, float, float]:
    """An ExecStart's fields checked: (env, workdir, timeout, grace), or one
    ApiError naming every problem."""
    argv = start.get("argv") or []
    problems = []
    if not start.get("sandbox_id"):
        problems.append("sandbox_id: required")
    if not argv:
        problems.append("argv: at least the command is required")
    if len(argv) > MAX_ARGV_ITEMS:
        problems.append(f"argv: at most {MAX_ARGV_ITEMS} arguments, got {len(argv)}")
    for i, a in enumerate(argv[:MAX_ARGV_ITEMS + 1]):
        if b"\0" in a:
            problems.append(f"argv[{i}]: contains a NUL byte")
            break
        if len(a) >= MAX_ARG_BYTES:
            problems.append(f"argv[{i}]: {len(a)} bytes; one argument may have at most {MAX_ARG_BYTES - 1} "
                            f"(Linux MAX_ARG_STRLEN)")
            break
    timeout = start.get("timeout_seconds") or 0.0
    grace = start.get("grace_seconds") or 0.0
    if math.isnan(timeout) or timeout < 0:
        problems.append(f"timeout_seconds: must be >= 0 (0 = none), got {timeout}")
    if math.isnan(grace) or grace < 0 or grace > MAX_GRACE:
        problems.append(f"grace_seconds: between 0 (default) and {MAX_GRACE:g}, got {grace}")
    workdir = start.get("workdir") or None
    if workdir is not None and (not workdir.startswith("/") or "\0" in workdir):
        problems.append(f"workdir {workdir[:200]!r}: must be an absolute path")
    env = {}
    try:
        env = parse_env(start.get("env") or [], "env")
    except ApiError as e:
        problems.append(e.message)
    if not problems:
        enc = len(json.dumps({"argv": [_fs(a) for a in argv], "env": env}))
        if enc > MAX_EXEC_BYTES:
            problems.append(f"argv and env: {enc} bytes once encoded; a step may carry at most "
                            f"{MAX_EXEC_BYTES} (put large inputs in stdin or files)")
    if problems:
        raise _bad("; ".join(problems))
    return env, workdir, timeout, grace
