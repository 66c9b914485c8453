"""`nvhook doctor`: why a GPU container fails (or will work), on one screen.

It puts side by side what the driver offers (host driver version and the newest CUDA it
supports), what the image needs (its CUDA runtime and that runtime's minimum drivers), the
image's forward-compatibility libraries, the compat decision nvhook makes for it, and, for each
selected GPU, the predicted outcome:

  works               the runtime's driver requirement is met (possibly through CUDA minor
                      version compatibility, or through forward compatibility on a GPU that
                      supports it)
  error-804           a compat libcuda newer than the kernel module on a GPU that cannot use
                      forward compatibility (cudaErrorCompatNotSupportedOnDevice)
  error-803           a compat libcuda that does not match the kernel module: older than it, or
                      built for other driver branches (cudaErrorSystemDriverMismatch)
  needs-newer-driver  the runtime needs a newer driver than the libcuda it gets
                      (cudaErrorInsufficientDriver, 35); says whether the GPU could use
                      forward compatibility and what to do
  unknown             no CUDA runtime found, or a release newer than our table

Interactive: imports and costs do not matter here. `diagnose` returns a JSON-able dict
(`--format json` prints it as is); `render_text` formats it for a terminal.
"""

from __future__ import annotations

from ..base import rootpath, versions
from ..base.catalog import DEFAULT_CAPABILITIES
from ..base.errors import HookError
from ..decide import compat, cuda_releases
from ..observe import image

ERROR_35 = "CUDA error 35 (cudaErrorInsufficientDriver)"


def _cmp(a: str | None, b: str | None) -> int | None:
    if a is None or b is None:
        return None
    try:
        return versions.compare(a, b)
    except (ValueError, TypeError, AttributeError):
        return None


def _forced_compat(rootfs: str, env: dict, candidates: list[dict]) -> dict | None:
    """A compat libcuda the image loads by itself: its compat directory is in LD_LIBRARY_PATH,
    which the dynamic linker searches before ld.so.cache, whatever nvhook decides."""
    entries = [p for p in (env.get("LD_LIBRARY_PATH") or "").split(":") if p.startswith("/")]
    usable = [c for c in candidates if not c.get("skipped") and c.get("library") == "libcuda"]
    for p in entries:
        inside = rootpath.resolve(rootfs, p)
        if inside is None:
            continue
        here = [c for c in usable if c["container_path"].rpartition("/")[0] == inside]
        if here:
            best = max(here, key=lambda c: versions.parse_version(c["version"]))
            return dict(best, ld_library_path_entry=p)
    return None


def _runtime_check(eff: str | None, eff_label: str, runtime: str | None, release: str | None,
                   mins: tuple[str, str] | None) -> tuple[str, str, str | None]:
    """(outcome, detail, how) of a CUDA runtime on the libcuda version `eff`; how is "full" or
    "minor-version-compat" when it works, else None."""
    if runtime is None:
        return "unknown", "no CUDA runtime found in the image (no libcudart, no CUDA_VERSION): nothing to check", None
    if mins is None:
        if _cmp(release, cuda_releases.known_newest()) == 1:
            return "unknown", (f"CUDA {release} is newer than nvhook's release table "
                               f"(up to {cuda_releases.known_newest()}): its minimum driver is unknown"), None
        return "works", f"CUDA {release} is older than every supported driver's minimum", "full"
    minor, full = mins
    order = _cmp(eff, full)
    if order is None:
        return ("unknown", f"{eff_label} version {eff!r} unknown: cannot compare with CUDA {release}'s minimum "
                f"{full}", None)
    if order >= 0:
        return "works", f"CUDA {release} needs driver >= {full}; {eff_label} {eff} meets it", "full"
    if (_cmp(eff, minor) or 0) >= 0:
        return "works", (f"CUDA {release} runs on {eff_label} {eff} through minor version compatibility "
                         f"(>= {minor}); features that need driver >= {full} are unavailable and PTX "
                         f"newer than the driver cannot be JIT-compiled"), "minor-version-compat"
    return "needs-newer-driver", (f"CUDA {release} needs driver >= {minor} (>= {full} for every feature); "
                                  f"{eff_label} is {eff}: {ERROR_35}"), None


