"""The engine config files nvhook's runtime commands read and write: read as UTF-8 text only when
a regular file (never a FIFO, device or directory), written atomically through symbolic links to
the file they name, mode and owner kept."""

from __future__ import annotations

import difflib
import os
import stat

from ..base.errors import HookError, show
from ..base.rootpath import kind_name


class Change:
    """One file to write: its path, old text (None: new file) and new text."""

    def __init__(self, path: str, old: str | None, new: str, what: str):
        self.path, self.old, self.new, self.what = path, old, new, what

    def diff(self) -> str:
        a = (self.old or "").splitlines(keepends=True)
        b = self.new.splitlines(keepends=True)
        return "".join(difflib.unified_diff(a, b, fromfile=self.path if self.old is not None else "/dev/null",
                                            tofile=self.path))


def read_text(path: str) -> str | None:
    """The file's text, None when there is none. Opened non-blocking and checked on the open
    file: a FIFO, a device or a directory there is refused, never read (a FIFO would hang)."""
    target_of(path)  # a dangling or looping link is refused, not taken for "no file yet"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}; nothing written") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise HookError(f"{show(path)} is a {kind_name(mode)}, not a regular file; nothing written: "
                        "give the engine's config file (--config)")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise HookError(f"{show(path)} is not UTF-8 text ({e.reason} at byte {e.start}); "
                            "nothing written") from None
        except OSError as e:
            raise HookError(f"cannot read {show(path)}: {e.strerror}; nothing written") from None


def target_of(path: str) -> str:
    """The file to write for `path`: itself, or the file its symbolic links finally name (an
    engine config kept elsewhere, linked from /etc, must get the runtime, the link stay a
    link). A link to nothing, or a loop, is refused."""
    if not os.path.islink(path):
        return path  # links among its directories are fine: the file is replaced in the one they name
    real = os.path.realpath(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise HookError(f"{show(path)} is a symbolic link to {show(real)}, which does not exist; nothing written: "
                        "create that file (it may be empty) or give the real file with --config") from None
    except OSError as e:
        raise HookError(f"cannot follow the symbolic link {show(path)}: {e.strerror}; nothing written") from None
    return real


def write(change: Change) -> str:
    """Atomically (base.files.replace_file: a temp file in the same directory, renamed over the
    target), through symbolic links to the file they name (returned), the old file's mode,
    owner and group kept (a root:docker 0640 daemon.json stays so)."""
    from ..base.files import replace_file

    target = target_of(change.path)
    directory = os.path.dirname(os.path.abspath(target))
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        owner = None
        try:
            st = os.stat(target)
        except FileNotFoundError:
            mode = 0o644
        else:
            if not stat.S_ISREG(st.st_mode):  # it was one when read; replaced since
                raise HookError(f"{show(target)} is a {kind_name(st.st_mode)}, not a regular file; nothing written")
            mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot write {show(target)}: {e.strerror}") from None
    try:
        replace_file(dir_fd, os.path.basename(target), change.new.encode("utf-8"), mode, show(target), owner)
    finally:
        os.close(dir_fd)
    return target
