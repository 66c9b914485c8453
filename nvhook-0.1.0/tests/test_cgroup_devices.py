"""Device access of real runc containers with nvhook as their prestart hook, in both cgroup modes.

"v1": runc as this host runs it (the v1 devices controller; on a host that boots cgroup v2
only, v1 cannot exist and those cases skip). "v2": runc in real cgroup v2 mode with its real
BPF device program: on a hybrid host, in a private mount namespace where cgroup2 is mounted on
/sys/fs/cgroup (runcbox.in_cgroup2); on a v2 host, as is. The v2 cases never skip: a kernel
that refuses BPF here fails them, loudly.

What the container can open tells the outcome without a GPU: ENXIO ("No such device or
address") means the cgroup allowed the open and no driver answered; EPERM means the cgroup
denied it. The fixture host's device numbers (195:*, 235:*) are unassigned on this kernel
(checked first), and 1:99 is a made-up node of the `mem` major that runc's default rules deny.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402

from nvhook.base import bpf  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

HOST_MODE = rb.host_cgroup_mode()
NO_V1 = pytest.mark.skipif(HOST_MODE == "v2", reason="a cgroup v2 host has no v1 devices controller")
MODES = [pytest.param("v1", marks=NO_V1), "v2"]
ENXIO = "No such device or address"
EPERM = "Operation not permitted"

# Nodes the image carries (in its rootfs, not runc's /dev tmpfs): other GPUs and a device
# runc's defaults deny.
PROBES = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidia2": (195, 2), "mem99": (1, 99)}

# Each node opened for reading and writing (`<>`, O_RDWR), as CUDA opens them: the cgroup checks
# the access bits, and a read-only open would pass a rule that confuses them.
OPEN_ALL = ("for d in /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools "
            "/probe/nvidia0 /probe/nvidia1 /probe/nvidia2 /probe/mem99 /dev/null; do "
            "test -e $d || { echo \"$d: absent\"; continue; }; "
            "echo \"$d: $( (: <>$d) 2>&1 && echo opened)\"; done")


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


def add_probes(rootfs: Path) -> None:
    (rootfs / "probe").mkdir()
    for name, (major, minor) in PROBES.items():
        os.mknod(rootfs / "probe" / name, 0o666 | 0o020000, os.makedev(major, minor))


def outcomes(out: str) -> dict[str, str]:
    """{node: "ENXIO" | "EPERM" | "opened" | "absent"} from OPEN_ALL's output."""
    res = {}
    for line in out.splitlines():
        node, sep, what = line.partition(": ")
        if not sep or not node.startswith("/"):
            continue
        res[node] = ("ENXIO" if ENXIO in what else "EPERM" if EPERM in what
                     else "opened" if what.endswith("opened") else "absent" if what == "absent" else what)
    return res


def start(tmp: Path, host: Path, mode: str, env: dict, script: str = OPEN_ALL, **kw) -> rb.HookRun:
    return rb.run_with_nvhook(tmp, host=host, env=env, script=script, prepare=add_probes,
                              cgroup2=(mode == "v2"), **kw)


def host_cgroup2_dir(cid: str) -> Path:
    """The container's cgroup2 directory as the host sees the (one, shared) v2 hierarchy."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split(" ")
            if post.split(" ")[0] == "cgroup2" and fields[3] == "/":
                return Path(fields[4]) / cid
    raise AssertionError("the host has no cgroup2 mount: cannot look at the container's programs")


def attached(cid: str) -> list[tuple[int, str]]:
    """(id, name) of the BPF_CGROUP_DEVICE programs on the container's cgroup, via bpf(2)."""
    import ctypes
    import struct

    fd = os.open(host_cgroup2_dir(cid), os.O_RDONLY | os.O_DIRECTORY)
    try:
        _, ids = bpf.bpf_prog_query(fd)
    finally:
        os.close(fd)
    out = []
    for i in ids:
        pfd = bpf.bpf_prog_get_fd_by_id(i)
        try:
            info = ctypes.create_string_buffer(80)
            attr = ctypes.create_string_buffer(144)
            struct.pack_into("=IIQ", attr, 0, pfd, 80, ctypes.addressof(info))
            bpf._bpf(bpf.BPF_OBJ_GET_INFO_BY_FD, attr, "program")
            out.append((i, info.raw[64:80].split(b"\0")[0].decode()))
        finally:
            os.close(pfd)
    return out


