"""SandboxFusion's `/run_code`, run on the node agent's sandboxes (docs/trainers.md).

    req = parse_request(body, hcfg)                   # RunCodeRequest, or BadRequest (400/422, FastAPI's shape)
    status, resp = run_code(agent, hcfg, langs, req, caller)   # SandboxFusion's RunCodeResponse (+ "dsec")

One request is one sandbox, taken from the warm pool of its language's profile
(`http.profile` / `http.languages`), recorded like every other agent sandbox
(labels request_id, caller, language, api=run_code), closed at the end:

  compiled languages   step 1: dsec's writer puts `files` and the code in the
                       workdir, then execs the compiler (compile_timeout);
                       step 2: the program, with `stdin` (run_timeout)
  interpreted          step 1: the writer, then execs the interpreter with `stdin`
  fetch_files          one more step reads them back (base64)

The writer is a short Python program (`python3 -I -S -c`) that reads a header
and the files' bytes from its stdin and execs the command: the program's own
stdin is what follows. The whole stdin is in the step's step_start record
(bounded), so `dsec replay --rerun` writes the files again.

Statuses follow SandboxFusion's parse_run_status: SandboxError when dsec could
not run the request (the message says why); else Failed when a phase timed out
(TimeLimitExceeded) or returned non-zero; else Success. A process killed by a
signal has return_code -SIGNAL (what SandboxFusion's asyncio subprocess reports).
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import secrets
import time

from agent.node.records import ENDED, QUEUED, RUNNING, STARTING, ApiError
from agent.node import steps

log = logging.getLogger("dsec.agent.http")

# SandboxFusion's `Language` literal (sandbox/runners/types.py): anything else is a 422
SANDBOXFUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket")

# language -> (code file suffix, compile argv or None, run argv, binaries the rootfs must have); "{f}" = the
# code file. Mirrors SandboxFusion's runners (sandbox/runners/major.py) where the toolchain is the same.
LANGUAGES = {
    "python": (".py", None, ["python3", "{f}"], ["python3"]),
    "pytest": (".py", None, ["pytest", "{f}"], ["pytest"]),
    "bash": (".sh", None, ["/bin/bash", "{f}"], ["bash"]),
    "nodejs": (".js", None, ["node", "{f}"], ["node"]),
    "typescript": (".ts", None, ["tsx", "{f}"], ["tsx"]),
    "php": (".php", None, ["php", "-f", "{f}"], ["php"]),
    "perl": (".pl", None, ["perl", "{f}"], ["perl"]),
    "lua": (".lua", None, ["lua", "{f}"], ["lua"]),
    "ruby": (".rb", None, ["ruby", "{f}"], ["ruby"]),
    "R": (".R", None, ["Rscript", "{f}"], ["Rscript"]),
    "julia": (".jl", None, ["julia", "{f}"], ["julia"]),
    "cpp": (".cpp", ["g++", "-std=c++17", "{f}", "-o", "test"], ["./test"], ["g++"]),
    "go": (".go", ["go", "build", "-o", "out", "{f}"], ["./out"], ["go"]),
    "rust": (".rs", ["rustc", "{f}", "-o", "test"], ["./test"], ["rustc"]),
    "java": ("Main.java", ["javac", "Main.java"], ["java", "-ea", "Main"], ["javac", "java"]),
}
SANDBOX_PATH = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/sbin", "/sbin")
RUNNER_ERROR = 125            # the writer's exit code when it could not write a file or exec the command
RUNNER_MARK = "dsec-runner: "
FETCH_TIMEOUT = 60.0
KILL_GRACE = 0.1              # a timed-out phase: SIGTERM, then SIGKILL this much later (SandboxFusion kills)

# The writer: header length line, JSON header {"files": [[path, size]...], "argv": [...]}, the files' bytes,
# then the program's stdin (left unread in the pipe for the exec'd command).
WRITER = r"""
import os, sys, json
def rd(n):
    b = bytearray()
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            break
        b += c
    return bytes(b)
ln = b""
while True:
    c = os.read(0, 1)
    if not c or c == b"\n":
        break
    ln += c
h = json.loads(rd(int(ln)))
for p, n in h["files"]:
    try:
        d = os.path.dirname(p)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(p, "wb") as f:
            f.write(rd(n))
    except OSError as e:
        sys.stderr.write("dsec-runner: cannot write %r: %s\n" % (p, e.strerror))
        sys.exit(125)
