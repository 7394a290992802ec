#!/usr/bin/env python3
"""Image loading: first start from a freshly imported image (unpack included),
a cached start, and --rootfs of the same tree; 16 concurrent first starts of one
image; store bytes of two images sharing their base vs the sum of their tarballs.

usage:
  .venv/bin/python bench/images.py              # 8 runs of each start
  .venv/bin/python bench/images.py --runs 4

The images are built here with umoci from this host's files (no registry):
  base     busybox-static, /etc
  runtime  python3.11, its shared libraries and standard library (~60 MB)
  task-a   base + runtime + a task layer (a script and 4 MB of data)
  task-b   base + runtime + another task layer
Each start is launcher.launch() of `python3 -c pass` in this process (the
sandbox cost without the CLI's interpreter start-up; audit off: image loading is
what is measured):
  first    a fresh store, task-a imported (untimed), then prepare (unpack of every
           layer, coalesced, synced) + launch
  cached   the same store again: every layer cached, prepare is a lease + stat
  rootfs   --rootfs of task-a's flattened tree (umoci unpack), the no-image baseline
Then 16 threads start task-a at once on a fresh store (one unpack per layer
expected: the unpack log is counted), against 16 concurrent cached starts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import entry, pct, ratio, table  # noqa: E402


def sh(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench/images.py: {' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def build(tmp: str) -> str:
    lay = os.path.join(tmp, "layout")
    sh("umoci", "init", "--layout", lay)
    sh("umoci", "new", "--image", f"{lay}:task-a")
    base = os.path.join(tmp, "base")
    os.makedirs(f"{base}/bin")
    shutil.copy2("/bin/busybox", f"{base}/bin/busybox")
    for a in ("sh", "ls", "cat", "true"):
        os.symlink("busybox", f"{base}/bin/{a}")
    os.makedirs(f"{base}/etc")
    with open(f"{base}/etc/passwd", "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000::/workspace:/bin/sh\n")
    for d in ("tmp", "workspace", "proc", "sys", "dev"):
        os.makedirs(f"{base}/{d}")
    sh("umoci", "insert", "--image", f"{lay}:task-a", base, "/")
    rt = os.path.join(tmp, "runtime")
    os.makedirs(f"{rt}/usr/bin")
    shutil.copy2("/usr/bin/python3.11", f"{rt}/usr/bin/python3")
    os.makedirs(f"{rt}/lib/x86_64-linux-gnu")
    os.makedirs(f"{rt}/lib64")
    for lib in ("libm.so.6", "libz.so.1", "libexpat.so.1", "libc.so.6"):
        shutil.copy2(os.path.realpath(f"/lib/x86_64-linux-gnu/{lib}"), f"{rt}/lib/x86_64-linux-gnu/{lib}")
    shutil.copy2(os.path.realpath("/lib64/ld-linux-x86-64.so.2"), f"{rt}/lib64/ld-linux-x86-64.so.2")
    shutil.copytree("/usr/lib/python3.11", f"{rt}/usr/lib/python3.11", symlinks=True,
                    ignore=shutil.ignore_patterns("dist-packages", "__pycache__", "test", "idlelib", "tkinter"))
    sh("umoci", "insert", "--image", f"{lay}:task-a", f"{rt}/usr", "/usr")
    sh("umoci", "insert", "--image", f"{lay}:task-a", f"{rt}/lib", "/lib")
    sh("umoci", "insert", "--image", f"{lay}:task-a", f"{rt}/lib64", "/lib64")
    sh("umoci", "config", "--image", f"{lay}:task-a", "--config.env=PATH=/usr/bin:/bin")
    sh("umoci", "tag", "--image", f"{lay}:task-a", "task-b")
    for t in ("a", "b"):
        d = os.path.join(tmp, f"task-{t}")
        os.makedirs(f"{d}/task")
        with open(f"{d}/task/run.py", "w") as f:
            f.write(f"print('task {t}')\n")
        with open(f"{d}/task/data.bin", "wb") as f:
            f.write(os.urandom(4 << 20))
        sh("umoci", "insert", "--image", f"{lay}:task-{t}", f"{d}/task", "/task")
    sh("umoci", "gc", "--layout", lay)
    return lay


def start(spec_kw, store=None, img=None, sid=None):
    from agent.sandbox import images
    from agent.sandbox.launcher import SandboxSpec, launch
    spec = SandboxSpec(argv=["/usr/bin/python3", "-c", "pass"], sandbox_id=sid, **spec_kw)
    if img is not None:
        images.prepare_spec(store, spec, img, argv=spec.argv, env={})
    dn = os.open(os.devnull, os.O_RDWR)
    try:
        r = launch(spec, stdio={"child": [dn, dn, dn], "relay": {}, "close_after_fork": []})
    finally:
        os.close(dn)
    if r.exit_code != 0:
        raise SystemExit(f"bench/images.py: the sandbox failed: {r.summary.get('error') or r.exit_code}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    args = ap.parse_args()
    from agent.sandbox import images
    from agent.sandbox.launcher import new_sandbox_id
    tmp = tempfile.mkdtemp(prefix="dsec-bench-images-", dir="/var/tmp")
    try:
        lay = build(tmp)
        flat = os.path.join(tmp, "flat")
        sh("umoci", "unpack", "--image", f"{lay}:task-a", flat)
        rootfs = os.path.join(flat, "rootfs")
        cached = images.ImageStore(os.path.join(tmp, "cached"))
        img_c, _ = cached.import_image(f"{lay}:task-a")
        cached.prepare(img_c, "warmup")
        times = {"first": [], "cached": [], "rootfs": []}
        unpack_ms = []
        for i in range(args.runs):
            d = os.path.join(tmp, f"fresh-{i}")
            st = images.ImageStore(d)
            img, _ = st.import_image(f"{lay}:task-a")
            t = time.perf_counter()
            start({}, st, img, new_sandbox_id())
            times["first"].append(time.perf_counter() - t)
            unpack_ms.append(sum(x["unpack_ms"] for x in st.unpack_log()))
            shutil.rmtree(d)
            t = time.perf_counter()
            start({}, cached, img_c, new_sandbox_id())
            times["cached"].append(time.perf_counter() - t)
            t = time.perf_counter()
            start({"rootfs": rootfs}, sid=new_sandbox_id())
            times["rootfs"].append(time.perf_counter() - t)
        rows = []
        for k in ("first", "cached", "rootfs"):
            xs = [x * 1000 for x in times[k]]
            rows.append([k, f"{min(xs):.1f}", f"{statistics.median(xs):.1f}", f"{pct(xs, 90):.1f}",
                         ratio(statistics.median(xs), statistics.median(times["rootfs"]) * 1000)])
        print(f"start of `python3 -c pass` on task-a ({len(img_c.layers)} layers), {args.runs} runs each (ms):")
        print(table(["start", "min", "median", "p90", "vs rootfs"], rows))
        print(f"  unpack of all layers (inside 'first'): median {statistics.median(unpack_ms):.1f} ms; "
              f"first/cached {ratio(statistics.median(times['first']), statistics.median(times['cached']))}")

        # 16 concurrent first starts of one image
        def burst(st, img):
            errs = []

            def one():
                try:
                    start({}, st, img, new_sandbox_id())
                except BaseException as e:  # noqa: BLE001
                    errs.append(e)
            ts = [threading.Thread(target=one) for _ in range(16)]
            t = time.perf_counter()
            for x in ts:
                x.start()
            for x in ts:
                x.join()
            if errs:
                raise SystemExit(f"bench/images.py: a concurrent start failed: {errs[0]}")
            return time.perf_counter() - t
        d = os.path.join(tmp, "burst")
        st = images.ImageStore(d)
        img, _ = st.import_image(f"{lay}:task-a")
        cold = burst(st, img)
        unpacks = len(st.unpack_log())
        warm = burst(cached, img_c)
        print(f"16 concurrent starts: first {cold * 1000:.0f} ms (unpacks: {unpacks} for {len(img.layers)} layers, "
              f"{st.stats['coalesced']} waits coalesced), cached {warm * 1000:.0f} ms; first/cached {ratio(cold, warm)}")

        # disk: two images sharing base + runtime vs the sum of their tarballs
        sizes = {}
        for t in ("task-a", "task-b"):
            p = os.path.join(tmp, f"{t}.tar")
            sh("skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{lay}:{t}", f"docker-archive:{p}")
            sizes[t] = os.path.getsize(p)
        two = images.ImageStore(os.path.join(tmp, "two"))
        for t in ("task-a", "task-b"):
            two.import_image(os.path.join(tmp, f"{t}.tar"), name=f"{t}:1")
            two.prepare(two.resolve(f"{t}:1"), "disk")
        u = two.usage()
        tar_sum = sum(sizes.values())
        print(f"store for task-a + task-b: layers {u['layer_bytes'] >> 20} MiB + blobs {u['blob_bytes'] >> 20} MiB "
              f"= {(u['layer_bytes'] + u['blob_bytes']) >> 20} MiB vs their docker-archive tarballs "
              f"{tar_sum >> 20} MiB: unpacked layers {ratio(u['layer_bytes'], tar_sum)} of the tarballs, "
              f"whole store {ratio(u['layer_bytes'] + u['blob_bytes'], tar_sum)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    entry(main, "bench/images.py")
