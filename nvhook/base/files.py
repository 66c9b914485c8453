"""Replacing a file atomically without following a link someone planted: shared by the bundle's
config.json (nvhook-runtime), the CDI spec, the engines' configs (`nvhook runtime configure`),
the start-path bundle, the /dev/char links (`nvhook system create-dev-char-links`), and the
files the container start writes into the container's /etc (apply/profilefile.py's
application profile, apply/ldconfdropin.py's loader drop-in)."""

from __future__ import annotations

import os

from .errors import HookError, show


def replace_file(dir_fd: int, name: str, data: bytes, mode: int, what: str | None,
                 owner: tuple[int, int] | None = None, *, create_as: tuple[int, int] | None = None,
                 sync: bool = True) -> None:
    """Replace `name` in the directory `dir_fd` with `data`: a new file created there under a
    temporary name with O_EXCL|O_NOFOLLOW (a planted file or link is never written through),
    given `mode` whatever the umask, renamed over the old one. On any failure nothing is left
    behind.

    `what` names the file in the HookError a failure raises; None raises the OSError itself,
    for a caller that words its own line (the container's files, in NVIDIA's words).
    `owner` (uid, gid) is given to the file once written (fchown): a host file that keeps
    its old owner. `create_as` (uid, gid) is who creates it instead (sandbox.FsIds): a file
    in a container's root is its root's from the start, where a filesystem mounted in the
    container's user namespace refuses one of host root's (EOVERFLOW). `sync=False` skips
    the fsync, for the container start path: a container's writable layer need not outlive a
    crash of the node, and an fsync on a busy disk would cost the start milliseconds."""
    tmp = temp_name(name)
    try:
        fd = _create(dir_fd, tmp, mode, create_as)
    except OSError as e:
        if what is None:
            raise
        raise HookError(f"cannot write {what}: creating {show(tmp)}: {e.strerror}") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if owner is not None:
                os.fchown(fd, *owner)  # before the mode: a chown clears set-id bits
            os.fchmod(fd, mode)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        _discard(dir_fd, tmp)
        if what is None or not isinstance(e, OSError):
            raise
        raise HookError(f"cannot write {what}: {e.strerror}") from None


def _create(dir_fd: int, tmp: str, mode: int, ids: tuple[int, int] | None) -> int:
    """The new file `tmp` in `dir_fd`, open for writing. An entry already at that name (our
    pid's: left by a run that was killed, or planted, as an image can guess a long-lived NRI
    plugin's pid) is removed once, never opened: unlink takes the entry, not a link's target.
    So one thread of a process writes a given file at a time (the NRI plugin's starts, each
    in a thread, write into their own containers' roots)."""
    try:
        return _open_new(dir_fd, tmp, mode, ids)
    except FileExistsError:
        os.unlink(tmp, dir_fd=dir_fd)
    return _open_new(dir_fd, tmp, mode, ids)


def _open_new(dir_fd: int, tmp: str, mode: int, ids: tuple[int, int] | None) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if ids is None:
        return os.open(tmp, flags, mode, dir_fd=dir_fd)
    from .sandbox import FsIds  # only here: the host's files are created as nvhook itself

    with FsIds(ids):
        return os.open(tmp, flags, mode, dir_fd=dir_fd)


def replace_symlink(dir_fd: int, name: str, target: str, what: str) -> None:
    """Point `name` in the directory `dir_fd` at `target`: a new link made under a temporary
    name and renamed over the old entry, so that there is never a moment without one. On any
    failure nothing is left behind and the HookError names `what`."""
    tmp = temp_name(name)
    try:
        os.symlink(target, tmp, dir_fd=dir_fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        _discard(dir_fd, tmp)
        raise HookError(f"cannot create {what}: {e.strerror}") from None


def temp_name(name: str) -> str:
    """The name a new `name` is written under before it is renamed into place."""
    return f".{name}.nvhook-{os.getpid()}"


def _discard(dir_fd: int, tmp: str) -> None:
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except OSError:
        pass
