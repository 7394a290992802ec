"""The agent's side of `dsec run`'s own socket (protocol: agent/node/runclient.py):
a connection that opens with R is CreateSandbox (wait until it runs) + one Exec with
close_after; one that opens with X or U carries the SDK's steps (agent/node/stepsock.py)
and calls (agent/node/callsock.py).
Both go through the same agent calls as the gRPC API (agent/node/api.py), so the
checks, the audit records and what is durable before the reply are the same. Root
only: the socket is created 0600 like the gRPC one, and a peer whose SO_PEERCRED uid
is not root's (nor the agent's) is refused (PERMISSION_DENIED, an access_denied
record); its callers are the admin caller of a unix-socket gRPC call.

    svc = RunSocketService(agent, api.create_dict).start()   # listens on run_socket_path(cfg.socket)
    svc.stop_accepting(); ...; svc.close()    # as the HTTP listeners (api.serve)
"""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading

from agent.errors import ReportedError
from agent.node.records import ApiError
from agent.node.runclient import FrameWriter, ProtocolError, read_frame, run_socket_path

log = logging.getLogger("dsec.agent")


class RunSocketService:
    def __init__(self, agent, create_dict):
        self.agent = agent
        self.create_dict = create_dict      # api.create_dict: a CreateSandboxRequest as agent.create's req
        self.path = run_socket_path(agent.cfg.socket)
        self._sock: socket.socket | None = None
        self._conns: set = set()
        self._lock = threading.Lock()
        self._closing = False
        self._slots = threading.BoundedSemaphore(max(1, agent.cfg.limits.max_concurrent_rpcs))

    def start(self) -> "RunSocketService":
        try:
            os.unlink(self.path)        # the agent lock is held: a socket left here is a dead agent's
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)           # created 0600: never connectable by others, not even briefly
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(128)
        self._sock = s
        threading.Thread(target=self._accept, name="dsec-run-accept", daemon=True).start()
        self.agent.transports.append(f"unix:{self.path} (dsec run)")
        return self

    def _accept(self):
        while True:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return                  # closed (stop_accepting)
            if self._closing:
                c.close()
                return
            if not self._slots.acquire(blocking=False):
                _refuse(c, "RESOURCE_EXHAUSTED", "too many connections to the run socket at once "
                                                  "(limits.max_concurrent_rpcs)")
                continue
            with self._lock:
                self._conns.add(c)
            threading.Thread(target=self._serve, args=(c,), name="dsec-run-conn", daemon=True).start()

    def stop_accepting(self):
        self._closing = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self):
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _serve(self, c: socket.socket):
        calls = self.agent.calls
        w = FrameWriter(c)
        counted = False
        try:
            if not self._peer_allowed(c, w):
                return
            first = read_frame(c)
            if first is None:
                return
            kind, payload = first
            if kind in ("X", "U"):      # the SDK's steps and calls, as many as the connection carries
                from agent.node.stepsock import serve_steps
                serve_steps(self.agent, c, w, kind, payload, "unix:" + self.path)
                return
            calls.begin()
            counted = True
            self._one(c, w, kind, payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except ProtocolError as e:
            _send_error(w, "INVALID_ARGUMENT", f"dsec run socket: {e}")
        except ApiError as e:
            _send_error(w, e.code, e.message)
        except ReportedError as e:
            _send_error(w, "FAILED_PRECONDITION", e.message)
        except Exception as e:  # noqa: BLE001
            log.exception("dsec run socket: internal error")
            _send_error(w, "INTERNAL", f"internal error: {type(e).__name__}: {e}")
        finally:
            if counted:
                calls.end()
            with self._lock:
                self._conns.discard(c)
            try:
                c.shutdown(socket.SHUT_RDWR)    # wakes the step's stdin reader blocked in recv
            except OSError:
                pass
            c.close()
            self._slots.release()

    def _peer_allowed(self, c, w) -> bool:
        """The kernel's word on who connected (SO_PEERCRED): root, or the agent's own uid.
        The socket's mode already keeps others out; this holds if it is ever loosened."""
        pid, uid, gid = struct.unpack("3i", c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
        if uid in (0, os.geteuid()):
            return True
        reason = (f"uid {uid} (pid {pid}) may not use the agent's socket {self.path}: only root "
                  f"(the socket is the node's admin)")
        try:
            self.agent.audit_refusal(f"unix:{self.path}", [f"uid:{uid}"], "run socket", reason)
        except Exception:  # noqa: BLE001
            log.exception("could not audit a refused caller")
        _send_error(w, "PERMISSION_DENIED", reason)
        return False

    def _one(self, c, w, kind: str, payload: bytes):
        from agent.node.client import AgentError, _create_request
        if kind != "R":
            raise ProtocolError(f"the first frame must be a request (R), a step (X) or a call (U), got {kind!r}")
        try:
            req = json.loads(payload)
            create, ex = dict(req["create"]), dict(req["exec"])
            argv = [os.fsencode(a) for a in ex["argv"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"bad request: {e}")
        try:
            msg = _create_request(wait=True, **create)
        except AgentError as e:
            raise ApiError(e.status, e.message)
        except TypeError as e:
            raise ProtocolError(f"bad create: {e}")
        a = self.agent
        caller = a.authz.caller("unix:", [])
        rec = a.create(self.create_dict(msg), caller)
        info, _ = a.wait(rec.id, "running", None, lambda: _alive(c), caller)
        if not _alive(c):               # the client went away before its sandbox ran: a one-shot run ends
            a.close(rec.id)
            return
        if info.get("state") == "failed":
            reason = info.get("reason") or ""
            w.send_json("E", {"code": "FAILED", "message": f"sandbox {rec.id} failed: {reason}",
                              "reason": reason})
            return
        w.send_json("C", {"sandbox_id": rec.id})
        start = {"sandbox_id": rec.id, "argv": argv, "env": [], "workdir": "", "stdin": b"",
                 "close_stdin": not ex.get("stdin"), "timeout_seconds": float(ex.get("timeout") or 0),
                 "grace_seconds": float(ex.get("grace") or 0), "close_after": True,
                 "wait_export": bool(ex.get("wait_export"))}
        cancels = []
        state = {"ended": False}

        def cancel_all():
            for cb in cancels:
                try:
                    cb()
                except Exception:  # noqa: BLE001
                    log.exception("dsec run socket: cancelling a step")

        def inputs():
            try:
                while True:
                    f = read_frame(c)
                    if f is None:
                        break
                    k, p = f
                    if k == "i":
                        yield ("stdin", p)
                    elif k == "c":
                        yield ("close_stdin", True)
                    elif k == "s":
                        n = int(json.loads(p))
                        if 0 < n < 65:
                            yield ("signal", n)
            except (OSError, ProtocolError, ValueError):
                pass
            if not state["ended"]:
                cancel_all()            # the client went away mid-step (as a cancelled Exec)

        gen = a.exec_step(start, inputs(), cancels.append, lambda: None, caller)
        try:
            for item in gen:
                k = item[0]
                if k == "started":
                    w.send_json("S", {"step": item[1]})
                elif k == "stdout":
                    w.send("o", item[1])
                elif k == "stderr":
                    w.send("e", item[1])
                elif k == "exit":
                    w.send_json("x", item[1])
        except (BrokenPipeError, ConnectionResetError):
            cancel_all()                # before the generator closes (exec_step's cancel checks that)
            raise
        finally:
            state["ended"] = True
            gen.close()
        if rec.warm:
            a.warm.refill_soon()        # answered: the next `dsec run` finds a ready one (agent/node/warm.py)


def _alive(c) -> bool:
    p = select.poll()
    p.register(c.fileno(), select.POLLRDHUP)
    try:
        return not p.poll(0)
    except OSError:
        return False


def _send_error(w, code: str, message: str):
    try:
        w.send_json("E", {"code": code, "message": message})
    except OSError:
        pass


def _refuse(c, code, message):
    try:
        FrameWriter(c).send_json("E", {"code": code, "message": message})
    except OSError:
        pass
    c.close()
