"""trees.remove (agent/sandbox/trees.py, trees.c): a tree a workload made, removed in one
call, never through a symlink or into another file system, at any depth."""
from __future__ import annotations

import os
import subprocess

from agent.sandbox import trees


def _chain(top: str, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
        f.write("bottom")
    os.close(fd)


def test_remove_stays_on_its_file_system_and_off_symlinks(tmp_path):
    """A symlink to a directory outside and a mount inside the tree (as a workload's
    state directory may hold if an unmount failed) keep their contents; a chain deeper
    than the library's 128 levels and every ordinary entry are gone; the library is
    built by `make setup` (without it every removal forks rm or hands the interpreter
    lock around per call)."""
    assert trees._rmtree_fn() is not None, trees._lib.get("why")
    top = tmp_path / "state"
    (top / "upper" / "_root" / "etc").mkdir(parents=True)
    (top / "upper" / "_root" / "etc" / "passwd").write_text("x")
    (top / "work" / "work").mkdir(parents=True)
    os.chmod(top / "work" / "work", 0)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    os.symlink(outside, top / "upper" / "link")
    os.symlink(outside / "keep", top / "upper" / "filelink")
    (top / "deep").mkdir()
    _chain(str(top / "deep"), 300)
    mnt = top / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "dsec-test-trees", str(mnt)], check=True)
    try:
        (mnt / "inside").write_text("m")
        trees.remove(str(top))
        assert (outside / "keep").read_text() == "k"
        assert (mnt / "inside").read_text() == "m"                  # not into another file system
        assert sorted(os.listdir(top)) == ["mnt"]                   # everything else gone, the deep chain too
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    trees.remove(str(top))
    assert not top.exists() and (outside / "keep").exists()
    trees.remove(str(top))                                          # missing: fine
    f = tmp_path / "plain"
    f.write_text("p")
    trees.remove(str(f))                                            # a file: removed
    assert not f.exists()
