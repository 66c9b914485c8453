"""CDI (Container Device Interface) specs, built from the same container edits as hook mode
and the runtime wrapper (decide.edits), and the other way round: the request a CDI container
was given, read from the device nodes the runtime put into its config.json. Pure: no I/O.

A spec lists one CDI device per GPU (by index and/or UUID), per MIG device (`<gpu>:<mig>`
and `MIG-<uuid>`) and `all`; each device carries only its own nodes (the GPU node, a MIG
device's two capability nodes and its parent GPU's node). The spec-wide edits carry what
every GPU container gets: the control nodes, the driver's read-only binds for the chosen
capabilities, NVIDIA_VISIBLE_DEVICES=void (a legacy hook installed beside it then injects
nothing a second time) and nvhook's createContainer hook, which does what must happen inside
the container (SONAME links, the image's compat libcuda when the GPUs allow it, the
ld.so.cache, /proc/driver/nvidia) with the GPUs the runtime really gave the container.

Libraries go to the directory they have on the host, whatever the image's layout: a spec is
made once per host and serves every image, and the hook writes that directory first into the
image's ld.so.cache (so it works for RHEL-style images too).
"""

from __future__ import annotations

from . import cdiselect
from . import edits as edits_mod
from . import plan as plan_mod

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from .types import Container

KIND = "nvidia.com/gpu"
# The management spec (`cdi generate --mode management`): one device, all, with every node of
# the host, for monitoring and management containers (DCGM, the GPU Operator's validators), as
# NVIDIA's toolkit writes it under this kind.
MANAGEMENT_KIND = "management.nvidia.com/gpu"
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"
HOOK_NAME = "createContainer"
HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_TIMEOUT = 60
STRATEGIES = ("index", "uuid", "type-index")  # type-index: gpu0, mig0:1, as nvidia-ctk names them
# The hook's option carrying the spec's capabilities (start/client.py parses it).
CAPS_OPTION = "--cdi"
# A spec without nvhook's hook (`cdi generate --no-hook`) carries this spec-wide variable with
# its capabilities: CDI 0.5.0 has no spec annotations (podman 4 reads no later version), and
# `cdi check` and nvhookd's refresh read a spec's options back from the spec itself.
NO_HOOK_ENV = "NVHOOK_CDI_NO_HOOK"
# glibc's default library directories by family (its slibdir/libdir as Debian and Ubuntu build
# it, multiarch, and as the RHEL family builds it): an image's loader searches its own family's
# without any ld.so.cache entry (`ld.so --list-diagnostics`: path.system_dirs).
_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}

# CDI spec versions by the first feature of each (container-device-interface's own rules,
# specs-go/version.go): mount "type" came with 0.4.0; device names that start with a digit and
# a device node "hostPath" with 0.5.0; annotations and a kind whose class has a dot with 0.6.0;
# additionalGids (and intelRdt) with 0.7.0; 0.8.0 and 1.0.0 add nothing a spec must declare.
# Engines refuse a version their copy of the library does not know (podman 4.3.1: 0.5.0 at
# most), so the label is the lowest that carries what the spec holds.
V030, V040, V050, V060, V070, V080 = "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0"
VERSIONS = (V030, V040, V050, V060, V070, V080, "1.0.0")
# Fields nvhook drops to fit an older version, and the version each needs.
DROPPABLE = {"additionalGids": V070}


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _all_edits(spec: dict) -> list[dict]:
    return [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec["devices"]]


def cdi_version(spec: dict) -> str:
    """The lowest cdiVersion that has every field and name form `spec` uses."""
    all_edits = _all_edits(spec)
    if any(e.get("additionalGids") or e.get("intelRdt") for e in all_edits):
        return V070
    if spec.get("annotations") or any(d.get("annotations") for d in spec["devices"]) \
            or "." in str(spec.get("kind", "")).partition("/")[2]:
        return V060
    if any(d["name"][:1].isdigit() for d in spec["devices"]):
        return V050
    if any("hostPath" in n for e in all_edits for n in e.get("deviceNodes", ())):
        return V050
    if any("type" in m for e in all_edits for m in e.get("mounts", ())):
        return V040
    return V030


