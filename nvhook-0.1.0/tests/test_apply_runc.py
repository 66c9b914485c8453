"""nvhook.apply against real containers: `runc run` with tests/e2e/apply_hook.py as the
prestart hook, and the container's own process reporting what a user would see.

Each test builds its container in tmp_path (busybox rootfs, fake host driver tree, plan) and
always deletes it; every subprocess call has a time limit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")]

L = rb.LIBDIR
LIB = f"libcuda.so.{rb.DRIVER}"
NVML = f"libnvidia-ml.so.{rb.DRIVER}"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return rb.make_host(tmp_path / "host")


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    r = rb.make_rootfs(tmp_path / "rootfs")
    (r / L.lstrip("/")).mkdir(parents=True)
    return r


def run(tmp_path: Path, rootfs: Path, plan: dict, script: str, **kw):
    bundle = rb.Bundle(tmp_path / "bundle", rootfs, plan, ["sh", "-c", script], **kw)
    proc = rb.runc_run(bundle, tmp_path / "runc-state")
    return proc, bundle


def events(bundle, name: str) -> list[dict]:
    return [e for e in bundle.events() if e["event"] == name]


def no_host_mounts_under(path: Path) -> None:
    inside = [m for m in rb.host_mount_points() if m == str(path) or m.startswith(str(path) + "/")]
    assert inside == [], f"mounts appeared on the host: {inside}"


USER_VIEW = f"""
echo "TYPE:$(stat -c %F {L}/{LIB})"
touch {L}/{LIB} 2>/dev/null && echo LIB-WRITABLE || echo LIB-READONLY
echo "LINK1:$(readlink {L}/libcuda.so.1)"
echo "LINK:$(readlink {L}/libcuda.so)"
echo "NVML:$(cat {L}/{NVML})"
echo "DEV:$(stat -c '%F %t:%T' /dev/nvidia0)"
test -x /usr/bin/nvidia-smi && echo SMI-EXEC
echo "GPUS:$(ls /proc/driver/nvidia/gpus)"
echo PROC:$(ls /proc/driver/nvidia)
cat /proc/driver/nvidia/registry
echo "INFO:$(cat /proc/driver/nvidia/gpus/0000:07:00.0/information)"
touch /proc/driver/nvidia/x 2>/dev/null && echo PROC-WRITABLE || echo PROC-READONLY
echo MOUNTINFO
cat /proc/self/mountinfo
"""


def test_user_sees_driver(tmp_path, host, rootfs):
    before = rb.mount_table()
    proc, bundle = run(tmp_path, rootfs, rb.plan_for(host), USER_VIEW)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "TYPE:regular file" in out
    assert "LIB-READONLY" in out and "LIB-WRITABLE" not in out
    assert f"LINK1:{LIB}" in out
    assert "LINK:libcuda.so.1" in out
    assert "NVML:FAKE-NVML" in out
    assert "DEV:character special file c3:0" in out  # 195:0, printed in hex
    assert "SMI-EXEC" in out
    assert "GPUS:0000:07:00.0\n" in out  # the selected GPU only
    assert "0000:08:00.0" not in out
    assert "ModifyDeviceFiles: 0" in out and "ModifyDeviceFiles: 1" not in out.split("MOUNTINFO")[0]
    assert "Bus Location: \t 0000:07:00.0" in out
    assert "PROC-READONLY" in out
    for name in ("params", "registry", "version", "gpus"):
        assert name in out.split("PROC:")[1].split("\n")[0]
    mountinfo = out.split("MOUNTINFO\n")[1]
    lib_line = next(ln for ln in mountinfo.splitlines() if f" {L}/{LIB} " in ln)
    assert lib_line.split(" ")[5].split(",")[:3] == ["ro", "nosuid", "nodev"]
    # device nodes are created in the container's /dev (mknod), not bind-mounted
    assert not any(" /dev/nvidia0 " in ln for ln in mountinfo.splitlines())
    # the image's /usr/lib got placeholders, the host nothing
    assert (rootfs / L.lstrip("/") / LIB).stat().st_size == 0
    assert rb.leaked_mounts(before, tmp_path, rootfs, host) == []
    # events: the emulated /proc/driver/nvidia is explained, the summary is logged
    emulated = events(bundle, "procfs.emulated")
    assert emulated and emulated[0]["level"] == "warning"
    assert "no NVIDIA kernel module" in emulated[0]["reason"]
    done = events(bundle, "apply.done")[0]
    assert done["mounts"] == 9 and done["symlinks"] == 2 and done["devices"] == 1
    for phase in ("prepare", "enter", "mounts", "symlinks", "ldconfig", "cgroups"):
        assert isinstance(done[f"apply_{phase}_ms"], float)
    assert done["apply_ms"] >= done["apply_mounts_ms"]


def _cgroup_v1_devices() -> bool:
    return rb.host_cgroup_mode() == "v1"


def test_device_cgroup_rule(tmp_path, host, rootfs):
    proc, bundle = run(tmp_path, rootfs, rb.plan_for(host), "cat /dev/null")
    assert proc.returncode == 0, proc.stderr
    if _cgroup_v1_devices():
        assert "c 195:0 rw" in bundle.cgroup_file.read_text().splitlines()
        allow = events(bundle, "cgroups.allowed")
        assert len(allow) == 1 and allow[0]["rules"] == ["c 195:0 rw"]
        assert allow[0]["cgroup"].startswith("/")
    else:  # cgroup v2 (tests/test_cgroup_devices.py has both modes on any host)
        allow = events(bundle, "cgroups.allowed")
        assert len(allow) == 1 and allow[0]["mode"] == "v2" and allow[0]["rules"] == ["c 195:0 rw"]


def test_no_device_rules_no_cgroup_writes(tmp_path, host, rootfs):
    plan = rb.plan_for(host)
    plan["devices_cgroup"] = []
    proc, bundle = run(tmp_path, rootfs, plan, "true")
    assert proc.returncode == 0, proc.stderr
    assert "195:" not in bundle.cgroup_file.read_text()
    assert not [e for e in bundle.events() if e["event"].startswith("cgroups.")]


def test_image_file_is_shadowed_by_host(tmp_path, host, rootfs):
    (rootfs / L.lstrip("/") / NVML).write_text("IMAGE-BUNDLED-NVML\n")
    proc, bundle = run(tmp_path, rootfs, rb.plan_for(host), f"cat {L}/{NVML}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "FAKE-NVML\n"
    shadowed = events(bundle, "mount.shadowed")
    assert [e["path"] for e in shadowed] == [f"{L}/{NVML}"]
    assert (rootfs / L.lstrip("/") / NVML).read_text() == "IMAGE-BUNDLED-NVML\n"  # the image is untouched


def test_directory_where_file_expected(tmp_path, host, rootfs):
    (rootfs / L.lstrip("/") / NVML).mkdir()
    proc, _ = run(tmp_path, rootfs, rb.plan_for(host), "echo STARTED")
    assert proc.returncode != 0
    assert "STARTED" not in proc.stdout
    assert f"nvhook: cannot mount {host}{L}/{NVML} on {L}/{NVML}: the image has a directory there" in proc.stderr


def test_vanished_source_stops_container(tmp_path, host, rootfs):
    plan = rb.plan_for(host)
    gone = f"{host}{L}/libnvidia-gone.so.{rb.DRIVER}"
    plan["mounts"].insert(1, dict(plan["mounts"][0], source=gone, target=f"{L}/libnvidia-gone.so.{rb.DRIVER}"))
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode != 0
    assert "STARTED" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "nvhook:" in ln]
    assert len(lines) == 1, proc.stderr
    assert f"nvhook: host library vanished: {gone}" in lines[0]
    # host-side check: nothing was mounted or created in the image either
    assert not (rootfs / L.lstrip("/") / LIB).exists()


def test_symlinks_existing(tmp_path, host, rootfs):
    lib = rootfs / L.lstrip("/")
    os.symlink(LIB, lib / "libcuda.so.1")  # same content: fine
    os.symlink("libcuda.so.0", lib / "libcuda.so")  # different: replaced
    plan = rb.plan_for(host)
    plan["symlinks"].append({"path": f"{L}/libGLX_indirect.so.0", "target": "libGLX_nvidia.so.0"})
    (lib / "libGLX_indirect.so.0").write_text("image file")  # a file: left alone
    proc, bundle = run(tmp_path, rootfs, plan,
                       f"readlink {L}/libcuda.so.1; readlink {L}/libcuda.so; cat {L}/libGLX_indirect.so.0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{LIB}\nlibcuda.so.1\nimage file"
    assert [e["previous"] for e in events(bundle, "symlink.replaced")] == ["libcuda.so.0"]
    assert [e["path"] for e in events(bundle, "symlink.skipped")] == [f"{L}/libGLX_indirect.so.0"]
    assert not [p for p in os.listdir(lib) if "nvhook" in p]  # no temporary link left


def test_compat_library_from_the_image(tmp_path, host, rootfs):
    compat = rootfs / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.545.23.06").write_text("COMPAT-LIBCUDA\n")
    plan = rb.plan_for(host)
    plan["mounts"].append({"kind": "compat", "source": f"{rootfs}/usr/local/cuda/compat/libcuda.so.545.23.06",
                           "target": f"{L}/libcuda.so.545.23.06", "options": ["ro", "nosuid", "nodev"]})
    proc, _ = run(tmp_path, rootfs, plan, f"cat {L}/libcuda.so.545.23.06")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "COMPAT-LIBCUDA\n"


# -- hostile images --------------------------------------------------------------------------

def test_hostile_symlinks_stay_inside_rootfs(tmp_path, host, rootfs):
    hostile_lib = tmp_path / "hostile-lib"  # host dirs the image's links point at
    hostile_bin = tmp_path / "hostile-bin"
    hostile_lib.mkdir()
    hostile_bin.mkdir()
    (hostile_bin / "sentinel").write_text("host file")
    secrets = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (Path("/etc/shadow"), Path("/etc/gshadow"))
               if p.exists()}

    lib = rootfs / L.lstrip("/")
    lib.rmdir()
    os.symlink("/../../" + str(hostile_lib).lstrip("/"), lib)  # climbs above "/", then to the host dir
    shutil.rmtree(rootfs / "usr/bin")
    os.symlink(str(hostile_bin), rootfs / "usr/bin")  # absolute path of a host dir
    (rootfs / "usr/lib64").mkdir()
    os.symlink("/etc/shadow", rootfs / "usr/lib64" / NVML)  # a target file that is a link to /etc/shadow
    os.symlink("../../../../../../../../etc/gshadow", rootfs / "usr/lib64" / LIB)  # climbing, relative
    os.symlink("/../../" + str(hostile_lib).lstrip("/"), rootfs / "usr/lib64/evil")

    plan = rb.plan_for(host)
    m0 = plan["mounts"][0]
    plan["mounts"] += [
        dict(m0, source=f"{host}{L}/{NVML}", target=f"/usr/lib64/{NVML}"),
        dict(m0, target=f"/usr/lib64/{LIB}"),
    ]
    plan["symlinks"].append({"path": "/usr/lib64/evil/libcuda.so", "target": "libcuda.so.1"})
    script = (f"cat {L}/{NVML}; test -x /usr/bin/nvidia-smi && echo SMI; cat /usr/lib64/{NVML}; "
              f"cat /usr/lib64/{LIB}; readlink /usr/lib64/evil/libcuda.so; cat /etc/shadow")
    proc, bundle = run(tmp_path, rootfs, plan, script)

    # the host is untouched, whatever happened in the container
    assert os.listdir(hostile_lib) == []
    assert os.listdir(hostile_bin) == ["sentinel"]
    assert (hostile_bin / "sentinel").read_text() == "host file"
    no_host_mounts_under(hostile_lib)
    no_host_mounts_under(hostile_bin)
    assert not {"/etc/shadow", "/etc/gshadow"} & set(rb.host_mount_points())
    for p, before in secrets.items():
        assert (p.stat().st_mtime_ns, p.read_bytes()) == before
    # ...and the links were resolved inside the rootfs, where the mounts landed
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["FAKE-NVML", "SMI", "FAKE-NVML", "\x7fELF fake libcuda", "libcuda.so.1",
                                        "FAKE-NVML"]
    inside = rootfs / str(hostile_lib).lstrip("/")
    assert (inside / NVML).exists() and (inside / "libcuda.so").is_symlink()
    assert (rootfs / str(hostile_bin).lstrip("/") / "nvidia-smi").exists()
    assert (rootfs / "etc/shadow").exists() and (rootfs / "etc/gshadow").exists()  # placeholders, inside
    assert {e["path"] for e in events(bundle, "mount.redirected")} == {f"/usr/lib64/{NVML}", f"/usr/lib64/{LIB}"}


def test_hostile_proc_symlink_not_followed_to_host(tmp_path, host, rootfs):
    """A link through /proc/self/root would be a magic link to the host's root."""
    lib = rootfs / L.lstrip("/")
    lib.rmdir()
    os.symlink("/proc/self/root" + str(tmp_path / "hostile-magic"), lib)
    (tmp_path / "hostile-magic").mkdir()
    proc, _ = run(tmp_path, rootfs, rb.plan_for(host), "echo STARTED")
    assert os.listdir(tmp_path / "hostile-magic") == []
    no_host_mounts_under(tmp_path / "hostile-magic")
    # /proc/self inside the container's procfs at prestart time names no process of the
    # container's pid namespace: the path does not resolve, and the container does not start.
    assert proc.returncode != 0
    assert "nvhook: cannot create mount point" in proc.stderr


