"""What puts nvhook on a host and keeps its settings: `runtime configure`, `config`, `setup`."""

from __future__ import annotations

import os

import click

from ..base import config as config_mod
from .clikit import FORMAT, fmt_of, global_options


@click.group()
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
@click.option("--runtime-name", "name", metavar="NAME", default="nvidia", show_default=True,
              help="The name the engine knows the runtime by (`docker run --runtime NAME`, containerd's and "
              "CRI-O's runtime handler, a RuntimeClass's `handler`); `nvidia`, as `node install` and NVIDIA's "
              "Container Toolkit name it, keeps their configs and RuntimeClasses working.")
@click.option("--dry-run", is_flag=True, help="Print the changes as a diff; write nothing.")
@click.option("--record", "record_path", metavar="PATH", help="Where to keep what each file was before, for "
              "`runtime unconfigure` [default: /var/lib/nvhook/runtime-configure.json].")
def configure(engine, path, runtime_path, set_as_default, name, dry_run, record_path):
    """Register nvhook-runtime as the runtime "nvidia" (or --runtime-name). Idempotent; keeps
    comments and other settings; says it worked only when the engine reads it so (containerd's
    `config dump`, `dockerd --validate`), else puts every file back; restarts nothing (it says
    what to restart). `runtime unconfigure` undoes it."""
    from .configure import configure as run

    return run(engine, path, runtime_path, set_as_default, dry_run, name=name, record_path=record_path)


@runtime.command()
@click.option("--runtime", "engine", type=click.Choice(["docker", "containerd", "crio"]), required=True,
              help="The container engine to take nvhook-runtime out of.")
@click.option("--config", "path", metavar="PATH", help="The engine's config file, as given to `runtime configure` "
              "[default: /etc/docker/daemon.json, /etc/containerd/config.toml, /etc/crio/crio.conf.d/99-nvhook.conf].")
@click.option("--record", "record_path", metavar="PATH", help="The record `runtime configure` kept "
              "[default: /var/lib/nvhook/runtime-configure.json].")
def unconfigure(engine, path, record_path):
    """Put back, byte for byte, every file `runtime configure` wrote for the engine (the config,
    its drop-in), from its record. A file changed since is left alone, with one line saying so
    (exit 1). Restarts nothing (it says what to restart)."""
    from .configrecord import unconfigure as run
    from .configure import DEFAULT_PATHS

    return run(engine, path or DEFAULT_PATHS[engine], record_path)


@runtime.command(name="enable-nri")
@click.option("--runtime", "engine", type=click.Choice(["containerd", "crio"]), required=True,
              help="The container engine whose NRI to turn on.")
@click.option("--config", "path", metavar="PATH", help="The engine's config file [default: "
              "/etc/containerd/config.toml, /etc/crio/crio.conf.d/99-nvhook-nri.conf].")
@click.option("--dry-run", is_flag=True, help="Print the changes as a diff; write nothing.")
def enable_nri(engine, path, dry_run):
    """Turn NRI on in the engine's config, for `nvhook nri` (docs/nri.md): containerd's
    [plugins."io.containerd.nri.v1.nri"] disable = false where containerd (its `config dump`)
    has it off (1.7's default; 2.x has it on), CRI-O's [crio.nri] enable_nri = true. Idempotent;
    keeps comments and other settings; restarts nothing (it says what to restart)."""
    from .enginenri import enable_nri as run

    return run(engine, path, dry_run)



@click.group(name="config")
def config_group():
    """Check a config file, set keys in it, or print the default one."""


@config_group.command(name="check")
@click.argument("file", required=False, metavar="[FILE]")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too (a root that is not a driver root).")
@FORMAT
def config_check(file, strict, fmt):
    """Validate FILE [default: $NVHOOK_CONFIG, else /etc/nvhook/hook.toml] before deploying it.
    Exit 0 when nvhook would accept it, 1 with one line naming the problem. A `root` that is
    not a driver root on this machine (missing, no proc/driver/nvidia, no driver libraries) is
    a warning on stderr: exit 0 (the file may be meant for another machine), 1 with --strict."""
    from ..base.errors import HookError
    from .configimport import nvidia_key_hint
    from .render import to_json

    fmt = fmt_of(fmt)
    path = file or os.environ.get("NVHOOK_CONFIG") or config_mod.DEFAULT_PATH
    try:
        cfg = config_mod.check_file(path)
    except HookError as e:
        raise HookError(e.message + nvidia_key_hint(path, e.message), code=e.code) from None
    where = f"root in {path}" if _sets_root(path) else f"root, not set in {path}: the default"
    warnings = [f"root = {cfg['root']!r} ({where}): {p}" for p in config_mod.root_problems(cfg["root"])]
    from .nodedoctor import log_problems

    warnings += [f"log_file = {cfg['log_file']!r}: {p['problem']}; fix: {p['fix']}"
                 for p in log_problems(cfg["log_file"])]
    if fmt == "json":
        click.echo(to_json({"path": path, "ok": True, "warnings": warnings, "config": cfg}))
    else:
        for w in warnings:
            click.echo(f"warning: {w}", err=True)
        click.echo(f"{path}: ok" + (f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''})" if warnings
                                    else ""))
    if warnings and strict:
        raise SystemExit(1)