def additional_gids(nodes: list[dict]) -> list[int]:
    """The groups a non-root container user needs to open `nodes` (spec device nodes): the
    group of each node that is not both world-readable and world-writable, when that group is
    not root's (NVIDIA 1.19's rule; the driver's own nodes are 0666 and need none, a site's
    0660 root:video node does)."""
    out: list[int] = []
    for n in nodes:
        mode, gid = n.get("fileMode"), n.get("gid")
        if mode is None or not gid or (mode & 0o006) == 0o006:
            continue
        if gid not in out:
            out.append(gid)
    return out


def fit_version(spec: dict, limit: str | None, label: str | None = None) -> list[str]:
    """Make `spec` readable by an engine that knows CDI versions up to `limit` (None: no limit):
    fields that need more are removed from it, one line each in the answer, and cdiVersion set
    to the lowest that carries what is left, or to `label` when given (`--cdi-version`). A
    spec that still needs more than the limit (its names or hostPath need 0.5.0) raises
    ValueError with the line to show."""
    dropped: list[str] = []
    if limit is not None:
        for field, needs in DROPPABLE.items():
            if version_key(needs) <= version_key(limit):
                continue
            holders = [e for e in _all_edits(spec) if e.get(field)]
            if holders:
                values = sorted({v for e in holders for v in e[field]})
                for e in holders:
                    del e[field]
                dropped.append(f"{field} {values} left out (needs cdiVersion {needs})")
    need = cdi_version(spec)
    if limit is not None and version_key(need) > version_key(limit):
        raise ValueError(f"the spec needs cdiVersion {need} (device names or hostPath), more than {limit}")
    spec["cdiVersion"] = label if label is not None else need
    return dropped


def spec_libdirs(files: dict) -> tuple[str, str]:
    """Where a CDI spec puts the driver libraries: their directory on the host (64-bit, 32-bit)."""
    def first_dir(kind: str, default: str) -> str:
        for lib in files["libraries"]:
            if lib["kind"] == kind:
                return str(lib["path"]).rsplit("/", 1)[0] or "/"
        return default
    return first_dir("library", "/usr/lib/x86_64-linux-gnu"), first_dir("library32", "/usr/lib/i386-linux-gnu")


def spec_image(files: dict) -> dict:
    """The image facts a spec is planned for: any image (no compat libraries; the hook decides
    those per container), libraries in their host directories."""
    return {"debian": True, "compat_libs": [], "compat_skipped": [], "libdirs": spec_libdirs(files)}


def _request(kind: str, devices: list[str], caps: list[str]) -> dict:
    return {"kind": kind, "devices": devices, "capabilities": list(caps), "requirements": [],
            "requirement_sources": [], "devices_source": "cdi", "privileged": False, "reason": "",
            "mig_config": [], "mig_monitor": [], "imex": []}


_HOST_LIBCUDA = {"decision": "host", "reason": "CDI spec: the host's libcuda; the hook decides per container",
                 "libraries": []}
_CONTAINER: Container = {"id": "cdi-spec", "pid": None, "rootfs": "/"}


def _edits(inv: dict, config: dict, image: dict, kind: str, tokens: list[str], caps: list[str]) -> dict:
    req = _request(kind, tokens, caps)
    selected, migs = plan_mod.select(req, inv["gpus"], inv["files"]["mig_minors"])
    p = plan_mod.build(_CONTAINER, req, inv, image, config, _HOST_LIBCUDA, selected, migs)
    return edits_mod.from_plan(p, (VOID_ENV,))


