"""observe -> decide: from a container to a plan, with every decision logged.

`decide(source, host, options)` is the one model for every front door (decide/sources.py):
hook mode and nvhookd's child (which then apply the plan), nvhook-runtime (which writes it
into config.json), nvhook's CDI hook, the NRI plugin, --dry-run (which prints it) and doctor
(`explain`, which explains it). Imports
are kept to what a run needs: pyelftools, pynvml and the apply layer load only when used.
"""

from __future__ import annotations

import os
import time

from ..base.errors import HookError, short, show
from ..base.rootpath import resolve
from ..decide import request as request_mod
from ..decide.sources import CdiDevices, Decision, Host, NriContainer, OciBundle, Options
from ..observe import oci

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from ..decide.sources import Source
    from ..decide.types import Container, Driver, Plan


def observe_image(rootfs: str, capabilities: list[str], driver_version: str, log) -> dict:
    """Facts about the container image that decisions need."""
    debian = (resolve(rootfs, "/etc/debian_version") is not None
              or resolve(rootfs, "/usr/lib/x86_64-linux-gnu") is not None)
    facts: dict = {"debian": debian, "compat_libs": [], "compat_skipped": []}
    if "compute" in capabilities:
        from ..observe import image

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
    from ..decide.cuda_releases import max_cuda_for_driver

    cuda = max_cuda_for_driver(inv["driver"]["version"])
    inv["driver"]["cuda"] = cuda
    inv["driver"]["cuda_source"] = "release table"
    return cuda


