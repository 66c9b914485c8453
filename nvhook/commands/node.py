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
import json
import os
import posixpath
import sys

from ..base.errors import HookError
from .nodehost import (
    CDI_SPEC,
    CONFIG,
    ENGINE_FILES,
    HOOK_PYTHON,
    INSTALL_DIR,
    MARKER,
    NRI_FILES,
    NRI_UNIT,
    RECORD,
    RUN_FILES,
    UNIT_DIR,
    UNITS,
    Host,
    Record,
    check_proc,
    config_text,
    containerd_nri_socket,
    detect_engines,
    ensure_hook_group,
    hook_python_files,
    in_node,
    node_oci_runtime,
    node_python,
    parse_strategies,
    remove_hook_group,
    sha256_of,
    unit_text,
    wanted_tree,
)


def install(host_root: str, driver_root: str = "/", engines: list[str] | None = None, runtime_name: str = "nvidia",
            python: str = "/usr/bin/python3", restart_engine: bool = False, set_default: bool = False,
            strategies: list[str] | tuple[str, ...] = ("envvar",), oci_runtime: str = "runc",
            nri: bool = False) -> list[dict]:
    """One {"action", "what", "path"} per change; [] when the node already had it all. `nri`:
    also NRI on in the engine and nvhook's NRI plugin as the node's systemd unit (checked
    before anything is written: a node it cannot be done on is refused whole)."""
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
    nri_engines = _nri_engines(host, engines) if nri else []
    done: list[dict] = []
    rec = Record(host)
    for marker_dir in (INSTALL_DIR,):
        if host.exists(marker_dir) and marker_dir not in rec.paths and not host.exists(f"{marker_dir}/{MARKER}"):
            raise HookError(f"{marker_dir} exists on the node and is not nvhook node install's; remove it first")
    for path in ("/opt", INSTALL_DIR, "/var/lib/nvhook", "/etc/nvhook", "/etc/cdi", UNIT_DIR,
                 *(f"{UNIT_DIR}/{w}" for w in UNITS.values() if w), "/etc/containerd/conf.d",
                 "/etc/crio/crio.conf.d", *RUN_FILES):
        rec.note(path, "dir")
    rec.note(CDI_SPEC, "dir")
    rec.save()

    # 1. nvhook itself, for the node's python
    tree = wanted_tree(python)
    host.makedirs(INSTALL_DIR)
    changed_lib = False
    for rel, (data, mode) in sorted(tree.items()):
        path = f"{INSTALL_DIR}/{rel}"
        got = host.read(path)
        if got != (data, mode):
            host.write(path, data, mode)
            changed_lib = True
    gid, no_group = ensure_hook_group(host, rec)
    if no_group:
        done.append({"action": "note", "what": f"{no_group}: nvidia-cdi-hook's first stage is root:{gid} mode 2710, "
                     "which user-namespaced containers (hostUsers: false, podman --userns=auto) cannot execute: "
                     "they fail to start with CDI specs naming it", "path": HOOK_PYTHON})
    for path, (data, mode) in hook_python_files(host, python).items():
        if mode & 0o2000 and no_group:
            mode &= ~0o001
        where = host.where(path)
        st = os.lstat(where) if where and os.path.lexists(where) else None
        owner_ok = not mode & 0o2000 or (st is not None and (st.st_uid, st.st_gid) == (0, gid))
        if host.read(path) != (data, mode) or not owner_ok:
            host.write(path, data, mode, gid=gid if mode & 0o2000 else None)
            changed_lib = True
    interp = host.where(HOOK_PYTHON)
    if interp and os.statvfs(interp).f_flag & os.ST_NOSUID:
        done.append({"action": "note", "what": "mounted nosuid: nvidia-cdi-hook's first stage cannot drop a "
                     "container's LD_PRELOAD for specs whose hooks carry no env", "path": INSTALL_DIR})
    base = host.where(INSTALL_DIR)
    assert base is not None
    for dirpath, _dirnames, filenames in os.walk(base, topdown=False):  # files of an older nvhook
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), base)
            if rel.startswith("libexec/"):
                continue
            if rel not in tree and "__pycache__" not in rel and not fn.endswith(".bundle"):
                os.unlink(os.path.join(dirpath, fn))
                changed_lib = True
    if changed_lib or not _has_pycache(host):
        in_node(host, [python, "-I", "-m", "compileall", "-q", "-d", f"{INSTALL_DIR}/lib", f"{INSTALL_DIR}/lib"])
        in_node(host, [python, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import nvhook; "
                       "from nvhook.base import modbundle; modbundle.write(nvhook.__path__[0])", f"{INSTALL_DIR}/lib"])
        done.append({"action": "installed", "what": f"nvhook for the node's Python {version[0]}.{version[1]} "
                     f"({python})", "path": INSTALL_DIR})

    # 2. its config, as the node sees the driver
    rec.note(CONFIG, "file")
    want = config_text(driver_root, strategies, oci_runtime)
    have = host.read(CONFIG)
    entry = rec.paths[CONFIG]
    if have is None or (entry["before"] is None and have[0] != want and entry.get("sha256") == sha256_of(have[0])):
        host.write(CONFIG, want)
        rec.written(CONFIG, want)
        done.append({"action": "created" if have is None else "updated",
                     "what": f"config, root = {driver_root}, device list: {','.join(strategies)}"
                             + (f", OCI runtime {oci_runtime}" if oci_runtime != "runc" else ""),
                     "path": CONFIG})
    elif have[0] != want and _root_of(have[0]) != driver_root:
        done.append({"action": "kept", "what": f"config (not install's; its root is {_root_of(have[0])!r}, "
                     f"--driver-root says {driver_root!r})", "path": CONFIG})
    rec.save()

    nvhook = [python, "-I", f"{INSTALL_DIR}/bin/nvhook", "--config", CONFIG]

    # 3. the runtime, registered with each engine (run as the node: paths in the files are its own)
    for engine in engines:
        paths = ENGINE_FILES[engine]
        before = {p: host.read(p) for p in paths}
        for p in paths:
            rec.note(posixpath.dirname(p), "dir")
            rec.note(p, "file")
        rec.save()
        argv = [*nvhook, "runtime", "configure", "--runtime", engine, "--runtime-name", runtime_name,
                "--runtime-path", f"{INSTALL_DIR}/bin/nvhook-runtime"]
        if set_default:
            argv.append("--set-as-default")
        in_node(host, argv)
        for p in paths:
            after = host.read(p)
            if after != before[p] and after is not None:
                rec.written(p, after[0])
                done.append({"action": "created" if before[p] is None else "updated",
                             "what": f"{engine}: runtime {runtime_name}", "path": p})
                rec.restart_pending(engine, True)
        rec.save()

    # 3b. NRI on in those engines (run as the node: its own containerd says what it reads)
    for engine in nri_engines:
        path = NRI_FILES[engine]
        before_nri = host.read(path)
        rec.note(posixpath.dirname(path), "dir")
        rec.note(path, "file")
        rec.save()
        in_node(host, [*nvhook, "runtime", "enable-nri", "--runtime", engine])
        after_nri = host.read(path)
        if after_nri != before_nri and after_nri is not None:
            rec.written(path, after_nri[0])
            done.append({"action": "created" if before_nri is None else "updated", "what": f"{engine}: NRI on",
                         "path": path})
            rec.restart_pending(engine, True)
        rec.save()

    # 4. the CDI spec and its refresh (and, with --nri, the plugin's unit)
    units_changed = nri_unit_changed = False
    units = {**UNITS, NRI_UNIT: "multi-user.target.wants"} if nri else UNITS
    socket = containerd_nri_socket(host) if "containerd" in nri_engines else None
    for name, wants in units.items():
        path = f"{UNIT_DIR}/{name}"
        rec.note(path, "file")
        text = unit_text(name, socket) if name == NRI_UNIT and socket else unit_text(name)
        if host.read(path) != (text, 0o644):
            host.write(path, text)
            rec.written(path, text)
            units_changed = True
            nri_unit_changed |= name == NRI_UNIT
            done.append({"action": "created", "what": "systemd unit", "path": path})
        if wants:
            link = f"{UNIT_DIR}/{wants}/{name}"
            where = host.where(link)
            if where is None or not os.path.islink(where):
                host.makedirs(f"{UNIT_DIR}/{wants}")
                rec.note(link, "dir")
                os.symlink(path, host.where(link) or "")
                done.append({"action": "enabled", "what": "systemd unit", "path": link})
                units_changed = True
    rec.save()
    spec_before = host.read(CDI_SPEC)
    r = in_node(host, [*nvhook, "cdi", "generate", "--output", CDI_SPEC, "--hook-path", f"{INSTALL_DIR}/bin/nvhook"],
                check=False)
    spec_after = host.read(CDI_SPEC)
    # The inventory that generate cached was seen from this container's view of the node: a mount
    # the node makes later (a driver container's /run/nvidia/driver), or one this view lacks,
    # would be served from it to every container start. The node's first start takes its own.
    cache = host.where(RUN_FILES[1])
    if cache and os.path.isdir(cache) and not os.path.islink(cache):
        for name in os.listdir(cache):
            if name.startswith("inventory"):
                os.unlink(os.path.join(cache, name))
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        done.append({"action": "note", "what": f"CDI spec not written ({last}); nvhook-cdi.path and "
                     ".timer try again", "path": CDI_SPEC})
    elif spec_after != spec_before:
        done.append({"action": "created" if spec_before is None else "updated", "what": "CDI spec",
                     "path": CDI_SPEC})
    if units_changed and _systemd_runs(host):
        in_node(host, ["systemctl", "daemon-reload"], env={"SYSTEMD_IGNORE_CHROOT": "1"})
        in_node(host, ["systemctl", "start", "--no-block", "nvhook-cdi.path", "nvhook-cdi.timer"],
                env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)

    # 5. the engines read their config again, when asked: each one whose config changed since
    # its last restart by install (also by an earlier install that could not restart it: its pod
    # killed in between, or the restart failed), so that a retried install never turns Ready
    # with an engine that has not read the runtime.
    if restart_engine:
        restart_all(host, rec, [e for e in engines if e in rec.pending()], done)

    # 6. the NRI plugin running (after the engine's restart: PartOf= would restart it there anyway)
    if nri:
        _start_plugin(host, nri_unit_changed or changed_lib, done)
        for engine in nri_engines:
            if engine in rec.pending():
                done.append({"action": "note", "what": f"{engine} has not read NRI on yet: restart it (systemctl "
                             f"restart {engine}, or install with --restart-engine); until then no GPU container gets "
                             "its GPU from the plugin", "path": NRI_FILES[engine]})
    elif f"{UNIT_DIR}/{NRI_UNIT}" in rec.paths and host.exists(f"{UNIT_DIR}/{NRI_UNIT}"):
        # an earlier --nri install's plugin: kept (uninstall takes it back), and restarted when the
        # nvhook it runs changed under it (a process half old code, half new modules imported later)
        if changed_lib and _systemd_runs(host):
            _start_plugin(host, True, done, only_if_active=True)
        done.append({"action": "note", "what": f"{NRI_UNIT} of an earlier `node install --nri` is kept; give --nri "
                     "again, or uninstall first to remove it", "path": f"{UNIT_DIR}/{NRI_UNIT}"})
    return done


