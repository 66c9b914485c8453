"""`nvhook nri`: a long-lived NRI plugin. It dials the engine's NRI socket, registers, and
answers CreateContainer with the container's GPU edits as an NRI ContainerAdjustment
(apply/nriadjust.py), decided by nvhook's own pipeline (the request rules, config, compat
decision and catalog of hook mode and CDI). No process runs per container: what must happen
inside the container's root filesystem (`in_container_work`) is either done by the plugin itself
at StartContainer (the loader cache and the compat libcuda choice: `Plugin.start_work`, through
/proc/<pid>/root by fd, once runc has created the container and before it starts), or, for the
work it cannot do from outside (/proc/driver/nvidia masking, 32-bit libraries, links), by
nvhook's CDI createContainer hook, exactly as with a CDI spec.

Faults (docs/nri.md): a message that cannot be decoded, or a decision that fails, is answered
with an error for that request alone and logged; the connection and the plugin go on. A
container that asks for no GPU gets an empty adjustment before anything else is read. When
the engine goes away the plugin reconnects (backoff up to 5 s), and at every Synchronize it
names each running container that asked for a GPU and has no NVIDIA device node (one that was
created while the plugin was down: containerd 1.7 then creates it unadjusted), and each running
one that got its answer but missed its StartContainer work (started while the plugin was down or
too slow: `check_start_work`, which only reads).

Speed: the warm process keeps each answer it gave, keyed by what the decision read of the
container, and serves it again only after the check every decision starts with (the inventory's
inputs, the GPU list and device nodes, read again); pods on a runtime class that injects the GPU
itself (nvhook-runtime, NVIDIA's) are left to it.
"""

from __future__ import annotations

import os
import posixpath
import time

from ...base import protobuf as pb
from ...base.errors import HookError
from ...base.log import LEVELS, EventLog
from . import ttrpc

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"
CREATE_CONTAINER = 4  # api.Event; the subscription mask has bit (event - 1)
START_CONTAINER = 6  # sent as a StateChange, after runc create and before the container's start
CONTAINER_CREATED, CONTAINER_RUNNING = 1, 3
# Runtime classes whose runtime injects the GPU itself (nvhook-runtime as `nvhook runtime
# configure` and `nvhook node install` name it; NVIDIA's runtime): their pods are left to it.
DEFAULT_RUNTIME_HANDLERS = ("nvhook", "nvidia")
# Directories a library bind must never land in, whatever the image's LD_LIBRARY_PATH says.
_NEVER_UNDER = ("/proc", "/sys", "/dev")
# The longest LD_LIBRARY_PATH entry taken as the bind directory: a directory plus "/" and a
# file name (NAME_MAX 255) within PATH_MAX (4096, its NUL included). A longer one is no path the
# kernel can mount on, and every bind's destination (and every kept answer) would repeat it.
MAX_LOADER_DIR = 4096 - 1 - 256
NAME_MAX = 255
# In-container work the plugin itself does at StartContainer, through the container's root
# (start_work): no process. The others (procfs, ldcache32, links) still take the CDI hook.
IN_PLUGIN = ("ldcache", "compat")
# How much of /proc/<pid>/cgroup is read to check that the process is the container's.
CGROUP_READ = 1 << 16
# The share of containerd's plugin_request_timeout (2 s by default; containerd 1.7 does not send
# it, so the default is assumed) that Synchronize spends checking running containers' start work:
# the rest of the containers are named unchecked, never a late answer that drops the plugin.
SYNC_CHECK_SHARE = 0.4
DEFAULT_REQUEST_TIMEOUT_MS = 2000
# The share of that timeout a StartContainer's cache scan may spend: an image can make it slow
# (thousands of libraries read cold from disk: 13 s measured for 16,000 here), and an answer past
# the timeout makes containerd drop the plugin, so that every GPU container created before it
# reconnects starts without its GPU. Past the share, that one start is refused instead.
START_SCAN_SHARE = 0.5
# The largest /etc/ld.so.cache (not nvhook's) that Synchronize parses to tell whether it lists
# the driver: a CUDA devel image's is about 100 KiB, and parsing 1 MiB takes about 0.15 s here
# (16 MiB: 1.4 s, most of containerd's timeout, which one container must not spend).
MAX_CACHE_READ = 1 << 20
# sysexits.h EX_CONFIG: `nvhook nri` could not load its config or host root (see `run`).
CONFIG_ERROR = 78


def container_facts(c: dict) -> dict:
    """oci.load_bundle's facts from an NRI Container message (there is no bundle yet). The
    engine does not tell a plugin the container's capabilities: it counts as unprivileged."""
    env: dict[str, str] = {}
    for item in pb.strings(c, 8):
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    mounts = [{"destination": pb.string(m, 1), "source": pb.string(m, 3)} for m in pb.messages(c, 9)]
    linux = pb.message(c, 11)
    devices = [{"path": pb.string(d, 1), "type": pb.string(d, 2), "major": pb.integer(d, 3),
                "minor": pb.integer(d, 4)} for d in pb.messages(linux, 2)]
    return {"config_path": f"NRI container {pb.string(c, 1)}", "rootfs": None, "env": env,
            "privileged": False, "mounts": mounts, "annotations": pb.string_map(c, 6), "devices": devices}


