"""nvhook.apply pieces that need no container: options, procfs rewrites, cgroup parsing,
ldconfig candidates, plan checks, event relay."""

from __future__ import annotations

import json
import os
import select
import subprocess

import pytest
from hostfix import in_fork

from nvhook.apply import _relay, apply_plan, cgroups, ldconfig
from nvhook.apply.mounts import Options, rewrite
from nvhook.base import sandbox
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog


def test_options():
    o = Options(["ro", "nosuid", "nodev", "noexec", "mode=0555", "size=1m"], "/x")
    assert o.flags == sandbox.MS_RDONLY | sandbox.MS_NOSUID | sandbox.MS_NODEV | sandbox.MS_NOEXEC
    assert o.data == "mode=0555,size=1m" and not o.copy
    o = Options(["ro", "copy", "set:ModifyDeviceFiles=0"], "/x")
    assert o.copy and o.sets == [("ModifyDeviceFiles", "0")] and o.data is None
    with pytest.raises(HookError, match="unknown mount option 'bogus' for /x"):
        Options(["bogus"], "/x")


def test_rewrite_registry():
    reg = b'Binary: ""\nModifyDeviceFiles: 1\nRmGpuComputeExecTimeout: 0\n'
    assert rewrite(reg, [("ModifyDeviceFiles", "0")]) == b'Binary: ""\nModifyDeviceFiles: 0\nRmGpuComputeExecTimeout: 0\n'
    assert rewrite(b"A: 1\n", [("ModifyDeviceFiles", "0")]) == b"A: 1\nModifyDeviceFiles: 0\n"
    assert rewrite(b"A: 1", [("A", "2")]) == b"A: 2"
    # a key that only starts like another is not touched
    assert rewrite(b"ModifyDeviceFilesX: 1\n", [("ModifyDeviceFiles", "0")]) == b"ModifyDeviceFilesX: 1\nModifyDeviceFiles: 0\n"


V1 = """\
25 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 /kubepods /sys/fs/cgroup/dev\\040ices rw - cgroup cgroup rw,devices
"""
V2 = """\
25 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""


def test_find_mounts():
    assert cgroups.find_mounts(V1) == (("/kubepods", "/sys/fs/cgroup/dev ices"), "/sys/fs/cgroup/unified")
    assert cgroups.find_mounts(V2) == (None, "/sys/fs/cgroup")


def test_rule_text():
    assert cgroups.rule_text({"type": "c", "major": 195, "minor": 255, "access": "rw"}) == "c 195:255 rw"
    assert cgroups.rule_text({"type": "c", "major": 508, "minor": "*", "access": "rwm"}) == "c 508:* rwm"
    with pytest.raises(HookError, match="invalid device cgroup rule"):
        cgroups.rule_text({"type": "x", "major": 1, "minor": 1})
    with pytest.raises(HookError, match="invalid device cgroup rule"):
        cgroups.rule_text({"type": "c", "major": 1, "minor": 1, "access": "rwz"})


def test_cgroup_mode_is_the_filesystem_at_the_cgroup_root(tmp_path):
    """The mode comes from statfs of the cgroup root, not from which lines mountinfo or
    /proc/PID/cgroup list: here a v2-looking mountinfo over a root that is not cgroup2 takes the
    v1 path, finds no devices controller in that mountinfo, and says so."""
    mi = tmp_path / "mountinfo"
    mi.write_text(V2)
    assert cgroups.cgroup_mode(str(tmp_path)) == "v1"
    assert cgroups.cgroup_mode(str(tmp_path / "missing")) == "none"
    log = EventLog()
    n = cgroups.apply_devices([{"type": "c", "major": 195, "minor": 0, "access": "rw"}], os.getpid(), log,
                              mountinfo_path=str(mi), cgroup_root=str(tmp_path))
    assert n == 0
    ev = [e for e in log.events if e["event"].startswith("cgroups.")]
    assert [e["event"] for e in ev] == ["cgroups.not_found"] and ev[0]["mode"] == "v1"
    assert ev[0]["level"] == "warning" and ev[0]["rules"] == ["c 195:0 rw"]


def _v1_devices_tree(tmp_path, allow_file=None):
    """A fake v1 devices hierarchy mounted (per the mountinfo) at tmp_path/devices, holding our
    own process's devices cgroup: the real code path, with a file we can read back."""
    with open("/proc/self/cgroup") as f:
        path = next((ln.split(":", 2)[2].strip() for ln in f if "devices" in ln.split(":")[1].split(",")), None)
    if path is None:
        pytest.skip("no cgroup v1 devices controller for this process")
    d = tmp_path / "devices" / path.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    if allow_file is None:
        (d / "devices.allow").write_text("")
    else:
        (d / "devices.allow").symlink_to(allow_file)
    mi = tmp_path / "mountinfo"
    mi.write_text(f"30 25 0:26 / {tmp_path / 'devices'} rw,nosuid - cgroup cgroup rw,devices\n")
    return d / "devices.allow", str(mi)


