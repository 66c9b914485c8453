"""The /proc/driver/nvidia tmpfs: the plan's `tmpfs` mounts, and the emulation of a missing
/proc/driver/nvidia.

  - `tmpfs`: a tmpfs with the plan's flags and data (mode=...), writable while nvhook fills it,
    remounted read-only after the last mount of the plan (unless its options say "rw"; see
    `mounts.Mounter.finish`).

Emulated /proc/driver/nvidia. When the container's procfs has no /proc/driver/nvidia (the host
has no NVIDIA kernel module loaded: CI machines, a driver tree given with `--root`), procfs
cannot hold a new directory. nvhook then keeps O_PATH fds on the existing entries of
/proc/driver, mounts a tmpfs (mode 0555) on the container's /proc/driver, binds those entries
back into it so they stay visible, creates nvidia/ in it, and goes on with the plan's tmpfs on
/proc/driver/nvidia. It logs the warning `procfs.emulated`. The /proc/driver tmpfs is remounted
read-only at the end like the plan's own tmpfs.
"""

from __future__ import annotations

import os
import stat

from ..base import sandbox
from ..base.errors import HookError
from ..base.rootpath import kind_name
from .mountbase import MounterBase, Options, fdpath
from .mountbase import normpath as _normpath
from .mountbase import reason as _reason

PROC_DRIVER = "/proc/driver"


class ProcDir(MounterBase):
    """The tmpfs kind of `mounts.Mounter`, and the /proc/driver emulation it may need."""

    def tmpfs(self, m: dict, opts: Options) -> None:
        target = m["target"]
        try:
            os.close(self.root.lookup(target))
        except FileNotFoundError:
            self._maybe_emulate_procfs_parent(target)
        except OSError as e:
            raise HookError(f"cannot resolve {target} in the container: {_reason(e)}") from None
        t = self._ensure(target, True, "tmpfs")
        try:
            if not stat.S_ISDIR(t.mode):
                raise HookError(f"cannot mount a tmpfs on {target}: the image has a "
                                f"{kind_name(t.mode)} there, a directory is needed")
            flags = opts.flags & ~sandbox.MS_RDONLY
            sandbox.mount("tmpfs", fdpath(t.fd), "tmpfs", flags, self._tmpfs_data(opts.data), what=target)
        except OSError as e:
            raise HookError(f"cannot mount a tmpfs on {target}: {_reason(e)}") from None
        finally:
            t.close()
        if not opts.rw:
            self.readonly_later.append((target, flags))
        self.own_tmpfs.add(_normpath(target))
        self.count += 1
        self.log.debug("mount.done", kind="tmpfs", source="tmpfs", target=target, options=m["options"])

    def _tmpfs_data(self, data: str | None) -> str | None:
        """In a user-namespaced container, a tmpfs owned by the container's root, not by a host
        root that the container sees as nobody."""
        uid, gid = self.root.owner
        if (uid, gid) == (0, 0):
            return data
        opts = data.split(",") if data else []
        if not any(o.startswith("uid=") for o in opts):
            opts.append(f"uid={uid}")
        if not any(o.startswith("gid=") for o in opts):
            opts.append(f"gid={gid}")
        return ",".join(opts)

    def _maybe_emulate_procfs_parent(self, target: str) -> None:
        """A target missing in a procfs directory: that directory cannot hold a new one."""
        parent = target.rstrip("/").rpartition("/")[0] or "/"
        try:
            pfd = self.root.lookup(parent)
        except OSError:
            return  # missing parents are created inside the image as usual
        try:
            if sandbox.fstatfs_type(pfd) != sandbox.PROC_SUPER_MAGIC:
                return
            if parent.rstrip("/") != PROC_DRIVER:
                raise HookError(f"cannot create {target}: {parent} is in the container's procfs, "
                                f"and nvhook only emulates directories in {PROC_DRIVER}")
            self._emulate_proc_driver(pfd, target)
        finally:
            os.close(pfd)

    def _emulate_proc_driver(self, pfd: int, target: str) -> None:
        kept: list[tuple[str, int, str | None]] = []  # (name, O_PATH fd, symlink content)
        try:
            dfd = os.open(fdpath(pfd), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                names = sorted(os.listdir(dfd))
            finally:
                os.close(dfd)
            for name in names:
                efd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                link = None
                if stat.S_ISLNK(os.fstat(efd).st_mode):
                    link = os.readlink("", dir_fd=efd)
                kept.append((name, efd, link))
            sandbox.mount("tmpfs", fdpath(pfd), "tmpfs",
                          sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC, self._tmpfs_data("mode=0555"),
                          what=PROC_DRIVER)
            nfd = self.root.lookup(PROC_DRIVER)
            try:
                if sandbox.fstatfs_type(nfd) != sandbox.TMPFS_MAGIC:
                    raise HookError(f"tmpfs on {PROC_DRIVER} did not take effect")
                for name, efd, link in kept:
                    if link is not None:
                        os.symlink(link, name, dir_fd=nfd)
                        continue
                    is_dir = stat.S_ISDIR(os.fstat(efd).st_mode)
                    t = self.root.ensure(f"{PROC_DRIVER}/{name}", is_dir)
                    try:
                        sandbox.mount(fdpath(efd), fdpath(t.fd), None, sandbox.MS_BIND | sandbox.MS_REC,
                                      None, what=f"{PROC_DRIVER}/{name}")
                    finally:
                        t.close()
                os.mkdir("nvidia", 0o555, dir_fd=nfd)
            finally:
                os.close(nfd)
        except OSError as e:
            raise HookError(f"cannot emulate {target} with a tmpfs on {PROC_DRIVER}: {_reason(e)}") from None
        finally:
            for _, efd, _ in kept:
                os.close(efd)
        self.readonly_later.append((PROC_DRIVER, sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC))
        self.log.warning(
            "procfs.emulated", path=target, kept=[k[0] for k in kept],
            reason=f"the host has no NVIDIA kernel module loaded (the container's procfs has no "
                   f"{target}), so nvhook mounted a tmpfs on {PROC_DRIVER} (keeping its existing "
                   f"entries) and emulated {target} from the host root's copy")
