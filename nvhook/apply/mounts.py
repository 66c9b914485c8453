"""The mounts of a plan, applied inside the container's mount namespace.

Runs in the apply step (`nvhook.apply.child.run_plan`: the hook's own process, nvhookd's request
child, or a forked worker) after setns(2) into the container's mount namespace and before the
runtime's pivot_root, so host paths (the mount sources) and the rootfs (at its host
path) are both visible. Every target is resolved inside the rootfs by `paths.Root`, and every
mount goes onto the resolved object's O_PATH fd (`/proc/self/fd/N`), so no symlink in the image
can move a mount out of the rootfs.

Per plan mount, in the plan's order (`apply_mounts`), one operation per kind; this module has
the binds and the sequence, the other kinds have a module each (small enough to audit in one
sitting; `mountbase` holds what they share):

  - bind kinds (library, library32, binary, firmware, compat, device, ipc, and procfs without
    "copy"): the target is created when missing (an empty file for files, device nodes and
    sockets; a directory for directories), the source bind-mounted on it, then remounted with
    MS_REMOUNT|MS_BIND|<flags> (the first MS_BIND call ignores ro/nosuid/nodev/noexec). The
    remount goes through a fresh lookup of the target, which lands on the new mount, and checks
    that it is the source's inode.
  - an image that already ships a regular file at the target (images that bundle driver
    libraries): the host's file is mounted over it and `mount.shadowed` is logged; the host's
    driver must win, a stale bundled copy would not match the kernel module. A directory where a
    file is expected, or a file where a directory is, is an error naming the path.
  - a target that is a symlink in the image is followed inside the rootfs (`mount.redirected`,
    a warning, with the container path it `resolved` to); a dangling one gets its target created
    inside the rootfs. A target reached through a symlinked directory (`/lib -> usr/lib`, or a
    hostile `/usr/lib/x86_64-linux-gnu -> /host/dir`, resolved inside the rootfs all the same)
    is logged as `mount.via_symlink` (info) with the container path it resolved to.
  - `device`: a node made in place by mknod, or bound where that would be unusable
    (`devnodes`).
  - `tmpfs`: the /proc/driver/nvidia tmpfs, and the emulation of a missing /proc/driver/nvidia
    (`procdir`).
  - `procfs` with "copy": a file copied into that tmpfs, with "set:Key=Value" rewrites
    (`copies`).

Symlinks come after the mounts (`symlinks.apply_symlinks`).

User-namespaced containers: everything nvhook creates in the image (placeholders, directories,
symlinks) is created with the fsuid/fsgid of the container's root, so the container owns it (and
runc's /dev tmpfs, which belongs to the container's user namespace, accepts it); the tmpfs it
mounts get uid=/gid= options to the same effect. Mount sources are still opened as nvhook.

All mounts happen in the container's mount namespace only; it dies with the container, so a
failure half-way leaves nothing mounted on the host.
"""

from __future__ import annotations

import errno
import os
import stat

from ..base import sandbox
from ..base.errors import HookError
from ..base.rootpath import kind_name
from .copies import Copies, CopySource, rewrite
from .devnodes import DeviceNodes, NodeSource, PlannedNode
from .mountbase import Options, Source, fdpath
from .mountbase import normpath as _normpath
from .mountbase import reason as _reason
from .paths import Root
from .procdir import ProcDir

# The mount layer's face: the kinds' own names too, so callers and tests need not know the split.
__all__ = ["KINDS", "NOUNS", "CopySource", "Mounter", "NodeSource", "Options", "PlannedNode", "Source",
           "apply_mounts", "fdpath", "remount", "rewrite"]

# statvfs f_flag bits -> mount flags, to carry the current atime mode through a remount (a
# mount with a locked atime mode, in a user namespace, refuses a remount that changes it).
_ST_NOATIME, _ST_NODIRATIME, _ST_RELATIME = 1024, 2048, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
# What a user namespace locks on a mount it did not make, so a remount of a bind from it must
# keep them: read-only too (a driver root on a read-only mount, as the test node's fixture host).
_ST_KEEP = sandbox.MS_RDONLY | sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC  # same bits in ST_* and MS_*

