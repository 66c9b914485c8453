"""The steps of `nvhook node install` (nvhook/commands/node.py): nvhook copied for the node's
python, its config, the runtime registered with each engine, NRI, the CDI spec and its units,
the engines restarted. Each step records what it changes (nodehost.Record) before it changes
it, and returns what it did as {"action", "what", "path"} entries."""

from __future__ import annotations

import json
import os
import posixpath

from ..base.errors import HookError
from . import hookstages
from .nodehost import (
    CDI_SPEC,
    CONFIG,
    ENGINE_FILES,
    HOOK_PYTHON,
    INSTALL_DIR,
    NRI_FILES,
    NRI_UNIT,
    RECORD,
    RUN_FILES,
    UNIT_DIR,
    UNITS,
    Host,
    Record,
    config_text,
    containerd_nri_socket,
    in_node,
    sha256_of,
    unit_text,
    wanted_tree,
)


def copy_nvhook(host: Host, python: str, version: tuple[int, int], gid: int, no_group: str) -> tuple[bool, list[dict]]:
    """nvhook and its dependencies in INSTALL_DIR for the node's python, the hook's stages
    set-group-ID to `gid` (root's only where `no_group` says why the node has no hook group),
    byte-compiled and bundled by the node's python. (whether anything changed, what was done)"""
    done: list[dict] = []
    tree = wanted_tree(python)
    hookstages.own_dirs(host, INSTALL_DIR, [INSTALL_DIR, posixpath.dirname(HOOK_PYTHON)])
    changed = False
    for rel, (data, mode) in sorted(tree.items()):
        path = f"{INSTALL_DIR}/{rel}"
        if host.read(path) != (data, mode):
            host.write(path, data, mode)
            changed = True
    if no_group:
        done.append({"action": "note", "what": f"{no_group}: nvidia-cdi-hook's first stage is root:{gid} mode 2710, "
                     "which user-namespaced containers (hostUsers: false, podman --userns=auto) cannot execute: "
                     "they fail to start with CDI specs naming it", "path": HOOK_PYTHON})
    changed |= hookstages.write_copies(host, hookstages.copies(host, python, posixpath.dirname(HOOK_PYTHON)), gid,
                                       bool(no_group))
    interp = host.where(HOOK_PYTHON)
    if interp and os.statvfs(interp).f_flag & os.ST_NOSUID:
        done.append({"action": "note", "what": "mounted nosuid: nvidia-cdi-hook's first stage cannot drop a "
                     "container's LD_PRELOAD for specs whose hooks carry no env", "path": INSTALL_DIR})
    changed |= _drop_stale(host, tree)
    if changed or not has_pycache(host):
        in_node(host, [python, "-I", "-m", "compileall", "-q", "-d", f"{INSTALL_DIR}/lib", f"{INSTALL_DIR}/lib"])
        in_node(host, [python, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import nvhook; "
                       "from nvhook.base import modbundle; modbundle.write(nvhook.__path__[0])", f"{INSTALL_DIR}/lib"])
        done.append({"action": "installed", "what": f"nvhook for the node's Python {version[0]}.{version[1]} "
                     f"({python})", "path": INSTALL_DIR})
    return changed, done


def _drop_stale(host: Host, tree: dict) -> bool:
    """The files of an older nvhook in INSTALL_DIR removed (not the stages, byte code, bundles)."""
    base = host.where(INSTALL_DIR)
    assert base is not None
    changed = False
    for dirpath, _dirnames, filenames in os.walk(base, topdown=False):
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), base)
            if rel.startswith("libexec/"):
                continue
            if rel not in tree and "__pycache__" not in rel and not fn.endswith(".bundle"):
                os.unlink(os.path.join(dirpath, fn))
                changed = True
    return changed


def write_config(host: Host, rec: Record, driver_root: str, strategies, oci_runtime: str) -> list[dict]:
    """nvhook's config, as the node sees the driver: written where there is none, or where it is
    the one an earlier install wrote and nobody changed; kept (and said) otherwise."""
    rec.note(CONFIG, "file")
    want = config_text(driver_root, strategies, oci_runtime)
    have = host.read(CONFIG)
    entry = rec.paths[CONFIG]
    done = []
    if have is None or (entry["before"] is None and have[0] != want and entry.get("sha256") == sha256_of(have[0])):
        host.write(CONFIG, want)
        rec.written(CONFIG, want)
        done.append({"action": "created" if have is None else "updated",
                     "what": f"config, root = {driver_root}, device list: {','.join(strategies)}"
                             + (f", OCI runtime {oci_runtime}" if oci_runtime != "runc" else ""),
                     "path": CONFIG})
    elif have[0] != want and root_of(have[0]) != driver_root:
        done.append({"action": "kept", "what": f"config (not install's; its root is {root_of(have[0])!r}, "
                     f"--driver-root says {driver_root!r})", "path": CONFIG})
    rec.save()
    return done


