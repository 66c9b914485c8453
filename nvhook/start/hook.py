"""Entry point. Hook mode (what runc/podman run on every container start) is parsed here by
hand and never imports click or structlog: together they cost more than the hook's whole time
budget. Everything else (--dry-run, info, list, doctor, --help) goes to the click CLI.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.perf_counter()

from ..base.log import LEVELS  # noqa: E402 - after _T0, so that startup_imports_ms counts it

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from ..apply import Worker
    from ..decide.sources import CdiDevices, OciBundle
    from ..decide.types import Plan


def run_hook(opts: dict) -> int:
    """Hook mode. `opts["resident"]`, set by nvhookd's per-container child only, carries what
    the daemon got from its client: "state" (the OCI state bytes), "t0" (when the request
    arrived), "pidfd" (the container process), "log" (fields for every event), and "gate",
    called before anything is applied: it returns once the client is committed to this run
    (base/residentwire.py), and raises when the client gave up and runs the hook itself.

    From bin/nvhook's client (nvhook/start/client.py `main`), which got here because nvhookd did not
    serve this start: "cfg" (the config, read from its cache), "state" (once read from stdin)
    and "daemon" (what asking nvhookd gave: client.attempt)."""

    from ..base import config as config_mod
    from ..base import userns
    from ..base.errors import HookError
    from ..base.log import EventLog, stderr_line

    resident = opts.get("resident")
    t0 = resident["t0"] if resident else _T0
    phases: dict = {"startup_imports_ms": round((time.perf_counter() - t0) * 1000, 2)}
    t_start = time.perf_counter()
    log = EventLog(opts.get("log_level") or "info",
                   opts["log_file"] if opts.get("log_file") is not None else config_mod.DEFAULTS["log_file"])
    if resident:
        log.bind(**resident["log"])
    workers = _Workers()
    code = 0
    try:
        # The state first (it needs no config), so that every event carries the container id
        # and a container that asks for no GPU can start even when the config is broken.
        state_bytes, state = _read_state(opts, resident)
        log.bind(container=state["id"])
        cfg = _config(opts, state, log)
        if cfg is None:
            return code
        log.level = LEVELS[opts.get("log_level") or cfg["log_level"]]
        log.path = opts.get("log_file") if opts.get("log_file") is not None else cfg["log_file"]
        log.journal = cfg["log_journal"]
        if userns.namespaced():  # a rootless engine: root's log and cache are not ours
            if not log.journal:
                log.path, log.journal, log.open_as = userns.log_target(log.path)
            cfg = dict(cfg, cache_dir=userns.cache_dir(cfg["cache_dir"]))
        code = _run_started(opts, state, state_bytes, cfg, log, phases, t_start, workers)
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


def _run_started(opts: dict, state: dict, state_bytes: bytes, cfg: dict, log, phases: dict, t_start: float,
                 workers: _Workers) -> int:
    """Hook mode once the state and config are read: nvhookd serves the start, or this process
    observes, decides and applies; 0, or nvhookd's exit code. Raises HookError to refuse."""
    from ..base import config as config_mod
    from ..decide.sources import Host, Options

    resident = opts.get("resident")
    # nvhook's own cache writer: this process (the hook, or nvhookd's request child)
    # applies the plan itself
    workers.inline = config_mod.ldconfig_is_builtin(cfg["ldconfig"]["path"])
    fallback: dict = {}  # why nvhookd did not serve this start: logged after hook.start
    served = _served_by_daemon(opts, cfg, state_bytes, fallback)
    if served is not None:
        return served  # nvhookd logged the run; this log holds at most debug events
    from . import pipeline

    root = _root(opts, state, cfg, log)
    if root is None:
        return 0
    log.info("hook.start", stage=opts["stage"], root=root, nvhook_version=_version(),
             in_container_only=opts.get("in_container_only", False), cdi=opts.get("cdi"),
             container=state["id"], container_pid=state["pid"])
    if fallback:
        log.event("daemon.fallback", fallback.pop("level"), **fallback)

    def gpu_work_begins() -> None:
        # Written now, on its own, once the container is known to need the driver: a hook
        # killed later (the runtime's hook timeout) still leaves which container it was
        # working on. A container that asks for no GPU gets its events in one write.
        log.flush()
        workers.start()

    _check_stage(opts, state)
    options = Options(on_gpu_request=gpu_work_begins, before_change=resident["gate"] if resident else None,
                      phases=phases)
    plan = pipeline.decide(_source(opts, state), Host(root, cfg, log), options).plan
    if opts.get("in_container_only"):
        from ..decide.edits import in_container_plan

        plan = in_container_plan(plan)
    if opts["stage"] == "createContainer":
        plan["container"]["own_mount_namespace"] = True
    applied: dict = {}
    if plan["mounts"] or plan["symlinks"]:
        applied = _apply(plan, cfg, log, phases, resident, workers)
    phases["total_ms"] = round((time.perf_counter() - t_start) * 1000 + phases["startup_imports_ms"], 2)
    rss_kb, cpu_ms = _usage()
    log.info("hook.done", result="ok", mounted=[m["target"] for m in plan["mounts"]], peak_rss_kb=rss_kb,
             cpu_ms=cpu_ms,
             symlinks=len(plan["symlinks"]), symlinks_changed=applied.get("symlinks_changed", 0),
             compat=plan["compat"]["decision"],
             reason=plan["compat"]["reason"] if not plan["mounts"] else None,
             phases={k: round(v, 2) for k, v in phases.items()})
    return 0


