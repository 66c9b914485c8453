"""Container edits (nvhook.decide.edits) serialised as an NRI ContainerAdjustment, the answer an
NRI plugin gives to CreateContainer: the engine folds it into the container's OCI spec before
the runtime sees it, so the runtime makes the device nodes, their cgroup rules and the binds
itself, exactly as with nvhook-runtime's config.json (apply/ocispec.py) or a CDI spec.

Encoded by hand (start/nri/pb.py says why); field numbers are those of NRI's
pkg/api/api.proto:
  ContainerAdjustment {3 mounts: Mount, 4 env: KeyValue, 5 hooks: Hooks, 6 linux}
  Mount {1 destination, 2 type, 3 source, 4 options}     KeyValue {1 key, 2 value}
  Hooks {1 prestart: Hook}    Hook {1 path, 2 args, 3 env}
  LinuxContainerAdjustment {1 devices: LinuxDevice, 2 resources: LinuxResources}
  LinuxDevice {1 path, 2 type, 3 major, 4 minor, 5 file_mode, 6 uid, 7 gid (wrapped)}
  LinuxResources {7 devices: LinuxDeviceCgroup}
  LinuxDeviceCgroup {1 allow, 2 type, 3 major, 4 minor (wrapped), 5 access}
"""

from __future__ import annotations

from ..base import protobuf as pb


def _device(n: dict) -> bytes:
    out = bytearray()
    pb.put_string(out, 1, n["path"])
    pb.put_string(out, 2, n["type"])
    pb.put_varint(out, 3, int(n["major"]))
    pb.put_varint(out, 4, int(n["minor"]))
    for num, key in ((5, "file_mode"), (6, "uid"), (7, "gid")):
        if n.get(key) is not None:
            pb.put_message(out, num, pb.wrapped_int(int(n[key]) & 0o7777 if key == "file_mode" else int(n[key])))
    return bytes(out)


def _rule(r: dict) -> bytes:
    out = bytearray()
    pb.put_bool(out, 1, bool(r["allow"]))
    pb.put_string(out, 2, r["type"])
    if r.get("major") is not None:
        pb.put_message(out, 3, pb.wrapped_int(int(r["major"])))
    if r.get("minor") is not None:
        pb.put_message(out, 4, pb.wrapped_int(int(r["minor"])))
    pb.put_string(out, 5, r["access"])
    return bytes(out)


def _mount(destination: str, source: str, options: list[str]) -> bytes:
    out = bytearray()
    pb.put_string(out, 1, destination)
    pb.put_string(out, 2, "bind")
    pb.put_string(out, 3, source)
    for o in options:
        pb.put_string(out, 4, o)
    return bytes(out)


def _hook(hook: dict) -> bytes:
    h = bytearray()
    pb.put_string(h, 1, hook["path"])
    for a in hook["args"]:
        pb.put_string(h, 2, a)
    for e in hook.get("env") or ():
        pb.put_string(h, 3, e)
    hooks = bytearray()
    pb.put_message(hooks, 3, bytes(h))  # create_container: where a CDI spec puts it
    return bytes(hooks)


def adjustment(edits: dict, mounts: list[dict], hook: dict | None) -> bytes:
    """The ContainerAdjustment for `edits`: every device node (path, type, numbers, mode, owner)
    and cgroup rule, the binds in `mounts` (read-only, as decided), the environment, and `hook`
    when in-container work remains."""
    out = bytearray()
    for m in mounts:
        pb.put_message(out, 3, _mount(m["container_path"], m["host_path"], list(m["options"])))
    for item in edits["env"]:
        key, _, value = item.partition("=")
        kv = bytearray()
        pb.put_string(kv, 1, key)
        pb.put_string(kv, 2, value)
        pb.put_message(out, 4, bytes(kv))
    if hook is not None:
        pb.put_message(out, 5, _hook(hook))
    linux = bytearray()
    for n in edits["device_nodes"]:
        pb.put_message(linux, 1, _device(n))
    if edits["cgroup_devices"]:
        res = bytearray()
        for r in edits["cgroup_devices"]:
            pb.put_message(res, 7, _rule(r))
        pb.put_message(linux, 2, bytes(res))
    if linux:
        pb.put_message(out, 6, bytes(linux))
    return bytes(out)


def create_response(adjust: bytes) -> bytes:
    """CreateContainerResponse {1 adjust}."""
    out = bytearray()
    if adjust:
        pb.put_message(out, 1, adjust)
    return bytes(out)
