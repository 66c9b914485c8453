#!/usr/bin/env python3
"""A/B benchmark: this checkout's hook against another checkout's, side by side in one run.

    sudo .venv/bin/python bench/ab.py /path/to/other-checkout [-n 20] [--resident]

The other checkout needs its own `make venv` (its .venv/bin/nvhook is the B hook). Every round
starts, in a shuffled order, a bare `runc run` and the same container with each tree's hook
for each case, so both trees see the same load; each tree gets its own config file and cache
directory (they must not take turns rebuilding one inventory cache). Reported per case: each
tree's hook overhead (median over rounds of container-with-hook minus bare start in the same
round, with its quartiles) and the median of the per-round ratio this/other with its quartiles,
in wall-clock time and in CPU time (user + system of runc and everything it waited for, the hook
and its children included: much less disturbed by other load on a shared machine than wall time).
Both trees read this checkout's fixture hosts.

--resident: every hook is served by its own tree's nvhookd ([daemon] mode = "required"; one
daemon per tree and fixture host, warm before the rounds). The CPU time is then the client's
and runc's; the daemons' request children are reported apart, per start and tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

CASES = [  # label, fixture host, NVIDIA_VISIBLE_DEVICES, capabilities
    ("1 GPU, compute,utility", "host-gpu1", "0", "compute,utility"),
    ("8 GPUs, compute,utility", "host-gpu8", "all", "compute,utility"),
    ("8x7 MIG (112 cap devices), compute,utility", "host-mig8x7", "MIG", "compute,utility"),
    ("not a GPU container", "host-gpu8", None, None),
]


def _bundle(work: Path, name: str, hook: Path | None, conf: Path | None, host: Path | None,
            env: list[str]) -> Path:
    d = work / name
    d.mkdir()
    rootfs = bench.make_fixtures.build_container("container-debian", d)
    cfg = bench.make_fixtures.oci_config(str(rootfs), ["PATH=/usr/bin:/bin", *env])
    cfg["process"]["args"] = ["/bin/true"]
    if hook is not None:
        cfg["hooks"] = {"prestart": [{"path": str(hook), "env": ["PATH=/usr/bin:/bin"],
                                      "args": ["nvhook", "--config", str(conf), "--root", str(host), "prestart"]}]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def _run(d: Path, k: list[int]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one `runc run`."""
    k[0] += 1
    cid = f"ab-{os.getpid()}-{k[0]}"
    try:
        cpu = _cpu_ms()
        wall = bench.timed(["runc", "run", cid], 1, cwd=d)[0]
        return wall, _cpu_ms() - cpu
    finally:
        subprocess.run(["runc", "delete", "-f", cid], stderr=subprocess.DEVNULL)


