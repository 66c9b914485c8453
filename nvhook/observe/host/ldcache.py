"""Read the host's ld.so.cache. The format itself, both ways, is nvhook.base.ldformat, shared
with the apply side that writes the container's cache: every offset is bounds-checked, so a
corrupt or hostile cache gives a ValueError, never a wrong path or a crash.
"""

from __future__ import annotations

import os
import stat

from ...base.ldformat import ARCH_BY_FLAGS, MAX_STRING, NEW_ENTRY, NEW_HEADER, NEW_MAGIC, OLD_MAGIC, parse  # noqa: F401 - re-exported for the inventory and the tests


def read(path: str) -> list[tuple[str, str, str]]:
    """OSError when unreadable (FileNotFoundError when missing), ValueError when corrupt or not
    a regular file (opened non-blocking: a FIFO there must not hang the hook)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        return parse(f.read())