a = h["argv"]
try:
    os.execvp(a[0], a)
except OSError as e:
    sys.stderr.write("dsec-runner: cannot run %r: %s\n" % (a[0], e.strerror))
    sys.exit(125)
"""

# The reader of fetch_files: JSON {"files": {path: base64}, "skipped": {path: why}} on stdout.
FETCHER = r"""
import os, sys, json, base64
paths, cap = json.loads(sys.argv[1]), int(sys.argv[2])
out, skipped, total = {}, {}, 0
for p in paths:
    try:
        if not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            d = f.read(cap - total + 1)
        if total + len(d) > cap:
            skipped[p] = "over the agent's max_fetch_bytes"
            continue
        total += len(d)
        out[p] = base64.b64encode(d).decode()
    except OSError as e:
        skipped[p] = e.strerror
sys.stdout.write(json.dumps({"files": out, "skipped": skipped}))
"""


class BadRequest(Exception):
    """A request refused before any sandbox: HTTP status and FastAPI's body shape
    ({"detail": [{"type", "loc", "msg", "input"}]}) plus "message", one line."""

    def __init__(self, status: int, loc: list, msg: str, typ: str = "value_error", value=None, ctx=None):
        super().__init__(msg)
        self.status = status
        item = {"type": typ, "loc": ["body", *loc], "msg": msg}
        if value is not None:
            item["input"] = value
        if ctx:
            item["ctx"] = ctx
        where = ".".join(str(x) for x in loc) or "body"
        self.body = {"detail": [item], "message": f"{where}: {msg}"}


class RunCodeRequest:
    __slots__ = ("code", "language", "compile_timeout", "run_timeout", "memory_limit_mb", "stdin", "files",
                 "fetch_files")


# ---------------------------------------------------------------- request parsing

def _type_error(loc, want, value):
    shown = value if isinstance(value, (int, float, bool)) or value is None else type(value).__name__
    return BadRequest(400, loc, f"Input should be a valid {want}", f"{want}_type", shown)


def _number(d, key, default):
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error([key], "number", v)
    if math.isnan(v) or math.isinf(v):
        raise BadRequest(400, [key], "must be a finite number", value=str(v))
    return float(v)


def parse_request(body: bytes, hcfg) -> RunCodeRequest:
    """The JSON body checked against SandboxFusion's RunCodeRequest and the agent's
    limits. Raises BadRequest naming the field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, [], f"not UTF-8 (byte offset {e.start})", "json_invalid") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(400, [], f"JSON decode error: {e.msg} at line {e.lineno} column {e.colno}",
                         "json_invalid") from None
    except RecursionError:
        raise BadRequest(400, [], "JSON nested too deeply", "json_invalid") from None
    if not isinstance(d, dict):
        raise BadRequest(400, [], f"Input should be a valid dictionary or object, got {type(d).__name__}",
                         "model_attributes_type")
    r = RunCodeRequest()
    if "code" not in d:
        raise BadRequest(400, ["code"], "Field required", "missing")
    if not isinstance(d["code"], str):
        raise _type_error(["code"], "string", d["code"])
    r.code = d["code"]
    if len(r.code.encode("utf-8", "surrogatepass")) > hcfg.max_code_bytes:
        raise BadRequest(400, ["code"], f"larger than the agent's http.max_code_bytes ({hcfg.max_code_bytes})",
                         "too_long")
    if "language" not in d:
        raise BadRequest(400, ["language"], "Field required", "missing")
    lang = d["language"]
    if not isinstance(lang, str):
        raise _type_error(["language"], "string", lang)
    if lang not in SANDBOXFUSION_LANGUAGES:
        expected = ", ".join(f"'{x}'" for x in SANDBOXFUSION_LANGUAGES[:-1]) + f" or '{SANDBOXFUSION_LANGUAGES[-1]}'"
        raise BadRequest(422, ["language"], f"Input should be {expected}", "literal_error", lang[:200],
                         {"expected": expected})
    r.language = lang
    r.compile_timeout = _number(d, "compile_timeout", 10.0)
    r.run_timeout = _number(d, "run_timeout", 10.0)
    for key in ("compile_timeout", "run_timeout"):
        v = getattr(r, key)
        if not 0 < v <= hcfg.max_timeout_seconds:
            raise BadRequest(400, [key], f"must be > 0 and at most the agent's http.max_timeout_seconds "
                                         f"({hcfg.max_timeout_seconds:g}), got {v:g}", value=v)
    mem = d.get("memory_limit_MB", -1)
    if mem is None:
        mem = -1
    if isinstance(mem, bool) or not isinstance(mem, (int, float)) or (isinstance(mem, float) and mem != int(mem)):
        raise _type_error(["memory_limit_MB"], "integer", mem)
    mem = int(mem)
    if mem != -1 and not 4 <= mem <= hcfg.max_memory_mb:
        raise BadRequest(400, ["memory_limit_MB"], f"-1 (the profile's) or 4 to the agent's http.max_memory_mb "
                                                   f"({hcfg.max_memory_mb}), got {mem}", value=mem)
    r.memory_limit_mb = mem
    budget = hcfg.max_files_bytes
    stdin = d.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise _type_error(["stdin"], "string", stdin)
    r.stdin = (stdin or "").encode("utf-8", "surrogatepass")
    budget -= len(r.stdin)
    if budget < 0:
        raise BadRequest(400, ["stdin"], f"larger than the agent's http.max_files_bytes ({hcfg.max_files_bytes})",
                         "too_long")
    files = d.get("files")
    if files is None:
        files = {}
    if not isinstance(files, dict):
        raise _type_error(["files"], "dictionary", files)
    if len(files) > hcfg.max_files:
        raise BadRequest(400, ["files"], f"at most {hcfg.max_files} files (http.max_files), got {len(files)}",
                         "too_long")
    r.files = []
    for path, content in files.items():
        _check_path(["files", path[:200]], path)
        if content is None:                  # SandboxFusion skips null entries
            continue
        if not isinstance(content, str):
            raise _type_error(["files", path[:200]], "string", content)
        if len(content) > (budget + 3) * 4 // 3 + 4:
            raise BadRequest(400, ["files", path[:200]], f"the files are larger than the agent's "
                                                         f"http.max_files_bytes ({hcfg.max_files_bytes})", "too_long")
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(400, ["files", path[:200]], "not valid base64", "value_error") from None
        budget -= len(data)
        if budget < 0:
            raise BadRequest(400, ["files", path[:200]], f"the files are larger than the agent's "
                                                         f"http.max_files_bytes ({hcfg.max_files_bytes})", "too_long")
        r.files.append((path, data))
    fetch = d.get("fetch_files")
    if fetch is None:
        fetch = []
    if not isinstance(fetch, list):
        raise _type_error(["fetch_files"], "list", fetch)
    if len(fetch) > hcfg.max_files:
        raise BadRequest(400, ["fetch_files"], f"at most {hcfg.max_files} paths (http.max_files)", "too_long")
    for i, p in enumerate(fetch):
        if not isinstance(p, str):
            raise _type_error(["fetch_files", i], "string", p)
        _check_path(["fetch_files", i], p)
    if len(json.dumps(fetch)) > 100_000:
        raise BadRequest(400, ["fetch_files"], "the paths add up to more than 100000 bytes", "too_long")
    r.fetch_files = list(dict.fromkeys(fetch))
    return r


