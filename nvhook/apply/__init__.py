"""The act layer: apply a plan (see nvhook.decide.plan) to a running container, and nothing else.

`apply_plan(plan, log, *, ldconfig_timeout=10.0, worker=None, inline=False) -> dict` runs from a prestart (or
createRuntime) hook: the container's namespaces exist, its process is `plan["container"]["pid"]`,
and the runtime has not yet done pivot_root, so the rootfs is at its host path in the container's
mount namespace too. It assumes nothing else about the runtime (runc, crun, podman's hooks dir).

Steps:

 1. Where the work is done. The hook's own process (`inline=True`, hook mode with nvhook's own
    ld.so.cache writer) does it itself: it opens what it needs, enters the container's mount
    namespace, applies, and goes back to its own mount namespace (root, working directory,
    fs ids, securebits, umask) before anything else, the log above all, touches a path; until
    that return is complete the log is off, so a return that fails or is cut short ends the
    hook without writing the log file, which would otherwise be written in the container's
    view of the filesystem. The time limit is an alarm, backed by a SIGKILL timer for waits
    only a fatal signal ends. A fork would cost more than it saves: ~4 ms of CPU per GPU start
    (copy-on-write faults in both processes, the child's exit, events passed as JSON through a
    pipe) against ~1.3 ms of imports it would overlap (bench, 1 GPU). nvhookd's request child
    (a process of its own, never the daemon) applies the same way. A configured ldconfig
    program (whose hang must not lose the events before it) uses a forked worker: `start_worker()` forks the apply child
    (`nvhook.apply.child`), which imports what applying needs while its parent decides;
    `apply_plan` starts one itself when given none and not inline. This module imports none of
    that.
 2. `apply_plan` sends the plan down the worker's pipe (inline: calls `child.run_plan` itself). The
    child (or the hook), single-threaded as setns(CLONE_NEWNS) requires, first works host side:
    it opens /proc/<pid>/ns/mnt (a missing process is the error "container process <pid> is
    gone"), the rootfs, and every mount source (O_PATH; O_RDONLY for procfs copies; device nodes
    are stat'ed), so that a source that disappeared is reported by name before anything is
    mounted ("host library vanished: <path>"); compat libraries, which come from the image, are
    resolved inside the rootfs and must be regular files; a configured host ldconfig ("@/path")
    and the container's cgroup.procs files (for a configured ldconfig program to join) are
    opened too. Then it enters the container's mount namespace, opens the rootfs there (checking
    it is the same directory and that it is not in a peer group shared with the host, where
    mounts would propagate to the host: runc and crun keep it private), applies the mounts of
    libraries, binaries, firmware and sockets, the device nodes and /proc/driver/nvidia
    (`mounts.apply_mounts`, in the plan's order), the symlinks (`symlinks.apply_symlinks`), and
    last the container's ld.so.cache: written by nvhook (`ldscan.update`, the default), or by a
    configured ldconfig program (`ldconfig.start`/`finish`), which so never runs alongside
    nvhook's own work in the rootfs. It reports over a pipe as JSON lines: its events, then one
    final status line.
 3. meanwhile (inline: before) this process writes the device cgroup rules (`cgroups.apply_devices`: host side,
    in the host's cgroup mount), then relays the child's events into `log`, reaps the child and
    raises HookError with the child's reason if it failed (or died by a signal, or overran).

Nothing is mounted in the host's namespace and nothing is created outside the rootfs; mounts
exist only in the container's mount namespace, which dies with the container, so a failure half
way leaves nothing behind on the host.

Events (besides those of `mounts`, `ldscan`, `ldconfig` and `cgroups`): `apply.done` with the
summary that `apply_plan` returns: {"mounts": n (copies included), "symlinks": n planned (as
hook.done counts them), "symlinks_changed": n of them created or replaced (the others were
already right), "devices": n cgroup rules written, "ldconfig": "written" (nvhook's own cache) | "ran" |
"missing" (a program) | "skipped", and durations in ms, flat so that callers can merge them into
their phase timings: "apply_child_imports_ms" (the child's imports, overlapping the decision;
inline: "apply_imports_ms"), "apply_prepare_ms" (host-side opens), "apply_enter_ms" (setns, rootfs
checks), "apply_mounts_ms", "apply_symlinks_ms", "apply_ldconfig_ms" (the cache step, written or
run), "apply_cgroups_ms" (this process, concurrent with a child), "apply_ms" (from the plan's
hand-over to the end)}.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # not `signal`, which imports enum
import marshal
import os
import time

from ..base import jsonfast as json
from ..base.config import ldconfig_is_builtin
from ..base.errors import HookError

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from ..decide.types import Plan

__all__ = ["Worker", "apply_plan", "start_worker"]


# How long the parent waits for the child beyond ldconfig's own limit (mounts, symlinks).
CHILD_GRACE_S = 30.0
# Inline (step 1): how long past that limit a wait only SIGKILL ends may hold the hook.
KILL_GRACE_S = 5


class Worker:
    """A forked apply child waiting for its plan (see `start_worker`)."""

    __slots__ = ("pid", "plan_w", "ev_r")

    def __init__(self, pid: int, plan_w: int, ev_r: int):
        self.pid, self.plan_w, self.ev_r = pid, plan_w, ev_r

    def send(self, job: dict) -> None:
        """Hand over the job and close the pipe; a child that already died is reported by
        `_collect` (its exit status), not here."""
        # marshal, not JSON: the same interpreter reads it, and for a MIG plan (250 mounts) it
        # is a tenth of the cost.
        data = memoryview(marshal.dumps(job))
        try:
            while data:
                data = data[os.write(self.plan_w, data):]
        except BrokenPipeError:
            pass
        finally:
            os.close(self.plan_w)
            self.plan_w = -1

    def cancel(self) -> None:
        """No plan after all (or a failure on the way): stop and reap the child, close the
        pipes. Idempotent; a child already reaped is never signalled (its pid may be reused)."""
        for fd in (self.plan_w, self.ev_r):
            if fd >= 0:
                os.close(fd)
        self.plan_w = self.ev_r = -1
        if self.pid > 0:
            from ..base import process

            process.kill_and_reap(self.pid)
            self.pid = -1


def start_worker() -> Worker:
    """Fork the apply child now; it imports its modules and waits for `Worker.send`."""
    from ..base import process  # here: the hook applying inline forks nothing

    parent = os.getpid()
    t_fork = time.perf_counter()
    try:
        pid, ((plan_r, plan_w), (ev_r, ev_w)) = process.fork_with_pipes(2)
    except OSError as e:  # EAGAIN under a pids limit, EMFILE
        raise HookError(f"cannot start nvhook's apply step: {e.strerror or e}") from None
    if pid == 0:  # pragma: no cover - the child reports over the pipe and never returns
        try:
            os.close(plan_w)
            os.close(ev_r)
            try:
                from . import child
            except BaseException as e:  # noqa: BLE001 - a broken install must say what broke
                # Without this line the parent could only say "exited without a result" (seen
                # on a real host where a dependency of the apply step was not installed).
                msg = f"cannot load nvhook's apply step: {type(e).__name__}: {e}"
                os.write(ev_w, json.dumps({"failed": msg, "code": 1}).encode() + b"\n")
                raise
            child.main(plan_r, ev_w, parent, t_fork)
        finally:
            os._exit(1)
    os.close(plan_r)
    os.close(ev_w)
    return Worker(pid, plan_w, ev_r)


def apply_plan(plan: Plan, log, *, ldconfig_timeout: float = 10.0, worker: Worker | None = None,
               pidfd: int | None = None, inline: bool = False) -> dict:
    """Apply `plan` to its container; returns the summary (see the module docstring).

    `pidfd` (nvhookd: the client's pidfd of the container process) lets the child (after its
    last read of /proc/<pid>) and the device cgroup step here (after reading /proc/<pid>/cgroup)
    check that the pid still names that process: a process that exited may have had its pid
    reused by another one.

    `inline`: apply in this process (see step 1), unless a worker is given or the plan runs an
    ldconfig program. Only for a single-threaded process that may enter the container's mount
    namespace for a while: the hook's own."""
    t0 = time.perf_counter()
    # Here, not at the top: nvhook.apply.cdispec (`cdi generate`, which applies nothing) would
    # otherwise load ctypes through cgroups -> sandbox (~5 ms).
    from . import cgroups

    try:
        container = plan.get("container") or {}
        pid = container.get("pid")
        if pid is None:
            raise HookError("the plan has no container pid (a dry-run plan cannot be applied)")
        rootfs = container.get("rootfs")
        if not isinstance(rootfs, str) or not rootfs.startswith("/"):
            raise HookError(f"the plan's container rootfs must be an absolute path, not {rootfs!r}")
        here = worker is None and inline and _builtin_cache(plan)
        if not here:
            if worker is None:
                worker = start_worker()
            worker.send({"plan": plan, "ldconfig_timeout": ldconfig_timeout, "level": getattr(log, "level", 0),
                         "pidfd": pidfd})
        # Host side: device cgroup rules, while a worker applies, or before this process leaves
        # the host's namespace to apply itself.
        t_cg = time.perf_counter()
        n_devices = cgroups.apply_devices(plan.get("devices_cgroup") or [], pid, log, pidfd=pidfd)
        cg_ms = _ms(t_cg)
        if here:
            result = _apply_here(plan, log, ldconfig_timeout, pidfd)
        else:
            assert worker is not None
            result = _collect(worker, log, ldconfig_timeout + CHILD_GRACE_S)
    finally:
        if worker is not None:
            worker.cancel()
    result["devices"] = n_devices
    # The plan's symlinks, as hook.done counts them; those that were not already right: changed
    result["symlinks_changed"] = result.get("symlinks", 0)
    result["symlinks"] = len(plan.get("symlinks") or ())
    result["apply_cgroups_ms"] = cg_ms
    result["apply_ms"] = _ms(t0)
    log.info("apply.done", **result)
    return result


