"""StartContainer's work for a GPU container whose answer left it to the plugin: what a hook
would have done inside the container, done from the plugin through its root (/proc/<pid>/root,
checked to be that container's) by fd, RESOLVE_IN_ROOT: the driver application profile of a
graphics or display container (as hook mode writes it), the compat libcuda choice (reading the
image's files, the same decision as hook mode) and the loader cache, /etc/ld.so.cache written
with the directories the libraries are bound in (and the compat directory first when the
image's libcuda is chosen). The files are in apply/nriroot.py, the choices in
decide/nriwork.py; every read of the container's files here has a deadline.
"""

from __future__ import annotations

import os
import posixpath

from ...base import sandbox
from ...base.errors import HookError
from ...base.nrimessages import Container
from ...decide.nriwork import StartWork

# The share of containerd's plugin_request_timeout (2 s by default; containerd 1.7 does not send
# it, so the default is assumed) a StartContainer's reads of the container's files may spend: an
# image can make them slow (thousands of libraries read cold from disk: 13 s measured for
# 16,000 here), and an answer past the timeout makes containerd drop the plugin, so that every
# GPU container created before it reconnects starts without its GPU. Past the share, that one
# start is refused instead.
START_SCAN_SHARE = 0.5
# The loader config file naming the directories the driver's libraries are bound in, for an
# image whose loader does not search them by default.
DRIVER_CONF = "00-driver-nvhook.conf"


def start_work(plugin, c: Container, work: StartWork, log) -> dict:
    """Do `work` for created container `c` (its init waits on the start): its application
    profile first (write_profile), then the loader files where the work has them. A read-only root
    filesystem: refused when the compat libcuda must be used (only the cache can put it first),
    else a warning (the libraries load from their binds; `ldconfig -p` does not list them).
    Every read of the container's files ends by one deadline, a share of the engine's request
    timeout: past it, this start is refused. Returns the `nri.started` event's fields."""
    from ...apply import ldscan, nriroot
    from ...apply.ldconf import TRIPLETS
    from ...apply.paths import Root
    from ...decide.nriwork import cache_dirs, loader_defaults, loader_finds
    from ...observe.image import CompatScanTooSlow

    budget = plugin.request_timeout_ms / 1000 * START_SCAN_SHARE
    deadline = ldscan.clock() + budget
    fd, owner = nriroot.open_container_root(c.pid, c.id)
    bits = None
    try:
        bits = keep_fs_caps(owner)
        root = Root(fd, owner=owner)
        out: dict = {"work": ",".join(work.why), "compat": None}
        if work.profile is not None:
            out["app_profile"] = write_profile(root, work.profile, log)
        if not work.loader_work():
            return out
        compat_dir = None
        try:
            scan = ldscan.Scan(root)
            defaults = loader_defaults(scan.libc_dir(), TRIPLETS.get(scan.machine))
            if work.image is not None:
                plugin.book.learn(work.image, defaults)
            finds = loader_finds(work.dirs, defaults)
            out["lib_dirs"] = ",".join(work.dirs)
            if "compat" in work.why:
                out["compat"], compat_dir = compat_choice(plugin, c, work, fd, log, deadline)
            refused = nriroot.etc_refusal(root, plugin.root, compat_dir, log, c.id)
            if refused is not None:
                if not finds:
                    raise HookError(unreachable(work, defaults, next(iter(refused.values()))))
                return dict(out, **refused)
            if not finds and nriroot.etc_is_volume(root):  # no cache can be written there either
                raise HookError(unreachable(work, defaults, "volume"))
            if compat_dir is not None:
                from ...apply.ldconfdropin import write_conf

                write_conf(root, "/etc/ld.so.conf.d", "00-compat-nvhook.conf", compat_dir + "\n")
                out["compat_dir"] = compat_dir
            if not finds:
                out["lib_conf"] = cache_only(root, work, defaults, log, c.id)
            dirs = cache_dirs(work.dirs, set(scan.system_dirs()), compat_dir)
            out["ldcache"] = ldscan.update(root, dirs, log, deadline=deadline)
        except (ldscan.ScanTooSlow, CompatScanTooSlow) as e:
            raise HookError(f"{e.message}: past {round(budget * 1000)} ms, half of containerd's NRI "
                            f"request timeout, so nvhook wrote no loader cache and refused this start rather "
                            f"than be dropped by containerd; starting it again usually finds the image's "
                            f"files in the page cache") from None
        return out
    finally:
        os.close(fd)
        if bits is not None:
            sandbox.set_securebits(bits)


