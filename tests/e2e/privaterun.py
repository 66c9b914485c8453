"""A private /run/nvhook and /var/log/nvhook.log for this process and everything it starts: the
test suite (tests/conftest.py) and the bench (bench/*.py) enter it first.

Why not NVHOOK_RUN_DIR alone: nvidia-cdi-hook drops its whole environment before it runs (a CDI
spec's entry without `env` is run with the container's environment; docs/security.md), so it
keeps its config cache in /run/nvhook, and the marks of its first stage with it, whatever the
tests set; so does `nvhook --cdi ...` run from a spec entry by runc with the container's
environment, and a hook whose config names no log, or that fails before it reads one, logs to
/var/log/nvhook.log. The production rule stays as it is: here the process moves into a mount
namespace of its own whose /run/nvhook and /var/log/nvhook.log are a directory and a file of the
run. Mounts made in it never reach the machine (its mounts are slaves of the machine's), and
runc, the engines, the daemons and the hooks the run starts inherit it, so the machine's own
files are out of reach of every one of them.

The machine's view stays readable through `machine_root()`: a descriptor on / taken before the
move, which tests/conftest.py's per-module check walks (/proc/self/fd/N/run/nvhook is the
machine's /run/nvhook, not the private one)."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import stat
import tempfile
from pathlib import Path

CLONE_NEWNS = 0x20000
MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE, MS_SHARED = 0x1000, 0x4000, 1 << 18, 1 << 19, 1 << 20

# What the private namespace puts its own copy over: directories, then files.
PRIVATE_DIRS = ("/run/nvhook",)
PRIVATE_FILES = ("/var/log/nvhook.log",)

_machine_fd: int | None = None
_work: Path | None = None
_saved: list[Path] = []  # the machine's directories bound aside (`_shadow`), detached by `leave`
MNT_DETACH = 2


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {target}: {os.strerror(e)}")


def machine_root() -> str:
    """The machine's / as the process saw it before `enter` ("/" when it never moved)."""
    return f"/proc/self/fd/{_machine_fd}" if _machine_fd is not None else "/"


def work_dir() -> Path | None:
    """Where the private /run/nvhook and /var/log/nvhook.log live (None when not entered)."""
    return _work


def enter(prefix: str = "nvhook-private-run-") -> bool:
    """Move this process into its private mount namespace (once; as root only, else False: an
    unprivileged run cannot write the machine's /run/nvhook or root's log anyway). Must run before
    the process has a second thread (unshare(CLONE_NEWNS) refuses a process that shares its
    filesystem context)."""
    global _machine_fd, _work
    if _machine_fd is not None:
        return True
    if os.geteuid() != 0:
        return False
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        os.close(fd)
        return False
    # slave first (nothing of ours goes back to the machine), then shared again among our own
    # namespace and the ones runc and the tests make from it, as on a systemd machine
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    _mount(None, "/", None, MS_REC | MS_SHARED)
    _machine_fd, _work = fd, Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(leave)
    for target in PRIVATE_DIRS:
        own = _work / Path(target).name
        own.mkdir(mode=0o700)
        _shadow(target, own)
    for target in PRIVATE_FILES:
        own = _work / Path(target).name
        own.touch(mode=0o640)
        _shadow(target, own)
    return True


def leave() -> None:
    """Remove the private copies (the namespace itself ends with the process)."""
    if _work is None:
        return
    for target in PRIVATE_DIRS:
        shutil.rmtree(_work / Path(target).name, ignore_errors=True)
    for target in PRIVATE_FILES:
        (_work / Path(target).name).unlink(missing_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    for d in (*_saved, _work):
        try:
            if d in _saved:
                libc.umount2(str(d).encode(), MNT_DETACH)
            d.rmdir()  # never a tree: a directory still holding anything stays
        except OSError:
            pass


def _shadow(target: str, own: Path) -> None:
    """Bind `own` over `target`; where the machine has no `target` (no mount point to bind on,
    and making one would be a write to the machine), a tmpfs of this namespace over its parent,
    the parent's entries bound back on it, and the mount point made there."""
    if not os.path.lexists(target):
        parent = os.path.dirname(target)
        # beside the work dir, not in it: `leave` removes the work dir, never what is bound here
        saved = Path(tempfile.mkdtemp(prefix="nvhook-machine" + parent.replace("/", "-") + "-"))
        _mount(parent, str(saved), None, MS_BIND | MS_REC)
        _saved.append(saved)
        # a bind of a shared mount joins its peer group: the tmpfs below would land on it too
        _mount(None, str(saved), None, MS_REC | MS_PRIVATE)
        st = os.stat(parent)
        _mount("tmpfs", parent, "tmpfs", 0, f"mode={stat.S_IMODE(st.st_mode):o}")
        for entry in os.scandir(saved):
            dst = os.path.join(parent, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), dst)
                continue
            if entry.is_dir(follow_symlinks=False):
                os.mkdir(dst)
            else:
                open(dst, "w").close()
            _mount(entry.path, dst, None, MS_BIND | MS_REC)
        if own.is_dir():
            os.mkdir(target)
        else:
            open(target, "w").close()
    _mount(str(own), target, None, MS_BIND)
