"""Manage dsec's private ClickHouse server, the default audit store.

examples:
  dsec clickhouse start     # start it, or reuse the running one; print where it is
  dsec clickhouse status    # is it running, where it listens, where its data lives
  dsec clickhouse stop      # stop it cleanly (SIGTERM; SIGKILL after 30 s)

The private server is Debian's clickhouse-server with a config of dsec's own:
it listens on 127.0.0.1 only, native port DSEC_CLICKHOUSE_PORT (default
19000) and HTTP port DSEC_CLICKHOUSE_HTTP_PORT (default 18123), so it never
collides with a system ClickHouse on 9000/8123; its data, logs, config and
pid file live under DSEC_CLICKHOUSE_DIR (default /var/lib/dsec/clickhouse).
Every dsec command that needs ClickHouse starts it when it is not running.
When DSEC_CLICKHOUSE_URL is set (clickhouse://user:pass@host:port/db), dsec
uses that server instead and never starts this one.

  clickhouse-client --port 19000 -q 'SELECT kind, count() FROM dsec.events FINAL GROUP BY kind'

exit status: 0 ok (status: running); 1 failure (status: not running); 2 bad usage.
"""
from __future__ import annotations

from exporters.clickhouse_server import USER, PrivateServer, connect, external_url, parse_url
from agent.errors import ReportedError

HELP = "start, stop or show dsec's private ClickHouse server"


def register(p):
    p.add_argument("action", choices=("start", "stop", "status"), help="what to do")


def _schema_line(url: str) -> str:
    from audit_schema.migrations import LATEST, current_version
    try:
        client, db = connect(url, connect_timeout=2.0, send_receive_timeout=10.0)
        try:
            version = client.execute("SELECT version()")[0][0]
            v = current_version(client, db)
        finally:
            client.disconnect()
    except ReportedError as e:
        return f"not answering queries: {e.message}"
    except Exception as e:
        lines = str(e).strip().splitlines()
        return f"not answering queries: {lines[0] if lines else type(e).__name__}"
    if not v:
        return f"ClickHouse {version}; database {db} not created yet (the first export creates it)"
    note = "" if v == LATEST else f" (this dsec knows {LATEST})"
    return f"ClickHouse {version}; database {db}, schema version {v}{note}"


def _print_status(server: PrivateServer, st, verb: str):
    if st.running:
        print(f"dsec ClickHouse {verb} (pid {st.pid})")
    else:
        print("dsec ClickHouse is not running" + (f": {st.detail}" if st.detail else ""))
    print(f"  native  127.0.0.1:{st.tcp_port}   {parse_url(st.url).url}")
    print(f"  user    {USER}, password in {server.password_file} (0600)")
    print(f"  http    127.0.0.1:{st.http_port}   http://127.0.0.1:{st.http_port}/")
    print(f"  data    {st.data_dir}")
    print(f"  logs    {st.log_dir}")
    print(f"  config  {st.config}")
    if st.running:
        print(f"  server  {_schema_line(st.url)}")


def run(args) -> int:
    ext = external_url()
    if ext:
        print(f"note: DSEC_CLICKHOUSE_URL is set: dsec exports to {parse_url(ext).url}, "
              "not to the private server below")
    server = PrivateServer()
    if args.action == "start":
        before = server.status()
        st = server.start()
        _print_status(server, st, "already running" if before.running else "started")
        return 0
    if args.action == "stop":
        pid = server.stop()
        print(f"dsec ClickHouse stopped (pid {pid}); data kept in {server.data_dir}" if pid
              else f"dsec ClickHouse was not running (home {server.home})")
        return 0
    st = server.status()
    _print_status(server, st, "is running")
    return 0 if st.running else 1
