"""Remove what crashed or killed dsec runs left behind.

examples:
  dsec gc              # remove orphaned sandboxes' cgroups, veths, state dirs
  dsec gc --dry-run    # only list them

A sandbox is orphaned when no dsec process holds its state directory's lock
(the launcher holds it for the sandbox's whole life). Live sandboxes are never
touched. Everything dsec creates is recognisable: cgroups under "dsec/" in
each hierarchy, host links named dsv*/dsp*, state under /var/lib/dsec, the
nftables table "ip dsec" and the empty "dsec" parent cgroups (removed when no
sandbox is left), and the sandboxes' tmpfs of an agent with host.scratch: memory
that died (unmounted once empty; a running agent's is never touched).

Prints one line per removed item; exit 0 when everything is clean, 1 when
something could not be removed.
"""
from __future__ import annotations

HELP = "remove what crashed dsec runs left behind"


def register(p):
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")


def run(args) -> int:
    from agent.sandbox import gc
    from agent.sensors.enforce import gc_stale_pins
    rep = gc.remove(dry_run=args.dry_run)
    for item in rep["sandboxes"]:
        pid = item["supervisor_pid"]
        print(f"sandbox {item['sandbox_id']}: orphaned" + (f" (supervisor pid {pid})" if pid else ""))
        for p in item["cgroups_removed"]:
            print(f"  removed cgroup {p}")
        for p in item["cgroups_left"]:
            print(f"  could not remove cgroup {p}")
        if item["state_removed"]:
            print(f"  removed state {item['state_removed']}")
    for item in rep["links"]:
        print(f"link {item['link']}: orphaned")
        if item["error"]:
            print(f"  could not remove link {item['link']}: {item['error']}")
    pins = [] if args.dry_run else gc_stale_pins()
    for d in pins:
        print(f"removed stale BPF pin {d}")
    if not rep["sandboxes"] and not rep["links"]:
        n = len(rep["live"])
        print(f"clean ({n} live sandbox{'es' if n != 1 else ''})")
    for parent in rep["parents"]:
        print(f"removed empty cgroup parent {parent}")
    for path in rep.get("trash", ()):
        print(f"removed closed sandbox state {path}")
    if rep.get("scratch_unmounted"):
        print(f"unmounted the sandboxes' empty tmpfs {rep['scratch_unmounted']} (host.scratch: memory)")
    return 1 if rep["failed"] else 0
