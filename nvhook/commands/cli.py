"""The interactive command line (click): --dry-run, info, list, doctor.

Hook mode is handled in nvhook.start without click; the global options here mirror its options.
"""

from __future__ import annotations

import json
import os
import sys

import click

from ..base.errors import HookError
from ..base.log import LEVELS
from ..start.client import GLOBAL_OPTIONS
from .clikit import FORMAT, Ctx, Interrupted, cdi_global_args, emit, fail, fmt_of, global_options


class Group(click.Group):
    """Every failure ends as one stderr line: HookError as itself, a bug as 'internal error'."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except HookError as e:
            fail(e)
        # BrokenPipeError: the reader went away (`nvhook cdi list | head`); click ends that quietly, exit 1
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                BrokenPipeError):
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
    # a HookError here or in a subcommand ends as Group.invoke's one line
    from ..decide.sources import Host, OciBundle, Options
    from ..observe import oci
    from ..start import pipeline
    from .render import plan_text

    c = ctx.obj
    log = c.log()
    if bundle:
        state = oci.state_for_bundle(bundle)
    else:
        if sys.stdin.isatty():
            raise click.UsageError("--dry-run reads the OCI state on stdin; or pass --bundle DIR")
        state = oci.parse_state(sys.stdin.buffer.read(1 << 20))
    try:
        plan = pipeline.decide(OciBundle.from_state(state), Host(c.root, c.cfg, log), Options(change_host=False)).plan
    finally:
        log.flush()
    emit(fmt, plan, lambda p: plan_text(p, c.root))


@cli.command()
@FORMAT
@global_options
@click.pass_obj
def info(c: Ctx, fmt):
    """Driver, CUDA version and GPUs (from NVML when it answers, else /proc)."""
    from ..observe import host
    from ..start.pipeline import cuda_for
    from . import devaccess
    from .render import info_text

    log = c.log()
    inv = c.observe(log)
    ok = host.add_nvml(inv, c.cfg, log, reason="nvhook info", live_instances=True)
    cuda_for(inv)
    log.flush()
    data = {"driver": inv["driver"], "gpu_source": inv["gpu_source"],
            "nvml_note": None if ok else f"NVML {inv['nvml_state']}: {inv['nvml_error']}",
            "gpus": [{k: g.get(k) for k in ("index", "minor", "model", "brand", "brand_id", "uuid", "bus_id", "cc",
                                             "mig_mode", "migs", "source")} for g in inv["gpus"]]}
    da = devaccess.describe()
    data["device_access"] = dict(da, mode_text=devaccess.mode_text(da))
    emit(fmt_of(fmt), data, info_text)


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
        add(b["cap"], "binary", f"/usr/bin/{b['name']}", b["source"])  # where the plan mounts it
    for i in files["ipc"]:
        add(i["cap"], "ipc", i["path"], i["source"])
    for c in files["configs"]:
        add(c["cap"], "config", c["path"], c["source"])
    for f in files["firmware"]:
        add("utility,compute", "firmware", f["path"], f["source"])
    from ..base.catalog import ALWAYS, DEVICE_GATES

    for d in files["devices"]:
        gate = DEVICE_GATES.get(d["role"], d["role"])
        add("all" if gate == ALWAYS else gate, "device", d["path"], d["source"], dev=d)
    from ..base.rootpath import join

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
    from .render import list_text

    log = c.log()
    inv = c.observe(log)
    log.flush()
    emit(fmt_of(fmt), inventory_items(inv), list_text)


# doctor's exit codes (README "Commands"): what it predicts for the container.
DOCTOR_OK, DOCTOR_REFUSED, DOCTOR_CUDA_FAILS = 0, 3, 4


@cli.command()
@click.option("--bundle", metavar="DIR", type=click.Path(), help="OCI bundle of the failing container.")
@click.option("--rootfs", metavar="DIR", type=click.Path(), help="An image's root filesystem (all GPUs assumed).")
@click.option("--node", is_flag=True, help="Check the node instead: config, log file, engines' registration, "
              "NVIDIA's leftovers, CDI specs, NRI, the hook stages; one line per problem with its fix, exit 5.")
@click.option("--prefix", metavar="DIR", default="/", show_default=True,
              help="With --node: the node's root, every file read under it.")
@click.option("--runtime-name", metavar="NAME", default="nvidia", show_default=True,
              help="With --node: the runtime name pods and containers ask for (a RuntimeClass's handler).")
@FORMAT
@global_options
@click.pass_obj
def doctor(c: Ctx, bundle, rootfs, node, prefix, runtime_name, fmt):
    """Explain which libcuda a container gets and whether CUDA will work (error 804, 803, ...).

    With --bundle, the container is evaluated by the hook's own code (request, legacy image
    rules, requirements, policy, forward-compat decision). Exit status: 0 it should work (or
    asks for no GPU), 3 the hook would refuse to start it, 4 it starts but CUDA is predicted to
    fail on a selected GPU, 1 doctor could not tell (unreadable bundle or host), 2 usage."""
    fmt = fmt_of(fmt)
    if node:
        from .nodedoctor import run

        return run(prefix, c.config_path, runtime_name, fmt, bundle or rootfs)
    from ..decide.sources import Host, OciBundle, Options
    from ..observe import host, oci
    from ..start import pipeline
    from . import doctor as doctor_mod

    if bool(bundle) == bool(rootfs):
        raise click.UsageError("give exactly one of --bundle DIR or --rootfs DIR")
    log = c.log()
    refused = None
    if bundle:
        oci.load_bundle(bundle)  # a missing or broken bundle is reported before the host is probed
        root = c.root  # a root that is not one: doctor cannot tell (one line, exit 1), not a refusal
        decision, refused = pipeline.explain(OciBundle.from_state(oci.state_for_bundle(bundle)), Host(root, c.cfg, log),
                                             Options(change_host=False))
        facts = decision.facts
        if "bundle" not in facts:  # raised before the bundle was read: nothing to explain
            raise HookError(refused or "the bundle could not be evaluated")
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
        inv = c.observe(log)
        host.add_nvml(inv, c.cfg, log, reason="nvhook doctor", live_instances=True)
        pipeline.cuda_for(inv)
        report = doctor_mod.diagnose(inv, rootfs, {}, list(inv["gpus"]), c.cfg["compat"]["mode"],
                                     allow_override=c.cfg["compat"]["allow_env_override"], capabilities=None)
        from . import devaccess

        report["device_access"] = devaccess.report(inv, c.root, None)
    from ..start.cdispecs import doctor_report

    report["cdi"] = doctor_report(c.cfg, c.root, log, cdi_global_args(c))
    import nvhook

    from ..base import modbundle

    report["startpath"] = modbundle.status(nvhook.__path__[0])
    log.flush()
    emit(fmt, report, doctor_mod.render_text)
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
    fmt = fmt_of(fmt)
    from . import devaccess
    from .render import to_json

    log = c.log()
    inv = c.observe(log)
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


def _hook_command(stage: str) -> None:
    @cli.command(name=stage, help=f"Hook mode, {stage} stage: read the OCI state on stdin, give the container "
                 "the driver. runc, crun and podman run this; to try it by hand, use nvhook --dry-run --bundle DIR.")
    @click.option("--in-container-only", is_flag=True,
                  help="Only what must happen inside the container (nvhook-runtime registers the hook this way).")
    @global_options
    @click.pass_obj
    def hook(c: Ctx, in_container_only):
        from ..start.hook import run_hook

        return run_hook({"stage": stage, "config": c.config_path, "root": c.root_opt, "log_file": c.log_file,
                         "log_level": c.log_level, "in_container_only": in_container_only})


for _stage in ("prestart", "createRuntime"):
    _hook_command(_stage)


def _register() -> None:
    from .admin import config_group, runtime, setup_cmd
    from .cdi import cdi
    from .node import node
    from .nri import nri

    for command in (cdi, runtime, config_group, setup_cmd, node, nri):
        cli.add_command(command)


_register()


def run(argv: list[str]) -> int:
    """nvhook's commands (nvhook.entry sends every command line that is not hook mode here)."""
    import gc

    gc.enable()  # bin/nvhook turns it off for hook mode; people's commands may run longer
    try:
        rv = cli.main(args=argv, prog_name="nvhook", standalone_mode=False)
    except Interrupted:
        sys.stderr.write("nvhook: interrupted\n")
        return 130
    except click.exceptions.NoSuchOption as e:
        where = e.ctx.command_path if e.ctx is not None else "nvhook"
        sys.stderr.write(f"nvhook: {e.format_message()} ({_option_hint(e.option_name, where)})\n")
        return 2
    except click.exceptions.UsageError as e:  # click's own form is four lines; ours is one
        sys.stderr.write(f"nvhook: {e.format_message()} (see nvhook --help)\n")
        return 2
    except click.exceptions.ClickException as e:
        sys.stderr.write(f"nvhook: {e.format_message()}\n")
        return e.exit_code
    except click.exceptions.Abort:  # click's form of Ctrl-C (and of EOF at a prompt)
        sys.stderr.write("nvhook: interrupted\n")
        return 130
    return rv if isinstance(rv, int) else 0


def _option_hint(option: str, command_path: str) -> str:
    """Where an option that the subcommand does not take belongs."""
    if option in GLOBAL_OPTIONS or option in ("--dry-run", "--bundle"):
        return f"{option} is an option of nvhook itself: give it before the subcommand"
    return f"see {command_path} --help"
