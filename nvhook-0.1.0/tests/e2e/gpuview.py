"""What a container that got GPU 0 of the 8-GPU fixture host (compute,utility) shows from the
inside, shared by the runtime-wrapper, Docker and containerd tests. Opening a device node
tells the device cgroup's answer without a GPU: ENXIO ("No such device or address") =
allowed, no driver behind it; EPERM = denied."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))

import make_fixtures as mf  # noqa: E402

DRIVER = mf.HOSTS["host-gpu8"].driver
L = "/usr/lib/x86_64-linux-gnu"
LIBCUDA = f"libcuda.so.{DRIVER}"

SCRIPT = f"""
echo STARTED
echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"
echo "OPENCTL:$(head -c 1 /dev/nvidiactl 2>&1)"
test -e /dev/nvidia1 && echo HAS-NVIDIA1 || echo NO-NVIDIA1
echo "TOUCH-LIB:$(touch {L}/{LIBCUDA} 2>&1)"
echo "LDCONFIG:$(/sbin/ldconfig -p | grep 'libcuda.so.1 ')"
echo "MOUNTS-LIBCUDA:$(grep -c ' {L}/{LIBCUDA} ' /proc/self/mountinfo)"
echo "GPUS:$(ls /proc/driver/nvidia/gpus)"
/usr/bin/cuda-probe
"""


def line(out: str, prefix: str) -> str:
    found = [ln[len(prefix):] for ln in out.splitlines() if ln.startswith(prefix)]
    assert len(found) == 1, f"expected one {prefix!r} line in:\n{out}"
    return found[0]


def assert_gpu0(out: str) -> None:
    assert "STARTED" in out, out
    # allowed by the device cgroup, no kernel module behind the node (not EPERM)
    assert line(out, "OPEN0:") == "head: /dev/nvidia0: No such device or address"
    assert line(out, "OPENCTL:") == "head: /dev/nvidiactl: No such device or address"
    assert "NO-NVIDIA1" in out
    assert line(out, "TOUCH-LIB:") == f"touch: {L}/{LIBCUDA}: Read-only file system"
    assert line(out, "LDCONFIG:").strip() == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1"
    assert line(out, "MOUNTS-LIBCUDA:") == "1"  # mounted once: nothing done twice
    assert line(out, "GPUS:") == mf.HOSTS["host-gpu8"].gpus[0].bus_id
    assert line(out, "path: ") == f"{L}/{LIBCUDA}"  # a CUDA program loads the host's libcuda
