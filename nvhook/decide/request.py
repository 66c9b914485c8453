"""What the container asks for, from its environment and mounts. Pure: no I/O.

The rules are the ones users' images already rely on (reference section 2): an image that sets
nothing is not a GPU container, a legacy CUDA image (CUDA_VERSION without NVIDIA_REQUIRE_CUDA)
gets every GPU and every capability, `void`/empty means do nothing, `none` means the driver
without any GPU.
"""

from __future__ import annotations

from ..base.catalog import CAPABILITIES, DEFAULT_CAPABILITIES
from ..base.errors import HookError, short
from .requirements import MAX_CHARS as MAX_REQUIRE_CHARS

# Device lists come from the image (NVIDIA_VISIBLE_DEVICES) or the orchestrator: bounded, so that
# no input makes the hook's work grow past what 8 GPUs x 7 MIG instances (and their UUIDs) need.
MAX_TOKENS = 1024
MAX_REQUIRE_VARS = 64
MAX_VALUE_CHARS = 65536  # a device or capability list: 1024 MIG UUIDs fit with room to spare


def _split(value: str, what: str = "value") -> list[str]:
    if len(value) > MAX_VALUE_CHARS:
        raise HookError(f"{what} is {len(value)} characters long; nvhook reads at most {MAX_VALUE_CHARS}")
    if value.count(",") >= MAX_TOKENS:
        raise HookError(f"{what} lists more than {MAX_TOKENS} entries; nvhook reads at most {MAX_TOKENS}")
    return [t.strip() for t in value.split(",") if t.strip()]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def devices_from_mounts(mounts: list[dict], root: str) -> list[str]:
    prefix = root.rstrip("/") + "/"
    ids = []
    for m in mounts:
        dest = m["destination"]
        if dest.startswith(prefix) and m.get("source") in ("/dev/null", None):
            ids.append(dest[len(prefix):].strip("/"))
    return [i for i in ids if i]


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
                ident = name[len(CDI_KIND):].strip()
                if ident and ident not in ids:
                    ids.append(ident)
                    if len(ids) > MAX_TOKENS:
                        raise HookError(f"CDI annotations name more than {MAX_TOKENS} GPUs; nvhook reads "
                                        f"at most {MAX_TOKENS}")
    return ids


