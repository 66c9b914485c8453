"""Whether a container gets the image's CUDA forward-compatibility libcuda or the host's.

Pure: no I/O. The facts come from nvhook.observe.image (compat libraries found in the rootfs, with the
ELF note of each candidate libcuda) and from the host inventory (driver version, selected GPUs
with their NVML brand or procfs model name).

Forward compatibility lets a libcuda newer than the kernel module run on it, but only on data
center and professional GPUs; elsewhere CUDA fails with error 804
(cudaErrorCompatNotSupportedOnDevice). The reference hook looked only at version strings,
which is how GeForce users got 804. Here, in mode `auto`, the compat libcuda is used only when
  1. the container asked for `compute`;
  2. its version is numerically newer than the host driver's;
  3. the host driver's branch is in the note's "Driver" list (when the note exists);
  4. every selected GPU supports forward compatibility: its NVML brand is in the note's
     "Device" list, or, without a note (or without a "Device" list), in DATACENTER_BRANDS.
     Without NVML the brand is guessed from the procfs model name and the reason says so.
Mode `image` is the reference's old behaviour (compat whenever newer), mode `host` never uses
it. A compat libcuda older than or equal to the host driver is never used, in any mode.

Reason codes (result["reason_code"]):
  compute-not-requested  neither compute nor video: no libcuda at all (decision "none"), or
                         video only (decision "host": compat needs compute)
  mode-host              mode host (config or NVHOOK_COMPAT_MODE)
  host-driver-unknown    the host driver version is unknown or not a version
  no-compat-libs         no compat libcuda in the image
  compat-not-newer       the image's compat libcuda is older than or equal to the host driver
  mode-image             mode image: used because newer, hardware not checked
  no-gpu-selected        no GPU selected (NVIDIA_VISIBLE_DEVICES=none)
  compat-note-invalid    the candidate's ELF note is present but malformed
  driver-branch-not-in-note  the note's Driver list excludes the host driver's branch
  gpu-not-supported      some selected GPU cannot use forward compatibility (brand known or guessed)
  gpu-brand-guessed      every GPU supports it, but at least one brand is a guess from procfs
  all-gpus-supported     every GPU supports it (NVML brands)
"""

from __future__ import annotations

from ..base import versions
from ..base.brands import BRAND_IDS, BRANDS
from ..base.errors import HookError

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Iterable

MODES = ("auto", "image", "host")
ENV_VAR = "NVHOOK_COMPAT_MODE"


# Brands that support forward compatibility when the compat libcuda carries no Device list:
# data center (tesla, nvidia), professional/NGC-ready RTX (quadro, quadro_rtx, nvidia_rtx) and
# the vGPU products. The same set as the Device list seen in compat notes ([1,2,7..14]);
# GeForce, Titan, NVS and GRID are left out.
DATACENTER_BRANDS = frozenset({
    "quadro", "tesla", "nvidiavapps", "nvidiavpc", "nvidiavcs", "nvidiavws",
    "nvidiacloudgaming", "quadrortx", "nvidiartx", "nvidia",
})

ERROR_804 = "CUDA error 804 (cudaErrorCompatNotSupportedOnDevice)"
ERROR_803 = "CUDA error 803 (cudaErrorSystemDriverMismatch)"

# Letters that start a data center product name followed by digits: A100, H100, L4, T4, B200,
# GH200, V100, P100, K80, M60...
_DC_PREFIXES = ("GB", "GH", "A", "B", "H", "L", "T", "V", "P", "K", "M")


def _dc_token(token: str) -> bool:
    for p in _DC_PREFIXES:
        if token.startswith(p) and len(token) > len(p) and token[len(p)].isdigit():
            return True
    return False


