"""Protocol Buffers wire format, by hand, for the few NRI messages nvhook reads and writes.

Why not generated code and the protobuf library: the plugin uses a few dozen fields of NRI's API,
the nodes have no compiler (protoc would be an install-time step on every distribution's
python3 from 3.9 on), and the wire format is five rules (varint, zigzag-free int64 as
two's complement, length-delimited, fixed32/64 skipped). This module knows no message: the
fields are named in base/nrischema.py, decoded into typed objects in base/nrimessages.py;
tests/test_nri_schema.py round-trips generated messages through this codec and protobuf's own
code compiled from the .proto.

A decoded message is {field number: [values]}: a varint is an int, a length-delimited field
bytes (a nested message, string or packed list: the reader knows which). Unknown fields are
kept and ignored, as protobuf does, so a newer runtime's additions do not break the plugin.
"""

from __future__ import annotations


class ProtobufError(ValueError):
    """A message that is not valid protobuf (truncated, bad wire type, runaway varint)."""


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int32/int64 negatives: ten bytes, two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    end = len(buf)
    while True:
        if i >= end:
            raise ProtobufError("truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7
        if shift > 63:
            raise ProtobufError("varint longer than 10 bytes")


def decode(buf: bytes) -> dict[int, list]:
    """{field: [values]} of one message (see the module docstring)."""
    fields: dict[int, list] = {}
    i, end = 0, len(buf)
    while i < end:
        key, i = _read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise ProtobufError("field number 0")
        v: int | bytes
        if wt == 0:
            v, i = _read_varint(buf, i)
        elif wt == 2:
            n, i = _read_varint(buf, i)
            if i + n > end:
                raise ProtobufError(f"field {num}: length {n} past the end of the message")
            v = bytes(buf[i:i + n])
            i += n
        elif wt == 1:
            if i + 8 > end:
                raise ProtobufError("truncated fixed64")
            v, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wt == 5:
            if i + 4 > end:
                raise ProtobufError("truncated fixed32")
            v, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ProtobufError(f"field {num}: unsupported wire type {wt}")
        fields.setdefault(num, []).append(v)
    return fields


def string(msg: dict, num: int, default: str = "") -> str:
    v = msg.get(num)
    if not v:
        return default
    if not isinstance(v[-1], bytes):
        raise ProtobufError(f"field {num}: a string was expected")
    return v[-1].decode("utf-8", "replace")


def strings(msg: dict, num: int) -> list[str]:
    out = []
    for v in msg.get(num, ()):
        if not isinstance(v, bytes):
            raise ProtobufError(f"field {num}: a string was expected")
        out.append(v.decode("utf-8", "replace"))
    return out


def integer(msg: dict, num: int, default: int = 0) -> int:
    v = msg.get(num)
    if not v:
        return default
    if not isinstance(v[-1], int):
        raise ProtobufError(f"field {num}: a number was expected")
    n = v[-1]
    return n - (1 << 64) if n >= 1 << 63 else n


def message(msg: dict, num: int) -> dict:
    v = msg.get(num)
    if not v:
        return {}
    if not isinstance(v[-1], bytes):
        raise ProtobufError(f"field {num}: a message was expected")
    return decode(v[-1])


def messages(msg: dict, num: int) -> list[dict]:
    out = []
    for v in msg.get(num, ()):
        if not isinstance(v, bytes):
            raise ProtobufError(f"field {num}: a message was expected")
        out.append(decode(v))
    return out


# -- encoding: fields appended to a bytearray, in field order ------------------------------

def put_varint(out: bytearray, num: int, n: int) -> None:
    out += _varint(num << 3)
    out += _varint(n)


def put_bytes(out: bytearray, num: int, data: bytes) -> None:
    out += _varint(num << 3 | 2)
    out += _varint(len(data))
    out += data


def put_string(out: bytearray, num: int, s: str) -> None:
    if s:
        put_bytes(out, num, s.encode("utf-8"))


def put_strings(out: bytearray, num: int, items: list[str] | tuple[str, ...]) -> None:
    """A repeated string: every item, an empty one too (it is an element, not a default)."""
    for item in items:
        put_bytes(out, num, item.encode("utf-8"))


def put_bool(out: bytearray, num: int, b: bool) -> None:
    if b:
        put_varint(out, num, 1)


def put_message(out: bytearray, num: int, body: bytes) -> None:
    put_bytes(out, num, body)
