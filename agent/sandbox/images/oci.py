"""Reading OCI images from what the tools write: an OCI image layout directory
(umoci, skopeo `oci:`, buildah), or a tarball: an OCI archive (skopeo
`oci-archive:`, podman save --format oci-archive, docker save >= 25) or a
docker archive (docker save, podman save).

    with open_source(path, work_dir) as src:      # a tarball becomes a layout dir through skopeo
        img = read_image(src.layout, src.ref, label)  # manifest, config, layer descriptors, all verified

Tarballs are converted by skopeo (`skopeo copy docker-archive:... oci:...`), which
knows every docker-archive variant; the layout it writes is then read like any
other. A layout directory is read directly: it is JSON and content-addressed
files, and every blob is verified here (digest and size) anyway. An image
index (multi-platform) is resolved to this node's platform (linux/amd64 on
x86_64); another platform is refused naming what the image has.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile

from agent.sandbox.images.errors import ImageError
from agent.sandbox.images.layer import MEDIA_TYPES
from agent.sandbox import trees

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
REF_ANNOTATION = "org.opencontainers.image.ref.name"
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MAX_JSON = 4 << 20
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
        "riscv64": "riscv64", "i686": "386"}


def host_platform() -> tuple[str, str]:
    m = os.uname().machine
    return "linux", ARCH.get(m, m)


def check_digest(d, where: str) -> str:
    if not isinstance(d, str) or not DIGEST_RE.match(d):
        raise ImageError(f"{where}: digest {str(d)[:80]!r} is not sha256:<64 hex digits> (the only algorithm dsec accepts)")
    return d


class ParsedImage:
    def __init__(self):
        self.manifest_digest = ""
        self.manifest_bytes = b""
        self.manifest_media_type = ""
        self.config_digest = ""
        self.config_bytes = b""
        self.config: dict = {}
        self.layers: list[dict] = []        # {digest, media_type, size, diff_id}
        self.ref = ""                        # the ref annotation it was found under, if any
        self.layout = ""

    def blob(self, digest: str) -> str:
        return os.path.join(self.layout, "blobs", "sha256", digest.split(":", 1)[1])


class Source:
    """A layout directory to read (for a tarball, a temporary one skopeo wrote)."""

    def __init__(self, layout: str, ref: str | None, kind: str, tmp: str | None = None):
        self.layout, self.ref, self.kind, self.tmp = layout, ref, kind, tmp

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tmp:
            trees.remove(self.tmp)
        return False


def split_ref(path: str) -> tuple[str, str | None]:
    """PATH or PATH:REF (as skopeo spells oci:DIR:REF); PATH wins when it exists as given."""
    if os.path.exists(path) or ":" not in path:
        return path, None
    p, _, ref = path.rpartition(":")
    if os.path.exists(p):
        return p, ref or None
    return path, None


def _tar_kind(path: str) -> tuple[str, list[str]]:
    """('oci-archive' | 'docker-archive', refs it holds) for a tarball."""
    try:
        with tarfile.open(path, "r:*") as tf:
            names = {}
            for m in tf:
                n = m.name.lstrip("./") if m.name not in ("./", ".") else ""
                if n in ("oci-layout", "index.json", "manifest.json") and m.isreg() and m.size <= MAX_JSON:
                    names[n] = tf.extractfile(m).read()
                if len(names) == 3:
                    break
    except (tarfile.TarError, OSError, EOFError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "compression method" in why or "invalid header" in why:
            why = "not a tar archive, plain or compressed"
        raise ImageError(f"{path}: not an OCI layout directory or an image tarball ({why})") from None
    try:
        if "oci-layout" in names and "index.json" in names:
            idx = json.loads(names["index.json"])
            refs = [m.get("annotations", {}).get(REF_ANNOTATION) for m in idx.get("manifests", [])]
            return "oci-archive", [r for r in refs if r]
        if "manifest.json" in names:
            man = json.loads(names["manifest.json"])
            refs = [t for e in man if isinstance(e, dict) for t in (e.get("RepoTags") or [])]
            return "docker-archive", refs
    except (ValueError, AttributeError, TypeError) as e:
        raise ImageError(f"{path}: its index.json or manifest.json is not valid JSON ({e})") from None
    raise ImageError(f"{path}: a tarball without oci-layout + index.json (OCI archive) or manifest.json "
                     f"(docker archive)")


def _skopeo_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines else "failed"
    msg = re.sub(r'^time="[^"]*" level=\w+ msg="(.*)"$', r"\1", msg)
    return msg.removeprefix("Error: ").removeprefix("FATA[0000] ")[:400]


def open_source(path: str, work_dir: str, ref: str | None = None) -> Source:
    path, path_ref = split_ref(path)
    ref = path_ref or ref
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "oci-layout")):
            raise ImageError(f"{path}: a directory without an oci-layout file is not an OCI image layout")
        return Source(path, ref, "oci-layout")
    if not os.path.isfile(path):
        raise ImageError(f"{path}: no such file or directory")
    kind, refs = _tar_kind(path)
    chosen = None
    if ref is not None:
        chosen = ref
    elif len(refs) > 1:
        raise ImageError(f"{path}: holds {len(refs)} images ({', '.join(refs[:8])}): name one as {path}:REF")
    if shutil.which("skopeo") is None:
        raise ImageError(f"{path}: reading a {kind} tarball needs skopeo (apt-get install skopeo)")
    tmp = tempfile.mkdtemp(prefix="skopeo-", dir=work_dir)
    out = os.path.join(tmp, "layout")
    srcref = f"{kind}:{path}" + (f":{chosen}" if chosen else "")
    try:
        r = subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", srcref, f"oci:{out}:image"],
                           capture_output=True, timeout=3600, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        trees.remove(tmp)
        raise ImageError(f"{path}: skopeo did not finish within an hour") from None
    if r.returncode != 0:
        trees.remove(tmp)
        raise ImageError(f"{path}: skopeo could not read the {kind}: "
                         f"{_skopeo_error(r.stderr.decode(errors='replace'))}")
    src = Source(out, "image", kind, tmp)
    src.original_ref = chosen or (refs[0] if refs else None)
    return src


def _read_blob_json(layout: str, desc: dict, where: str, what: str) -> tuple[bytes, dict]:
    if not isinstance(desc, dict):
        raise ImageError(f"{where}: {what} descriptor is not an object")
    d = check_digest(desc.get("digest"), f"{where}: {what}")
    size = desc.get("size")
    p = os.path.join(layout, "blobs", "sha256", d[7:])
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_JSON + 1)
    except FileNotFoundError:
        raise ImageError(f"{where}: {what} {d} is missing from the layout (blobs/sha256/{d[7:19]}...)") from None
    except OSError as e:
        raise ImageError(f"{where}: {what} {d}: {e.strerror}") from None
    if len(data) > MAX_JSON:
        raise ImageError(f"{where}: {what} {d} is larger than {MAX_JSON} bytes")
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if got != d:
        raise ImageError(f"{where}: {what} {d} is corrupt (its content hashes to {got})")
    if isinstance(size, int) and size != len(data):
        raise ImageError(f"{where}: {what} {d} is {len(data)} bytes, the descriptor says {size}")
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ImageError(f"{where}: {what} {d} is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ImageError(f"{where}: {what} {d} is not a JSON object")
    return data, obj


def _pick(descs: list, ref: str | None, where: str, layout: str, depth: int = 0) -> tuple[dict, str]:
    """The manifest descriptor for `ref` (and this platform) from an index's manifests."""
    if depth > 4:
        raise ImageError(f"{where}: image indexes nested too deeply")
    if not isinstance(descs, list) or not descs:
        raise ImageError(f"{where}: the index lists no manifests")
    found_ref = ""
    if ref is not None and depth == 0:
        named = [d for d in descs if isinstance(d, dict) and (d.get("annotations") or {}).get(REF_ANNOTATION) == ref]
        if not named:
            refs = sorted({(d.get("annotations") or {}).get(REF_ANNOTATION) or "?" for d in descs if isinstance(d, dict)})
            raise ImageError(f"{where}: no image named {ref!r} in it (it has: {', '.join(refs[:8])})")
        descs, found_ref = named, ref
    want_os, want_arch = host_platform()
    manifests = [d for d in descs if isinstance(d, dict)]
    if len({d.get("digest") for d in manifests}) > 1:
        plat = [d for d in manifests if isinstance(d.get("platform"), dict)]
        if plat and len(plat) == len(manifests):
            match = [d for d in plat if d["platform"].get("os") == want_os
                     and d["platform"].get("architecture") == want_arch]
            if not match:
                have = sorted({f"{d['platform'].get('os')}/{d['platform'].get('architecture')}" for d in plat})
                raise ImageError(f"{where}: no manifest for {want_os}/{want_arch} (the image has "
                                 f"{', '.join(have)})")
            manifests = match[:1]
        elif depth == 0:
            refs = sorted({(d.get("annotations") or {}).get(REF_ANNOTATION) or "?" for d in manifests})
            raise ImageError(f"{where}: holds {len(manifests)} images ({', '.join(refs[:8])}): name one as PATH:REF")
    desc = manifests[0]
    if not found_ref:
        found_ref = (desc.get("annotations") or {}).get(REF_ANNOTATION) or ""
    mt = desc.get("mediaType", "")
    if mt in INDEX_TYPES:
        _, idx = _read_blob_json(layout, desc, where, "image index")
        d, _ = _pick(idx.get("manifests"), None, where, layout, depth + 1)
        return d, found_ref
    return desc, found_ref


