"""Cache of the host inventory's file part, so that a container start does not re-parse
ld.so.cache or re-read ELF headers (pyelftools alone costs more than the hook's budget).

Validity: the cache records the identity (inode, size, mtime) of ld.so.cache and of every
file it lists, the rdev, mode and owner of every device node, the presence of the device nodes and IPC paths that may
appear after boot (nvidia-uvm, MIG and IMEX nodes, daemons' sockets), and the kernel
module's version line; any
difference (a driver upgrade rewrites the libraries and ld.so.cache, a module reload changes
the version line, a reboot may renumber nvidia-uvm) rebuilds the inventory. Stat-ing ~60 paths
costs well under a millisecond.

The cache directory must be owned by us and not writable by others; otherwise the cache is
ignored (a forged cache would let someone choose what gets mounted into containers).
"""

from __future__ import annotations

import os
import stat

from ...base import catalog
from ...base import jsonfast as json
from ...base.config import cache_file_name, cache_usable, write_json_atomic
from ...base.rootpath import join
from . import procfs

# The cache is valid for the code that wrote it: the identity of the modules that decide what
# an inventory holds (the catalog and its readers) is part of the key, so an nvhook upgrade or
# a catalog change never reads an old cache, and no format number has to be bumped by hand.
_CODE = tuple(os.path.join(os.path.dirname(p), n) for p, n in (
    (catalog.__file__, "catalog.py"), (__file__, "cache.py"), (__file__, "inventory.py"),
    (__file__, "procfs.py"), (__file__, "ldcache.py"), (__file__, "elf.py")))


def code_identity() -> list:
    out: list[list[int] | None] = []
    for path in _CODE:
        try:
            st = os.stat(path)
            out.append([st.st_size, st.st_mtime_ns])
        except OSError:
            out.append(None)
    return out

# Paths that appear at run time (a module loaded after boot, a daemon started later): their
# absence is part of the stamp too, or a node created after the first run would never be seen.
RUNTIME_PATHS = catalog.RUNTIME_PATHS
IMEX_DIR = "/dev/nvidia-caps-imex-channels"


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


def _ident(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return [st.st_ino, st.st_size, st.st_mtime_ns]
    # Device nodes, sockets and the MPS directory: their times change with use, their
    # identity (and a device's number) only with a reinstall or reboot. Mode and owner are
    # part of it too: the plan gives a device node the host node's (chmod on the host shows).
    return [st.st_ino, st.st_rdev, st.st_mode, st.st_uid, st.st_gid]


def stamp(files: dict) -> dict:
    root = files["root"]
    paths = [join(root, "/etc/ld.so.cache")]
    for group in ("libraries", "binaries", "devices", "ipc", "firmware", "configs"):
        paths.extend(item["source"] for item in files[group])
    have = set(paths)
    caps = [f"/dev/nvidia-caps/nvidia-cap{m}" for m in sorted(set(files["mig_minors"].values()))]
    for p in (*RUNTIME_PATHS, *caps):
        p = join(root, p)
        if p not in have:  # the ones found are listed already
            paths.append(p)
    try:
        imex = sorted(os.listdir(join(root, IMEX_DIR)))
    except OSError:
        imex = None
    text = procfs._read(join(root, procfs.NVIDIA + "/version"))
    version_line = text.split("\n", 1)[0] if text is not None else None
    return {"paths": paths, "idents": [_ident(p) for p in paths], "version_line": version_line, "imex": imex}


def _valid(files: dict, recorded: dict) -> bool:
    return stamp(files) == recorded


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
            if _valid(warm[2]["files"], warm[2]["stamp"]):
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
        if not _valid(data["files"], data["stamp"]):
            return None
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(cache_dir: str, files: dict, nvml: dict | None = None) -> bool:
    if not cache_dir:
        return False
    data = {"code": code_identity(), "files": files, "stamp": stamp(files), "nvml": nvml}
    return write_json_atomic(cache_dir, _key(files["root"]), data)
