"""nvhookd: resident mode. A root daemon that keeps nvhook's modules imported and the host
inventory parsed, and serves each container start the hook forwards to it (nvhook/start/client.py;
the protocol is in base/residentwire.py) in a child of its own, which runs the hook's own code
(hook.run_hook: the same validation, observe, decide and apply).

Where each part is:
- listen.py   the listening socket (systemd's, the one a re-executed daemon kept, or its own:
              0600 in a root-only directory) and the checks on a request: its fields, its
              namespaces (the client's and the peer's), the pidfd of the container's process
- pool.py     the Daemon: the spares forked in advance, waiting in accept(), each serving one
              start; reaping, the limit on a request's life, re-reading the inventory cache,
              executing itself again when nvhook is upgraded
- serve.py    one start, in the child that accepted it: the peer must be root (SO_PEERCRED),
              then the request is checked, answered `ready`, and run by the hook's own code
- pages.py    the pages request children copy on write, reported and copied ahead (prefault)
              by the next spares
- specrefresh.py  the CDI spec kept current while idle

Trust: the socket is root's alone, each connection's peer must be uid 0, and a request is
bounded (size, time, fds), checked field by field, and must come from the daemon's own mount,
pid and cgroup namespaces (listen.py). Everything else is what the hook itself trusts: its
command line, the OCI state, the bundle it names.
"""

from __future__ import annotations

import argparse
import os
import sys

from ... import __version__
from ...base import config as config_mod
from ...base import residentwire
from ...base.errors import HookError
from ...base.log import LEVELS, EventLog
from . import listen
from .pool import Daemon
from .serve import flush


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nvhookd", description="nvhook's resident daemon (resident mode).")
    ap.add_argument("--config", help="config file (default: NVHOOK_CONFIG, else /etc/nvhook/hook.toml)")
    ap.add_argument("--root", help="host root whose inventory is kept warm (default: the config's root)")
    ap.add_argument("--socket", help="listen here when not socket-activated (default: [daemon] socket)")
    ap.add_argument("--log-file", help="the daemon's own events (default: the config's log_file)")
    ap.add_argument("--log-level", choices=tuple(LEVELS))
    args = ap.parse_args(argv)
    log = EventLog(args.log_level or "info", args.log_file)
    try:
        if os.geteuid() != 0:
            raise HookError("nvhookd must run as root (it does the hook's work: mounts, device cgroups)")
        cfg = config_mod.load(args.config, explicit=args.config is not None)
        log.level = LEVELS[args.log_level or cfg["log_level"]]
        log.path = args.log_file if args.log_file is not None else cfg["log_file"]
        listener, how, own_path = listen.listener(args.socket or cfg["daemon"]["socket"])
    except HookError as e:
        log.error("daemon.failed", error=e.message)
        flush(log)
        sys.stderr.write(f"nvhookd: {e.message}\n")
        return 1
    daemon = Daemon(listener, cfg, args, log, own_path)
    daemon.warm_up()
    log.info("daemon.start", socket=how, pid=os.getpid(), nvhook_version=__version__, protocol=residentwire.PROTOCOL,
             root=daemon.root, cache_dir=cfg["cache_dir"] or None, inventory_warm=daemon.inventory_warm,
             rss_kb=_rss_kb(), warm_up_ms=daemon.warm_up_ms)
    flush(log)
    return daemon.run()


def _rss_kb() -> int:
    """Peak RSS of this process image (VmHWM: ru_maxrss would carry the peak of whatever
    process exec'ed nvhookd)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