@pytest.mark.parametrize("target", [
    "/proc/driver/nvidia/capabilities/../../../../etc/nvhook-escape",
    "/proc/driver/nvidia/../nvhook-escape",
    "/etc/nvhook-escape",
])
def test_copy_outside_own_tmpfs_is_refused(tmp_path, host, rootfs, target):
    """Copies are written relative to the tmpfs nvhook mounted: a '..' or a target elsewhere
    must stop the container and write nothing anywhere."""
    plan = rb.plan_for(host)
    plan["mounts"].append({"kind": "procfs", "source": str(host / "proc/driver/nvidia/version"),
                           "target": target, "options": ["ro", "copy"]})
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert "is not in a tmpfs nvhook mounted" in proc.stderr
    assert not (rootfs / "etc/nvhook-escape").exists() and not (rootfs / "proc/nvhook-escape").exists()
    assert not os.path.exists("/etc/nvhook-escape")


def test_copies_build_nested_directories(tmp_path, host, rootfs):
    """Capability files deep in the tmpfs: parents made once, shared by siblings."""
    plan = rb.plan_for(host)
    v = str(host / "proc/driver/nvidia/version")
    for rel in ("capabilities/gpu0/mig/gi1/access", "capabilities/gpu0/mig/gi1/ci0/access",
                "capabilities/gpu0/mig/gi2/access", "capabilities//gpu0/./mig/gi2/ci0/access"):
        plan["mounts"].append({"kind": "procfs", "source": v, "target": f"/proc/driver/nvidia/{rel}",
                               "options": ["ro", "copy"]})
    c = "/proc/driver/nvidia/capabilities/gpu0/mig"
    proc, _ = run(tmp_path, rootfs, plan,
                  f"ls {c}; ls {c}/gi1 {c}/gi2; stat -c '%a %F' {c}/gi2/ci0/access; "
                  f"cmp {c}/gi1/ci0/access /proc/driver/nvidia/version && echo SAME; "
                  f"touch {c}/x 2>/dev/null || echo RO")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    assert out[:2] == ["gi1", "gi2"]
    assert "444" in out and "SAME" in out and "RO" in out


