"""Waiting for pipes with a time limit."""

from __future__ import annotations

import select


def readable(fds: list[int], timeout: float) -> list[int]:
    """Those of `fds` readable (or closed at the other end) within `timeout` seconds.

    poll(2), not select(2): select cannot take an fd above 1023, which a long-running caller
    (a test process, a daemon calling nvhook's functions) easily has."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    ms = max(0, int(timeout * 1000) + 1)  # rounded up: no busy loop on the last millisecond
    return [fd for fd, _ in p.poll(ms)]
