"""nvhook as users meet it: registered as the OCI hook of real runc containers.

Each test starts a private copy of a fixture image (tests/fixtures/rootfs/container-*) with
`runc run`, the installed console script (.venv/bin/nvhook) as its prestart (or createRuntime)
hook with `--root` on a fixture host, and a config whose log file and inventory cache live in
tmp_path. What is checked is what a user sees: the container's own output, runc's error
message, the host left alone, and nvhook's JSON log. Every container run is bounded in time and
deleted afterwards (tests/e2e/runcbox.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402  (tests/conftest.py puts tests/fixtures on sys.path)
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

DRIVER = mf.HOSTS["host-gpu8"].driver  # 535.261.03
GPU8 = mf.HOSTS["host-gpu8"].gpus
L = "/usr/lib/x86_64-linux-gnu"
LIBCUDA = f"libcuda.so.{DRIVER}"
NVML = f"libnvidia-ml.so.{DRIVER}"


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


def run(tmp_path: Path, host: Path, **kw) -> rb.HookRun:
    return rb.run_with_nvhook(tmp_path, host=host, **kw)


def lines_with(out: str, prefix: str) -> list[str]:
    return [ln[len(prefix):] for ln in out.splitlines() if ln.startswith(prefix)]


def one(out: str, prefix: str) -> str:
    found = lines_with(out, prefix)
    assert len(found) == 1, f"expected one {prefix!r} line in:\n{out}"
    return found[0]


def ldconfig_p(out: str, soname: str) -> list[str]:
    """`ldconfig -p` lines for `soname`: the paths it resolves to."""
    return [ln.split("=>", 1)[1].strip() for ln in out.splitlines()
            if ln.strip().startswith(soname + " ") and "=>" in ln]


def assert_done_ok(r: rb.HookRun) -> dict:
    """The log parses line by line and ends with hook.done, result ok; returns that event."""
    evs = r.events()
    assert evs, "nvhook wrote no log"
    for e in evs:
        assert {"ts", "level", "event", "nvhook_pid"} <= set(e), e
    assert evs[0]["event"] == "hook.start"
    assert len({e["nvhook_pid"] for e in evs}) == 1
    last = evs[-1]
    assert last["event"] == "hook.done", [e["event"] for e in evs]
    assert last["result"] == "ok" and last["level"] == "info"
    assert isinstance(last["mounted"], list)
    assert isinstance(last["peak_rss_kb"], int) and last["peak_rss_kb"] > 0
    assert isinstance(last["phases"], dict) and last["phases"]["total_ms"] > 0
    if last["mounted"]:  # applied by the hook itself (its own cache writer) or a forked worker
        assert ("apply_imports_ms" in last["phases"]) != ("apply_child_imports_ms" in last["phases"])
    assert not r.events("hook.failed") and not r.events("hook.crashed")
    return last


def assert_failed(r: rb.HookRun, starts_with: str) -> str:
    """The container did not start; runc shows nvhook's one line, the same as the log's
    hook.failed error (the log's last event). Returns the error."""
    assert r.proc.returncode != 0, r.stdout
    assert "STARTED" not in r.stdout
    assert not (r.rootfs / "started").exists()
    last = r.events()[-1]
    assert last["event"] == "hook.failed" and last["level"] == "error"
    error = last["error"]
    assert error.startswith(starts_with), error
    assert "\n" not in error
    assert r.hook_error_lines() == [f"nvhook: {error}"], r.proc.stderr
    return error


STARTED = "touch /started; echo STARTED"

USER_VIEW = f"""
echo STARTED
echo "TYPE:$(stat -c %F {L}/{LIBCUDA})"
echo "TOUCH-LIB:$(touch {L}/{LIBCUDA} 2>&1)"
echo "TOUCH-SMI:$(touch /usr/bin/nvidia-smi 2>&1)"
echo "REALPATH:$(realpath {L}/libcuda.so.1)"
echo LDCONFIG; /sbin/ldconfig -p; echo END-LDCONFIG
/usr/bin/cuda-probe
echo "DEV0:$(stat -c '%F %t:%T %a %u:%g' /dev/nvidia0)"
echo "DEVCTL:$(stat -c '%F %t:%T' /dev/nvidiactl)"
test -e /dev/nvidia1 && echo HAS-NVIDIA1 || echo NO-NVIDIA1
echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"
echo "GPUS:$(ls /proc/driver/nvidia/gpus)"
echo "PARAMS:$(grep ModifyDeviceFiles /proc/driver/nvidia/params)"
echo "SMI-PATH:$(command -v nvidia-smi)"
echo "SMI:$(nvidia-smi)"
"""


def test_gpu0_compute_utility_what_the_user_sees(tmp_path, gpu8):
    before = rb.mount_table()
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": "0"}, script=USER_VIEW)
    assert r.proc.returncode == 0, r.proc.stderr
    out = r.stdout
    assert "STARTED" in out
    # the driver files are there, read-only
    assert one(out, "TYPE:") == "regular file"
    assert one(out, "TOUCH-LIB:") == f"touch: {L}/{LIBCUDA}: Read-only file system"
    assert one(out, "TOUCH-SMI:") == "touch: /usr/bin/nvidia-smi: Read-only file system"
    # the container's own ldconfig cache resolves libcuda.so.1 to the injected file
    cache = out.split("LDCONFIG\n", 1)[1].split("END-LDCONFIG", 1)[0]
    assert ldconfig_p(cache, "libcuda.so.1") == [f"{L}/libcuda.so.1"]
    assert ldconfig_p(cache, "libnvidia-ml.so.1") == [f"{L}/libnvidia-ml.so.1"]
    assert one(out, "REALPATH:") == f"{L}/{LIBCUDA}"
    # and a CUDA program loads it
    assert one(out, "path: ") == f"{L}/{LIBCUDA}"
    assert one(out, "label: ") == f"libcuda {DRIVER}"
    assert one(out, "cuDriverGetVersion: ") == "12020"
    # GPU 0's device node only, plus the control devices
    host_node = os.stat(gpu8 / f"dev/nvidia{GPU8[0].minor}")  # same number, mode and owner as the host's
    assert one(out, "DEV0:") == (f"character special file {195:x}:{GPU8[0].minor:x} "
                                 f"{stat.S_IMODE(host_node.st_mode):o} {host_node.st_uid}:{host_node.st_gid}")
    assert one(out, "DEVCTL:") == f"character special file {195:x}:{255:x}"
    assert "NO-NVIDIA1" in out and "HAS-NVIDIA1" not in out
    # allowed by the device cgroup (v1 rule or v2 program): no module behind it, but not EPERM
    assert "Operation not permitted" not in one(out, "OPEN0:")
    assert "No such device" in one(out, "OPEN0:")
    # /proc/driver/nvidia: GPU 0 only, and the container cannot ask the driver for device nodes
    assert one(out, "GPUS:") == GPU8[0].bus_id
    assert one(out, "PARAMS:") == "ModifyDeviceFiles: 0"
    assert one(out, "SMI-PATH:") == "/usr/bin/nvidia-smi"
    assert one(out, "SMI:") == f"nvidia-smi (nvhook fixture, driver {DRIVER})"
    # the log
    done = assert_done_ok(r)
    for target in (f"{L}/{LIBCUDA}", f"{L}/{NVML}", "/usr/bin/nvidia-smi", "/dev/nvidia0", "/dev/nvidiactl",
                   f"/proc/driver/nvidia/gpus/{GPU8[0].bus_id}"):
        assert target in done["mounted"]
    assert "/dev/nvidia1" not in done["mounted"]
    assert done["compat"] == "host"
    # nvhook's own cache writer: the hook applied in its own process, no apply worker forked
    assert "apply_imports_ms" in done["phases"] and "apply_child_imports_ms" not in done["phases"]
    assert r.events("hook.start")[0]["stage"] == "prestart"
    assert r.event("request")["devices"] == ["0"]
    assert r.event("plan")["gpus"] == [0]
    # nothing was mounted on the host: not on the image or the bundle (in tmp_path), not from the
    # fixture host's files, not at the driver's host paths
    assert rb.leaked_mounts(before, tmp_path, gpu8) == []


def test_void_injects_nothing(tmp_path, gpu8):
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": "void"},
            script=f"echo STARTED; echo LIBS:$(ls -A {L}); echo DEV:$(ls /dev); echo DRIVER:$(ls /proc/driver); "
                   f"cuda-probe 2>&1 || echo NO-LIBCUDA")
    assert r.proc.returncode == 0, r.proc.stderr
    assert "STARTED" in r.stdout and "NO-LIBCUDA" in r.stdout
    assert "cuda-probe: cannot load libcuda.so.1" in r.stdout
    assert one(r.stdout, "LIBS:") == ""
    assert "nvidia" not in one(r.stdout, "DEV:") and "null" in one(r.stdout, "DEV:")
    assert "nvidia" not in one(r.stdout, "DRIVER:")
    assert os.listdir(r.rootfs / L.lstrip("/")) == []
    done = assert_done_ok(r)
    assert done["mounted"] == [] and "nothing requested" in done["reason"]
    assert r.event("request")["kind"] == "skip"


