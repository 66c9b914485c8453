"""Observe the container: the OCI state on stdin and the bundle's config.json."""

from __future__ import annotations

import os

from ..base import jsonfast as json
from ..base.errors import HookError, short, show

CAP_SYS_ADMIN = "CAP_SYS_ADMIN"


def _load_json(text: bytes | str, what: str) -> dict:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HookError(f"malformed {what}: {e}") from None
    if not isinstance(data, dict):
        raise HookError(f"malformed {what}: expected a JSON object, got {type(data).__name__}")
    return data


def is_privileged(caps: object) -> bool:
    """CAP_SYS_ADMIN in the bounding set: the container was started privileged. Runtime specs
    before 1.0.0-rc5 listed process.capabilities as one plain array (no sets); NVIDIA's hook
    reads that form for those versions, nvhook whatever the version says."""
    if isinstance(caps, list):
        return CAP_SYS_ADMIN in caps
    bounding = caps.get("bounding") if isinstance(caps, dict) else None
    return isinstance(bounding, list) and CAP_SYS_ADMIN in bounding


def parse_state(text: bytes | str) -> dict:
    """The fields nvhook uses from the OCI state: id, pid, bundle (crun's `root`, old `bundlePath`)."""
    if not text or not text.strip():
        raise HookError("no OCI state on stdin (nvhook runs as a prestart hook; use --dry-run --bundle DIR to try "
                        "it by hand)")
    state = _load_json(text, "OCI state on stdin")
    bundle = state.get("bundle") or state.get("bundlePath") or state.get("root")
    if not isinstance(bundle, str) or not bundle:
        raise HookError("malformed OCI state on stdin: no bundle path (keys bundle/bundlePath/root)")
    pid = state.get("pid")
    if pid == 0 and not isinstance(pid, bool):
        pid = None  # crun's state for createContainer hooks: no pid (the hook runs in the container)
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0):
        raise HookError(f"malformed OCI state on stdin: pid must be a positive integer, got {short(pid)}")
    cid = state.get("id", "")
    if not isinstance(cid, str):
        raise HookError(f"malformed OCI state on stdin: id must be a string, got {short(cid)}")
    return {"id": cid, "pid": pid, "bundle": bundle, "annotations": state.get("annotations") or {}}


def state_for_bundle(bundle: str) -> dict:
    """A state for --dry-run --bundle: no process yet."""
    return {"id": os.path.basename(os.path.abspath(bundle)), "pid": None, "bundle": bundle, "annotations": {}}


def load_bundle(bundle: str) -> dict:
    """config.json facts: env (last duplicate wins), rootfs (absolute), mounts, privileged."""
    path = os.path.join(bundle, "config.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise HookError(f"cannot read bundle config {show(path)}: {e.strerror}") from None
    except ValueError:  # a NUL in the bundle path
        raise HookError(f"cannot read bundle config {show(path)}: the path contains a NUL byte") from None
    spec = _load_json(raw, f"bundle config {show(path)}")
    path = show(path)

    root = spec.get("root")
    if not isinstance(root, dict) or not isinstance(root.get("path"), str) or not root["path"]:
        raise HookError(f"malformed bundle config {path}: root.path is missing")
    rootfs = os.path.normpath(os.path.join(os.path.abspath(bundle), root["path"]))
    if not os.path.isdir(rootfs):
        raise HookError(f"container rootfs {show(rootfs)} (root.path in {path}) is not a directory")

    process = spec.get("process") or {}
    if not isinstance(process, dict):
        raise HookError(f"malformed bundle config {path}: process must be an object")
    env_list = process.get("env") or []
    if not isinstance(env_list, list):
        raise HookError(f"malformed bundle config {path}: process.env must be a list")
    env: dict[str, str] = {}
    for item in env_list:
        if not isinstance(item, str):
            raise HookError(f"malformed bundle config {path}: process.env entry {short(item)} is not a string")
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value  # last duplicate wins, as in execve's consumers

    privileged = is_privileged(process.get("capabilities"))

    mounts = spec.get("mounts") or []
    if not isinstance(mounts, list):
        raise HookError(f"malformed bundle config {path}: mounts must be a list")
    destinations = []
    for m in mounts:
        if isinstance(m, dict) and isinstance(m.get("destination"), str):
            destinations.append({"destination": m["destination"], "source": m.get("source")})

    return {"config_path": path, "rootfs": rootfs, "env": env, "privileged": privileged,
            "mounts": destinations, "annotations": spec.get("annotations") or {},
            "devices": _linux_devices(spec, path)}


def _linux_devices(spec: dict, path: str) -> list[dict]:
    """linux.devices: the nodes the runtime creates (a CDI container's GPUs are read from here)."""
    linux = spec.get("linux") or {}
    devices = linux.get("devices") if isinstance(linux, dict) else None
    if devices is None:
        return []
    if not isinstance(devices, list):
        raise HookError(f"malformed bundle config {path}: linux.devices must be a list")
    out = []
    for d in devices:
        if not isinstance(d, dict):
            raise HookError(f"malformed bundle config {path}: linux.devices entry {short(d)} is not an object")
        major, minor = d.get("major"), d.get("minor")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (major, minor)):
            continue  # no numbers (a device the runtime stats itself): nothing to match
        out.append({"path": d.get("path"), "type": d.get("type"), "major": major, "minor": minor})
    return out
