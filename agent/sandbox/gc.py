"""Garbage collection of what crashed or killed sandboxes left on the host: the
one gc, used by `dsec gc` and by the node agent when it starts.

    found = collect()                       # live and orphaned sandboxes, stray links
    report = remove(found)                  # remove the orphans; report what was done
    report = remove(found, dry_run=True)    # only say what would be removed

A sandbox is orphaned when no dsec process holds its state directory's lock
(the launcher holds it for the sandbox's whole life). Live sandboxes are never
touched. Everything dsec creates is recognisable: cgroups under "dsec/" in
each hierarchy, host links named dsv*/dsp*, state under the state directory,
the nftables table "ip dsec" and the empty "dsec" parent cgroups (removed when
no sandbox is left, with final=True). With several agents on one host each
gc sees its own: its state directory (DSEC_STATE_DIR), cgroup parent
(DSEC_CGROUP_PARENT), links of its egress pool and NAT table (DSEC_EGRESS_POOL).

Starting sandboxes: gc holds <state dir>/gc.lock exclusively from its first
listing to its last removal; a launcher holds it shared from before its state
directory exists until its cgroups exist and its state lock is held
(start_guard()). So a sandbox is either wholly visible to gc as live, or not
there yet; gc never takes a starting sandbox's cgroups (or, with no sandbox
live, the NAT table under it) for an orphan's. Each orphan is also checked
once more, under the lock, just before it is removed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time


from agent.sandbox import trees
from agent.sandbox.gclock import gc_lock as _gc_lock
from agent.sandbox.scratch import sandbox_entries


def _live_now() -> set:
    from agent.sandbox import launcher
    if not os.path.isdir(launcher.SANDBOX_DIR):
        return set()
    return {sid for sid in sandbox_entries(launcher.SANDBOX_DIR)
            if _is_live(os.path.join(launcher.SANDBOX_DIR, sid))}


def _is_live(state_dir: str) -> bool:
    try:
        fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # being created right now, or a torn dir: treat a fresh dir as live
        try:
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
    from agent.sandbox import cgroups, launcher, netns
    state = {}
    if os.path.isdir(launcher.SANDBOX_DIR):
        for sid in sandbox_entries(launcher.SANDBOX_DIR):
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
        "links": [n for n in netns.list_host_links(own_pool_only=True) if n not in live_links],
    }


def _state_of(state_dir: str) -> dict:
    try:
        with open(os.path.join(state_dir, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def remove(found: dict | None = None, *, dry_run: bool = False, final: bool = True) -> dict:
    """See _remove; collects (when found is None) and removes under gc.lock."""
    with _gc_lock(fcntl.LOCK_EX):
        return _remove(found, dry_run=dry_run, final=final)


def _remove(found: dict | None = None, *, dry_run: bool = False, final: bool = True) -> dict:
    """Remove the orphans of `found` (collect() when None). final=True (`dsec gc`)
    also removes the NAT table and the empty parent cgroups when no sandbox is
    left. Returns {"sandboxes": [{sandbox_id, owner_pid, supervisor_pid,
    cgroups_removed, cgroups_left, state_removed}], "links": [{link, error}],
    "parents": [...], "trash": [closed sandboxes' state dirs left queued for removal
    (agent/sandbox/trash.py), removed], "live": [...], "failed": n}."""
    from agent.sandbox import cgroups, launcher, netns
    found = found or collect()
    live_now = _live_now()            # under the lock: what started since `found` was collected
    out = {"sandboxes": [], "links": [], "parents": [], "trash": [], "live": sorted(set(found["live"]) | live_now),
           "failed": 0}
    for sid in found["orphans"]:
        sd = os.path.join(launcher.SANDBOX_DIR, sid)
        st = _state_of(sd)
        item = {"sandbox_id": sid, "owner_pid": st.get("owner_pid"), "supervisor_pid": st.get("supervisor_pid"),
                "cgroups_removed": [], "cgroups_left": [], "state_removed": None}
        if sid in live_now:
            continue                  # started since it was listed: not an orphan
        out["sandboxes"].append(item)
        if dry_run:
            continue
        cg = cgroups.SandboxCgroup(found["layout"], sid)
        left = cg.remove()
        item["cgroups_left"] = list(left)
        item["cgroups_removed"] = [p for p in cg.paths if p not in left and p in found["cgroups"].get(sid, [])]
        out["failed"] += len(left)
        netns.teardown(sid)
        if os.path.isdir(sd) and not left:
            trees.remove(sd)
            item["state_removed"] = sd
    if not dry_run:
        from agent.sandbox import trash
        out["trash"] = trash.sweep(launcher.SANDBOX_DIR)     # closed sandboxes' dirs a crash left queued
    for link in found["links"]:
        item = {"link": link, "error": None}
        out["links"].append(item)
        if dry_run:
            continue
        from pyroute2 import IPRoute
        try:
            with IPRoute() as ipr:
                idx = ipr.link_lookup(ifname=link)
                if idx:
                    ipr.link("del", index=idx[0])
        except Exception as e:  # noqa: BLE001 - reported, counted
            item["error"] = str(e)
            out["failed"] += 1
    if final and not out["live"] and not dry_run:
        netns.remove_nat()
        out["parents"] = cgroups.remove_empty_parents(found["layout"])
    if final and not dry_run:
        # the sandboxes' tmpfs a crashed agent left (host.scratch: memory), once empty
        from agent.sandbox.scratch import release_locked
        out["scratch_unmounted"] = release_locked(launcher.SANDBOX_DIR)[0] and launcher.SANDBOX_DIR
    return out
