#!/usr/bin/env python3
"""Benchmark nvhook on the container-start path (`make bench`).

Everything is measured in one run on this machine, so the ratios compare like with like:
  floor     `python -I -c pass` with nvhook's interpreter
  baseline  `runc run` of a busybox `true` container, no hook
  hook      the same container with nvhook as prestart hook (--root = a fixture host), for
            1 GPU, 8 GPUs, and 8 GPUs x 7 MIG instances, capabilities compute,utility and all
  dry-run   `nvhook --dry-run --bundle` alone
  wrapper   (--wrapper) nvhook-runtime against runc itself: a pass-through `state`, and
            `create` of a container without and with a GPU request (see bench_wrapper)
  cdi       (--cdi) podman 4.3.1 + runc: `podman run` with GPU 0 from nvhook's CDI spec against
            the same with nvhook's OCI hooks dir (hook mode) and without a GPU; and
            `nvhook cdi generate` for 8 GPUs x 7 MIG against the interpreter floor (bench_cdi)
plus nvhook's own phases (medians over the runs) and peak RSS from its final log event (hook.done).

Needs root and runc. Prints a table and the ratios; --json FILE writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402

PY = Path(sys.executable)
NVHOOK = PY.parent / "nvhook"
WRAPPER = PY.parent / "nvhook-runtime"


def mig_uuids(host: Path) -> list[str]:
    conf = next(host.rglob("fake-nvml.conf"))
    return [line.split()[3] for line in conf.read_text().splitlines() if line.startswith("mig ")]


def timed(cmd: list[str], n: int, env=None, cwd=None, before=None) -> list[float]:
    out = []
    for _ in range(n):
        if before:
            before()
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out.append((time.perf_counter() - t) * 1000)
        if r.returncode != 0:
            raise SystemExit(f"benchmark command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.decode()}")
    return out


def stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


class Bundle:
    def __init__(self, work: Path, name: str, env: list[str], host: Path | None, log: Path):
        self.dir = work / name
        self.dir.mkdir()
        rootfs = make_fixtures.build_container("container-debian", self.dir)
        cfg = make_fixtures.oci_config(str(rootfs), ["PATH=/usr/bin:/bin", *env])
        cfg["process"]["args"] = ["/bin/true"]
        if host is not None:
            cfg["hooks"] = {"prestart": [{
                "path": str(NVHOOK),
                "args": ["nvhook", "--root", str(host), "--log-file", str(log), "prestart"],
                "env": ["PATH=/usr/bin:/bin"]}]}
        (self.dir / "config.json").write_text(json.dumps(cfg))
        self.count = 0

    def run_cmd(self) -> list[str]:
        self.count += 1
        return ["runc", "run", f"bench-{self.dir.name}-{os.getpid()}-{self.count}"]

    def measure(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            cmd = self.run_cmd()
            out += timed(cmd, 1, cwd=self.dir)
            subprocess.run(["runc", "delete", "-f", cmd[-1]], stderr=subprocess.DEVNULL)
        return out


def done_events(log: Path) -> list[dict]:
    """Every hook.done of a case's log; a hook.failed stops the benchmark with its error."""
    out = []
    for line in log.read_text().splitlines():
        ev = json.loads(line)
        if ev["event"] == "hook.failed":
            raise SystemExit(f"hook failed: {ev['error']}")
        if ev["event"] == "hook.done":
            out.append(ev)
    if not out:
        raise SystemExit("no hook.done event in the log")
    return out


def median_phases(events: list[dict]) -> dict:
    """Each phase's median over the runs; peak RSS as its median and its largest (the first,
    cold start builds the inventory cache with pyelftools)."""
    keys = {k for ev in events for k in ev["phases"]}
    out = {k: round(statistics.median(ev["phases"][k] for ev in events if k in ev["phases"]), 2) for k in keys}
    rss = [ev.get("peak_rss_kb") or 0 for ev in events]
    out["peak_rss_kb"] = statistics.median(rss)
    out["peak_rss_max_kb"] = max(rss)
    return out