def _sets_root(path: str) -> bool:
    from ..base import tomlread as tomllib
    from ..base.configscan import read_config

    return "root" in tomllib.loads(read_config(path, stdin_ok=True).decode())


@config_group.command(name="set")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...")
@click.option("--config", "path", metavar="FILE", help="The file to change [default: $NVHOOK_CONFIG, else "
              "/etc/nvhook/hook.toml; a missing one starts as `nvhook config default`].")
@click.option("--dry-run", is_flag=True, help="Print the changes as a diff; write nothing.")
def config_set(assignments, path, dry_run):
    """Set keys in nvhook's config file, keeping its comments: `nvhook config set
    daemon.mode=off log_level=debug`. Dotted keys name a table's key; each value is typed by the
    key's default. The result is validated as `config check` does before it is written
    (atomically, owner and mode kept); an unknown key is refused with a "did you mean"."""
    import difflib

    from .configset import config_set as run

    path = path or os.environ.get("NVHOOK_CONFIG") or config_mod.DEFAULT_PATH
    new, old = run(path, list(assignments), dry_run=dry_run)
    if dry_run:
        click.echo("".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                                fromfile=path if old is not None else "/dev/null", tofile=path)),
                   nl=False)
        return
    if new == old:
        click.echo(f"{path}: unchanged")
    else:
        click.echo(f"{path}: {'set' if old is not None else 'created with'} "
                   f"{', '.join(a.split('=', 1)[0].strip() for a in assignments)}")


@config_group.command(name="import")
@click.argument("file", required=False, metavar="[FILE]")
def config_import(file):
    """Print NVIDIA Container Toolkit's config.toml (FILE [default:
    /etc/nvidia-container-runtime/config.toml]) as an nvhook config that `config check`
    accepts: every key with a meaning here carried over, one line on stderr for each key that
    has none, saying why. Save it with `nvhook config import > /etc/nvhook/hook.toml`."""
    from .configimport import NVIDIA_DEFAULT_PATH, import_file

    text, dropped = import_file(file or NVIDIA_DEFAULT_PATH)
    for line in dropped:
        click.echo(f"nvhook: {line}", err=True)
    click.echo(text, nl=False)


@config_group.command(name="default")
def config_default():
    """Print the default config: every key, its default value and why you would change it."""
    from .setup import data

    click.echo(data("hook.toml"), nl=False)


@click.command(name="setup")
@click.option("--prefix", metavar="DIR", default="/", show_default=True,
              help="Install under DIR (as DESTDIR for packages); the paths inside the files stay the final ones.")
@click.option("--hook-path", metavar="PATH", help="nvhook as the runtime should run it [default: the nvhook beside "
              "this interpreter, else /usr/local/bin/nvhook].")
@click.option("--hooks-dir", metavar="DIR", default="/etc/containers/oci/hooks.d", show_default=True,
              help="Where podman and CRI-O read OCI hook files.")
@click.option("--uninstall", is_flag=True, help="Remove what setup installed (a config you changed is kept).")
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing.")
@FORMAT
@global_options
@click.pass_obj
def setup_cmd(c, prefix, hook_path, hooks_dir, uninstall, dry_run, fmt):
    """Install /etc/nvhook/hook.toml (or the file nvhook --config names, which the hooks file
    then passes as NVHOOK_CONFIG; kept when it exists), the OCI hooks file, and the
    systemd-tmpfiles and logrotate entries. Idempotent."""
    from .render import to_json
    from .setup import setup

    fmt = fmt_of(fmt)
    config_path = os.path.abspath(c.config_path) if c is not None and c.config_path else None
    done = setup(prefix, hook_path, hooks_dir, uninstall=uninstall, dry_run=dry_run, config_path=config_path)
    if fmt == "json":
        click.echo(to_json(done))
        return
    for d in done:
        click.echo(f"{d['action']:<22} {d['path']}")
