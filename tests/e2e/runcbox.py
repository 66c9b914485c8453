"""Tiny containers for the apply tests: a busybox rootfs, a fake host driver tree, an OCI
bundle whose prestart hook is tests/e2e/apply_hook.py, and `runc run` bounded in time and
always cleaned up. Standard library only; nothing here is specific to one test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOOK = HERE / "apply_hook.py"
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "stat", "touch", "readlink", "test", "echo", "sleep", "grep", "true", "env", "tr",
           "mkdir", "mknod", "chroot", "pwd")

DRIVER = "535.261.03"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
BUS_IDS = ("0000:07:00.0", "0000:08:00.0")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "runc tests need root"
    if not shutil.which("runc"):
        return "runc is not installed"
    if not os.path.exists(BUSYBOX):
        return "busybox (static) is not installed"
    return None


# -- file trees ----------------------------------------------------------------------------

def make_rootfs(path: Path, applets: tuple = APPLETS) -> Path:
    """A minimal rootfs: /bin/busybox and applet links, the usual top-level dirs."""
    for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "usr/bin", "usr/lib", "sbin", "run"):
        (path / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, path / "bin/busybox")
    for a in applets:
        os.symlink("busybox", path / "bin" / a)
    return path


def build_elf_library(path: Path, soname: str) -> Path:
    """A real (if useless) ELF shared object with the given SONAME, so ldconfig indexes it."""
    src = path.with_suffix(".c")
    src.write_text("int nvhook_test_symbol(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(path), str(src)],
                   check=True, capture_output=True, timeout=60)
    src.unlink()
    return path


def make_host(path: Path, *, elf: bool = False) -> Path:
    """A fake host root with one driver library, a binary, a GPU device node and the procfs
    files of two GPUs."""
    lib = path / LIBDIR.lstrip("/")
    lib.mkdir(parents=True)
    if elf:
        build_elf_library(lib / f"libcuda.so.{DRIVER}", "libcuda.so.1")
    else:
        (lib / f"libcuda.so.{DRIVER}").write_bytes(b"\x7fELF fake libcuda\n")
    (lib / f"libnvidia-ml.so.{DRIVER}").write_text("FAKE-NVML\n")
    (path / "usr/bin").mkdir(parents=True)
    smi = path / "usr/bin/nvidia-smi"
    smi.write_text("#!/bin/sh\necho fake nvidia-smi\n")
    smi.chmod(0o755)
    (path / "dev").mkdir()
    os.mknod(path / "dev/nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
    proc = path / "proc/driver/nvidia"
    proc.mkdir(parents=True)
    (proc / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Tue Jan 1 00:00:00 UTC 2025\n"
                                  "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    (proc / "params").write_text("ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\n")
    (proc / "registry").write_text("Binary: \"\"\nModifyDeviceFiles: 1\nRmGpuComputeExecTimeout: 0\n")
    for minor, bus in enumerate(BUS_IDS):
        g = proc / "gpus" / bus
        g.mkdir(parents=True)
        (g / "information").write_text(f"Model: \t\t NVIDIA Test GPU\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{minor:08d}-0000-0000-0000-000000000000\n"
                                       f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n")
    return path


def plan_for(host: Path, *, bus: str = BUS_IDS[0], ldconfig: dict | None = None) -> dict:
    """The plan nvhook's planner would make for GPU `bus` with compute,utility on `host`."""
    sys.path.insert(0, str(REPO))
    from nvhook.plan import mount

    h = str(host)
    p = f"{h}/proc/driver/nvidia"
    return {
        "container": {"id": "test", "pid": None, "rootfs": "/nonexistent"},
        "request": {"devices": ["0"], "capabilities": ["compute", "utility"], "requirements": []},
        "driver": {"version": DRIVER, "cuda": "12.2"},
        "gpus": [],
        "mounts": [
            mount("library", f"{h}{LIBDIR}/libcuda.so.{DRIVER}", f"{LIBDIR}/libcuda.so.{DRIVER}"),
            mount("library", f"{h}{LIBDIR}/libnvidia-ml.so.{DRIVER}", f"{LIBDIR}/libnvidia-ml.so.{DRIVER}"),
            mount("binary", f"{h}/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
            mount("device", f"{h}/dev/nvidia0", "/dev/nvidia0"),
            mount("tmpfs", "tmpfs", "/proc/driver/nvidia"),
            mount("procfs", f"{p}/params", "/proc/driver/nvidia/params", ("copy",)),
            mount("procfs", f"{p}/version", "/proc/driver/nvidia/version", ("copy",)),
            mount("procfs", f"{p}/registry", "/proc/driver/nvidia/registry", ("copy", "set:ModifyDeviceFiles=0")),
            mount("procfs", f"{p}/gpus/{bus}", f"/proc/driver/nvidia/gpus/{bus}"),
        ],
        "symlinks": [
            {"path": f"{LIBDIR}/libcuda.so.1", "target": f"libcuda.so.{DRIVER}"},
            {"path": f"{LIBDIR}/libcuda.so", "target": "libcuda.so.1"},
        ],
        "devices_cgroup": [{"type": "c", "major": 195, "minor": 0, "access": "rw"}],
        "compat": {"decision": "host", "reason": "test", "libraries": []},
        "ldconfig": ldconfig,
    }


# -- bundles and runc ----------------------------------------------------------------------

class Bundle:
    """An OCI bundle in `path` (config.json from `runc spec`, adjusted) running `args` in
    `rootfs` with apply_hook.py as its prestart hook."""

    def __init__(self, path: Path, rootfs: Path, plan: dict, args: list[str], *,
                 ldconfig_timeout: float | None = None):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.plan_file = path / "plan.json"
        self.log_file = path / "events.jsonl"
        self.cgroup_file = path / "devices.list"
        self.result_file = path / "result.json"
        self.plan_file.write_text(json.dumps(plan))
        subprocess.run(["runc", "spec", "--bundle", str(path)], check=True, capture_output=True, timeout=30)
        cfg = json.loads((path / "config.json").read_text())
        proc = cfg["process"]
        proc.pop("rlimits", None)  # the sandbox refuses raised rlimits
        proc["terminal"] = False
        proc["args"] = args
        cfg["root"] = {"path": str(rootfs), "readonly": False}
        hook_args = [sys.executable, str(HOOK), str(self.plan_file), "--log", str(self.log_file),
                     "--cgroup-out", str(self.cgroup_file), "--result-out", str(self.result_file)]
        if ldconfig_timeout is not None:
            hook_args += ["--ldconfig-timeout", str(ldconfig_timeout)]
        cfg["hooks"] = {"prestart": [{"path": sys.executable, "args": hook_args,
                                      "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH=/hook-env-leak"], "timeout": 60}]}
        (path / "config.json").write_text(json.dumps(cfg, indent=1))

    def events(self) -> list[dict]:
        if not self.log_file.exists():
            return []
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line]


def runc_run(bundle: Bundle, state_root: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """`runc run` the bundle in the foreground; the container is deleted whatever happens."""
    cid = f"nvhook-test-{uuid.uuid4().hex[:12]}"
    base = ["runc", "--root", str(state_root)]
    try:
        return subprocess.run(base + ["run", "--bundle", str(bundle.path), cid], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        subprocess.run(base + ["delete", "-f", cid], capture_output=True, timeout=30)


def host_mount_points() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            out.append(line.split(" ")[4].replace("\\040", " "))
    return out
