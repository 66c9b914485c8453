"""Every protobuf field nvhook's NRI plugin reads or writes, by name: NRI's API (containerd/nri
pkg/api/api.proto, package nri.pkg.api.v1alpha1) and ttrpc's envelope (Request, Response,
Status). One class per message, named as in the .proto, one attribute per field, named as in the
.proto (lower case where NRI spells it otherwise: `CDI_devices` is `cdi_devices`). No other
module of nvhook writes a field number: the decoders (base/nrimessages.py), the adjustment's
encoder (apply/nriadjust.py) and ttrpc (start/nri/ttrpc.py) name fields from here.

tests/test_nri_schema.py checks every name and number here against the descriptor protobuf's own
compiler makes of the .proto (tests/nri/nri_api.proto); a field the plugin does not use is not
listed (an unknown field is skipped on decode, as protobuf does).
"""

from __future__ import annotations


class TtrpcRequest:
    service = 1
    method = 2
    payload = 3
    timeout_nano = 4


class TtrpcResponse:
    status = 1
    payload = 2


class TtrpcStatus:
    code = 1
    message = 2


class RegisterPluginRequest:
    plugin_name = 1
    plugin_idx = 2


class ConfigureRequest:
    runtime_name = 2
    runtime_version = 3
    request_timeout = 5  # milliseconds; containerd 2.x sends it, 1.7 does not


class ConfigureResponse:
    events = 2  # the subscription: bit (Event - 1) per event


class SynchronizeRequest:
    pods = 1
    containers = 2


class CreateContainerRequest:
    pod = 1
    container = 2


class CreateContainerResponse:
    adjust = 1


class StateChangeEvent:
    event = 1
    pod = 2
    container = 3


class PodSandbox:
    id = 1
    name = 2
    namespace = 4
    annotations = 6
    runtime_handler = 7


class Container:
    id = 1
    pod_sandbox_id = 2
    name = 3
    state = 4
    annotations = 6
    env = 8
    mounts = 9
    linux = 11
    pid = 12


class Mount:
    destination = 1
    type = 2
    source = 3
    options = 4


class LinuxContainer:
    devices = 2


class LinuxDevice:
    path = 1
    type = 2
    major = 3
    minor = 4
    file_mode = 5
    uid = 6
    gid = 7


class OptionalValue:
    """OptionalInt, OptionalInt64, OptionalUInt32, OptionalFileMode: one field, `value`."""

    value = 1


class MapEntry:
    """A map<string, string> entry on the wire."""

    key = 1
    value = 2


class KeyValue:
    key = 1
    value = 2


class Hooks:
    create_container = 3


class Hook:
    path = 1
    args = 2
    env = 3


class ContainerAdjustment:
    mounts = 3
    env = 4
    hooks = 5
    linux = 6
    cdi_devices = 8


class CDIDevice:
    name = 1


class LinuxContainerAdjustment:
    devices = 1
    resources = 2


class LinuxResources:
    devices = 7


class LinuxDeviceCgroup:
    allow = 1
    type = 2
    major = 3
    minor = 4
    access = 5


# Every class above, by its .proto name (MapEntry is the wire form of a map, no message of its
# own; OptionalValue stands for each Optional* message).
MESSAGES = {cls.__name__: cls for cls in (
    TtrpcRequest, TtrpcResponse, TtrpcStatus, RegisterPluginRequest, ConfigureRequest, ConfigureResponse,
    SynchronizeRequest, CreateContainerRequest, CreateContainerResponse, StateChangeEvent, PodSandbox, Container,
    Mount, LinuxContainer, LinuxDevice, OptionalValue, MapEntry, KeyValue, Hooks, Hook, ContainerAdjustment,
    CDIDevice, LinuxContainerAdjustment, LinuxResources, LinuxDeviceCgroup)}


def fields(cls: type) -> dict[str, int]:
    """{field name: number} of one message class above."""
    return {k: v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, int)}


# api.Event values nvhook subscribes to (the subscription mask has bit (event - 1)).
EVENT_CREATE_CONTAINER = 4
EVENT_START_CONTAINER = 6  # a StateChangeEvent, after runc create and before the container's start
# api.ContainerState values Synchronize looks at.
CONTAINER_CREATED = 1
CONTAINER_RUNNING = 3
