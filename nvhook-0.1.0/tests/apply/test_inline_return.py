"""What the hook's own process is left with after its in-process apply step (nvhook.apply.
_apply_here): the step enters the container's mount namespace and changes credentials there,
and the hook goes on to write its log by path. Each test fails on the code before the return
restored that piece of state. Run in forked processes (hostfix.in_fork)."""

from __future__ import annotations

import ctypes
import os
import signal
import time

from hostfix import in_fork
from test_apply_units import _plan, _tmpfs_plan

from nvhook.apply import apply_plan
from nvhook.base import sandbox
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog

CLONE_NEWUSER = 0x10000000


def _securebits() -> int:
    return ctypes.CDLL(None, use_errno=True).prctl(27, 0, 0, 0, 0)  # PR_GET_SECUREBITS


def _fs_ids() -> tuple[int, int]:
    """(fsuid, fsgid) as the kernel reports them: the 4th of the Uid: and Gid: lines."""
    with open("/proc/self/status") as f:
        lines = dict(line.split(":", 1) for line in f)
    return int(lines["Uid"].split()[3]), int(lines["Gid"].split()[3])


def _userns_holder() -> int:
    """A process in a user namespace whose root is host uid/gid 100000, and a mount namespace
    of its own owned by it: a user-namespaced container's stand-in. Its pid."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            sandbox.unshare(CLONE_NEWUSER | sandbox.CLONE_NEWNS)
            os.write(ready_w, b"x")
            os.read(go_r, 1)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write("0 100000 65536\n")
    os.write(go_w, b"x")
    os.close(go_w)
    return pid


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_user_namespaced_container_leaves_no_securebits(tmp_path):
    """The step sets SECBIT_NO_SETUID_FIXUP when the container's root is not host uid 0 (so
    that files it creates as that uid keep root's capabilities); a forked worker took it to its
    grave, the hook's own process must drop it again."""
    holder = _userns_holder()
    try:
        rootfs = tmp_path / "rootfs"
        rootfs.mkdir()

        def go() -> dict:
            before = _securebits()
            apply_plan(_plan(pid=holder, rootfs=str(rootfs)), EventLog(), inline=True)
            return {"before": before, "after": _securebits()}

        out = in_fork(go)
        assert out == {"before": 0, "after": 0}
    finally:
        _stop(holder)


def test_alarm_inside_a_credential_change_leaves_no_container_ids(tmp_path, monkeypatch):
    """The time limit (SIGALRM, whose handler raises) arriving between setfsgid and setfsuid,
    while the step creates a directory as the container's root: the change's undo never runs.
    The hook must not go on (to its log file) with the container root's group as fsgid."""
    holder = _userns_holder()
    try:
        rootfs = tmp_path / "rootfs"
        rootfs.mkdir()  # /x is created, as the container's root: the credential change
        plan = _plan(pid=holder, rootfs=str(rootfs))
        plan["mounts"] = [{"kind": "tmpfs", "target": "/x", "options": ["nosuid", "nodev", "mode=755"]}]
        real = sandbox._setfsgid
        fired = []

        def setfsgid(gid):
            previous = real(gid)
            if gid == 100000 and not fired:
                fired.append(gid)
                os.kill(os.getpid(), signal.SIGALRM)  # the limit, reached right here
            return previous

        monkeypatch.setattr(sandbox, "_setfsgid", setfsgid)

        def go() -> dict:
            before = _fs_ids()
            try:
                apply_plan(plan, EventLog(), inline=True)
                error = None
            except HookError as e:
                error = e.message
            return {"error": error, "before": list(before), "after": list(_fs_ids())}

        out = in_fork(go)
        assert out["error"] is not None and out["error"].startswith("nvhook's apply step did not finish within")
        assert out["before"] == [0, 0] and out["after"] == [0, 0], out
    finally:
        _stop(holder)


