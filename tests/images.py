"""Test images built here, with umoci and skopeo (no registry is reachable):

    base    one layer: Debian's busybox-static as /bin/busybox + applet links,
            /etc/passwd and /etc/group (root, app uid 1001), /tmp, /workspace
    app     base + a runtime layer: /opt/app/hello.py (the host's python3 is not
            in the image; the script runs through the dsec test's --volume or
            is read by busybox), a whiteout of /etc/motd and an opaque /srv
    tool    base + another layer (shares base with app)

    layout = build_layout(tmp_path)          # OCI layout dir with refs base, app, tool
    tarball(layout, "app", path, "docker-archive")    # what docker save writes
    raw_layer_image(tmp_path, members)       # a one-layer image from a hand-made tar (bad inputs)
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "echo", "id", "env", "pwd", "stat", "touch", "rm", "mkdir", "sleep", "true",
           "false", "head", "wc", "readlink", "test", "grep", "sha256sum", "find", "cp", "mv", "ln", "date",
           "getfattr", "printf", "sync", "md5sum", "dd", "seq", "du")
HELLO = "print('hello from the app layer')\n"


def run(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def _base_tree(d):
    os.makedirs(f"{d}/bin")
    shutil.copy2(BUSYBOX, f"{d}/bin/busybox")
    for a in APPLETS:
        os.symlink("busybox", f"{d}/bin/{a}")
    os.makedirs(f"{d}/etc")
    with open(f"{d}/etc/passwd", "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001:app:/home/app:/bin/sh\n"
                "nobody:x:65534:65534:nobody:/:/bin/false\n")
    with open(f"{d}/etc/group", "w") as f:
        f.write("root:x:0:\napp:x:1001:\nstaff:x:50:\nnogroup:x:65534:\n")
    with open(f"{d}/etc/motd", "w") as f:
        f.write("base motd\n")
    os.makedirs(f"{d}/srv/old")
    with open(f"{d}/srv/old/stale.txt", "w") as f:
        f.write("from base\n")
    for p, mode in (("tmp", 0o1777), ("workspace", 0o755), ("home/app", 0o750), ("root", 0o700), ("usr/bin", 0o755)):
        os.makedirs(f"{d}/{p}", exist_ok=True)
        os.chmod(f"{d}/{p}", mode)
    os.chown(f"{d}/home/app", 1001, 1001)


def build_layout(tmp) -> str:
    """An OCI layout with images base, app, tool (app and tool share base's layer)."""
    tmp = str(tmp)
    layout = os.path.join(tmp, "layout")
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:base")
    tree = os.path.join(tmp, "base-tree")
    _base_tree(tree)
    run("umoci", "insert", "--image", f"{layout}:base", tree, "/")
    run("umoci", "config", "--image", f"{layout}:base", "--config.env=PATH=/bin:/usr/bin",
        "--config.env=IMAGE_LEVEL=base", "--config.cmd=/bin/sh")
    for t in ("app", "tool"):
        run("umoci", "tag", "--image", f"{layout}:base", t)
    app = os.path.join(tmp, "app-tree")
    os.makedirs(f"{app}/opt/app")
    with open(f"{app}/opt/app/hello.py", "w") as f:
        f.write(HELLO)
    os.chmod(f"{app}/opt/app/hello.py", 0o640)
    os.chown(f"{app}/opt/app/hello.py", 1001, 50)
    os.setxattr(f"{app}/opt/app/hello.py", "user.dsec.test", b"kept")
    os.utime(f"{app}/opt/app/hello.py", (1_600_000_000, 1_600_000_000))
    run("umoci", "insert", "--image", f"{layout}:app", f"{app}/opt", "/opt")
    run("umoci", "insert", "--image", f"{layout}:app", "--whiteout", "/etc/motd")
    srv = os.path.join(tmp, "srv-tree")
    os.makedirs(srv)
    with open(f"{srv}/new.txt", "w") as f:
        f.write("from app\n")
    run("umoci", "insert", "--image", f"{layout}:app", "--opaque", srv, "/srv")
    run("umoci", "config", "--image", f"{layout}:app", "--config.env=IMAGE_LEVEL=app",
        "--config.workingdir=/opt/app", "--config.user=app", "--config.entrypoint=/bin/sh",
        "--config.cmd=-c", "--config.cmd=cat /opt/app/hello.py; id -u; pwd; echo $IMAGE_LEVEL")
    tool = os.path.join(tmp, "tool-tree")
    os.makedirs(f"{tool}/usr/bin")
    with open(f"{tool}/usr/bin/tool.sh", "w") as f:
        f.write("#!/bin/sh\necho tool ran\n")
    os.chmod(f"{tool}/usr/bin/tool.sh", 0o755)
    run("umoci", "insert", "--image", f"{layout}:tool", f"{tool}/usr", "/usr")
    run("umoci", "config", "--image", f"{layout}:tool", "--config.user=0")
    run("umoci", "gc", "--layout", layout)
    return layout


def tarball(layout: str, ref: str, path: str, kind: str = "docker-archive", tag: str | None = None) -> str:
    dest = f"{kind}:{path}" + (f":{tag}" if tag and kind == "docker-archive" else "")
    if kind == "oci-archive":
        dest = f"oci-archive:{path}:{tag or ref}"
    run("skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{layout}:{ref}", dest)
    return path


def manifest_of(layout: str, ref: str) -> dict:
    with open(os.path.join(layout, "index.json")) as f:
        idx = json.load(f)
    d = next(m for m in idx["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref)
    with open(os.path.join(layout, "blobs", d["digest"].replace(":", "/"))) as f:
        return json.load(f)


def _blob(layout, data: bytes) -> dict:
    h = hashlib.sha256(data).hexdigest()
    p = os.path.join(layout, "blobs", "sha256", h)
    with open(p, "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + h, "size": len(data)}


def raw_layer_image(tmp, members, *, name="bad", arch="amd64", diff_id=None, extra_layers=()) -> str:
    """A one-layer OCI layout whose layer is the tar of `members`: (TarInfo, bytes|None) pairs."""
    layout = os.path.join(str(tmp), f"raw-{name}")
    os.makedirs(os.path.join(layout, "blobs", "sha256"))
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    tar = buf.getvalue()
    gz = gzip.compress(tar, mtime=0)
    layers = [dict(_blob(layout, gz), mediaType="application/vnd.oci.image.layer.v1.tar+gzip")]
    diffs = [diff_id or "sha256:" + hashlib.sha256(tar).hexdigest()]
    for L, d in extra_layers:
        layers.append(L)
        diffs.append(d)
    cfg = {"architecture": arch, "os": "linux", "config": {"Cmd": ["/bin/sh"]},
           "rootfs": {"type": "layers", "diff_ids": diffs}}
    c = _blob(layout, json.dumps(cfg).encode())
    man = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "config": dict(c, mediaType="application/vnd.oci.image.config.v1+json"), "layers": layers}
    m = _blob(layout, json.dumps(man).encode())
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [dict(m, mediaType="application/vnd.oci.image.manifest.v1+json",
                                                          annotations={"org.opencontainers.image.ref.name": name})]}, f)
    return layout


def member(name, kind=tarfile.REGTYPE, data=b"", **kw):
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = kw.pop("mode", 0o644)
    for k, v in kw.items():
        setattr(ti, k, v)
    if kind == tarfile.REGTYPE:
        ti.size = len(data)
        return ti, data
    return ti, None


# --- fixtures both test files use (imported there) -------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """The test images (OCI layout with refs base, app, tool), built once per module."""
    return build_layout(tmp_path_factory.mktemp("imgsrc"))


@pytest.fixture
def store_dir(tmp_path):
    """A private image store for one test (the node's own is never touched)."""
    d = str(tmp_path / "store")
    yield d
    subprocess.run(["rm", "-rf", d])