def test_cgroup_v1_writes_each_rule_and_logs_one_event(tmp_path):
    allow, mi = _v1_devices_tree(tmp_path)
    rules = [{"type": "c", "major": 195, "minor": m, "access": "rw"} for m in (255, 0, 1)]
    log = EventLog()
    assert cgroups.apply_devices(rules, os.getpid(), log, mountinfo_path=mi) == 3
    assert allow.read_text() == "c 195:255 rwc 195:0 rwc 195:1 rw"  # one write(2) per rule
    ev = [e for e in log.events if e["event"].startswith("cgroups.")]
    assert [e["event"] for e in ev] == ["cgroups.allowed"]
    assert ev[0]["rules"] == ["c 195:255 rw", "c 195:0 rw", "c 195:1 rw"]
    assert ev[0]["cgroup"] == str(allow.parent) and ev[0]["mode"] == "v1"


def test_cgroup_v1_write_failure_names_rule_and_count(tmp_path):
    _, mi = _v1_devices_tree(tmp_path, allow_file="/dev/full")
    log = EventLog()
    with pytest.raises(HookError, match=r"cannot allow 'c 195:0 rw' in .*devices.allow: No space left "
                                        r"on device \(0 of 2 rules written\)"):
        cgroups.apply_devices([{"type": "c", "major": 195, "minor": m} for m in (0, 1)], os.getpid(), log,
                              mountinfo_path=mi)
    assert not [e for e in log.events if e["event"] == "cgroups.allowed"]


def test_cgroup_empty_rules_reads_nothing(tmp_path):
    log = EventLog()
    assert cgroups.apply_devices([], 999999999, log, mountinfo_path=str(tmp_path / "missing")) == 0
    assert log.events == []


