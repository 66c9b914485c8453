"""The interactive command line (click): --dry-run, info, list, doctor.

Hook mode is handled in main.py without click; the global options here mirror its options.
"""

from __future__ import annotations

import json
import os
import sys

import click

from .base import config as config_mod
from .base.errors import HookError, clean
from .base.log import LEVELS, EventLog, message

FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default=None,
                      help="Output format [default: nvhook --format, else text].")


def _fmt(fmt: str | None) -> str:
    """A subcommand's --format, else the one given before the subcommand, else text."""
    if fmt:
        return fmt
    parent = click.get_current_context().find_root()
    return parent.params.get("fmt") or "text"



class Ctx:
    def __init__(self, config_path, root, log_file, log_level):
        self.root_opt, self.log_file, self.log_level = root, log_file, log_level
        self._config_path = config_path
        self._cfg = None

    @property
    def config_path(self):
        return self._config_path

    @config_path.setter
    def config_path(self, value) -> None:
        self._config_path, self._cfg = value, None

    @property
    def cfg(self) -> dict:
        if self._cfg is None:
            self._cfg = config_mod.load(self.config_path, explicit=self.config_path is not None)
        return self._cfg

    @property
    def root(self) -> str:
        from .pipeline import root_from

        return root_from(self.root_opt, self.cfg)

    def log(self) -> EventLog:
        """Interactive commands log to stderr only: a --dry-run or doctor run at a terminal must
        not land in the production log among real container starts. --log-file asks for a file."""
        level = self.log_level or self.cfg["log_level"]
        log = EventLog(level, self.log_file or None)
        log.bind(interactive=True)
        log.sinks.append(_console_sink(level))
        return log


def _console_sink(level: str):
    """Echo warnings (or everything at debug level) to stderr through structlog's console renderer."""
    import structlog

    # https://no-color.org: a set, non-empty NO_COLOR turns colours off.
    colors = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    render = structlog.dev.ConsoleRenderer(colors=colors)
    # a person at a terminal sees warnings and errors, and everything when debugging
    threshold = LEVELS["debug"] if level == "debug" else max(LEVELS[level], LEVELS["warning"])

    def sink(ev: dict) -> None:
        if LEVELS.get(ev["level"], 20) >= threshold:
            if level == "debug":
                fields = {k: v for k, v in ev.items() if k not in ("ts", "interactive")}
            else:  # a person reads the sentence; the fields are in --log-file or at debug level
                fields = {"level": ev["level"], "event": ev["event"], "message": message(ev)}
            sys.stderr.write(render(None, ev["level"], fields) + "\n")
    return sink


