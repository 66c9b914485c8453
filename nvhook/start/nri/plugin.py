"""`nvhook nri`: a long-lived NRI plugin. It dials the engine's NRI socket, registers, and
answers CreateContainer with the container's GPU edits as an NRI ContainerAdjustment
(apply/nriadjust.py), decided by nvhook's own pipeline (the request rules, config, compat
decision and catalog of hook mode and CDI). No process runs per container: what must happen
inside the container's root filesystem (decide.nriwork.in_container_work) is either done by the
plugin itself at StartContainer (the loader cache and the compat libcuda choice: nristart.py,
through /proc/<pid>/root by fd, once runc has created the container and before it starts), or,
for the work it cannot do from outside (/proc/driver/nvidia masking, 32-bit libraries, links),
by nvhook's CDI createContainer hook, exactly as with a CDI spec.

The walk of a request: ttrpc.py reads the frame; base/nrimessages.py decodes the message once
into typed objects (field names: base/nrischema.py); this module's handler parses the request
rules once; nrianswer.py decides and encodes the answer (kept per container until its start);
nristart.py does the start work; nrisync.py checks existing containers.

Faults (docs/nri.md): a message that cannot be decoded, or a decision that fails, is answered
with an error for that request alone and logged; the connection and the plugin go on. A
container that asks for no GPU gets an empty adjustment before anything else is read. A start
with work runs in its own thread within a deadline, so no image holds another pod's answer.
When the engine goes away, or sends a frame that cannot be right, the plugin logs it and
reconnects (backoff up to 5 s); a bug outside any request is logged and ends the process with
status 1 for systemd to restart it. At every Synchronize it
names each running container that asked for a GPU and has no NVIDIA device node, and each
running one that got its answer but missed its StartContainer work (nrisync.py).

Speed: the warm process keeps each answer it gave, keyed by what the decision read of the
container, and serves it again only after the check every decision starts with (the inventory's
inputs, the GPU list and device nodes, read again); pods on a runtime class that injects the GPU
itself (nvhook-runtime, NVIDIA's) are left to it.
"""

from __future__ import annotations

import os
import threading
import time

from ...base import nrimessages as msgs
from ...base import protobuf as pb
from ...base.errors import HookError
from ...base.log import LEVELS, EventLog
from ...base.nrischema import EVENT_CREATE_CONTAINER, EVENT_START_CONTAINER
from ...decide.nriwork import StartWork
from . import ttrpc
from .nrianswer import AnswerBook

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"
# Runtime classes whose runtime injects the GPU itself (nvhook-runtime as `nvhook runtime
# configure` and `nvhook node install` name it; NVIDIA's runtime): their pods are left to it.
DEFAULT_RUNTIME_HANDLERS = ("nvhook", "nvidia")
DEFAULT_REQUEST_TIMEOUT_MS = 2000
# sysexits.h EX_CONFIG: `nvhook nri` could not load its config or host root (see `run`).
CONFIG_ERROR = 78
# Start work kept from a container's CreateContainer answer until its StartContainer: more
# containers than that between the two (created and never started) drop the oldest, whose start
# then decides again.
MAX_PENDING = 4096


