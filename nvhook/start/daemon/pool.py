"""nvhookd's children: the spares kept waiting in accept(), each serving one container start,
and the loop that forks, reaps and replaces them.

The children are forked in advance (SPARES waiting in accept()) and serve one start each
(serve.py), applying it themselves (as the hook does in-process: apply.apply_plan, inline; a
configured ldconfig program forks a worker), so one container's state never reaches the next
and a crash in one request does not stop the daemon. What they inherit: every module a request
runs (WARM_MODULES), the config, the inventory of the root as read from the cache file
(observe/host/cache.py: WARM, NVML facts included), out of the garbage collector's reach, and
the pages earlier requests were seen to write (pages.py), copied before they serve.

Each request re-checks that inventory against the host (the stamp: ~50 stats for one GPU, no
file read), so a driver upgrade is noticed; the child that rebuilds it writes the cache file,
which the daemon reads again once idle (and replaces its spares). Also while idle: a look for
an upgraded nvhook (the daemon then executes itself again on the same socket) and the CDI
spec's refresh (cdi.py).
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import sys
import time

from ...base import config as config_mod
from ...base.log import EventLog
from ..client import RESULT_SLACK_S
from . import pages, serve
from .listen import REEXEC_OWN_SOCKET
from .serve import GO_TIMEOUT_S, REQUEST_TIMEOUT_S, flush
from .specrefresh import CdiRefresh

MAX_CHILDREN = 64  # containers served at once; further clients wait, then run in-process
SPARES = 2  # children kept waiting for a connection
STOP_GRACE_S = 60.0  # SIGTERM: how long requests in flight may still run
CODE_CHECK_S = 1.0  # how often, when idle, nvhookd looks for an upgraded nvhook
# A request child still running this long after it took its connection is killed: past the
# longest any client waits (the request and `go`, then NVML's and ldconfig's timeouts at the
# config's maximum, 600 s each, and the client's slack), nobody needs its answer. The apply
# step ends itself at its limit (an alarm, and a SIGKILL timer for a wait only a fatal signal
# ends); the timer is best effort (no queued-signal slot left, no timer_create before glibc
# 2.34), and a kernel wait before it (a FUSE mount in the image that never answers, while
# observing) has no timer at all: without this bound such a child held one of MAX_CHILDREN for
# ever.
REQUEST_LIMIT_S = REQUEST_TIMEOUT_S + GO_TIMEOUT_S + 2 * config_mod.TIMEOUT_MAX_S + RESULT_SLACK_S + 30.0
# Every module a request's child runs, imported before the spares are
# forked: a request imports nothing (a test reads the import log of nvhookd serving GPU, MIG and
# no-GPU containers). Left out: what only a rebuild of the inventory (pyelftools, through
# observe.host.elf) or an NVML query (pynvml, in the probe's own child) loads.
WARM_MODULES = (
    "nvhook.start.hook", "nvhook.start.pipeline", "nvhook.start.client", "nvhook.start.daemon.listen",
    "nvhook.start.daemon.pages", "nvhook.start.daemon.serve",
    "nvhook.apply", "nvhook.apply.cgroups", "nvhook.apply.child", "nvhook.apply.hostnodes", "nvhook.apply.ldconf",
    "nvhook.apply.profilefile", "nvhook.decide.appprofile", "nvhook.base.userns",
    "nvhook.apply.ldconfig", "nvhook.apply.ldelf", "nvhook.apply.ldscan", "nvhook.apply.muslpath",
    "nvhook.base.bpf", "nvhook.base.sandbox",
    "nvhook.decide.compat", "nvhook.decide.cuda_releases", "nvhook.decide.edits", "nvhook.decide.nodes",
    "nvhook.decide.plan", "nvhook.decide.request", "nvhook.decide.requirements", "nvhook.decide.sources",
    "nvhook.observe.image", "nvhook.observe.oci", "nvhook.observe.host.cache", "nvhook.observe.host.discover",
    "nvhook.observe.host.inventory", "nvhook.observe.host.nvml", "nvhook.observe.host.procfs",
    "ctypes", "fcntl", "resource", "select", "traceback", "_socket",
)


class Daemon:
    """The resident process: its listening socket, its children, what they inherit."""

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
        self.cdi = CdiRefresh(cfg, self.root, log)

    def warm_up(self) -> None:
        """Import what a request runs and parse the inventory cache, once."""
        t = time.perf_counter()
        for name in WARM_MODULES:
            importlib.import_module(name)
        from ...observe.host import cache

        cache.KEEP_PARSED = True
        self.refresh()
        self.warm_up_ms = round((time.perf_counter() - t) * 1000, 2)

    def refresh(self) -> bool:
        """Re-read the inventory cache file if it changed (a child rebuilt it): done while idle.
        True when what the spares inherit changed."""
        from ...observe.host import cache

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
                    flush(self.log)
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
            if not events and self.cdi.due():
                self.cdi.check()
                flush(self.log)
        for pid in self.idle | self.busy:  # still running after the grace period
            os.kill(pid, signal.SIGKILL)
        if self.reexec is not None and not self.stopping:
            self._exec_again()
        self.log.info("daemon.stop", killed=len(self.busy))
        flush(self.log)
        return 0

    def _spawn(self) -> None:
        want = 1 if self.busy else SPARES
        while len(self.idle) < want and len(self.busy) + len(self.idle) < MAX_CHILDREN:
            try:
                pid = os.fork()
            except OSError as e:
                self.log.error("daemon.fork_failed", error=e.strerror)
                flush(self.log)
                return
            if pid == 0:  # pragma: no cover - a spare; always ends in os._exit
                code = 1
                try:
                    code = self._spare()
                except BaseException as e:  # noqa: BLE001 - a bug: one line in the log
                    self.log.error("daemon.crashed", error=f"{type(e).__name__}: {e}")
                    flush(self.log)
                finally:
                    os._exit(code)
            self.idle.add(pid)

    def _learn(self) -> None:
        """Merge the pages request children report (one message each, see _spare)."""
        try:
            data = os.read(self.learn_r, 1 << 20)  # more than LEARN_REQUESTS messages of PIPE_BUF
        except BlockingIOError:
            return
        self.lessons += pages.merge(data, self.learned)
        self.runs = pages.as_runs(sorted(self.learned))

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
        pages.prefault(self.runs)
        learn = self.lessons < pages.LEARN_REQUESTS
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
        code = serve.serve_connection(conn, t0, self.log)
        if learn:  # the client has its answer: what this request wrote, for the next spares
            msg = pages.report()
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
        flush(self.log)
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
            flush(self.log)

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
                    flush(self.log)
            elif pid in self.idle:  # a spare died before any request: a bug, or killed
                self.log.error("daemon.spare_failed", child_pid=pid, status=code)
                flush(self.log)
            self.busy.discard(pid)
            self.idle.discard(pid)
            self.retiring.discard(pid)
            self.taken_at.pop(pid, None)
            fd = self.exits.pop(pid, None)
            if fd is not None:
                self.poller.unregister(fd)
                os.close(fd)
        return served


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
