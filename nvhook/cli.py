"""The interactive command line (click): --dry-run, info, list, doctor.

Hook mode is handled in main.py without click; the global options here mirror its options.
"""

from __future__ import annotations

import os
import sys

import click

from .base import config as config_mod
from .base.errors import HookError, clean
from .base.log import LEVELS, EventLog

FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
                      help="Output format.")


class Ctx:
    def __init__(self, config_path, root, log_file, log_level):
        self.config_path, self.root_opt, self.log_file, self.log_level = config_path, root, log_file, log_level
        self._cfg = None

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
        level = self.log_level or self.cfg["log_level"]
        path = self.log_file if self.log_file is not None else self.cfg["log_file"]
        log = EventLog(level, path)
        log.sinks.append(_console_sink(level))
        return log


def _console_sink(level: str):
    """Echo warnings (or everything at debug level) to stderr through structlog's console renderer."""
    import structlog

    render = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    # a person at a terminal sees warnings and errors, and everything when debugging
    threshold = LEVELS["debug"] if level == "debug" else max(LEVELS[level], LEVELS["warning"])

    def sink(ev: dict) -> None:
        if LEVELS.get(ev["level"], 20) >= threshold:
            fields = {k: v for k, v in ev.items() if k != "ts"}
            sys.stderr.write(render(None, ev["level"], fields) + "\n")
    return sink


def _printable(text: str) -> str:
    """Text output for a terminal: image paths, link targets and reasons quoted in it carry no
    control characters (each line cleaned; the newlines between them kept)."""
    if text.isprintable():
        return text
    return "\n".join(clean(line) for line in text.split("\n"))


def _fail(e: HookError):
    click.echo(f"nvhook: {e.message}", err=True)
    sys.exit(e.code)


