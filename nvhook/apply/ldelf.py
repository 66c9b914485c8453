"""What ldconfig reads from a shared library: its flags (machine, class, libc generation) and
its SONAME, from the program headers and the dynamic section.

A small reader of its own (no pyelftools: it stays off the start path), for files an image
controls: every read is bounded (headers, program headers, dynamic entries, strings), offsets
are checked against the file's size, and anything ldconfig would skip (not ELF, big-endian, not
a shared object, another machine, no dynamic section or string table) is None.
"""

from __future__ import annotations

import os
import struct

from ..base import ldformat

MAX_PHNUM = 256
MAX_DYN = 4096  # dynamic entries read per library
MAX_NAME = 4096

_INTERPRETERS = {b"/lib/ld-linux.so.2": 3, b"/lib/ld-linux.so.1": 2, b"/lib64/ld-linux-x86-64.so.2": 3,
                 b"/libx32/ld-linux-x32.so.2": 3, b"/lib/ld-linux-aarch64.so.1": 3,
                 b"/lib64/ld64.so.2": 3}
_KNOWN_LIBS = {b"libc.so.6": 3, b"libm.so.6": 3, b"libc.so.5": 2, b"libm.so.5": 2}

_PH64, _PH32 = struct.Struct("<IIQQQQQQ"), struct.Struct("<IIIIIIII")

EM_386, EM_PPC64, EM_X86_64, EM_AARCH64 = 3, 21, 62, 183


def _machine_flags(machine: str, e_machine: int, elf64: bool) -> int | None:
    """ldconfig's per-architecture rule: the flags a library of this machine and class always
    gets (0: the generic ELF/libc5/libc6 guess), or None when ldconfig skips it."""
    if machine == "x86_64":
        if e_machine == EM_X86_64:
            return (ldformat.FLAG_X8664_LIB64 if elf64 else ldformat.FLAG_X8664_LIBX32) | 3
        if e_machine == EM_386 and not elf64:
            return 0
        return None
    if machine == "aarch64":
        return ldformat.FLAG_AARCH64_LIB64 | 3 if e_machine == EM_AARCH64 and elf64 else None
    if machine == "ppc64le":
        return ldformat.FLAG_POWERPC_LIB64 | 3 if e_machine == EM_PPC64 and elf64 else None
    return 0


def _pread(fd: int, n: int, off: int) -> bytes:
    if off < 0 or n <= 0:
        return b""
    return os.pread(fd, n, off)


def _cstring(fd: int, off: int, size: int, head: bytes = b"") -> bytes | None:
    if not 0 <= off < size:
        return None
    if off < len(head):  # most strings are in the first pages, read already
        end = head.find(b"\0", off, off + MAX_NAME + 1)
        if end >= 0:
            return head[off:end]
    data = _pread(fd, min(256, size - off), off)
    end = data.find(b"\0")
    if end < 0:
        data = _pread(fd, min(MAX_NAME + 1, size - off), off)
        end = data.find(b"\0")
        if end < 0:
            return None
    return data[:end]


