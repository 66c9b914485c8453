"""The NRI plugin's own decisions, pure: where the driver's libraries are bound so that the
image's loader finds them, what of a container's in-container work the plugin does at its
StartContainer and what needs nvhook's CDI hook, which directories its loader cache lists, what
an answer is kept by, and whether a cgroup names a container. The plugin
(nvhook/start/nri/) gets the facts and acts on these answers.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from .types import Plan

# Directories a library bind must never land in, whatever the image's LD_LIBRARY_PATH says.
NEVER_UNDER = ("/proc", "/sys", "/dev")
# The longest LD_LIBRARY_PATH entry taken as the bind directory: a directory plus "/" and a
# file name (NAME_MAX 255) within PATH_MAX (4096, its NUL included). A longer one is no path the
# kernel can mount on, and every bind's destination (and every kept answer) would repeat it.
MAX_LOADER_DIR = 4096 - 1 - 256
NAME_MAX = 255
# In-container work the plugin itself does at StartContainer, through the container's root:
# no process. The others (procfs, ldcache32, links) still take the CDI hook.
IN_PLUGIN = ("ldcache", "compat")


@dataclass
class StartWork:
    """What a GPU container's StartContainer must do (the plugin, through its root): `why`
    (ldcache, compat), the directories its libraries are bound in (`dirs`), the libraries'
    container paths (`libraries`: the answer's binds, by which the start knows the container
    got nvhook's answer), and for the compat choice the request's expanded capabilities and the
    indices of the GPUs it was given (a MIG device's parent counted)."""

    why: list[str]
    dirs: list[str]
    libraries: list[str] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)


def loader_dir(env: dict[str, str]) -> str | None:
    """The first directory of the image's LD_LIBRARY_PATH where a library bound at its SONAME
    is found by the loader with no cache entry and no link, or None."""
    for entry in env.get("LD_LIBRARY_PATH", "").split(":"):
        if not entry.startswith("/"):
            continue
        d = posixpath.normpath(entry)
        if len(d) > MAX_LOADER_DIR or any(len(c) > NAME_MAX for c in d.split("/")):
            continue  # ENAMETOOLONG for the loader and the runtime alike
        if d == "/" or ".." in d.split("/") or any(d == p or d.startswith(p + "/") for p in NEVER_UNDER):
            continue
        return d
    return None


def link_target(path: str, links: dict, libs: set) -> str | None:
    """The library a link (or a chain of links, libcuda.so -> libcuda.so.1 -> the file) names."""
    for _ in range(8):
        if path in libs:
            return path
        if path not in links:
            return None
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), links[path]))
    return None


def in_container_work(plan: Plan, edits: dict, env: dict[str, str], driver_cuda: str | None,
                      mask_procfs: bool) -> list[str]:
    """Why a hook must run inside this container (empty: the spec alone is enough). The rule:
    - /proc/driver/nvidia masking: runc refuses spec mounts under /proc, so only when the
      operator asks for it (--mask-procfs);
    - the compat libcuda choice: for a compute container unless the image declares its CUDA
      (CUDA_VERSION, set by every CUDA base image) and the host driver supports it;
    - the loader: libraries are bound at their SONAME in the image's LD_LIBRARY_PATH directory;
      without one (or with 32-bit libraries, which would share it) the loader cache is needed;
    - links that are not library names (none in today's catalog)."""
    from ..base.versions import compare

    why = []
    if mask_procfs and edits["in_container"]["procfs"]:
        why.append("procfs")
    caps = plan["request"]["capabilities"]
    if "compute" in caps or "all" in caps:
        cuda = env.get("CUDA_VERSION", "")
        try:
            ok = bool(cuda and driver_cuda and compare(cuda, driver_cuda) <= 0)
        except ValueError:
            ok = False
        if not ok:
            why.append("compat")
    if any(m["kind"] == "library32" for m in edits["mounts"]):
        why.append("ldcache32")
    libs = {m["container_path"] for m in edits["mounts"] if m["kind"] == "library"}
    if libs and loader_dir(env) is None:
        why.append("ldcache")
    links = {s["path"]: s["target"] for s in edits["symlinks"]}
    if any(link_target(p, links, libs) is None for p in links):
        why.append("links")
    return why


def loader_mounts(edits: dict, directories: list[str]) -> list[dict]:
    """The spec's binds with each library (and each of its link names) bound in every one of
    `directories`."""
    from .edits import spec_mounts

    out = [m for m in spec_mounts(edits) if m["kind"] != "library"]
    by_path = {m["container_path"]: m for m in edits["mounts"] if m["kind"] == "library"}
    links = {s["path"]: s["target"] for s in edits["symlinks"]}
    for directory in directories:
        for m in by_path.values():
            out.append(dict(m, container_path=posixpath.join(directory, posixpath.basename(m["container_path"]))))
        for s in edits["symlinks"]:
            lib = by_path.get(link_target(s["path"], links, set(by_path)) or "")
            if lib is not None:
                out.append(dict(lib, container_path=posixpath.join(directory, posixpath.basename(s["path"]))))
    unique: dict[str, dict] = {}
    for m in out:
        unique.setdefault(m["container_path"], m)
    return list(unique.values())


