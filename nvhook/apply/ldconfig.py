"""Run ldconfig for the container, confined to its rootfs.

Which binary: plan["ldconfig"]["binary"] starting with "@" names the HOST's binary
("@/sbin/ldconfig"): the parent opens it with O_PATH on the host, and the child executes that
fd (fexecve, i.e. execveat(fd, "", AT_EMPTY_PATH)) after chroot, so the path never has to
exist in the container. Otherwise the container's own: the first regular file among
<binary>.real, <binary>, /sbin/ldconfig.real, /sbin/ldconfig, /usr/sbin/ldconfig, each
resolved inside the rootfs (Ubuntu's /sbin/ldconfig is a shell wrapper around ldconfig.real).
No ldconfig at all is not an error: `ldconfig.missing` is logged and the container starts
(the libraries are there; only SONAME links and the cache are not refreshed).

Only when configured: by default nvhook writes the cache itself (`ldscan`) and runs nothing.
`ldconfig.path = "builtin"` (or empty) selects that; anything else selects a program.

How a program runs (`ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache <plan directories>`),
from the apply child, which is already in the container's mount namespace, after every mount
and symlink of nvhook's is done (nothing of nvhook's own work in the rootfs runs while it does):

  - a new PID namespace (unshare(CLONE_NEWPID) before the fork), so ldconfig is its pid 1 and
    killing it on timeout kills everything it started; where that is refused, a new process
    group, killed as a group;
  - in the container's cgroups (every hierarchy the container's process is in, joined before
    anything else), so the container's pids and memory limits hold it; then new mount,
    network, IPC, UTS and cgroup namespaces: no host socket, abstract socket, SysV object or
    hostname is reachable; in its private copy of the container's mounts, a fresh read-only
    /proc (its own PID namespace: it sees only itself) and empty read-only /sys and /dev;
  - the process: parent-death signal SIGKILL, re-armed after every credential change (which
    clears it) and checked against a pipe only the apply child holds open; stdin /dev/null,
    stdout and stderr a pipe, every other fd closed (an fd on a host directory would be a way
    out of the chroot); chroot into the rootfs through its fd, chdir /; in a user-namespaced
    container it switches to the host uid/gid that the container's root maps to, which drops
    every capability, so ldconfig acts as the container's own root would;
  - otherwise (container root is host root) every capability is dropped from the bounding,
    ambient, inheritable, permitted and effective sets except CAP_DAC_OVERRIDE (capset and
    prctl through `nvhook.base.sandbox`), then no_new_privs is set.
    Why DAC_OVERRIDE: ldconfig creates SONAME symlinks in the library directories and replaces
    /etc/ld.so.cache (a temporary file renamed over it), and library directories need not be
    writable by their owner (RHEL's /usr/lib64 is 0555). It needs nothing else: it chowns
    nothing (no CAP_CHOWN), only changes modes of files it created itself (no CAP_FOWNER), and
    CAP_SYS_CHROOT is exactly what an image's binary would need to leave a chroot, so it goes;
  - rlimits: CPU seconds (the time limit), address space 1 GiB, 256 open files, files of at most
    64 MiB, 64 processes (the kernel does not apply that one to uid 0: there the container's
    pids cgroup and the PID namespace bound it), no core dumps;
  - an empty environment (the container's LD_PRELOAD and friends must not reach it), SIGPIPE
    and SIGXFSZ back to their defaults (Python ignores them, and exec would keep that);
  - the apply child reads its output under a time limit (`ldconfig_timeout`, 10 s by default)
    and kills it when the limit passes.

Errors are HookErrors: "ldconfig failed with exit code N: <first line of its output>", a
timeout, a death by signal.
"""

from __future__ import annotations

import os
import stat
import time

from ..base import process, sandbox
from ..base.errors import HookError
from ..base.waiting import readable
from .cgroups import unescape
from .paths import Root, container_root_ids  # noqa: F401 - with it, for callers of the program

CANDIDATES = ("/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig")
_EXEC_MARK = "nvhook-exec-failed: "
_OUTPUT_CAP = 64 * 1024


def candidates(binary: str | None) -> list[str]:
    out: list[str] = []
    if binary and not binary.startswith("@"):
        if not binary.endswith(".real"):
            out.append(binary + ".real")
        out.append(binary)
    for c in CANDIDATES:
        if c not in out:
            out.append(c)
    return out


