"""glibc's ld.so.cache format, both ways: `parse` (bytes -> entries, used on the host's cache)
and `build` (entries -> the bytes glibc 2.36's ldconfig writes for them), plus `sort_key`, the
order the dynamic loader's binary search relies on.

Pure: no I/O. Facts from glibc's elf/cache.c, elf/dl-cache.c, elf/stringtable.c (2.33-2.36):

  - new format ("glibc-ld.so.cache1.1"): a 48-byte header (magic+version, nlibs, len_strings,
    one flags byte (2 = little endian), 3 pad bytes, extension_offset, 3 unused words), then
    24-byte entries {int32 flags, u32 key, u32 value, u32 osversion, u64 hwcap}, then the
    string table. String offsets count from the start of the new header.
  - the old format ("ld.so-1.7.0", written before the new one by glibc < 2.32 by default): a
    16-byte header, 12-byte entries {int32 flags, u32 key, u32 value}, their count rounded up
    to an even number (the last one repeated) so that the new header lands 8-aligned; the old
    entries' offsets count from the end of the old table.
  - entries are sorted by key in *descending* `_dl_cache_libcmp` order (runs of digits compared
    as numbers), then by flags (higher first), then glibc-hwcaps entries before the others and
    among them by subdirectory name (strcmp); equal entries keep the order they were added in.
  - the string table is deduplicated with tail merging: distinct strings sorted by their
    reversed bytes, descending (a string before its own suffixes), and a string that is a
    suffix of the one before it shares its bytes.
  - after the strings, at the next multiple of 4: the extension directory (magic 0xeaa42174,
    count, then {tag, flags, offset, size} per section): tag 0 the generator string, tag 1
    (only when glibc-hwcaps entries exist) an array of u32 string offsets, one per used
    subdirectory name in strcmp order; an entry from a glibc-hwcaps subdirectory has
    hwcap = 1 << 62 | its name's index in that array.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False  # typing and collections.abc cost milliseconds on the start path
if TYPE_CHECKING:
    from collections.abc import Iterable

NEW_MAGIC = b"glibc-ld.so.cache1.1"
OLD_MAGIC = b"ld.so-1.7.0"
NEW_HEADER = struct.Struct("<20sII4xI12x")  # read: the flags byte is not checked
_NEW_HEADER_W = struct.Struct("<20sIIB3xI12x")
NEW_ENTRY = struct.Struct("<iIIIQ")
_OLD_HEADER = struct.Struct("<11sxI")
_OLD_ENTRY = struct.Struct("<iII")
_EXT_HEADER = struct.Struct("<II")
_EXT_SECTION = struct.Struct("<IIII")
EXT_MAGIC = 0xEAA42174
ENDIAN_LITTLE = 2
HWCAP_EXTENSION = 1 << 62

# flags & 0xff: the ELF type (1 ELF, 2 libc5, 3 libc6); flags & 0xff00: the ABI ldconfig saw.
FLAG_ELF = 0x0001
FLAG_ELF_LIBC5 = 0x0002
FLAG_ELF_LIBC6 = 0x0003
FLAG_X8664_LIB64 = 0x0300
FLAG_X8664_LIBX32 = 0x0800
FLAG_POWERPC_LIB64 = 0x0500
FLAG_AARCH64_LIB64 = 0x0A00
ARCH_BY_FLAGS = {0x0300: "x86_64", 0x0000: "i386", 0x0A00: "aarch64", 0x0500: "ppc64le"}

# No key or path in a real cache is longer than PATH_MAX. Bounding each string, decoding each
# offset once and capping the total keeps parsing linear in the file size: a hostile cache
# whose entries all point at one long string would otherwise cost O(entries x length).
MAX_STRING = 4096


class Entry:
    """One cache entry: key (the SONAME), value (the path the loader opens), flags, and the
    glibc-hwcaps subdirectory name it came from (None for a plain directory)."""

    __slots__ = ("key", "value", "flags", "hwcaps")

    def __init__(self, key: bytes, value: bytes, flags: int, hwcaps: bytes | None = None):
        self.key, self.value, self.flags, self.hwcaps = key, value, flags, hwcaps

    def __repr__(self) -> str:
        return f"Entry({self.key!r}, {self.value!r}, {self.flags:#06x}, {self.hwcaps!r})"


# Byte -> its value as a signed C char, plus 128 (so that it fits a byte); digits -> 0, others -> 1.
_SIGNED = bytes((c + 128) & 0xFF for c in range(256))
_KIND = bytes(0 if 48 <= c <= 57 else 1 for c in range(256))
_RUN = (1 << 32) + 128  # added to a digit run: above every byte value


def libcmp_key(name: bytes) -> tuple:
    """A tuple of ints whose Python order is `_dl_cache_libcmp`'s: any byte other than a digit
    is its value as a signed C char (plus 128), so bytes >= 0x80 sort before the end of the
    string, which is 0 (+128); a run of digits is one element, its value wrapped to a C int,
    placed above every byte. Runs are found with C-level `find`, not a loop per byte."""
    kinds = name.translate(_KIND)
    out: list[int] = []
    pos, n = 0, len(name)
    while pos < n:
        d = kinds.find(0, pos)
        if d < 0:
            d = n
        if d > pos:
            out += name[pos:d].translate(_SIGNED)
        if d == n:
            break
        e = kinds.find(1, d)
        if e < 0:
            e = n
        v = int(name[d:e]) & 0xFFFFFFFF  # a name is at most 4096 bytes: int() accepts it
        out.append((v - (1 << 32) if v & 0x80000000 else v) + _RUN)
        pos = e
    out.append(128)
    return tuple(out)


def libcmp(a: bytes, b: bytes) -> int:
    """The sign of glibc's `_dl_cache_libcmp(a, b)`."""
    ka, kb = libcmp_key(a), libcmp_key(b)
    return (ka > kb) - (ka < kb)


