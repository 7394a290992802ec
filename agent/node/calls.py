"""The agent's unary calls that the SDK also sends over the run socket's frames
(agent/node/stepsock.py, docs/agent.md "Calls over the run socket"): CreateSandbox, RunOnce,
Wait, Kill, CloseSandbox and Get. Each has one body here, run by the gRPC servicer
(agent/node/api.py) and by the frames alike, so both give the same checks, authorisation,
scheduling, warm claims, records, replies and errors; only the transport differs. A handler
takes the request message and a `call` (what it needs of its caller's call), returns the
reply message, and raises ApiError (invoke() maps every other failure the way the servicer
always did):

    call.caller               who calls (agent/node/authz.py)
    call.is_active()          the caller is still there and its deadline has not passed
    call.time_remaining()     seconds to its deadline, or None
    call.add_callback(cb)     cb() when the call ends before its handler (the caller went away)
    call.hangup               the caller's connection (a frame socket's fd), -1 for gRPC

    reply = invoke(HANDLERS["CreateSandbox"].fn, agent, request, call)

Also the conversions between the API's messages and the agent's Python values that the
servicer and these handlers share (create_dict, info_message ...).
"""
from __future__ import annotations

import json
import logging
from typing import Callable, NamedTuple

from agent.errors import ReportedError
from agent.node.proto import pb
from agent.node.records import ApiError
from agent.node.requests import check_exec

log = logging.getLogger("dsec.agent.node.api")


# ---------------------------------------------------------------- messages <-> values

def _policy(msg) -> dict:
    if not msg.HasField("policy"):
        return {}
    p = msg.policy
    which = p.WhichOneof("source")
    return {"name": p.name if which == "name" else None, "yaml": p.yaml if which == "yaml" else None,
            "mode": p.mode, "source_name": p.source_name}


def info_message(info: dict) -> "pb.SandboxInfo":
    m = pb.SandboxInfo(
        sandbox_id=info["sandbox_id"], state=info["state"], reason=info.get("reason") or "",
        priority=info.get("priority") or "",
        resources=pb.Resources(cpus=info.get("cpus") or 0.0, memory_bytes=info.get("memory") or 0,
                               pids=info.get("pids") or 0),
        labels=info.get("labels") or {}, policy_name=info.get("policy_name", ""),
        policy_hash=info.get("policy_hash", ""), mode=info.get("mode", ""), network=info.get("network", ""),
        created_ns=info.get("created_ns", 0), admitted_ns=info.get("admitted_ns", 0),
        started_ns=info.get("started_ns", 0), ended_ns=info.get("ended_ns", 0),
        queued_seconds=info.get("queued_seconds") or 0.0, steps=info.get("steps", 0), warm=info.get("warm", False),
        waiting=info.get("waiting") or "", queue_position=info.get("queue_position", -1),
        preempted_for=info.get("preempted_for") or "", node=info.get("node", ""),
        cgroup_id=info.get("cgroup_id", 0), warm_profile=info.get("warm_profile") or "",
        image=info.get("image") or "", image_digest=info.get("image_digest") or "",
        frozen=bool(info.get("frozen")))
    if info.get("window"):
        w = info["window"]
        m.phase = w.get("phase") or ""
        m.window.CopyFrom(window_message(w))
    if info.get("summary") is not None:
        m.summary_json = json.dumps(info["summary"], ensure_ascii=True, default=str)
    return m


# ---------------------------------------------------------------- live resources (issue 20)

def _res_msg(r: dict) -> "pb.Resources":
    return pb.Resources(cpus=r.get("cpus") or 0.0, memory_bytes=r.get("memory") or 0, pids=r.get("pids") or 0)


def window_message(w: dict) -> "pb.ResourceWindow":
    m = pb.ResourceWindow(base=_res_msg(w["base"]), peak=_res_msg(w["peak"]), phase=w.get("phase") or "")
    for name, r in (w.get("phases") or {}).items():
        m.phases[name].CopyFrom(_res_msg(r))
    return m


def _window(request) -> dict | None:
    if not request.HasField("window"):
        return None
    w = request.window

    def res(r):
        return {"cpus": r.cpus, "memory_bytes": r.memory_bytes}
    return {"base": res(w.base) if w.HasField("base") else None, "peak": res(w.peak) if w.HasField("peak") else None,
            "phases": {k: res(v) for k, v in w.phases.items()}, "initial_phase": w.initial_phase}


