"""The container's /proc/driver/nvidia/params with ModifyDeviceFiles 0: what NVIDIA's
disable-device-node-modification hook does (nvhook/start/cdihook/disable_device_node_modification.py
is its front door), so that no CUDA call in the container creates or changes device nodes
(the driver would otherwise make the nodes of every GPU in the container's /dev).

Every step goes by fd inside the rootfs; the copy lives on a private tmpfs that is gone from
the image once the bind holds it.
"""

from __future__ import annotations

import os

from .paths import reopen_dir

# A module global, read at each call: tests point it at a procfs file every kernel has.
PARAMS = "/proc/driver/nvidia/params"


def modified_params(content: bytes) -> bytes | None:
    """params with ModifyDeviceFiles 1 turned to 0; None when nothing is to change."""
    out, changed = [], False
    for line in content.decode(errors="replace").splitlines():
        if line.startswith("ModifyDeviceFiles: "):
            if line == "ModifyDeviceFiles: 0":
                return None
            if line == "ModifyDeviceFiles: 1":
                line, changed = "ModifyDeviceFiles: 0", True
        out.append(line + "\n")
    return "".join(out).encode() if changed else None


def mask_params(root, host_root: str, log) -> None:
    """A read-only copy of the host's params with ModifyDeviceFiles 0, bound over the
    container's /proc/driver/nvidia/params. The copy lives on a tmpfs mounted on a directory
    nvhook makes in the rootfs and unmounts (detached) and removes once the bind holds the
    file, so nothing is left in the image; every step goes through fds resolved inside the
    rootfs, and the target must be a procfs file (the image cannot plant one: procfs is the
    runtime's mount)."""
    from ..base import sandbox
    from ..base.errors import HookError

    host_root = host_root.rstrip("/")
    try:
        with open(host_root + PARAMS, "rb") as f:
            content = modified_params(f.read(1 << 16))
    except FileNotFoundError:
        return
    except OSError as e:
        raise HookError(f"failed to load params file: {e.strerror}") from None
    if content is None:
        return
    try:
        target = root.lookup(PARAMS)
    except OSError as e:
        log.debug("params.absent", reason=str(e))
        return  # no NVIDIA procfs in the container: nothing to hide
    try:
        if masked_already(sandbox, target, content):
            log.info("params.already_masked", path=PARAMS, modify_device_files=0)
            return
        if sandbox.fstatfs_type(target) != sandbox.PROC_SUPER_MAGIC:
            raise HookError(f"{PARAMS} in the container is not on procfs; refusing to mount over it")
        # Random, not the pid alone: a hook killed before its rmdir leaves the directory in the
        # image's layer, and a later start of that container may get the same pid.
        name = f".nvhook-params-{os.getpid()}-{os.urandom(4).hex()}"
        rfd = reopen_dir(root.fd)
        try:
            os.mkdir(name, 0o700, dir_fd=rfd)
            try:
                _params_via_tmpfs(sandbox, rfd, name, content, target, lambda: root.lookup(PARAMS))
            finally:
                os.rmdir(name, dir_fd=rfd)
        finally:
            os.close(rfd)
    except OSError as e:
        raise HookError(f"failed to mount modified params file: {e.strerror or e}") from None
    finally:
        os.close(target)
    log.info("params.masked", path=PARAMS, modify_device_files=0)


def masked_already(sandbox, target: int, content: bytes) -> bool:
    """The target is the read-only tmpfs copy an earlier run of this entry bound there for this
    container (same bytes): the entry run twice (its marker lost to another container of the
    same id, the hook named in two phases) then succeeds as NVIDIA's does, which mounts again.
    An image cannot put a mount under /proc: only the runtime or a hook has."""
    if sandbox.fstatfs_type(target) != sandbox.TMPFS_MAGIC:
        return False
    fd = os.open(f"/proc/self/fd/{target}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            return False
        return os.read(fd, len(content) + 1) == content
    finally:
        os.close(fd)


def _params_via_tmpfs(sandbox, rfd: int, name: str, content: bytes, target: int, relookup) -> None:
    """Write `content` on a tmpfs mounted on the empty directory `name` (in the rootfs at
    `rfd`), bind it read-only over `target`, and detach the tmpfs again (the bind keeps the
    file). `relookup()` opens the target path again: after the bind, that reaches the bind."""
    from ..base.errors import HookError

    scratch = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
    try:
        sandbox.mount("tmpfs", f"/proc/self/fd/{scratch}", "tmpfs", 0, f"size={max(len(content), 4096)},mode=0700")
    finally:
        os.close(scratch)
    # A magic link resolves to the directory the fd was opened on, beneath the new mount (the
    # file would land in the image, and umount would find no mount root there): a name looked
    # up in the parent crosses onto the tmpfs.
    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
    try:
        if sandbox.fstatfs_type(inner) != sandbox.TMPFS_MAGIC:
            raise HookError(f"the tmpfs nvhook mounted on /{name} in the container is not there")
        fd = os.open("params", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=inner)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        src = os.open("params", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
        try:
            sandbox.mount(f"/proc/self/fd/{src}", f"/proc/self/fd/{target}", None, sandbox.MS_BIND)
        finally:
            os.close(src)
        # `target` still names the procfs file beneath the bind (as above): the remount must
        # name the bind itself, found again by path, and be nvhook's tmpfs file.
        bound = relookup()
        try:
            if sandbox.fstatfs_type(bound) != sandbox.TMPFS_MAGIC:
                raise HookError(f"{PARAMS} in the container is not nvhook's copy after the bind")
            sandbox.mount(None, f"/proc/self/fd/{bound}", None,
                          sandbox.MS_BIND | sandbox.MS_REMOUNT | sandbox.MS_RDONLY | sandbox.MS_NODEV
                          | sandbox.MS_NOSUID | sandbox.MS_NOEXEC)
        finally:
            os.close(bound)
    finally:
        try:
            sandbox.umount2(f"/proc/self/fd/{inner}", sandbox.MNT_DETACH)
        finally:
            os.close(inner)