def test_utility_only_gets_nvml_not_libcuda(tmp_path, gpu8):
    r = run(tmp_path, gpu8, env={"NVIDIA_DRIVER_CAPABILITIES": "utility"},
            script=f"ls -A {L}; echo CACHE; /sbin/ldconfig -p; echo SMI:$(nvidia-smi)")
    assert r.proc.returncode == 0, r.proc.stderr
    files = r.stdout.split("CACHE")[0].split()
    assert NVML in files and "libnvidia-ml.so.1" in files
    assert not [f for f in files if f.startswith("libcuda")]
    assert ldconfig_p(r.stdout, "libnvidia-ml.so.1") == [f"{L}/libnvidia-ml.so.1"]
    assert ldconfig_p(r.stdout, "libcuda.so.1") == []
    assert one(r.stdout, "SMI:").startswith("nvidia-smi")
    done = assert_done_ok(r)
    assert not [m for m in done["mounted"] if "libcuda" in m]
    assert done["compat"] == "none"


DEVICES_VIEW = "ls /dev; echo GPUS:$(ls /proc/driver/nvidia/gpus); cuda-probe"


def _nvidia_nodes(out: str) -> set[str]:
    return {w for w in out.split() if w.startswith("nvidia") and w[6:].isdigit()}


def test_two_gpus_by_index(tmp_path, gpu8):
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": "1,3"}, script=DEVICES_VIEW)
    assert r.proc.returncode == 0, r.proc.stderr
    assert _nvidia_nodes(r.stdout) == {f"nvidia{GPU8[1].minor}", f"nvidia{GPU8[3].minor}"}
    assert one(r.stdout, "GPUS:").split() == sorted([GPU8[1].bus_id, GPU8[3].bus_id])
    assert one(r.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert r.event("plan")["gpus"] == [1, 3]
    assert_done_ok(r)


def test_gpu_by_uuid(tmp_path, gpu8):
    gpu = GPU8[5]
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": gpu.uuid.upper().replace("GPU-", "gpu-")},
            script=DEVICES_VIEW)
    assert r.proc.returncode == 0, r.proc.stderr
    assert _nvidia_nodes(r.stdout) == {f"nvidia{gpu.minor}"}
    assert one(r.stdout, "GPUS:") == gpu.bus_id
    assert r.event("plan")["gpus"] == [gpu.index]
    assert_done_ok(r)