def v1_devices_list(cid: str) -> str:
    return (Path("/sys/fs/cgroup/devices") / cid / "devices.list").read_text()


class Running:
    """A container started in a thread that waits (in its script) until `release()`: its cgroup
    can be looked at from outside while it runs."""

    def __init__(self, tmp: Path, host: Path, mode: str, env: dict, script: str = OPEN_ALL, **kw):
        self.cid = f"nvhook-cg-{uuid.uuid4().hex[:10]}"
        self.rootfs: Path | None = None
        self.result: rb.HookRun | None = None
        # waits for release(); the run's own timeout ends it should the test never release it
        wait = f"{script}; touch /ready; i=0; while [ ! -e /go ] && [ $i -lt 12000 ]; do sleep 0.05; i=$((i+1)); done"

        def prepare(rootfs: Path) -> None:
            add_probes(rootfs)
            self.rootfs = rootfs

        def run() -> None:
            self.result = rb.run_with_nvhook(tmp, host=host, env=env, script=wait, prepare=prepare,
                                             cgroup2=(mode == "v2"), cid=self.cid, **kw)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def wait_ready(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.thread.is_alive():
            if self.rootfs is not None and (self.rootfs / "ready").exists():
                return True
            time.sleep(0.05)
        return False

    def release(self) -> rb.HookRun:
        if self.rootfs is not None:
            (self.rootfs / "go").touch()
        self.thread.join(90)
        assert self.result is not None, "the container thread did not finish"
        return self.result


def run_and_look(tmp: Path, host: Path, mode: str, env: dict, **kw) -> tuple[rb.HookRun, list | str]:
    """A container run to its end that its device cgroup was read from while it ran: v2 the
    programs attached (`attached`), v1 devices.list. It must have started and exited 0."""
    c = Running(tmp, host, mode, env, **kw)
    try:
        assert c.wait_ready(), "the container did not start"
        seen = attached(c.cid) if mode == "v2" else v1_devices_list(c.cid)
    finally:
        r = c.release()
    assert r.proc.returncode == 0, r.proc.stderr
    return r, seen


def record_programs(mode: str, to: Path) -> list[dict] | None:
    """v2: a hook, run just before nvhook's, that writes the ids of the programs then attached
    (the runtime's) to `to`; v1 has none."""
    return [_bpf_hook("record", str(to))] if mode == "v2" else None


# -- preconditions: fail, never skip, when this machine cannot tell allowed from denied --------

def test_fixture_device_numbers_are_unassigned_here():
    """ENXIO means "allowed" only for majors no driver owns; a fixture major that became a real
    device on this kernel would make these tests meaningless."""
    with open("/proc/devices") as f:
        text = f.read().split("Block devices:")[0]
    majors = {int(ln.split()[0]) for ln in text.splitlines()[1:] if ln.strip()}
    assert not {195, 235} & majors, f"fixture majors are real devices on this kernel: {sorted({195, 235} & majors)}"


def test_bpf_device_programs_load_here():
    """The v2 cases need bpf(BPF_PROG_LOAD) of a cgroup device program: say so plainly if this
    kernel (or a seccomp filter around the CI) refuses it."""
    from nvhook.apply import cgroups

    # as many rules as a MIG-heavy plan has (8 GPUs x 7 instances x 2 caps + GPUs + controls)
    code = cgroups.device_filter([{"type": "c", "major": 195, "minor": m, "access": "rw"} for m in range(150)], None)
    try:
        fd = cgroups._load(code)
    except OSError as e:
        pytest.fail(f"this machine cannot load BPF_PROG_TYPE_CGROUP_DEVICE programs ({e}): the cgroup v2 "
                    f"device tests cannot prove anything here")
    os.close(fd)


def test_cgroup2_mode_as_the_hook_sees_it(tmp_path):
    """The mode is the filesystem type at /sys/fs/cgroup in the hook's mount namespace: the same
    process tree reads "v2" inside the private namespace and the host's mode outside."""
    probe = [sys.executable, "-c", "from nvhook.apply import cgroups; print(cgroups.cgroup_mode())"]
    inside = subprocess.run(rb.in_cgroup2(probe), capture_output=True, text=True, timeout=60)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == "v2"
    outside = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert outside.stdout.strip() == HOST_MODE


# -- what containers can open --------------------------------------------------------------

@pytest.mark.parametrize("mode,stage", [
    pytest.param("v1", "prestart", marks=MODES[0].marks, id="v1"), pytest.param("v2", "prestart", id="v2"),
    pytest.param("v2", "createRuntime", id="v2-createRuntime")])
def test_gpu_container_opens_exactly_its_devices(tmp_path, gpu8, mode, stage):
    r = start(tmp_path, gpu8, mode, {"NVIDIA_VISIBLE_DEVICES": "0"}, stage=stage)
    # Before issue 11, a v2-mode runc on a hybrid host failed here: the hook looked for
    # /sys/fs/cgroup/devices/devices.allow because /proc/PID/cgroup also lists v1 lines.
    assert r.proc.returncode == 0, r.proc.stderr
    got = outcomes(r.stdout)
    assert got == {
        "/dev/nvidia0": "ENXIO", "/dev/nvidiactl": "ENXIO", "/dev/nvidia-uvm": "ENXIO",
        "/dev/nvidia-uvm-tools": "ENXIO", "/probe/nvidia0": "ENXIO",  # the same device, another path
        "/dev/nvidia1": "absent", "/probe/nvidia1": "EPERM", "/probe/nvidia2": "EPERM",
        "/probe/mem99": "EPERM",  # the runtime's own rules still deny what they denied
        "/dev/null": "opened",    # and still allow what they allowed
    }, r.stdout
    ev = r.event("cgroups.allowed")
    assert ev["mode"] == mode
    assert sorted(ev["rules"]) == ["c 195:0 rw", "c 195:255 rw", "c 235:0 rw", "c 235:1 rw"]
    if mode == "v2":
        assert ev["cgroup"] == f"/sys/fs/cgroup/{ev['container']}"
        old, new = ev["programs_old"], ev["programs_new"]
        assert len(old) == 1 and len(new) == 1 and set(old).isdisjoint(new), ev  # runc's one program, replaced
    assert not r.events("cgroups.not_found")


@pytest.mark.parametrize("mode", MODES)
def test_program_on_the_running_container_is_the_new_one(tmp_path, gpu8, mode):
    before = tmp_path / "programs-before.json"
    r, seen = run_and_look(tmp_path, gpu8, mode, {"NVIDIA_VISIBLE_DEVICES": "1"},
                           hooks_before=record_programs(mode, before))
    ev = r.event("cgroups.allowed")
    if mode == "v2":
        # exactly nvhook's program, the one the log names, in place of runc's, which the log names too
        assert seen == [(ev["programs_new"][0], "nvhook_devices")], (seen, ev)
        assert ev["programs_old"] == json.loads(before.read_text())
    else:
        assert "c 195:1 rw" in seen.splitlines() and "c 195:0 rw" not in seen.splitlines()
    got = outcomes(r.stdout)
    assert got["/dev/nvidia1"] == got["/probe/nvidia1"] == "ENXIO"
    assert got["/probe/nvidia0"] == "EPERM" and got["/probe/mem99"] == "EPERM"


@pytest.mark.parametrize("mode", MODES)
def test_container_without_gpu_is_untouched(tmp_path, gpu8, mode):
    # v2: the ids of the runtime's programs, recorded by a hook that runs just before nvhook
    before = tmp_path / "programs-before.json"
    r, seen = run_and_look(tmp_path, gpu8, mode, {"NVIDIA_VISIBLE_DEVICES": "void"},
                           hooks_before=record_programs(mode, before))
    assert not [e for e in r.events() if e["event"].startswith("cgroups.")]
    if mode == "v2":
        # runc's own program, alone and the same one: nvhook loaded and attached nothing
        assert [i for i, _ in seen] == json.loads(before.read_text()), seen
        assert len(seen) == 1 and seen[0][1] != "nvhook_devices", seen
    else:
        assert "195:" not in seen and "235:" not in seen
    got = outcomes(r.stdout)
    assert got["/probe/nvidia0"] == got["/probe/nvidia1"] == "EPERM"
    assert got["/probe/mem99"] == "EPERM" and got["/dev/null"] == "opened"


@pytest.mark.parametrize("mode", MODES)
def test_parallel_containers_each_get_only_their_own_gpu(tmp_path, gpu8, mode):
    # Both wait until both are running: their hooks and device programs overlap in time.
    a = Running(tmp_path / "a", gpu8, mode, {"NVIDIA_VISIBLE_DEVICES": "0"})
    b = Running(tmp_path / "b", gpu8, mode, {"NVIDIA_VISIBLE_DEVICES": "2"})
    try:
        assert a.wait_ready() and b.wait_ready(), "the containers did not start"
    finally:
        ra, rb_ = a.release(), b.release()
    assert ra.proc.returncode == 0, ra.proc.stderr
    assert rb_.proc.returncode == 0, rb_.proc.stderr
    ga, gb = outcomes(ra.stdout), outcomes(rb_.stdout)
    assert (ga["/probe/nvidia0"], ga["/probe/nvidia2"]) == ("ENXIO", "EPERM"), ra.stdout
    assert (gb["/probe/nvidia0"], gb["/probe/nvidia2"]) == ("EPERM", "ENXIO"), rb_.stdout
    for g in (ga, gb):
        assert g["/dev/nvidiactl"] == "ENXIO" and g["/probe/nvidia1"] == "EPERM" and g["/probe/mem99"] == "EPERM"
    if mode == "v2":
        ea, eb = ra.event("cgroups.allowed"), rb_.event("cgroups.allowed")
        assert ea["cgroup"] != eb["cgroup"]
        assert set(ea["programs_old"] + ea["programs_new"]).isdisjoint(eb["programs_old"] + eb["programs_new"])


def test_hook_killed_before_attach_leaves_the_runtime_program(tmp_path, gpu8):
    """nvhook SIGKILLed at the moment it would swap the program (tests/e2e/killed_hook.py, whose
    wrapper lets runc start the container anyway): the runtime's program is still the one
    attached, whole (the GPU is denied, /dev/null allowed), and nothing of nvhook's is."""
    report = tmp_path / "killed"
    wrapper = Path(rb.__file__).with_name("killed_hook.py")
    before = tmp_path / "programs-before.json"
    r, progs = run_and_look(tmp_path, gpu8, "v2", {"NVIDIA_VISIBLE_DEVICES": "0"}, hook_script=[wrapper, report],
                            hooks_before=record_programs("v2", before))
    assert report.read_text() == "-9"  # nvhook died by SIGKILL, at the attach
    assert [i for i, _ in progs] == json.loads(before.read_text()), progs  # the runtime's, untouched
    assert len(progs) == 1 and progs[0][1] != "nvhook_devices", progs
    assert not r.events("cgroups.allowed")
    got = outcomes(r.stdout)
    # (the device nodes nvhook would have made are not there: its apply worker died with it)
    assert got["/probe/nvidia0"] == "EPERM" and got["/probe/mem99"] == "EPERM" and got["/dev/null"] == "opened"


@pytest.mark.parametrize("mode", MODES)
def test_access_bits_of_each_rule_are_enforced(tmp_path, mode):
    """Rules with other access than nvhook's usual "rw", applied by nvhook.apply
    (tests/e2e/apply_hook.py): read-only, write-only and rwm each allow exactly those opens."""
    host = rb.make_host(tmp_path / "host")
    rootfs = rb.make_rootfs(tmp_path / "rootfs")
    (rootfs / rb.LIBDIR.lstrip("/")).mkdir(parents=True)
    add_probes(rootfs)
    plan = rb.plan_for(host)
    plan["devices_cgroup"] = [{"type": "c", "major": 195, "minor": 0, "access": "r"},
                              {"type": "c", "major": 195, "minor": 1, "access": "w"},
                              {"type": "c", "major": 195, "minor": 2, "access": "rwm"},
                              {"type": "b", "major": 1, "minor": 99, "access": "rw"}]  # a block rule: not 1:99 char
    script = ("for d in /probe/nvidia0 /probe/nvidia1 /probe/nvidia2 /probe/mem99; do "
              "echo \"$d r: $( (: <$d) 2>&1 && echo opened)\"; echo \"$d w: $( (: >>$d) 2>&1 && echo opened)\"; "
              "echo \"$d rw: $( (: <>$d) 2>&1 && echo opened)\"; done")
    bundle = rb.Bundle(tmp_path / "bundle", rootfs, plan, ["sh", "-c", script])
    proc = rb.runc_run(bundle, tmp_path / "runc-state", cgroup2=(mode == "v2"))
    assert proc.returncode == 0, proc.stderr
    got = outcomes(proc.stdout)
    assert got == {
        "/probe/nvidia0 r": "ENXIO", "/probe/nvidia0 w": "EPERM", "/probe/nvidia0 rw": "EPERM",
        "/probe/nvidia1 r": "EPERM", "/probe/nvidia1 w": "ENXIO", "/probe/nvidia1 rw": "EPERM",
        "/probe/nvidia2 r": "ENXIO", "/probe/nvidia2 w": "ENXIO", "/probe/nvidia2 rw": "ENXIO",
        "/probe/mem99 r": "EPERM", "/probe/mem99 w": "EPERM", "/probe/mem99 rw": "EPERM",
    }, proc.stdout
    ev = [e for e in bundle.events() if e["event"] == "cgroups.allowed"]
    assert len(ev) == 1 and ev[0]["mode"] == mode


def _bpf_hook(*args: str) -> dict:
    script = Path(rb.__file__).with_name("bpf_hook.py")
    return {"path": sys.executable, "args": [sys.executable, str(script), *args], "timeout": 30}


def test_v2_without_any_program_keeps_the_kernel_default(tmp_path, gpu8):
    """No device program on the cgroup (detached by an earlier hook): nvhook attaches one that
    allows its devices and then everything, as the kernel would without a program."""
    r, progs = run_and_look(tmp_path, gpu8, "v2", {"NVIDIA_VISIBLE_DEVICES": "0"},
                            hooks_before=[_bpf_hook("detach-all")])
    ev = r.event("cgroups.allowed")
    assert ev["programs_old"] == [] and len(ev["programs_new"]) == 1
    assert progs == [(ev["programs_new"][0], "nvhook_devices")]
    got = outcomes(r.stdout)
    assert got["/dev/nvidia0"] == got["/dev/nvidiactl"] == "ENXIO"
    assert got["/probe/nvidia1"] == got["/probe/mem99"] == "ENXIO"  # nothing restricted: the kernel's default


def test_v2_every_attached_program_allows_the_planned_devices(tmp_path, gpu8):
    """Two programs on the cgroup (runc's and one denying 195:0 and 195:2 by another tool's hook):
    the kernel ANDs them, so nvhook extends both; each keeps its own other rules."""
    r, progs = run_and_look(tmp_path, gpu8, "v2", {"NVIDIA_VISIBLE_DEVICES": "0"},
                            hooks_before=[_bpf_hook("add-deny", "195:0"), _bpf_hook("add-deny", "195:2")])
    ev = r.event("cgroups.allowed")
    assert len(ev["programs_old"]) == 3 and len(ev["programs_new"]) == 3
    assert sorted(progs) == sorted((i, "nvhook_devices") for i in ev["programs_new"])
    got = outcomes(r.stdout)
    assert got["/dev/nvidia0"] == got["/probe/nvidia0"] == got["/dev/nvidiactl"] == "ENXIO"
    assert got["/probe/nvidia2"] == "EPERM"  # denied by runc's program and by the extra one
    assert got["/probe/mem99"] == "EPERM" and got["/dev/null"] == "opened"


def test_v2_never_attaches_to_the_root_cgroup():
    """A process in the hierarchy's root cgroup (this test's own, here): a program there would
    filter the whole host, so nvhook attaches nothing and says why."""
    with open("/proc/self/cgroup") as f:
        if next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None) != "/":
            pytest.skip("this test process is not in the cgroup2 root")
    code = ("import os; from nvhook.apply import cgroups; from nvhook.base.log import EventLog; log = EventLog(); "
            "n = cgroups.apply_devices([{'type': 'c', 'major': 195, 'minor': 0, 'access': 'rw'}], os.getpid(), log); "
            "print(n, [(e['event'], e['mode']) for e in log.events])")
    before = _root_programs()
    r = subprocess.run(rb.in_cgroup2([sys.executable, "-c", code]), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 [('cgroups.root_cgroup', 'v2')]"
    assert _root_programs() == before


def _root_programs() -> list[int]:
    fd = os.open(host_cgroup2_dir(""), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpf.bpf_prog_query(fd)[1]
    finally:
        os.close(fd)


def test_a_program_the_verifier_refuses_says_why():
    """A refused load is retried with the verifier's log, whose last lines end up in the error
    (the hook's one line then says what the kernel disliked)."""
    from nvhook.apply import cgroups

    with pytest.raises(OSError) as e:
        cgroups._load(bpf.exit_insn())  # r0 never set
    assert e.value.errno == 13 and "BPF_PROG_LOAD" in str(e.value)
    assert "verifier: " in str(e.value) and "R0" in str(e.value), str(e.value)
