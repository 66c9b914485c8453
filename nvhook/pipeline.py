"""observe -> decide: from the container's state to a plan, with every decision logged.

Shared by hook mode (which then applies the plan) and --dry-run (which prints it). Imports
are kept to what a run needs: pyelftools, pynvml and the apply layer load only when used.
"""

from __future__ import annotations

import os
import time

from .observe import oci
from .decide import plan, request as request_mod
from .base.errors import HookError, short, show
from .base.rootpath import resolve


def observe_image(rootfs: str, capabilities: list[str], driver_version: str, log) -> dict:
    """Facts about the container image that decisions need."""
    debian = (resolve(rootfs, "/etc/debian_version") is not None
              or resolve(rootfs, "/usr/lib/x86_64-linux-gnu") is not None)
    facts = {"debian": debian, "compat_libs": [], "compat_skipped": []}
    if "compute" in capabilities:
        from .observe import image

        found = image.find_compat_libs(rootfs, driver_version)
        facts["compat_libs"] = [c for c in found if not c.get("skipped")]
        facts["compat_skipped"] = [c for c in found if c.get("skipped")]
        for c in facts["compat_skipped"]:
            log.warning("compat.skipped", path=c.get("container_path"), reason=c.get("skipped"))
    log.debug("image.observed", rootfs=rootfs, family="debian" if debian else "other",
              compat_libs=[c["container_path"] for c in facts["compat_libs"]])
    return facts


def cuda_for(inv: dict) -> str | None:
    if inv["driver"]["cuda"]:
        return inv["driver"]["cuda"]
    from .decide.cuda_releases import max_cuda_for_driver

    cuda = max_cuda_for_driver(inv["driver"]["version"])
    inv["driver"]["cuda"] = cuda
    inv["driver"]["cuda_source"] = "release table"
    return cuda


def check_requirements(req: dict, inv: dict, selected: list[dict], config: dict, log) -> None:
    from .observe import host
    from .decide import requirements

    facts = {"driver": inv["driver"]["version"], "cuda": cuda_for(inv)}
    for source, expr in zip(req["requirement_sources"], req["requirements"]):
        parsed = requirements.parse(expr, source)
        if requirements.uses_gpu_facts(parsed) and selected and not requirements.alternatives_without_gpu_facts_hold(parsed, facts):
            host.add_nvml(inv, config, log, reason=f"{source} checks arch/brand")
        if not requirements.satisfied(parsed, facts, selected):
            gpus = ", ".join(f"{g['index']}: {g['model']} brand={g.get('brand') or '?'} arch={g.get('cc') or '?'}"
                             for g in selected)
            raise HookError(f"unsatisfied requirement {source}={short(expr)}: host driver {facts['driver']} "
                            f"supports CUDA {facts['cuda'] or 'unknown'}" + (f"; GPUs {gpus}" if gpus else "")
                            + " (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
        log.debug("requirement.ok", source=source, expression=expr)


def decide(state: dict, config: dict, root: str, log, phases: dict, on_gpu_request=None) -> dict:
    """The plan for the container in `state`. `on_gpu_request()`, when given, is called once the
    request is known to need the driver, before the host is observed: the hook starts its
    apply worker there, so that the worker's imports overlap the decision."""
    t0 = time.perf_counter()
    bundle = oci.load_bundle(state["bundle"])
    container = {"id": state["id"], "pid": state["pid"], "rootfs": bundle["rootfs"]}
    log.bind(container=state["id"])
    req = request_mod.parse(bundle["env"], privileged=bundle["privileged"], mounts=bundle["mounts"], config=config,
                            annotations=bundle["annotations"])
    log.info("request", kind=req["kind"], devices=req["devices"], capabilities=req["capabilities"],
             requirements=req["requirements"], source=req["devices_source"], privileged=req["privileged"],
             reason=req["reason"] or None)
    if req["kind"] == "skip":
        from .observe.host import procfs

        driver = {"version": procfs.driver_version(root), "cuda": None}
        phases["decide_ms"] = (time.perf_counter() - t0) * 1000
        return plan.empty_plan(container, {"devices": [], "capabilities": req["capabilities"],
                                           "requirements": req["requirements"]}, driver, req["reason"])

    if on_gpu_request is not None:
        on_gpu_request()
    from .observe import host  # not needed by containers that asked for nothing

    inv = host.observe(root, config["cache_dir"], log)
    t1 = time.perf_counter()
    phases["discover_ms"] = (t1 - t0) * 1000
    if plan.needs_mig_facts(req):
        if not host.add_nvml(inv, config, log, reason="MIG device requested",
                             live_instances=plan.uses_mig_indices(req)):
            raise HookError(f"MIG devices were requested but NVML is unavailable ({inv['nvml_error']}), so MIG "
                            f"ids cannot be resolved (NVIDIA_VISIBLE_DEVICES={','.join(req['devices'])})")
    try:
        selected, selected_migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
    except plan.UnknownMig:
        # Cached facts from before that instance was created: NVML answers for now (once).
        if not host.add_nvml(inv, config, log, reason="MIG device not in the cached NVML facts", refresh=True):
            raise
        selected, selected_migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
    check_requirements(req, inv, selected + [m["gpu"] for m in selected_migs], config, log)

    caps = plan.expand_capabilities(req["capabilities"])
    image = observe_image(bundle["rootfs"], caps, inv["driver"]["version"], log)

    from .decide import compat

    mode, mode_source, refused = compat.mode_from_env(bundle["env"], config["compat"]["mode"],
                                                      config["compat"]["allow_env_override"])
    if refused:
        log.warning("compat.override_refused", message=refused)
    gpus_for_compat = selected + [m["gpu"] for m in selected_migs if m["gpu"] not in selected]
    if compat.needs_gpu_brands(caps, inv["driver"]["version"], image["compat_libs"], mode):
        host.add_nvml(inv, config, log, reason="forward-compat decision needs GPU brands")
    # decide() ignores skipped candidates but reports them in its event.
    decision = compat.decide(caps, inv["driver"]["version"], gpus_for_compat,
                             image["compat_libs"] + image["compat_skipped"], mode)
    level = "warning" if decision.get("warnings") else "info"
    fields = dict(decision["event"], mode=mode, mode_source=mode_source, reason=decision["reason"],
                  warnings=decision.get("warnings") or None)
    log.event("compat.decision", level, **fields)
    cuda_for(inv)
    result = plan.build(container, req, inv, image, config, decision, selected, selected_migs)
    if result["devices_cgroup"]:
        # The mode the apply step will act in (one statfs; apply.cgroups is loaded for it anyway).
        from .apply.cgroups import ACTIONS, cgroup_mode

        mode = cgroup_mode()
        result["cgroup"] = {"mode": mode, "action": ACTIONS[mode]}
    phases["decide_ms"] = (time.perf_counter() - t1) * 1000
    log.info("plan", mounts=len(result["mounts"]), symlinks=len(result["symlinks"]),
             devices=len(result["devices_cgroup"]), gpus=[g["index"] for g in result["gpus"]],
             compat=result["compat"]["decision"])
    return result


def root_from(cli_root: str | None, config: dict) -> str:
    root = cli_root or config["root"] or "/"
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise HookError(f"host root {show(root)} is not a directory")
    return root