class Plugin:
    def __init__(self, cfg: dict, root: str, *, socket_path: str = DEFAULT_SOCKET, name: str = "nvhook",
                 index: str = "10", hook_path: str = "", hook_global_args: list | None = None,
                 mask_procfs: bool = False, runtime_handlers: tuple = DEFAULT_RUNTIME_HANDLERS,
                 cdi_namespaces: tuple | None = None):
        self.cfg, self.root = cfg, root
        # Namespaces whose pods' nvidia.cdi.k8s.io annotation is honoured: the command's list,
        # else the config's.
        if cdi_namespaces is None:
            cdi_namespaces = tuple(n.strip() for n in cfg["nri"]["cdi_annotation_namespaces"].split(","))
        self.cdi_namespaces = tuple(n for n in cdi_namespaces if n)
        self.runtime = ("", "")  # the engine's name and version (Configure)
        self.runtime_handlers = frozenset(runtime_handlers)
        self.socket_path, self.name, self.index = socket_path, name, index
        self.mask_procfs = mask_procfs
        self.book = AnswerBook(cfg, root, hook_path, list(hook_global_args or []), mask_procfs)
        self.mux: ttrpc.Mux | None = None
        self.registered = False
        self.request_timeout_ms = DEFAULT_REQUEST_TIMEOUT_MS
        # Each GPU container's start work, from its CreateContainer answer, by container id.
        self.pending: dict[str, StartWork] = {}
        self.pending_lock = threading.Lock()
        # Requests being answered, less those whose thread is in a background scan (an image's
        # compat libraries, nristart.py): such a scan waits while this is above 0, so that it
        # never takes the interpreter from another container's answer.
        self.answering = 0
        self.answering_lock = threading.Lock()

    @property
    def answers(self) -> dict:
        return self.book.answers

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
            except pb.ProtobufError as e:
                # A frame of the runtime's own that is not valid protobuf (a reply to
                # RegisterPlugin, say): that connection cannot be trusted; a new one may.
                self.event("nri.disconnected", "error", socket=self.socket_path,
                           error=f"the runtime sent a malformed message: {e}")
            finally:
                self.mux.close()
                self.registered = False
            time.sleep(delay)

    def serve(self, mux: ttrpc.Mux) -> None:
        reg_stream = mux.call(RUNTIME_SERVICE, "RegisterPlugin", msgs.register_plugin(self.name, self.index),
                              timeout_s=5)
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
        if method == "StateChange":
            self.dispatch_start(mux, msg, payload)
            return ""
        self.answer(mux, msg, method, handler, payload)
        return "shutdown" if method == "Shutdown" else ""

    def dispatch_start(self, mux: ttrpc.Mux, msg: ttrpc.Message, payload: bytes) -> None:
        """A StateChange. A container with nothing of nvhook's to do at its start (no GPU, its
        runtime's, another event) is answered at once, here: the engine's round trip is all it
        costs. One with start work reads its files (within a deadline) in a thread of its own, so
        that another pod's CreateContainer or StartContainer is answered meanwhile, never held by
        this image."""
        try:
            req = msgs.state_change(payload)
            todo = self.start_todo(req)
        except Exception:  # malformed, refused or a bug: answered as any request is
            self.answer(mux, msg, "StateChange", self.on_StateChange, payload)
            return
        if todo is None:
            mux.reply(msg, b"")
            return
        threading.Thread(target=self.answer, args=(mux, msg, "StateChange", lambda _p: self.started(req, *todo),
                                                   payload), daemon=True, name=f"nri-start-{msg.stream}").start()

    def answer(self, mux: ttrpc.Mux, msg: ttrpc.Message, method: str, handler, payload: bytes) -> None:
        """Run one request's handler and send its reply: an error answers that request alone."""
        self.count_answering(1)
        try:
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
        except OSError as e:
            if threading.current_thread() is threading.main_thread() or method != "StateChange":
                raise
            # The connection went while this start ran: the engine takes the start as failed.
            self.event("nri.reply_lost", "warning", method=method, error=e.strerror or str(e))
        finally:
            self.count_answering(-1)

    def count_answering(self, n: int) -> None:
        with self.answering_lock:
            self.answering += n

    def wait_while_answering(self, deadline: float, clock) -> None:
        """A background scan's pause: while another request is being answered (until the
        scan's own deadline)."""
        while self.answering > 0 and clock() < deadline:
            time.sleep(0.0005)

    # -- the plugin service -------------------------------------------------------------

    def on_Configure(self, payload: bytes) -> bytes:
        req = msgs.configure(payload)
        self.request_timeout_ms = req.request_timeout_ms or DEFAULT_REQUEST_TIMEOUT_MS
        self.runtime = (req.runtime_name, req.runtime_version)
        self.event("nri.configured", runtime=req.runtime_name, runtime_version=req.runtime_version,
                   request_timeout_ms=req.request_timeout_ms or None)
        return msgs.configure_response((1 << (EVENT_CREATE_CONTAINER - 1)) | (1 << (EVENT_START_CONTAINER - 1)))

    def on_Synchronize(self, payload: bytes) -> bytes:
        from .nrisync import synchronize

        synchronize(self, msgs.synchronize(payload))
        return b""

    def request(self, c: msgs.Container) -> dict:
        """The container's request (decide.request.parse), once per event."""
        from ...decide import request as request_mod

        return request_mod.parse(c.env, privileged=False, mounts=c.mount_dicts(), config=self.cfg,
                                 annotations=c.annotations)

    def on_CreateContainer(self, payload: bytes) -> bytes:
        from ...apply import nriadjust

        req = msgs.create_container(payload)
        c = req.container
        try:
            r = self.request(c)
        except HookError as e:  # the request itself is bad: refused, said in nvhook's log too
            self.event("nri.refused", "error", container=c.id, container_name=c.name, pod=req.pod.name,
                       namespace=req.pod.namespace, error=e.message)
            raise
        cdi = self.cdi_devices(req.pod, c) if req.pod.annotations else []
        if r["kind"] == "skip" and not cdi:
            return b""  # no GPU: the container as the engine made it
        t0 = time.perf_counter()
        if r["kind"] == "skip" or req.pod.runtime_handler in self.runtime_handlers:
            if r["kind"] != "skip":
                self.event("nri.left_to_runtime", container=c.id, container_name=c.name,
                           runtime_handler=req.pod.runtime_handler)
            if not cdi:
                return b""
            self.event("nri.adjusted", container=c.id, container_name=c.name, cdi_devices=cdi,
                       ms=round((time.perf_counter() - t0) * 1000, 2))
            return nriadjust.create_response(cdi_adjustment(cdi))
        log = self.log()
        try:
            answer = self.book.answer(c, r, log, namespace=req.pod.namespace)
        except HookError as e:
            log.error("nri.refused", container=c.id, container_name=c.name, error=e.message)
            raise
        finally:
            log.flush()
        if answer.work is not None:
            with self.pending_lock:
                if len(self.pending) >= MAX_PENDING:
                    del self.pending[next(iter(self.pending))]
                self.pending[c.id] = answer.work
        summary = dict(answer.summary, cdi_devices=cdi) if cdi else answer.summary
        self.event("nri.adjusted", container=c.id, container_name=c.name,
                   ms=round((time.perf_counter() - t0) * 1000, 2), **summary)
        # Two encoded adjustments concatenated are one (protobuf appends repeated fields).
        return nriadjust.create_response(answer.adjust + cdi_adjustment(cdi))

    def cdi_devices(self, pod: msgs.Pod, c: msgs.Container) -> list[str]:
        """The CDI devices the pod's nvidia.cdi.k8s.io annotation names for `c`, where its
        namespace is one the operator named (decide.nriwork.annotated_cdi_devices); an engine that
        would drop them unread refuses the container instead (HookError)."""
        from ...decide import nriwork

        try:
            names, ignored = nriwork.annotated_cdi_devices(pod.annotations, c.name, pod.namespace, self.cdi_namespaces)
            if names and not nriwork.engine_applies_cdi_devices(*self.runtime):
                raise HookError(f"pod annotation {nriwork.CDI_ANNOTATION} names CDI devices ({','.join(names)}), but "
                                f"{self.runtime[0]} {self.runtime[1]} does not apply the CDI devices an NRI plugin "
                                f"names (containerd 2.1 does): upgrade containerd, or give the pod its devices "
                                f"through the device plugin")
        except HookError as e:
            self.event("nri.refused", "error", container=c.id, container_name=c.name, pod=pod.name,
                       namespace=pod.namespace, error=e.message)
            raise
        if ignored:
            self.event("nri.cdi_annotation_ignored", container=c.id, container_name=c.name, pod=pod.name,
                       namespace=pod.namespace, message=ignored)
        return names

    def on_StateChange(self, payload: bytes) -> bytes:
        """StartContainer (the only state change nvhook subscribes to; others are ignored): the
        in-container work of a GPU container whose answer left it to the plugin (nristart.py).
        The container was created (runc create: its init waits on the start, its root pivoted,
        every spec mount in place) and does not run yet. An error here fails the start, with
        nvhook's line in the engine's message: never a GPU container that starts broken."""
        req = msgs.state_change(payload)
        try:
            todo = self.start_todo(req)
        except HookError as e:  # a request that cannot be parsed (not answered by this process)
            self.event("nri.start_refused", "error", container=req.container.id, container_name=req.container.name,
                       error=e.message)
            raise
        return b"" if todo is None else self.started(req, *todo)

    def start_todo(self, req: msgs.StateChange) -> tuple[StartWork | None, dict | None] | None:
        """None where nvhook has nothing to do at this start (another event, no GPU, its
        runtime's); else the start work kept from the container's CreateContainer answer, or
        (None, its request) where this process did not answer it (it restarted since)."""
        if req.event != EVENT_START_CONTAINER:
            return None
        c = req.container
        with self.pending_lock:
            work = self.pending.pop(c.id, None)
        if work is not None:
            return work, None
        r = self.request(c)
        if r["kind"] == "skip" or req.pod.runtime_handler in self.runtime_handlers:
            return None  # no GPU, or its runtime's: nothing of nvhook's to do at the start
        return None, r

    def started(self, req: msgs.StateChange, work: StartWork | None, r: dict | None) -> bytes:
        c = req.container
        t0 = time.perf_counter()
        log = self.log()
        log.bind(container=c.id)
        try:
            if work is None:
                # Not answered by this process: the work decided again (not encoded).
                work = self.book.bound_work(c, r or self.request(c), log, req.pod.namespace)
                if work is None:
                    return b""
            if not set(work.libraries) <= c.destinations():
                # Created unadjusted (the plugin was down or too slow at its creation): no GPU
                # of nvhook's to finish; Synchronize names it.
                log.warning("nri.start_not_adjusted", container=c.id, container_name=c.name,
                            message="this container did not get nvhook's answer at its creation; nothing done "
                                    "at its start")
                return b""
            from .nristart import start_work

            done = start_work(self, c, work, log)
        except HookError as e:
            log.error("nri.start_refused", container=c.id, container_name=c.name, error=e.message)
            raise
        finally:
            log.flush()
        self.event("nri.started", container=c.id, container_name=c.name,
                   ms=round((time.perf_counter() - t0) * 1000, 2), **done)
        return b""


