"""Serving one container start, in a child of nvhookd (a spare that took a connection).

The child checks its peer (uid 0 by SO_PEERCRED) and the request (listen.check_request), answers
`ready`, and runs the hook's own code (hook.run_hook: the same validation, observe, decide and
apply) with the client's state and options; observing and deciding start while the client's
`go` travels, and the gate holds the first change until it has come. The result (the hook's
exit code and what it wrote to stderr) goes back on the connection; the child then exits, so one
container's state never reaches the next.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import time

from ... import __version__
from ...base import residentwire
from ...base.log import EventLog
from .listen import check_request

REQUEST_TIMEOUT_S = 5.0  # to read a request (the client sends it at once)
GO_TIMEOUT_S = 10.0  # between ready and go (the client answers at once)


def flush(log: EventLog) -> None:
    """Write the daemon's events now (each matters on its own: a refusal, a crash)."""
    log.flush()
    if log.write_error:
        sys.stderr.write(f"nvhookd: {log.write_error}\n")
        log.write_error = None


def serve_connection(conn: socket.socket, t0: float, log: EventLog) -> int:
    """Serve the connection a spare accepted: its peer must be root, then one Request."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    peer_pid, uid = residentwire.peer_uid(conn)
    if uid != 0:
        why = f"peer uid {uid} is not root"
        log.warning("daemon.refused", peer_pid=peer_pid, peer_uid=uid, reason=why)
        flush(log)
        _try_send(conn, {"refused": why, "v": residentwire.PROTOCOL, "nvhook": __version__})
        return 0
    return Request(conn, peer_pid, t0, log).serve()


def _try_send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.settimeout(1.0)
        residentwire.send(conn, obj)
    except OSError:
        pass


class Abandoned(BaseException):
    """The client left before `go`: not an error of the hook's (so not an Exception, which
    run_hook would report as its own failure); the apply step never started."""


class Request:
    """One container start, in its own child of the daemon."""

    def __init__(self, conn: socket.socket, peer_pid: int, t0: float, log: EventLog):
        self.conn = conn
        self.peer_pid = peer_pid
        self.t0 = t0
        self.log = log  # the daemon's log: refusals; the hook's own run logs where its config says
        self.went = False  # the client said go

    def refuse(self, reason: str) -> int:
        self.log.warning("daemon.refused", peer_pid=self.peer_pid, reason=reason)
        flush(self.log)
        _try_send(self.conn, {"refused": reason, "v": residentwire.PROTOCOL, "nvhook": __version__})
        return 0

    def serve(self) -> int:
        try:
            req, fds = residentwire.recv(self.conn, time.monotonic() + REQUEST_TIMEOUT_S, time.monotonic, want_fds=True)
        except residentwire.ResidentWireError as e:
            return self.refuse(f"malformed request: {e}")
        if req.get("v") != residentwire.PROTOCOL or req.get("nvhook") != __version__:
            return self.refuse(f"client nvhook {req.get('nvhook')!s} (protocol {req.get('v')!s}) does not match "
                               f"nvhookd {__version__} (protocol {residentwire.PROTOCOL})")
        problem = check_request(req, fds, self.peer_pid)
        if problem is not None:
            return self.refuse(problem)
        try:
            residentwire.send(self.conn, {"ready": True, "v": residentwire.PROTOCOL, "nvhook": __version__})
        except OSError as e:
            return self.abandoned(str(e.strerror or e))
        # Observing and deciding change nothing, so they start now, while `go` travels; the
        # gate holds the first change (the apply step) until it has come.
        try:
            return self.run_hook(req, fds[0])
        except Abandoned as e:
            return self.abandoned(str(e))

    def gate(self) -> None:
        """Return once the client said `go` (read once: the first host change and the apply
        step both pass here)."""
        if self.went:
            return
        try:
            go, _ = residentwire.recv(self.conn, time.monotonic() + GO_TIMEOUT_S, time.monotonic)
        except residentwire.ResidentWireError as e:
            raise Abandoned(str(e)) from None
        if go.get("go") is not True:
            raise Abandoned("the client sent something else than go")
        self.went = True

    def abandoned(self, why: str) -> int:
        # The client gave up waiting for `ready` and runs the hook itself: nothing applied here.
        self.log.warning("daemon.abandoned", peer_pid=self.peer_pid,
                         reason=f"the client left before go ({why}); nothing was applied")
        flush(self.log)
        return 0

    def run_hook(self, req: dict, pidfd: int) -> int:
        from .. import hook

        if req.get("env_config") is None:  # NVHOOK_CONFIG as the hook had it, not the daemon's own
            os.environ.pop("NVHOOK_CONFIG", None)
        else:
            os.environ["NVHOOK_CONFIG"] = req["env_config"]
        captured = io.StringIO()
        sys.stderr = captured
        opts = dict(req["opts"])
        opts.setdefault("stage", "prestart")
        resident = {"state": req["state"].encode(), "t0": self.t0, "pidfd": pidfd, "gate": self.gate,
                    "log": {"served_by": "nvhookd", "client_pid": self.peer_pid}}
        opts["resident"] = resident
        try:
            code = hook.run_hook(opts)
        finally:
            sys.stderr = sys.__stderr__
        try:
            residentwire.send(self.conn, {"code": code, "stderr": captured.getvalue()})
        except OSError:
            pass  # the client died; its runtime reports the hook's failure
        return 0