def test_ldconfig_candidates():
    assert ldconfig.candidates("/sbin/ldconfig") == ["/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
    assert ldconfig.candidates("@/sbin/ldconfig") == list(ldconfig.CANDIDATES)
    assert ldconfig.candidates("/usr/local/sbin/ldconfig")[:2] == ["/usr/local/sbin/ldconfig.real",
                                                                  "/usr/local/sbin/ldconfig"]


def test_container_root_ids_without_userns():
    assert ldconfig.container_root_ids(os.getpid()) == (0, 0) or os.geteuid() != 0


def _plan(**container):
    return {"container": dict({"id": "x", "pid": None, "rootfs": "/"}, **container), "mounts": [],
            "symlinks": [], "devices_cgroup": [], "ldconfig": None}


def test_dry_plan_refused():
    with pytest.raises(HookError, match="no container pid"):
        apply_plan(_plan(), EventLog())


def test_relative_rootfs_refused():
    with pytest.raises(HookError, match="absolute path"):
        apply_plan(_plan(pid=os.getpid(), rootfs="rootfs"), EventLog())


def test_pid_gone():
    p = subprocess.Popen(["true"])
    p.wait(timeout=30)
    with pytest.raises(HookError, match=f"^container process {p.pid} is gone$"):
        apply_plan(_plan(pid=p.pid), EventLog())


def test_unknown_kind_refused(tmp_path):
    plan = _plan(pid=os.getpid(), rootfs=str(tmp_path))
    plan["mounts"] = [{"kind": "weird", "source": "/x", "target": "/x", "options": []}]
    with pytest.raises(HookError, match="unknown mount kind 'weird'"):
        apply_plan(plan, EventLog())


def test_vanished_source_detected_before_fork(tmp_path):
    (tmp_path / "rootfs").mkdir()
    plan = _plan(pid=os.getpid(), rootfs=str(tmp_path / "rootfs"))
    plan["mounts"] = [{"kind": "library", "source": str(tmp_path / "libcuda.so.1"), "target": "/usr/lib/libcuda.so.1",
                       "options": ["ro"]}]
    with pytest.raises(HookError, match=f"^host library vanished: {tmp_path}/libcuda.so.1$"):
        apply_plan(plan, EventLog())


def test_relay_keeps_level_and_renames_reserved_fields():
    log = EventLog("debug")
    line = json.dumps({"event": "x.y", "level": "warning", "ts": 1.5, "fields": {"name": "n", "path": "/p"}}).encode()
    assert _relay(line, log) is None
    ev = log.events[0]
    assert ev["event"] == "x.y" and ev["level"] == "warning" and ev["ts"] == 1.5
    assert ev["name_"] == "n" and ev["path"] == "/p"
    assert _relay(b'{"done": {"mounts": 1}}', log) == {"done": {"mounts": 1}}
    assert _relay(b"garbage", log) is None and log.events[-1]["event"] == "apply.garbled"


def test_compat_library_must_be_a_regular_file_in_the_image(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr/local/cuda/compat").mkdir(parents=True)
    (tmp_path / "host-lib.so").write_text("host")
    # an image link pointing at a host file is resolved inside the rootfs: it does not exist there
    os.symlink(str(tmp_path / "host-lib.so"), root / "usr/local/cuda/compat/libcuda.so.1")
    plan = _plan(pid=os.getpid(), rootfs=str(root))
    plan["mounts"] = [{"kind": "compat", "source": f"{root}/usr/local/cuda/compat/libcuda.so.1",
                       "target": "/usr/lib/libcuda.so.1", "options": ["ro"]}]
    with pytest.raises(HookError, match="^container library vanished: /usr/local/cuda/compat/libcuda.so.1"):
        apply_plan(plan, EventLog())
    os.unlink(root / "usr/local/cuda/compat/libcuda.so.1")
    (root / "usr/local/cuda/compat/libcuda.so.1").mkdir()
    with pytest.raises(HookError, match="is not a regular file"):
        apply_plan(plan, EventLog())


@pytest.mark.skipif(os.geteuid() != 0, reason="writing a uid_map needs root")
def test_container_root_ids_in_a_user_namespace():
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            sandbox.unshare(0x10000000)  # CLONE_NEWUSER
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    # the parent's copies of the child's ends closed first: a child that could not unshare
    # (EPERM in a chroot) gives EOF here, a failure, not a read that waits for ever
    os.close(ready_w)
    os.close(done_r)
    try:
        assert os.read(ready_r, 1) == b"x", "the child could not make a user namespace"
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write("0 100000 65536\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write("0 200000 65536\n")
        assert ldconfig.container_root_ids(pid) == (100000, 200000)
    finally:
        try:
            os.write(done_w, b"x")
        except BrokenPipeError:  # the child is gone already
            pass
        os.waitpid(pid, 0)
        for fd in (ready_r, done_w):
            os.close(fd)


def test_apply_worker_killed_before_its_plan(tmp_path):
    """The forked apply worker dies (OOM killer, a stray kill) before the plan arrives: one
    clear error, no hang, nothing left to reap."""
    from nvhook.apply import start_worker

    w = start_worker()
    pid = w.pid
    os.kill(pid, 9)
    plan = _plan(pid=os.getpid(), rootfs=str(tmp_path))
    plan["mounts"] = [{"kind": "tmpfs", "source": "tmpfs", "target": "/x", "options": []}]
    with pytest.raises(HookError, match="^nvhook's apply step was killed by signal 9 before it finished$"):
        apply_plan(plan, EventLog(), worker=w)
    assert w.pid == -1 and w.ev_r == -1 and w.plan_w == -1
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(pid, os.WNOHANG)


def test_apply_worker_that_cannot_load_says_why(tmp_path, monkeypatch):
    """A broken install (a dependency of the apply step missing, as seen on a real GPU host)
    must name the import that failed, not only 'exited without a result'."""
    import sys

    from nvhook.apply import start_worker

    monkeypatch.setitem(sys.modules, "nvhook.apply.child", None)  # the import fails in the child
    w = start_worker()
    plan = _plan(pid=os.getpid(), rootfs=str(tmp_path))
    plan["mounts"] = [{"kind": "tmpfs", "source": "tmpfs", "target": "/x", "options": []}]
    with pytest.raises(HookError, match=r"^cannot load nvhook's apply step: ModuleNotFoundError: .*nvhook\.apply\.child"):
        apply_plan(plan, EventLog(), worker=w)


def test_cancelled_worker_is_reaped():
    from nvhook.apply import start_worker

    w = start_worker()
    pid = w.pid
    w.cancel()
    w.cancel()  # idempotent: never signals a reaped (maybe reused) pid
    assert not os.path.exists(f"/proc/{pid}") or "zombie" not in open(f"/proc/{pid}/status").read()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_container_exit_while_reading_its_proc_files_is_caught(tmp_path, monkeypatch):
    """nvhookd names the container process by a pidfd as well as its pid. Everything the apply
    step reads from /proc/<pid> (mount namespace, cgroups, user-namespace id maps) must belong
    to that process: the pidfd check comes after the last of those reads, so a container that
    exits (and whose pid a new process may take) while they are read is refused, not applied to
    whatever holds the pid now. Here the pidfd's process exits during the id-map read while
    another process (in its own mount namespace) holds the state's pid."""
    from nvhook.apply import child

    holder = subprocess.Popen(["unshare", "-m", "sleep", "30"])
    gone = subprocess.Popen(["sleep", "30"])
    try:
        for _ in range(100):  # unshare has exec'd sleep: the holder is in its own namespace now
            if os.readlink(f"/proc/{holder.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                break
            __import__("time").sleep(0.01)
        pidfd = os.pidfd_open(gone.pid)
        real = child.container_root_ids

        def exits_meanwhile(pid):
            os.kill(gone.pid, 9)  # from the forked child below: it cannot wait(), the pidfd says when
            p = select.poll()
            p.register(pidfd, select.POLLIN)
            assert p.poll(5000)
            return real(pid)

        monkeypatch.setattr(child, "container_root_ids", exits_meanwhile)
        rootfs = tmp_path / "rootfs"
        rootfs.mkdir()
        plan = {"container": {"pid": holder.pid, "rootfs": str(rootfs)}, "mounts": [], "symlinks": []}
        pid = os.fork()
        if pid == 0:  # run_plan may enter the holder's namespace: never in the test process itself
            code = 3
            try:
                child.run_plan(plan, EventLog("error", None), 5.0, pidfd)
            except HookError as e:
                code = 0 if f"container process {holder.pid} exited before" in e.message else 2
            except BaseException as e:  # noqa: BLE001 - any other outcome fails the test
                os.write(2, f"unexpected: {e!r}\n".encode())
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        for p in (holder, gone):
            p.kill()
            p.wait()


def test_device_rules_never_go_to_the_cgroup_of_a_pid_reused_after_the_container_exited(tmp_path):
    """The apply step's own host side (device cgroup rules, in nvhookd's request child) reads
    /proc/<pid>/cgroup too: with the container's pidfd saying its process has exited, the cgroup
    read may be that of whatever process took the pid (another container's), so no rule is
    written and the start fails. A (v1) devices hierarchy laid out in tmp_path, so that a
    rule written would be seen; the state's pid is a live process, the pidfd's one is gone."""
    allow = tmp_path / "devices" / "devices.allow"
    allow.parent.mkdir()
    allow.write_text("")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 25 0:26 / {allow.parent} rw - cgroup cgroup rw,devices\n")
    rules = [{"type": "c", "major": 195, "minor": 0, "access": "rw"}]
    holder = subprocess.Popen(["sleep", "30"])
    gone = subprocess.Popen(["sleep", "30"])
    try:
        pidfd = os.pidfd_open(gone.pid)
        gone.kill()
        gone.wait()
        assert cgroups.cgroup_mode(str(tmp_path)) == "v1"
        if cgroups.container_cgroup(holder.pid)[0] is None:
            pytest.skip("this host has no v1 devices controller line in /proc/<pid>/cgroup")
        with pytest.raises(HookError, match=f"container process {holder.pid} exited before its device access"):
            cgroups.apply_devices(rules, holder.pid, EventLog(), mountinfo_path=str(mountinfo),
                                  cgroup_root=str(tmp_path), pidfd=pidfd)
        assert allow.read_text() == ""
        # the same with the process alive: the rule is written (the layout above works)
        alive = os.pidfd_open(holder.pid)
        assert cgroups.apply_devices(rules, holder.pid, EventLog(), mountinfo_path=str(mountinfo),
                                     cgroup_root=str(tmp_path), pidfd=alive) == 1
        assert allow.read_text() == "c 195:0 rw"
        os.close(alive)
        os.close(pidfd)
    finally:
        holder.kill()
        holder.wait()


def _tmpfs_plan(tmp_path, pid: int) -> tuple:
    """(rootfs, a plan for process `pid` that mounts one tmpfs on the rootfs's /x)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "x").mkdir(parents=True)
    plan = _plan(pid=pid, rootfs=str(rootfs))
    plan["mounts"] = [{"kind": "tmpfs", "target": "/x", "options": ["nosuid", "nodev", "mode=755"]}]
    return rootfs, plan


@pytest.mark.parametrize("outcome", ["applied", "failed half way"])
def test_inline_apply_comes_back_to_its_own_namespace_and_directory(holder, tmp_path, monkeypatch, outcome):
    """Hook mode applies in its own process: it enters the container's mount namespace and
    must come back (namespace and working directory) however the work ends, since it writes
    its log by path afterwards and a path opened in the container's view is the image's to
    choose. The tmpfs it mounts exists in the container's namespace only."""
    from nvhook.apply import child

    rootfs, plan = _tmpfs_plan(tmp_path, holder.pid)
    if outcome != "applied":
        def boom(*a, **k):
            raise HookError("host library vanished: /boom")
        monkeypatch.setattr(child, "apply_mounts", boom)
    work = tmp_path / "cwd"
    work.mkdir()

    def go() -> dict:
        os.chdir(work)
        before = os.readlink("/proc/self/ns/mnt")
        log = EventLog("debug", str(tmp_path / "log"))
        try:
            result = apply_plan(plan, log, inline=True)
            error = None
        except HookError as e:
            result, error = {}, e.message
        return {"before": before, "after": os.readlink("/proc/self/ns/mnt"), "cwd": os.getcwd(),
                "error": error, "mounts": result.get("mounts"), "imports": "apply_imports_ms" in result,
                "log_path": log.path}

    out = in_fork(go)
    assert "raised" not in out, out
    assert out["after"] == out["before"] and out["cwd"] == str(work)
    assert out["log_path"] == str(tmp_path / "log")
    if outcome == "applied":
        assert out["error"] is None and out["mounts"] == 1 and out["imports"]
        with open(f"/proc/{holder.pid}/mountinfo") as f:
            assert any(line.split()[4] == str(rootfs / "x") for line in f)
    else:
        assert out["error"] == "host library vanished: /boom"
    assert not os.path.ismount(rootfs / "x")  # nothing mounted in this (the host's) namespace


def test_inline_apply_that_cannot_come_back_writes_no_log(holder, tmp_path, monkeypatch):
    """If the return to its own mount namespace fails, the hook is still in the container's
    view: it must not open its log file there (the image decides what that path is), and says
    so on its one line."""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    real = sandbox.setns
    calls = []

    def refuse_the_return(fd, nstype, **kw):
        calls.append(kw.get("what"))
        if len(calls) > 1:
            raise OSError(1, "Operation not permitted")
        real(fd, nstype, **kw)

    monkeypatch.setattr(sandbox, "setns", refuse_the_return)

    def go() -> dict:
        log = EventLog("info", str(tmp_path / "log"))
        try:
            apply_plan(_plan(pid=holder.pid, rootfs=str(rootfs)), log, inline=True)
        except HookError as e:
            return {"error": e.message, "log_path": log.path, "journal": log.journal}
        return {"error": None}

    out = in_fork(go)
    assert out == {"error": "cannot return to nvhook's own mount namespace after applying: Operation not "
                            "permitted; the log file was not written", "log_path": None, "journal": False}
    assert not (tmp_path / "log").exists()


def test_inline_apply_that_overruns_is_stopped_with_its_reason(holder, tmp_path, monkeypatch):
    """Without a worker's parent to watch it, the hook's own apply step still ends at the
    limit a worker would have had (ldconfig's timeout plus the grace), with that reason, back
    in its own namespace; the alarm is cleared when the step ends."""
    import time

    from nvhook import apply
    from nvhook.apply import child

    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    monkeypatch.setattr(apply, "CHILD_GRACE_S", 1.0)
    monkeypatch.setattr(child, "apply_mounts", lambda *a, **k: time.sleep(30))

    def go() -> dict:
        before = os.readlink("/proc/self/ns/mnt")
        t = time.monotonic()
        try:
            apply_plan(_plan(pid=holder.pid, rootfs=str(rootfs)), EventLog(), ldconfig_timeout=0.5, inline=True)
            error = None
        except HookError as e:
            error = e.message
        return {"error": error, "s": time.monotonic() - t, "home": os.readlink("/proc/self/ns/mnt") == before,
                "alarm_left": __import__("signal").alarm(0)}

    out = in_fork(go)
    assert out["error"] == "nvhook's apply step did not finish within 1 s and was stopped"
    # stopped at the 1 s grace, not after the 30 s the stuck step would take (room for a loaded machine)
    assert 0.9 < out["s"] < 15, out
    assert out["home"] and out["alarm_left"] == 0


def test_apply_holds_the_umask_at_zero_and_gives_it_back(holder, tmp_path):
    """apply_mounts sets the umask to 0 once for the whole plan (a MIG container's 112 device
    nodes no longer pay two umask calls each): whatever the runtime's umask, what nvhook
    creates has the mode it states (a placeholder 0644, a directory 0755, a node the host
    node's), and the runtime's umask is back afterwards."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    lib = tmp_path / "libfake.so.1"
    lib.write_bytes(b"\x7fELF")
    plan = _plan(pid=holder.pid, rootfs=str(rootfs))
    plan["mounts"] = [
        {"kind": "library", "source": str(lib), "target": "/usr/lib/nv/libfake.so.1", "options": ["ro", "nosuid", "nodev"]},
        {"kind": "device", "source": "/dev/null", "target": "/dev/nvidia-fake", "options": ["ro", "nosuid", "noexec"],
         "node": {"major": 1, "minor": 3, "mode": 0o666, "uid": 0, "gid": 0}},
    ]

    def go() -> dict:
        os.umask(0o077)
        apply_plan(plan, EventLog(), inline=True)
        return {"umask": os.umask(0o077)}

    out = in_fork(go)
    assert out == {"umask": 0o077}
    mode = lambda p: oct(os.stat(p, follow_symlinks=False).st_mode & 0o7777)  # noqa: E731
    assert mode(rootfs / "usr/lib/nv") == "0o755" and mode(rootfs / "usr/lib/nv/libfake.so.1") == "0o644"
    assert mode(rootfs / "dev/nvidia-fake") == "0o666"
