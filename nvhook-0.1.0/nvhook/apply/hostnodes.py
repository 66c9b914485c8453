"""Create the host device nodes the driver left to nvidia-modprobe (decide/nodes.py says which).

Only with devices.create_missing_nodes, only under the host root nvhook was configured with,
and without following links: the root is opened once, /dev and each directory below it with
O_NOFOLLOW relative to the directory nvhook opened before, and the node is made by mknodat in
that directory (mknod never follows a final link, and fails when anything has the name). A
container that shares the host's /dev and plants `nvidia-caps-imex-channels -> /etc` gets
an error here, not a node in /etc. An existing name is left alone and reported as such; the
caller checks what is there before the plan uses it.
"""

from __future__ import annotations

import errno
import os
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, parent: int, create: bool) -> int:
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            pass
    return os.open(name, _DIR, dir_fd=parent)


def _components(path: str) -> list[str]:
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "" or parts[1] != "dev" or any(p in ("", ".", "..") for p in parts[2:]):
        raise ValueError(f"not a node path under /dev: {path!r}")
    return parts[2:]


def create(root: str, nodes: list[dict]) -> list[dict]:
    """Make each node; returns [{path, result: "created" | "exists" | "error", error?}]."""
    results: list[dict] = []
    if not nodes:
        return results
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            dev_fd = os.open("dev", _DIR, dir_fd=root_fd)
        except OSError as e:
            return [{"path": n["path"], "result": "error", "error": f"{root}/dev: {e.strerror}"} for n in nodes]
        try:
            for n in nodes:
                results.append(_create_one(dev_fd, n))
        finally:
            os.close(dev_fd)
    finally:
        os.close(root_fd)
    return results


def _create_one(dev_fd: int, n: dict) -> dict:
    path = n["path"]
    fds: list[int] = []
    try:
        *dirs, name = _components(path)
        fd = dev_fd
        for d in dirs:
            fd = _open_dir(d, fd, create=True)
            fds.append(fd)
        old = os.umask(0)  # the driver's mode exactly, as nvidia-modprobe sets it
        try:
            os.mknod(name, stat.S_IFCHR | (n["mode"] & 0o777), os.makedev(n["major"], n["minor"]), dir_fd=fd)
        finally:
            os.umask(old)
        os.chown(name, n["uid"], n["gid"], dir_fd=fd, follow_symlinks=False)
        return {"path": path, "result": "created"}
    except FileExistsError:
        return {"path": path, "result": "exists"}
    except OSError as e:
        reason = ("a directory on the way is a symbolic link or not a directory"
                  if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror)
        return {"path": path, "result": "error", "error": reason}
    except ValueError as e:
        return {"path": path, "result": "error", "error": str(e)}
    finally:
        for fd in fds:
            os.close(fd)
