"""nvhook.observe.host.ldcache: ld.so.cache files written by the real ldconfig (new and old+new
formats, 64- and 32-bit entries), compared with what `ldconfig -p` reads from the same file;
and corrupt, truncated and hostile bytes, which must give ValueError and nothing else."""

from __future__ import annotations

import platform
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from fuzzscale import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvhook.observe.host import ldcache

LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not Path(LDCONFIG).exists()
                                or shutil.which("gcc") is None,
                                reason="needs x86_64 with gcc (-m32) and ldconfig")

SRC = "int nvhook_test_symbol(void) { return 42; }\n"


def _gcc(out: Path, soname: str, *, m32: bool = False, needs_libc: Path | None = None) -> None:
    src = out.with_suffix(".c")
    src.write_text(SRC)
    cmd = ["gcc", *(["-m32"] if m32 else []), "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{soname}",
           str(src), "-o", str(out)]
    if needs_libc is not None:
        cmd += ["-Wl,--no-as-needed", str(needs_libc)]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> dict[str, Path]:
    """Shared objects compiled once: 64-bit, 32-bit without DT_NEEDED (ldconfig files it as
    "ELF"), and 32-bit with DT_NEEDED libc.so.6 (filed as "libc6", like the driver's)."""
    d = tmp_path_factory.mktemp("ldobjs")
    libc32 = d / "libc32.so"
    _gcc(libc32, "libc.so.6", m32=True)
    objs = {"foo64": d / "foo64", "bar64": d / "bar64", "foo32": d / "foo32", "only32": d / "only32"}
    _gcc(objs["foo64"], "libfoo.so.1")
    _gcc(objs["bar64"], "libbar.so.5")
    _gcc(objs["foo32"], "libfoo.so.1", m32=True, needs_libc=libc32)
    _gcc(objs["only32"], "libonly32.so.2", m32=True)
    return objs


def make_tree(root: Path, objects: dict[str, Path]) -> Path:
    """A root with /lib64 (64-bit) and /lib32 (32-bit) libraries and an ld.so.conf."""
    for rel, key in (("lib64/libfoo.so.1.2.3", "foo64"), ("lib64/libbar.so.5.0", "bar64"),
                     ("lib32/libfoo.so.1.2.3", "foo32"), ("lib32/libonly32.so.2.7", "only32")):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(objects[key], p)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/ld.so.conf").write_text("/lib64\n/lib32\n")
    return root


def run_ldconfig(root: Path, fmt: str = "new", cache: str = "/etc/ld.so.cache") -> Path:
    """The real ldconfig on a tree: -r keeps its trusted directories inside the tree too, -i
    keeps it away from the system's aux cache. -C and -f name files inside the root."""
    subprocess.run([LDCONFIG, "-i", "-r", str(root), "-c", fmt, "-C", cache, "-f", "/etc/ld.so.conf"],
                   check=True, capture_output=True)
    return root / cache.lstrip("/")


_P_LINE = re.compile(r"^\t(\S+) \(([^)]*)\) => (.+)$")


def ldconfig_p(cache: Path) -> list[tuple[str, str, str]]:
    """What glibc's own reader sees in a cache file: `ldconfig -p -C FILE`."""
    out = subprocess.run([LDCONFIG, "-p", "-C", str(cache)], check=True, capture_output=True, text=True).stdout
    entries = []
    for line in out.splitlines():
        m = _P_LINE.match(line)
        if m:
            key, flags, path = m.groups()
            arch = "x86_64" if "x86-64" in flags else "aarch64" if "AArch64" in flags else "i386"
            entries.append((key, path, arch))
    assert re.search(rf"^{len(entries)} libs found in cache", out, re.M), out
    return entries


@pytest.fixture
def tree(tmp_path, objects) -> Path:
    return make_tree(tmp_path / "root", objects)


EXPECTED = {
    ("libfoo.so.1", "/lib64/libfoo.so.1", "x86_64"),
    ("libfoo.so.1", "/lib32/libfoo.so.1", "i386"),
    ("libbar.so.5", "/lib64/libbar.so.5", "x86_64"),
    ("libonly32.so.2", "/lib32/libonly32.so.2", "i386"),
}


