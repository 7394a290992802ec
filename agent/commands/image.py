"""Manage the node's OCI images: import, list, inspect, remove, gc, prewarm.

examples:
  dsec image import ./layout:app --name app:1      # an OCI layout dir (DIR or DIR:REF)
  dsec image import app.tar                        # docker save / podman save / skopeo docker-archive
  dsec image import app-oci.tar --name app:oci     # an OCI archive (skopeo oci-archive, podman --format oci-archive)
  dsec image ls
  dsec image inspect app:1                         # JSON: manifest digest, layers, config, cache state
  dsec image prewarm app:1 tool:2                  # unpack now, so the first sandbox starts fast
  dsec image rm app:1                              # the name; the layers go once nothing else uses them
  dsec image gc                                    # blobs/layers no image needs, stale leases, staging
  dsec run --image app:1 -- python3 /opt/app/main.py

Every blob is verified against its digest and every layer checked (paths,
links, device nodes, diff_id) at import; nothing is stored unless the whole
image is good. Layers are unpacked once per node, on first use or by
prewarm, and shared by every image that has them (docs/images.md). The
store is DSEC_IMAGE_STORE or /var/lib/dsec/images; DSEC_IMAGE_BUDGET (e.g.
20G) bounds its unpacked layers (least recently used ones no sandbox uses are
evicted).

exit status: 0 ok; 1 failure (store, budget); 2 bad input (a bad image, an
unknown name, bad usage).
"""
from __future__ import annotations

import json
import os
import sys
import time

HELP = "import, list, inspect, remove, prewarm OCI images (the node's layer store)"


def register(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    imp = sub.add_parser("import", help="import an OCI layout dir or an OCI/docker archive")
    imp.add_argument("path", metavar="PATH[:REF]")
    imp.add_argument("--name", metavar="NAME[:TAG]", help="name it (default: the archive's tag or DIR:REF)")
    ls = sub.add_parser("ls", help="list images")
    ls.add_argument("--format", choices=("table", "json"), default="table")
    ins = sub.add_parser("inspect", help="an image as JSON")
    ins.add_argument("image", metavar="NAME[:TAG]|DIGEST")
    rm = sub.add_parser("rm", help="remove an image name (or an image, by digest)")
    rm.add_argument("image", nargs="+", metavar="NAME[:TAG]|DIGEST")
    sub.add_parser("gc", help="remove what no image needs")
    pw = sub.add_parser("prewarm", help="unpack images' layers now")
    pw.add_argument("image", nargs="+", metavar="NAME[:TAG]|DIGEST")
    for s in (imp, ls, ins, rm, pw):
        s.usage_exit = 2


def store():
    from agent.sandbox import images
    budget = os.environ.get("DSEC_IMAGE_BUDGET")
    if budget:
        from agent.node.config import parse_size
        from agent.errors import UsageError
        try:
            budget = parse_size(budget)
        except ValueError as e:
            raise UsageError(f"DSEC_IMAGE_BUDGET {budget!r}: {e}")
    return images.open_store(budget=budget or None)


def _size(n) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def describe(st, img) -> dict:
    cached = st.cached(img)
    return {"names": img.names, "digest": img.digest, "config_digest": img.config_digest,
            "os": img.os, "architecture": img.architecture, "created": img.created, "source": img.source,
            "imported_ns": img.imported_ns, "config": img.config,
            "layers": [dict(L, unpacked=c) for L, c in zip(img.layers, cached)],
            "size": sum(L["size"] for L in img.layers), "cached_layers": sum(cached)}


def run(args) -> int:
    st = store()
    a = args.action
    if a == "import":
        t0 = time.monotonic()
        img, names = st.import_image(args.path, args.name)
        print(f"imported {names[0]} {img.digest} ({len(img.layers)} layers, "
              f"{_size(sum(L['size'] for L in img.layers))}) in {time.monotonic() - t0:.2f}s")
        return 0
    if a == "ls":
        rows = []
        for img in st.images():
            c = st.cached(img)
            for n in img.names or ["<none>"]:
                rows.append({"name": n, "digest": img.digest, "layers": len(img.layers), "cached": sum(c),
                             "size": sum(L["size"] for L in img.layers), "imported_ns": img.imported_ns})
        if args.format == "json":
            for r in rows:
                print(json.dumps(r))
            return 0
        u = st.usage()
        print(f"{'NAME':32} {'DIGEST':19} {'LAYERS':>6} {'CACHED':>6} {'SIZE':>8}")
        for r in rows:
            print(f"{r['name'][:32]:32} {r['digest'][:19]:19} {r['layers']:>6} {r['cached']:>6} {_size(r['size']):>8}")
        print(f"store {u['root']}: blobs {_size(u['blob_bytes'])}, unpacked layers {_size(u['layer_bytes'])} "
              f"({u['layers_cached']})" + (f", budget {_size(u['budget'])}" if u["budget"] else ""))
        return 0
    if a == "inspect":
        print(json.dumps(describe(st, st.resolve(args.image)), indent=2))
        return 0
    if a == "rm":
        for ref in args.image:
            r = st.remove(ref)
            what = ", ".join(r["names"]) or r["image"]
            tail = "; the image is gone" if r["image_removed"] else "; other names remain"
            print(f"removed {what} ({r['image'][:19]}){tail}; freed {_size(r['bytes_freed'])}")
        return 0
    if a == "gc":
        r = st.gc()
        print(f"removed {r['blobs_removed']} blobs and {r['layers_removed']} layers, freed {_size(r['bytes_freed'])}"
              f" ({r['leases_live']} sandboxes hold leases)")
        return 0
    if a == "prewarm":
        for ref in args.image:
            img = st.resolve(ref)
            t0 = time.monotonic()
            before = sum(st.cached(img))
            st.prepare(img, f"prewarm-{os.getpid()}")
            st.release(f"prewarm-{os.getpid()}")
            print(f"{img.asked} {img.digest[:19]}: {len(img.layers) - before} of {len(img.layers)} layers unpacked "
                  f"in {time.monotonic() - t0:.2f}s")
        return 0
    sys.stderr.write(f"dsec image: unknown action {a}\n")
    return 2