# -- ldconfig --------------------------------------------------------------------------------

@pytest.fixture
def debian_rootfs(tmp_path: Path, fixtures_root: Path) -> Path:
    """A copy of the fixture generator's container-debian (it has /sbin/ldconfig and libc)."""
    dst = tmp_path / "debian-rootfs"
    shutil.copytree(fixtures_root / "container-debian", dst, symlinks=True)
    return dst


def test_ldconfig_indexes_injected_library(tmp_path, debian_rootfs):
    host = rb.make_host(tmp_path / "host", elf=True)
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    plan["symlinks"] = [{"path": f"{L}/libcuda.so", "target": "libcuda.so.1"}]  # libcuda.so.1 comes from ldconfig
    proc, bundle = run(tmp_path, debian_rootfs, plan, f"/sbin/ldconfig -p; readlink {L}/libcuda.so.1")
    assert proc.returncode == 0, proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if "libcuda.so.1 " in ln), None)
    assert line is not None, proc.stdout
    assert line.strip().endswith(f"=> {L}/libcuda.so.1")
    assert proc.stdout.splitlines()[-1] == LIB
    done = events(bundle, "ldconfig.done")
    assert done and done[0]["binary"] == "/sbin/ldconfig" and done[0]["directories"] == [L]


def test_ldconfig_prefers_real_and_host_binary(tmp_path, debian_rootfs):
    host = rb.make_host(tmp_path / "host", elf=True)
    # Ubuntu layout: /sbin/ldconfig is a wrapper (here: one that would fail), ldconfig.real the binary
    os.rename(debian_rootfs / "sbin/ldconfig", debian_rootfs / "sbin/ldconfig.real")
    (debian_rootfs / "sbin/ldconfig").write_text("#!/bin/sh\nexit 9\n")
    (debian_rootfs / "sbin/ldconfig").chmod(0o755)
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, bundle = run(tmp_path, debian_rootfs, plan, f"readlink {L}/libcuda.so.1")
    assert proc.returncode == 0, proc.stderr
    assert events(bundle, "ldconfig.done")[0]["binary"] == "/sbin/ldconfig.real"

    # "@/sbin/ldconfig": the host's binary, executed by fd inside the container's root
    (debian_rootfs / "sbin/ldconfig.real").unlink()
    (debian_rootfs / "etc/ld.so.cache").unlink()
    shutil.rmtree(tmp_path / "bundle")
    plan = rb.plan_for(host, ldconfig={"binary": "@/sbin/ldconfig", "directories": [L]})
    plan["symlinks"] = []
    proc, bundle = run(tmp_path, debian_rootfs, plan, f"readlink {L}/libcuda.so.1; test -s /etc/ld.so.cache && echo CACHE")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [LIB, "CACHE"]
    assert events(bundle, "ldconfig.done")[0]["binary"] == "@/sbin/ldconfig"


