"""`enable-cuda-compat [--host-driver-version V] [--host-cuda-version V]
[--cuda-compat-container-root DIR]`: the image's compat libcuda first on the loader's path
(a drop-in in its /etc/ld.so.conf.d, apply/ldconfdropin.py) when nvhook's per-GPU decision
(decide/compat.py) says so; NVIDIA's cmd/nvidia-cdi-hook/cudacompat."""

from __future__ import annotations

import os

from .hookargs import DEFAULTS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def gpus_of_container(state: dict, cfg: dict, log) -> tuple[dict, list]:
    """The host inventory and the GPUs whose nodes the runtime put into config.json."""
    from ...decide import cdimodel as cdi
    from ...decide import plan as plan_mod
    from ...observe import host, oci

    bundle = oci.load_bundle(state["bundle"])
    caps = ["compute", "utility"]
    inv = host.observe(cfg.get("root") or "/", cfg["cache_dir"], log, capabilities=caps)
    req, _unknown = cdi.request_from_devices(bundle["devices"], inv, caps)
    selected, migs = plan_mod.select(req, inv["gpus"], inv["files"]["mig_minors"])
    gpus = selected + [m["gpu"] for m in migs if m["gpu"] not in selected]
    return {"inv": inv, "bundle": bundle}, gpus


def run(opts: dict, entry: Entry, out: Out) -> None:
    """NVIDIA's hook adds the image's compat directory to the loader's path when the compat
    libcuda's major is above the host driver's; nvhook's decision also asks whether every GPU
    the container got can use forward compatibility (no error 804 on GeForce). Where nvhook
    cannot observe the host (no driver under its root), NVIDIA's rule with the spec's versions
    (decide/compat.decide_by_versions), with a warning: never a failed start NVIDIA's passes."""
    if not opts.get("host-driver-version") and not opts.get("host-cuda-version"):
        return  # NVIDIA's hook: a no-op without either version
    from ...base.errors import HookError

    try:
        facts, gpus = gpus_of_container(entry.state, entry.cfg, entry.log)
    except HookError as e:
        decision = by_versions(opts, entry, out, e.message)
    else:
        decision = observed(opts, entry, out, facts, gpus)
    if decision["decision"] != "image" or not decision["libraries"]:
        out.say("debug", decision["reason"])
        return
    from ...apply.ldconfdropin import write_conf

    compat_dir = decision["libraries"][0].rsplit("/", 1)[0]
    write_conf(entry.root, "/etc/ld.so.conf.d", "00-compat-nvhook.conf", compat_dir + "\n")
    out.say("debug", f"{decision['reason']}: {compat_dir} added to the loader's path")


def observed(opts: dict, entry: Entry, out: Out, facts: dict, gpus: list) -> dict:
    """nvhook's decision, with the host's driver and the container's GPUs."""
    from ...decide import compat
    from ...observe import host, image

    cfg, log = entry.cfg, entry.log
    inv = facts["inv"]
    host_version = inv["driver"].get("version") or opts.get("host-driver-version")
    candidates = image.find_compat_libs(entry.rootfs, host_version, compat_root(opts))
    mode, _src, refused = compat.mode_from_env(facts["bundle"]["env"], cfg["compat"]["mode"],
                                               cfg["compat"]["allow_env_override"])
    if compat.needs_gpu_brands(["compute"], host_version, [c for c in candidates if not c.get("skipped")], mode):
        host.add_nvml(inv, cfg, log, reason="forward-compat decision needs GPU brands")
    decision: dict = compat.decide(["compute", "utility"], host_version, gpus, candidates, mode)
    log.event("compat.decision", "info", **decision.get("event", {}))
    for w in decision.get("warnings") or []:
        out.say("warning", w)
    return decision


def by_versions(opts: dict, entry: Entry, out: Out, why: str) -> dict:
    """NVIDIA's rule, from the versions the spec gives, where the host cannot be observed."""
    from ...base.errors import HookError
    from ...decide import compat
    from ...observe import image, oci

    cfg, log = entry.cfg, entry.log
    driver, cuda = opts.get("host-driver-version") or None, opts.get("host-cuda-version") or None
    mode = cfg["compat"]["mode"]
    try:
        env = oci.load_bundle(entry.state["bundle"])["env"]
    except HookError:
        env = {}  # the container's own NVHOOK_COMPAT_MODE unread: the config's mode
    mode, _src, _refused = compat.mode_from_env(env, mode, cfg["compat"]["allow_env_override"])
    # "0": every libcuda's note is read (NVIDIA's rule looks at the note whatever the versions)
    candidates = image.find_compat_libs(entry.rootfs, driver or "0", compat_root(opts))
    decision: dict = compat.decide_by_versions(driver, cuda, candidates, mode)
    message = (f"nvhook cannot observe the host driver ({why}): enable-cuda-compat decided by NVIDIA's rule "
               f"from the spec's versions, without checking the GPUs: {decision['reason']}")
    log.warning("compat.host_unobserved", reason=why, host_driver=driver, host_cuda=cuda,
                decision=decision["decision"], rule=decision["reason"])
    log.event("compat.decision", "info", **decision["event"])
    out.say("warning", message)
    return decision


def compat_root(opts: dict) -> str | None:
    """The compat directory `--cuda-compat-container-root` names, as a container path (NVIDIA
    joins it to the rootfs, so a relative one is taken from /), or None for NVIDIA's default:
    then nvhook looks where it always does, /usr/local/cuda/compat and the
    /usr/local/cuda-X.Y/compat that /usr/local/cuda names (NVIDIA's default reaches the same
    directory through that link)."""
    value = opts.get("cuda-compat-container-root", DEFAULTS["cuda-compat-container-root"])
    path = os.path.normpath("/" + value)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return None if path == DEFAULTS["cuda-compat-container-root"] else path
