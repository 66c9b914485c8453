"""The plan's types, for readers and for mypy; the plan itself stays plain dicts and lists.

Why TypedDicts and not dataclasses: the plan may cross a pipe to a forked apply worker
(marshal) and is printed by --dry-run as JSON, both of which take dicts as they are; and the container-start
path must not import `typing` (~2 ms). So modules name these types only for the checker:

    TYPE_CHECKING = False
    if TYPE_CHECKING:
        from ..decide.types import Plan

(mypy treats any name TYPE_CHECKING as true; at run time the import never happens.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict

if TYPE_CHECKING:  # typing's own is 3.11's; here annotations are strings, never evaluated
    from typing_extensions import NotRequired

MountKind = Literal["library", "library32", "binary", "device", "ipc", "firmware", "procfs", "tmpfs", "compat"]


class Node(TypedDict):
    """The host node a device mount stands for, as observed this run."""
    major: int
    minor: int
    mode: int
    uid: int
    gid: int


class Mount(TypedDict):
    kind: MountKind
    source: str            # on this machine, host root joined in ("tmpfs" for the tmpfs)
    target: str            # inside the container
    options: list[str]     # ro, nosuid, nodev, noexec, mode=, and the apply-only copy, set:K=V
    node: NotRequired[Node]


class Symlink(TypedDict):
    path: str
    target: str


class CgroupRule(TypedDict):
    type: Literal["c", "b"]
    major: int
    minor: int
    access: str


class Container(TypedDict):
    id: str
    pid: int | None
    rootfs: str
    # The CDI createContainer hook runs in the container's mount namespace on purpose (and has
    # checked that it is not the host's init's): the apply step's refusal of a container that
    # shares nvhook's own mount namespace does not apply to it.
    own_mount_namespace: NotRequired[bool]


class RequestSummary(TypedDict):
    devices: list[str]
    capabilities: list[str]
    requirements: list[str]


class Driver(TypedDict):
    version: str | None
    cuda: str | None


class Gpu(TypedDict):
    index: int
    minor: int
    uuid: str | None
    bus_id: str
    model: str | None
    brand: str | None
    brand_source: Literal["nvml", "guessed"]  # guessed: from the procfs model name, NVML not asked


class Compat(TypedDict):
    decision: Literal["host", "image", "none"]
    reason: str
    libraries: list[str]


class LdCache(TypedDict):
    binary: str
    directories: list[str]


CgroupModeName = Literal["v1", "v2", "none"]


class CgroupMode(TypedDict):
    """Not decided: the pipeline adds the mode the apply step will act in (--dry-run shows it)."""
    mode: CgroupModeName
    action: str


class Plan(TypedDict):
    container: Container
    request: RequestSummary
    driver: Driver
    gpus: list[Gpu]
    mounts: list[Mount]
    symlinks: list[Symlink]
    devices_cgroup: list[CgroupRule]
    compat: Compat
    ldconfig: LdCache | None
    cgroup: NotRequired[CgroupMode]
    # The driver application profile's content, for a container that asked for graphics or
    # display and got GPU nodes (decide/appprofile.py; written by apply/profilefile.py)
    app_profile: NotRequired[str]


class Request(TypedDict):
    """decide.request.parse's answer: what the container asked for."""
    kind: Literal["skip", "none", "devices"]
    devices: list[str]
    capabilities: list[str]
    requirements: list[str]
    requirement_sources: list[str]
    devices_source: str | None
    privileged: bool
    reason: str | None
    legacy: NotRequired[bool]
    mig_config: NotRequired[bool]
    mig_monitor: NotRequired[bool]
    imex: NotRequired[list[str]]
    imex_source: NotRequired[str | None]
    notes: NotRequired[list[str]]   # requests ignored, one sentence each (logged as warnings)


class HostFile(TypedDict):
    path: str      # where the container sees it
    source: str    # on this machine


class Inventory(TypedDict):
    """observe.host's answer: the driver install ("files", cacheable) and the GPUs."""
    root: str
    driver: dict
    files: dict
    gpus: list[dict]