def _check_path(loc, p: str):
    if not p:
        raise BadRequest(400, loc, "empty path")
    if "\0" in p:
        raise BadRequest(400, loc, "path contains a NUL character")
    if len(p.encode("utf-8", "surrogatepass")) > 4096:
        raise BadRequest(400, loc, "path longer than 4096 bytes")
    try:
        p.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, loc, "path is not valid Unicode (lone surrogate)") from None


# ---------------------------------------------------------------- languages

def _has(root: str | None, binary: str) -> bool:
    if binary.startswith("/"):
        cands = [binary]
    else:
        cands = [os.path.join(d, binary) for d in SANDBOX_PATH]
    for c in cands:
        p = os.path.join(root, c.lstrip("/")) if root else c
        if root:
            if os.path.lexists(p):
                return True
        elif os.path.isfile(p) and os.access(p, os.X_OK):
            return True
    return False


def languages(cfg) -> dict[str, dict]:
    """Every SandboxFusion language -> {"available", "profile", "reason"} for this agent
    (the toolchain looked up in the profile's rootfs, as the sandbox's PATH would)."""
    h = cfg.http
    profiles = {p.name: p for p in cfg.warm_pool}
    out = {}
    for lang in SANDBOXFUSION_LANGUAGES:
        pname = h.languages.get(lang, h.profile)
        prof = profiles[pname]
        entry = {"available": False, "profile": pname, "reason": ""}
        spec = LANGUAGES.get(lang)
        if spec is None:
            entry["reason"] = f"language {lang!r} is not supported by dsec's /run_code"
        elif not _has(prof.rootfs, "python3"):
            entry["reason"] = (f"profile {pname!r}: its rootfs has no python3 (dsec's file writer needs it)")
        else:
            missing = [b for b in spec[3] if not _has(prof.rootfs, b)]
            if missing:
                entry["reason"] = (f"language {lang!r} is not available on this node: no {', '.join(missing)} "
                                   f"in the rootfs of profile {pname!r}")
            else:
                entry["available"] = True
        out[lang] = entry
    return out