def test_rhel_image_gets_usr_lib64(tmp_path, gpu8):
    r = run(tmp_path, gpu8, container="container-rhel", env={"NVIDIA_VISIBLE_DEVICES": GPU8[2].uuid},
            script="/sbin/ldconfig -p; realpath /usr/lib64/libcuda.so.1; cuda-probe; "
                   "test -e /usr/lib/x86_64-linux-gnu && echo HAS-DEBIAN-DIR; ls /dev")
    assert r.proc.returncode == 0, r.proc.stderr
    out = r.stdout
    assert ldconfig_p(out, "libcuda.so.1") == ["/usr/lib64/libcuda.so.1"]
    assert ldconfig_p(out, "libnvidia-ml.so.1") == ["/usr/lib64/libnvidia-ml.so.1"]
    assert f"/usr/lib64/{LIBCUDA}\n" in out
    assert one(out, "path: ") == f"/usr/lib64/{LIBCUDA}"
    assert one(out, "cuDriverGetVersion: ") == "12020"
    assert "HAS-DEBIAN-DIR" not in out
    assert _nvidia_nodes(out) == {f"nvidia{GPU8[2].minor}"}
    done = assert_done_ok(r)
    assert f"/usr/lib64/{LIBCUDA}" in done["mounted"]
    assert r.event("ldcache.written")["directories"] == ["/usr/lib64"]


