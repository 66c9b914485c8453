#!/usr/bin/env python3
"""Pod start through the CRI on the private Debian 13 node (tests/node/): nvhook's NRI plugin
against nvhook's runtime handler (nvhook-runtime), on the same node, in the same rounds.

    sudo .venv/bin/python bench/nri_pod_start.py [-n 15]

Each round runs, in a shuffled order, one pod per case and times CreateContainer +
StartContainer of its container (the sandbox is made before the clock starts; both are what
kubelet waits for). Cases: a pod without a GPU on runc with NRI on and no plugin connected
(the baseline), the same with the plugin connected, a GPU pod through the plugin (a CUDA image:
no hook; a plain image: the CDI hook), and a GPU / no-GPU pod through the runtime handler
"nvhook". Reported per case: median and
quartiles of the added time over the baseline of the same round, and the ratio to the runtime
handler's GPU pod.

The runtime handler's pods run while the plugin is disconnected, so that a GPU pod there is
injected once (by nvhook-runtime). NVIDIA's runtime (nvidia-container-runtime) is not measured:
it is a Go program whose build needs the Go module proxy, which this machine does not reach.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests/node"), str(REPO / "tests/fixtures"), str(REPO / "tests/e2e"), str(REPO / "tests")]

import images  # noqa: E402
from cri import device_plugin  # noqa: E402
from gpuprobe import CAPS, GPUS  # noqa: E402
from node import build_wheels, start_node  # noqa: E402
from test_nri import CUDA_IMAGE_ENV, NRIPlugin  # noqa: E402


def quart(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):7.1f} ms  [{q[0]:.1f} .. {q[2]:.1f}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=15)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="nvhook-nri-bench-"))
    fixtures = REPO / "tests/fixtures/rootfs"
    if not (fixtures / "host-gpu8").is_dir():
        sys.exit("run `make fixtures` first")
    node = start_node(fixtures / "host-gpu8", images.build_all(out / "images"), build_wheels(out / "wheels"))
    try:
        node.run(["mkdir", "-p", "/run/nvhook-test"])
        node.enable_nri()
        k = node.kubelet
        plugin = NRIPlugin(node)
        gpu = device_plugin("envvar", [GPUS[1].uuid])
        cases = {
            "baseline: no GPU, NRI on, no plugin": ("", {}, None, False),
            "plugin: no GPU": ("", {}, None, True),
            "plugin: GPU, CUDA image (no hook)": ("", CUDA_IMAGE_ENV, gpu, True),
            "plugin: GPU, plain image (CDI hook)": ("", {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, gpu, True),
            "runtime handler: no GPU": ("nvhook", {}, None, False),
            "runtime handler: GPU": ("nvhook", {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, gpu, False),
        }
        times: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(args.n + 1):  # round 0 warms caches and is dropped
            order = list(cases)
            random.shuffle(order)
            order.sort(key=lambda c: cases[c][3])  # plugin-less cases first, then connect
            plugin.kill()
            for c in order:
                handler, env, alloc, with_plugin = cases[c]
                if with_plugin and plugin.pid is None:
                    plugin.start()
                pod = k.run_pod(f"b{r}", runtime_handler=handler)
                t0 = time.perf_counter()
                k.run_container(pod, "app", images.DEBIAN, env=env, gpu=alloc)
                dt = (time.perf_counter() - t0) * 1000
                k.remove_pod(pod)
                if r:
                    times[c].append(dt)
        base = times["baseline: no GPU, NRI on, no plugin"]
        ref = [t - b for t, b in zip(times["runtime handler: GPU"], base, strict=True)]
        print(f"{args.n} rounds; CreateContainer+StartContainer, added time over the baseline of the same round")
        print(f"  {'baseline (absolute)':40s} {quart(base)}")
        for c, ts in times.items():
            if c.startswith("baseline"):
                continue
            added = [t - b for t, b in zip(ts, base, strict=True)]
            ratio = [a / rr for a, rr in zip(added, ref, strict=True) if rr > 0]
            print(f"  {c:40s} {quart(added)}   x runtime-handler GPU: {statistics.median(ratio):.2f}")
        plugin.kill()
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