def bench_wrapper(work: Path, host: Path, n: int) -> dict:
    """nvhook-runtime's cost, interleaved per round against runc itself (same bundles, same
    state root): `state` of a created container (the pass-through every engine pays on each
    state/start/kill/delete), `create` + `delete` of a container that asks for no GPU, and of
    one that asks for GPU 0 (wrapper edits config.json, its hook does the in-container part),
    compared with runc + nvhook as an ordinary prestart hook. Returns {case: [ms per round]}."""
    state = work / "wrapper-state"
    log = work / "wrapper.log"
    conf = work / "wrapper.toml"
    conf.write_text(f'root = "{host}"\nlog_file = "{log}"\n')
    env = {**os.environ, "NVHOOK_CONFIG": str(conf)}
    gpu0 = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
    plain = Bundle(work, "w-plain", [], None, log)
    gpu = Bundle(work, "w-gpu", gpu0, None, log)
    hooked = Bundle(work, "w-hook", gpu0, host, log)
    gpu_spec = (gpu.dir / "config.json").read_bytes()
    runc, wrap = ["runc", "--root", str(state)], [str(WRAPPER), "--root", str(state)]
    errors = work / "wrapper-stderr"

    def run(cmd: list[str]) -> list[float]:
        # Files, not pipes: a created container's init keeps its stdio open until it is deleted.
        with open(errors, "w+b") as err:
            t = time.perf_counter()
            r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            ms = (time.perf_counter() - t) * 1000
            if r.returncode != 0:
                err.seek(0)
                raise SystemExit(f"benchmark command failed ({r.returncode}): {' '.join(cmd)}\n{err.read().decode()}")
        return [ms]

    run([*runc, "create", "--bundle", str(plain.dir), "w-state"])

    def create(cmd: list[str], bundle: Path) -> list[float]:
        cid = f"w-{os.getpid()}-{time.monotonic_ns()}"
        try:
            return run([*cmd, "create", "--bundle", str(bundle), cid])
        finally:
            subprocess.run([*runc, "delete", "-f", cid], stderr=subprocess.DEVNULL)
            (gpu.dir / "config.json").write_bytes(gpu_spec)  # the wrapper edited it

    cases = {
        "state: runc": lambda: run([*runc, "state", "w-state"]),
        "state: nvhook-runtime (pass-through)": lambda: run([*wrap, "state", "w-state"]),
        "create, no GPU: runc": lambda: create(runc, plain.dir),
        "create, no GPU: nvhook-runtime": lambda: create(wrap, plain.dir),
        "create, GPU 0: runc + nvhook prestart hook": lambda: create(runc, hooked.dir),
        "create, GPU 0: nvhook-runtime (+ its in-container hook)": lambda: create(wrap, gpu.dir),
    }
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    for _ in range(3):  # warm: caches, page cache
        for f in cases.values():
            f()
    shuffle = random.Random(7).shuffle
    try:
        for _ in range(n):
            shuffle(order)
            for k in order:
                rounds[k] += cases[k]()
    finally:
        subprocess.run([*runc, "delete", "-f", "w-state"], stderr=subprocess.DEVNULL)
    return rounds


