"""nvhook.observe.host.elf: ELF facts and the CUDA forward-compatibility note, on real ELF files built by
tests/fixtures/make_fixtures.py, stripped and corrupted copies of them, and random bytes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

import imagefix
import pytest
from fuzzscale import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import cpu_seconds

from nvhook.observe.host import elf

NOTE = imagefix.NOTE_CUDA113


@pytest.fixture(scope="module")
def lib() -> bytes:
    return imagefix.compat_lib("465.19.01", NOTE).read_bytes()


def write(tmp_path, data: bytes, name: str = "libcuda.so.465.19.01") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def patch(data: bytes, offset: int, fmt: str, *values) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


# ELF64 header offsets
E_SHOFF, E_PHNUM, E_SHENTSIZE, E_SHNUM, E_SHSTRNDX = 40, 56, 58, 60, 62


def test_facts_of_a_compat_libcuda():
    assert elf.elf_facts(str(imagefix.compat_lib())) == {"class": 64, "machine": "x86_64",
                                                          "soname": "libcuda.so.1"}


def test_facts_of_a_32bit_library():
    obj = imagefix.make_fixtures.compile_driver_lib("libcuda", "535.261.03", "libcuda.so.1", m32=True)
    assert elf.elf_facts(str(obj)) == {"class": 32, "machine": "i386", "soname": "libcuda.so.1"}


def test_facts_of_a_handmade_aarch64_header(tmp_path):
    hdr = bytearray(64)
    hdr[:7] = b"\x7fELF\x02\x01\x01"
    struct.pack_into("<HHI", hdr, 16, 3, 183, 1)  # ET_DYN, EM_AARCH64
    struct.pack_into("<H", hdr, 52, 64)
    assert elf.elf_facts(write(tmp_path, bytes(hdr))) == {"class": 64, "machine": "aarch64", "soname": None}


def test_note_is_read():
    assert elf.fwd_compat_note(str(imagefix.compat_lib("465.19.01", NOTE))) == NOTE


def test_no_note_is_none():
    assert elf.fwd_compat_note(str(imagefix.compat_lib("465.19.01", None))) is None


def test_note_found_without_section_headers(tmp_path, lib):
    """sstrip-like: no section header table at all; the PT_NOTE segment still has it."""
    stripped = patch(lib, E_SHOFF, "<Q", 0)
    stripped = patch(stripped, E_SHNUM, "<HH", 0, 0)
    path = write(tmp_path, stripped)
    assert elf.fwd_compat_note(path) == NOTE
    assert elf.elf_facts(path)["soname"] == "libcuda.so.1"


def test_note_found_without_section_names(tmp_path, lib):
    """Section name table index broken: names are lost, SHT_NOTE sections remain."""
    path = write(tmp_path, patch(lib, E_SHSTRNDX, "<H", 0xFEFF))
    assert elf.fwd_compat_note(path) == NOTE


def test_note_with_other_nvidia_notes_first(tmp_path, lib):
    """An NVIDIA note whose payload is not JSON is not the compat note when found by walking."""
    start = lib.index(b"NVIDIA Corporation")
    desc = lib.index(b"{", start)
    # Turn the payload into non-JSON binary, then strip section headers so only walking finds it.
    bad = lib[:desc] + b"\x01" + lib[desc + 1:]
    bad = patch(bad, E_SHOFF, "<Q", 0)
    bad = patch(bad, E_SHNUM, "<HH", 0, 0)
    assert elf.fwd_compat_note(write(tmp_path, bad)) is None


@pytest.mark.parametrize("note, message", [
    ([450, 460], "not a JSON object"),
    ({"Driver": "460"}, "'Driver' is not a list of integers"),
    ({"Device": [1, "2"]}, "'Device' is not a list of integers"),
    ({"Device": [True]}, "'Device' is not a list of integers"),
    ({"Format": "1"}, "'Format' is not an integer"),
])
def test_malformed_note_values(note, message):
    obj = imagefix.make_fixtures.compile_driver_lib("libcuda", "465.19.01", "libcuda.so.1", note=note)
    with pytest.raises(ValueError, match=message):
        elf.fwd_compat_note(str(obj))


def test_malformed_note_json(tmp_path, lib):
    desc = lib.index(b'{"Format"')
    bad = lib[:desc] + b"{{{" + lib[desc + 3:]
    with pytest.raises(ValueError, match="malformed"):
        elf.fwd_compat_note(write(tmp_path, bad))


def test_note_header_with_huge_sizes(tmp_path, lib):
    start = lib.index(b"NVIDIA Corporation") - 12
    bad = patch(lib, start, "<II", 19, 0xFFFFFFFF)
    with pytest.raises(ValueError, match="no note owned"):
        elf.fwd_compat_note(write(tmp_path, bad))
    bad = patch(lib, start, "<II", 0xFFFFFFF0, 10)
    with pytest.raises(ValueError, match="no note owned"):
        elf.fwd_compat_note(write(tmp_path, bad))


def test_huge_header_counts_are_bounded(tmp_path, lib):
    """e_phnum/e_shnum at their maximum with tables pointing into the file: no hang."""
    bad = patch(lib, E_PHNUM, "<H", 0xFFFF)
    bad = patch(bad, E_SHNUM, "<H", 0xFF00)
    bad = patch(bad, E_SHOFF, "<Q", 64)
    path = write(tmp_path, bad + b"\x00" * 4_000_000)
    with cpu_seconds() as took:
        for fn in (elf.elf_facts, elf.fwd_compat_note):
            try:
                fn(path)
            except ValueError:
                pass
    assert took.seconds < 10, f"{took.seconds:.1f} s of CPU"


def test_bad_entry_sizes_are_not_elf(tmp_path, lib):
    with pytest.raises(ValueError, match="not an ELF file"):
        elf.elf_facts(write(tmp_path, patch(lib, E_SHENTSIZE, "<H", 0)))


@pytest.mark.parametrize("content", [b"", b"\x7fEL", b"#!/bin/sh\necho hi\n", b"\x7fELF" + b"\xff" * 60,
                                     b"\x7fELF\x02\x01\x01" + b"\x00" * 9])
def test_not_elf(tmp_path, content):
    path = write(tmp_path, content)
    with pytest.raises(ValueError, match="not an ELF file"):
        elf.elf_facts(path)
    with pytest.raises(ValueError, match="not an ELF file"):
        elf.fwd_compat_note(path)


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "libcuda.so.999.1"
    os.mkfifo(fifo)
    for fn in (elf.elf_facts, elf.fwd_compat_note):
        with pytest.raises(ValueError, match="not a regular file"):
            fn(str(fifo))
        with pytest.raises(ValueError, match="not a regular file"):
            fn(str(tmp_path))
        with pytest.raises(ValueError, match="not an ELF file"):
            fn(str(tmp_path / "missing"))


def test_nofollow(tmp_path):
    link = tmp_path / "libcuda.so.465.19.01"
    os.symlink(imagefix.compat_lib(), link)
    assert elf.fwd_compat_note(str(link)) == NOTE
    with pytest.raises(ValueError, match="not an ELF file"):
        elf.fwd_compat_note(str(link), follow_symlinks=False)


def test_real_system_library():
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    if not os.path.exists(libc):
        pytest.skip("no glibc at the Debian path")
    facts = elf.elf_facts(libc)
    assert facts["class"] == 64 and facts["soname"] == "libc.so.6"
    assert elf.fwd_compat_note(libc) is None


def _check(path: str) -> None:
    for fn in (elf.elf_facts, elf.fwd_compat_note):
        try:
            fn(path)
        except ValueError:
            pass


_FUZZ = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        _check(f.name)


@_FUZZ
@given(st.binary(min_size=0, max_size=64))
def test_fuzz_random_elf_headers(tail):
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"\x7fELF" + bytes([1 + len(tail) % 2, 1 + len(tail) % 3 % 2, 1]) + tail)
        f.flush()
        _check(f.name)


@_FUZZ
@given(st.data())
def test_fuzz_mutated_compat_lib(data):
    """Flip bytes of a real compat libcuda, mostly in its headers and note, or truncate it."""
    lib = imagefix.compat_lib().read_bytes()
    buf = bytearray(lib)
    note_at = lib.index(b"NVIDIA Corporation") - 12
    for _ in range(data.draw(st.integers(1, 8))):
        region = data.draw(st.sampled_from(["header", "note", "anywhere"]))
        if region == "header":
            pos = data.draw(st.integers(0, 63))
        elif region == "note":
            pos = data.draw(st.integers(note_at, min(note_at + 140, len(buf) - 1)))
        else:
            pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(buf))))
    if cut is not None:
        del buf[cut:]
    with tempfile.NamedTemporaryFile() as f:
        f.write(bytes(buf))
        f.flush()
        _check(f.name)


def test_fwd_compat_note_json_roundtrip_of_fixture_note():
    # The note the fixtures write is the JSON the real compat libraries carry.
    assert json.loads(json.dumps(NOTE)) == elf.fwd_compat_note(str(imagefix.compat_lib()))


def test_copy_keeps_note(tmp_path):
    dst = tmp_path / "copy.so"
    shutil.copyfile(imagefix.compat_lib(), dst)
    assert elf.fwd_compat_note(str(dst)) == NOTE
