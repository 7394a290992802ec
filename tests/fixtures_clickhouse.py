"""ClickHouse fixtures: the project's own private server, real, on loopback.

    clickhouse_server    (session)  the reusable private server (exporters.clickhouse_server.PrivateServer),
                                    started by the project's code if it is not running; left running
    clickhouse_url       (session)  clickhouse://... URL of a database unique to this test session on
                                    that server; the database is dropped at the end of the session
    clickhouse_client    (session)  (clickhouse_driver.Client, database name) for clickhouse_url
    scratch_clickhouse   (function) a throwaway private server (own home in tmp, free ports) for tests
                                    that stop and restart ClickHouse; stopped and removed afterwards
    free_ports(n)        helper: n free TCP ports on 127.0.0.1
    chdb_events_without(session, cols)  helper: in a chdb (current engine) session, m.events with
                         every FIELDS column but `cols` (a database from before their migration);
                         returns the engine's Features

Importing these names into a test module or conftest.py registers them. The
session database name is computed once per process, so importing them in
several places still yields one database.
"""
from __future__ import annotations

import os
import shutil
import socket
import uuid

import pytest

from exporters.clickhouse_server import PrivateServer, connect

__all__ = ["clickhouse_server", "clickhouse_url", "clickhouse_client", "scratch_clickhouse", "free_ports",
           "SESSION_DB", "chdb_events_without"]

SESSION_DB = f"dsec_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@pytest.fixture(scope="session")
def clickhouse_server():
    server = PrivateServer()
    server.start()
    return server


@pytest.fixture(scope="session")
def clickhouse_url(clickhouse_server):
    url = clickhouse_server.url_for(SESSION_DB)
    yield url
    client, db = connect(url)
    try:
        client.execute(f"DROP DATABASE IF EXISTS {db}")
    finally:
        client.disconnect()


@pytest.fixture(scope="session")
def clickhouse_client(clickhouse_url):
    client, db = connect(clickhouse_url)
    yield client, db
    client.disconnect()


@pytest.fixture
def scratch_clickhouse(tmp_path_factory):
    home = tmp_path_factory.mktemp("clickhouse")
    tcp, http = free_ports(2)
    server = PrivateServer(str(home), tcp, http)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(home, ignore_errors=True)


def chdb_events_without(session, cols=()):
    """m.events in a chdb session (ClickHouse's current dialect) with the FIELDS columns
    but `cols`, as a database migrated before they existed; the engine's Features."""
    from audit_schema import migrations
    from audit_schema.events import FIELDS
    version = session.query("SELECT version()", "CSV").bytes().decode().strip().strip('"')
    settings = dict(line.replace('"', "").split(",", 1) for line in session.query(
        "SELECT name, value FROM system.settings WHERE name LIKE '%low_cardinality%'", "CSV").bytes().decode().split())
    modern = migrations.features_for(version, settings)
    session.query("CREATE DATABASE IF NOT EXISTS m")
    defs = ", ".join(f"{f.name} {migrations.column_type(f, modern)}" for f in FIELDS if f.name not in cols)
    session.query(f"CREATE TABLE m.events ({defs}) ENGINE = ReplacingMergeTree ORDER BY (kind, sandbox_id, ts_ns, event_id)")
    return modern
