"""`nvhook node install|uninstall --host-root DIR`: what a Kubernetes DaemonSet's container runs
with the node's root filesystem mounted at DIR (deploy/kubernetes/, docs/kubernetes.md).

install copies nvhook and its pure-Python dependencies to /opt/nvhook on the node, with
launchers whose #! is the node's own python3 (-IS, as packaging/build-deb's), then runs the
rest AS THE NODE: `chroot DIR <node's python3> /opt/nvhook/bin/nvhook ...` byte-compiles and
writes the start-path bundle (both are per interpreter version: the node's python, not this
container's, must write them), writes the CDI spec and registers the runtime. Run in the node's
root, every path those commands touch is the node's path as the kernel resolves it there (a
node's absolute /var/run -> /run link stays on the node), and every path written in a file is
the one the node's engines read. What this process itself reads or writes under DIR is
resolved by nvhook.base.rootpath with DIR as "/": never followed out into the container.

Everything install creates or changes is recorded first in /var/lib/nvhook/node-install.json
(original bytes and mode of each file it changes, which paths did not exist); uninstall puts
each back: an engine config byte-identical to before, no nvhook file, log or cache left. A file
someone changed after install is kept, and uninstall says so.
"""

from __future__ import annotations

import base64
import os
import posixpath
import sys

from ..base.errors import HookError
from . import hookgroup
from .nodehost import (
    CDI_SPEC,
    CONFIG,
    ENGINE_FILES,
    INSTALL_DIR,
    MARKER,
    NRI_UNIT,
    RECORD,
    RUN_FILES,
    UNIT_DIR,
    UNITS,
    Host,
    Record,
    check_proc,
    detect_engines,
    in_node,
    node_oci_runtime,
    node_python,
    parse_strategies,
    sha256_of,
)
from .nodesteps import (
    RestartError,
    copy_nvhook,
    enable_nri,
    register,
    restart_all,
    restart_notes,
    start_plugin,
    systemd_runs,
    units_and_spec,
    write_config,
)
from .nodesteps import (
    nri_engines as nri_engines_of,
)


def install(host_root: str, driver_root: str = "/", engines: list[str] | None = None, runtime_name: str = "nvidia",
            python: str = "/usr/bin/python3", restart_engine: bool = False, set_default: bool = False,
            strategies: list[str] | tuple[str, ...] = ("envvar",), oci_runtime: str = "runc",
            nri: bool = False) -> list[dict]:
    """One {"action", "what", "path"} per change; [] when the node already had it all. `nri`:
    also NRI on in the engine and nvhook's NRI plugin as the node's systemd unit. Everything
    that can refuse the node is checked before anything is written."""
    from .configure import check_name

    host = Host(host_root)
    check_name(runtime_name)
    check_proc(host)
    if not posixpath.isabs(driver_root):
        raise HookError(f"--driver-root {driver_root} must be an absolute path on the node")
    version = node_python(host, python)
    node_oci_runtime(host, oci_runtime)
    engines = engines or detect_engines(host)
    if not engines:
        raise HookError("no container engine on the node (no containerd, CRI-O or Docker config or binary "
                        "under the host root); name one with --runtime")
    nri_engines = nri_engines_of(host, engines) if nri else []
    rec = Record(host)
    if host.exists(INSTALL_DIR) and INSTALL_DIR not in rec.paths and not host.exists(f"{INSTALL_DIR}/{MARKER}"):
        raise HookError(f"{INSTALL_DIR} exists on the node and is not nvhook node install's; remove it first")
    gid, no_group = hookgroup.ensure(host, lambda h, argv: in_node(h, argv, check=False))
    for path in ("/opt", INSTALL_DIR, "/var/lib/nvhook", "/etc/nvhook", "/etc/cdi", UNIT_DIR,
                 *(f"{UNIT_DIR}/{w}" for w in UNITS.values() if w), "/etc/containerd/conf.d",
                 "/etc/crio/crio.conf.d", *RUN_FILES):
        rec.note(path, "dir")
    rec.note(CDI_SPEC, "dir")
    rec.save()

    changed_lib, done = copy_nvhook(host, python, version, gid, no_group)
    done += write_config(host, rec, driver_root, strategies, oci_runtime)
    nvhook = [python, "-I", f"{INSTALL_DIR}/bin/nvhook", "--config", CONFIG]
    done += register(host, rec, nvhook, engines, runtime_name, set_default)
    done += enable_nri(host, rec, nvhook, nri_engines)
    nri_unit_changed = units_and_spec(host, rec, nvhook, nri, nri_engines, done)

    # the engines read their config again, when asked: each one whose config changed since its
    # last restart by install (also by an earlier install that could not restart it: its pod
    # killed in between, or the restart failed), so that a retried install never turns Ready
    # with an engine that has not read the runtime. Not asked: the operator is told to.
    if restart_engine:
        restart_all(host, rec, [e for e in engines if e in rec.pending()], done)
    else:
        done += restart_notes(rec, engines, nri_engines)

    # the NRI plugin running (after the engine's restart: PartOf= would restart it there anyway)
    if nri:
        start_plugin(host, nri_unit_changed or changed_lib, done)
    elif f"{UNIT_DIR}/{NRI_UNIT}" in rec.paths and host.exists(f"{UNIT_DIR}/{NRI_UNIT}"):
        # an earlier --nri install's plugin: kept (uninstall takes it back), and restarted when the
        # nvhook it runs changed under it (a process half old code, half new modules imported later)
        if changed_lib and systemd_runs(host):
            start_plugin(host, True, done, only_if_active=True)
        done.append({"action": "note", "what": f"{NRI_UNIT} of an earlier `node install --nri` is kept; give --nri "
                     "again, or uninstall first to remove it", "path": f"{UNIT_DIR}/{NRI_UNIT}"})
    return done


