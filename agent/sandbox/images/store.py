"""The node's image store: verified blobs, image records, names, and the layer
cache (each layer unpacked once, shared by every image that has it).

    store = ImageStore()                                   # DSEC_IMAGE_STORE or /var/lib/dsec/images
    img, names = store.import_image("app.tar", name="app:1")
    img = store.resolve("app:1")                           # or app@sha256:..., sha256:..., a 12+ digit prefix
    lowers = store.prepare(img, sandbox_id)                # the overlay lower dirs, top first (unpacked, leased)

Layout (docs/images.md "The store"):
    blobs/sha256/<hex>          verified blobs (manifests, configs, layers), read-only
    images/<hex>.json           an image record, by manifest digest
    refs.json                   NAME:TAG -> manifest digest
    layers/<hex>/root/          an unpacked layer, by diff_id (the sha256 of its tar)
    layers/<hex>/layer.json     its size on disk, unpack time, source blob
    l/<16 hex>                  short symlinks to layers/<hex>/root: overlayfs' options fit one page
    leases/<sandbox>.<r>.json   the layers a sandbox uses (live while its state dir exists)
    locks/, failed/, tmp/       per-layer unpack locks, recent unpack failures, staging
    unpack.log                  one JSON line per unpack (what bench/images.py counts)

Atomicity: a layer is unpacked into layers/.tmp-<hex>-..., synced, then
renamed to layers/<hex>; only a complete layer has that name. An import
stages its blobs under tmp/ and commits them (blobs, record, name) under the
store lock only after every blob and every layer has been verified.

Coalescing: one unpack per layer at a time on the node. Threads of one
process wait for the first (an in-process flight); processes wait on the
layer's flock. Every waiter of a failed unpack gets the same error.

Budget: `budget` bytes of unpacked layers; before an unpack, the least
recently used layers no live sandbox leases are evicted to make room (they
are unpacked again from their blobs when next needed). Blobs are not evicted:
they are the image (`dsec image rm` + gc remove them).
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import struct
import threading
import time

from agent.sandbox import rootfs
import agent.sandbox.images.layer as layer_mod
import agent.sandbox.images.oci as oci
from agent.sandbox.images.errors import ImageError, ImageNotFound
from agent.sandbox import trees

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,254}$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
HEX_RE = re.compile(r"^[0-9a-f]{12,64}$")
SID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
LEASE_GRACE_S = 300.0
SHORT = 16
RUNTIME_KEYS = ("Env", "User", "WorkingDir", "Entrypoint", "Cmd", "Labels", "StopSignal", "Volumes", "ExposedPorts")
SANDBOX_DIR = os.path.join(rootfs.STATE_ROOT, "sandboxes")     # the launcher's (a lease lives while it does)


def default_root() -> str:
    return os.environ.get("DSEC_IMAGE_STORE") or os.path.join(rootfs.STATE_ROOT, "images")


def parse_name(text: str, what: str = "--name") -> str:
    """NAME[:TAG] -> 'name:tag' (tag 'latest' by default)."""
    name, tag = text, "latest"
    head, sep, t = text.rpartition(":")
    if sep and "/" not in t:
        name, tag = head, t
    if not NAME_RE.match(name) or "//" in name or name.endswith("/"):
        raise ImageError(f"{what} {text!r}: a name is lowercase letters, digits and . _ / - (e.g. python:3.11)")
    if not TAG_RE.match(tag):
        raise ImageError(f"{what} {text!r}: a tag is 1-128 of [A-Za-z0-9_.-]")
    return f"{name}:{tag}"


class Image:
    """One image record."""

    def __init__(self, d: dict, names=()):
        self.digest: str = d["digest"]
        self.config_digest: str = d["config_digest"]
        self.layers: list[dict] = d["layers"]          # lowest first: digest, media_type, size, diff_id
        self.config: dict = d.get("config") or {}       # the runtime part of the image config
        self.os, self.architecture = d.get("os", "linux"), d.get("architecture", "")
        self.created = d.get("created")
        self.imported_ns = d.get("imported_ns", 0)
        self.source = d.get("source", "")
        self.names: list[str] = sorted(names)
        self.asked: str = self.names[0] if self.names else self.digest     # how the caller named it

    def to_dict(self) -> dict:
        return {"digest": self.digest, "config_digest": self.config_digest, "layers": self.layers,
                "config": self.config, "os": self.os, "architecture": self.architecture, "created": self.created,
                "imported_ns": self.imported_ns, "source": self.source}

    def record(self) -> dict:
        """What the audit record says about it (sandbox_start extra.image)."""
        return {"name": self.asked, "digest": self.digest, "config": self.config_digest,
                "layers": [x["digest"] for x in self.layers], "diff_ids": [x["diff_id"] for x in self.layers]}


class _Flight:
    def __init__(self):
        self.event = threading.Event()
        self.error: ImageError | None = None


_FLIGHTS: dict[tuple, _Flight] = {}
_FLIGHTS_LOCK = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(path: str):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj, mode=0o600):
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
    os.chmod(tmp, mode)
    os.rename(tmp, path)


def _read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise ImageError(f"image store: {path} is unreadable ({e}); `dsec image gc` repairs the store", 1) from None


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


class ImageStore:
    def __init__(self, root: str | None = None, budget: int | None = None):
        self.root = os.path.abspath(root or default_root())
        self.budget = budget               # bytes of unpacked layers (None: unbounded)
        self.stats = {"unpacks": 0, "coalesced": 0, "evicted": 0, "cache_hits": 0}
        for d in ("blobs/sha256", "images", "layers", "l", "leases", "locks", "failed", "tmp"):
            os.makedirs(os.path.join(self.root, d), mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)

    # -- paths and locks -----------------------------------------------------------
    def _p(self, *parts) -> str:
        return os.path.join(self.root, *parts)

    def blob_path(self, digest: str) -> str:
        return self._p("blobs", "sha256", _hex(digest))

    def layer_dir(self, diff_id: str) -> str:
        return self._p("layers", _hex(diff_id))

    def lower_path(self, diff_id: str) -> str:
        """The short path the overlay mount names for a layer."""
        return self._p("l", _hex(diff_id)[:SHORT])

    class _Lock:
        def __init__(self, path, shared=False):
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            os.close(self.fd)
            return False

    def _lock(self, shared=False):
        return self._Lock(self._p("lock"), shared)

    def in_store(self, path: str) -> bool:
        """Is `path` (resolved) an unpacked layer of this store, or inside one?"""
        rp = os.path.realpath(path)
        layers = os.path.realpath(self._p("layers")) + os.sep
        return rp.startswith(layers)

    # -- names ----------------------------------------------------------------------
    def refs(self) -> dict:
        return _read_json(self._p("refs.json"), {}) or {}

    def _names_of(self, digest: str, refs=None) -> list[str]:
        refs = self.refs() if refs is None else refs
        return sorted(n for n, d in refs.items() if d == digest)

    def _load(self, digest: str, refs=None) -> Image | None:
        d = _read_json(self._p("images", _hex(digest) + ".json"))
        return Image(d, self._names_of(digest, refs)) if d else None

    def images(self) -> list[Image]:
        refs = self.refs()
        out = []
        for fn in sorted(os.listdir(self._p("images"))):
            if fn.endswith(".json") and len(fn) == 69:
                img = self._load("sha256:" + fn[:-5], refs)
                if img:
                    out.append(img)
        return out

    def resolve(self, ref: str) -> Image:
        """NAME[:TAG], NAME@sha256:HEX, sha256:HEX or a unique prefix of 12+ hex digits."""
        if not ref or len(ref) > 400:
            raise ImageError(f"image {ref[:80]!r}: expected NAME[:TAG], NAME@sha256:DIGEST or a digest")
        refs = self.refs()
        name, at, digest = ref.partition("@")
        if at:
            oci.check_digest(digest, f"image {ref}")
            img = self._load(digest, refs)
            if img is None or (name and not any(n == name or n.startswith(name + ":") for n in img.names)):
                raise ImageNotFound(f"image {ref}: not in this node's image store ({self.root})")
            img.asked = ref
            return img
        h = ref.removeprefix("sha256:")
        if HEX_RE.match(h) and (ref.startswith("sha256:") or parse_name(ref, "image") not in refs):
            hits = [fn[:-5] for fn in os.listdir(self._p("images")) if fn.startswith(h) and fn.endswith(".json")]
            if len(hits) > 1:
                raise ImageError(f"image {ref}: the prefix matches {len(hits)} images; give more digits")
            if hits:
                img = self._load("sha256:" + hits[0], refs)
                img.asked = img.digest
                return img
            if ref.startswith("sha256:"):
                raise ImageNotFound(f"image {ref}: not in this node's image store ({self.root})")
        full = parse_name(ref, "image")
        digest = refs.get(full)
        img = self._load(digest, refs) if digest else None
        if img is None:
            raise ImageNotFound(f"image {ref}: not in this node's image store ({self.root}); "
                                f"`dsec image import` it (`dsec image ls` lists what is there)")
        img.asked = full
        return img

    # -- import ----------------------------------------------------------------------
    def import_image(self, path: str, name: str | None = None) -> tuple[Image, list[str]]:
        """Verify and store an image; returns it and the name it was given."""
        want = parse_name(name) if name else None
        src_path, path_ref = oci.split_ref(path)
        with oci.open_source(path, self._p("tmp")) as src:
            label = want or src_path
            where = f"image {label}"
            img = oci.read_image(src.layout, src.ref, where)
            if want is None:
                ref = getattr(src, "original_ref", None) if src.kind != "oci-layout" else (img.ref or path_ref)
                want = self._default_name(src_path, ref)
                where = f"image {want}"
            stage = os.path.join(self._p("tmp"), f"import-{os.getpid()}-{os.urandom(4).hex()}")
            os.mkdir(stage, 0o700)
            try:
                staged = self._stage(img, stage, where)
                n = len(img.layers)
                for i, L in enumerate(img.layers, 1):
                    blob = staged.get(L["digest"]) or self.blob_path(L["digest"])
                    layer_mod.scan(blob, L["media_type"], f"{where} layer {i}/{n} {L['digest'][:19]}", L["diff_id"])
                rec = {"digest": img.manifest_digest, "config_digest": img.config_digest, "layers": img.layers,
                       "config": {k: v for k, v in (img.config.get("config") or {}).items() if k in RUNTIME_KEYS},
                       "os": img.config.get("os", "linux"), "architecture": img.config.get("architecture", ""),
                       "created": img.config.get("created"), "imported_ns": time.time_ns(),
                       "source": os.path.abspath(src_path)}
                with self._lock():
                    for digest, p in staged.items():
                        dst = self.blob_path(digest)
                        if not os.path.exists(dst):
                            os.rename(p, dst)
                    _write_json(self._p("images", _hex(img.manifest_digest) + ".json"), rec)
                    refs = self.refs()
                    refs[want] = img.manifest_digest
                    _write_json(self._p("refs.json"), refs)
                    out = Image(rec, self._names_of(img.manifest_digest, refs))
            finally:
                trees.remove(stage)
        out.asked = want
        return out, [want]

    @staticmethod
    def _default_name(path: str, ref: str | None) -> str:
        if ref and ("/" in ref or ":" in ref):
            try:
                return parse_name(ref, "the image's ref")
            except ImageError:
                pass
        base = os.path.basename(os.path.normpath(path))
        for sfx in (".tar.gz", ".tgz", ".tar", ".oci"):
            base = base.removesuffix(sfx)
        base = re.sub(r"[^a-z0-9._/-]", "-", base.lower()).strip("-._") or "image"
        tag = ref if ref and TAG_RE.match(ref) else "latest"
        try:
            return parse_name(f"{base}:{tag}")
        except ImageError:
            raise ImageError(f"{path}: cannot derive an image name from it: give --name NAME[:TAG]") from None

    def _stage(self, img, stage: str, where: str) -> dict:
        """Copy what the store lacks into `stage`, verified; digest -> staged path."""
        staged = {}
        for digest, data in ((img.manifest_digest, img.manifest_bytes), (img.config_digest, img.config_bytes)):
            if not os.path.exists(self.blob_path(digest)):
                p = os.path.join(stage, _hex(digest))
                with open(p, "wb") as f:
                    f.write(data)
                os.chmod(p, 0o444)
                staged[digest] = p
        n = len(img.layers)
        for i, L in enumerate(img.layers, 1):
            d = L["digest"]
            if d in staged or os.path.exists(self.blob_path(d)):
                continue
            p = os.path.join(stage, _hex(d))
            oci.copy_verified(img.blob(d), p, d, L["size"], f"{where} layer {i}/{n} {d[:19]}")
            staged[d] = p
        return staged

    # -- the layer cache -----------------------------------------------------------------
    def cached(self, img: Image) -> list[bool]:
        return [os.path.isdir(self.layer_dir(L["diff_id"])) for L in img.layers]

    def prepare(self, img: Image, sandbox_id: str) -> list[str]:
        """The lower dirs of `img` for a sandbox, top first: each layer unpacked (once,
        coalesced), leased to the sandbox (not evicted while its state dir exists)."""
        return self.prepare_lease(img, sandbox_id)[0]

    def prepare_lease(self, img: Image, sandbox_id: str) -> tuple[list[str], str]:
        """prepare(), and the lease file (remove it if the sandbox is never created)."""
        if not SID_RE.match(sandbox_id or ""):
            raise ImageError(f"image {img.asked}: sandbox id {str(sandbox_id)[:80]!r} is not a valid id")
        lease = self._p("leases", f"{sandbox_id}.{os.urandom(4).hex()}.json")
        with self._lock(shared=True):
            _write_json(lease, {"sandbox_id": sandbox_id, "image": img.digest,
                                "layers": [L["diff_id"] for L in img.layers]})
        try:
            n = len(img.layers)
            for i, L in enumerate(img.layers, 1):
                self._ensure(L, f"image {img.asked} layer {i}/{n} {L['digest'][:19]}")
                os.utime(lease)
        except BaseException:
            try:
                os.unlink(lease)
            except OSError:
                pass
            raise
        return [self.lower_path(L["diff_id"]) for L in reversed(img.layers)], lease

    def release(self, sandbox_id: str):
        """Drop a sandbox's leases (optional: a lease dies with the sandbox's state dir)."""
        for fn in os.listdir(self._p("leases")):
            if fn.startswith(sandbox_id + "."):
                try:
                    os.unlink(self._p("leases", fn))
                except OSError:
                    pass

    def _touch(self, d: str):
        try:
            os.utime(os.path.join(d, "layer.json"))
        except OSError:
            pass

    def _ensure(self, L: dict, where: str):
        final = self.layer_dir(L["diff_id"])
        if os.path.isdir(final):
            self.stats["cache_hits"] += 1
            self._touch(final)
            return
        key = (self.root, L["diff_id"])
        with _FLIGHTS_LOCK:
            fl = _FLIGHTS.get(key)
            leader = fl is None
            if leader:
                fl = _FLIGHTS[key] = _Flight()
        if not leader:
            fl.event.wait()
            self.stats["coalesced"] += 1
            if fl.error is not None:
                raise ImageError(fl.error.message, fl.error.code)
            return
        try:
            self._unpack_locked(L, where)
        except ImageError as e:
            fl.error = e
            raise
        except Exception as e:  # noqa: BLE001 - every waiter gets one clear line
            fl.error = ImageError(f"{where}: unpack failed: {type(e).__name__}: {e}", 1)
            raise fl.error from None
        finally:
            with _FLIGHTS_LOCK:
                _FLIGHTS.pop(key, None)
            fl.event.set()

    def _unpack_locked(self, L: dict, where: str):
        h = _hex(L["diff_id"])
        final = self.layer_dir(L["diff_id"])
        t_wait = time.time()
        with self._Lock(self._p("locks", h + ".lock")):
            if os.path.isdir(final):             # another process unpacked it while we waited
                self.stats["coalesced"] += 1
                self._touch(final)
                return
            failed = _read_json(self._p("failed", h + ".json"))
            if failed and failed.get("ts", 0) >= t_wait:
                raise ImageError(failed["message"], failed.get("code", 2))
            for fn in os.listdir(self._p("layers")):     # partial trees of a dead unpacker: never used
                if fn.startswith(f".tmp-{h}-"):
                    trees.remove(self._p("layers", fn))
            blob = self.blob_path(L["digest"])
            if not os.path.isfile(blob):
                raise ImageError(f"{where}: its blob is missing from the store (import the image again)", 1)
            self._make_room(_estimate(blob, L["media_type"]), where)
            tmp = self._p("layers", f".tmp-{h}-{os.getpid()}-{os.urandom(4).hex()}")
            os.mkdir(tmp, 0o700)
            os.mkdir(os.path.join(tmp, "root"), 0o755)
            try:
                info = layer_mod.unpack(blob, L["media_type"], os.path.join(tmp, "root"), where, L["diff_id"])
                info.update(digest=L["digest"], media_type=L["media_type"], unpacked_ns=time.time_ns(),
                            disk_bytes=layer_mod.disk_bytes(os.path.join(tmp, "root")))
                _write_json(os.path.join(tmp, "layer.json"), info)
                _syncfs(tmp)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not os.path.isdir(final):
                        raise
                    trees.remove(tmp)     # unpacked by another one meanwhile
            except ImageError as e:
                trees.remove(tmp)
                _write_json(self._p("failed", h + ".json"), {"ts": time.time(), "message": e.message, "code": e.code})
                raise
            except BaseException:
                trees.remove(tmp)
                raise
            link = self.lower_path(L["diff_id"])
            try:
                if os.readlink(link) != os.path.join("..", "layers", h, "root"):
                    raise ImageError(f"{where}: short name {link} is taken by another layer", 1)
            except FileNotFoundError:
                os.symlink(os.path.join("..", "layers", h, "root"), link)
            try:
                os.unlink(self._p("failed", h + ".json"))
            except FileNotFoundError:
                pass
            self.stats["unpacks"] += 1
            self._log({"ts_ns": time.time_ns(), "diff_id": L["diff_id"], "pid": os.getpid(),
                       "unpack_ms": info["unpack_ms"], "disk_bytes": info["disk_bytes"]})
        if self.budget is not None:
            self._make_room(0, where, strict=False)

    def _log(self, entry: dict):
        p = self._p("unpack.log")
        try:
            if os.path.getsize(p) > (1 << 20):
                os.replace(p, p + ".1")
        except OSError:
            pass
        with open(p, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def unpack_log(self) -> list[dict]:
        try:
            with open(self._p("unpack.log")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    # -- leases, budget, eviction -----------------------------------------------------------
    def _live_leases(self) -> dict[str, set]:
        """diff_id -> sandbox ids using it; stale leases are removed."""
        out: dict[str, set] = {}
        now = time.time()
        for fn in os.listdir(self._p("leases")):
            p = self._p("leases", fn)
            try:
                st = os.stat(p)
                with open(p) as f:
                    lease = json.load(f)
            except (OSError, ValueError):
                continue
            sid = lease.get("sandbox_id", "")
            if os.path.isdir(os.path.join(SANDBOX_DIR, sid)) or now - st.st_mtime < LEASE_GRACE_S:
                for d in lease.get("layers", []):
                    out.setdefault(d, set()).add(sid)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
        return out

    def layers(self) -> list[dict]:
        out = []
        for fn in os.listdir(self._p("layers")):
            if fn.startswith("."):
                continue
            d = self._p("layers", fn)
            try:
                meta = _read_json(os.path.join(d, "layer.json")) or {}
                used = os.stat(os.path.join(d, "layer.json")).st_mtime
            except (OSError, ImageError):
                meta, used = {}, 0.0
            out.append({"diff_id": "sha256:" + fn, "disk_bytes": int(meta.get("disk_bytes", 0)),
                        "last_used": used, "digest": meta.get("digest", ""), "unpack_ms": meta.get("unpack_ms")})
        return out

    def _evict(self, diff_id: str):
        h = _hex(diff_id)
        trash = self._p("layers", f".trash-{h}-{os.urandom(4).hex()}")
        try:
            os.rename(self.layer_dir(diff_id), trash)
        except FileNotFoundError:
            return
        try:
            os.unlink(self.lower_path(diff_id))
        except OSError:
            pass
        trees.remove(trash)
        self.stats["evicted"] += 1

    def _make_room(self, need: int, where: str, strict: bool = True):
        if self.budget is None:
            return
        with self._lock():
            layers = self.layers()
            used = sum(x["disk_bytes"] for x in layers)
            if used + need <= self.budget:
                return
            live = self._live_leases()
            for x in sorted(layers, key=lambda x: x["last_used"]):
                if used + need <= self.budget:
                    return
                if x["diff_id"] in live:
                    continue
                self._evict(x["diff_id"])
                used -= x["disk_bytes"]
            if strict and used + need > self.budget:
                raise ImageError(f"{where}: the image store's budget of {self.budget} bytes is exhausted "
                                 f"({used} bytes of unpacked layers in use by running sandboxes, {need} more needed)",
                                 1)

    # -- maintenance --------------------------------------------------------------------------
    def usage(self) -> dict:
        blobs = 0
        for fn in os.listdir(self._p("blobs", "sha256")):
            try:
                blobs += os.lstat(self._p("blobs", "sha256", fn)).st_blocks * 512
            except OSError:
                pass
        layers = self.layers()
        return {"root": self.root, "blob_bytes": blobs, "layer_bytes": sum(x["disk_bytes"] for x in layers),
                "layers_cached": len(layers), "images": len(self.images()), "budget": self.budget}

    def remove(self, ref: str) -> dict:
        """Forget a name (or, for a digest, the image and all its names); then gc."""
        img = self.resolve(ref)
        by_digest = img.asked == img.digest or "@" in ref
        with self._lock():
            refs = self.refs()
            gone = [n for n, d in refs.items() if d == img.digest and (by_digest or n == img.asked)]
            for n in gone:
                del refs[n]
            _write_json(self._p("refs.json"), refs)
            left = [n for n, d in refs.items() if d == img.digest]
            if not left:
                try:
                    os.unlink(self._p("images", _hex(img.digest) + ".json"))
                except FileNotFoundError:
                    pass
        res = self.gc()
        res.update(image=img.digest, names=gone, image_removed=not left)
        return res

    def gc(self) -> dict:
        """Remove blobs and layers no image references (unless a live sandbox uses them),
        stale leases, failed-unpack notes and staging left by dead processes."""
        removed_blobs = removed_layers = freed = 0
        with self._lock():
            images = self.images()
            keep_blobs = set()
            keep_layers = set()
            for img in images:
                keep_blobs.update({img.digest, img.config_digest})
                for L in img.layers:
                    keep_blobs.add(L["digest"])
                    keep_layers.add(L["diff_id"])
            live = self._live_leases()
            for fn in os.listdir(self._p("blobs", "sha256")):
                if "sha256:" + fn not in keep_blobs:
                    p = self._p("blobs", "sha256", fn)
                    try:
                        freed += os.lstat(p).st_blocks * 512
                        os.unlink(p)
                        removed_blobs += 1
                    except OSError:
                        pass
            for x in self.layers():
                if x["diff_id"] not in keep_layers and x["diff_id"] not in live:
                    self._evict(x["diff_id"])
                    self.stats["evicted"] -= 1
                    removed_layers += 1
                    freed += x["disk_bytes"]
            for fn in os.listdir(self._p("layers")):
                if fn.startswith(".trash-"):
                    trees.remove(self._p("layers", fn))
                elif fn.startswith(".tmp-"):
                    h = fn.split("-")[1]
                    fd = os.open(self._p("locks", h + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        trees.remove(self._p("layers", fn))
                    except BlockingIOError:
                        pass                        # an unpack in progress
                    finally:
                        os.close(fd)
            for fn in os.listdir(self._p("l")):
                p = self._p("l", fn)
                if not os.path.exists(p):
                    os.unlink(p)
            now = time.time()
            for sub in ("tmp", "failed"):          # (lock files stay: removing one could split a lock)
                for fn in os.listdir(self._p(sub)):
                    p = self._p(sub, fn)
                    try:
                        if now - os.lstat(p).st_mtime > 3600 or sub == "failed":
                            if os.path.isdir(p) and not os.path.islink(p):
                                trees.remove(p)
                            else:
                                os.unlink(p)
                    except OSError:
                        pass
        return {"blobs_removed": removed_blobs, "layers_removed": removed_layers, "bytes_freed": freed,
                "leases_live": len({s for v in live.values() for s in v})}


def _estimate(blob: str, media_type: str) -> int:
    """Bytes an unpacked layer will take, before unpacking it (for the budget)."""
    size = os.path.getsize(blob)
    kind = layer_mod.MEDIA_TYPES.get(media_type)
    if kind == "gzip" and size >= 18:
        with open(blob, "rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = struct.unpack("<I", f.read(4))[0]        # size mod 2^32 of the last member
        return max(isize, size)
    if kind == "zstd":
        return size * 3
    return size
