"""`nvhook cdi generate | list | check` and doctor's staleness check: observe the host, build
the spec (decide.cdimodel, pure), write it (apply.cdispec)."""

from __future__ import annotations

import os
import sys

from ..base.errors import HookError, show

DEFAULT_CAPABILITIES = "compute,utility"
DEFAULT_STRATEGY = "index,uuid"


def parse_strategies(value: str) -> tuple[str, ...]:
    from ..decide.cdimodel import STRATEGIES

    out = []
    for s in (t.strip() for t in value.split(",")):
        if not s:
            continue
        if s not in STRATEGIES:
            raise HookError(f"unknown device name strategy {s!r} (known: {', '.join(STRATEGIES)})")
        if s not in out:
            out.append(s)
    if not out:
        raise HookError("--device-name-strategy names no strategy (index, uuid, type-index)")
    return tuple(out)


def driver_root(root: str | None, driver: str | None, dev: str | None) -> str | None:
    """nvidia-ctk's --driver-root and --dev-root as nvhook's one host root (--root): the same
    directory, or an error that says so."""
    chosen = [(n, v) for n, v in (("--root", root), ("--driver-root", driver), ("--dev-root", dev)) if v]
    paths = {os.path.realpath(v) for _, v in chosen}
    if len(paths) > 1:
        raise HookError(f"{' and '.join(f'{n} {show(v)}' for n, v in chosen)} differ: nvhook reads the driver's "
                        "files, /proc and /dev under one host root; give one directory")
    return chosen[0][1] if chosen else None


def default_hook_path() -> str:
    """This nvhook, as the runtime should run it: the launcher that runs now, else PATH's."""
    me = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(me) == "nvhook" and os.access(me, os.X_OK):
        return me
    import shutil

    found = shutil.which("nvhook")
    if not found:
        raise HookError("cannot tell where nvhook is installed: pass --hook-path")
    return os.path.abspath(found)


def global_args(config_path: str | None, root_opt: str | None) -> list[str]:
    """The hook's --config/--root: what this command was given, so that the hook reads the
    same config and host as the spec was made from (the hook gets no NVHOOK_CONFIG)."""
    args = []
    cfg = config_path or os.environ.get("NVHOOK_CONFIG")
    if cfg:
        args += ["--config", os.path.abspath(cfg)]
    if root_opt:
        args += ["--root", os.path.abspath(root_opt)]
    return args


def host_spec(cfg: dict, root: str, log, *, capabilities: list[str], strategies: tuple[str, ...],
              hook_path: str, hook_global_args: list[str], facts: dict | None = None,
              mode: str = "gpu", no_hook: bool = False, cdi_version: str | None = None,
              complete: bool = True, device_ids: tuple[str, ...] = ("all",), all_device: bool = True) -> dict:
    """Observe the host under `root` and build its spec; `facts` gets the driver version.
    `no_hook`: a spec without nvhook's hook (gpu mode only). cdiVersion: see choose_version
    (`cdi_version`: --cdi-version)."""
    if no_hook and mode != "gpu":
        raise HookError("--no-hook is for the GPU spec (--mode gpu): the management spec keeps nvhook's hook")
    from ..decide import cdimodel as cdi
    from ..observe import host

    # The spec's capabilities, as a container's: a file behind another one (the modeset node of
    # `display` on a compute server) is no warning here.
    inv = host.observe(root, cfg["cache_dir"], log, capabilities=None if mode == "management" else capabilities)
    if not inv["gpus"]:
        raise HookError(f"no NVIDIA GPU found under {show(root)} (/proc/driver/nvidia/gpus is empty or "
                        "missing: is the driver loaded?); a CDI spec would name no device")
    if complete:  # a spec to write; `cdi check` builds one only to list how the host differs
        _require_core_libraries(inv, root, capabilities)
    if inv["files"]["mig_minors"] and not host.add_nvml(inv, cfg, log, reason="CDI spec: MIG devices",
                                                         live_instances=True):
        log.warning("cdi.mig_skipped", reason=f"NVML unavailable ({inv['nvml_error']}): MIG devices are not "
                                              "in the spec")
    if facts is not None:
        facts["driver"] = inv["driver"]["version"]
    if mode == "management":
        spec = cdi.build_management_spec(inv, cfg, capabilities=capabilities, hook_path=hook_path,
                                         global_args=hook_global_args)
    else:
        try:
            spec = cdi.build_spec(inv, cfg, capabilities=capabilities, strategies=strategies, hook_path=hook_path,
                                  global_args=hook_global_args, no_hook=no_hook, device_ids=device_ids,
                                  all_device=all_device)
        except ValueError as e:
            raise HookError(str(e)) from None
    choose_version(spec, root, log, cdi_version)
    return spec