def test_alarm_while_a_device_node_is_made_leaves_the_umask(holder, tmp_path, monkeypatch):
    """A device node is made under umask 0 (its exact mode, no chmod by name); the time limit
    arriving just after the umask call, before the step's own restore is armed, left the
    hook with umask 0."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    plan = _plan(pid=holder.pid, rootfs=str(rootfs))
    plan["mounts"] = [{"kind": "device", "source": "/dev/null", "target": "/dev/nvidia0", "options": ["nosuid"],
                       "node": {"major": 1, "minor": 3, "mode": 0o666, "uid": 0, "gid": 0}}]
    real = os.umask

    def umask(mask):
        previous = real(mask)
        if mask == 0:
            os.kill(os.getpid(), signal.SIGALRM)  # the limit, reached right here
        return previous

    def go() -> dict:
        real(0o027)
        monkeypatch.setattr(os, "umask", umask)
        try:
            apply_plan(plan, EventLog(), inline=True)
            error = None
        except HookError as e:
            error = e.message
        monkeypatch.undo()
        return {"error": error, "umask": real(0o022)}

    out = in_fork(go)
    assert out["error"] is not None and out["error"].startswith("nvhook's apply step did not finish within")
    assert out["umask"] == 0o027, oct(out["umask"])


def test_no_room_for_the_kill_timer_still_applies(holder, tmp_path):
    """The SIGKILL timer behind the alarm needs a queued-signal slot, counted per user: a
    container whose root is host root can use them all up. Its absence must not refuse the
    start (the alarm remains)."""
    import resource

    _, plan = _tmpfs_plan(tmp_path, holder.pid)

    def go() -> dict:
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, 0))
        try:
            return {"mounts": apply_plan(plan, EventLog(), inline=True)["mounts"], "error": None}
        except HookError as e:
            return {"error": e.message}

    assert in_fork(go) == {"mounts": 1, "error": None}


def test_chrooted_hook_keeps_its_root(holder, tmp_path):
    """setns(CLONE_NEWNS) sets the caller's root to the namespace's: a hook started in a
    chroot would, after the return, resolve its log path (and any module imported later)
    outside it. The apply step here fails (the rootfs seen from the chroot is not the one in
    the container's namespace), as it would have in a worker; the hook keeps its root."""
    from nvhook.apply import child  # noqa: F401 - loaded here: the fork's imports would look in the chroot

    newroot = tmp_path / "newroot"
    (newroot / "proc").mkdir(parents=True)
    (newroot / "rootfs").mkdir()

    def go() -> dict:
        sandbox.unshare(sandbox.CLONE_NEWNS)  # the bind of /proc stays in this fork
        sandbox.mount(None, "/", None, sandbox.MS_REC | sandbox.MS_PRIVATE)
        sandbox.mount("/proc", str(newroot / "proc"), None, sandbox.MS_BIND | sandbox.MS_REC)
        os.chroot(newroot)
        os.chdir("/")
        before = os.stat("/")
        try:
            apply_plan(_plan(pid=holder.pid, rootfs="/rootfs"), EventLog(), inline=True)
            error = None
        except HookError as e:
            error = e.message
        after = os.stat("/")
        return {"error": error, "same_root": (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino),
                "rootfs_here": os.path.isdir("/rootfs")}

    out = in_fork(go)
    assert "raised" not in out, out
    assert out["error"] is not None and "is not visible in the container's mount namespace" in out["error"]
    assert out["same_root"] and out["rootfs_here"], out


def test_exception_that_escapes_the_return_leaves_the_log_off(holder, tmp_path, monkeypatch):
    """Whatever ends the return half way (here a KeyboardInterrupt raised as it begins), the
    hook is still in the container's view and its caller's `finally` flushes the log: the log
    must then have nowhere to go. (A failed setns is tested in test_apply_units.)"""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    real = sandbox.setns

    def setns(fd, nstype, **kw):
        if kw.get("what") == "nvhook's own mnt":
            raise KeyboardInterrupt
        real(fd, nstype, **kw)

    monkeypatch.setattr(sandbox, "setns", setns)

    def go() -> dict:
        before = os.readlink("/proc/self/ns/mnt")
        log = EventLog("info", str(tmp_path / "log"))
        log.journal = True
        try:
            apply_plan(_plan(pid=holder.pid, rootfs=str(rootfs)), log, inline=True)
        except KeyboardInterrupt:
            pass
        return {"log_path": log.path, "journal": log.journal,
                "home": os.readlink("/proc/self/ns/mnt") == before}

    out = in_fork(go)
    assert out == {"log_path": None, "journal": False, "home": False}
