"""The apply child: forked by `nvhook.apply.start_worker` before the plan exists, it imports
what applying needs (the mount and ld.so.cache code: ~3 ms) while the parent observes the host
and decides, then reads the plan from its pipe and applies it.

Everything here runs in that child and reports to the parent over the event pipe as JSON lines
(`_PipeLog`): events, then one final {"done": summary} or {"failed": message, "code": n}. It
always ends in os._exit.
"""

from __future__ import annotations

import marshal
import os
import stat
import time

from ..base import jsonfast as json
from ..base import sandbox
from ..base.config import ldconfig_is_builtin
from ..base.errors import HookError
from ..base.log import LEVELS
from . import cgroups, ldscan
from .copies import CopySource
from .devnodes import NodeSource, PlannedNode
from .mountbase import Source
from .mounts import KINDS, NOUNS, apply_mounts
from .paths import Root, container_root_ids
from .symlinks import apply_symlinks


def main(plan_r: int, ev_w: int, parent: int, t_fork: float) -> None:  # pragma: no cover
    """The worker's life: never returns."""
    code = 1
    log = _PipeLog(ev_w)
    try:
        from ..base import process  # the forked worker's own: the hook applying inline needs none of it

        process.die_with_parent(parent)
        imports_ms = _ms(t_fork)
        chunks = []
        while b := os.read(plan_r, 1 << 16):
            chunks.append(b)
        os.close(plan_r)
        if not chunks:  # cancelled: the container needs nothing applied
            code = 0
            return
        job = marshal.loads(b"".join(chunks))
        log.level = job["level"]
        result = run_plan(job["plan"], log, job["ldconfig_timeout"], job.get("pidfd"))
        result["apply_child_imports_ms"] = imports_ms
        log.send({"done": result})
        code = 0
    except HookError as e:
        _try_send(log, {"failed": e.message, "code": e.code})
    except OSError as e:
        _try_send(log, {"failed": f"applying the plan failed: {e.strerror or e}", "code": 1})
    except BaseException as e:  # noqa: BLE001 - a bug, reported on one line
        _try_send(log, {"failed": f"internal error in nvhook's apply step: {type(e).__name__}: {e}",
                        "code": 1})
    finally:
        os._exit(code)


def _exited(pidfd: int) -> bool:
    from ..base import process  # only nvhookd passes a pidfd

    return process.exited(pidfd)


def _ms(t: float) -> float:
    return round((time.perf_counter() - t) * 1000, 2)


def run_plan(plan: dict, log, timeout: float, pidfd: int | None = None) -> dict:
    """Host side first (the child is still in the host's namespaces): open /proc/<pid>/ns/mnt,
    the rootfs and every mount source, so that a missing one is reported by name before
    anything is mounted; then enter the container's mount namespace and apply."""
    t0 = time.perf_counter()
    container = plan["container"]
    pid = container["pid"]
    rootfs = os.path.normpath(container["rootfs"])
    ld_spec = plan.get("ldconfig")
    try:
        ns_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise HookError(f"container process {pid} is gone") from None
    except OSError as e:
        raise HookError(f"cannot open the mount namespace of container process {pid}: "
                        f"{e.strerror}") from None
    try:
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open the container rootfs {rootfs}: {e.strerror}") from None
    root_st = os.fstat(root_fd)
    sources = _open_sources(plan.get("mounts") or [], rootfs, Root(root_fd))
    os.close(root_fd)
    ns_st, own = os.fstat(ns_fd), os.stat("/proc/self/ns/mnt")
    if (ns_st.st_dev, ns_st.st_ino) == (own.st_dev, own.st_ino) and not container.get("own_mount_namespace"):
        # Mounting "into the container" would mount into nvhook's own namespace, the host's:
        # a wrong or forged state, or a runtime that gave the container no mount namespace.
        raise HookError(f"container process {pid} shares nvhook's own mount namespace; refusing to mount "
                        f"into it (the OCI state's pid must be the container's process)")
    ld_fd = None
    cg_fds: list[int] = []
    if ld_spec and not ldconfig_is_builtin(ld_spec.get("binary")):
        # A configured program: its confinement code loads only then (~1 ms of imports).
        from . import ldconfig

        if str(ld_spec.get("binary") or "").startswith("@"):
            ld_fd = ldconfig.open_host_binary(ld_spec["binary"])
        cg_fds = ldconfig.open_cgroup_procs(pid)  # the host's view of the container's cgroups
    ids = container_root_ids(pid)
    if pidfd is not None and _exited(pidfd):
        # After the last read of /proc/<pid> (namespace, cgroups, id maps): while the pidfd's
        # process lives its pid is its own, so everything read above was that process's; once
        # it has exited, any of it may be from a process that got the pid since.
        raise HookError(f"container process {pid} exited before its driver could be applied")
    prepare_ms = _ms(t0)
    result = _apply(plan, log, ns_fd, pid, rootfs, root_st, sources, ld_fd, ids, timeout, cg_fds)
    result["apply_prepare_ms"] = prepare_ms
    return result


