"""Step snapshots and forks (issue 17, first part): a real agent, real sandboxes on a
real image; the snapshot is taken frozen, holds the writable layer (files, a
deletion as a whiteout, metadata, the order of changes) and the step context;
forks start from it, each with its own writable layer; lineage is recorded; an
export imports as an image that runs elsewhere."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

import images as T
from images import layout, store_dir  # noqa: F401 - fixtures
from conftest import dsec
from test_agent import AgentProc
from agent.sandbox import images
from agent.sandbox.snapshots import SnapshotStore
from agent.node.client import AgentError


def test_snapshot_fork_lineage_and_export(layout, store_dir, clickhouse_url, tmp_path):
    st = images.ImageStore(store_dir)
    st.import_image(f"{layout}:app")
    snaps = str(tmp_path / "snaps")
    os.makedirs(tmp_path / "agent")
    agent = AgentProc(str(tmp_path / "agent"), clickhouse_url,
                      {"images": {"store": store_dir}, "capacity": {"cpus": 8, "memory": "8G"}})
    agent.env["DSEC_SNAPSHOT_STORE"] = snaps
    agent.start()
    e = {"DSEC_SNAPSHOT_STORE": snaps, "DSEC_IMAGE_STORE": store_dir, "DSEC_AGENT_SOCKET": agent.socket,
         "DSEC_CLICKHOUSE_URL": clickhouse_url}
    try:
        with agent.client(timeout=120) as c:
            caps = c.capabilities()["snapshots"]
            assert caps["store"] == snaps and caps["filesystem"] is True
            assert caps["processes"]["available"] is False and caps["processes"]["detail"]   # said, not silent
            sb = c.create(image="layout:app", env={"TASK": "t1"}, user="root")
            r = sb.exec(["/bin/sh", "-c", "echo one > /opt/app/a.txt; sleep 0.01; echo two > /opt/app/b.txt; "
                                          "rm /etc/group; mkdir -p /opt/app/d; chmod 700 /opt/app/d; "
                                          "sleep 30 & echo started"])
            assert r.stdout == b"started\n", r.stderr
            # a step still running (the background sleep): it is frozen for the copy, then goes on
            r = dsec("snapshot", "create", sb.id, env=e)
            assert r.returncode == 0, r.stderr
            sid = r.stdout.decode().split()[1]
            snap = c.snapshot(sb.id)             # the same state again: the same content-addressed id
            assert snap["id"] == sid and snap["step"] == 1
            assert snap["context"]["env"]["TASK"] == "t1" and snap["context"]["workdir"] == "/opt/app"
            ch = {x["path"]: x for x in snap["changes"]}
            assert ch["/etc/group"]["kind"] == "whiteout"
            assert ch["/opt/app/a.txt"]["kind"] == "file" and ch["/opt/app/a.txt"]["uid"] == 0
            assert ch["/opt/app/d"]["mode"] == 0o700
            order = [x["path"] for x in snap["changes"]]
            assert order.index("/opt/app/a.txt") < order.index("/opt/app/b.txt")   # the order they were made in
            # the parent goes on and changes more; forks see the snapshot's state, each its own
            sb.exec(["/bin/sh", "-c", "echo later > /opt/app/c.txt; echo changed > /opt/app/a.txt"])
            kids = c.fork(sid, 3, labels={"job": "fork-test"})
            outs = []
            for i, k in enumerate(kids):
                r = k.exec(["/bin/sh", "-c", f"cat a.txt b.txt; test -e c.txt || echo no-c; "
                                             f"test -e /etc/group || echo no-group; echo $TASK; id -u; "
                                             f"echo {i} > mine.txt; ls"])
                outs.append(r.stdout.decode().split())
            for i, o in enumerate(outs):
                assert o[:6] == ["one", "two", "no-c", "no-group", "t1", "0"], o
                assert "mine.txt" in o
            r = kids[0].exec(["/bin/cat", "/opt/app/mine.txt"])
            assert r.stdout == b"0\n"                 # its own writable layer, not a sibling's
            # a snapshot of a fork chains to its parent's
            s2 = c.snapshot(kids[1].id)
            assert s2["chain"] == [sid]
            # rollback of the live parent: same id, cgroup and PID 1; later files gone, the background
            # process of step 1 ended; twice gives the same state
            info = c.get(sb.id)
            for _ in range(2):
                r = c.restore(sb.id, sid)
                assert r["step"] == 1 and r["snapshot"] == sid
                out = sb.exec(["/bin/sh", "-c", "cat /opt/app/a.txt; test -e c.txt || echo no-c; "
                                                "test -e /etc/group || echo no-group; ps -o pid= 2>/dev/null | wc -l; "
                                                "echo again > /opt/app/c.txt"]).stdout.decode().split()
                assert out[:3] == ["one", "no-c", "no-group"], out
            assert c.get(sb.id).cgroup_id == info.cgroup_id
            r = dsec("snapshot", "restore", sb.id, "abcdef123456", env=e)
            assert r.returncode == 2 and "no such snapshot" in r.stderr.decode()
            # a running step: refused unless forced, then ended
            import threading
            t = threading.Thread(target=lambda: sb.exec(["/bin/sleep", "20"]))
            t.start()
            import time as _t
            _t.sleep(0.5)
            with pytest.raises(AgentError, match="is running; restore ends it only when forced"):
                c.restore(sb.id, sid)
            c.restore(sb.id, sid, force=True)
            t.join(10)
            assert not t.is_alive()
            for k in kids:
                k.close()
            sb.close()
            with pytest.raises(AgentError, match="no such snapshot"):
                c.create(from_snapshot="ab" * 8)
            plain = c.create()                        # the default root: several overlays, refused clearly
            with pytest.raises(AgentError, match="snapshots need a sandbox on an image or a --rootfs"):
                c.snapshot(plain.id)
            plain.close()
            # a fork's default user runs as a uid of its own and may change what its parent's user made
            p = c.create(image="layout:app", user="sandbox")     # the leased default user, not the image's
            r = p.exec(["/bin/sh", "-c", "mkdir -p /workspace/proj/sub && echo one > /workspace/proj/f.txt; id -u"])
            puid = r.stdout.strip()
            assert int(puid) >= 1879048192, (r.stdout, r.stderr)
            psnap = c.snapshot(p.id)
            p.close()
            (k,) = c.fork(psnap["id"], 1)
            r = k.exec(["/bin/sh", "-c", "echo two >> /workspace/proj/f.txt && touch /workspace/proj/sub/new && "
                                         "cat /workspace/proj/f.txt; id -u"])
            assert r.exit_code == 0, r.stderr
            out = r.stdout.split()
            assert out[:2] == [b"one", b"two"] and out[2] != puid, (out, puid)
            k.close()
        # replay --rerun --from-step 2: from the snapshot taken after step 1, only steps 2.. re-run
        with agent.client(timeout=120) as c:
            t = c.create(image="layout:app", user="root")
            t.exec(["/bin/sh", "-c", "echo base > /opt/app/state"])
            c.snapshot(t.id)
            t.exec(["/bin/sh", "-c", "cat /opt/app/state; echo more >> /opt/app/state"])
            t.close()
        import time as _t
        _t.sleep(2)                              # the agent exports continuously
        r = dsec("replay", t.id, "--rerun", "--from-step", "2", "--format", "json", env=e, timeout=180)
        d = json.loads(r.stdout)
        assert r.returncode == 0 and not d["changed"], (r.stdout, r.stderr)
        assert [x["step"] for x in d["steps"]] == [2]
        assert any("started from snapshot" in n for n in d["notes"])
        evs = [json.loads(x) for x in dsec("events", "--sandbox", d["rerun"], "--kind", "sandbox_start", "--format",
                                           "json", env=e).stdout.splitlines()]
        assert json.loads(evs[0]["extra"])["lineage"]["parent_sandbox"] == t.id
        # lineage in every child's sandbox_start
        for k in kids:
            evs = [json.loads(x) for x in dsec("events", "--sandbox", k.id, "--kind", "sandbox_start", "--format",
                                               "json", env=e).stdout.splitlines()]
            lin = json.loads(evs[0]["extra"])["lineage"]
            assert lin == {"parent_sandbox": sb.id, "snapshot": sid, "step": 1}
        # exported as an OCI image, imported into another store, run there
        out = str(tmp_path / "exported")
        r = dsec("snapshot", "export", sid, "-o", out, env=e)
        assert r.returncode == 0, r.stderr
        other = str(tmp_path / "other-store")
        e2 = {"DSEC_IMAGE_STORE": other, "DSEC_AGENT": "off"}
        r = dsec("image", "import", f"{out}:snapshot", "--name", "restored:1", env=e2)
        assert r.returncode == 0, r.stderr
        r = dsec("run", "--audit", "off", "--image", "restored:1", "--entrypoint", "", "--", "/bin/sh", "-c",
                 "cat /opt/app/a.txt; test -e /etc/group || echo no-group; stat -c %a /opt/app/d", env=e2)
        assert r.stdout.decode().split() == ["one", "no-group", "700"], r.stderr
        r = dsec("snapshot", "inspect", "ffff00001111", env=e)
        assert r.returncode == 2 and "no such snapshot" in r.stderr.decode()
        subprocess.run(["rm", "-rf", other])
    finally:
        assert agent.stop() == 0, agent.read_log()[-2000:]


def test_auto_snapshots_retention_budget_and_leases(layout, store_dir, clickhouse_url, tmp_path):
    """Automatic snapshots by policy (every 2 steps, keep 2, a 1 MiB disk budget); a snapshot
    a fork or a restored sandbox stands on is neither removed by retention nor by `dsec
    snapshot rm` (naming the sandbox), and is released when that sandbox ends."""
    from test_agent import _events
    st = images.ImageStore(store_dir)
    st.import_image(f"{layout}:app")
    snaps = str(tmp_path / "snaps")
    os.makedirs(tmp_path / "agent")
    agent = AgentProc(str(tmp_path / "agent"), clickhouse_url,
                      {"images": {"store": store_dir}, "capacity": {"cpus": 8, "memory": "8G"},
                       "snapshots": {"every_steps": 2, "retention": 2, "disk_budget": "1M"}})
    agent.env["DSEC_SNAPSHOT_STORE"] = snaps
    agent.start()
    e = {"DSEC_SNAPSHOT_STORE": snaps, "DSEC_IMAGE_STORE": store_dir, "DSEC_CLICKHOUSE_URL": clickhouse_url}
    store = SnapshotStore(snaps)

    def autos(sid):
        return {s["step"]: s["id"] for s in store.list() if s["sandbox_id"] == sid and s["auto"]}
    try:
        with agent.client(timeout=120) as c:
            caps = c.capabilities()["snapshots"]
            assert caps["auto"] == {"every_steps": 2, "retention": 2} and caps["disk_budget"] == 1 << 20
            sb = c.create(image="layout:app", user="root")
            for i in range(1, 7):
                r = sb.exec(["/bin/sh", "-c", f"echo {i} > /opt/app/s{i}"])
                assert r.exit_code == 0, r.stderr
            # taken after steps 2, 4, 6 (the state each step left); retention 2 removed step 2's
            got = autos(sb.id)
            assert sorted(got) == [4, 6], got
            man = {x["path"] for x in store.get(got[4])["changes"]}
            assert "/opt/app/s4" in man and "/opt/app/s5" not in man
            # a fork of step 4's snapshot leases it: retention keeps it, rm refuses naming the fork
            (kid,) = c.fork(got[4], 1)
            assert kid.exec(["/bin/cat", "/opt/app/s4"]).stdout == b"4\n"
            for i in (7, 8):
                sb.exec(["/bin/sh", "-c", f"echo {i} > /opt/app/s{i}"])
            assert sorted(autos(sb.id)) == [4, 6, 8]
            r = dsec("snapshot", "rm", got[4], env=e)
            assert r.returncode == 2 and f"in use by sandbox {kid.id} (a fork" in r.stderr.decode(), r.stderr
            kid.close()                               # released when the fork ends
            r = dsec("snapshot", "rm", got[4], env=e)
            assert r.returncode == 0, r.stderr
            # a restored sandbox leases its snapshot until it ends
            c.restore(sb.id, got[6])
            r = dsec("snapshot", "rm", got[6], env=e)
            assert r.returncode == 2 and f"in use by sandbox {sb.id} (restored" in r.stderr.decode(), r.stderr
            # past the disk budget: refused before anything is copied, the step's result stands
            r = sb.exec(["/bin/sh", "-c", "head -c 2097152 /dev/zero > /opt/app/big"])      # step 9
            assert r.exit_code == 0
            r = sb.exec(["/bin/true"])                                                       # step 10: auto
            assert r.exit_code == 0
            with pytest.raises(AgentError, match="disk budget is 1048576 bytes"):
                c.snapshot(sb.id)
            assert 10 not in autos(sb.id)
            assert not [d for d in os.listdir(os.path.join(snaps, "layers")) if d.startswith(".tmp")]
            # a request's own policy: every step, keep 1; and refused on the default root
            s2 = c.create(image="layout:app", user="root", auto_snapshot={"every_steps": 1, "retention": 1})
            for i in (1, 2):
                s2.exec(["/bin/sh", "-c", f"echo {i} > /opt/app/x"])
            assert list(autos(s2.id)) == [2]
            s2.close()
            with pytest.raises(AgentError, match="auto_snapshot: snapshots need a sandbox on an image"):
                c.create(auto_snapshot={"every_steps": 1})
            sb.close()
        assert os.listdir(os.path.join(snaps, "leases")) == []
        r = dsec("snapshot", "rm", got[6], env=e)
        assert r.returncode == 0, r.stderr
        # both refusals (step 10's automatic one, then the explicit one) are durable before their calls
        # return; their export to ClickHouse may land in two batches: wait for both, not the first
        evs = _events(clickhouse_url, sb.id, ["lifecycle"],
                      want=lambda evs: sum(json.loads(x["extra"])["state"] == "snapshot_failed" for x in evs) >= 2)
        lc = [json.loads(x["extra"]) for x in evs]
        assert [x["step"] for x in evs if json.loads(x["extra"])["state"] == "snapshotted"] == [2, 4, 6, 8]
        removed = [x for x in lc if x["state"] == "snapshot_removed"]
        assert [x["snapshot_step"] for x in removed] == [2] and removed[0]["reason"] == "retention 2"
        failed = [x for x in lc if x["state"] == "snapshot_failed"]
        assert len(failed) == 2 and "disk budget" in failed[0]["reason"]
        assert [x for x in lc if x["state"] == "snapshotting" and x.get("auto")]
    finally:
        assert agent.stop() == 0, agent.read_log()[-2000:]


def test_snapshot_config_names_file_line_and_field(tmp_path):
    from agent.node.config import ConfigError, load_config
    p = tmp_path / "a.yaml"
    p.write_text("snapshots:\n  every_steps: 5\n  retention: 3\n  disk_budget: 20G\n")
    c = load_config(str(p), environ={}).snapshots
    assert (c.every_steps, c.retention, c.disk_budget) == (5, 3, 20 << 30)
    p.write_text("snapshots:\n  every_steps: 2\n  disk_budget: lots\n")
    with pytest.raises(ConfigError, match=r"a\.yaml:3: snapshots\.disk_budget: expected a size"):
        load_config(str(p), environ={})
    with pytest.raises(ConfigError, match="snapshots.retention"):
        load_config(None, environ={"DSEC_AGENT__SNAPSHOTS__RETENTION": "-1"})


def test_snapshot_id_is_the_state_not_the_copy_order(tmp_path):
    """Two copies of one layer have one id even when the copy's ctimes tie differently
    (CI saw two ids for one state: the id hashed the manifest in the copy's ctime order),
    and the manifest's order is the source's order of change, not the copy's."""
    from agent.sandbox import snapshots as S
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for name in ("z.txt", "a.txt", "d/m.txt"):          # made in this order, not in name order
        (src / name).write_text(name)
        os.utime(src / name, ns=(1, 1))
        time.sleep(0.02)                                  # past a clock tick: distinct ctimes
    order = S.ctimes(str(src))
    ids, orders = set(), []
    for i in range(2):
        dst = tmp_path / f"copy{i}"
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
        man = S.manifest(str(dst), order)
        orders.append([e["path"] for e in man if e["kind"] == "file"])
        ids.add(S.snapshot_id(man, [], ["base"]))
        ids.add(S.snapshot_id(list(reversed(man)), [], ["base"]))   # whatever order ties fall in
    assert len(ids) == 1
    assert orders[0] == orders[1] == ["/z.txt", "/a.txt", "/d/m.txt"]
    # a change of content is a change of id
    (tmp_path / "copy0" / "a.txt").write_text("other")
    assert S.snapshot_id(S.manifest(str(tmp_path / "copy0"), order), [], ["base"]) not in ids


def test_a_layer_deeper_than_path_max_is_refused_in_one_line(tmp_path):
    """A workload's directory chain past PATH_MAX (2,100 levels under a --rootfs sandbox):
    the snapshot's copy (cp -a, or reading the copy back by path) fails below some depth.
    On main the refusal kept the first 300 characters of cp's message, all of them the
    long path, and lost the reason (an OSError came out of take() where cp got through);
    now one line names the sandbox and the reason, nothing is half-made in the store, and
    the sandbox runs on."""
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    from agent.sandbox.snapshots import SnapshotError
    rf = tmp_path / "rootfs"
    for d in ("bin", "etc"):
        (rf / d).mkdir(parents=True)
    shutil.copy2("/bin/busybox", rf / "bin" / "busybox")
    for applet in ("sh", "mkdir", "true"):
        os.symlink("busybox", rf / "bin" / applet)
    (rf / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    store = SnapshotStore(str(tmp_path / "snaps"))
    sb = Sandbox(SandboxSpec(argv=[], rootfs=str(rf), workdir="/", user="root")).start()
    try:
        r = sb.exec(["/bin/sh", "-c", "mkdir /w && cd /w && i=0; while [ $i -lt 2100 ]; do "
                                      "mkdir d && cd -P d || exit 1; i=$((i+1)); done"], timeout=120)
        assert r.exit_code == 0, r.error
        with pytest.raises(SnapshotError) as ei:
            store.take(sb, retries=1)
        msg = str(ei.value)
        assert msg.startswith(f"sandbox {sb.sid}: snapshot") and "name too long" in msg.lower(), msg
        assert "\n" not in msg and len(msg) < 600, msg
        assert store.list() == []
        assert not [n for n in os.listdir(tmp_path / "snaps" / "layers") if n.startswith(".tmp-")]
        assert sb.exec(["/bin/true"]).exit_code == 0                 # thawed
    finally:
        sb.close()


def test_sparse_files_are_snapshotted_and_forked_by_their_data(tmp_path):
    """A workload's sparse files (4 x `truncate -s 1T`: no disk used; one 2 MiB file with 3 bytes at
    1 MiB). On main the snapshot read and hashed every byte of them (4 TiB of zeros: hours of the
    agent's time for one snapshot), and a fork's copy of its parent's files for its own user wrote
    the zeros out (4 TiB of disk). Now a file with holes is identified by the sha256 of its data
    extents (`extents_sha256`, `data_bytes`; `sha256` stays the plain hash of a file without
    holes), the snapshot's bytes are its data, and both copies keep the holes."""
    import hashlib
    from agent.sandbox.launcher import Sandbox, SandboxSpec
    from agent.sandbox import snapexport, snapshots as S
    rf = tmp_path / "rootfs"
    for d in ("bin", "etc", "w"):
        (rf / d).mkdir(parents=True)
    os.chmod(rf / "w", 0o1777)
    shutil.copy2("/bin/busybox", rf / "bin" / "busybox")
    for applet in ("sh", "truncate", "dd", "true", "cat"):
        os.symlink("busybox", rf / "bin" / applet)
    (rf / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    store = SnapshotStore(str(tmp_path / "snaps"))
    sb = Sandbox(SandboxSpec(argv=[], rootfs=str(rf), workdir="/", user="sandbox")).start()
    fb = None
    try:
        r = sb.exec(["/bin/sh", "-c", "for i in 1 2 3 4; do truncate -s 1099511627776 /w/s$i || exit 1; done; "
                                      "truncate -s 2M /w/d && printf abc | dd of=/w/d bs=1 seek=1048576 "
                                      "conv=notrunc 2>/dev/null && echo dense > /w/plain"], timeout=60)
        assert r.exit_code == 0, r.error
        ctx = {"step": 1, "uid": sb.uid, "gid": sb.gid, "user": "sandbox"}
        snap = store.take(sb, ctx, retries=1)
        ch = {e["path"]: e for e in snap["changes"]}
        s1 = ch["/w/s1"]
        assert s1["size"] == 1 << 40 and s1["sha256"] is None and s1["data_bytes"] == 0, s1
        assert s1["extents_sha256"] == ch["/w/s4"]["extents_sha256"]          # one state, one identity
        d = ch["/w/d"]
        assert d["sha256"] is None and 3 <= d["data_bytes"] <= 1 << 16, d
        assert d["extents_sha256"] != s1["extents_sha256"]
        assert ch["/w/plain"]["sha256"] == hashlib.sha256(b"dense\n").hexdigest()
        assert "extents_sha256" not in ch["/w/plain"]
        assert snap["bytes"] < 1 << 20, snap["bytes"]                         # data, not apparent sizes
        layer = store.layer_root(snap["id"])
        assert os.stat(os.path.join(layer, "w", "s1")).st_blocks == 0          # cp -a kept the holes
        assert store.take(sb, ctx, retries=1)["id"] == snap["id"]               # content-addressed
        with pytest.raises(S.SnapshotError) as ei:      # an OCI layer would hold the holes as zeros
            snapexport._refuse_holes(snap)
        assert "export refused" in str(ei.value) and "'/w/s" in str(ei.value) and "\n" not in str(ei.value)
        # the bytes inside the hole change: the identity changes
        assert sb.exec(["/bin/sh", "-c", "printf x | dd of=/w/s2 bs=1 seek=4096 conv=notrunc 2>/dev/null"]
                       ).exit_code == 0
        snap2 = store.take(sb, dict(ctx, step=2), retries=1)
        assert snap2["id"] != snap["id"]
        ch2 = {e["path"]: e for e in snap2["changes"]}
        assert ch2["/w/s2"]["extents_sha256"] != s1["extents_sha256"] and ch2["/w/s2"]["data_bytes"] > 0
        # a fork runs its user as another uid: the parent's files are copied for it, holes kept
        spec = SandboxSpec(argv=[], workdir="/", user="sandbox")
        S.fork_spec(spec, snap2, store)
        fb = Sandbox(spec).start()
        assert fb.uid != sb.uid
        upper = fb.layers[0][1]
        st = os.stat(os.path.join(upper, "w", "s1"))
        assert st.st_size == 1 << 40 and st.st_blocks == 0 and st.st_uid == fb.uid
        st = os.stat(os.path.join(upper, "w", "s2"))
        assert st.st_size == 1 << 40 and 0 < st.st_blocks * 512 <= 1 << 16
        out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            r = fb.exec(["/bin/sh", "-c", "dd if=/w/d bs=1 skip=1048576 count=3 2>/dev/null; "
                                          "dd if=/w/s2 bs=1 skip=4096 count=1 2>/dev/null; cat /w/plain"],
                        stdout=out)
        finally:
            os.close(out)
        got = (tmp_path / "out").read_bytes()
        assert r.exit_code == 0 and got == b"abcxdense\n", (got, r.error)
    finally:
        if fb is not None:
            fb.close()
        sb.close()
