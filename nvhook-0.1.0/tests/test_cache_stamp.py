"""The inventory cache never serves a host that changed: what `nvhook list` (the installed
console script, a real cache directory) reports after the host changes without ld.so.cache
changing -- a library gone and back, a Debian alternatives switch, a link retargeted in place,
a library, binary or firmware file that appears -- and after a scan that could not read the
libraries (no /proc), which must never be cached as the host's truth."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hostfix import NVHOOK, copy_host, events, fx, named, nvhook, private_dir, write_config  # noqa: F401

DRIVER = "535.261.03"
DEBIAN_DRIVER = "525.147.05"
LIB64 = "usr/lib/x86_64-linux-gnu"


class Host:
    """A fixture host copy, its config (private cache dir, debug log) and `nvhook list`."""

    def __init__(self, fx: Path, name: str, tmp_path: Path) -> None:
        self.root = copy_host(fx, name, tmp_path / "hosts")
        self.cache = private_dir(tmp_path / "cache")
        self.log = tmp_path / "nvhook.log"
        self.conf = write_config(tmp_path / "hook.toml", cache_dir=self.cache)
        self.ldcache = self.root / "etc/ld.so.cache"
        self._ldcache = self._ldcache_ident()

    def _ldcache_ident(self) -> tuple:
        st = os.stat(self.ldcache)
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, self.ldcache.read_bytes()

    def list(self, *prefix: str) -> tuple[dict[str, str], list[dict]]:
        """{container path: host path} of `nvhook list`, and the log events of that run. The
        host's ld.so.cache must be as it was at the start: nothing here may depend on it."""
        self.log.unlink(missing_ok=True)
        argv = ["--config", str(self.conf), "--root", str(self.root), "--log-file", str(self.log),
                "--log-level", "debug", "list", "--format", "json"]
        if prefix:
            p = subprocess.run([*prefix, *NVHOOK, *argv], capture_output=True, text=True, timeout=120)
        else:
            p = nvhook(*argv)
        assert p.returncode == 0, p.stderr
        assert self._ldcache_ident() == self._ldcache, "the test changed ld.so.cache"
        rows = json.loads(p.stdout)
        return {r["container_path"]: r["host_path"] for r in rows}, events(self.log)

    def cached(self, evs: list[dict]) -> bool:
        """Whether the run was served from the cache (and did not rebuild)."""
        hit, built = named(evs, "inventory.cache_hit"), named(evs, "inventory.built")
        assert bool(hit) != bool(built), evs
        return bool(hit)

    def warm(self) -> dict[str, str]:
        """Build the cache, and prove that an unchanged host is then served from it."""
        first, evs = self.list()
        assert not self.cached(evs) and named(evs, "inventory.built")[0]["cached"] is True
        again, evs = self.list()
        assert self.cached(evs) and again == first
        return first


def _swap_link(link: Path, target: str) -> None:
    """Replace a symlink the way dpkg and update-alternatives do: a new link renamed over it."""
    tmp = link.with_name(link.name + ".dpkg-tmp")
    os.symlink(target, tmp)
    os.rename(tmp, link)


def test_library_gone_and_back(fx, tmp_path):
    """A package being reinstalled: the file is missing at one start; once it is back, the
    next start has it (the cached inventory that lacked it is not served)."""
    h = Host(fx, "host-gpu1", tmp_path)
    want = f"/{LIB64}/libnvidia-ml.so.{DRIVER}"
    assert want in h.warm()
    lib = h.root / want.lstrip("/")
    os.rename(lib, tmp_path / "away")
    gone, evs = h.list()
    assert want not in gone and not h.cached(evs)
    assert any(e["library"] == "libnvidia-ml.so" for e in named(evs, "library.skipped"))
    gone_again, evs = h.list()
    assert want not in gone_again and h.cached(evs)  # a missing file is a fact that can be cached ...
    os.rename(tmp_path / "away", lib)
    back, evs = h.list()
    assert back.get(want) == str(lib) and not h.cached(evs)  # ... until it is back
    _, evs = h.list()
    assert h.cached(evs)


def test_debian_alternatives_switch(fx, tmp_path):
    """update-alternatives retargets /etc/alternatives/* and leaves ld.so.cache alone: the next
    start gives containers the library the alternative now names."""
    h = Host(fx, "host-debian", tmp_path)
    current = f"/{LIB64}/nvidia/current/libcuda.so.{DEBIAN_DRIVER}"
    assert current in h.warm()
    other = h.root / LIB64 / "nvidia/tesla" / f"libcuda.so.{DEBIAN_DRIVER}"
    other.parent.mkdir()
    shutil.copy2(h.root / current.lstrip("/"), other)
    alt = h.root / "etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu"
    _swap_link(alt, f"/{LIB64}/nvidia/tesla/libcuda.so.{DEBIAN_DRIVER}")
    after, evs = h.list()
    assert not h.cached(evs)
    assert current not in after
    assert after[f"/{LIB64}/nvidia/tesla/libcuda.so.{DEBIAN_DRIVER}"] == str(other)
    _, evs = h.list()
    assert h.cached(evs)


