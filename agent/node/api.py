"""The agent's gRPC servicer and server (transport, access control, message
conversion). The work is done by agent/node/daemon.py's Agent; this module only
translates between protobuf messages and the agent's Python values, and maps
ApiError to gRPC status codes.

Transports:
  unix socket   the default; only root can open it (directory 0700, socket
                0600, root-owned): the kernel refuses everyone else.
  TCP + mTLS    optional (config `tcp`): a client needs a certificate signed
                by `client_ca`; its identity (CN, SAN DNS/URI) must be in
                `allowed_clients`, else PERMISSION_DENIED and an
                `access_denied` audit event.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import threading

from agent.node.proto import pb, pb_grpc  # sets GRPC_ENABLE_FORK_SUPPORT=0 before grpc loads

import grpc  # noqa: E402

from agent.node import calls  # noqa: E402
from agent.node.calls import (RUN_ONCE_OUTPUT, _exit_message, _policy, _res_msg, _start_dict,  # noqa: E402,F401
                              create_dict, info_message, window_message)
from agent.node.daemon import Agent, ApiError, to_json  # noqa: E402
from agent.errors import DsecError, ReportedError  # noqa: E402

log = logging.getLogger("dsec.agent.node.api")


def _code(name: str):
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


def _abort(context, e: ApiError):
    context.abort(_code(e.code), e.message)


def event_message(r: dict) -> "pb.EventMessage":
    return pb.EventMessage(event=pb.AuditEvent(
        json=to_json(r), sandbox_id=r.get("sandbox_id") or "", kind=r.get("kind") or "",
        step=int(r.get("step") or 0), ts_ns=int(r.get("ts_ns") or 0), decision=r.get("decision") or "",
        event_id=r.get("event_id") or ""))


def _deadline(context):
    def remaining():
        return context.time_remaining()
    return remaining


class GrpcCall:
    """A gRPC call as agent/node/calls.py's handlers see their caller's call."""
    __slots__ = ("caller", "is_active", "time_remaining", "add_callback")
    hangup = -1

    def __init__(self, context, caller):
        self.caller = caller
        self.is_active = context.is_active
        self.time_remaining = context.time_remaining
        self.add_callback = context.add_callback


class AgentServicer(pb_grpc.AgentServicer):
    def __init__(self, agent: Agent):
        self.agent = agent

    def _caller(self, context):
        """Who calls (agent/node/authz.py): the unix socket is admin, a TCP client its identity."""
        return self.agent.authz.caller(context.peer() or "", _identities(context))

    # every handler: ApiError -> status; anything else -> INTERNAL with one line (logged in full)
    def _call(self, context, fn, *args):
        try:
            return calls.invoke(fn, *args)
        except ApiError as e:
            _abort(context, e)

    def _unary(self, name, request, context):
        """One of the calls the run socket's frames also carry (agent/node/calls.py): the same body."""
        return self._call(context, calls.HANDLERS[name].fn, self.agent, request,
                          GrpcCall(context, self._caller(context)))

    def CreateSandbox(self, request, context):
        return self._unary("CreateSandbox", request, context)

    def Exec(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Exec: the first message must be `start`")
            return
        if first.WhichOneof("msg") != "start":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Exec: the first message must be `start`, got `{first.WhichOneof('msg')}`")
            return

        def inputs():
            for m in request_iterator:
                kind = m.WhichOneof("msg")
                if kind == "stdin":
                    yield ("stdin", m.stdin)
                elif kind == "close_stdin":
                    if m.close_stdin:
                        yield ("close_stdin", True)
                elif kind == "signal":
                    if 0 < m.signal < 65:
                        yield ("signal", m.signal)
        yield from self._step(_start_dict(first.start), inputs(), context)

    def ExecOnce(self, request, context):
        # the whole stdin is in the request: it is closed after it, and nothing reads a request stream
        start = _start_dict(request)
        start["close_stdin"] = True
        yield from self._step(start, None, context)

    def _step(self, start, inputs, context):
        try:
            for item in self.agent.exec_step(start, inputs, context.add_callback, _deadline(context),
                                             self._caller(context)):
                kind = item[0]
                if kind == "started":
                    yield pb.ExecOutput(started=pb.StepStarted(step=item[1], ts_ns=item[2]))
                elif kind == "stdout":
                    yield pb.ExecOutput(stdout=item[1])
                elif kind == "stderr":
                    yield pb.ExecOutput(stderr=item[1])
                elif kind == "exit":
                    yield pb.ExecOutput(exit=_exit_message(item[1]))
        except ApiError as e:
            _abort(context, e)
        except ReportedError as e:
            _abort(context, ApiError("FAILED_PRECONDITION", e.message))

    def RunOnce(self, request, context):
        return self._unary("RunOnce", request, context)

    def Wait(self, request, context):
        return self._unary("Wait", request, context)

    def Kill(self, request, context):
        return self._unary("Kill", request, context)

    def CloseSandbox(self, request, context):
        return self._unary("CloseSandbox", request, context)

    def Get(self, request, context):
        return self._unary("Get", request, context)

    def List(self, request, context):
        return self._call(context, lambda: pb.ListResponse(sandboxes=[
            info_message(i) for i in self.agent.list(dict(request.labels), list(request.states), request.limit,
                                                     self._caller(context))]))

    def UpdatePolicy(self, request, context):
        def run():
            if not request.HasField("policy"):
                raise ApiError("INVALID_ARGUMENT", "policy: required (name or yaml)")
            r = self.agent.update_policy(request.sandbox_id, _policy(request), self._caller(context))
            return pb.UpdatePolicyResponse(**r)
        return self._call(context, run)

    def StreamEvents(self, request, context):
        try:
            for item in self.agent.stream_events(list(request.sandbox_ids), list(request.kinds),
                                                 list(request.decisions), dict(request.labels), context.is_active,
                                                 self._caller(context)):
                if item[0] == "lost":
                    yield pb.EventMessage(lost=pb.Lost(count=item[1], reason=item[2]))
                else:
                    yield event_message(item[1])
        except ApiError as e:
            _abort(context, e)

    def QueryEvents(self, request, context):
        try:
            for ev in self.agent.query_events(request.sandbox_id, list(request.kinds), request.limit,
                                              request.flush_timeout_seconds, self._caller(context)):
                yield event_message(ev)
        except ApiError as e:
            _abort(context, e)

    def Snapshot(self, request, context):
        def run():
            s = self.agent.snapshots.take(request.sandbox_id, self._caller(context))
            return pb.SnapshotInfo(snapshot_id=s["id"], sandbox_id=s["sandbox_id"], step=s["step"], files=s["files"],
                                   bytes=s["bytes"], frozen_ms=s["frozen_ms"], total_ms=s["total_ms"],
                                   attempts=s["attempts"], json=json.dumps(s, default=str))
        return self._call(context, run)

    def Restore(self, request, context):
        def run():
            r = self.agent.snapshots.restore(request.sandbox_id, request.snapshot_id, request.force,
                                             self._caller(context))
            return pb.RestoreResponse(sandbox_id=request.sandbox_id, snapshot_id=r["snapshot"], step=r["step"],
                                      total_ms=r["total_ms"])
        return self._call(context, run)

    def UpdateResources(self, request, context):
        from agent.node.resources import update_resources

        def run():
            r = request.resources
            out = update_resources(self.agent, request.sandbox_id, cpus=r.cpus, memory=r.memory_bytes, pids=r.pids,
                                   force=request.force, thaw=request.thaw, reason=request.reason,
                                   caller=self._caller(context))
            return pb.UpdateResourcesResponse(sandbox_id=out["sandbox_id"], resources=_res_msg(out["resources"]),
                                              previous=_res_msg(out["previous"]), thawed=out["thawed"])
        return self._call(context, run)

    def SetPhase(self, request, context):
        from agent.node.resources import set_phase

        def run():
            out = set_phase(self.agent, request.sandbox_id, request.phase, request.wait_seconds, request.force,
                            caller=self._caller(context))
            return pb.SetPhaseResponse(sandbox_id=out["sandbox_id"], phase=out["phase"],
                                       resources=_res_msg(out["resources"]), waited_seconds=out["waited_seconds"])
        return self._call(context, run)

    def Capabilities(self, request, context):
        def run():
            c = self.agent.capabilities()
            return pb.CapabilitiesResponse(
                node=c["node"], agent_version=c["agent_version"], kernel=c["kernel"], cgroup_mode=c["cgroup_mode"],
                audit=pb.Feature(**c["audit"]), enforcement=pb.Feature(**c["enforcement"]), degraded=c["degraded"],
                capacity_json=json.dumps(c["capacity"], default=str),
                warm_profiles=[pb.WarmProfileInfo(name=w["name"], count=w["count"], ready=w["ready"],
                                                  spec_json=json.dumps(w["spec"])) for w in c["warm_profiles"]],
                limits_json=json.dumps(c["limits"]), transports=c["transports"], pid=c["pid"],
                started_ns=c["started_ns"], images_json=json.dumps(c.get("images") or {}, default=str),
                snapshots_json=json.dumps(c.get("snapshots") or {}, default=str))
        return self._call(context, run)


# ---------------------------------------------------------------- access control

def _identities(context) -> list[str]:
    ac = context.auth_context() or {}
    out = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for v in ac.get(key, ()):
            s = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            if s not in out:
                out.append(s)
    return out


class AccessControl(grpc.ServerInterceptor):
    """Unix-socket callers passed the kernel's permission check (root only).
    TCP callers passed mutual TLS; their certificate identity must be allowed."""

    def __init__(self, agent: Agent, allowed: list[str]):
        self.agent = agent
        self.allowed = set(allowed)

    def _check(self, context, method):
        peer = context.peer() or ""
        if peer.startswith("unix:"):
            return
        ids = _identities(context)
        if "*" in self.allowed and ids:
            return
        if any(i in self.allowed for i in ids):
            return
        reason = (f"client certificate identity {', '.join(repr(i) for i in ids) or '(none)'} is not in the "
                  f"agent's allowlist (tcp.allowed_clients)")
        try:
            self.agent.audit_refusal(peer, ids, method, reason)
        except Exception:  # noqa: BLE001
            log.exception("could not audit a refused caller")
        context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        check = self._check
        calls = self.agent.calls          # in-flight calls: an agent with --idle-exit waits for them

        def wrap(fn, streaming_response):
            if fn is None:
                return None
            if streaming_response:
                def w(req, context):
                    calls.begin()
                    try:
                        check(context, method)
                        yield from fn(req, context)
                    finally:
                        calls.end()
            else:
                def w(req, context):
                    calls.begin()
                    try:
                        check(context, method)
                        return fn(req, context)
                    finally:
                        calls.end()
            return w

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True),
                                                     handler.request_deserializer, handler.response_serializer)


