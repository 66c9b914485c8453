"""What puts nvhook on a host and keeps its settings: `runtime configure`, `config`, `setup`."""

from __future__ import annotations

import os

import click

from ..base import config as config_mod
from .clikit import FORMAT, fmt_of


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
@click.option("--dry-run", is_flag=True, help="Print the changes as a diff; write nothing.")
def configure(engine, path, runtime_path, set_as_default, dry_run):
    """Register nvhook-runtime as the runtime "nvhook". Idempotent; keeps comments and other
    settings; restarts nothing (it says what to restart)."""
    from .configure import configure as run

    return run(engine, path, runtime_path, set_as_default, dry_run)



@click.group(name="config")
def config_group():
    """Check a config file, or print the default one."""


@config_group.command(name="check")
@click.argument("file", required=False, metavar="[FILE]")
@FORMAT
def config_check(file, fmt):
    """Validate FILE [default: $NVHOOK_CONFIG, else /etc/nvhook/hook.toml] before deploying it.
    Exit 0 when nvhook would accept it, 1 with one line naming the problem."""
    from .render import to_json

    fmt = fmt_of(fmt)
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
def setup_cmd(prefix, hook_path, hooks_dir, uninstall, dry_run, fmt):
    """Install /etc/nvhook/hook.toml (kept when it exists), the OCI hooks file, and the
    systemd-tmpfiles and logrotate entries. Idempotent."""
    from .render import to_json
    from .setup import setup

    fmt = fmt_of(fmt)
    done = setup(prefix, hook_path, hooks_dir, uninstall=uninstall, dry_run=dry_run)
    if fmt == "json":
        click.echo(to_json(done))
        return
    for d in done:
        click.echo(f"{d['action']:<22} {d['path']}")
