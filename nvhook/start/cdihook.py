"""`nvidia-cdi-hook`, by nvhook: NVIDIA's CDI hook command line, done with nvhook's fd-safe code.

CDI specs written by NVIDIA's tools (nvidia-ctk, the device plugin, the DRA driver) call
`<hook path> <subcommand> --flag ...` as createContainer hooks. This front door accepts every
subcommand and flag of NVIDIA's 1.17-1.20 hook with the same meaning and exit codes, so that
those specs run with nvhook as their hook (docs/cdi-hook.md says where each differs on purpose):

  create-symlinks --link TARGET::LINK ...        links in the rootfs (apply/symlinks.py)
  update-ldcache --folder DIR ... [--ldconfig-path P]
                                                  the rootfs's ld.so.cache, written by nvhook
                                                  (apply/ldscan.py); no host ldconfig runs
  enable-cuda-compat [--host-driver-version V] [--host-cuda-version V]
                     [--cuda-compat-container-root DIR]
                                                  the image's compat libcuda, when nvhook's
                                                  per-GPU decision (decide/compat.py) says so
  disable-device-node-modification                params with ModifyDeviceFiles 0 over the
                                                  container's /proc/driver/nvidia/params
  chmod --mode OCTAL --path P ...                 modes, resolved inside the rootfs by fd
  create-soname-symlinks --folder DIR ...         SONAME links (1.18.0-rc.1's hook)
  noop                                            nothing
  global: --debug/-d, --quiet, --help/-h, --version/-v; every subcommand: --container-spec

An unknown subcommand (update-application-profile of 1.20 included), no subcommand, or an
unknown flag before the subcommand: a warning and exit 0, as NVIDIA's 1.18+ (a spec naming a
hook this version does not have never stops a container). An unknown flag or a bad value of a
known subcommand: one error line, exit 1, as NVIDIA's (urfave/cli's "flag provided but not
defined: -NAME").

The environment: when a spec's hook entry carries no `env`, runc runs createContainer hooks
with the container's own environment. Nothing of it is read here but NVIDIA's two logging
switches (NVIDIA_CTK_DEBUG/QUIET and their NVIDIA_CDI_ forms); the rest (NVHOOK_CONFIG and
NVHOOK_RUN_DIR included) is dropped before anything else runs, and nvhook's config is read from
its default path or from `--nvhook-config PATH` in the hook's arguments (which the spec's author
wrote, not the image). That the container's LD_PRELOAD never reached this interpreter at all is
the first stage's job: see bin/nvidia-cdi-hook and docs/cdi-hook.md.
"""

from __future__ import annotations

import os
import sys
import time

from .cdihookargs import (
    DEFAULTS,
    NAME,
    Out,
    Unsupported,
    UsageError,
    env_switches,
    parse,
    scrub_environment,
    usage,
)

PARAMS = "/proc/driver/nvidia/params"
_LOADER_VARS = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH")
# The state carries the spec's annotations, as large as a podman user or a CRI-O pod makes them
# (NVIDIA's hook reads any size): a state cut at 1 MiB failed the container.
MAX_STATE = 64 << 20