# ---------------------------------------------------------------- running

class Caller:
    def __init__(self, identity: str, peer: str, request_id: str, labels: dict):
        self.identity = identity
        self.peer = peer
        self.request_id = request_id
        self.labels = labels


class TooBusy(Exception):
    """Over capacity: answered 429."""


def _result(ex: dict | None, out: bytes, err: bytes, error: str | None = None) -> dict:
    if ex is None or ex.get("error") and ex.get("exit_code") is None and not ex.get("signal") \
            and not ex.get("timed_out"):
        return {"status": "Error", "execution_time": None, "return_code": None,
                "stdout": out.decode("utf-8", "replace"),
                "stderr": (err.decode("utf-8", "replace") + (error or (ex or {}).get("error") or ""))}
    secs = round((ex.get("wall_ms") or 0) / 1000.0, 6)
    if ex.get("timed_out"):
        return {"status": "TimeLimitExceeded", "execution_time": secs, "return_code": None,
                "stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace")}
    rc = ex["exit_code"] if ex.get("exit_code") is not None else -int(ex.get("signal") or 9)
    return {"status": "Finished", "execution_time": secs, "return_code": rc,
            "stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace")}


def _step(agent, sid: str, argv: list, stdin: bytes, timeout: float, max_out: int):
    """One step of the sandbox, in this thread: (exit dict | None, stdout, stderr, truncated, error)."""
    start = {"sandbox_id": sid, "argv": [a.encode("utf-8", "surrogateescape") if isinstance(a, str) else a
                                         for a in argv],
             "env": [], "workdir": "", "stdin": stdin, "close_stdin": True, "timeout_seconds": timeout,
             "grace_seconds": KILL_GRACE}
    out, err = bytearray(), bytearray()
    truncated = []
    ex = None
    try:
        for item in steps.exec_step(agent, start, None, lambda cb: None, lambda: None):
            kind = item[0]
            if kind in ("stdout", "stderr"):
                buf = out if kind == "stdout" else err
                room = max_out - len(buf)
                if room > 0:
                    buf += item[1][:room]
                if len(item[1]) > room and kind not in truncated:
                    truncated.append(kind)
            elif kind == "exit":
                ex = item[1]
    except ApiError as e:
        return ex, bytes(out), bytes(err), truncated, e.message
    return ex, bytes(out), bytes(err), truncated, None


def _runner_failed(ex, err: bytes) -> str | None:
    if ex is not None and ex.get("exit_code") == RUNNER_ERROR:
        text = err.decode("utf-8", "replace")
        if text.startswith(RUNNER_MARK):
            return text.splitlines()[0][len(RUNNER_MARK):]
    return None


def _payload(files: list, argv: list, stdin: bytes) -> bytes:
    header = json.dumps({"files": [[p, len(d)] for p, d in files], "argv": argv}).encode("utf-8", "surrogatepass")
    return b"%d\n" % len(header) + header + b"".join(d for _, d in files) + stdin


