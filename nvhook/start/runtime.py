"""nvhook-runtime: an OCI runtime (runc, crun) wrapper for engines that run no OCI hooks of
their own choosing (Docker, containerd, CRI-O without a hooks dir).

Container engines call the runtime binary for every step of every container (create, start,
state, kill, delete, ...), so everything but `create` and `run` is handed to the real runtime
at once: argv is scanned for the command, nothing is read or parsed, and the process execs the
runtime with the same arguments. Only this module's own two imports (os, sys) are loaded.

Its stdout and stderr carry nothing but a fatal error: under Docker, containerd and CRI-O the
runtime's stderr during `create` is the container's own log (`docker logs`), so a warning
there would land in every container's output. Warnings go to the runtime's `--log` file (the
engine's, in runc's format) and to nvhook's log, or the journal where that cannot be written.

For `create`/`run`, the bundle's config.json is read; a container that asks for GPUs (see
nvhook.decide.request: NVIDIA_VISIBLE_DEVICES, the volume-mount device list, CDI annotations
naming nvidia.com/gpu, a legacy image's CUDA_VERSION, request.swarm_resource variables) gets
nvhook's plan, made by the hook's own observe -> decide pipeline,
written into the spec (nvhook.apply.ocispec): device nodes, their cgroup rules and the driver
binds, which the runtime makes itself, and nvhook's hook with `--in-container-only` for
symlinks, compat libraries, /proc/driver/nvidia and ldconfig. A container that asks for no GPU
gets its config.json untouched. Then the real runtime is exec'ed.

The real runtime: NVHOOK_RUNTIME, else `[runtime] path` of nvhook's config (NVHOOK_CONFIG or
/etc/nvhook/hook.toml), else "runc". Pass-through commands find that key with a line scan
(no TOML parser: tomllib costs 12 ms); `create` parses the config and refuses a key the scan
read differently, so every command of a container goes to the same runtime.
"""

import os
import sys

PROG = "nvhook-runtime"
DEFAULT_CONFIG = "/etc/nvhook/hook.toml"

# Global options of runc and crun that take a value (`--root DIR`); the others are flags.
_GLOBAL_VALUE = frozenset(("--root", "--log", "--log-format", "--log-level", "--criu", "--rootless",
                           "--cgroup-manager", "-root", "-log", "-log-format", "-criu", "-rootless"))
# Options of create/run that take a value.
_CREATE_VALUE = frozenset(("--bundle", "-b", "-bundle", "--console-socket", "-console-socket", "--pid-file",
                           "-pid-file", "--preserve-fds", "-preserve-fds", "--config", "-f"))
_BUNDLE = ("--bundle", "-b", "-bundle")


def command_index(argv: list) -> int:
    """Where the runtime command is in argv (after the global options); -1 if none."""
    i, n = 0, len(argv)
    while i < n:
        a = argv[i]
        if a[:1] != "-" or a == "-":
            return i
        if a == "--":
            return i + 1 if i + 1 < n else -1
        i += 2 if a in _GLOBAL_VALUE else 1
    return -1


def create_args(argv: list, start: int) -> tuple:
    """(bundle, container id, crun's --config file) from the options after create/run."""
    bundle, config, positional = None, None, []
    i, n = start, len(argv)
    while i < n:
        a = argv[i]
        if a == "--":
            positional += argv[i + 1:]
            break
        if a[:1] == "-" and a != "-":
            name, eq, value = a.partition("=")
            if name in _CREATE_VALUE:
                if not eq:
                    i += 1
                    value = argv[i] if i < n else None
                if name in _BUNDLE:
                    bundle = value
                elif name in ("--config", "-f"):
                    config = value
        else:
            positional.append(a)
        i += 1
    return bundle, (positional[-1] if positional else ""), config


def log_options(argv: list, end: int) -> tuple:
    """(--log file, --log-format) among the global options argv[:end]. containerd's shim reads
    a failed runtime's reason from that file (runc's JSON lines), not from its stderr."""
    log, fmt = None, "text"
    i = 0
    while i < end:
        name, eq, value = argv[i].partition("=")
        if name in ("--log", "-log", "--log-format", "-log-format"):
            if not eq:
                i += 1
                value = argv[i] if i < end else ""
            if name.endswith("format"):
                fmt = value
            else:
                log = value
        elif name in _GLOBAL_VALUE and not eq:
            i += 1
        i += 1
    return log, fmt


