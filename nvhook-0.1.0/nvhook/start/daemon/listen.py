"""nvhookd's way in: the listening socket, and the checks on who connects and what they send.

Trust: the socket is root's alone (0600, in a root-owned directory nobody else can write), and
each connection's peer must be uid 0 (SO_PEERCRED, checked by the child that accepts it:
request.serve_connection). A request must come from the daemon's own mount, pid and cgroup
namespaces (the client sends its namespace fds; the peer's own are compared too), with a pidfd
that names the state's pid in the daemon's pid namespace, and is checked field by field
(check_request) before anything is done for it.
"""

from __future__ import annotations

import os
import socket
import stat

from ...base.errors import HookError
from ...base.log import LEVELS
from ..client import state_pid

REEXEC_OWN_SOCKET = "NVHOOKD_OWN_SOCKET"  # for the re-executed daemon: the socket path it created
NAMESPACES = ("mnt", "pid", "cgroup")
OPTION_KEYS = {"config": str, "root": str, "log_file": str, "log_level": str, "stage": str, "in_container_only": bool}
STAGES = ("prestart", "createRuntime")


def listener(path: str) -> tuple[socket.socket, str, str | None]:
    """(socket, how it was got, the path to unlink at exit or None): systemd's (LISTEN_FDS,
    nvhookd.socket), the one an nvhookd that re-executed itself passed on, or our own at `path`."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS") == "1":
        own = os.environ.pop(REEXEC_OWN_SOCKET, None)
        for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(k, None)  # not for the children
        s = socket.socket(fileno=3)
        if s.family != socket.AF_UNIX or s.type != socket.SOCK_STREAM:
            raise HookError("the socket systemd passed is not a unix stream socket (see nvhookd.socket)")
        os.set_inheritable(3, False)
        name = s.getsockname()
        return s, f"{'reexec' if own is not None else 'systemd'}:{name}", own or None
    return own_socket(path), path, path


def own_socket(path: str) -> socket.socket:
    """Bind `path` 0600 in a directory that only root can change (created 0700 if missing)."""
    if not path.startswith("/") or len(path.encode()) >= 108:
        raise HookError(f"socket path {path!r} must be absolute and under 108 bytes")
    directory = os.path.dirname(path)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise HookError(f"cannot create the socket directory {directory}: {e.strerror}") from None
    if os.path.realpath(directory) != directory:
        raise HookError(f"socket directory {directory} is reached through a symbolic link; name its real path")
    try:
        dfd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open the socket directory {directory}: {e.strerror}") from None
    try:
        st = os.fstat(dfd)
    finally:
        os.close(dfd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise HookError(f"socket directory {directory} must be owned by root and writable by root only "
                        f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        old = None
    if old is not None:
        if not stat.S_ISSOCK(old.st_mode):
            raise HookError(f"{path} exists and is not a socket; not replacing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
            raise HookError(f"another nvhookd already listens on {path}")
        except ConnectionRefusedError:
            os.unlink(path)  # a stale socket left by a daemon that was killed
        except (BlockingIOError, TimeoutError):
            # A live daemon whose backlog is full (a burst of starts): not stale.
            raise HookError(f"another nvhookd listens on {path}, its backlog full; not replacing it") from None
        except OSError as e:
            raise HookError(f"cannot tell whether another nvhookd listens on {path} ({e.strerror or e}); "
                            f"not replacing it") from None
        finally:
            probe.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is created 0600: no moment where others could connect
    try:
        s.bind(path)
    except OSError as e:
        s.close()
        raise HookError(f"cannot bind {path}: {e.strerror}") from None
    finally:
        os.umask(umask)
    s.listen(128)
    return s


def check_request(req: dict, fds: list[int], peer_pid: int | None = None) -> str | None:
    """None, or why this request is refused (before anything is done for it). The namespaces
    are checked twice: the descriptors the client sent, and those of the process the kernel
    says connected (SO_PEERCRED's pid): descriptors prove only that the client could open
    them, not that it runs there (a root process that opened the host's, then unshared)."""
    opts = req.get("opts")
    if not isinstance(opts, dict):
        return "malformed request: opts must be an object"
    for k, v in opts.items():
        want = OPTION_KEYS.get(k)
        if want is None:
            return f"malformed request: unknown option {k!r}"
        if not isinstance(v, want) or (isinstance(v, str) and ("\0" in v or not v and k != "log_file")):
            return f"malformed request: option {k} has a bad value"
    if opts.get("log_level") is not None and opts["log_level"] not in LEVELS:
        return "malformed request: unknown log level"
    if opts.get("stage", "prestart") not in STAGES:
        return "malformed request: unknown stage"
    env_config = req.get("env_config")
    if env_config is not None and (not isinstance(env_config, str) or "\0" in env_config):
        return "malformed request: env_config must be a path"
    state = req.get("state")
    if not isinstance(state, str) or len(state) > 1 << 20:
        return "malformed request: state must be a string of at most 1 MiB"
    if len(fds) != 1 + len(NAMESPACES):
        return f"malformed request: {len(fds)} descriptors, expected {1 + len(NAMESPACES)}"
    checks: list[tuple[str, int | str]] = list(zip(NAMESPACES, fds[1:]))  # the client's word first
    if peer_pid is not None:
        checks += [(ns, f"/proc/{peer_pid}/ns/{ns}") for ns in NAMESPACES]
    for ns, theirs_at in checks:
        try:
            theirs, ours = os.stat(theirs_at), os.stat(f"/proc/self/ns/{ns}")
        except OSError as e:
            return f"cannot compare {ns} namespaces: {e.strerror}"
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return (f"the client runs in another {ns} namespace than nvhookd (run nvhookd in the host's "
                    f"namespaces, like the container runtime)")
    pid = state_pid(state.encode())
    if pid is None:  # the client runs such a state in-process, whose error says what is wrong
        return "the OCI state has no pid or no absolute bundle path"
    seen = pidfd_pid(fds[0])
    if seen != pid:
        return (f"the container process {pid} is not the process the client named (pid {seen} in nvhookd's pid "
                f"namespace)")
    return None


def pidfd_pid(fd: int) -> int | None:
    """The pid a pidfd names in our pid namespace (fdinfo's Pid: -1 once it exited), None if
    `fd` is no pidfd."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None