# ---------------------------------------------------------------- the server

def build_server(agent: Agent):
    """A started grpc.Server on the unix socket (and TCP+mTLS if configured)."""
    from concurrent.futures import ThreadPoolExecutor
    cfg = agent.cfg
    n = cfg.limits.max_message_bytes
    options = [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
               ("grpc.keepalive_time_ms", 30000), ("grpc.keepalive_timeout_ms", 10000),
               ("grpc.http2.min_ping_interval_without_data_ms", 5000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.so_reuseport", 0)]
    interceptors = [AccessControl(agent, cfg.tcp.allowed_clients if cfg.tcp else [])]
    server = grpc.server(ThreadPoolExecutor(max_workers=cfg.limits.max_concurrent_rpcs,
                                            thread_name_prefix="dsec-rpc"),
                         options=options, interceptors=interceptors,
                         maximum_concurrent_rpcs=cfg.limits.max_concurrent_rpcs)
    pb_grpc.add_AgentServicer_to_server(AgentServicer(agent), server)
    sock = cfg.socket
    if os.path.lexists(sock):
        os.unlink(sock)            # we hold the agent lock: a socket left here is a dead agent's
    old = os.umask(0o177)          # the socket is created 0600 (never world-connectable, not even briefly)
    try:
        server.add_insecure_port(f"unix:{sock}")
    finally:
        os.umask(old)
    os.chmod(sock, 0o600)
    agent.transports.append(f"unix:{sock}")
    if cfg.tcp:
        t = cfg.tcp
        with open(t.key, "rb") as f:
            key = f.read()
        with open(t.cert, "rb") as f:
            cert = f.read()
        with open(t.client_ca, "rb") as f:
            ca = f.read()
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        try:
            port = server.add_secure_port(t.listen, creds)
        except RuntimeError as e:
            raise DsecError(f"tcp.listen {t.listen}: cannot listen: {e}")
        if port == 0:
            raise DsecError(f"tcp.listen {t.listen}: cannot listen (address in use?)")
        agent.transports.append(f"tcp+mtls:{t.listen}")
    server.start()
    st = os.stat(sock)
    if st.st_mode & 0o777 != 0o600 or st.st_uid != 0:
        server.stop(0)
        raise DsecError(f"socket {sock}: mode {oct(st.st_mode & 0o777)} owner {st.st_uid}: expected 0600 root")
    return server


def serve(agent: Agent, stop: threading.Event, idle_exit: float | None = None):
    """Start the agent and its server; block until `stop` (or, with idle_exit,
    until it has had no sandbox and no call for that many seconds); shut down."""
    agent.start()
    try:
        server = build_server(agent)
    except BaseException:
        agent.shutdown("could not start the API server")
        agent.release()
        raise
    listeners = []                                 # the HTTP listeners (agent/node/httpapi.py, metrics_http.py)
    from agent.node.runsock import RunSocketService
    try:
        listeners.append(RunSocketService(agent, create_dict).start())     # dsec run's own socket (no gRPC client)
    except OSError as e:
        log.warning("dsec run's socket could not be started (dsec run uses gRPC): %s", e)
    for section, what in (("http", "the HTTP listener"), ("metrics", "the metrics listener")):
        if getattr(agent.cfg, section) is None:
            continue
        if section == "http":                      # SandboxFusion-compatible /run_code
            from agent.node.httpapi import HTTPService as Service
        else:                                      # Prometheus /metrics
            from agent.node.metrics_http import MetricsService as Service
        try:
            listeners.append(Service(agent, getattr(agent.cfg, section)).start())
        except BaseException:
            for svc in listeners:
                svc.stop_accepting()
            server.stop(0)
            agent.shutdown(f"could not start {what}")
            try:
                os.unlink(agent.cfg.socket)
            except OSError:
                pass
            agent.release()
            raise
    # what start-up made (modules, compiled programs, the servers) lives as long as the agent:
    # frozen out of the cyclic collector's sight, a full collection walks only what came since
    # (~18 ms a pause, in whichever call was in flight, measured: docs/launch-figures.md)
    gc.collect()
    gc.freeze()
    log.info("dsec agent (pid %d) serving on %s", os.getpid(), ", ".join(agent.transports))
    try:
        while not stop.wait(0.5):
            if idle_exit is not None and agent.idle_seconds() >= idle_exit:
                log.warning("idle for %.0f s (no sandbox, no call; --idle-exit): exiting", idle_exit)
                agent.idle_exited = True
                break
    finally:
        log.info("shutting down: stopping sandboxes")
        try:
            for svc in listeners:
                svc.stop_accepting()
            agent.shutdown()
        finally:
            for svc in listeners:
                svc.close()
            server.stop(grace=2).wait(5)
            try:
                os.unlink(agent.cfg.socket)
            except OSError:
                pass
            agent.release()
            log.info("stopped")