def brand_from_model(model: str | None) -> tuple[str, bool]:
    """A brand name guessed from a procfs model name: (brand, True). The second item is always
    True: the result is a guess and reasons built on it say so. "unknown" when nothing fits."""
    words = (model or "").replace("-", " ").replace("_", " ").upper().split()
    ws = set(words)
    # GeForce and TITAN boards, RTX or not, report NVML's plain geforce/titan brand (e.g. an
    # RTX 2080 Ti says geforce); a guess cannot tell the rarer geforcertx/titanrtx apart, and
    # none of the four can use forward compatibility.
    if "GEFORCE" in ws:
        return "geforce", True
    if "TITAN" in ws:
        return "titan", True
    if "QUADRO" in ws:
        return ("quadrortx" if "RTX" in ws else "quadro"), True
    if "TESLA" in ws:
        return "tesla", True
    if "NVS" in ws:
        return "nvs", True
    if "GRID" in ws:
        return "grid", True
    if "RTX" in ws:  # NVIDIA RTX A6000, RTX 6000 Ada, RTX PRO 6000
        return "nvidiartx", True
    if any(_dc_token(w) for w in words):  # NVIDIA A100-SXM4-80GB, NVIDIA L4, NVIDIA H100 PCIe
        return "nvidia", True
    return "unknown", True


def _compute(capabilities: Iterable[str] | None) -> tuple[bool, bool]:
    """(libcuda involved, compute requested)."""
    caps = set(capabilities or ())
    compute = "compute" in caps or "all" in caps
    return compute or "video" in caps, compute


def _newer(version: str | None, host: str | None) -> bool:
    if version is None or host is None:
        return False
    try:
        return versions.compare(version, host) > 0
    except (ValueError, TypeError, AttributeError):
        return False


def _vkey(version: str | None) -> tuple[int, ...]:
    if version is None:
        return ()
    try:
        return versions.parse_version(version)
    except (ValueError, AttributeError, TypeError):
        return ()


def _dirname(path: str | None) -> str:
    return (path or "").rpartition("/")[0]


def _usable(candidates: Iterable[dict] | None) -> list[dict]:
    return [c for c in candidates or () if not c.get("skipped") and c.get("version")]


def _pick(host_driver_version: str | None, candidates: Iterable[dict] | None) -> tuple[dict | None, list[dict]]:
    """(newest libcuda candidate newer than the host, every usable libcuda candidate)."""
    libcudas = [c for c in _usable(candidates) if c.get("library") == "libcuda"]
    best = None
    for c in libcudas:
        if not _newer(c["version"], host_driver_version):
            continue
        if best is None or versions.compare(c["version"], best["version"]) > 0:
            best = c
    return best, libcudas


def _branch_ok(note: dict | None, host_driver_version: str | None) -> bool:
    if not note or not note.get("Driver"):
        return True
    if host_driver_version is None:
        return False
    try:
        return versions.branch(host_driver_version) in note["Driver"]
    except ValueError:
        return False


def gpu_support(gpu: dict, note: dict | None) -> dict:
    """Whether one GPU can run a forward-compatible libcuda under this note.

    {"index", "model", "brand", "brand_id", "brand_source": "nvml"|"procfs-guess",
     "guessed": bool, "supported": bool, "rule": "note Device list"|"data center brands"}
    """
    brand = gpu.get("brand")
    brand_id = gpu.get("brand_id")
    if isinstance(brand_id, bool) or not isinstance(brand_id, int):
        brand_id = None
    if brand_id is not None:
        brand = BRANDS.get(brand_id, brand or f"brand{brand_id}")
    if brand and gpu.get("brand_source") in ("guessed", "procfs-guess") and brand_id is None:
        # a brand already guessed from the model name (a plan's GPU entry): still a guess
        source, guessed = "procfs-guess", True
    elif brand:
        source, guessed = "nvml", False
    else:
        brand, guessed = brand_from_model(gpu.get("model"))
        source = "procfs-guess"
    if brand_id is None:
        brand_id = BRAND_IDS.get(brand)
    devices = note.get("Device") if note else None
    if devices:
        supported, rule = brand_id is not None and brand_id in devices, "note Device list"
    else:
        supported, rule = brand in DATACENTER_BRANDS, "data center brands"
    return {"index": gpu.get("index"), "model": gpu.get("model"), "brand": brand,
            "brand_id": brand_id, "brand_source": source, "guessed": guessed,
            "supported": supported, "rule": rule}


