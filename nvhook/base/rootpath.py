"""Resolve paths inside a directory treated as "/": the host root (--root) or a container rootfs.

Symlinks are followed by hand with the directory as the root: an absolute target restarts at
the root, ".." stops at the root. So Debian's absolute /etc/alternatives links resolve inside
a fixture host, and a hostile image link to /etc/shadow resolves to <rootfs>/etc/shadow, never
to the host's file. This is for reading; the apply step re-resolves with openat2
(RESOLVE_IN_ROOT) before it mounts anything, so a race here cannot redirect a mount.
"""

from __future__ import annotations

import os
import stat

MAX_LINKS = 40


_KINDS = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISSOCK, "socket"))


def kind_name(mode: int) -> str:
    """What a file is, for messages: "regular file", "symbolic link", "FIFO", ..."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def join(root: str, path: str) -> str:
    """The host path of a path inside root, lexically (no link resolution)."""
    if root in ("", "/"):
        return "/" + path.lstrip("/")
    return root.rstrip("/") + "/" + path.lstrip("/")


def resolve(root: str, path: str) -> str | None:
    """The path inside root (starting with "/") that `path` finally names, or None when some
    component is missing, a link loops, or a non-directory is traversed."""
    todo = [c for c in path.split("/") if c]
    todo.reverse()
    done: list[str] = []
    links = 0
    while todo:
        comp = todo.pop()
        if comp == ".":
            continue
        if comp == "..":
            if done:
                done.pop()
            continue
        inside = "/" + "/".join(done + [comp])
        try:
            st = os.lstat(join(root, inside))
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return None
            try:
                target = os.readlink(join(root, inside))
            except OSError:
                return None
            if target.startswith("/"):
                done = []
            parts = [c for c in target.split("/") if c]
            parts.reverse()
            todo.extend(parts)
            continue
        if todo and not stat.S_ISDIR(st.st_mode):
            return None
        done.append(comp)
    return "/" + "/".join(done)


def resolve_host(root: str, path: str) -> str | None:
    """Like resolve, but returns the path on this machine (root joined in)."""
    inside = resolve(root, path)
    return None if inside is None else join(root, inside)
