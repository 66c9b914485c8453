"""The plan: everything nvhook will do to one container, as plain data.

A plan is a dict of lists and strings (cheap to build, to print as JSON and to hand to the
apply step) with this shape:

    {"container": {"id": str, "pid": int|None, "rootfs": abs-path},
     "request": {"devices": [str], "capabilities": [str], "requirements": [str]},
     "driver": {"version": str, "cuda": str|None},
     "gpus": [{"index", "minor", "uuid", "bus_id", "model", "brand", "brand_source": "nvml"|"guessed"}],
     "mounts": [{"kind", "source", "target", "options"} (+ "node" for devices)],
     "symlinks": [{"path", "target"}],
     "devices_cgroup": [{"type": "c", "major", "minor", "access": "rw"}],
     "compat": {"decision": "host|image|none", "reason": str, "libraries": [container-path]},
     "ldconfig": {"binary": str, "directories": [container-path]} | None,
     "cgroup": {"mode": "v1|v2|none", "action": str},  (only with devices_cgroup rules)
     "app_profile": str}  (only for graphics or display with GPU nodes: decide/appprofile.py)

"cgroup" is not decided here: the pipeline adds the mode the apply step will act in (the
filesystem at /sys/fs/cgroup as the hook sees it) so that --dry-run shows it with the rules.

Mount kinds: library, library32, binary, device, ipc, firmware, procfs, tmpfs, compat.
`source` is the path on this machine (the host root already joined in); `target` is a path
inside the container. Options are mount options (ro, nosuid, nodev, noexec) plus two that
only the apply step interprets:
  - "copy": a procfs file copied into the /proc/driver/nvidia tmpfs instead of bind-mounted
    (the kernel's files cannot be bind-mounted into a tmpfs that outlives them cheaply, and
    params must be edited);
  - "set:Key=Value": with "copy", rewrite that `Key: value` line of the copy (params'
    ModifyDeviceFiles is forced to 0 so the container cannot ask the driver to create nodes).
Mounts are listed in the order they must be applied (the tmpfs before what goes in it).
A device mount also says which node the apply step creates in the container's /dev:
"node": {"major", "minor", "mode", "uid", "gid"}, the host node's number, permission bits and
owner as observed in this run (the inventory cache re-checks all of them on every start).
"""

from __future__ import annotations

from ..base import catalog
from ..base.errors import HookError, short
from . import appprofile
from .request import empty_plan  # noqa: F401 - here for the decisions that end empty, and callers

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from .types import CgroupRule, Container, Driver, Gpu, LdCache, Mount, MountKind, Plan, RequestSummary

KINDS = ("library", "library32", "binary", "device", "ipc", "firmware", "procfs", "tmpfs", "compat")

# Mount flags per kind, after the reference's choices: read-only everywhere a container must
# not change the host's driver; device nodes keep dev (they are devices) but lose exec.
OPTIONS = {
    "library": ["ro", "nosuid", "nodev"],
    "library32": ["ro", "nosuid", "nodev"],
    "binary": ["ro", "nosuid", "nodev"],
    "firmware": ["ro", "nosuid", "nodev"],
    "compat": ["ro", "nosuid", "nodev"],
    "device": ["ro", "nosuid", "noexec"],
    "ipc": ["nosuid", "nodev", "noexec"],
    "procfs": ["ro", "nosuid", "nodev", "noexec"],
    "tmpfs": ["nosuid", "nodev", "noexec", "mode=0555"],
}


def mount(kind: MountKind, source: str, target: str, extra: tuple[str, ...] = ()) -> Mount:
    return {"kind": kind, "source": source, "target": target, "options": OPTIONS[kind] + list(extra)}


# ---------------------------------------------------------------------------------------------
# Deciding: (request, host inventory, image facts, config) -> plan. Pure: reads nothing.


# Fixed device nodes and the capability that brings each (None: every GPU container).
CONTROL_ROLES = {role: (None if gate == catalog.ALWAYS else gate) for _, role, gate, _ in catalog.FIXED_DEVICES}