def _builtin_cache(plan: Plan) -> bool:
    spec = plan.get("ldconfig")
    return not spec or ldconfig_is_builtin(spec.get("binary"))


def _apply_here(plan: Plan, log, ldconfig_timeout: float, pidfd: int | None) -> dict:
    """The child's work, done by this process (see step 1): it comes back to its own mount
    namespace, root and working directory, file system ids, securebits and umask however the
    work ends; until it has, the log writes nothing (an exception that escaped the return, a
    signal's or a bug's, would otherwise write it by path in the container's view)."""
    t = time.perf_counter()
    from ..base import sandbox
    from . import child

    imports_ms = _ms(t)
    # The watchdog a worker's parent would be: what returns to Python (a loop, an interrupted
    # wait) ends at the limit with its reason; a wait the kernel lets only a fatal signal end
    # (a FUSE request its server never answers) ends a little later by SIGKILL, as a worker's
    # parent would have killed the worker.
    limit = max(1, int(ldconfig_timeout + CHILD_GRACE_S))
    working = [True]

    def overran(signum, frame) -> None:
        if working[0]:  # never once the return has begun: it must run to its end
            raise HookError(f"nvhook's apply step did not finish within {limit} s and was stopped")

    saved = (log.path, log.journal)
    home = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # setns resets it (a chroot's) to the namespace's
    try:
        cwd: int | None = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # a working directory removed under us: "/" after the return
        cwd = None
    ids, bits = (os.geteuid(), os.getegid()), sandbox.get_securebits()
    umask = os.umask(0o022)
    os.umask(umask)
    timer = None
    previous = _signal.signal(_signal.SIGALRM, overran)
    try:
        try:
            timer = sandbox.kill_timer(limit + KILL_GRACE_S)
        except OSError:
            # EAGAIN: queued signals count per user, and a container's root may be host root:
            # it could use up RLIMIT_SIGPENDING to refuse every GPU start. The alarm remains.
            timer = None
        log.path, log.journal = None, False
        _signal.alarm(limit)
        result = child.run_plan(dict(plan), log, ldconfig_timeout, pidfd)
    except OSError as e:  # as a worker reports it
        raise HookError(f"applying the plan failed: {e.strerror or e}") from None
    finally:
        working[0] = False
        _signal.alarm(0)
        try:
            sandbox.setns(home, sandbox.CLONE_NEWNS, what="nvhook's own mnt")
            os.fchdir(root)
            os.chroot(".")
            if cwd is not None:
                os.fchdir(cwd)
            else:
                os.chdir("/")
            if sandbox.fsids() != ids:  # the container root's, left by a step the alarm cut short
                sandbox.setfsids(*ids)
            if sandbox.get_securebits() != bits:  # child._apply's for a user-namespaced container
                sandbox.set_securebits(bits)
            os.umask(umask)  # 0 while a device node is made: the alarm may cut that short too
        except OSError as e:
            # Still in the container's view: no path may be opened now, the log file's included.
            raise HookError(f"cannot return to nvhook's own mount namespace after applying: "
                            f"{os.strerror(e.errno or 0)}; the log file was not written") from None
        finally:
            if timer is not None:
                sandbox.cancel_timer(timer)
            _signal.signal(_signal.SIGALRM, previous)
            for fd in (home, root, cwd):
                if fd is not None:
                    os.close(fd)
        log.path, log.journal = saved
    result["apply_imports_ms"] = imports_ms
    return result