def device_names(inv: dict, strategies: tuple[str, ...]) -> list[tuple[list[str], str]]:
    """([CDI names], the NVIDIA_VISIBLE_DEVICES token that selects it) for every device, in
    index order: each GPU, then its MIG devices; `all` last."""
    out: list[tuple[list[str], str]] = []
    for g in sorted(inv["gpus"], key=lambda g: g["index"]):
        names = []
        if "index" in strategies:
            names.append(str(g["index"]))
        if "uuid" in strategies and g.get("uuid"):
            names.append(g["uuid"])
        if "type-index" in strategies:
            names.append(f"gpu{g['index']}")
        if names:
            out.append((names, str(g["index"])))
        for m in sorted(g.get("migs") or [], key=lambda m: m["index"]):
            names = []
            if "index" in strategies:
                names.append(f"{g['index']}:{m['index']}")
            if "uuid" in strategies:
                names.append(m["uuid"])
            if "type-index" in strategies:
                names.append(f"mig{g['index']}:{m['index']}")
            if names:
                out.append((names, m["uuid"]))
    if inv["gpus"]:
        out.append((["all"], "all"))
    return out


def _node(n: dict) -> dict:
    out: dict = {"path": n["path"]}
    if n["host_path"] != n["path"]:
        out["hostPath"] = n["host_path"]
    out.update(type=n["type"], major=n["major"], minor=n["minor"])
    if n.get("file_mode") is not None:
        out["fileMode"] = n["file_mode"]
    out["permissions"] = n["permissions"]
    if n.get("uid") is not None:
        out["uid"] = n["uid"]
    if n.get("gid") is not None:
        out["gid"] = n["gid"]
    return out


def _mount(m: dict) -> dict:
    return {"hostPath": m["host_path"], "containerPath": m["container_path"], "type": "bind",
            "options": list(m["options"])}


def default_dirs(libdir: str, arch: str) -> list[str]:
    """Where a spec without a hook binds each 64-bit driver library under its SONAME: the
    host's library directory (the spec's), /usr/lib/<multiarch> (what a Debian or Ubuntu
    image's loader searches by default) and /usr/lib64 (a RHEL-family image's)."""
    out = [libdir]
    for d in (f"/usr/lib/{_MULTIARCH[arch]}" if arch in _MULTIARCH else "", "/usr/lib64"):
        if d and d not in out:
            out.append(d)
    return out


def _no_hook_mounts(inv: dict, shared: dict) -> list[dict]:
    """The binds of a spec without a hook: the spec's binds, and each driver library's file
    again at every name a link of the plan would have given it (its SONAME, the gbm link), in
    its own directory and, for 64-bit libraries, in both glibc families' default directories
    (default_dirs). Nothing then has to happen inside the container for the loader to find
    them: no link, no ld.so.cache entry."""
    import posixpath

    binds = edits_mod.spec_mounts(shared)
    out = [_mount(m) for m in binds]
    taken = {m["container_path"] for m in binds}
    libs = {lib["path"]: lib for lib in inv["files"]["libraries"]}
    host_of: dict[str, str] = {}  # container path -> host file, for the link targets below

    def add(host: str, path: str) -> None:
        host_of.setdefault(path, host)
        if path not in taken:
            taken.add(path)
            out.append({"hostPath": host, "containerPath": path, "type": "bind",
                        "options": edits_mod.bind_options(["ro", "nosuid", "nodev"])})

    for m in binds:
        host_of[m["container_path"]] = m["host_path"]
        lib = libs.get(m["container_path"])
        if lib is None or m["kind"] not in ("library", "library32") or not lib.get("soname"):
            continue
        here = m["container_path"].rsplit("/", 1)[0]
        dirs = default_dirs(here, lib.get("arch") or "") if m["kind"] == "library" else [here]
        for d in dirs:
            add(m["host_path"], f"{d}/{lib['soname']}")
    for link in shared["symlinks"]:  # a link to a library file (gbm's), as a bind of that file
        target = posixpath.normpath(posixpath.join(posixpath.dirname(link["path"]), link["target"]))
        if target in host_of:
            add(host_of[target], link["path"])
    return out


