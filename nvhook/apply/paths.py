"""Container paths resolved inside the rootfs, never outside it.

An image is untrusted: any directory on the way to a mount target may be a symlink, and an
absolute link (`/usr/lib/x86_64-linux-gnu -> /tmp/hostile`) or a climbing one (`-> ../../..`)
would, resolved by the host's kernel from the host's root, point at the host (the reference's
CVE-2024-0132). `Root` resolves every container path with the rootfs as "/":

  - where the kernel has openat2(2) (5.6+): `openat2(rootfs_fd, path, O_PATH,
    RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`; the kernel clamps absolute links and ".." at the
    rootfs and refuses /proc magic links;
  - otherwise (ENOSYS, checked once per process) a component-by-component walk: each component
    opened with O_PATH|O_NOFOLLOW relative to the previous directory's fd, symlinks read with
    readlinkat and expanded by us with the rootfs as "/", ".." popping our own stack of fds (it
    never goes above the rootfs), at most 40 links.

Everything that is created is created relative to an fd of its resolved parent: directories with
mkdirat, files with openat(O_CREAT|O_EXCL|O_NOFOLLOW), so a name that turns out to be a symlink
is never followed by the creating call. Missing components are created where the walk stands,
which for a dangling symlink means at its target, resolved inside the rootfs (as the reference
does), with the fsuid/fsgid of the container's root (`Root.owner`). Callers mount onto the
resolved object through its O_PATH fd (`/proc/self/fd/N`).
"""

from __future__ import annotations

import errno
import os
import stat

from ..base import sandbox

_O_PATH = os.O_PATH | os.O_CLOEXEC
_MAX_LINKS = 40

# None: not tried yet; True/False: whether this kernel has openat2.
_have_openat2: bool | None = None