# -- errors a user sees ---------------------------------------------------------------------

def test_unknown_device_stops_the_container(tmp_path, gpu8):
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": "42"}, script=STARTED)
    error = assert_failed(r, "unknown device '42' in NVIDIA_VISIBLE_DEVICES")
    assert "indices 0-7" in error
    assert isinstance(r.events()[-1]["phases"], dict)
    assert not r.events("apply.done")


@pytest.mark.parametrize("require, starts_with", [
    ("cuda>>12", "NVIDIA_REQUIRE_CUDA: cuda needs a numeric version in 'cuda>>12'"),
    ("cuda>=13.0", "unsatisfied requirement NVIDIA_REQUIRE_CUDA='cuda>=13.0': host driver 535.261.03 "
                   "supports CUDA 12.2"),
], ids=["malformed", "unsatisfied"])
def test_requirement_errors_stop_the_container(tmp_path, gpu8, require, starts_with):
    r = run(tmp_path, gpu8, env={"NVIDIA_REQUIRE_CUDA": require}, script=STARTED)
    assert_failed(r, starts_with)


# -- hostile images ---------------------------------------------------------------------------

def _shadow_state() -> tuple:
    p = Path("/etc/shadow")
    if not p.exists():
        return ()
    st = p.stat()
    return (st.st_mtime_ns, st.st_size, p.read_bytes())


def _lib_dir_absolute(rootfs: Path, hostdir: Path) -> None:
    (rootfs / L.lstrip("/")).rmdir()
    os.symlink(str(hostdir), rootfs / L.lstrip("/"))


def _lib_dir_climbing(rootfs: Path, hostdir: Path) -> None:
    (rootfs / L.lstrip("/")).rmdir()
    os.symlink("../" * 12 + str(hostdir).lstrip("/"), rootfs / L.lstrip("/"))


def _usr_bin_absolute(rootfs: Path, hostdir: Path) -> None:
    shutil.move(rootfs / "usr/bin/cuda-probe", rootfs / "bin/cuda-probe")
    shutil.rmtree(rootfs / "usr/bin")
    os.symlink(str(hostdir), rootfs / "usr/bin")


def _lib_to_shadow(rootfs: Path, hostdir: Path) -> None:
    os.symlink("/etc/shadow", rootfs / L.lstrip("/") / LIBCUDA)


NEWER = "545.23.08"


def _compat_to_host(rootfs: Path, hostdir: Path) -> None:
    mf.build_compat_lib(hostdir, NEWER, {**mf.NOTE_CUDA113, "Driver": [535]}, 12030)
    (rootfs / "usr/local/cuda").mkdir(parents=True)
    os.symlink(str(hostdir), rootfs / "usr/local/cuda/compat")


HOSTILE = {
    "libdir-absolute-link": _lib_dir_absolute,
    "libdir-climbing-link": _lib_dir_climbing,
    "usr-bin-absolute-link": _usr_bin_absolute,
    "libcuda-link-to-etc-shadow": _lib_to_shadow,
    "compat-dir-link-to-host": _compat_to_host,
}