def test_ldconfig_missing_is_a_warning(tmp_path, host, rootfs):
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, bundle = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "STARTED\n"
    missing = events(bundle, "ldconfig.missing")
    assert missing and missing[0]["level"] == "warning"
    assert events(bundle, "apply.done")[0]["ldconfig"] == "missing"


def _fake_ldconfig(rootfs: Path, body: str) -> None:
    p = rootfs / "sbin/ldconfig"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)


def test_ldconfig_failing_stops_container(tmp_path, host, rootfs):
    _fake_ldconfig(rootfs, "echo 'ldconfig: cannot write the cache' >&2\nexit 3\n")
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode != 0
    assert "STARTED" not in proc.stdout
    assert "nvhook: ldconfig failed with exit code 3: ldconfig: cannot write the cache" in proc.stderr


def test_ldconfig_environment_and_capabilities(tmp_path, host, rootfs):
    """ldconfig runs in the container's root with an empty environment (the hook's own,
    LD_LIBRARY_PATH included, does not reach it; busybox sh adds only its default PATH) and, of all
    capabilities, only CAP_DAC_OVERRIDE: a fake one reports what it may do, then fails so that
    its report reaches runc's stderr."""
    (rootfs / "ro555").mkdir(mode=0o555)
    (rootfs / "ro555").chmod(0o555)
    _fake_ldconfig(rootfs, 'echo "env=[$(env | grep -v -e ^PWD= -e ^SHLVL= -e ^PATH=/sbin:/usr/sbin:/bin:/usr/bin\\$ | tr \'\\n\' \' \')] pwd=$(pwd) args=$*" '
                           '"$(test -d /ro555 && echo ROOTFS)" '
                           '"$(mkdir /ro555/sub 2>&- && echo DAC-OK || echo DAC-DENIED)" '
                           '"$(mknod /tmp/null c 1 3 2>&- && echo MKNOD-OK || echo MKNOD-DENIED)" '
                           '"$(chroot / true 2>&- && echo CHROOT-OK || echo CHROOT-DENIED)" '
                           '"$(for fd in 3 4 5 6 7 8 9 10 11 12 13 14 15; do (: <&$fd) 2>&- && echo FD$fd-OPEN; '
                           'done; echo FDS-CHECKED)" >&2\n'
                           'exit 5\n')
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, _ = run(tmp_path, rootfs, plan, "true")
    assert proc.returncode != 0
    line = next(ln for ln in proc.stderr.splitlines() if "nvhook:" in ln)
    assert "ldconfig failed with exit code 5: env=[] pwd=/" in line, line[-400:]
    assert f"args=-f /etc/ld.so.conf -C /etc/ld.so.cache {L}" in line
    assert "ROOTFS" in line
    assert "DAC-OK" in line  # writes where only DAC_OVERRIDE allows it (RHEL's 0555 /usr/lib64)
    assert "MKNOD-DENIED" in line and "CHROOT-DENIED" in line
    assert "FDS-CHECKED" in line and "-OPEN" not in line  # no fd of nvhook's leaks into ldconfig


