"""Step snapshots of a sandbox's filesystem (issue 17, first part; docs/snapshots.md).

    store = SnapshotStore()                               # DSEC_SNAPSHOT_STORE or /var/lib/dsec/snapshots
    snap = store.take(sb, context={"step": 3, ...})       # sb: a running launcher.Sandbox on an image or rootfs
    lowers = store.lowers(snap)                           # [snapshot layers..., base layers...], top first
    store.export(snap, "out-dir", image_store)            # an OCI image layout (base image + snapshot layer)

take(): the sandbox's processes are frozen (cgroup2 cgroup.freeze, or the v1
freezer), its writable layer is copied (`cp -a`: modes, owners, mtimes,
xattrs, overlay whiteouts and opaque dirs) into snapshots/layers/.tmp-..., then
thawed; the copy is walked for the manifest of changes (path, change, kind,
mode, uid, gid, mtime, ctime, size, sha256), ordered by ctime (the order the
changes were made in), and the snapshot's id is the sha256 of that manifest and
its parent chain: the same state gives the same id (content-addressed), and an
existing one is reused. The sandbox keeps running on its writable layer;
a later snapshot holds everything since the start (not a delta: docs).
Freezing has a timeout (FREEZE_TIMEOUT_S) and is retried (RETRIES); on a
failure the sandbox is always thawed and nothing is left in the store.

Layout:
    snapshots/<id>.json        sandbox, node, step context, base (image digest + layer digests, or
                               rootfs), parent snapshot, the manifest, sizes, timings
    layers/<id>/root/          the frozen writable layer (overlayfs format)
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time

from agent.errors import DsecError, EXIT_USAGE
from agent.sandbox import rootfs

FREEZE_TIMEOUT_S = 5.0
RETRIES = 3
ID_RE = re.compile(r"^[0-9a-f]{12,64}$")


class SnapshotError(DsecError):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message, code)


def default_root() -> str:
    return os.environ.get("DSEC_SNAPSHOT_STORE") or os.path.join(rootfs.STATE_ROOT, "snapshots")


# --- the freezer ---------------------------------------------------------------------

def _freeze_files(cg) -> tuple[str, str, str]:
    """(control file, frozen value, thawed value) of the sandbox's freezer."""
    if cg.v2_path and os.path.exists(os.path.join(cg.v2_path, "cgroup.freeze")):
        return os.path.join(cg.v2_path, "cgroup.freeze"), "1", "0"
    root = cg.layout.v1_roots.get("freezer") or "/sys/fs/cgroup/freezer"
    p = os.path.join(root, "dsec", cg.sandbox_id, "freezer.state")
    if os.path.exists(p):
        return p, "FROZEN", "THAWED"
    raise SnapshotError(f"sandbox {cg.sandbox_id}: no cgroup freezer (cgroup2 cgroup.freeze or the v1 freezer): "
                        f"a snapshot would not be consistent")


def _frozen(cg, control: str) -> bool:
    if control.endswith("cgroup.freeze"):
        with open(os.path.join(cg.v2_path, "cgroup.events")) as f:
            return "frozen 1" in f.read()
    with open(control) as f:
        return f.read().strip() == "FROZEN"