def read_state(spec: str | None) -> tuple[dict, bytes]:
    """The container state, and its bytes as read: from `--container-spec PATH`, else stdin
    (NVIDIA: empty or "-")."""
    from ..base import jsonfast as json
    from ..base.errors import HookError

    try:
        if spec and spec != "-":
            with open(spec, "rb") as f:
                data = f.read(MAX_STATE + 1)
        else:
            data = sys.stdin.buffer.read(MAX_STATE + 1)
        if len(data) > MAX_STATE:
            raise ValueError(f"more than {MAX_STATE >> 20} MiB")
        state = json.loads(data)
    except (OSError, ValueError) as e:
        raise HookError(f"failed to load container state: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("bundle"), str):
        raise HookError("failed to load container state: no bundle in it")
    return state, data


def container_root(state: dict, bundle_spec: dict | None = None) -> str:
    """root.path of the bundle's config.json, joined to the bundle when relative (NVIDIA's
    GetContainerRoot). `bundle_spec`: that config.json when already read (bundle_config)."""
    from ..base.errors import HookError

    bundle = state["bundle"]
    try:
        spec = bundle_config(state) if bundle_spec is None else bundle_spec
        path = spec["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HookError(f"failed to determine container root from bundle {bundle}: {e}") from None
    if not isinstance(path, str) or not path:
        raise HookError(f"failed to determine container root: bundle {bundle} has no root.path")
    root = os.path.normpath(path if path.startswith("/") else os.path.join(bundle, path))
    if root == "/":
        raise HookError("refusing a container root of / (the host's)")
    return root


def bundle_config(state: dict) -> dict:
    """The bundle's config.json (OSError, ValueError as json raises them)."""
    from ..base import jsonfast as json

    with open(os.path.join(state["bundle"], "config.json"), "rb") as f:
        spec = json.loads(f.read())
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    return spec


def open_root(path: str):
    from ..apply.paths import Root
    from ..base.errors import HookError

    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open the container root {path}: {e.strerror}") from None
    return Root(fd)


# -- the subcommands ---------------------------------------------------------------------------

def _links(opts: dict, root, log) -> None:
    from ..apply.symlinks import apply_symlinks
    from ..base.errors import HookError

    links, seen = [], set()
    for spec in opts.get("link") or []:
        if spec in seen:
            continue
        seen.add(spec)
        parts = spec.split("::")
        if len(parts) != 2:
            raise HookError(f"invalid symlink specification {spec}")
        links.append({"path": parts[1], "target": parts[0]})
    apply_symlinks(root, links, log)


def _ldcache(opts: dict, root, log) -> None:
    from ..apply import ldscan
    from ..base.errors import HookError

    if not opts.get("ldconfig-path"):
        raise HookError("ldconfig-path must be specified")
    # ldconfig (which NVIDIA's hook runs) also makes the SONAME links of the folders it
    # scans: the spec mounts only the versioned files (libcuda.so.535.261.03), and
    # libcuda.so.1 is what programs load.
    _soname_links(opts, root, log)
    folders = [d.rstrip("/") for d in opts.get("folder") or [] if d.startswith("/")]
    from ..apply import muslpath

    if muslpath.musl_arch(root) is not None:
        # musl's loader reads neither ld.so.conf nor ld.so.cache: every folder goes into its
        # path file (NVIDIA 1.19+ appends there too, for images with /etc/alpine-release).
        ldscan.update(root, folders, log)
        return
    # As NVIDIA's hook: folders the image's loader config or its system directories already
    # cover stay where that config puts them (so a 00-compat-*.conf written by
    # enable-cuda-compat comes first), the others go into a drop-in that also keeps them for
    # an ldconfig run inside the container later.
    extra = [d for d in dict.fromkeys(folders) if d not in _known_dirs(root)]
    if extra:
        _write_conf(root, "/etc/ld.so.conf.d", "00-nvcr-nvhook.conf", "".join(d + "\n" for d in extra))
    known = _known_dirs(root)
    ldscan.update(root, [d for d in extra if d not in known], log)


def _known_dirs(root) -> set[str]:
    """The directories the image's /etc/ld.so.conf (includes followed) and the loader's own
    defaults name."""
    from ..apply import ldscan

    scan = ldscan.Scan(root)
    scan.parse_conf("/etc/ld.so.conf")
    return set(scan.paths_seen) | set(scan.system_dirs())


def _soname_links(opts: dict, root, log) -> None:
    """For every shared library in the folders, a link from its SONAME to it (what
    `ldconfig -n` makes), read by nvhook's own ELF reader; an image's file at the name stays."""
    import stat

    from ..apply import ldscan
    from ..apply.symlinks import apply_symlinks
    from ..base.errors import HookError

    if not opts.get("ldconfig-path"):
        raise HookError("ldconfig-path must be specified")
    machine = os.uname().machine
    links = []
    for folder in opts.get("folder") or []:
        try:
            dfd = root.lookup(folder)
        except OSError:
            log.debug("soname.folder_missing", folder=folder)
            continue
        try:
            d = _reopen_dir(dfd)
        except OSError:
            os.close(dfd)
            continue
        try:
            for name in sorted(os.listdir(d)):
                if ".so" not in name:
                    continue
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=d)
                except OSError:
                    continue  # a link or something unreadable: ldconfig -n skips links too
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    elf = ldscan.read_elf(fd, st.st_size, machine)
                finally:
                    os.close(fd)
                soname = elf[1].decode(errors="replace") if elf and elf[1] else None
                if soname and soname != name and "/" not in soname:
                    links.append({"path": folder.rstrip("/") + "/" + soname, "target": name})
        finally:
            os.close(d)
            os.close(dfd)
    apply_symlinks(root, links, log)


def _chmod(opts: dict, root, log, out: Out) -> None:
    """NVIDIA's chmod, every path resolved inside the rootfs (a link the image planted cannot
    lead out of it) and changed through the fd resolved there."""
    import errno
    import stat

    from ..base.errors import HookError

    mode_s = (opts.get("mode") or "").strip()
    if not mode_s:
        raise HookError("a non-empty mode must be specified")
    try:
        mode = int(mode_s, 8)
        if mode < 0 or mode > 0o7777:
            raise ValueError
    except ValueError:
        raise HookError(f'failed to parse mode as octal: strconv.ParseUint: parsing "{mode_s}": '
                        f'invalid syntax') from None
    paths = opts.get("path") or []
    if any(not p.strip() for p in paths):
        raise HookError("paths must not be empty")
    first_error = None
    for p in paths:
        try:
            fd = root.lookup(p)
        except OSError as e:
            out.say("debug", f"Skipping path {p!r}: {e.strerror}")
            continue
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) == mode:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue  # not reached: lookup follows links inside the rootfs
            try:
                os.chmod(f"/proc/self/fd/{fd}", mode)
                log.debug("chmod.done", path=p, mode=oct(mode))
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
                    out.say("debug", f"Ignoring permission error with chmod: {p}: {e.strerror}")
                elif first_error is None:
                    first_error = f"chmod {p}: {e.strerror}"
        finally:
            os.close(fd)
    if first_error:
        raise HookError(first_error)


