"""Waiting for something in a test on a busy, shared machine.

Other test sessions, builds and container starts share the CPU with every test: a fixed sleep
that is "long enough" here is a race there, and a wall-clock bound on work measures the
machine, not the code. So:
  - `wait_until(condition, what)` polls until the condition holds, with a deadline far above
    what the event needs on an idle machine, and fails saying what was awaited (and, through
    `show`, what was seen instead);
  - `cpu_seconds()` measures a bound on work as this process's CPU time, which other
    processes' load does not inflate.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

# The deadline of an event-driven wait: what the awaited event takes on a loaded 2-core machine
# is well under a second; a deadline is only there so that a broken test fails instead of hanging.
PATIENCE_S = 60.0


def wait_until(condition: Callable[[], T], what: str, timeout: float = PATIENCE_S, interval: float = 0.02,
               show: Callable[[], object] | None = None) -> T:
    """Poll `condition` until it returns something true, and return that; fail after `timeout`
    seconds with "waited N s for <what>" (and `show()`, what there was instead)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() >= deadline:
            seen = f"; seen: {show()!r}" if show is not None else ""
            raise AssertionError(f"waited {timeout:g} s for {what}{seen}")
        time.sleep(interval)


class Took:
    seconds: float = 0.0


@contextlib.contextmanager
def cpu_seconds(children: bool = False) -> Iterator[Took]:
    """`with cpu_seconds() as took: ...`, then `took.seconds`: the CPU time this process (all of
    its threads) spent in the block, which a busy machine does not stretch as it does wall time.
    With `children`, that of the child processes waited for in the block too (and of their
    waited-for descendants: runc and the hook it ran, for a container started in the block)."""
    took = Took()

    def now() -> float:
        t = time.process_time()
        if children:
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            t += ru.ru_utime + ru.ru_stime
        return t

    t0 = now()
    try:
        yield took
    finally:
        took.seconds = now() - t0