def _predict(g: dict, driver: str | None, max_cuda: str | None, runtime: str | None, release: str | None,
             mins: tuple[str, str] | None, libcuda: dict, best: dict | None, decision: dict,
             mode: str) -> dict:
    """The predicted outcome for one GPU (g: compat.gpu_support output)."""
    out = {"index": g["index"], "model": g["model"], "brand": g["brand"], "brand_source": g["brand_source"],
           "forward_compat": g["supported"], "outcome": "", "label": "", "detail": "", "fix": [],
           "via": None}
    name = g["model"] or f"GPU {g['index']}"
    if libcuda["from"] != "host":
        c = libcuda["candidate"]
        ver = c["version"]
        how = ("loaded through LD_LIBRARY_PATH" if libcuda["from"] == "LD_LIBRARY_PATH"
               else "chosen by nvhook")
        undo = ([f"remove {c['ld_library_path_entry']} from the image's LD_LIBRARY_PATH"]
                if libcuda["from"] == "LD_LIBRARY_PATH"
                else [f"run with {compat.ENV_VAR}=auto or host (or compat.mode = \"auto\" in the config)"])
        order = _cmp(ver, driver)
        note = c.get("note") or {}
        if order is not None and order < 0:
            out.update(outcome="error-803", label="error 803 (cudaErrorSystemDriverMismatch)",
                       detail=f"compat libcuda {ver} ({how}) is older than the kernel module {driver}",
                       fix=undo)
            return out
        if order and order > 0 and driver is not None:  # order is None when driver is
            if note.get("Driver") and versions.branch(driver) not in note["Driver"]:
                listed = ", ".join(str(d) for d in note["Driver"])
                out.update(outcome="error-803", label="error 803 (cudaErrorSystemDriverMismatch)",
                           detail=(f"compat libcuda {ver} ({how}) supports driver branches {listed}, "
                                   f"not {versions.branch(driver)}"),
                           fix=undo + [f"use an image whose compat package lists branch {versions.branch(driver)}"])
                return out
            if not g["supported"]:
                fix = undo + [f"upgrade the host driver to >= {mins[1]}" if mins else "upgrade the host driver",
                              "use a data-center GPU (they support forward compatibility)"]
                out.update(outcome="error-804", label="error 804 (cudaErrorCompatNotSupportedOnDevice)",
                           detail=(f"compat libcuda {ver} ({how}) is newer than the kernel module {driver} "
                                   f"and {name} (brand {g['brand']}) cannot use forward compatibility"),
                           fix=fix)
                return out
            cap = str(note.get("CUDA Version") or cuda_releases.max_cuda_for_driver(ver) or "?")
            outcome, detail, how_ok = _runtime_check(ver, "compat libcuda", runtime, release, mins)
            out.update(outcome=outcome, label=outcome.replace("-", " "),
                       via="forward-compat" if how_ok else None,
                       detail=f"forward compatibility: compat libcuda {ver} (CUDA {cap}) on kernel module "
                              f"{driver}; " + detail)
            if outcome == "needs-newer-driver" and mins is not None:
                out["label"] = "runtime needs a newer driver than the image's compat libcuda"
                out["fix"] = [f"use an image whose compat package matches its CUDA {release} runtime",
                              f"upgrade the host driver to >= {mins[1]}"]
            return out
    # The host's libcuda.
    outcome, detail, how_ok = _runtime_check(driver, "host driver", runtime, release, mins)
    out.update(outcome=outcome, label=outcome.replace("-", " "), detail=detail, via=how_ok)
    if outcome != "needs-newer-driver" or mins is None:  # only a known minimum makes it "newer"
        return out
    upgrade = f"upgrade the host driver to >= {mins[1]} (>= {mins[0]} is the least that runs CUDA {release})"
    older = f"use an image with CUDA <= {max_cuda}" if max_cuda else "use an image with an older CUDA"
    if not g["supported"]:
        out["label"] = "runtime needs a newer driver and this GPU cannot use forward compat"
        out["fix"] = [upgrade, older, "use a data-center GPU (forward compatibility)"]
    elif best is not None:
        out["label"] = "runtime needs a newer driver; the image's compat libcuda could provide it but is not used"
        out["detail"] += (f"; the image's compat libcuda {best['version']} is not used "
                          f"({decision['reason_code']})")
        fix = [upgrade, older]
        if mode == "host":
            fix.insert(0, f"allow forward compatibility: {compat.ENV_VAR}=auto (or compat.mode = \"auto\")")
        out["fix"] = fix
    else:
        out["label"] = "runtime needs a newer driver; this GPU could use forward compat"
        out["fix"] = [upgrade, older,
                      f"add NVIDIA's cuda-compat package for CUDA {release} to the image "
                      f"(this GPU supports forward compatibility)"]
    return out


