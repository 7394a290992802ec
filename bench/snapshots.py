#!/usr/bin/env python3
"""Step snapshots: snapshot latency for writable layers of 1 KiB, 1 MiB and 100 MiB
of changes, fork of 8 children, disk bytes per snapshot; against a plain `cp -a`
of the same tree measured in the same run, and DeltaBox's published figures
(10.83 ms per checkpoint, 1.86 ms per rollback).

usage:
  .venv/bin/python bench/snapshots.py             # 20 snapshots per size
  .venv/bin/python bench/snapshots.py --runs 5

Each case: a sandbox on a busybox image (launcher.Sandbox in this process,
audit off) whose step writes the change set (1 file of 1 KiB; 16 files of
64 KiB; 100 files of 1 MiB) and leaves a process running; then, --runs times:
  snapshot   SnapshotStore.take(): freeze (cgroup2), cp -a of the writable layer,
             thaw, manifest (sha256 of every file: the content address), record
  frozen     the part of it during which the sandbox was frozen
  cp -a      `cp -a` of the same writable layer to a fresh dir (the baseline)
Fork of 8: 8 sandboxes started from one snapshot (each its own writable layer
over the snapshot's): the whole start of each (namespaces, cgroups, overlay,
PID 1), sequential and 8 threads at once, against 8 plain starts on the image.
  rollback   snapshots.restore() of the live sandbox to its last snapshot (its processes
             ended, a fresh writable layer over the snapshot, pivot_root of PID 1)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, entry, pct, ratio, table  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))

CASES = (("1 KiB", 1, 1 << 10), ("1 MiB", 16, 64 << 10), ("100 MiB", 100, 1 << 20))
DELTABOX_SNAPSHOT_MS, DELTABOX_ROLLBACK_MS = 10.83, 1.86


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    import images as T
    from agent.sandbox import images
    from agent.sandbox.launcher import Sandbox, SandboxSpec, new_sandbox_id
    from agent.sandbox.snapshots import SnapshotStore, restore
    tmp = tempfile.mkdtemp(prefix="dsec-bench-snap-", dir="/var/tmp")
    sandboxes = []
    try:
        lay = T.build_layout(tmp)
        ist = images.ImageStore(os.path.join(tmp, "images"))
        img, _ = ist.import_image(f"{lay}:base")
        sst = SnapshotStore(os.path.join(tmp, "snaps"))

        def sandbox():
            sid = new_sandbox_id()
            spec = SandboxSpec(argv=[], sandbox_id=sid, user="root", workdir="/workspace")
            images.prepare_spec(ist, spec, img, user="root", workdir="/workspace", env={})
            sb = Sandbox(spec).start()
            sandboxes.append(sb)
            return sb

        rows, rb = [], []
        snap_for_fork = None
        for label, n, size in CASES:
            sb = sandbox()
            r = sb.exec(["/bin/sh", "-c", f"for i in $(seq {n}); do dd if=/dev/urandom of=/workspace/f$i "
                                          f"bs={size} count=1 2>/dev/null; done; sleep 600 >/dev/null 2>&1 &"])
            assert r.code == 0, r.error
            upper = os.path.join(sb.dir, "upper", "_root")
            snap_ms, frozen_ms, cp_ms, disk = [], [], [], 0
            for i in range(args.runs):
                sb.exec(["/bin/sh", "-c", f"echo {i} > /workspace/step"])     # a new state each time
                t = time.perf_counter()
                s = sst.take(sb, {"step": i})
                snap_ms.append((time.perf_counter() - t) * 1000)
                frozen_ms.append(s["frozen_ms"])
                d = os.path.join(tmp, f"cp-{i}")
                t = time.perf_counter()
                subprocess.run(["cp", "-a", upper, d], check=True)
                cp_ms.append((time.perf_counter() - t) * 1000)
                shutil.rmtree(d)
                disk = sum(os.lstat(os.path.join(dp, f)).st_blocks * 512
                           for dp, _, fn in os.walk(sst.layer_root(s["id"])) for f in fn)
                if label == "1 MiB":
                    snap_for_fork = s
            back_ms = []
            for i in range(args.runs):          # rollback of the live sandbox to the last snapshot
                t = time.perf_counter()
                restore(sst, sb, s, ist)
                back_ms.append((time.perf_counter() - t) * 1000)
            rb.append([label, f"{sorted(back_ms)[len(back_ms) // 2]:.2f}", f"{pct(back_ms, 99):.2f}",
                       ratio(sorted(back_ms)[len(back_ms) // 2], DELTABOX_ROLLBACK_MS)])
            med = sorted(snap_ms)[len(snap_ms) // 2]
            rows.append([label, f"{med:.2f}", f"{pct(snap_ms, 99):.2f}", f"{sorted(frozen_ms)[len(frozen_ms) // 2]:.2f}",
                         f"{sorted(cp_ms)[len(cp_ms) // 2]:.2f}", ratio(med, sorted(cp_ms)[len(cp_ms) // 2]),
                         ratio(med, DELTABOX_SNAPSHOT_MS), f"{disk >> 10} KiB"])
            sb.close()
            sandboxes.remove(sb)
        print(f"snapshot of a live sandbox, {args.runs} runs per size (ms):")
        print(table(["changes", "median", "p99", "frozen", "cp -a", "vs cp -a", "vs DeltaBox 10.83",
                     "disk/snapshot"], rows))
        print(f"rollback of the live sandbox to its last snapshot (processes ended, new writable layer, "
              f"pivot_root), {args.runs} runs (ms):")
        print(table(["changes", "median", "p99", "vs DeltaBox 1.86"], rb))

        # fork of 8 from the 1 MiB snapshot
        def start_from(snap):
            sid = new_sandbox_id()
            spec = SandboxSpec(argv=[], sandbox_id=sid, user="root", workdir="/workspace")
            own = len(snap["chain"]) + 1
            base = ist.prepare(img, sid)
            spec.layers = sst.lowers(snap)[:own] + base
            spec.image = img.record()
            return Sandbox(spec).start()

        def plain():
            sid = new_sandbox_id()
            spec = SandboxSpec(argv=[], sandbox_id=sid, user="root")
            spec.layers = ist.prepare(img, sid)
            return Sandbox(spec).start()

        def timed_starts(fn, parallel):
            got = []
            t = time.perf_counter()
            if parallel:
                ts = [threading.Thread(target=lambda: got.append(fn())) for _ in range(8)]
                for x in ts:
                    x.start()
                for x in ts:
                    x.join()
            else:
                for _ in range(8):
                    got.append(fn())
            ms = (time.perf_counter() - t) * 1000
            for sb in got:
                sb.close()
            return ms
        seq_f = timed_starts(lambda: start_from(snap_for_fork), False)
        par_f = timed_starts(lambda: start_from(snap_for_fork), True)
        seq_p = timed_starts(plain, False)
        par_p = timed_starts(plain, True)
        print(f"fork of 8 from a 1 MiB snapshot (whole sandbox starts): sequential {seq_f:.0f} ms, 8 threads "
              f"{par_f:.0f} ms; 8 plain starts on the image: {seq_p:.0f} / {par_p:.0f} ms "
              f"(fork/plain {ratio(par_f, par_p)}); the snapshot's layer is shared, 0 bytes copied per child")
    finally:
        for sb in sandboxes:
            sb.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    entry(main, "bench/snapshots.py")
