"""Facts read from ELF files without running them: class, machine, SONAME, and the
`.note.cuda.fwd_compatibility` note of CUDA forward-compatibility libraries.

The files read here may come from a container image, so every byte is hostile input:
  - a file is opened only if it is a regular file (O_NONBLOCK, so a FIFO cannot block us);
  - pyelftools (about 40 ms to import) is imported inside the functions that need it, and only
    parses the ELF header and the section/program header tables, with at most MAX_HEADERS
    entries of each;
  - note and dynamic-section payloads are read by this module in one bounded read each
    (MAX_PAYLOAD bytes) and parsed with struct, so a forged size cannot make us read or loop
    over the whole file;
  - every failure, whatever pyelftools raises, leaves as ValueError.
"""

from __future__ import annotations

import json
import os
import stat
import struct

from ...base.rootpath import FACT_ERRNOS

NOTE_SECTION = ".note.cuda.fwd_compatibility"
NOTE_OWNER = "NVIDIA Corporation"
MAX_HEADERS = 4096        # section or program headers looked at (real libcuda: about 30)
MAX_PAYLOAD = 64 * 1024   # bytes read from one note region or dynamic table
MAX_REGIONS = 64          # note sections/segments walked
MAX_STRING = 4096         # bytes read for the SONAME string

_MACHINES = {"EM_X86_64": "x86_64", "EM_386": "i386", "EM_AARCH64": "aarch64",
             "EM_ARM": "arm", "EM_PPC64": "ppc64", "EM_S390": "s390", "EM_RISCV": "riscv"}
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14


class Unreadable(ValueError):
    """The file could not be read for a reason that says nothing about the file: /proc not
    mounted (the reopen goes through /proc/self/fd), out of file descriptors, no permission,
    an I/O error. An inventory that met one is not a fact about the host to keep."""


def _unreadable(path: str, e: OSError) -> ValueError:
    cls = ValueError if e.errno in FACT_ERRNOS else Unreadable
    return cls(f"not an ELF file: {path}: {e.strerror}")


def _open(path: str, follow_symlinks: bool):
    """A binary file object for a regular file, or ValueError. The path is opened O_PATH first
    (which opens nothing: a FIFO or a device node planted under a library's name is never
    opened, not even non-blocking) and checked on that fd; the file is then reopened for
    reading through the fd, so what is read is the object that was checked."""
    flags = os.O_PATH | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        pfd = os.open(path, flags)
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        return open_checked(pfd, path)
    finally:
        os.close(pfd)


def open_checked(pfd: int, path: str):
    """A binary file object reading the regular file the O_PATH fd `pfd` is on, or ValueError."""
    st = os.fstat(pfd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"not an ELF file: {path}: not a regular file")
    try:
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        # The file is there (pfd is on it): whatever failed here is this process's situation.
        raise Unreadable(f"not an ELF file: {path}: cannot reopen it through /proc/self/fd "
                         f"({e.strerror}; is /proc mounted?)") from None
    try:
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):  # cannot happen: same object
            raise ValueError(f"not an ELF file: {path}: changed while opened")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _load(f, path: str):
    """pyelftools' ELFFile over f; ValueError on anything that is not a sane ELF header."""
    from elftools.elf.elffile import ELFFile

    head = f.read(64)
    if len(head) < 52 or head[:4] != b"\x7fELF":
        raise ValueError(f"not an ELF file: {path}: bad magic or too short")
    try:
        elf = ELFFile(f)
        hdr = elf.header
        # Entry sizes other than the standard ones would make pyelftools read overlapping or
        # huge tables; real files never have them.
        want_sh, want_ph = (40, 32) if elf.elfclass == 32 else (64, 56)
        if hdr["e_shoff"] and hdr["e_shentsize"] != want_sh:
            raise ValueError(f"not an ELF file: {path}: bad section header size {hdr['e_shentsize']}")
        if hdr["e_phoff"] and hdr["e_phentsize"] != want_ph:
            raise ValueError(f"not an ELF file: {path}: bad program header size {hdr['e_phentsize']}")
    except ValueError:
        raise
    except Exception as e:  # pyelftools raises ELFError, ELFParseError, construct errors, ...
        raise ValueError(f"not an ELF file: {path}: {e}") from None
    return elf


