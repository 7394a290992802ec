"""What a sandbox is asked to be: SandboxSpec, and its id's rules (out of launcher.py,
which re-exports every name here; it was over the layout's ~800 lines).

    spec = SandboxSpec(argv=["python3", "x.py"], memory=256 << 20, network="none")
    sid = validate_id(spec.sandbox_id or new_sandbox_id())
"""
from __future__ import annotations

import os
import re

from agent.errors import DsecError, EXIT_DSEC

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class SandboxSpec:
    """What to run and how (plain class: dataclasses would cost `dsec run` ~6 ms of imports).

    rootfs: a directory, the read-only lower layer of /; layers: several lower
    layers, topmost first (an image's layers from the layer store, or a
    snapshot's; rootfs is then ignored); volumes: agent/sandbox/volumes.Volume
    (checked against the allowed roots) or {"source": host path, "target": path
    inside, "readonly": bool}, bind-mounted (data, never baked into an image)."""

    def __init__(self, argv, sandbox_id=None, cpus=None, memory=1 << 30, pids=1024, timeout=None,
                 grace=3.0, rootfs=None, network="none", env=None, workdir="/workspace",
                 user="sandbox", keep=False, tmp_size=None, policy=None, layers=None, image=None, volumes=None,
                 rootfs_roots=None):
        self.argv: list[str] = list(argv)
        self.sandbox_id: str | None = sandbox_id
        self.cpus: float | None = cpus
        self.memory: int | None = memory
        self.pids: int | None = pids
        self.timeout: float | None = timeout
        self.grace: float = grace
        self.rootfs: str | None = rootfs
        self.rootfs_roots = rootfs_roots  # None: any directory rootfs.check_rootfs accepts
        self.allow_root = True            # False: uid/gid 0 inside is refused (an API caller without "root")
        self.network: str = network
        self.env: dict[str, str] = dict(env or {})
        self.workdir: str = workdir
        self.user: str = user
        self.keep: bool = keep
        self.tmp_size: int | None = tmp_size
        self.policy = policy              # policies.model.Policy or None (no filter, all writable)
        # an image (agent/sandbox/images): its unpacked layers as overlay lower dirs, top first,
        # and what the record says about it; volumes: agent/sandbox/volumes.Volume, checked
        self.layers: list[str] = list(layers or ())
        self.image: dict | None = image
        self.volumes: list = list(volumes or ())


def _volume(v) -> dict:
    """A volume as the mount plan takes it (agent/sandbox/plan.py)."""
    if isinstance(v, dict):
        return v
    return {"source": v.host, "target": v.sandbox, "readonly": bool(v.read_only)}


def new_sandbox_id() -> str:
    return "sbx-" + os.urandom(6).hex()


def validate_id(sid: str) -> str:
    if not ID_RE.match(sid):
        raise DsecError(f"invalid sandbox id {sid!r}: use 1-63 of [A-Za-z0-9_.-], starting alphanumeric", EXIT_DSEC)
    return sid