def cdi_adjustment(names: list[str]) -> bytes:
    """A ContainerAdjustment naming CDI devices alone (b"" for none)."""
    from ...apply import nriadjust

    if not names:
        return b""
    return nriadjust.adjustment({"env": [], "device_nodes": [], "cgroup_devices": []}, [], None, names)


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
                    runtime_handlers=tuple(h for h in opts.get("runtime_handlers") or DEFAULT_RUNTIME_HANDLERS if h),
                    cdi_namespaces=tuple(opts["cdi_namespaces"]) if opts.get("cdi_namespaces") else None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    plugin.event("nri.start", socket=plugin.socket_path, plugin=f"{plugin.index}-{plugin.name}", pid=os.getpid(),
                 mask_procfs=plugin.mask_procfs, runtime_handlers=sorted(plugin.runtime_handlers),
                 cdi_annotation_namespaces=list(plugin.cdi_namespaces))
    plugin.warm()
    try:
        plugin.serve_forever()
    except KeyboardInterrupt:
        pass
    except Exception as e:  # a bug outside any one request: said, and exit for systemd to restart it
        import traceback

        plugin.event("nri.crashed", "error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        sys.stderr.write(f"nvhook nri: internal error, exiting for a restart: {type(e).__name__}: {e}\n")
        return 1
    return 0



