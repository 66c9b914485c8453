"""What a pod's container shows of its GPUs, read through the CRI (ExecSync) the way a user in
`kubectl exec` would see it, and the checks the node tests make on it. Without a GPU, opening a
device node tells the device cgroup's answer: "No such device or address" (ENXIO) = allowed,
no driver behind it; "Operation not permitted" (EPERM) = denied."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))

import make_fixtures as mf  # noqa: E402

HOST = mf.HOSTS["host-gpu8"]
GPUS = HOST.gpus
DRIVER = HOST.driver
L = "/usr/lib/x86_64-linux-gnu"
LIBCUDA = f"libcuda.so.{DRIVER}"
ALLOWED = "No such device or address"
DENIED = "Operation not permitted"
CAPS = "compute,utility"

# One line per fact, `KEY:value`; device nodes are tried one by one.
SCRIPT = f"""
echo "DEV:$(cd /dev && ls -d nvidia* 2>/dev/null | busybox tr '\\n' ' ')"
echo "CAPS:$(ls /dev/nvidia-caps 2>/dev/null | busybox tr '\\n' ' ')"
for d in /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm; do
  [ -e "$d" ] && echo "OPEN:$d:$(head -c 1 "$d" 2>&1 | busybox sed 's/.*: //')"
done
echo "GPUS:$(ls /proc/driver/nvidia/gpus 2>/dev/null | busybox tr '\\n' ' ')"
echo "LDCONFIG:$(/sbin/ldconfig -p | grep 'libcuda.so.1 ' | busybox sed 's/^[[:space:]]*//')"
echo "TOUCH:$(touch {L}/{LIBCUDA} 2>&1 | busybox sed 's/.*: //')"
echo "MOUNTS:$(grep -c ' {L}/{LIBCUDA} ' /proc/self/mountinfo)"
/usr/bin/cuda-probe 2>&1 | busybox sed 's/^/PROBE:/'
"""


class View:
    """The parsed probe output of one container."""

    def __init__(self, out: str):
        self.out = out
        self.lines: dict[str, list[str]] = {}
        for line in out.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                self.lines.setdefault(key, []).append(value.strip())

    def one(self, key: str) -> str:
        vals = self.lines.get(key, [])
        assert len(vals) == 1, f"expected one {key}: line in:\n{self.out}"
        return vals[0]

    @property
    def devices(self) -> set[str]:
        return set(self.one("DEV").split())

    @property
    def caps(self) -> set[str]:
        return set(self.one("CAPS").split())

    @property
    def opens(self) -> dict[str, str]:
        return dict(v.split(":", 1) for v in self.lines.get("OPEN", []))

    @property
    def bus_ids(self) -> set[str]:
        return set(self.one("GPUS").split())

    @property
    def probe(self) -> dict[str, str]:
        return dict(v.split(": ", 1) for v in self.lines.get("PROBE", []) if ": " in v)


def look(kubelet, cid: str) -> View:
    code, out, err = kubelet.exec(cid, SCRIPT)
    assert code == 0, f"probe failed in {cid} (exit {code}): {out}{err}"
    return View(out)


def assert_gpus(view: View, gpus: list, *, mig_caps: set[str] | None = None) -> None:
    """The container has exactly `gpus` (fixture Gpu objects) and the driver, as CUDA sees it."""
    want = {f"nvidia{g.minor}" for g in gpus}
    nodes = {d for d in view.devices if d[len("nvidia"):].isdigit()}
    assert nodes == want, view.out
    assert {"nvidiactl", "nvidia-uvm"} <= view.devices, view.out
    for name in (*sorted(want), "nvidiactl", "nvidia-uvm"):
        assert view.opens[f"/dev/{name}"] == ALLOWED, view.out  # the device cgroup lets it through
    assert view.bus_ids == {g.bus_id for g in gpus}, view.out
    assert view.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1", view.out
    assert view.one("TOUCH") == "Read-only file system", view.out  # the driver is mounted read-only
    assert view.one("MOUNTS") == "1", view.out
    assert view.probe.get("path") == f"{L}/{LIBCUDA}", view.out  # a CUDA program loads the host's libcuda
    assert view.probe.get("cuDriverGetVersion") == str(HOST.cuda), view.out
    if mig_caps is not None:
        assert view.caps == mig_caps, view.out


def assert_no_gpu(view: View) -> None:
    assert view.devices == set(), view.out
    assert view.one("GPUS") == "", view.out
    assert view.one("LDCONFIG") == "", view.out
    assert "path" not in view.probe, view.out
