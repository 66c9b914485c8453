"""Cache of the host inventory's file part, so that a container start does not re-parse
ld.so.cache or re-read ELF headers (pyelftools alone costs more than the hook's budget).

Validity: the stamp is everything the scan that built the inventory looked at (inventory.Inputs),
as it was when it looked: the identity (lstat: inode, size, times, a link's target, a device's
numbers, mode and owner) of every entry on every path it resolved -- ld.so.cache, each link it
followed (/etc/alternatives included), each directory it crossed, each file it chose or
skipped, and each lookup that found nothing (so a library, binary, device node or socket that
appears later is seen); the listing of each directory whose contents it used (firmware, IMEX
channels); and the kernel module's version line. Any difference rebuilds the inventory: a
driver upgrade, an alternatives switch, a library that was missing and is back, a module
reload. An lstat per entry (a few hundred) costs well under a millisecond.

An inventory whose scan could not look at something for a reason that is no fact about the
driver (no /proc, out of file descriptors, no permission) is never written: it serves the
run that built it, and the next run scans again.

The cache directory must be owned by us and not writable by others; otherwise the cache is
ignored (a forged cache would let someone choose what gets mounted into containers).

A hook in a user namespace (a rootless engine's) cannot write root's cache_dir: it uses its
user's own, ~/.cache/nvhook (base/userns.py `cache_dir`). It serves only that user's
containers, with that user's rights, so a cache only the user (or root) can write is as
trustworthy for it as root's is for a rootful hook; the directories above it show the overflow
uid there (the host's root) and are accepted as such (base/config.py `cache_problem`).
"""

from __future__ import annotations

import os

from ...base import catalog, rootpath, userns
from ...base import jsonfast as json
from ...base.config import cache_file_name, cache_usable, write_json_atomic
from ...base.rootpath import identity, join, listing
from . import procfs

# The cache is valid for the code that wrote it: the identity of the modules that decide what
# an inventory holds (the catalog and its readers) is part of the key, so an nvhook upgrade or
# a catalog change never reads an old cache, and no format number has to be bumped by hand.
_CODE = tuple(os.path.join(os.path.dirname(p), n) for p, n in (
    (catalog.__file__, "catalog.py"), (rootpath.__file__, "rootpath.py"), (__file__, "cache.py"),
    (__file__, "inventory.py"), (__file__, "procfs.py"), (__file__, "ldcache.py"), (__file__, "elf.py")))


def code_identity() -> list:
    out: list[list[int] | None] = []
    for path in _CODE:
        try:
            st = os.stat(path)
            out.append([st.st_size, st.st_mtime_ns])
        except OSError:
            out.append(None)
    return out


# nvhookd sets this: the parsed cache file is kept in memory between requests, keyed by the
# file's identity (a rewritten file is read again); each use still re-checks the stamp.
KEEP_PARSED = False
_parsed: dict = {}
# nvhookd sets this too: (cache_dir, root, data), the inventory it loaded (every check of
# `load` passed then), which its request children use for that cache_dir and root without
# opening the file while its stamp still matches the host (a driver upgrade shows there).
WARM: tuple | None = None


def _read(path: str) -> dict:
    with open(path, "rb") as f:
        if not KEEP_PARSED:
            return json.loads(f.read())
        st = os.fstat(f.fileno())
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        kept = _parsed.get(path)
        if kept is not None and kept[0] == ident:
            return kept[1]
        data = json.loads(f.read())
    _parsed[path] = (ident, data)
    return data


def _key(root: str) -> str:
    return cache_file_name("inventory", root)


def _valid(files: dict) -> bool:
    """Every entry the scan looked at is still what it was (see the module's docstring)."""
    inputs = files["inputs"]
    for path, ident in inputs["entries"].items():
        if identity(path) != ident:
            return False
    for path, names in inputs["listings"].items():
        if listing(path) != names:
            return False
    return procfs.version_line(files["root"]) == inputs["version_line"]


def _sources_in_root(files: dict, root: str) -> bool:
    """Every mount source a cached inventory names lies under the host root, lexically (no
    ".." component): what gets mounted into containers is chosen by nvhook's own scan of that
    root, not by whoever wrote the file."""
    prefix = join(root, "")
    for group in ("libraries", "binaries", "devices", "ipc", "firmware", "configs"):
        for item in files[group]:
            src = item["source"]
            if type(src) is not str or not src.startswith(prefix) or "/../" in src + "/" or "\0" in src:
                return False
    return True


def load(cache_dir: str, root: str) -> dict | None:
    warm = WARM
    if warm is not None and warm[0] == cache_dir and warm[1] == root:
        try:
            if _valid(warm[2]["files"]):
                held: dict = warm[2]
                return held
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    if not cache_dir or not cache_usable(cache_dir):
        return None
    try:
        data = _read(os.path.join(cache_dir, _key(root)))
        if data.get("code") != code_identity() or data["files"]["root"] != root:
            return None
        if not _sources_in_root(data["files"], root):
            return None
        if not _valid(data["files"]):
            return None
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(cache_dir: str, files: dict, nvml: dict | None = None) -> bool:
    if not cache_dir or files.get("incomplete"):
        return False
    data = {"code": code_identity(), "files": files, "nvml": nvml}
    return write_json_atomic(cache_dir, _key(files["root"]), data)


def refusal(cache_dir: str) -> tuple[str, str] | None:
    """(level, reason) when `cache_dir` cannot hold the inventory cache, or None: a warning
    where a directory's owner or mode can be fixed; in a user namespace, information that says
    so, since each start then pays for a scan (no home for the user, a home it cannot write)."""
    from ...base.config import cache_problem

    problem = cache_problem(cache_dir)
    if problem is None:
        return None
    if userns.namespaced():
        return "info", (f"this hook runs in a user namespace (a rootless engine, host uid {userns.outside_uid()}) "
                        f"and cannot use {cache_dir} ({problem}): each start scans the host's driver files again")
    return "warning", problem
