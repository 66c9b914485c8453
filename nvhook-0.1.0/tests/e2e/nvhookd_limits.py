"""nvhookd for the tests that push a request past its limits: the installed daemon's code, with
the apply step's grace periods and the daemon's bound on a request child (REQUEST_LIMIT_S)
shortened, and optionally no room for queued signals (RLIMIT_SIGPENDING 0: what a container
running as host root can make of the per-user count, or a glibc without timer_create), so that
the apply step's SIGKILL timer cannot be armed.

    <python> nvhookd_limits.py [--grace S] [--request-limit S] [--no-sigpending] [NVHOOKD] NVHOOKD-ARGS...
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> int:
    args = list(argv)
    grace = limit = None
    no_sigpending = False
    while args[:1] in (["--grace"], ["--request-limit"], ["--no-sigpending"]):
        if args[0] == "--no-sigpending":
            no_sigpending, args = True, args[1:]
            continue
        if args[0] == "--grace":
            grace = int(args[1])
        else:
            limit = float(args[1])
        args = args[2:]
    if args and os.path.basename(args[0]) == "nvhookd":
        args = args[1:]  # the launcher's path, as the tests' Daemon.start passes it
    sys.path.insert(0, REPO)
    if no_sigpending:
        import resource

        resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, 0))
    from nvhook import apply
    from nvhook.start import daemon
    from nvhook.start.daemon import pool

    if grace is not None:
        apply.CHILD_GRACE_S = apply.KILL_GRACE_S = grace
    if limit is not None:
        pool.REQUEST_LIMIT_S = limit
    return daemon.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
