"""Where the audit trail goes: DSEC_CLICKHOUSE_URL, or dsec's private ClickHouse.

    url = ensure_clickhouse()        # "clickhouse://dsec:<password>@127.0.0.1:19000/dsec"
    client, db = connect(url)        # clickhouse_driver.Client, database name

When DSEC_CLICKHOUSE_URL (clickhouse://user:pass@host:port/db[?secure=1]) is
set, dsec uses that server and never starts one. Otherwise it starts, or
reuses, a private clickhouse-server (Debian's /usr/sbin/clickhouse-server, or
any `clickhouse-server` / `clickhouse server` on PATH, or DSEC_CLICKHOUSE_SERVER):

  home     DSEC_CLICKHOUSE_DIR, default /var/lib/dsec/clickhouse (0700)
           config.xml, users.xml (generated at every start), server.pid, lock,
           password (generated once, 0600: the password of user `dsec`)
  data     <home>/data        logs  <home>/log
  listens  127.0.0.1 only: native DSEC_CLICKHOUSE_PORT (default 19000) and
           HTTP DSEC_CLICKHOUSE_HTTP_PORT (default 18123), away from a system
           ClickHouse's 9000/8123; no interserver port.

The server runs in its own session and outlives the dsec process that started
it; `dsec clickhouse stop` stops it. Starting takes a lock (several `dsec run`
at once start one server); when it is already up, ensure_clickhouse() costs a
pid check and one TCP connect. 18.16 runs as root in this container without
changes (it only needs its own writable paths, which the config provides).

Credentials: the server has one user, `dsec`, whose password is generated at
the first start (secrets.token_urlsafe, 32 bytes) into <home>/password (mode
0600, root's) and kept in users.xml only as its SHA-256
(<password_sha256_hex>, known to 18.16 and to current releases). There is no
`default` user: users.xml is the server's whole user list (config.xml names
it as users_config; with no users.d beside it nothing is merged in), so a user
missing from it does not exist, on 18.16 as on current releases; a local
process without the password file gets "Unknown user default" / "Wrong
password" instead of the audit rows. Every dsec command reaches the server
through PrivateServer.url (ensure_clickhouse), which carries the credentials;
what dsec prints masks the password. A server started by an older dsec (with
a password-less `default`) gets the new users.xml at the next `dsec` start:
ClickHouse reloads users.xml by itself within seconds.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

from exporters.errors import ExportError, USAGE as EXIT_USAGE

DEFAULT_TCP_PORT = 19000
DEFAULT_HTTP_PORT = 18123
DEFAULT_DATABASE = "dsec"
START_TIMEOUT = 60.0
USER = "dsec"                     # the private server's only user


# --- URLs -------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    host: str
    port: int
    user: str
    password: str
    database: str
    secure: bool = False

    @property
    def url(self) -> str:
        cred = self.user + (":***" if self.password else "")
        return f"clickhouse://{cred}@{self.host}:{self.port}/{self.database}"


def parse_url(url: str, what: str = "DSEC_CLICKHOUSE_URL") -> Target:
    def bad(why):
        return ExportError(f"{what}={url!r}: {why} (expected clickhouse://user:pass@host:port/db)", EXIT_USAGE)
    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError as e:
        raise bad(str(e))
    if u.scheme not in ("clickhouse", "clickhouses"):
        raise bad(f"scheme {u.scheme!r} is not clickhouse")
    if not u.hostname:
        raise bad("no host")
    db = unquote(u.path.lstrip("/")) or DEFAULT_DATABASE
    if "/" in db:
        raise bad("the path must be just a database name")
    q = parse_qs(u.query)
    secure = u.scheme == "clickhouses" or q.get("secure", ["0"])[0].lower() in ("1", "true", "yes")
    return Target(host=u.hostname, port=port or (9440 if secure else 9000), user=unquote(u.username or "default"),
                  password=unquote(u.password or ""), database=db, secure=secure)


def connect(url: str, *, connect_timeout: float = 3.0, send_receive_timeout: float = 60.0):
    """A clickhouse_driver Client for url, and the database name to qualify
    tables with. dsec qualifies every table with the database, so the session
    keeps the user's default database (the URL's may not exist before the
    migrations). The client connects lazily, at its first query."""
    from clickhouse_driver import Client
    from audit_schema.migrations import quote_ident
    # the driver logs every failed connect with a traceback; dsec reports
    # connection failures itself, as one line
    logging.getLogger("clickhouse_driver").setLevel(logging.ERROR)
    t = parse_url(url)
    quote_ident(t.database)
    client = Client(host=t.host, port=t.port, user=t.user, password=t.password, secure=t.secure,
                    database="", connect_timeout=connect_timeout, send_receive_timeout=send_receive_timeout,
                    sync_request_timeout=min(5.0, send_receive_timeout), client_name="dsec")
    return client, t.database


# --- the private server --------------------------------------------------------------

def _env_port(name: str, default: int) -> int:
    v = os.environ.get(name)
    if not v:
        return default
    if not v.isdigit() or not 0 < int(v) < 65536:
        raise ExportError(f"{name}={v!r}: not a TCP port (1-65535)", EXIT_USAGE)
    return int(v)


def find_server_binary() -> list[str]:
    env = os.environ.get("DSEC_CLICKHOUSE_SERVER")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise ExportError(f"DSEC_CLICKHOUSE_SERVER={env!r}: not an executable file", EXIT_USAGE)
        return [env]
    path = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/usr/local/bin"
    b = shutil.which("clickhouse-server", path=path)
    if b:
        return [b]
    b = shutil.which("clickhouse", path=path)
    if b:
        return [b, "server"]
    raise ExportError("no clickhouse-server found (Debian: apt-get install clickhouse-server; "
                    "or set DSEC_CLICKHOUSE_URL to use an existing ClickHouse)")


def _config_xml(home: str, tcp: int, http: int) -> str:
    data, logs = os.path.join(home, "data"), os.path.join(home, "log")
    return f"""<?xml version="1.0"?>
