"""`nvhook cdi`: generate, list and check CDI specs (the spec itself: start/cdispecs.py)."""

from __future__ import annotations

import os
import sys

import click

from .clikit import FORMAT, Ctx, cdi_global_args


@click.group()
def cdi():
    """CDI specs (Container Device Interface) for podman, containerd, CRI-O, Docker 25+, Kubernetes."""



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
    from ..apply import cdispec
    from ..decide import request as request_mod
    from ..start import cdispecs

    caps = request_mod.capabilities(capabilities, False)
    strategies = cdispecs.parse_strategies(strategy)
    fmt = fmt or ("yaml" if output and output.endswith((".yaml", ".yml")) else "json")
    log = c.log()
    try:
        spec = cdispecs.host_spec(c.cfg, c.root, log, capabilities=caps, strategies=strategies,
                                hook_path=hook_path or cdispecs.default_hook_path(),
                                hook_global_args=cdi_global_args(c))
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
    from ..apply import cdispec
    from ..decide.cdi import KIND
    from ..start import cdispecs
    from .render import to_json

    path = file or c.cfg["cdi"]["spec"]
    if file or (path and os.path.exists(path)):
        spec = cdispec.read_spec(path)
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


@cdi.command(name="check")
@click.argument("file", required=False)
@click.pass_obj
def cdi_check(c: Ctx, file):
    """Exit 1 with one line per difference when the spec FILE [default: cdi.spec of the config]
    no longer matches the host (driver version, missing files, device numbers, GPUs or MIG
    devices added or removed); run with the --config/--root that generate was run with."""
    from ..start import cdispecs

    path = file or c.cfg["cdi"]["spec"]
    if not path:
        raise click.UsageError("no spec file given and cdi.spec is empty")
    log = c.log()
    try:
        spec, diffs = cdispecs.check(c.cfg, c.root, log, path, cdi_global_args(c))
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
