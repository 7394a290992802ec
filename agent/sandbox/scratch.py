"""Where the sandboxes' writable layers live (the agent's `host.scratch`).

    disk    (default) their state directories under <state dir>/sandboxes, on the
            file system that holds the state directory.
    memory  one tmpfs of the agent's, mounted on <state dir>/sandboxes when it starts
            (use_memory) and unmounted when it stops with nothing left in it (release).

With `memory` every file a sandbox writes is a page of that tmpfs charged to the
sandbox's own memory cgroup (the kernel charges a tmpfs page to the cgroup of the
task that writes it): a sandbox's writes count against its memory limit, as
Kubernetes' emptyDir with medium Memory does, and past it a write fails or the
sandbox is OOM-killed, where on disk it could fill the node's disk. Nothing of a
sandbox touches the disk: its layers' directories are made and removed in memory
(on this VM's no-journal ext4 with synchronous discards: a cold create through
the agent ~1.4 ms faster of ~7.5, ~15% less of the agent's CPU a sandbox;
docs/launcher.md). The tmpfs's own size is the node's memory: the memory cgroups,
not the tmpfs, bound what is written, and the scheduler's memory capacity bounds
their sum.

Nothing else moves: the base rootfs, images, snapshots, kept upper layers (copied
out of memory at the close) and the spool stay on disk. A crashed agent leaves the
tmpfs mounted with its sandboxes' state, for the next agent's gc (or `dsec gc`, which
unmounts it once empty). use_memory refuses to cover a directory that holds another
dsec process's live sandboxes: their layers would vanish under them; the agent then
stays on disk and says so (degraded).
"""
from __future__ import annotations

import errno
import fcntl
import os

from agent.sandbox import sysutil
from agent.sandbox.gclock import gc_lock
from agent.sandbox.trash import IN_FS as TRASH, sweep

_held = -1                # the agent's fd on its tmpfs: busy (never unmounted by `dsec gc`) while it runs


def fs_type(path: str) -> str:
    """The type of the file system mounted exactly on `path` ("" when none is)."""
    path = os.path.realpath(path)
    return next((t for where, t in reversed(sysutil.mounts()) if where == path), "")


def sandbox_entries(sandboxes_dir: str) -> list[str]:
    """The sandboxes' state directories in `sandboxes_dir` (its trash left out)."""
    try:
        return [n for n in os.listdir(sandboxes_dir) if n != TRASH]
    except OSError:
        return []


def use_memory(sandboxes_dir: str) -> dict:
    """Put `sandboxes_dir` on a tmpfs of its own (mounted now, or a crashed agent's,
    reused). Returns {"scratch": "memory", "mounted": bool}, or {"scratch": "disk",
    "reason": ...} when it must stay on disk. Run once every orphan has been removed
    (the agent's start-up gc): what is left there then belongs to live sandboxes."""
    with gc_lock(fcntl.LOCK_EX):      # no launcher is between its state dir and its lock meanwhile
        return _use_memory(sandboxes_dir)


def _mem_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _hold(sandboxes_dir: str) -> None:
    global _held
    if _held < 0:
        _held = os.open(sandboxes_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _use_memory(sandboxes_dir: str) -> dict:
    os.makedirs(sandboxes_dir, mode=0o700, exist_ok=True)
    kind = fs_type(sandboxes_dir)
    if kind == "tmpfs":
        _hold(sandboxes_dir)
        return {"scratch": "memory", "mounted": False}
    if kind:
        return {"scratch": "disk", "reason": f"{sandboxes_dir} is a mount point of its own ({kind}), not a "
                                             f"tmpfs: left as it is"}
    live = sandbox_entries(sandboxes_dir)
    if live:
        return {"scratch": "disk", "reason": f"{sandboxes_dir} holds {len(live)} live sandbox(es) of other dsec "
                                             f"processes ({', '.join(sorted(live)[:3])}): a tmpfs over them would "
                                             f"hide their layers; writable layers stay on disk until the agent "
                                             f"restarts without them"}
    try:
        # no inode count of its own (nr_inodes=0): a sandbox's inodes are charged to its memory
        # cgroup as its pages are, where a shared count would let one sandbox's empty files
        # exhaust it for every other (ENOSPC)
        sysutil.mount("tmpfs", sandboxes_dir, "tmpfs", 0, f"mode=0700,size={_mem_bytes()},nr_inodes=0")
    except OSError as e:
        return {"scratch": "disk", "reason": f"cannot mount a tmpfs on {sandboxes_dir}: {e.strerror or e}"}
    _hold(sandboxes_dir)
    return {"scratch": "memory", "mounted": True}


def release(sandboxes_dir: str) -> tuple[bool, str | None]:
    """Unmount the sandboxes' tmpfs (the agent's stop) when nothing is left in it (its
    trash emptied first). Returns (unmounted now, why it stays: None when it was
    unmounted or is no tmpfs)."""
    global _held
    if _held >= 0:
        os.close(_held)
        _held = -1
    with gc_lock(fcntl.LOCK_EX):
        return release_locked(sandboxes_dir)


def release_locked(sandboxes_dir: str) -> tuple[bool, str | None]:
    """release(), gc.lock held (`dsec gc`: a running agent's tmpfs is busy, its fd in it)."""
    if fs_type(sandboxes_dir) != "tmpfs":
        return False, None
    sweep(sandboxes_dir)
    left = sandbox_entries(sandboxes_dir)
    if left:
        return False, f"{len(left)} sandbox state dir(s) left in it ({', '.join(sorted(left)[:3])})"
    try:
        sysutil.umount2(sandboxes_dir)
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False, "in use (a running agent holds it)"
        return False, f"cannot unmount it: {e.strerror or e}"
    return True, None
