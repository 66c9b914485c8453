"""Observe the container: the OCI state on stdin and the bundle's config.json."""

from __future__ import annotations

import os

from ..base import jsonfast as json
from ..base.errors import HookError, short, show

CAP_SYS_ADMIN = "CAP_SYS_ADMIN"


def load_json(text: bytes | str, what: str) -> dict:
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
    state = load_json(text, "OCI state on stdin")
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
    spec = load_json(raw, f"bundle config {show(path)}")
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


def _is_mount_point(path: str) -> bool:
    """A directory (not a link) on another filesystem than its parent: what a runtime's mount
    of /proc, /dev or /sys there looks like, which no image content can imitate."""
    import stat

    try:
        st = os.lstat(path)
        parent = os.lstat(os.path.dirname(path))
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_dev != parent.st_dev


def foreign_mount_namespace(rootfs: str, mounts: list[dict]) -> str | None:
    """Why this process (a createContainer hook) is not known to run in the container's own
    mount namespace, or None when it is. The positive sign: the runtime's mounts for this
    container (config.json's mounts: /proc, /dev, /sys) are mounted under its rootfs here. The
    runtime makes them in the container's new mount namespace, before pivot_root and before
    this hook, and they are never seen from the host's namespace (or any other). Absent that
    sign, the hook refuses: mounting onto the rootfs path from any other namespace would put
    the driver's files onto the host's view of it, or nowhere the container sees."""
    from ..base.rootpath import join, resolve

    here = []
    for m in mounts:
        dest = os.path.normpath("/" + m["destination"].lstrip("/"))  # not "//proc": POSIX keeps two
        # Only a path with no link on it: an image's link (a -> /) must not make the host's
        # own /proc pass for the container's.
        if dest != "/" and resolve(rootfs, dest) == dest and _is_mount_point(join(rootfs, dest)):
            here.append(dest)
            break
    if not here:
        named = ", ".join(sorted({m["destination"] for m in mounts})[:3]) or "none in config.json"
        return (f"none of the container's mounts ({named}) is mounted under its rootfs {show(rootfs)} here, "
                "so this is not the container's mount namespace")
    try:  # and never the namespace of the host's init, where that can be read
        if os.stat("/proc/self/ns/mnt").st_ino == os.stat("/proc/1/ns/mnt").st_ino:
            return "it is the mount namespace of the host's init (pid 1)"
    except OSError:
        pass
    return None

