"""The runtime's side of NRI for the plugin's tests off the node: the NRI socket, the mux, ttrpc
and the messages encoded by protobuf's own code (nri_api.proto compiled with grpcio-tools), so
that nvhook's hand-written encoding is checked against the library's."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

PROTO = Path(__file__).resolve().parent / "nri_api.proto"
PLUGIN = "nri.pkg.api.v1alpha1.Plugin"
_pb = None


def pb():
    global _pb
    if _pb is None:
        from protogen import compiled

        _pb = compiled(PROTO, "nri")
    return _pb


class Runtime:
    """One accepted plugin connection."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.buf = {1: b"", 2: b""}
        self.stream = 1
        self.answers: dict[int, bytes] = {}  # replies read while waiting for another stream's

    def _frame(self) -> None:
        hdr = self._exact(8)
        cid, n = struct.unpack(">II", hdr)
        self.buf[cid] += self._exact(n)

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.conn.recv(n - len(out))
            if not chunk:
                raise EOFError("plugin closed the connection")
            out += chunk
        return out

    def read(self, conn: int) -> tuple[int, int, bytes]:
        while True:
            b = self.buf[conn]
            if len(b) >= 10:
                length, stream, typ, _flags = struct.unpack(">IIBB", b[:10])
                if len(b) >= 10 + length:
                    self.buf[conn] = b[10 + length:]
                    return stream, typ, b[10:10 + length]
            self._frame()

    def send_raw(self, conn: int, stream: int, typ: int, body: bytes) -> None:
        msg = struct.pack(">IIBB", len(body), stream, typ, 0) + body
        self.conn.sendall(struct.pack(">II", conn, len(msg)) + msg)

    def accept_registration(self):
        stream, typ, body = self.read(2)
        req = pb().TtrpcRequest.FromString(body)
        reg = pb().RegisterPluginRequest.FromString(req.payload)
        self.send_raw(2, stream, 2, pb().TtrpcResponse(payload=pb().Empty().SerializeToString()).SerializeToString())
        return req, reg

    def send(self, method: str, message, service: str = PLUGIN, raw: bytes | None = None) -> int:
        """Send a request without waiting for its answer; its stream id (for `answer`)."""
        self.stream += 2
        payload = raw if raw is not None else message.SerializeToString()
        req = pb().TtrpcRequest(service=service, method=method, payload=payload, timeout_nano=2_000_000_000)
        self.send_raw(1, self.stream, 1, req.SerializeToString())
        return self.stream

    def answer(self, stream: int):
        """(status code, status message, payload) of the plugin's answer on `stream`; answers
        to other streams that come first are kept for their own `answer`."""
        while stream not in self.answers:
            got, typ, body = self.read(1)
            assert typ == 2 and got not in self.answers, (got, typ)
            self.answers[got] = body
        resp = pb().TtrpcResponse.FromString(self.answers.pop(stream))
        return resp.status.code, resp.status.message, resp.payload

    def call(self, method: str, message, service: str = PLUGIN, raw: bytes | None = None):
        """(status code, status message, payload) of the plugin's answer."""
        return self.answer(self.send(method, message, service, raw))
