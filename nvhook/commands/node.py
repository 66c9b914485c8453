"""`nvhook node install|uninstall --host-root DIR`: what a Kubernetes DaemonSet's container runs
with the node's root filesystem mounted at DIR (deploy/kubernetes/, docs/kubernetes.md).

install copies nvhook and its pure-Python dependencies to /opt/nvhook on the node, with
launchers whose #! is the node's own python3 (-IS, as packaging/build-deb's), then runs the
rest AS THE NODE: `chroot DIR <node's python3> /opt/nvhook/bin/nvhook ...` byte-compiles and
writes the start-path bundle (both are per interpreter version: the node's python, not this
container's, must write them), writes the CDI spec and registers the runtime. Run in the node's
root, every path those commands touch is the node's path as the kernel resolves it there (a
node's absolute /var/run -> /run link stays on the node), and every path written in a file is
the one the node's engines read. What this process itself reads or writes under DIR is
resolved by nvhook.base.rootpath with DIR as "/": never followed out into the container.

Everything install creates or changes is recorded first in /var/lib/nvhook/node-install.json
(original bytes and mode of each file it changes, which paths did not exist); uninstall puts
each back: an engine config byte-identical to before, no nvhook file, log or cache left. A file
someone changed after install is kept, and uninstall says so.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import posixpath
import shutil
import stat
import subprocess
import sys

from ..base import rootpath
from ..base.errors import HookError

INSTALL_DIR = "/opt/nvhook"
RECORD = "/var/lib/nvhook/node-install.json"
MARKER = ".nvhook-node-install"
CONFIG = "/etc/nvhook/hook.toml"
CDI_SPEC = "/etc/cdi/nvhook.json"
UNIT_DIR = "/etc/systemd/system"
UNITS = {"nvhook-cdi.service": None, "nvhook-cdi.path": "multi-user.target.wants",
         "nvhook-cdi.timer": "timers.target.wants"}
ENGINE_FILES = {"containerd": ["/etc/containerd/config.toml", "/etc/containerd/conf.d/99-nvhook.toml"],
                "docker": ["/etc/docker/daemon.json"], "crio": ["/etc/crio/crio.conf.d/99-nvhook.conf"]}
ENGINE_SIGNS = {"containerd": ["/etc/containerd", "/usr/bin/containerd", "/usr/local/bin/containerd"],
                "crio": ["/etc/crio", "/usr/bin/crio", "/usr/local/bin/crio"],
                "docker": ["/etc/docker", "/usr/bin/dockerd", "/usr/local/bin/dockerd"]}
# What nvhook writes while it runs on the node (the shipped config's log_file and cache_dir):
# removed by uninstall unless they were there before install.
RUN_FILES = ["/var/log/nvhook.log", "/run/nvhook"]
# Module (import name) -> distribution, copied with nvhook: its pure-Python dependencies.
DEPENDENCIES = {"click": "click", "structlog": "structlog", "elftools": "pyelftools", "pynvml": "nvidia-ml-py",
                "tomli": "tomli"}


def _sha(data: bytes) -> str:
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

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """A new file beside the target, renamed over it (a link there is replaced, not followed)."""
        directory = self.makedirs(posixpath.dirname(path))
        final = os.path.join(directory, posixpath.basename(path))
        tmp = final + ".nvhook-new"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
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
                if fn.endswith((".pyc", ".pyo")) or fn.startswith(".") or fn == "startpath.bundle":
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
    files[MARKER] = (b"Installed by `nvhook node install`; `nvhook node uninstall` removes it.\n", 0o644)
    return files


def launcher(python: str, module: str, gc_off: bool) -> str:
    """As packaging/build-deb's (see its comments): -I and -S, nvhook's lib found from the
    launcher's own place, the start-path bundle installed, gc off for the hook's short life."""
    gc = "import gc\ngc.disable()\n" if gc_off else ""
    return (f"#!{python} -IS\n{gc}import os\nimport sys\n"
            "sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "
            "\"lib\"))\nimport nvhook  # noqa: E402\nfrom nvhook.base import startpath  # noqa: E402\n"
            f"startpath.install(nvhook.__path__[0])\nfrom {module} import main  # noqa: E402\nsys.exit(main())\n")


def config_text(driver_root: str, strategy: str = "envvar") -> bytes:
    """The shipped config with the node's driver root; for the device plugin's volume-mounts
    strategy, the device list from its mounts only (an image's NVIDIA_VISIBLE_DEVICES ignored
    in unprivileged pods: on a shared cluster any image could set it)."""
    from .setup import data

    values = {"root": json.dumps(driver_root)}
    if strategy == "volume-mounts":
        values.update(accept_volume_mounts="true", accept_envvar_unprivileged="false")
    lines = data("hook.toml").splitlines(keepends=True)
    for i, line in enumerate(lines):
        key = line.split(" = ", 1)[0]
        if key in values and not line.startswith("#"):
            lines[i] = f"{key} = {values.pop(key)}\n"
    if values:  # pragma: no cover - the shipped file has every key
        raise HookError(f"internal error: the shipped config has no {', '.join(values)}")
    return "".join(lines).encode()


def unit_text(name: str) -> bytes:
    """packaging/systemd's unit (shipped in the package as nvhook/data/systemd), run from /opt/nvhook."""
    from importlib import resources

    text = (resources.files("nvhook") / "data" / "systemd" / name).read_text()
    return text.replace("/usr/local/bin/nvhook", f"{INSTALL_DIR}/bin/nvhook").encode()


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
        if self.paths[path].get("sha256") != _sha(data):
            self.paths[path]["sha256"] = _sha(data)
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