def create_dict(request) -> dict:
    """A CreateSandboxRequest as agent.create's `req` (also dsec run's socket: agent/node/runsock.py)."""
    res = request.resources
    return {"sandbox_id": request.sandbox_id,
            "resources": {"cpus": res.cpus, "memory_bytes": res.memory_bytes, "pids": res.pids},
            "priority": request.priority, "policy": _policy(request), "rootfs": request.rootfs,
            "network": request.network, "labels": dict(request.labels),
            "env": [(e.name, e.value) for e in request.env], "workdir": request.workdir,
            "user": request.user, "lifetime_seconds": request.lifetime_seconds,
            "grace_seconds": request.grace_seconds, "keep": request.keep,
            "over_budget": request.over_budget, "no_audit": request.no_audit, "no_warm": request.no_warm,
            "image": request.image, "volumes": [(v.host_path, v.sandbox_path, v.read_write)
                                                for v in request.volumes],
            "from_snapshot": request.from_snapshot, "window": _window(request),
            "auto_snapshot": ({"every_steps": request.auto_snapshot.every_steps,
                               "retention": request.auto_snapshot.retention}
                              if request.HasField("auto_snapshot") else None)}


def _start_dict(s) -> dict:
    """An ExecStart message as agent.exec_step's `start`."""
    return {"sandbox_id": s.sandbox_id, "argv": list(s.argv), "env": [(e.name, e.value) for e in s.env],
            "workdir": s.workdir, "stdin": s.stdin, "close_stdin": s.close_stdin,
            "timeout_seconds": s.timeout_seconds, "grace_seconds": s.grace_seconds,
            "close_after": s.close_after, "wait_export": s.wait_export, "no_started": s.no_started}


RUN_ONCE_OUTPUT = 4 << 20          # RunOnce keeps this much of each stream unless asked otherwise


def _exit_message(ex: dict) -> "pb.ExitStatus":
    st = pb.ExitStatus(step=ex["step"], code=ex["code"], signal=ex["signal"] or 0,
                       timed_out=ex["timed_out"], oom_killed=bool(ex["oom_killed"]),
                       error=ex["error"] or "", wall_ms=ex["wall_ms"] or 0, cpu_ms=ex["cpu_ms"] or 0,
                       max_rss_bytes=ex["max_rss_bytes"] or 0, sandbox_state=ex["sandbox_state"],
                       sandbox_reason=ex["sandbox_reason"] or "", preempted=ex["preempted"],
                       final=bool(ex.get("final")), error_code=ex.get("error_code") or "",
                       error_message=ex.get("error_message") or "")
    if ex.get("exit_code") is not None:
        st.exit_code = ex["exit_code"]
    if ex.get("summary") is not None:
        st.summary_json = json.dumps(ex["summary"], ensure_ascii=True, default=str)
    return st


def invoke(fn, *args):
    """fn(*args), any failure as ApiError: ApiError as it is, a ReportedError FAILED_PRECONDITION
    with its message, anything else INTERNAL with one line (logged in full)."""
    try:
        return fn(*args)
    except ApiError:
        raise
    except ReportedError as e:
        raise ApiError("FAILED_PRECONDITION", e.message) from None
    except Exception as e:  # noqa: BLE001
        log.exception("internal error")
        raise ApiError("INTERNAL", f"internal error: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------- the handlers

def create_sandbox(agent, request, call) -> "pb.SandboxInfo":
    """CreateSandbox. With wait_running, a caller that goes away (or whose deadline passes) before
    the sandbox runs has it closed: nobody would ever learn its id (DEADLINE_EXCEEDED for the
    deadline, as RunOnce). The reply does not wait for the durable append of the create's records
    (requested; a warm claim's sandbox_start): their place is reserved, ahead of anything of the
    sandbox's in the spool (docs/agent.md "When a step's records are durable")."""
    caller = call.caller
    rec = agent.create(create_dict(request), caller)
    if not request.wait_running:
        return info_message(agent.info(rec))
    info, timed_out = agent.wait(rec.id, "running", call.time_remaining(), call.is_active, caller)
    if timed_out:                       # its deadline passed, or its caller went away
        close_quietly(agent, rec.id)
        if _past_deadline(call):
            raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id} was still {info.get('state')} at the call's "
                                                f"deadline: closed")
        info = agent.info(rec)
    m = info_message(info)
    m.timed_out = timed_out
    return m


