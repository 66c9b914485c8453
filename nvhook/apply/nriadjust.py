"""Container edits (nvhook.decide.edits) serialised as an NRI ContainerAdjustment, the answer an
NRI plugin gives to CreateContainer: the engine folds it into the container's OCI spec before
the runtime sees it, so the runtime makes the device nodes, their cgroup rules and the binds
itself, exactly as with nvhook-runtime's config.json (apply/ocispec.py) or a CDI spec.

Encoded by hand (base/protobuf.py says why), every field named in base/nrischema.py.
"""

from __future__ import annotations

from ..base import nrischema as s
from ..base import protobuf as pb


def _optional(n: int) -> bytes:
    """NRI's Optional{Int,Int64,UInt32,FileMode}: a message holding the value."""
    out = bytearray()
    pb.put_varint(out, s.OptionalValue.value, n)
    return bytes(out)


def _device(n: dict) -> bytes:
    f = s.LinuxDevice
    out = bytearray()
    pb.put_string(out, f.path, n["path"])
    pb.put_string(out, f.type, n["type"])
    pb.put_varint(out, f.major, int(n["major"]))
    pb.put_varint(out, f.minor, int(n["minor"]))
    if n.get("file_mode") is not None:
        pb.put_message(out, f.file_mode, _optional(int(n["file_mode"]) & 0o7777))
    for num, key in ((f.uid, "uid"), (f.gid, "gid")):
        if n.get(key) is not None:
            pb.put_message(out, num, _optional(int(n[key])))
    return bytes(out)


def _rule(r: dict) -> bytes:
    f = s.LinuxDeviceCgroup
    out = bytearray()
    pb.put_bool(out, f.allow, bool(r["allow"]))
    pb.put_string(out, f.type, r["type"])
    if r.get("major") is not None:
        pb.put_message(out, f.major, _optional(int(r["major"])))
    if r.get("minor") is not None:
        pb.put_message(out, f.minor, _optional(int(r["minor"])))
    pb.put_string(out, f.access, r["access"])
    return bytes(out)


def _mount(destination: str, source: str, options: list[str]) -> bytes:
    f = s.Mount
    out = bytearray()
    pb.put_string(out, f.destination, destination)
    pb.put_string(out, f.type, "bind")
    pb.put_string(out, f.source, source)
    pb.put_strings(out, f.options, options)
    return bytes(out)


def _hooks(hook: dict) -> bytes:
    h = bytearray()
    pb.put_string(h, s.Hook.path, hook["path"])
    pb.put_strings(h, s.Hook.args, hook["args"])
    pb.put_strings(h, s.Hook.env, hook.get("env") or ())
    hooks = bytearray()
    pb.put_message(hooks, s.Hooks.create_container, bytes(h))  # where a CDI spec puts it
    return bytes(hooks)


def adjustment(edits: dict, mounts: list[dict], hook: dict | None, cdi_devices: tuple | list = ()) -> bytes:
    """The ContainerAdjustment for `edits`: every device node (path, type, numbers, mode, owner)
    and cgroup rule, the binds in `mounts` (read-only, as decided), the environment, `hook`
    when in-container work remains, and the CDI devices named (the engine resolves them)."""
    f = s.ContainerAdjustment
    out = bytearray()
    for m in mounts:
        pb.put_message(out, f.mounts, _mount(m["container_path"], m["host_path"], list(m["options"])))
    for item in edits["env"]:
        key, _, value = item.partition("=")
        kv = bytearray()
        pb.put_string(kv, s.KeyValue.key, key)
        pb.put_string(kv, s.KeyValue.value, value)
        pb.put_message(out, f.env, bytes(kv))
    if hook is not None:
        pb.put_message(out, f.hooks, _hooks(hook))
    linux = bytearray()
    for n in edits["device_nodes"]:
        pb.put_message(linux, s.LinuxContainerAdjustment.devices, _device(n))
    if edits["cgroup_devices"]:
        res = bytearray()
        for r in edits["cgroup_devices"]:
            pb.put_message(res, s.LinuxResources.devices, _rule(r))
        pb.put_message(linux, s.LinuxContainerAdjustment.resources, bytes(res))
    if linux:
        pb.put_message(out, f.linux, bytes(linux))
    for name in cdi_devices:
        dev = bytearray()
        pb.put_string(dev, s.CDIDevice.name, name)
        pb.put_message(out, f.cdi_devices, bytes(dev))
    return bytes(out)


def create_response(adjust: bytes) -> bytes:
    """CreateContainerResponse: the adjustment, or nothing at all (the container as made)."""
    out = bytearray()
    if adjust:
        pb.put_message(out, s.CreateContainerResponse.adjust, adjust)
    return bytes(out)