def keep_fs_caps(owner: tuple[int, int]) -> int | None:
    """SECBIT_NO_SETUID_FIXUP for the calling thread while it works in a container with a user
    namespace of its own, whose files nvhook creates as that container's root (a host uid such
    as 100000: sandbox.FsIds). Why: switching the fsuid from 0 to another id makes the kernel
    drop CAP_DAC_OVERRIDE & co. from the effective set, so nvhook could not make the profile's
    second directory inside its first (0555, as NVIDIA's hook makes them) nor write the cache
    in an image's 0555 /etc, which the container's root itself may (it holds those capabilities
    in its namespace); hook mode sets the same bit in its apply child (apply/child.py).
    Securebits are per thread, and the start work runs in a thread of the plugin's (or in the
    one that reads the socket): the previous bits are returned for start_work to set back once
    the work ends; None where nothing was changed (the container's root is host root, the bit
    is set already, or this process may not set securebits: no CAP_SETPCAP, where the writes
    that need the bit fail with their own lines, as before)."""
    if owner == (0, 0):
        return None
    try:
        bits = sandbox.get_securebits()
        if bits & sandbox.SECBIT_NO_SETUID_FIXUP:
            return None
        sandbox.set_securebits(bits | sandbox.SECBIT_NO_SETUID_FIXUP)
    except OSError:
        return None
    return bits


def unreachable(work: StartWork, defaults: tuple[str, ...] | None, etc: str) -> str:
    """The line that refuses a start whose libraries only the loader cache can point at (the
    image's loader searches none of their directories by default), where the cache cannot be
    written (`etc`: read-only, node-etc, volume)."""
    why = {"read-only": "the container's /etc is read-only",
           "volume": "the container's /etc is a volume mounted into it, not its image's"}.get(
        etc, "the container's /etc is this node's own /etc (a hostPath volume)")
    bound = ", ".join(work.dirs)
    looks = ", ".join(defaults or ())
    if work.guessed:
        return (f"the driver's libraries were bound in {bound}, where this image's loader looked when nvhook last "
                f"started it, but the image changed: its loader searches {looks}; {why}, so nvhook cannot list "
                f"them in its loader cache: start the container again (nvhook now binds them where this image "
                f"looks)")
    return (f"this image's loader searches {looks}, none of the directories nvhook binds the driver's libraries in "
            f"({bound}), and {why}, so nvhook cannot list them in its loader cache: allow writes to the root "
            f"filesystem (readOnlyRootFilesystem: false) or set LD_LIBRARY_PATH={work.dirs[0]} in the image")