# -- uninstall -------------------------------------------------------------------------------------

def uninstall(host_root: str, restart_engine: bool = False) -> list[dict]:
    host = Host(host_root)
    if not host.exists(RECORD):
        return []
    rec = Record(host)
    done: list[dict] = []
    engines_changed = set()
    if systemd_runs(host) and f"{UNIT_DIR}/{NRI_UNIT}" in rec.paths:
        # first: GPU containers created from here on are the engine's alone (no plugin half gone)
        in_node(host, ["systemctl", "stop", NRI_UNIT], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if systemd_runs(host):
        in_node(host, ["systemctl", "stop", "nvhook-cdi.path", "nvhook-cdi.timer", "nvhook-cdi.service"],
                env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    # files, then what nvhook wrote while it ran, then the directories install created (deepest first)
    for path, entry in sorted(rec.paths.items(), key=lambda kv: -len(kv[0])):
        if entry["kind"] != "file":
            continue
        got = host.read(path) if not _is_link(host, path) else None
        before = entry.get("before")
        if got is None and before is None:
            continue
        if entry.get("sha256") and got is not None and sha256_of(got[0]) != entry["sha256"]:
            done.append({"action": "kept", "what": "changed since install; put it back by hand", "path": path})
            continue
        if before is None:
            host.remove(path)
            done.append({"action": "removed", "what": "", "path": path})
        else:
            data = base64.b64decode(before["b64"])
            if got != (data, before["mode"]):
                host.write(path, data, before["mode"])
                done.append({"action": "restored", "what": "as before install", "path": path})
        engine = next((e for e, ps in ENGINE_FILES.items() if path in ps), None)
        if engine:
            engines_changed.add(engine)
    for path in [INSTALL_DIR, *RUN_FILES, CDI_SPEC, *(p for p, e in rec.paths.items() if _is_link(host, p))]:
        if not rec.paths.get(path, {"existed": True}).get("existed", True) and host.remove(path):
            done.append({"action": "removed", "what": "", "path": path})
    for rotated in _rotated_logs(host, rec):
        host.remove(rotated)
        done.append({"action": "removed", "what": "", "path": rotated})
    done += hookgroup.kept_note(host)  # never deleted: docs/security.md, "The hook's group"
    host.remove(RECORD)
    for path, entry in sorted(rec.paths.items(), key=lambda kv: -len(kv[0])):
        if entry["kind"] == "dir" and not entry["existed"] and host.exists(path) and host.rmdir_empty(path):
            done.append({"action": "removed", "what": "empty directory", "path": path})
    if systemd_runs(host) and any(d["path"].startswith(UNIT_DIR) for d in done):
        in_node(host, ["systemctl", "daemon-reload"], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if restart_engine:
        restart_all(host, rec, sorted(engines_changed), done)
    return done


def _is_link(host: Host, path: str) -> bool:
    p = host.where(path)
    return p is not None and os.path.islink(p)


def _rotated_logs(host: Host, rec: Record) -> list[str]:
    """The log's rotations (logrotate's .1, .2.gz), when the log was not there before install."""
    log = RUN_FILES[0]
    if rec.paths.get(log, {}).get("existed", True):
        return []
    parent = host.where(posixpath.dirname(log))
    if parent is None or not os.path.isdir(parent):
        return []
    stem = posixpath.basename(log) + "."
    return [posixpath.join(posixpath.dirname(log), n) for n in sorted(os.listdir(parent)) if n.startswith(stem)]


def show_done(done: list[dict], fmt: str, verb: str) -> None:
    import click

    from .render import to_json

    changes = [d for d in done if d["action"] != "note"]
    if fmt == "json":
        click.echo(to_json({"changed": bool(changes), "changes": changes,
                            "notes": [d for d in done if d["action"] == "note"]}))
        return
    if not changes:
        click.echo(f"nvhook node {verb}: nothing to change")
    for d in done:
        click.echo(f"{d['action']:<14} {d['path']}" + (f": {d['what']}" if d["what"] else ""))
    sys.stdout.flush()


def _uninstall_and_show(host_root: str, restart_engine: bool, fmt: str) -> None:
    try:
        done = uninstall(host_root, restart_engine)
    except RestartError as e:
        show_done(e.done, fmt, "uninstall")
        raise
    show_done(done, fmt, "uninstall")


def _wait_then_uninstall(host_root: str, restart_engine: bool, fmt: str, ready_file: str | None) -> None:
    """--wait: a DaemonSet's pod stays until SIGTERM, then takes back what it installed."""
    import signal

    import click

    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    got = signal.sigwait(signals)
    click.echo(f"nvhook node install: {signal.Signals(got).name}: uninstalling")
    if ready_file:
        try:
            os.unlink(ready_file)
        except FileNotFoundError:
            pass
    _uninstall_and_show(host_root, restart_engine, fmt)


# -- the commands ----------------------------------------------------------------------------------

def _commands():
    import click

    from .clikit import FORMAT, fmt_of

    host_root = click.option("--host-root", metavar="DIR", required=True,
                             help="Where the node's / is mounted in this container (hostPath /).")
    restart_opt = click.option("--restart-engine", is_flag=True,
                               help="Restart the engines whose config changed (the node's systemctl).")

    @click.group()
    def node():
        """Install nvhook on a node from a container that sees the node's root (a DaemonSet)."""

    @node.command(name="install")
    @host_root
    @click.option("--driver-root", metavar="PATH", default="/", show_default=True,
                  help="The driver's root as the node sees it (GPU Operator's driver container: /run/nvidia/driver).")
    @click.option("--runtime", "engines", multiple=True, type=click.Choice(["containerd", "crio", "docker"]),
                  help="The engine to register the runtime with (repeatable) [default: each one found].")
    @click.option("--runtime-name", metavar="NAME", default="nvidia", show_default=True,
                  help="The engine's name for nvhook-runtime: a RuntimeClass's handler.")
    @click.option("--set-as-default", is_flag=True, help="Make it the engine's default runtime.")
    @click.option("--device-list-strategy", "strategies", metavar="LIST", multiple=True,
                  help="The device plugin's deviceListStrategy, comma-separated or repeated (envvar, volume-mounts, "
                  "cdi-annotations, cdi-cri) [default: envvar]: an unprivileged pod's NVIDIA_VISIBLE_DEVICES is "
                  "read only with envvar, the volume-mount list only with volume-mounts.")
    @click.option("--oci-runtime", metavar="PATH", default="runc", show_default=True,
                  help="The OCI runtime nvhook-runtime hands the container to (runc or crun; a name on the node's "
                  "PATH or its path on the node): what the engine's runc runtime runs.")
    @click.option("--host-python", metavar="PATH", default="/usr/bin/python3", show_default=True,
                  help="The node's python3 (3.9+), as the node sees it: the launchers' #!.")
    @restart_opt
    @click.option("--nri", is_flag=True, help="Also run nvhook's NRI plugin: NRI turned on in containerd's or "
                  "CRI-O's config, the plugin as the node's systemd unit nvhook-nri.service, enabled and started. "
                  "GPU pods then need no runtime class; pods of the runtime class are left to nvhook-runtime. "
                  "Needs a node booted with systemd.")
    @click.option("--ready-file", metavar="FILE", help="Create FILE (in this container) once installed: "
                  "the DaemonSet's readiness probe.")
    @click.option("--wait", is_flag=True, help="Then stay until SIGTERM, and uninstall (a DaemonSet's pod).")
    @FORMAT
    def install_cmd(host_root, driver_root, engines, runtime_name, set_as_default, strategies, oci_runtime,
                    host_python, restart_engine, nri, ready_file, wait, fmt):
        """Put nvhook on the node: /opt/nvhook run by the node's python3, its config, the CDI spec
        and its systemd refresh, the runtime registered with containerd, CRI-O or Docker. A second
        install changes nothing and says so; uninstall takes it all back."""
        fmt = fmt_of(fmt)
        try:
            done = install(host_root, driver_root, list(engines), runtime_name, host_python, restart_engine,
                           set_as_default, parse_strategies(strategies), oci_runtime, nri)
        except RestartError as e:  # what changed, then the line; no ready file: the pod never turns Ready
            show_done(e.done, fmt, "install")
            raise
        show_done(done, fmt, "install")
        if ready_file:
            with open(ready_file, "w") as f:
                f.write("installed\n")
        if wait:
            _wait_then_uninstall(host_root, restart_engine, fmt, ready_file)

    @node.command(name="uninstall")
    @host_root
    @restart_opt
    @FORMAT
    def uninstall_cmd(host_root, restart_engine, fmt):
        """Take back what install did: each engine config byte-identical to before, no nvhook file,
        log or cache left (a file changed since install is kept, and named)."""
        _uninstall_and_show(host_root, restart_engine, fmt_of(fmt))

    return node


node = _commands()
