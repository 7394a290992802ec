"""Images in the record and in the node agent (issue 16): sandbox_start names the
image (name, manifest and layer digests), every row carries image_digest
(migration 3, LowCardinality on 18.16 and on a current engine through chdb),
`dsec search image` and replay show it; the agent prewarms images, keeps warm
pools per image, coalesces concurrent first starts, mounts allowed volumes."""
from __future__ import annotations

import json
import os
import tarfile
import threading
import uuid

import pytest

import images as T
from images import layout, store_dir  # noqa: F401 - fixtures
from conftest import dsec
from fixtures_clickhouse import SESSION_DB, chdb_events_without, connect
from test_agent import AgentProc
from agent.sandbox import images
from audit_schema import migrations


def test_the_record_names_the_image_and_search_and_replay_find_it(layout, store_dir, clickhouse_url, tmp_path, sid):
    e = {"DSEC_IMAGE_STORE": store_dir, "DSEC_AGENT": "off", "DSEC_CLICKHOUSE_URL": clickhouse_url,
         "DSEC_SPOOL_DIR": str(tmp_path / "spool"), "DSEC_VOLUME_ROOTS": str(tmp_path)}
    assert dsec("image", "import", f"{layout}:app", "--name", f"rec-{sid}:1", env=e).returncode == 0
    st = images.ImageStore(store_dir)
    img = st.resolve(f"rec-{sid}:1")
    (tmp_path / "vol").mkdir()
    r = dsec("run", "--sandbox-id", sid, "--image", f"rec-{sid}:1", "--volume", f"{tmp_path}/vol:/data", "--",
             "-c", "cat /opt/app/hello.py >/dev/null; ls /data; echo hi > /tmp/x", env=e)
    assert r.returncode == 0, r.stderr
    evs = [json.loads(x) for x in dsec("events", "--sandbox", sid, "--format", "json", env=e).stdout.splitlines()]
    assert {"sandbox_start", "exec", "step_start", "sandbox_exit"} <= {x["kind"] for x in evs}
    assert {x["image_digest"] for x in evs} == {img.digest}                    # every row
    start = next(x for x in evs if x["kind"] == "sandbox_start")
    info = json.loads(start["extra"])
    assert info["image"]["name"] == f"rec-{sid}:1" and info["image"]["digest"] == img.digest
    assert info["image"]["layers"] == [x["digest"] for x in img.layers]
    assert info["image"]["diff_ids"] == [x["diff_id"] for x in img.layers]
    assert info["volumes"] == [{"host": f"{tmp_path}/vol", "sandbox": "/data", "mode": "ro"}]
    assert info["user"] == "1001:1001" and info["workdir"] == "/opt/app"
    execs = [x for x in evs if x["kind"] == "exec"]
    assert execs and all(x["image_digest"] == img.digest for x in execs)
    # which sandboxes ran this image: by name (through the store), by digest
    for key in (f"rec-{sid}:1", img.digest):
        r = dsec("search", "image", "--image", key, "--format", "json", env=e)
        assert r.returncode == 0, r.stderr
        assert [json.loads(x)["sandbox_id"] for x in r.stdout.splitlines()] == [sid]
    r = dsec("search", "image", "--image", "sha256:" + "1" * 64, env=e)
    assert r.returncode == 1
    r = dsec("replay", sid, env=e)
    assert r.returncode == 0 and f"image rec-{sid}:1 ({img.digest}, 4 layers)" in r.stdout.decode(), r.stdout
    assert f"volume {tmp_path}/vol:/data:ro" in r.stdout.decode()
    # re-run of the recorded steps on the recorded image (by digest)
    r = dsec("replay", sid, "--rerun", env=e)
    assert r.returncode == 0, r.stderr