def sort_key(e: Entry) -> tuple:
    """Sorting entries by this key *descending* (reverse=True, which Python keeps stable)
    gives ldconfig's order."""
    if e.hwcaps is None:
        tail: tuple = (0,)
    else:  # before plain entries, and among themselves by name, ascending
        tail = (1, tuple(255 - b for b in e.hwcaps) + (255,))
    return (libcmp_key(e.key), e.flags, tail)


def sort_entries(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=sort_key, reverse=True)


def _string_table(strings: Iterable[bytes]) -> tuple[bytes, dict[bytes, int]]:
    """glibc's tail-merged string table: (bytes, {string: offset})."""
    order = sorted(set(strings), key=lambda s: s[::-1], reverse=True)
    if not order:
        return b"", {}
    offsets: dict[bytes, int] = {}
    prev = order[0]
    offsets[prev] = 0
    for cur in order[1:]:
        if len(prev) >= len(cur) and prev.endswith(cur):
            offsets[cur] = offsets[prev] + len(prev) - len(cur)
        else:
            offsets[cur] = offsets[prev] + len(prev) + 1
        prev = cur
    buf = bytearray(offsets[prev] + len(prev) + 1)
    for s, off in offsets.items():
        buf[off:off + len(s)] = s
    return bytes(buf), offsets


def build(entries: list[Entry], *, hwcaps_seen: Iterable[bytes] = (), generator: bytes = b"nvhook",
          old_format: bool = False) -> bytes:
    """The cache file for `entries`, which must be in ldconfig's order already (`sort_entries`).

    `hwcaps_seen`: every glibc-hwcaps subdirectory name ldconfig found, used or not (their
    names go into the string table even when they hold no library). `generator`: the text of
    the generator extension (ldconfig writes its own version string there). `old_format`: the
    old+new layout that glibc before 2.32 writes."""
    used = sorted({e.hwcaps for e in entries if e.hwcaps is not None})
    index = {name: i for i, name in enumerate(used)}
    strings = [s for e in entries for s in (e.key, e.value)]
    strings += list(hwcaps_seen) + used
    table, offsets = _string_table(strings)

    n = len(entries)
    new_size = NEW_HEADER.size + n * NEW_ENTRY.size  # also where the strings start
    old = b""
    if old_format:
        n_old = (n + 1) & ~1
        rows = [_OLD_ENTRY.pack(e.flags, new_size + offsets[e.key], new_size + offsets[e.value])
                for e in entries]
        if n_old > n:
            rows.append(rows[-1])
        old = _OLD_HEADER.pack(OLD_MAGIC, n_old) + b"".join(rows)
        old += b"\0" * (-len(old) % 8)
    ext_offset = len(old) + new_size + len(table)
    ext_offset += -ext_offset % 4

    rows = []
    for e in entries:
        hwcap = 0 if e.hwcaps is None else HWCAP_EXTENSION | index[e.hwcaps]
        rows.append(NEW_ENTRY.pack(e.flags, new_size + offsets[e.key], new_size + offsets[e.value], 0, hwcap))
    header = _NEW_HEADER_W.pack(NEW_MAGIC, n, len(table), ENDIAN_LITTLE, ext_offset)

    nsect = 2 if used else 1
    after_dir = ext_offset + _EXT_HEADER.size + nsect * _EXT_SECTION.size
    hw_array = b"".join(struct.pack("<I", new_size + offsets[name]) for name in used)
    sections = [_EXT_SECTION.pack(0, 0, after_dir + len(hw_array), len(generator))]
    if used:
        sections.append(_EXT_SECTION.pack(1, 0, after_dir, len(hw_array)))
    body = old + header + b"".join(rows) + table
    body += b"\0" * (ext_offset - len(body))
    return body + _EXT_HEADER.pack(EXT_MAGIC, nsect) + b"".join(sections) + hw_array + generator


def parse(data: bytes) -> list[tuple[str, str, str]]:
    """[(key, path, arch)] in cache order (ldconfig's search priority). Every offset is
    bounds-checked, so a corrupt or hostile cache gives a ValueError, never a wrong path."""
    base = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < 16:
            raise ValueError("truncated old-format header")
        (nold,) = struct.unpack_from("<I", data, 12)
        base = 16 + nold * _OLD_ENTRY.size
        base = (base + 7) & ~7
        if base > len(data) or data[base:base + len(NEW_MAGIC)] != NEW_MAGIC:
            raise ValueError("old-format cache without the glibc-ld.so.cache1.1 section")
    if data[base:base + len(NEW_MAGIC)] != NEW_MAGIC:
        raise ValueError("not an ld.so.cache (bad magic)")
    if len(data) < base + NEW_HEADER.size:
        raise ValueError("truncated header")
    _, nlibs, _len_strings, _ext = NEW_HEADER.unpack_from(data, base)
    entries_end = base + NEW_HEADER.size + nlibs * NEW_ENTRY.size
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
        flags, key, value, _osv, _hwcap = NEW_ENTRY.unpack_from(data, base + NEW_HEADER.size + i * NEW_ENTRY.size)
        arch = ARCH_BY_FLAGS.get(flags & 0xFF00, f"flags-{flags & 0xFF00:#06x}")
        out.append((string(key), string(value), arch))
    return out
