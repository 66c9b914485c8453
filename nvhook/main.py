"""Entry point. Hook mode (what runc/podman run on every container start) is parsed here by
hand and never imports click or structlog: together they cost more than the hook's whole time
budget. Everything else (--dry-run, info, list, doctor, --help) goes to the click CLI.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.perf_counter()

from .base.log import LEVELS  # noqa: E402 - after _T0, so that startup_imports_ms counts it

GLOBAL_OPTIONS = ("--config", "--root", "--log-file", "--log-level")
STAGES = ("prestart", "createRuntime")
# Set by nvhook-runtime in the hook it writes into config.json: the runtime has already made
# the device nodes, their cgroup rules and the driver binds from the spec, so the hook does
# only what must happen inside the container (decide.edits.in_container_plan).
IN_CONTAINER_ONLY = "--in-container-only"


def _parse_hook_argv(argv: list[str]) -> dict | None:
    """Global options plus an optional stage; None when this is not hook mode."""
    opts: dict = {"stage": "prestart"}
    i = 0
    stage_seen = False
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a == IN_CONTAINER_ONLY:
            opts["in_container_only"] = True
        elif name in GLOBAL_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    return None  # let click report the usage error
                value = argv[i + 1]
                i += 1
            if name == "--log-level" and value not in LEVELS:
                return None  # click rejects it with the list of choices
            opts[name[2:].replace("-", "_")] = value
        elif a in STAGES and not stage_seen:
            opts["stage"] = a
            stage_seen = True
        else:
            return None
        i += 1
    return opts


def run_hook(opts: dict) -> int:
    from .base import config as config_mod
    from .base.errors import HookError
    from .base.log import EventLog, stderr_line

    phases: dict = {"startup_imports_ms": round((time.perf_counter() - _T0) * 1000, 2)}
    t_start = time.perf_counter()
    log = EventLog(opts.get("log_level") or "info", opts.get("log_file"))
    workers = _Workers()
    code = 0
    try:
        cfg = config_mod.load(opts.get("config"), explicit=opts.get("config") is not None)
        log.level = LEVELS[opts.get("log_level") or cfg["log_level"]]
        log.path = opts.get("log_file") if opts.get("log_file") is not None else cfg["log_file"]
        from . import pipeline
        from .observe import oci

        root = pipeline.root_from(opts.get("root"), cfg)
        log.info("hook.start", stage=opts["stage"], root=root, nvhook_version=_version(),
                 in_container_only=opts.get("in_container_only", False))
        state = oci.parse_state(sys.stdin.buffer.read(1 << 20))
        if state["pid"] is None:
            raise HookError("OCI state has no pid: nvhook must run as a prestart or createRuntime hook")
        plan = pipeline.decide(state, cfg, root, log, phases, on_gpu_request=workers.start)
        if opts.get("in_container_only"):
            from .decide.edits import in_container_plan

            plan = in_container_plan(plan)
        result = {"mounts": 0, "symlinks": 0}
        if plan["mounts"] or plan["symlinks"]:
            from .apply import apply_plan

            t = time.perf_counter()
            result = apply_plan(plan, log, ldconfig_timeout=cfg["ldconfig"]["timeout"], worker=workers.take())
            phases["apply_ms"] = round((time.perf_counter() - t) * 1000, 2)
            phases.update({k: v for k, v in result.items() if k.endswith("_ms")})
        phases["total_ms"] = round((time.perf_counter() - t_start) * 1000 + phases["startup_imports_ms"], 2)
        log.info("hook.done", result="ok", mounted=[m["target"] for m in plan["mounts"]], peak_rss_kb=_peak_rss_kb(),
                 symlinks=len(plan["symlinks"]), compat=plan["compat"]["decision"],
                 reason=plan["compat"]["reason"] if not plan["mounts"] else None,
                 phases={k: round(v, 2) for k, v in phases.items()})
    except HookError as e:
        code = e.code
        log.error("hook.failed", error=e.message, phases={k: round(v, 2) for k, v in phases.items()})
        stderr_line(e.message)
    except Exception as e:  # a bug: still one line for the user, the details in the log
        import traceback

        code = 1
        log.error("hook.crashed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        stderr_line(f"internal error: {type(e).__name__}: {e} (details in the nvhook log)")
    finally:
        workers.cancel()  # a worker that got no plan (an error, nothing to apply)
        log.flush()
        if log.write_error:
            stderr_line(f"{log.write_error}; the hook's work was not affected")
    sys.stdout.flush()
    return code


class _Workers:
    """The apply worker, started as soon as the container is known to need the driver."""

    def __init__(self):
        self.worker = None

    def start(self) -> None:
        from .apply import start_worker

        self.worker = start_worker()

    def take(self):
        w, self.worker = self.worker, None
        return w

    def cancel(self) -> None:
        if self.worker is not None:
            self.take().cancel()


def _peak_rss_kb() -> int:
    """The larger of this process and its children (the apply child, ldconfig, NVML probe)."""
    import resource

    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv_given = argv is not None
    argv = sys.argv[1:] if argv is None else argv
    opts = _parse_hook_argv(argv)
    if opts is not None:
        code = run_hook(opts)
        if not argv_given:
            # The log is written and stderr flushed: skip the interpreter's teardown (module
            # cleanup, GC), a millisecond or two the container would otherwise wait for.
            try:
                sys.stderr.flush()
            finally:
                os._exit(code)
        return code
    import click

    from .cli import cli

    try:
        rv = cli.main(args=argv, prog_name="nvhook", standalone_mode=False)
    except click.exceptions.UsageError as e:  # click's own form is four lines; ours is one
        sys.stderr.write(f"nvhook: {e.format_message()} (see nvhook --help)\n")
        return 2
    except click.exceptions.ClickException as e:
        sys.stderr.write(f"nvhook: {e.format_message()}\n")
        return e.exit_code
    except click.exceptions.Abort:
        sys.stderr.write("nvhook: aborted\n")
        return 1
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
