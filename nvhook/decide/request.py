"""What the container asks for, from its environment and mounts. Pure: no I/O.

The rules are the ones users' images already rely on (reference section 2) and the ones
NVIDIA's hook and libnvidia-container apply; where nvhook differs on purpose, docs/request-rules.md
("Request rules: where nvhook differs from NVIDIA") says so and why. In short: an image that
sets nothing is not a GPU container; a legacy CUDA image (a non-empty CUDA_VERSION without a
non-empty NVIDIA_REQUIRE_CUDA) asks for every GPU and every capability, and that implied `all`
is an environment request like any other; `void`/empty means do nothing; `none` means the
driver without any GPU.

Whatever the image's environment asks for (devices, IMEX channels) is subject to
devices.accept_envvar_unprivileged; what the orchestrator sets (volume mounts, CDI
annotations) is not.
"""

from __future__ import annotations

from ..base.catalog import CAPABILITIES, DEFAULT_CAPABILITIES
from ..base.errors import HookError, short

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from .types import Container, Driver, Plan, RequestSummary

# Device lists come from the image (NVIDIA_VISIBLE_DEVICES) or the orchestrator: bounded, so that
# no input makes the hook's work grow past what 8 GPUs x 7 MIG instances (and their UUIDs) need.
MAX_TOKENS = 1024
MAX_REQUIRE_VARS = 64
# One NVIDIA_REQUIRE_* expression (decide.requirements reads this bound from here: the
# requirements module loads only for containers that state requirements).
MAX_REQUIRE_CHARS = 16384
MAX_VALUE_CHARS = 65536  # a device or capability list: 1024 MIG UUIDs fit with room to spare

IMEX_PREFIX = "imex/"
_UINT32 = 1 << 32


def _split(value: str, what: str = "value") -> list[str]:
    if len(value) > MAX_VALUE_CHARS:
        raise HookError(f"{what} is {len(value)} characters long; nvhook reads at most {MAX_VALUE_CHARS}")
    if value.count(",") >= MAX_TOKENS:
        raise HookError(f"{what} lists more than {MAX_TOKENS} entries; nvhook reads at most {MAX_TOKENS}")
    return [t.strip() for t in value.split(",") if t.strip()]


def _unique(tokens: list[str]) -> list[str]:
    return list(dict.fromkeys(tokens))


def go_parse_bool(value: str | None) -> bool:
    """Go's strconv.ParseBool, as NVIDIA reads NVIDIA_DISABLE_REQUIRE: exactly these spellings
    are true; anything else (yes, on, " true") is not, so the requirements stay checked."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _decimal(text: str) -> bool:
    """Semver's numeric identifier: ASCII digits, no leading zero (str.isdigit accepts '²')."""
    return text.isascii() and text.isdigit() and (text == "0" or text[0] != "0")


def _identifiers(text: str, *, numeric_no_zero: bool) -> bool:
    for ident in text.split("."):
        if not ident or not all(c.isascii() and (c.isalnum() or c == "-") for c in ident):
            return False
        if numeric_no_zero and ident.isdigit() and not _decimal(ident):
            return False
    return True


def cuda_major_minor(version: str) -> str | None:
    """A legacy image's CUDA_VERSION as NVIDIA reads it (a semantic version, `v` allowed, minor
    and patch optional, pre-release and build parts allowed; major and minor below 2^32):
    "major.minor", or None when it is not such a version."""
    if len(version) > 256:
        return None
    core = version[1:] if version.startswith("v") else version
    core, plus, build = core.partition("+")
    if plus and not _identifiers(build, numeric_no_zero=False):
        return None
    core, dash, pre = core.partition("-")
    if dash and not _identifiers(pre, numeric_no_zero=True):
        return None
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(_decimal(p) for p in parts):
        return None
    major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    if major >= _UINT32 or minor >= _UINT32 or (len(parts) == 3 and int(parts[2]) >= 1 << 64):
        return None
    return f"{major}.{minor}"


