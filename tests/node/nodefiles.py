"""A node's files, reached from the machine without ever following the node's links onto it.

A node root is a Debian tree: /var/run -> /run, /etc/alternatives/* -> /usr/..., and a test
may plant any link it likes. Reached as /proc/<init>/root/<path>, the machine's kernel follows
an absolute link in <path> from the machine's own root: `/etc/foo -> /etc/bar` in the node would
make a test that writes the node's /etc/foo write the machine's /etc/bar. So every path here is
resolved with the node root as "/" (nvhook's own `Root`: openat2 RESOLVE_IN_ROOT, or a walk
component by component where the kernel lacks it), as a container's runtime resolves an image's
links, and files are created and replaced relative to the fd of their resolved directory.

`root` is a machine path of the node's "/" (/proc/<init>/root, or any directory for the tests).
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

from nvhook.apply.paths import Root, parent_name, reopen_dir

_MAX_LINKS = 40


class _Tree:
    """An open node root: `with _Tree(root) as t:`."""

    def __init__(self, root: str | Path):
        self.fd = os.open(str(root), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.root = Root(self.fd)

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def directory(self, path: str, create: bool) -> int:
        """A readable fd on directory `path` (created with its parents when `create`)."""
        if create:
            t = self.root.ensure(path, directory=True)
            fd, mode = t.fd, t.mode
        else:
            fd = self.root.lookup(path)
            mode = os.fstat(fd).st_mode
        try:
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{path}: not a directory in the node")
            return reopen_dir(fd)
        finally:
            os.close(fd)


def write(root: str | Path, path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Replace node file `path` with `data` atomically (a link at `path` itself is replaced,
    never followed); missing parent directories are created, inside the node."""
    parent, name = parent_name(path)
    raw = data.encode() if isinstance(data, str) else data
    with _Tree(root) as t:
        dfd = t.directory(parent, create=True)
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            try:
                os.write(fd, raw)  # a test's file: small, and a short write on a local fs does not happen
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(dfd)


def read(root: str | Path, path: str) -> bytes:
    """The content of node file `path`, its links followed inside the node."""
    with _Tree(root) as t:
        pfd = t.root.lookup(path)
        try:
            if not stat.S_ISREG(os.fstat(pfd).st_mode):
                raise OSError(errno.EINVAL, f"{path}: not a regular file in the node")
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(pfd)
        with os.fdopen(fd, "rb") as f:
            return f.read()


def remove(root: str | Path, path: str, missing_ok: bool = True) -> None:
    """Unlink node file (or link) `path`, its directory resolved inside the node."""
    parent, name = parent_name(path)
    with _Tree(root) as t:
        try:
            dfd = t.directory(parent, create=False)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            if not missing_ok:
                raise
        finally:
            os.close(dfd)


def resolve(root: str | Path, path: str, follow: bool = True) -> str:
    """The node path `path` names with every link resolved inside the node (the last one only
    when `follow`): a path the machine can walk under `root` without meeting a link (unless one
    is swapped in meanwhile: for reading and stat; writes go through `write` and `remove`)."""
    base = str(root).rstrip("/")
    todo = [p for p in path.split("/") if p and p != "."][::-1]
    done: list[str] = []
    links = 0
    while todo:
        comp = todo.pop()
        if comp == "..":
            if done:
                done.pop()
            continue
        here = "/".join([base, *done, comp])
        try:
            st = os.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            done.append(comp)  # nothing below a missing name is a link: the rest as it stands
            continue
        if stat.S_ISLNK(st.st_mode) and (todo or follow):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, f"{path}: {os.strerror(errno.ELOOP)}")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo.extend(p for p in reversed(target.split("/")) if p and p != ".")
            continue
        done.append(comp)
    return "/" + "/".join(done)