class Group(click.Group):
    """Every failure ends as one stderr line: HookError as itself, a bug as 'internal error'."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HookError as e:
            _fail(e)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as e:
            click.echo(f"nvhook: internal error: {type(e).__name__}: {e}", err=True)
            sys.exit(1)


@click.group(cls=Group, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", help="Config file [default: $NVHOOK_CONFIG or /etc/nvhook/hook.toml].")
@click.option("--root", metavar="DIR", help="The host root: driver files, /proc and /dev are read under it [default: /].")
@click.option("--log-file", metavar="FILE", help="JSON log file (empty string: none).")
@click.option("--log-level", type=click.Choice(list(LEVELS)), help="Log level.")
@click.option("--dry-run", is_flag=True, help="Print the plan for the container on stdin (or --bundle); change nothing.")
@click.option("--bundle", metavar="DIR", type=click.Path(), help="With --dry-run: build the state from this OCI bundle.")
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
        from .observe import oci
        from . import pipeline
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
            plan = pipeline.decide(state, c.cfg, c.root, log, {})
        finally:
            log.flush()
        click.echo(to_json(plan) if fmt == "json" else _printable(plan_text(plan)), nl=fmt == "json")
    except HookError as e:
        _fail(e)


@cli.command()
@FORMAT
@click.pass_obj
def info(c: Ctx, fmt):
    """Driver, CUDA version and GPUs (from NVML when it answers, else /proc)."""
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
    files = inv["files"]
    items = []
    for lib in files["libraries"]:
        items.append({"capability": "compat32" if lib["kind"] == "library32" else lib["cap"], "kind": lib["kind"],
                      "path": lib["path"], "source": lib["source"], "also_for": lib["cap"] if lib["kind"] == "library32" else None})
    for b in files["binaries"]:
        items.append({"capability": b["cap"], "kind": "binary", "path": b["path"], "source": b["source"]})
    for i in files["ipc"]:
        items.append({"capability": i["cap"], "kind": "ipc", "path": i["path"], "source": i["source"]})
    for c in files["configs"]:
        items.append({"capability": c["cap"], "kind": "config", "path": c["path"], "source": c["source"]})
    for f in files["firmware"]:
        items.append({"capability": "utility,compute", "kind": "firmware", "path": f["path"], "source": f["source"]})
    from .base.catalog import ALWAYS, DEVICE_GATES

    for d in files["devices"]:
        gate = DEVICE_GATES.get(d["role"], d["role"])
        items.append({"capability": "all" if gate == ALWAYS else gate, "kind": "device",
                      "path": d["path"], "source": f"{d['source']} (c {d['major']}:{d['minor']})"})
    from .base.rootpath import join

    root = inv["root"]
    for g in inv["gpus"]:
        if g.get("device"):
            d = g["device"]
            items.append({"capability": f"gpu {g['index']}", "kind": "device", "path": d["path"],
                          "source": f"{d['source']} (c {d['major']}:{d['minor']})"})
        items.append({"capability": f"gpu {g['index']}", "kind": "procfs", "path": g["proc_dir"],
                      "source": join(root, g["proc_dir"])})
    for name in files["procfs"]:
        items.append({"capability": "all", "kind": "procfs", "path": f"/proc/driver/nvidia/{name}",
                      "source": join(root, f"/proc/driver/nvidia/{name}")})
    return items


@cli.command(name="list")
@FORMAT
@click.pass_obj
def list_cmd(c: Ctx, fmt):
    """Every host file and device nvhook would inject, with its capability."""
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


@cli.command()
@click.option("--bundle", metavar="DIR", type=click.Path(), help="OCI bundle of the failing container.")
@click.option("--rootfs", metavar="DIR", type=click.Path(), help="An image's root filesystem (all GPUs assumed).")
@FORMAT
@click.pass_obj
def doctor(c: Ctx, bundle, rootfs, fmt):
    """Explain which libcuda a container gets and whether CUDA will work (error 804, 803, ...)."""
    from . import doctor as doctor_mod
    from .observe import host, oci
    from .decide import plan, request as request_mod
    from .pipeline import cuda_for
    from .render import to_json

    if bool(bundle) == bool(rootfs):
        raise click.UsageError("give exactly one of --bundle DIR or --rootfs DIR")
    log = c.log()
    inv = host.observe(c.root, c.cfg["cache_dir"], log)
    host.add_nvml(inv, c.cfg, log, reason="nvhook doctor", live_instances=True)
    cuda_for(inv)
    if bundle:
        b = oci.load_bundle(bundle)
        env, rootfs = b["env"], b["rootfs"]
        req = request_mod.parse(env, privileged=b["privileged"], mounts=b["mounts"], config=c.cfg,
                                annotations=b["annotations"])
        selected, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
        selected += [m["gpu"] for m in migs if m["gpu"] not in selected]
        caps = req["capabilities"] or None
    else:
        if not os.path.isdir(rootfs):
            raise HookError(f"--rootfs {rootfs} is not a directory")
        env, selected, caps = {}, list(inv["gpus"]), None
    report = doctor_mod.diagnose(inv, rootfs, env, selected, c.cfg["compat"]["mode"],
                                 allow_override=c.cfg["compat"]["allow_env_override"], capabilities=caps)
    from . import devaccess

    bundle_config = None
    if bundle:
        import json

        with open(b["config_path"], "rb") as f:
            bundle_config = json.load(f)
    report["device_access"] = devaccess.report(inv, c.root, bundle_config)
    log.flush()
    click.echo(to_json(report) if fmt == "json" else _printable(doctor_mod.render_text(report)), nl=fmt == "json")


@cli.group()
def system():
    """Host setup tasks."""


@system.command(name="create-dev-char-links")
@click.option("--dev-root", metavar="DIR", help="Where the char/ links go [default: the host root's /dev].")
@FORMAT
@click.pass_obj
def create_dev_char_links(c: Ctx, dev_root, fmt):
    """/dev/char/MAJ:MIN links for the NVIDIA device nodes (runc 1.1.3-1.1.6 needs them with the
    systemd cgroup driver, runc#3671). Idempotent."""
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
