#!/usr/bin/env python3
"""What nvhook's NRI plugin costs a container that asks for no GPU, on the plugin's side: the
round trip of its CreateContainer and of its StartContainer through the plugin's socket (the
mux, ttrpc, the decoding, the request rules, the empty answer), measured by a runtime played by
this script (tests/nri/fakeruntime.py: messages encoded by protobuf's own code), with a pod's
usual environment, mounts and annotations. The engine's own side of the round trip (containerd
encoding the request, its timeout bookkeeping) is not in it: bench/nri_pod_start.py
--no-gpu-only measures whole pod starts on the node.

    .venv/bin/python bench/nri_nogpu_answer.py [-n 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests/nri"), str(REPO / "tests/e2e"), str(REPO / "tests/fixtures")]

import fakeruntime as fr  # noqa: E402
import privaterun  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.base import config as config_mod  # noqa: E402
from nvhook.start.nri.plugin import Plugin  # noqa: E402


def quart(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs) * 1000:6.3f} ms [{q[0] * 1000:.3f} .. {q[2] * 1000:.3f}]"


def main() -> int:
    privaterun.enter("nvhook-bench-run-")  # a /run/nvhook and /var/log/nvhook.log of its own (tests/e2e/privaterun.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2000)
    args = ap.parse_args()
    root = REPO / "tests/fixtures/rootfs/host-gpu8"
    if not root.is_dir():
        sys.exit("run `make fixtures` first")
    tmp = Path(tempfile.mkdtemp(prefix="nvhook-nri-nogpu-"))
    cfg = config_mod.load(str(rb.write_nvhook_config(tmp / "hook.toml", log_file=tmp / "log.jsonl",
                                                     cache_dir=tmp / "cache")), explicit=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp / "nri.sock"))
    srv.listen(1)
    plugin = Plugin(cfg, str(root), socket_path=str(tmp / "nri.sock"))
    threading.Thread(target=plugin.serve_forever, daemon=True).start()
    conn, _ = srv.accept()
    rt = fr.Runtime(conn)
    rt.accept_registration()
    p = fr.pb()
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME=web-7d4b9c",
           *[f"SERVICE_{i}_PORT=tcp://10.96.0.{i}:443" for i in range(20)]]
    c = p.Container(id="a" * 64, pod_sandbox_id="b" * 64, name="app", env=env, pid=4242,
                    mounts=[p.Mount(destination=f"/var/run/m{i}", source=f"/var/lib/kubelet/pods/x/m{i}",
                                    type="bind", options=["rbind", "ro"]) for i in range(6)],
                    annotations={f"io.kubernetes.container.k{i}": "v" * 40 for i in range(8)})
    pod = p.PodSandbox(id="b" * 64, name="web", namespace="default",
                       annotations={f"kubernetes.io/k{i}": "v" * 40 for i in range(8)})
    calls = {"CreateContainer": p.CreateContainerRequest(pod=pod, container=c),
             "StateChange (StartContainer)": p.StateChangeEvent(event=6, pod=pod, container=c)}
    times: dict[str, list[float]] = {k: [] for k in calls}
    load0 = os.getloadavg()[0]
    for i in range(args.n + 50):
        for name, msg in calls.items():
            t0 = time.perf_counter()
            code, err, _ = rt.call(name.split()[0], msg)
            dt = time.perf_counter() - t0
            assert code == 0, err
            if i >= 50:  # warm-up dropped
                times[name].append(dt)
    print(f"{args.n} no-GPU containers, round trip through the plugin, median [quartiles]; load average "
          f"{load0:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    for name, ts in times.items():
        print(f"  {name:30s} {quart(ts)}")
    both = [a + b for a, b in zip(*times.values())]
    print(f"  {'both (one container)':30s} {quart(both)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
