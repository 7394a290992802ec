"""The agent's HTTP listener: SandboxFusion's `/run_code` (agent/node/runcode.py)
for trainers that speak it (verl, SkyRL, ...), off unless `http:` is configured
(docs/trainers.md).

    svc = HTTPService(agent, cfg.http).start()      # a thread accepting; one thread per connection
    ... svc.stop_accepting(); agent.shutdown(); svc.close()

Routes: POST /run_code; GET /v1/ping ("pong"), GET / , GET /dsec/v1/languages
(which SandboxFusion languages this node runs, and why not). Anything else
gets FastAPI's {"detail": "Not Found"}.

Access control, the same as the gRPC TCP listener's: every caller is
authenticated (a client certificate of `tls.client_ca`, or a token of
`tokens_file` as Authorization: Bearer TOKEN or Basic NAME:TOKEN, i.e.
http://NAME:TOKEN@host:port/run_code for clients that only take a URL) and
its identity must be in `allowed_clients`; a refused caller gets 401/403 and
an `access_denied` audit event. `unauthenticated: true` is allowed on a
loopback address only, and is listed as degraded in Capabilities. Sandboxes
never reach the port (the `inet dsec` nftables table drops their connections to
the host).

Load: at most `max_inflight` requests are served at once; the next one is
answered 429 at once (Retry-After: 1), and a request that cannot get a
sandbox within `queue_timeout_seconds` (node full) is answered 429 too.

Why the standard library's http.server: the agent is threads around one lock
(every Agent call blocks), a request holds a thread for the life of its
sandbox anyway, and the listener needs HTTP/1.1 keep-alive, TLS with client
certificates and bounded reads, all of which http.server + ssl give without
a new dependency. It is wrapped so that no path prints a traceback or an
HTML error page: every answer is JSON.
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import secrets
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agent.errors import DsecError
from agent.node.records import MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, ApiError
from agent.node.runcode import BadRequest, Caller, TooBusy, languages, parse_request, run_code

log = logging.getLogger("dsec.agent.http")

RESERVED_LABELS = ("api", "request_id", "caller", "language")
_REQ_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _cert_identities(cert: dict | None) -> list[str]:
    out = []
    for rdn in (cert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName" and v not in out:
                out.append(v)
    for k, v in (cert or {}).get("subjectAltName", ()):
        if k in ("DNS", "URI") and v not in out:
            out.append(v)
    return out


class HTTPService:
    """One HTTP listener of the agent with its access control (config section `section`);
    agent/node/metrics_http.py's /metrics is one too, with its own routes."""
    section = "http"
    what = "SandboxFusion /run_code"

    def __init__(self, agent, hcfg):
        from agent.node.config import load_tokens
        self.agent = agent
        self.cfg = hcfg
        self.tokens = load_tokens(hcfg.tokens_file) if hcfg.tokens_file else {}
        self.langs = languages(agent.cfg) if self.section == "http" else {}
        self.allowed = set(hcfg.allowed_clients)
        self._slots = threading.BoundedSemaphore(hcfg.max_inflight)
        self._lock = threading.Lock()
        self._conns: set = set()
        self.max_connections = hcfg.max_inflight * 2 + 32
        self.inflight = 0
        self.closing = 0                      # answered requests whose sandbox is still being closed
        self.max_closing = hcfg.max_inflight * 2
        self.counters = {"requests": 0, "answered_429": 0, "answered_4xx": 0, "answered_5xx": 0,
                         "refused": 0, "connections_dropped": 0}
        self.by_status: dict[str, int] = {}
        self.server = None
        self.thread = None
        from concurrent.futures import ThreadPoolExecutor
        self._closer = ThreadPoolExecutor(max_workers=min(64, hcfg.max_inflight), thread_name_prefix="dsec-http-close")
        self.scheme = "http"
        self.routes = self.make_routes()

    def make_routes(self) -> dict:
        return {("POST", "/run_code"): self._run_code, ("GET", "/v1/ping"): self._ping,
                ("GET", "/"): self._root, ("GET", "/dsec/v1/languages"): self._languages}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "HTTPService":
        c = self.cfg
        host, _, port = c.listen.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ctx = None
        if c.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(c.tls.cert, c.tls.key)
                if c.tls.client_ca:
                    ctx.verify_mode = ssl.CERT_REQUIRED
                    ctx.load_verify_locations(c.tls.client_ca)
            except (ssl.SSLError, OSError) as e:
                raise DsecError(f"{self.section}.tls: {e}", 2) from None
            self.scheme = "https+mtls" if c.tls.client_ca else "https"
        service = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 256
            address_family = family

            def process_request(self, request, client_address):
                if not service._conn_open(request):
                    service.count("connections_dropped")
                    try:
                        request.close()
                    except OSError:
                        pass
                    return
                super().process_request(request, client_address)

            def handle_error(self, request, client_address):
                log.debug("http: connection from %s ended with an error", client_address, exc_info=True)

            def shutdown_request(self, request):
                service._conn_closed(request)
                super().shutdown_request(request)

        try:
            self.server = Server((host, int(port)), _handler(self))
        except OSError as e:
            raise DsecError(f"{self.section}.listen {c.listen}: cannot listen: {e.strerror}") from None
        if ctx is not None:
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True,
                                                 do_handshake_on_connect=False)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name=f"dsec-{self.section}", daemon=True)
        self.thread.start()
        self.agent.transports.append(f"{self.scheme}:{c.listen}")
        if c.unauthenticated:
            self.agent.degraded.append(f"{self.section} {c.listen}: unauthenticated (loopback): any local user "
                                       f"can reach {self.what}")
        avail = [k for k, v in self.langs.items() if v["available"]]
        log.info("%s: %s on %s://%s%s", self.section, self.what, self.scheme.split("+")[0], c.listen,
                 f" (languages: {', '.join(avail) or 'none'})" if self.section == "http" else "")
        return self

    def stop_accepting(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def close(self, timeout: float = 30.0):
        """After the agent stopped its sandboxes: wait for the requests in flight, drop idle connections."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while (self.inflight or self.closing) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._closer.shutdown(wait=False, cancel_futures=False)
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _conn_open(self, sock) -> bool:
        with self._lock:
            if len(self._conns) >= self.max_connections:
                return False
            self._conns.add(sock)
            return True

    def _conn_closed(self, sock):
        with self._lock:
            self._conns.discard(sock)

    def count(self, key: str):
        with self._lock:
            self.counters[key] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"inflight": self.inflight, "closing": self.closing, "connections": len(self._conns),
                    **self.counters,
                    "by_status": dict(self.by_status)}

    # ------------------------------------------------------------ access control
    def authorize(self, h: "BaseHTTPRequestHandler") -> str | None:
        """The caller's identity, or None after answering 401/403 (and auditing it)."""
        ids = []
        if isinstance(h.connection, ssl.SSLSocket):
            ids += _cert_identities(h.connection.getpeercert())
        auth = h.headers.get("Authorization")
        bad = None
        if auth:
            name = self._token_identity(auth)
            if name is None:
                bad = "invalid credentials in the Authorization header"
            else:
                ids.append(name)
        method = f"{h.command} {h.path.split('?')[0][:200]}"
        if bad is None:
            if any(i in self.allowed for i in ids):
                return next(i for i in ids if i in self.allowed)
            if "*" in self.allowed and ids:
                return ids[0]
            if self.cfg.unauthenticated and not ids:
                return "anonymous"
        if bad is not None or not ids:
            reason = bad or (f"authentication required: a client certificate ({self.section}.tls.client_ca) or a "
                             f"token (Authorization: Bearer TOKEN, or http://NAME:TOKEN@host/...)")
            status = 401
        else:
            reason = (f"identity {', '.join(repr(i) for i in ids)} is not in the agent's allowlist "
                      f"({self.section}.allowed_clients)")
            status = 403
        self.count("refused")
        h.close_connection = True
        try:
            self.agent.audit_refusal(f"http:{h.client_address[0]}:{h.client_address[1]}", ids, method, reason)
        except Exception:  # noqa: BLE001
            log.exception("could not audit a refused HTTP caller")
        headers = {"WWW-Authenticate": 'Basic realm="dsec"'} if status == 401 else {}
        h.reply(status, {"detail": reason}, headers)
        return None

    def _token_identity(self, auth: str) -> str | None:
        kind, _, cred = auth.strip().partition(" ")
        cred = cred.strip()
        user = None
        if kind.lower() == "basic":
            try:
                user, sep, cred = base64.b64decode(cred, validate=True).decode("utf-8").partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            if not sep:
                return None
        elif kind.lower() != "bearer":
            return None
        found = None
        for token, name in self.tokens.items():          # constant time per token
            if hmac.compare_digest(token.encode(), cred.encode("utf-8", "replace")):
                found = name
        if found is None or (user and user != found):
            return None
        return found

    # ------------------------------------------------------------ routes
    def _ping(self, h, identity):
        h.reply(200, "pong")

    def _root(self, h, identity):
        h.reply(200, {"service": "dsec node agent", "api": "SandboxFusion /run_code",
                      "node": self.agent.node, "docs": "docs/trainers.md"})

    def _languages(self, h, identity):
        h.reply(200, {"node": self.agent.node, "languages": self.langs})

    def _run_code(self, h, identity):
        labels, rid = self._caller_fields(h)
        if labels is None:
            return
        if self.closing > self.max_closing:
            self.count("answered_429")
            h.reply(429, {"detail": f"{self.closing} sandboxes of earlier requests are still being closed; "
                                    f"retry later"}, {"Retry-After": "1", "X-Request-Id": rid})
            return
        if not self._slots.acquire(blocking=False):
            self.count("answered_429")
            h.close_connection = True
            h.reply(429, {"detail": f"the agent is serving its maximum of {self.cfg.max_inflight} requests "
                                    f"(http.max_inflight); retry later"}, {"Retry-After": "1", "X-Request-Id": rid})
            return
        with self._lock:
            self.inflight += 1
        answer = None
        closing = []
        try:
            body = h.read_body(self.cfg.max_body_bytes)
            if body is None:
                return
            try:
                req = parse_request(body, self.cfg)
            except BadRequest as e:
                answer = (e.status, e.body, {"X-Request-Id": rid})
                return
            caller = Caller(identity, f"{h.client_address[0]}:{h.client_address[1]}", rid, labels)
            try:
                resp = run_code(self.agent, self.cfg, self.langs, req, caller, closing.append)
            except TooBusy as e:
                self.count("answered_429")
                answer = (429, {"detail": str(e)}, {"Retry-After": "1", "X-Request-Id": rid})
                return
            with self._lock:
                self.by_status[resp["status"]] = self.by_status.get(resp["status"], 0) + 1
                if closing:
                    self.closing += 1
            answer = (200, resp, {"X-Request-Id": rid})
        finally:
            # the slot is free before the answer leaves: a client that sends its next request
            # the moment it has this answer never finds its own previous request still counted
            with self._lock:
                self.inflight -= 1
            self._slots.release()
            if answer is not None:
                h.reply(*answer)
            if closing:                 # answered: the sandbox is closed off this connection's thread
                try:
                    self._closer.submit(self._close, closing[0])
                except RuntimeError:    # shutting down
                    self._close(closing[0])

    def _close(self, fn):
        try:
            fn()
        finally:
            with self._lock:
                self.closing -= 1

    def _caller_fields(self, h):
        rid = h.headers.get("X-Request-Id")
        if rid is None:
            rid = "req-" + secrets.token_hex(8)
        elif not _REQ_ID_RE.match(rid):
            h.reply(400, {"detail": "X-Request-Id: 1-128 of [A-Za-z0-9._:-], starting alphanumeric",
                          "message": "X-Request-Id: 1-128 of [A-Za-z0-9._:-], starting alphanumeric"})
            return None, rid
        labels = {}
        for value in h.headers.get_all("X-Dsec-Labels") or ():
            for item in value.split(","):
                item = item.strip()
                if not item:
                    continue
                k, sep, v = item.partition("=")
                k, v = k.strip(), v.strip()
                problem = None
                if not sep or not k or len(k) > MAX_LABEL_KEY or not k.isprintable():
                    problem = f"X-Dsec-Labels: {item[:80]!r}: expected KEY=VALUE"
                elif len(v) > MAX_LABEL_VALUE or not v.isprintable():
                    problem = f"X-Dsec-Labels: {k[:40]!r}: value of at most {MAX_LABEL_VALUE} printable characters"
                elif k in RESERVED_LABELS:
                    problem = f"X-Dsec-Labels: {k!r} is set by dsec (reserved: {', '.join(RESERVED_LABELS)})"
                if problem:
                    h.reply(400, {"detail": problem, "message": problem}, {"X-Request-Id": rid})
                    return None, rid
                labels[k] = v
        if len(labels) + len(self.cfg.labels) + len(RESERVED_LABELS) > MAX_LABELS:
            msg = f"X-Dsec-Labels: at most {MAX_LABELS - len(RESERVED_LABELS) - len(self.cfg.labels)} labels"
            h.reply(400, {"detail": msg, "message": msg}, {"X-Request-Id": rid})
            return None, rid
        return labels, rid


def _handler(service: HTTPService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "dsec"
        sys_version = ""
        timeout = service.cfg.client_timeout_seconds

        def setup(self):
            super().setup()
            if isinstance(self.connection, ssl.SSLSocket):
                try:
                    self.connection.do_handshake()
                except (ssl.SSLError, OSError) as e:
                    log.info("http: TLS handshake with %s failed: %s", self.client_address[0], e)
                    raise

        def log_message(self, fmt, *args):
            log.debug("http %s: " + fmt, self.client_address[0], *args)

        def drain(self):
            """Read (and drop) a request body nobody will read, bounded, so that closing the
            connection does not reset it under the answer the client has not read yet."""
            n = self.pending_body
            self.pending_body = 0
            if n == 0:
                return
            deadline = time.monotonic() + 5.0
            left = n if n > 0 else 1 << 20              # -1: chunked, read what is there
            try:
                if n < 0:
                    self.connection.settimeout(0.2)
                while left > 0 and time.monotonic() < deadline:
                    c = self.rfile.read1(min(left, 1 << 16)) if n < 0 else self.rfile.read(min(left, 1 << 16))
                    if not c:
                        break
                    left -= len(c)
            except (OSError, ValueError):
                pass
            if n < 0 or left > 0:
                self.close_connection = True

        def reply(self, status: int, body, headers: dict | None = None):
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
            self.reply_raw(status, data, "application/json", headers)

        def reply_raw(self, status: int, data: bytes, content_type: str, headers: dict | None = None):
            self.drain()
            if 400 <= status < 500 and status != 429:
                service.count("answered_4xx")
            elif status >= 500:
                service.count("answered_5xx")
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                self.close_connection = True

        def send_error(self, code, message=None, explain=None):
            # http.server's own errors (bad request line, header too long, unsupported method): JSON, not HTML
            self.close_connection = True
            if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
                self.request_version = "HTTP/1.0"       # an unparsable request line: answer with a status line
            msg = message or self.responses.get(code, ("error",))[0]
            self.reply(code, {"detail": msg})

        pending_body = 0

        def _pending(self) -> int:
            """Bytes of request body still unread: N, 0, or -1 (chunked: unknown)."""
            if self.headers is None:
                return 0
            if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
                return -1
            n = (self.headers.get("Content-Length") or "").strip()
            return min(int(n), 256 << 20) if n.isdigit() else 0

        def read_body(self, limit: int) -> bytes | None:
            if self.pending_body < 0:
                self.close_connection = True
                self.reply(411, {"detail": "Content-Length required (chunked request bodies are not accepted)"})
                return None
            n = self.headers.get("Content-Length")
            if n is None or not n.strip().isdigit():
                self.close_connection = True
                self.reply(411, {"detail": "Content-Length required"})
                return None
            n = int(n)
            if n > limit:
                self.close_connection = True
                self.pending_body = min(n, 4 * limit)
                self.reply(413, {"detail": f"request body of {n} bytes is larger than the agent's "
                                           f"http.max_body_bytes ({limit})",
                                 "message": f"body: larger than http.max_body_bytes ({limit})"})
                return None
            self.pending_body = 0
            chunks, got = [], 0
            while got < n:
                c = self.rfile.read(min(n - got, 1 << 20))
                if not c:
                    self.close_connection = True
                    return None
                chunks.append(c)
                got += len(c)
            return b"".join(chunks)

        def _dispatch(self):
            service.count("requests")
            self.pending_body = self._pending()
            path = self.path.split("?", 1)[0]
            route = service.routes.get((self.command, path))
            try:
                if route is None:
                    if any(p == path for _, p in service.routes):
                        self.close_connection = True
                        self.reply(405, {"detail": "Method Not Allowed"})
                    else:
                        self.close_connection = True
                        self.reply(404, {"detail": "Not Found"})
                    return
                identity = service.authorize(self)
                if identity is None:
                    self.close_connection = True
                    return
                route(self, identity)
            except (BrokenPipeError, ConnectionResetError, TimeoutError, ssl.SSLError):
                self.close_connection = True
            except ApiError as e:
                log.warning("http %s %s: %s", self.command, path, e.message)
                self.close_connection = True
                self.reply(500, {"detail": f"dsec: {e.message}"})
            except Exception as e:  # noqa: BLE001
                log.exception("http %s %s: internal error", self.command, path)
                self.close_connection = True
                self.reply(500, {"detail": f"internal error: {type(e).__name__}"})

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    return Handler