def _on_host(call, path: str, noun: str, verb: str):
    """call(path), its failure told as the user needs it ("host library vanished: ...")."""
    try:
        return call(path)
    except FileNotFoundError:
        raise HookError(f"host {noun} vanished: {path}") from None
    except OSError as e:
        raise HookError(f"cannot {verb} host {noun} {path}: {e.strerror}") from None


def _open_sources(mounts: list, rootfs: str, host_root: Root) -> list[Source | NodeSource | CopySource | None]:
    """Host side: a source per mount (a `NodeSource` for device nodes, a `CopySource` for procfs
    copies, a `Source` for binds, None for tmpfs), opened now so that a missing one is reported
    before anything is mounted."""
    out: list[Source | NodeSource | CopySource | None] = []
    prefix = rootfs.rstrip("/") + "/"
    for m in mounts:
        kind = m.get("kind")
        target = m.get("target")
        if kind not in KINDS:
            raise HookError(f"unknown mount kind {kind!r} in the plan (target {target})")
        if not isinstance(target, str) or not target.startswith("/"):
            raise HookError(f"mount target must be an absolute container path, not {target!r}")
        if kind == "tmpfs":
            out.append(None)
            continue
        source = m.get("source")
        if not isinstance(source, str) or not source:
            raise HookError(f"mount of {target} has no source in the plan")
        noun = NOUNS.get(kind, "file")
        in_root = None
        if kind == "compat" or source.startswith(prefix):
            # From the image: resolved inside the rootfs, never through its symlinks to the host.
            in_root = source[len(prefix) - 1:] if source.startswith(prefix) else source
            try:
                fd = host_root.lookup(in_root)
            except FileNotFoundError:
                raise HookError(f"container {noun} vanished: {in_root} (in {rootfs})") from None
            except OSError as e:
                raise HookError(f"cannot open container {noun} {in_root}: {e.strerror}") from None
            st = os.fstat(fd)
            if kind == "compat" and not stat.S_ISREG(st.st_mode):
                raise HookError(f"compat library {in_root} in the image is not a regular file")
        elif kind == "device":
            # The node is created from its number, mode and owner: the plan's "node" (observed
            # this run, no syscall here) or a stat of the host node. A bind instead (user
            # namespaces, a nodev /dev) stats the path when it opens it.
            node = _planned_node(m.get("node"), target) if "node" in m else None
            out.append(NodeSource(source, node or _on_host(os.stat, source, noun, "stat")))
            continue
        elif "copy" in (m.get("options") or ()):
            # Read by the child through this fd: its bytes are all a copy needs.
            fd = _on_host(lambda path: os.open(path, os.O_RDONLY | os.O_CLOEXEC), source, noun, "open")
            out.append(CopySource(source, fd))
            continue
        else:
            fd = _on_host(lambda path: os.open(path, os.O_PATH | os.O_CLOEXEC), source, noun, "open")
            st = os.fstat(fd)
        out.append(Source(source, fd, st, in_root))
    return out


def _planned_node(node, target: str) -> PlannedNode:
    """The plan's device node, checked: numbers and ids in range, permission bits only."""
    ok = isinstance(node, dict) and all(type(node.get(k)) is int for k in ("major", "minor", "mode", "uid", "gid"))
    if not ok or not (0 <= node["major"] < 1 << 12 and 0 <= node["minor"] < 1 << 20 and 0 <= node["mode"] <= 0o7777
                      and 0 <= node["uid"] < 1 << 32 and 0 <= node["gid"] < 1 << 32):
        raise HookError(f"invalid device node in the plan for {target}: {node!r}")
    return PlannedNode(stat.S_IFCHR | node["mode"], os.makedev(node["major"], node["minor"]), node["uid"], node["gid"])


class _PipeLog:
    """The child's EventLog stand-in: events go to the parent as JSON lines on the pipe.

    Routine events are buffered and sent in one write (a MIG container's 250 device and
    procfs events would otherwise be 250 pipe writes); a warning or error, the start of
    ldconfig (which may hang) and the final status flush the buffer, so the parent has every
    event that precedes anything that can go wrong."""

    LIMIT = 32768

    def __init__(self, fd: int, level: int = 0):
        self.fd = fd
        self.level = level  # the parent log's threshold: what it would not write is not sent
        self.buf: list[str] = []
        self.size = 0

    def _line(self, obj: dict) -> None:
        line = json.dumps(obj, default=str, separators=(",", ":")) + "\n"
        self.buf.append(line)
        self.size += len(line)

    def flush(self) -> None:
        if not self.buf:
            return
        view = memoryview("".join(self.buf).encode())
        self.buf, self.size = [], 0
        while view:
            view = view[os.write(self.fd, view):]

    def send(self, obj: dict) -> None:
        self._line(obj)
        self.flush()

    def event(self, name: str, level: str = "info", **fields) -> None:
        if LEVELS.get(level, 20) < self.level:
            return
        self._line({"event": name, "level": level, "ts": time.time(), "fields": fields})
        if level in ("warning", "error") or self.size > self.LIMIT:
            self.flush()

    def debug(self, name: str, **fields) -> None:
        self.event(name, "debug", **fields)

    def info(self, name: str, **fields) -> None:
        self.event(name, "info", **fields)

    def warning(self, name: str, **fields) -> None:
        self.event(name, "warning", **fields)

    def error(self, name: str, **fields) -> None:
        self.event(name, "error", **fields)


