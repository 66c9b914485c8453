"""nvidia-cdi-hook's two set-group-ID stages, as every install path makes them (the .deb's
postinst does the same in shell; docs/cdi-hook.md, "The container's environment never reaches
the hook"): in a libexec directory, copies of the host's /bin/sh and python3 (root, the hook
group, mode 2711), the pyvenv.cfg that lets the python copy find the host's standard library,
and the python stage; the shell first stage (nvhook/data/nvidia-cdi-hook.sh) names them.

`nvhook node install` puts them in /opt/nvhook/libexec; `nvhook setup` (a pip install) in
SETUP_DIR/libexec, and the wheel's own bin/nvidia-cdi-hook is that first stage with SETUP_DIR's
paths (packaging/wheel/nvidia-cdi-hook): before `nvhook setup` has made the copies, its #! names
a file that does not exist and the kernel runs nothing, never the venv's dynamically linked
python on a container's environment."""

from __future__ import annotations

import os
import posixpath
import stat
from importlib import resources

from ..base.errors import HookError

MARKS = "/run/nvhook/cdi-hook"
SETUP_DIR = "/usr/local/lib/nvhook"


def shell_stage(sh: str, python: str, stage2: str, marks: str = MARKS) -> str:
    """nvhook/data/nvidia-cdi-hook.sh with its paths."""
    text = (resources.files("nvhook") / "data" / "nvidia-cdi-hook.sh").read_text()
    for key, value in (("@SH@", sh), ("@PYTHON@", python), ("@STAGE2@", stage2), ("@MARKS@", marks)):
        text = text.replace(key, value)
    return text


def setup_first_stage() -> str:
    """The wheel's bin/nvidia-cdi-hook (and SETUP_DIR/bin/nvidia-cdi-hook)."""
    lx = f"{SETUP_DIR}/libexec"
    return shell_stage(f"{lx}/sh", f"{lx}/python3", f"{lx}/nvidia-cdi-hook.py")


def copies(host, python: str, libexec: str) -> dict[str, tuple[bytes, int]]:
    """{path: (content, mode)}: the host's `python` and /bin/sh copied to `libexec` (mode 2711,
    set-group-ID: the caller gives the group), and the pyvenv.cfg beside them, whose `home` lets
    the python copy find the host's standard library from there wherever the distribution
    keeps it."""
    from ..base import rootpath

    real = rootpath.resolve(host.root, python)
    src = host.resolved(python)
    if real is None or src is None:
        raise HookError(f"the host has no {python}")
    sh = host.resolved("/bin/sh")
    if sh is None:
        raise HookError("the host has no /bin/sh")
    with open(src, "rb") as f, open(sh, "rb") as g:
        return {f"{libexec}/python3": (f.read(), 0o2711), f"{libexec}/sh": (g.read(), 0o2711),
                f"{libexec}/pyvenv.cfg": (f"home = {posixpath.dirname(real)}\n".encode(), 0o644)}


def python_stage(python_copy: str, paths: list[str]) -> str:
    """The python stage (bin/nvidia-cdi-hook of the source tree, installed as the wheel's
    packaging/nvidia-cdi-hook.py) under `python_copy`, with `paths` (where nvhook and its
    dependencies are) put first on sys.path."""
    body = (resources.files("nvhook") / "data" / "nvidia-cdi-hook.py").read_text().split("\n", 1)[1]
    return f"#!{python_copy} -IS\nimport sys\nsys.path[:0] = {paths!r}\n{body}"


def own_dirs(host, top: str, dirs: list[str]) -> None:
    """Refuse (HookError, one line) where `dirs` (made first, under `top`, the install's own
    directory) could be changed by anyone but root: a directory on the way that another user
    owns, or that others may write (not sticky), or, from `top` down, that a group other than
    root's may write. Such a user could put their own program where root runs it at every
    container start (a pre-made /usr/local/lib/nvhook, a /usr/local chowned to a user)."""
    for d in dirs:
        root_only(host, host.makedirs(d), top, f"make it root's and not writable by others (or remove {top}), "
                  "then install again")


def root_only(host, real: str, top: str, fix: str) -> None:
    """`real` (this machine's path of a directory inside the host's root, links resolved) and
    every directory above it: root's, as own_dirs says; HookError naming the first that is not."""
    rel = os.path.relpath(real, host.root)
    parts = [] if rel == "." else rel.split("/")
    for i in range(len(parts) + 1):
        here = "/" + "/".join(parts[:i])
        # the host root itself may be given as a link (/proc/<pid>/root): its directory counts
        st = (os.lstat if i else os.stat)(os.path.join(host.root, *parts[:i]))
        mine = (here + "/").startswith(top.rstrip("/") + "/")
        why = (f"is owned by uid {st.st_uid}" if st.st_uid != 0 else
               f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
               if st.st_mode & 0o002 and not (st.st_mode & 0o1000 and not mine) else
               f"is writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):o})"
               if mine and st.st_mode & 0o020 and st.st_gid != 0 else "")
        if why:
            raise HookError(f"{here} {why}: whoever can change it can replace what nvidia-cdi-hook runs as root; {fix}")


def write_copies(host, files: dict[str, tuple[bytes, int]], gid: int, root_only: bool) -> bool:
    """Each file written where it differs (content, mode, or a set-group-ID copy's owner);
    `root_only`: the copies 2710 (no hook group to hand out). Whether anything changed."""
    changed = False
    for path, (data, mode) in files.items():
        if mode & 0o2000 and root_only:
            mode &= ~0o001
        where = host.where(path)
        st = os.lstat(where) if where and os.path.lexists(where) else None
        owner_ok = not mode & 0o2000 or (st is not None and (st.st_uid, st.st_gid) == (0, gid))
        if host.read(path) != (data, mode) or not owner_ok:
            host.write(path, data, mode, gid=gid if mode & 0o2000 else None)
            changed = True
    return changed