NOUNS = {"library": "library", "library32": "library", "compat": "library", "binary": "binary",
         "firmware": "firmware file", "device": "device node", "ipc": "IPC socket",
         "procfs": "procfs file"}
# What this layer can apply: one operation per kind (a bind per source kind, plus the tmpfs
# that procfs copies go into). A plan naming another kind is refused before anything is mounted.
KINDS = frozenset(NOUNS) | {"tmpfs"}


def _atime_flags(fd: int) -> int:
    f = os.fstatvfs(fd).f_flag
    out = 0
    if f & _ST_NOATIME:
        out |= _MS_NOATIME
    if f & _ST_NODIRATIME:
        out |= _MS_NODIRATIME
    if f & _ST_RELATIME:
        out |= _MS_RELATIME
    if not f & (_ST_NOATIME | _ST_RELATIME):
        out |= _MS_STRICTATIME
    return out


def remount(fd: int, flags: int, what: str) -> None:
    """MS_REMOUNT|MS_BIND with `flags` on the mount whose root `fd` is, keeping its atime mode;
    on EPERM (flags locked by a user namespace) retry keeping its ro/nosuid/nodev/noexec too."""
    base = sandbox.MS_REMOUNT | sandbox.MS_BIND | flags | _atime_flags(fd)
    try:
        sandbox.mount(None, fdpath(fd), None, base, None, what=what)
    except OSError as e:
        if e.errno != errno.EPERM:
            raise
        sandbox.mount(None, fdpath(fd), None, base | (os.fstatvfs(fd).f_flag & _ST_KEEP), None, what=what)


