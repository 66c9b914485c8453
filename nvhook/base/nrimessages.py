"""NRI's requests to a plugin, decoded once, at the edge, into typed objects: each handler of
the plugin gets a `CreateContainer`, a `StateChange`, a `Synchronize` or a `Configure` and
never sees a field number (those are base/nrischema.py's). Strings are decoded as UTF-8 with
replacement (an engine does not send anything else; a hostile pod's environment is still a
string); a field of the wrong wire type is a ProtobufError, which the plugin answers for that
request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import nrischema as s
from . import protobuf as pb


@dataclass
class Mount:
    destination: str
    source: str


@dataclass
class Device:
    path: str
    type: str
    major: int
    minor: int


@dataclass
class Pod:
    id: str = ""
    name: str = ""
    namespace: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    runtime_handler: str = ""


@dataclass
class Container:
    """An NRI Container. `env` is the process environment as a dict (a later duplicate wins;
    an entry without `=` or with an empty name is dropped, as the loader drops it)."""

    id: str = ""
    pod_sandbox_id: str = ""
    name: str = ""
    state: int = 0
    annotations: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    pid: int = 0

    def mount_dicts(self) -> list[dict]:
        """The mounts in the shape the request rules read (observe.oci.load_bundle's)."""
        return [{"destination": m.destination, "source": m.source} for m in self.mounts]

    def device_dicts(self) -> list[dict]:
        return [{"path": d.path, "type": d.type, "major": d.major, "minor": d.minor} for d in self.devices]

    def destinations(self) -> set[str]:
        return {m.destination for m in self.mounts}


@dataclass
class Configure:
    runtime_name: str
    runtime_version: str
    request_timeout_ms: int  # 0: not sent (containerd 1.7)


@dataclass
class CreateContainer:
    pod: Pod
    container: Container


@dataclass
class StateChange:
    event: int
    pod: Pod
    container: Container


@dataclass
class Synchronize:
    pods: list[Pod]
    containers: list[Container]


def _pod(m: dict) -> Pod:
    f = s.PodSandbox
    return Pod(id=pb.string(m, f.id), name=pb.string(m, f.name), namespace=pb.string(m, f.namespace),
               annotations=string_map(m, f.annotations), runtime_handler=pb.string(m, f.runtime_handler))


def _container(m: dict) -> Container:
    f = s.Container
    env: dict[str, str] = {}
    for item in pb.strings(m, f.env):
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    mounts = [Mount(pb.string(x, s.Mount.destination), pb.string(x, s.Mount.source)) for x in pb.messages(m, f.mounts)]
    d = s.LinuxDevice
    devices = [Device(pb.string(x, d.path), pb.string(x, d.type), pb.integer(x, d.major), pb.integer(x, d.minor))
               for x in pb.messages(pb.message(m, f.linux), s.LinuxContainer.devices)]
    return Container(id=pb.string(m, f.id), pod_sandbox_id=pb.string(m, f.pod_sandbox_id), name=pb.string(m, f.name),
                     state=pb.integer(m, f.state), annotations=string_map(m, f.annotations), env=env, mounts=mounts,
                     devices=devices, pid=pb.integer(m, f.pid))


def string_map(m: dict, num: int) -> dict[str, str]:
    """map<string, string>: repeated entries {key, value}."""
    out = {}
    for entry in pb.messages(m, num):
        out[pb.string(entry, s.MapEntry.key)] = pb.string(entry, s.MapEntry.value)
    return out


def configure(payload: bytes) -> Configure:
    m = pb.decode(payload)
    f = s.ConfigureRequest
    return Configure(pb.string(m, f.runtime_name), pb.string(m, f.runtime_version), pb.integer(m, f.request_timeout))


def create_container(payload: bytes) -> CreateContainer:
    m = pb.decode(payload)
    f = s.CreateContainerRequest
    return CreateContainer(_pod(pb.message(m, f.pod)), _container(pb.message(m, f.container)))


def state_change(payload: bytes) -> StateChange:
    m = pb.decode(payload)
    f = s.StateChangeEvent
    return StateChange(pb.integer(m, f.event), _pod(pb.message(m, f.pod)), _container(pb.message(m, f.container)))


def synchronize(payload: bytes) -> Synchronize:
    m = pb.decode(payload)
    f = s.SynchronizeRequest
    return Synchronize([_pod(p) for p in pb.messages(m, f.pods)], [_container(c) for c in pb.messages(m, f.containers)])


def register_plugin(name: str, index: str) -> bytes:
    out = bytearray()
    pb.put_string(out, s.RegisterPluginRequest.plugin_name, name)
    pb.put_string(out, s.RegisterPluginRequest.plugin_idx, index)
    return bytes(out)


def configure_response(events: int) -> bytes:
    out = bytearray()
    pb.put_varint(out, s.ConfigureResponse.events, events)
    return bytes(out)
