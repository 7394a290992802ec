"""Images (issue 16): import, the layer store, sandboxes on images, bad input,
atomicity, coalescing, the budget, volumes. Real images built here with umoci
and skopeo from Debian's busybox-static (tests/images.py), real sandboxes, the
real CLI. The record and the agent are in tests/test_images_record.py."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
import threading

import pytest

import images as T
from images import layout, store_dir  # noqa: F401 - fixtures
from conftest import dsec
from agent.sandbox import images
from agent.sandbox.images import ImageError


def env_for(store_dir, **kw):
    e = {"DSEC_IMAGE_STORE": store_dir, "DSEC_AGENT": "off"}
    e.update(kw)
    return e


def out(r) -> str:
    return r.stdout.decode(errors="replace")


def err(r) -> str:
    return r.stderr.decode(errors="replace")


def files(d):
    return sorted(os.path.relpath(os.path.join(dp, f), d) for dp, dn, fn in os.walk(d) for f in fn)


# ------------------------------------------------------------------ import, sharing, metadata

def test_import_layout_and_tarballs_share_layers(layout, store_dir, tmp_path):
    e = env_for(store_dir)
    for ref in ("base", "app", "tool"):
        r = dsec("image", "import", f"{layout}:{ref}", env=e)
        assert r.returncode == 0, err(r)
        assert out(r).startswith(f"imported layout:{ref} sha256:")
    docker_tar = T.tarball(layout, "app", str(tmp_path / "app.tar"), "docker-archive", tag="example.org/app:2")
    oci_tar = T.tarball(layout, "tool", str(tmp_path / "tool.tar"), "oci-archive")
    r = dsec("image", "import", docker_tar, env=e)
    assert r.returncode == 0 and "imported example.org/app:2 " in out(r), err(r)
    r = dsec("image", "import", oci_tar, "--name", "tool:oci", env=e)
    assert r.returncode == 0, err(r)
    st = images.ImageStore(store_dir)
    app, tool, app2 = st.resolve("layout:app"), st.resolve("layout:tool"), st.resolve("example.org/app:2")
    assert app.layers[0]["diff_id"] == tool.layers[0]["diff_id"]            # the shared base
    assert [x["diff_id"] for x in app2.layers] == [x["diff_id"] for x in app.layers]
    assert st.resolve("tool:oci").digest == tool.digest                      # same manifest: one image, two names
    # by digest, NAME@digest and a prefix
    assert st.resolve(app.digest).digest == app.digest
    assert st.resolve("layout:app@" + app.digest).digest == app.digest
    assert st.resolve(app.digest[7:20]).digest == app.digest
    r = dsec("image", "ls", "--format", "json", env=e)
    names = {json.loads(x)["name"] for x in out(r).splitlines()}
    assert names == {"layout:base", "layout:app", "layout:tool", "example.org/app:2", "tool:oci"}
    # nothing unpacked yet; prewarm unpacks each distinct layer once
    assert st.usage()["layers_cached"] == 0
    r = dsec("image", "prewarm", "layout:app", "example.org/app:2", "layout:tool", env=e)
    assert r.returncode == 0, err(r)
    distinct = {x["diff_id"] for i in (app, app2, tool) for x in i.layers}
    log = st.unpack_log()
    assert sorted(x["diff_id"] for x in log) == sorted(distinct)
    assert "0 of 4 layers unpacked" in out(r).splitlines()[1]
    info = json.loads(out(dsec("image", "inspect", "layout:app", env=e)))
    assert info["cached_layers"] == 4 and info["config"]["User"] == "app"


def test_layer_tree_keeps_metadata_and_turns_whiteouts_into_overlay_ones(layout, store_dir):
    st = images.ImageStore(store_dir)
    img, _ = st.import_image(f"{layout}:app")
    lowers = st.prepare(img, "meta-1")
    st.release("meta-1")
    base_l = os.path.realpath(lowers[-1])
    hello = next(os.path.join(os.path.realpath(d), "opt/app/hello.py") for d in lowers
                 if os.path.exists(os.path.join(os.path.realpath(d), "opt/app/hello.py")))
    s = os.lstat(hello)
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode), int(s.st_mtime)) == (1001, 50, 0o640, 1_600_000_000)
    assert os.getxattr(hello, "user.dsec.test") == b"kept"
    motd = next(os.path.join(os.path.realpath(d), "etc/motd") for d in lowers
                if os.path.lexists(os.path.join(os.path.realpath(d), "etc/motd")))
    ms = os.lstat(motd)
    assert stat.S_ISCHR(ms.st_mode) and ms.st_rdev == 0                     # the OCI whiteout, overlay-style
    srv = next(os.path.join(os.path.realpath(d), "srv") for d in lowers
               if os.path.exists(os.path.join(os.path.realpath(d), "srv/new.txt")))
    assert os.getxattr(srv, "trusted.overlay.opaque") == b"y"
    assert stat.S_IMODE(os.lstat(os.path.join(base_l, "tmp")).st_mode) == 0o1777
    assert os.readlink(os.path.join(base_l, "bin/sh")) == "busybox"
    assert os.lstat(os.path.join(base_l, "home/app")).st_uid == 1001
    assert images.in_store(hello, store_dir) and not images.in_store("/usr/bin", store_dir)
    assert images.in_store(lowers[0], store_dir)           # the short links resolve into the store


# ------------------------------------------------------------------ sandboxes on images

def test_run_on_an_image_applies_its_config_and_dsec_defaults_win(layout, store_dir):
    e = env_for(store_dir)
    for ref in ("app", "tool"):
        assert dsec("image", "import", f"{layout}:{ref}", env=e).returncode == 0
    # no CMD: Entrypoint + Cmd, the image's user (app, 1001), workdir and env
    r = dsec("run", "--audit", "off", "--image", "layout:app", env=e)
    assert r.returncode == 0, err(r)
    assert out(r).splitlines() == ["print('hello from the app layer')", "1001", "/opt/app", "app"]
    # CMD replaces Cmd, Entrypoint stays; the whiteout and the opaque dir hold
    r = dsec("run", "--audit", "off", "--image", "layout:app", "--", "-c",
             "ls /etc; ls /srv; test -e /etc/motd || echo no-motd; echo $HOSTNAME", env=e)
    assert r.returncode == 0, err(r)
    lines = out(r).split()
    assert "passwd" in lines and "motd" not in lines[:-1] and "no-motd" in lines
    assert "new.txt" in lines and "old" not in lines
    # an image whose user is root runs unprivileged, unless root is asked for
    r = dsec("run", "--audit", "off", "--image", "layout:tool", "--", "/bin/id", "-u", env=e)
    assert r.returncode == 0 and int(out(r).strip()) >= 1879048192, err(r)    # its own leased uid
    r = dsec("run", "--audit", "off", "--user", "root", "--image", "layout:tool", "--", "/bin/id", "-u", env=e)
    assert (r.returncode, out(r).strip()) == (0, "0"), err(r)
    r = dsec("run", "--audit", "off", "--image", "layout:tool", "--entrypoint", "", "--", "/usr/bin/tool.sh", env=e)
    assert (r.returncode, out(r).strip()) == (0, "tool ran"), err(r)
    # writes land in the private upper layer, never in the shared layer store
    before = files(os.path.join(store_dir, "layers"))
    r = dsec("run", "--audit", "off", "--user", "root", "--image", "layout:tool", "--summary-json",
             os.path.join(store_dir, "..", "s.json"), "--", "/bin/sh", "-c",
             "echo x >> /etc/group && echo y > /etc/new && rm /etc/passwd", env=e)
    assert r.returncode == 0, err(r)
    assert files(os.path.join(store_dir, "layers")) == before
    with open(os.path.join(store_dir, "..", "s.json")) as f:
        ch = {c["path"]: c["change"] for c in json.load(f)["changes"]}
    assert ch == {"/etc/group": "modified", "/etc/new": "added", "/etc/passwd": "deleted"}
    base = os.path.realpath(images.ImageStore(store_dir).prepare(images.ImageStore(store_dir).resolve("layout:tool"),
                                                                   "chk")[-1])
    with open(os.path.join(base, "etc/group")) as f:
        assert "x" not in f.read().split()


def test_run_image_errors_are_one_line(layout, store_dir):
    e = env_for(store_dir)
    r = dsec("run", "--image", "nope:1", "--", "true", env=e)
    assert r.returncode == 125 and len(err(r).strip().splitlines()) == 1
    assert "image nope:1: not in this node's image store" in err(r)
    r = dsec("run", "--image", "Bad Name", "--", "true", env=e)
    assert r.returncode == 125 and "a name is lowercase" in err(r)
    assert dsec("image", "import", f"{layout}:base", "--name", "b:1", env=e).returncode == 0
    r = dsec("run", "--image", "b:1", "--rootfs", "/", "--", "true", env=e)
    assert r.returncode == 125 and "--image and --rootfs" in err(r)
    r = dsec("image", "inspect", "nope", env=e)
    assert r.returncode == 2 and "not in this node's image store" in err(r)


# ------------------------------------------------------------------ bad input

def _tarinfo(name, kind=tarfile.REGTYPE, **kw):
    return T.member(name, kind, **kw)


BAD = {
    "dotdot": ([_tarinfo("etc/../../evil", data=b"x")], "has a '..' component"),
    "absolute": ([_tarinfo("/etc/evil", data=b"x")], "is an absolute path"),
    "device": ([_tarinfo("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0)], "is a device node (block 8:0)"),
    "chardev": ([_tarinfo("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1)], "is a device node (char 1:1)"),
    "symlink-out": ([_tarinfo("a/b/link", tarfile.SYMTYPE, linkname="../../../etc/shadow")], "points out of the layer"),
    "hardlink-out": ([_tarinfo("x", tarfile.LNKTYPE, linkname="etc/passwd")], "not a file earlier in this layer"),
    "through-link": ([_tarinfo("lib", tarfile.SYMTYPE, linkname="/etc"), _tarinfo("lib/cron", data=b"x")],
                     "goes through 'lib', which is a symlink in this layer"),
    "trusted-xattr": ([_tarinfo("d", tarfile.DIRTYPE, mode=0o755, pax_headers={"SCHILY.xattr.trusted.overlay.redirect": "/x"})],
                      "sets the xattr trusted.overlay.redirect"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_layers_are_refused_at_import_naming_image_and_layer(case, tmp_path, store_dir):
    members, msg = BAD[case]
    lay = T.raw_layer_image(tmp_path, members, name=case)
    r = dsec("image", "import", lay, "--name", f"bad:{case}", env=env_for(store_dir))
    lines = err(r).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, err(r)
    assert lines[0].startswith(f"dsec image: error: image bad:{case} layer 1/1 sha256:") and msg in lines[0], lines[0]
    _assert_store_empty(store_dir)


def test_a_layer_deeper_than_the_recursion_limit_unpacks(tmp_path, store_dir):
    """A layer (hostile or not) with a 1,500-level directory chain that a later entry of the
    same layer replaces by a file: on main the replacement's removal recursed once per level
    (RecursionError, a traceback); now the layer unpacks and the file is there."""
    deep = [_tarinfo("/".join(["a"] * n), tarfile.DIRTYPE, mode=0o755) for n in range(1, 1501)]
    lay = T.raw_layer_image(tmp_path, deep + [_tarinfo("a", data=b"flat\n"),
                                              _tarinfo("bin", tarfile.DIRTYPE, mode=0o755)], name="deep")
    r = dsec("image", "import", lay, "--name", "deep:1", env=env_for(store_dir))
    assert r.returncode == 0, err(r)
    r = dsec("image", "prewarm", "deep:1", env=env_for(store_dir))
    assert r.returncode == 0, err(r)
    roots = [os.path.join(dp, "a") for dp, dn, fn in os.walk(store_dir) if "a" in fn and "bin" in dn]
    assert roots and all(open(p).read() == "flat\n" for p in roots), roots


def _assert_store_empty(store_dir):
    assert files(os.path.join(store_dir, "blobs")) == []
    assert os.listdir(os.path.join(store_dir, "images")) == []
    assert os.listdir(os.path.join(store_dir, "tmp")) == []
    assert not os.path.exists(os.path.join(store_dir, "refs.json")) or \
        json.load(open(os.path.join(store_dir, "refs.json"))) == {}


def test_corrupt_missing_and_foreign_images_are_refused(layout, tmp_path, store_dir):
    e = env_for(store_dir)
    src = str(tmp_path / "copy")
    subprocess.run(["cp", "-a", layout, src], check=True)
    man = T.manifest_of(src, "app")
    layer = man["layers"][1]["digest"]
    p = os.path.join(src, "blobs", "sha256", layer[7:])
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    r = dsec("image", "import", f"{src}:app", env=e)
    assert r.returncode == 2 and len(err(r).strip().splitlines()) == 1
    assert f"image copy:app layer 2/4 {layer[:19]}: blob {layer} is corrupt" in err(r), err(r)
    os.unlink(p)
    r = dsec("image", "import", f"{src}:app", env=e)
    assert r.returncode == 2 and f"image copy:app layer 2/4 {layer[:19]}: blob {layer} is missing" in err(r), err(r)
    _assert_store_empty(store_dir)
    lay = T.raw_layer_image(tmp_path, [_tarinfo("f", data=b"x")], name="arm", arch="arm64")
    r = dsec("image", "import", lay, env=e)
    assert r.returncode == 2 and "image " in err(r) and "built for linux/arm64, this node is linux/amd64" in err(r)
    lay = T.raw_layer_image(tmp_path, [_tarinfo("f", data=b"x")], name="lie", diff_id="sha256:" + "0" * 64)
    r = dsec("image", "import", lay, env=e)
    assert r.returncode == 2 and "not the diff_id sha256:0000" in err(r), err(r)
    r = dsec("image", "import", str(tmp_path / "nothing"), env=e)
    assert r.returncode == 2 and "no such file or directory" in err(r)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    r = dsec("image", "import", str(junk), env=e)
    assert r.returncode == 2 and "junk.tar" in err(r) and len(err(r).strip().splitlines()) == 1
    _assert_store_empty(store_dir)


# ------------------------------------------------------------------ atomicity, coalescing

def _tamper_blob(st, img, i):
    """Replace a stored layer blob with another valid tar: import checked the original,
    so only the unpack's diff_id check (after the tree is written) can catch it."""
    import gzip
    import io
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for n in range(50):
            ti = tarfile.TarInfo(f"f{n}")
            ti.size = 4
            tf.addfile(ti, io.BytesIO(b"evil"))
    p = st.blob_path(img.layers[i]["digest"])
    os.chmod(p, 0o644)
    with open(p, "wb") as f:
        f.write(gzip.compress(buf.getvalue()))