# The [ldconfig] timeout of the tests whose fake ldconfig hangs (for months): a start that
# waited for it takes this long, one that did not, a few seconds even on a loaded machine.
LDCONFIG_HANG_S = 60


def test_ldconfig_timeout_kills_everything(tmp_path, host, rootfs):
    marker = str(random.randint(10**6, 10**7))  # unique: other runs may be going on
    _fake_ldconfig(rootfs, f"sh -c 'sleep {marker}; true'\n")  # a grandchild; no &: ldconfig's /dev is empty
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED", ldconfig_timeout=1)
    assert proc.returncode != 0
    assert "STARTED" not in proc.stdout
    assert "nvhook: ldconfig did not finish within 1 s and was killed" in proc.stderr
    assert rb.strays(marker) == []


def test_program_ldconfig_never_runs_alongside_the_mounts(tmp_path, host, rootfs):
    """A configured ldconfig program runs only once every mount (device nodes and
    /proc/driver/nvidia last) is done: when one fails, it has not started at all. (nvhook used
    to start it first and make the nodes while it ran, so image code raced nvhook's own work.)"""
    marker = str(random.randint(10**6, 10**7))
    _fake_ldconfig(rootfs, f"touch /LDCONFIG-RAN\nsh -c 'sleep {marker}; true'\n")
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    dev = next(m["target"] for m in plan["mounts"] if m["kind"] == "device")
    plan["mounts"] = [m for m in plan["mounts"] if m["kind"] != "device"] + \
        [m for m in plan["mounts"] if m["kind"] == "device"]
    # runc's /dev is a tmpfs made before the hook runs: a directory at the node's path comes
    # from a device the plan lists twice, the second time as a directory's source.
    plan["mounts"].append({"kind": "device", "source": str(host / "proc/driver/nvidia/gpus"),
                           "target": dev, "options": ["ro", "nosuid", "noexec"]})
    t = time.monotonic()
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED", ldconfig_timeout=LDCONFIG_HANG_S)
    elapsed = time.monotonic() - t
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert f"nvhook: cannot mount {host}/proc/driver/nvidia/gpus on {dev}" in proc.stderr
    assert elapsed < LDCONFIG_HANG_S / 2, f"{elapsed:.1f} s: the start waited for the (hanging) ldconfig"
    assert rb.strays(marker) == []
    assert not (rootfs / "LDCONFIG-RAN").exists()


