"""Mounts and symlinks of a plan, applied inside the container's mount namespace.

Runs in the apply child (`nvhook.apply.child`) after setns(2) into the container's mount namespace and
before the runtime's pivot_root, so host paths (the mount sources) and the rootfs (at its host
path) are both visible. Every target is resolved inside the rootfs by `paths.Root`, and every
mount goes onto the resolved object's O_PATH fd (`/proc/self/fd/N`), so no symlink in the image
can move a mount out of the rootfs.

Per plan mount, in the plan's order:

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
  - `tmpfs`: a tmpfs with the plan's flags and data (mode=...), writable while nvhook fills it,
    remounted read-only after the last mount of the plan (unless its options say "rw").
  - `procfs` with "copy": the source file's bytes are written to a new file (mode 0444, created
    O_EXCL|O_NOFOLLOW in a directory fd nvhook made and opened O_NOFOLLOW itself) in the
    target's directory, which must be on a tmpfs (the /proc/driver/nvidia tmpfs); "set:Key=Value"
    options rewrite the `Key: value` line (appended when missing), which is how ModifyDeviceFiles
    in params (a module parameter, where real drivers show it) becomes 0.

Emulated /proc/driver/nvidia. When the container's procfs has no /proc/driver/nvidia (the host
has no NVIDIA kernel module loaded: CI machines, a driver tree given with `--root`), procfs
cannot hold a new directory. nvhook then keeps O_PATH fds on the existing entries of
/proc/driver, mounts a tmpfs (mode 0555) on the container's /proc/driver, binds those entries
back into it so they stay visible, creates nvidia/ in it, and goes on with the plan's tmpfs on
/proc/driver/nvidia. It logs the warning `procfs.emulated`. The /proc/driver tmpfs is remounted
read-only at the end like the plan's own tmpfs.

Symlinks: created with symlinkat on the resolved parent's fd. An existing symlink with the same
content is fine; one with different content is replaced atomically (a new link renamed over it)
and logged (`symlink.replaced`); anything else (a file, a directory) is left alone and logged
(`symlink.skipped`). Nothing on the way is followed out of the rootfs.

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
from .paths import Root, parent_name, split_path

_FLAGS = {"ro": sandbox.MS_RDONLY, "nosuid": sandbox.MS_NOSUID, "nodev": sandbox.MS_NODEV,
          "noexec": sandbox.MS_NOEXEC}

# statvfs f_flag bits -> mount flags, to carry the current atime mode through a remount (a
# mount with a locked atime mode, in a user namespace, refuses a remount that changes it).
_ST_NOATIME, _ST_NODIRATIME, _ST_RELATIME = 1024, 2048, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_ST_KEEP = sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC  # same bits in ST_* and MS_*

NOUNS = {"library": "library", "library32": "library", "compat": "library", "binary": "binary",
         "firmware": "firmware file", "device": "device node", "ipc": "IPC socket",
         "procfs": "procfs file"}
# What this layer can apply: one operation per kind (a bind per source kind, plus the tmpfs
# that procfs copies go into). A plan naming another kind is refused before anything is mounted.
KINDS = frozenset(NOUNS) | {"tmpfs"}

PROC_DRIVER = "/proc/driver"

# A copy is a new file in a directory nvhook made in its own tmpfs: O_EXCL|O_NOFOLLOW, so that
# nothing already there (a link, a file) is ever written through.
_COPY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def fdpath(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


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
    on EPERM (flags locked by a user namespace) retry keeping its nosuid/nodev/noexec too."""
    base = sandbox.MS_REMOUNT | sandbox.MS_BIND | flags | _atime_flags(fd)
    try:
        sandbox.mount(None, fdpath(fd), None, base, None, what=what)
    except OSError as e:
        if e.errno != errno.EPERM:
            raise
        sandbox.mount(None, fdpath(fd), None, base | (os.fstatvfs(fd).f_flag & _ST_KEEP), None, what=what)


def rewrite(content: bytes, sets: list[tuple[str, str]]) -> bytes:
    """Set `Key: value` lines (procfs format) to the given values; append missing keys."""
    lines = content.split(b"\n")
    for key, value in sets:
        k = key.encode()
        new = k + b": " + value.encode()
        for i, line in enumerate(lines):
            name, sep, _ = line.partition(b":")
            if sep and name.strip() == k:
                lines[i] = new
                break
        else:
            if lines and lines[-1] == b"":
                lines.insert(len(lines) - 1, new)
            else:
                lines.append(new)
    return b"\n".join(lines)


