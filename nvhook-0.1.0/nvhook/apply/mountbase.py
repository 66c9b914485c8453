"""What every mount kind of the apply step shares: the bind source, fd paths, the error text,
and the mounter's state (`MounterBase`; `mounts.Mounter` combines it with the kinds).

The kinds live in their own modules, each small enough to audit in one sitting: binds
(`mounts`), device nodes (`devnodes`), the procfs tmpfs and /proc/driver emulation (`procdir`),
procfs copies (`copies`), symlinks (`symlinks`).
"""

from __future__ import annotations

import os

from ..base import sandbox
from ..base.errors import HookError
from .paths import Root, split_path

_FLAGS = {"ro": sandbox.MS_RDONLY, "nosuid": sandbox.MS_NOSUID, "nodev": sandbox.MS_NODEV,
          "noexec": sandbox.MS_NOEXEC}


class Options:
    __slots__ = ("flags", "data", "copy", "sets", "rw")

    def __init__(self, options: list, where: str):
        self.flags = 0
        self.copy = False
        self.rw = False
        self.sets: list[tuple[str, str]] = []
        data = []
        for opt in options:
            if opt in _FLAGS:
                self.flags |= _FLAGS[opt]
            elif opt == "rw":
                self.rw = True
            elif opt == "copy":
                self.copy = True
            elif opt.startswith("set:") and "=" in opt:
                key, _, value = opt[4:].partition("=")
                self.sets.append((key.strip(), value.strip()))
            elif "=" in opt:
                data.append(opt)
            else:
                raise HookError(f"unknown mount option {opt!r} for {where}")
        self.data = ",".join(data) or None


def fdpath(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


class Source:
    """A bind mount's source as the apply step saw it host side, before entering the container's
    mount namespace: path, O_PATH fd and stat, so that it can check it mounts the same inode.
    (Device nodes and procfs copies have their own: `devnodes.NodeSource`, `copies.CopySource`.)"""

    __slots__ = ("path", "fd", "st", "in_root")

    def __init__(self, path: str, fd: int, st: os.stat_result, in_root: str | None = None):
        self.path = path
        self.fd = fd
        self.st = st
        self.in_root = in_root  # the source's path inside the rootfs (compat libraries)


class MounterBase:
    """What one plan's mounts share across kinds: the root, the log, the count, and the fds and
    paths kept so that 112 MIG nodes and capability files do not each resolve their directory."""

    def __init__(self, root: Root, log):
        self.root = root
        self.log = log
        # Per-mount events are debug level; with 250 mounts in a MIG container, not even
        # building them when the log would drop them is worth a check.
        self.debug = getattr(log, "level", 0) <= 10
        self.readonly_later: list[tuple[str, int]] = []  # tmpfs to remount ro: (target, flags)
        self.count = 0
        # True while apply_mounts holds the umask at 0 for the whole plan (every file and
        # directory nvhook creates states its mode, none wider than 0755): device nodes then
        # skip their own umask(0)/umask(old) pair, 224 syscalls for a MIG container's nodes.
        self.umask_zero = False
        # Directories that take device nodes, resolved once (112 MIG nodes share one):
        # parent path -> O_PATH fd, or None where nodes must be bind-mounted instead.
        self.node_dirs: dict[str, int | None] = {}
        # Directories inside a tmpfs this run mounted (nothing of the image's can be in
        # there): path -> O_PATH fd, so that 112 MIG capability files under
        # /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/ci<C> do not each re-walk the tree.
        self.own_tmpfs: set[str] = set()
        self.own_dirs: dict[str, int] = {}  # tmpfs root -> O_PATH fd
        self.made_dirs: dict[str, int] = {}  # container path of a directory made in one -> O_PATH fd

    def _ensure(self, target: str, directory: bool, source: str):
        try:
            return self.root.ensure(target, directory)
        except OSError as e:
            raise HookError(f"cannot create mount point {target} in the container for {source}: "
                            f"{reason(e)}") from None

    def bind(self, m: dict, opts: Options, src: Source) -> None:
        """The bind of `src` on m's target (mounts.Mounter); other kinds fall back to it."""
        raise NotImplementedError


def normpath(path: str) -> str:
    return "/" + "/".join(split_path(path))


def reason(e: OSError) -> str:
    """An OSError's text without Python's "[Errno N]" prefix."""
    if e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    return e.strerror or str(e)