def _nri_engines(host: Host, engines: list[str]) -> list[str]:
    """--nri's checks, before install writes anything: an engine with NRI, and the node's
    systemd to run the plugin (it must live in the node's pid namespace and see its paths: its
    work at a container's start goes through /proc/<pid>/root with the engine's pid)."""
    found = [e for e in engines if e in NRI_FILES]
    if not found:
        raise HookError(f"--nri: {', '.join(engines)} has no NRI (containerd 1.7+ and CRI-O have); name the engine "
                        "with --runtime, or leave --nri out and use the runtime class")
    if not _systemd_runs(host):
        raise HookError("--nri: the node was not booted with systemd (no /run/systemd/system), and the NRI plugin "
                        f"runs as its systemd unit {NRI_UNIT}; nothing installed: leave --nri out (the runtime class), "
                        "or run `/opt/nvhook/bin/nvhook nri` under the node's own init system (docs/nri.md)")
    if "containerd" in found:
        r = in_node(host, ["containerd", "--version"], check=False)
        ver = _version(r.stdout) if r.returncode == 0 else None
        if ver is not None and ver < (1, 7):
            raise HookError(f"--nri: the node's containerd is {ver[0]}.{ver[1]}; NRI needs containerd 1.7 or newer: "
                            "upgrade it, or leave --nri out and use the runtime class")
    return found