def check_requirements(req: dict, inv: dict, selected: list[dict], config: dict, log) -> None:
    if not req["requirements"]:
        return
    from ..decide import requirements
    from ..observe import host

    facts = {"driver": inv["driver"]["version"], "cuda": cuda_for(inv)}
    for source, expr in zip(req["requirement_sources"], req["requirements"]):
        parsed = requirements.parse(expr, source)
        if (requirements.uses_gpu_facts(parsed) and selected
                and not requirements.alternatives_without_gpu_facts_hold(parsed, facts)):
            host.add_nvml(inv, config, log, reason=f"{source} checks arch/brand")
        if not requirements.satisfied(parsed, facts, selected):
            gpus = ", ".join(f"{g['index']}: {g['model']} brand={g.get('brand') or '?'} arch={g.get('cc') or '?'}"
                             for g in selected)
            gpus = gpus if requirements.uses_gpu_facts(parsed) else ""  # only when it is about them
            raise HookError(f"unsatisfied requirement {source}={short(expr)}: host driver {facts['driver']} "
                            f"supports CUDA {facts['cuda'] or 'unknown'}" + (f"; GPUs {gpus}" if gpus else "")
                            + " (set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
        log.debug("requirement.ok", source=source, expression=expr)


def create_missing_nodes(req: dict, inv: dict, root: str, selected: list[dict], selected_migs: list[dict],
                         log, before_change=None) -> None:
    """devices.create_missing_nodes: make the nodes this request needs that the driver left to
    nvidia-modprobe (uvm, MIG capabilities, IMEX channels), then add what is there now to the
    inventory, each checked to be the character device it should be. `before_change()`, when
    given, is called before the first node is made (nvhookd's gate: nothing changes on the host
    for a client that left before `go` and runs the hook itself)."""
    from ..decide import nodes, plan
    from ..observe.host import procfs

    files = inv["files"]
    majors = procfs.char_majors(root)
    managed = plan.mig_management_gpus(req, selected, selected_migs)
    names = [n for n, _ in plan.mig_access_names(selected_migs)] + ["config", "monitor"]
    wanted = nodes.missing(req, files, req["capabilities"], selected_migs, managed, majors,
                           procfs.device_file_owner(root), procfs.capability_modes(root, names))
    if not wanted:
        return
    if before_change is not None:
        before_change()
    from ..apply import hostnodes
    from ..observe.host import inventory

    results = {r["path"]: r for r in hostnodes.create(root, wanted)}
    files["devices"] = list(files["devices"])
    for n in wanted:
        r = results[n["path"]]
        if r["result"] == "error":
            log.warning("device.create_failed", device=n["path"], error=r["error"])
            continue
        dev = inventory.chardev(root, n["path"])
        if not dev or "error" in dev or (dev["major"], dev["minor"]) != (n["major"], n["minor"]):
            # Not what nvhook made or meant (a link, a file, another device): not used.
            log.warning("device.unexpected", device=n["path"], want=f"{n['major']}:{n['minor']}",
                        found=(f"{dev['major']}:{dev['minor']}" if dev and "error" not in dev else
                               (dev or {}).get("error", "missing")))
            continue
        dev["role"] = n["role"]
        if "cap_name" in n:
            dev["cap_name"] = n["cap_name"]
        files["devices"].append(dev)
        log.info("device.created" if r["result"] == "created" else "device.found", device=n["path"],
                 major=n["major"], minor=n["minor"], mode=oct(dev["mode"]))


def decide(source: Source, host: Host, options: Options | None = None) -> Decision:
    """The plan for the container that `source` describes (decide/sources.py: an OCI bundle, an
    NRI container, or the devices a CDI spec gave a container), on `host`, within `options`,
    with every decision logged. Raises HookError where the container must not start."""
    options = options or Options()
    decision = Decision(options.phases)
    _decide(source, host, options, decision)
    return decision


def explain(source: Source, host: Host, options: Options | None = None) -> tuple[Decision, str | None]:
    """decide for `nvhook doctor`: a refusal comes back as its message, with the facts known by
    then (decision.facts), so that the outcome is explained also where the container would not
    start; decision.plan is set only where it would."""
    options = options or Options()
    decision = Decision(options.phases)
    try:
        _decide(source, host, options, decision)
    except HookError as e:
        return decision, e.message
    return decision, None


def _decide(source: Source, host: Host, options: Options, decision: Decision) -> None:
    if isinstance(source, CdiDevices):
        decision.plan = _decide_cdi(source, host, options, decision)
        return
    t0 = time.perf_counter()
    log, config = host.log, host.config
    facts = decision.facts
    # An NRI container has no bundle yet: the plugin decoded the same facts from its request.
    bundle = source.bundle_facts() if isinstance(source, NriContainer) else oci.load_bundle(source.bundle)
    facts["bundle"] = bundle
    container: Container = {"id": source.id, "pid": source.pid, "rootfs": bundle["rootfs"]}
    log.bind(container=source.id)
    req = source.request if isinstance(source, NriContainer) and source.request is not None else \
        request_mod.parse(bundle["env"], privileged=bundle["privileged"], mounts=bundle["mounts"], config=config,
                          annotations=bundle["annotations"])
    log.info("request", kind=req["kind"], devices=req["devices"], capabilities=req["capabilities"],
             requirements=req["requirements"], source=req["devices_source"], privileged=req["privileged"],
             reason=req["reason"] or None)
    for note in req.get("notes", []):
        log.warning("request.ignored", message=note)
    facts["request"] = req
    if req["kind"] == "skip":
        from ..observe.host import procfs

        driver: Driver = {"version": procfs.driver_version(host.root), "cuda": None}
        decision.phases["decide_ms"] = (time.perf_counter() - t0) * 1000
        decision.plan = request_mod.empty_plan(container, {"devices": [], "capabilities": req["capabilities"],
                                                           "requirements": req["requirements"]}, driver, req["reason"])
        return
    if options.on_gpu_request is not None:
        options.on_gpu_request()
    from ..decide import plan  # these two: not for a container that asks for no GPU
    from ..observe import host as node

    caps = plan.expand_capabilities(req["capabilities"])
    inv = node.observe(host.root, config["cache_dir"], log, capabilities=caps)
    facts.update(inventory=inv, capabilities=caps)
    t1 = time.perf_counter()
    decision.phases["discover_ms"] = (t1 - t0) * 1000
    selected, selected_migs = _select(req, inv, host)
    facts["selected"] = selected + [m["gpu"] for m in selected_migs if m["gpu"] not in selected]
    check_requirements(req, inv, selected + [m["gpu"] for m in selected_migs], config, log)
    if config["devices"]["create_missing_nodes"] and options.change_host:
        create_missing_nodes(req, inv, host.root, selected, selected_migs, log, options.before_change)
    # Where the image cannot be read yet (an NRI container at CreateContainer), the plan is
    # for any image, the libraries in their host directories, as a CDI spec's.
    image = _spec_image(inv) if bundle["rootfs"] is None else None
    decision.plan = _plan(container, req, bundle, inv, host, decision, t1, selected, selected_migs, image)


def _select(req: dict, inv: dict, host: Host) -> tuple[list, list]:
    """The GPUs and MIG devices the request names, asking NVML where /proc cannot tell."""
    from ..decide import plan
    from ..observe import host as node

    config, log = host.config, host.log
    if plan.needs_mig_facts(req):
        if not node.add_nvml(inv, config, log, reason="MIG device requested",
                             live_instances=plan.uses_mig_indices(req)):
            raise HookError(f"MIG devices were requested but NVML is unavailable ({inv['nvml_error']}), so MIG "
                            f"ids cannot be resolved (NVIDIA_VISIBLE_DEVICES={','.join(req['devices'])})")
    instances: list[str] = []
    if req["devices"] == ["all"] or req.get("mig_config") or req.get("mig_monitor"):
        # `all` brings every MIG device that exists now; MIG management brings the live
        # instances' capability files. The driver's capability tree says which exist.
        from ..observe.host import procfs

        instances = procfs.mig_instances(host.root)
        inv["mig_instances"] = instances
    if req.get("mig_config") or req.get("mig_monitor"):
        node.add_nvml(inv, config, log, reason="MIG management is granted only on MIG-capable GPUs")
    try:
        return plan.select(req, inv["gpus"], inv["files"]["mig_minors"], instances)
    except plan.UnknownMig:
        # Cached facts from before that instance was created: NVML answers for now (once).
        if not node.add_nvml(inv, config, log, reason="MIG device not in the cached NVML facts", refresh=True):
            raise
        return plan.select(req, inv["gpus"], inv["files"]["mig_minors"], instances)


def _spec_image(inv: dict) -> dict:
    from ..decide import cdimodel

    return cdimodel.spec_image(inv["files"])


def _plan(container: Container, req: dict, bundle: dict, inv: dict, host: Host, decision: Decision, t1: float,
          selected: list, selected_migs: list, image: dict | None) -> Plan:
    """The rest of a decision once the GPUs are selected: the image (observed now unless
    given), forward compat, the plan."""
    from ..decide import plan
    from ..observe import host as node

    config, log = host.config, host.log
    caps = plan.expand_capabilities(req["capabilities"])
    if image is None:
        image = observe_image(bundle["rootfs"], caps, inv["driver"]["version"], log)

    from ..decide import compat

    mode, mode_source, refused = compat.mode_from_env(bundle["env"], config["compat"]["mode"],
                                                      config["compat"]["allow_env_override"])
    if refused:
        log.warning("compat.override_refused", message=refused)
    gpus_for_compat = selected + [m["gpu"] for m in selected_migs if m["gpu"] not in selected]
    if compat.needs_gpu_brands(caps, inv["driver"]["version"], image["compat_libs"], mode):
        node.add_nvml(inv, config, log, reason="forward-compat decision needs GPU brands")
    # decide() ignores skipped candidates but reports them in its event.
    choice = compat.decide(caps, inv["driver"]["version"], gpus_for_compat,
                           image["compat_libs"] + image["compat_skipped"], mode)
    decision.facts.update(mode=mode, compat=choice, image=image)
    level = "warning" if choice.get("warnings") else "info"
    fields = dict(choice["event"], mode=mode, mode_source=mode_source, reason=choice["reason"],
                  warnings=choice.get("warnings") or None)
    log.event("compat.decision", level, **fields)
    cuda_for(inv)
    result = plan.build(container, req, inv, image, config, choice, selected, selected_migs)
    if result["devices_cgroup"]:
        # The mode the apply step will act in (one statfs; apply.cgroups is loaded for it anyway).
        from ..apply.cgroups import ACTIONS, cgroup_mode

        mode = cgroup_mode()
        result["cgroup"] = {"mode": mode, "action": ACTIONS[mode]}
    decision.phases["decide_ms"] = (time.perf_counter() - t1) * 1000
    log.info("plan", mounts=len(result["mounts"]), symlinks=len(result["symlinks"]),
             devices=len(result["devices_cgroup"]), gpus=[g["index"] for g in result["gpus"]],
             compat=result["compat"]["decision"])
    return result


def _decide_cdi(source: CdiDevices, host: Host, options: Options, decision: Decision) -> Plan:
    """The plan for a container whose devices a CDI spec of nvhook's gave it: the GPUs are the
    ones whose nodes the runtime put into config.json (linux.devices), the capabilities the
    spec's. The caller keeps only the in-container part (decide.edits.in_container_plan): the
    runtime made the rest."""
    t0 = time.perf_counter()
    log, config = host.log, host.config
    state = source.bundle
    bundle = oci.load_bundle(state.bundle)
    decision.facts["bundle"] = bundle
    container: Container = {"id": state.id, "pid": state.pid, "rootfs": bundle["rootfs"]}
    log.bind(container=state.id)
    # This hook mounts in its own mount namespace (createContainer): it must be the container's.
    why = oci.foreign_mount_namespace(bundle["rootfs"], bundle["mounts"])
    if why is not None:
        raise HookError(f"the createContainer hook does not run in the container's mount namespace ({why}): "
                        "nothing was mounted; this runtime does not run createContainer hooks where the OCI spec "
                        "says: use a prestart or createRuntime hook with it")
    caps = request_mod.capabilities(source.capabilities, False)
    if options.on_gpu_request is not None:
        options.on_gpu_request()
    from ..decide import cdimodel, plan
    from ..observe import host as node

    inv = node.observe(host.root, config["cache_dir"], log, capabilities=plan.expand_capabilities(caps))
    t1 = time.perf_counter()
    decision.phases["discover_ms"] = (t1 - t0) * 1000
    if cdimodel.has_mig_nodes(bundle["devices"], inv["files"]):
        node.add_nvml(inv, config, log, reason="MIG device given by the CDI spec", live_instances=True)
    req, unknown = cdimodel.request_from_devices(bundle["devices"], inv, caps)
    if unknown and node.add_nvml(inv, config, log, reason="MIG device not in the cached NVML facts", refresh=True):
        req, unknown = cdimodel.request_from_devices(bundle["devices"], inv, caps)
    if unknown:
        raise HookError(f"the runtime gave the container MIG device(s) {', '.join(unknown)} that NVML does not "
                        f"list ({inv['nvml_error'] or 'no such instance'}); regenerate the CDI spec")
    log.info("request", kind=req["kind"], devices=req["devices"], capabilities=req["capabilities"],
             requirements=[], source="cdi linux.devices", privileged=bundle["privileged"], reason=None)
    decision.facts.update(request=req, inventory=inv, capabilities=plan.expand_capabilities(caps))
    selected, selected_migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
    decision.facts["selected"] = selected + [m["gpu"] for m in selected_migs if m["gpu"] not in selected]
    image = observe_image(bundle["rootfs"], plan.expand_capabilities(caps), inv["driver"]["version"], log)
    image["libdirs"] = cdimodel.spec_libdirs(inv["files"])
    return _plan(container, req, bundle, inv, host, decision, t1, selected, selected_migs, image)


def asks_for_gpu(source: OciBundle | CdiDevices, config: dict | None = None, config_path: str | None = None) -> bool:
    """Whether the container asks for the driver (a GPU, or `none`: the driver without one),
    decided from the state and bundle alone, before anything that depends on the host root, the
    cache or the log: a container that asks for nothing starts whatever is wrong with those.

    `config`: the config in force, when it could be read. None: it could not, so the request
    is read as under any config could make it one: the defaults, volume-mount device lists and
    unprivileged requests accepted, and the `volume_mounts_root` and `swarm_resource` that a
    line scan of the broken file (`config_path`) finds. A broken config then stops the
    containers it might have served (with its error) and no other.

    A CdiDevices source (nvhook's CDI hook, which runs only in containers that nvhook's spec
    gave devices) asks unless the runtime gave it no NVIDIA device node at all."""
    state = source.bundle if isinstance(source, CdiDevices) else source
    try:
        bundle = oci.load_bundle(state.bundle)
    except HookError:
        return True  # not readable either: the config's or the root's error is the one to report
    if isinstance(source, CdiDevices):
        return any(str(d.get("path", "")).startswith("/dev/nvidia") for d in bundle["devices"])
    if config is None:
        config = permissive_config(config_path)
    try:
        req = request_mod.parse(bundle["env"], privileged=bundle["privileged"], mounts=bundle["mounts"],
                                config=config, annotations=bundle["annotations"])
    except HookError:
        return True
    return req["kind"] != "skip"


def permissive_config(config_path: str | None) -> dict:
    """The defaults with every request source that a config could turn on turned on, and the
    request keys a line scan of the (unparsable) file at `config_path` finds."""
    from ..base.config import DEFAULTS
    from ..base.configscan import scan_key

    devices = dict(DEFAULTS["devices"], accept_volume_mounts=True, accept_envvar_unprivileged=True)
    request = dict(DEFAULTS["request"])
    if config_path:
        root = scan_key(config_path, "devices", "volume_mounts_root")
        if root and root.startswith("/"):
            devices["volume_mounts_root"] = root
        swarm = scan_key(config_path, "request", "swarm_resource")
        if swarm and all(c.isascii() and (c.isalnum() or c in "_-., ") for c in swarm):
            request["swarm_resource"] = swarm
    return dict(DEFAULTS, devices=devices, request=request)


def root_from(cli_root: str | None, config: dict) -> str:
    root = cli_root or config["root"] or "/"
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise HookError(f"host root {show(root)} is not a directory")
    return root
