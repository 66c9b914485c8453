"""`chmod --mode OCTAL --path P ...`: NVIDIA's cmd/nvidia-cdi-hook/chmod, with every path
resolved inside the rootfs (a link the image planted cannot lead out of it) and changed through
the fd resolved there."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    """NVIDIA's chmod, every path resolved inside the rootfs (a link the image planted cannot
    lead out of it) and changed through the fd resolved there."""
    import errno
    import stat

    from ...base.errors import HookError

    root, log = entry.root, entry.log
    mode_s = (opts.get("mode") or "").strip()
    if not mode_s:
        raise HookError("a non-empty mode must be specified")
    try:
        mode = int(mode_s, 8)
        if mode < 0 or mode > 0o7777:
            raise ValueError
    except ValueError:
        raise HookError(f'failed to parse mode as octal: strconv.ParseUint: parsing "{mode_s}": '
                        f'invalid syntax') from None
    paths = opts.get("path") or []
    if any(not p.strip() for p in paths):
        raise HookError("paths must not be empty")
    first_error = None
    for p in paths:
        try:
            fd = root.lookup(p)
        except OSError as e:
            out.say("debug", f"Skipping path {p!r}: {e.strerror}")
            continue
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) == mode:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue  # not reached: lookup follows links inside the rootfs
            try:
                os.chmod(f"/proc/self/fd/{fd}", mode)
                log.debug("chmod.done", path=p, mode=oct(mode))
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
                    out.say("debug", f"Ignoring permission error with chmod: {p}: {e.strerror}")
                elif first_error is None:
                    first_error = f"chmod {p}: {e.strerror}"
        finally:
            os.close(fd)
    if first_error:
        raise HookError(first_error)
