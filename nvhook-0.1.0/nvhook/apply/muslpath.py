"""Images whose dynamic loader is musl's (Alpine, busybox:musl, Void musl, distroless-musl).

musl's loader reads no /etc/ld.so.cache and no ld.so.conf: it searches LD_LIBRARY_PATH, then
the directories listed in /etc/ld-musl-ARCH.path (newlines or colons between them), and only
when that file does not exist its built-in "/lib:/usr/local/lib:/usr/lib". A glibc cache
written into such an image is never read, so the driver directories go into the path file
instead: the file's own entries kept first and in order (or, where the image has none, the
built-in default it replaces), the driver directories appended once each. The file is replaced
atomically through an fd on /etc resolved inside the rootfs (ldscan.write), so a link planted
at its name is replaced, never written through.

What that buys: musl's loader finds libcuda.so.1 and the other driver libraries. It cannot run
them: they are glibc's (libc.so.6, GLIBC_2.x symbol versions). CUDA programs and nvidia-smi in
a musl image need glibc compatibility in the image (Alpine's gcompat gives the glibc loader
name and libc.so.6; CUDA is still not supported by NVIDIA there) or a glibc image.

An image that has musl's loader and a glibc loader (Debian with the musl package, Alpine with a
glibc package) is a glibc image here: its ld.so.cache is written as usual.
"""

from __future__ import annotations

import os
import time

from ..base.errors import HookError
from .ldconf import read_regular
from .paths import Root

# musl's name for the machine, and where glibc's loader is on it.
_ARCHES = {"x86_64": ("x86_64", "/lib64/ld-linux-x86-64.so.2"),
           "aarch64": ("aarch64", "/lib/ld-linux-aarch64.so.1")}
DEFAULT_PATH = ("/lib", "/usr/local/lib", "/usr/lib")  # musl's built-in search path
MAX_PATH_FILE = 64 << 10


def _real_name(root: Root, path: str) -> str | None:
    """The final file name `path` leads to inside the root, or None when it leads nowhere."""
    try:
        fd = root.lookup(path)
    except OSError:
        return None
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    finally:
        os.close(fd)


def musl_arch(root: Root, machine: str | None = None) -> str | None:
    """musl's architecture name when the image's loader is musl's (its /lib/ld-musl-ARCH.so.1
    exists and no glibc loader does: gcompat's glibc loader name leads to musl or libgcompat),
    else None."""
    arch_loader = _ARCHES.get(machine or os.uname().machine)
    if arch_loader is None:
        return None
    arch, glibc_loader = arch_loader
    if _real_name(root, f"/lib/ld-musl-{arch}.so.1") is None:
        return None
    glibc = _real_name(root, glibc_loader)
    if glibc is not None and not glibc.startswith(("ld-musl-", "libgcompat", "libc.musl")):
        return None
    return arch


def entries(text: str) -> list[str]:
    return [e for e in text.replace(":", "\n").split("\n") if e.strip()]


def update(root: Root, arch: str, directories: list[str], log, write) -> str:
    """Append `directories` to /etc/ld-musl-ARCH.path (created with musl's default first)
    with `write(root, data, name)` (ldscan.write: atomic, by fd on /etc); logs
    `ldcache.musl_path`. Returns "musl-path" (or "musl-path-unchanged")."""
    t0 = time.perf_counter()
    name = f"ld-musl-{arch}.path"
    raw = read_regular(root, f"/etc/{name}", MAX_PATH_FILE)
    try:
        if raw is not None and len(raw) >= MAX_PATH_FILE:
            raise HookError(f"/etc/{name} is {MAX_PATH_FILE} bytes or more: not a loader path file")
        have = entries(raw.decode("utf-8", "replace")) if raw is not None else list(DEFAULT_PATH)
        added = [d for d in dict.fromkeys(d.rstrip("/") or "/" for d in directories) if d not in have]
        state = "musl-path-unchanged"
        if added or raw is None:
            write(root, "".join(e + "\n" for e in have + added).encode(), name)
            state = "musl-path"
    except HookError as e:
        # The image's own file is odd (a directory, huge, a read-only /etc): the container
        # starts as it would have without nvhook's entries; LD_LIBRARY_PATH still works.
        log.warning("ldcache.musl_path_failed", file=f"/etc/{name}", directories=directories,
                    reason=f"{e.message}; the driver's directories are not in musl's search path (set "
                           f"LD_LIBRARY_PATH={':'.join(directories)} in the image to use them)")
        return "musl-path-failed"
    log.info("ldcache.musl_path", file=f"/etc/{name}", added=added, created=raw is None,
             directories=directories, ms=round((time.perf_counter() - t0) * 1000, 2))
    return state