def _host(host: dict | None) -> dict:
    drv = (host or {}).get("driver") or {}
    driver = drv.get("version")
    return {"driver": driver, "cuda": drv.get("cuda"), "cuda_source": drv.get("cuda_source"),
            "max_cuda": cuda_releases.max_cuda_for_driver(driver) if driver else None}


def no_gpu_report(rootfs: str, reason: str) -> dict:
    """The container asks for no GPU: the hook injects nothing, so there is no libcuda to judge."""
    return {"image": {"rootfs": rootfs}, "gpu_requested": False, "refused": None, "gpus": [], "problems": [],
            "summary": f"nvhook injects nothing: {reason}"}


def refused_report(rootfs: str, error: str, host: dict | None) -> dict:
    """The hook would stop the container with `error` (the line runc/podman would show)."""
    return {"host": _host(host) if host else None, "image": {"rootfs": rootfs}, "gpu_requested": True,
            "refused": error, "gpus": [], "problems": [],
            "summary": "the hook refuses this container: it will not start "
                       "(the line above is what runc or podman shows)"}


def diagnose(host: dict, rootfs: str, env: dict, selected_gpus: list[dict], mode: str, *,
             allow_override: bool = True, capabilities=None, decision: dict | None = None) -> dict:
    """Everything doctor knows, as a JSON-able dict.

    host: {"driver": {"version": str, "cuda": str|None}, ...} (the inventory).
    rootfs: the container's root directory on this machine. env: the container's environment.
    selected_gpus: the GPUs the container gets (NVML brands when available).
    mode: the configured compat mode; the container's NVHOOK_COMPAT_MODE applies on top of it
    when allow_override. capabilities: the request's capabilities (default compute,utility).
    decision: the hook's own compat decision for this container (pipeline.decide), when known;
    otherwise it is made here with the same function and inputs.
    """
    env = dict(env or {})
    drv = (host or {}).get("driver") or {}
    driver = drv.get("version")
    caps = list(capabilities) if capabilities is not None else list(DEFAULT_CAPABILITIES)
    problems: list[str] = []
    try:
        eff_mode, mode_source, mode_warning = compat.mode_from_env(env, mode, allow_override)
    except HookError as e:
        eff_mode, mode_source, mode_warning = mode if mode in compat.MODES else "auto", "config", None
        problems.append(str(e))
    if mode_warning:
        problems.append(mode_warning)

    candidates = image.find_compat_libs(rootfs, driver)
    runtime, runtime_source = image.cuda_runtime_version(rootfs, env)
    release = mins = None
    if runtime:
        release = cuda_releases.release_of(runtime)
        mins = cuda_releases.min_driver(runtime)
    max_cuda = cuda_releases.max_cuda_for_driver(driver) if driver else None
    gpus = list(selected_gpus or ())
    if decision is None:
        decision = compat.decide(caps, driver, gpus, candidates, eff_mode)
    best = next((c for c in decision["selected"] if c.get("library") == "libcuda"), None)
    newest = None
    for c in candidates:
        if (not c.get("skipped") and c.get("library") == "libcuda" and c.get("newer_than_host")
                and (newest is None or (_cmp(c["version"], newest["version"]) or 0) > 0)):
            newest = c

    libcuda = _libcuda_loaded(rootfs, env, candidates, decision, best, driver, problems)

    note_for_gpus = (libcuda["candidate"] or newest or {}).get("note")
    preds = []
    if decision["decision"] != "none":
        for g in gpus:
            support = compat.gpu_support(g, note_for_gpus)
            preds.append(_predict(support, driver, max_cuda, runtime, release, mins, libcuda, newest,
                                  decision, eff_mode))

    summary = _summary(decision, gpus, preds)

    decision_out = {k: v for k, v in decision.items() if k not in ("selected", "event")}
    return {
        "host": _host(host),
        "gpu_requested": True,
        "refused": None,
        "image": {"rootfs": rootfs, "cuda_runtime": runtime, "cuda_runtime_source": runtime_source,
                  "cuda_release": release,
                  "min_driver": {"minor_compat": mins[0], "full": mins[1]} if mins else None},
        "capabilities": caps,
        "compat_libs": candidates,
        "mode": {"mode": eff_mode, "configured": mode, "source": mode_source},
        "decision": decision_out,
        "libcuda": {k: v for k, v in libcuda.items() if k != "candidate"},
        "gpus": preds,
        "problems": problems,
        "summary": summary,
    }