def global_options(f):
    """--config, --root, --log-file, --log-level (and --format) accepted after the subcommand
    too: `nvhook info --root X` means `nvhook --root X info`."""
    def store(name: str):
        def callback(ctx: click.Context, _param: click.Parameter, value):
            if value is not None and ctx.obj is not None:
                setattr(ctx.obj, name, value)
            return value
        return callback

    opts = [
        click.option("--config", "_config", metavar="FILE", expose_value=False, callback=store("config_path"),
                     help="As nvhook --config."),
        click.option("--root", "_root", metavar="DIR", expose_value=False, callback=store("root_opt"),
                     help="As nvhook --root."),
        click.option("--log-file", "_log_file", metavar="FILE", expose_value=False, callback=store("log_file"),
                     help="As nvhook --log-file."),
        click.option("--log-level", "_log_level", type=click.Choice(list(LEVELS)), expose_value=False,
                     callback=store("log_level"), help="As nvhook --log-level."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f
def _printable(text: str) -> str:
    """Text output for a terminal: image paths, link targets and reasons quoted in it carry no
    control characters (each line cleaned; the newlines between them kept)."""
    if text.isprintable():
        return text
    return "\n".join(clean(line) for line in text.split("\n"))


def _fail(e: HookError):
    click.echo(f"nvhook: {e.message}", err=True)
    sys.exit(e.code)


class Interrupted(Exception):
    """Ctrl-C, carried past click (which would print a blank line first) to main's one line."""


class Group(click.Group):
    """Every failure ends as one stderr line: HookError as itself, a bug as 'internal error'."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except HookError as e:
            _fail(e)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as e:
            click.echo(f"nvhook: internal error: {type(e).__name__}: {e}", err=True)
            sys.exit(1)


@click.group(cls=Group, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE",
              help="Config file [default: $NVHOOK_CONFIG or /etc/nvhook/hook.toml].")
@click.option("--root", metavar="DIR",
              help="The host root: driver files, /proc and /dev are read under it [default: /].")
@click.option("--log-file", metavar="FILE", help="JSON log file (empty string: none).")
@click.option("--log-level", type=click.Choice(list(LEVELS)), help="Log level.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan for the container on stdin (or --bundle); change nothing.")
@click.option("--bundle", metavar="DIR", type=click.Path(),
              help="With --dry-run: build the state from this OCI bundle.")
@FORMAT
@click.version_option(package_name="nvhook", prog_name="nvhook")
@click.pass_context
def cli(ctx, config_path, root, log_file, log_level, dry_run, bundle, fmt):
    """OCI prestart hook that gives containers the host's NVIDIA driver.

    As a hook: `nvhook [prestart|createRuntime]` with the OCI state on stdin.
    """
    ctx.obj = Ctx(config_path, root, log_file, log_level)
    if ctx.invoked_subcommand is not None:
        return
    if not dry_run:
        raise click.UsageError("hook mode takes only the global options and an optional stage "
                               "(prestart, createRuntime); try --dry-run or --help")
    try:
        from . import pipeline
        from .observe import oci
        from .render import plan_text, to_json

        c = ctx.obj
        log = c.log()
        if bundle:
            state = oci.state_for_bundle(bundle)
        else:
            if sys.stdin.isatty():
                raise click.UsageError("--dry-run reads the OCI state on stdin; or pass --bundle DIR")
            state = oci.parse_state(sys.stdin.buffer.read(1 << 20))
        try:
            plan = pipeline.decide(state, c.cfg, c.root, log, {}, change_host=False)
        finally:
            log.flush()
        click.echo(to_json(plan) if fmt == "json" else _printable(plan_text(plan)), nl=fmt == "json")
    except HookError as e:
        _fail(e)


@cli.command()
@FORMAT
@global_options
@click.pass_obj
def info(c: Ctx, fmt):
    """Driver, CUDA version and GPUs (from NVML when it answers, else /proc)."""
    fmt = _fmt(fmt)
    try:
        from .observe import host
        from .render import info_text, to_json

        log = c.log()
        inv = host.observe(c.root, c.cfg["cache_dir"], log)
        ok = host.add_nvml(inv, c.cfg, log, reason="nvhook info", live_instances=True)
        from .pipeline import cuda_for

        cuda_for(inv)
        log.flush()
        data = {"driver": inv["driver"], "gpu_source": inv["gpu_source"],
                "nvml_note": None if ok else f"NVML {inv['nvml_state']}: {inv['nvml_error']}",
                "gpus": [{k: g.get(k) for k in ("index", "minor", "model", "brand", "brand_id", "uuid", "bus_id", "cc",
                                                 "mig_mode", "migs", "source")} for g in inv["gpus"]]}
        from . import devaccess

        da = devaccess.describe()
        data["device_access"] = dict(da, mode_text=devaccess.mode_text(da))
        click.echo(to_json(data) if fmt == "json" else _printable(info_text(data)), nl=fmt == "json")
    except HookError as e:
        _fail(e)


def inventory_items(inv: dict) -> list[dict]:
    """One row per injectable thing: where it appears in the container, where it is on the host
    (under --root), and for device nodes their numbers in fields of their own."""
    files = inv["files"]
    items = []

    def add(capability: str, kind: str, container_path: str, host_path: str, dev: dict | None = None,
            also_for: str | None = None) -> None:
        items.append({"capability": capability, "kind": kind, "container_path": container_path,
                      "host_path": host_path, "major": dev["major"] if dev else None,
                      "minor": dev["minor"] if dev else None, "also_for": also_for})

    for lib in files["libraries"]:
        lib32 = lib["kind"] == "library32"
        add("compat32" if lib32 else lib["cap"], lib["kind"], lib["path"], lib["source"],
            also_for=lib["cap"] if lib32 else None)
    for b in files["binaries"]:
        add(b["cap"], "binary", b["path"], b["source"])
    for i in files["ipc"]:
        add(i["cap"], "ipc", i["path"], i["source"])
    for c in files["configs"]:
        add(c["cap"], "config", c["path"], c["source"])
    for f in files["firmware"]:
        add("utility,compute", "firmware", f["path"], f["source"])
    from .base.catalog import ALWAYS, DEVICE_GATES

    for d in files["devices"]:
        gate = DEVICE_GATES.get(d["role"], d["role"])
        add("all" if gate == ALWAYS else gate, "device", d["path"], d["source"], dev=d)
    from .base.rootpath import join

    root = inv["root"]
    for g in inv["gpus"]:
        if g.get("device"):
            d = g["device"]
            add(f"gpu {g['index']}", "device", d["path"], d["source"], dev=d)
        add(f"gpu {g['index']}", "procfs", g["proc_dir"], join(root, g["proc_dir"]))
    for name in files["procfs"]:
        add("all", "procfs", f"/proc/driver/nvidia/{name}", join(root, f"/proc/driver/nvidia/{name}"))
    return items


@cli.command(name="list")
@FORMAT
@global_options
@click.pass_obj
def list_cmd(c: Ctx, fmt):
    """Every host file and device nvhook would inject, with its capability."""
    fmt = _fmt(fmt)
    try:
        from .observe import host
        from .render import list_text, to_json

        log = c.log()
        inv = host.observe(c.root, c.cfg["cache_dir"], log)
        log.flush()
        items = inventory_items(inv)
        click.echo(to_json(items) if fmt == "json" else _printable(list_text(items)), nl=fmt == "json")
    except HookError as e:
        _fail(e)


# doctor's exit codes (README "Commands"): what it predicts for the container.
DOCTOR_OK, DOCTOR_REFUSED, DOCTOR_CUDA_FAILS = 0, 3, 4


@cli.command()
@click.option("--bundle", metavar="DIR", type=click.Path(), help="OCI bundle of the failing container.")
@click.option("--rootfs", metavar="DIR", type=click.Path(), help="An image's root filesystem (all GPUs assumed).")
@FORMAT
@global_options
@click.pass_obj
def doctor(c: Ctx, bundle, rootfs, fmt):
    """Explain which libcuda a container gets and whether CUDA will work (error 804, 803, ...).

    With --bundle, the container is evaluated by the hook's own code (request, legacy image
    rules, requirements, policy, forward-compat decision). Exit status: 0 it should work (or
    asks for no GPU), 3 the hook would refuse to start it, 4 it starts but CUDA is predicted to
    fail on a selected GPU, 1 doctor could not tell (unreadable bundle or host), 2 usage."""
    fmt = _fmt(fmt)
    from . import doctor as doctor_mod
    from . import pipeline
    from .observe import host, oci
    from .render import to_json

    if bool(bundle) == bool(rootfs):
        raise click.UsageError("give exactly one of --bundle DIR or --rootfs DIR")
    log = c.log()
    refused = None
    if bundle:
        oci.load_bundle(bundle)  # a missing or broken bundle is reported before the host is probed
        facts: dict = {}
        try:
            pipeline.decide(oci.state_for_bundle(bundle), c.cfg, c.root, log, {}, facts=facts, change_host=False)
        except HookError as e:
            refused = e.message
        b, req = facts["bundle"], facts.get("request")
        env, rootfs = b["env"], b["rootfs"]
        if req is None or (refused and "inventory" not in facts):
            # refused before the host was looked at (a malformed request)
            report = doctor_mod.refused_report(rootfs, refused or "", None)
        elif req["kind"] == "skip":
            report = doctor_mod.no_gpu_report(rootfs, req["reason"])
        else:
            inv = facts["inventory"]
            host.add_nvml(inv, c.cfg, log, reason="nvhook doctor", live_instances=True)
            pipeline.cuda_for(inv)
            if refused:
                report = doctor_mod.refused_report(rootfs, refused, inv)
            else:
                report = doctor_mod.diagnose(inv, rootfs, env, facts.get("selected", []), c.cfg["compat"]["mode"],
                                             allow_override=c.cfg["compat"]["allow_env_override"],
                                             capabilities=req["capabilities"] or None, decision=facts.get("compat"))
            from . import devaccess

            with open(b["config_path"], "rb") as f:
                bundle_config = json.loads(f.read())
            report["device_access"] = devaccess.report(inv, c.root, bundle_config)
    else:
        if not os.path.isdir(rootfs):
            raise HookError(f"--rootfs {rootfs} is not a directory")
        inv = host.observe(c.root, c.cfg["cache_dir"], log)
        host.add_nvml(inv, c.cfg, log, reason="nvhook doctor", live_instances=True)
        pipeline.cuda_for(inv)
        report = doctor_mod.diagnose(inv, rootfs, {}, list(inv["gpus"]), c.cfg["compat"]["mode"],
                                     allow_override=c.cfg["compat"]["allow_env_override"], capabilities=None)
        from . import devaccess

        report["device_access"] = devaccess.report(inv, c.root, None)
    from .cdicmd import doctor_report

    report["cdi"] = doctor_report(c.cfg, c.root, log, _cdi_global_args(c))
    import nvhook

    from .base import startpath

    report["startpath"] = startpath.status(nvhook.__path__[0])
    log.flush()
    click.echo(to_json(report) if fmt == "json" else _printable(doctor_mod.render_text(report)), nl=fmt == "json")
    if report.get("refused"):
        return DOCTOR_REFUSED
    if any(p["outcome"] not in ("works", "unknown") for p in report.get("gpus", [])):
        return DOCTOR_CUDA_FAILS
    return DOCTOR_OK


@cli.group()
def system():
    """Host setup tasks."""


@system.command(name="create-dev-char-links")
@click.option("--dev-root", metavar="DIR", help="Where the char/ links go [default: the host root's /dev].")
@FORMAT
@global_options
@click.pass_obj
def create_dev_char_links(c: Ctx, dev_root, fmt):
    """/dev/char/MAJ:MIN links for the NVIDIA device nodes (runc 1.1.3-1.1.6 needs them with the
    systemd cgroup driver, runc#3671). Idempotent."""
    fmt = _fmt(fmt)
    from . import devaccess
    from .observe import host
    from .render import to_json

    log = c.log()
    inv = host.observe(c.root, c.cfg["cache_dir"], log)
    log.flush()
    devices = devaccess.host_devices(inv)
    if not devices:
        raise HookError(f"no NVIDIA device nodes under {os.path.join(c.root, 'dev')}: nothing to link")
    done = devaccess.create_dev_char_links(devices, dev_root or os.path.join(c.root, "dev"))
    if fmt == "json":
        click.echo(to_json(done))
    else:
        for d in done:
            click.echo(f"{d['action']:<10} {d['link']} -> {d['target']}")


@cli.group()
def cdi():
    """CDI specs (Container Device Interface) for podman, containerd, CRI-O, Docker 25+, Kubernetes."""


def _cdi_global_args(c: Ctx) -> list[str]:
    from .cdicmd import global_args

    return global_args(c.config_path, c.root_opt)


@cdi.command()
@click.option("--output", "-o", metavar="FILE", help="Write the spec to FILE (atomically; unchanged content is "
              "not rewritten) [default: stdout].")
@click.option("--format", "fmt", type=click.Choice(["json", "yaml"]), help="Spec format [default: yaml for a "
              ".yaml/.yml FILE, else json].")
@click.option("--device-name-strategy", "strategy", default="index,uuid", show_default=True, metavar="LIST",
              help="Device names: index (0, 1:0), uuid (GPU-..., MIG-...), or both.")
@click.option("--capabilities", default="compute,utility", show_default=True, metavar="LIST",
              help="Driver capabilities whose files the spec mounts (as NVIDIA_DRIVER_CAPABILITIES).")
@click.option("--hook-path", metavar="PATH", help="nvhook as the runtime should run it [default: this nvhook].")
@click.pass_obj
def generate(c: Ctx, output, fmt, strategy, capabilities, hook_path):
    """Write a CDI spec of kind nvidia.com/gpu for this host's GPUs and MIG devices."""
    from . import cdicmd
    from .apply import cdispec
    from .decide import request as request_mod

    caps = request_mod.capabilities(capabilities, False)
    strategies = cdicmd.parse_strategies(strategy)
    fmt = fmt or ("yaml" if output and output.endswith((".yaml", ".yml")) else "json")
    log = c.log()
    try:
        spec = cdicmd.host_spec(c.cfg, c.root, log, capabilities=caps, strategies=strategies,
                                hook_path=hook_path or cdicmd.default_hook_path(),
                                hook_global_args=_cdi_global_args(c))
    finally:
        log.flush()
    data = cdispec.serialize(spec, fmt)
    if not output:
        sys.stdout.buffer.write(data)
        return
    changed = cdispec.write_atomic(output, data)
    n = len(spec["devices"])
    click.echo(f"{'wrote' if changed else 'unchanged'} {output}: {n} devices, cdiVersion {spec['cdiVersion']}",
               err=True)


@cdi.command(name="list")
@click.argument("file", required=False)
@FORMAT
@click.pass_obj
def cdi_list(c: Ctx, file, fmt):
    """Device names to pass to the runtime (`--device nvidia.com/gpu=0`), from the spec FILE
    [default: cdi.spec of the config], or from this host when no spec is installed."""
    from . import cdicmd
    from .apply import cdispec
    from .decide.cdi import KIND
    from .render import to_json

    path = file or c.cfg["cdi"]["spec"]
    if file or (path and os.path.exists(path)):
        spec = cdispec.read_spec(path)
        from .decide.cdi import foreign_hooks

        # The names are the spec's; what it runs is checked against what nvhook writes.
        for line in foreign_hooks(spec, cdicmd.default_hook_path(), _cdi_global_args(c)):
            click.echo(f"nvhook: warning: CDI spec {_printable(path)}: {_printable(line)}; "
                       f"see `nvhook cdi check {_printable(path)}`", err=True)
    else:
        click.echo(f"nvhook: no CDI spec at {path}; these are the devices `nvhook cdi generate` would write",
                   err=True)
        log = c.log()
        try:
            spec = cdicmd.host_spec(c.cfg, c.root, log, capabilities=["compute", "utility"],
                                    strategies=("index", "uuid"), hook_path="/nvhook", hook_global_args=[])
        finally:
            log.flush()
    items = [{"name": f"{spec.get('kind', KIND)}={d.get('name')}",
              "nodes": [n.get("path") for n in (d.get("containerEdits") or {}).get("deviceNodes") or []]}
             for d in spec["devices"] if isinstance(d, dict)]
    if fmt == "json":
        click.echo(to_json(items))
    else:
        for it in items:
            click.echo(f"{it['name']:<60} {' '.join(str(n) for n in it['nodes'])}".rstrip())


@cdi.command(name="check")
@click.argument("file", required=False)
@click.option("--hook-path", metavar="PATH", help="The hook the spec must run, as generate's --hook-path "
              "[default: this nvhook].")
@click.pass_obj
def cdi_check(c: Ctx, file, hook_path):
    """Exit 1 with one line per difference when the spec FILE [default: cdi.spec of the config]
    no longer matches the host (driver version, missing files, device numbers, GPUs or MIG
    devices added or removed) or runs another hook than nvhook's (path and arguments); run
    with the --config/--root (and --hook-path) that generate was run with."""
    from . import cdicmd

    path = file or c.cfg["cdi"]["spec"]
    if not path:
        raise click.UsageError("no spec file given and cdi.spec is empty")
    log = c.log()
    try:
        spec, diffs = cdicmd.check(c.cfg, c.root, log, path, _cdi_global_args(c), hook_path)
    finally:
        log.flush()
    for line in diffs:
        click.echo(line)
    if diffs:
        click.echo(f"nvhook: CDI spec {path} does not match the host ({len(diffs)} difference"
                   f"{'s' if len(diffs) != 1 else ''}): regenerate it with `nvhook cdi generate --output {path}`",
                   err=True)
        sys.exit(1)
    click.echo(f"CDI spec {path} matches the host ({len(spec['devices'])} devices)")


@cli.group()
def runtime():
    """nvhook-runtime, the OCI runtime wrapper for Docker, containerd and CRI-O."""


@runtime.command()
@click.option("--runtime", "engine", type=click.Choice(["docker", "containerd", "crio"]), required=True,
              help="The container engine to register nvhook-runtime with.")
@click.option("--config", "path", metavar="PATH", help="The engine's config file [default: /etc/docker/daemon.json, "
              "/etc/containerd/config.toml, /etc/crio/crio.conf.d/99-nvhook.conf].")
@click.option("--runtime-path", metavar="PATH", help="nvhook-runtime as the engine should run it "
              "[default: the one beside this nvhook].")
@click.option("--set-as-default", is_flag=True, help="Make nvhook the engine's default runtime.")
@click.option("--dry-run", is_flag=True, help="Print the changes as a diff; write nothing.")
def configure(engine, path, runtime_path, set_as_default, dry_run):
    """Register nvhook-runtime as the runtime "nvhook". Idempotent; keeps comments and other
    settings; restarts nothing (it says what to restart)."""
    from .configure import configure as run

    return run(engine, path, runtime_path, set_as_default, dry_run)


def _hook_command(stage: str) -> None:
    @cli.command(name=stage, help=f"Hook mode, {stage} stage: read the OCI state on stdin, give the container "
                 "the driver. runc, crun and podman run this; to try it by hand, use nvhook --dry-run --bundle DIR.")
    @click.option("--in-container-only", is_flag=True,
                  help="Only what must happen inside the container (nvhook-runtime registers the hook this way).")
    @global_options
    @click.pass_obj
    def hook(c: Ctx, in_container_only):
        from .main import run_hook

        return run_hook({"stage": stage, "config": c.config_path, "root": c.root_opt, "log_file": c.log_file,
                         "log_level": c.log_level, "in_container_only": in_container_only})


for _stage in ("prestart", "createRuntime"):
    _hook_command(_stage)


@cli.group(name="config")
def config_group():
    """Check a config file, or print the default one."""


@config_group.command(name="check")
@click.argument("file", required=False, metavar="[FILE]")
@FORMAT
def config_check(file, fmt):
    """Validate FILE [default: $NVHOOK_CONFIG, else /etc/nvhook/hook.toml] before deploying it.
    Exit 0 when nvhook would accept it, 1 with one line naming the problem."""
    from .render import to_json

    fmt = _fmt(fmt)
    path = file or os.environ.get("NVHOOK_CONFIG") or config_mod.DEFAULT_PATH
    cfg = config_mod.check_file(path)
    if fmt == "json":
        click.echo(to_json({"path": path, "ok": True, "config": cfg}))
    else:
        click.echo(f"{path}: ok")


@config_group.command(name="default")
def config_default():
    """Print the default config: every key, its default value and why you would change it."""
    from .setup import data

    click.echo(data("hook.toml"), nl=False)


@cli.command(name="setup")
@click.option("--prefix", metavar="DIR", default="/", show_default=True,
              help="Install under DIR (as DESTDIR for packages); the paths inside the files stay the final ones.")
@click.option("--hook-path", metavar="PATH", help="nvhook as the runtime should run it [default: the nvhook beside "
              "this interpreter, else /usr/local/bin/nvhook].")
@click.option("--hooks-dir", metavar="DIR", default="/etc/containers/oci/hooks.d", show_default=True,
              help="Where podman and CRI-O read OCI hook files.")
@click.option("--uninstall", is_flag=True, help="Remove what setup installed (a config you changed is kept).")
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing.")
@FORMAT
def setup_cmd(prefix, hook_path, hooks_dir, uninstall, dry_run, fmt):
    """Install /etc/nvhook/hook.toml (kept when it exists), the OCI hooks file, and the
    systemd-tmpfiles and logrotate entries. Idempotent."""
    from .render import to_json
    from .setup import setup

    fmt = _fmt(fmt)
    done = setup(prefix, hook_path, hooks_dir, uninstall=uninstall, dry_run=dry_run)
    if fmt == "json":
        click.echo(to_json(done))
        return
    for d in done:
        click.echo(f"{d['action']:<22} {d['path']}")