def _link_nodes(own: dict) -> list[dict]:
    """For a spec without a hook: each link the hook would make to one of a device's nodes
    (/dev/dri/by-path/pci-...-card -> ../cardN) as a node of its own with the same numbers,
    which opens the same device (the runtime makes it in the container's /dev)."""
    import posixpath

    nodes = {n["path"]: n for n in own["device_nodes"]}
    out = []
    for link in own["symlinks"]:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(link["path"]), link["target"]))
        if target in nodes and link["path"] not in nodes:
            out.append(_node(dict(nodes[target], path=link["path"])))
    return out


def hook_args(caps: list[str], global_args: list[str]) -> list[str]:
    """argv of nvhook's createContainer hook: `global_args` (--config/--root as generate got
    them), the spec's capabilities, the stage."""
    return ["nvhook", *global_args, CAPS_OPTION, ",".join(caps), HOOK_NAME]


def nvhook_hook(caps: list[str], hook_path: str, global_args: list[str]) -> dict:
    """The one hook nvhook's spec holds (spec-wide)."""
    return {"hookName": HOOK_NAME, "path": hook_path, "args": hook_args(caps, global_args),
            "env": list(HOOK_ENV), "timeout": HOOK_TIMEOUT}


def build_spec(inv: dict, config: dict, *, capabilities: list[str], strategies: tuple[str, ...],
               hook_path: str, global_args: list[str], no_hook: bool = False,
               device_ids: tuple[str, ...] = ("all",), all_device: bool = True) -> dict:
    """The CDI spec for the host in `inv` (with NVML's MIG facts when there are MIG devices).
    `no_hook`: without nvhook's createContainer hook (docs/cdi.md, "A spec without a hook").
    `device_ids`, `all_device`: decide.cdiselect.chosen_devices."""
    image = spec_image(inv["files"])
    shared = _edits(inv, config, image, "none", [], capabilities)
    shared_paths = {n["path"] for n in shared["device_nodes"]}
    devices: list[dict] = []
    if "none" in device_ids:
        devices.append({"name": "none", "containerEdits": {"env": [cdiselect.NONE_DEVICE_ENV]}})
    for names, tokens in cdiselect.chosen_devices(inv, device_names(inv, strategies), device_ids, all_device):
        own = _edits(inv, config, image, "devices", tokens, capabilities)
        nodes = [_node(n) for n in own["device_nodes"] if n["path"] not in shared_paths]
        if no_hook and nodes:
            nodes += _link_nodes(own)
        if not nodes:
            # A GPU whose /dev/nvidiaN is missing (the inventory warns): a device with no edits
            # would make runtimes refuse the whole spec; `cdi check` reports it gone.
            continue
        own_edits: dict = {"deviceNodes": nodes}
        gids = additional_gids(nodes)
        if gids:
            own_edits["additionalGids"] = gids
        for name in names:
            devices.append({"name": name, "containerEdits": dict(own_edits)})
    edits: dict = {
        "env": list(shared["env"]),
        "deviceNodes": [_node(n) for n in shared["device_nodes"]],
        "mounts": [_mount(m) for m in edits_mod.spec_mounts(shared)],
        "hooks": [nvhook_hook(capabilities, hook_path, global_args)],
    }
    if no_hook:
        edits["env"].append(f"{NO_HOOK_ENV}={','.join(capabilities)}")
        edits["mounts"] = _no_hook_mounts(inv, shared)
        del edits["hooks"]
    _add_gids(edits, edits["deviceNodes"])
    spec: dict = {"cdiVersion": V030, "kind": KIND, "devices": devices, "containerEdits": edits}
    spec["cdiVersion"] = cdi_version(spec)
    return spec


def _add_gids(edits: dict, nodes: list[dict]) -> None:
    gids = additional_gids(nodes)
    if gids:
        edits["additionalGids"] = gids