def freeze(cg, timeout: float = FREEZE_TIMEOUT_S) -> str:
    control, on, _ = _freeze_files(cg)
    with open(control, "w") as f:
        f.write(on)
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while not _frozen(cg, control):
        if time.monotonic() > deadline:
            thaw(cg)
            raise SnapshotError(f"sandbox {cg.sandbox_id}: not frozen within {timeout:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return control


def thaw(cg):
    control, _, off = _freeze_files(cg)
    with open(control, "w") as f:
        f.write(off)


# --- the store -----------------------------------------------------------------------

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def manifest(root: str) -> list[dict]:
    """Every entry of a writable layer, in the order it was last changed (ctime)."""
    out = []
    for dp, dn, fn in os.walk(root):
        dn.sort()
        for name in sorted(dn) + sorted(fn):
            full = os.path.join(dp, name)
            st = os.lstat(full)
            rel = "/" + os.path.relpath(full, root)
            e = {"path": os.fsdecode(rel), "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                 "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                e["kind"] = "whiteout"
            elif stat.S_ISDIR(st.st_mode):
                e["kind"] = "dir"
                try:
                    e["opaque"] = os.getxattr(full, "trusted.overlay.opaque") == b"y"
                except OSError:
                    e["opaque"] = False
            elif stat.S_ISLNK(st.st_mode):
                e["kind"], e["target"] = "symlink", os.fsdecode(os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                e["kind"], e["size"], e["sha256"] = "file", st.st_size, _sha256(full)
            else:
                e["kind"] = "other"
            out.append(e)
    out.sort(key=lambda e: (e["ctime_ns"], e["path"]))
    return out


class SnapshotStore:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root or default_root())
        for d in ("layers", "snapshots"):
            os.makedirs(os.path.join(self.root, d), mode=0o700, exist_ok=True)

    def _meta(self, sid: str) -> str:
        return os.path.join(self.root, "snapshots", sid + ".json")

    def layer_root(self, sid: str) -> str:
        return os.path.join(self.root, "layers", sid, "root")

    def get(self, ref: str) -> dict:
        if not ref or not ID_RE.match(ref.removeprefix("snap-")):
            raise SnapshotError(f"snapshot {ref[:80]!r}: not a snapshot id (hex digits)", EXIT_USAGE)
        h = ref.removeprefix("snap-")
        hits = [f[:-5] for f in os.listdir(os.path.join(self.root, "snapshots")) if f.startswith(h) and f.endswith(".json")]
        if len(hits) != 1:
            raise SnapshotError(f"snapshot {ref}: {'no such snapshot' if not hits else 'ambiguous prefix'} "
                                f"in {self.root}", EXIT_USAGE)
        with open(self._meta(hits[0])) as f:
            snap = json.load(f)
        for s in [snap["id"]] + snap.get("chain", []):
            if not os.path.isdir(self.layer_root(s)):
                raise SnapshotError(f"snapshot {snap['id'][:12]}: its layer {s[:12]} is missing from {self.root}",
                                    EXIT_USAGE)
        return snap

    def list(self) -> list[dict]:
        out = []
        for f in sorted(os.listdir(os.path.join(self.root, "snapshots"))):
            if f.endswith(".json"):
                with open(os.path.join(self.root, "snapshots", f)) as fh:
                    out.append(json.load(fh))
        return sorted(out, key=lambda s: s["created_ns"])

    def lowers(self, snap: dict) -> list[str]:
        """The overlay lower dirs of a sandbox restored from `snap`, top first."""
        own = [self.layer_root(s) for s in [snap["id"]] + snap.get("chain", [])]
        return own + list(snap["base"]["lowers"])

    def take(self, sb, context: dict | None = None, *, timeout: float = FREEZE_TIMEOUT_S,
             retries: int = RETRIES) -> dict:
        """Freeze, copy the writable layer, thaw; record the snapshot. `sb` is a running
        launcher.Sandbox whose root is an image or a --rootfs (one overlay)."""
        spec = sb.spec
        if not spec.layers and not spec.rootfs:
            raise SnapshotError(f"sandbox {sb.sid}: snapshots need a sandbox on an image or a --rootfs "
                                f"(the default root is several overlays over host directories)", EXIT_USAGE)
        if sb.state != "running" or sb.cg is None:
            raise SnapshotError(f"sandbox {sb.sid} is {sb.state}: only a running sandbox can be snapshotted",
                                EXIT_USAGE)
        upper = os.path.join(sb.dir, "upper", "_root")
        lowers = list(spec.layers) if spec.layers else [os.path.abspath(spec.rootfs)]
        parent = getattr(spec, "snapshot", None) or {}
        chain = ([parent["id"]] + parent.get("chain", [])) if parent else []
        base_lowers = lowers[len(chain):] if parent else lowers
        tmp = os.path.join(self.root, "layers", f".tmp-{os.getpid()}-{os.urandom(4).hex()}")
        attempts, last, ok = 0, None, False
        t0 = time.monotonic()
        while attempts < retries and not ok:
            attempts += 1
            try:
                os.makedirs(tmp, 0o700)
                tf = time.monotonic()
                freeze(sb.cg, timeout)
                try:
                    frozen_at = time.monotonic()
                    r = subprocess.run(["cp", "-a", upper, os.path.join(tmp, "root")], capture_output=True)
                    if r.returncode != 0:
                        raise SnapshotError(f"sandbox {sb.sid}: copying the writable layer failed: "
                                            f"{r.stderr.decode(errors='replace').strip()[:300]}")
                finally:
                    thaw(sb.cg)
                frozen_ms = (time.monotonic() - tf) * 1000
                copy_ms = (time.monotonic() - frozen_at) * 1000
                ok = True
            except (SnapshotError, OSError) as e:
                last = e
                shutil.rmtree(tmp, ignore_errors=True)
                if sb.state != "running":
                    break
        if not ok:
            msg = last.message if isinstance(last, SnapshotError) else str(last)
            raise SnapshotError(f"sandbox {sb.sid}: snapshot failed after {attempts} attempt(s): {msg}")
        try:
            man = manifest(os.path.join(tmp, "root"))
            key = json.dumps({"manifest": [{k: v for k, v in e.items() if k != "ctime_ns"} for e in man],
                              "chain": chain, "base": base_lowers}, sort_keys=True)
            sid = hashlib.sha256(key.encode()).hexdigest()
            final = os.path.join(self.root, "layers", sid)
            if os.path.isdir(final):
                shutil.rmtree(tmp, ignore_errors=True)        # the same state: one layer
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ctx = dict(context or {})
        snap = {"id": sid, "sandbox_id": sb.sid, "node": os.uname().nodename, "created_ns": time.time_ns(),
                "step": ctx.get("step", 0), "context": ctx, "chain": chain,
                "base": {"image": spec.image, "rootfs": None if spec.layers else os.path.abspath(spec.rootfs),
                         "lowers": base_lowers},
                "changes": man, "files": sum(1 for e in man if e["kind"] == "file"),
                "bytes": sum(e.get("size", 0) for e in man), "attempts": attempts,
                "frozen_ms": round(frozen_ms, 3), "copy_ms": round(copy_ms, 3),
                "total_ms": round((time.monotonic() - t0) * 1000, 3)}
        tmpm = self._meta(sid) + f".{os.getpid()}.tmp"
        with open(tmpm, "w") as f:
            json.dump(snap, f)
        os.rename(tmpm, self._meta(sid))
        return snap

    def remove(self, ref: str) -> dict:
        snap = self.get(ref)
        users = [s["id"] for s in self.list() if snap["id"] in s.get("chain", [])]
        if users:
            raise SnapshotError(f"snapshot {snap['id'][:12]} is the parent of {len(users)} other snapshot(s) "
                                f"({', '.join(u[:12] for u in users[:4])})", EXIT_USAGE)
        os.unlink(self._meta(snap["id"]))
        shutil.rmtree(os.path.join(self.root, "layers", snap["id"]), ignore_errors=True)
        return snap


# --- export as an OCI image ------------------------------------------------------------

def _layer_tar(root: str, path: str) -> None:
    """A tar of an overlayfs-format layer with overlay whiteouts and opaque dirs turned
    back into OCI ones (.wh.NAME, .wh..wh..opq); user.* and security.capability xattrs kept."""
    import tarfile
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for dp, dn, fn in os.walk(root):
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


def _blob(layout: str, data: bytes) -> dict:
    h = hashlib.sha256(data).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", h), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + h, "size": len(data)}


def export(store: "SnapshotStore", snap: dict, out_dir: str, image_store, ref: str = "snapshot") -> dict:
    """Write an OCI image layout: the base image's layers, then the snapshot's, lowest first.
    `dsec image import OUT_DIR:REF` on another node restores it there."""
    import gzip
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
    for sid in list(reversed(snap.get("chain", []))) + [snap["id"]]:
        tmp = os.path.join(out_dir, f".layer-{sid[:12]}.tar")
        _layer_tar(store.layer_root(sid), tmp)
        with open(tmp, "rb") as f:
            tar = f.read()
        os.unlink(tmp)
        gz = gzip.compress(tar, compresslevel=1, mtime=0)
        b = _blob(out_dir, gz)
        layers.append(dict(b, mediaType="application/vnd.oci.image.layer.v1.tar+gzip"))
        cfg.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(
            "sha256:" + hashlib.sha256(tar).hexdigest())
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
