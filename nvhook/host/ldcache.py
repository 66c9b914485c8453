"""Parse glibc's ld.so.cache (format glibc-ld.so.cache1.1, optionally after the old
ld.so-1.7.0 table). Read-only; every offset is bounds-checked, so a corrupt or hostile cache
gives a ValueError, never a wrong path or a crash.
"""

from __future__ import annotations

import struct

NEW_MAGIC = b"glibc-ld.so.cache1.1"
OLD_MAGIC = b"ld.so-1.7.0"
_NEW_HEADER = struct.Struct("<20sII4xI12x")  # magic+version, nlibs, len_strings, flags..., ext offset
_NEW_ENTRY = struct.Struct("<iIIIQ")
_OLD_ENTRY_SIZE = 12

# flags & 0xff00: the architecture ldconfig recorded; flags & 0xff: the ELF type (3 = libc6).
ARCH_BY_FLAGS = {0x0300: "x86_64", 0x0000: "i386", 0x0a00: "aarch64", 0x0500: "ppc64le"}


def parse(data: bytes) -> list[tuple[str, str, str]]:
    """[(key, path, arch)] in cache order (ldconfig's search priority)."""
    base = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < 16:
            raise ValueError("truncated old-format header")
        (nold,) = struct.unpack_from("<I", data, 12)
        base = 16 + nold * _OLD_ENTRY_SIZE
        base = (base + 7) & ~7
        if base > len(data) or data[base:base + len(NEW_MAGIC)] != NEW_MAGIC:
            raise ValueError("old-format cache without the glibc-ld.so.cache1.1 section")
    if data[base:base + len(NEW_MAGIC)] != NEW_MAGIC:
        raise ValueError("not an ld.so.cache (bad magic)")
    if len(data) < base + _NEW_HEADER.size:
        raise ValueError("truncated header")
    _, nlibs, len_strings, _ext = _NEW_HEADER.unpack_from(data, base)
    entries_end = base + _NEW_HEADER.size + nlibs * _NEW_ENTRY.size
    if entries_end > len(data):
        raise ValueError(f"header claims {nlibs} entries but the file is only {len(data)} bytes")

    def string(off: int) -> str:
        start = base + off
        if not entries_end <= start < len(data):
            raise ValueError(f"string offset {off} outside the string table")
        end = data.find(b"\0", start)
        if end < 0:
            raise ValueError("unterminated string")
        return data[start:end].decode("utf-8", "surrogateescape")

    out = []
    for i in range(nlibs):
        flags, key, value, _osv, _hwcap = _NEW_ENTRY.unpack_from(data, base + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        arch = ARCH_BY_FLAGS.get(flags & 0xFF00, f"flags-{flags & 0xFF00:#06x}")
        out.append((string(key), string(value), arch))
    return out


def read(path: str) -> list[tuple[str, str, str]]:
    with open(path, "rb") as f:
        return parse(f.read())