def _gpu_name(g: dict) -> str:
    return g.get("model") or f"GPU {g.get('index')}"


def _gpu_list(gs: list[dict]) -> str:
    """'NVIDIA GeForce RTX 2080 Ti (GPUs 0, 1; brand geforce from NVML)' per model."""
    groups: dict = {}
    for g in gs:
        groups.setdefault((_gpu_name(g), g["brand"], g["brand_source"]), []).append(g.get("index"))
    parts = []
    for (name, brand, source), idx in groups.items():
        label = "GPU" if len(idx) == 1 else "GPUs"
        how = "from NVML" if source == "nvml" else "guessed from the procfs model name"
        parts.append(f"{name} ({label} {', '.join(str(i) for i in idx)}; brand {brand} {how})")
    return ", ".join(parts)


def needs_gpu_brands(capabilities: Iterable[str] | None, host_driver_version: str | None,
                     candidates: Iterable[dict] | None, mode: str) -> bool:
    """True only when decide()'s answer depends on the GPUs' brands, i.e. mode auto, compute
    requested, a libcuda candidate newer than the host with a valid note (or none) that lists
    the host's branch. The hook initialises NVML for brands only then."""
    if mode != "auto":
        return False
    if not _compute(capabilities)[1]:
        return False
    best, _ = _pick(host_driver_version, candidates)
    if best is None or best.get("note_error"):
        return False
    return _branch_ok(best.get("note"), host_driver_version)


class _Case:
    """One decision's inputs and what is learnt on the way (the chosen candidate, the GPUs
    checked, the warnings), so each rule below is a small function of it."""

    __slots__ = ("capabilities", "host", "gpus", "candidates", "mode", "best", "libcudas", "note",
                 "checked", "warnings", "what")

    def __init__(self, capabilities: Iterable[str] | None, host: str | None, gpus: Iterable[dict] | None,
                 candidates: Iterable[dict] | None, mode: str) -> None:
        self.capabilities, self.host, self.mode = capabilities, host, mode
        self.gpus = list(gpus or ())
        self.candidates = candidates
        self.best, self.libcudas = _pick(host, candidates)
        self.note = self.best.get("note") if self.best else None
        self.checked: list[dict] = []
        self.warnings: list[str] = []
        self.what = (f"image's compat libcuda {self.best['version']} ({self.best.get('container_path')})"
                     if self.best else "")


def _companions(case: _Case, use: dict) -> list[dict]:
    """The chosen libcuda and its companions of the same version from the same compat
    directory (libnvidia-ptxjitcompiler, libnvidia-nvvm, ...), one file per library."""
    where = _dirname(use.get("container_path"))
    selected = [use]
    names: set[str | None] = {"libcuda"}
    for c in sorted(_usable(case.candidates), key=lambda c: c.get("container_path") or ""):
        if (c.get("version") == use["version"] and c.get("library") not in names
                and _dirname(c.get("container_path")) == where):
            names.add(c.get("library"))
            selected.append(c)
    return selected