def requests_from_mounts(mounts: list[dict], root: str) -> list[str]:
    """The orchestrator's requests as /dev/null bind mounts under `root` (the Kubernetes device
    plugin's volume-mounts strategy): `<root>/<id>` names a device, `<root>/imex/<n>` an IMEX
    channel. Each destination once."""
    prefix = root.rstrip("/") + "/"
    ids: list[str] = []
    for m in mounts:
        dest = m["destination"]
        if dest.startswith(prefix) and m.get("source") in ("/dev/null", None):
            ident = dest[len(prefix):].strip("/")
            if ident and ident not in ids:
                ids.append(ident)
    return ids


def devices_from_mounts(mounts: list[dict], root: str) -> list[str]:
    return [i for i in requests_from_mounts(mounts, root) if not i.startswith(IMEX_PREFIX)]


def imex_from_mounts(mounts: list[dict], root: str) -> list[str]:
    return [i[len(IMEX_PREFIX):] for i in requests_from_mounts(mounts, root)
            if i.startswith(IMEX_PREFIX) and len(i) > len(IMEX_PREFIX)]


CDI_PREFIX = "cdi.k8s.io/"
CDI_KIND = "nvidia.com/gpu="


def devices_from_cdi_annotations(annotations: object) -> list[str]:
    """GPU ids named by CDI annotations (`cdi.k8s.io/<anything>: nvidia.com/gpu=0,...`), which
    Kubernetes device plugins set and which runtimes without CDI support (Docker 20.10,
    containerd 1.6) pass through unresolved. Other vendors' devices are not ours."""
    ids: list[str] = []
    if not isinstance(annotations, dict):
        return ids
    for key in sorted(annotations):
        value = annotations[key]
        if not isinstance(key, str) or not key.startswith(CDI_PREFIX) or not isinstance(value, str):
            continue
        for name in value.split(","):
            name = name.strip()
            if name.startswith(CDI_KIND):
                ident = type_index_id(name[len(CDI_KIND):].strip())
                if ident and ident not in ids:
                    ids.append(ident)
                    if len(ids) > MAX_TOKENS:
                        raise HookError(f"CDI annotations name more than {MAX_TOKENS} GPUs; nvhook reads "
                                        f"at most {MAX_TOKENS}")
    return ids


def _env_device_vars(env: dict[str, str], swarm_resource: str) -> list[str]:
    """The variables the image's device request is read from: the admin's swarm resource
    variables (request.swarm_resource, e.g. DOCKER_RESOURCE_GPU) that are set, else
    NVIDIA_VISIBLE_DEVICES when set."""
    swarm = [v for v in _split(swarm_resource) if v in env]
    if swarm:
        return swarm
    return ["NVIDIA_VISIBLE_DEVICES"] if "NVIDIA_VISIBLE_DEVICES" in env else []


def parse(env: dict[str, str], *, privileged: bool, mounts: list[dict], config: dict,
          annotations: object = None) -> dict:
    """Returns {kind, devices, capabilities, requirements, reason, ...}.

    kind: "skip" (not a GPU container / void / policy), "none" (driver, no GPU), "devices".
    notes: requests that were ignored, each a sentence the hook logs as a warning.
    """
    dev_cfg = config["devices"]
    req_cfg = config["request"]
    legacy = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
    env_allowed = privileged or bool(dev_cfg["accept_envvar_unprivileged"])
    policy = "the container is unprivileged and devices.accept_envvar_unprivileged is false"
    req: dict = {
        "kind": "devices", "devices": [], "capabilities": [], "requirements": [],
        "legacy": legacy, "privileged": privileged, "reason": "",
        "devices_source": "NVIDIA_VISIBLE_DEVICES",
        "requirement_sources": [], "mig_config": False, "mig_monitor": False, "imex": [],
        "imex_source": None, "notes": [],
    }

    mount_root = dev_cfg["volume_mounts_root"]
    raw = _device_list(env, mounts, annotations, dev_cfg, req_cfg, legacy, env_allowed, policy, req)
    if raw is None or not _devices(raw, req):
        return req

    req["capabilities"] = capabilities(env.get("NVIDIA_DRIVER_CAPABILITIES"), legacy,
                                       req_cfg["supported_driver_capabilities"])
    _requirements(env, legacy, bool(req_cfg["disable_require"]), req)
    _mig_management(env, privileged, req)
    _imex(env, mounts, mount_root, bool(dev_cfg["accept_volume_mounts"]), env_allowed, policy, req_cfg, req)
    return req


