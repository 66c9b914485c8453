"""Container edits (nvhook.decide.edits) written into an OCI bundle's config.json, for
nvhook-runtime: the runtime then makes the device nodes, their cgroup rules and the driver
binds itself, and nvhook's hook (registered here) does what must happen inside the container.

Only what nvhook owns changes: entries are appended to `mounts`, `linux.devices`,
`linux.resources.devices` and one hook list; every other value keeps its place and order, and
the file is written back in the style it was read in (indentation, separators, a final
newline, non-ASCII left as is or escaped), so a diff of the two files shows only additions
(and the comma before each). The file is replaced atomically in the bundle directory.
"""

from __future__ import annotations

import os

from ..base.errors import HookError
from ..base.files import replace_file

# Hooks that inject the driver themselves: nvhook under any name it is installed as, and
# NVIDIA's hook (which Docker's --gpus adds as nvidia-container-runtime-hook). Left beside
# the spec edits they would inject everything a second time.
INJECTING_HOOKS = ("nvhook", "nvidia-container-runtime-hook", "nvidia-container-toolkit")
HOOK_STAGES = ("prestart", "createRuntime")


def is_injecting_hook(hook, own_hook_path: str) -> bool:
    """Whether `hook` is one that injects the driver: named like one, or nvhook's own launcher
    (also when registered as its interpreter with flags: base.launch)."""
    from ..base.launch import names_launcher

    if not isinstance(hook, dict) or not isinstance(hook.get("path"), str):
        return False
    args = hook.get("args")
    path = names_launcher(hook["path"], args if isinstance(args, list) else [])
    if os.path.basename(path) in INJECTING_HOOKS:
        return True
    try:
        return os.path.realpath(path) == os.path.realpath(own_hook_path)
    except (OSError, ValueError):
        return False


def _obj(parent: dict, key: str, where: str) -> dict:
    value = parent.get(key)
    if value is None:
        value = parent[key] = {}
    if not isinstance(value, dict):
        raise HookError(f"malformed bundle config: {where} must be an object")
    return value


def _list(parent: dict, key: str, where: str) -> list:
    value = parent.get(key)
    if value is None:
        value = parent[key] = []
    if not isinstance(value, list):
        raise HookError(f"malformed bundle config: {where} must be a list")
    return value


def add_edits(spec: dict, edits: dict, mounts: list[dict], hook: dict, own_launcher: str | None = None) -> dict:
    """Append `edits`' device nodes and cgroup rules, `mounts` (binds from edits) and `hook` to
    `spec` (changed in place). Returns what was added, for the log.

    A destination the spec already mounts, or a device path it already lists, is left to the
    spec (the user's own `-v` or `--device` wins, and nothing is listed twice). An injecting
    hook already in the spec (Docker's `--gpus` adds one) is replaced by `hook` at its place;
    further ones are removed; without one, `hook` is appended to prestart."""
    linux = _obj(spec, "linux", "linux")
    devices = _list(linux, "devices", "linux.devices")
    have_dev = {d.get("path") for d in devices if isinstance(d, dict)}
    added_devices: list[str] = []
    added_mounts: list[str] = []
    n_rules = 0
    for n in edits["device_nodes"]:
        if n["path"] in have_dev:
            continue
        entry = {"path": n["path"], "type": n["type"], "major": n["major"], "minor": n["minor"]}
        if n.get("file_mode") is not None:
            entry["fileMode"] = n["file_mode"]
        if n.get("uid") is not None:
            entry["uid"] = n["uid"]
        if n.get("gid") is not None:
            entry["gid"] = n["gid"]
        devices.append(entry)
        have_dev.add(n["path"])
        added_devices.append(n["path"])

    added_gids = _add_groups(spec, [n for n in edits["device_nodes"] if n["path"] in added_devices])

    rules = _list(_obj(linux, "resources", "linux.resources"), "devices", "linux.resources.devices")
    for r in edits["cgroup_devices"]:
        rule = {"allow": True, "type": r["type"], "major": r["major"], "minor": r["minor"], "access": r["access"]}
        # Appended: runtimes apply the list in order, so these come after a leading deny-all.
        if rule not in rules:
            rules.append(rule)
            n_rules += 1

    spec_mounts = _list(spec, "mounts", "mounts")
    have_dest = {m.get("destination") for m in spec_mounts if isinstance(m, dict)}
    for m in mounts:
        if m["container_path"] in have_dest:
            continue
        spec_mounts.append({"destination": m["container_path"], "type": "bind", "source": m["host_path"],
                            "options": list(m["options"])})
        have_dest.add(m["container_path"])
        added_mounts.append(m["container_path"])

    hooks = _obj(spec, "hooks", "hooks")
    placed = False
    how = ""
    for stage in HOOK_STAGES:
        entries = hooks.get(stage)
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise HookError(f"malformed bundle config: hooks.{stage} must be a list")
        kept = []
        for h in entries:
            if is_injecting_hook(h, own_launcher or hook["path"]):
                if not placed:
                    args = hook["args"]
                    kept.append(dict(hook, args=[*args[:-1], stage]) if args[-1] in HOOK_STAGES else hook)
                    placed = True
                    how = f"replaced {h.get('path')} in {stage}"
                continue
            kept.append(h)
        entries[:] = kept
    if not placed:
        _list(hooks, "prestart", "hooks.prestart").append(hook)
        how = "added to prestart"
    out = {"devices": added_devices, "mounts": added_mounts, "cgroup_rules": n_rules, "hook": how}
    if added_gids:
        out["additional_gids"] = added_gids
    return out


