"""Remove what crashed or killed dsec runs left behind.

examples:
  dsec gc              # remove orphaned sandboxes' cgroups, veths, state dirs
  dsec gc --dry-run    # only list them

A sandbox is orphaned when no dsec process holds its state directory's lock
(the launcher holds it for the sandbox's whole life). Live sandboxes are never
touched. Everything dsec creates is recognisable: cgroups under "dsec/" in
each hierarchy, host links named dsv*/dsp*, state under /var/lib/dsec, the
nftables table "ip dsec" and the empty "dsec" parent cgroups (removed when no
sandbox is left).

Prints one line per removed item; exit 0 when everything is clean, 1 when
something could not be removed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil

HELP = "remove what crashed dsec runs left behind"


def register(p):
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")


def _is_live(state_dir: str) -> bool:
    try:
        fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # being created right now, or a torn dir: treat a fresh dir as live
        try:
            import time
            return time.time() - os.stat(state_dir).st_mtime < 10
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def collect() -> dict:
    """What exists on this host, split into live and orphaned sandboxes."""
    from agent.sandbox import cgroups
    from agent.sandbox import launcher
    from agent.sandbox import netns
    state = {}
    if os.path.isdir(launcher.SANDBOX_DIR):
        for sid in os.listdir(launcher.SANDBOX_DIR):
            state[sid] = _is_live(os.path.join(launcher.SANDBOX_DIR, sid))
    layout = cgroups.detect()
    cgs = cgroups.list_sandbox_cgroups(layout)
    live = {sid for sid, alive in state.items() if alive}
    live_links = set()
    for sid in live:
        live_links.update(netns.ifnames(sid))
    return {
        "layout": layout,
        "live": sorted(live),
        "orphans": sorted(set(state) - live | (set(cgs) - live)),
        "cgroups": cgs,
        "links": [n for n in netns.list_host_links() if n not in live_links],
    }


def run(args) -> int:
    from agent.sandbox import cgroups
    from agent.sandbox import launcher
    from agent.sandbox import netns
    found = collect()
    failed = 0
    for sid in found["orphans"]:
        sd = os.path.join(launcher.SANDBOX_DIR, sid)
        try:
            with open(os.path.join(sd, "state.json")) as f:
                pid = json.load(f).get("supervisor_pid")
        except (OSError, ValueError):
            pid = None
        print(f"sandbox {sid}: orphaned" + (f" (supervisor pid {pid})" if pid else ""))
        if args.dry_run:
            continue
        cg = cgroups.SandboxCgroup(found["layout"], sid)
        left = cg.remove()
        for p in cg.paths:
            if p not in left and p in found["cgroups"].get(sid, []):
                print(f"  removed cgroup {p}")
        for p in left:
            print(f"  could not remove cgroup {p}")
            failed += 1
        netns.teardown(sid)
        if os.path.isdir(sd) and not left:
            shutil.rmtree(sd, ignore_errors=True)
            print(f"  removed state {sd}")
    for link in found["links"]:
        print(f"link {link}: orphaned")
        if not args.dry_run:
            from pyroute2 import IPRoute
            with IPRoute() as ipr:
                idx = ipr.link_lookup(ifname=link)
                if idx:
                    try:
                        ipr.link("del", index=idx[0])
                    except Exception as e:  # noqa: BLE001
                        print(f"  could not remove link {link}: {e}")
                        failed += 1
    if not found["live"] and not args.dry_run:
        netns.remove_nat()
    parents = [] if found["live"] or args.dry_run else cgroups.remove_empty_parents(found["layout"])
    if not found["orphans"] and not found["links"]:
        print(f"clean ({len(found['live'])} live sandbox{'es' if len(found['live']) != 1 else ''})")
    for parent in parents:
        print(f"removed empty cgroup parent {parent}")
    return 1 if failed else 0
