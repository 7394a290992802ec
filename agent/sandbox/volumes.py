"""Data volumes: host directories (or files) bind-mounted into a sandbox,
read-only unless asked, and only from the roots the node allows.

    vols = parse(["/srv/data/set1:/data", "/srv/out/run7:/out:rw"], allowed_roots=["/srv"])
    # [Volume(host="/srv/data/set1", sandbox="/data", read_only=True), ...]
    mount_all(root, vols, created)      # in the sandbox's mount namespace, before pivot_root

Allowed roots: the agent config's `volumes.allowed_roots`; for `dsec run`
without an agent, DSEC_VOLUME_ROOTS (colon-separated), else the same key of
/etc/dsec/agent.yaml. No roots configured: no volume is allowed.

The host path is resolved (symlinks followed) and must lie inside an allowed
root; the mount then uses exactly the object that was checked (opened with
O_PATH and mounted through /proc/self/fd, so a symlink swapped in between is
caught). The sandbox path must be absolute, without '..', not /, /proc, /sys,
/dev or below them; inside the image it must not pass through a symlink
(an image could otherwise aim the mount at a host path). Every volume is
nosuid and nodev; read-only ones are remounted MS_RDONLY.
"""
from __future__ import annotations

import os
import stat

from agent.errors import DsecError, EXIT_USAGE
from agent.sandbox import sysutil as su

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


# --- in the sandbox's mount namespace (the supervisor, before pivot_root) ---------------

def _target(root: str, rel: str, is_dir: bool, created: list) -> str:
    """root+rel, made if missing, never through a symlink of the image."""
    p = root
    parts = [x for x in rel.split("/") if x]
    for i, part in enumerate(parts):
        p = os.path.join(p, part)
        last = i == len(parts) - 1
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            if last and not is_dir:
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            else:
                os.mkdir(p, 0o755)
            created.append("/" + "/".join(parts[:i + 1]))
            continue
        if stat.S_ISLNK(st.st_mode):
            raise OSError(f"volume {rel}: {'/'.join(parts[:i + 1])} is a symlink in the sandbox's root")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise OSError(f"volume {rel}: {'/'.join(parts[:i + 1])} is not a directory in the sandbox's root")
        if last and stat.S_ISDIR(st.st_mode) != is_dir:
            raise OSError(f"volume {rel}: the sandbox has a {'directory' if stat.S_ISDIR(st.st_mode) else 'file'} "
                          f"there, the host path is not one")
    return p


def mount_all(root: str, vols, created: list):
    """Bind-mount each volume (a dict from Volume.to_dict or a Volume) under root.
    Raises OSError with a message naming the volume."""
    for v in vols or ():
        if isinstance(v, dict):
            v = Volume(v["host"], v["sandbox"], v.get("mode", "ro") != "rw")
        fd = os.open(v.host, os.O_PATH | os.O_CLOEXEC)
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != v.host:
                raise OSError(f"volume {v.host}: the path changed after it was checked")
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            t = _target(root, v.sandbox, is_dir, created)
            su.mount(f"/proc/self/fd/{fd}", t, None, su.MS_BIND)     # not recursive: no host submounts
            ro = su.MS_RDONLY if v.read_only else 0
            su.mount(None, t, None, su.MS_BIND | su.MS_REMOUNT | su.MS_NOSUID | su.MS_NODEV | ro)
        finally:
            os.close(fd)