def install(host_root: str, driver_root: str = "/", engines: list[str] | None = None, runtime_name: str = "nvidia",
            python: str = "/usr/bin/python3", restart_engine: bool = False, set_default: bool = False,
            strategy: str = "envvar") -> list[dict]:
    """One {"action", "what", "path"} per change; [] when the node already had it all."""
    from .configure import check_name

    host = Host(host_root)
    check_name(runtime_name)
    if not posixpath.isabs(driver_root):
        raise HookError(f"--driver-root {driver_root} must be an absolute path on the node")
    version = node_python(host, python)
    engines = engines or detect_engines(host)
    if not engines:
        raise HookError("no container engine on the node (no containerd, CRI-O or Docker config or binary "
                        "under the host root); name one with --runtime")
    done: list[dict] = []
    rec = Record(host)
    for marker_dir in (INSTALL_DIR,):
        if host.exists(marker_dir) and marker_dir not in rec.paths and not host.exists(f"{marker_dir}/{MARKER}"):
            raise HookError(f"{marker_dir} exists on the node and is not nvhook node install's; remove it first")
    for path in ("/opt", INSTALL_DIR, "/var/lib/nvhook", "/etc/nvhook", "/etc/cdi", UNIT_DIR,
                 *(f"{UNIT_DIR}/{w}" for w in UNITS.values() if w), "/etc/containerd/conf.d",
                 "/etc/crio/crio.conf.d", *RUN_FILES):
        rec.note(path, "dir")
    rec.note(CDI_SPEC, "dir")
    rec.save()

    # 1. nvhook itself, for the node's python
    tree = wanted_tree(python)
    host.makedirs(INSTALL_DIR)
    changed_lib = False
    for rel, (data, mode) in sorted(tree.items()):
        path = f"{INSTALL_DIR}/{rel}"
        got = host.read(path)
        if got != (data, mode):
            host.write(path, data, mode)
            changed_lib = True
    base = host.where(INSTALL_DIR)
    assert base is not None
    for dirpath, _dirnames, filenames in os.walk(base, topdown=False):  # files of an older nvhook
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), base)
            if rel not in tree and "__pycache__" not in rel and not fn.endswith(".bundle"):
                os.unlink(os.path.join(dirpath, fn))
                changed_lib = True
    if changed_lib or not _has_pycache(host):
        in_node(host, [python, "-I", "-m", "compileall", "-q", "-d", f"{INSTALL_DIR}/lib", f"{INSTALL_DIR}/lib"])
        in_node(host, [python, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import nvhook; "
                       "from nvhook.base import startpath; startpath.write(nvhook.__path__[0])", f"{INSTALL_DIR}/lib"])
        done.append({"action": "installed", "what": f"nvhook for the node's Python {version[0]}.{version[1]} "
                     f"({python})", "path": INSTALL_DIR})

    # 2. its config, as the node sees the driver
    rec.note(CONFIG, "file")
    want = config_text(driver_root, strategy)
    have = host.read(CONFIG)
    entry = rec.paths[CONFIG]
    if have is None or (entry["before"] is None and have[0] != want and entry.get("sha256") == _sha(have[0])):
        host.write(CONFIG, want)
        rec.written(CONFIG, want)
        done.append({"action": "created" if have is None else "updated",
                     "what": f"config, root = {driver_root}, device list: {strategy}",
                     "path": CONFIG})
    elif have[0] != want and _root_of(have[0]) != driver_root:
        done.append({"action": "kept", "what": f"config (not install's; its root is {_root_of(have[0])!r}, "
                     f"--driver-root says {driver_root!r})", "path": CONFIG})
    rec.save()

    nvhook = [python, "-I", f"{INSTALL_DIR}/bin/nvhook", "--config", CONFIG]

    # 3. the runtime, registered with each engine (run as the node: paths in the files are its own)
    for engine in engines:
        paths = ENGINE_FILES[engine]
        before = {p: host.read(p) for p in paths}
        for p in paths:
            rec.note(posixpath.dirname(p), "dir")
            rec.note(p, "file")
        rec.save()
        argv = [*nvhook, "runtime", "configure", "--runtime", engine, "--runtime-name", runtime_name,
                "--runtime-path", f"{INSTALL_DIR}/bin/nvhook-runtime"]
        if set_default:
            argv.append("--set-as-default")
        in_node(host, argv)
        for p in paths:
            after = host.read(p)
            if after != before[p] and after is not None:
                rec.written(p, after[0])
                done.append({"action": "created" if before[p] is None else "updated",
                             "what": f"{engine}: runtime {runtime_name}", "path": p})
        rec.save()

    # 4. the CDI spec and its refresh
    units_changed = False
    for name, wants in UNITS.items():
        path = f"{UNIT_DIR}/{name}"
        rec.note(path, "file")
        text = unit_text(name)
        if host.read(path) != (text, 0o644):
            host.write(path, text)
            rec.written(path, text)
            units_changed = True
            done.append({"action": "created", "what": "systemd unit", "path": path})
        if wants:
            link = f"{UNIT_DIR}/{wants}/{name}"
            where = host.where(link)
            if where is None or not os.path.islink(where):
                host.makedirs(f"{UNIT_DIR}/{wants}")
                rec.note(link, "dir")
                os.symlink(path, host.where(link) or "")
                done.append({"action": "enabled", "what": "systemd unit", "path": link})
                units_changed = True
    rec.save()
    spec_before = host.read(CDI_SPEC)
    r = in_node(host, [*nvhook, "cdi", "generate", "--output", CDI_SPEC, "--hook-path", f"{INSTALL_DIR}/bin/nvhook"],
                check=False)
    spec_after = host.read(CDI_SPEC)
    # The inventory that generate cached was seen from this container's view of the node: a mount
    # the node makes later (a driver container's /run/nvidia/driver), or one this view lacks,
    # would be served from it to every container start. The node's first start takes its own.
    cache = host.where(RUN_FILES[1])
    if cache and os.path.isdir(cache) and not os.path.islink(cache):
        for name in os.listdir(cache):
            if name.startswith("inventory"):
                os.unlink(os.path.join(cache, name))
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        done.append({"action": "note", "what": f"CDI spec not written ({last}); nvhook-cdi.path and "
                     ".timer try again", "path": CDI_SPEC})
    elif spec_after != spec_before:
        done.append({"action": "created" if spec_before is None else "updated", "what": "CDI spec",
                     "path": CDI_SPEC})
    if units_changed and _systemd_runs(host):
        in_node(host, ["systemctl", "daemon-reload"], env={"SYSTEMD_IGNORE_CHROOT": "1"})
        in_node(host, ["systemctl", "start", "--no-block", "nvhook-cdi.path", "nvhook-cdi.timer"],
                env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)

    # 5. the engines read their config again, when asked
    if restart_engine and any(d["what"].startswith(tuple(f"{e}:" for e in engines)) for d in done):
        for engine in engines:
            done.append(restart(host, engine))
    return done