def _result(case: _Case, decision: str, code: str, reason: str, use: dict | None = None) -> dict:
    best = case.best
    selected = _companions(case, use) if use is not None else []
    gpu_event = case.checked or [gpu_support(g, case.note) for g in case.gpus]
    event = {
        "host_driver": case.host,
        "compat_version": best["version"] if best else None,
        "compat_path": best.get("container_path") if best else None,
        "compat_found": [c.get("container_path") for c in case.libcudas],
        "skipped": [{"path": c.get("container_path"), "reason": c.get("skipped")}
                    for c in case.candidates or () if c.get("skipped")],
        "note": case.note,
        "note_error": best.get("note_error") if best else None,
        "mode": case.mode,
        "gpus": [{"index": g["index"], "model": g["model"], "brand": g["brand"],
                  "brand_source": g["brand_source"], "supported": g["supported"]} for g in gpu_event],
        "decision": decision,
        "reason_code": code,
    }
    return {
        "decision": decision, "reason": reason, "reason_code": code,
        "libraries": [c["container_path"] for c in selected], "selected": selected,
        "compat_version": best["version"] if best else None,
        "guessed": any(g["guessed"] for g in case.checked),
        "warnings": case.warnings, "gpus": case.checked, "event": event,
    }


def _no_candidate(case: _Case) -> dict | None:
    """The cases where no compat libcuda is even a candidate."""
    involved, compute = _compute(case.capabilities)
    if not involved:
        return _result(case, "none", "compute-not-requested",
                       "neither compute nor video requested: no libcuda in this container")
    if not compute:
        return _result(case, "host", "compute-not-requested",
                       "compute not requested: the host's libcuda, compat libraries are for compute")
    if case.mode == "host":
        extra = f" (image's compat libcuda {case.best['version']} not used)" if case.best else ""
        return _result(case, "host", "mode-host", f"compat mode is host: the host's libcuda{extra}")
    try:
        versions.parse_version(case.host or "")
    except (ValueError, AttributeError, TypeError):
        return _result(case, "host", "host-driver-unknown",
                       f"host driver version {case.host!r} unknown: the host's libcuda")
    if not case.libcudas:
        return _result(case, "host", "no-compat-libs", "no compat libcuda in the image: the host's libcuda")
    if case.best is None:
        newest = max(case.libcudas, key=lambda c: _vkey(c["version"]))
        return _result(case, "host", "compat-not-newer",
                       f"image's compat libcuda {newest['version']} is not newer than the host driver "
                       f"{case.host}: the host's libcuda")
    return None


def _image_mode(case: _Case) -> dict:
    """The reference's old behaviour: newer is enough. Say what we know about the hardware."""
    bad = [s for s in (gpu_support(g, case.note) for g in case.gpus) if not s["supported"]]
    if bad:
        case.warnings.append(f"{case.what} used because compat mode is image; it is expected to fail with "
                             f"{ERROR_804} on {_gpu_list(bad)}")
    if case.host is not None and not _branch_ok(case.note, case.host):  # _no_candidate: host is known
        case.warnings.append(f"{case.what} used because compat mode is image; its note does not list driver "
                             f"branch {versions.branch(case.host)}: expect {ERROR_803}")
    return _result(case, "image", "mode-image",
                   f"compat mode is image: {case.what} used, newer than the host driver {case.host}",
                   use=case.best)


def _refused_by_note(case: _Case) -> dict | None:
    """No GPU to check, or the candidate's own note rules it out."""
    what, best, host, note = case.what, case.best, case.host, case.note
    # _no_candidate let the case through: there is a candidate and the host's version parsed.
    assert best is not None and host is not None
    if not case.gpus:
        return _result(case, "host", "no-gpu-selected", f"no GPU selected: the host's libcuda, {what} not needed")
    if best.get("note_error"):
        case.warnings.append(f"{what} not used: its forward-compatibility note is malformed "
                             f"({best['note_error']}); using the host's libcuda {case.host}")
        return _result(case, "host", "compat-note-invalid",
                       f"{what} has a malformed forward-compatibility note: the host's libcuda")
    if note and not _branch_ok(note, host):
        branch = versions.branch(host)
        listed = ", ".join(str(d) for d in note["Driver"])
        case.warnings.append(f"{what} not used: its note supports driver branches {listed}, not {branch}; "
                             f"it would fail with {ERROR_803}; using the host's libcuda {case.host}")
        return _result(case, "host", "driver-branch-not-in-note",
                       f"{what} does not support host driver branch {branch} (note lists {listed}): "
                       f"the host's libcuda")
    return None


