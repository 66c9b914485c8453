"""Symlinks of a plan, created inside the container's rootfs.

Created with symlinkat on the resolved parent's fd. An existing symlink with the same content
is fine; one with different content is replaced atomically (a new link renamed over it) and
logged (`symlink.replaced`); anything else (a file, a directory) is left alone and logged
(`symlink.skipped`). Nothing on the way is followed out of the rootfs.
"""

from __future__ import annotations

import os
import stat

from ..base.errors import HookError
from ..base.rootpath import kind_name
from .mountbase import reason as _reason
from .paths import Root


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