def split_path(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def _split_walk(path: str) -> list[str]:
    """Components for the walk: "." kept, and a trailing "/" read as "/.", so that, as for the
    kernel, "file/." and "file/" are ENOTDIR rather than the file."""
    parts = [p for p in path.split("/") if p]
    if path.endswith("/") and parts:
        parts.append(".")
    return parts


def mount_id(fd: int) -> int | None:
    """The id of the mount `fd` is open on (its `mnt_id:` line in /proc/self/fdinfo), or None."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class Target:
    """A resolved container path: an O_PATH fd on it and how it came to be."""

    __slots__ = ("fd", "mode", "created", "link")

    def __init__(self, fd: int, mode: int, created: bool, link: str | None):
        self.fd = fd
        self.mode = mode
        self.created = created  # nvhook created the final object (a placeholder)
        self.link = link  # the image had a symlink at the path, with this content

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Root:
    """Resolves container paths relative to an fd on the rootfs (opened in the container's
    mount namespace, so that mounts on the returned fds land in that namespace)."""

    def __init__(self, fd: int, use_openat2: bool | None = None, owner: tuple[int, int] = (0, 0)):
        self.fd = fd
        self._use_openat2 = use_openat2  # None: decide by probing (tests force False)
        # The host uid/gid of the container's root: what nvhook creates in the image belongs to
        # it. In a user-namespaced container, runc's /dev tmpfs even refuses (EOVERFLOW) files
        # owned by host root, which has no id in the container's namespace.
        self.owner = owner
        self._base: str | None = None  # the kernel's name for the rootfs, for container_path()

    def container_path(self, fd: int) -> str | None:
        """The container path of the object `fd` is open on, from the kernel's name for it
        (/proc/self/fd), or None when that name is not under the rootfs. Used to report where
        a target really landed when the image has symlinks on the way."""
        try:
            if self._base is None:
                self._base = os.readlink(f"/proc/self/fd/{self.fd}")
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        base = self._base.rstrip("/")
        if not base:
            return path
        if path == base:
            return "/"
        if path.startswith(base + "/"):
            return path[len(base):]
        return None

    def same_mount(self, fd: int) -> bool:
        """Whether the object `fd` is open on lies on the root filesystem's own mount, not on a
        volume mounted into the container (a hostPath of the node's /etc, an emptyDir shared by
        two containers): nvhook writes its loader files only into the image's own filesystem.
        Unknown (no /proc): True, as before this check."""
        mine, theirs = mount_id(self.fd), mount_id(fd)
        return mine is None or theirs is None or mine == theirs

    def as_owner(self) -> sandbox.FsIds:
        """`with root.as_owner():` creates files as the container's root (a no-op for root)."""
        return sandbox.FsIds(self.owner)

    # -- lookups -------------------------------------------------------------------------

    def _openat2_ok(self) -> bool:
        global _have_openat2
        if self._use_openat2 is not None:
            return self._use_openat2
        return _have_openat2 is not False

    def lookup(self, path: str) -> int:
        """O_PATH fd on the object `path` names inside the rootfs, following symlinks (all of
        them, the last one too) with the rootfs as "/". OSError (ENOENT, ENOTDIR, ELOOP...)
        when it does not resolve."""
        global _have_openat2
        if self._openat2_ok():
            for _ in range(8):
                try:
                    fd = sandbox.openat2(self.fd, path, _O_PATH, 0,
                                         sandbox.RESOLVE_IN_ROOT | sandbox.RESOLVE_NO_MAGICLINKS)
                except OSError as e:
                    if e.errno == errno.ENOSYS:
                        _have_openat2 = False
                        break
                    if e.errno == errno.EAGAIN:  # a rename raced with ".."; the kernel asks to retry
                        continue
                    raise OSError(e.errno, f"{path}: {os.strerror(e.errno or 0)}") from None
                _have_openat2 = True
                return fd
        return self._walk(path, None)

    def exists(self, path: str) -> bool:
        try:
            os.close(self.lookup(path))
        except OSError:
            return False
        return True

    def lstat_in(self, path: str) -> tuple[int, str, os.stat_result | None]:
        """(parent fd, name, lstat of name or None) with the parent resolved inside the root."""
        parent, name = parent_name(path)
        pfd = self.lookup(parent)
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError:
            os.close(pfd)
            raise
        return pfd, name, st

    # -- creating ------------------------------------------------------------------------

    def ensure(self, path: str, directory: bool) -> Target:
        """Resolve `path`, creating what is missing (parents as directories, the last component
        as a directory or an empty regular file). An existing object is returned as is, of
        whatever type: the caller checks it."""
        parent, name = parent_name(path)
        if not name:
            fd = self.lookup("/")
            return Target(fd, os.fstat(fd).st_mode, False, None)
        try:
            pfd = self.lookup(parent)
        except FileNotFoundError:
            return self._walk_target(path, directory)
        try:
            for _ in range(4):
                try:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    if _create(pfd, name, directory, self.owner):
                        fd = os.open(name, _O_PATH | os.O_NOFOLLOW, dir_fd=pfd)
                        st = os.fstat(fd)
                        if stat.S_ISLNK(st.st_mode):  # swapped under us; resolve it like any link
                            os.close(fd)
                            continue
                        return Target(fd, st.st_mode, True, None)
                    continue  # lost a race with someone creating it: look again
                if stat.S_ISLNK(st.st_mode):
                    link = os.readlink(name, dir_fd=pfd)
                    try:
                        fd = self.lookup(path)
                    except FileNotFoundError:
                        t = self._walk_target(path, directory)  # dangling: create its target, inside
                        t.link = link
                        return t
                    return Target(fd, os.fstat(fd).st_mode, False, link)
                fd = os.open(name, _O_PATH | os.O_NOFOLLOW, dir_fd=pfd)
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    os.close(fd)
                    continue
                return Target(fd, st.st_mode, False, None)
            raise OSError(errno.EAGAIN, f"{path}: changed repeatedly while nvhook resolved it")
        finally:
            os.close(pfd)

    def _walk_target(self, path: str, directory: bool) -> Target:
        created: list[bool] = []
        fd = self._walk(path, "dir" if directory else "file", created)
        return Target(fd, os.fstat(fd).st_mode, bool(created), None)

    # -- the walk ------------------------------------------------------------------------

    def _walk(self, path: str, create: str | None, created: list | None = None) -> int:
        """Resolve `path` one component at a time without letting the kernel follow any
        symlink; `create` ("dir"/"file") creates missing components."""
        todo = _split_walk(path)
        todo.reverse()  # a stack: pop() gives the next component
        stack: list[int] = []  # fds of the directories below the root we are in
        links = 0
        result = -1
        try:
            while todo:
                comp = todo.pop()
                cur = stack[-1] if stack else self.fd
                if comp == ".":  # we only ever stand in directories
                    continue
                if comp == "..":
                    if stack:  # at the root, ".." stays at the root
                        os.close(stack.pop())
                    continue
                last = not todo
                try:
                    fd = os.open(comp, _O_PATH | os.O_NOFOLLOW, dir_fd=cur)
                except FileNotFoundError:
                    if create is None:
                        raise OSError(errno.ENOENT, f"{path}: {os.strerror(errno.ENOENT)}") from None
                    made = _create(cur, comp, create == "dir" or not last, self.owner)
                    fd = os.open(comp, _O_PATH | os.O_NOFOLLOW, dir_fd=cur)
                    if made and last and created is not None:
                        created.append(True)
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > _MAX_LINKS:
                        os.close(fd)
                        raise OSError(errno.ELOOP, f"{path}: {os.strerror(errno.ELOOP)}")
                    target = os.readlink("", dir_fd=fd)
                    os.close(fd)
                    if target.startswith("/"):
                        while stack:
                            os.close(stack.pop())
                    parts = _split_walk(target)
                    parts.reverse()
                    todo.extend(parts)
                    continue
                if last:
                    result = fd
                    break
                if not stat.S_ISDIR(st.st_mode):
                    os.close(fd)
                    raise OSError(errno.ENOTDIR, f"{path}: {os.strerror(errno.ENOTDIR)}")
                stack.append(fd)
            if result < 0:  # the path (or the last link) ended at a directory we hold
                result = os.dup(stack[-1] if stack else self.fd)
            return result
        finally:
            for fd in stack:
                if fd != result:
                    os.close(fd)


def reopen_dir(fd: int) -> int:
    """A readable directory fd on the object the O_PATH `fd` holds (the same inode, whatever
    its name points at by now): what listdir and *at calls with a name need."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def parent_name(path: str) -> tuple[str, str]:
    parts = split_path(path)
    if not parts:
        return "/", ""
    if parts[-1] == "..":
        raise OSError(errno.EINVAL, f"{path}: a target may not end in '..'")
    return "/" + "/".join(parts[:-1]), parts[-1]


def _create(dirfd: int, name: str, directory: bool, owner: tuple[int, int] = (0, 0)) -> bool:
    """Create `name` in `dirfd` without following anything; False if it already exists."""
    try:
        with sandbox.FsIds(owner):
            if directory:
                os.mkdir(name, 0o755, dir_fd=dirfd)
            else:
                os.close(os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o644, dir_fd=dirfd))
    except FileExistsError:
        return False
    return True


def container_root_ids(pid: int) -> tuple[int, int]:
    """The uid and gid that the container's root is in nvhook's own user namespace: (0, 0)
    when the container shares it (no user namespace, or rootless podman, where the hook runs
    in the container's user namespace already)."""
    try:
        mine, theirs = os.stat("/proc/self/ns/user"), os.stat(f"/proc/{pid}/ns/user")
        if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
            return 0, 0
    except OSError:
        return 0, 0
    # Read from another user namespace, the maps' second column is in the reader's namespace.
    ids = []
    for name in ("uid_map", "gid_map"):
        host = 0
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "0":
                        host = int(parts[1])
                        break
        except OSError:
            pass
        ids.append(host)
    return ids[0], ids[1]