def default_lib_dirs(edits: dict, machine: str) -> list[str]:
    """Where an image's loader looks with no LD_LIBRARY_PATH and no cache entry: the host's own
    library directory and both glibc families' defaults (/usr/lib/<multiarch>, /usr/lib64),
    as `cdi generate --no-hook` binds them (decide.cdimodel.default_dirs)."""
    from . import cdimodel as cdi

    libs = [m["container_path"] for m in edits["mounts"] if m["kind"] == "library"]
    libdir = posixpath.dirname(libs[0]) if libs else "/usr/lib64"
    return cdi.default_dirs(libdir, machine)


def bind_dirs(edits: dict, env: dict, why: list[str], machine: str) -> list[str]:
    """The directories the libraries are bound in when the plugin does the in-container work:
    the LD_LIBRARY_PATH directory, unless a compat libcuda may have to come first (the loader
    reads LD_LIBRARY_PATH before the cache, so the driver's libraries then go to the default
    directories, which it reads after the cache)."""
    ldir = loader_dir(env)
    return [ldir] if ldir and "compat" not in why else default_lib_dirs(edits, machine)


def cache_dirs(dirs: list[str], system: set[str], compat_dir: str | None) -> list[str]:
    """The directories the plugin's loader cache lists: of the bind directories, those the
    image's own ldconfig scans (its family's defaults: a Debian image's /usr/lib/<multiarch>,
    not the /usr/lib64 bound for RHEL images), so that the cache is the one it would write; all
    of them where it scans none; the compat directory first when the image's libcuda is chosen."""
    dirs = ([compat_dir] if compat_dir is not None else []) + list(dirs)
    return [d for d in dirs if d in system or d == compat_dir] if system & set(dirs) else dirs


def answer_key(request: dict, env: dict) -> str | None:
    """What a decision reads of a container, as a key for its answer; None where the answer
    depends on more than the host's files and GPU list (NVML's MIG facts, `all`, MIG
    management: the live instances). The key is a digest: the values come from the pod's
    environment (up to ttrpc's 4 MiB), and up to 256 answers are kept."""
    import hashlib
    import json

    from . import compat, plan

    if (plan.needs_mig_facts(request) or request["devices"] == ["all"] or request.get("mig_config")
            or request.get("mig_monitor")):
        return None
    # LD_LIBRARY_PATH counts by the one directory the answer uses of it (loader_dir).
    read = {k: env.get(k) for k in ("CUDA_VERSION", compat.ENV_VAR)}
    read["loader_dir"] = loader_dir(env)
    return hashlib.sha256(json.dumps([request, read], sort_keys=True, default=str).encode()).hexdigest()


# NVIDIA's NRI plugin (1.19, 1.20) reads CDI device names from this pod annotation, as NRI's
# effective annotation: "<domain>/container.<container name>", else "<domain>/pod", else the
# domain alone; a comma list of fully qualified CDI names.
CDI_ANNOTATION = "nvidia.cdi.k8s.io"
MAX_CDI_NAMES = 64
# vendor/class=name, as CDI qualifies a device (the engine resolves it against its spec dirs).
CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*=[A-Za-z0-9][A-Za-z0-9._:-]*\Z")


def annotated_cdi_devices(annotations: dict[str, str], container: str, namespace: str,
                          namespaces: tuple[str, ...] | list[str]) -> tuple[list[str], str | None]:
    """The CDI devices pod annotation `nvidia.cdi.k8s.io/...` names for `container`, honoured
    only for a pod in one of `namespaces` (the operator's list; none by default): (names, None),
    or ([], why it is ignored) for a pod elsewhere, or ([], None) with no annotation. A value
    that is not a comma list of qualified CDI names is a HookError naming the annotation."""
    from ..base.errors import HookError

    for key in (f"{CDI_ANNOTATION}/container.{container}", f"{CDI_ANNOTATION}/pod", CDI_ANNOTATION):
        if key in annotations:
            break
    else:
        return [], None
    if namespace not in namespaces:
        allowed = ", ".join(namespaces) or "none"
        return [], (f"pod annotation {key} is honoured only in the namespaces the operator names (nvhook nri "
                    f"--cdi-annotation-namespace, config nri.cdi_annotation_namespaces: {allowed}), not in "
                    f"{namespace or 'its namespace'}")
    names = annotations[key].split(",")
    bad = [n for n in names if not CDI_NAME.match(n)]
    if bad or len(names) > MAX_CDI_NAMES:
        what = f"{bad[0][:80]!r} is not a CDI device name (vendor/class=name)" if bad else \
            f"{len(names)} names (at most {MAX_CDI_NAMES})"
        raise HookError(f"pod annotation {key}: {what}; give a comma list such as "
                        f"management.nvidia.com/gpu=all")
    return list(dict.fromkeys(names)), None


def engine_applies_cdi_devices(runtime: str, version: str) -> bool:
    """Whether the engine applies the CDI devices an NRI adjustment names: containerd from 2.1
    (its NRI has them; 1.7 drops the field unread), any other engine assumed to."""
    if runtime != "containerd":
        return True
    m = re.match(r"v?(\d+)\.(\d+)", version)
    return m is None or (int(m.group(1)), int(m.group(2))) >= (2, 1)