def _gpus_of_container(state: dict, cfg: dict, log) -> tuple[dict, list]:
    """The host inventory and the GPUs whose nodes the runtime put into config.json."""
    from ..decide import cdimodel as cdi
    from ..decide import plan as plan_mod
    from ..observe import host, oci

    bundle = oci.load_bundle(state["bundle"])
    caps = ["compute", "utility"]
    inv = host.observe(cfg.get("root") or "/", cfg["cache_dir"], log, capabilities=caps)
    req, _unknown = cdi.request_from_devices(bundle["devices"], inv, caps)
    selected, migs = plan_mod.select(req, inv["gpus"], inv["files"]["mig_minors"])
    gpus = selected + [m["gpu"] for m in migs if m["gpu"] not in selected]
    return {"inv": inv, "bundle": bundle}, gpus


def _compat(opts: dict, state: dict, rootfs: str, root, cfg: dict, log, out: Out) -> None:
    """NVIDIA's hook adds the image's compat directory to the loader's path when the compat
    libcuda's major is above the host driver's; nvhook's decision also asks whether every GPU
    the container got can use forward compatibility (no error 804 on GeForce)."""
    if not opts.get("host-driver-version") and not opts.get("host-cuda-version"):
        return  # NVIDIA's hook: a no-op without either version
    from ..decide import compat
    from ..observe import host, image

    facts, gpus = _gpus_of_container(state, cfg, log)
    inv = facts["inv"]
    host_version = inv["driver"].get("version") or opts.get("host-driver-version")
    candidates = image.find_compat_libs(rootfs, host_version, compat_root(opts))
    mode, _src, refused = compat.mode_from_env(facts["bundle"]["env"], cfg["compat"]["mode"],
                                               cfg["compat"]["allow_env_override"])
    if compat.needs_gpu_brands(["compute"], host_version, [c for c in candidates if not c.get("skipped")], mode):
        host.add_nvml(inv, cfg, log, reason="forward-compat decision needs GPU brands")
    decision = compat.decide(["compute", "utility"], host_version, gpus, candidates, mode)
    log.event("compat.decision", "info", **decision.get("event", {}))
    for w in decision.get("warnings") or []:
        out.say("warning", w)
    if decision["decision"] != "image" or not decision["libraries"]:
        out.say("debug", decision["reason"])
        return
    compat_dir = decision["libraries"][0].rsplit("/", 1)[0]
    _write_conf(root, "/etc/ld.so.conf.d", "00-compat-nvhook.conf", compat_dir + "\n")
    out.say("debug", f"{decision['reason']}: {compat_dir} added to the loader's path")


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


