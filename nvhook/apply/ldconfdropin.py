"""A loader drop-in in the container's /etc/ld.so.conf.d, written by fd: nvidia-cdi-hook's
update-ldcache (the folders the image's loader config lacks) and enable-cuda-compat (the compat
directory first), and the NRI plugin's compat choice, all write it through here.
"""

from __future__ import annotations

import os

from .paths import reopen_dir


def write_conf(root, directory: str, name: str, content: str) -> None:
    """A new file in a directory of the rootfs: created by fd (base/files.replace_file:
    O_EXCL|O_NOFOLLOW under a temporary name, renamed over the final one, not fsync'ed on the
    start path), so that no link the image has there is written through; the container's
    root's, as the directories made on the way and the loader cache are. /etc/ld.so.conf is
    created (including the directory) when missing, as NVIDIA's hook does, so that the loader
    cache step reads the file."""
    from ..base.errors import HookError
    from ..base.files import replace_file

    def ours(t, path: str) -> None:
        if not root.same_mount(t.fd):
            raise HookError(f"the container's {path} is a volume mounted into it (a hostPath or a shared "
                            f"directory), not its image's: nvhook does not write {directory}/{name} there, where "
                            f"it would land outside the container's root filesystem; mount that volume elsewhere")

    try:
        etc = root.ensure("/etc", True)
        try:
            ours(etc, "/etc")
            ed = reopen_dir(etc.fd)
            try:
                _include(root, ed, directory)
            finally:
                os.close(ed)
        finally:
            etc.close()
        t = root.ensure(directory, True)
        try:
            ours(t, directory)
            d = reopen_dir(t.fd)
            try:
                replace_file(d, name, content.encode(), 0o644, what=None, create_as=root.owner, sync=False)
            finally:
                os.close(d)
        finally:
            t.close()
    except OSError as e:
        raise HookError(f"cannot write {directory}/{name} in the container: {e.strerror}") from None


def _include(root, etc: int, directory: str) -> None:
    """/etc/ld.so.conf including `directory`, made (as the container's root) where the image
    has none: looked up first, since nearly every image has one and a switch of the creating
    ids costs a start system calls for nothing."""
    try:
        os.stat("ld.so.conf", dir_fd=etc, follow_symlinks=False)
        return
    except FileNotFoundError:
        pass
    try:
        with root.as_owner():
            fd = os.open("ld.so.conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=etc)
    except FileExistsError:  # made meanwhile
        return
    try:
        os.write(fd, f"include {directory}/*.conf\n".encode())
    finally:
        os.close(fd)