# --- real caches ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_real_cache_matches_ldconfig_p(tree, fmt):
    """Both formats ldconfig writes today (new; old+new "compat"): same entries, same order,
    same architectures as glibc's reader, including both 32-bit flag kinds (libc6 and ELF)."""
    cache = run_ldconfig(tree, fmt)
    if fmt == "compat":
        assert cache.read_bytes().startswith(ldcache.OLD_MAGIC)
    else:
        assert cache.read_bytes().startswith(ldcache.NEW_MAGIC)
    got = ldcache.read(str(cache))
    assert got == ldconfig_p(cache)
    assert set(got) == EXPECTED
    assert len(got) == len(EXPECTED)


def test_compat_and_new_formats_give_the_same_entries(tree):
    new = ldcache.read(str(run_ldconfig(tree, "new", "/etc/new.cache")))
    compat = ldcache.read(str(run_ldconfig(tree, "compat", "/etc/compat.cache")))
    assert new == compat


def test_32_and_64_bit_entries_of_one_soname_are_both_listed(tree):
    got = ldcache.read(str(run_ldconfig(tree)))
    foo = [(path, arch) for key, path, arch in got if key == "libfoo.so.1"]
    assert sorted(foo) == [("/lib32/libfoo.so.1", "i386"), ("/lib64/libfoo.so.1", "x86_64")]


def test_entries_are_in_cache_order(tree):
    """Cache order is the search priority inventory relies on to pick among duplicates."""
    cache = run_ldconfig(tree)
    data = cache.read_bytes()
    got = ldcache.parse(data)
    # Re-derive the order from the raw entry table: key offsets in table order.
    _, nlibs, _, _ = ldcache.NEW_HEADER.unpack_from(data, 0)
    keys = []
    for i in range(nlibs):
        _, key, _, _, _ = ldcache.NEW_ENTRY.unpack_from(data, ldcache.NEW_HEADER.size + i * ldcache.NEW_ENTRY.size)
        keys.append(data[key:data.index(b"\0", key)].decode())
    assert [k for k, _, _ in got] == keys


def test_old_format_only_is_rejected_with_a_reason(tree):
    """ldconfig -c old writes only the libc5-era table, without architectures: not accepted."""
    cache = run_ldconfig(tree, "old")
    data = cache.read_bytes()
    assert data.startswith(ldcache.OLD_MAGIC) and ldcache.NEW_MAGIC not in data
    with pytest.raises(ValueError, match="glibc-ld.so.cache1.1"):
        ldcache.parse(data)


def test_system_cache_matches_ldconfig_p():
    """The machine's own /etc/ld.so.cache, hundreds of entries, read like glibc reads it."""
    path = Path("/etc/ld.so.cache")
    if not path.is_file():
        pytest.skip("no /etc/ld.so.cache here")
    got = ldcache.read(str(path))
    assert got == ldconfig_p(path)
    assert len(got) > 10