def _libcuda_loaded(rootfs: str, env: dict, candidates: list[dict], decision: dict, best: dict | None,
                    driver: str | None, problems: list[str]) -> dict:
    """Which libcuda the container's loader will find: the image's own through LD_LIBRARY_PATH
    (whatever nvhook decides), the compat one nvhook chose, or the host's."""
    forced = _forced_compat(rootfs, env, candidates)
    if forced is not None:
        problems.append(f"the image puts {forced['ld_library_path_entry']} in LD_LIBRARY_PATH: its compat "
                        f"libcuda {forced['version']} is loaded whatever nvhook decides")
        return {"from": "LD_LIBRARY_PATH", "version": forced["version"], "path": forced["container_path"],
                "candidate": forced}
    if decision["decision"] == "image" and best is not None:
        return {"from": "image compat", "version": best["version"], "path": best["container_path"],
                "candidate": best}
    return {"from": "host", "version": driver, "path": None, "candidate": None}


def _summary(decision: dict, gpus: list[dict], preds: list[dict]) -> str:
    """The one line doctor leads with."""
    bad = [p for p in preds if p["outcome"] not in ("works", "unknown")]
    if decision["decision"] == "none":
        return "no compute or video capability requested: libcuda is not involved"
    if not gpus:
        return "no GPU selected"
    if bad:
        return f"{len(bad)} of {len(preds)} GPU(s) will fail: " + "; ".join(sorted({p["label"] for p in bad}))
    if not all(p["outcome"] == "works" for p in preds):
        return "outcome unknown: " + preds[0]["detail"]
    summary = "CUDA should work on every selected GPU"
    if any(p["via"] == "minor-version-compat" for p in preds):
        summary += " (through minor version compatibility: features that need a newer driver are unavailable)"
    elif any(p["via"] == "forward-compat" for p in preds):
        summary += " (through forward compatibility)"
    return summary


def _source_text(source: str) -> str:
    if source.startswith("file:"):
        return source[5:]
    if source.startswith("env:"):
        return f"from {source[4:]}"
    return "not found"


def _host_line(h: dict) -> str:
    """The driver and the CUDA versions, each with where it came from."""
    drv = h["driver"] or "unknown"
    parts = [f"supports CUDA up to {h['max_cuda'] or 'unknown'} by nvhook's release table"]
    if h.get("cuda") and h.get("cuda_source") == "nvml":
        parts.append(f"NVML reports CUDA {h['cuda']}")
    return f"Host driver     {drv} ({'; '.join(parts)})"


def render_text(report: dict) -> str:
    """One screen for a person debugging a failing GPU container."""
    if not report.get("gpu_requested", True) or report.get("refused"):
        lines = []
        if report.get("host"):
            lines.append(_host_line(report["host"]))
        lines.append(f"Image           {report['image']['rootfs']}")
        if report.get("refused"):
            lines.append(f"Hook            refuses the container: nvhook: {report['refused']}")
        lines.append(f"Summary         {report['summary']}")
        return "\n".join(lines) + "\n"
    h, d = report["host"], report["decision"]
    lines = [_host_line(h)]
    lines.extend(_image_lines(report["image"]))
    lines.extend(_compat_lib_lines(report["compat_libs"]))
    mo = report["mode"]
    lines.append(f"Compat mode     {mo['mode']} (from {mo['source']})")
    lines.append(f"Decision        {d['decision']} [{d['reason_code']}]: {d['reason']}")
    lc = report["libcuda"]
    if lc["from"] == "host":
        lines.append(f"libcuda.so.1    host's libcuda {lc['version'] or 'unknown'}")
    else:
        lines.append(f"libcuda.so.1    {lc['path']} ({lc['from']})")
    for w in d.get("warnings", []):
        lines.append(f"Warning         {w}")
    for p in report.get("problems", []):
        lines.append(f"Note            {p}")
    lines.extend(_gpu_lines(report["gpus"]))
    lines.extend(_access_lines(report.get("device_access")))
    lines.extend(_cdi_lines(report.get("cdi")))
    lines.extend(_startpath_lines(report.get("startpath")))
    lines.append(f"Summary         {report['summary']}")
    return "\n".join(lines) + "\n"


