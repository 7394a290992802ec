"""Walking and removing directory trees that a sandbox wrote: any depth.

    for dirpath, dirnames, filenames in trees.walk(top): ...   # os.walk, top-down, not recursive
    trees.remove(path)                                          # shutil.rmtree, any depth
    trees.move(src, dest)                                       # rename, or cp -a + remove across file systems

Python 3.11's os.walk and shutil.rmtree recurse once per directory level, and a
workload makes a tree deeper than the interpreter's recursion limit (~1,000) with
one mkdir + chdir loop: both then raise RecursionError (not OSError, so
`ignore_errors` does not catch it). A sandbox's writable layer is such a tree, and
the close walks it (the change manifest), snapshots copy it, and the trash thread
removes it: a RecursionError there lost the close's summary or killed the thread
that removes every later sandbox's state directory.

walk() keeps its own stack (dirnames may be pruned or sorted in place, as with
os.walk). A path it yields can still exceed PATH_MAX (4,096 bytes) below some
depth, where path-based calls fail with ENAMETOOLONG: callers that must not skip
silently pass onerror and check their own calls' errors (rootfs.changes lists
such a directory as not walked). remove() calls agent/sandbox/trees.c (one call,
the interpreter lock released once for the whole tree: shutil.rmtree gives it up
around each of its ~5 system calls an entry, and in the node agent each was a
hand-off between threads), which stays on the tree's file system and goes 128
levels deep; below that, or at another file system inside the tree, GNU rm
finishes (`rm -rf --one-file-system`: fts, no depth limit). Without the library
(not built, or older than its source: said once in the log) shutil.rmtree
removes, and rm where it recurses too deep.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import subprocess
import threading

log = logging.getLogger("dsec.launcher")
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "trees.c")
LIB = os.path.join(HERE, "build", "libdsec_trees.so")
_lib: dict = {}                 # "fn": dsec_rmtree, or "why": why not
_lib_lock = threading.Lock()


def build(out: str = LIB) -> str:
    """Compile trees.c (scripts/setup.sh)."""
    from exporters.columns import build_extension
    return build_extension(SRC, out)


def _rmtree_fn():
    if _lib:
        return _lib.get("fn")
    with _lib_lock:
        if not _lib:
            try:
                if os.stat(LIB).st_mtime < os.stat(SRC).st_mtime:
                    raise OSError(f"{LIB} is older than its source")
                fn = ctypes.CDLL(LIB, use_errno=False).dsec_rmtree
                fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_char_p,)
                _lib["fn"] = fn
            except (OSError, AttributeError) as e:
                _lib["why"] = str(e)
                log.warning("tree removal: %s (run `make setup`); trees are removed by rm -rf, slower", e)
        return _lib.get("fn")


def walk(top, onerror=None):
    """os.walk(top) (top-down, symlinks not followed; a directory that cannot be
    listed is skipped after onerror(OSError), as with os.walk) without recursion."""
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            if onerror is not None:
                onerror(e)
            continue
        dirs, files = [], []
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(e.name)
        yield d, dirs, files
        stack.extend(os.path.join(d, name) for name in reversed(dirs))


def remove(path) -> None:
    """Remove a tree (missing is fine; what cannot be removed is left, like
    shutil.rmtree(ignore_errors=True)), at any depth, on its own file system."""
    fn = _rmtree_fn()
    if fn is not None:
        rc = fn(os.fsencode(path))
        if rc not in (-errno.ELOOP, -errno.EXDEV):   # done; or e.g. EPERM (an immutable file): left, as rmtree
            return
    else:
        try:
            shutil.rmtree(path, ignore_errors=True)
            return
        except RecursionError:
            pass
    subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def move(src: str, dest: str) -> None:
    """rename(2), or across file systems (the sandboxes' tmpfs, host.scratch: memory, to the
    kept dir on disk) a copy with everything an upper layer holds (whiteouts, the overlay's
    xattrs, owners, modes, times: `cp -a`), then the source removed."""
    try:
        os.rename(src, dest)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    r = subprocess.run(["cp", "-a", "--", src, dest], capture_output=True)
    if r.returncode != 0:
        remove(dest)
        raise OSError(errno.EIO, f"copying {src} to {dest}: "
                                 f"{r.stderr.decode(errors='replace').strip()[-300:] or r.returncode}")
    remove(src)
