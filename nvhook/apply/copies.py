"""procfs copies: files of /proc/driver/nvidia written into the tmpfs nvhook mounted there.

  - `procfs` with "copy": the source file's bytes are written to a new file (mode 0444) in the
    target's directory, which must be on a tmpfs (the /proc/driver/nvidia tmpfs); "set:Key=Value"
    options rewrite the `Key: value` line (appended when missing), which is how the registry's
    ModifyDeviceFiles becomes 0.

The source is a `CopySource`: an fd the apply child opened for reading on the host side.
"""

from __future__ import annotations

import os

from ..base import sandbox
from ..base.errors import HookError
from .mountbase import MounterBase, Source
from .mountbase import reason as _reason
from .paths import split_path

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from .mounts import Options

_COPY_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


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
        dfd, rel = where
        try:
            fd = os.open(name if rel == "." else f"{rel}/{name}", _COPY_FLAGS, 0o444, dir_fd=dfd)
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

    def _in_own_tmpfs(self, directory: str) -> tuple[int, str] | None:
        """(O_PATH fd of the tmpfs this run mounted that holds `directory`, `directory` relative
        to it), creating the directories on the way; None when no such tmpfs holds it.

        Paths below that fd are used as they are, without resolving each component inside the
        root: the tmpfs is seconds old, only nvhook has written to it (directories and regular
        files, never a symlink), and the container has not started, so nothing in it can lead
        elsewhere. That is one mkdirat per new directory instead of a mkdirat, an open and a
        close, for the 128 directories of an 8 x 7 MIG container's capability tree."""
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
        rel = directory[len(top):].lstrip("/")
        if not rel:
            return fd, "."
        if directory not in self.made_dirs:
            self._mkdirs(fd, top, rel)
        return fd, rel

    def _mkdirs(self, fd: int, top: str, rel: str) -> None:
        parent = rel.rpartition("/")[0]
        if parent and f"{top.rstrip('/')}/{parent}" not in self.made_dirs:
            self._mkdirs(fd, top, parent)
        try:
            os.mkdir(rel, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        self.made_dirs.add(f"{top.rstrip('/')}/{rel}")
