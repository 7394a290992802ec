"""The HTML incident report in a real headless browser (Debian's chromium).

Chromium runs as root with --headless --no-sandbox --disable-gpu, every
background network feature off and a new empty --user-data-dir; the test
talks to it over the DevTools protocol (a small websocket client below,
loopback only) to collect console messages, exceptions and network requests,
read the DOM and take screenshots. Pages and screenshots go to artifacts/ at
the repository root (gitignored): replay-incident.{html,png}, replay-holes.{html,png}.

Checked: the page renders (the script ran: <html data-rendered="1">), no
console error or exception, no request but the file itself, and the counts
on the page are the trajectory's (marks in the chart, steps, denials, changes,
lost-event markers); hostile file names stay text.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import ROOT, dsec
from test_replay import incident, lossy_records, testhost, trajectory  # noqa: F401 - session fixtures

from replay.render_html import MARK_KINDS, mark_count, render
from replay.trajectory import reconstruct
from audit_schema.events import normalize

ARTIFACTS = os.path.join(ROOT, "artifacts")


# ---------------------------------------------------------------- a minimal DevTools Protocol client
# Chromium with a new empty --user-data-dir, --remote-debugging-port=0 (the port is read from
# <user-data-dir>/DevToolsActivePort; loopback only); the websocket is RFC 6455 by hand: text
# frames, client-side masking, fragmented and 16/64-bit-length frames.

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
                  "--disable-extensions", "--disable-default-apps", "--metrics-recording-only",
                  "--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider",
                  "--hide-scrollbars", "--mute-audio", "--remote-allow-origins=*"]


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


class WebSocket:
    def __init__(self, host: str, port: int, path: str, timeout: float = 30.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake refused: {head[:200]!r}")

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("websocket closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str):
        data = text.encode()
        head = bytearray([0x81])
        n = len(data)
        if n < 126:
            head.append(0x80 | n)
        elif n < 1 << 16:
            head.append(0x80 | 126)
            head += struct.pack(">H", n)
        else:
            head.append(0x80 | 127)
            head += struct.pack(">Q", n)
        mask = os.urandom(4)
        head += mask
        self.sock.sendall(bytes(head) + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            op, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if op == 0x8:
                raise ConnectionError("websocket closed by the browser")
            if op == 0x9:        # ping -> pong
                continue
            if op in (0x1, 0x2, 0x0):
                parts.append(payload)
                if b0 & 0x80:
                    return b"".join(parts).decode("utf-8", "replace")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Page:
    def __init__(self, ws: WebSocket):
        self.ws = ws
        self.next_id = 0
        self.console: list[dict] = []      # {"source", "level", "text"}
        self.events: list[dict] = []

    def _on_event(self, m: dict):
        method, p = m.get("method"), m.get("params", {})
        self.events.append(m)
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.console.append({"source": "console", "level": p.get("type"), "text": text})
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            text = (d.get("exception") or {}).get("description") or d.get("text", "")
            self.console.append({"source": "exception", "level": "error", "text": text})
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            self.console.append({"source": e.get("source"), "level": e.get("level"), "text": e.get("text", ""),
                                 "url": e.get("url", "")})

    def call(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = json.loads(self.ws.recv())
            if m.get("id") == mid:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self._on_event(m)
        raise TimeoutError(method)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        for m in self.events:
            if m.get("method") == method:
                return m
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = json.loads(self.ws.recv())
            if "method" in m:
                self._on_event(m)
                if m["method"] == method:
                    return m
        raise TimeoutError(method)

    def navigate(self, url: str):
        self.events.clear()
        self.call("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def eval(self, expr: str):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: str, width: int = 1400):
        h = int(self.eval("Math.ceil(document.documentElement.scrollHeight)") or 900)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": min(h, 6000),
                                                         "deviceScaleFactor": 1, "mobile": False})
        time.sleep(0.4)              # the page redraws its chart on resize (debounced 100 ms)
        self.eval("1")
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def network_requests(self) -> list[str]:
        return [m["params"]["request"]["url"] for m in self.events if m.get("method") == "Network.requestWillBeSent"]


class Chromium:
    def __init__(self, profile_dir: str, binary: str | None = None):
        self.profile = str(profile_dir)
        self.binary = binary or chromium_binary()
        self.proc = None
        self.port = None
        self.stderr_path = os.path.join(self.profile, "chromium.stderr")

    def __enter__(self):
        os.makedirs(self.profile, exist_ok=True)
        err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
                                      "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                                      "--enable-logging=stderr", "--v=0", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                     env={**os.environ, "TMPDIR": self.profile})   # its Singleton dir too
        err.close()
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(port_file):
                lines = open(port_file).read().split()
                if lines:
                    self.port = int(lines[0])
                    break
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited: {open(self.stderr_path, errors='replace').read()[-2000:]}")
            time.sleep(0.1)
        if self.port is None:
            self.__exit__()
            raise RuntimeError("chromium did not open its DevTools port within 60 s")
        return self

    def new_page(self) -> Page:
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            info = json.loads(r.read())
        path = info["webSocketDebuggerUrl"].split(f":{self.port}", 1)[1]
        page = Page(WebSocket("127.0.0.1", self.port, path))
        for m in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            page.call(m)
        return page

    def open_file(self, path: str) -> Page:
        page = self.new_page()
        page.navigate("file://" + os.path.abspath(path))
        return page

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        return False


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if chromium_binary() is None:
        pytest.fail("chromium is not installed: run scripts/setup.sh (it installs Debian's chromium)")
    with Chromium(tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


def _errors(page) -> list:
    return [c for c in page.console if c["level"] in ("error", "assert") or c["source"] == "exception"]


def _check_page(page, path):
    assert page.eval("document.documentElement.getAttribute('data-rendered')") == "1", page.console
    assert _errors(page) == [], page.console
    reqs = page.network_requests()
    assert reqs and all(u == "file://" + os.path.abspath(path) for u in reqs), reqs      # no fetch at all
    assert not [m for m in page.events if m.get("method") == "Page.javascriptDialogOpening"]


def test_incident_report_renders_with_the_expected_counts(browser, incident, trajectory):
    os.makedirs(ARTIFACTS, exist_ok=True)
    html_path = os.path.join(ARTIFACTS, "replay-incident.html")
    r = dsec("replay", incident["sid"], "--format", "html", "-o", html_path, env=incident["env"])
    assert r.returncode == 0, r.stderr
    t = trajectory
    page = browser.open_file(html_path)
    _check_page(page, html_path)
    n = mark_count(t)
    assert n > 20
    assert page.eval("document.querySelectorAll('#chart svg .mark').length") == n
    assert page.eval("document.getElementById('chart-stats').textContent") == f"{n} of {n} events shown, 3 steps"
    assert page.eval("document.querySelectorAll('#chart svg .band').length") == 3
    denied = [r for r in t.records if r["kind"] in ("syscall_violation",)]
    assert page.eval("document.querySelectorAll('#chart svg .mark[data-decision=\\'would-deny\\']').length") \
        == len(denied) == 1
    assert page.eval("document.querySelectorAll('#steps tbody tr').length") == 3
    assert page.eval("document.querySelectorAll('#denials tbody tr').length") == len(t.denial_rows()) == 1
    assert page.eval("document.querySelectorAll('#changes tbody tr').length") == len(t.changes) == 1
    for key, val in (("events", len(t.records)), ("steps", 3), ("denials", 1), ("changes", 1), ("lost", 0)):
        assert page.eval(f"document.getElementById('count-{key}').dataset.count") == str(val), key
    assert page.eval("document.getElementById('lost-banner')") is None
    procs = sum(len(_walk(p, s)) for s in range(0, 4) for p in t.step_roots(s))
    assert page.eval("document.querySelectorAll('.tree li.proc').length") == procs
    assert "/workspace/x.sh" in page.eval("document.getElementById('changes').textContent")
    assert "keyctl" in page.eval("document.getElementById('denials').textContent")
    page.screenshot(os.path.join(ARTIFACTS, "replay-incident.png"))
    # click a step band: the chart zooms to that step
    page.eval("document.querySelector('#chart svg .band[data-step=\\'3\\']').dispatchEvent("
              "new MouseEvent('click', {bubbles: true}))")
    shown = int(page.eval("document.getElementById('chart').getAttribute('data-marks')"))
    s3 = t.step(3)
    in3 = sum(1 for r in t.records if r["kind"] in MARK_KINDS and s3.start_ns <= r["ts_ns"] <= s3.end_ns)
    assert in3 >= 10 and in3 <= shown < n, (in3, shown, n)
    assert _errors(page) == []


def _walk(p, step):
    out = [p]
    for c in p.children:
        if c.step == step:
            out += _walk(c, step)
    return out


def test_holes_and_hostile_names_in_the_report(browser):
    os.makedirs(ARTIFACTS, exist_ok=True)
    sid = "lossy-browser"
    recs = [normalize(dict(r, event_id=f"e{i}")) for i, r in enumerate(lossy_records(sid))]
    t = reconstruct(sid, recs)
    path = os.path.join(ARTIFACTS, "replay-holes.html")
    unattributed = [{"event_id": "x", "ts_ns": recs[0]["ts_ns"] + 5, "node": "n", "count": 7,
                     "extra": json.dumps({"reason": "spool_damage"})}]
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(t, unattributed_lost=unattributed))
    page = browser.open_file(path)
    _check_page(page, path)
    banner = page.eval("document.getElementById('lost-banner').textContent")
    assert "4242 events were lost" in banner
    assert page.eval("document.querySelectorAll('.lost-banner.unattributed').length") == 1
    assert page.eval("document.querySelectorAll('#chart svg .lost-marker').length") == 1
    assert page.eval("document.querySelectorAll('#events tr.lost').length") == 1
    assert page.eval("document.querySelectorAll('#chart svg .mark').length") == mark_count(t)
    assert page.eval("document.querySelectorAll('#chart svg .mark[data-decision=\\'denied\\']').length") == 2
    assert page.eval("document.querySelectorAll('#denials tbody tr').length") == 1
    assert page.eval("document.getElementById('count-lost').dataset.count") == "4242"
    # the hostile name is text: no element was made from it, the escapes show
    assert page.eval("document.querySelectorAll('img').length") == 0
    text = page.eval("document.getElementById('changes').textContent")
    assert "</script><img src=x onerror=alert(1)>" in text and "\\xff" in text
    page.screenshot(os.path.join(ARTIFACTS, "replay-holes.png"))