def _try_send(log: _PipeLog, obj: dict) -> None:
    try:
        log.send(obj)
    except BaseException:  # noqa: BLE001 - the parent reports the missing status
        pass


def _apply(plan, log, ns_fd, pid, rootfs, root_st, sources, ld_fd, ids, timeout, cg_fds=()) -> dict:
    t = time.perf_counter()
    host_mountinfo = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)  # the host's, kept
    try:
        sandbox.setns(ns_fd, sandbox.CLONE_NEWNS, what=f"mnt of process {pid}")
    except OSError as e:
        raise HookError(f"cannot enter the mount namespace of container process {pid}: "
                        f"{os.strerror(e.errno or 0)}") from None
    try:
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"the container rootfs {rootfs} is not visible in the container's mount "
                        f"namespace ({e.strerror}); nvhook must run as a prestart or createRuntime "
                        f"hook, before the runtime's pivot_root") from None
    st = os.fstat(root_fd)
    if (st.st_dev, st.st_ino) != (root_st.st_dev, root_st.st_ino):
        raise HookError(f"{rootfs} in the container's mount namespace is not the rootfs the host sees; "
                        f"nvhook must run before the runtime's pivot_root")
    peer = _peer_group(os.readlink(f"/proc/self/fd/{root_fd}"))
    if peer is not None and _host_has_peer(host_mountinfo, peer):
        raise HookError(f"the container rootfs {rootfs} is a mount shared with the host (peer group "
                        f"{peer}): nvhook's mounts would propagate to the host; refusing (the runtime "
                        f"should keep the rootfs private or slave, as runc and crun do)")
    os.close(host_mountinfo)
    if ids != (0, 0):
        # Placeholders, directories and symlinks are created with the container root's fsuid
        # (see paths.Root.owner); keep CAP_DAC_OVERRIDE & co. effective while the fsuid is not 0.
        sandbox.set_securebits(sandbox.SECBIT_NO_SETUID_FIXUP)
    root = Root(root_fd, owner=ids)
    enter_ms = _ms(t)

    mounts = plan.get("mounts") or []
    t = time.perf_counter()
    n_mounts = apply_mounts(root, mounts, sources, log)
    mounts_ms = _ms(t)

    t = time.perf_counter()
    n_links = apply_symlinks(root, plan.get("symlinks") or [], log)
    symlinks_ms = _ms(t)
    if plan.get("app_profile"):
        from .profilefile import write_profile_or_warn

        write_profile_or_warn(root, plan["app_profile"], log)

    # The cache: written by nvhook itself by default (no program runs); a configured program
    # runs last, once nothing of nvhook's own work in the rootfs is left to race with it.
    t_ld = time.perf_counter()
    ld_spec = plan.get("ldconfig")
    ld_state = "skipped"
    if ld_spec:
        if ldconfig_is_builtin(ld_spec.get("binary")):
            ld_state = ldscan.update(root, list(ld_spec.get("directories") or []), log)
        else:
            from . import ldconfig

            log.flush()  # ldconfig may hang and be killed: the parent has everything before it
            job = ldconfig.start(root, ld_spec, log, timeout=timeout, host_fd=ld_fd, ids=ids, cgroup_fds=cg_fds)
            ld_state = ldconfig.finish(job, log)
    return {"mounts": n_mounts, "symlinks": n_links, "ldconfig": ld_state, "apply_enter_ms": enter_ms,
            "apply_mounts_ms": round(mounts_ms, 2), "apply_symlinks_ms": symlinks_ms,
            "apply_ldconfig_ms": _ms(t_ld)}


def _peer_group(path: str) -> str | None:
    """The shared peer group ("shared:N") of the mount holding `path` in this process's mount
    namespace, or None when that mount does not propagate (private, slave)."""
    best_len, peer = -1, None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) < 7:
                continue
            mp = cgroups.unescape(fields[4])
            if path == mp or path.startswith(mp.rstrip("/") + "/"):
                if len(mp) >= best_len:  # later lines are mounted on top
                    best_len = len(mp)
                    opt = fields[6:fields.index("-")] if "-" in fields else []
                    peer = next((o[7:] for o in opt if o.startswith("shared:")), None)
    return peer


def _host_has_peer(fd: int, peer: str) -> bool:
    """Whether a mount of the host's namespace (mountinfo opened before setns) is in peer group
    `peer` or its slave: mounts made in that group would show up on the host."""
    chunks = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            break
        chunks.append(b)
    wanted = {f"shared:{peer}".encode(), f"master:{peer}".encode()}
    for line in b"".join(chunks).split(b"\n"):
        fields = line.split(b" ")
        if b"-" in fields and wanted & set(fields[6:fields.index(b"-")]):
            return True
    return False