# Where warnings go besides nvhook's log: the runtime's --log file and its format (main sets it).
WARNINGS_TO: list = [None, "text"]


def report_to_runtime_log(path, fmt: str, message: str, level: str = "error") -> None:
    """Append `message` as an entry in the format runc writes its own, best effort."""
    if not path:
        return
    import time

    from ..base.errors import engine_safe

    message = engine_safe(message)
    t = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"
    if fmt == "json":
        from ..base import jsonfast

        text = jsonfast.dumps({"level": level, "msg": message, "time": stamp}, separators=(",", ":"))
    else:
        text = f'time="{stamp}" level={level} msg={jsonfast_quote(message)}'
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (text + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pass


def jsonfast_quote(message: str) -> str:
    from ..base import jsonfast

    return jsonfast.dumps(message)


def scan_runtime_key(path: str):
    """`[runtime] path = "..."` read from the config file without a TOML parser, or None."""
    from ..base.configscan import scan_key

    return scan_key(path, "runtime", "path")


def real_runtime() -> tuple:
    """(runtime, where that came from)."""
    env = os.environ.get("NVHOOK_RUNTIME")
    if env:
        return env, "NVHOOK_RUNTIME"
    path = os.environ.get("NVHOOK_CONFIG") or DEFAULT_CONFIG
    found = scan_runtime_key(path)
    return (found, path) if found else ("runc", "default")


def run_runtime(runtime: str, argv: list) -> int:
    try:
        if "/" in runtime:
            os.execv(runtime, [runtime, *argv])
        os.execvp(runtime, [runtime, *argv])
    except OSError as e:
        # Not the C library's "No such file or directory": podman reads that as "the OCI runtime
        # was not found", here it means the real runtime behind this one
        why = "it does not exist (not installed, or not in PATH)" if e.errno == 2 else e.strerror
        sys.stderr.write(f"{PROG}: cannot run the OCI runtime {runtime!r}: {why}\n")
        return 127
    return 127  # pragma: no cover - exec does not return


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    runtime, source = real_runtime()
    ci = command_index(argv)
    if ci < 0 or argv[ci] not in ("create", "run"):
        if ci < 0 or argv[ci:] == ["help"]:
            _introduce(argv if ci < 0 else argv[:ci] + ["--help"], runtime, source)
        return run_runtime(runtime, argv)
    bundle, cid, crun_config = create_args(argv, ci + 1)
    log, fmt = log_options(argv, ci)
    WARNINGS_TO[:] = [log, fmt]
    code, error = prepare_bundle(bundle or ".", cid, crun_config, runtime, source)
    if code:
        report_to_runtime_log(log, fmt, f"{PROG}: {error}")
        return code
    return run_runtime(runtime, argv)


def _introduce(options: list, runtime: str, source: str) -> None:
    """`--version` and `--help` name nvhook first, then the real runtime answers as itself.
    Docker reads `runtime --version` line by line and keeps the last line with "version" in
    it: the runtime's own, printed after this one."""
    from .. import __version__

    where = "" if source == "default" else f", from {source}"
    if "--version" in options or "-v" in options:
        text = f"{PROG} version {__version__} (nvhook's OCI runtime wrapper; the real runtime: {runtime}{where})\n"
    elif "--help" in options or "-h" in options:
        text = (f"{PROG} {__version__}: nvhook's OCI runtime wrapper. `create` and `run` of a container that "
                f"asks for GPUs get nvhook's edits in its config.json; every command goes to the real runtime, "
                f"{runtime}{where} (NVHOOK_RUNTIME, else [runtime] path in NVHOOK_CONFIG or {DEFAULT_CONFIG}). "
                f"See `nvhook runtime --help`. {runtime}'s own help follows.\n\n")
    else:
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:
        pass


def hook_path() -> str:
    """nvhook beside this wrapper (both are installed in the same bin directory)."""
    return os.path.join(os.path.dirname(os.path.realpath(sys.argv[0])), "nvhook")


def prepare_bundle(bundle: str, cid: str, crun_config, runtime: str, source: str) -> tuple:
    """Edit the bundle of a container that asks for GPUs. (0, None), or the exit code and
    message of a failure (after one line on stderr; config.json is then unchanged)."""
    import time

    from ..base.errors import HookError, show
    from ..base.log import EventLog

    t0 = time.perf_counter()
    log = EventLog("info", None)
    dir_fd = -1
    code, error = 0, None
    try:
        log.bind(container=cid)
        if crun_config not in (None, "config.json"):
            raise HookError(f"crun's --config {show(crun_config)} is not supported: "
                            "the spec must be the bundle's config.json")
        try:
            dir_fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise HookError(f"cannot open bundle {show(bundle)}: {e.strerror}") from None
        except ValueError:
            raise HookError(f"cannot open bundle {show(bundle)}: the path contains a NUL byte") from None
        _edit_bundle(dir_fd, bundle, cid, runtime, source, log, t0)
    except HookError as err:
        code, error = err.code, err.message
        log.error("runtime.failed", error=err.message)
        _stderr(err.message)
    except Exception as err:  # a bug: one line, the details in the log; the container does not start
        import traceback

        code, error = 1, f"internal error: {type(err).__name__}: {err} (details in the nvhook log)"
        log.error("runtime.crashed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        _stderr(error)
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
        events = list(log.events)
        log.flush()
        if log.write_error:
            _log_lost(log, events, f"{log.write_error}; the container's edits were not affected")
    return code, error


def _edit_bundle(dir_fd: int, bundle: str, cid: str, runtime: str, source: str, log, t0: float) -> None:
    """The work of prepare_bundle on the open bundle directory: config.json untouched for a
    container that asks for no GPU, else nvhook's edits written into it. Raises HookError."""
    import time

    from ..apply import ocispec
    from ..base import config as config_mod
    from ..base.errors import HookError, show
    from ..base.log import LEVELS
    from ..decide.sources import Host, OciBundle

    config_path = os.environ.get("NVHOOK_CONFIG") or DEFAULT_CONFIG
    # The spec first: whether the container asks for a GPU needs no config, so that one
    # that asks for none goes to the runtime unchanged whatever is wrong with the config.
    raw = ocispec.read(dir_fd)
    container = OciBundle(cid, None, os.path.abspath(bundle))
    try:
        cfg = config_mod.load(None, explicit=False)
    except HookError as err:
        if not _may_ask_for_gpus(raw, None, config_path) or not _asks(container, None, config_path):
            from ..base.configscan import scan_key

            _unused(log, config_path, "config.unusable", err.message, runtime,
                    scan_key(config_path, "", "log_file"))
            return
        raise
    log.level = LEVELS[cfg["log_level"]]
    log.path = cfg["log_file"]
    if source != "NVHOOK_RUNTIME" and cfg["runtime"]["path"] != runtime:
        raise HookError(f"runtime.path in {show(config_path)} must be "
                        f"written on one line as path = \"...\" (nvhook-runtime reads it without a TOML "
                        f"parser on every command; it read {runtime!r}, the file says {cfg['runtime']['path']!r})")
    if not _may_ask_for_gpus(raw, cfg):
        return  # untouched: not even parsed
    from ..observe import oci
    from . import pipeline

    spec = oci.load_json(raw, f"bundle config {show(os.path.join(bundle, 'config.json'))}")
    try:
        root = pipeline.root_from(None, cfg)
    except HookError as err:
        if _asks(container, cfg, config_path):
            raise
        _unused(log, config_path, "root.unusable", err.message, runtime, None, key="root")
        return
    plan = pipeline.decide(container, Host(root, cfg, log)).plan
    if not plan["mounts"] and not plan["symlinks"]:
        log.info("runtime.unchanged", reason=plan["compat"]["reason"], runtime=runtime)
        return
    from ..decide import edits as edits_mod

    changes = edits_mod.from_plan(plan)
    nvhook = hook_path()
    added = ocispec.add_edits(spec, changes, edits_mod.spec_mounts(changes), _hook_entry(nvhook), own_launcher=nvhook)
    ocispec.write_atomic(dir_fd, ocispec.serialize(spec, ocispec.style(raw)))
    log.info("runtime.edited", runtime=runtime, devices=added["devices"], mounts=len(added["mounts"]),
             cgroup_rules=added["cgroup_rules"], hook=added["hook"], gpus=[g["index"] for g in plan["gpus"]],
             compat=plan["compat"]["decision"], additional_gids=added.get("additional_gids") or [],
             ms=round((time.perf_counter() - t0) * 1000, 2))


def _hook_entry(nvhook: str) -> dict:
    """nvhook's own prestart hook for the spec: `--in-container-only`, the rest of the work."""
    from ..base.errors import HookError, show
    from ..base.launch import registration

    args = ["nvhook"]
    if os.environ.get("NVHOOK_CONFIG"):
        args += ["--config", os.path.abspath(os.environ["NVHOOK_CONFIG"])]
    if not os.path.isfile(nvhook):
        raise HookError(f"nvhook is not installed beside nvhook-runtime ({show(nvhook)} is missing)")
    hook_env = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
    if os.environ.get("NVHOOK_RUN_DIR"):  # where the hook caches its parsed config (tests)
        hook_env.append(f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}")
    path, argv0 = registration(nvhook)  # the interpreter with -IS where pip dropped the flags
    return {"path": path, "args": [*argv0, *args[1:], "--in-container-only", "prestart"], "env": hook_env}


def _asks(container, cfg, config_path: str) -> bool:
    from . import pipeline

    return pipeline.asks_for_gpu(container, cfg, config_path)


def _unused(log, config_path: str, event: str, error: str, runtime: str, log_file, key: str = "") -> None:
    """A config (or its root) that cannot be used, for a container that asks for no GPU: it
    goes to the runtime unchanged, with a warning in the runtime's --log file and nvhook's log
    (the one the broken file names, where a line scan finds it)."""
    from ..base.config import DEFAULTS

    log.path = log_file if log_file and log_file.startswith("/") else log.path or DEFAULTS["log_file"]
    where = f"{key} in {config_path}" if key else config_path
    log.warning(event, error=error, config=config_path, runtime=runtime,
                message=f"{error} ({where}); ignored: the container asks for no GPU and goes to {runtime} unchanged")
    _warn(f"warning: {error} ({where}; the container asks for no GPU, so it starts unchanged)")


def _may_ask_for_gpus(raw: bytes, cfg, config_path: str = "") -> bool:
    """A cheap test on the raw file: can this spec hold a GPU request at all? `cfg` None: the
    config could not be read, so under any config it could (start/pipeline.py permissive_config)."""
    if b"NVIDIA_VISIBLE_DEVICES" in raw or b"CUDA_VERSION" in raw or b"cdi.k8s.io/" in raw:
        return True
    if cfg is None:
        from . import pipeline

        cfg = pipeline.permissive_config(config_path)
    swarm = (cfg.get("request") or {}).get("swarm_resource", "")  # request.swarm_resource variables
    if any(v.strip() and v.strip().encode() in raw for v in swarm.split(",")):
        return True
    dev = cfg["devices"]
    return bool(dev["accept_volume_mounts"]) and dev["volume_mounts_root"].rstrip("/").encode() in raw


def _warn(message: str) -> None:
    """A warning: never on stderr (the container's log), in the runtime's --log file."""
    from ..base.errors import engine_safe

    report_to_runtime_log(WARNINGS_TO[0], WARNINGS_TO[1], f"{PROG}: {engine_safe(message)}", "warning")


def _log_lost(log, events: list, message: str) -> None:
    """nvhook's log could not be written: the run's events and that fact to the journal
    (best effort: a host without one keeps the --log line alone)."""
    from ..base.log import journal_send

    _warn(message)
    if log.journal:
        return  # they went there already
    log.events = events
    log.warning("log.unwritable", error=message)
    journal_send(log.lines())


def _stderr(message: str) -> None:
    from ..base.errors import engine_safe

    try:
        sys.stderr.write(f"{PROG}: {engine_safe(message)}\n")
        sys.stderr.flush()
    except OSError:
        pass