def _create(agent, hcfg, prof, mem_bytes: int | None, labels: dict):
    """A running sandbox of profile `prof` (warm when one is ready), or TooBusy."""
    memory = prof.memory if mem_bytes is None or mem_bytes <= prof.memory else mem_bytes
    req = {"sandbox_id": "", "resources": {"cpus": prof.cpus or 0.0, "memory_bytes": memory, "pids": prof.pids},
           "priority": "", "policy": {"name": prof.policy, "mode": prof.mode or ""}, "rootfs": prof.rootfs or "",
           "network": prof.network, "labels": labels, "env": [(k.encode(), v.encode()) for k, v in prof.env.items()],
           "workdir": prof.workdir, "user": prof.user, "lifetime_seconds": 0.0, "grace_seconds": 0.0,
           "keep": False, "over_budget": "", "no_audit": False, "no_warm": False}
    try:
        rec = agent.create(req)
    except ApiError as e:
        if e.code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
            raise TooBusy(e.message) from None
        raise
    info, _ = agent.wait(rec.id, "running", hcfg.queue_timeout_seconds or 0.001)
    if info["state"] == QUEUED:
        agent.kill(rec.id, 0.0, f"http: no capacity within queue_timeout_seconds "
                                f"({hcfg.queue_timeout_seconds:g}s)")
        raise TooBusy(f"the node has no capacity for another sandbox of profile {prof.name!r} "
                      f"(waited {hcfg.queue_timeout_seconds:g}s; {info.get('waiting') or 'queued'})")
    if info["state"] == STARTING:
        info, _ = agent.wait(rec.id, "running", 120.0)
    return rec, info


def run_code(agent, hcfg, langs: dict, req: RunCodeRequest, caller: Caller, closer=None) -> dict:
    """Run one request; SandboxFusion's RunCodeResponse as a dict, with a "dsec" object
    (request_id, sandbox_id, node, policy, warm, truncated, fetch_skipped). Raises TooBusy.
    The sandbox is closed by closer(fn) (default: fn() at once): the HTTP service answers
    first and closes after."""
    closer = closer or (lambda fn: fn())
    t0 = time.monotonic()
    lang = langs[req.language]
    resp = {"status": "Success", "message": "", "compile_result": None, "run_result": None,
            "executor_pod_name": agent.node, "files": {}}
    ext = {"request_id": caller.request_id, "sandbox_id": "", "node": agent.node}
    resp["dsec"] = ext
    if not lang["available"]:
        resp.update(status="SandboxError", message=lang["reason"])
        return resp
    prof = next(p for p in agent.cfg.warm_pool if p.name == lang["profile"])
    mem = None if req.memory_limit_mb == -1 else req.memory_limit_mb << 20
    labels = dict(hcfg.labels)
    labels.update(caller.labels)
    labels.update({"api": "run_code", "request_id": caller.request_id, "caller": caller.identity,
                   "language": req.language})
    try:
        rec, info = _create(agent, hcfg, prof, mem, labels)
    except ApiError as e:
        resp.update(status="SandboxError", message=f"dsec could not create a sandbox: {e.message}")
        return resp
    ext.update(sandbox_id=rec.id, warm=bool(rec.warm), policy={"name": info.get("policy_name", ""),
                                                                "hash": info.get("policy_hash", ""),
                                                                "mode": info.get("mode", "")})
    ext["replay"] = f"dsec replay {rec.id}"
    try:
        if info["state"] != RUNNING:
            resp.update(status="SandboxError", message=f"sandbox {rec.id} is {info['state']}: "
                                                       f"{info.get('reason') or 'it did not start'}")
            return resp
        if mem is not None and mem < rec.memory:
            from agent.node.resources import limit_memory_of_fresh
            err = limit_memory_of_fresh(agent, rec, mem, f"memory_limit_MB {req.memory_limit_mb} of request "
                                                           f"{caller.request_id}")
            if err:
                resp.update(status="SandboxError", message=err)
                return resp
        ext["memory_bytes"] = mem or rec.memory
        _run_phases(agent, hcfg, req, resp, ext)
        return resp
    finally:
        _finish(agent, rec, req, resp, caller, t0, closer)


