"""nvhookd: resident mode. A root daemon that keeps nvhook's modules imported and the host
inventory parsed, and serves each container start the hook forwards to it (nvhook/start/client.py;
the protocol is in base/wire.py) in a child of its own, which runs the hook's own code
(hook.run_hook: the same validation, observe, decide and apply). The children are forked in
advance (spares waiting in accept()) and serve one start each, applying it themselves (as the
hook does in-process: apply.apply_plan, inline; a configured ldconfig program forks a worker), so
one container's state never reaches the next and a crash in one request does not stop the
daemon.

What the daemon holds: every module a request runs (WARM_MODULES), its config, and the
inventory of its root as read from the cache file (observe/host/cache.py: WARM), NVML facts
included. Each request re-checks that inventory against the host (the stamp: ~50 stats for one
GPU, no file read), so a driver upgrade is noticed; the child that rebuilds it writes the
cache file, which the daemon reads again once idle (and replaces its spares). And which pages
its first request children copied on write (touched_pages): each new spare copies those while
idle (prefault), so that serving takes ~3x fewer page faults (~4 us each).

Trust: the socket is root's alone (0600, in a root-owned directory nobody else can write), and
each connection's peer must be uid 0 (SO_PEERCRED). A request is bounded (size, time, fds),
checked field by field, and must come from the daemon's own mount, pid and cgroup namespaces
(the client sends its namespace fds), with a pidfd that names the state's pid in the daemon's
pid namespace. Everything else is what the hook itself trusts: its command line, the OCI state,
the bundle it names.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import os
import select
import signal
import socket
import stat
import sys
import time

from .. import __version__
from ..base import config as config_mod
from ..base import wire
from ..base.errors import HookError
from ..base.log import LEVELS, EventLog
from .client import RESULT_SLACK_S

MAX_CHILDREN = 64  # containers served at once; further clients wait, then run in-process
SPARES = 2  # children kept waiting for a connection
REQUEST_TIMEOUT_S = 5.0  # to read a request (the client sends it at once)
GO_TIMEOUT_S = 10.0  # between ready and go (the client answers at once)
STOP_GRACE_S = 60.0  # SIGTERM: how long requests in flight may still run
CODE_CHECK_S = 1.0  # how often, when idle, nvhookd looks for an upgraded nvhook
# The CDI spec is compared with the host in full at least this often (as nvhook-cdi.timer
# does), for the changes the driver identity does not see (a library deleted by hand).
CDI_FULL_CHECK_S = 600.0
# A request child still running this long after it took its connection is killed: past the
# longest any client waits (the request and `go`, then NVML's and ldconfig's timeouts at the
# config's maximum, 600 s each, and the client's slack), nobody needs its answer. The apply
# step ends itself at its limit (an alarm, and a SIGKILL timer for a wait only a fatal signal
# ends); the timer is best effort (no queued-signal slot left, no timer_create before glibc
# 2.34), and a kernel wait before it (a FUSE mount in the image that never answers, while
# observing) has no timer at all: without this bound such a child held one of MAX_CHILDREN for
# ever.
REQUEST_LIMIT_S = REQUEST_TIMEOUT_S + GO_TIMEOUT_S + 2 * config_mod.TIMEOUT_MAX_S + RESULT_SLACK_S + 30.0
LEARN_REQUESTS = 16  # request children that report the pages they copied (see touched_pages)
LEARN_RUN_PAGES, LEARN_PAGES = 4096, 16384  # at most 16 MiB in one run, 64 MiB in all
REEXEC_OWN_SOCKET = "NVHOOKD_OWN_SOCKET"  # for the re-executed daemon: the socket path it created
NAMESPACES = ("mnt", "pid", "cgroup")
OPTION_KEYS = {"config": str, "root": str, "log_file": str, "log_level": str, "stage": str, "in_container_only": bool}
STAGES = ("prestart", "createRuntime")
# Every module a request's child runs, imported before the spares are
# forked: a request imports nothing (a test reads the import log of nvhookd serving GPU, MIG and
# no-GPU containers). Left out: what only a rebuild of the inventory (pyelftools, through
# observe.host.elf) or an NVML query (pynvml, in the probe's own child) loads.
WARM_MODULES = (
    "nvhook.start.hook", "nvhook.start.pipeline", "nvhook.start.client",
    "nvhook.apply", "nvhook.apply.cgroups", "nvhook.apply.child", "nvhook.apply.hostnodes", "nvhook.apply.ldconfig",
    "nvhook.base.bpf", "nvhook.base.sandbox",
    "nvhook.decide.compat", "nvhook.decide.cuda_releases", "nvhook.decide.edits", "nvhook.decide.nodes",
    "nvhook.decide.plan", "nvhook.decide.request", "nvhook.decide.requirements",
    "nvhook.observe.image", "nvhook.observe.oci", "nvhook.observe.host.cache", "nvhook.observe.host.discover",
    "nvhook.observe.host.inventory", "nvhook.observe.host.nvml", "nvhook.observe.host.procfs",
    "ctypes", "fcntl", "resource", "select", "traceback", "_socket",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nvhookd", description="nvhook's resident daemon (resident mode).")
    ap.add_argument("--config", help="config file (default: NVHOOK_CONFIG, else /etc/nvhook/hook.toml)")
    ap.add_argument("--root", help="host root whose inventory is kept warm (default: the config's root)")
    ap.add_argument("--socket", help="listen here when not socket-activated (default: [daemon] socket)")
    ap.add_argument("--log-file", help="the daemon's own events (default: the config's log_file)")
    ap.add_argument("--log-level", choices=tuple(LEVELS))
    args = ap.parse_args(argv)
    log = EventLog(args.log_level or "info", args.log_file)
    try:
        if os.geteuid() != 0:
            raise HookError("nvhookd must run as root (it does the hook's work: mounts, device cgroups)")
        cfg = config_mod.load(args.config, explicit=args.config is not None)
        log.level = LEVELS[args.log_level or cfg["log_level"]]
        log.path = args.log_file if args.log_file is not None else cfg["log_file"]
        listener, how, own_path = _listener(args.socket or cfg["daemon"]["socket"])
    except HookError as e:
        log.error("daemon.failed", error=e.message)
        _flush(log)
        sys.stderr.write(f"nvhookd: {e.message}\n")
        return 1
    daemon = Daemon(listener, cfg, args, log, own_path)
    daemon.warm_up()
    log.info("daemon.start", socket=how, pid=os.getpid(), nvhook_version=__version__, protocol=wire.PROTOCOL,
             root=daemon.root, cache_dir=cfg["cache_dir"] or None, inventory_warm=daemon.inventory_warm,
             rss_kb=_rss_kb(), warm_up_ms=daemon.warm_up_ms)
    _flush(log)
    return daemon.run()


def _flush(log: EventLog) -> None:
    log.flush()
    if log.write_error:
        sys.stderr.write(f"nvhookd: {log.write_error}\n")
        log.write_error = None


def _rss_kb() -> int:
    """Peak RSS of this process image (VmHWM: ru_maxrss would carry the peak of whatever
    process exec'ed nvhookd)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


# -- the listening socket ---------------------------------------------------------------------

def _listener(path: str) -> tuple[socket.socket, str, str | None]:
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
    return _own_socket(path), path, path


def _own_socket(path: str) -> socket.socket:
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


# -- the daemon -------------------------------------------------------------------------------

class Daemon:
    def __init__(self, listener: socket.socket, cfg: dict, args, log: EventLog, own_path: str | None):
        self.listener = listener
        self.own_path = own_path
        self.code = code_identity()
        self.code_checked = time.monotonic()
        self.reexec: list[str] | None = None
        self.cfg = cfg
        self.args = args
        self.log = log
        self.root = os.path.abspath(args.root or cfg["root"] or "/")
        self.idle: set[int] = set()  # spares waiting for a connection
        self.busy: set[int] = set()  # children serving one
        self.exits: dict[int, int] = {}  # busy child -> its pidfd, readable once it exited
        self.taken_at: dict[int, float] = {}  # busy child -> when it took its connection (monotonic)
        self.learned: set[int] = set()  # pages request children copied (touched_pages)
        self.lessons = 0  # how many reported them
        self.runs: list[tuple[int, int]] = []  # self.learned as (first page, count) runs
        self.poller = select.poll()
        self.retiring: set[int] = set()
        self.stopping = False
        self.inventory_warm = False
        self.warm: dict | None = None
        self.warm_up_ms = 0.0
        self.cdi_interval = float(cfg["daemon"]["cdi_refresh_interval"])
        self.cdi_checked = 0.0  # monotonic time of the last look; 0: look once idle after start
        self.driver: list | None = None  # cdispecs.driver_identity at the last spec refresh
        self.cdi_full = 0.0  # monotonic time of the last full comparison of spec and host

    def warm_up(self) -> None:
        """Import what a request runs and parse the inventory cache, once."""
        t = time.perf_counter()
        for name in WARM_MODULES:
            importlib.import_module(name)
        from ..observe.host import cache

        cache.KEEP_PARSED = True
        self.refresh()
        self.warm_up_ms = round((time.perf_counter() - t) * 1000, 2)

    def refresh(self) -> bool:
        """Re-read the inventory cache file if it changed (a child rebuilt it): done while idle.
        True when what the spares inherit changed."""
        from ..observe.host import cache

        cache.WARM = None  # this reads the file, every check made
        data = cache.load(self.cfg["cache_dir"], self.root)
        changed = data is not self.warm
        self.warm = data
        self.inventory_warm = data is not None
        cache.WARM = (self.cfg["cache_dir"], self.root, data) if data is not None else None
        # What the children inherit stays out of their garbage collector: a collection would
        # touch (and so copy) every page of it in each child.
        gc.collect()
        gc.freeze()
        return changed

    def run(self) -> int:
        """Keep SPARES children waiting in accept(), so a container start costs no fork on its
        way; each child serves one connection, tells
        us on the `taken` pipe, and exits. Closing the `life` pipe retires the idle ones.

        While a start is in flight only one spare is replaced at once (when none is left): on a
        small host, forking the next spare would take CPU from the start the
        runtime is waiting for. The rest are forked as soon as the request child exits (its
        pidfd wakes us)."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.listener.setblocking(False)  # the spares poll, then accept: one of them wins
        self.taken_r, self.taken_w = os.pipe()
        os.set_blocking(self.taken_r, False)
        self.life_r, self.life_w = os.pipe()
        self.learn_r, self.learn_w = os.pipe()
        os.set_blocking(self.learn_r, False)
        poller = self.poller
        poller.register(self.taken_r, select.POLLIN)
        poller.register(self.learn_r, select.POLLIN)
        stop_deadline = None
        while True:
            if self.stopping or self.reexec is not None:
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + STOP_GRACE_S
                    self._retire_spares()
                    if self.stopping:
                        self.listener.close()
                        self._unlink_own()
                    self.log.info("daemon.stopping", requests_in_flight=len(self.busy),
                                  reexec=self.reexec is not None)
                    _flush(self.log)
                if not self.idle and not self.busy or time.monotonic() > stop_deadline:
                    break
                poller.poll(50)
                self._taken()
                self._reap()
                continue
            self._spawn()
            events = poller.poll(500)
            self._taken()  # before reaping: a child that served and exited is known as busy
            self._learn()
            if self._reap() and self.refresh():
                self._retire_spares()  # they hold the old inventory: replaced by the next _spawn
            self._kill_overdue()
            if not events and time.monotonic() - self.code_checked > CODE_CHECK_S:
                self._check_code()
            if not events and self.cdi_interval and time.monotonic() - self.cdi_checked > self.cdi_interval:
                self._refresh_cdi()
        for pid in self.idle | self.busy:  # still running after the grace period
            os.kill(pid, signal.SIGKILL)
        if self.reexec is not None and not self.stopping:
            self._exec_again()
        self.log.info("daemon.stop", killed=len(self.busy))
        _flush(self.log)
        return 0

    def _refresh_cdi(self) -> None:
        """Keep nvhook's CDI spec ([cdi] spec) current: when the driver identity (a few reads)
        differs from the last refresh's, at the first look after start, and every
        CDI_FULL_CHECK_S, regenerate the spec if it no longer matches the host. Runs while
        idle; the spares already forked keep serving container starts meanwhile. A failure is
        logged and tried again at the next change, never fatal to the daemon."""
        self.cdi_checked = time.monotonic()
        path = self.cfg["cdi"]["spec"]
        if not path or not os.path.isfile(path):
            return  # no spec: not even the CDI code is loaded
        from . import cdispecs
        identity = cdispecs.driver_identity(self.root)
        if identity == self.driver and time.monotonic() - self.cdi_full < CDI_FULL_CHECK_S:
            return
        self.cdi_full = time.monotonic()
        t = time.perf_counter()
        try:
            r = cdispecs.refresh(self.cfg, self.root, self.log, path)
        except Exception as e:  # a spec edited into a shape nvhook never writes, too: never fatal
            self.driver = identity  # the same failure would repeat every interval
            error = e.message if isinstance(e, HookError) else f"not a spec nvhook writes ({type(e).__name__}: {e})"
            self.log.error("daemon.cdi_refresh_failed", spec=path, error=error,
                           message=f"CDI spec {path} could not be regenerated: {error}")
            _flush(self.log)
            return
        self.driver = identity
        ms = round((time.perf_counter() - t) * 1000, 2)
        if r is None:
            self.log.debug("daemon.cdi_not_ours", spec=path, reason="not written by nvhook: left alone")
        elif r["changed"]:
            self.log.info("daemon.cdi_refreshed", spec=path, devices=r["devices"], differences=r["differences"],
                             refresh_ms=ms, message=f"CDI spec {path} regenerated: the host changed "
                                                   f"({len(r['differences'])} differences; {r['devices']} devices)")
        else:
            self.log.debug("daemon.cdi_current", spec=path, devices=r["devices"], refresh_ms=ms)
        _flush(self.log)

    def _spawn(self) -> None:
        want = 1 if self.busy else SPARES
        while len(self.idle) < want and len(self.busy) + len(self.idle) < MAX_CHILDREN:
            try:
                pid = os.fork()
            except OSError as e:
                self.log.error("daemon.fork_failed", error=e.strerror)
                _flush(self.log)
                return
            if pid == 0:  # pragma: no cover - a spare; always ends in os._exit
                code = 1
                try:
                    code = self._spare()
                except BaseException as e:  # noqa: BLE001 - a bug: one line in the log
                    self.log.error("daemon.crashed", error=f"{type(e).__name__}: {e}")
                    _flush(self.log)
                finally:
                    os._exit(code)
            self.idle.add(pid)

    def _learn(self) -> None:
        """Merge the pages request children report (one message each, see _spare)."""
        try:
            data = os.read(self.learn_r, 1 << 20)  # more than LEARN_REQUESTS messages of PIPE_BUF
        except BlockingIOError:
            return
        # Only pages of our own private writable mappings, which the spares inherit: a report
        # naming anything else (a bug, a process that inherited the pipe: a request child's
        # forked ldconfig worker does) would have every later spare populate memory that is not the heap (a
        # thread's stack, a shared mapping, an address madvise's conversion truncates).
        ours = _own_private_pages()
        while len(data) >= 4:
            n = int.from_bytes(data[:4], "little")
            body, data = data[4:4 + 12 * n], data[4 + 12 * n:]
            for i in range(0, len(body) - 11, 12):
                first = int.from_bytes(body[i:i + 8], "little")
                count = int.from_bytes(body[i + 8:i + 12], "little")
                if count <= LEARN_RUN_PAGES and len(self.learned) < LEARN_PAGES:  # bounded, whatever arrives
                    for lo, hi in ours:
                        self.learned.update(range(max(lo, first), min(hi, first + count)))
            self.lessons += 1
        self.runs = _runs(sorted(self.learned))

    def _taken(self) -> None:
        """Move the spares that took a connection from idle to busy (the pipe is non-blocking)."""
        try:
            data = os.read(self.taken_r, 4096)
        except BlockingIOError:
            return
        for i in range(0, len(data) - len(data) % 4, 4):
            pid = int.from_bytes(data[i:i + 4], "little")
            if pid in self.idle:
                self.idle.discard(pid)
                self.busy.add(pid)
                self.taken_at[pid] = time.monotonic()
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue  # exited already: reaped by the next _reap
                self.exits[pid] = fd
                self.poller.register(fd, select.POLLIN)

    def _retire_spares(self) -> None:
        """Idle spares exit when the life pipe's write end closes; a new pipe for new ones."""
        os.close(self.life_w)
        os.close(self.life_r)
        self.retiring |= self.idle
        self.idle = set()
        self.life_r, self.life_w = os.pipe()

    def _spare(self) -> int:
        """In the child: wait for a connection (or retirement), then serve it."""
        gc.disable()  # a short-lived child: nothing to collect that exit does not free
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.close(self.taken_r)
        os.close(self.life_w)
        os.close(self.learn_r)
        for fd in self.exits.values():  # the daemon's watch on its other children
            os.close(fd)
        # Copy now the pages requests were seen to write, rather than one copy-on-write fault at
        # a time while serving.
        prefault(self.runs)
        learn = self.lessons < LEARN_REQUESTS
        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        poller.register(self.life_r, select.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.life_r in events:
                return 0  # retired, or the daemon is gone
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                continue  # another spare took it
            break
        t0 = time.perf_counter()
        os.write(self.taken_w, os.getpid().to_bytes(4, "little"))
        self.listener.close()
        os.close(self.life_r)
        conn.settimeout(REQUEST_TIMEOUT_S)
        peer_pid, uid = wire.peer_uid(conn)
        if uid != 0:
            why = f"peer uid {uid} is not root"
            self.log.warning("daemon.refused", peer_pid=peer_pid, peer_uid=uid, reason=why)
            _flush(self.log)
            _try_send(conn, {"refused": why, "v": wire.PROTOCOL, "nvhook": __version__})
            return 0
        code = Request(conn, peer_pid, t0, self.log).serve()
        if learn:  # the client has its answer: what this request wrote, for the next spares
            runs = touched_pages()[:340]  # one atomic pipe write (PIPE_BUF)
            msg = len(runs).to_bytes(4, "little") + b"".join(
                a.to_bytes(8, "little") + n.to_bytes(4, "little") for a, n in runs)
            try:  # never waits: a daemon that is gone or busy just learns less
                os.set_blocking(self.learn_w, False)
                os.write(self.learn_w, msg)
            except OSError:
                pass
        return code

    def _unlink_own(self) -> None:
        if self.own_path is not None:
            try:
                os.unlink(self.own_path)
            except OSError:
                pass

    def _check_code(self) -> None:
        """nvhook upgraded under a running daemon (same version or not): serve no request with
        the old code; finish those in flight and execute the new one, keeping the socket."""
        self.code_checked = time.monotonic()
        now = code_identity()
        if now != self.code:
            old = dict(self.code)
            self.reexec = sorted(p for p, ident in now if old.get(p) != ident)[:10] or ["(files removed)"]

    def _exec_again(self) -> None:
        self.log.info("daemon.reexec", reason="nvhook's code changed on disk", changed=self.reexec)
        _flush(self.log)
        fd = self.listener.fileno()
        if fd != 3:
            os.dup2(fd, 3)
        os.set_inheritable(3, True)
        os.set_blocking(3, True)
        os.environ.update({"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid()),
                           REEXEC_OWN_SOCKET: self.own_path or ""})
        os.execv(sys.executable, _own_argv())

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _kill_overdue(self) -> None:
        """SIGKILL the request children past REQUEST_LIMIT_S (a kill needs no queued-signal
        slot, and ends a wait the kernel lets only a fatal signal end); _reap logs their exit."""
        now = time.monotonic()
        for pid, t in list(self.taken_at.items()):
            if now - t <= REQUEST_LIMIT_S:
                continue
            del self.taken_at[pid]
            try:
                os.kill(pid, signal.SIGKILL)  # not reaped yet (still in taken_at): the pid is still our child's
            except ProcessLookupError:
                continue
            self.log.error("daemon.request_killed", child_pid=pid, limit_s=REQUEST_LIMIT_S,
                           message=f"nvhookd killed request child {pid}: still running {REQUEST_LIMIT_S:g} s after "
                                   f"it took its connection, past every limit its client waits for (a wait in "
                                   f"the kernel, such as a FUSE mount in the image that never answers)")
            _flush(self.log)

    def _reap(self) -> bool:
        """Reap exited children; True when a request child finished."""
        served = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            if pid in self.busy:
                served = True
                if code != 0:  # a request child that crashed: its client got no result and said so
                    self.log.error("daemon.child_failed", child_pid=pid, status=code)
                    _flush(self.log)
            elif pid in self.idle:  # a spare died before any request: a bug, or killed
                self.log.error("daemon.spare_failed", child_pid=pid, status=code)
                _flush(self.log)
            self.busy.discard(pid)
            self.idle.discard(pid)
            self.retiring.discard(pid)
            self.taken_at.pop(pid, None)
            fd = self.exits.pop(pid, None)
            if fd is not None:
                self.poller.unregister(fd)
                os.close(fd)
        return served


# madvise(2) advice: populate page tables writable, copying copy-on-write pages (Linux 5.14).
MADV_POPULATE_WRITE = 23
_LARGEST_MAPPING = 64 << 20  # bigger ones (a thread's stack, a reservation) are not the heap


def _private_writable(maps: list[bytes]) -> list[tuple[int, int]]:
    out = []
    for line in maps:
        fields = line.split()
        if len(fields) < 2 or not fields[1].startswith(b"rw") or fields[1][3:4] != b"p":
            continue
        if len(fields) > 5 and fields[5].startswith((b"[stack", b"[v")):
            continue
        start, _, end = fields[0].partition(b"-")
        lo, hi = int(start, 16), int(end, 16)
        if hi - lo <= _LARGEST_MAPPING:
            out.append((lo, hi))
    return out


def _own_private_pages() -> list[tuple[int, int]]:
    """(first page, end page) of this process's private writable mappings (touched_pages' view)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().splitlines()
    except OSError:
        return []
    return [(lo // page, hi // page) for lo, hi in _private_writable(maps)]


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) runs."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def touched_pages() -> list[tuple[int, int]]:
    """(first page, count) runs of this process's private writable pages that it no longer
    shares (/proc/self/pagemap: present and exclusively mapped): in a child of the daemon, the
    pages it copied on write since the fork, or allocated. Python writes the reference count of
    every object it touches, so serving a request copies ~1,000 pages, one fault each (~4 us)."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().splitlines()
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return runs
    try:
        for lo, hi in _private_writable(maps):
            first = lo // page
            entries = memoryview(os.pread(fd, (hi - lo) // page * 8, first * 8)).cast("Q")
            start = -1
            for i, e in enumerate(entries):
                if e >> 63 and e >> 56 & 1:
                    if start < 0:
                        start = i
                elif start >= 0:
                    runs.append((first + start, i - start))
                    start = -1
            if start >= 0:
                runs.append((first + start, len(entries) - start))
    except (OSError, ValueError, TypeError):
        return []
    finally:
        os.close(fd)
    return runs


def prefault(runs: list[tuple[int, int]]) -> None:
    """Copy the pages of `runs` now (MADV_POPULATE_WRITE); best effort: an older kernel
    (EINVAL) or a range no longer mapped is left as it is."""
    if not runs:
        return
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    for first, n in runs:
        madvise(first * page, n * page, MADV_POPULATE_WRITE)


def _own_argv() -> list:
    """The command line this interpreter was started with, its own options (-IS) included: what
    a re-exec must repeat. sys.orig_argv is 3.10's; before, the kernel's copy of it."""
    if hasattr(sys, "orig_argv"):
        return list(sys.orig_argv)
    with open("/proc/self/cmdline", "rb") as f:
        return [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]


def code_identity() -> list:
    """[(path, [size, mtime, inode])] of nvhook's Python files: an upgrade changes it."""
    out = []
    pkg = os.path.abspath(sys.modules["nvhook"].__path__[0])  # the whole package, not this module's folder
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out.append((path, [st.st_size, st.st_mtime_ns, st.st_ino]))
    return out


def _try_send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.settimeout(1.0)
        wire.send(conn, obj)
    except OSError:
        pass


class Abandoned(BaseException):
    """The client left before `go`: not an error of the hook's (so not an Exception, which
    run_hook would report as its own failure); the apply step never started."""


class Request:
    """One container start, in its own child of the daemon."""

    def __init__(self, conn: socket.socket, peer_pid: int, t0: float, log: EventLog):
        self.conn = conn
        self.peer_pid = peer_pid
        self.t0 = t0
        self.log = log  # the daemon's log: refusals; the hook's own run logs where its config says
        self.went = False  # the client said go

    def refuse(self, reason: str) -> int:
        self.log.warning("daemon.refused", peer_pid=self.peer_pid, reason=reason)
        _flush(self.log)
        _try_send(self.conn, {"refused": reason, "v": wire.PROTOCOL, "nvhook": __version__})
        return 0

    def serve(self) -> int:
        try:
            req, fds = wire.recv(self.conn, time.monotonic() + REQUEST_TIMEOUT_S, time.monotonic, want_fds=True)
        except wire.WireError as e:
            return self.refuse(f"malformed request: {e}")
        if req.get("v") != wire.PROTOCOL or req.get("nvhook") != __version__:
            return self.refuse(f"client nvhook {req.get('nvhook')!s} (protocol {req.get('v')!s}) does not match "
                               f"nvhookd {__version__} (protocol {wire.PROTOCOL})")
        problem = check_request(req, fds, self.peer_pid)
        if problem is not None:
            return self.refuse(problem)
        try:
            wire.send(self.conn, {"ready": True, "v": wire.PROTOCOL, "nvhook": __version__})
        except OSError as e:
            return self.abandoned(str(e.strerror or e))
        # Observing and deciding change nothing, so they start now, while `go` travels; the
        # gate holds the first change (the apply step) until it has come.
        try:
            return self.run_hook(req, fds[0])
        except Abandoned as e:
            return self.abandoned(str(e))

    def gate(self) -> None:
        """Return once the client said `go` (read once: the first host change and the apply
        step both pass here)."""
        if self.went:
            return
        try:
            go, _ = wire.recv(self.conn, time.monotonic() + GO_TIMEOUT_S, time.monotonic)
        except wire.WireError as e:
            raise Abandoned(str(e)) from None
        if go.get("go") is not True:
            raise Abandoned("the client sent something else than go")
        self.went = True

    def abandoned(self, why: str) -> int:
        # The client gave up waiting for `ready` and runs the hook itself: nothing applied here.
        self.log.warning("daemon.abandoned", peer_pid=self.peer_pid,
                         reason=f"the client left before go ({why}); nothing was applied")
        _flush(self.log)
        return 0

    def run_hook(self, req: dict, pidfd: int) -> int:
        from . import hook

        if req.get("env_config") is None:  # NVHOOK_CONFIG as the hook had it, not the daemon's own
            os.environ.pop("NVHOOK_CONFIG", None)
        else:
            os.environ["NVHOOK_CONFIG"] = req["env_config"]
        captured = io.StringIO()
        sys.stderr = captured
        opts = dict(req["opts"])
        opts.setdefault("stage", "prestart")
        resident = {"state": req["state"].encode(), "t0": self.t0, "pidfd": pidfd, "gate": self.gate,
                    "log": {"served_by": "nvhookd", "client_pid": self.peer_pid}}
        opts["resident"] = resident
        try:
            code = hook.run_hook(opts)
        finally:
            sys.stderr = sys.__stderr__
        try:
            wire.send(self.conn, {"code": code, "stderr": captured.getvalue()})
        except OSError:
            pass  # the client died; its runtime reports the hook's failure
        return 0


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
    from .client import state_pid

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


if __name__ == "__main__":
    sys.exit(main())