def _by_gpus(case: _Case) -> dict:
    """The rule the reference lacks: every selected GPU must support forward compatibility."""
    what, host = case.what, case.host
    case.checked.extend(gpu_support(g, case.note) for g in case.gpus)
    bad = [g for g in case.checked if not g["supported"]]
    rule = "the note's Device list" if case.note and case.note.get("Device") else "data center/professional brands"
    if bad:
        guessed = any(g["guessed"] for g in bad)
        guess = " (brand guessed from the procfs model name: NVML unavailable)" if guessed else ""
        case.warnings.append(f"{what} not used: it would fail with {ERROR_804} on {_gpu_list(bad)}; "
                             f"using the host's libcuda {host}")
        return _result(case, "host", "gpu-not-supported",
                       f"{what} refused: {_gpu_list(bad)} cannot use forward compatibility "
                       f"(not in {rule}){guess}: the host's libcuda")
    if any(g["guessed"] for g in case.checked):
        return _result(case, "image", "gpu-brand-guessed",
                       f"{what} used: newer than the host driver {host} and every selected "
                       f"GPU looks forward-compatible by {rule}, a guess from procfs model names "
                       f"(NVML unavailable)", use=case.best)
    return _result(case, "image", "all-gpus-supported",
                   f"{what} used: newer than the host driver {host} and every selected GPU "
                   f"supports forward compatibility ({rule})", use=case.best)


def decide(capabilities: Iterable[str] | None, host_driver_version: str | None, gpus: Iterable[dict] | None,
           candidates: Iterable[dict] | None, mode: str) -> dict:
    """The compat decision for one container. See the module docstring for the rules.

    capabilities: the request's expanded capability list ("all" is accepted too).
    gpus: selected GPUs, {"index", "model", "brand"|None, "brand_id"|None, "source", ...}.
    candidates: nvhook.observe.image.find_compat_libs() output; entries with "skipped" are ignored.
    mode: "auto" | "image" | "host".

    Returns {"decision": "host"|"image"|"none", "reason": sentence, "reason_code": str,
             "libraries": [container paths to use: libcuda and its same-version companions],
             "selected": [the candidate dicts behind "libraries"],
             "compat_version": str|None, "guessed": bool, "warnings": [sentences],
             "gpus": [gpu_support() per GPU, when checked], "event": {compat.decision fields}}.
    """
    if mode not in MODES:
        raise HookError(f"compat mode must be one of {', '.join(MODES)}, not {mode!r}")
    case = _Case(capabilities, host_driver_version, gpus, candidates, mode)
    early = _no_candidate(case)
    if early is not None:
        return early
    if mode == "image":
        return _image_mode(case)
    return _refused_by_note(case) or _by_gpus(case)