class UnknownMig(HookError):
    """A MIG id that the GPUs' facts do not list (maybe facts from before the instance existed)."""


def needs_mig_facts(request: dict) -> bool:
    """MIG ids can only be mapped to devices with NVML's help."""
    return any(_is_mig_token(t) for t in request["devices"])


def uses_mig_indices(request: dict) -> bool:
    """A "GPU:MIG" index names a MIG device by its place in NVML's enumeration, which moves
    whenever an instance is created or destroyed; a MIG UUID names one instance for its life."""
    return any(_is_mig_token(t) and not t.upper().startswith("MIG-") for t in request["devices"])


def _is_mig_token(token: str) -> bool:
    if token.upper().startswith("MIG-"):
        return True
    a, sep, b = token.partition(":")
    return bool(sep) and a.isdigit() and b.isdigit()


def _norm_bus(bus: str) -> str:
    bus = bus.lower()
    dom, sep, rest = bus.partition(":")
    if sep and rest.count(":") == 1:  # domain given: keep its last 4 digits
        return dom[-4:].rjust(4, "0") + ":" + rest
    return "0000:" + bus


def mig_devices_from_instances(gpus: list[dict], instances: list[str] | tuple[str, ...]) -> list[dict]:
    """Every MIG device that exists now, from the driver's capability tree
    ("gpu<minor>/gi<G>/ci<C>" entries): what `all` selects besides the GPUs, as
    libnvidia-container does. A GPU instance without a compute instance is no device yet."""
    by_minor = {g["minor"]: g for g in gpus}
    out: list[dict] = []
    for name in instances:
        parts = name.split("/")
        if len(parts) != 3 or not parts[0].startswith("gpu") or not parts[1].startswith("gi") \
                or not parts[2].startswith("ci"):
            continue
        numbers = (parts[0][3:], parts[1][2:], parts[2][2:])
        if not all(n.isascii() and n.isdigit() and len(n) <= 10 for n in numbers):
            continue
        g = by_minor.get(int(numbers[0]))
        if g is None:
            continue
        out.append({"gpu": g, "mig": {"index": None, "uuid": None, "gi": int(numbers[1]), "ci": int(numbers[2])}})
    return out