class Mounter(DeviceNodes, ProcDir, Copies):
    """Applies one plan's mounts: the binds here, the other kinds from their modules; the
    state they share is `mountbase.MounterBase`'s."""

    # -- helpers -----------------------------------------------------------------------

    def _open_source(self, kind: str, src: Source) -> int:
        noun = ("container " if src.in_root is not None else "host ") + NOUNS.get(kind, "file")
        try:
            if src.in_root is not None:
                fd = self.root.lookup(src.in_root)
            else:
                fd = os.open(src.path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            raise HookError(f"{noun} vanished: {src.path} (not visible in the container's "
                            f"mount namespace)") from None
        except OSError as e:
            raise HookError(f"cannot open {noun} {src.path}: {_reason(e)}") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (src.st.st_dev, src.st.st_ino):
            os.close(fd)
            raise HookError(f"{noun} {src.path} was replaced while nvhook was mounting it")
        return fd

    # -- kinds ---------------------------------------------------------------------------

    def bind(self, m: dict, opts: Options, src: Source) -> None:
        kind, target = m["kind"], m["target"]
        sfd = self._open_source(kind, src)
        try:
            want_dir = stat.S_ISDIR(src.st.st_mode)
            t = self._ensure(target, want_dir, src.path)
            try:
                if want_dir and not stat.S_ISDIR(t.mode):
                    raise HookError(f"cannot mount {src.path} on {target}: the image has a "
                                    f"{kind_name(t.mode)} there, a directory is needed")
                if not want_dir and stat.S_ISDIR(t.mode):
                    raise HookError(f"cannot mount {src.path} on {target}: the image has a directory "
                                    f"there, where nvhook mounts a {kind_name(src.st.st_mode)}")
                resolved = self.root.container_path(t.fd)
                if t.link is not None:
                    self.log.warning("mount.redirected", path=target, resolved=resolved, link=t.link,
                                     reason="the image has a symlink here; nvhook followed it inside "
                                            "the container's root and mounted on its target")
                elif resolved is not None and resolved != _normpath(target):
                    self.log.info("mount.via_symlink", path=target, resolved=resolved,
                                  reason="a directory on the way is a symlink in the image; nvhook "
                                         "followed it inside the container's root")
                if not t.created and stat.S_ISREG(t.mode):
                    if os.fstat(t.fd).st_size == 0:  # nvhook's placeholder from an earlier start
                        self.log.debug("mount.placeholder_reused", path=target)
                    else:
                        self.log.warning("mount.shadowed", path=target, source=src.path,
                                         reason="the image ships its own file here; the host's "
                                                "driver file is mounted over it")
                sandbox.mount(fdpath(sfd), fdpath(t.fd), None, sandbox.MS_BIND, None, what=target)
            except OSError as e:
                raise HookError(f"cannot mount {src.path} on {target}: {_reason(e)}") from None
            finally:
                t.close()
            if opts.flags:
                self._remount_bind(target, src, opts.flags)
        finally:
            os.close(sfd)
        self.count += 1
        if self.debug:
            self.log.debug("mount.done", kind=kind, source=src.path, target=target, options=m["options"])

    def _remount_bind(self, target: str, src: Source, flags: int) -> None:
        try:
            fd = self.root.lookup(target)
        except OSError as e:
            raise HookError(f"mount on {target} vanished right after nvhook made it: {_reason(e)}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (src.st.st_dev, src.st.st_ino):
                raise HookError(f"mount of {src.path} on {target} did not take effect "
                                f"(the path resolves to another file)")
            remount(fd, flags, target)
        except OSError as e:
            raise HookError(f"cannot remount {target} with its options: {_reason(e)}") from None
        finally:
            os.close(fd)

    def finish(self) -> None:
        """Remount the tmpfs read-only, innermost first."""
        for fd in [*self.node_dirs.values(), *self.own_dirs.values(), *self.made_dirs.values()]:
            if fd is not None:
                os.close(fd)
        self.node_dirs.clear()
        self.own_dirs.clear()
        self.made_dirs.clear()
        for target, flags in reversed(self.readonly_later):
            try:
                fd = self.root.lookup(target)
                try:
                    if sandbox.fstatfs_type(fd) != sandbox.TMPFS_MAGIC:
                        raise HookError(f"tmpfs on {target} is gone before nvhook made it read-only")
                    remount(fd, flags | sandbox.MS_RDONLY, target)
                finally:
                    os.close(fd)
            except OSError as e:
                raise HookError(f"cannot make the tmpfs on {target} read-only: {_reason(e)}") from None
            self.log.debug("tmpfs.readonly", target=target)


def apply_mounts(root: Root, mounts: list, sources: list, log) -> int:
    """Apply the plan's mounts in order; `sources[i]` is the parent's `Source` for mounts[i]
    (None for tmpfs). Returns the number of mounts made (copies included)."""
    m_ = Mounter(root, log)
    parsed: dict[tuple, Options] = {}  # a plan has a handful of distinct option lists
    old_umask = os.umask(0)
    m_.umask_zero = True
    try:
        _apply_each(m_, mounts, sources, parsed)
    finally:
        os.umask(old_umask)
        m_.umask_zero = False
    m_.finish()
    return m_.count


def _apply_each(m_: Mounter, mounts: list, sources: list, parsed: dict) -> None:
    for m, src in zip(mounts, sources):
        kind = m.get("kind")
        key = tuple(m.get("options") or ())
        opts = parsed.get(key)
        if opts is None:
            opts = parsed[key] = Options(list(key), m.get("target", "?"))
        if kind == "tmpfs":
            m_.tmpfs(m, opts)
        elif kind == "procfs" and opts.copy and isinstance(src, (CopySource, Source)):
            m_.copy(m, opts, src)
        elif kind == "device" and isinstance(src, (NodeSource, Source)):
            m_.device(m, opts, src)
        elif isinstance(src, Source):
            m_.bind(m, opts, src)
        else:  # the child opens each source for its kind and options: a plan that mixes them
            raise HookError(f"the plan's options for {m.get('target')} do not fit a {kind} mount")
