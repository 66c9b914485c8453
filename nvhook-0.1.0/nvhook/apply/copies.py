"""procfs copies: files of /proc/driver/nvidia written into the tmpfs nvhook mounted there.

  - `procfs` with "copy": the source file's bytes are written to a new file (mode 0444, created
    O_EXCL|O_NOFOLLOW in a directory fd nvhook made and opened O_NOFOLLOW itself) in the
    target's directory, which must be on a tmpfs (the /proc/driver/nvidia tmpfs); "set:Key=Value"
    options rewrite the `Key: value` line (appended when missing), which is how ModifyDeviceFiles
    in params (a module parameter, where real drivers show it) becomes 0.

The source is a `CopySource`: an fd the apply step opened for reading on the host side.
"""

from __future__ import annotations

import os

from ..base import sandbox
from ..base.errors import HookError
from .mountbase import MounterBase, Options, Source
from .mountbase import reason as _reason
from .paths import split_path

# A copy is a new file in a directory nvhook made in its own tmpfs: O_EXCL|O_NOFOLLOW, so that
# nothing already there (a link, a file) is ever written through.
_COPY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


class CopySource:
    """A procfs copy's source: its host path and an fd open for reading."""

    __slots__ = ("path", "fd")

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd


class Copies(MounterBase):
    """The procfs-copy kind of `mounts.Mounter`."""

    def copy(self, m: dict, opts: Options, src: CopySource | Source) -> None:
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