def test_a_failed_unpack_is_never_used_and_fails_every_waiter_alike(layout, store_dir):
    st = images.ImageStore(store_dir)
    img, _ = st.import_image(f"{layout}:tool")
    _tamper_blob(st, img, 1)
    errors, lowers = [], []

    def go(i):
        try:
            lowers.append(images.open_store(store_dir).prepare(img, f"w-{i}"))
        except ImageError as e:
            errors.append(e.message)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not lowers and len(errors) == 16 and len(set(errors)) == 1, set(errors)
    assert errors[0].startswith("image layout:tool layer 2/2 sha256:") and "not the diff_id" in errors[0]
    h = img.layers[1]["diff_id"][7:]
    assert not os.path.exists(os.path.join(store_dir, "layers", h))
    assert not [f for f in os.listdir(os.path.join(store_dir, "layers")) if f.startswith(".tmp-")]
    assert os.path.isdir(os.path.join(store_dir, "layers", img.layers[0]["diff_id"][7:]))   # the good one is kept
    # another process later gets the same clear error (a new attempt, not a stale note)
    r = dsec("image", "prewarm", "layout:tool", env=env_for(store_dir))
    assert r.returncode == 2 and "not the diff_id" in err(r) and "layer 2/2" in err(r)
    # a partial tree left by a killed unpacker is removed, never used
    partial = os.path.join(store_dir, "layers", f".tmp-{h}-999999-dead")
    os.makedirs(os.path.join(partial, "root", "etc"))
    assert dsec("image", "gc", env=env_for(store_dir)).returncode == 0
    assert not os.path.exists(partial)