HOSTILE_VIEW = ("echo STARTED; cuda-probe; echo SMI:$(nvidia-smi); "
                "echo MAPS; /sbin/ldconfig -p | grep libcuda")


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_image_cannot_reach_the_host(tmp_path, gpu8, case):
    hostdir = tmp_path / "host-dir"  # a host directory the image's links point at
    hostdir.mkdir()
    (hostdir / "sentinel").write_text("host file\n")
    snapshots: dict = {}

    def prepare_and_snapshot(rootfs: Path) -> None:
        HOSTILE[case](rootfs, hostdir)
        snapshots["dir"] = rb.tree_snapshot(hostdir)  # after the compat case filled it
        snapshots["shadow"] = _shadow_state()
        snapshots["mounts"] = rb.mount_table()

    r = run(tmp_path, gpu8, prepare=prepare_and_snapshot, script=HOSTILE_VIEW)

    # whatever happened in the container, the host is as it was
    assert rb.tree_snapshot(hostdir) == snapshots["dir"], "the host directory changed"
    assert _shadow_state() == snapshots["shadow"], "/etc/shadow changed"
    # none at or from the host dir or the image, none at /etc/... (ESCAPE_TARGETS)
    assert rb.leaked_mounts(snapshots["mounts"], tmp_path) == []
    assert rb.host_mounts_under(r.rootfs) == []

    # and the user and the log can tell what happened
    assert r.proc.returncode == 0, r.proc.stderr
    done = assert_done_ok(r)
    inside = str(hostdir)  # the host path, as a path inside the container's own root
    out = r.stdout
    assert one(out, "SMI:").startswith("nvidia-smi")
    if case in ("libdir-absolute-link", "libdir-climbing-link"):
        # the links were followed inside the rootfs: the files landed in <rootfs><hostdir>
        assert one(out, "path: ") == f"{inside}/{LIBCUDA}"
        assert (r.rootfs / inside.lstrip("/") / LIBCUDA).exists()
        via = {e["path"]: e["resolved"] for e in r.events("mount.via_symlink")}
        assert via[f"{L}/{LIBCUDA}"] == f"{inside}/{LIBCUDA}"
    elif case == "usr-bin-absolute-link":
        assert (r.rootfs / inside.lstrip("/") / "nvidia-smi").exists()
        via = {e["path"]: e["resolved"] for e in r.events("mount.via_symlink")}
        assert via["/usr/bin/nvidia-smi"] == f"{inside}/nvidia-smi"
        assert one(out, "path: ") == f"{L}/{LIBCUDA}"
    elif case == "libcuda-link-to-etc-shadow":
        # mounted on the container's own /etc/shadow (a placeholder nvhook created in the image)
        assert one(out, "path: ") == "/etc/shadow"
        assert (r.rootfs / "etc/shadow").exists()
        red = r.event("mount.redirected")
        assert red["level"] == "warning" and red["path"] == f"{L}/{LIBCUDA}"
        assert red["link"] == "/etc/shadow" and red["resolved"] == "/etc/shadow"
    elif case == "compat-dir-link-to-host":
        # the host's fake newer libcuda is not used; the host driver's is
        assert one(out, "path: ") == f"{L}/{LIBCUDA}"
        assert one(out, "cuDriverGetVersion: ") == "12020"
        assert done["compat"] == "host"
        assert not [m for m in done["mounted"] if NEWER in m]
        skipped = r.event("compat.skipped")
        assert skipped["level"] == "warning" and skipped["path"] == "/usr/local/cuda/compat"
        assert str(hostdir) in skipped["reason"]


# -- CVE-2025-23266: the container's LD_PRELOAD must not reach what the hook runs ---------------

EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void evil(void)
{
    const char *paths[] = { HOST_MARKER, "/tmp/preload-marker" };
    for (unsigned i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
        int fd = open(paths[i], O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { write(fd, "evil.so loaded\n", 15); close(fd); }
    }
}
"""

# A dynamically linked /sbin/ldconfig.real (what nvhook prefers to /sbin/ldconfig): it notes
# the LD_PRELOAD it got, then runs the image's real, static ldconfig with the same arguments.
WRAPPER_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    const char *pre = getenv("LD_PRELOAD");
    int fd = open("/tmp/ldconfig-wrapper-ran", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        write(fd, "LD_PRELOAD=", 11);
        write(fd, pre ? pre : "-", strlen(pre ? pre : "-"));
        write(fd, "\n", 1);
        close(fd);
    }
    (void)argc;
    execv("/sbin/ldconfig", argv);
    return 127;
}
"""


def _gcc(tmp: Path, name: str, source: str, out: Path, *flags: str) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(source)
    subprocess.run(["gcc", "-O2", *flags, "-o", str(out), str(src)], check=True, capture_output=True,
                   timeout=60)
    return out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_container_ld_preload_does_not_reach_the_hook(tmp_path, gpu8):
    host_marker = tmp_path / "host-preload-marker"
    build = tmp_path / "build"
    build.mkdir()
    made: dict = {}

    def prepare(rootfs: Path) -> None:
        evil = _gcc(build, "evil", EVIL_C, rootfs / "usr/lib/evil.so", "-shared", "-fPIC",
                    f'-DHOST_MARKER="{host_marker}"')
        _gcc(build, "wrapper", WRAPPER_C, rootfs / "sbin/ldconfig.real")
        # the test's own check: evil.so does fire when a dynamic program is given it
        subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(evil)}, check=True, timeout=30)
        assert host_marker.exists(), "evil.so did not fire in the control run"
        host_marker.unlink()
        made["evil"] = evil

    evil_host = str(tmp_path / "images/container-debian/usr/lib/evil.so")
    r = run(tmp_path, gpu8, prepare=prepare, args=["/bin/busybox", "true"], env={
        "LD_PRELOAD": f"/usr/lib/evil.so:{evil_host}",
        "LD_LIBRARY_PATH": f"/usr/lib:{tmp_path / 'images/container-debian/usr/lib'}",
    }, config_extra='[ldconfig]\npath = "/sbin/ldconfig"\n')  # a program runs only when configured
    assert made["evil"] == Path(evil_host)
    assert r.proc.returncode == 0, r.proc.stderr
    done = assert_done_ok(r)
    assert r.event("ldconfig.done")["binary"] == "/sbin/ldconfig.real"
    # the dynamic ldconfig ran, without the container's LD_PRELOAD, and evil.so never loaded
    assert (r.rootfs / "tmp/ldconfig-wrapper-ran").read_text() == "LD_PRELOAD=-\n"
    assert not (r.rootfs / "tmp/preload-marker").exists()
    assert not host_marker.exists()
    assert f"{L}/{LIBCUDA}" in done["mounted"]