def register(host: Host, rec: Record, nvhook: list[str], engines: list[str], runtime_name: str,
             set_default: bool) -> list[dict]:
    """The runtime registered with each engine, run as the node (paths in the files are its own)."""
    done = []
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
    return done


def enable_nri(host: Host, rec: Record, nvhook: list[str], nri_engines: list[str]) -> list[dict]:
    """NRI on in those engines (run as the node: its own containerd says what it reads)."""
    done = []
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
    return done


def units_and_spec(host: Host, rec: Record, nvhook: list[str], nri: bool, nri_engines: list[str],
                   done: list[dict]) -> bool:
    """The CDI spec and its refresh units (and, with --nri, the plugin's unit); whether the
    plugin's unit changed."""
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
    _cdi_spec(host, nvhook, done)
    if units_changed and systemd_runs(host):
        in_node(host, ["systemctl", "daemon-reload"], env={"SYSTEMD_IGNORE_CHROOT": "1"})
        in_node(host, ["systemctl", "start", "--no-block", "nvhook-cdi.path", "nvhook-cdi.timer"],
                env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    return nri_unit_changed


def _cdi_spec(host: Host, nvhook: list[str], done: list[dict]) -> None:
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


def restart_notes(rec: Record, engines: list[str], nri_engines: list[str]) -> list[dict]:
    """What the operator must still do when install did not restart the engines: each engine
    whose config changed and that has not been restarted since reads none of it until then."""
    out = []
    for engine in engines:
        if engine not in rec.pending():
            continue
        what = "NRI on and the runtime" if engine in nri_engines else "the runtime"
        out.append({"action": "note", "what": f"{engine} has not read {what} yet: restart it (systemctl restart "
                    f"{engine} on the node), or install again with --restart-engine; until then no GPU container "
                    "gets its GPU through nvhook there", "path": ENGINE_FILES[engine][0]})
    return out


def nri_engines(host: Host, engines: list[str]) -> list[str]:
    """--nri's checks, before install writes anything: an engine with NRI, and the node's
    systemd to run the plugin (it must live in the node's pid namespace and see its paths: its
    work at a container's start goes through /proc/<pid>/root with the engine's pid)."""
    found = [e for e in engines if e in NRI_FILES]
    if not found:
        raise HookError(f"--nri: {', '.join(engines)} has no NRI (containerd 1.7+ and CRI-O have); name the engine "
                        "with --runtime, or leave --nri out and use the runtime class")
    if not systemd_runs(host):
        raise HookError("--nri: the node was not booted with systemd (no /run/systemd/system), and the NRI plugin "
                        f"runs as its systemd unit {NRI_UNIT}; nothing installed: leave --nri out (the runtime class), "
                        "or run `/opt/nvhook/bin/nvhook nri` under the node's own init system (docs/nri.md)")
    if "containerd" in found:
        r = in_node(host, ["containerd", "--version"], check=False)
        ver = containerd_version(r.stdout) if r.returncode == 0 else None
        if ver is not None and ver < (1, 7):
            raise HookError(f"--nri: the node's containerd is {ver[0]}.{ver[1]}; NRI needs containerd 1.7 or newer: "
                            "upgrade it, or leave --nri out and use the runtime class")
    return found


def containerd_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of `containerd --version`: "containerd github.com/containerd/containerd
    v2.0.4 <commit>" or a distribution's "1.7.24~ds1 1.7.24~ds1-6"."""
    import re

    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def start_plugin(host: Host, changed: bool, done: list[dict], only_if_active: bool = False) -> None:
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


def has_pycache(host: Host) -> bool:
    p = host.where(f"{INSTALL_DIR}/lib/nvhook/__pycache__")
    return p is not None and os.path.isdir(p)


def root_of(data: bytes) -> str | None:
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("root"):
            try:
                return json.loads(line.split("=", 1)[1].split("#")[0].strip())
            except ValueError:
                return None
    return "/"


def systemd_runs(host: Host) -> bool:
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
    if not systemd_runs(host):
        raise HookError(f"--restart-engine: cannot restart {service}: the node was not booted with systemd "
                        f"(no /run/systemd/system); restart {service} with the node's own init system, and leave "
                        "--restart-engine out on such nodes")
    r = in_node(host, ["systemctl", "restart", service], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise HookError(f"--restart-engine: systemctl restart {service} failed on the node (exit {r.returncode}): "
                        f"{last}; see `journalctl -u {service}` there")
    return {"action": "restarted", "what": f"{engine}", "path": f"{service}.service"}
