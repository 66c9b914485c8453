"""The NRI plugin's work on a container's files, from outside it: its root opened through its
init process (checked to be that container's), what its /etc is (read-only, a volume, the
node's own), its loader files written at StartContainer, and what of that work a running
container's root does not show (Synchronize's check, which only reads). Every path is resolved
by fd inside the container's root (apply/paths.py Root).
"""

from __future__ import annotations

import os
import posixpath

from ..base.errors import HookError

# How much of /proc/<pid>/cgroup is read to check that the process is the container's.
CGROUP_READ = 1 << 16
# The largest /etc/ld.so.cache (not nvhook's) that Synchronize parses to tell whether it lists
# the driver: a CUDA devel image's is about 100 KiB, and parsing 1 MiB takes about 0.15 s here
# (16 MiB: 1.4 s, most of containerd's timeout, which one container must not spend).
MAX_CACHE_READ = 1 << 20


def open_container_root(pid: int, cid: str) -> tuple[int, tuple[int, int]]:
    """An O_PATH fd on the root directory of container `cid`'s init process `pid` (as the
    container sees it: its mounts are crossed below it), and the host ids of the container's
    root. The pid is the engine's word at StartContainer; it is checked to be that container's
    (its cgroup names the container id) and to be the same process after the root was opened
    (a pidfd, taken first, outlives a reuse of the number), and the root must not be this
    process's own (the host's)."""
    from .paths import container_root_ids

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
        pidfd, born = -1, start_time(pid, gone)
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
                elif start_time(pid, gone) != born:
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


def start_time(pid: int, gone: str) -> str:
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


def cache_tail(root, n: int) -> bytes | None:
    """The last `n` bytes of the container's /etc/ld.so.cache (a regular file: a FIFO or device
    planted there is never opened for reading), or None."""
    from .ldconf import open_regular

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


def start_work_missing(root, work, compat_dir) -> list[str]:
    """What of a running container's start work (start/nri/nristart.py) its root does not show:
    [] when nvhook's cache is there (its generator string ends the file: start_work writes it
    last, after the compat conf, so the whole work ran), or when the cache the image has (its own
    ldconfig run since, say) lists the driver's libcuda and, where the image's compat libcuda
    is needed (`compat_dir()`, the compat decision, made only when nvhook's cache is not
    there), lists that one first; else "ldcache" (the cache does not list the
    driver) and/or "compat" (the host's libcuda comes first though the image's is needed). A
    musl image: its loader path file must name a bind directory. A cache that is not nvhook's
    and is too large to parse in the time (MAX_CACHE_READ) is a HookError: not checked."""
    from ..base import ldformat
    from . import ldscan, muslpath
    from .ldconf import read_regular

    arch = muslpath.musl_arch(root)
    if arch is not None:
        raw = read_regular(root, f"/etc/ld-musl-{arch}.path", muslpath.MAX_PATH_FILE) or b""
        have = set(muslpath.entries(raw.decode("utf-8", "replace")))
        return [] if have & set(work.dirs) else ["ldcache"]
    if cache_tail(root, len(ldscan.GENERATOR)) == ldscan.GENERATOR:
        return []
    data = read_regular(root, "/etc/ld.so.cache", MAX_CACHE_READ + 1) or b""
    if len(data) > MAX_CACHE_READ:
        raise HookError(f"its /etc/ld.so.cache is not nvhook's and over {MAX_CACHE_READ >> 20} MiB: not parsed "
                        f"within the synchronisation's time; look inside with `ldconfig -p`")
    names = {posixpath.basename(p) for p in work.libraries}
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


def etc_refusal(root, host_root: str, compat_dir: str | None, log, cid: str) -> dict | None:
    """Why a created container's loader files are not written at its StartContainer (the event's
    fields), or None where they are: a container whose /etc is the node's own or read-only gets
    none (a warning), unless the image's compat libcuda is needed (`compat_dir`): only the cache
    can put it first, so the start is refused (HookError)."""
    if node_etc(root, host_root):
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
        return {"ldcache": "node-etc"}
    if read_only(root, "/etc"):
        if compat_dir is not None:
            raise HookError(f"the image's forward-compat libcuda ({compat_dir}) is needed on this host's "
                            f"GPUs, but the container's /etc is read-only, so nvhook cannot put it in the "
                            f"loader cache: allow writes to the root filesystem (readOnlyRootFilesystem: "
                            f"false) or set LD_LIBRARY_PATH={compat_dir} in the image")
        log.warning("nri.start_read_only", container=cid,
                    message="the container's /etc is read-only: no loader cache written; the driver's "
                            "libraries load from their binds, but `ldconfig -p` does not list them")
        return {"ldcache": "read-only"}
    if compat_dir is not None and node_etc(root, host_root, "/etc/ld.so.conf.d"):
        raise HookError(f"the image's forward-compat libcuda ({compat_dir}) is needed on this host's GPUs, "
                        f"but the container's /etc/ld.so.conf.d is this node's own (a hostPath volume), "
                        f"where nvhook does not write: mount it elsewhere or set "
                        f"LD_LIBRARY_PATH={compat_dir} in the image")
    return None