def _device_list(env: dict[str, str], mounts: list[dict], annotations: object, dev_cfg: dict, req_cfg: dict,
                 legacy: bool, env_allowed: bool, policy: str, req: dict) -> str | None:
    """The raw device list and where it came from (req["devices_source"]): the orchestrator's
    volume mounts or CDI annotations, else the image's environment under the policy. None when
    the container is not a GPU container (req says why)."""
    volume_ids = devices_from_mounts(mounts, dev_cfg["volume_mounts_root"]) if dev_cfg["accept_volume_mounts"] else []
    # `NVIDIA_VISIBLE_DEVICES=void` beside CDI annotations: a CDI-aware runtime already
    # injected them (nvhook's CDI specs set it), so the annotations are not a request again.
    cdi_ids = devices_from_cdi_annotations(annotations) if env.get("NVIDIA_VISIBLE_DEVICES") != "void" else []
    if volume_ids:
        req["devices_source"] = "volume-mounts"
        return ",".join(volume_ids)
    if cdi_ids:
        # Set by the orchestrator, not by the image: not subject to accept_envvar_unprivileged.
        req["devices_source"] = "cdi-annotations"
        return ",".join(cdi_ids)
    names = _env_device_vars(env, req_cfg["swarm_resource"])
    if names:
        raw = ",".join(env[n] for n in names)
        req["devices_source"] = "+".join(names)
    elif legacy:
        raw = "all"
        req["devices_source"] = "legacy CUDA_VERSION image"
    else:
        req["kind"] = "skip"
        req["reason"] = "not a GPU container: NVIDIA_VISIBLE_DEVICES is not set"
        return None
    # A legacy image's implied `all` is the image's request too (any image can set
    # CUDA_VERSION), so the policy refuses it like NVIDIA_VISIBLE_DEVICES=all.
    if not env_allowed and _split(raw) and "void" not in (t.lower() for t in _split(raw)):
        what = (f"{req['devices_source']} (which means NVIDIA_VISIBLE_DEVICES=all)" if not names
                else f"{req['devices_source']}={short(raw)}")
        req["kind"] = "skip"
        req["reason"] = f"{what} ignored: {policy}"
        return None
    return raw


# The CDI kinds whose devices are nvhook's GPUs: the kind NVIDIA's and nvhook's specs use, and
# the one NVIDIA's runtime generates specs for on the fly (its jit-cdi mode); both name devices
# the same way (decide.cdimodel.device_names).
CDI_GPU_KINDS = ("nvidia.com/gpu", "runtime.nvidia.com/gpu")


def type_index_id(name: str) -> str:
    """nvidia-ctk's type-index CDI names as device ids (gpu1 -> 1, mig0:1 -> 0:1); any other
    name as it is."""
    if name[:3] == "gpu" and _decimal(name[3:]):
        return name[3:]
    if name[:3] == "mig" and name.count(":") == 1 and all(_decimal(p) for p in name[3:].split(":")):
        return name[3:]
    return name


def cdi_device_token(token: str, what: str) -> str:
    """A device list entry as the token plan.select reads: a CDI device name of a GPU kind
    (`nvidia.com/gpu=<name>`, what NVIDIA's runtime takes in its cdi and jit-cdi modes) becomes
    the name's GPU index, `<gpu>:<mig>`, UUID or `all` (type-index names: gpu0 -> 0, mig0:1 ->
    0:1); any other entry is returned as it is. `what`: the variable, for the error line."""
    kind, eq, name = token.partition("=")
    if not eq:
        return token
    if kind not in CDI_GPU_KINDS:
        raise HookError(f"{what}: {short(token)} is not a CDI device nvhook serves (vendor/class "
                        f"{short(kind)}; use nvidia.com/gpu=<index|UUID|all>, e.g. nvidia.com/gpu=0)")
    name = type_index_id(name)
    if not name or name.lower() in ("none", "void"):
        raise HookError(f"{what}: {short(token)} names no device (a CDI device is an index, UUID, "
                        f"<gpu>:<mig> or all; for no GPU set NVIDIA_VISIBLE_DEVICES={name.lower() or 'void'})")
    return name


