"""What the container image brings that matters to the driver: CUDA forward-compatibility
libraries and the CUDA runtime version. Pure reads under the rootfs, no writes.

Every path is resolved inside the rootfs (nvhook.base.rootpath: absolute link targets restart at the
rootfs, ".." stops there, 40 links at most), so a hostile image cannot make us look at host
files. Compat libraries count only as regular files (lstat); anything else that carries a
compat library's name is returned with a "skipped" reason instead of being used.

Cost: this module imports only os/stat and nvhook.base.rootpath/versions. The ELF note of a compat
libcuda (pyelftools, ~40 ms to import) is read only for a libcuda newer than the host driver,
the case where it can change the decision; an image without compat libraries, or with ones
older than the host driver, never imports pyelftools.
"""

from __future__ import annotations

import os
import stat

from ..base import rootpath, versions
from ..base.errors import HookError

COMPAT_DIRS = ("/usr/local/cuda/compat",)
CUDA_LINK = "/usr/local/cuda"
MAX_ENTRIES = 4096  # directory entries looked at per directory


class CompatScanTooSlow(HookError):
    """find_compat_libs still reading past its deadline (thousands of compat-named files, each
    an ELF file to parse: 44 s measured for 4,095 links to one libcuda)."""


def resolve_in_rootfs(rootfs: str, path: str) -> str | None:
    """The host path of container path `path`, symlinks followed inside rootfs (absolute
    targets and ".." clamped at rootfs, at most 40 links), or None when missing, looping, or
    crossing a non-directory."""
    return rootpath.resolve_host(rootfs, path)


def _kind(mode: int) -> str:
    return "a " + rootpath.kind_name(mode)


def _split_versioned(name: str) -> tuple[str, str] | None:
    """'libcuda.so.465.19.01' -> ('libcuda', '465.19.01'); None unless the suffix is a dotted
    numeric driver version with at least two parts (libcuda.so.1 is a SONAME link)."""
    lib, sep, ver = name.partition(".so.")
    if not sep or not lib.startswith("lib") or "." not in ver:
        return None
    try:
        versions.parse_version(ver)
    except ValueError:
        return None
    return lib, ver


def _listdir(host_dir: str) -> list[str]:
    try:
        with os.scandir(host_dir) as it:
            names = []
            for entry in it:
                names.append(entry.name)
                if len(names) >= MAX_ENTRIES:
                    break
    except OSError:
        return []
    names.sort()
    return names