def _run_phases(agent, hcfg, req: RunCodeRequest, resp: dict, ext: dict):
    suffix, compile_argv, run_argv, _ = LANGUAGES[req.language]
    name = suffix if not suffix.startswith(".") else f"tmp{secrets.token_hex(4)}{suffix}"
    code = req.code
    if req.language == "php" and "<?php" not in code:
        code = "<?php\n" + code
    files = list(req.files) + [(name, code.encode("utf-8", "surrogatepass"))]
    sid = ext["sandbox_id"]
    truncated = []
    fill = [a.replace("{f}", name) for a in (compile_argv or run_argv)]
    if compile_argv is not None:
        ex, out, err, trunc, error = _step(agent, sid, ["python3", "-I", "-S", "-c", WRITER],
                                           _payload(files, fill, b""), req.compile_timeout, hcfg.max_output_bytes)
        truncated += [f"compile_result.{t}" for t in trunc]
        failed = error or _runner_failed(ex, err)
        if failed:
            resp.update(status="SandboxError", message=failed)
            return
        resp["compile_result"] = _result(ex, out, err)
        c = resp["compile_result"]
        if c["status"] != "Finished" or c["return_code"] != 0:
            resp["status"] = "SandboxError" if c["status"] == "Error" else "Failed"
            if c["status"] == "Error":
                resp["message"] = c["stderr"]
            return
        argv = [a.replace("{f}", name) for a in run_argv]
        ex, out, err, trunc, error = _step(agent, sid, argv, req.stdin, req.run_timeout, hcfg.max_output_bytes)
    else:
        ex, out, err, trunc, error = _step(agent, sid, ["python3", "-I", "-S", "-c", WRITER],
                                           _payload(files, fill, req.stdin), req.run_timeout,
                                           hcfg.max_output_bytes)
        failed = _runner_failed(ex, err)
        if failed:
            resp.update(status="SandboxError", message=failed)
            return
    truncated += [f"run_result.{t}" for t in trunc]
    if error and ex is None:
        resp.update(status="SandboxError", message=error)
        return
    resp["run_result"] = r = _result(ex, out, err)
    if ex is not None and ex.get("oom_killed"):
        ext["oom_killed"] = True
    if r["status"] == "Error":
        resp.update(status="SandboxError", message=r["stderr"])
    elif r["status"] == "TimeLimitExceeded" or r["return_code"] != 0:
        resp["status"] = "Failed"
    if error:                       # the sandbox was stopped under the step (preempted, killed ...)
        resp.update(status="SandboxError", message=error)
        return
    if req.fetch_files:
        cap = hcfg.max_fetch_bytes
        ex, out, err, _, error = _step(agent, sid, ["python3", "-I", "-S", "-c", FETCHER,
                                                    json.dumps(req.fetch_files), str(cap)],
                                       b"", FETCH_TIMEOUT, cap * 4 // 3 + (1 << 20))
        try:
            got = json.loads(out) if ex is not None and ex.get("exit_code") == 0 else None
        except ValueError:
            got = None
        if got is None:
            resp.update(status="SandboxError", message=f"fetch_files failed: {error or err.decode('utf-8', 'replace')[-500:] or 'no output'}")
            return
        resp["files"] = got.get("files") or {}
        if got.get("skipped"):
            ext["fetch_skipped"] = got["skipped"]
    if truncated:
        ext["truncated"] = truncated


def _close(agent, sid: str, request_id: str):
    try:
        agent.close(sid)
    except ApiError as e:
        log.warning("run_code %s: closing sandbox %s: %s", request_id, sid, e.message)
    except Exception:  # noqa: BLE001
        log.exception("run_code %s: closing sandbox %s", request_id, sid)


def _finish(agent, rec, req, resp, caller, t0, closer):
    """Record the request's outcome on the sandbox, then have it closed (by `closer`)."""
    try:
        with agent._lock:
            live = rec.state not in ENDED
            agent._lifecycle(rec.id, "run_code", step=rec.steps, request_id=caller.request_id,
                             caller=caller.identity, peer=caller.peer, language=req.language,
                             status=resp["status"],
                             compile_status=(resp.get("compile_result") or {}).get("status"),
                             run_status=(resp.get("run_result") or {}).get("status"),
                             message=resp.get("message")[:500] or None,
                             seconds=round(time.monotonic() - t0, 6))
        agent._flush_emits()
        if live:
            closer(lambda: _close(agent, rec.id, caller.request_id))
    except ApiError as e:
        log.warning("run_code %s: closing sandbox %s: %s", caller.request_id, rec.id, e.message)
    except Exception:  # noqa: BLE001
        log.exception("run_code %s: closing sandbox %s", caller.request_id, rec.id)