def loader_dir(env: dict) -> str | None:
    """The first directory of the image's LD_LIBRARY_PATH where a library bound at its SONAME
    is found by the loader with no cache entry and no link, or None."""
    for entry in env.get("LD_LIBRARY_PATH", "").split(":"):
        if not entry.startswith("/"):
            continue
        d = posixpath.normpath(entry)
        if len(d) > MAX_LOADER_DIR or any(len(c) > NAME_MAX for c in d.split("/")):
            continue  # ENAMETOOLONG for the loader and the runtime alike
        if d == "/" or ".." in d.split("/") or any(d == p or d.startswith(p + "/") for p in _NEVER_UNDER):
            continue
        return d
    return None


def _link_target(path: str, links: dict, libs: set) -> str | None:
    """The library a link (or a chain of links, libcuda.so -> libcuda.so.1 -> the file) names."""
    for _ in range(8):
        if path in libs:
            return path
        if path not in links:
            return None
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), links[path]))
    return None


def in_container_work(plan, edits: dict, env: dict, driver_cuda: str | None, mask_procfs: bool) -> list[str]:
    """Why a hook must run inside this container (empty: the spec alone is enough). The rule:
    - /proc/driver/nvidia masking: runc refuses spec mounts under /proc, so only when the
      operator asks for it (--mask-procfs);
    - the compat libcuda choice: for a compute container unless the image declares its CUDA
      (CUDA_VERSION, set by every CUDA base image) and the host driver supports it;
    - the loader: libraries are bound at their SONAME in the image's LD_LIBRARY_PATH directory;
      without one (or with 32-bit libraries, which would share it) the loader cache is needed;
    - links that are not library names (none in today's catalog)."""
    from ...base.versions import compare

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
    if any(_link_target(p, links, libs) is None for p in links):
        why.append("links")
    return why


def loader_mounts(edits: dict, directories: list[str]) -> list[dict]:
    """The spec's binds with each library (and each of its link names) bound in every one of
    `directories`."""
    from ...decide.edits import spec_mounts

    out = [m for m in spec_mounts(edits) if m["kind"] != "library"]
    by_path = {m["container_path"]: m for m in edits["mounts"] if m["kind"] == "library"}
    links = {s["path"]: s["target"] for s in edits["symlinks"]}
    for directory in directories:
        for m in by_path.values():
            out.append(dict(m, container_path=posixpath.join(directory, posixpath.basename(m["container_path"]))))
        for s in edits["symlinks"]:
            lib = by_path.get(_link_target(s["path"], links, set(by_path)) or "")
            if lib is not None:
                out.append(dict(lib, container_path=posixpath.join(directory, posixpath.basename(s["path"]))))
    unique: dict[str, dict] = {}
    for m in out:
        unique.setdefault(m["container_path"], m)
    return list(unique.values())


def default_lib_dirs(edits: dict) -> list[str]:
    """Where an image's loader looks with no LD_LIBRARY_PATH and no cache entry: the host's own
    library directory and both glibc families' defaults (/usr/lib/<multiarch>, /usr/lib64),
    as `cdi generate --no-hook` binds them (decide.cdimodel.default_dirs)."""
    from ...decide import cdimodel as cdi

    libs = [m["container_path"] for m in edits["mounts"] if m["kind"] == "library"]
    libdir = posixpath.dirname(libs[0]) if libs else "/usr/lib64"
    return cdi.default_dirs(libdir, os.uname().machine)


def open_container_root(pid: int, cid: str) -> tuple[int, tuple[int, int]]:
    """An O_PATH fd on the root directory of container `cid`'s init process `pid` (as the
    container sees it: its mounts are crossed below it), and the host ids of the container's
    root. The pid is the engine's word at StartContainer; it is checked to be that container's
    (its cgroup names the container id) and to be the same process after the root was opened
    (a pidfd, taken first, outlives a reuse of the number), and the root must not be this
    process's own (the host's)."""
    from ...apply.paths import container_root_ids

    short = cid[:12]
    if pid <= 0:
        raise HookError(f"the engine gave no process for container {short} at its start: nvhook cannot write its "
                        f"loader cache; containerd 1.7 or later sends it (is this engine older?)")
    gone = (f"container {short}'s process {pid} is gone before its start: nvhook wrote nothing; "
            f"the engine will report why the container died")
    try:
        pidfd = os.pidfd_open(pid)
        born = None
    except ProcessLookupError:
        raise HookError(gone) from None
    except (AttributeError, OSError):  # no pidfd_open (a kernel before 5.3): the start time instead
        pidfd, born = -1, _start_time(pid, gone)
    try:
        try:
            with open(f"/proc/{pid}/cgroup", "rb") as f:
                cgroup = f.read(CGROUP_READ).decode(errors="replace")
            fd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (ProcessLookupError, FileNotFoundError):
            raise HookError(gone) from None
        try:
            if not names_container(cgroup, cid):
                raise HookError(f"process {pid} is not container {short}'s (its cgroup does not name the "
                                f"container): nvhook writes nothing into it; report this engine bug")
            ids = container_root_ids(pid)
            import signal

            try:
                if pidfd >= 0:
                    signal.pidfd_send_signal(pidfd, 0)  # still that process: the root and ids are its
                elif _start_time(pid, gone) != born:
                    raise ProcessLookupError
            except ProcessLookupError:
                raise HookError(gone) from None
            mine, theirs = os.stat("/"), os.fstat(fd)
            if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                raise HookError(f"container {short}'s process {pid} has this host's root as its own: nvhook "
                                f"writes nothing there")
        except BaseException:
            os.close(fd)
            raise
        return fd, ids
    except OSError as e:
        raise HookError(f"cannot open container {short}'s root through process {pid}: {e.strerror or e}") from None
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def names_container(cgroup: str, cid: str) -> bool:
    """Whether /proc/<pid>/cgroup puts the process in container `cid`'s cgroup (or one below it):
    a path component that is the id (cgroupfs), or a systemd unit "<prefix>-<id>.scope"
    (cri-containerd-, docker-, libpod-). The id as a mere substring is not enough: a longer id
    that starts with it, or another container's cgroup that quotes it, is not this container."""
    if not cid or "/" in cid:
        return False
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        for comp in path.split("/"):
            if comp == cid or (comp.endswith(".scope") and comp[:-len(".scope")].endswith("-" + cid)):
                return True
    return False


