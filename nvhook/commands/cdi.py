"""`nvhook cdi`: generate, list and check CDI specs (the spec itself: start/cdispecs.py)."""

from __future__ import annotations

import os
import sys

import click

from . import hookreach
from .clikit import FORMAT, Ctx, cdi_global_args, global_options, printable


@click.group()
def cdi():
    """CDI specs (Container Device Interface) for podman, containerd, CRI-O, Docker 25+, Kubernetes."""



@cdi.command()
@click.option("--output", "-o", metavar="FILE", help="Write the spec to FILE (atomically; unchanged content is "
              "not rewritten) [default: stdout].")
@click.option("--format", "fmt", type=click.Choice(["json", "yaml"]), help="Spec format [default: yaml for a "
              ".yaml/.yml FILE, else json].")
@click.option("--device-name-strategy", "strategy", default="index,uuid", show_default=True, metavar="LIST",
              help="Device names: index (0, 1:0), uuid (GPU-..., MIG-...), type-index (gpu0, mig1:0), "
              "a comma list of them.")
@click.option("--capabilities", default="compute,utility", show_default=True, metavar="LIST",
              help="Driver capabilities whose files the spec mounts (as NVIDIA_DRIVER_CAPABILITIES).")
@click.option("--hook-path", metavar="PATH", help="nvhook as the runtime should run it [default: this nvhook].")
@click.option("--mode", type=click.Choice(["gpu", "management"]), default="gpu", show_default=True,
              help="gpu: kind nvidia.com/gpu, one device per GPU and MIG device; management: kind "
                   "management.nvidia.com/gpu, one device `all` with every node (monitoring containers).")
@click.option("--driver-root", metavar="DIR", help="As nvidia-ctk's: the host root (nvhook --root DIR).")
@click.option("--dev-root", metavar="DIR", help="As nvidia-ctk's; nvhook reads /dev under the same root as the "
              "driver, so it must name the --driver-root (or --root) directory.")
@click.option("--no-hook", is_flag=True,
              help="No nvhook hook in the spec: each library also bound at its SONAME in /usr/lib/<multiarch> and "
                   "/usr/lib64; no /proc/driver/nvidia masking, no forward compat, no ld.so.cache entries "
                   "(docs/cdi.md, \"A spec without a hook\").")
@click.option("--cdi-version", metavar="VERSION", help="Label the spec with this cdiVersion (0.3.0 ... 1.0.0) "
              "whatever engines are installed; fields that need a newer one are left out. [default: the lowest "
              "that carries the spec's fields, lowered to what the installed podman/containerd/Docker read]")
@click.option("--device-id", "--device-ids", "device_ids", multiple=True, metavar="ID[,ID...]",
              help="Only these devices (repeatable, as nvidia-ctk 1.19's): a GPU index or UUID, <gpu>:<mig>, a MIG "
                   "UUID; `all` (the default): every one; `none`: one device `none` with no GPU (and no `all`).")
@click.option("--no-all-device", is_flag=True, help="No `all` device in the spec.")
@global_options
@click.pass_obj
def generate(c: Ctx, output, fmt, strategy, capabilities, hook_path, mode, driver_root, dev_root, no_hook,
             cdi_version, device_ids, no_all_device):
    """Write a CDI spec of kind nvidia.com/gpu for this host's GPUs and MIG devices."""
    from ..apply import cdispec
    from ..decide import request as request_mod
    from ..start import cdispecs

    c.root_opt = cdispecs.driver_root(c.root_opt, driver_root, dev_root)

    caps = request_mod.capabilities(capabilities, False)
    strategies = cdispecs.parse_strategies(strategy)
    ids = tuple(i.strip() for v in device_ids for i in v.split(",") if i.strip()) or ("all",)
    if mode == "management" and (ids != ("all",) or no_all_device):
        raise click.UsageError("--device-id and --no-all-device are for the GPU spec (--mode gpu): the "
                               "management spec is its one device `all`")
    fmt = fmt or ("yaml" if output and output.endswith((".yaml", ".yml")) else "json")
    log = c.log()
    try:
        spec = cdispecs.host_spec(c.cfg, c.root, log, capabilities=caps, strategies=strategies,
                                hook_path=hook_path or ("" if no_hook else cdispecs.default_hook_path()),
                                hook_global_args=cdi_global_args(c), mode=mode, no_hook=no_hook,
                                cdi_version=cdi_version, device_ids=ids, all_device=not no_all_device)
    finally:
        log.flush()
    data = cdispec.serialize(spec, fmt)
    hookreach.warn(spec, c.cfg["cdi"]["check_timeout"], output or "the spec")
    if not output:
        sys.stdout.buffer.write(data)
        return
    changed = cdispec.write_atomic(output, data)
    n = len(spec["devices"])
    click.echo(f"{'wrote' if changed else 'unchanged'} {output}: {n} devices, cdiVersion {spec['cdiVersion']}",
               err=True)
    from .leftovers import for_spec, warn

    warn(for_spec(output) if mode != "management" else [])  # a second spec of nvhook's kind


