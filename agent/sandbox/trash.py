"""What of a closed sandbox's teardown runs off the close's path: its state
directory, and (for the node agent) an egress sandbox's host link.

    trash.remove_later(state_dir)     # one rename; a background thread removes it
    trash.later(sid, fn)              # fn() on that thread; until it has run, wait_for(sid) waits
    trash.drain(timeout=10)           # wait until everything queued is gone (also at exit)
    trash.sweep(sandboxes_dir)        # what a crash left (`dsec gc`, the agent's start)

The directory (its upper and work layers, the mount point, state.json, the lock:
~21 entries for a default sandbox) is renamed into <state dir>/trash/ (the same
file system: one rename, and the sandbox id is free at once), and a daemon thread
removes it. Removing it inline was ~2 ms of a close on a quiet node and up to 12 ms
on a busy one, nearly all of it waiting (on this VM's root file system, ext4
without a journal mounted with `discard`, every freed block is discarded inline;
~1.3 ms of CPU): docs/launch-figures.md. Where the rename fails (no trash directory
can be made, another file system) the directory is removed inline, as before.

An egress sandbox's host link (agent/sandbox/netns.py teardown: the nftables
element, then the veth, whose deletion waits for the kernel's synchronous
unregister) took ~19 ms of a close; the node agent runs it here (the launcher's
Sandbox.teardown_later), followed by the rest of the teardown that must come
after it: the state directory's rename, its lock's release (until then `dsec
gc` sees a live sandbox, links included) and the uid lease's. A start of the
same sandbox id in this process waits for it (wait_for), and the agent's
`cleaned` record for the sandbox is written after it (Sandbox.after_teardown
queues it here), not when the close answers.
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading

from agent.sandbox import trees

_q: "queue.SimpleQueue" = queue.SimpleQueue()     # a path to remove, or (key, fn) to run
_lock = threading.Lock()
_thread: threading.Thread | None = None
_pending = 0
_keys: dict[str, int] = {}          # key -> its jobs queued or running (later())
_idle = threading.Condition(_lock)
IN_FS = ".trash"         # the trash in a sandboxes directory with a file system of its own (trash_dir)


def trash_dir(sandboxes_dir: str) -> str:
    """The trash directory on the sandboxes' state directories' file system (a rename
    is all a close pays): beside them (<state dir>/trash), or, when the sandboxes
    directory is a file system of its own (host.scratch: memory, agent/sandbox/scratch.py),
    in it (<state dir>/sandboxes/.trash)."""
    sd = os.path.abspath(sandboxes_dir)
    if is_own_fs(sd):
        return os.path.join(sd, IN_FS)
    return os.path.join(os.path.dirname(sd), "trash")


def is_own_fs(path: str) -> bool:
    """True when `path` is the root of a file system of its own (a mount point)."""
    try:
        return os.stat(path).st_dev != os.stat(os.path.join(path, "..")).st_dev
    except OSError:
        return False


def remove_later(state_dir: str) -> None:
    """Take `state_dir` out of the way now (rename) and remove it in the background."""
    tdir = trash_dir(os.path.dirname(os.path.abspath(state_dir)))
    dest = os.path.join(tdir, f"{os.path.basename(state_dir)}-{os.urandom(4).hex()}")
    try:
        try:
            os.rename(state_dir, dest)
        except FileNotFoundError:
            if not os.path.exists(state_dir):
                return
            os.mkdir(tdir, 0o700)
            os.rename(state_dir, dest)
    except OSError:
        trees.remove(state_dir)
        return
    _put(dest)


def later(key: str, fn) -> None:
    """Run fn() on the background thread, after what is queued before it; until it has
    run, wait_for(key) waits (a sandbox id: its next start waits for its teardown)."""
    with _lock:
        _keys[key] = _keys.get(key, 0) + 1
    _put((key, fn))


def wait_for(key: str, timeout: float = 30.0) -> bool:
    """Wait until every job of `key` queued so far has run; False at the timeout."""
    with _lock:
        return _idle.wait_for(lambda: not _keys.get(key), timeout)


def _put(item) -> None:
    global _thread, _pending
    with _lock:
        _pending += 1
        if _thread is None:
            _thread = threading.Thread(target=_run, name="dsec-trash", daemon=True)
            _thread.start()
            atexit.register(drain)
    _q.put(item)


def _run() -> None:
    global _pending
    while True:
        item = _q.get()
        key = None
        if isinstance(item, tuple):
            key, fn = item
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the thread outlives one failed job (said on stderr)
                sys.stderr.write(f"dsec: background teardown of {key}: {e!r}\n")
        else:
            try:
                trees.remove(item)        # any depth (a workload's tree: agent/sandbox/trees.py)
            except Exception as e:  # noqa: BLE001 - the thread outlives one failed removal (said on stderr)
                sys.stderr.write(f"dsec: background removal of {item}: {e!r}\n")
        with _lock:
            _pending -= 1
            if key is not None:
                _keys[key] -= 1
                if not _keys[key]:
                    del _keys[key]
            _idle.notify_all()


def drain(timeout: float = 10.0) -> bool:
    """Wait until every directory queued so far is removed; False at the timeout."""
    with _lock:
        return _idle.wait_for(lambda: _pending == 0, timeout)


def sweep(sandboxes_dir: str) -> list[str]:
    """Remove what is in the trash directory (a crash's leftovers; another process's
    thread may be removing an entry at the same time: both ignore what is gone)."""
    tdir = trash_dir(sandboxes_dir)
    try:
        names = os.listdir(tdir)
    except OSError:
        return []
    out = []
    for n in names:
        trees.remove(os.path.join(tdir, n))
        out.append(os.path.join(tdir, n))
    return out
