"""host.scratch: memory (agent/sandbox/scratch.py): the sandboxes' writable layers on a tmpfs
the agent mounts on its state dir's sandboxes directory. Real agents, real sandboxes: a
sandbox's writes are its own memory (past its limit it is OOM-killed, the disk untouched), a
kept upper layer is copied out to disk (its whiteouts too), a clean stop unmounts the tmpfs, a
crashed agent's is cleaned and unmounted by the next agent on disk (and by `dsec gc` once
empty), and the tmpfs is never mounted over another process's live sandbox (the agent says
so: degraded, on disk)."""
from __future__ import annotations

import fcntl
import os
import shutil
import stat
import uuid

from agents import AgentProc
from conftest import dsec

from agent.sandbox.scratch import fs_type
from agent.sandbox.trash import is_own_fs


def _host(base: str) -> dict:
    return {"state_dir": os.path.join(base, "state"), "cgroup_parent": f"dsec-t-scratch-{uuid.uuid4().hex[:6]}",
            "egress_pool": "10.219.0.0/24", "scratch": "memory"}


def _agent(base: str, clickhouse_url: str, host: dict) -> AgentProc:
    os.makedirs(base, exist_ok=True)
    return AgentProc(base, clickhouse_url, {"host": host, "warm_pool": [],
                                            "capacity": {"cpus": 2, "memory": "4G", "reserve_memory": 0}}).start()


def _gc(host: dict):
    r = dsec("gc", env={"DSEC_STATE_DIR": host["state_dir"], "DSEC_CGROUP_PARENT": host["cgroup_parent"],
                           "DSEC_EGRESS_POOL": host["egress_pool"]})
    return r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


def test_writes_live_in_the_sandboxs_memory_and_a_stop_unmounts(tmp_path, clickhouse_url):
    host = _host(str(tmp_path))
    sdir = os.path.join(host["state_dir"], "sandboxes")
    a = _agent(str(tmp_path), clickhouse_url, host)
    try:
        assert is_own_fs(sdir) and fs_type(sdir) == "tmpfs"
        # no shared inode count: one sandbox's empty files cannot exhaust it for the others
        # (each sandbox's inodes are charged to its memory cgroup, as its pages)
        assert os.statvfs(sdir).f_files == 0
        with a.client() as c:
            caps = c.capabilities()
            assert caps["limits"]["scratch"] == "memory" and not [d for d in caps["degraded"] if "scratch" in d]
            sb = c.create(memory="64M", pids=64, warm=False, keep=True, user="root")
            r = sb.exec(["sh", "-c", "head -c 8000000 /dev/zero > /etc/f && rm /etc/os-release"])
            assert r.code == 0, r.stderr
            f = os.path.join(sdir, sb.id, "upper", "_root", "etc", "f")
            assert os.path.getsize(f) == 8_000_000 and os.stat(f).st_dev == os.stat(sdir).st_dev   # in the tmpfs
            # 100 MB more in a 64 MiB sandbox: its memory, not the node's disk -> killed by its own limit
            r = sb.exec(["sh", "-c", "head -c 100000000 /dev/zero > /etc/g"])
            assert r.code != 0
            summ = sb.close().summary
            assert summ["oom_killed"] is True
            kept = summ["kept_upper"]
            assert kept == os.path.join(host["state_dir"], "kept", sb.id)
            assert not is_own_fs(kept) and os.stat(kept).st_dev != os.stat(sdir).st_dev     # copied out to disk
            assert os.path.getsize(os.path.join(kept, "_root", "etc", "f")) == 8_000_000
            wh = os.stat(os.path.join(kept, "_root", "etc", "os-release"), follow_symlinks=False)
            assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0           # the overlay's whiteout, kept
            shutil.rmtree(kept)
    finally:
        rc = a.stop()
        unmounted = not is_own_fs(sdir)
        gc_out = _gc(host)                        # its parent cgroups removed, whatever happened
    assert rc == 0, a.read_log()[-3000:]
    assert unmounted, "a clean stop leaves the sandboxes' tmpfs mounted"
    assert "writable layers in memory" in a.read_log() and "unmounted" not in gc_out


def test_never_over_live_sandboxes_and_gc_unmounts_a_dead_agents(tmp_path, clickhouse_url):
    host = _host(str(tmp_path))
    sdir = os.path.join(host["state_dir"], "sandboxes")
    # another dsec process's live sandbox (its state dir's lock held): the tmpfs would hide it
    live = os.path.join(sdir, "sbx-livelivelive")
    os.makedirs(live)
    fd = os.open(os.path.join(live, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        a = _agent(os.path.join(str(tmp_path), "a1"), clickhouse_url, host)
        try:
            assert not is_own_fs(sdir)
            with a.client() as c:
                caps = c.capabilities()
                (why,) = [d for d in caps["degraded"] if "scratch" in d]
                assert caps["limits"]["scratch"] == "disk"
                assert "not in force" in why and "sbx-livelivelive" in why, why
                with c.create(warm=False) as sb:                  # on disk, as without the setting
                    assert sb.exec(["true"]).code == 0
        finally:
            assert a.stop() == 0, a.read_log()[-3000:]
    finally:
        os.close(fd)
        shutil.rmtree(live)
    # the next agent mounts it; killed with a sandbox live, it leaves the tmpfs and the orphan
    try:
        b = _agent(os.path.join(str(tmp_path), "a2"), clickhouse_url, host)
        try:
            assert fs_type(sdir) == "tmpfs"
            out = _gc(host)         # no sandbox in it: a running agent's tmpfs is never taken all the same
            assert "unmounted" not in out and is_own_fs(sdir), out
            with b.client() as c:
                sid = c.create(warm=False).id
        finally:
            b.kill9()
        assert is_own_fs(sdir) and os.path.isdir(os.path.join(sdir, sid))
        # an agent on disk after it: its clean-up removes the orphan, then it unmounts the tmpfs
        d = _agent(os.path.join(str(tmp_path), "a3"), clickhouse_url, dict(host, scratch="disk"))
        try:
            assert not is_own_fs(sdir)
            with d.client() as c:
                caps = c.capabilities()
                assert caps["limits"]["scratch"] == "disk" and not [x for x in caps["degraded"] if "scratch" in x]
        finally:
            assert d.stop() == 0, d.read_log()[-3000:]
        assert "orphan" in d.read_log() and sid in d.read_log()
        # a memory agent killed with nothing in its tmpfs: `dsec gc` unmounts it
        e = _agent(os.path.join(str(tmp_path), "a4"), clickhouse_url, host)
        e.kill9()
        assert is_own_fs(sdir)
        out = _gc(host)
        assert "unmounted the sandboxes' empty tmpfs" in out, out
        assert not is_own_fs(sdir)
    finally:
        _gc(host)                   # whatever happened: its cgroups, pins and tmpfs gone