def volume_mount_cdi_name(entry: str) -> str:
    """A volume-mount entry `cdi/<vendor>/<class>/<device>` or `cdi/<vendor>/<class>=<device>`
    (the device plugin's form for CDI devices, as NVIDIA's runtime reads it) as the CDI name
    `<vendor>/<class>=<device>`; any other entry as it is."""
    if not entry.startswith("cdi/"):
        return entry
    name = entry[len("cdi/"):]
    if "=" in name:
        return name
    parts = name.split("/", 2)
    return f"{parts[0]}/{parts[1]}={parts[2]}" if len(parts) == 3 else entry


def _devices(raw: str, req: dict) -> bool:
    """The device list's keywords and ids into req; False when it asks for nothing."""
    source = str(req["devices_source"])
    tokens = _split(raw, source)
    if source == "volume-mounts":
        tokens = [volume_mount_cdi_name(t) for t in tokens]
    if "void" not in (t.lower() for t in tokens):  # `void` wins over anything beside it
        tokens = [cdi_device_token(t, source) for t in tokens]
    keywords = [t.lower() for t in tokens]
    legacy_all = req["devices_source"] == "legacy CUDA_VERSION image"
    what = "CUDA_VERSION" if legacy_all else f"{req['devices_source']}={short(raw)}"
    if not tokens or "void" in keywords:
        # `void` anywhere wins, as in NVIDIA's hook: a container that asked for nothing starts.
        req["kind"] = "skip"
        req["reason"] = f"{what}: nothing requested"
        return False
    if "none" in keywords:
        if keywords != ["none"] * len(keywords):
            raise HookError(f"{what}: 'none' cannot be combined with 'all' or device ids ('none' means no GPU)")
        req["kind"] = "none"
    elif "all" in keywords:
        req["devices"] = ["all"]  # `all` with ids is still every GPU (libnvidia-container stops at `all`)
    else:
        req["devices"] = _unique(tokens)
    return True