def _has_pycache(host: Host) -> bool:
    p = host.where(f"{INSTALL_DIR}/lib/nvhook/__pycache__")
    return p is not None and os.path.isdir(p)


def _root_of(data: bytes) -> str | None:
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("root"):
            try:
                return json.loads(line.split("=", 1)[1].split("#")[0].strip())
            except ValueError:
                return None
    return "/"


def _systemd_runs(host: Host) -> bool:
    p = host.resolved("/run/systemd/system")
    return p is not None and os.path.isdir(p)


def restart(host: Host, engine: str) -> dict:
    """`systemctl restart` of the node's engine, through the node's own systemctl in its root.
    SYSTEMD_IGNORE_CHROOT: systemctl otherwise refuses to act from a chroot; the node's
    /run/systemd/private socket, under the host root, reaches its systemd without hostPID."""
    service = {"containerd": "containerd", "docker": "docker", "crio": "crio"}[engine]
    if not _systemd_runs(host):
        return {"action": "not restarted", "what": f"{engine}: the node runs no systemd; restart {service} by hand",
                "path": service}
    in_node(host, ["systemctl", "restart", service], env={"SYSTEMD_IGNORE_CHROOT": "1"})
    return {"action": "restarted", "what": f"{engine}", "path": f"{service}.service"}


