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
# no process. The others (procfs, ldcache32, links) still take the CDI hook. The application
# profile ("profile" in StartWork.why) is the plugin's too where it does the rest, else the
# hook's, which writes it for the same capabilities.
IN_PLUGIN = ("ldcache", "compat")


@dataclass
class StartWork:
    """What a GPU container's StartContainer must do (the plugin, through its root): `why`
    (ldcache, compat), the directories its libraries are bound in (`dirs`), the libraries'
    container paths (`libraries`: the answer's binds, by which the start knows the container
    got nvhook's answer), and for the compat choice the request's expanded capabilities and the
    indices of the GPUs it was given (a MIG device's parent counted); `profile`: the driver
    application profile's text for a graphics or display container (decide/appprofile.py, from
    the device nodes its answer gives it; "profile" is then in `why`), or None."""

    why: list[str]
    dirs: list[str]
    libraries: list[str] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    profile: str | None = None
    # The image's key (image_key) where the engine named the image, so that the start records
    # where its loader looks; `guessed`: `dirs` are those an earlier start of the image showed
    # its loader searching, not every family's (bind_dirs).
    image: str | None = None
    guessed: bool = False

    def loader_work(self) -> bool:
        """Whether the start writes the loader files (the cache, the compat conf), not only the
        application profile."""
        return any(w in IN_PLUGIN for w in self.why)


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


def bind_dirs(edits: dict, env: dict, why: list[str], machine: str,
              searched: tuple[str, ...] | None = None) -> tuple[list[str], bool]:
    """The directories the libraries are bound in when the plugin does the in-container work,
    and whether they were picked by `searched`: the LD_LIBRARY_PATH directory, unless a compat
    libcuda may have to come first (the loader reads LD_LIBRARY_PATH before the cache, so the
    driver's libraries then go to the default directories, which it reads after the cache).
    Of the default directories (default_lib_dirs, one per glibc family), the first one the
    image's loader searches by default when an earlier start of the same image showed which
    (`searched`, from loader_defaults): half the binds of both families, each a mount the
    engine and runc make on every start; else all of them, since the image cannot be read
    before it is created."""
    ldir = loader_dir(env)
    if ldir and "compat" not in why:
        return [ldir], False
    dirs = default_lib_dirs(edits, machine)
    mine = [d for d in dirs if d in (searched or ())]
    return (mine[:1], True) if mine else (dirs, False)


# The engines' annotation naming a container's image (containerd's CRI plugin, CRI-O): the key
# under which the plugin remembers where that image's loader looks.
IMAGE_ANNOTATIONS = ("io.kubernetes.cri.image-name", "io.kubernetes.cri-o.ImageName")
# How many images' loader directories are remembered (each a digest and a few paths).
MAX_IMAGES = 1024


def image_key(annotations: dict[str, str], namespace: str) -> str | None:
    """What the loader directories of a container's image are remembered by: its name as the
    engine annotates it, within its pod's namespace (a pod elsewhere that names the same image
    over another one's annotation never moves this namespace's binds), as a digest; None where
    the engine names no image."""
    import hashlib
    import json

    for key in IMAGE_ANNOTATIONS:
        name = annotations.get(key)
        if name:
            return hashlib.sha256(json.dumps([namespace, name]).encode()).hexdigest()
    return None


def loader_defaults(libc_at: str | None, triplet: str | None) -> tuple[str, ...] | None:
    """The directories an image's glibc loader searches with no cache and no LD_LIBRARY_PATH
    (`ld.so --help`'s system search path), from the directory its libc.so.6 is in: a Debian or
    Ubuntu build's four (multiarch), a RHEL-family build's /lib64 and /usr/lib64, one that keeps
    64-bit libraries in /usr/lib (Arch) its /lib and /usr/lib; None where there is no glibc to
    tell by (musl, a static image)."""
    if libc_at is None:
        return None
    if triplet and libc_at in (f"/lib/{triplet}", f"/usr/lib/{triplet}"):
        return (f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib")
    if libc_at in ("/lib64", "/usr/lib64"):
        return ("/lib64", "/usr/lib64")
    return ("/lib", "/usr/lib")


def loader_finds(dirs: list[str], defaults: tuple[str, ...] | None) -> bool:
    """Whether the image's loader finds a library bound in one of `dirs` with no cache entry:
    one of them is a directory it searches by default (an image whose loader is not known, no
    glibc, counts as finding them: its own loader path file is what the start writes)."""
    return defaults is None or bool(set(dirs) & set(defaults))


def as_bound(work: StartWork, destinations: set[str]) -> StartWork:
    """`work` decided again (the plugin restarted since the container's creation, or
    Synchronize) narrowed to the directories the container has the libraries bound in: its
    creation may have bound them in one family's directory where this decision, without what
    the image showed before, binds every family's."""
    from dataclasses import replace

    names = {posixpath.basename(p) for p in work.libraries}
    dirs = [d for d in work.dirs if all(posixpath.join(d, n) in destinations for n in names)]
    if not dirs or dirs == work.dirs:
        return work
    return replace(work, dirs=dirs, libraries=[p for p in work.libraries if posixpath.dirname(p) in dirs],
                   guessed=True)


def start_profile(capabilities: list[str], device_nodes: list[dict]) -> tuple[str | None, list[int]]:
    """The application profile a container's start writes (decide/appprofile.py): for its
    capabilities and the device nodes its answer gives it (edits' device_nodes); (None, [])
    for one that asks for neither graphics nor display or gets no GPU node."""
    from . import appprofile

    # A node whose minor the host did not tell (None) is no GPU the mask can name.
    return appprofile.for_container(capabilities, [(n["path"], n.get("type") == "c", n["minor"])
                                                   for n in device_nodes if isinstance(n.get("minor"), int)])


def cache_dirs(dirs: list[str], system: set[str], compat_dir: str | None) -> list[str]:
    """The directories the plugin's loader cache lists: of the bind directories, those the
    image's own ldconfig scans (its family's defaults: a Debian image's /usr/lib/<multiarch>,
    not the /usr/lib64 bound for RHEL images), so that the cache is the one it would write; all
    of them where it scans none; the compat directory first when the image's libcuda is chosen."""
    dirs = ([compat_dir] if compat_dir is not None else []) + list(dirs)
    return [d for d in dirs if d in system or d == compat_dir] if system & set(dirs) else dirs


def answer_key(request: dict, env: dict, searched: tuple[str, ...] | None = None) -> str | None:
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
    read["searched"] = searched  # where the image's loader looks, as an earlier start showed
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