def _source(opts: dict, state: dict) -> OciBundle | CdiDevices:
    """What decide is asked about: the container in the OCI state, or (--cdi CAPS) the devices
    nvhook's CDI spec gave it."""
    from ..decide.sources import CdiDevices, OciBundle

    bundle = OciBundle.from_state(state)
    return bundle if opts.get("cdi") is None else CdiDevices(bundle, opts["cdi"])


def _read_state(opts: dict, resident: dict | None) -> tuple[bytes, dict]:
    """The OCI state's bytes (nvhookd's, the client's or stdin's) and the state parsed."""
    from ..base.errors import HookError
    from ..observe import oci

    if not resident and "state" not in opts and os.isatty(0):
        # A person typed `nvhook`: reading stdin would wait for ever.
        raise HookError("stdin is a terminal: hook mode reads the OCI state that runc, crun or podman "
                        "pass on stdin; try nvhook --help, or nvhook --dry-run --bundle DIR")
    state_bytes = resident["state"] if resident else opts.get("state")
    if state_bytes is None:
        state_bytes = sys.stdin.buffer.read(1 << 20)
    return state_bytes, oci.parse_state(state_bytes)


def _config(opts: dict, state: dict, log) -> dict | None:
    """The config (the client's cached read, or read now); None when it cannot be read and the
    container asks for no GPU, which then starts (with a warning): a broken config stops only
    the containers it would have served."""
    from ..base import config as config_mod
    from ..base.errors import HookError
    from ..base.log import stderr_line

    try:
        cfg: dict = opts.get("cfg") or config_mod.load(opts.get("config"), explicit=opts.get("config") is not None)
        return cfg
    except HookError as e:
        from ..base.configscan import scan_key
        from . import pipeline

        path, _ = config_mod.located(opts.get("config"), opts.get("config") is not None)
        if opts.get("log_file") is None:
            # The log the operator configured, where a line scan of the broken file finds it.
            scanned = scan_key(path, "", "log_file")
            if scanned and scanned.startswith("/"):
                log.path = scanned
        if pipeline.asks_for_gpu(_source(opts, state), None, path):
            raise
        log.warning("config.unusable", error=e.message, stage=opts["stage"], config=path,
                    message=f"{e.message}; ignored: the container asks for no GPU")
        stderr_line(f"warning: {e.message} (the container asks for no GPU, so it starts)")
        return None


def _root(opts: dict, state: dict, cfg: dict, log) -> str | None:
    """The host root; None when it is unusable and the container asks for no GPU, which then
    starts (with a warning): a wrong `root` stops only the containers it would have served."""
    from ..base.errors import HookError
    from ..base.log import stderr_line
    from . import pipeline

    try:
        return pipeline.root_from(opts.get("root"), cfg)
    except HookError as e:
        if pipeline.asks_for_gpu(_source(opts, state), cfg):
            raise
        key = "--root" if opts.get("root") else "root in the config"
        log.warning("root.unusable", error=e.message, stage=opts["stage"], key=key,
                    message=f"{e.message} ({key}); ignored: the container asks for no GPU")
        stderr_line(f"warning: {e.message} ({key}; the container asks for no GPU, so it starts)")
        return None