def read_image(layout: str, ref: str | None, where: str) -> ParsedImage:
    """Index -> manifest -> config of the image in `layout`, each verified; the
    layer descriptors with their diff_ids (the layer blobs are verified when copied)."""
    try:
        with open(os.path.join(layout, "oci-layout")) as f:
            ver = json.load(f).get("imageLayoutVersion")
    except (OSError, ValueError, AttributeError) as e:
        raise ImageError(f"{where}: oci-layout is unreadable ({e})") from None
    if ver != "1.0.0":
        raise ImageError(f"{where}: imageLayoutVersion {ver!r} (dsec reads 1.0.0)")
    try:
        with open(os.path.join(layout, "index.json"), "rb") as f:
            index = json.loads(f.read(MAX_JSON))
    except (OSError, ValueError) as e:
        raise ImageError(f"{where}: index.json is unreadable ({e})") from None
    if not isinstance(index, dict):
        raise ImageError(f"{where}: index.json is not a JSON object")
    desc, found_ref = _pick(index.get("manifests"), ref, where, layout)
    img = ParsedImage()
    img.layout = layout
    img.ref = found_ref
    img.manifest_bytes, man = _read_blob_json(layout, desc, where, "manifest")
    img.manifest_digest = desc["digest"]
    mt = man.get("mediaType") or desc.get("mediaType") or MANIFEST_TYPES[0]
    if man.get("schemaVersion") == 1:
        raise ImageError(f"{where}: a docker schema 1 manifest (deprecated; convert it with skopeo copy)")
    if mt in INDEX_TYPES:
        raise ImageError(f"{where}: the manifest {img.manifest_digest} is an index")
    if mt not in MANIFEST_TYPES:
        raise ImageError(f"{where}: manifest media type {mt!r} is not an image manifest")
    img.manifest_media_type = mt
    img.config_bytes, cfg = _read_blob_json(layout, man.get("config"), where, "config")
    img.config_digest = man["config"]["digest"]
    img.config = cfg
    want_os, want_arch = host_platform()
    if cfg.get("os", want_os) != want_os or cfg.get("architecture", want_arch) != want_arch:
        raise ImageError(f"{where}: built for {cfg.get('os')}/{cfg.get('architecture')}, this node is "
                         f"{want_os}/{want_arch}")
    layers = man.get("layers")
    if not isinstance(layers, list):
        raise ImageError(f"{where}: the manifest has no layers list")
    diff_ids = ((cfg.get("rootfs") or {}).get("diff_ids")) or []
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise ImageError(f"{where}: the manifest has {len(layers)} layers but the config lists "
                         f"{len(diff_ids) if isinstance(diff_ids, list) else 'no'} diff_ids")
    for i, (ld, diff) in enumerate(zip(layers, diff_ids), 1):
        lw = f"{where} layer {i}/{len(layers)}"
        if not isinstance(ld, dict):
            raise ImageError(f"{lw}: descriptor is not an object")
        d = check_digest(ld.get("digest"), lw)
        check_digest(diff, f"{lw} diff_id")
        mtype = ld.get("mediaType", "")
        if mtype not in MEDIA_TYPES:
            raise ImageError(f"{lw} {d[:19]}: unsupported layer media type {mtype!r}")
        size = ld.get("size")
        if not isinstance(size, int) or size < 0:
            raise ImageError(f"{lw} {d[:19]}: descriptor has no valid size")
        img.layers.append({"digest": d, "media_type": mtype, "size": size, "diff_id": diff})
    return img


def copy_verified(src: str, dst: str, digest: str, size: int, where: str) -> None:
    """Copy a blob, checking its size and sha256 on the way; dst appears only if it matches."""
    h = hashlib.sha256()
    n = 0
    tmp = dst + ".part"
    try:
        fin = open(src, "rb")
    except FileNotFoundError:
        raise ImageError(f"{where}: blob {digest} is missing from the image") from None
    except OSError as e:
        raise ImageError(f"{where}: blob {digest}: {e.strerror}") from None
    try:
        with fin, open(tmp, "wb") as fout:
            while True:
                chunk = fin.read(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
                if n > size:
                    break
                h.update(chunk)
                fout.write(chunk)
        if n != size:
            raise ImageError(f"{where}: blob {digest} is {'larger' if n > size else f'{n} bytes'}, "
                             f"the manifest says {size} bytes")
        got = "sha256:" + h.hexdigest()
        if got != digest:
            raise ImageError(f"{where}: blob {digest} is corrupt (its content hashes to {got})")
        os.chmod(tmp, 0o444)
        os.rename(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
