"""Observe the host: the cached driver-file inventory, this run's GPUs from procfs, NVML facts on demand."""

from __future__ import annotations

from ...base.brands import BRANDS as BRAND_NAMES
from . import cache, inventory, procfs


def observe(root: str, cache_dir: str, log, capabilities=None) -> dict:
    """The host inventory: cached driver files plus this run's GPU list from procfs.

    `capabilities` (expanded): what the container asked for. A missing file is reported only
    when its capability is among them (every capability when None: info, list, doctor); a
    container that asked for compute does not need to hear that the video libraries are absent.
    """
    cached = cache.load(cache_dir, root)
    if cached is not None:
        files, nvml = cached["files"], cached.get("nvml")
        log.debug("inventory.cache_hit", cache_dir=cache_dir)
    else:
        files, nvml = inventory.build_files(root), None
        stored = cache.store(cache_dir, files)
        log.info("inventory.built", libraries=len(files["libraries"]), binaries=len(files["binaries"]),
                 devices=len(files["devices"]), cached=stored, cache_dir=cache_dir or None)
        if files["incomplete"]:
            # Not the host's truth: kept out of the cache, so the next start scans again.
            log.warning("inventory.incomplete", count=len(files["incomplete"]), first=files["incomplete"][0],
                        cached=False)
        elif cache_dir and not stored:
            refused = cache.refusal(cache_dir)
            if refused is not None:  # every start pays the full scan
                log.event("inventory.cache_refused", refused[0], cache_dir=cache_dir, reason=refused[1])
    for p in files["problems"]:
        if capabilities is not None and p.get("capability", "") not in ("", *capabilities):
            continue
        fields = {k: v for k, v in p.items() if k not in ("level", "event")}
        log.event(p["event"], p["level"], **fields)
    gpus, problems = procfs.gpus(root)
    for text in problems:
        log.warning("gpu.procfs_problem", problem=text)
    gpu_problems: list = []
    inventory.gpu_devices(root, gpus, gpu_problems)
    if capabilities is None or "graphics" in capabilities:
        inventory.gpu_drm(root, gpus, gpu_problems)  # sysfs and /dev/dri: only where they are given
    for p in gpu_problems:
        log.event(p["event"], p["level"], **{k: v for k, v in p.items() if k not in ("level", "event")})
    log.info("gpus.procfs", count=len(gpus), source="procfs")
    return {"root": root, "cache_dir": cache_dir, "files": files, "gpus": gpus, "gpu_source": "procfs",
            "nvml_cached": nvml, "nvml_state": None, "nvml_error": None,
            "driver": dict(files["driver"], cuda=None, cuda_source=None)}


def _nvml_ident(inv: dict) -> list:
    """What cached NVML facts are valid for: the GPUs and the MIG capability minors. Lists
    only, so that it compares equal after a JSON round trip through the cache."""
    return [sorted(g["uuid"] for g in inv["gpus"]),
            sorted([k, v] for k, v in inv["files"]["mig_minors"].items())]


def add_nvml(inv: dict, config: dict, log, reason: str, *, live_instances: bool = False,
             refresh: bool = False) -> bool:
    """Merge NVML facts into inv["gpus"]; at most one NVML query per run. False on fallback.

    Cached facts are used while the GPUs and MIG minors are the same. MIG instances come and go
    without changing either, so:
      - `live_instances`: the caller names MIG devices by index, whose meaning shifts with any
        instance created or destroyed; the cached facts must also list exactly the instances
        that exist now (/proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>/ci<C>, a listing of
        every GPU's tree, so it is only done when needed);
      - `refresh`: the cached facts could not answer (a MIG UUID they do not list, an instance
        created since); ask NVML now, unless this run already did.
    A UUID names one instance for its life, so a request by UUID needs neither check when the
    facts list it; one they do not list gets a fresh answer through `refresh`."""
    state = inv["nvml_state"]
    if state is not None:
        if state != "ok" or not inv.get("nvml_from_cache"):
            return state == "ok"  # a fallback already logged, or NVML already asked this run
        if not refresh and not (live_instances and not _instances_match(inv)):
            return True
        use_cache = False  # the cached facts this run used cannot answer: ask NVML
    else:
        use_cache = not refresh
    ident = _nvml_ident(inv)
    cached: dict = inv.get("nvml_cached") or {}
    facts = None
    from_cache = (use_cache and bool(cached) and cached.get("ident") == ident
                  and (not live_instances or _instances_match(inv)))
    if from_cache:
        facts = cached["facts"]
        log.debug("nvml.cache_hit", reason=reason)
    elif not config["nvml"]["enabled"]:
        return _fallback(inv, log, "disabled", "NVML is disabled in the config ([nvml] enabled)", reason)
    else:
        from . import nvml  # only when NVML must really be asked (pulls in signal, enum)

        lib = nvml.library_path(inv["files"])
        if lib is None:
            return _fallback(inv, log, "missing", "libnvidia-ml.so.1 not found on the host", reason)
        try:
            facts = nvml.probe(lib, config["nvml"]["timeout"])
        except nvml.NvmlUnavailable as e:
            return _fallback(inv, log, "failed", str(e), reason, library=lib)
        log.info("nvml.queried", reason=reason, library=lib, gpus=len(facts["gpus"]))
        inv["nvml_cached"] = {"ident": ident, "instances": procfs.mig_instances(inv["root"]), "facts": facts}
        cache.store(inv["cache_dir"], inv["files"], inv["nvml_cached"])
    _merge(inv, facts, log)
    inv["nvml_state"] = "ok"
    inv["nvml_from_cache"] = from_cache
    log.info("gpus.nvml", count=len(facts["gpus"]), source="nvml", cached=from_cache)
    return True


def _instances_match(inv: dict) -> bool:
    return (inv.get("nvml_cached") or {}).get("instances") == procfs.mig_instances(inv["root"])


def _fallback(inv: dict, log, state: str, error: str, reason: str, **fields) -> bool:
    inv["nvml_state"], inv["nvml_error"] = state, error
    log.warning("nvml.unavailable", reason=reason, state=state, error=error, fallback="procfs", **fields)
    return False


def _merge(inv: dict, facts: dict, log) -> None:
    by_uuid = {g["uuid"].lower(): g for g in facts["gpus"]}
    by_bus = {g["bus_id"]: g for g in facts["gpus"]}
    for g in inv["gpus"]:
        n = by_uuid.get(g["uuid"].lower()) or by_bus.get(g["bus_id"])
        if n is None:
            log.warning("nvml.gpu_unmatched", gpu=g["index"], uuid=g["uuid"], bus_id=g["bus_id"])
            continue
        g.update(brand_id=n["brand_id"], brand=BRAND_NAMES.get(n["brand_id"], f"brand{n['brand_id']}"),
                 cc=n["cc"], mig_mode=n["mig_mode"], migs=n["migs"], source="nvml")
        if n["model"] and n["model"] != g["model"]:
            g["model"] = n["model"]
    inv["gpu_source"] = "nvml"
    if facts.get("cuda"):
        inv["driver"]["cuda"] = facts["cuda"]
        inv["driver"]["cuda_source"] = "nvml"
