"""Device nodes in the container: created in place by mknod (or bind-mounted where a node nvhook
makes would be unusable), with the host node's number, mode and owner.

A `device` mount's source is a `NodeSource`: the plan's node facts (`PlannedNode`, observed by
this run on the host, so no syscall is needed here) or a stat of the host node.
"""

from __future__ import annotations

import os
import stat

from ..base import sandbox, userns
from ..base.errors import HookError
from .mountbase import MounterBase, Options, Source
from .mountbase import reason as _reason
from .paths import parent_name


class PlannedNode:
    """A device node as the plan describes it, standing in for the host node's stat: what
    mknod needs (type and mode, number, owner), no inode to compare a bind mount with."""

    __slots__ = ("st_mode", "st_rdev", "st_uid", "st_gid")

    def __init__(self, mode: int, rdev: int, uid: int, gid: int):
        self.st_mode, self.st_rdev, self.st_uid, self.st_gid = mode, rdev, uid, gid


class NodeSource:
    """A device mount's source: the host node's path and its facts (the plan's or a stat)."""

    __slots__ = ("path", "st")

    def __init__(self, path: str, st: os.stat_result | PlannedNode):
        self.path = path
        self.st = st


class DeviceNodes(MounterBase):
    """The device-node kind of `mounts.Mounter`."""

    rootless: bool = userns.namespaced()  # read once: the namespace of a process never changes

    def device(self, m: dict, opts: Options, src: NodeSource | Source) -> None:
        """A device node is created in place (mknod) rather than bind-mounted: one syscall
        instead of about a dozen, which is what makes 8 GPUs x 7 MIG instances (112 capability
        nodes) cheap. The node gets the host node's number, mode and owner; the mount options
        (ro, nosuid, noexec) have nothing to restrict on a device node. Bind mounts remain for
        user-namespaced containers and a nodev /dev, where a node nvhook creates would be
        unusable, for a hook that is itself in a user namespace (a rootless engine's: mknod of
        a device is the host root's alone), and for anything unexpected at the target (bind
        reports it)."""
        if self.root.owner != (0, 0) or not stat.S_ISCHR(src.st.st_mode) or self.rootless:
            return self.bind(m, opts, self._stat_source(src))
        target = m["target"]
        parent, name = parent_name(target)
        pfd = self._node_dir(parent, src.path)
        if pfd is None:
            return self.bind(m, opts, self._stat_source(src))
        mode = stat.S_IMODE(src.st.st_mode)
        try:
            # umask 0 so that mknod gives the node its exact mode: no chmod by name afterwards,
            # which would follow a symlink swapped in for the new node (a second container
            # sharing this /dev could plant one pointing at a host file).
            old_umask = None if self.umask_zero else os.umask(0)
            try:
                os.mknod(name, stat.S_IFCHR | mode, src.st.st_rdev, dir_fd=pfd)
            except FileExistsError:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == src.st.st_rdev):
                    return self.bind(m, opts, self._stat_source(src))  # not ours: bind decides (shadow, error)
                self.log.debug("device.exists", path=target)
            else:
                # Owner: fchownat(AT_SYMLINK_NOFOLLOW), only where mknod's result differs (a
                # link swapped in meanwhile gets the new owner itself; nothing is followed).
                if (src.st.st_uid, src.st.st_gid) != (0, 0):
                    os.chown(name, src.st.st_uid, src.st.st_gid, dir_fd=pfd, follow_symlinks=False)
            finally:
                if old_umask is not None:
                    os.umask(old_umask)
        except OSError as e:
            raise HookError(f"cannot create device node {target} ({os.major(src.st.st_rdev)}:"
                            f"{os.minor(src.st.st_rdev)}) in the container: {_reason(e)}") from None
        self.count += 1
        if self.debug:
            self.log.debug("mount.done", kind="device", source=src.path, target=target, options=m["options"],
                           method="mknod")

    def _stat_source(self, src: NodeSource | Source) -> Source:
        """A bind needs the host node's inode to check what it mounted: a planned node has none."""
        if isinstance(src, Source):
            return src
        if not isinstance(src.st, PlannedNode):
            return Source(src.path, -1, src.st)
        try:
            st = os.stat(src.path)
        except FileNotFoundError:
            raise HookError(f"host device node vanished: {src.path}") from None
        except OSError as e:
            raise HookError(f"cannot stat host device node {src.path}: {_reason(e)}") from None
        return Source(src.path, -1, st)

    def _node_dir(self, parent: str, source: str) -> int | None:
        if parent not in self.node_dirs:
            p = self._ensure(parent, True, source)
            usable = (stat.S_ISDIR(p.mode) and p.link is None
                      and not os.fstatvfs(p.fd).f_flag & sandbox.MS_NODEV)
            if usable:
                self.node_dirs[parent] = p.fd  # kept open until finish()
            else:
                p.close()
                self.node_dirs[parent] = None
        return self.node_dirs[parent]
