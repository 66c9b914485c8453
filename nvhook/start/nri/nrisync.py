"""Synchronize: the containers that exist already when the plugin (re)connects. Named (level
error), nothing changed in them:
- every one that asked for a GPU and has no NVIDIA device (`nri.gpu_missing`: created while
  nvhook was not answering; containerd 1.7 then creates it unadjusted);
- every running one that got nvhook's answer but not its StartContainer work (the plugin was
  down or too slow at its start: `nri.start_work_missing`), checked through its root
  (`check_start_work`, which only reads). Those checks share a bounded part of containerd's
  request timeout; the containers left when it is spent are named unchecked. One container's
  failure is logged and the others go on.
"""

from __future__ import annotations

import os
import time

from ...base.errors import HookError
from ...base.nrimessages import Container, Synchronize
from ...base.nrischema import CONTAINER_CREATED, CONTAINER_RUNNING

# The share of containerd's plugin_request_timeout that Synchronize spends checking running
# containers' start work: the rest of the containers are named unchecked, never a late answer
# that drops the plugin.
SYNC_CHECK_SHARE = 0.4


def synchronize(plugin, msg: Synchronize) -> None:
    from ...apply import ldscan
    from ...decide import request as request_mod

    pods = {p.id: p for p in msg.pods}
    missing = work_missing = checked = 0
    unchecked: list[str] = []
    t0 = time.perf_counter()
    budget = plugin.request_timeout_ms / 1000 * SYNC_CHECK_SHARE
    deadline = ldscan.clock() + budget  # for the reads of the containers' files
    for c in msg.containers:
        if c.state not in (CONTAINER_CREATED, CONTAINER_RUNNING):
            continue
        try:
            r = request_mod.parse(c.env, privileged=False, mounts=c.mount_dicts(), config=plugin.cfg,
                                  annotations=c.annotations)
        except HookError:
            continue
        if r["kind"] == "skip":
            continue
        pod = pods.get(c.pod_sandbox_id)
        if pod is not None and pod.runtime_handler in plugin.runtime_handlers:
            continue  # its runtime injected it, in config.json: the engine's spec does not show it
        where = {"container": c.id, "container_name": c.name, "pod": pod.name if pod else "",
                 "namespace": pod.namespace if pod else ""}
        if not any(d.path.startswith("/dev/nvidia") for d in c.devices):
            missing += 1
            plugin.event("nri.gpu_missing", "error", **where, devices=r["devices"],
                         message="this container asked for a GPU and has no NVIDIA device: it was created "
                                 "while nvhook's NRI plugin was not answering; delete it to have it recreated "
                                 "with its GPU")
            continue
        if c.state != CONTAINER_RUNNING:
            continue  # created, not started: its StartContainer is still to come
        if time.perf_counter() - t0 > budget:
            unchecked.append(c.id)
            continue
        found = check_start_work(plugin, c, r, where, deadline)
        checked += found is not None
        work_missing += bool(found)
    if unchecked:
        plugin.event("nri.start_work_unchecked", "warning", containers=unchecked,
                     message=f"the synchronisation's time for checking running GPU containers' start work "
                             f"({round(budget * 1000)} ms) was spent: these were not checked")
    plugin.event("nri.synchronized", containers=len(msg.containers), gpu_missing=missing,
                 start_work_checked=checked, start_work_missing=work_missing, start_work_unchecked=len(unchecked),
                 ms=round((time.perf_counter() - t0) * 1000, 2))


def check_start_work(plugin, c: Container, request: dict, where: dict, deadline: float) -> bool | None:
    """Whether running container `c` misses the work its StartContainer should have done
    (True, logged as `nri.start_work_missing`), or has it (False); None where it was not
    checked (nothing was left to its start, not nvhook's answer, not its pid, a failure).
    Only read: the container runs, its processes may be loading libraries right now, and
    some may already have loaded the host's libcuda or failed to find one; a cache written
    under them would leave it half one way, half the other, and a running container can make
    the scan slow inside the engine's timeout. The fix is a clean start (delete the pod). A
    pid that is not the container's (it exited, and the number was reused) is skipped with
    a debug event; any other failure (a compat scan past `deadline`, the end of Synchronize's
    share of the request timeout, included) is logged and Synchronize goes on."""
    log = plugin.log()
    try:
        work = plugin.book.bound_work(c, request, log, where.get("namespace", ""))
        if work is None or not work.loader_work() or not set(work.libraries) <= c.destinations():
            # Nothing left to the start but the application profile (not checked: the image's
            # layout may keep it out, a warning at the start), or not nvhook's answer
            # (gpu_missing's case).
            return None
        found = missing_work(plugin, c, work, where, log, deadline)
        if found is None:
            return None
        lost, compat = found
        if not lost:
            return False
        said = []
        if "ldcache" in lost:
            said.append("the loader cache does not list the driver's libraries (`ldconfig -p` misses "
                        "libcuda: tools that look it up there, such as Triton, fail)")
        if "compat" in lost:
            said.append("the image's forward-compat libcuda is needed on this host's GPUs but the host's "
                        "comes first (CUDA reports the driver too old)")
        log.error("nri.start_work_missing", **where, pid=c.pid, missing=lost, work=",".join(work.why),
                  compat=compat,
                  message=f"this GPU container was started without nvhook's start work (nvhook's NRI plugin "
                          f"was down or too slow at its start): {'; '.join(said)}; delete the pod to have it "
                          f"recreated with nvhook's work done at its start")
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


def missing_work(plugin, c: Container, work, where: dict, log, deadline: float) -> tuple[list[str], str | None] | None:
    """What of `work` container `c`'s root does not show (apply.nriroot.start_work_missing),
    and the compat decision where one was made; None where its root cannot be checked (a debug
    event); nothing missing where nothing could have been written at its start either
    (nri.start_read_only)."""
    from ...apply import nriroot
    from ...apply.paths import Root
    from .nristart import compat_choice

    try:
        fd, owner = nriroot.open_container_root(c.pid, c.id)
    except HookError as e:
        log.debug("nri.start_work_unchecked", **where, pid=c.pid, error=e.message)
        return None
    try:
        root = Root(fd, owner=owner)
        compat: dict = {}

        def compat_dir() -> str | None:
            if "compat" not in work.why:
                return None
            compat["decision"], d = compat_choice(plugin, c, work, fd, log, deadline)
            return d

        lost = nriroot.start_work_missing(root, work, compat_dir)
        if lost == ["ldcache"] and (nriroot.read_only(root, "/etc") or nriroot.node_etc(root, plugin.root)
                                    or nriroot.etc_is_volume(root)):
            lost = []  # nothing could be written at its start either (nri.start_read_only)
        return lost, compat.get("decision")
    finally:
        os.close(fd)