def build_management_spec(inv: dict, config: dict, *, capabilities: list[str], hook_path: str,
                          global_args: list[str]) -> dict:
    """The management spec: device `all` carries every GPU node, the control nodes and, on a
    MIG-capable host, the MIG config/monitor capability nodes and every MIG instance's (what
    NVIDIA_MIG_CONFIG_DEVICES=all and NVIDIA_MIG_MONITOR_DEVICES=all grant in hook mode);
    the spec-wide edits carry the driver's files and nvhook's hook, as in the GPU spec."""
    image = spec_image(inv["files"])
    present = {d.get("cap_name") for d in inv["files"]["devices"] if d["role"] == "mig-cap"}
    req = _request("devices", ["all"], capabilities)
    req["mig_config"] = ["all"] if "config" in present else []
    req["mig_monitor"] = ["all"] if "monitor" in present else []
    selected, migs = plan_mod.select(req, inv["gpus"], inv["files"]["mig_minors"])
    p = plan_mod.build(_CONTAINER, req, inv, image, config, _HOST_LIBCUDA, selected, migs)
    e = edits_mod.from_plan(p, (VOID_ENV,))
    hook = {"hookName": HOOK_NAME, "path": hook_path, "args": hook_args(capabilities, global_args),
            "env": list(HOOK_ENV), "timeout": HOOK_TIMEOUT}
    spec: dict = {
        "cdiVersion": V030,
        "kind": MANAGEMENT_KIND,
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [_node(n) for n in e["device_nodes"]]}}],
        "containerEdits": {
            "env": list(e["env"]),
            "mounts": [_mount(m) for m in edits_mod.spec_mounts(e)],
            "hooks": [hook],
        },
    }
    _add_gids(spec["devices"][0]["containerEdits"], spec["devices"][0]["containerEdits"]["deviceNodes"])
    spec["cdiVersion"] = cdi_version(spec)
    return spec


# -- the other way: what the runtime gave a CDI container --------------------------------------

def request_from_devices(devices: list[dict], inv: dict, caps: list[str]) -> tuple[dict, list[str]]:
    """The request of a container whose config.json `linux.devices` the runtime filled from a
    CDI spec, matched by device number (never by path, never from the container's
    environment): GPU nodes select GPUs; a MIG device is selected when both its GPU-instance
    and compute-instance access nodes are there. Returns (request, MIG devices seen whose
    facts are missing) - the caller asks NVML once more for those."""
    numbers = {(d["major"], d["minor"]) for d in devices if (d.get("type") or "c") == "c"}
    gpu_by_num = {}
    for g in inv["gpus"]:
        dev = g.get("device")
        if dev:
            gpu_by_num[(dev["major"], dev["minor"])] = g
    caps_present = {d["cap_name"] for d in inv["files"]["devices"]
                    if d["role"] == "mig-cap" and (d["major"], d["minor"]) in numbers}
    tokens: list[str] = []
    unknown: list[str] = []
    mig_parents = set()
    for g in sorted(inv["gpus"], key=lambda g: g["index"]):
        for name in sorted(caps_present):
            parts = name.split("/")  # gpu<minor>/gi<G>/ci<C>/access
            if len(parts) != 4 or parts[0] != f"gpu{g['minor']}" or f"{parts[0]}/{parts[1]}/access" not in caps_present:
                continue
            gi, ci = int(parts[1][2:]), int(parts[2][2:])
            hit = [m for m in g.get("migs") or [] if m["gi"] == gi and m["ci"] == ci]
            if hit:
                tokens.append(hit[0]["uuid"])
                mig_parents.add(g["index"])
            else:
                unknown.append(name.rsplit("/", 1)[0])
    for num, g in sorted(gpu_by_num.items(), key=lambda kv: kv[1]["index"]):
        if num in numbers and g["index"] not in mig_parents:
            tokens.append(str(g["index"]))
    kind = "devices" if tokens else "none"
    return _request(kind, tokens, caps), unknown


def has_mig_nodes(devices: list[dict], files: dict) -> bool:
    numbers = {(d["major"], d["minor"]) for d in devices}
    return any(d["role"] == "mig-cap" and (d["major"], d["minor"]) in numbers for d in files["devices"])
