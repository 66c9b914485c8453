"""The node `nvhook node install` works on: its root reached through nvhook.base.rootpath (never
followed out into the installer's own filesystem), commands run as the node (chroot with its
own python3), what is installed there (the files, launchers, config and units), and the record
of every change that uninstall puts back."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import posixpath
import shutil
import stat
import subprocess

from ..base import rootpath
from ..base.errors import HookError
from .hookstages import shell_stage

INSTALL_DIR = "/opt/nvhook"
RECORD = "/var/lib/nvhook/node-install.json"
MARKER = ".nvhook-node-install"
CONFIG = "/etc/nvhook/hook.toml"
CDI_SPEC = "/etc/cdi/nvhook.json"
# nvidia-cdi-hook's python stage runs under a copy of the node's python3, root-owned,
# set-group-ID to nvhook-hook, mode 2711 (as the .deb's /usr/lib/nvhook/libexec/python3):
# executing it changes the effective gid, so the kernel sets AT_SECURE and the loader ignores an
# LD_PRELOAD that runc handed over from the container's environment (a spec's hook entry without
# `env`). Executable by others (a user-namespaced container's root is an unprivileged host uid),
# so everyone can have that gid: nvhook/commands/hookgroup.py says why that gives no one anything.
HOOK_PYTHON = "/opt/nvhook/libexec/python3"
# bin/nvidia-cdi-hook itself is the shell first stage (nvhook/data/nvidia-cdi-hook.sh): its #!
# names a copy of the node's /bin/sh made the same way, which ends the later entries of a run
# that the python stage (libexec/nvidia-cdi-hook.py under HOOK_PYTHON) did in one process.
HOOK_SH = "/opt/nvhook/libexec/sh"
HOOK_STAGE2 = "/opt/nvhook/libexec/nvidia-cdi-hook.py"
HOOK_MARKS = "/run/nvhook/cdi-hook"
UNIT_DIR = "/etc/systemd/system"
UNITS = {"nvhook-cdi.service": None, "nvhook-cdi.path": "multi-user.target.wants",
         "nvhook-cdi.timer": "timers.target.wants"}
ENGINE_FILES = {"containerd": ["/etc/containerd/config.toml", "/etc/containerd/conf.d/99-nvhook.toml"],
                "docker": ["/etc/docker/daemon.json"],
                "crio": ["/etc/crio/crio.conf.d/99-nvhook.conf", "/etc/crio/crio.conf.d/99-nvhook-nri.conf"]}
# --nri: the engines with NRI, the file `nvhook runtime enable-nri` edits in each, and the
# plugin's unit (the shipped one, run from /opt/nvhook, enabled in multi-user.target)
NRI_FILES = {"containerd": "/etc/containerd/config.toml", "crio": "/etc/crio/crio.conf.d/99-nvhook-nri.conf"}
NRI_UNIT = "nvhook-nri.service"
ENGINE_SIGNS = {"containerd": ["/etc/containerd", "/usr/bin/containerd", "/usr/local/bin/containerd"],
                "crio": ["/etc/crio", "/usr/bin/crio", "/usr/local/bin/crio"],
                "docker": ["/etc/docker", "/usr/bin/dockerd", "/usr/local/bin/dockerd"]}
# What nvhook writes while it runs on the node (the shipped config's log_file and cache_dir):
# removed by uninstall unless they were there before install.
RUN_FILES = ["/var/log/nvhook.log", "/run/nvhook"]
# Module (import name) -> distribution, copied with nvhook: its pure-Python dependencies.
DEPENDENCIES = {"click": "click", "structlog": "structlog", "elftools": "pyelftools", "pynvml": "nvidia-ml-py",
                "tomli": "tomli"}


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Host:
    """The node's root at `root`: host paths resolved inside it (rootpath), never outside."""

    def __init__(self, root: str):
        # abspath, not realpath: /proc/PID/root (another mount namespace's root, as a test or
        # nsenter-less tool passes it) reads as a link to "/", which would be this machine's root
        real = os.path.abspath(root)
        if not os.path.isdir(real):
            raise HookError(f"--host-root {root} is not a directory; mount the node's / there (hostPath /)")
        self.root = real
        self.created: list[str] = []  # directories made (inside paths): the record keeps them

    def where(self, path: str) -> str | None:
        """This machine's path for the node's `path` (its parents' links resolved inside the
        root, the last component itself not followed), or None when a parent is missing."""
        parent, name = posixpath.split(path)
        inside = rootpath.resolve(self.root, parent)
        return None if inside is None else rootpath.join(self.root, posixpath.join(inside, name))

    def resolved(self, path: str) -> str | None:
        """Like where, the last component followed too (a config that is a link inside the node)."""
        inside = rootpath.resolve(self.root, path)
        return None if inside is None else rootpath.join(self.root, inside)

    def makedirs(self, path: str) -> str:
        """The node's directory `path`, created component by component inside the root (a
        link on the way to a missing directory: its target is created, inside the root)."""
        return rootpath.join(self.root, self._mkdirs(path, 0))

    def _mkdirs(self, path: str, depth: int) -> str:
        if depth > rootpath.MAX_LINKS:
            raise HookError(f"cannot create {path} on the node: too many levels of links")
        done = "/"
        for comp in [c for c in path.split("/") if c]:
            want = posixpath.join(done, comp)
            inside = rootpath.resolve(self.root, want)
            if inside is None:
                here = posixpath.join(done, comp)
                if os.path.islink(rootpath.join(self.root, here)):
                    target = os.readlink(rootpath.join(self.root, here))
                    inside = self._mkdirs(posixpath.join(done, target), depth + 1)
                else:
                    os.mkdir(rootpath.join(self.root, here), 0o755)
                    self.created.append(here)
                    inside = here
            elif not os.path.isdir(rootpath.join(self.root, inside)):
                raise HookError(f"cannot create {path} on the node: {want} is not a directory")
            done = inside
        return done

    def read(self, path: str) -> tuple[bytes, int] | None:
        p = self.resolved(path)
        if p is None:
            return None
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise HookError(f"cannot read {path} on the node: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise HookError(f"{path} on the node is not a regular file")
            return f.read(), stat.S_IMODE(os.fstat(f.fileno()).st_mode)

    def write(self, path: str, data: bytes, mode: int = 0o644, gid: int | None = None) -> None:
        """A new file beside the target, renamed over it (a link there is replaced, not followed);
        owned by root and `gid` when given (before its mode: chown clears set-group-ID)."""
        directory = self.makedirs(posixpath.dirname(path))
        final = os.path.join(directory, posixpath.basename(path))
        tmp = final + ".nvhook-new"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        # created 0600: a set-group-ID mode given at creation would be root's group's until the
        # fchown (a local user executing the copy under its temporary name: effective gid 0)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if gid is not None:
                os.fchown(f.fileno(), 0, gid)
            os.fchmod(f.fileno(), mode)
        os.rename(tmp, final)

    def exists(self, path: str) -> bool:
        p = self.where(path)
        return p is not None and os.path.lexists(p)

    def remove(self, path: str) -> bool:
        """Remove the node's file, link or tree at `path` (never what a link points at)."""
        p = self.where(path)
        if p is None or not os.path.lexists(p):
            return False
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        return True

    def rmdir_empty(self, path: str) -> bool:
        p = self.where(path)
        try:
            os.rmdir(p) if p else None
            return p is not None
        except OSError:
            return False


# -- the node's python --------------------------------------------------------------------------

def required_python() -> tuple[int, int]:
    """The oldest python nvhook runs on: its own Requires-Python."""
    from importlib import metadata

    try:
        spec = metadata.metadata("nvhook")["Requires-Python"] or ">=3.9"
    except metadata.PackageNotFoundError:
        spec = ">=3.9"
    for part in spec.split(","):
        part = part.strip()
        if part.startswith(">="):
            nums = part[2:].strip().split(".")
            return int(nums[0]), int(nums[1]) if len(nums) > 1 else 0
    return 3, 9


def check_proc(host: Host) -> None:
    """The node's /proc must show this process: what install runs as the node (chroot) reads
    /proc/self, and nvhook reopens each driver library through /proc/self/fd after checking it.
    A DaemonSet's pod is in a child of the node's pid namespace, so it is there; a process of
    another tree (the node being a container of this machine: a kind node, or the tests' node
    reached from the machine) is not, and the CDI spec would silently lose every library. A
    host root with no /proc mounted at all (a node image, a plain `mount --bind /` that leaves
    the node's submounts out) would have every command run as the node miss it the same way."""
    if host.root == "/":
        return
    proc = rootpath.join(host.root, "/proc")
    if not os.path.isdir(proc) or os.path.islink(proc) or not os.path.ismount(proc):
        raise HookError(f"--host-root {host.root} has no /proc mounted: mount the node's / with its submounts "
                        "(hostPath / as Kubernetes mounts it, or mount --rbind), or mount proc on "
                        f"{host.root}/proc; nothing installed")
    if not os.path.exists(os.path.join(proc, "self")):
        raise HookError(f"the node's /proc (under --host-root {host.root}) does not show this process: run it in the "
                        "node's pid namespace or one of its children (a pod; from the machine: nsenter --target "
                        "<a node process> --pid)")


def in_node(host: Host, argv: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command as the node sees it: chrooted into its root (paths, links and the dynamic
    loader are the node's)."""
    full = ["chroot", host.root, *argv] if host.root != "/" else argv
    base_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
    try:
        r = subprocess.run(full, env={**base_env, **(env or {})}, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, errors="replace")
    except OSError as e:
        raise HookError(f"cannot run {argv[0]} in the node's root: {e.strerror}") from None
    if check and r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        raise HookError(f"{' '.join(argv[:4])} failed on the node (exit {r.returncode}): {tail}")
    return r


def node_python(host: Host, python: str) -> tuple[int, int]:
    need = required_python()
    fix = (f"install python3 >= {need[0]}.{need[1]} on the node (its package manager), or name another "
           "interpreter with --host-python PATH")
    if not posixpath.isabs(python):
        raise HookError(f"--host-python {python} must be an absolute path on the node")
    if host.resolved(python) is None:
        raise HookError(f"the node has no {python}: nvhook runs on the node's own python; {fix}")
    r = in_node(host, [python, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=False)
    try:
        major, minor = (int(x) for x in r.stdout.strip().split("."))
    except ValueError:
        raise HookError(f"the node's {python} does not run (exit {r.returncode}: "
                        f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}); {fix}") from None
    if (major, minor) < need:
        raise HookError(f"the node's {python} is Python {major}.{minor}; nvhook needs {need[0]}.{need[1]} or "
                        f"newer: {fix}")
    return major, minor


NODE_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def node_oci_runtime(host: Host, runtime: str) -> str:
    """The node's path of the OCI runtime nvhook-runtime is to run (a name looked up on the
    node's PATH, as nvhook-runtime will): a missing one would fail every GPU pod's start, so
    install stops here instead."""
    if "/" in runtime and not posixpath.isabs(runtime):
        raise HookError(f"--oci-runtime {runtime} must be a name on the node's PATH or an absolute path on the node")
    candidates = [runtime] if posixpath.isabs(runtime) else [posixpath.join(d, runtime) for d in NODE_PATH]
    for path in candidates:
        p = host.resolved(path)
        if p is not None and os.path.isfile(p) and os.access(p, os.X_OK):
            return path
    where = runtime if posixpath.isabs(runtime) else f"{runtime} on its PATH ({':'.join(NODE_PATH)})"
    raise HookError(f"the node has no executable {where}: install it, or name the node's runc or crun with "
                    "--oci-runtime PATH")


# -- what gets copied ---------------------------------------------------------------------------

def sources() -> list[tuple[str, str]]:
    """(this machine's path, name under lib/) of nvhook and each dependency importable here."""
    import importlib.util

    import nvhook

    out = [(nvhook.__path__[0], "nvhook")]
    for module in DEPENDENCIES:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            continue
        if spec.submodule_search_locations:
            out.append((list(spec.submodule_search_locations)[0], module))
        else:
            out.append((spec.origin, os.path.basename(spec.origin)))
    return out


def _dist_infos() -> dict[str, bytes]:
    """name-version.dist-info/METADATA for nvhook and the copied dependencies: click's
    version_option and `nvhook --version` read them."""
    from importlib import metadata

    out = {}
    for dist in ["nvhook", *DEPENDENCIES.values()]:
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        text = d.read_text("METADATA")
        if text:
            name = d.metadata["Name"].replace("-", "_")
            out[f"{name}-{d.version}.dist-info/METADATA"] = text.encode()
    return out


def wanted_tree(python: str) -> dict[str, tuple[bytes, int]]:
    """Every file of /opt/nvhook, relative to it: (content, mode)."""
    files: dict[str, tuple[bytes, int]] = {}
    for src, name in sources():
        if os.path.isfile(src):
            with open(src, "rb") as f:
                files[f"lib/{name}"] = (f.read(), 0o644)
            continue
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                if fn.endswith((".pyc", ".pyo")) or fn.startswith(".") or fn == "modbundle.bundle":
                    continue
                if fn.endswith(".bundle") or fn.endswith(".so"):
                    continue
                full = os.path.join(dirpath, fn)
                rel = os.path.relpath(full, src)
                with open(full, "rb") as f:
                    files[f"lib/{name}/{rel}"] = (f.read(), 0o644)
    for rel, data in _dist_infos().items():
        files[f"lib/{rel}"] = (data, 0o644)
    for name, module in (("nvhook", "nvhook.entry"), ("nvhook-runtime", "nvhook.start.runtime"),
                         ("nvhookd", "nvhook.start.daemon")):
        files[f"bin/{name}"] = (launcher(python, module, gc_off=name == "nvhook").encode(), 0o755)
    # nvidia-cdi-hook: the hook path for CDI specs written by NVIDIA's tools (nvidia-ctk, the
    # device plugin, the DRA driver) pointed at nvhook (docs/cdi-hook.md): the shell first stage,
    # and its python stage, whose interpreter is HOOK_PYTHON, whose set-group-ID it gives back
    # before anything else
    hook = launcher(HOOK_PYTHON, "nvhook.start.cdihook", gc_off=True).split("\n", 1)
    files[HOOK_STAGE2[len(INSTALL_DIR) + 1:]] = (
        (hook[0] + "\nimport os\n_g = os.getgid()\nif os.getegid() != _g:\n"
         "    os.setresgid(_g, _g, _g)\n" + hook[1]).encode(), 0o644)
    files["bin/nvidia-cdi-hook"] = (shell_stage(HOOK_SH, HOOK_PYTHON, HOOK_STAGE2, HOOK_MARKS).encode(), 0o755)
    files[MARKER] = (b"Installed by `nvhook node install`; `nvhook node uninstall` removes it.\n", 0o644)
    return files


def launcher(python: str, module: str, gc_off: bool) -> str:
    """As packaging/build-deb's (see its comments): -I and -S, nvhook's lib found from the
    launcher's own place, the start-path bundle installed, gc off for the hook's short life."""
    gc = "import gc\ngc.disable()\n" if gc_off else ""
    return (f"#!{python} -IS\n{gc}import os\nimport sys\n"
            "sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "
            "\"lib\"))\nimport nvhook  # noqa: E402\nfrom nvhook.base import modbundle  # noqa: E402\n"
            f"modbundle.install(nvhook.__path__[0])\nfrom {module} import main  # noqa: E402\nsys.exit(main())\n")


STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")


def parse_strategies(values: list[str] | tuple[str, ...]) -> list[str]:
    """The device plugin's deviceListStrategy as its own flag takes it: repeated, or one
    comma-separated list (`envvar,volume-mounts`); in the order given, each once."""
    out: list[str] = []
    for value in values:
        for s in value.split(","):
            s = s.strip()
            if not s:
                continue
            if s not in STRATEGIES:
                raise HookError(f"--device-list-strategy {s}: not a strategy of the device plugin; "
                                f"use {', '.join(STRATEGIES)} (comma-separated for several)")
            if s not in out:
                out.append(s)
    return out or ["envvar"]


def config_text(driver_root: str, strategies: list[str] | tuple[str, ...] = ("envvar",),
                oci_runtime: str = "runc") -> bytes:
    """The shipped config with the node's driver root and OCI runtime, and the device list
    taken only from what the device plugin's strategies hand in: NVIDIA_VISIBLE_DEVICES of an
    unprivileged pod only with `envvar` (otherwise any image on a shared cluster could set it),
    the volume-mount list only with `volume-mounts` (NVIDIA's default, off). The CDI strategies
    need no setting: the spec is always written."""
    from importlib import resources

    def data(name: str) -> str:
        return (resources.files("nvhook") / "data" / name).read_text()

    values = {"root": json.dumps(driver_root),
              "devices.accept_volume_mounts": "true" if "volume-mounts" in strategies else "false",
              "devices.accept_envvar_unprivileged": "true" if "envvar" in strategies else "false",
              "runtime.path": json.dumps(oci_runtime)}
    lines = data("hook.toml").splitlines(keepends=True)
    section = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip().strip("[]") + "."
            continue
        key = section + line.split(" = ", 1)[0]
        if key in values and not line.startswith("#"):
            lines[i] = f"{line.split(' = ', 1)[0]} = {values.pop(key)}\n"
    if values:  # pragma: no cover - the shipped file has every key
        raise HookError(f"internal error: the shipped config has no {', '.join(values)}")
    return "".join(lines).encode()


NRI_SOCKET = "/var/run/nri/nri.sock"


def unit_text(name: str, nri_socket: str = NRI_SOCKET) -> bytes:
    """packaging/systemd's unit (shipped in the package as nvhook/data/systemd), run from
    /opt/nvhook; the NRI plugin's with the socket the engine listens on."""
    from importlib import resources

    text = (resources.files("nvhook") / "data" / "systemd" / name).read_text()
    if name == NRI_UNIT and nri_socket != NRI_SOCKET:
        # a word of ExecStart as systemd splits it: no quoting, specifiers or variables to escape
        if not posixpath.isabs(nri_socket) or not all(c.isalnum() or c in "/._-" for c in nri_socket):
            raise HookError(f"containerd's NRI socket_path {nri_socket!r} is not a plain absolute path; give it "
                            "one (letters, digits, '/', '.', '_', '-')")
        text = text.replace(f"--socket {NRI_SOCKET}", f"--socket {nri_socket}")
    return text.replace("/usr/local/bin/nvhook", f"{INSTALL_DIR}/bin/nvhook").encode()


def containerd_nri_socket(host: Host) -> str:
    """The NRI socket the node's containerd listens on, as it reads its config (`config dump`):
    a site's socket_path, else the default."""
    from ..base import tomlread

    r = in_node(host, ["containerd", "--config", "/etc/containerd/config.toml", "config", "dump"], check=False)
    try:
        table = tomlread.loads(r.stdout).get("plugins", {}).get("io.containerd.nri.v1.nri", {})
    except tomlread.TOMLDecodeError:
        return NRI_SOCKET
    got = table.get("socket_path") if isinstance(table, dict) else None
    return got if isinstance(got, str) and got and r.returncode == 0 else NRI_SOCKET


# -- the record ----------------------------------------------------------------------------------

class Record:
    """node-install.json: for each path install touched, what was there before."""

    def __init__(self, host: Host):
        self.host = host
        got = host.read(RECORD)
        self.data: dict = json.loads(got[0]) if got else {"version": 1, "paths": {}}
        self.dirty = False

    @property
    def paths(self) -> dict:
        return self.data["paths"]

    def note(self, path: str, kind: str) -> None:
        """Before `path` is first changed: keep what it was (kept from the FIRST install)."""
        if path in self.paths:
            return
        parent = posixpath.dirname(path)
        if parent != path and not self.host.exists(parent):
            self.note(parent, "dir")  # created on the way: removed by uninstall when empty
        entry: dict = {"kind": kind}
        p = self.host.where(path)
        if kind == "file":
            got = self.host.read(path)
            entry["before"] = None if got is None else {"b64": base64.b64encode(got[0]).decode(), "mode": got[1]}
        else:
            entry["existed"] = p is not None and os.path.lexists(p)
        self.paths[path] = entry
        self.dirty = True

    def written(self, path: str, data: bytes) -> None:
        if self.paths[path].get("sha256") != sha256_of(data):
            self.paths[path]["sha256"] = sha256_of(data)
            self.dirty = True

    def pending(self) -> list[str]:
        """Engines whose config install changed and that no --restart-engine has restarted since."""
        return list(self.data.get("restart_pending", []))

    def restart_pending(self, engine: str, pending: bool) -> None:
        now = set(self.pending())
        new = now | {engine} if pending else now - {engine}
        if new != now:
            self.data["restart_pending"] = sorted(new)
            self.dirty = True

    def save(self) -> None:
        for d in self.host.created:
            if d not in self.paths:
                self.paths[d] = {"kind": "dir", "existed": False}
                self.dirty = True
        if self.dirty:
            self.host.write(RECORD, (json.dumps(self.data, indent=1, sort_keys=True) + "\n").encode(), 0o600)
            self.dirty = False


# -- install --------------------------------------------------------------------------------------

def detect_engines(host: Host) -> list[str]:
    return [e for e, signs in ENGINE_SIGNS.items() if any(host.resolved(s) for s in signs)]
