"""Replacing a file atomically without following a link someone planted: shared by the bundle's
config.json (nvhook-runtime), the CDI spec, the engines' configs (`nvhook runtime configure`),
the start-path bundle and the /dev/char links (`nvhook system create-dev-char-links`)."""

from __future__ import annotations

import os

from .errors import HookError, show


def replace_file(dir_fd: int, name: str, data: bytes, mode: int, what: str,
                 owner: tuple[int, int] | None = None) -> None:
    """Replace `name` in the directory `dir_fd` with `data`: a new file created there with
    O_EXCL|O_NOFOLLOW (a planted file or link is never written through), given `mode` and
    `owner` (uid, gid; default: ours), fsync'ed, renamed over the old one. On any failure
    nothing is left behind and the HookError names `what`."""
    tmp = _tmp_name(name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        raise HookError(f"cannot write {what}: creating {show(tmp)}: {e.strerror}") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if owner is not None:
                os.fchown(fd, *owner)  # before the mode: a chown clears set-id bits
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        _discard(dir_fd, tmp)
        raise HookError(f"cannot write {what}: {e.strerror}") from None


def replace_symlink(dir_fd: int, name: str, target: str, what: str) -> None:
    """Point `name` in the directory `dir_fd` at `target`: a new link made under a temporary
    name and renamed over the old entry, so that there is never a moment without one. On any
    failure nothing is left behind and the HookError names `what`."""
    tmp = _tmp_name(name)
    try:
        os.symlink(target, tmp, dir_fd=dir_fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        _discard(dir_fd, tmp)
        raise HookError(f"cannot create {what}: {e.strerror}") from None


def _tmp_name(name: str) -> str:
    return f".{name}.nvhook-{os.getpid()}"


def _discard(dir_fd: int, tmp: str) -> None:
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except OSError:
        pass