def _segments(elf) -> list[dict]:
    """Program headers as plain dicts (at most MAX_HEADERS); [] when the table is unreadable."""
    out: list[dict] = []
    try:
        if not elf["e_phoff"]:
            return out
        n = min(elf["e_phnum"], MAX_HEADERS)  # PN_XNUM (0xffff) is not followed: capped
        for i in range(n):
            h = elf.get_segment(i).header
            out.append({"type": h["p_type"], "offset": h["p_offset"], "filesz": h["p_filesz"],
                        "vaddr": h["p_vaddr"], "align": h["p_align"]})
    except Exception:
        pass
    return out


def _sections(elf) -> list[dict]:
    """Section headers with names (at most MAX_HEADERS); [] when unreadable. Names are ""
    when the section name table is missing or broken (stripped files)."""
    out: list[dict] = []
    try:
        if not elf["e_shoff"]:
            return out
        n = elf["e_shnum"]
        if n == 0:  # extended numbering: the count lives in section 0
            n = elf.get_section(0).header["sh_size"]
        n = min(n, MAX_HEADERS)
    except Exception:
        return out
    for i in range(n):
        try:
            sec = elf.get_section(i)
            h, name = sec.header, sec.name
        except Exception:
            # The header is readable but its name is not (broken or stripped name table):
            # keep it nameless, so the note walk still sees an SHT_NOTE section.
            try:
                h, name = elf._get_section_header(i), ""
            except Exception:
                break
            if h is None:  # past the end of the file (pyelftools before 0.33 says so with None)
                break
        out.append({"type": h["sh_type"], "name": name if isinstance(name, str) else "",
                    "offset": h["sh_offset"], "size": h["sh_size"], "align": h["sh_addralign"]})
    return out


def _read_at(f, offset: int, size: int, limit: int = MAX_PAYLOAD) -> bytes:
    if offset < 0 or size <= 0:
        return b""
    try:
        f.seek(offset)
        return f.read(min(size, limit))
    except (OSError, OverflowError, ValueError):
        return b""


def _notes(data: bytes, little: bool, align: int):
    """(owner, type, desc) for each note in data; stops at the first inconsistent header."""
    end = len(data)
    fmt = "<III" if little else ">III"
    off = 0
    a = align - 1
    while off + 12 <= end:
        namesz, descsz, ntype = struct.unpack_from(fmt, data, off)
        off += 12
        name_end = off + namesz
        desc_off = (name_end + a) & ~a
        desc_end = desc_off + descsz
        if name_end > end or desc_end > end:
            return
        owner = data[off:name_end].rstrip(b"\x00").decode("latin-1")
        yield owner, ntype, data[desc_off:desc_end]
        off = (desc_end + a) & ~a


def _parse_note_json(desc: bytes, where: str) -> dict:
    text = desc.strip(b"\x00 \t\r\n")
    try:
        note = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"malformed {NOTE_SECTION} note in {where}: {e}") from None
    if not isinstance(note, dict):
        raise ValueError(f"malformed {NOTE_SECTION} note in {where}: not a JSON object")
    for key in ("Driver", "Device"):
        if key in note:
            v = note[key]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ValueError(f"malformed {NOTE_SECTION} note in {where}: {key!r} is not a list of integers")
    if "CUDA Version" in note and not isinstance(note["CUDA Version"], (str, int, float)):
        raise ValueError(f"malformed {NOTE_SECTION} note in {where}: 'CUDA Version' is not a version")
    if "Format" in note and (not isinstance(note["Format"], int) or isinstance(note["Format"], bool)):
        raise ValueError(f"malformed {NOTE_SECTION} note in {where}: 'Format' is not an integer")
    return note


def _owner_notes(data: bytes, little: bool, align: int):
    """NVIDIA-owned notes in data, trying the region's alignment, then the other usual one."""
    aligns = [align if align in (4, 8) else 4]
    aligns.append(8 if aligns[0] == 4 else 4)
    for a in aligns:
        found = [desc for owner, _t, desc in _notes(data, little, a) if owner == NOTE_OWNER]
        if found:
            return found
    return []