class Source:
    """A mount source as the apply child saw it host side, before entering the container's mount
    namespace: path, O_PATH (or O_RDONLY for copies) fd, and stat (None for copies), so that it
    can check it mounts the same inode."""

    __slots__ = ("path", "fd", "st", "in_root")

    def __init__(self, path: str, fd: int, st: os.stat_result | PlannedNode | None, in_root: str | None = None):
        self.path = path
        self.fd = fd
        self.st = st
        self.in_root = in_root  # the source's path inside the rootfs (compat libraries)


class PlannedNode:
    """A device node as the plan describes it, standing in for the host node's stat: what
    mknod needs (type and mode, number, owner), no inode to compare a bind mount with."""

    __slots__ = ("st_mode", "st_rdev", "st_uid", "st_gid")

    def __init__(self, mode: int, rdev: int, uid: int, gid: int):
        self.st_mode, self.st_rdev, self.st_uid, self.st_gid = mode, rdev, uid, gid


class Mounter:
    def __init__(self, root: Root, log):
        self.root = root
        self.log = log
        # Per-mount events are debug level; with 250 mounts in a MIG container, not even
        # building them when the log would drop them is worth a check.
        self.debug = getattr(log, "level", 0) <= 10
        self.readonly_later: list[tuple[str, int]] = []  # tmpfs to remount ro: (target, flags)
        self.count = 0
        # Directories that take device nodes, resolved once (112 MIG nodes share one):
        # parent path -> O_PATH fd, or None where nodes must be bind-mounted instead.
        self.node_dirs: dict[str, int | None] = {}
        # Directories inside a tmpfs this run mounted (nothing of the image's can be in
        # there): path -> O_PATH fd, so that 112 MIG capability files under
        # /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/ci<C> do not each re-walk the tree.
        self.own_tmpfs: set[str] = set()
        self.own_dirs: dict[str, int] = {}  # tmpfs root -> O_PATH fd
        self.made_dirs: dict[str, int] = {}  # container path of a directory made in one -> O_PATH fd

    # -- helpers -----------------------------------------------------------------------

    def _ensure(self, target: str, directory: bool, source: str):
        try:
            return self.root.ensure(target, directory)
        except OSError as e:
            raise HookError(f"cannot create mount point {target} in the container for {source}: "
                            f"{_reason(e)}") from None

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

    def device(self, m: dict, opts: Options, src: Source) -> None:
        """A device node is created in place (mknod) rather than bind-mounted: one syscall
        instead of about a dozen, which is what makes 8 GPUs x 7 MIG instances (112 capability
        nodes) cheap. The node gets the host node's number, mode and owner; the mount options
        (ro, nosuid, noexec) have nothing to restrict on a device node. Bind mounts remain for
        user-namespaced containers and a nodev /dev, where a node nvhook creates would be
        unusable, and for anything unexpected at the target (bind reports it)."""
        if self.root.owner != (0, 0) or not stat.S_ISCHR(src.st.st_mode):
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
            old_umask = os.umask(0)
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
                os.umask(old_umask)
        except OSError as e:
            raise HookError(f"cannot create device node {target} ({os.major(src.st.st_rdev)}:"
                            f"{os.minor(src.st.st_rdev)}) in the container: {_reason(e)}") from None
        self.count += 1
        if self.debug:
            self.log.debug("mount.done", kind="device", source=src.path, target=target, options=m["options"],
                           method="mknod")

    def _stat_source(self, src: Source) -> Source:
        """A bind needs the host node's inode to check what it mounted: a planned node has none."""
        if not isinstance(src.st, PlannedNode):
            return src
        try:
            st = os.stat(src.path)
        except FileNotFoundError:
            raise HookError(f"host device node vanished: {src.path}") from None
        except OSError as e:
            raise HookError(f"cannot stat host device node {src.path}: {_reason(e)}") from None
        return Source(src.path, src.fd, st, src.in_root)

    def _in_own_tmpfs(self, directory: str) -> int | None:
        """O_PATH fd of `directory`, inside a tmpfs this run mounted, creating the directories
        on the way; None when no such tmpfs holds it.

        The tmpfs root is resolved inside the rootfs once; below it every directory is made
        with mkdirat and opened O_NOFOLLOW|O_DIRECTORY on its parent's fd, and kept open, so a
        link planted in there (image code or a second container cannot reach a tmpfs in this
        mount namespace today; nvhook does not count on it) is never followed. An 8 x 7 MIG
        container's capability tree is 128 directories: one mkdirat and one open each."""
        parts = split_path(directory)
        if ".." in parts:
            return None  # never climb out of the tmpfs
        directory = "/" + "/".join(parts)
        top = None
        for t in self.own_tmpfs:  # one or two entries
            if (directory == t or directory.startswith(t if t.endswith("/") else t + "/")) and \
                    (top is None or len(t) > len(top)):
                top = t
        if top is None:
            return None
        fd = self.own_dirs.get(top)
        if fd is None:
            fd = self.root.lookup(top)  # the tmpfs root itself: resolved inside the rootfs
            if sandbox.fstatfs_type(fd) != sandbox.TMPFS_MAGIC:
                os.close(fd)
                return None
            self.own_dirs[top] = fd
        if directory == top:
            return fd
        return self._own_dir(fd, top.rstrip("/"), directory)

    def _own_dir(self, top_fd: int, top: str, directory: str) -> int:
        fd = self.made_dirs.get(directory)
        if fd is not None:
            return fd
        parent, _, name = directory.rpartition("/")
        pfd = top_fd if parent == top else self._own_dir(top_fd, top, parent)
        try:
            os.mkdir(name, 0o755, dir_fd=pfd)
        except FileExistsError:
            pass  # made by an earlier copy's path; opened below without following anything
        fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        self.made_dirs[directory] = fd
        return fd

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

    def copy(self, m: dict, opts: Options, src: Source) -> None:
        target = m["target"]
        parent, _, name = target.rstrip("/").rpartition("/")
        try:
            content = os.read(src.fd, 65536)
            if content:  # procfs hands out what it has per read: read to the end
                more = [content]
                while b := os.read(src.fd, 65536):
                    more.append(b)
                content = b"".join(more)
        except OSError as e:
            raise HookError(f"cannot read {src.path}: {_reason(e)}") from None
        if opts.sets:
            content = rewrite(content, opts.sets)
        try:
            where = self._in_own_tmpfs(parent or "/")
        except OSError as e:
            raise HookError(f"cannot copy {src.path} to {target}: {_reason(e)}") from None
        if where is None or not name or name in (".", ".."):
            raise HookError(f"cannot copy {src.path} to {target}: {parent} is not in a tmpfs nvhook "
                            f"mounted (the plan must mount one there first)")
        try:
            fd = os.open(name, _COPY_FLAGS, 0o444, dir_fd=where)
            try:
                n = os.write(fd, content)
                if n < len(content):
                    view = memoryview(content)[n:]
                    while view:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as e:
            raise HookError(f"cannot copy {src.path} to {target}: {_reason(e)}") from None
        self.count += 1
        if self.debug:
            self.log.debug("procfs.copied", source=src.path, target=target,
                           rewrites=[f"{k}={v}" for k, v in opts.sets])

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
    for m, src in zip(mounts, sources, strict=False):
        kind = m.get("kind")
        key = tuple(m.get("options") or ())
        opts = parsed.get(key)
        if opts is None:
            opts = parsed[key] = Options(list(key), m.get("target", "?"))
        if kind == "tmpfs":
            m_.tmpfs(m, opts)
        elif kind == "procfs" and opts.copy:
            m_.copy(m, opts, src)
        elif kind == "device":
            m_.device(m, opts, src)
        else:
            m_.bind(m, opts, src)
    m_.finish()
    return m_.count