def select(request: dict, gpus: list[dict], mig_minors: dict,
           instances: list[str] | tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """(selected GPUs, selected MIG devices). Unknown ids raise HookError naming them.
    `instances`: the MIG instances that exist now (observe.host.procfs.mig_instances), which
    `all` selects with the GPUs."""
    if request["kind"] != "devices":
        return [], []
    tokens = request["devices"]
    if tokens == ["all"]:
        return list(gpus), mig_devices_from_instances(gpus, instances)
    by_uuid = {g["uuid"].lower(): g for g in gpus if g["uuid"]}
    by_bus = {g["bus_id"]: g for g in gpus}
    by_index = {str(g["index"]): g for g in gpus}
    migs = {}
    for gpu in gpus:
        for m in gpu.get("migs", []):
            migs[m["uuid"].lower()] = (gpu, m)
            migs[f"{gpu['index']}:{m['index']}"] = (gpu, m)
    selected: list[dict] = []
    selected_migs: list[dict] = []
    for t in tokens:
        low = t.lower()
        if _is_mig_token(t):
            hit = migs.get(low)
            if hit is None:
                raise UnknownMig(f"unknown MIG device {short(t)} in NVIDIA_VISIBLE_DEVICES "
                                f"({len(migs) // 2} MIG devices on this host)")
            selected_migs.append({"gpu": hit[0], "mig": hit[1]})
            continue
        g = by_index.get(t) or by_uuid.get(low)
        if g is None and ":" in t:
            g = by_bus.get(_norm_bus(t))
        if g is None:
            known = f"indices 0-{len(gpus) - 1}" if gpus else "no GPUs found"
            raise HookError(f"unknown device {short(t)} in NVIDIA_VISIBLE_DEVICES ({known}, GPU/MIG UUIDs or "
                            f"PCI bus ids)")
        if g not in selected:
            selected.append(g)
    return selected, selected_migs


def libdirs(image: dict) -> tuple[str, str]:
    if image.get("libdirs"):  # fixed by the caller: a CDI spec serves every image layout
        d64, d32 = image["libdirs"]
        return str(d64), str(d32)
    if image["debian"]:
        return "/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu"
    return "/usr/lib64", "/usr/lib"


def expand_capabilities(caps: list[str]) -> list[str]:
    out = list(caps)
    for c in caps:
        for extra in catalog.IMPLIES.get(c, ()):
            if extra not in out:
                out.append(extra)
    return out


def _gpu_entry(g: dict) -> Gpu:
    brand = g.get("brand")
    if brand:
        return {"index": g["index"], "minor": g["minor"], "uuid": g["uuid"], "bus_id": g["bus_id"],
                "model": g["model"], "brand": brand, "brand_source": "nvml"}
    from .compat import brand_from_model  # the same guess the forward-compat decision made

    return {"index": g["index"], "minor": g["minor"], "uuid": g["uuid"], "bus_id": g["bus_id"],
            "model": g["model"], "brand": brand_from_model(g["model"])[0], "brand_source": "guessed"}


class _Devices:
    """Device nodes in plan order, each container path once (procfs may list two GPUs with
    one minor; a MIG GPU instance and its compute instance share nothing, but a request may
    name both)."""

    def __init__(self) -> None:
        self.by_path: dict[str, dict] = {}

    def add(self, d: dict) -> bool:
        if d["path"] in self.by_path:
            return False
        self.by_path[d["path"]] = d
        return True


def _compat_libraries(files: dict, image: dict, decision: dict, libdir: str,
                      mounts: list, links: dict) -> set[str]:
    """The image's compat libraries chosen by the decision; returns the host libraries they
    replace. Each gets the SONAME link of the host library it stands in for."""
    replaced: set[str] = set()
    if decision["decision"] != "image":
        return replaced
    sonames = {lib["name"]: lib["soname"] for lib in files["libraries"] if lib["kind"] == "library"}
    for c in image.get("compat_libs", []):
        if c["container_path"] in decision["libraries"]:
            replaced.add(c["library"] + ".so")
            mounts.append(mount("compat", c["host_path"], f"{libdir}/{c['name']}"))
            soname = sonames.get(c["library"] + ".so", c["library"] + ".so.1")
            if soname != c["name"]:
                links[f"{libdir}/{soname}"] = c["name"]
    return replaced


def _host_libraries(files: dict, caps: list[str], libdir: str, libdir32: str, replaced: set[str],
                    mounts: list, links: dict) -> None:
    for lib in files["libraries"]:
        if lib["cap"] not in caps:
            continue
        if lib["kind"] == "library32":
            if "compat32" not in caps:
                continue
            d = libdir32
        else:
            if lib["name"] in replaced:
                continue
            d = libdir
        mounts.append(mount(lib["kind"], lib["source"], f"{d}/{lib['file']}"))
        if lib["soname"] != lib["file"]:
            links.setdefault(f"{d}/{lib['soname']}", lib["file"])


def _dev_links(files: dict, libdir: str, replaced: set[str], mounts: list, links: dict) -> None:
    mounted = {m["target"].rsplit("/", 1)[1] for m in mounts}
    for link, libname in catalog.DEV_LINKS.items():
        for lib in files["libraries"]:
            if lib["name"] == libname and lib["kind"] == "library" and (lib["file"] in mounted or libname in replaced):
                target = "libcuda.so.1" if libname == "libcuda.so" else lib["soname"]
                links.setdefault(f"{libdir}/{link}", "../" * link.count("/") + target)


def _files(files: dict, caps: list[str], mounts: list) -> None:
    """Loader configs, binaries, firmware and IPC sockets, gated by capability."""
    given = {m["target"].rsplit("/", 1)[1].split(".so", 1)[0] + ".so" for m in mounts if m["kind"] == "library"}
    for c in files["configs"]:
        # Loader configs (Vulkan ICD, EGL vendor, OpenCL ICD) belong with the libraries; the
        # schema has no kind of their own, and the cache writer ignores their directories.
        # One that names a library comes only with it (catalog.CONFIG_NEEDS).
        need = catalog.CONFIG_NEEDS.get(c["path"])
        if c["cap"] in caps and (need is None or need in given):
            mounts.append(mount("library", c["source"], c["path"]))
    for b in files["binaries"]:
        if b["cap"] in caps:
            mounts.append(mount("binary", b["source"], f"/usr/bin/{b['name']}"))
    if any(g in caps for g in catalog.FIRMWARE_GATES):
        for fw in files["firmware"]:
            mounts.append(mount("firmware", fw["source"], fw["path"]))
    for ipc in files["ipc"]:
        if ipc["cap"] in caps:
            # rw only where it must be: a socket is connected to (which needs write access);
            # a directory (the MPS pipe directory) is bound read-only, its pipes and sockets
            # stay usable (a read-only mount does not stop writes to them)
            mounts.append(mount("ipc", ipc["source"], ipc["path"], () if ipc.get("socket") is True else ("ro",)))


def _control_devices(files: dict, caps: list[str], devices: _Devices) -> None:
    for d in files["devices"]:
        role = d["role"]
        if role in CONTROL_ROLES and (CONTROL_ROLES[role] is None or CONTROL_ROLES[role] in caps):
            devices.add(d)


def _gpu_devices(parents: list[dict], devices: _Devices) -> list[Gpu]:
    for g in parents:
        if g.get("device"):
            devices.add(g["device"])
    return [_gpu_entry(g) for g in parents]


def _drm_devices(selected: list[dict], caps: list[str], devices: _Devices, links: dict) -> None:
    """With graphics, each selected GPU's own DRM nodes (/dev/dri/cardN, renderDN, as the
    inventory matched them to the GPU's PCI address) and their /dev/dri/by-path links where the
    host has them (Vulkan, EGL and Mesa's loader pick a GPU's node by PCI address there). Not for
    MIG devices: a MIG device does no graphics, and its parent's nodes would be the whole GPU's.
    The link's content is nvhook's own (`../<node>`), never the host link's text."""
    if "graphics" not in caps:
        return
    for g in selected:
        for d in g.get("drm") or ():
            devices.add(d)
            if d.get("by_path"):
                links.setdefault(d["by_path"], "../" + d["path"].rsplit("/", 1)[1])


def mig_access_names(selected_migs: list[dict]) -> list[tuple[str, str]]:
    """(mig-minors name, MIG device named) of the access capabilities the selected MIG devices
    need: the GPU instance's and the compute instance's."""
    out: list[tuple[str, str]] = []
    for sm in selected_migs:
        g, m = sm["gpu"], sm["mig"]
        label = m.get("uuid") or f"gpu{g['minor']}/gi{m['gi']}/ci{m['ci']}"
        for name in (f"gpu{g['minor']}/gi{m['gi']}/access", f"gpu{g['minor']}/gi{m['gi']}/ci{m['ci']}/access"):
            out.append((name, label))
    return out


def mig_capable(g: dict) -> bool:
    """NVML's MIG mode: enabled or disabled (capable), None when the GPU cannot do MIG or
    NVML did not say."""
    return g.get("mig_mode") is not None


def mig_management_gpus(request: dict, selected: list[dict], selected_migs: list[dict]) -> list[dict]:
    """The GPUs NVIDIA_MIG_CONFIG_DEVICES / _MONITOR_DEVICES=all grant: the visible GPUs (and
    the selected MIG devices' parents) that are MIG capable, as libnvidia-container does.
    Specific MIG devices beside them are refused: the grant covers whole GPUs."""
    if not (request.get("mig_config") or request.get("mig_monitor")):
        return []
    if selected_migs and request["devices"] != ["all"]:
        var = "NVIDIA_MIG_CONFIG_DEVICES" if request.get("mig_config") else "NVIDIA_MIG_MONITOR_DEVICES"
        raise HookError(f"{var} cannot be combined with specific MIG devices in NVIDIA_VISIBLE_DEVICES "
                        "(it grants whole GPUs: name the GPUs or 'all')")
    out: list[dict] = []
    for g in [*selected, *(sm["gpu"] for sm in selected_migs)]:
        if mig_capable(g) and g not in out:
            out.append(g)
    return out


def _mig_devices(files: dict, request: dict, selected_migs: list[dict], managed: list[dict],
                 instances: list[str], devices: _Devices) -> list[str]:
    """MIG access capability nodes of the selected MIG devices, and the management ones the
    request asks for; returns the capability files (under /proc/driver/nvidia/capabilities)
    CUDA reads to find those nodes."""
    caps_by_name = {d["cap_name"]: d for d in files["devices"] if d["role"] == "mig-cap"}
    mig_procfs: list[str] = []
    for name, label in mig_access_names(selected_migs):
        dev = caps_by_name.get(name)
        if dev is None:
            raise HookError(f"MIG device {label}: no /dev/nvidia-caps node for {name} "
                            "(see /proc/driver/nvidia-caps/mig-minors; devices.create_missing_nodes creates it)")
        if devices.add(dev):
            mig_procfs.append(name.replace("/", "/mig/", 1))  # gpu0/gi1/access -> gpu0/mig/gi1/access
    if not managed:
        return mig_procfs
    for key, name in (("mig_config", "config"), ("mig_monitor", "monitor")):
        if request.get(key):
            dev = caps_by_name.get(name)
            if dev is None:
                raise HookError(f"NVIDIA_MIG_{name.upper()}_DEVICES is set but the host has no MIG {name} "
                                "capability node")
            if devices.add(dev):
                mig_procfs.append(f"mig/{name}")
    # Each granted GPU's every MIG capability: the container manages its instances, including
    # ones it creates later (their nodes exist when the host made them; their procfs files
    # are copied for the instances that exist now).
    live = set(instances)
    for g in managed:
        prefix = f"gpu{g['minor']}/"
        for name, dev in sorted(caps_by_name.items(), key=lambda kv: kv[1]["minor"]):
            if name.startswith(prefix) and devices.add(dev) and name.rsplit("/", 1)[0] in live:
                mig_procfs.append(name.replace("/", "/mig/", 1))
    return mig_procfs


def _imex_devices(files: dict, request: dict, devices: _Devices) -> None:
    if not request.get("imex"):
        return
    channels = {d["path"].rsplit("channel", 1)[1]: d for d in files["devices"] if d["role"] == "imex"}
    wanted = sorted(channels, key=int) if request["imex"] == ["all"] else request["imex"]
    source = request.get("imex_source") or "NVIDIA_IMEX_CHANNELS"
    for ch in wanted:
        if ch not in channels:
            raise HookError(f"unknown IMEX channel {ch!r} (from {source}): no "
                            f"/dev/nvidia-caps-imex-channels/channel{ch} on the host "
                            "(devices.create_missing_nodes creates it)")
        devices.add(channels[ch])


def _device_mounts(devices: _Devices, mounts: list[Mount]) -> list[CgroupRule]:
    """A device mount per node (with the node facts the apply step creates it from), and the
    cgroup rules: one per distinct device number."""
    for d in devices.by_path.values():
        m = mount("device", d["source"], d["path"])
        if "mode" in d:
            m["node"] = {"major": d["major"], "minor": d["minor"], "mode": d["mode"], "uid": d["uid"], "gid": d["gid"]}
        mounts.append(m)
    numbers = dict.fromkeys((d["major"], d["minor"]) for d in devices.by_path.values())
    return [{"type": "c", "major": ma, "minor": mi, "access": "rw"} for ma, mi in numbers]


def _procfs(files: dict, root: str, parents: list[dict], mig_procfs: list[str], mounts: list) -> None:
    """/proc/driver/nvidia: a tmpfs with copies of the driver's files (rewritten where the
    catalog says), the selected GPUs' directories, and the MIG capability files."""
    if not files["procfs"]:
        return
    proc = "/proc/driver/nvidia"
    host_proc = (root.rstrip("/") if root != "/" else "") + proc
    mounts.append({"kind": "tmpfs", "source": "tmpfs", "target": proc, "options": list(OPTIONS["tmpfs"])})
    for name in files["procfs"]:
        extra = ("copy", *(f"set:{k}={v}" for k, v in catalog.PROCFS_REWRITES.get(name, ())))
        mounts.append({"kind": "procfs", "source": f"{host_proc}/{name}", "target": f"{proc}/{name}",
                       "options": ["ro", *extra]})
    for g in parents:
        bus = g["proc_dir"].rsplit("/", 1)[1]
        mounts.append(mount("procfs", f"{host_proc}/gpus/{bus}", f"{proc}/gpus/{bus}"))
    for name in mig_procfs:
        # Small static files (DeviceFileMinor/Mode): copied, not bound; 56 MIG devices would
        # otherwise cost 112 bind mounts.
        mounts.append({"kind": "procfs", "source": f"{host_proc}/capabilities/{name}",
                       "target": f"{proc}/capabilities/{name}", "options": ["ro", "copy"]})


def _ldcache(mounts: list[Mount], libdir: str, libdir32: str, config: dict) -> LdCache | None:
    lib_dirs = sorted({m["target"].rsplit("/", 1)[0] for m in mounts
                       if m["kind"] in ("library", "library32", "compat")} & {libdir, libdir32})
    return {"binary": config["ldconfig"]["path"], "directories": lib_dirs} if lib_dirs else None


def build(container: Container, request: dict, inv: dict, image: dict, config: dict, compat_decision: dict,
          selected: list[dict], selected_migs: list[dict]) -> Plan:
    """The plan for a request whose devices are already selected and checked: the per-kind
    planners above, combined in the order the apply step needs (binds, then device nodes,
    then the procfs tmpfs and what goes in it)."""
    files = inv["files"]
    driver: Driver = {"version": inv["driver"]["version"], "cuda": inv["driver"]["cuda"]}
    req_out: RequestSummary = {"devices": request["devices"] if request["kind"] == "devices" else [request["kind"]],
               "capabilities": request["capabilities"], "requirements": request["requirements"]}
    if request["kind"] == "skip":
        return empty_plan(container, req_out, driver, request["reason"])

    caps = expand_capabilities(request["capabilities"])
    libdir, libdir32 = libdirs(image)
    mounts: list[Mount] = []
    links: dict[str, str] = {}

    replaced = _compat_libraries(files, image, compat_decision, libdir, mounts, links)
    _host_libraries(files, caps, libdir, libdir32, replaced, mounts, links)
    _dev_links(files, libdir, replaced, mounts, links)
    _files(files, caps, mounts)

    devices = _Devices()
    _control_devices(files, caps, devices)
    parents = list(selected)  # GPUs whose node and procfs directory the container gets
    for sm in selected_migs:
        if sm["gpu"] not in parents:
            parents.append(sm["gpu"])
    gpu_entries = _gpu_devices(parents, devices)
    _drm_devices(selected, caps, devices, links)
    managed = mig_management_gpus(request, selected, selected_migs)
    mig_procfs = _mig_devices(files, request, selected_migs, managed, inv.get("mig_instances", []), devices)
    _imex_devices(files, request, devices)
    rules = _device_mounts(devices, mounts)
    _procfs(files, inv["root"], parents, mig_procfs, mounts)

    result: Plan = {
        "container": container,
        "request": req_out,
        "driver": driver,
        "gpus": gpu_entries,
        "mounts": mounts,
        "symlinks": [{"path": p, "target": t} for p, t in links.items()],
        "devices_cgroup": rules,
        "compat": {"decision": compat_decision["decision"], "reason": compat_decision["reason"],
                   "libraries": list(compat_decision.get("libraries", []))},
        "ldconfig": _ldcache(mounts, libdir, libdir32, config),
    }
    # Beyond NVIDIA's hook mode: EGL and Vulkan shown only the container's GPUs (decide/appprofile.py)
    profile, _left_out = appprofile.for_container(caps, [(p, True, d["minor"]) for p, d in devices.by_path.items()])
    if profile is not None:
        result["app_profile"] = profile
    return result

