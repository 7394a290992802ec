"""The node agent's side of images (docs/images.md "The agent"): the store opened
from the config, images.prewarm, CreateSandbox's image and volumes checked, a
request's warm-pool key, layers unpacked before a request queues, and the
report Capabilities carries.

    ni = NodeImages(agent); agent.images = ni.open()
    img, vols = ni.check_request(req, rootfs)     # ApiError(INVALID_ARGUMENT) naming what is wrong
    ni.prepare(spec, img, user=..., workdir=..., env=...)   # unpack (coalesced) + apply the config
"""
from __future__ import annotations

import logging
import time

from audit_schema.errors import ReportedError
from agent.node.records import _bad

log = logging.getLogger("dsec.agent")


class NodeImages:
    def __init__(self, agent):
        self.agent = agent

    def open(self):
        from agent.sandbox import images
        c = self.agent.cfg.images
        return images.open_store(c.store, c.budget)

    def prewarm(self, refs: list[str]):
        """images.prewarm: unpack these images' layers at start (executor thread);
        a failure is a degraded feature, logged and recorded."""
        a = self.agent
        lid = f"prewarm-{a.instance}"
        for ref in refs:
            t0 = time.monotonic()
            try:
                img = a.images.resolve(ref)
                before = sum(a.images.cached(img))
                a.images.prepare(img, lid)
                a._lifecycle("", "image_prewarmed", image=ref, image_digest=img.digest, layers=len(img.layers),
                             unpacked=len(img.layers) - before, ms=round((time.monotonic() - t0) * 1000, 3))
            except ReportedError as e:
                log.error("images.prewarm %s: %s", ref, e.message)
                a.degraded.append(f"image prewarm {ref}: {e.message}")
                a._lifecycle("", "image_prewarm_failed", image=ref, reason=e.message)
            finally:
                a.images.release(lid)

    def prepare(self, spec, img=None, **args):
        """A sandbox on an image: its layers unpacked (once, coalesced) and leased, its
        config applied (a warm profile's spec carries img and args itself)."""
        from agent.sandbox import images
        if img is None:
            img, args = spec.image_ref, spec.image_args
        images.prepare_spec(self.agent.images, spec, img, **args)

    def check_request(self, req: dict, rootfs):
        """CreateSandbox's image (resolved in the node's store) and volumes (checked
        against volumes.allowed_roots)."""
        from agent.sandbox import volumes
        img = None
        ref = req.get("image") or ""
        if ref:
            if rootfs:
                raise _bad("image and rootfs: give one of them")
            try:
                img = self.agent.images.resolve(ref)
            except ReportedError as e:
                raise _bad(e.message) from None
        items = req.get("volumes") or []
        roots = self.agent.cfg.volumes.allowed_roots
        try:
            if len(items) > volumes.MAX_VOLUMES:
                raise volumes.VolumeError(f"volumes: at most {volumes.MAX_VOLUMES}, got {len(items)}")
            vols = volumes.parse([volumes.check(h, s, not rw, roots) for h, s, rw in items], roots)
        except ReportedError as e:
            raise _bad(e.message) from None
        return img, vols

    def report(self, warm: list) -> dict:
        """For Capabilities: what a placer needs to prefer this node (which images are
        cached here, how many warm sandboxes of each are ready)."""
        a = self.agent
        if a.images is None:
            return {}
        try:
            out = []
            for img in a.images.images():
                c = a.images.cached(img)
                ready = sum(w["ready"] for w, p in zip(warm, a.warm.profiles.values())
                            if p.image is not None and p.image.digest == img.digest)
                out.append({"names": img.names, "digest": img.digest, "layers": len(img.layers),
                            "cached_layers": sum(c), "cached": all(c), "warm_ready": ready})
            return dict(a.images.usage(), images=out, stats=dict(a.images.stats))
        except ReportedError as e:
            return {"error": e.message}