def _served_by_daemon(opts: dict, cfg: dict, state_bytes: bytes, fallback: dict) -> int | None:
    """nvhookd's exit code when it served this start; None to run in-process, with why in
    `fallback` (logged after hook.start)."""
    daemon = cfg["daemon"]
    if (opts.get("resident") or daemon["mode"] == "off" or opts["stage"] == "createContainer"
            or opts.get("cdi") is not None):
        # createContainer runs inside the container's namespaces: nvhookd cannot stand in;
        # nor for --cdi, which the protocol does not carry
        return None
    if "daemon" not in opts and daemon["mode"] == "auto" and not os.path.exists(daemon["socket"]):
        # No nvhookd on this host, the usual case: one stat, not the client's imports (~1 ms).
        fallback.update(level="debug", cause="absent", socket=daemon["socket"], waited_ms=0,
                        reason="nvhookd not used: its socket does not exist; running in-process")
        return None
    from . import client

    # bin/nvhook's client may have asked nvhookd already (opts["daemon"])
    outcome = opts["daemon"] if "daemon" in opts else client.attempt(opts, cfg, state_bytes)
    served: int | None = client.settle(outcome, state_bytes, cfg, fallback)
    return served


def _check_stage(opts: dict, state: dict) -> None:
    """The stage's own rules: createContainer only for the CDI hook, run where the OCI spec
    says (the container's namespaces, the state's pid taken as this process); a pid always."""
    from ..base.errors import HookError

    if opts["stage"] == "createContainer":
        if opts.get("cdi") is None:
            raise HookError("the createContainer stage is for nvhook's CDI hook (--cdi CAPABILITIES); "
                            "register nvhook as a prestart or createRuntime hook")
        # Run in the container's namespaces before pivot_root: the state's pid is the
        # container's own view (runc: 1, crun: 0), which this process's /proc (still the
        # host's) would read as the host's init. This process is in the container's mount
        # namespace, user namespace and cgroup: it stands for the container.
        # (That this is the container's mount namespace is checked on the bundle: pipeline.decide,
        # for a CdiDevices source.)
        state["pid"] = int(os.readlink("/proc/self"))
    if state["pid"] is None:
        raise HookError("OCI state has no pid: nvhook must run as a prestart or createRuntime hook")


def _apply(plan: Plan, cfg: dict, log, phases: dict, resident: dict | None, workers: _Workers) -> dict:
    """Apply the plan (nvhookd: once its client said `go`), its timings into `phases`."""
    from ..apply import apply_plan

    if resident:
        resident["gate"]()
    t = time.perf_counter()
    result = apply_plan(plan, log, ldconfig_timeout=cfg["ldconfig"]["timeout"], worker=workers.take(),
                        pidfd=resident["pidfd"] if resident else None, inline=workers.inline)
    phases["apply_ms"] = round((time.perf_counter() - t) * 1000, 2)
    phases.update({k: v for k, v in result.items() if k.endswith("_ms")})
    return result


class _Workers:
    """The apply worker, started as soon as the container is known to need the driver, where
    one is needed (a configured ldconfig program: apply.apply_plan, step 1)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.inline = False  # set once the config is known

    def start(self) -> None:
        if self.inline:
            return  # the hook applies in its own process (apply.apply_plan, step 1)
        from ..apply import start_worker

        self.worker = start_worker()

    def take(self):
        w, self.worker = self.worker, None
        return w

    def cancel(self) -> None:
        if self.worker is not None:
            self.take().cancel()


def _usage() -> tuple[int, float]:
    """Peak RSS in kB, the larger of this process and its children (an apply worker, ldconfig,
    the NVML probe); and the CPU time in ms of both, the interpreter's start included. Without
    children (the usual hook run), from the clock and /proc/self/status: the `resource`
    module is a shared library whose load costs ~0.2 ms of every start."""
    process = sys.modules.get("nvhook.base.process")
    if (process is not None and process.forked) or "resource" in sys.modules:
        import resource

        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return max(me.ru_maxrss, kids.ru_maxrss), round(cpu * 1000, 1)
    cpu_ms = round(time.process_time() * 1000, 1)
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            status = os.read(fd, 8192)
        finally:
            os.close(fd)
        hwm = status.split(b"VmHWM:", 1)[1].split(b"kB", 1)[0]
        return int(hwm), cpu_ms
    except (OSError, IndexError, ValueError):  # no procfs here: unknown, not a failed start
        return 0, cpu_ms


def _version() -> str:
    from .. import __version__

    return __version__


def run(opts: dict, handoff: dict | None = None, exit_now: bool = True) -> int:
    """Hook mode in this process, after nvhookd did not serve it (nvhook.entry). `handoff`:
    what the resident client learnt on the way (start/client.py `serve`)."""
    if handoff:
        opts.update(handoff)
    try:
        code = run_hook(opts)
    except KeyboardInterrupt:
        sys.stderr.write("nvhook: interrupted\n")
        code = 130
    if exit_now:
        # The log is written and stderr flushed: skip the interpreter's teardown (module
        # cleanup, GC), a millisecond or two the container would otherwise wait for.
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)
    return code