<!-- generated by dsec (exporters/clickhouse_server.py) at every start: edits are overwritten -->
<yandex>
  <logger>
    <level>warning</level>
    <log>{logs}/clickhouse-server.log</log>
    <errorlog>{logs}/clickhouse-server.err.log</errorlog>
    <size>100M</size>
    <count>3</count>
  </logger>
  <listen_host>127.0.0.1</listen_host>
  <tcp_port>{tcp}</tcp_port>
  <http_port>{http}</http_port>
  <path>{data}/</path>
  <tmp_path>{data}/tmp/</tmp_path>
  <user_files_path>{data}/user_files/</user_files_path>
  <format_schema_path>{data}/format_schemas/</format_schema_path>
  <users_config>{home}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <timezone>UTC</timezone>
  <max_connections>1024</max_connections>
  <max_concurrent_queries>100</max_concurrent_queries>
  <mark_cache_size>268435456</mark_cache_size>
  <uncompressed_cache_size>268435456</uncompressed_cache_size>
  <mlock_executable>false</mlock_executable>
  <shutdown_wait_unfinished>5</shutdown_wait_unfinished>
</yandex>
"""


def _users_xml(password: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"""<?xml version="1.0"?>
<!-- generated by dsec (exporters/clickhouse_server.py) at every start: edits are overwritten.
     The private server answers on loopback only, to one user with a generated password
     (the file `password` beside this one, 0600); there is no `default` user. -->
<yandex>
  <profiles>
    <default>
      <max_memory_usage>4000000000</max_memory_usage>
      <load_balancing>random</load_balancing>
      <!-- idle connections notice a shutdown within 1 s (default 10 s) -->
      <poll_interval>1</poll_interval>
    </default>
  </profiles>
  <users>
    <{USER}>
      <password_sha256_hex>{digest}</password_sha256_hex>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </{USER}>
  </users>
  <quotas>
    <default>
      <interval>
        <duration>3600</duration>
        <queries>0</queries><errors>0</errors><result_rows>0</result_rows>
        <read_rows>0</read_rows><execution_time>0</execution_time>
      </interval>
    </default>
  </quotas>
