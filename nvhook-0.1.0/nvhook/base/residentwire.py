"""The resident-mode protocol between the hook (a client) and nvhookd, both sides.

Kept import-light for the hook's start path: `_socket` (not `socket`, which imports enum),
`os` and `_json` through jsonfast. A message is a 4-byte big-endian length and that many bytes
of JSON; file descriptors travel with the request as SCM_RIGHTS.

The exchange, in the order it happens:

  client -> daemon  request  {"v", "nvhook", "opts", "env_config", "state"} + fds
                             [pidfd of the container process, the client's mnt, pid and
                             cgroup namespaces]
  daemon -> client  ready    {"ready": true, "v", "nvhook"}, or
                    refused  {"refused": "<why>", "v", "nvhook"}: nothing was done; the
                             client may run the hook in-process
  client -> daemon  go       {"go": true}: from here on the client waits for the result and
                             never falls back (the daemon may be applying)
  daemon -> client  result   {"code": n, "stderr": "<the lines the hook would print>"}

The daemon applies nothing before it has read `go` (it observes and decides meanwhile: that
changes nothing); a client that gave up before `ready` closes the connection instead of
sending it, and the daemon then stops. A container with nothing to apply may get its result
before the daemon reads `go`. So a fallback can
never run the hook's work a second time: either the daemon never started it, or the client is
committed to the daemon's answer (a daemon that dies after `go` is a failed start, one line).
"""

from __future__ import annotations

import _socket
import os
import sys

from . import jsonfast as json

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Callable

PROTOCOL = 1
# The request carries the OCI state, which the hook reads bounded to 1 MiB, as a JSON string
# (escaped ASCII: at most 3 bytes for each byte of UTF-8); the rest is small.
MAX_MESSAGE = (3 << 20) + (64 << 10)
# Descriptors a request may carry (pidfd + three namespaces); more is a malformed request.
MAX_FDS = 4

SOL_SOCKET = _socket.SOL_SOCKET
SCM_RIGHTS = _socket.SCM_RIGHTS
SO_PEERCRED = _socket.SO_PEERCRED
_INT = 4  # sizeof(int): SCM_RIGHTS carries an int array, SO_PEERCRED three ints
_ORDER = sys.byteorder


class ResidentWireError(Exception):
    """A broken exchange: closed early, over a limit, not our protocol, too slow."""


def encode(obj: dict) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return len(data).to_bytes(4, "big") + data


def connect(path: str, timeout: float) -> _socket.socket:
    """A connected client socket (blocking calls bounded by `timeout` each). Raises OSError."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(path)
    except BaseException:
        s.close()
        raise
    return s


def peer_uid(s: _socket.socket) -> tuple[int, int]:
    """(pid, uid) of the other end, as the kernel recorded them at connect/listen."""
    raw = s.getsockopt(SOL_SOCKET, SO_PEERCRED, 3 * _INT)
    pid = int.from_bytes(raw[0:4], _ORDER, signed=True)
    uid = int.from_bytes(raw[4:8], _ORDER)
    return pid, uid


def send(s: _socket.socket, obj: dict | bytes, fds: list[int] | tuple = ()) -> None:
    """Send `obj` (or bytes `encode` made of it) with `fds`."""
    data = obj if isinstance(obj, bytes) else encode(obj)
    if fds:
        anc = [(SOL_SOCKET, SCM_RIGHTS, b"".join(fd.to_bytes(_INT, _ORDER) for fd in fds))]
        n = s.sendmsg([data], anc)
    else:
        n = s.send(data)
    if n < len(data):
        s.sendall(data[n:])


def recv(s: _socket.socket, deadline: float, clock: Callable[[], float], *,
         want_fds: bool = False) -> tuple[dict, list[int]]:
    """One message, and the descriptors that came with its first bytes, before `deadline`
    (on `clock`, a monotonic time function). Raises ResidentWireError; descriptors received with a
    message that is then refused are closed."""
    fds: list[int] = []
    try:
        head = _read(s, 4, deadline, clock, fds if want_fds else None)
        size = int.from_bytes(head, "big")
        if size > MAX_MESSAGE:
            raise ResidentWireError(f"message of {size} bytes is over the limit of {MAX_MESSAGE}")
        body = _read(s, size, deadline, clock, None)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ResidentWireError(f"message is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ResidentWireError("message is not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return obj, fds


def _read(s: _socket.socket, n: int, deadline: float, clock: Callable[[], float], fds: list[int] | None) -> bytes:
    buf = b""
    while len(buf) < n:
        left = deadline - clock()
        if left <= 0:
            raise ResidentWireError("no answer in time")
        s.settimeout(left)
        try:
            if fds is not None and not buf:
                data, anc, flags, _ = s.recvmsg(n, _socket.CMSG_SPACE(MAX_FDS * _INT), _socket.MSG_CMSG_CLOEXEC)
                _take_fds(anc, flags, fds)
            else:
                data = s.recv(n - len(buf))
        except TimeoutError:
            raise ResidentWireError("no answer in time") from None
        except OSError as e:
            raise ResidentWireError(f"connection broken: {e.strerror or e}") from None
        if not data:
            raise ResidentWireError("connection closed" + (f" after {len(buf)} of {n} bytes" if buf else ""))
        buf += data
    return buf


def _take_fds(anc: list, flags: int, fds: list[int]) -> None:
    for level, kind, data in anc:
        if level == SOL_SOCKET and kind == SCM_RIGHTS:
            whole = len(data) - len(data) % _INT
            fds.extend(int.from_bytes(data[i:i + _INT], _ORDER) for i in range(0, whole, _INT))
    if flags & _socket.MSG_CTRUNC:
        raise ResidentWireError(f"more than {MAX_FDS} descriptors sent")
