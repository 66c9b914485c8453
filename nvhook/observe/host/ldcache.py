"""Parse glibc's ld.so.cache (format glibc-ld.so.cache1.1, optionally after the old
ld.so-1.7.0 table). Read-only; every offset is bounds-checked, so a corrupt or hostile cache
gives a ValueError, never a wrong path or a crash.
"""

from __future__ import annotations

import os
import stat
import struct

NEW_MAGIC = b"glibc-ld.so.cache1.1"
OLD_MAGIC = b"ld.so-1.7.0"
_NEW_HEADER = struct.Struct("<20sII4xI12x")  # magic+version, nlibs, len_strings, flags..., ext offset
_NEW_ENTRY = struct.Struct("<iIIIQ")
_OLD_ENTRY_SIZE = 12

# flags & 0xff00: the architecture ldconfig recorded; flags & 0xff: the ELF type (3 = libc6).
ARCH_BY_FLAGS = {0x0300: "x86_64", 0x0000: "i386", 0x0a00: "aarch64", 0x0500: "ppc64le"}

# No key or path in a real cache is longer than PATH_MAX. Bounding each string, decoding each
# offset once and capping the total keeps the work linear in the file size: a hostile cache
# whose entries all point at one long string would otherwise cost O(entries x length).
MAX_STRING = 4096


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

    strings: dict[int, str] = {}
    budget = [4 * len(data) + 65536]  # characters decoded in all: real caches use < 1x

    def string(off: int) -> str:
        if off in strings:
            return strings[off]
        start = base + off
        if not entries_end <= start < len(data):
            raise ValueError(f"string offset {off} outside the string table")
        end = data.find(b"\0", start, start + MAX_STRING + 1)
        if end < 0:
            raise ValueError(f"unterminated string at offset {off} (or longer than {MAX_STRING} bytes)")
        budget[0] -= end - start
        if budget[0] < 0:
            raise ValueError("entries reference more string data than the file holds")
        text = strings[off] = data[start:end].decode("utf-8", "surrogateescape")
        return text

    out = []
    for i in range(nlibs):
        flags, key, value, _osv, _hwcap = _NEW_ENTRY.unpack_from(data, base + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        arch = ARCH_BY_FLAGS.get(flags & 0xFF00, f"flags-{flags & 0xFF00:#06x}")
        out.append((string(key), string(value), arch))
    return out


def read(path: str) -> list[tuple[str, str, str]]:
    """OSError when unreadable (FileNotFoundError when missing), ValueError when corrupt or not
    a regular file (opened non-blocking: a FIFO there must not hang the hook)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        return parse(f.read())