def test_ldconfig_and_devices_both_done(tmp_path, host, rootfs):
    """With the overlap, what the container sees is the same: nodes, procfs and the cache."""
    plan = rb.plan_for(host, ldconfig={"binary": "@/sbin/ldconfig", "directories": [L]})
    proc, bundle = run(tmp_path, rootfs, plan,
                       f"ls -l /dev/nvidia0; cat /proc/driver/nvidia/version; /sbin/ldconfig -p 2>/dev/null "
                       f"|| echo NOLDCONFIG; ls {L}")
    assert proc.returncode == 0, proc.stderr
    assert "/dev/nvidia0" in proc.stdout and "NVRM" in proc.stdout
    done = events(bundle, "apply.done")[0]
    assert done["ldconfig"] == "ran" and done["mounts"] == len(plan["mounts"])


def _with_planned_nodes(plan: dict) -> dict:
    """Device mounts as the pipeline writes them: with the host node's facts in "node"."""
    for m in plan["mounts"]:
        if m["kind"] == "device":
            st = os.stat(m["source"])
            m["node"] = {"major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev), "mode": st.st_mode & 0o7777,
                         "uid": st.st_uid, "gid": st.st_gid}
    return plan


@pytest.mark.parametrize("planned,binary", [(False, "/sbin/ldconfig"), (True, "/sbin/ldconfig"), (False, "builtin")],
                         ids=["stat", "planned-node", "builtin-cache"])