def read_elf(fd: int, size: int, machine: str) -> tuple[int, bytes | None] | None:
    """(flags, SONAME or None) of the shared library open on `fd`, or None when ldconfig would
    skip it (not ELF, not a shared object, another machine, no dynamic section)."""
    head = _pread(fd, 16384, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[5] != 1:  # little-endian only
        return None
    elf64 = head[4] == 2
    if not elf64 and head[4] != 1:
        return None
    e_type, e_machine = struct.unpack_from("<HH", head, 16)
    base_flag = _machine_flags(machine, e_machine, elf64)
    if base_flag is None or e_type != 3:  # ET_DYN
        return None
    if elf64:
        if len(head) < 64:
            return None
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        ph = _PH64
    else:
        (phoff,) = struct.unpack_from("<I", head, 28)
        phentsize, phnum = struct.unpack_from("<HH", head, 42)
        ph = _PH32
    if phnum > MAX_PHNUM or phoff >= size:
        return None
    phentsize = ph.size  # ldconfig steps by its own struct size, whatever e_phentsize says
    need = phoff + phnum * phentsize
    table = head[phoff:need] if need <= len(head) else _pread(fd, phnum * phentsize, phoff)
    if len(table) < phnum * phentsize:
        return None
    segments = _segments(fd, size, head, table, ph, elf64)
    if segments is None:
        return None
    flag, dyn_off, dyn_size, loads = segments
    if dyn_size == 0 or dyn_off >= size:
        return None
    return _dynamic(fd, size, head, elf64, (dyn_off, dyn_size), loads, base_flag, flag)


def _segments(fd: int, size: int, head: bytes, table: bytes, ph: struct.Struct,
              elf64: bool) -> tuple[int, int, int, list] | None:
    """From the program headers: (flags by the interpreter, the dynamic section's offset and
    size, the PT_LOAD segments as (vaddr, offset, filesz)); None where ldconfig skips the file."""
    flag = ldformat.FLAG_ELF
    dyn_off = dyn_size = 0
    loads = []
    for f in ph.iter_unpack(table):
        p_type = f[0]
        if elf64:
            p_offset, p_vaddr, p_filesz = f[2], f[3], f[5]
        else:
            p_offset, p_vaddr, p_filesz = f[1], f[2], f[4]
        if p_type == 2:  # PT_DYNAMIC
            dyn_off, dyn_size = p_offset, p_filesz
        elif p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 3:  # PT_INTERP
            interp = _cstring(fd, p_offset, size, head)
            if interp is None:
                return None
            if interp in _INTERPRETERS:
                flag = _INTERPRETERS[interp]
    return flag, dyn_off, dyn_size, loads


def _dynamic(fd: int, size: int, head: bytes, elf64: bool, dynamic: tuple[int, int], loads: list,
             base_flag: int | None, flag: int) -> tuple[int, bytes | None] | None:
    """(flags, SONAME or None) from the dynamic section (`dynamic`: its offset and size);
    DT_NEEDED names the C library that sets the flags where the architecture does not."""
    dyn_off, dyn_size = dynamic
    width = 8 if elf64 else 4
    n = min(max(dyn_size, 2 * width), MAX_DYN * 2 * width)
    dyn = head[dyn_off:dyn_off + n] if dyn_off + n <= len(head) else _pread(fd, n, dyn_off)
    words = memoryview(dyn[:len(dyn) - len(dyn) % (2 * width)]).cast("Q" if elf64 else "I").tolist()
    dtags, dvals = words[0::2], words[1::2]
    if 0 in dtags:
        del dtags[dtags.index(0):]
    if 5 not in dtags:  # DT_STRTAB: a virtual address; the PT_LOAD holding it gives the offset
        return None
    val = dvals[dtags.index(5)]
    load = 0
    for vaddr, offset, filesz in loads:
        if vaddr <= val < vaddr + filesz:
            load = vaddr - offset
            break
    strtab = val - load
    if not 0 <= strtab <= size:
        return None
    soname = None
    if base_flag and dtags.count(14) == 1:
        # The architecture fixes the flags, so DT_NEEDED cannot change them, and with one
        # DT_SONAME which entry ldconfig stops at does not matter.
        soname = _cstring(fd, strtab + dvals[dtags.index(14)], size, head)
        if soname is None:
            return None
        return base_flag, soname
    for tag, val in zip(dtags, dvals):  # dvals may be longer (cut at DT_NULL)
        if tag == 1 and flag == ldformat.FLAG_ELF:  # DT_NEEDED
            name = _cstring(fd, strtab + val, size, head)
            if name is None:
                return None
            if name in _KNOWN_LIBS:
                flag = _KNOWN_LIBS[name]
        elif tag == 14:  # DT_SONAME
            name = _cstring(fd, strtab + val, size, head)
            if name is None:
                return None
            soname = name
        if soname is not None and flag != ldformat.FLAG_ELF:
            break
    return (base_flag if base_flag else flag), soname
