#!/usr/bin/env python3
"""The NRI plugin's Synchronize with K running GPU containers, as after a reconnection: each
container's start work is checked through its root (Plugin.check_start_work). The containers
are created by the real runc (`runc create`, as tests/test_nri_plugin.py makes them: a copy of
the fixture's Debian image, the plugin's answer's binds as spec mounts) on a fixture host; half
got their StartContainer work (nvhook's cache: the check reads its last bytes), half did not
(the image's own cache is looked at, and the container is named).

    sudo .venv/bin/python bench/nri_synchronize.py [-k 20] [-n 30] [--host host-gpu8]

Reported: ms per Synchronize, median [quartiles], the containers checked and named, and the
machine's load average. The plugin is called in this process (no socket), its kept answers as
in the warm process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests/e2e"), str(REPO / "tests/fixtures"), str(REPO / "tests/nri"), str(REPO / "tests")]

import privaterun  # noqa: E402
import runcbox as rb  # noqa: E402
from fakeruntime import pb  # noqa: E402

from nvhook.base import config as config_mod  # noqa: E402
from nvhook.observe.host import cache  # noqa: E402
from nvhook.start.nri.plugin import Plugin  # noqa: E402

ENV = ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


def create(tmp: Path, i: int, mounts, state: Path) -> tuple[str, int]:
    """A container of the Debian fixture image created by runc with `mounts`; (id, pid)."""
    d = tmp / f"c{i}"
    rootfs = d / "rootfs"
    shutil.copytree(REPO / "tests/fixtures/rootfs/container-debian", rootfs, symlinks=True)
    subprocess.run(["runc", "spec", "--bundle", str(d)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((d / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"].update(terminal=False, args=["/bin/true"])
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    cfg["mounts"] += [{"destination": m.destination, "type": "bind", "source": m.source,
                       "options": list(m.options)} for m in mounts]
    (d / "config.json").write_text(json.dumps(cfg))
    cid = f"nvhook-bench-sync-{uuid.uuid4().hex[:12]}"
    subprocess.run(["runc", "--root", str(state), "create", "--bundle", str(d), cid], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    st = json.loads(subprocess.run(["runc", "--root", str(state), "state", cid], check=True, capture_output=True,
                                   timeout=30).stdout)
    return cid, st["pid"]


def quart(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):7.2f} ms [{q[0]:.2f} .. {q[2]:.2f}]"


def main() -> int:
    privaterun.enter("nvhook-bench-run-")  # a /run/nvhook and /var/log/nvhook.log of its own (tests/e2e/privaterun.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", type=int, default=20, help="running GPU containers")
    ap.add_argument("-n", type=int, default=30, help="Synchronize calls timed")
    ap.add_argument("--host", default="host-gpu8")
    args = ap.parse_args()
    root = REPO / "tests/fixtures/rootfs" / args.host
    if not root.is_dir():
        sys.exit("run `make fixtures` first")
    if os.geteuid() != 0 or not shutil.which("runc"):
        sys.exit("needs root and runc")
    tmp = Path(tempfile.mkdtemp(prefix="nvhook-nri-sync-"))
    state = tmp / "runc-state"
    cfg = config_mod.load(str(rb.write_nvhook_config(tmp / "hook.toml", log_file=tmp / "log.jsonl",
                                                     cache_dir=tmp / "cache")), explicit=True)
    cache.KEEP_PARSED = True  # as nvhook nri sets it
    plugin = Plugin(cfg, str(root), hook_path="/usr/bin/nvhook")
    plugin.warm()
    p = pb()
    resp = p.CreateContainerResponse.FromString(plugin.on_CreateContainer(p.CreateContainerRequest(
        pod=p.PodSandbox(id="pod1", name="bench"), container=p.Container(id="x", env=ENV)).SerializeToString()))
    mounts = resp.adjust.mounts
    devices = [p.LinuxDevice(path=d.path, type=d.type, major=d.major, minor=d.minor) for d in resp.adjust.linux.devices]
    made: list[str] = []
    try:
        containers = []
        for i in range(args.k):
            cid, pid = create(tmp, i, mounts, state)
            made.append(cid)
            c = p.Container(id=cid, pod_sandbox_id="pod1", name=f"app{i}", env=ENV, pid=pid, state=3,
                            mounts=[p.Mount(destination=m.destination, type="bind", source=m.source) for m in mounts],
                            linux=p.LinuxContainer(devices=devices))
            if i % 2 == 0:  # its StartContainer work done
                plugin.on_StateChange(p.StateChangeEvent(event=6, pod=p.PodSandbox(id="pod1", name="bench"),
                                                         container=c).SerializeToString())
            containers.append(c)
        payload = p.SynchronizeRequest(pods=[p.PodSandbox(id="pod1", name="bench", namespace="bench")],
                                       containers=containers).SerializeToString()
        plugin.on_Synchronize(payload)  # the kept answers, as after the containers' creation
        times = []
        load0 = os.getloadavg()[0]
        for _ in range(args.n):
            t0 = time.perf_counter()
            plugin.on_Synchronize(payload)
            times.append((time.perf_counter() - t0) * 1000)
        last = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()
                if '"nri.synchronized"' in line][-1]
        print(f"Synchronize with {args.k} running GPU containers ({(args.k + 1) // 2} with nvhook's cache, "
              f"{args.k // 2} without), {args.host}, {args.n} calls; load average {load0:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
        print(f"  per Synchronize: {quart(times)}; per container {statistics.median(times) / args.k:.2f} ms")
        print(f"  last: checked {last['start_work_checked']}, named {last['start_work_missing']}, "
              f"unchecked {last['start_work_unchecked']}")
    finally:
        for cid in made:
            subprocess.run(["runc", "--root", str(state), "delete", "-f", cid], capture_output=True, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