# -- stages -------------------------------------------------------------------------------------

def test_create_runtime_stage(tmp_path, gpu8):
    r = run(tmp_path, gpu8, stage="createRuntime", script="cuda-probe; ls /dev")
    assert r.proc.returncode == 0, r.proc.stderr
    assert one(r.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert _nvidia_nodes(r.stdout) == {f"nvidia{GPU8[0].minor}"}
    assert r.events("hook.start")[0]["stage"] == "createRuntime"
    assert "createRuntime" in (r.bundle / "config.json").read_text()
    assert_done_ok(r)


def test_mig_device_gets_its_capability_nodes_and_procfs_files(tmp_path, gpu8):
    """A MIG device (by UUID and as gpu:mig) brings its parent GPU node, the GPU-instance and
    compute-instance capability nodes, and the procfs files CUDA reads to find them."""
    conf = (gpu8 / "usr/lib/x86_64-linux-gnu/fake-nvml.conf").read_text().splitlines()
    migs = {(int(f[1]), int(f[2])): f for f in (line.split() for line in conf) if f and f[0] == "mig"}
    gi1 = migs[(0, 0)]  # GPU 0, GI 1, CI 0
    minors = dict(line.split() for line in (gpu8 / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    r = run(tmp_path, gpu8, env={"NVIDIA_VISIBLE_DEVICES": f"{gi1[3]},1:1"},
            script="echo DEV:$(ls /dev | grep nvidia); echo CAPS:$(ls /dev/nvidia-caps); "
                   "cat /proc/driver/nvidia/capabilities/gpu0/mig/gi1/access "
                   "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access; "
                   "echo GIS:$(ls /proc/driver/nvidia/capabilities/gpu0/mig)")
    assert r.proc.returncode == 0, r.proc.stderr
    devs = one(r.stdout, "DEV:").split()
    assert "nvidia0" in devs and "nvidia1" in devs and "nvidia2" not in devs
    caps = set(one(r.stdout, "CAPS:").split())
    want = {f"nvidia-cap{minors[k]}" for k in ("gpu0/gi1/access", "gpu0/gi1/ci0/access",
                                                "gpu1/gi1/access", "gpu1/gi1/ci1/access")}
    assert caps == want
    assert f"DeviceFileMinor: {minors['gpu0/gi1/access']}" in r.stdout
    assert f"DeviceFileMinor: {minors['gpu0/gi1/ci0/access']}" in r.stdout
    assert one(r.stdout, "GIS:") == "gi1"  # GPU 0's other instance (GI 2) stays hidden
    assert_done_ok(r)


# -- what the start path imports ----------------------------------------------------------------

# Heavy or needless on the container-start path: the CLI and console logging (click,
# structlog), ELF and NVML bindings (only when the inventory is rebuilt or NVML must answer),
# the TOML parser (12 ms: the parsed config is cached; tomli before Python 3.11), and stdlib modules the start path
# avoids on purpose (json: _json is driven directly; re, typing, enum: nothing needs them;
# ctypes: ~7 ms of CPU for its Python layer, the syscall code uses `_ctypes` through base.ffi).
NOT_ON_START_PATH = {"click", "structlog", "elftools", "pynvml", "tomllib", "tomli", "json", "re", "typing",
                     "logging", "subprocess", "pathlib", "argparse", "shlex", "enum", "ctypes"}


def _hook_import_log(tmp_path: Path, host: Path, env: dict, cgroup2: bool = False) -> tuple[set, Path]:
    """The modules Python's own import log (PYTHONPROFILEIMPORTTIME) shows for the second of two
    real starts (the first builds the inventory and config caches), and nvhook's log file."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    log_file, errs = tmp_path / "nvhook.jsonl", tmp_path / "stderr"
    config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=log_file, cache_dir=tmp_path / "cache")
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", env))
    oci["process"]["args"] = ["/bin/true"]
    bundle = rb.nvhook_bundle(tmp_path / "bundle", oci, ["--config", str(config), "--root", str(host), "prestart"],
                              stderr_to=errs)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["hooks"]["prestart"][0]["env"] = ["PATH=/usr/bin:/bin", "PYTHONPROFILEIMPORTTIME=1",
                                          f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    for n in range(2):
        errs.write_text("")
        proc = rb.runc_run(bundle, tmp_path / f"state{n}", cgroup2=cgroup2)
        assert proc.returncode == 0, proc.stderr
    imported = {ln.split("|")[-1].strip() for ln in errs.read_text().splitlines() if ln.startswith("import time:")}
    return imported, log_file


@pytest.mark.parametrize("cgroup2", [False, True], ids=["host-cgroups", "cgroup-v2"])
def test_start_path_imports_only_what_it_uses(tmp_path, fixtures_root, cgroup2):
    """Python's own import log of the hook for a 1-GPU compute,utility container on a warm
    inventory cache; also with runc in cgroup v2 mode, where the hook swaps the BPF device
    program. The hook applies in its own process, so every module it runs is in the log."""
    imported, _ = _hook_import_log(tmp_path, fixtures_root / "host-gpu1",
                                   {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
                                   cgroup2=cgroup2)
    assert "nvhook.apply.child" in imported and "nvhook.observe.host.discover" in imported  # the log is real
    assert "nvhook.base.sandbox" in imported and "nvhook.base.ffi" in imported
    assert ("nvhook.base.bpf" in imported) == (cgroup2 or rb.host_cgroup_mode() == "v2")
    # the hook applies in its own process: nothing of a worker's (fork, pipes, reaping), and
    # hook.done's figures without `resource`
    assert sorted(imported & {"nvhook.base.process", "nvhook.base.waiting", "select", "resource"}) == []
    assert sorted(imported & NOT_ON_START_PATH) == []
    assert {m for m in imported if m.split(".")[0] in NOT_ON_START_PATH} == set()


def test_a_container_without_a_gpu_imports_no_more_than_it_needs(tmp_path, fixtures_root):
    """The start of a container that asks for no GPU (most containers on a GPU host) reads the
    request and stops: none of the GPU path's modules, no `resource` (hook.done's figures
    come from the clock and /proc/self/status), no runtime import of __future__ (the start-path
    bundle compiles it out)."""
    imported, log_file = _hook_import_log(tmp_path, fixtures_root / "host-gpu1",
                                          {"NVIDIA_VISIBLE_DEVICES": None, "NVIDIA_DRIVER_CAPABILITIES": None})
    assert "nvhook.start.hook" in imported and "nvhook.decide.request" in imported  # the log is real
    gpu_path = {"nvhook.decide.plan", "nvhook.observe.host.discover", "nvhook.observe.host.inventory",
                "nvhook.apply", "nvhook.apply.child", "nvhook.base.sandbox", "nvhook.base.ffi", "_ctypes"}
    assert sorted(imported & (gpu_path | {"resource", "__future__"} | NOT_ON_START_PATH)) == []
    done = [json.loads(ln) for ln in log_file.read_text().splitlines()][-1]
    assert done["event"] == "hook.done" and done["mounted"] == [] and done["peak_rss_kb"] > 0