def check_version(value: str | None) -> str | None:
    from ..decide import cdimodel as cdi

    if value is None:
        return None
    v = value.strip().lstrip("v")
    if v not in cdi.VERSIONS:
        raise HookError(f"--cdi-version {show(value)} is no CDI spec version (known: {', '.join(cdi.VERSIONS)})")
    return v


def choose_version(spec: dict, root: str, log, forced: str | None = None) -> None:
    """The spec's cdiVersion: the lowest that carries its fields, unless an engine installed
    under `root` (the host's own, also when `node install` generates from a DaemonSet: it runs
    the generator in the node's root) reads only older versions; then the fields that need
    more are left out of the spec, so that every engine there still reads it, and one warning
    line says which engine, which field and how to force it. `forced` (--cdi-version) labels
    the spec with that version whatever is installed; fields above it are left out (warned)."""
    from ..decide import cdimodel as cdi

    forced = check_version(forced)
    try:
        if forced is not None:
            for line in cdi.fit_version(spec, forced, label=forced):
                log.warning("cdi.version_limited", reason=f"{line}: --cdi-version {forced} asks for that version")
            return
        need = spec["cdiVersion"]
        if cdi.version_key(need) <= cdi.version_key(cdi.V050):
            return  # every engine with CDI support reads 0.5.0 (podman 4.3.1 is the oldest in use)
        from ..observe.host import engines

        readers = engines.cdi_readers(root)
        older = [r for r in readers if cdi.version_key(r["max_version"]) < cdi.version_key(need)]
        if not older:
            return
        limit = min((r["max_version"] for r in older), key=cdi.version_key)
        names = ", ".join(f"{r['engine']} ({r['path']}) reads up to {r['max_version']}" for r in older)
        for line in cdi.fit_version(spec, limit):
            log.warning("cdi.version_limited",
                        reason=f"{line}: {names}; `--cdi-version {need}` writes it anyway, and that engine "
                               f"then refuses the whole spec")
    except ValueError as e:
        raise HookError(f"cannot write the spec as --cdi-version {forced}: {e}") from None


# What a container that was given a GPU cannot do without: with either missing, the spec
# would hand out device nodes and no driver, and every CUDA or nvidia-smi call would fail.
_CORE = {"compute": "libcuda.so", "utility": "libnvidia-ml.so"}


def _require_core_libraries(inv: dict, root: str, capabilities: list[str]) -> None:
    have = {lib["name"] for lib in inv["files"]["libraries"] if lib["kind"] == "library"}  # not the 32-bit ones
    wanted = set(capabilities) if "all" not in capabilities else set(_CORE)
    missing = [name for cap, name in _CORE.items() if cap in wanted and name not in have]
    if missing:
        raise HookError(f"{' and '.join(missing)} of driver {inv['driver']['version'] or '(unknown)'} not found under "
                        f"{show(root)}: the spec would give containers the GPUs without their driver; point "
                        "--root at the driver's root (the GPU Operator's driver container: /run/nvidia/driver) "
                        "and check that its ld.so.cache lists the libraries")


def stuck(at: str, seconds: float, what: str) -> tuple[str, str]:
    """What the commands say when a look at `at` did not come back within `seconds`
    (`cdi.check_timeout`): the problem (`what` was not done), and its fix."""
    return (f"{at} did not answer within {seconds:g} s (a network mount whose server does not answer?): {what}",
            f"find what serves it (findmnt -T {at}) and repair or unmount it (umount -l), or raise "
            "cdi.check_timeout")


