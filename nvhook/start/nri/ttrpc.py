"""ttrpc over NRI's connection multiplexer, as much of both as an NRI plugin needs.

NRI puts two ttrpc connections on one unix socket (containerd/nri pkg/net/multiplex): every
chunk on the socket is framed as [conn id uint32 BE][length uint32 BE][bytes]; conn 1 carries
the plugin's service (the runtime calls Configure, Synchronize, CreateContainer, ... and the
plugin answers), conn 2 the runtime's service (the plugin calls RegisterPlugin). Each conn is
a byte stream of ttrpc messages: [length uint32 BE][stream id uint32 BE][type u8][flags u8]
then a protobuf Request (type 1) or Response (type 2), their fields named in base/nrischema.py.
A client numbers its streams with odd ids from 1.

No ttrpc library exists for Python (the gRPC stack speaks HTTP/2, not ttrpc), and the subset
is small: this module reads frames, reassembles messages per conn, and writes replies. One
thread reads; replies may be sent from several (the plugin answers a StartContainer from its own
thread, so that one container's slow start holds no other's answer): each message is written
whole under a lock.
"""

from __future__ import annotations

import socket
import struct
import threading

from ...base import nrischema as s
from ...base import protobuf as pb

PLUGIN_CONN = 1  # the runtime calls the plugin's service here
RUNTIME_CONN = 2  # the plugin calls the runtime's service here
MUX_HEADER = struct.Struct(">II")
TTRPC_HEADER = struct.Struct(">IIBB")
TYPE_REQUEST, TYPE_RESPONSE = 1, 2
MAX_MESSAGE = 4 << 20  # ttrpc's own limit
# The largest mux frame nvhook sends. The Go side hands each frame to ttrpc's reader in one
# Read, which fails (ENOMEM, and the runtime drops the plugin) for a frame larger than the
# buffer that Read is given: bufio's 4096 bytes. So the ttrpc header goes in a frame of its own,
# as the Go writer sends it, and the body in frames of at most 4096 bytes.
MAX_CHUNK = 4096

# gRPC status codes used in replies.
OK, INVALID_ARGUMENT, UNIMPLEMENTED, INTERNAL = 0, 3, 12, 13


class ConnectionClosed(Exception):
    pass


class ProtocolError(Exception):
    """The stream itself is broken (a frame or message header that cannot be right): the
    connection must be dropped, unlike a bad message body, which is refused alone."""


class Message:
    __slots__ = ("conn", "stream", "type", "flags", "body")

    def __init__(self, conn: int, stream: int, type_: int, flags: int, body: bytes):
        self.conn, self.stream, self.type, self.flags, self.body = conn, stream, type_, flags, body


class Mux:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._rbuf = bytearray()
        self._streams: dict[int, bytearray] = {PLUGIN_CONN: bytearray(), RUNTIME_CONN: bytearray()}
        self._next_stream = 1
        self._send_lock = threading.Lock()

    @classmethod
    def dial(cls, path: str, timeout: float | None = None) -> Mux:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        s.settimeout(None)
        return cls(s)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionClosed("the runtime closed the NRI connection")
        self._rbuf += data

    def read(self) -> Message:
        """The next complete ttrpc message on either conn (blocking)."""
        while True:
            for conn, buf in self._streams.items():
                msg = self._take(conn, buf)
                if msg is not None:
                    return msg
            while len(self._rbuf) < MUX_HEADER.size:
                self._recv()
            conn, n = MUX_HEADER.unpack_from(self._rbuf)
            if n > MAX_MESSAGE + TTRPC_HEADER.size:
                raise ProtocolError(f"mux frame of {n} bytes on conn {conn}")
            while len(self._rbuf) < MUX_HEADER.size + n:
                self._recv()
            chunk = bytes(self._rbuf[MUX_HEADER.size:MUX_HEADER.size + n])
            del self._rbuf[:MUX_HEADER.size + n]
            if conn not in self._streams:
                raise ProtocolError(f"mux frame for unknown conn {conn}")
            self._streams[conn] += chunk

    @staticmethod
    def _take(conn: int, buf: bytearray) -> Message | None:
        if len(buf) < TTRPC_HEADER.size:
            return None
        length, stream, type_, flags = TTRPC_HEADER.unpack_from(buf)
        if length > MAX_MESSAGE:
            raise ProtocolError(f"ttrpc message of {length} bytes on conn {conn} (limit {MAX_MESSAGE})")
        end = TTRPC_HEADER.size + length
        if len(buf) < end:
            return None
        body = bytes(buf[TTRPC_HEADER.size:end])
        del buf[:end]
        return Message(conn, stream, type_, flags, body)

    def send(self, conn: int, stream: int, type_: int, body: bytes) -> None:
        header = TTRPC_HEADER.pack(len(body), stream, type_, 0)
        out = bytearray(MUX_HEADER.pack(conn, len(header)) + header)
        for i in range(0, len(body), MAX_CHUNK):
            piece = body[i:i + MAX_CHUNK]
            out += MUX_HEADER.pack(conn, len(piece)) + piece
        with self._send_lock:
            self.sock.sendall(out)

    def reply(self, req: Message, payload: bytes = b"", code: int = OK, error: str = "") -> None:
        body = bytearray()
        if code != OK:
            status = bytearray()
            pb.put_varint(status, s.TtrpcStatus.code, code)
            pb.put_string(status, s.TtrpcStatus.message, error)
            pb.put_message(body, s.TtrpcResponse.status, bytes(status))
        if payload:
            pb.put_bytes(body, s.TtrpcResponse.payload, payload)
        self.send(req.conn, req.stream, TYPE_RESPONSE, bytes(body))

    def call(self, service: str, method: str, payload: bytes, timeout_s: float = 0.0) -> int:
        """Send a request on the runtime conn; returns its stream id (the answer comes through
        read(), as a response on RUNTIME_CONN with that stream id)."""
        stream = self._next_stream
        self._next_stream += 2
        body = bytearray()
        f = s.TtrpcRequest
        pb.put_string(body, f.service, service)
        pb.put_string(body, f.method, method)
        pb.put_bytes(body, f.payload, payload)
        if timeout_s:
            pb.put_varint(body, f.timeout_nano, int(timeout_s * 1e9))
        self.send(RUNTIME_CONN, stream, TYPE_REQUEST, bytes(body))
        return stream


def parse_request(body: bytes) -> tuple[str, str, bytes]:
    """(service, method, payload) of a ttrpc Request; pb.ProtobufError if malformed."""
    msg = pb.decode(body)
    f = s.TtrpcRequest
    payload = msg.get(f.payload, [b""])[-1]
    if not isinstance(payload, bytes):
        raise pb.ProtobufError("request payload is not bytes")
    return pb.string(msg, f.service), pb.string(msg, f.method), payload


def parse_response(body: bytes) -> tuple[int, str, bytes]:
    """(status code, status message, payload) of a ttrpc Response."""
    msg = pb.decode(body)
    status = pb.message(msg, s.TtrpcResponse.status)
    payload = msg.get(s.TtrpcResponse.payload, [b""])[-1]
    return (pb.integer(status, s.TtrpcStatus.code), pb.string(status, s.TtrpcStatus.message),
            payload if isinstance(payload, bytes) else b"")