def test_link_retargeted_in_place(fx, tmp_path):
    """The soname link ld.so.cache names is replaced by one to another copy of the library,
    carrying the old link's mtime: its inode and target differ, nothing ld.so.cache records."""
    h = Host(fx, "host-gpu1", tmp_path)
    old = f"/{LIB64}/libcuda.so.{DRIVER}"
    assert old in h.warm()
    link = h.root / LIB64 / "libcuda.so.1"
    new_dir = h.root / LIB64 / "v2"
    new_dir.mkdir()
    shutil.copy2(h.root / old.lstrip("/"), new_dir / f"libcuda.so.{DRIVER}")
    target = f"v2/libcuda.so.{DRIVER}"
    st = os.lstat(link)
    link.unlink()
    os.symlink(target, link)
    os.utime(link, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    after, evs = h.list()
    assert not h.cached(evs)
    assert old not in after and after[f"/{LIB64}/v2/libcuda.so.{DRIVER}"] == str(new_dir / f"libcuda.so.{DRIVER}")


@pytest.mark.parametrize("what", ["library", "binary", "firmware"])
def test_new_file_appears(fx, tmp_path, what):
    """Something that was not there when the cache was built and appears later (a package
    unpacked after the first container started): seen at the next start."""
    h = Host(fx, "host-gpu1", tmp_path)
    if what == "library":  # ld.so.cache lists the soname link; link and file come later
        path = f"/{LIB64}/libnvidia-ptxjitcompiler.so.{DRIVER}"
        moved = [h.root / LIB64 / "libnvidia-ptxjitcompiler.so.1", h.root / path.lstrip("/")]
    elif what == "binary":
        path = "/usr/bin/nvidia-smi"
        moved = [h.root / path.lstrip("/")]
    else:
        fw = sorted((h.root / f"lib/firmware/nvidia/{DRIVER}").glob("gsp*.bin"))
        assert fw, "the fixture host has GSP firmware"
        path = "/" + str(fw[0].relative_to(h.root))
        moved = [fw[0]]
    pairs = [(src, tmp_path / f"saved{i}") for i, src in enumerate(moved)]
    for src, dst in pairs:
        os.rename(src, dst)
    before = h.warm()
    assert path not in before
    for src, dst in pairs:
        os.rename(dst, src)
    after, evs = h.list()
    assert not h.cached(evs)
    assert after[path] == str(h.root / path.lstrip("/"))


def test_scan_without_proc_is_not_cached(fx, tmp_path):
    """Without /proc the libraries cannot be read (nvhook reopens each through /proc/self/fd):
    that run says so and serves what it could, but does not cache it; the next run, with
    /proc, has every library."""
    h = Host(fx, "host-gpu1", tmp_path)
    no_proc = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs none /proc && exec "$@"', "sh"]
    blind, evs = h.list(*no_proc)
    assert not any(p.endswith(f"libcuda.so.{DRIVER}") for p in blind)
    (inc,) = named(evs, "inventory.incomplete")
    assert inc["level"] == "warning" and "/proc" in inc["first"]
    assert named(evs, "inventory.built")[0]["cached"] is False
    assert not list(h.cache.glob("inventory*.json"))
    seen, evs = h.list()
    assert not h.cached(evs)
    assert seen[f"/{LIB64}/libcuda.so.{DRIVER}"] == str(h.root / LIB64 / f"libcuda.so.{DRIVER}")
    _, evs = h.list()
    assert h.cached(evs)


EMFILE_SCAN = """
import json, os, sys
from nvhook.observe.host import cache, elf, inventory
import elftools.elf.elffile  # imported now: the scan below has one descriptor to spare
root, cache_dir = sys.argv[1:]
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(held.pop())  # one left: each library's O_PATH open takes it, its reopen gets EMFILE
files = inventory.build_files(root)
for fd in held:
    os.close(fd)
print(json.dumps({"incomplete": files["incomplete"], "libraries": len(files["libraries"]),
                  "stored": cache.store(cache_dir, files)}))
"""


def test_scan_out_of_file_descriptors_is_not_cached(fx, tmp_path):
    """EMFILE while reading the libraries (a real one: every descriptor but one in use) is the
    scanning process's state, not the host's: that inventory is not written to the cache."""
    import sys

    h = Host(fx, "host-gpu1", tmp_path)
    p = subprocess.run([sys.executable, "-c", EMFILE_SCAN, str(h.root), str(h.cache)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["libraries"] == 0 and out["stored"] is False
    assert out["incomplete"] and "Too many open files" in out["incomplete"][0]
    assert not list(h.cache.glob("inventory*.json"))
    seen, evs = h.list()
    assert not h.cached(evs) and seen[f"/{LIB64}/libcuda.so.{DRIVER}"]