def missing_within(paths: list[str], seconds: float | None) -> tuple[list[str], str | None]:
    """The `paths` that do not exist (lexists) and None; with `seconds`, looked at in a child
    given that long (base/process.records_within), and at the deadline (those found missing
    before, the path it waits on)."""
    if seconds is None or not paths:
        return [p for p in paths if not os.path.lexists(p)], None
    from ..base import process

    def work(send) -> None:
        for p in paths:
            send(b"P" + os.fsencode(p))
            if not os.path.lexists(p):
                send(b"M" + os.fsencode(p))

    records, done = process.records_within(work, seconds)
    missing = [os.fsdecode(r[1:]) for r in records if r[:1] == b"M"]
    at = next((os.fsdecode(r[1:]) for r in reversed(records) if r[:1] == b"P"), paths[0])
    return missing, None if done else at


def check(cfg: dict, root: str, log, path: str, hook_global_args: list[str],
          hook_path: str | None = None) -> tuple[dict, list[str]]:
    """(the spec in `path`, one line per difference from the host); a spec not made by nvhook
    is an error. Its hooks are compared with the one nvhook writes: `hook_path` (default:
    this nvhook, as generate's default) with `hook_global_args` -- never with the path read
    back from the file being checked, which would make any program there "match"."""
    from ..apply import cdispec
    from ..decide import cdimodel as cdi

    old = cdispec.read_spec(path)
    again = _regenerate(cfg, root, log, old, hook_global_args, hook_path or default_hook_path(), complete=False,
                        seconds=cfg["cdi"]["check_timeout"], shown=show(path))
    if again is None:
        raise HookError(f"CDI spec {show(path)} was not generated by nvhook (no nvhook {cdi.HOOK_NAME} hook "
                        f"with {cdi.CAPS_OPTION}): nvhook checks only its own specs")
    return old, again[1]


def _regenerate(cfg: dict, root: str, log, old: dict, hook_global_args: list[str],
                hook_path: str | None = None, complete: bool = True, seconds: float | None = None,
                shown: str = "the spec") -> tuple[dict, list[str]] | None:
    """The spec the host gives now with the options `old` was written with (its hook at
    `hook_path`, else at the path `old` names: a refresh, see _check_trusted), and one line per
    difference between them; None when nvhook did not write `old`. With `seconds`, the files
    `old` names are looked at within that long (missing_within), HookError at the deadline."""
    from ..decide import cdicheck
    from ..decide import cdimodel as cdi
    from ..decide import request as request_mod

    opts = cdicheck.spec_options(old)
    if not opts["capabilities"] or not (opts["hook_path"] or opts["no_hook"]):
        return None
    caps = request_mod.capabilities(",".join(opts["capabilities"]), False)
    facts: dict = {}
    mode = "management" if old.get("kind") == cdi.MANAGEMENT_KIND else "gpu"
    def again(version: str | None = None) -> dict:
        return host_spec(cfg, root, log, capabilities=caps, strategies=opts["strategies"] or ("index",),
                         hook_path=hook_path or opts["hook_path"] or "", hook_global_args=hook_global_args,
                         facts=facts, mode=mode, no_hook=opts["no_hook"], cdi_version=version, complete=complete)

    new = again()
    # A label above the one chosen now was asked for (--cdi-version): an option like the others.
    label = old.get("cdiVersion")
    if label in cdi.VERSIONS and cdi.version_key(label) > cdi.version_key(new["cdiVersion"]):
        new = again(label)
    missing, at = missing_within(cdicheck.host_paths(old), seconds)
    if at is not None and seconds is not None:
        raise HookError("; ".join(stuck(at, seconds, f"CDI spec {shown} could not be checked")))
    return new, cdicheck.differences(old, new, missing, facts["driver"])