def run_once(agent, request, call) -> "pb.RunOnceReply":
    """RunOnce: CreateSandbox(wait_running) + ExecOnce(close_after) in one call; the output is
    kept up to the cap."""
    if request.exec.sandbox_id:
        raise ApiError("INVALID_ARGUMENT", "exec.sandbox_id: must be empty in RunOnce (the sandbox is "
                                           "named by create.sandbox_id)")
    caller = call.caller
    cap = min(request.max_output_bytes or RUN_ONCE_OUTPUT,
              max(0, (agent.cfg.limits.max_message_bytes - (256 << 10)) // 2))
    start = _start_dict(request.exec)
    check_exec(dict(start, sandbox_id="-"))     # a bad step is refused before any sandbox is made
    # its records are not waited for (Agent.create): the reply waits for the close's append (FIFO:
    # theirs first); the step's events wait for them at the recorder's gate
    rec = agent.create(create_dict(request.create), caller)
    info, timed_out = agent.wait(rec.id, "running", call.time_remaining(), call.is_active, caller)
    reply = pb.RunOnceReply()
    if timed_out and _past_deadline(call):  # still queued at the call's deadline: a one-shot run ends
        agent.close(rec.id)
        raise ApiError("DEADLINE_EXCEEDED", f"sandbox {rec.id} was still {info.get('state')} at the "
                                            f"call's deadline: closed")
    if not call.is_active():            # the caller went away before its sandbox ran: it ends
        close_quietly(agent, rec.id)
        return reply
    reply.sandbox.CopyFrom(info_message(info))
    if info.get("state") != "running":  # failed (or ended) before its step: the SDK raises
        return reply
    start.update(sandbox_id=rec.id, close_stdin=True, close_after=True)
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    dropped = {"stdout": 0, "stderr": 0}
    try:
        for item in agent.exec_step(start, None, call.add_callback, call.time_remaining, caller, call.hangup):
            kind = item[0]
            if kind in kept:
                buf, data = kept[kind], item[1]
                room = cap - len(buf)
                buf += data[:max(room, 0)]
                dropped[kind] += max(len(data) - max(room, 0), 0)
            elif kind == "exit":
                reply.exit.CopyFrom(_exit_message(item[1]))
    except ApiError as e:
        if not reply.HasField("exit"):
            raise
        reply.error_code, reply.error_message = e.code, e.message    # stopped under the step
    finally:
        if not reply.HasField("exit"):  # no step ran to its end here (refused, cancelled): it ends
            close_quietly(agent, rec.id)
    reply.stdout, reply.stderr = bytes(kept["stdout"]), bytes(kept["stderr"])
    reply.stdout_dropped_bytes, reply.stderr_dropped_bytes = dropped["stdout"], dropped["stderr"]
    return reply


def wait(agent, request, call) -> "pb.SandboxInfo":
    info, timed_out = agent.wait(request.sandbox_id, request.until,
                                 request.timeout_seconds or call.time_remaining(), call.is_active, call.caller)
    m = info_message(info)
    m.timed_out = timed_out
    return m


def kill(agent, request, call) -> "pb.SandboxInfo":
    return info_message(agent.kill(request.sandbox_id,
                                   request.grace_seconds if request.HasField("grace_seconds") else None,
                                   request.reason, call.is_active, call.caller))


def close_sandbox(agent, request, call) -> "pb.SandboxInfo":
    return info_message(agent.close(request.sandbox_id, call.is_active, call.caller))


def get(agent, request, call) -> "pb.SandboxInfo":
    return info_message(agent.info(agent.lookup(request.sandbox_id, call.caller, "Get")))


def _past_deadline(call) -> bool:
    left = call.time_remaining()
    return left is not None and left <= 0


def close_quietly(agent, sid: str):
    try:
        agent.close(sid)
    except (ApiError, ReportedError):
        pass


class Handler(NamedTuple):
    request: str                # the request message's name in pb
    reply: str                  # the reply's
    fn: Callable


HANDLERS = {
    "CreateSandbox": Handler("CreateSandboxRequest", "SandboxInfo", create_sandbox),
    "RunOnce": Handler("RunOnceRequest", "RunOnceReply", run_once),
    "Wait": Handler("WaitRequest", "SandboxInfo", wait),
    "Kill": Handler("KillRequest", "SandboxInfo", kill),
    "CloseSandbox": Handler("CloseRequest", "SandboxInfo", close_sandbox),
    "Get": Handler("GetRequest", "SandboxInfo", get),
}