# -- uninstall -------------------------------------------------------------------------------------

def uninstall(host_root: str, restart_engine: bool = False) -> list[dict]:
    host = Host(host_root)
    if not host.exists(RECORD):
        return []
    rec = Record(host)
    done: list[dict] = []
    engines_changed = set()
    if _systemd_runs(host):
        in_node(host, ["systemctl", "stop", "nvhook-cdi.path", "nvhook-cdi.timer", "nvhook-cdi.service"],
                env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    # files, then what nvhook wrote while it ran, then the directories install created (deepest first)
    for path, entry in sorted(rec.paths.items(), key=lambda kv: -len(kv[0])):
        if entry["kind"] != "file":
            continue
        got = host.read(path) if not _is_link(host, path) else None
        before = entry.get("before")
        if got is None and before is None:
            continue
        if entry.get("sha256") and got is not None and _sha(got[0]) != entry["sha256"]:
            done.append({"action": "kept", "what": "changed since install; put it back by hand", "path": path})
            continue
        if before is None:
            host.remove(path)
            done.append({"action": "removed", "what": "", "path": path})
        else:
            data = base64.b64decode(before["b64"])
            if got != (data, before["mode"]):
                host.write(path, data, before["mode"])
                done.append({"action": "restored", "what": "as before install", "path": path})
        engine = next((e for e, ps in ENGINE_FILES.items() if path in ps), None)
        if engine:
            engines_changed.add(engine)
    for path in [INSTALL_DIR, *RUN_FILES, CDI_SPEC, *(p for p, e in rec.paths.items() if _is_link(host, p))]:
        if not rec.paths.get(path, {"existed": True}).get("existed", True) and host.remove(path):
            done.append({"action": "removed", "what": "", "path": path})
    for rotated in _rotated_logs(host, rec):
        host.remove(rotated)
        done.append({"action": "removed", "what": "", "path": rotated})
    host.remove(RECORD)
    for path, entry in sorted(rec.paths.items(), key=lambda kv: -len(kv[0])):
        if entry["kind"] == "dir" and not entry["existed"] and host.exists(path) and host.rmdir_empty(path):
            done.append({"action": "removed", "what": "empty directory", "path": path})
    if _systemd_runs(host) and any(d["path"].startswith(UNIT_DIR) for d in done):
        in_node(host, ["systemctl", "daemon-reload"], env={"SYSTEMD_IGNORE_CHROOT": "1"}, check=False)
    if restart_engine:
        for engine in sorted(engines_changed):
            done.append(restart(host, engine))
    return done


def _is_link(host: Host, path: str) -> bool:
    p = host.where(path)
    return p is not None and os.path.islink(p)


def _rotated_logs(host: Host, rec: Record) -> list[str]:
    """The log's rotations (logrotate's .1, .2.gz), when the log was not there before install."""
    log = RUN_FILES[0]
    if rec.paths.get(log, {}).get("existed", True):
        return []
    parent = host.where(posixpath.dirname(log))
    if parent is None or not os.path.isdir(parent):
        return []
    stem = posixpath.basename(log) + "."
    return [posixpath.join(posixpath.dirname(log), n) for n in sorted(os.listdir(parent)) if n.startswith(stem)]


def show_done(done: list[dict], fmt: str, verb: str) -> None:
    import click

    from .render import to_json

    changes = [d for d in done if d["action"] != "note"]
    if fmt == "json":
        click.echo(to_json({"changed": bool(changes), "changes": changes,
                            "notes": [d for d in done if d["action"] == "note"]}))
        return
    if not changes:
        click.echo(f"nvhook node {verb}: nothing to change")
    for d in done:
        click.echo(f"{d['action']:<14} {d['path']}" + (f": {d['what']}" if d["what"] else ""))
    sys.stdout.flush()


# -- the commands ----------------------------------------------------------------------------------

def _commands():
    import click

    from .clikit import FORMAT, fmt_of

    host_root = click.option("--host-root", metavar="DIR", required=True,
                             help="Where the node's / is mounted in this container (hostPath /).")
    restart_opt = click.option("--restart-engine", is_flag=True,
                               help="Restart the engines whose config changed (the node's systemctl).")

    @click.group()
    def node():
        """Install nvhook on a node from a container that sees the node's root (a DaemonSet)."""

    @node.command(name="install")
    @host_root
    @click.option("--driver-root", metavar="PATH", default="/", show_default=True,
                  help="The driver's root as the node sees it (GPU Operator's driver container: /run/nvidia/driver).")
    @click.option("--runtime", "engines", multiple=True, type=click.Choice(["containerd", "crio", "docker"]),
                  help="The engine to register the runtime with (repeatable) [default: each one found].")
    @click.option("--runtime-name", metavar="NAME", default="nvidia", show_default=True,
                  help="The engine's name for nvhook-runtime: a RuntimeClass's handler.")
    @click.option("--set-as-default", is_flag=True, help="Make it the engine's default runtime.")
    @click.option("--device-list-strategy", "strategy", type=click.Choice(["envvar", "volume-mounts"]),
                  default="envvar", show_default=True, help="The device plugin's deviceListStrategy: volume-mounts "
                  "also ignores NVIDIA_VISIBLE_DEVICES from images of unprivileged pods.")
    @click.option("--host-python", metavar="PATH", default="/usr/bin/python3", show_default=True,
                  help="The node's python3 (3.9+), as the node sees it: the launchers' #!.")
    @restart_opt
    @click.option("--ready-file", metavar="FILE", help="Create FILE (in this container) once installed: "
                  "the DaemonSet's readiness probe.")
    @click.option("--wait", is_flag=True, help="Then stay until SIGTERM, and uninstall (a DaemonSet's pod).")
    @FORMAT
    def install_cmd(host_root, driver_root, engines, runtime_name, set_as_default, strategy, host_python,
                    restart_engine, ready_file, wait, fmt):
        """Put nvhook on the node: /opt/nvhook run by the node's python3, its config, the CDI spec
        and its systemd refresh, the runtime registered with containerd, CRI-O or Docker. A second
        install changes nothing and says so; uninstall takes it all back."""
        fmt = fmt_of(fmt)
        done = install(host_root, driver_root, list(engines), runtime_name, host_python, restart_engine,
                       set_as_default, strategy)
        show_done(done, fmt, "install")
        if ready_file:
            with open(ready_file, "w") as f:
                f.write("installed\n")
        if wait:
            import signal

            signals = {signal.SIGTERM, signal.SIGINT}
            signal.pthread_sigmask(signal.SIG_BLOCK, signals)
            got = signal.sigwait(signals)
            click.echo(f"nvhook node install: {signal.Signals(got).name}: uninstalling")
            if ready_file:
                try:
                    os.unlink(ready_file)
                except FileNotFoundError:
                    pass
            show_done(uninstall(host_root, restart_engine), fmt, "uninstall")

    @node.command(name="uninstall")
    @host_root
    @restart_opt
    @FORMAT
    def uninstall_cmd(host_root, restart_engine, fmt):
        """Take back what install did: each engine config byte-identical to before, no nvhook file,
        log or cache left (a file changed since install is kept, and named)."""
        show_done(uninstall(host_root, restart_engine), fmt_of(fmt), "uninstall")

    return node


node = _commands()
