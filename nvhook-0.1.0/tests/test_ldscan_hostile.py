"""nvhook's ld.so.cache writer against images built to make it slow or to write where it must
not: every bound ends the work in well under a second with one line naming the problem, the
cache is never written through a planted object, and concurrent writers leave one whole cache.
(The equality with the real ldconfig, and links, FIFOs and device nodes named like libraries,
are in tests/apply/test_ldscan.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvhook.apply import ldscan
from nvhook.apply.paths import Root
from nvhook.base import ldformat
from nvhook.base.errors import HookError

REPO = Path(__file__).resolve().parent.parent
LIBZ = next((p for p in ("/usr/lib/x86_64-linux-gnu/libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1")
             if os.path.exists(p)), None)


def _build(root: Path) -> tuple[bytes, int] | HookError:
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return ldscan.build(Root(fd), [])
    except HookError as e:
        return e
    finally:
        os.close(fd)


def _timed(root: Path) -> tuple[bytes | HookError | tuple, float]:
    t = time.monotonic()
    got = _build(root)
    return got, time.monotonic() - t


def test_ld_so_conf_of_200000_lines_is_refused_at_once(tmp_path):
    """Before: each line was a lookup (16 s for one 1 MiB file, and 256 files are allowed)."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "etc/ld.so.conf").write_text("/lib\n" * 200_000)
    got, took = _timed(tmp_path)
    assert isinstance(got, HookError) and "more than 16384 lines" in got.message, got
    assert took < 1, took
    (tmp_path / "etc/ld.so.conf").write_text("".join(f"/lib/{i}\n" for i in range(10_000)))  # distinct, missing
    got, took = _timed(tmp_path)
    assert isinstance(got, HookError) and "look up more than 4096 paths" in got.message, got
    assert took < 1, took


def test_thousands_of_glibc_hwcaps_subdirectories_are_refused_at_once(tmp_path):
    """Before: a lookup each and a quadratic list of names (30,000: 70 s)."""
    (tmp_path / "etc").mkdir()
    hw = tmp_path / "usr/lib/glibc-hwcaps"
    hw.mkdir(parents=True)
    for i in range(5000):
        (hw / f"h{i}").mkdir()
    (tmp_path / "etc/ld.so.conf").write_text("/usr/lib\n")
    got, took = _timed(tmp_path)
    assert isinstance(got, HookError) and "look up more than 4096 paths" in got.message, got
    assert took < 1, took


@pytest.mark.skipif(LIBZ is None, reason="needs a real shared library to link to")
def test_tens_of_thousands_of_library_links_are_refused_at_once(tmp_path):
    (tmp_path / "etc").mkdir()
    d = tmp_path / "usr/lib"
    d.mkdir(parents=True)
    shutil.copy(LIBZ, d / "libz.so.1")
    for i in range(ldscan.MAX_LIBRARIES + 10):
        os.symlink("libz.so.1", d / f"libq{i}.so.1")
    (tmp_path / "etc/ld.so.conf").write_text("/usr/lib\n")
    got, took = _timed(tmp_path)
    assert isinstance(got, HookError) and f"more than {ldscan.MAX_LIBRARIES} libraries" in got.message, got
    assert took < 1, took


@pytest.mark.skipif(LIBZ is None, reason="needs a real shared library")
def test_symlink_loops_and_links_out_of_the_root_in_conf(tmp_path):
    """Directories that loop, climb out or point at the host resolve inside the root (or not at
    all); the host's directory is never scanned."""
    host = tmp_path / "host"
    host.mkdir()
    shutil.copy(LIBZ, host / "libhostonly.so.1")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "lib").mkdir()
    shutil.copy(LIBZ, root / "lib/libz.so.1")
    os.symlink("loop", root / "loop")
    os.symlink(str(host), root / "abs")
    os.symlink("../../../../../../" + str(host).lstrip("/"), root / "climb")
    (root / "etc/ld.so.conf").write_text("/loop\n/abs\n/climb\n/lib\ninclude /loop/*.conf\n")
    got = _build(root)
    assert isinstance(got, tuple), got
    keys = {k for k, _, _ in ldformat.parse(got[0])}
    assert keys == {"libz.so.1"}


def test_cache_that_is_a_directory_stops_with_one_line(tmp_path):
    (tmp_path / "etc/ld.so.cache").mkdir(parents=True)
    (tmp_path / "etc/ld.so.cache/keep").write_text("image data\n")
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(HookError, match=r"^cannot write the container's /etc/ld.so.cache: Is a directory$"):
            ldscan.write(Root(fd), b"cache")
    finally:
        os.close(fd)
    assert (tmp_path / "etc/ld.so.cache/keep").read_text() == "image data\n"
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["ld.so.cache"]  # no temporary left


_WRITER = r"""
import os, sys
from nvhook.apply import ldscan
from nvhook.apply.paths import Root
root, tag, n = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
r = Root(os.open(root, os.O_PATH | os.O_DIRECTORY))
for i in range(n):
    ldscan.write(r, tag * 4096)
"""


def test_concurrent_writers_leave_one_whole_cache(tmp_path):
    """Two hooks (two containers on one rootfs) writing at once: readers only ever see one
    writer's whole cache, and no temporary file is left."""
    (tmp_path / "etc").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), tag, "300"], cwd=REPO)
             for tag in ("A", "B")]
    seen = set()
    while any(p.poll() is None for p in procs):
        try:
            data = (tmp_path / "etc/ld.so.cache").read_bytes()
        except FileNotFoundError:
            continue
        seen.add(data)
    assert all(p.returncode == 0 for p in procs)
    assert seen <= {b"A" * 4096, b"B" * 4096}, {d[:8] for d in seen}
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["ld.so.cache"]
