"""Data volumes: host directories (or files) bind-mounted into a sandbox,
read-only unless asked, and only from the roots the node allows.

    vols = parse(["/srv/data/set1:/data", "/srv/out/run7:/out:rw"], allowed_roots=["/srv"])
    # [Volume(host="/srv/data/set1", sandbox="/data", read_only=True), ...]
    # mounted by dsec-init from the launcher's mount plan (agent/sandbox/plan.py)

Allowed roots: the agent config's `volumes.allowed_roots`; for `dsec run`
without an agent, DSEC_VOLUME_ROOTS (colon-separated), else the same key of
/etc/dsec/agent.yaml. No roots configured: no volume is allowed.

The host path is resolved (symlinks followed) and must lie inside an allowed
root. The sandbox path must be absolute, without '..', not /, /proc, /sys,
/dev or below them; dsec-init resolves it inside the sandbox's root
(openat2 RESOLVE_IN_ROOT: a symlink of the image cannot aim the mount at a
host path). Every volume is a non-recursive bind, nosuid and nodev;
read-only ones are remounted MS_RDONLY. Known limitation: the host path is
checked when the sandbox is created and mounted by path a moment later, so
a host process that can write inside an allowed root could swap a symlink
in between (keep allowed roots writable by dsec's callers only).
"""
from __future__ import annotations

import os
import stat

from agent.errors import DsecError, EXIT_USAGE

MAX_VOLUMES = 64
FORBIDDEN = ("/proc", "/sys", "/dev")
ENV_ROOTS = "DSEC_VOLUME_ROOTS"


class VolumeError(DsecError):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message, code)


class Volume:
    __slots__ = ("host", "sandbox", "read_only")

    def __init__(self, host: str, sandbox: str, read_only: bool = True):
        self.host, self.sandbox, self.read_only = host, sandbox, read_only

    def to_dict(self) -> dict:
        return {"host": self.host, "sandbox": self.sandbox, "mode": "ro" if self.read_only else "rw"}

    def __repr__(self):
        return f"Volume({self.host!r}, {self.sandbox!r}, {'ro' if self.read_only else 'rw'})"


def default_roots() -> list[str]:
    """Allowed roots for a sandbox this process launches without an agent."""
    env = os.environ.get(ENV_ROOTS)
    if env is not None:
        return [r for r in env.split(":") if r]
    path = "/etc/dsec/agent.yaml"
    if not os.path.isfile(path):
        return []
    try:
        import yaml
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        roots = ((data.get("volumes") or {}).get("allowed_roots")) or []
        return [str(r) for r in roots]
    except Exception as e:  # noqa: BLE001 - a broken config allows nothing, and says so
        raise VolumeError(f"{path}: cannot read volumes.allowed_roots ({e})")


def _clean_sandbox_path(p: str, what: str) -> str:
    if not p.startswith("/") or "\0" in p:
        raise VolumeError(f"{what}: the sandbox path {p!r} must be absolute")
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if ".." in parts:
        raise VolumeError(f"{what}: the sandbox path {p!r} must not contain '..'")
    norm = "/" + "/".join(parts)
    if norm == "/" or any(norm == f or norm.startswith(f + "/") for f in FORBIDDEN):
        raise VolumeError(f"{what}: cannot mount over {norm}")
    if any(c in norm for c in ",:"):
        raise VolumeError(f"{what}: the sandbox path {p!r} must not contain ',' or ':'")
    return norm


def parse_one(text: str, allowed_roots) -> Volume:
    what = f"--volume {text!r}"
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3:
        mode = parts[2]
    elif len(parts) != 2:
        raise VolumeError(f"{what}: expected HOST_PATH:SANDBOX_PATH[:ro|rw]")
    if mode not in ("ro", "rw"):
        raise VolumeError(f"{what}: mode {mode!r}: expected ro or rw")
    return check(parts[0], parts[1], mode == "ro", allowed_roots)


def check(host: str, sandbox: str, read_only: bool, allowed_roots) -> Volume:
    what = f"volume {host}:{sandbox}"
    if not host.startswith("/"):
        raise VolumeError(f"{what}: the host path must be absolute")
    roots = [os.path.realpath(r) for r in allowed_roots or ()]
    if not roots:
        raise VolumeError(f"{what}: no volume roots are allowed on this node (agent config volumes.allowed_roots, "
                          f"or {ENV_ROOTS} for dsec run)")
    real = os.path.realpath(host)
    if not os.path.exists(real):
        raise VolumeError(f"{what}: {host} does not exist")
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
        raise VolumeError(f"{what}: {real} is not inside an allowed root ({', '.join(roots)})")
    st = os.stat(real)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise VolumeError(f"{what}: {real} is not a directory or a regular file")
    return Volume(real, _clean_sandbox_path(sandbox, what), read_only)


def parse(items, allowed_roots) -> list[Volume]:
    items = list(items or ())
    if len(items) > MAX_VOLUMES:
        raise VolumeError(f"at most {MAX_VOLUMES} volumes, got {len(items)}")
    out = [v if isinstance(v, Volume) else parse_one(v, allowed_roots) for v in items]
    seen = set()
    for v in out:
        if v.sandbox in seen:
            raise VolumeError(f"volume {v.sandbox}: mounted twice")
        seen.add(v.sandbox)
    return out