def _q(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    bench.privaterun.enter("nvhook-bench-run-")  # its own /run/nvhook and log (tests/e2e/privaterun.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", type=Path, help="the other checkout (with its own .venv)")
    ap.add_argument("-n", type=int, default=20, help="rounds (default 20)")
    ap.add_argument("--resident", action="store_true", help="each tree's hooks served by its own tree's nvhookd")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("runc"):
        raise SystemExit("ab needs root and runc")
    hooks = {"this": bench.NVHOOK, "other": args.other.resolve() / ".venv" / "bin" / "nvhook"}
    if not hooks["other"].exists():
        raise SystemExit(f"{hooks['other']} does not exist: run make venv in {args.other}")
    root = bench.FIXTURES / "rootfs"
    subprocess.run([sys.executable, str(bench.FIXTURES / "make_fixtures.py")], check=True,
                   stdout=subprocess.DEVNULL)
    migs = ",".join(bench.mig_uuids(root / "host-mig8x7"))
    counter = [0]
    daemons: dict[tuple[str, str], subprocess.Popen] = {}
    daemon_cpu: dict[str, float] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="nvhook-ab-") as tmp:
        work = Path(tmp)
        try:
            bundles: dict[str, Path] = {"bare": _bundle(work, "bare", None, None, None, [])}
            for tree, hook in hooks.items():
                for i, (label, host, devices, caps) in enumerate(CASES):
                    conf = work / (f"{tree}-{host}.toml" if args.resident else f"{tree}.toml")
                    text = f'cache_dir = "{work / ("cache-" + tree)}"\nlog_file = ""\n'
                    if args.resident and (tree, host) not in daemons:
                        sockdir = work / f"run-{tree}-{host}"
                        sockdir.mkdir(mode=0o700)
                        conf.write_text(text + f'[daemon]\nmode = "required"\nsocket = "{sockdir / "nvhookd.sock"}"\n')
                        daemons[tree, host] = subprocess.Popen(
                            [str(hook.parent / "nvhookd"), "--config", str(conf), "--root", str(root / host),
                             "--log-file", str(work / f"nvhookd-{tree}-{host}.log")])
                        while not (sockdir / "nvhookd.sock").exists():
                            if daemons[tree, host].poll() is not None:
                                raise SystemExit(f"{tree}'s nvhookd exited: see its log")
                            time.sleep(0.05)
                    elif not args.resident:
                        conf.write_text(text)
                    env = [] if devices is None else [
                        f"NVIDIA_VISIBLE_DEVICES={migs if devices == 'MIG' else devices}",
                        f"NVIDIA_DRIVER_CAPABILITIES={caps}"]
                    bundles[f"{tree}|{label}"] = _bundle(work, f"{tree}-{i}", hook, conf, root / host, env)
            for d in bundles.values():  # warm: inventory and NVML caches, page cache
                for _ in range(3):
                    _run(d, counter)
            time.sleep(1.5)  # nvhookd reaps its request children when idle
            for (tree, _), p in daemons.items():
                daemon_cpu[tree] = daemon_cpu.get(tree, 0.0) - bench._daemon_children_cpu_ms(p.pid)
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in bundles}
            order = list(bundles)
            shuffle = random.Random(11).shuffle
            for _ in range(args.n):
                shuffle(order)
                for k in order:
                    times[k].append(_run(bundles[k], counter))
                load.append(os.getloadavg()[0])
            time.sleep(1.5)
            for (tree, _), p in daemons.items():
                daemon_cpu[tree] += bench._daemon_children_cpu_ms(p.pid)
        finally:
            for p in daemons.values():
                p.terminate()
                p.wait(30)
    print(f"hook overhead over {args.n} rounds (container with hook - bare runc run in the same round)"
          f"{'; hooks served by nvhookd' if args.resident else ''};")
    print(f"this = {bench.REPO}, other = {args.other.resolve()}; 1-min load average min/median/max "
          f"{min(load):.1f}/{statistics.median(load):.1f}/{max(load):.1f} on {os.cpu_count()} CPUs")
    for tree, ms in daemon_cpu.items():
        print(f"{tree}: nvhookd request children's CPU {ms / (args.n * len(CASES)):.1f} ms per start "
              f"(not in the CPU ms below)")
    for i, what in enumerate(("wall-clock ms", "CPU ms")):
        bare = [t[i] for t in times["bare"]]
        print(f"\n{what}: bare runc run median {statistics.median(bare):.1f}")
        print(f"{'case':<46} {'this q1/med/q3':>20} {'other q1/med/q3':>20} {'this/other q1/med/q3':>22}")
        for label, *_ in CASES:
            a = [t[i] - b for t, b in zip(times[f"this|{label}"], bare)]
            o = [t[i] - b for t, b in zip(times[f"other|{label}"], bare)]
            ratio = [x / y for x, y in zip(a, o) if y > 0.5]
            fa, fo = _q(a), _q(o)
            fr = _q(ratio) if len(ratio) >= 2 else (float("nan"),) * 3
            print(f"{label:<46} {fa[0]:6.1f}/{fa[1]:6.1f}/{fa[2]:6.1f} {fo[0]:6.1f}/{fo[1]:6.1f}/{fo[2]:6.1f} "
                  f"  {fr[0]:5.2f}/{fr[1]:5.2f}/{fr[2]:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