def _ms(t: float) -> float:
    return round((time.perf_counter() - t) * 1000, 2)


_RESERVED = ("name", "level")


def _collect(worker: Worker, log, limit_s: float) -> dict:
    """Relay the child's events into `log` until it closes the pipe, reap it, return its result."""
    buf = b""
    final = None

    def relay_lines(data: bytes) -> None:
        nonlocal buf, final
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            final = _relay(line, log) or final

    from ..base import process

    if not process.read_until_eof(worker.ev_r, process.deadline(limit_s), relay_lines):
        worker.cancel()
        raise HookError(f"nvhook's apply step did not finish within {limit_s:g} s and was killed")
    if buf:
        final = _relay(buf, log) or final
    code = process.reap(worker.pid)
    worker.pid = -1  # reaped
    if code is None:  # pragma: no cover - only this process reaps its worker
        code = 1
    if final is not None and "failed" in final:
        raise HookError(final["failed"], code=final.get("code") or 1)
    if code < 0:
        raise HookError(f"nvhook's apply step was killed by signal {-code} before it finished")
    if final is None or "done" not in final:
        raise HookError(f"nvhook's apply step exited with code {code} without reporting a result")
    return final["done"]


def _relay(line: bytes, log) -> dict | None:
    try:
        obj = json.loads(line)
    except ValueError:
        log.warning("apply.garbled", line=line[:200].decode(errors="replace"))
        return None
    if "event" not in obj:
        return obj
    fields = obj.get("fields") or {}
    for k in _RESERVED:
        if k in fields:
            fields[k + "_"] = fields.pop(k)
    log.event(obj["event"], obj.get("level", "info"), ts=obj.get("ts", time.time()), **fields)
    return None