</yandex>
"""


@dataclass
class ServerStatus:
    running: bool
    pid: int | None
    tcp_port: int
    http_port: int
    home: str
    data_dir: str
    log_dir: str
    config: str
    url: str
    detail: str = ""


def _listening(port: int) -> bool:
    """Is some socket listening on TCP `port` (any local address) in this netns?
    Read from /proc/net/tcp{,6}: a connect() probe would make the server log
    a warning for every `dsec` command."""
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[3] == "0A" and parts[1].endswith(want):
                        return True
        except OSError:
            continue
    return False


def _write_if_changed(path: str, text: str, mode: int = 0o644):
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.rename(tmp, path)


_CHILDREN: dict[int, subprocess.Popen] = {}   # servers this process started (to reap them)


class PrivateServer:
    """dsec's own clickhouse-server: one home directory, two loopback ports."""

    def __init__(self, home: str | None = None, tcp_port: int | None = None, http_port: int | None = None):
        self.home = os.path.abspath(home or os.environ.get("DSEC_CLICKHOUSE_DIR") or os.path.join(
            os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"), "clickhouse"))
        self.tcp_port = tcp_port or _env_port("DSEC_CLICKHOUSE_PORT", DEFAULT_TCP_PORT)
        self.http_port = http_port or _env_port("DSEC_CLICKHOUSE_HTTP_PORT", DEFAULT_HTTP_PORT)
        if self.tcp_port == self.http_port:
            raise ExportError(f"ClickHouse native and HTTP ports are both {self.tcp_port}: set "
                            "DSEC_CLICKHOUSE_PORT and DSEC_CLICKHOUSE_HTTP_PORT apart", EXIT_USAGE)
        self.data_dir = os.path.join(self.home, "data")
        self.log_dir = os.path.join(self.home, "log")
        self.config = os.path.join(self.home, "config.xml")
        self.pid_file = os.path.join(self.home, "server.pid")
        self.password_file = os.path.join(self.home, "password")

    # -- credentials
    def password(self, create: bool = False) -> str:
        """The password of user `dsec` (<home>/password, 0600); generated when
        create and missing. "" when there is none yet (the server never ran)."""
        try:
            with open(self.password_file, encoding="ascii") as f:
                pw = f.read().strip()
            if pw:
                return pw
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as e:
            raise ExportError(f"ClickHouse password file {self.password_file}: {getattr(e, 'strerror', e)}")
        if not create:
            return ""
        os.makedirs(self.home, mode=0o700, exist_ok=True)
        pw = secrets.token_urlsafe(32)
        tmp = f"{self.password_file}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pw + "\n")
        os.rename(tmp, self.password_file)
        return pw

    @property
    def url(self) -> str:
        return self.url_for(DEFAULT_DATABASE)

    def url_for(self, database: str) -> str:
        pw = quote(self.password(), safe="")
        return f"clickhouse://{USER}:{pw}@127.0.0.1:{self.tcp_port}/{database}"

    def _write_users(self) -> None:
        """users.xml for the current password (the server reloads it by itself)."""
        _write_if_changed(os.path.join(self.home, "users.xml"), _users_xml(self.password(create=True)), 0o600)

    # -- process
    def pid(self) -> int | None:
        """Pid of this home's running server (not a zombie), else None."""
        try:
            with open(self.pid_file) as f:
                pid = int(f.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            return None
        if pid <= 0:
            return None
        child = _CHILDREN.get(pid)
        if child is not None and child.poll() is not None:
            _CHILDREN.pop(pid, None)
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            return None
        return pid if self.config.encode() in cmd else None

    def status(self) -> ServerStatus:
        pid = self.pid()
        up = pid is not None and _listening(self.tcp_port)
        detail = ""
        if pid is not None and not up:
            detail = "process running but not answering on its port (starting, or hung)"
        return ServerStatus(up, pid, self.tcp_port, self.http_port, self.home, self.data_dir, self.log_dir,
                            self.config, self.url, detail)

    def _lock(self):
        os.makedirs(self.home, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.home, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def start(self, timeout: float = START_TIMEOUT) -> ServerStatus:
        """Start the server unless it already runs; wait until it answers."""
        st = self.status()
        if st.running and self.password():
            return st
        try:
            fd = self._lock()
        except OSError as e:
            raise ExportError(f"ClickHouse home {self.home}: {e.strerror}")
        try:
            pid = self.pid()
            if pid is None:
                pid = self._spawn()
            else:
                self._write_users()       # a server of an older dsec: password it now
            self._wait_ready(pid, timeout)
        finally:
            os.close(fd)
        return self.status()

    def _spawn(self) -> int:
        for port in (self.tcp_port, self.http_port):
            if _listening(port):
                raise ExportError(f"127.0.0.1:{port} is taken by another process (not dsec's ClickHouse in "
                                f"{self.home}): set DSEC_CLICKHOUSE_PORT / DSEC_CLICKHOUSE_HTTP_PORT, or "
                                "DSEC_CLICKHOUSE_URL to use that server")
        binary = find_server_binary()
        try:
            for d in (self.data_dir, self.log_dir, os.path.join(self.data_dir, "tmp")):
                os.makedirs(d, mode=0o700, exist_ok=True)
            _write_if_changed(self.config, _config_xml(self.home, self.tcp_port, self.http_port))
            os.chmod(self.home, 0o700)
            self._write_users()
            out = open(os.path.join(self.log_dir, "stdout.log"), "ab")
        except OSError as e:
            raise ExportError(f"ClickHouse home {self.home}: {e.strerror} ({e.filename})")
        try:
            proc = subprocess.Popen([*binary, f"--config-file={self.config}"], cwd=self.home,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        except OSError as e:
            raise ExportError(f"cannot run {binary[0]}: {e.strerror}")
        finally:
            out.close()
        _CHILDREN[proc.pid] = proc
        _write_if_changed(self.pid_file, f"{proc.pid}\n")
        return proc.pid

    def _wait_ready(self, pid: int, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            child = _CHILDREN.get(pid)
            if (child.poll() is not None) if child is not None else self.pid() != pid:
                _CHILDREN.pop(pid, None)
                raise ExportError(f"clickhouse-server (pid {pid}) exited during start-up: {self._last_error()}")
            if _listening(self.tcp_port):
                try:
                    from clickhouse_driver import Client
                    Client("127.0.0.1", port=self.tcp_port, user=USER, password=self.password(),
                           connect_timeout=2).execute("SELECT 1")
                    return
                except Exception:
                    pass
            if time.monotonic() > deadline:
                raise ExportError(f"clickhouse-server (pid {pid}) did not answer on 127.0.0.1:{self.tcp_port} "
                                f"within {timeout:.0f}s; see {self.log_dir}")
            time.sleep(0.05)

    def _last_error(self) -> str:
        for name in ("clickhouse-server.err.log", "stdout.log"):
            try:
                with open(os.path.join(self.log_dir, name), "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                    lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
                for ln in reversed(lines):
                    if "<Error>" in ln or "Exception" in ln or name == "stdout.log":
                        return ln[:300]
            except OSError:
                continue
        return f"no error logged (see {self.log_dir})"

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after timeout). Returns the
        pid that was stopped, None when it was not running."""
        fd = self._lock()
        try:
            pid = self.pid()
            if pid is None:
                self._remove_pid_file()
                return None
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.pid() == pid:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 10
                time.sleep(0.05)
            child = _CHILDREN.pop(pid, None)
            if child is not None:
                child.wait()
            self._remove_pid_file()
            return pid
        finally:
            os.close(fd)

    def _remove_pid_file(self):
        try:
            os.unlink(self.pid_file)
        except FileNotFoundError:
            pass


def external_url() -> str | None:
    url = os.environ.get("DSEC_CLICKHOUSE_URL", "").strip()
    if url:
        parse_url(url)
        return url
    return None


def ensure_clickhouse() -> str:
    """The ClickHouse URL to use: DSEC_CLICKHOUSE_URL, else the private server's
    (started when it is not running). Raises ExportError with one clear line."""
    url = external_url()
    if url:
        return url
    server = PrivateServer()
    server.start()
    return server.url