def _write_conf(root, directory: str, name: str, content: str) -> None:
    """A new file in a directory of the rootfs: created by fd (O_EXCL|O_NOFOLLOW under a
    temporary name, renamed over the final one), so that no link the image has there is
    written through. /etc/ld.so.conf is created (including the directory) when missing, as
    NVIDIA's hook does, so that the loader cache step reads the file."""
    import errno

    from ..base.errors import HookError

    def ours(t, path: str) -> None:
        if not root.same_mount(t.fd):
            raise HookError(f"the container's {path} is a volume mounted into it (a hostPath or a shared "
                            f"directory), not its image's: nvhook does not write {directory}/{name} there, where "
                            f"it would land outside the container's root filesystem; mount that volume elsewhere")

    try:
        etc = root.ensure("/etc", True)
        try:
            ours(etc, "/etc")
            ed = _reopen_dir(etc.fd)
            try:
                fd = os.open("ld.so.conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644, dir_fd=ed)
                os.write(fd, f"include {directory}/*.conf\n".encode())
                os.close(fd)
            except FileExistsError:
                pass
            finally:
                os.close(ed)
        finally:
            etc.close()
        t = root.ensure(directory, True)
        try:
            ours(t, directory)
            d = _reopen_dir(t.fd)
            try:
                # The NRI plugin is one long-lived process: a temporary file with its pid, left by
                # a write that failed (a full volume), or planted, would refuse every later start.
                tmp = f".{name}.{os.getpid()}"
                for _ in range(2):
                    try:
                        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o644, dir_fd=d)
                        break
                    except FileExistsError:
                        os.unlink(tmp, dir_fd=d)
                else:
                    raise OSError(errno.EEXIST, f"{tmp} keeps reappearing")
                try:
                    try:
                        data = memoryview(content.encode())
                        while data:
                            data = data[os.write(fd, data):]
                        os.fchmod(fd, 0o644)
                    finally:
                        os.close(fd)
                    os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=d)
                    except OSError:
                        pass
                    raise
            finally:
                os.close(d)
        finally:
            t.close()
    except OSError as e:
        raise HookError(f"cannot write {directory}/{name} in the container: {e.strerror}") from None