def _add_groups(spec: dict, nodes: list[dict]) -> list[int]:
    """process.user.additionalGids gets the group of each added node that a non-root process
    could not open otherwise (not world-read-writable, group not root's, not already one of the
    process's groups): what CDI 0.7's additionalGids does, for a container that runs as a user.
    A root process needs none and gets none."""
    process = spec.get("process")
    user = process.get("user") if isinstance(process, dict) else None
    if not isinstance(user, dict) or not user.get("uid"):
        return []
    have = user.get("additionalGids")
    if have is None:
        have = []
    if not isinstance(have, list):
        raise HookError("malformed bundle config: process.user.additionalGids must be a list")
    added: list[int] = []
    for n in nodes:
        mode, gid = n.get("file_mode"), n.get("gid")
        if mode is None or not gid or (mode & 0o006) == 0o006 or gid == user.get("gid") or gid in have:
            continue
        have.append(gid)
        added.append(gid)
    if added:
        user["additionalGids"] = have
    return added


# -- reading and writing config.json in its own style ---------------------------------------

def read(dir_fd: int, name: str = "config.json") -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise HookError(f"cannot read bundle config {name}: {e.strerror}") from None
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def style(raw: bytes) -> dict:
    """How `raw` was written, as json.dumps arguments (Go's encoder, runc spec, python)."""
    text = raw.decode("utf-8", "replace")
    body = text.strip()
    out: dict = {"ensure_ascii": all(c < 0x80 for c in raw), "final_newline": text.endswith("\n")}
    nl = body.find("\n")
    if nl < 0:
        out["indent"] = None
        compact = '":' in body and '": ' not in body
        out["separators"] = (",", ":") if compact else (", ", ": ")
        return out
    line = body[nl + 1:].split("\n", 1)[0]
    out["indent"] = line[:len(line) - len(line.lstrip(" \t"))] or None
    out["separators"] = (",", ": ") if '": ' in body else (",", ":")
    return out


def serialize(spec: dict, how: dict) -> bytes:
    import json  # only for a container that gets the driver: indent and ensure_ascii=False

    text = json.dumps(spec, indent=how["indent"], separators=how["separators"], ensure_ascii=how["ensure_ascii"])
    return (text + ("\n" if how["final_newline"] else "")).encode("utf-8")


def write_atomic(dir_fd: int, data: bytes, name: str = "config.json") -> None:
    """Replace `name` in the bundle directory with `data` (replace_file); the old file's mode
    is kept."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        raise HookError(f"cannot write bundle config {name}: {e.strerror}") from None
    replace_file(dir_fd, name, data, st.st_mode & 0o777, "bundle config")