def _real_path(fd: int) -> str | None:
    """The kernel's name for what `fd` is open on (None if it has none)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _dir_skip(path: str, reason: str) -> dict:
    return {"name": os.path.basename(path), "container_path": path, "host_path": None,
            "library": None, "version": None, "newer_than_host": False,
            "note": None, "note_error": None, "skipped": reason}


def _compat_dirs(rootfs: str, skipped: list[dict], only: str | None = None) -> list[str]:
    """Container paths of the compat directories, deduplicated by resolved path. Compat paths
    that exist but are no directory inside the rootfs go to `skipped` (once each). `only`: this
    directory alone instead of the defaults (nvidia-cdi-hook's --cuda-compat-container-root)."""
    if only is not None:
        wanted = [only]
    else:
        wanted = list(COMPAT_DIRS)
        cuda = rootpath.resolve(rootfs, CUDA_LINK)
        if cuda and os.path.basename(cuda).startswith("cuda-"):
            wanted.append(cuda + "/compat")  # /usr/local/cuda-X.Y/compat, what /usr/local/cuda points to
    out: list[str] = []
    seen: set[str] = set()
    for path in wanted:
        inside = rootpath.resolve(rootfs, path)
        if inside is None:
            # A link going nowhere inside the rootfs (typically an absolute link meant to
            # reach a host path): report it, never follow it.
            parent = rootpath.resolve(rootfs, os.path.dirname(path))
            if parent is None:
                continue
            link = parent.rstrip("/") + "/" + os.path.basename(path)
            try:
                host = rootpath.join(rootfs, link)
                if not stat.S_ISLNK(os.lstat(host).st_mode):
                    continue
                target = os.readlink(host)
            except OSError:
                continue
            if link not in seen:
                seen.add(link)
                skipped.append(_dir_skip(path, f"compat directory {link} is a link to {target}, which does "
                                               f"not resolve inside the container's rootfs"))
            continue
        if inside in seen or inside in out:
            continue
        try:
            st = os.lstat(rootpath.join(rootfs, inside))
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            seen.add(inside)
            skipped.append(_dir_skip(path, f"compat directory resolves to {inside}, {_kind(st.st_mode)}, "
                                           f"not a directory"))
            continue
        out.append(inside)
    return out


def find_compat_libs(rootfs: str, host_driver_version: str | None, compat_dir: str | None = None, *,
                     deadline: float | None = None, clock=None, between=None) -> list[dict]:
    """Compat libraries in /usr/local/cuda/compat and the /usr/local/cuda-X.Y/compat that
    /usr/local/cuda points to (resolved inside rootfs, deduplicated by resolved path), or in
    `compat_dir` alone (an absolute container path) when given.

    One dict per file named lib<name>.so.<driver version>:
      {"name": "libcuda.so.465.19.01",
       "container_path": "/usr/local/cuda-11.3/compat/libcuda.so.465.19.01" (resolved),
       "host_path": the file on this machine, None when skipped,
       "library": "libcuda" | "libnvidia-ptxjitcompiler" | ...,
       "version": "465.19.01",
       "newer_than_host": numeric comparison with host_driver_version (False if unknown),
       "note": the .note.cuda.fwd_compatibility JSON, read only for a libcuda newer than the
               host driver; None otherwise or when the file has no note,
       "note_error": why the note could not be read (malformed, not ELF), else None,
       "skipped": None for a usable file, else why it is not used: not a regular file
                  (symlink, FIFO, device...), or a compat directory link that leads nowhere
                  inside the rootfs (then library/version are None)}
    Skipped entries are listed so that the decision log and `nvhook doctor` can show them;
    nvhook.decide.compat ignores them.

    With a `deadline` (read on `clock()`, time.monotonic by default), a scan still running past
    it is CompatScanTooSlow: a long-lived reader (the NRI plugin) must answer in its time.
    `between()`, when given, is called before each file is looked at (the plugin waits there
    while it answers another container).
    """
    if deadline is not None and clock is None:
        import time

        clock = time.monotonic
    out: list[dict] = []
    skipped: list[dict] = []
    real_root = os.path.realpath(rootfs).rstrip("/")  # the kernel's names start with it
    for cdir in _compat_dirs(rootfs, skipped, compat_dir):
        host_dir = rootpath.join(rootfs, cdir)
        for name in _listdir(host_dir):
            parts = _split_versioned(name)
            if parts is None:
                continue
            if between is not None:
                between()
            if deadline is not None and clock() > deadline:
                raise CompatScanTooSlow(f"reading the image's CUDA compat libraries ({cdir}: {len(out)} files "
                                        f"so far) took too long")
            lib, ver = parts
            container_path = cdir.rstrip("/") + "/" + name
            host_path = host_dir.rstrip("/") + "/" + name
            try:
                newer = host_driver_version is not None and versions.compare(ver, host_driver_version) > 0
            except (ValueError, AttributeError, TypeError):
                newer = False
            entry = {"name": name, "container_path": container_path, "host_path": host_path,
                     "library": lib, "version": ver, "newer_than_host": newer,
                     "note": None, "note_error": None, "skipped": None}
            _inspect(entry, real_root)
            out.append(entry)
    return skipped + out


def _inspect(entry: dict, real_root: str) -> None:
    """Fill a compat candidate's "skipped" (not a regular file, moved) or its note. The file is
    opened once, O_PATH|O_NOFOLLOW (a FIFO or device node under this name is never opened),
    checked on the fd, and read (the note) through that fd only."""
    try:
        pfd = os.open(entry["host_path"], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        entry["host_path"] = None
        entry["skipped"] = f"cannot stat: {e.strerror}"
        return
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            entry["host_path"] = None
            what = _kind(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                try:
                    what += f" to {os.readlink('', dir_fd=pfd)}"
                except OSError:
                    pass
            entry["skipped"] = f"{what}; compat libraries must be regular files"
        elif _real_path(pfd) != real_root + entry["container_path"]:
            # a directory on the way was swapped for a link since it was resolved
            entry["host_path"] = None
            entry["skipped"] = "changed while nvhook looked at it (a directory on the way became a link)"
        elif entry["library"] == "libcuda" and entry["newer_than_host"]:
            from .host import elf

            try:
                entry["note"] = elf.fwd_compat_note(entry["host_path"], fd=pfd)
            except ValueError as e:
                entry["note_error"] = str(e)
    finally:
        os.close(pfd)


def _cudart_dirs(rootfs: str) -> list[str]:
    dirs = []
    targets = rootpath.resolve(rootfs, CUDA_LINK + "/targets")
    if targets is not None:
        for t in _listdir(rootpath.join(rootfs, targets)):
            d = rootpath.resolve(rootfs, f"{targets}/{t}/lib")
            if d is not None and d not in dirs:
                dirs.append(d)
    d = rootpath.resolve(rootfs, CUDA_LINK + "/lib64")
    if d is not None and d not in dirs:
        dirs.append(d)
    return dirs


def cuda_runtime_version(rootfs: str, env: dict) -> tuple[str | None, str]:
    """The image's CUDA runtime version and where it came from.

    From the newest libcudart.so.X.Y.Z under /usr/local/cuda/targets/*/lib or
    /usr/local/cuda/lib64 (resolved in rootfs): ("11.3.109", "file:/usr/local/cuda-11.3/
    targets/x86_64-linux/lib/libcudart.so.11.3.109"). Two-part names (libcudart.so.11.0, the
    SONAME link of every 11.x) count only as regular files and only without a three-part one.
    Else from env CUDA_VERSION: ("11.3.1", "env:CUDA_VERSION"). Else (None, "none").
    """
    best = None  # (rank, version tuple, version, source)
    for d in _cudart_dirs(rootfs):
        host_dir = rootpath.join(rootfs, d)
        for name in _listdir(host_dir):
            if not name.startswith("libcudart.so."):
                continue
            ver = name[len("libcudart.so."):]
            try:
                parsed = versions.parse_version(ver)
            except ValueError:
                continue
            if len(parsed) < 2:
                continue
            rank = 1 if len(parsed) >= 3 else 0
            if rank == 0:
                try:
                    if not stat.S_ISREG(os.lstat(host_dir + "/" + name).st_mode):
                        continue
                except OSError:
                    continue
            key = (rank, parsed)
            if best is None or key > best[0]:
                best = (key, ver, f"file:{d.rstrip('/')}/{name}")
    if best is not None:
        return best[1], best[2]
    raw = (env or {}).get("CUDA_VERSION")
    if isinstance(raw, str) and raw.strip():
        try:
            versions.parse_version(raw)
            return raw.strip(), "env:CUDA_VERSION"
        except ValueError:
            pass
    return None, "none"
