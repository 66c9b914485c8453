"""What a front door hands to `nvhook.start.pipeline.decide(source, host, options)`, and what
comes back: one model for every door.

The source, one of:
- `OciBundle`: a container the runtime is starting, its OCI state (hook mode, nvhookd's child,
  nvhook-runtime, `--dry-run`, `doctor --bundle`); the bundle's config.json is read by decide;
- `NriContainer`: a container as the NRI plugin got it from containerd or CRI-O, before there
  is a bundle (its environment, mounts, annotations and device nodes, already decoded);
- `CdiDevices`: a container whose GPUs a CDI spec of nvhook's gave it (nvhook's CDI hook,
  `nvhook --cdi CAPS`): its devices are the NVIDIA nodes the runtime wrote into the bundle's
  linux.devices, its capabilities the spec's.

`Host`: where the facts come from and where the decisions are written (host root, config,
event log). `Options`: what the caller allows (changing the host: making device nodes) and
the two moments it wants to hear of. `Decision`: the plan, the facts it was made from, and
the phase timings.

Plain slotted classes, not dataclasses: the container-start path imports neither `typing`
nor `dataclasses` (several milliseconds of every start); the classes cost nothing to load.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Callable

    from ..base.log import EventLog
    from .types import Plan


class OciBundle:
    """A container the runtime is starting: the OCI state's id, pid (None before the process
    exists: --dry-run, nvhook-runtime's `create`) and bundle directory."""

    __slots__ = ("id", "pid", "bundle")
    kind = "oci"

    def __init__(self, id: str, pid: int | None, bundle: str) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle

    @classmethod
    def from_state(cls, state: dict) -> OciBundle:
        """From observe.oci.parse_state's (or state_for_bundle's) dict."""
        return cls(state["id"], state["pid"], state["bundle"])


class NriContainer:
    """A container as an NRI CreateContainer (or StartContainer) request describes it, before
    any bundle exists. The engine does not tell a plugin the container's capabilities, so it
    counts as unprivileged unless `privileged` says otherwise.

    `env`: the process environment (last duplicate wins); `mounts`: {"destination", "source"}
    per mount; `annotations`: the container's; `devices`: {"path", "type", "major", "minor"}
    per linux device. `rootfs`: a path that reads the container's root (the plugin's
    /proc/self/fd/N at StartContainer), or None where it cannot be read yet (CreateContainer):
    the plan is then for any image, the libraries in their host directories, as a CDI spec's.
    `request`: the container's request (decide.request.parse of these facts) where the caller
    parsed it already (the plugin, to answer a container that asks for no GPU at once), so that
    it is parsed once per event."""

    __slots__ = ("id", "pid", "env", "mounts", "annotations", "devices", "rootfs", "privileged", "request")
    kind = "nri"

    def __init__(self, id: str, env: dict[str, str], mounts: list[dict], annotations: dict[str, str],
                 devices: list[dict], rootfs: str | None = None, pid: int | None = None,
                 privileged: bool = False, request: dict | None = None) -> None:
        self.id = id
        self.pid = pid
        self.request = request
        self.env = env
        self.mounts = mounts
        self.annotations = annotations
        self.devices = devices
        self.rootfs = rootfs
        self.privileged = privileged

    def bundle_facts(self) -> dict:
        """The container in the shape observe.oci.load_bundle gives a bundle's config.json."""
        return {"config_path": f"NRI container {self.id}", "rootfs": self.rootfs, "env": self.env,
                "privileged": self.privileged, "mounts": self.mounts, "annotations": self.annotations,
                "devices": self.devices}


class CdiDevices:
    """A container that a CDI spec of nvhook's gave GPUs (its createContainer hook): `bundle`
    is the container (its linux.devices name the device nodes the runtime made from the
    spec), `capabilities` the spec's (the hook's `--cdi` argument). NVIDIA_VISIBLE_DEVICES and
    NVIDIA_DRIVER_CAPABILITIES are not read: void in such a container."""

    __slots__ = ("bundle", "capabilities")
    kind = "cdi"

    def __init__(self, bundle: OciBundle, capabilities: str) -> None:
        self.bundle = bundle
        self.capabilities = capabilities

    @property
    def id(self) -> str:
        return self.bundle.id


class Host:
    """The host the decision is made on: its root (files, /proc and /dev are read under it),
    nvhook's config, and the event log every decision is written to."""

    __slots__ = ("root", "config", "log")

    def __init__(self, root: str, config: dict, log: EventLog) -> None:
        self.root = root
        self.config = config
        self.log = log


class Options:
    """What the caller allows and wants to hear.

    `change_host`: False for --dry-run and doctor: nothing on the host is changed, so the
    device nodes `devices.create_missing_nodes` would make are neither made nor planned.
    `on_gpu_request()`: called once the request is known to need the driver, before the host
    is observed (the hook starts its apply worker there, so the worker's imports overlap the
    decision). `before_change()`: called before the first change to the host (nvhookd's gate:
    nothing changes for a client that left before `go`). `phases`: the caller's timings dict,
    which the decision's own (Decision.phases) are written into as it goes, so that a refused
    start's event still carries the phases timed before the refusal."""

    __slots__ = ("change_host", "on_gpu_request", "before_change", "phases")

    def __init__(self, change_host: bool = True, on_gpu_request: Callable[[], None] | None = None,
                 before_change: Callable[[], None] | None = None, phases: dict | None = None) -> None:
        self.change_host = change_host
        self.on_gpu_request = on_gpu_request
        self.before_change = before_change
        self.phases = phases


class Decision:
    """What decide gives back. `plan`: the plan (decide/types.py Plan; unset where the
    decision was refused: pipeline.explain). `facts`: what it was
    decided from, filled as it goes: "bundle" (load_bundle's shape), "request", "inventory",
    "capabilities", "selected" (GPUs), "mode", "compat", "image"; a container that asks for no
    GPU has only the first two. `phases`: timings in ms ("discover_ms", "decide_ms")."""

    __slots__ = ("plan", "facts", "phases")
    plan: Plan  # set once decided

    def __init__(self, phases: dict | None = None) -> None:
        self.facts: dict = {}
        self.phases: dict = {} if phases is None else phases


if TYPE_CHECKING:
    from typing import Union

    Source = Union[OciBundle, NriContainer, CdiDevices]