def open_host_binary(spec: str) -> int | None:
    """Parent side, for "@/path": an O_PATH fd on the host's binary, or None if it is missing."""
    path = spec[1:]
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HookError(f"cannot open the host's ldconfig {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise HookError(f"the host's ldconfig {path} is not a regular file")
    return fd


def find_in_root(root: Root, binary: str | None) -> str | None:
    for c in candidates(binary):
        try:
            fd = root.lookup(c)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return c
        finally:
            os.close(fd)
    return None


class Running:
    """An ldconfig started by `start`, to be collected by `finish` (or stopped by `kill`)."""

    __slots__ = ("pid", "r", "new_pidns", "shown", "argv", "timeout", "deadline", "t0", "alive")

    def __init__(self, pid: int, r: int, new_pidns: bool, shown: str, argv: list, timeout: float,
                 alive: int = -1):
        self.pid, self.r, self.new_pidns, self.shown, self.argv = pid, r, new_pidns, shown, argv
        self.alive = alive  # write end of the pipe that tells the child its parent still lives
        self.timeout = timeout
        self.t0 = time.perf_counter()
        self.deadline = process.deadline(timeout)

    def kill(self) -> None:
        """Stop it (the apply step failed elsewhere); idempotent."""
        if self.r < 0:
            return
        _kill(self.pid, self.new_pidns)
        os.close(self.r)
        self.r = -1
        self.close_alive()

    def close_alive(self) -> None:
        if self.alive >= 0:
            os.close(self.alive)
            self.alive = -1


def run(root: Root, spec: dict, log, *, timeout: float, host_fd: int | None = None,
        ids: tuple[int, int] = (0, 0)) -> str:
    """Run ldconfig as planned and wait for it; returns "ran" or "missing"."""
    return finish(start(root, spec, log, timeout=timeout, host_fd=host_fd, ids=ids), log)


def start(root: Root, spec: dict, log, *, timeout: float, host_fd: int | None = None,
          ids: tuple[int, int] = (0, 0), cgroup_fds: list | None = None) -> Running | str:
    """Start ldconfig as planned and return without waiting. "missing" when there is no
    ldconfig to run (logged). The time limit runs from here. `cgroup_fds`: the container's
    cgroup.procs files, opened on the host side (`open_cgroup_procs`), joined by the child."""
    binary = spec.get("binary") or ""
    directories = list(spec.get("directories") or [])
    if binary.startswith("@"):
        if host_fd is None:
            log.warning("ldconfig.missing", binary=binary,
                        reason=f"the host has no {binary[1:]}; SONAME links and the container's "
                               f"ld.so.cache were not updated")
            return "missing"
        exe: int | str = host_fd
        shown = binary
    else:
        path = find_in_root(root, binary)
        if path is None:
            log.warning("ldconfig.missing", candidates=candidates(binary),
                        reason="the image has no ldconfig; SONAME links and the container's "
                               "ld.so.cache were not updated")
            return "missing"
        exe = shown = path
    argv = [shown.lstrip("@"), "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"] + directories
    return _spawn(root, exe, argv, ids, timeout, shown, list(cgroup_fds or []))


def finish(job: Running | str, log) -> str:
    """Wait for a started ldconfig; "ran", or the state `start` returned. Raises HookError when
    it failed, was killed or overran its time limit."""
    if isinstance(job, str):
        return job
    shown = job.shown
    try:
        code, output = _wait(job)
    finally:
        if job.r >= 0:
            os.close(job.r)
            job.r = -1
        job.close_alive()
    ms = round((time.perf_counter() - job.t0) * 1000, 2)
    text = output.decode(errors="replace")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if code == 127 and first.startswith(_EXEC_MARK):
        raise HookError(f"cannot run ldconfig {shown} in the container: {first[len(_EXEC_MARK):]}")
    if code < 0:
        raise HookError(f"ldconfig {shown} was killed by signal {-code}"
                        + (f": {first[:200]}" if first else ""))
    if code != 0:
        raise HookError(f"ldconfig failed with exit code {code}: {first[:200] or 'no output'} "
                        f"(ran {shown} in the container)")
    fields = {"binary": shown, "directories": job.argv[5:], "duration_ms": ms}
    if text.strip():
        fields["output"] = text[:2000]
    log.info("ldconfig.done", **fields)
    return "ran"


def open_cgroup_procs(pid: int) -> list[int]:
    """Host side: write fds on the cgroup.procs file of every cgroup process `pid` is in (one per
    v1 hierarchy, or the v2 one), for the ldconfig child to join. Best effort: a hierarchy that
    cannot be found or opened is left out."""
    mounts = []  # (mount point, root, fstype, super options)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields:
                    continue
                k = fields.index("-")
                if k + 3 < len(fields) + 1 and fields[k + 1] in ("cgroup", "cgroup2"):
                    mounts.append((unescape(fields[4]), unescape(fields[3]), fields[k + 1],
                                   set(fields[k + 3].split(",")) if k + 3 < len(fields) else set()))
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    fds = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        wanted = set(controllers.split(",")) if controllers else set()
        for mp, mroot, fstype, opts in mounts:
            if (fstype == "cgroup2") != (not wanted) or not wanted <= opts:
                continue
            rel = path[len(mroot):] if mroot != "/" and path.startswith(mroot) else path
            try:
                fds.append(os.open(f"{mp.rstrip('/')}/{rel.lstrip('/')}/cgroup.procs".replace("//", "/"),
                                   os.O_WRONLY | os.O_CLOEXEC))
            except OSError:
                pass
            break
    return fds


# Confinement limits for a program run (see the module docstring).
RLIMIT_AS_BYTES = 1 << 30
RLIMIT_NOFILE_N = 256
RLIMIT_FSIZE_BYTES = 64 << 20
RLIMIT_NPROC_N = 64


def _spawn(root: Root, exe: int | str, argv: list, ids: tuple[int, int], timeout: float,
           shown: str, cgroup_fds: list) -> Running:
    try:
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        null = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # stdin that reads nothing
    try:
        sandbox.unshare(sandbox.CLONE_NEWPID)
        new_pidns = True
    except OSError:
        new_pidns = False
    # The rootfs by its name in this mount namespace: the child resolves it again in its own
    # copy of the namespace, where its mounts must land.
    rootfs = os.readlink(f"/proc/self/fd/{root.fd}")
    try:
        pid, ((r, w), (alive_r, alive_w)) = process.fork_with_pipes(2)
    except OSError:
        os.close(null)
        raise
    if pid == 0:  # pragma: no cover - runs in the child, reports through its exit code
        code = 127
        try:
            _child(root.fd, rootfs, exe, argv, ids, r, w, null, new_pidns, alive_r, alive_w, cgroup_fds,
                   timeout)
        except BaseException as e:  # noqa: BLE001 - everything must become the exit code
            msg = f"{_EXEC_MARK}{getattr(e, 'strerror', None) or e}\n".encode()
            for fd in (w, 2):  # w until the child closed it, then its copy on fd 2
                try:
                    os.write(fd, msg)
                    break
                except BaseException:  # noqa: BLE001
                    pass
        finally:
            os._exit(code)
    for fd in [w, null, alive_r, *cgroup_fds]:
        os.close(fd)
    return Running(pid, r, new_pidns, shown, argv, timeout, alive_w)


def _child(root_fd, rootfs, exe, argv, ids, r, w, null, new_pidns, alive_r, alive_w, cgroup_fds,
           timeout) -> None:  # pragma: no cover
    # Not process.die_with_parent: in a new PID namespace getppid() is 0 whoever the parent is,
    # so whether the parent still lives is read from the alive pipe instead (below).
    sandbox.set_pdeathsig(sandbox.SIGKILL)
    os.close(r)
    os.close(alive_w)
    # The program option only: never loaded on the default path. Imported here, before the
    # chroot: after it, an import would look in the image.
    import resource  # noqa: F401 - used by _limit_and_drop, from sys.modules

    for fd in cgroup_fds:  # into the container's cgroups before anything can fork
        os.write(fd, b"0")
        os.close(fd)
    root_fd = _own_mount_namespace(rootfs, root_fd)
    try:  # the fds to close before exec, listed while the host's /proc is still reachable
        open_fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = None
    os.fchdir(root_fd)
    os.chroot(".")
    os.chdir("/")
    os.dup2(null, 0)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.dup2(alive_r, 3)
    os.set_inheritable(3, False)
    alive_r = 3
    keep = 4
    if isinstance(exe, int):
        os.dup2(exe, 4)  # dup2 clears close-on-exec; an ELF exec'd by fd does not need it open
        os.set_inheritable(4, False)
        exe = 4
        keep = 5
    # An fd on a host directory would be a way out of the chroot: close everything else.
    if open_fds is None:
        os.closerange(keep, os.sysconf("SC_OPEN_MAX"))
    else:
        for fd in open_fds:
            if fd >= keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
    if not new_pidns:
        os.setpgid(0, 0)
    _limit_and_drop(timeout, ids)
    sandbox.set_no_new_privs()
    # Every credential change above cleared the parent-death signal: arm it for good now, then
    # make sure the parent did not die before that (its end of the pipe would be closed).
    sandbox.set_pdeathsig(sandbox.SIGKILL)
    if readable([alive_r], 0):
        os._exit(1)
    sandbox.default_signals(sandbox.SIGPIPE, sandbox.SIGXFSZ)
    os.execve(exe, argv, {})


def _own_mount_namespace(rootfs: str, root_fd: int) -> int:  # pragma: no cover
    """In the ldconfig child: new namespaces, and its own copy of the mounts in which the
    image's /proc, /sys and /dev are covered; the rootfs fd in that copy."""
    sandbox.unshare(sandbox.CLONE_NEWNS | sandbox.CLONE_NEWNET | sandbox.CLONE_NEWIPC | sandbox.CLONE_NEWUTS
                    | sandbox.CLONE_NEWCGROUP)
    # Its own copy of the mounts, propagating nowhere: what it mounts stays with it. Mounts
    # need paths of this copy, so the rootfs is opened again (and checked to be the same).
    sandbox.mount(None, "/", None, sandbox.MS_REC | sandbox.MS_PRIVATE)
    new_root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    a, b = os.fstat(new_root), os.fstat(root_fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise OSError(1, f"{rootfs} changed under nvhook")
    os.close(root_fd)
    root_fd = new_root
    ro = sandbox.MS_RDONLY | sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC
    view = Root(root_fd)
    for name in ("proc", "sys", "dev"):  # never created: an image without them hides nothing there
        try:
            fd = view.lookup("/" + name)
        except OSError:
            continue
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                continue
            target = f"/proc/self/fd/{fd}"
            if name == "proc":
                sandbox.mount("proc", target, "proc", ro, what="/proc (ldconfig's own)")
            else:
                sandbox.mount("tmpfs", target, "tmpfs", ro, "size=4k,mode=0555", what=f"/{name} (empty)")
        finally:
            os.close(fd)
    return root_fd


def _limit_and_drop(timeout: float, ids: tuple) -> None:  # pragma: no cover
    """In the ldconfig child: resource limits, then the credentials it runs with (`ids`: the
    uid and gid; at most CAP_DAC_OVERRIDE kept, as uid 0)."""
    import resource  # already in sys.modules (_child, before the chroot): no lookup in the image

    cpu = int(timeout) + 1
    for res, limit in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, RLIMIT_AS_BYTES),
                       (resource.RLIMIT_NOFILE, RLIMIT_NOFILE_N), (resource.RLIMIT_FSIZE, RLIMIT_FSIZE_BYTES),
                       (resource.RLIMIT_NPROC, RLIMIT_NPROC_N), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (limit, limit))
    keep_caps = 1 << sandbox.CAP_DAC_OVERRIDE
    sandbox.drop_bounding_set(keep_caps)  # needs CAP_SETPCAP: first
    uid, gid = ids
    if uid or gid:
        sandbox.set_securebits(0)  # the apply child may have set NO_SETUID_FIXUP
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    caps = keep_caps if uid == 0 else 0
    sandbox.capset(caps, caps, 0)


def _wait(job: Running) -> tuple[int, bytes]:
    out = bytearray()

    def keep(data: bytes) -> None:
        if len(out) < _OUTPUT_CAP:
            out.extend(data)

    status = process.read_until_exit(job.pid, job.r, job.deadline, keep)
    if status is None:
        _kill(job.pid, job.new_pidns)
        raise HookError(f"ldconfig did not finish within {job.timeout:g} s and was killed ({job.shown} in the "
                        f"container)")
    return os.waitstatus_to_exitcode(status), bytes(out)


def _kill(pid: int, new_pidns: bool) -> None:
    """SIGKILL ldconfig and all it started, and reap it: in its own PID namespace it is pid 1
    (the kernel kills the rest with it); otherwise it made itself a group leader."""
    process.kill_and_reap(pid, group=not new_pidns)