def decide_by_versions(host_driver_version: str | None, host_cuda_version: str | None,
                       candidates: Iterable[dict] | None, mode: str) -> dict:
    """NVIDIA's enable-cuda-compat rule (1.20), for when nvhook cannot observe the host and has
    only the versions a spec gives (no GPU facts, so no check for error 804): the image's one
    compat libcuda is used when
      - its note lists the host driver's branch and it is newer than the host driver, or, given
        only the host CUDA version, the note's "CUDA Version" is newer than that;
      - without a (readable) note: no host CUDA version was given and its major is above the
        host driver's.
    Never in mode host (the admin's word); more than one compat libcuda: none used (NVIDIA's
    "unexpected number"). `candidates` must carry the note of every libcuda (find_compat_libs
    reads it for those newer than the version it is given). Returns decide()'s keys."""
    libcudas = [c for c in _usable(candidates) if c.get("library") == "libcuda"]
    one = libcudas[0] if len(libcudas) == 1 else None

    def result(code: str, reason: str, use: bool = False) -> dict:
        decision = "image" if use else "host"
        event = {"host_driver": host_driver_version, "host_cuda": host_cuda_version,
                 "compat_version": one["version"] if one else None,
                 "compat_path": one.get("container_path") if one else None,
                 "compat_found": [c.get("container_path") for c in libcudas], "note": one.get("note") if one else None,
                 "mode": mode, "rule": "nvidia", "gpus": [], "decision": decision, "reason_code": code}
        libraries = [one["container_path"]] if use and one else []
        return {"decision": decision, "reason": reason, "reason_code": code, "libraries": libraries,
                "selected": [one] if use and one else [], "compat_version": event["compat_version"],
                "guessed": False, "warnings": [], "gpus": [], "event": event}

    if mode == "host":
        return result("mode-host", "compat mode is host: the host's libcuda")
    if one is None:
        return result("no-compat-libs", f"{len(libcudas) or 'no'} compat libcuda in the image: the host's libcuda"
                      + (" (NVIDIA's rule takes exactly one)" if libcudas else ""))
    what = f"image's compat libcuda {one['version']}"
    note = one.get("note") if not one.get("note_error") else None
    try:
        if note is not None and host_driver_version:
            if versions.branch(host_driver_version) in (note.get("Driver") or ()) and \
                    versions.compare(one["version"], host_driver_version) > 0:
                return result("nvidia-rule-note", f"{what} used: its note lists driver branch "
                              f"{versions.branch(host_driver_version)} and it is newer than "
                              f"{host_driver_version}", True)
            return result("nvidia-rule-note", f"{what} not used: its note does not list driver branch "
                          f"{versions.branch(host_driver_version)}, or it is not newer than {host_driver_version}")
        if note is not None and host_cuda_version:
            ours = str(note.get("CUDA Version") or "")
            if ours and versions.compare(ours, host_cuda_version) > 0:
                return result("nvidia-rule-cuda", f"{what} used: its CUDA {ours} is newer than the host's "
                              f"{host_cuda_version}", True)
            return result("nvidia-rule-cuda", f"{what} not used: its CUDA {ours or '?'} is not newer than the "
                          f"host's {host_cuda_version}")
        if host_cuda_version or not host_driver_version:
            return result("nvidia-rule-no-note", f"{what} not used: no forward-compatibility note to compare "
                          f"with the host CUDA version")
        if versions.branch(one["version"]) > versions.branch(host_driver_version):
            return result("nvidia-rule-major", f"{what} used: its major is above the host driver "
                          f"{host_driver_version}'s", True)
        return result("nvidia-rule-major", f"{what} not used: its major is not above the host driver "
                      f"{host_driver_version}'s")
    except (ValueError, TypeError, AttributeError):
        return result("host-driver-unknown", f"host version {host_driver_version or host_cuda_version!r} is not a "
                      f"version: the host's libcuda")


def mode_from_env(env: dict, config_mode: str, allow_override: bool) -> tuple[str, str, str | None]:
    """The effective compat mode: (mode, source, warning).

    source is "config" or "env NVHOOK_COMPAT_MODE". warning is None, or a sentence when the
    variable is set but the config forbids per-container overrides (ignored). An unknown value
    while overrides are allowed is a HookError: the container asked for something we cannot do.
    """
    if config_mode not in MODES:
        raise HookError(f"compat.mode must be one of {', '.join(MODES)}, not {config_mode!r}")
    found = (env or {}).get(ENV_VAR)
    raw = found if isinstance(found, str) else ""
    value = raw.strip().lower()
    if not value:
        return config_mode, "config", None
    if not allow_override:
        return config_mode, "config", (f"{ENV_VAR}={raw.strip()} ignored: per-container compat overrides "
                                       f"are disabled in the config (compat.allow_env_override); "
                                       f"mode {config_mode}")
    if value not in MODES:
        raise HookError(f"{ENV_VAR} must be one of {', '.join(MODES)}, not {raw.strip()!r}")
    return value, f"env {ENV_VAR}", None