def test_concurrent_first_starts_unpack_once(layout, store_dir):
    st = images.ImageStore(store_dir)
    img, _ = st.import_image(f"{layout}:app")
    res = []
    threads = [threading.Thread(target=lambda i=i: res.append(images.open_store(store_dir).prepare(img, f"c-{i}")))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(res) == 16 and all(r == res[0] for r in res)
    assert len(st.unpack_log()) == len(img.layers)
    # and across processes: four `dsec image prewarm` at once on a fresh store of the same image
    other = store_dir + "-2"
    e = env_for(other)
    assert dsec("image", "import", f"{layout}:app", env=e).returncode == 0
    from conftest import DSEC
    procs = [subprocess.Popen([DSEC, "image", "prewarm", "layout:app"], env=dict(os.environ, **e),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    for p in procs:
        assert p.wait(60) == 0, p.stderr.read()
    assert len(images.ImageStore(other).unpack_log()) == len(img.layers)
    subprocess.run(["rm", "-rf", other])


# ------------------------------------------------------------------ budget, rm, gc

def test_budget_evicts_least_recently_used_unleased_layers(layout, store_dir):
    st = images.ImageStore(store_dir)
    app, _ = st.import_image(f"{layout}:app")
    tool, _ = st.import_image(f"{layout}:tool")
    st.prepare(app, "b-1")
    st.release("b-1")
    used = st.usage()["layer_bytes"]
    tool_only = tool.layers[1]["diff_id"]
    small = images.ImageStore(store_dir, budget=used + 1024)     # room for app's layers, not tool's too
    small.prepare(tool, "b-2")                                   # base is shared; app's own layers go (LRU)
    cached = {x["diff_id"] for x in small.layers()}
    assert tool_only in cached and tool.layers[0]["diff_id"] in cached     # the leased and the new one stay
    assert {x["diff_id"] for x in app.layers[1:]} - cached                 # app's own layers made the room
    assert small.stats["evicted"] >= 1 and small.usage()["layer_bytes"] <= used + 1024
    # a layer a live sandbox leases is never evicted: then the budget refuses, clearly
    tiny = images.ImageStore(store_dir, budget=4096)
    with pytest.raises(ImageError, match="budget of 4096 bytes is exhausted"):
        tiny.prepare(app, "b-3")
    assert tool_only in {x["diff_id"] for x in tiny.layers()}     # b-2's lease held it
    # rm forgets the name and gc frees what nothing needs (and no lease holds)
    st.release("b-2")
    st.release("b-3")
    r = dsec("image", "rm", "layout:app", env=env_for(store_dir))
    assert r.returncode == 0 and "the image is gone" in out(r), err(r)
    left = {x["diff_id"] for x in st.layers()}
    assert not {x["diff_id"] for x in app.layers[1:]} & left and tool_only in left
    assert app.digest[7:] not in os.listdir(os.path.join(store_dir, "blobs", "sha256"))
    assert tool.layers[0]["digest"][7:] in os.listdir(os.path.join(store_dir, "blobs", "sha256"))


# ------------------------------------------------------------------ volumes

def test_volumes_read_only_by_default_and_only_from_allowed_roots(layout, store_dir, tmp_path):
    data = tmp_path / "data"
    outd = tmp_path / "out"
    data.mkdir()
    outd.mkdir()
    (data / "train.txt").write_text("weights\n")
    e = env_for(store_dir, DSEC_VOLUME_ROOTS=str(tmp_path))
    assert dsec("image", "import", f"{layout}:base", "--name", "b:1", env=e).returncode == 0
    r = dsec("run", "--audit", "off", "--user", "root", "--image", "b:1", "--volume", f"{data}:/data",
             "--volume", f"{outd}:/out:rw", "--", "/bin/sh", "-c",
             "cat /data/train.txt; echo x > /data/y 2>/dev/null || echo ro; echo result > /out/r.txt", env=e)
    assert r.returncode == 0, err(r)
    assert out(r).split() == ["weights", "ro"]
    assert (outd / "r.txt").read_text() == "result\n" and not (data / "y").exists()
    for vol, msg in (("/etc:/x", "is not inside an allowed root"), (f"{data}:/proc/x", "cannot mount over /proc/x"),
                     (f"{data}:rel", "must be absolute"), (f"{data}:/d:rx", "expected ro or rw"),
                     (f"{tmp_path}/none:/d", "does not exist"), (f"{data}:/a/../b", "'..'")):
        r = dsec("run", "--image", "b:1", "--volume", vol, "--", "true", env=e)
        assert r.returncode == 125 and msg in err(r) and len(err(r).strip().splitlines()) == 1, (vol, err(r))
    # a symlink to the host in the image is not followed by the mount
    (tmp_path / "escape").symlink_to(data)
    # (--audit off: the mounts are under test, not the record; an audited run pays ~6 s of eBPF compile)
    r = dsec("run", "--audit", "off", "--image", "b:1", "--volume", f"{tmp_path}/escape:/d", "--", "/bin/cat",
             "/d/train.txt", env=e)
    assert r.returncode == 0 and out(r) == "weights\n"            # the host side resolves, inside the root
    r = dsec("run", "--image", "b:1", "--volume", f"{data}:/d", env=env_for(store_dir, DSEC_VOLUME_ROOTS=""))
    assert r.returncode == 125 and "no volume roots are allowed" in err(r)
    with open("/bin/busybox", "rb") as f:
        bb = f.read()
    lay = T.raw_layer_image(tmp_path, [_tarinfo("bin", tarfile.DIRTYPE, mode=0o755),
                                              _tarinfo("bin/sh", mode=0o755, data=bb),
                                              _tarinfo("mnt", tarfile.SYMTYPE, linkname="/etc")], name="lnk")
    assert dsec("image", "import", lay, "--name", "lnk:1", env=e).returncode == 0
    r = dsec("run", "--audit", "off", "--image", "lnk:1", "--volume", f"{data}:/mnt/x", "--", "/bin/sh", "-c",
             "read l < /etc/x/train.txt; echo $l", env=e)
    # dsec-init resolves the target inside the root (RESOLVE_IN_ROOT): /mnt -> /etc is the sandbox's /etc
    assert r.returncode == 0 and out(r) == "weights\n", err(r)
    assert not os.path.exists("/etc/x")