def bench_cdi(work: Path, root: Path, n: int) -> dict:
    """Interleaved rounds: `podman run --rm` of the Debian fixture image running /bin/true (no
    GPU), with `--device nvidia.com/gpu=0` from nvhook's CDI spec (runtime makes nodes, binds and
    cgroup rules; nvhook's createContainer hook the in-container part), and with
    NVIDIA_VISIBLE_DEVICES=0 through nvhook's OCI hooks dir (hook mode does everything); plus
    `nvhook cdi generate` for host-mig8x7 (129 devices) and `python -I -c pass`. Returns
    {case: [ms per round]}."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import cdibox
    import runcbox

    host = root / "host-gpu8"
    conf = runcbox.write_nvhook_config(work / "cdi.toml", log_file=work / "cdi.log", cache_dir=work / "cache")
    pm = cdibox.CdiPodman(work / "pm")
    hooks = runcbox.podman_hooks_dir(work / "hooks.d", work / "hooks.toml")
    runcbox.write_nvhook_config(work / "hooks.toml", log_file=work / "hooks.log", cache_dir=work / "cache2", root=host)
    r = cdibox.generate(pm.spec_dir / "nvhook.json", config=conf, host=host)
    if r.returncode:
        raise SystemExit(f"nvhook cdi generate failed: {r.stderr}")
    rootfs = make_fixtures.build_container("container-debian", work / "images")
    mig_out = work / "mig.json"
    gen = [str(NVHOOK), "--config", str(conf), "--root", str(root / "host-mig8x7"), "cdi", "generate",
           "--output", str(mig_out)]

    def podman(devices: list[str], env: dict | None = None, hooks_dir: bool = False) -> list[float]:
        if hooks_dir:  # the same podman, private namespace and options, with the OCI hooks dir
            pm.base.extend(["--hooks-dir", str(hooks)])
        try:
            t = time.perf_counter()
            p = pm.run(rootfs, "true", devices, env=env)
            ms = (time.perf_counter() - t) * 1000
        finally:
            if hooks_dir:
                del pm.base[-2:]
        if p.returncode:
            raise SystemExit(f"podman failed: {p.stderr}")
        return [ms]

    def generate() -> list[float]:
        mig_out.unlink(missing_ok=True)  # a real write each time
        return timed(gen, 1)

    gpu0 = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
    cases = {
        "podman run, no GPU": lambda: podman([]),
        "podman run --device nvidia.com/gpu=0 (CDI spec + nvhook createContainer hook)":
            lambda: podman(["nvidia.com/gpu=0"]),
        "podman run -e NVIDIA_VISIBLE_DEVICES=0 (nvhook OCI hooks dir, hook mode)":
            lambda: podman([], env=gpu0, hooks_dir=True),
        "nvhook cdi generate, 8 GPUs x 7 MIG (129 devices)": generate,
        "floor: python -I -c pass": lambda: timed([str(PY), "-I", "-c", "pass"], 1),
    }
    rounds: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    try:
        for f in cases.values():  # warm
            f()
        shuffle = random.Random(11).shuffle
        for _ in range(n):
            shuffle(order)
            for k in order:
                rounds[k] += cases[k]()
    finally:
        pm.close()
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=30, help="repetitions per case (default 30)")
    ap.add_argument("--json", metavar="FILE", help="write raw figures as JSON")
    ap.add_argument("--wrapper", action="store_true", help="only nvhook-runtime against runc (bench_wrapper)")
    ap.add_argument("--cdi", action="store_true", help="only podman with a CDI spec against hook mode (bench_cdi)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("runc"):
        raise SystemExit("bench needs root and runc")
    root = FIXTURES / "rootfs"
    subprocess.run([sys.executable, str(FIXTURES / "make_fixtures.py")], check=True, stdout=subprocess.DEVNULL)

    if args.cdi:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            w = bench_cdi(Path(tmp), root, args.n)
        print(f"{'CDI (' + str(args.n) + ' rounds)':<80} {'min':>8} {'median':>8} {'max':>8}  ms")
        for k, xs in w.items():
            st = stats(xs)
            print(f"{k:<80} {st['min']:8.1f} {st['median']:8.1f} {st['max']:8.1f}")
        keys = list(w)
        print("median of per-round differences against podman run without a GPU:")
        for k in keys[1:3]:
            d = statistics.median(x - y for x, y in zip(w[k], w[keys[0]], strict=True))
            print(f"  {k}: {d:+.1f} ms")
        d = statistics.median(x - y for x, y in zip(w[keys[1]], w[keys[2]], strict=True))
        print(f"  CDI against hook mode: {d:+.1f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps({"cdi_rounds": w}, indent=2))
        return 0

    if args.wrapper:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            w = bench_wrapper(Path(tmp), root / "host-gpu8", args.n)
        print(f"{'nvhook-runtime vs runc (' + str(args.n) + ' rounds)':<62} {'min':>8} {'median':>8} {'max':>8}  ms")
        for k, xs in w.items():
            st = stats(xs)
            print(f"{k:<62} {st['min']:8.1f} {st['median']:8.1f} {st['max']:8.1f}")
        print("median of per-round differences:")
        for a, b in (("state: nvhook-runtime (pass-through)", "state: runc"),
                     ("create, no GPU: nvhook-runtime", "create, no GPU: runc"),
                     ("create, GPU 0: nvhook-runtime (+ its in-container hook)",
                      "create, GPU 0: runc + nvhook prestart hook")):
            d = statistics.median(x - y for x, y in zip(w[a], w[b], strict=True))
            print(f"  {a}: {d:+.1f} ms against {b}")
        if args.json:
            Path(args.json).write_text(json.dumps({"wrapper_rounds": w}, indent=2))
        return 0

    results: dict = {}
    rounds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
        work = Path(tmp)
        migs = mig_uuids(root / "host-mig8x7")
        cases = [
            ("baseline: runc run (no hook)", None, None, None),
            ("runc run with /bin/true as prestart hook", "true", None, None),
            ("hook: 1 GPU, compute,utility", "host-gpu1", "0", "compute,utility"),
            ("hook: 8 GPUs, compute,utility", "host-gpu8", "all", "compute,utility"),
            ("hook: 8 GPUs, all capabilities", "host-gpu8", "all", "all"),
            ("hook: 8x7 MIG (112 cap devices), compute,utility", "host-mig8x7", ",".join(migs), "compute,utility"),
            ("hook: 8x7 MIG, all capabilities", "host-mig8x7", ",".join(migs), "all"),
            ("hook: not a GPU container (NVIDIA_VISIBLE_DEVICES unset)", "host-gpu8", None, None),
        ]
        bundles = {}
        for k, (label, host, devices, caps) in enumerate(cases):
            env = [] if devices is None else [f"NVIDIA_VISIBLE_DEVICES={devices}", f"NVIDIA_DRIVER_CAPABILITIES={caps}"]
            log = work / f"nvhook-{k}.log"
            b = Bundle(work, f"c{k}", env, None if host in (None, "true") else root / host, log)
            if host == "true":  # what runc charges for running any hook (fork/exec, stdin, wait)
                cfg = json.loads((b.dir / "config.json").read_text())
                cfg["hooks"] = {"prestart": [{"path": shutil.which("true"), "args": ["true"]}]}
                (b.dir / "config.json").write_text(json.dumps(cfg))
            b.measure(3)  # warm: inventory and NVML caches, page cache
            bundles[label] = (b, log, devices is not None)
        floor_cmd = [str(PY), "-I", "-c", "pass"]
        timed(floor_cmd, 3)
        # Rounds: every case runs once per round, in a shuffled order, so all of them see the
        # same load on the machine; overheads are medians of per-round differences against the
        # bare start.
        order = list(bundles)
        shuffle = random.Random(42).shuffle  # a new order each round: no case always runs first
        for _ in range(args.n):
            rounds.setdefault("floor: python -I -c pass", []).extend(timed(floor_cmd, 1))
            shuffle(order)
            for label in order:
                rounds.setdefault(label, []).extend(bundles[label][0].measure(1))
        rounds = {k: rounds[k] for k in ["floor: python -I -c pass", *bundles]}
        for label, xs in rounds.items():
            results[label] = stats(xs)
        phases = {}
        for label, (_b, log, gpu) in bundles.items():
            if gpu:
                phases[label[6:]] = median_phases(done_events(log))

        dry = Bundle(work, "dry", ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"], None,
                     work / "dry.log")
        results["dry-run alone (8 GPUs, text)"] = stats(timed(
            [str(NVHOOK), "--root", str(root / "host-gpu8"), "--log-file", "", "--dry-run", "--bundle", str(dry.dir)],
            args.n))

    floor = results["floor: python -I -c pass"]["median"]
    base = results["baseline: runc run (no hook)"]["median"]
    print(f"{'case':<62} {'min':>8} {'median':>8} {'max':>8}  ms")
    for k, v in results.items():
        print(f"{k:<62} {v['min']:8.1f} {v['median']:8.1f} {v['max']:8.1f}")
    print()
    bare = rounds["baseline: runc run (no hook)"]

    def paired(label: str) -> float:
        return statistics.median(x - b for x, b in zip(rounds[label], bare))

    any_hook = paired("runc run with /bin/true as prestart hook")
    print("hook overhead = median over rounds of (container with hook - bare runc run in the same round)")
    print(f"  (runc's own cost of running any prestart hook, /bin/true: {any_hook:.1f} ms)")
    overhead = {}
    for k in results:
        if k.startswith("hook: "):
            o = paired(k)
            overhead[k[6:]] = o
            print(f"  {k[6:]:<58} {o:7.1f} ms  = {o / floor:5.2f} x floor, {o / base:5.2f} x bare runc start")
    one, mig = "1 GPU, compute,utility", "8x7 MIG (112 cap devices), compute,utility"
    print(f"  112 MIG cap devices / 1 GPU: {overhead[mig] / overhead[one]:.2f} x")
    print()
    print(f"nvhook phases (ms, medians over every run of a case, from hook.done; peak RSS in kB, median and")
    print(f"  largest, the largest being the cold start that builds the inventory cache);")
    print(f"  before them, the interpreter's own start: about the floor, {floor:.1f} ms;")
    print("  apply_child_imports_ms runs in the apply worker while discover and decide run, and")
    print("  apply_ldconfig_ms overlaps the device/procfs part of apply_mounts_ms:")
    keys = sorted({k for p in phases.values() for k in p})
    for label, p in phases.items():
        print(f"  {label}")
        print("    " + ", ".join(f"{k}={p[k]}" for k in keys if k in p))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "overhead_ms": overhead, "phases": phases,
                                               "floor_ms": floor, "baseline_ms": base, "any_hook_ms": any_hook,
                                               "rounds": rounds},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
