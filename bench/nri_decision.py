#!/usr/bin/env python3
"""The NRI plugin's per-GPU-container decision in the warm process, as `nvhook nri` runs it
(the parsed inventory cache kept in memory, each use checked against the host), on a fixture
host: answered from the plugin's kept answers (the host unchanged) against decided afresh
(the kept answers dropped before each call), interleaved in the same loop.

    .venv/bin/python bench/nri_decision.py [-n 300] [--host host-gpu8]

Reported: ms per decision, median [quartiles], and the machine's load average."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests/e2e"), str(REPO / "tests/fixtures")]

import make_fixtures as mf  # noqa: E402
import privaterun  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.base import config as config_mod  # noqa: E402
from nvhook.base.nrimessages import Container  # noqa: E402
from nvhook.decide import request as request_mod  # noqa: E402
from nvhook.observe.host import cache  # noqa: E402
from nvhook.start.nri.plugin import Plugin  # noqa: E402


def quart(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):6.2f} ms [{q[0]:.2f} .. {q[2]:.2f}]"


def main() -> int:
    privaterun.enter("nvhook-bench-run-")  # a /run/nvhook and /var/log/nvhook.log of its own (tests/e2e/privaterun.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--host", default="host-gpu8")
    args = ap.parse_args()
    root = REPO / "tests/fixtures/rootfs" / args.host
    if not root.is_dir():
        sys.exit("run `make fixtures` first")
    tmp = Path(tempfile.mkdtemp(prefix="nvhook-nri-decision-"))
    cfg = config_mod.load(str(rb.write_nvhook_config(tmp / "hook.toml", log_file=tmp / "log.jsonl",
                                                     cache_dir=tmp / "cache")), explicit=True)
    cache.KEEP_PARSED = True  # as nvhook nri sets it
    plugin = Plugin(cfg, str(root), hook_path="/usr/bin/nvhook")
    host = mf.HOSTS[args.host]
    gpu = next(g for g in host.gpus if not g.migs)
    cuda = f"{host.cuda // 1000}.{host.cuda % 1000 // 10}.0"
    env = {"NVIDIA_VISIBLE_DEVICES": gpu.uuid, "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
           "CUDA_VERSION": cuda, "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"}
    container = Container(id="c0", env=env)

    def one(i: int, keep: bool) -> float:
        if not keep:
            plugin.answers.clear()
        t0 = time.perf_counter()
        r = request_mod.parse(env, privileged=False, mounts=[], config=cfg, annotations={})
        log = plugin.log()
        container.id = f"c{i}"
        summary = plugin.book.answer(container, r, log).summary
        log.flush()
        dt = (time.perf_counter() - t0) * 1000
        assert summary["cached"] is keep, summary
        return dt

    one(0, False)  # builds the inventory cache
    one(0, False)
    times: dict[bool, list[float]] = {True: [], False: []}
    load0 = os.getloadavg()[0]
    for i in range(args.n):
        for keep in (i % 2 == 0, i % 2 != 0):
            times[keep].append(one(i, keep))
    print(f"{args.n} decisions each, {args.host}, 1 GPU, CUDA image; load average {load0:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    print(f"  decided afresh:        {quart(times[False])}")
    print(f"  kept answer (checked): {quart(times[True])}")
    print(f"  ratio of medians: {statistics.median(times[True]) / statistics.median(times[False]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