def _reopen_dir(fd: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def modified_params(content: bytes) -> bytes | None:
    """params with ModifyDeviceFiles 1 turned to 0; None when nothing is to change."""
    out, changed = [], False
    for line in content.decode(errors="replace").splitlines():
        if line.startswith("ModifyDeviceFiles: "):
            if line == "ModifyDeviceFiles: 0":
                return None
            if line == "ModifyDeviceFiles: 1":
                line, changed = "ModifyDeviceFiles: 0", True
        out.append(line + "\n")
    return "".join(out).encode() if changed else None


def _params(root, cfg: dict, log) -> None:
    """A read-only copy of the host's params with ModifyDeviceFiles 0, bound over the
    container's /proc/driver/nvidia/params. The copy lives on a tmpfs mounted on a directory
    nvhook makes in the rootfs and unmounts (detached) and removes once the bind holds the
    file, so nothing is left in the image; every step goes through fds resolved inside the
    rootfs, and the target must be a procfs file (the image cannot plant one: procfs is the
    runtime's mount)."""
    from ..base import sandbox
    from ..base.errors import HookError

    host_root = (cfg.get("root") or "/").rstrip("/")
    try:
        with open(host_root + PARAMS, "rb") as f:
            content = modified_params(f.read(1 << 16))
    except FileNotFoundError:
        return
    except OSError as e:
        raise HookError(f"failed to load params file: {e.strerror}") from None
    if content is None:
        return
    try:
        target = root.lookup(PARAMS)
    except OSError as e:
        log.debug("params.absent", reason=str(e))
        return  # no NVIDIA procfs in the container: nothing to hide
    try:
        if _masked_already(sandbox, target, content):
            log.info("params.already_masked", path=PARAMS, modify_device_files=0)
            return
        if sandbox.fstatfs_type(target) != sandbox.PROC_SUPER_MAGIC:
            raise HookError(f"{PARAMS} in the container is not on procfs; refusing to mount over it")
        # Random, not the pid alone: a hook killed before its rmdir leaves the directory in the
        # image's layer, and a later start of that container may get the same pid.
        name = f".nvhook-params-{os.getpid()}-{os.urandom(4).hex()}"
        rfd = _reopen_dir(root.fd)
        try:
            os.mkdir(name, 0o700, dir_fd=rfd)
            try:
                _params_via_tmpfs(sandbox, rfd, name, content, target, lambda: root.lookup(PARAMS))
            finally:
                os.rmdir(name, dir_fd=rfd)
        finally:
            os.close(rfd)
    except OSError as e:
        raise HookError(f"failed to mount modified params file: {e.strerror or e}") from None
    finally:
        os.close(target)
    log.info("params.masked", path=PARAMS, modify_device_files=0)


def _masked_already(sandbox, target: int, content: bytes) -> bool:
    """The target is the read-only tmpfs copy an earlier run of this entry bound there for this
    container (same bytes): the entry run twice (its marker lost to another container of the
    same id, the hook named in two phases) then succeeds as NVIDIA's does, which mounts again.
    An image cannot put a mount under /proc: only the runtime or a hook has."""
    if sandbox.fstatfs_type(target) != sandbox.TMPFS_MAGIC:
        return False
    fd = os.open(f"/proc/self/fd/{target}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not os.fstatvfs(fd).f_flag & os.ST_RDONLY:
            return False
        return os.read(fd, len(content) + 1) == content
    finally:
        os.close(fd)


def _params_via_tmpfs(sandbox, rfd: int, name: str, content: bytes, target: int, relookup) -> None:
    """Write `content` on a tmpfs mounted on the empty directory `name` (in the rootfs at
    `rfd`), bind it read-only over `target`, and detach the tmpfs again (the bind keeps the
    file). `relookup()` opens the target path again: after the bind, that reaches the bind."""
    from ..base.errors import HookError

    scratch = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
    try:
        sandbox.mount("tmpfs", f"/proc/self/fd/{scratch}", "tmpfs", 0, f"size={max(len(content), 4096)},mode=0700")
    finally:
        os.close(scratch)
    # A magic link resolves to the directory the fd was opened on, beneath the new mount (the
    # file would land in the image, and umount would find no mount root there): a name looked
    # up in the parent crosses onto the tmpfs.
    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
    try:
        if sandbox.fstatfs_type(inner) != sandbox.TMPFS_MAGIC:
            raise HookError(f"the tmpfs nvhook mounted on /{name} in the container is not there")
        fd = os.open("params", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=inner)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        src = os.open("params", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
        try:
            sandbox.mount(f"/proc/self/fd/{src}", f"/proc/self/fd/{target}", None, sandbox.MS_BIND)
        finally:
            os.close(src)
        # `target` still names the procfs file beneath the bind (as above): the remount must
        # name the bind itself, found again by path, and be nvhook's tmpfs file.
        bound = relookup()
        try:
            if sandbox.fstatfs_type(bound) != sandbox.TMPFS_MAGIC:
                raise HookError(f"{PARAMS} in the container is not nvhook's copy after the bind")
            sandbox.mount(None, f"/proc/self/fd/{bound}", None,
                          sandbox.MS_BIND | sandbox.MS_REMOUNT | sandbox.MS_RDONLY | sandbox.MS_NODEV
                          | sandbox.MS_NOSUID | sandbox.MS_NOEXEC)
        finally:
            os.close(bound)
    finally:
        try:
            sandbox.umount2(f"/proc/self/fd/{inner}", sandbox.MNT_DETACH)
        finally:
            os.close(inner)


# -- the front door ---------------------------------------------------------------------------

def _config(path: str | None, out: Out) -> dict:
    from ..base import config as config_mod
    from ..base.errors import HookError

    try:
        cfg: dict = config_mod.load(path or config_mod.DEFAULT_PATH, explicit=path is not None)
        return cfg
    except HookError as e:
        if path is not None:
            raise
        out.say("warning", f"{e.message}; using nvhook's defaults")
        return dict(config_mod.DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    """`nvidia-cdi-hook ARGS` (bin/nvidia-cdi-hook) and `nvhook cdi-hook ARGS`; behind the
    shell first stage (nvhook/data/nvidia-cdi-hook.sh) `--nvhook-first-stage MARKS HOOK_PATH
    ARGS`: HOOK_PATH is the entry's path as the runtime ran it, MARKS where the entries done
    for the container are recorded (nvhook/start/cdihookrun.py)."""
    argv = sys.argv[1:] if argv is None else argv
    first: tuple[str, str] | None = None
    if argv[:1] == ["--nvhook-first-stage"] and len(argv) >= 3:
        first, argv = (argv[1], argv[2]), argv[3:]
    env_debug, env_quiet = env_switches()
    # The loader removes these in secure mode (AT_SECURE): still here, the first stage ran without
    # it (a nosuid mount, a user namespace without the copies' group, a plain interpreter) and a
    # container's preload was loaded into this root process: said in the log of every start.
    exposed = [k for k in _LOADER_VARS if k in os.environ]
    scrub_environment()
    out = Out(env_debug, env_quiet)
    try:
        glob, sub, opts = parse(argv)
    except Unsupported as u:
        out.say("warning", f"Unsupported CDI hook: {u.args[0]}" if u.args[0] else "No CDI hook specified")
        return 0
    except UsageError as e:
        out.say("error", str(e))
        return 1
    out = Out(bool(glob.get("debug") or glob.get("d") or env_debug) and not env_quiet,
               bool(glob.get("quiet") or env_quiet))
    if glob.get("help") or glob.get("h") or opts.get("help") or opts.get("h"):
        sys.stdout.write(usage())
        return 0
    if glob.get("version") or glob.get("v"):
        from .hook import _version

        sys.stdout.write(f"{NAME} (nvhook) version {_version()}\n")
        return 0
    if sub == "noop":
        return 0
    return run(sub, opts, glob.get("nvhook-config"), out, first=first, argv=argv, exposed=exposed)


def _step(sub: str, opts: dict, state: dict, rootfs: str, root, cfg: dict, log, out: Out) -> None:
    if sub == "create-symlinks":
        _links(opts, root, log)
    elif sub == "update-ldcache":
        _ldcache(opts, root, log)
    elif sub == "create-soname-symlinks":
        _soname_links(opts, root, log)
    elif sub == "chmod":
        _chmod(opts, root, log, out)
    elif sub == "enable-cuda-compat":
        _compat(opts, state, rootfs, root, cfg, log, out)
    elif sub == "disable-device-node-modification":
        _params(root, cfg, log)


def run(sub: str, opts: dict, config_path: str | None, out: Out, first: tuple[str, str] | None = None,
        argv: list[str] | None = None, exposed: list[str] | None = None) -> int:
    from ..base.errors import HookError
    from ..base.log import EventLog

    t0 = time.perf_counter()
    log = EventLog("debug" if out.debug else "info", None)
    code = 0
    try:
        cfg = _config(config_path, out)
        log.path = cfg["log_file"]
        log.journal = cfg.get("log_journal", False)
        if log.path and not log.journal and not os.access(log.path, os.W_OK):
            from .cdihookrun import user_namespaced

            if user_namespaced():
                # a user-namespaced container's entries run as its root, an unprivileged host
                # uid that cannot append to root's log: the node's journal (its socket is open
                # to every uid) keeps the events, cdi_hook.loader_env_reached above all; a
                # rootless engine's user without one gets a log of their own
                from ..base.userns import log_target

                log.path, log.journal, log.open_as = log_target(log.path)
                log.journal = log.journal or log.path == cfg["log_file"]
        if not out.debug:
            from ..base.log import LEVELS

            log.level = LEVELS.get(cfg["log_level"], 20)
        state, raw = read_state(opts.get("container-spec"))
        log.bind(container=state.get("id"), cdi_hook=sub)
        if exposed:
            log.warning("cdi_hook.loader_env_reached", variables=exposed,
                        reason="the hook ran without AT_SECURE: the container's loader variables reached it "
                               "(CVE-2025-23266); see docs/cdi-hook.md, 'The container's environment never "
                               "reaches the hook'")
        spec = None
        if first is not None and not opts.get("container-spec"):
            try:
                spec = bundle_config(state)
            except (OSError, ValueError):
                pass  # container_root says what is wrong
        rootfs = container_root(state, spec)
        root = open_root(rootfs)
        try:
            _step(sub, opts, state, rootfs, root, cfg, log, out)
            log.info("cdi_hook.done", root=rootfs, ms=round((time.perf_counter() - t0) * 1000, 2))
            if spec is not None and first is not None:
                try:
                    _run_after(first, spec, state, raw, argv or [], config_path, rootfs, root, cfg, log)
                except Exception as e:  # never this entry's failure: the later ones run themselves
                    log.warning("cdi_hook.not_coalesced", reason=f"{type(e).__name__}: {e}")
        finally:
            os.close(root.fd)
    except HookError as e:
        code = 1
        log.error("cdi_hook.failed", error=e.message)
        out.say("error", e.message)
    except Exception as e:  # a bug: one line for the user, the details in the log
        import traceback

        code = 1
        log.error("cdi_hook.crashed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        out.say("error", f"internal error: {type(e).__name__}: {e} (details in the nvhook log)")
    finally:
        log.flush()
    return code


def _run_after(first: tuple[str, str], spec: dict, state: dict, raw: bytes, argv: list[str],
               config_path: str | None, rootfs: str, root, cfg: dict, log) -> None:
    """The entries after this one with the same hook path, done here in their order, and the
    marker that lets their own runs end in the shell first stage (nvhook/start/cdihookrun.py).
    The first that fails is left to its own run (which does it again, and fails with NVIDIA's
    message and exit code there); so is everything after it."""
    from ..base.errors import HookError
    from . import cdihookrun

    marks, hook_path = first
    # createContainer entries run from the container's init, whose pid the state carries (runc:
    # as the container's pid namespace numbers it, which is this process's too; crun: 0). The
    # same entry named in prestart or createRuntime runs from the runtime itself: doing the
    # createContainer entries there would do them a phase early, in the runtime's namespaces.
    if state.get("pid") not in (0, os.getppid()):
        log.debug("cdi_hook.not_coalesced", reason="not run from the container's init (another phase's entry)")
        return
    steps = cdihookrun.plan(spec, hook_path, argv, config_path)
    if not steps:
        return
    cid = cdihookrun.marker_name(state, raw)
    key = cdihookrun.parent_key()
    if cid is None or key is None:
        log.debug("cdi_hook.not_coalesced", reason="no container id or parent process the first stage can check")
        return
    dfd = cdihookrun.marks_dir(marks)
    if dfd is None and cdihookrun.user_namespaced():
        # the container's root is an unprivileged host uid: root's marker directory is not its
        # to write (nor to trust), so each entry runs itself, as NVIDIA's hook does
        log.debug("cdi_hook.not_coalesced", reason="in a user namespace whose root is not the host's: each entry "
                  "runs in its own process")
        return
    if dfd is None:
        log.warning("cdi_hook.not_coalesced", reason=f"{marks} is not a directory only root can write")
        return
    done: list[list[str]] = []
    try:
        for st in steps:
            t0 = time.perf_counter()
            log.bind(cdi_hook=st.sub or "unsupported")
            if st.warning is not None:
                st.out.say("warning", st.warning)
            else:
                try:
                    _step(st.sub, st.opts, state, rootfs, root, cfg, log, st.out)
                except HookError as e:
                    log.info("cdi_hook.left_to_its_entry", error=e.message)
                    break
                except Exception as e:  # its own run reports it (a crash there too, if it is one)
                    log.info("cdi_hook.left_to_its_entry", error=f"{type(e).__name__}: {e}")
                    break
            done.append(st.args)
            log.info("cdi_hook.done", root=rootfs, ms=round((time.perf_counter() - t0) * 1000, 2),
                     coalesced=True)
        if done:
            cdihookrun.write_marker(dfd, cid, key, done, log)
    finally:
        os.close(dfd)