def _start_time(pid: int, gone: str) -> str:
    """The process's start time (field 22 of /proc/<pid>/stat): with the pid, it names one
    process for the life of the machine."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except (ProcessLookupError, FileNotFoundError):
        raise HookError(gone) from None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else ""


def read_only(root, path: str) -> bool:
    """Whether `path` (a directory of the container, resolved inside it) is on a read-only
    mount (Kubernetes' readOnlyRootFilesystem)."""
    try:
        fd = root.lookup(path)
    except OSError:
        fd = os.dup(root.fd)
    try:
        return bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    finally:
        os.close(fd)


def etc_is_volume(root) -> bool:
    """Whether the container's /etc is a volume mounted into it rather than its image's own
    directory: nvhook writes no loader file there (ldscan.write), so nothing is missing."""
    try:
        fd = root.lookup("/etc")
    except OSError:
        return False
    try:
        return not root.same_mount(fd)
    finally:
        os.close(fd)


def node_etc(root, host_root: str, path: str = "/etc") -> bool:
    """Whether the container's `path` (/etc, /etc/ld.so.conf.d) is this node's own (a hostPath
    volume of the node's directory mounted there): the loader files in it are then the node's,
    which nvhook never writes."""
    try:
        fd = root.lookup(path)
    except OSError:
        return False
    try:
        theirs, mine = os.fstat(fd), os.stat(os.path.join(host_root, path.lstrip("/")))
    except OSError:
        return False
    finally:
        os.close(fd)
    return (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino)


def _cache_tail(root, n: int) -> bytes | None:
    """The last `n` bytes of the container's /etc/ld.so.cache (a regular file: a FIFO or device
    planted there is never opened for reading), or None."""
    from ...apply.ldconf import open_regular

    opened = open_regular(root, "/etc/ld.so.cache")
    if opened is None:
        return None
    fd, st = opened
    try:
        return os.pread(fd, n, st.st_size - n) if st.st_size >= n else None
    except OSError:
        return None
    finally:
        os.close(fd)


def start_work_missing(root, work: dict, compat_dir) -> list[str]:
    """What of a running container's start work (`Plugin.start_work`) its root does not show:
    [] when nvhook's cache is there (its generator string ends the file: start_work writes it
    last, after the compat conf, so the whole work ran), or when the cache the image has (its own
    ldconfig run since, say) lists the driver's libcuda and, where the image's compat libcuda
    is needed (`compat_dir()`, the compat decision, made only when nvhook's cache is not
    there), lists that one first; else "ldcache" (the cache does not list the
    driver) and/or "compat" (the host's libcuda comes first though the image's is needed). A
    musl image: its loader path file must name a bind directory. A cache that is not nvhook's
    and is too large to parse in the time (MAX_CACHE_READ) is a HookError: not checked."""
    from ...apply import ldscan, muslpath
    from ...apply.ldconf import read_regular
    from ...base import ldformat

    arch = muslpath.musl_arch(root)
    if arch is not None:
        raw = read_regular(root, f"/etc/ld-musl-{arch}.path", muslpath.MAX_PATH_FILE) or b""
        have = set(muslpath.entries(raw.decode("utf-8", "replace")))
        return [] if have & set(work["dirs"]) else ["ldcache"]
    if _cache_tail(root, len(ldscan.GENERATOR)) == ldscan.GENERATOR:
        return []
    data = read_regular(root, "/etc/ld.so.cache", MAX_CACHE_READ + 1) or b""
    if len(data) > MAX_CACHE_READ:
        raise HookError(f"its /etc/ld.so.cache is not nvhook's and over {MAX_CACHE_READ >> 20} MiB: not parsed "
                        f"within the synchronisation's time; look inside with `ldconfig -p`")
    names = {posixpath.basename(p) for p in work["libraries"]}
    try:
        # Parsed only where a driver library's name is in it at all (a string of the cache).
        entries = ldformat.parse(data) if any(n.encode() + b"\0" in data for n in names) else []
    except ValueError:
        entries = []
    want = "libcuda.so.1" if "libcuda.so.1" in names else None
    listed = [path for key, path, _arch in entries if (key == want if want else key in names)]
    missing = []
    if not listed:
        missing.append("ldcache")
    compat = compat_dir()
    if compat is not None and not (listed and listed[0].startswith(compat.rstrip("/") + "/")):
        missing.append("compat")
    return missing


class Plugin:
    def __init__(self, cfg: dict, root: str, *, socket_path: str = DEFAULT_SOCKET, name: str = "nvhook",
                 index: str = "10", hook_path: str = "", hook_global_args: list | None = None,
                 mask_procfs: bool = False, runtime_handlers: tuple = DEFAULT_RUNTIME_HANDLERS):
        self.cfg, self.root = cfg, root
        self.runtime_handlers = frozenset(runtime_handlers)
        self.socket_path, self.name, self.index = socket_path, name, index
        self.hook_path, self.hook_global_args = hook_path, list(hook_global_args or [])
        self.mask_procfs = mask_procfs
        self.mux: ttrpc.Mux | None = None
        self.registered = False
        # Answers already decided, by what the decision read of the container (memo_key): each
        # is served again only while the host it was decided on is the host now (`answered`).
        self.answers: dict[str, dict] = {}
        self.request_timeout_ms = DEFAULT_REQUEST_TIMEOUT_MS

    def log(self) -> EventLog:
        log = EventLog("info", None)
        log.level = LEVELS[self.cfg["log_level"]]
        log.path = self.cfg["log_file"]
        return log

    def event(self, name: str, level: str = "info", **fields) -> None:
        log = self.log()
        log.event(name, level, **fields)
        log.flush()

    def warm(self) -> None:
        """Before serving: ask NVML once (its probe is a forked child, bounded by a timeout, so a
        hung driver cannot hang the plugin) and keep its facts in the inventory cache, so that a
        compat decision at a container's start finds the GPUs' brands there and starts no process.
        A driver or GPU change since makes the next such decision ask again, once (as hook mode
        does)."""
        from ...observe import host

        log = self.log()
        try:
            inv = host.observe(self.root, self.cfg["cache_dir"], log, capabilities=["compute", "utility"])
            if inv["gpus"] and self.cfg["nvml"]["enabled"]:
                host.add_nvml(inv, self.cfg, log, reason="NRI plugin start: the GPUs' brands for compat decisions")
        except HookError as e:  # the decisions will say it again, per container
            log.warning("nri.warm_failed", error=e.message)
        finally:
            log.flush()

    # -- connection ---------------------------------------------------------------------

    def serve_forever(self, stop=lambda: False) -> None:
        delay = 0.1
        while not stop():
            try:
                self.mux = ttrpc.Mux.dial(self.socket_path, timeout=5)
            except OSError as e:
                self.event("nri.connect_failed", "warning", socket=self.socket_path, error=e.strerror or str(e),
                           retry_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            try:
                self.serve(self.mux)
            except (ttrpc.ConnectionClosed, ttrpc.ProtocolError, OSError) as e:
                self.event("nri.disconnected", "warning", socket=self.socket_path, error=str(e))
            finally:
                self.mux.close()
                self.registered = False
            time.sleep(delay)

    def serve(self, mux: ttrpc.Mux) -> None:
        reg = bytearray()
        pb.put_string(reg, 1, self.name)
        pb.put_string(reg, 2, self.index)
        reg_stream = mux.call(RUNTIME_SERVICE, "RegisterPlugin", bytes(reg), timeout_s=5)
        while True:
            msg = mux.read()
            if msg.conn == ttrpc.RUNTIME_CONN:
                if msg.type == ttrpc.TYPE_RESPONSE and msg.stream == reg_stream:
                    code, error, _ = ttrpc.parse_response(msg.body)
                    if code:
                        raise ttrpc.ProtocolError(f"the runtime refused the registration: {error} (code {code})")
                    self.registered = True
                    self.event("nri.registered", socket=self.socket_path, plugin=f"{self.index}-{self.name}")
                continue
            if msg.type != ttrpc.TYPE_REQUEST:
                continue
            if self.dispatch(mux, msg) == "shutdown":
                return

    def dispatch(self, mux: ttrpc.Mux, msg: ttrpc.Message) -> str:
        try:
            service, method, payload = ttrpc.parse_request(msg.body)
        except pb.ProtobufError as e:
            self.event("nri.bad_message", "error", error=f"undecodable ttrpc request: {e}")
            mux.reply(msg, code=ttrpc.INVALID_ARGUMENT, error=f"nvhook: undecodable request: {e}")
            return ""
        if service != PLUGIN_SERVICE:
            mux.reply(msg, code=ttrpc.UNIMPLEMENTED, error=f"nvhook: unknown service {service}")
            return ""
        handler = getattr(self, "on_" + method, None)
        if handler is None:
            mux.reply(msg, b"")  # an event nvhook did not subscribe to: nothing to do
            return ""
        try:
            mux.reply(msg, handler(payload))
        except pb.ProtobufError as e:
            self.event("nri.bad_message", "error", method=method, error=str(e))
            mux.reply(msg, code=ttrpc.INVALID_ARGUMENT, error=f"nvhook: malformed {method} request: {e}")
        except HookError as e:
            mux.reply(msg, code=ttrpc.INVALID_ARGUMENT, error=f"nvhook: {e.message}")
        except Exception as e:  # a bug: this request fails, the plugin goes on
            import traceback

            self.event("nri.crashed", "error", method=method, error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc())
            mux.reply(msg, code=ttrpc.INTERNAL, error=f"nvhook: internal error: {type(e).__name__}: {e}")
        return "shutdown" if method == "Shutdown" else ""

    # -- the plugin service -------------------------------------------------------------

    def on_Configure(self, payload: bytes) -> bytes:
        req = pb.decode(payload)
        self.request_timeout_ms = pb.integer(req, 5) or DEFAULT_REQUEST_TIMEOUT_MS
        self.event("nri.configured", runtime=pb.string(req, 2), runtime_version=pb.string(req, 3),
                   request_timeout_ms=pb.integer(req, 5) or None)
        out = bytearray()
        pb.put_varint(out, 2, (1 << (CREATE_CONTAINER - 1)) | (1 << (START_CONTAINER - 1)))
        return bytes(out)

    def on_Synchronize(self, payload: bytes) -> bytes:
        """Containers that exist already. Named (level error), nothing changed in them:
        - every one that asked for a GPU and has no NVIDIA device (`nri.gpu_missing`: created
          while nvhook was not answering);
        - every running one that got nvhook's answer but not its StartContainer work (the plugin
          was down or too slow at its start: `nri.start_work_missing`), checked through its root
          (check_start_work). Those checks share a bounded part of containerd's request timeout;
          the containers left when it is spent are named unchecked. One container's failure is
          logged and the others go on."""
        from ...decide import request as request_mod

        req = pb.decode(payload)
        pods = {pb.string(p, 1): p for p in pb.messages(req, 1)}
        n = missing = work_missing = checked = 0
        unchecked: list[str] = []
        t0 = time.perf_counter()
        budget = self.request_timeout_ms / 1000 * SYNC_CHECK_SHARE
        for c in pb.messages(req, 2):
            n += 1
            state = pb.integer(c, 4)
            if state not in (CONTAINER_CREATED, CONTAINER_RUNNING):
                continue
            facts = container_facts(c)
            try:
                r = request_mod.parse(facts["env"], privileged=False, mounts=facts["mounts"], config=self.cfg,
                                      annotations=facts["annotations"])
            except HookError:
                continue
            if r["kind"] == "skip":
                continue
            pod = pods.get(pb.string(c, 2), {})
            if pb.string(pod, 7) in self.runtime_handlers:
                continue  # its runtime injected it, in config.json: the engine's spec does not show it
            where = {"container": pb.string(c, 1), "container_name": pb.string(c, 3),
                     "pod": pb.string(pod, 2), "namespace": pb.string(pod, 4)}
            if not any(str(d["path"]).startswith("/dev/nvidia") for d in facts["devices"]):
                missing += 1
                self.event("nri.gpu_missing", "error", **where, devices=r["devices"],
                           message="this container asked for a GPU and has no NVIDIA device: it was created "
                                   "while nvhook's NRI plugin was not answering; delete it to have it recreated "
                                   "with its GPU")
                continue
            if state != CONTAINER_RUNNING:
                continue  # created, not started: its StartContainer is still to come
            if time.perf_counter() - t0 > budget:
                unchecked.append(where["container"])
                continue
            found = self.check_start_work(c, facts, r, where)
            checked += found is not None
            work_missing += bool(found)
        if unchecked:
            self.event("nri.start_work_unchecked", "warning", containers=unchecked,
                       message=f"the synchronisation's time for checking running GPU containers' start work "
                               f"({round(budget * 1000)} ms) was spent: these were not checked")
        self.event("nri.synchronized", containers=n, gpu_missing=missing, start_work_checked=checked,
                   start_work_missing=work_missing, start_work_unchecked=len(unchecked),
                   ms=round((time.perf_counter() - t0) * 1000, 2))
        return b""

    def check_start_work(self, c, facts: dict, request: dict, where: dict) -> bool | None:
        """Whether running container `c` misses the work its StartContainer should have done
        (True, logged as `nri.start_work_missing`), or has it (False); None where it was not
        checked (nothing was left to its start, not nvhook's answer, not its pid, a failure).
        Only read: the container runs, its processes may be loading libraries right now, and
        some may already have loaded the host's libcuda or failed to find one; a cache written
        under them would leave it half one way, half the other, and a running container can make
        the scan slow inside the engine's timeout. The fix is a clean start (delete the pod). A
        pid that is not the container's (it exited, and the number was reused) is skipped with
        a debug event; any other failure is logged and Synchronize goes on."""
        from ...apply.paths import Root

        cid = where["container"]
        log = self.log()
        try:
            _adjust, _summary, work = self.adjustment(cid, facts, log, request)
            if work is None or not set(work["libraries"]) <= {m["destination"] for m in facts["mounts"]}:
                return None  # nothing left to the start, or not nvhook's answer (gpu_missing's case)
            pid = pb.integer(c, 12)
            try:
                fd, owner = open_container_root(pid, cid)
            except HookError as e:
                log.debug("nri.start_work_unchecked", **where, pid=pid, error=e.message)
                return None
            try:
                root = Root(fd, owner=owner)
                compat: dict = {}

                def compat_dir() -> str | None:
                    if "compat" not in work["why"]:
                        return None
                    compat["decision"], d = self.compat_choice(cid, pid, fd, facts, log)
                    return d

                lost = start_work_missing(root, work, compat_dir)
                if lost == ["ldcache"] and (read_only(root, "/etc") or node_etc(root, self.root)
                                            or etc_is_volume(root)):
                    return False  # nothing could be written at its start either (nri.start_read_only)
            finally:
                os.close(fd)
            if not lost:
                return False
            fix = "delete the pod to have it recreated with nvhook's work done at its start"
            said = []
            if "ldcache" in lost:
                said.append("the loader cache does not list the driver's libraries (`ldconfig -p` misses "
                            "libcuda: tools that look it up there, such as Triton, fail)")
            if "compat" in lost:
                said.append("the image's forward-compat libcuda is needed on this host's GPUs but the host's "
                            "comes first (CUDA reports the driver too old)")
            log.error("nri.start_work_missing", **where, pid=pid, missing=lost, work=",".join(work["why"]),
                      compat=compat.get("decision"),
                      message=f"this GPU container was started without nvhook's start work (nvhook's NRI "
                              f"plugin was down or too slow at its start): {'; '.join(said)}; {fix}")
            return True
        except HookError as e:
            log.warning("nri.start_work_check_failed", **where, error=e.message)
        except Exception as e:  # a bug: this container is not checked, the others are
            import traceback

            log.error("nri.start_work_check_failed", **where, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
        finally:
            log.flush()
        return None

    def on_CreateContainer(self, payload: bytes) -> bytes:
        from ...apply import nriadjust
        from ...decide import request as request_mod

        req = pb.decode(payload)
        c = pb.message(req, 2)
        facts = container_facts(c)
        r = request_mod.parse(facts["env"], privileged=False, mounts=facts["mounts"], config=self.cfg,
                              annotations=facts["annotations"])
        if r["kind"] == "skip":
            return b""  # no GPU: the container as the engine made it
        t0 = time.perf_counter()
        cid = pb.string(c, 1)
        handler = pb.string(pb.message(req, 1), 7)
        if handler in self.runtime_handlers:
            self.event("nri.left_to_runtime", container=cid, container_name=pb.string(c, 3),
                       runtime_handler=handler)
            return b""
        log = self.log()
        try:
            adjust, summary, _work = self.adjustment(cid, facts, log, r)
        except HookError as e:
            log.error("nri.refused", container=cid, container_name=pb.string(c, 3), error=e.message)
            raise
        finally:
            log.flush()
        self.event("nri.adjusted", container=cid, container_name=pb.string(c, 3),
                   ms=round((time.perf_counter() - t0) * 1000, 2), **summary)
        return nriadjust.create_response(adjust)

    def on_StateChange(self, payload: bytes) -> bytes:
        """StartContainer (the only state change nvhook subscribes to; others are ignored): the
        in-container work of a GPU container whose answer left it to the plugin (start_work).
        The container was created (runc create: its init waits on the start, its root pivoted,
        every spec mount in place) and does not run yet. An error here fails the start, with
        nvhook's line in the engine's message: never a GPU container that starts broken."""
        req = pb.decode(payload)
        if pb.integer(req, 1) != START_CONTAINER:
            return b""
        c = pb.message(req, 3)
        facts = container_facts(c)
        from ...decide import request as request_mod

        r = request_mod.parse(facts["env"], privileged=False, mounts=facts["mounts"], config=self.cfg,
                              annotations=facts["annotations"])
        if r["kind"] == "skip" or pb.string(pb.message(req, 2), 7) in self.runtime_handlers:
            return b""  # no GPU, or its runtime's: nothing of nvhook's to do at the start
        cid = pb.string(c, 1)
        t0 = time.perf_counter()
        log = self.log()
        try:
            _adjust, _summary, work = self.adjustment(cid, facts, log, r)
            if work is None:
                return b""
            given = {m["destination"] for m in facts["mounts"]}
            if not set(work["libraries"]) <= given:
                # Created unadjusted (the plugin was down or too slow at its creation): no GPU
                # of nvhook's to finish; Synchronize names it.
                log.warning("nri.start_not_adjusted", container=cid, container_name=pb.string(c, 3),
                            message="this container did not get nvhook's answer at its creation; nothing done "
                                    "at its start")
                return b""
            done = self.start_work(cid, pb.integer(c, 12), facts, work, log)
        except HookError as e:
            log.error("nri.start_refused", container=cid, container_name=pb.string(c, 3), error=e.message)
            raise
        finally:
            log.flush()
        self.event("nri.started", container=cid, container_name=pb.string(c, 3),
                   ms=round((time.perf_counter() - t0) * 1000, 2), **done)
        return b""

    def start_work(self, cid: str, pid: int, facts: dict, work: dict, log) -> dict:
        """What a hook would have done inside the container, done from here through its root
        (/proc/<pid>/root, checked to be that container's) by fd, RESOLVE_IN_ROOT: the compat
        libcuda choice (reading the image's files, the same decision as hook mode) and the
        loader cache, /etc/ld.so.cache written with the directories the libraries are bound in
        (and the compat directory first when the image's libcuda is chosen). A read-only root
        filesystem: refused when the compat libcuda must be used (only the cache can put it
        first), else a warning (the libraries load from their binds; `ldconfig -p` does not
        list them)."""
        from ...apply import ldscan
        from ...apply.paths import Root

        budget = self.request_timeout_ms / 1000 * START_SCAN_SHARE
        deadline = ldscan.clock() + budget
        fd, owner = open_container_root(pid, cid)
        try:
            root = Root(fd, owner=owner)
            dirs = list(work["dirs"])
            out: dict = {"work": ",".join(work["why"]), "compat": None}
            compat_dir = None
            if "compat" in work["why"]:
                out["compat"], compat_dir = self.compat_choice(cid, pid, fd, facts, log)
            if node_etc(root, self.root):
                if compat_dir is not None:
                    raise HookError(f"the image's forward-compat libcuda ({compat_dir}) is needed on this host's "
                                    f"GPUs, but the container's /etc is this node's own /etc (a hostPath volume), "
                                    f"whose loader cache nvhook does not write: mount the node's /etc elsewhere "
                                    f"(e.g. /host/etc) or set LD_LIBRARY_PATH={compat_dir} in the image")
                log.warning("nri.start_node_etc", container=cid,
                            message="the container's /etc is this node's own /etc (a hostPath volume): nvhook "
                                    "does not write the node's loader cache; the driver's libraries load from "
                                    "their binds, but `ldconfig -p` does not list them; mount the node's /etc "
                                    "elsewhere (e.g. /host/etc)")
                out["ldcache"] = "node-etc"
                return out
            if read_only(root, "/etc"):
                if compat_dir is not None:
                    raise HookError(f"the image's forward-compat libcuda ({compat_dir}) is needed on this host's "
                                    f"GPUs, but the container's /etc is read-only, so nvhook cannot put it in the "
                                    f"loader cache: allow writes to the root filesystem (readOnlyRootFilesystem: "
                                    f"false) or set LD_LIBRARY_PATH={compat_dir} in the image")
                log.warning("nri.start_read_only", container=cid,
                            message="the container's /etc is read-only: no loader cache written; the driver's "
                                    "libraries load from their binds, but `ldconfig -p` does not list them")
                out["ldcache"] = "read-only"
                return out
            if compat_dir is not None and node_etc(root, self.root, "/etc/ld.so.conf.d"):
                raise HookError(f"the image's forward-compat libcuda ({compat_dir}) is needed on this host's GPUs, "
                                f"but the container's /etc/ld.so.conf.d is this node's own (a hostPath volume), "
                                f"where nvhook does not write: mount it elsewhere or set "
                                f"LD_LIBRARY_PATH={compat_dir} in the image")
            if compat_dir is not None:
                from ..cdihook import _write_conf

                _write_conf(root, "/etc/ld.so.conf.d", "00-compat-nvhook.conf", compat_dir + "\n")
                dirs.insert(0, compat_dir)
                out["compat_dir"] = compat_dir
            # The bind directories that the image's own ldconfig scans (its family's defaults:
            # a Debian image's /usr/lib/<multiarch>, not the /usr/lib64 bound for RHEL images),
            # so that the cache is the one it would write; all of them where it scans none.
            system = set(ldscan.Scan(root).system_dirs())
            dirs = [d for d in dirs if d in system or d == compat_dir] if system & set(dirs) else dirs
            try:
                out["ldcache"] = ldscan.update(root, dirs, log, deadline=deadline)
            except ldscan.ScanTooSlow as e:
                raise HookError(f"{e.message}: past {round(budget * 1000)} ms, half of containerd's NRI "
                                f"request timeout, so nvhook wrote no loader cache and refused this start rather "
                                f"than be dropped by containerd; starting it again usually finds the image's "
                                f"files in the page cache") from None
            return out
        finally:
            os.close(fd)

    def compat_choice(self, cid: str, pid: int, fd: int, facts: dict, log) -> tuple[str, str | None]:
        """Hook mode's compat decision for the container whose root is `fd`: (decision, the
        compat directory to put first, or None). The image is read by path below the fd (links
        clamped at its root: observe/image.py). An image without compat libraries (most plain
        images) is decided from that alone; one with them gets the whole decision (the
        container's GPUs, their brands from NVML when needed, the libraries' notes)."""
        from ...decide import compat
        from ...observe import image
        from ...observe.host import procfs

        rootfs = f"/proc/self/fd/{fd}"
        version = procfs.driver_version(self.root)
        if not image.find_compat_libs(rootfs, version):
            mode, source, _refused = compat.mode_from_env(facts["env"], self.cfg["compat"]["mode"],
                                                          self.cfg["compat"]["allow_env_override"])
            d = compat.decide(["compute"], version, [], [], mode)
            log.event("compat.decision", "info", **dict(d["event"], mode=mode, mode_source=source,
                                                        reason=d["reason"]))
            return d["decision"], None
        from ...decide.sources import Host, NriContainer, Options
        from .. import pipeline

        container = NriContainer(cid, facts["env"], facts["mounts"], facts["annotations"], facts["devices"],
                                 rootfs=rootfs, pid=pid)
        plan = pipeline.decide(container, Host(self.root, self.cfg, log), Options(change_host=False)).plan
        if plan["compat"]["decision"] == "image" and plan["compat"]["libraries"]:
            return "image", posixpath.dirname(plan["compat"]["libraries"][0])
        return plan["compat"]["decision"], None

    def memo_key(self, request: dict, env: dict) -> str | None:
        """What a decision reads of a container, as a key for its answer; None where the answer
        depends on more than the host's files and GPU list (NVML's MIG facts, `all`, MIG
        management: the live instances). The key is a digest: the values come from the pod's
        environment (up to ttrpc's 4 MiB), and up to 256 answers are kept."""
        import hashlib
        import json

        from ...decide import compat, plan

        if (plan.needs_mig_facts(request) or request["devices"] == ["all"] or request.get("mig_config")
                or request.get("mig_monitor")):
            return None
        # LD_LIBRARY_PATH counts by the one directory the answer uses of it (loader_dir).
        read = {k: env.get(k) for k in ("CUDA_VERSION", compat.ENV_VAR)}
        read["loader_dir"] = loader_dir(env)
        return hashlib.sha256(json.dumps([request, read], sort_keys=True, default=str).encode()).hexdigest()

    def answered(self, key: str | None, request: dict, log) -> tuple[bytes, dict, dict | None] | None:
        """The answer already decided for `key`, if the host is still the one it was decided on:
        the same inventory (the cache's own check, every file the scan looked at, runs on each
        use: a driver upgrade or a library that came or went is a miss) and the same GPUs with
        the same device nodes (read again from /proc/driver/nvidia and /dev)."""
        memo = self.answers.get(key) if key is not None else None
        if memo is None:
            return None
        from ...decide import plan as plan_mod
        from ...observe import host

        inv = host.observe(self.root, self.cfg["cache_dir"], log,
                           capabilities=plan_mod.expand_capabilities(request["capabilities"]))
        if inv["files"]["inputs"] != memo["inputs"] or inv["gpus"] != memo["gpus"]:
            del self.answers[key]  # type: ignore[arg-type]
            return None
        return memo["adjust"], dict(memo["summary"], cached=True), memo["work"]

    def adjustment(self, cid: str, facts: dict, log, request: dict | None = None) -> tuple[bytes, dict, dict | None]:
        """The answer for a container (adjustment bytes), its event's fields, and the work left
        for its start (start_work), or None when there is none."""
        from ...apply import nriadjust
        from ...decide import cdimodel as cdi
        from ...decide import edits as edits_mod
        from ...decide.sources import Host, NriContainer
        from .. import pipeline

        key = self.memo_key(request, facts["env"]) if request is not None else None
        log.bind(container=cid)
        hit = self.answered(key, request, log) if request is not None else None
        if hit is not None:
            return hit
        # No rootfs: the image is not readable at CreateContainer; the plan is for any image.
        source = NriContainer(cid, facts["env"], facts["mounts"], facts["annotations"], facts["devices"])
        decision = pipeline.decide(source, Host(self.root, self.cfg, log))
        plan, known = decision.plan, decision.facts
        if not plan["mounts"] and not plan["symlinks"]:
            return b"", {"gpus": [], "reason": plan["compat"]["reason"]}, None
        edits = edits_mod.from_plan(plan)
        driver_cuda = pipeline.cuda_for(known["inventory"]) if "inventory" in known else None
        why = in_container_work(plan, edits, facts["env"], driver_cuda, self.mask_procfs)
        hook = None
        work: dict | None = None
        if any(w not in IN_PLUGIN for w in why):
            # The hook does all of it (its binds are a CDI spec's), as before.
            mounts = edits_mod.spec_mounts(edits)
            from ...base.launch import registration

            path, argv0 = registration(self.hook_path)
            args = cdi.hook_args(plan["request"]["capabilities"], self.hook_global_args)
            hook = {"path": path, "args": [*argv0, *args[1:]], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
        else:
            # The libraries at their names where the loader finds them with no cache: the
            # LD_LIBRARY_PATH directory, unless a compat libcuda may have to come first (the
            # loader reads LD_LIBRARY_PATH before the cache, so the driver's libraries then go
            # to the default directories, which it reads after the cache).
            ldir = loader_dir(facts["env"])
            dirs = [ldir] if ldir and "compat" not in why else default_lib_dirs(edits)
            mounts = loader_mounts(edits, dirs)
            if why:
                libs = [m["container_path"] for m in mounts if m["kind"] == "library"]
                work = {"why": list(why), "dirs": dirs, "libraries": libs}
        adjust = nriadjust.adjustment(edits, mounts, hook)
        summary = {"gpus": [g["index"] for g in plan["gpus"]], "devices": len(edits["device_nodes"]),
                   "mounts": len(mounts), "cgroup_rules": len(edits["cgroup_devices"]),
                   "hook": ",".join(why) if hook else None, "at_start": ",".join(why) if work else None,
                   "compat": plan["compat"]["decision"]}
        inv = known.get("inventory")
        # An answer that consulted NVML (GPU brands for the compat choice, MIG) is not kept: what
        # NVML said is not part of the check above.
        if key is not None and inv is not None and inv.get("nvml_state") is None:
            if len(self.answers) >= 256:
                self.answers.clear()
            self.answers[key] = {"inputs": inv["files"]["inputs"], "gpus": inv["gpus"], "adjust": adjust,
                                 "summary": summary, "work": work}
        return adjust, dict(summary, cached=False), work


def run(opts: dict) -> int:
    """`nvhook nri`: load the config, then serve until killed."""
    import signal
    import sys

    from ...base import config as config_mod
    from ...observe.host import cache
    from .. import pipeline

    # The parsed inventory cache stays in memory while its file is unchanged (as in nvhookd);
    # every use still checks it against the host.
    cache.KEEP_PARSED = True
    try:
        cfg = config_mod.load(opts.get("config"), explicit=bool(opts.get("config")))
        root = pipeline.root_from(opts.get("root"), cfg)
    except HookError as e:
        # EX_CONFIG: the unit's RestartPreventExitStatus, so that systemd does not restart a
        # plugin that can only fail the same way again until the operator fixes the config.
        sys.stderr.write(f"nvhook nri: {e.message}\n")
        return CONFIG_ERROR
    hook_path = opts.get("hook_path") or os.path.join(os.path.dirname(os.path.realpath(sys.argv[0])), "nvhook")
    gargs = []
    if opts.get("config"):
        gargs += ["--config", os.path.abspath(opts["config"])]
    if opts.get("root"):
        gargs += ["--root", os.path.abspath(opts["root"])]
    plugin = Plugin(cfg, root, socket_path=opts.get("socket") or DEFAULT_SOCKET, name=opts.get("name") or "nvhook",
                    index=opts.get("index") or "10", hook_path=hook_path, hook_global_args=gargs,
                    mask_procfs=bool(opts.get("mask_procfs")),
                    runtime_handlers=tuple(h for h in opts.get("runtime_handlers") or DEFAULT_RUNTIME_HANDLERS if h))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    plugin.event("nri.start", socket=plugin.socket_path, plugin=f"{plugin.index}-{plugin.name}", pid=os.getpid(),
                 mask_procfs=plugin.mask_procfs, runtime_handlers=sorted(plugin.runtime_handlers))
    plugin.warm()
    try:
        plugin.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0