def cache_only(root, work: StartWork, defaults: tuple[str, ...] | None, log, cid: str) -> str:
    """For an image whose loader searches none of the directories the libraries are bound in:
    the loader config names them (so that the image's own ldconfig, run later, keeps them in
    its cache too), and the cache written next lists them. "written", for the event; or
    "not-written" (a warning) where the image's /etc/ld.so.conf.d cannot take it (a volume
    such as a ConfigMap, a file, a link loop): the cache, in the image's own /etc, is what
    makes the loader find them, and is written all the same."""
    from ...apply.ldconfdropin import write_conf

    try:
        write_conf(root, "/etc/ld.so.conf.d", DRIVER_CONF, "".join(d + "\n" for d in work.dirs))
    except HookError as e:
        log.warning("nri.lib_conf_not_written", container=cid, lib_dirs=work.dirs, error=e.message,
                    message=f"the loader cache lists the driver's libraries in {', '.join(work.dirs)}, which "
                            f"this image's loader does not search by default, but no loader config names them: "
                            f"an ldconfig the container runs drops them from its cache")
        return "not-written"
    log.event("nri.lib_dirs_not_searched", "warning" if work.guessed else "info", container=cid,
              lib_dirs=work.dirs, searched=list(defaults or ()),
              message=("the image changed since nvhook last started it: " if work.guessed else "") +
                      f"its loader does not search {', '.join(work.dirs)} by default; the libraries are found "
                      f"through its loader cache and /etc/ld.so.conf.d/{DRIVER_CONF}")
    return "written"


def write_profile(root, text: str, log) -> str:
    """The application profile of a graphics or display container (decided at its
    CreateContainer from the device nodes its answer gave it), through its root by fd: a few
    lookups and one small file, before the loader work, whose reads of the image are what the
    deadline bounds. Never a failed start: what the image's layout keeps out (a volume, a
    link, a file on the way, a read-only /etc) is the warning app_profile.not_written.
    "written" or "not-written", for the nri.started event."""
    from ...apply.profilefile import write_profile_or_warn

    return "written" if write_profile_or_warn(root, text, log) else "not-written"


def compat_choice(plugin, c: Container, work: StartWork, fd: int, log, deadline: float) -> tuple[str, str | None]:
    """Hook mode's compat decision for container `c` whose root is `fd`: (decision, the compat
    directory to put first, or None). The image's compat libraries are read by path below the
    fd (links clamped at its root: observe/image.py) until `deadline` (on ldscan.clock:
    CompatScanTooSlow past it), with no lock held and pausing while any other request is
    answered: another container's answer never waits on this image. An image without compat
    libraries (most plain images) is decided from that alone; one with them against the GPUs
    its answer gave it (their brands from NVML when the rule needs them), as pipeline.decide
    would."""
    from ...apply import ldscan
    from ...decide import compat
    from ...observe import host, image
    from ...observe.host import procfs

    version = procfs.driver_version(plugin.root)
    # A background scan: it waits whenever another request is being answered (an image can
    # make it parse thousands of ELF files, and the interpreter runs one thread at a time).
    plugin.count_answering(-1)
    try:
        found = image.find_compat_libs(f"/proc/self/fd/{fd}", version, deadline=deadline, clock=ldscan.clock,
                                       between=lambda: plugin.wait_while_answering(deadline, ldscan.clock))
    finally:
        plugin.count_answering(1)
    cfg = plugin.cfg
    mode, source, refused = compat.mode_from_env(c.env, cfg["compat"]["mode"], cfg["compat"]["allow_env_override"])
    caps, gpus = ["compute"], []
    if found:
        if refused:
            log.warning("compat.override_refused", message=refused)
        caps = work.capabilities or caps
        with plugin.book.lock:  # the host's inventory cache is shared; no container file is read here
            inv = host.observe(plugin.root, cfg["cache_dir"], log, capabilities=caps)
            if compat.needs_gpu_brands(caps, version, found, mode):
                host.add_nvml(inv, cfg, log, reason="forward-compat decision needs GPU brands")
        gpus = [g for g in inv["gpus"] if g["index"] in work.gpus]
    d = compat.decide(caps, version, gpus, found, mode)
    level = "warning" if d.get("warnings") else "info"
    log.event("compat.decision", level, **dict(d["event"], mode=mode, mode_source=source, reason=d["reason"],
                                               warnings=d.get("warnings") or None))
    if d["decision"] == "image" and d["libraries"]:
        return "image", posixpath.dirname(d["libraries"][0])
    return d["decision"], None
