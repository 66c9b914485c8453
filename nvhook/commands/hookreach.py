"""Can a CDI spec's hooks be run by a user other than their owner?

A rootless engine (rootless podman) runs a spec's hooks as the user who ran it, and a
user-namespaced container's createContainer hooks run as the container's root, an unprivileged
host uid. Either fails to start the container with only "fork/exec <hook>: permission denied"
where the hook, its `#!` interpreter, or a directory above either is closed to other users (a
Python under /root, a 0700 home). A rootful engine runs them as root and never notices.

`spec_problems(spec)` is what `nvhook cdi generate`, `nvhook cdi check` and `nvhook doctor`
print: one line per hook path and per interpreter that others cannot run, none when all can.
They run it through `within(...)`: the walk stats paths that may lie on a network mount, and a
stat there waits for a server that may never answer, in the kernel, where no signal handler
runs and a thread cannot be stopped; so the walk runs in a forked child that the command
abandons (SIGKILL, not waited for) at the deadline `cdi.check_timeout`, naming the path
the child was waiting on.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from ..base import process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

WHY = "rootless engines and user-namespaced containers run it as an unprivileged uid"
# What the child reports through its pipe, NUL-terminated (no path contains a NUL): "P" and the
# path its next system call names, "L" and a problem line.
_at: Callable[[str], object] | None = None  # set in the forked child only: writes a "P" record


def spec_hook_paths(spec: dict) -> list[str]:
    """Every hook path in the spec (its own containerEdits and each device's), once each."""
    edits = [spec.get("containerEdits") or {}]
    edits += [(d.get("containerEdits") or {}) for d in spec.get("devices") or () if isinstance(d, dict)]
    paths: list[str] = []
    for e in edits:
        for h in e.get("hooks") or ():
            p = h.get("path") if isinstance(h, dict) else None
            if isinstance(p, str) and p and p not in paths:
                paths.append(p)
    return paths


def _closed(root: str, path: str, need: int, links: int = 0) -> tuple[str | None, str]:
    """Why others cannot reach and use `path` (`need`: the mode bits others need on the file
    itself), or None, and the path with its links resolved (past a directory closed to
    others too: nvhook, as root, reads the hook's #! line there). Every directory above it must
    let them through (o+x). `root`: the node's root the path is read under ("" for this
    machine's); a link on the way is followed to where it leads, inside that root (an absolute
    one restarts at it, ".." never climbs above it), and checked the same way."""
    if not path.startswith("/"):
        return f"{path} is not an absolute path", path
    parts = [p for p in path.split("/") if p]
    cur = ""
    why = None
    is_dir = True  # `cur`'s type (the root is a directory)
    for i, part in enumerate(parts):
        if part == "..":
            if not is_dir:
                return why or f"{cur}/..: {os.strerror(errno.ENOTDIR)}", cur
            cur = cur[:cur.rfind("/")]  # `cur` holds no link: its parent is a prefix of it
            continue
        cur += "/" + part
        try:
            _look(root + cur)
            st = os.lstat(root + cur)
        except OSError as e:
            return why or f"{cur}: {e.strerror}", cur
        if stat.S_ISLNK(st.st_mode):
            if links >= 40:  # the kernel's own limit (ELOOP): a loop of links never resolves
                return why or f"{cur}: too many levels of symbolic links", cur
            target = os.readlink(root + cur)
            rest = "/".join(parts[i + 1:])
            base = target if target.startswith("/") else posixpath.dirname(cur) + "/" + target
            deeper, real = _closed(root, base + ("/" + rest if rest else ""), need, links + 1)
            return why or deeper, real
        is_dir = stat.S_ISDIR(st.st_mode)
        mode = f"{cur} is mode {stat.S_IMODE(st.st_mode):04o}"
        if i < len(parts) - 1:
            if not st.st_mode & stat.S_IXOTH:
                why = why or f"{mode}, closed to other users"
        elif (st.st_mode & need) != need:
            what = "readable and executable" if need & stat.S_IROTH else "executable"
            why = why or f"{mode}, not {what} by other users"
    return why, cur or "/"


def interpreter(path: str, follow: bool = True) -> str | None:
    """The program of a `#!` line at the start of `path`, or None (a binary, unreadable, not a
    regular file: a FIFO planted there is never waited on, a device never opened, since opening
    one can act: a watchdog armed, a FIFO's writer released). `follow=False`: a link at `path`
    is not followed (a path already resolved inside a node's root)."""
    try:
        _look(path)
        if not stat.S_ISREG(os.stat(path, follow_symlinks=follow).st_mode):
            return None
    except OSError:
        return None
    return _shebang(path, 0 if follow else os.O_NOFOLLOW)


def _shebang(path: str, flags: int) -> str | None:
    """interpreter's read: a regular file's first line, opened without blocking (plus `flags`)."""
    try:
        _look(path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, 256)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return os.fsdecode(words[0]) if words else None


def path_problems(path: str, root: str = "") -> list[str]:
    """At most two lines: the hook `path` itself, and its `#!` interpreter; `root`: the node's
    root both are read under ("" for this machine's), the file read the one the hook's links
    lead to inside it."""
    out = []
    _, real = _closed(root, path, 0)
    prog = interpreter(root + real, follow=False) if real.startswith("/") else None
    # a script is read by its interpreter, running as that user: it must be readable too
    why, _ = _closed(root, path, stat.S_IXOTH | (stat.S_IROTH if prog else 0))
    if why:
        out.append(f"hook {path} cannot be run by other users: {why} ({WHY})")
    if prog:
        why, _ = _closed(root, prog, stat.S_IXOTH)
        if why:
            out.append(f"hook {path}: its interpreter {prog} cannot be run by other users: {why} ({WHY})")
    return out


def spec_problems(spec: dict, root: str = "/") -> list[str]:
    """One line per hook path or interpreter of the spec that other users cannot run; `root`:
    the node's root the paths are read under (`doctor --node --prefix`), links resolved inside
    it, nothing outside it read."""
    root = "" if root in ("", "/") else root
    return [line for p in spec_hook_paths(spec) for line in path_problems(p, root)]


def _look(path: str) -> None:
    if _at is not None:
        _at(path)


def within(spec: dict, root: str = "/", timeout: float = 10.0) -> tuple[list[str], str | None]:
    """spec_problems(spec, root), given `timeout` seconds (base/process.records_within): (its
    lines, None), or, where the walk still waits at the deadline, (the lines it found before,
    the path it waits on). A malformed spec's AttributeError or TypeError is raised here, as
    spec_problems raises it."""
    paths = spec_hook_paths(spec)
    if not paths:
        return [], None

    def work(send: Callable[[bytes], None]) -> None:
        global _at
        _at = lambda p: send(b"P" + os.fsencode(p))  # noqa: E731
        for p in paths:
            try:
                lines = path_problems(p, "" if root in ("", "/") else root)
            except ValueError as e:  # a NUL in the spec's path: no file has that name
                lines = [f"hook {p!r} cannot be run: {e}"]
            for line in lines:
                send(b"L" + os.fsencode(line))

    records, done = process.records_within(work, timeout)
    lines = [os.fsdecode(r[1:]) for r in records if r[:1] == b"L"]
    at = next((os.fsdecode(r[1:]) for r in reversed(records) if r[:1] == b"P"), paths[0])
    return lines, None if done else at


def warn(spec: dict, timeout: float = 10.0, spec_path: str = "the spec", fatal: bool = False) -> bool:
    """`spec_problems` as stderr lines (`cdi generate`, also its click-free fast path, and
    `cdi check`): warnings, not failures, since the spec is right for a rootful engine. At the
    deadline, one more line naming the path the check waited on: a warning too, or, `fatal`
    (`cdi check`), an error; True then."""
    import sys

    from ..base.errors import HookError, clean
    from ..start.cdispecs import stuck

    try:
        lines, at = within(spec, "/", timeout)
    except HookError as e:  # the walk's child failed: nothing is known, which is said, never "fine"
        sys.stderr.write(f"nvhook: {'' if fatal else 'warning: '}the hooks of {spec_path} were not checked for "
                         f"other users: {clean(e.message)}\n")
        return fatal
    for line in lines:
        sys.stderr.write(f"nvhook: warning: {clean(line)}\n")
    if at is not None:
        why, fix = stuck(at, timeout, f"the hooks of {spec_path} were not checked for other users")
        sys.stderr.write(f"nvhook: {'' if fatal else 'warning: '}{clean(why)}; {clean(fix)}\n")
    return at is not None