def doctor_report(cfg: dict, root: str, log, global_a: list[str]) -> dict | None:
    """For `nvhook doctor`: None when no spec is installed at cdi.spec, else whether it is stale."""
    path = cfg["cdi"]["spec"]
    if not path or not os.path.exists(path):
        return None
    try:
        _, diffs = check(cfg, root, log, path, global_a)
    except HookError as e:
        return {"spec": path, "stale": True, "differences": [e.message]}
    return {"spec": path, "stale": bool(diffs), "differences": diffs}


def spec_hook_global_args(spec: dict) -> list[str]:
    """The --config/--root the spec's own hook was written with (between argv[0] and --cdi):
    a refresh keeps them, so the regenerated spec's hook reads what the old one read."""
    from ..decide import cdimodel as cdi

    for h in (spec.get("containerEdits") or {}).get("hooks") or []:
        args = h.get("args") or []
        if cdi.CAPS_OPTION in args:
            return [str(a) for a in args[1:args.index(cdi.CAPS_OPTION)]]
    return []


def driver_identity(root: str) -> list:
    """What changes when the driver is upgraded or reloaded, a GPU comes or goes, or MIG
    instances are made or destroyed: the kernel module's version line, the GPUs and MIG
    instances /proc/driver/nvidia lists, the loader cache the driver's installer rebuilds, and
    the files the nvhook-cdi.path unit watches (nvidia-smi, the control and uvm nodes, the MIG
    capability directory). A few reads and stats: cheap enough for nvhookd to look every few
    seconds."""
    from ..observe.host import procfs

    try:
        gpus = sorted(os.listdir(os.path.join(root, "proc/driver/nvidia/gpus")))
    except OSError:
        gpus = []
    files: list[list[int] | None] = []
    for rel in ("etc/ld.so.cache", "usr/bin/nvidia-smi", "dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-caps"):
        try:
            st = os.stat(os.path.join(root, rel))
            files.append([st.st_ino, st.st_size, st.st_mtime_ns, st.st_rdev])
        except OSError:
            files.append(None)
    return [procfs.driver_version(root), gpus, procfs.mig_instances(root), files]


def refresh(cfg: dict, root: str, log, path: str) -> dict | None:
    """Regenerate the nvhook spec at `path` from the host as it is now, with the options it was
    written with (capabilities, name strategies, hook path and arguments, format), when it no
    longer matches. None when there is no such file or nvhook did not write it (nothing is
    created or taken over); else {"changed": bool, "differences": [...], "devices": n}."""
    from ..apply import cdispec

    if not path or not os.path.isfile(path):
        return None
    _check_trusted(path)
    old = cdispec.read_spec(path)
    again = _regenerate(cfg, root, log, old, spec_hook_global_args(old))
    if again is None:
        return None
    new, diffs = again
    fmt = "yaml" if path.endswith((".yaml", ".yml")) else "json"
    changed = bool(diffs) and cdispec.write_atomic(path, cdispec.serialize(new, fmt))
    return {"changed": changed, "differences": diffs, "devices": len(new["devices"])}


def _check_trusted(path: str) -> None:
    """A refresh re-issues the old spec's hook (path and arguments) in a file root writes: only
    from a spec no one but root (or this user) could have written, a regular file, not a link,
    in a directory others cannot write (or sticky). HookError otherwise."""
    import stat

    why = None
    try:
        st = os.lstat(path)
        d = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise HookError(f"cannot read CDI spec {show(path)}: {e.strerror}") from None
    mine = (0, os.geteuid())
    if not stat.S_ISREG(st.st_mode):
        why = "it is a symbolic link"
    elif st.st_uid not in mine:
        why = f"it is owned by uid {st.st_uid}"
    elif st.st_mode & 0o022:
        why = f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    elif d.st_uid not in mine or (d.st_mode & 0o022 and not d.st_mode & stat.S_ISVTX):
        why = "its directory can be written by others"
    if why:
        raise HookError(f"CDI spec {show(path)} not regenerated: {why}, so its hook (path and arguments, "
                        "which a refresh keeps) may not be nvhook's; regenerate it with `nvhook cdi generate`")