def apply_symlinks(root: Root, symlinks: list, log) -> int:
    count = 0
    for s in symlinks:
        path, content = s["path"], s["target"]
        parent, _, name = path.rstrip("/").rpartition("/")
        try:
            t = root.ensure(parent or "/", True)
        except OSError as e:
            raise HookError(f"cannot create the directory of symlink {path} in the container: "
                            f"{_reason(e)}") from None
        try:
            if not stat.S_ISDIR(t.mode):
                raise HookError(f"cannot create symlink {path}: {parent} is a {kind_name(t.mode)} in the image")
            try:
                with root.as_owner():
                    os.symlink(content, name, dir_fd=t.fd)
                count += 1
                log.debug("symlink.created", path=path, target=content)
                continue
            except FileExistsError:
                pass
            st = os.stat(name, dir_fd=t.fd, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode):
                log.warning("symlink.skipped", path=path, target=content,
                            reason=f"the image has a {kind_name(st.st_mode)} there; nvhook leaves it")
                continue
            old = os.readlink(name, dir_fd=t.fd)
            if old == content:
                log.debug("symlink.exists", path=path, target=content)
                continue
            tmp = f".{name}.nvhook-{os.getpid()}"
            with root.as_owner():
                os.symlink(content, tmp, dir_fd=t.fd)
            try:
                os.rename(tmp, name, src_dir_fd=t.fd, dst_dir_fd=t.fd)
            except OSError:
                os.unlink(tmp, dir_fd=t.fd)
                raise
            count += 1
            log.warning("symlink.replaced", path=path, target=content, previous=old)
        except OSError as e:
            raise HookError(f"cannot create symlink {path} -> {content}: {_reason(e)}") from None
        finally:
            t.close()
    return count


def _normpath(path: str) -> str:
    return "/" + "/".join(split_path(path))


def _reason(e: OSError) -> str:
    """An OSError's text without Python's "[Errno N]" prefix."""
    if e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    return e.strerror or str(e)
