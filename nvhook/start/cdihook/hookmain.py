"""nvidia-cdi-hook's front door: the command line parsed (hookargs.py), the environment
dropped, the state and the container root read (hookstate.py), the subcommand done
(dispatch.py), and the entries after it in the same process (coalesce.py); NVIDIA's messages and
exit codes. The package's docstring (__init__.py) says what each subcommand does."""

from __future__ import annotations

import os
import sys
import time

from .dispatch import step
from .hookargs import NAME, Out, Unsupported, UsageError, env_switches, parse, scrub_environment, usage
from .hookstate import Entry, bundle_config, container_root, open_root, read_state

_LOADER_VARS = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH")


# -- the front door ---------------------------------------------------------------------------

def _config(path: str | None, out: Out) -> dict:
    from ...base import config as config_mod
    from ...base.errors import HookError

    try:
        cfg: dict = config_mod.load(path or config_mod.DEFAULT_PATH, explicit=path is not None)
        return cfg
    except HookError as e:
        if path is not None:
            raise
        out.say("warning", f"{e.message}; using nvhook's defaults")
        return dict(config_mod.DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    """`nvidia-cdi-hook ARGS` (bin/nvidia-cdi-hook) and `nvhook cdi-hook ARGS`; behind the
    shell first stage (nvhook/data/nvidia-cdi-hook.sh) `--nvhook-first-stage MARKS HOOK_PATH
    ARGS`: HOOK_PATH is the entry's path as the runtime ran it, MARKS where the entries done
    for the container are recorded (coalesce.py)."""
    argv = sys.argv[1:] if argv is None else argv
    first: tuple[str, str] | None = None
    if argv[:1] == ["--nvhook-first-stage"] and len(argv) >= 3:
        first, argv = (argv[1], argv[2]), argv[3:]
    env_debug, env_quiet = env_switches()
    # The loader removes these in secure mode (AT_SECURE): still here, the first stage ran without
    # it (a nosuid mount, a user namespace without the copies' group, a plain interpreter) and a
    # container's preload was loaded into this root process: said in the log of every start.
    exposed = [k for k in _LOADER_VARS if k in os.environ]
    scrub_environment()
    out = Out(env_debug, env_quiet)
    try:
        glob, sub, opts = parse(argv)
    except Unsupported as u:
        out.say("warning", f"Unsupported CDI hook: {u.args[0]}" if u.args[0] else "No CDI hook specified")
        return 0
    except UsageError as e:
        out.say("error", str(e))
        return 1
    out = Out(bool(glob.get("debug") or glob.get("d") or env_debug) and not env_quiet,
               bool(glob.get("quiet") or env_quiet))
    if glob.get("help") or glob.get("h") or opts.get("help") or opts.get("h"):
        sys.stdout.write(usage())
        return 0
    if glob.get("version") or glob.get("v"):
        from ... import __version__

        sys.stdout.write(f"{NAME} (nvhook) version {__version__}\n")
        return 0
    if sub == "noop":
        return 0
    return run(sub, opts, glob.get("nvhook-config"), out, first=first, argv=argv, exposed=exposed)


def run(sub: str, opts: dict, config_path: str | None, out: Out, first: tuple[str, str] | None = None,
        argv: list[str] | None = None, exposed: list[str] | None = None) -> int:
    from ...base.errors import HookError
    from ...base.log import EventLog

    t0 = time.perf_counter()
    log = EventLog("debug" if out.debug else "info", None)
    code = 0
    try:
        cfg = _config(config_path, out)
        log.path = cfg["log_file"]
        log.journal = cfg.get("log_journal", False)
        if log.path and not log.journal and not os.access(log.path, os.W_OK):
            from .coalesce import user_namespaced

            if user_namespaced():
                # a user-namespaced container's entries run as its root, an unprivileged host
                # uid that cannot append to root's log: the node's journal (its socket is open
                # to every uid) keeps the events, cdi_hook.loader_env_reached above all; a
                # rootless engine's user without one gets a log of their own
                from ...base.userns import log_target

                log.path, log.journal, log.open_as = log_target(log.path)
                log.journal = log.journal or log.path == cfg["log_file"]
        if not out.debug:
            from ...base.log import LEVELS

            log.level = LEVELS.get(cfg["log_level"], 20)
        state, raw = read_state(opts.get("container-spec"))
        log.bind(container=state.get("id"), cdi_hook=sub)
        if exposed:
            log.warning("cdi_hook.loader_env_reached", variables=exposed,
                        reason="the hook ran without AT_SECURE: the container's loader variables reached it "
                               "(CVE-2025-23266); see docs/cdi-hook.md, 'The container's environment never "
                               "reaches the hook'")
        spec = None
        if first is not None and not opts.get("container-spec"):
            try:
                spec = bundle_config(state)
            except (OSError, ValueError):
                pass  # container_root says what is wrong
        rootfs = container_root(state, spec)
        root = open_root(rootfs)
        try:
            entry = Entry(state, rootfs, root, cfg, log)
            step(sub, opts, entry, out)
            log.info("cdi_hook.done", root=rootfs, ms=round((time.perf_counter() - t0) * 1000, 2))
            if spec is not None and first is not None:
                try:
                    from .coalesce import run_after  # only behind the shell first stage

                    run_after(first, spec, raw, argv or [], config_path, entry)
                except Exception as e:  # never this entry's failure: the later ones run themselves
                    log.warning("cdi_hook.not_coalesced", reason=f"{type(e).__name__}: {e}")
        finally:
            os.close(root.fd)
    except HookError as e:
        code = 1
        log.error("cdi_hook.failed", error=e.message)
        out.say("error", e.message)
    except Exception as e:  # a bug: one line for the user, the details in the log
        import traceback

        code = 1
        log.error("cdi_hook.crashed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        out.say("error", f"internal error: {type(e).__name__}: {e} (details in the nvhook log)")
    finally:
        log.flush()
    return code