def _version(text: str) -> tuple[int, int] | None:
    """(major, minor) of `containerd --version`: "containerd github.com/containerd/containerd
    v2.0.4 <commit>" or a distribution's "1.7.24~ds1 1.7.24~ds1-6"."""
    import re

    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _start_plugin(host: Host, changed: bool, done: list[dict], only_if_active: bool = False) -> None:
    """nvhook-nri.service started, or restarted where its unit or nvhook changed. A failure is
    raised as RestartError: the command shows what it changed, then the line."""
    env = {"SYSTEMD_IGNORE_CHROOT": "1"}
    active = in_node(host, ["systemctl", "is-active", "--quiet", NRI_UNIT], env=env, check=False).returncode == 0
    if (active and not changed) or (only_if_active and not active):
        return
    verb = "restart" if active else "start"
    r = in_node(host, ["systemctl", verb, NRI_UNIT], env=env, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RestartError(f"--nri: systemctl {verb} {NRI_UNIT} failed on the node (exit {r.returncode}): {last}; "
                           f"see `journalctl -u {NRI_UNIT}` there", done)
    done.append({"action": "restarted" if active else "started",
                 "what": "nvhook's NRI plugin", "path": f"{UNIT_DIR}/{NRI_UNIT}"})


def restart_all(host: Host, rec: Record, engines: list[str], done: list[dict]) -> None:
    """Restart each engine, recording it done; a failure is added to `done` and raised (after
    the others' restarts) as RestartError: the command shows what it changed, then the line."""
    failed = []
    for engine in engines:
        try:
            done.append(restart(host, engine))
        except HookError as e:
            failed.append(str(e))
            done.append({"action": "not restarted", "what": str(e), "path": engine})
            continue
        if host.exists(RECORD):
            rec.restart_pending(engine, False)
            rec.save()
    if failed:
        raise RestartError("; ".join(failed), done)


class RestartError(HookError):
    """--restart-engine could not restart an engine; `done` is what the command did before."""

    def __init__(self, message: str, done: list[dict]):
        super().__init__(message)
        self.done = done


def _has_pycache(host: Host) -> bool:
    p = host.where(f"{INSTALL_DIR}/lib/nvhook/__pycache__")
    return p is not None and os.path.isdir(p)


def _root_of(data: bytes) -> str | None:
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("root"):
            try:
                return json.loads(line.split("=", 1)[1].split("#")[0].strip())
            except ValueError:
                return None
    return "/"


def _systemd_runs(host: Host) -> bool:
    p = host.resolved("/run/systemd/system")
    return p is not None and os.path.isdir(p)


def restart(host: Host, engine: str) -> dict:
    """`systemctl restart` of the node's engine, through the node's own systemctl in its root.
    SYSTEMD_IGNORE_CHROOT: systemctl otherwise refuses to act from a chroot; the node's
    /run/systemd/private socket, under the host root, reaches its systemd without hostPID.

    A node not booted with systemd: HookError, nothing signalled. Whatever supervises its
    engine there (OpenRC, runit, s6, a k3s agent) is not one nvhook can name, and stopping the
    engine (NVIDIA's toolkit SIGHUPs containerd, which then exits and relies on systemd's
    Restart=) would leave the node without a CRI until something starts it again."""
    service = {"containerd": "containerd", "docker": "docker", "crio": "crio"}[engine]
    if not _systemd_runs(host):
        raise HookError(f"--restart-engine: cannot restart {service}: the node was not booted with systemd "
                        f"(no /run/systemd/system); restart {service} with the node's own init system, and leave "
                        "--restart-engine out on such nodes")
    r = in_node(host, ["systemctl", "restart", service], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise HookError(f"--restart-engine: systemctl restart {service} failed on the node (exit {r.returncode}): "
                        f"{last}; see `journalctl -u {service}` there")
    return {"action": "restarted", "what": f"{engine}", "path": f"{service}.service"}


# -- uninstall -------------------------------------------------------------------------------------

def uninstall(host_root: str, restart_engine: bool = False) -> list[dict]:
    host = Host(host_root)
    if not host.exists(RECORD):
        return []
    rec = Record(host)
    done: list[dict] = []
    engines_changed = set()
    if _systemd_runs(host) and f"{UNIT_DIR}/{NRI_UNIT}" in rec.paths:
        # first: GPU containers created from here on are the engine's alone (no plugin half gone)
        in_node(host, ["systemctl", "stop", NRI_UNIT], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if _systemd_runs(host):
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
    done += remove_hook_group(host, rec)  # after the copies, its only files, are gone
    host.remove(RECORD)
    for path, entry in sorted(rec.paths.items(), key=lambda kv: -len(kv[0])):
        if entry["kind"] == "dir" and not entry["existed"] and host.exists(path) and host.rmdir_empty(path):
            done.append({"action": "removed", "what": "empty directory", "path": path})
    if _systemd_runs(host) and any(d["path"].startswith(UNIT_DIR) for d in done):
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
            import signal

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