def parse(env: dict, *, privileged: bool, mounts: list[dict], config: dict,
          annotations: object = None) -> dict:
    """Returns {kind, devices, capabilities, requirements, reason, ...}.

    kind: "skip" (not a GPU container / void / policy), "none" (driver, no GPU), "devices".
    """
    dev_cfg = config["devices"]
    legacy = "CUDA_VERSION" in env and "NVIDIA_REQUIRE_CUDA" not in env
    req = {
        "kind": "devices", "devices": [], "capabilities": [], "requirements": [],
        "legacy": legacy, "privileged": privileged, "reason": "",
        "devices_source": "NVIDIA_VISIBLE_DEVICES",
        "requirement_sources": [], "mig_config": [], "mig_monitor": [], "imex": [],
    }

    volume_ids = devices_from_mounts(mounts, dev_cfg["volume_mounts_root"]) if dev_cfg["accept_volume_mounts"] else []
    # `NVIDIA_VISIBLE_DEVICES=void` beside CDI annotations: a CDI-aware runtime already
    # injected them (nvhook's CDI specs set it), so the annotations are not a request again.
    cdi_ids = devices_from_cdi_annotations(annotations) if env.get("NVIDIA_VISIBLE_DEVICES") != "void" else []
    if volume_ids:
        raw = ",".join(volume_ids)
        req["devices_source"] = "volume-mounts"
    elif cdi_ids:
        # Set by the orchestrator, not by the image: not subject to accept_envvar_unprivileged.
        raw = ",".join(cdi_ids)
        req["devices_source"] = "cdi-annotations"
    elif "NVIDIA_VISIBLE_DEVICES" in env:
        raw = env["NVIDIA_VISIBLE_DEVICES"]
        if not privileged and not dev_cfg["accept_envvar_unprivileged"]:
            req["kind"] = "skip"
            req["reason"] = ("NVIDIA_VISIBLE_DEVICES ignored: the container is unprivileged and "
                             "devices.accept_envvar_unprivileged is false")
            return req
    elif legacy:
        raw = "all"
        req["devices_source"] = "legacy CUDA_VERSION image"
    else:
        req["kind"] = "skip"
        req["reason"] = "not a GPU container: NVIDIA_VISIBLE_DEVICES is not set"
        return req

    tokens = _split(raw, str(req["devices_source"]))
    if not tokens or tokens == ["void"]:
        req["kind"] = "skip"
        req["reason"] = f"NVIDIA_VISIBLE_DEVICES={short(raw)}: nothing requested"
        return req
    if "none" in tokens:
        if tokens != ["none"]:
            raise HookError(f"NVIDIA_VISIBLE_DEVICES={short(raw)}: 'none' cannot be combined with device ids")
        req["kind"] = "none"
    elif "all" in tokens:
        if tokens != ["all"]:
            raise HookError(f"NVIDIA_VISIBLE_DEVICES={short(raw)}: 'all' cannot be combined with device ids")
        req["devices"] = ["all"]
    elif "void" in tokens:
        raise HookError(f"NVIDIA_VISIBLE_DEVICES={short(raw)}: 'void' cannot be combined with device ids")
    else:
        req["devices"] = list(dict.fromkeys(tokens))  # first occurrence kept, in order

    req["capabilities"] = capabilities(env.get("NVIDIA_DRIVER_CAPABILITIES"), legacy)

    if not _truthy(env.get("NVIDIA_DISABLE_REQUIRE")):
        names = [k for k in sorted(env) if k.startswith("NVIDIA_REQUIRE_") and env[k].strip()]
        if len(names) > MAX_REQUIRE_VARS:
            raise HookError(f"the image sets {len(names)} NVIDIA_REQUIRE_* variables; nvhook checks at most "
                            f"{MAX_REQUIRE_VARS} (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
        for k in names:  # refused before anything logs them
            if len(env[k].strip()) > MAX_REQUIRE_CHARS:
                raise HookError(f"{k} is {len(env[k].strip())} characters long; nvhook reads at most "
                                f"{MAX_REQUIRE_CHARS} (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
        reqs = [env[k].strip() for k in names]
        if legacy:
            ver = env["CUDA_VERSION"].strip().split(".")
            if len(ver) >= 2 and all(v.isascii() and v.isdigit() for v in ver[:2]):  # not "².³"
                names.append("CUDA_VERSION")
                reqs.append(f"cuda>={ver[0]}.{ver[1]}")
        req["requirements"] = reqs
        req["requirement_sources"] = names

    for var, key in (("NVIDIA_MIG_CONFIG_DEVICES", "mig_config"), ("NVIDIA_MIG_MONITOR_DEVICES", "mig_monitor")):
        if env.get(var, "").strip():
            if not privileged:
                raise HookError(f"{var} is set but the container is not privileged (it needs CAP_SYS_ADMIN)")
            req[key] = _split(env[var], var)
    if env.get("NVIDIA_IMEX_CHANNELS", "").strip():
        req["imex"] = _split(env["NVIDIA_IMEX_CHANNELS"], "NVIDIA_IMEX_CHANNELS")
    return req


def capabilities(value: str | None, legacy: bool) -> list[str]:
    if value is None or not value.strip():
        return list(CAPABILITIES) if legacy else list(DEFAULT_CAPABILITIES)
    tokens = [t.lower() for t in _split(value, "NVIDIA_DRIVER_CAPABILITIES")]
    if "all" in tokens:
        return list(CAPABILITIES)
    out = []
    for t in tokens:
        if t not in CAPABILITIES:
            raise HookError(f"unknown capability {short(t)} in NVIDIA_DRIVER_CAPABILITIES={short(value)} "
                            f"(known: {', '.join(CAPABILITIES)}, all)")
        if t not in out:
            out.append(t)
    return out