def test_user_namespaced_container(fixtures_root, planned, binary):
    """Container root is host uid 100000: what nvhook creates in the image belongs to it (runc's
    /dev tmpfs refuses files of an unmapped owner), and a configured ldconfig runs as it; the
    cache nvhook writes itself belongs to it too. Device nodes are bind-mounted there (a node
    nvhook made would be unusable), with or without the plan's node facts."""
    base = Path(tempfile.mkdtemp(prefix="nvhook-userns-"))  # tmp_path is 0700: not traversable
    base.chmod(0o755)
    try:
        rootfs = base / "rootfs"
        shutil.copytree(fixtures_root / "container-debian", rootfs, symlinks=True)
        for d, dirs, files in os.walk(rootfs):
            for n in [d, *(os.path.join(d, x) for x in dirs + files)]:
                os.lchown(n, 100000, 100000)
        host = rb.make_host(base / "host", elf=True)
        plan = rb.plan_for(host, ldconfig={"binary": binary, "directories": [L]})
        if planned:
            _with_planned_nodes(plan)
        plan["symlinks"] = [{"path": f"{L}/libcuda.so", "target": "libcuda.so.1"}]
        if binary == "builtin":  # the SONAME link then comes from the plan, as the planner writes it
            plan["symlinks"].append({"path": f"{L}/libcuda.so.1", "target": LIB})
        script = (f"/sbin/ldconfig -p | grep -c libcuda.so.1; stat -c '%u %N' {L}/libcuda.so {L}/libcuda.so.1 "
                  f"/etc/ld.so.cache /dev/nvidia0; cat /proc/driver/nvidia/version")
        bundle = rb.Bundle(base / "bundle", rootfs, plan, ["sh", "-c", script])
        cfg = json.loads((bundle.path / "config.json").read_text())
        cfg["linux"]["namespaces"].append({"type": "user"})
        cfg["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
        cfg["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
        (bundle.path / "config.json").write_text(json.dumps(cfg))
        proc = rb.runc_run(bundle, base / "runc-state")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == "1"
        assert lines[1] == f"0 '{L}/libcuda.so' -> 'libcuda.so.1'"  # created by nvhook, owned by container root
        assert lines[2] == f"0 '{L}/libcuda.so.1' -> '{LIB}'"  # created by ldconfig or nvhook, as container root
        assert lines[3].startswith("0 ")  # /etc/ld.so.cache
        assert lines[4].startswith("65534 ")  # the host's device node: host root is unmapped
        assert lines[5].startswith("NVRM version")
        ids = (rootfs / L.lstrip("/") / "libcuda.so").lstat()
        assert (ids.st_uid, ids.st_gid) == (100000, 100000)
    finally:
        shutil.rmtree(base)


def test_planned_node_makes_the_device(tmp_path, host, rootfs):
    """The pipeline's plan carries each device's number, mode and owner: the node is made from
    them, without looking at the host node again."""
    plan = _with_planned_nodes(rb.plan_for(host))
    dev = next(m for m in plan["mounts"] if m["kind"] == "device" and m["target"] == "/dev/nvidia0")
    dev["node"].update(mode=0o640, uid=0, gid=44)  # what the plan says is what the container gets
    proc, _ = run(tmp_path, rootfs, plan, "stat -c '%a %u %g %t:%T %F' /dev/nvidia0")
    assert proc.returncode == 0, proc.stderr
    st = os.stat(dev["source"])
    assert proc.stdout.split() == ["640", "0", "44", f"{os.major(st.st_rdev):x}:{os.minor(st.st_rdev):x}",
                                   "character", "special", "file"]


@pytest.mark.parametrize("node", [{"major": 195}, {"major": -1, "minor": 0, "mode": 0o666, "uid": 0, "gid": 0},
                                  {"major": 195, "minor": 0, "mode": 0o100666, "uid": 0, "gid": 0}, "c 195:0"])
def test_invalid_planned_node_is_one_line(tmp_path, host, rootfs, node):
    plan = rb.plan_for(host)
    dev = next(m for m in plan["mounts"] if m["kind"] == "device")
    dev["node"] = node
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert f"nvhook: invalid device node in the plan for {dev['target']}" in proc.stderr


def _many_nodes(host: Path, plan: dict, n: int = 40) -> list[str]:
    """n MIG-like capability nodes on the host and in the plan."""
    caps = host / "dev/nvidia-caps"
    caps.mkdir(exist_ok=True)
    targets = []
    for minor in range(1, n + 1):
        if not (caps / f"nvidia-cap{minor}").exists():
            os.mknod(caps / f"nvidia-cap{minor}", 0o444 | stat.S_IFCHR, os.makedev(236, minor))
        targets.append(f"/dev/nvidia-caps/nvidia-cap{minor}")
        plan["mounts"].append({"kind": "device", "source": str(caps / f"nvidia-cap{minor}"), "target": targets[-1],
                               "options": ["ro", "nosuid", "noexec"]})
    return targets


def test_many_device_nodes_made_while_ldconfig_runs(tmp_path, host, rootfs):
    plan = rb.plan_for(host, ldconfig={"binary": "@/sbin/ldconfig", "directories": [L]})
    targets = _many_nodes(host, plan)
    assert len([m for m in plan["mounts"] if m["kind"] == "device"]) >= 16
    _with_planned_nodes(plan)
    proc, bundle = run(tmp_path, rootfs, plan, "ls /dev/nvidia-caps | wc -l; stat -c '%t:%T %a' "
                       "/dev/nvidia-caps/nvidia-cap40 /dev/nvidia0; cat /proc/driver/nvidia/version | head -c 4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    gpu_mode = f"{os.stat(host / 'dev/nvidia0').st_mode & 0o7777:o}"
    assert out == ["40", "ec:28", "444", "c3:0", gpu_mode, "NVRM"]  # the host nodes' numbers and modes
    done = events(bundle, "apply.done")[0]
    assert done["mounts"] == len(plan["mounts"]) and done["ldconfig"] == "ran"
    made = {e["target"] for e in events(bundle, "mount.done") if e.get("method") == "mknod"}
    assert set(targets) <= made  # apply_hook logs at debug


def test_failure_among_many_device_nodes_means_no_ldconfig(tmp_path, host, rootfs):
    marker = str(random.randint(10**6, 10**7))
    _fake_ldconfig(rootfs, f"touch /LDCONFIG-RAN\nsh -c 'sleep {marker}; true'\n")
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    _many_nodes(host, plan)
    plan["mounts"].append({"kind": "device", "source": str(host / "dev/nvidia0"), "target": "/dev/null/nvidia0",
                           "options": ["ro", "nosuid", "noexec"]})
    t = time.monotonic()
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED", ldconfig_timeout=LDCONFIG_HANG_S)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert "nvhook: cannot create mount point /dev/null/nvidia0 in the container" in proc.stderr
    elapsed = time.monotonic() - t
    assert elapsed < LDCONFIG_HANG_S / 2, f"{elapsed:.1f} s: the start waited for the (hanging) ldconfig"
    assert rb.strays(marker) == []
    assert not (rootfs / "LDCONFIG-RAN").exists()


# -- the container process is gone ---------------------------------------------------------

def test_container_pid_gone(tmp_path, host, rootfs):
    from nvhook.apply import apply_plan
    from nvhook.base.errors import HookError
    from nvhook.base.log import EventLog

    p = subprocess.Popen(["true"])
    p.wait(timeout=30)
    plan = rb.plan_for(host)
    plan["container"].update(pid=p.pid, rootfs=str(rootfs))
    with pytest.raises(HookError, match=f"container process {p.pid} is gone"):
        apply_plan(plan, EventLog())
    assert not (rootfs / L.lstrip("/") / LIB).exists()


def test_ldconfig_that_cannot_be_executed(tmp_path, host, rootfs):
    (rootfs / "sbin/ldconfig").write_bytes(b"\x7fELF not really")  # a regular file, no exec bit
    plan = rb.plan_for(host, ldconfig={"binary": "/sbin/ldconfig", "directories": [L]})
    proc, _ = run(tmp_path, rootfs, plan, "echo STARTED")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "nvhook:" in ln]
    assert len(lines) == 1 and "nvhook: cannot run ldconfig /sbin/ldconfig in the container: Permission denied" in lines[0]


def test_restart_reuses_placeholders(tmp_path, host, rootfs):
    """A container started again (docker restart) finds nvhook's own placeholders and links."""
    for _ in range(2):
        shutil.rmtree(tmp_path / "bundle", ignore_errors=True)
        proc, bundle = run(tmp_path, rootfs, rb.plan_for(host), f"cat {L}/{NVML}; readlink {L}/libcuda.so")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "FAKE-NVML\nlibcuda.so.1\n"
        assert not events(bundle, "mount.shadowed") and not events(bundle, "symlink.replaced")
    assert events(bundle, "mount.placeholder_reused")