def elf_facts(path: str, *, follow_symlinks: bool = True) -> dict:
    """{"class": 32|64, "machine": "x86_64"|"i386"|"aarch64"|..., "soname": str|None}.

    ValueError("not an ELF file: ...") for anything unreadable, non-ELF or corrupt headers.
    The SONAME comes from the PT_DYNAMIC segment (present in stripped files too), its string
    table located through DT_STRTAB and the PT_LOAD segments.
    """
    with _open(path, follow_symlinks) as f:
        try:
            elf = _load(f, path)
        except OSError as e:  # the read itself failed (EIO): nothing learnt about the file
            raise Unreadable(f"not an ELF file: {path}: {e.strerror}") from None
        try:
            machine = elf["e_machine"]
            little = elf.little_endian
            elfclass = elf.elfclass
        except Exception as e:
            raise ValueError(f"not an ELF file: {path}: {e}") from None
        if isinstance(machine, int):
            machine = str(machine)
        else:
            machine = _MACHINES.get(machine, machine[3:].lower() if machine.startswith("EM_") else machine)
        return {"class": elfclass, "machine": machine, "soname": _soname(f, little, elfclass, _segments(elf))}


def _soname(f, little: bool, elfclass: int, segments: list[dict]) -> str | None:
    dyn = next((s for s in segments if s["type"] == "PT_DYNAMIC"), None)
    if dyn is None:
        return None
    data = _read_at(f, dyn["offset"], dyn["filesz"])
    fmt = ("<" if little else ">") + ("qQ" if elfclass == 64 else "iI")
    size = struct.calcsize(fmt)
    strtab = soname = None
    for off in range(0, len(data) - size + 1, size):
        tag, val = struct.unpack_from(fmt, data, off)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = val
        elif tag == _DT_SONAME:
            soname = val
    if strtab is None or soname is None:
        return None
    # DT_STRTAB is a virtual address: find the PT_LOAD segment holding it.
    for s in segments:
        if s["type"] == "PT_LOAD" and s["vaddr"] <= strtab < s["vaddr"] + s["filesz"]:
            raw = _read_at(f, s["offset"] + (strtab - s["vaddr"]) + soname, MAX_STRING, MAX_STRING)
            end = raw.find(b"\x00")
            if end <= 0:
                return None
            return raw[:end].decode("utf-8", "replace")
    return None


def fwd_compat_note(path: str, *, follow_symlinks: bool = True, fd: int | None = None) -> dict | None:
    """The parsed JSON of the file's CUDA forward-compatibility note, or None without one.

    Looked for first in the section named .note.cuda.fwd_compatibility, then (stripped files
    lose section names or the whole section table) in every SHT_NOTE section and PT_NOTE
    segment, as a note owned by "NVIDIA Corporation" whose payload is a JSON object.
    ValueError for a file that is not ELF, and for a note that is present but malformed (not
    JSON, not an object, "Driver"/"Device" not lists of integers). With `fd` (an O_PATH fd
    the caller opened and checked), the file is read through it and `path` only names it.
    """
    with (_open(path, follow_symlinks) if fd is None else open_checked(fd, path)) as f:
        elf = _load(f, path)
        little = elf.little_endian
        sections = _sections(elf)
        named = [s for s in sections if s["name"] == NOTE_SECTION]
        for s in named[:1]:
            if s["type"] != "SHT_NOTE":
                raise ValueError(f"malformed {NOTE_SECTION} note in {path}: section type {s['type']}")
            if s["size"] > MAX_PAYLOAD:
                raise ValueError(f"malformed {NOTE_SECTION} note in {path}: section of {s['size']} bytes")
            found = _owner_notes(_read_at(f, s["offset"], s["size"]), little, s["align"])
            if not found:
                raise ValueError(f"malformed {NOTE_SECTION} note in {path}: no note owned by {NOTE_OWNER!r}")
            return _parse_note_json(found[0], path)
        regions = [(s["offset"], s["size"], s["align"]) for s in sections if s["type"] == "SHT_NOTE"]
        regions += [(s["offset"], s["filesz"], s["align"]) for s in _segments(elf) if s["type"] == "PT_NOTE"]
        seen = set()
        for offset, size, align in regions[:MAX_REGIONS]:
            if (offset, size) in seen:
                continue
            seen.add((offset, size))
            for desc in _owner_notes(_read_at(f, offset, size), little, align):
                if desc.lstrip(b"\x00 \t\r\n").startswith(b"{"):
                    return _parse_note_json(desc, path)
        return None