@cdi.command(name="list")
@click.argument("file", required=False)
@FORMAT
@click.option("--all", "all_specs", is_flag=True,
              help="Every spec in the CDI spec directories (/etc/cdi, /var/run/cdi), with its file.")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR",
              help="With --all: this spec directory instead (repeatable; later ones take precedence).")
@global_options
@click.pass_obj
def cdi_list(c: Ctx, file, fmt, all_specs, spec_dirs):
    """Device names to pass to the runtime (`--device nvidia.com/gpu=0`), from the spec FILE
    [default: cdi.spec of the config], or from this host when no spec is installed; with --all,
    from every spec in the CDI spec directories, whoever wrote it (nvidia-ctk's too)."""
    from ..apply import cdispec
    from ..decide.cdimodel import KIND
    from ..start import cdispecs
    from .render import to_json

    if all_specs or spec_dirs:
        _list_dirs(list(spec_dirs) or list(SPEC_DIRS), fmt)
        return
    path = file or c.cfg["cdi"]["spec"]
    if file or (path and os.path.exists(path)):
        spec = cdispec.read_spec(path)
        from ..decide.cdicheck import foreign_hooks

        # The names are the spec's; what it runs is checked against what nvhook writes.
        for line in foreign_hooks(spec, cdispecs.default_hook_path(), cdi_global_args(c)):
            click.echo(f"nvhook: warning: CDI spec {printable(path)}: {printable(line)}; "
                       f"see `nvhook cdi check {printable(path)}`", err=True)
    else:
        click.echo(f"nvhook: no CDI spec at {path}; these are the devices `nvhook cdi generate` would write",
                   err=True)
        log = c.log()
        try:
            spec = cdispecs.host_spec(c.cfg, c.root, log, capabilities=["compute", "utility"],
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


# The CDI spec directories, lowest precedence first (container-device-interface's defaults: a
# device in /var/run/cdi overrides one of the same name in /etc/cdi).
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


def _list_dirs(dirs: list[str], fmt: str | None) -> None:
    """Every device of every .json/.yaml/.yml spec in `dirs`: its qualified name, nodes and
    file; a name given again by a later spec is marked as overriding the earlier one. An
    unreadable spec is one stderr line each (the runtimes skip or refuse it too) and exit 1."""
    from ..apply import cdispec
    from ..base.errors import HookError
    from .render import to_json

    items: list[dict] = []
    seen: dict[str, dict] = {}
    broken = 0
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith((".json", ".yaml", ".yml")))
        except FileNotFoundError:
            continue
        except OSError as e:
            click.echo(f"nvhook: cannot list {d}: {e.strerror}", err=True)
            broken += 1
            continue
        for n in names:
            path = os.path.join(d, n)
            try:
                spec = cdispec.read_spec(path)
                kind = spec["kind"]
                devices = [x for x in spec["devices"] if isinstance(x, dict)]
            except (HookError, KeyError, TypeError) as e:
                click.echo(f"nvhook: {path}: not a readable CDI spec: {getattr(e, 'message', e)}", err=True)
                broken += 1
                continue
            for dev in devices:
                name = f"{kind}={dev.get('name')}"
                it = {"name": name, "spec": path,
                      "nodes": [x.get("path") for x in (dev.get("containerEdits") or {}).get("deviceNodes") or []]}
                if name in seen:
                    it["overrides"] = seen[name]["spec"]
                seen[name] = it
                items.append(it)
    if fmt == "json":
        click.echo(to_json(items))
    else:
        for it in items:
            note = f"  (overrides {it['overrides']})" if "overrides" in it else ""
            click.echo(f"{it['name']:<50} {it['spec']}{note}  {' '.join(str(x) for x in it['nodes'])}".rstrip())
    if broken:
        sys.exit(1)


@cdi.command(name="check")
@click.argument("file", required=False)
@click.option("--hook-path", metavar="PATH", help="The hook the spec must run, as generate's --hook-path "
              "[default: this nvhook].")
@global_options
@click.pass_obj
def cdi_check(c: Ctx, file, hook_path):
    """Exit 1 with one line per difference when the spec FILE [default: cdi.spec of the config]
    no longer matches the host (driver version, missing files, device numbers, GPUs or MIG
    devices added or removed) or runs another hook than nvhook's (path and arguments); run
    with the --config/--root (and --hook-path) that generate was run with."""
    from ..start import cdispecs

    path = file or c.cfg["cdi"]["spec"]
    if not path:
        raise click.UsageError("no spec file given and cdi.spec is empty")
    log = c.log()
    try:
        spec, diffs = cdispecs.check(c.cfg, c.root, log, path, cdi_global_args(c), hook_path)
    finally:
        log.flush()
    for line in diffs:
        click.echo(line)
    # a hook path that hangs the check (a network mount not answering) fails it: nothing was verified there
    stuck = hookreach.warn(spec, c.cfg["cdi"]["check_timeout"], path, fatal=True)
    if diffs:
        click.echo(f"nvhook: CDI spec {path} does not match the host ({len(diffs)} difference"
                   f"{'s' if len(diffs) != 1 else ''}): regenerate it with `nvhook cdi generate --output {path}`",
                   err=True)
        sys.exit(1)
    if stuck:
        sys.exit(1)
    click.echo(f"CDI spec {path} matches the host ({len(spec['devices'])} devices)")
