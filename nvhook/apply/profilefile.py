"""The driver application profile file in the container (decide/appprofile.py says what and
why), and the container's GPU nodes it is decided from, both by fd inside the container root.

What the image may have planted on the way cannot move the write out of the root: every path is
resolved inside it (apply/paths.Root); the directories nvhook creates get mode 0555, as NVIDIA's
hook makes them; the file is written under a new name (O_EXCL|O_NOFOLLOW) and renamed over
10-container.conf (base/files.replace_file), so a link, FIFO or device the image has at that
name is replaced, never opened or followed (NVIDIA's hook would write through a link that stays
inside the root); and a directory on a volume mounted into the container (a hostPath of the
node's /etc) is not written. Written as the container's root, and not fsync'ed: the start
path's cost, for a file in the container's writable layer.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from ..base.errors import HookError
from ..base.files import replace_file
from .paths import reopen_dir

PROFILE_DIR = "/etc/nvidia/nvidia-application-profiles-rc.d"
PROFILE_NAME = "10-container.conf"
DIR_MODE = 0o555
FILE_MODE = 0o444


def gpu_nodes(root) -> list[tuple[str, bool, int]]:
    """(container path, is a character device, minor) of every /dev/nvidia* entry of the
    container's /dev (its link resolved inside the root; none when it has no /dev), links not
    followed: what decide/appprofile.gpu_minors takes. NVIDIA's hook lists the same entries."""
    try:
        dfd = root.lookup("/dev")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise HookError(f"failed to enumerate device nodes in container: {e.strerror or e}") from None
    out = []
    try:
        d = reopen_dir(dfd)
        try:
            for name in sorted(os.listdir(d)):
                if not name.startswith("nvidia"):
                    continue
                try:
                    st = os.stat(name, dir_fd=d, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since the listing
                is_char = stat.S_ISCHR(st.st_mode)
                out.append((f"/dev/{name}", is_char, os.minor(st.st_rdev) if is_char else 0))
        finally:
            os.close(d)
    except OSError as e:
        raise HookError(f"failed to enumerate device nodes in container: {e.strerror or e}") from None
    finally:
        os.close(dfd)
    return out


def write_profile(root, text: str, log) -> str | None:
    """PROFILE_DIR/PROFILE_NAME in the container with `text` (mode 0444), its missing
    directories made (0555). Returns why it was not written where the directory is a volume
    mounted into the container (logged as a warning: the container still starts, its EGL
    seeing every GPU); HookError with NVIDIA's words when it cannot be written otherwise."""
    try:
        dfd = _profile_dir(root)
    except _OnVolume as e:
        return _not_on_volume(e.filename, log)
    except OSError as e:
        raise HookError(f"failed to create application profiles directory {PROFILE_DIR} in the container: "
                        f"{e.strerror or e}") from None
    try:
        if not root.same_mount(dfd):
            return _not_on_volume(PROFILE_DIR, log)
        replace_file(dfd, PROFILE_NAME, text.encode(), FILE_MODE, what=None, create_as=root.owner, sync=False)
    except OSError as e:
        raise HookError(f"failed to write application profile {PROFILE_DIR}/{PROFILE_NAME} in the container: "
                        f"{e.strerror or e}") from None
    finally:
        os.close(dfd)
    log.info("app_profile.written", path=f"{PROFILE_DIR}/{PROFILE_NAME}", content=text)
    return None


def write_profile_or_warn(root, text: str, log) -> bool:
    """nvhook's own doors (hook mode, its CDI spec's hook, the NRI plugin): write_profile, where a
    profile the image's layout keeps out (a volume at its directory, a dangling link or a file
    on the way) is the warning event app_profile.not_written, never a failed start: the
    container's EGL then sees every GPU, as before NVIDIA 1.20. Whether it was written."""
    try:
        return write_profile(root, text, log) is None
    except HookError as e:
        log.warning("app_profile.not_written", error=e.message)
        return False


class _OnVolume(OSError):
    """A directory of PROFILE_DIR's is missing under one on a volume mounted into the container."""


def _not_on_volume(path: str, log) -> str:
    why = (f"the container's {path} is on a volume mounted into it (a hostPath or a shared directory), not "
           f"its image's: nvhook does not write {PROFILE_NAME} there, where it would land outside the "
           f"container's root filesystem; EGL and Vulkan see every GPU")
    log.warning("app_profile.not_written", reason=why)
    return why


def _profile_dir(root) -> int:
    """A directory fd on PROFILE_DIR, resolved inside the root, each missing component made
    with mode 0555 (whatever the umask) and owned by the container's root; never in a directory
    on a volume mounted into the container (a hostPath of the node's /etc: _OnVolume), where it
    would be the node's."""
    cur = root.lookup("/")
    path = ""
    try:
        for name in PROFILE_DIR.strip("/").split("/"):
            path += "/" + name
            try:
                fd = root.lookup(path)
            except FileNotFoundError:
                if not root.same_mount(cur):
                    raise _OnVolume(errno.EXDEV, "on a volume", posixpath.dirname(path) or "/") from None
                fd = _make_dir(root, cur, name, path)
            os.close(cur)
            cur = fd
            if not stat.S_ISDIR(os.fstat(cur).st_mode):
                raise OSError(errno.ENOTDIR, f"{path}: {os.strerror(errno.ENOTDIR)}")
        return reopen_dir(cur)
    finally:
        os.close(cur)


def _make_dir(root, parent: int, name: str, path: str) -> int:
    try:
        with root.as_owner():
            os.mkdir(name, DIR_MODE, dir_fd=parent)
    except FileExistsError:
        # made meanwhile, or a link whose target does not resolve inside the root (NVIDIA's hook
        # fails on it too): looked up again, the latter is ENOENT
        return root.lookup(path)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        os.fchmod(fd, DIR_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd

