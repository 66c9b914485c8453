"""Resolve paths inside a directory treated as "/": the host root (--root) or a container rootfs.

Symlinks are followed by hand with the directory as the root: an absolute target restarts at
the root, ".." stops at the root. So Debian's absolute /etc/alternatives links resolve inside
a fixture host, and a hostile image link to /etc/shadow resolves to <rootfs>/etc/shadow, never
to the host's file. This is for reading; the apply step re-resolves with openat2
(RESOLVE_IN_ROOT) before it mounts anything, so a race here cannot redirect a mount.
"""

from __future__ import annotations

import errno
import os
import stat

MAX_LINKS = 40

# What a failed lookup may say about the tree itself; any other errno (EACCES, EMFILE, EIO, ...)
# is about the process looking, not about the files.
FACT_ERRNOS = frozenset((errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG))
_FACT_NAMES = frozenset(errno.errorcode[n] for n in FACT_ERRNOS)


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


def _error(e: OSError) -> list:
    return ["error", errno.errorcode.get(e.errno or 0, str(e.errno))]


def is_fact(ident: list) -> bool:
    """False for a lookup that failed for the looker's reasons (see FACT_ERRNOS)."""
    return ident[0] != "error" or ident[1] in _FACT_NAMES


def identity(path: str, st: os.stat_result | None = None, target: str | None = None) -> list:
    """What one directory entry is, links not followed, for a cache stamp: compared with ==,
    also after a JSON round trip. A link carries its target (links are replaced, never
    changed, but a replacement may reuse the inode and land in the same clock tick); a
    directory only its identity (its times change whenever anything in it does); a regular
    file its inode, size and times; a device node or socket its numbers, mode and owner (its
    times change with use); a failed lookup its errno."""
    try:
        if st is None:
            st = os.lstat(path)
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            return ["link", st.st_dev, st.st_ino, st.st_mtime_ns, target if target is not None else os.readlink(path)]
    except OSError as e:
        return _error(e)
    if stat.S_ISDIR(mode):
        return ["dir", st.st_dev, st.st_ino]
    if stat.S_ISREG(mode):
        return ["file", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return ["node", st.st_dev, st.st_ino, st.st_rdev, mode, st.st_uid, st.st_gid]


def listing(path: str) -> list:
    """["names", [a directory's entry names, sorted]] or ["error", errno name]: what a scan
    that used the listing saw, compared with == by the cache stamp."""
    try:
        return ["names", sorted(os.listdir(path))]
    except OSError as e:
        return _error(e)


def resolve(root: str, path: str, seen: dict | None = None) -> str | None:
    """The path inside root (starting with "/") that `path` finally names, or None when some
    component is missing, a link loops, or a non-directory is traversed.

    `seen`, when given, gets the identity (see `identity`) of every entry looked at, keyed by
    its path on this machine: each link followed, each directory crossed, the final entry, or
    the lookup that failed. That is everything the answer depends on."""
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
        host = join(root, inside)
        try:
            st = os.lstat(host)
        except OSError as e:
            if seen is not None:
                seen[host] = _error(e)
            return None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(host)
            except OSError as e:
                if seen is not None:
                    seen[host] = _error(e)
                return None
            if seen is not None:
                seen[host] = identity(host, st, target)
            links += 1
            if links > MAX_LINKS:
                return None
            if target.startswith("/"):
                done = []
            parts = [c for c in target.split("/") if c]
            parts.reverse()
            todo.extend(parts)
            continue
        if seen is not None:
            seen[host] = identity(host, st)
        if todo and not stat.S_ISDIR(st.st_mode):
            return None
        done.append(comp)
    return "/" + "/".join(done)


def resolve_host(root: str, path: str) -> str | None:
    """Like resolve, but returns the path on this machine (root joined in)."""
    inside = resolve(root, path)
    return None if inside is None else join(root, inside)