def test_migration_3_adds_the_image_column_on_18_16_and_a_current_engine(clickhouse_url, tmp_path):
    client, _ = connect(clickhouse_url)
    db = f"{SESSION_DB}_i{uuid.uuid4().hex[:6]}"
    try:
        feat = migrations.detect_features(client)
        migrations.migrate(client, db)
        # back to a version-2 database: the column gone, the version record at 2
        client.execute(f"ALTER TABLE {db}.events DROP COLUMN image_digest")
        client.execute(f"DROP TABLE {db}.schema_migrations")
        client.execute(migrations.version_table_sql(db))
        client.execute(f"INSERT INTO {db}.schema_migrations (version, name) VALUES", [(1, "v1"), (2, "v2")])
        assert migrations.current_version(client, db) == 2
        r = migrations.migrate(client, db)
        assert r.before == 2 and r.applied == list(range(3, migrations.LATEST + 1)) and r.added_columns == []
        assert migrations.table_columns(client, db)["image_digest"] == "LowCardinality(String)"
        assert feat.lc_setting                     # the 18.16 server of the suite needs the setting
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
        client.disconnect()
    import chdb.session as chdb_session
    s = chdb_session.Session(str(tmp_path / "chdb"))
    try:
        modern = chdb_events_without(s, ("image_digest",))
        assert not modern.lc_setting
        step = migrations.MIGRATIONS[2][2]("m", modern)[0]
        s.query(step.sql(modern))
        t = s.query("SELECT type FROM system.columns WHERE database = 'm' AND table = 'events' AND name = 'image_digest'",
                    "CSV").bytes().decode().strip()
        assert t == '"LowCardinality(String)"'
    finally:
        s.close()


def test_agent_images_prewarm_warm_pools_coalescing_and_volumes(layout, store_dir, clickhouse_url, tmp_path):
    st = images.ImageStore(store_dir)
    for ref in ("app", "tool"):
        st.import_image(f"{layout}:{ref}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "w.bin").write_bytes(b"weights\n")
    cfg = {"images": {"store": store_dir, "prewarm": ["layout:tool"]},
           "volumes": {"allowed_roots": [str(tmp_path / "data")]},
           "warm_pool": [{"name": "app", "image": "layout:app", "count": 2, "memory": "256M"}],
           "capacity": {"cpus": 8, "memory": "8G"}}
    os.makedirs(tmp_path / "agent")
    agent = AgentProc(str(tmp_path / "agent"), clickhouse_url, cfg).start()
    try:
        with agent.client(timeout=120) as c:
            deadline = __import__("time").monotonic() + 60
            while __import__("time").monotonic() < deadline:
                caps = c.capabilities()
                imgs = {n: i for i in caps["images"]["images"] for n in i["names"]}
                if imgs["layout:tool"]["cached"] and caps["warm_profiles"][0]["ready"] == 2:
                    break
                __import__("time").sleep(0.2)
            assert imgs["layout:tool"]["cached"] and imgs["layout:app"]["cached"]
            assert imgs["layout:app"]["warm_ready"] == 2
            # a matching request takes a warm sandbox of the image
            sb = c.create(image="layout:app", memory="256M")
            assert sb.created.warm and sb.created.image_digest == st.resolve("layout:app").digest
            r = sb.exec(["/bin/sh", "-c", "id -u; pwd; echo $IMAGE_LEVEL"])
            assert r.stdout.decode().split() == ["1001", "/opt/app", "app"]
            sb.close()
            # a volume from the allowed root (read-only), one from elsewhere refused
            sb = c.create(image="layout:tool", volumes=[f"{tmp_path}/data:/data"], warm=False)
            r = sb.exec(["/bin/sh", "-c", "cat /data/w.bin; echo x > /data/y || echo ro"])
            assert r.stdout.decode().split() == ["weights", "ro"]
            sb.close()
            from agent.node.client import InvalidArgument
            with pytest.raises(InvalidArgument, match="not inside an allowed root"):
                c.create(image="layout:tool", volumes=["/etc:/etc2"])
            with pytest.raises(InvalidArgument, match="not in this node's image store"):
                c.create(image="nope:1")
        # 8 concurrent first starts of a freshly imported image: one unpack per layer
        fresh = T.raw_layer_image(tmp_path, [T.member("bin", tarfile.DIRTYPE, mode=0o755),
                                             T.member("bin/sh", mode=0o755, data=open("/bin/busybox", "rb").read())],
                                  name="fresh")
        img, _ = st.import_image(fresh, name="fresh:1")
        before = len(st.unpack_log())
        results, errors = [], []

        def one():
            try:
                with agent.client(timeout=120) as c2:
                    s2 = c2.create(image="fresh:1", cpus=0.1, memory="64M", warm=False)
                    results.append(s2.exec(["/bin/sh", "-c", "echo ok"]).stdout)
                    s2.close()
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors and results == [b"ok\n"] * 8, errors
        assert len(st.unpack_log()) - before == len(img.layers) == 1
    finally:
        assert agent.stop() == 0, agent.read_log()[-2000:]
