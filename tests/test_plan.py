"""The CONFIG message dsec-init gets: plan.config_message encodes the operations
every sandbox of a layout shares once and splices them between the sandbox's own
(agent/sandbox/plan.py). Whatever it caches, the message must be the one the plan's
items encode to, byte for byte, for every sandbox: a cache keyed on too little would
hand one sandbox another's layout (a writable path, a volume, noexec), silently."""
from __future__ import annotations

import os

from agent.sandbox import initproto as ip
from agent.sandbox import plan
from policies.compile import MountLayout

LAYOUTS = [
    MountLayout(None, False, False, []),
    MountLayout(["/workspace", "/data"], False, False, []),
    MountLayout(["/workspace", "/data"], False, True, []),      # differs only in noexec
    MountLayout(["/workspace", "/var/tmp", "/root", "/home"], True, True, ["/workspace/bin", "/tmp"]),
]


def _plan(sid, lay, volumes, tmp_size=64 << 20):
    return plan.Plan(root=f"/state/{sid}/root", upper=f"/state/{sid}/upper", work=f"/state/{sid}/work",
                     lowers=["/layers/a", "/layers/b"], host_dirs=["usr", "etc"], hostname=sid,
                     uid=1000 + len(sid), gid=1000, tmp_size=tmp_size, layout=lay, volumes=volumes,
                     seccomp=b"\x06\0\0\0\0\0\xff\x7f", sysctls=[("/proc/sys/vm/memfd_noexec", "2", True)],
                     hold=bool(len(sid) % 2))


def test_config_message_is_the_plan_encoded(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    volume_sets = [[], [{"source": str(tmp_path), "target": "/in", "readonly": True}],
                   [{"source": str(f), "target": "/in", "readonly": False}]]      # a file: mkfile, not mkdir
    plan._INNER_CACHE.clear()
    seen = set()
    for lay in LAYOUTS:
        for vols in volume_sets:
            for tmp_size in (64 << 20, 1 << 30):
                for sid in ("sbx-one", "sbx-second"):        # the second sandbox takes the first's entry
                    p = _plan(sid, lay, vols, tmp_size)
                    msg = plan.config_message(p)
                    assert msg == ip.encode(ip.MSG.CONFIG, plan.config_items(p)), (lay, vols, tmp_size, sid)
                    seen.add(msg)
    assert len(seen) == len(LAYOUTS) * len(volume_sets) * 2 * 2       # every sandbox's message its own
    assert len(plan._INNER_CACHE) == len(LAYOUTS) * len(volume_sets) * 2
    # a volume's source that becomes a file is another entry (its mount target is a file, not a dir)
    os.unlink(f)
    os.mkdir(f)
    p = _plan("sbx-third", LAYOUTS[0], volume_sets[2])
    assert plan.config_message(p) == ip.encode(ip.MSG.CONFIG, plan.config_items(p))
