"""`nvhook [GLOBAL] cdi generate [OPTIONS]` without click or structlog.

`cdi generate` runs from systemd units (nvhook-cdi.service, on every driver change and boot)
and from operators' scripts; click and structlog (which imports asyncio) were ~3/4 of its
time. This parses the same options by hand and does what commands/cdi.py `generate` does; any
other form (--help, an option it does not know, a bad value) returns None and the click CLI
handles it, so the messages a person sees for a mistake stay click's.
"""

from __future__ import annotations

import os
import sys

GLOBAL = ("--config", "--root", "--log-file", "--log-level")
OPTIONS = {"--output": "output", "-o": "output", "--format": "fmt", "--device-name-strategy": "strategy",
           "--capabilities": "capabilities", "--hook-path": "hook_path", "--mode": "mode",
           "--driver-root": "driver_root", "--dev-root": "dev_root", "--cdi-version": "cdi_version"}
FLAGS = {"--no-hook": "no_hook"}
LEVEL_NAMES = ("debug", "info", "warning", "error")


def parse(argv: list[str]) -> dict | None:
    """The options of a `cdi generate` command line, or None for the click CLI."""
    opts: dict = {"strategy": "index,uuid", "capabilities": "compute,utility"}
    words: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a in FLAGS and len(words) >= 2:
            opts[FLAGS[a]] = True
        elif a.startswith("-"):
            key = name.lstrip("-").replace("-", "_") if name in GLOBAL else OPTIONS.get(name)
            if key is None or (len(words) < 2 and name not in GLOBAL):
                return None
            if not eq:
                i += 1
                if i >= len(argv):
                    return None
                value = argv[i]
            opts[key] = value
        else:
            words.append(a)
        i += 1
    if words != ["cdi", "generate"]:
        return None
    if opts.get("mode") not in (None, "gpu", "management"):
        return None
    if opts.get("fmt") not in (None, "json", "yaml") or opts.get("log_level") not in (None, *LEVEL_NAMES):
        return None
    return opts


def _sink(level: str):
    from ..base.errors import clean
    from ..base.log import LEVELS, message

    threshold = LEVELS["debug"] if level == "debug" else max(LEVELS[level], LEVELS["warning"])

    def sink(ev: dict) -> None:
        if LEVELS.get(ev["level"], 20) >= threshold:
            sys.stderr.write(f"[{ev['level']:<9}] {ev['event']:<30} message={clean(message(ev))!r}\n")
    return sink


def generate(opts: dict) -> int:
    from ..apply import cdispec
    from ..base import config as config_mod
    from ..base.errors import HookError
    from ..base.log import EventLog
    from ..decide import request as request_mod
    from ..start import cdispecs
    from ..start.pipeline import root_from
    from . import hookreach

    try:
        opts["root"] = cdispecs.driver_root(opts.get("root"), opts.get("driver_root"), opts.get("dev_root"))
        cfg = config_mod.load(opts.get("config"), explicit=opts.get("config") is not None)
        root = root_from(opts.get("root"), cfg)
        caps = request_mod.capabilities(opts["capabilities"], False)
        strategies = cdispecs.parse_strategies(opts["strategy"])
        output = opts.get("output")
        fmt = opts.get("fmt") or ("yaml" if output and output.endswith((".yaml", ".yml")) else "json")
        level = opts.get("log_level") or cfg["log_level"]
        log = EventLog(level, opts.get("log_file") or None)
        log.bind(interactive=True)
        log.sinks.append(_sink(level))
        try:
            spec = cdispecs.host_spec(cfg, root, log, capabilities=caps, strategies=strategies,
                                      hook_path=opts.get("hook_path") or ("" if opts.get("no_hook")
                                                                          else cdispecs.default_hook_path()),
                                      hook_global_args=cdispecs.global_args(opts.get("config"), opts.get("root")),
                                      mode=opts.get("mode") or "gpu", no_hook=bool(opts.get("no_hook")),
                                      cdi_version=opts.get("cdi_version"))
        finally:
            log.flush()
        data = cdispec.serialize(spec, fmt)
        hookreach.warn(spec, cfg["cdi"]["check_timeout"], output or "the spec")
        if not output:
            sys.stdout.buffer.write(data)
            return 0
        changed = cdispec.write_atomic(output, data)
        from .leftovers import for_spec, warn

        sys.stderr.write(f"{'wrote' if changed else 'unchanged'} {output}: {len(spec['devices'])} devices, "
                         f"cdiVersion {spec['cdiVersion']}\n")
        warn(for_spec(output) if (opts.get("mode") or "gpu") == "gpu" else [])  # a second spec of its kind
        return 0
    except HookError as e:
        sys.stderr.write(f"nvhook: {e.message}\n")
        return e.code
    except KeyboardInterrupt:
        sys.stderr.write("nvhook: interrupted\n")
        return 130


def main(argv: list[str]) -> int | None:
    """The exit code, or None when the click CLI should take the command line."""
    if "_NVHOOK_COMPLETE" in os.environ:
        return None
    opts = parse(argv)
    return None if opts is None else generate(opts)
