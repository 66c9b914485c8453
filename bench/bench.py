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
  resident  (--resident) the hook served by nvhookd against the in-process hook, same rounds
            (see bench_resident)
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


NVHOOKD = PY.parent / "nvhookd"


def _cpu_ms(usage) -> float:
    return (usage.ru_utime + usage.ru_stime) * 1000


def _daemon_children_cpu_ms(pid: int) -> float:
    """CPU time of the request children nvhookd `pid` has reaped (cutime + cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) * 1000 / os.sysconf("SC_CLK_TCK")


def _daemon_hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def bench_resident(work: Path, root: Path, n: int) -> dict:
    """Resident mode against in-process, in the same shuffled rounds: per GPU case, one bundle
    whose hook runs in-process ([daemon] mode = "off") and one served by an nvhookd of its own
    (warm on that case's host root), plus the bare start. Wall time per start (runc run, as
    the other cases), CPU time of runc and its hook (RUSAGE_CHILDREN) plus, for resident cases,
    the daemon's per-request children's CPU averaged over the run (reaped: /proc/PID/stat).
    Returns {"rounds": {case: [ms]}, "cpu": {case: [ms]}, "daemon": {case: {...}}}."""
    import resource

    migs = mig_uuids(root / "host-mig8x7")
    gpu_cases = [
        ("1 GPU, compute,utility", "host-gpu1", "0", "compute,utility"),
        ("8 GPUs, compute,utility", "host-gpu8", "all", "compute,utility"),
        ("8 GPUs, all capabilities", "host-gpu8", "all", "all"),
        ("8x7 MIG, compute,utility", "host-mig8x7", ",".join(migs), "compute,utility"),
        ("not a GPU container", "host-gpu8", None, None),
    ]
    bundles: dict[str, Bundle] = {"bare runc run": Bundle(work, "r-bare", [], None, work / "unused.log")}
    daemons: dict[str, subprocess.Popen] = {}
    try:
        for k, (label, host, devices, caps) in enumerate(gpu_cases):
            env = [] if devices is None else [f"NVIDIA_VISIBLE_DEVICES={devices}", f"NVIDIA_DRIVER_CAPABILITIES={caps}"]
            for mode in ("in-process", "resident"):
                sockdir = work / f"run{k}"
                sockdir.mkdir(mode=0o700, exist_ok=True)
                conf = work / f"r{k}-{mode}.toml"
                log = work / f"r{k}-{mode}.log"
                conf.write_text(f'log_file = "{log}"\ncache_dir = "{work / f"cache{k}"}"\n[daemon]\n'
                                f'mode = "{"off" if mode == "in-process" else "required"}"\n'
                                f'socket = "{sockdir / "nvhookd.sock"}"\n')
                b = Bundle(work, f"r{k}-{mode}", env, root / host, log)
                cfg = json.loads((b.dir / "config.json").read_text())
                cfg["hooks"]["prestart"][0]["args"][1:1] = ["--config", str(conf)]
                (b.dir / "config.json").write_text(json.dumps(cfg))
                bundles[f"{label}: {mode}"] = b
                if mode == "resident":  # the first request builds the inventory cache, the daemon keeps it
                    daemons[label] = subprocess.Popen([str(NVHOOKD), "--config", str(conf), "--root", str(root / host),
                                                       "--log-file", str(work / f"nvhookd{k}.log")])
                    while not (sockdir / "nvhookd.sock").exists():
                        time.sleep(0.05)
        for b in bundles.values():
            b.measure(3)  # warm
        time.sleep(1.5)  # nvhookd reaps its request children when idle
        cpu0 = {label: _daemon_children_cpu_ms(p.pid) for label, p in daemons.items()}
        rounds: dict[str, list[float]] = {k: [] for k in bundles}
        cpu: dict[str, list[float]] = {k: [] for k in bundles}
        order = list(bundles)
        shuffle = random.Random(11).shuffle
        floor_cmd = [str(PY), "-I", "-c", "pass"]
        rounds["floor: python -I -c pass"] = []
        for _ in range(n):
            rounds["floor: python -I -c pass"] += timed(floor_cmd, 1)
            shuffle(order)
            for label in order:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                rounds[label] += bundles[label].measure(1)
                cpu[label].append(_cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu_ms(before))
        time.sleep(1.5)  # nvhookd reaps its request children when idle
        daemon = {}
        for label, p in daemons.items():
            daemon[label] = {"cpu_ms_per_request": (_daemon_children_cpu_ms(p.pid) - cpu0[label]) / n,
                             "daemon_peak_rss_kb": _daemon_hwm_kb(p.pid)}
        for k, (label, *_) in enumerate(gpu_cases):
            ev = done_events(work / f"r{k}-resident.log")
            daemon[label]["request_peak_rss_kb"] = statistics.median(e.get("peak_rss_kb") or 0 for e in ev)
            daemon[label]["phases"] = median_phases(ev)
    finally:
        for p in daemons.values():
            p.terminate()
            p.wait(30)
    return {"rounds": rounds, "cpu": cpu, "daemon": daemon}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=30, help="repetitions per case (default 30)")
    ap.add_argument("--json", metavar="FILE", help="write raw figures as JSON")
    ap.add_argument("--wrapper", action="store_true", help="only nvhook-runtime against runc (bench_wrapper)")
    ap.add_argument("--resident", action="store_true", help="only nvhookd against in-process (bench_resident)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("runc"):
        raise SystemExit("bench needs root and runc")
    root = FIXTURES / "rootfs"
    subprocess.run([sys.executable, str(FIXTURES / "make_fixtures.py")], check=True, stdout=subprocess.DEVNULL)

    if args.resident:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            r = bench_resident(Path(tmp), root, args.n)
        bare, bare_cpu = r["rounds"]["bare runc run"], r["cpu"]["bare runc run"]
        print(f"{'resident vs in-process (' + str(args.n) + ' shuffled rounds)':<44} {'start min':>9} {'median':>8} "
              f"{'max':>8} {'overhead':>9} {'q1..q3':>13} {'cpu':>7}  ms")
        over: dict = {}
        for k, xs in r["rounds"].items():
            st = stats(xs)
            line = f"{k:<44} {st['min']:9.1f} {st['median']:8.1f} {st['max']:8.1f}"
            if k not in ("bare runc run", "floor: python -I -c pass"):
                d = sorted(x - b for x, b in zip(xs, bare, strict=True))
                c = statistics.median(x - b for x, b in zip(r["cpu"][k], bare_cpu, strict=True))
                label = k.rsplit(": ", 1)[0]
                if k.endswith("resident"):
                    c += r["daemon"][label]["cpu_ms_per_request"]
                q = statistics.quantiles(d, n=4)
                over[k] = {"overhead": statistics.median(d), "q1": q[0], "q3": q[2], "cpu": c}
                line += f" {over[k]['overhead']:9.1f} {q[0]:6.1f}..{q[2]:<6.1f} {c:7.1f}"
            print(line)
        print("overhead = median over rounds of (start with hook - bare start of the same round); cpu = median of")
        print("  per-round CPU differences (runc + hook), plus nvhookd's per-request child CPU for resident cases")
        for label, d in r["daemon"].items():
            res, inp = over[f"{label}: resident"], over[f"{label}: in-process"]
            print(f"  {label:<28} resident/in-process: overhead {res['overhead'] / inp['overhead']:.2f} x, "
                  f"cpu {res['cpu'] / inp['cpu']:.2f} x; nvhookd peak RSS {d['daemon_peak_rss_kb'] / 1024:.1f} MB, "
                  f"request child {d['request_peak_rss_kb'] / 1024:.1f} MB")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(r, overhead=over), indent=2))
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
