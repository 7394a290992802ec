"""Walking and removing directory trees that a sandbox wrote: any depth.

    for dirpath, dirnames, filenames in trees.walk(top): ...   # os.walk, top-down, not recursive
    trees.remove(path)                                          # shutil.rmtree, any depth

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
such a directory as not walked). remove() tries shutil.rmtree (fd-based: long
paths are fine) and, when that recurses too deep, GNU rm (fts: no depth limit),
staying on the tree's file system.
"""
from __future__ import annotations

import os
import shutil
import subprocess


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
    shutil.rmtree(ignore_errors=True)), at any depth."""
    try:
        shutil.rmtree(path, ignore_errors=True)
        return
    except RecursionError:
        pass
    subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