def _image_lines(im: dict) -> list[str]:
    lines = [f"Image           {im['rootfs']}"]
    if im["cuda_runtime"]:
        lines.append(f"CUDA runtime    {im['cuda_runtime']} ({_source_text(im['cuda_runtime_source'])})")
    else:
        lines.append("CUDA runtime    not found (no libcudart under /usr/local/cuda, no CUDA_VERSION)")
    if im["min_driver"]:
        m = im["min_driver"]
        lines.append(f"Runtime needs   driver >= {m['full']} for all CUDA {im['cuda_release']} features, "
                     f">= {m['minor_compat']} at least")
    elif im["cuda_runtime"]:
        lines.append(f"Runtime needs   unknown (CUDA {im['cuda_release']} is not in nvhook's release table)")
    return lines


def _compat_lib_lines(libs: list) -> list[str]:
    if not libs:
        return ["Compat libs     none in the image"]
    lines = []
    for i, c in enumerate(libs):
        head = "Compat libs     " if i == 0 else "                "
        if c.get("skipped"):
            lines.append(f"{head}{c['container_path']}  SKIPPED: {c['skipped']}")
            continue
        rel = "newer than host" if c["newer_than_host"] else "not newer than host"
        text = f"{head}{c['container_path']}  ({rel})"
        if c.get("library") == "libcuda" and c["newer_than_host"]:
            if c.get("note_error"):
                text += f"  note: INVALID ({c['note_error']})"
            elif c.get("note"):
                n = c["note"]
                text += (f"  note: CUDA {n.get('CUDA Version', '?')}, drivers {n.get('Driver', '-')}, "
                         f"devices {n.get('Device', '-')}")
            else:
                text += "  note: none"
        lines.append(text)
    return lines


def _gpu_lines(gpus: list) -> list[str]:
    lines = ["GPUs"] if gpus else []
    for p in gpus:
        how = "NVML" if p["brand_source"] == "nvml" else "guessed from procfs"
        fc = "forward compat: yes" if p["forward_compat"] else "forward compat: no"
        lines.append(f"  {p['index']}  {p['model']}  (brand {p['brand']}, {how}; {fc})")
        lines.append(f"     -> {p['label']}: {p['detail']}")
        for f in p["fix"]:
            lines.append(f"        fix: {f}")
    return lines


def _access_lines(da: dict | None) -> list[str]:
    if not da:
        return []
    from .devaccess import mode_text

    lines = [f"Device access   {mode_text(da)}: nvhook {da['action']}"]
    if da.get("runtime_carries"):
        lines.append("                the bundle's config.json carries the NVIDIA devices itself "
                     "(linux.devices + linux.resources.devices): that access survives a daemon-reload")
    if da.get("runc"):
        lines.append(f"runc            {da['runc']}")
    for n in da.get("notes", []):
        lines.append(f"Note            {n}")
    return lines


def _cdi_lines(cdi: dict | None) -> list[str]:
    if not cdi:
        return []
    if not cdi["stale"]:
        return [f"CDI spec        {cdi['spec']} matches the host"]
    first = cdi["differences"][0] if cdi["differences"] else ""
    more = f" (+{len(cdi['differences']) - 1} more)" if len(cdi["differences"]) > 1 else ""
    return [f"Warning         CDI spec {cdi['spec']} is stale: {first}{more}; containers given "
            f"its devices may fail to start: `nvhook cdi check` lists every difference, "
            f"`nvhook cdi generate --output {cdi['spec']}` fixes it"]


def _startpath_lines(sp: dict | None) -> list[str]:
    """Whether container starts load nvhook's modules from the start-path bundle: not a cause
    of CUDA failures, a few milliseconds of every start (README, Performance)."""
    if not sp:
        return []
    fix = "`nvhook setup` (or `python3 -I -m nvhook.base.modbundle`) writes it"
    if sp["state"] == "current":
        return [f"Start path      nvhook's {sp['modules']} modules load from {sp['bundle']}"]
    if sp["state"] == "stale":
        names = ", ".join(sp["stale"][:3]) + (f" (+{len(sp['stale']) - 3} more)" if len(sp["stale"]) > 3 else "")
        return [f"Note            start-path bundle {sp['bundle']} is older than {len(sp['stale'])} of nvhook's "
                f"modules ({names}): each container start imports those the usual way, a little slower; {fix}"]
    if sp["state"] == "missing":
        return [f"Note            no start-path bundle ({sp['bundle']}): each container start imports nvhook's "
                f"modules the usual way, a few ms slower; {fix}"]
    return [f"Note            start-path bundle {sp['bundle']} is not used ({sp.get('reason')}): each container "
            f"start imports nvhook's modules the usual way; {fix}"]
