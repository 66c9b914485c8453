"""A musl-based container image for tests, as Alpine lays one out: musl's loader at
/lib/ld-musl-x86_64.so.1, no glibc loader, no ld.so.cache, /etc/alpine-release, the static
busybox of the fixtures, and /usr/bin/musl-probe, a program linked against musl that dlopen()s
libcuda.so.1 and prints what musl's loader answers.

musl comes from Debian's own archive (`apt-get download musl musl-dev`, unpacked with
dpkg -x; no registry), kept per machine under the tests' cache directory; the probe is built
with the machine's gcc against musl's crt files and headers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CACHE = Path(os.environ.get("NVHOOK_TEST_CACHE", "/var/cache/nvhook-tests"))
PACKAGES = ("musl", "musl-dev")
LOADER = "/lib/ld-musl-x86_64.so.1"

PROBE_C = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h) printf("DLOPEN: ok\n"); else printf("DLOPEN: %s\n", dlerror());
    return 0;
}
"""


def _musl_tree() -> Path:
    """musl's packages unpacked (cached per machine); RuntimeError when they cannot be had."""
    out = CACHE / "musl-debs"
    if (out / "x" / LOADER.lstrip("/")).exists():
        return out / "x"
    tmp = Path(f"{out}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        p = subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, capture_output=True, text=True, timeout=180)
        if p.returncode != 0:
            raise RuntimeError(f"apt-get download {' '.join(PACKAGES)}: {p.stderr.strip()[-300:]}")
        for deb in tmp.glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(tmp / "x")], check=True, capture_output=True, timeout=60)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "x"


def skip_reason() -> str | None:
    if shutil.which("gcc") is None:
        return "no gcc to build the musl probe"
    try:
        _musl_tree()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"musl from Debian's archive is not available: {e}"
    return None


def build_probe(out: Path) -> Path:
    tree = _musl_tree()
    lib = tree / "usr/lib/x86_64-linux-musl"
    src = out.with_suffix(".c")
    src.write_text(PROBE_C)
    gcc_inc = subprocess.run(["gcc", "-print-file-name=include"], capture_output=True, text=True,
                             check=True).stdout.strip()
    subprocess.run(["gcc", "-nostdinc", "-isystem", str(tree / "usr/include/x86_64-linux-musl"), "-isystem", gcc_inc,
                    "-nostdlib", "-pie", "-o", str(out), str(lib / "Scrt1.o"), str(lib / "crti.o"), str(src),
                    f"-L{tree / 'lib/x86_64-linux-musl'}", "-lc", str(lib / "crtn.o"),
                    f"-Wl,-dynamic-linker,{LOADER}"], check=True, capture_output=True, text=True, timeout=120)
    return out


def make_musl(root: Path) -> None:
    """Turn a fixture image (container-rhel's layout: /lib -> usr/lib, /lib64 -> usr/lib64)
    into a musl one: glibc's loader, libc and ldconfig gone, musl's loader and the probe in."""
    tree = _musl_tree()
    for rel in ("usr/lib64/ld-linux-x86-64.so.2", "usr/sbin/ldconfig", "etc/ld.so.cache", "etc/redhat-release"):
        (root / rel).unlink(missing_ok=True)
    for lib in (root / "usr/lib64").glob("lib*.so*"):
        lib.unlink()
    loader = root / LOADER.lstrip("/")
    loader.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(tree / LOADER.lstrip("/")), loader)
    (root / "etc/alpine-release").write_text("3.20.0\n")
    (root / "etc/os-release").write_text('NAME="Alpine Linux"\nID=alpine\nVERSION_ID=3.20.0\n')
    build_probe(root / "usr/bin/musl-probe")
    (root / "usr/bin/musl-probe.c").unlink()
