"""A snapshot exported as an OCI image layout (docs/snapshots.md): the base
image's layers as they are, then each snapshot of the chain as a gzipped layer tar.

    from agent.sandbox.snapexport import export
    export(store, snap, "out-dir", image_store)   # {"layout", "ref", "manifest_digest", "layers"}

A layer is tarred to a temporary file and streamed through gzip into its blob,
never held in memory whole. A plain tar has no holes: a snapshot whose sparse
files hold more than MAX_EXPORT_HOLES bytes of holes is refused (exit 2).
Split out of snapshots.py, which takes, stores, forks and restores.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat

from agent.errors import EXIT_USAGE
from agent.sandbox import trees
from agent.sandbox.snapshots import SnapshotError, SnapshotStore


def _layer_tar(root: str, path: str) -> None:
    """A tar of an overlayfs-format layer with overlay whiteouts and opaque dirs turned
    back into OCI ones (.wh.NAME, .wh..wh..opq); user.* and security.capability xattrs kept."""
    import tarfile
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for dp, dn, fn in trees.walk(root):
            dn.sort()
            for name in sorted(dn) + sorted(fn):
                full = os.path.join(dp, name)
                rel = os.path.relpath(full, root)
                st = os.lstat(full)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    ti = tarfile.TarInfo(os.path.join(os.path.dirname(rel), ".wh." + name))
                    ti.mtime = int(st.st_mtime)
                    tf.addfile(ti)
                    continue
                ti = tf.gettarinfo(full, rel)
                ti.uname = ti.gname = ""
                pax = {}
                for k in os.listxattr(full, follow_symlinks=False):
                    if k.startswith("user.") or k == "security.capability":
                        pax["SCHILY.xattr." + k] = os.getxattr(full, k, follow_symlinks=False).decode(
                            "utf-8", "surrogateescape")
                ti.pax_headers = pax
                if ti.isreg():
                    with open(full, "rb") as f:
                        tf.addfile(ti, f)
                else:
                    tf.addfile(ti)
                if stat.S_ISDIR(st.st_mode):
                    try:
                        opaque = os.getxattr(full, "trusted.overlay.opaque") == b"y"
                    except OSError:
                        opaque = False
                    if opaque:
                        tf.addfile(tarfile.TarInfo(os.path.join(rel, ".wh..wh..opq")))


MAX_EXPORT_HOLES = 1 << 30     # bytes of holes an export may write out as zeros (a plain tar has no holes)


def _refuse_holes(snap: dict) -> None:
    """An OCI layer (a plain tar) holds a sparse file's holes as zeros: a workload's
    `truncate -s 1T` would export as a terabyte. Refused past MAX_EXPORT_HOLES."""
    sparse = [e for e in snap.get("changes", []) if e.get("data_bytes") is not None]
    holes = sum(e["size"] - e["data_bytes"] for e in sparse)
    if holes > MAX_EXPORT_HOLES:
        top = max(sparse, key=lambda e: e["size"] - e["data_bytes"])
        raise SnapshotError(f"snapshot {snap['id'][:12]}: export refused: its sparse files hold {holes} bytes of "
                            f"holes, which an OCI layer (a plain tar) would hold as zeros (more than "
                            f"{MAX_EXPORT_HOLES}); the largest: {top['path']!r}, {top['size']} bytes, "
                            f"{top['data_bytes']} of data", EXIT_USAGE)


def _gzip_blob(layout: str, tar_path: str) -> tuple[dict, str]:
    """The layer tar at tar_path gzipped into a blob of `layout`, streamed (a layer is never
    held in memory whole); the tar removed. Returns (blob descriptor, diff_id)."""
    import zlib
    ht, hg = hashlib.sha256(), hashlib.sha256()
    gz_path = tar_path + ".gz"
    z = zlib.compressobj(1, zlib.DEFLATED, 31)       # wbits 31: a gzip stream (mtime 0, no name)
    try:
        with open(tar_path, "rb") as src, open(gz_path, "wb") as dst:
            while chunk := src.read(1 << 20):
                ht.update(chunk)
                out = z.compress(chunk)
                hg.update(out)
                dst.write(out)
            out = z.flush()
            hg.update(out)
            dst.write(out)
        size = os.path.getsize(gz_path)
        os.rename(gz_path, os.path.join(layout, "blobs", "sha256", hg.hexdigest()))
    finally:
        for p in (tar_path, gz_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    return {"digest": "sha256:" + hg.hexdigest(), "size": size}, "sha256:" + ht.hexdigest()


def _blob(layout: str, data: bytes) -> dict:
    h = hashlib.sha256(data).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", h), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + h, "size": len(data)}


def export(store: "SnapshotStore", snap: dict, out_dir: str, image_store, ref: str = "snapshot") -> dict:
    """Write an OCI image layout: the base image's layers, then the snapshot's, lowest first.
    `dsec image import OUT_DIR:REF` on another node restores it there."""
    base = snap["base"].get("image")
    if not base:
        raise SnapshotError(f"snapshot {snap['id'][:12]}: only snapshots of sandboxes on an image can be exported "
                            f"(this one is on a --rootfs)", EXIT_USAGE)
    img = image_store.resolve(base["digest"])
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise SnapshotError(f"{out_dir}: exists and is not empty", EXIT_USAGE)
    os.makedirs(os.path.join(out_dir, "blobs", "sha256"), exist_ok=True)
    with open(os.path.join(out_dir, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(image_store.blob_path(img.config_digest), "rb") as f:
        cfg = json.load(f)
    layers = []
    for L in img.layers:
        shutil.copyfile(image_store.blob_path(L["digest"]), os.path.join(out_dir, "blobs", "sha256", L["digest"][7:]))
        layers.append({"mediaType": L["media_type"], "digest": L["digest"], "size": L["size"]})
    chain = list(reversed(snap.get("chain", []))) + [snap["id"]]
    for sid in chain:
        _refuse_holes(store.get(sid) if sid != snap["id"] else snap)
    for sid in chain:
        tmp = os.path.join(out_dir, f".layer-{sid[:12]}.tar")
        _layer_tar(store.layer_root(sid), tmp)
        b, diff_id = _gzip_blob(out_dir, tmp)
        layers.append(dict(b, mediaType="application/vnd.oci.image.layer.v1.tar+gzip"))
        cfg.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(diff_id)
        cfg.setdefault("history", []).append({"created_by": f"dsec snapshot {sid[:12]} of sandbox "
                                                            f"{snap['sandbox_id']} at step {snap['step']}"})
    cfg.setdefault("config", {})
    if snap["context"].get("workdir"):
        cfg["config"]["WorkingDir"] = snap["context"]["workdir"]
    c = _blob(out_dir, json.dumps(cfg).encode())
    man = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "config": dict(c, mediaType="application/vnd.oci.image.config.v1+json"), "layers": layers,
           "annotations": {"dev.dsec.snapshot": snap["id"], "dev.dsec.sandbox": snap["sandbox_id"],
                           "dev.dsec.step": str(snap["step"])}}
    m = _blob(out_dir, json.dumps(man).encode())
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [dict(m, mediaType="application/vnd.oci.image.manifest.v1+json",
                                                          annotations={"org.opencontainers.image.ref.name": ref})]}, f)
    return {"layout": out_dir, "ref": ref, "manifest_digest": m["digest"], "layers": len(layers)}