def test_fixture_host_caches_match_ldconfig_p(fixtures_root):
    """The fixture hosts' caches (driver libraries, 32-bit ones on host-gpu8)."""
    for name in ("host-gpu8", "host-debian", "host-broken"):
        cache = fixtures_root / name / "etc/ld.so.cache"
        got = ldcache.read(str(cache))
        assert got == ldconfig_p(cache), name
    gpu8 = ldcache.read(str(fixtures_root / "host-gpu8/etc/ld.so.cache"))
    assert ("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1", "i386") in gpu8
    assert ("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "x86_64") in gpu8


def test_architecture_comes_from_the_entry_flags(tree):
    data = bytearray(run_ldconfig(tree).read_bytes())
    base = ldcache.NEW_HEADER.size
    flags = {0x0303: "x86_64", 0x0003: "i386", 0x0001: "i386", 0x0a03: "aarch64", 0x0503: "ppc64le",
             0x0b03: "flags-0x0b00"}
    for value, arch in flags.items():
        struct.pack_into("<i", data, base, value)
        assert ldcache.parse(bytes(data))[0][2] == arch


def test_read_missing_file_is_an_oserror(tmp_path):
    """Missing is not corrupt: the caller reports the two differently."""
    with pytest.raises(FileNotFoundError):
        ldcache.read(str(tmp_path / "nope"))


# --- corrupt and hostile bytes ------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory, objects) -> dict[str, bytes]:
    root = make_tree(tmp_path_factory.mktemp("ldreal"), objects)
    return {fmt: run_ldconfig(root, fmt, f"/etc/{fmt}.cache").read_bytes() for fmt in ("new", "compat")}


def _check(data: bytes) -> list | None:
    """parse() either returns well-formed entries or raises ValueError (anything else fails)."""
    try:
        out = ldcache.parse(data)
    except ValueError:
        return None
    assert isinstance(out, list)
    for entry in out:
        assert isinstance(entry, tuple) and len(entry) == 3 and all(isinstance(x, str) for x in entry)
    return out


@pytest.mark.parametrize("data, message", [
    (b"", "bad magic"),
    (b"\x7fELF" + bytes(60), "bad magic"),
    (ldcache.NEW_MAGIC, "truncated header"),
    (ldcache.NEW_MAGIC + bytes(27), "truncated header"),
    (ldcache.OLD_MAGIC + b"\0", "truncated old-format header"),
    (ldcache.OLD_MAGIC + b"\0" + struct.pack("<I", 0xFFFFFFFF) + bytes(64), "without the glibc"),
    (ldcache.NEW_MAGIC + struct.pack("<II", 0xFFFFFFFF, 0) + bytes(20), "claims 4294967295 entries"),
])
def test_hostile_headers(data, message):
    with pytest.raises(ValueError, match=message):
        ldcache.parse(data)


def test_fixture_badcache_is_a_valueerror(fixtures_root):
    data = (fixtures_root / "host-badcache/etc/ld.so.cache").read_bytes()
    with pytest.raises(ValueError):
        ldcache.parse(data)


def _set_entry(data: bytes, index: int, field: int, value: int) -> bytes:
    """Overwrite field 1 (key) or 2 (value) of entry `index` of a new-format cache."""
    b = bytearray(data)
    struct.pack_into("<I", b, ldcache.NEW_HEADER.size + index * ldcache.NEW_ENTRY.size + 4 * field, value)
    return bytes(b)


@pytest.mark.parametrize("field", [1, 2])
def test_string_offsets_outside_the_string_table(real, field):
    data = real["new"]
    end_of_entries = ldcache.NEW_HEADER.size + len(ldcache.parse(data)) * ldcache.NEW_ENTRY.size
    for bad in (0, 8, end_of_entries - 1, len(data), len(data) + 100, 0xFFFFFFFF):
        with pytest.raises(ValueError, match="outside the string table"):
            ldcache.parse(_set_entry(data, 0, field, bad))


def test_unterminated_string(real):
    data = real["new"]
    b = bytearray(data)
    # Point entry 0's key at the last byte and make that byte non-NUL.
    b[-1] = ord("x")
    with pytest.raises(ValueError, match="unterminated"):
        ldcache.parse(_set_entry(bytes(b), 0, 1, len(b) - 1))


@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_every_truncation(real, fmt):
    """A cut anywhere: ValueError, or (cut in the trailing extension data) the same entries."""
    data = real[fmt]
    full = ldcache.parse(data)
    for n in range(len(data)):
        got = _check(data[:n])
        assert got is None or got == full, n


_FUZZ = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data):
    _check(data)


@_FUZZ
@given(st.sampled_from([ldcache.NEW_MAGIC, ldcache.OLD_MAGIC + b"\0"]), st.binary(max_size=512))
def test_random_bytes_after_a_valid_magic(magic, data):
    _check(magic + data)


@_FUZZ
@given(data=st.data())
def test_mutated_real_caches(real, data):
    """Random byte flips and random 32-bit values over real caches' headers and tables."""
    fmt = data.draw(st.sampled_from(["new", "compat"]))
    b = bytearray(real[fmt])
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            pos = data.draw(st.integers(0, len(b) - 1))
            b[pos] = data.draw(st.integers(0, 255))
        else:
            pos = data.draw(st.integers(0, (min(len(b), 256) - 4) // 4)) * 4
            struct.pack_into("<I", b, pos, data.draw(st.sampled_from(
                [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(b), len(b) - 1]) | st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        b = b[:data.draw(st.integers(0, len(b)))]
    _check(bytes(b))