def _requirements(env: dict[str, str], legacy: bool, disabled_by_admin: bool, req: dict) -> None:
    if disabled_by_admin or go_parse_bool(env.get("NVIDIA_DISABLE_REQUIRE")):
        return
    # NVIDIA_REQUIRE_JETPACK* are Jetson mount selectors, not requirements.
    names = [k for k in sorted(env)
             if k.startswith("NVIDIA_REQUIRE_") and not k.startswith("NVIDIA_REQUIRE_JETPACK") and env[k].strip()]
    if len(names) > MAX_REQUIRE_VARS:
        raise HookError(f"the image sets {len(names)} NVIDIA_REQUIRE_* variables; nvhook checks at most "
                        f"{MAX_REQUIRE_VARS} (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
    for k in names:  # refused before anything logs them
        if len(env[k].strip()) > MAX_REQUIRE_CHARS:
            raise HookError(f"{k} is {len(env[k].strip())} characters long; nvhook reads at most "
                            f"{MAX_REQUIRE_CHARS} (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
    reqs = [env[k].strip() for k in names]
    if legacy:
        version = cuda_major_minor(env["CUDA_VERSION"])
        if version is None:
            raise HookError(f"CUDA_VERSION={short(env['CUDA_VERSION'])} is not a version (a legacy CUDA image's "
                            "CUDA_VERSION must be major[.minor[.patch]], e.g. 11.8.0; "
                            "NVIDIA_DISABLE_REQUIRE=true skips the check)")
        names.append("CUDA_VERSION")
        reqs.append(f"cuda>={version}")
    req["requirements"] = reqs
    req["requirement_sources"] = names


def _mig_management(env: dict[str, str], privileged: bool, req: dict) -> None:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: only `all` (the visible GPUs);
    for privileged containers only."""
    for var, key in (("NVIDIA_MIG_CONFIG_DEVICES", "mig_config"), ("NVIDIA_MIG_MONITOR_DEVICES", "mig_monitor")):
        value = env.get(var, "")
        if not value:
            continue
        if not privileged:
            raise HookError(f"{var} is set but the container is not privileged (it needs CAP_SYS_ADMIN)")
        tokens = _split(value, var)
        for t in tokens:
            if t.lower() != "all":
                raise HookError(f"{var}={short(value)}: only 'all' (every visible MIG-capable GPU) is supported")
        req[key] = bool(tokens)


def _imex(env: dict[str, str], mounts: list[dict], mount_root: str, accept_mounts: bool, env_allowed: bool,
          policy: str, req_cfg: dict, req: dict) -> None:
    """IMEX channels: the orchestrator's `imex/<n>` volume mounts win; NVIDIA_IMEX_CHANNELS is
    the image's request and obeys the same policy as its device request. `all` from the
    environment is not honoured (nor by NVIDIA's hook): every channel is every tenant's."""
    value = env.get("NVIDIA_IMEX_CHANNELS", "")
    from_mounts = imex_from_mounts(mounts, mount_root) if accept_mounts else []
    if req_cfg["ignore_imex_channel_requests"]:
        if from_mounts or _split(value, "NVIDIA_IMEX_CHANNELS"):
            req["notes"].append("IMEX channel request ignored: request.ignore_imex_channel_requests is true")
        return
    if from_mounts:
        channels, req["imex_source"] = from_mounts, "volume-mounts"
    else:
        tokens = _split(value, "NVIDIA_IMEX_CHANNELS")
        keywords = [t.lower() for t in tokens]
        if not tokens or "void" in keywords or "none" in keywords:
            return
        if not env_allowed:
            req["notes"].append(f"NVIDIA_IMEX_CHANNELS={short(value)} ignored: {policy}")
            return
        if "all" in keywords:
            req["notes"].append(f"NVIDIA_IMEX_CHANNELS={short(value)} ignored: 'all' is not honoured from the "
                                "environment (name the channels, or let the orchestrator mount imex/<n>)")
            return
        channels, req["imex_source"] = tokens, "NVIDIA_IMEX_CHANNELS"
    for ch in channels:
        if ch.lower() != "all" and not _decimal(ch):
            raise HookError(f"IMEX channel {short(ch)} from {req['imex_source']} is not a channel number")
    req["imex"] = ["all"] if any(ch.lower() == "all" for ch in channels) else _unique(channels)


def supported_capabilities(value: str) -> list[str]:
    """request.supported_driver_capabilities: "all" or a comma-separated subset."""
    tokens = [t.lower() for t in _split(value)]
    if "all" in tokens:
        return list(CAPABILITIES)
    return [c for c in CAPABILITIES if c in tokens]


def capabilities(value: str | None, legacy: bool, supported_value: str = "all") -> list[str]:
    """NVIDIA_DRIVER_CAPABILITIES. Unset: every supported capability for a legacy image, else
    the default (utility,compute) within the supported set. Set but empty: the default, for
    legacy images too. `all`: every supported one. Naming one the admin does not support is
    an error, as in NVIDIA's hook."""
    supported = supported_capabilities(supported_value)
    if value is None and legacy:
        return supported
    if value is None or not value.strip():
        return [c for c in DEFAULT_CAPABILITIES if c in supported]
    tokens = [t.lower() for t in _split(value, "NVIDIA_DRIVER_CAPABILITIES")]
    if "all" in tokens:
        return supported
    out = []
    for t in tokens:
        if t not in CAPABILITIES:
            raise HookError(f"unknown capability {short(t)} in NVIDIA_DRIVER_CAPABILITIES={short(value)} "
                            f"(known: {', '.join(CAPABILITIES)}, all)")
        if t not in supported:
            raise HookError(f"capability {short(t)} in NVIDIA_DRIVER_CAPABILITIES={short(value)} is not supported "
                            f"on this host (request.supported_driver_capabilities: "
                            f"{', '.join(supported) or 'none'})")
        if t not in out:
            out.append(t)
    return out


def empty_plan(container: Container, request: RequestSummary, driver: Driver, reason: str) -> Plan:
    """A plan that does nothing, with the reason in the compat field (the schema's one free-text
    slot). Here rather than in decide.plan: a container that asks for no GPU needs only this
    module, and not plan's import."""
    return {
        "container": container,
        "request": request,
        "driver": driver,
        "gpus": [],
        "mounts": [],
        "symlinks": [],
        "devices_cgroup": [],
        "compat": {"decision": "none", "reason": reason, "libraries": []},
        "ldconfig": None,
    }
