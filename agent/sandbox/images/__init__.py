"""OCI images for sandboxes: a content-addressed store of verified blobs and
unpacked layers, shared by every image on the node (docs/images.md).

    from agent.sandbox import images
    store = images.open_store()                          # the node's store (DSEC_IMAGE_STORE)
    img, names = store.import_image("app.tar", name="app:1")
    img = store.resolve("app:1")
    lowers = store.prepare(img, sandbox_id)              # overlay lower dirs, top first
    run = images.apply(img, lowers, argv=[], user=None, workdir=None, env={})
    images.in_store(path)                                # is this dir an unpacked layer of the store?

Files: oci.py (reading layouts and tarballs), layer.py (checking and
unpacking one layer), store.py (the store, cache, budget, coalescing),
runtime.py (the image config applied to a sandbox).
"""
from __future__ import annotations

from agent.sandbox.images.errors import ImageError, ImageNotFound
from agent.sandbox.images.runtime import apply, command, passwd_root, prepare_spec
from agent.sandbox.images.store import Image, ImageStore, default_root, parse_name

_stores: dict = {}


def open_store(root: str | None = None, budget: int | None = None) -> ImageStore:
    """The store at `root` (default: DSEC_IMAGE_STORE or <state dir>/images), one object
    per root and process so that its in-process coalescing covers every caller."""
    import os
    key = os.path.abspath(root or default_root())
    s = _stores.get(key)
    if s is None:
        s = _stores[key] = ImageStore(key, budget)
    elif budget is not None:
        s.budget = budget
    return s


def in_store(path: str, root: str | None = None) -> bool:
    """Is `path` inside the node's image store's unpacked layers? (For a launcher that
    allows rootfs/lower dirs only from allow-listed roots and the store.)"""
    import os
    key = os.path.abspath(root or default_root())
    if not os.path.isdir(os.path.join(key, "layers")):
        return False
    rp = os.path.realpath(path)
    return rp.startswith(os.path.realpath(os.path.join(key, "layers")) + os.sep)


__all__ = ["Image", "ImageError", "command", "ImageNotFound", "ImageStore", "apply", "in_store", "open_store",
           "parse_name", "passwd_root", "prepare_spec"]
