#!/usr/bin/env python3
"""Benchmark nvhook on the container-start path (`make bench`).

Everything is measured in one run on this machine, so the ratios compare like with like:
  floor     `python -I -c pass` with nvhook's interpreter (--launcher: that launcher's)
  baseline  `runc run` of a busybox `true` container, no hook
  hook      the same container with nvhook as prestart hook (--root = a fixture host), for
            1 GPU, 8 GPUs, and 8 GPUs x 7 MIG instances, capabilities compute,utility and all
  dry-run   `nvhook --dry-run --bundle` alone
  real /proc the GPU cases again on the path of a host with the NVIDIA kernel module: a first
            prestart hook (bench/procdriver_hook.c) binds the fixture's proc/driver onto the
            container's /proc/driver; their baseline is a container with that hook alone
  reference (--reference DIR) NVIDIA's legacy chain, nvidia-container-runtime-hook +
            nvidia-container-cli built from NVIDIA's sources into DIR (see docs/performance.md, "Side
            by side with NVIDIA's hook"), on the same fixture hosts through a config.toml
            (`root`), real /proc path (nvidia-container-cli needs /proc/driver/nvidia), and
            its early return for a container that asks for no GPU
  wrapper   (--wrapper) nvhook-runtime against runc itself: a pass-through `state`, and
            `create` of a container without and with a GPU request (see bench_wrapper)
  cdi       (--cdi) podman 4.3.1 + runc: `podman run` with GPU 0 from nvhook's CDI spec against
            the same with nvhook's OCI hooks dir (hook mode) and without a GPU; and
            `nvhook cdi generate` for 8 GPUs x 7 MIG against the interpreter floor (bench_cdi)
  cdi-runc  (--cdi-runc [SCRATCH]) a CDI start under runc without podman: each spec's edits for
            GPU 2 of host-gpu8 applied to one config.json by bench/cdirunc.py (nvhook's spec with
            its hook, nvhook's --no-hook spec, nvidia-ctk 1.17.0/1.18.0's specs from SCRATCH with
            NVIDIA's hooks and with nvhook's nvidia-cdi-hook, its python first stage (one process
            per entry) and its shell first stage (one per run of entries)), against the same
            start without a GPU; --python /usr/bin/python3 runs nvhook's hooks as the Debian
            package does
  cdi-gen   (--cdi-generate) `nvhook cdi generate` for host-gpu8 against the interpreter
            floors and (--reference-cdi DIR) nvidia-ctk's
  resident  (--resident) the hook served by nvhookd against the in-process hook, same rounds
            (see bench_resident); (--resident-client) the hook run directly, without runc,
            against a warm nvhookd, in-process and the bare interpreter: the client's own
            cost, without runc's (see bench_resident_client)
  hook-cpu  (--hook-cpu, with --reference DIR for the side by side) each hook process alone, run
            directly with an OCI state on stdin against a fresh process in a private mount
            namespace of its own (the container's stand-in; both hooks mount into it for real),
            no runc: the CPU time of the hook and everything it waited for (wait4), without
            runc's share and its noise (see bench_hook_cpu)
plus nvhook's own phases (medians over the runs) and peak RSS from its final log event (hook.done).

Every run's CPU time is the children's rusage (runc, its init, the hooks and what they start)
around it. Overheads are medians of per-round differences against the case's baseline, with
their interquartile range; ratios carry a bootstrap 95% interval (rounds resampled, pairs kept).

Needs root and runc (and gcc for the real /proc cases). Prints a table and the ratios, the
side-by-side ones last; --json FILE writes the raw figures.
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

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
sys.path[:0] = [str(FIXTURES), str(REPO / "tests" / "e2e")]
import make_fixtures  # noqa: E402
import privaterun  # noqa: E402

PY = Path(sys.executable)
NVHOOK = PY.parent / "nvhook"
WRAPPER = PY.parent / "nvhook-runtime"


def mig_uuids(host: Path) -> list[str]:
    conf = next(host.rglob("fake-nvml.conf"))
    return [line.split()[3] for line in conf.read_text().splitlines() if line.startswith("mig ")]


def start_cases(root: Path) -> list[tuple[str, str, str | None, str | None]]:
    """(label, fixture host, NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES) of the starts
    --resident and --hook-cpu measure; None: the variable is unset."""
    migs = ",".join(mig_uuids(root / "host-mig8x7"))
    return [
        ("1 GPU, compute,utility", "host-gpu1", "0", "compute,utility"),
        ("8 GPUs, compute,utility", "host-gpu8", "all", "compute,utility"),
        ("8 GPUs, all capabilities", "host-gpu8", "all", "all"),
        ("8x7 MIG (112 cap devices), compute,utility", "host-mig8x7", migs, "compute,utility"),
        ("not a GPU container", "host-gpu8", None, None),
    ]


def _children_cpu_ms() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime + ru.ru_stime) * 1000


# CPU time (ms) of each command timed() ran, in order: the rusage of the children reaped meanwhile.
CPU: list[float] = []


def timed(cmd: list[str], n: int, env=None, cwd=None, before=None) -> list[float]:
    out = []
    for _ in range(n):
        if before:
            before()
        c = _children_cpu_ms()
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out.append((time.perf_counter() - t) * 1000)
        CPU.append(_children_cpu_ms() - c)
        if r.returncode != 0:
            raise SystemExit(f"benchmark command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.decode()}")
    return out


def stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


class Bundle:
    """A busybox `true` container; `host` given: nvhook (or with `reference`, NVIDIA's hook
    with that config.toml) as its prestart hook; `procdriver` given: that hook binary first,
    binding `host`'s proc/driver onto the container's /proc/driver."""

    def __init__(self, work: Path, name: str, env: list[str], host: Path | None, log: Path,
                 procdriver: Path | None = None, reference: tuple[Path, Path] | None = None,
                 main_hook: bool = True, nvhook: tuple[Path, list[str]] = (NVHOOK, [])):
        self.dir = work / name
        self.dir.mkdir()
        rootfs = make_fixtures.build_container("container-debian", self.dir)
        cfg = make_fixtures.oci_config(str(rootfs), ["PATH=/usr/bin:/bin", *env])
        cfg["process"]["args"] = ["/bin/true"]
        hooks = []
        if procdriver is not None:
            assert host is not None
            hooks.append({"path": str(procdriver),
                          "args": ["procdriver-hook", str(host / "proc" / "driver"), str(rootfs)]})
        if not main_hook:
            pass
        elif reference is not None:
            ref_dir, ref_config = reference
            hooks.append({"path": str(ref_dir / "nvidia-container-runtime-hook"),
                          "args": ["nvidia-container-runtime-hook", "-config", str(ref_config), "prestart"],
                          "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]})
        elif host is not None:
            hooks.append({
                "path": str(nvhook[0]),
                # the interpreter itself (python -IS launcher): argv[0] must name it, Python
                # finds its venv from there
                "args": [str(nvhook[0]) if nvhook[0] == PY else "nvhook", *nvhook[1],
                         "--root", str(host), "--log-file", str(log), "prestart"],
                "env": ["PATH=/usr/bin:/bin"]})
        if hooks:
            cfg["hooks"] = {"prestart": hooks}
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
    cpu = [ev["cpu_ms"] for ev in events if "cpu_ms" in ev]
    if cpu:  # the hook's own CPU time (it and its children, the interpreter's start included)
        out["hook_cpu_ms"] = statistics.median(cpu)
        out["hook_cpu_iqr_ms"] = [round(q, 1) for q in quartiles(cpu)] if len(cpu) > 1 else [cpu[0], cpu[0]]
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


def bench_cdi_nvidia(work: Path, root: Path, n: int, ref: Path) -> dict:
    """Side by side with NVIDIA's CDI tools built by bench/build_reference_cdi.sh (REF = its
    TAG directory): `cdi generate` for host-gpu8 by nvhook and by nvidia-ctk (which reads the
    MIG minors from /proc/driver/nvidia-caps whatever --driver-root says, so it runs in a
    private mount namespace that puts the fixture's there: that wrapper alone is a case too),
    and `podman run --device nvidia.com/gpu=0` (podman 4.3.1 + runc, /bin/true) with nvhook's
    spec and hook, nvidia-ctk's spec and NVIDIA's hooks, and nvidia-ctk's spec with nvhook's
    nvidia-cdi-hook (tests/e2e/cdihookbox.py's first stage); plus the same podman without a GPU.
    Returns {"wall": {case: [ms]}, "cpu": {case: [ms]}}: CPU is the children's rusage (podman,
    conmon, runc, the hooks), less sensitive than wall time to a busy machine."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import cdibox
    import cdihookbox
    import runcbox

    host = root / "host-gpu8"
    conf = runcbox.write_nvhook_config(work / "cdi.toml", log_file=work / "cdi.log", cache_dir=work / "cache")
    ours = cdibox.CdiPodman(work / "pm-nvhook")
    r = cdibox.generate(ours.spec_dir / "nvhook.json", config=conf, host=host)
    if r.returncode:
        raise SystemExit(f"nvhook cdi generate failed: {r.stderr}")
    theirs = cdibox.CdiPodman(work / "pm-nvidia")
    mixed = cdibox.CdiPodman(work / "pm-mixed")
    hook = cdihookbox.first_stage(work / "first-stage")
    for pm, path in ((theirs, str(ref / "nvidia-cdi-hook")), (mixed, str(hook))):
        g = cdihookbox.nvidia_ctk_generate(ref, host, path)
        if g.returncode:
            raise SystemExit(f"nvidia-ctk cdi generate failed: {g.stderr}")
        spec = json.loads(g.stdout)
        spec["cdiVersion"] = min(spec["cdiVersion"], "0.5.0")  # podman 4.3.1's CDI knows up to 0.5.0
        if pm is mixed:
            for h in spec["containerEdits"]["hooks"]:
                h["args"][1:1] = ["--nvhook-config", str(conf)]
        (pm.spec_dir / "nvidia.json").write_text(json.dumps(spec))
    rootfs = make_fixtures.build_container("container-debian", work / "images")
    out = work / "gen.json"
    gen = [str(NVHOOK), "--config", str(conf), "--root", str(host), "cdi", "generate", "--output", str(out)]
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", cdihookbox._PROC, "sh"]
    ctk_cmd = [*wrap, str(ref / "nvidia-ctk"), "cdi", "generate", "--driver-root", str(host), "--dev-root", str(host),
               "--nvidia-cdi-hook-path", str(hook), "--format", "json", "--output", str(work / "ctk.json")]
    env = dict(os.environ, H=str(host))
    cpu: dict[str, list[float]] = {}

    def run(cmd: list[str], label: str) -> list[float]:
        c = _children_cpu_ms()
        t = time.perf_counter()
        p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ms = (time.perf_counter() - t) * 1000
        cpu.setdefault(label, []).append(_children_cpu_ms() - c)
        if p.returncode:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr.decode()}")
        return [ms]

    def podman(pm, devices: list[str], label: str) -> list[float]:
        c = _children_cpu_ms()
        t = time.perf_counter()
        p = pm.run(rootfs, "true", devices)
        ms = (time.perf_counter() - t) * 1000
        cpu.setdefault(label, []).append(_children_cpu_ms() - c)
        if p.returncode:
            raise SystemExit(f"podman failed: {p.stderr}")
        return [ms]

    cases = {
        "generate 8 GPUs: nvhook": lambda k: run(gen, k),
        "generate 8 GPUs: nvidia-ctk (in its /proc wrapper)": lambda k: run(ctk_cmd, k),
        "generate: the /proc wrapper alone": lambda k: run([*wrap, "true"], k),
        "floor: python -I -c pass": lambda k: run([str(PY), "-I", "-c", "pass"], k),
        "podman, no GPU": lambda k: podman(ours, [], k),
        "podman gpu=0: nvhook spec + nvhook hook": lambda k: podman(ours, ["nvidia.com/gpu=0"], k),
        "podman gpu=0: nvidia-ctk spec + NVIDIA hooks": lambda k: podman(theirs, ["nvidia.com/gpu=0"], k),
        "podman gpu=0: nvidia-ctk spec + nvhook nvidia-cdi-hook": lambda k: podman(mixed, ["nvidia.com/gpu=0"], k),
    }
    wall: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    try:
        for k, f in cases.items():  # warm
            f(k)
        cpu.clear()
        shuffle = random.Random(13).shuffle
        for _ in range(n):
            shuffle(order)
            for k in order:
                wall[k] += cases[k](k)
    finally:
        for pm in (ours, theirs, mixed):
            pm.close()
    return {"wall": wall, "cpu": cpu}


def bench_cdi_runc(work: Path, root: Path, n: int, scratch: Path | None, extra_nvhook: dict | None = None,
                   python: str | None = None) -> dict:
    """A CDI start under runc, each spec's edits applied to the same config.json by
    bench/cdirunc.py (see there): no GPU (the baseline), nvhook's spec + hook for GPU 2 of
    host-gpu8, and with `scratch` (bench/build_reference_cdi.sh's dir) nvidia-ctk's spec for
    the same host and GPU with NVIDIA's hooks and with nvhook's nvidia-cdi-hook (its python
    first stage, and the shell first stage that the .deb ships), per tag there.
    `extra_nvhook`: more nvhook specs, {label: extra `cdi generate` arguments}. `python`: the
    hooks (nvhook's and its nvidia-cdi-hook) run under that interpreter with -IS, as the Debian
    package runs them (its nvidia-cdi-hook first stage a set-group-ID copy of it), instead of
    the venv's launchers.
    Returns {"wall": {case: [ms]}, "cpu": {case: [ms]}}."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    sys.path.insert(0, str(REPO / "bench"))
    import cdibox
    import cdihookbox
    import cdirunc
    import runcbox

    host = root / "host-gpu8"
    # GPU 2: nvidia-ctk 1.18 lists no whole-GPU device for the fixture's MIG-enabled GPUs 0 and 1
    GPU = "2"
    image = make_fixtures.build_container("container-debian", work / "images")
    procdriver = build_procdriver_hook(work)
    if procdriver is None:
        raise SystemExit("--cdi-runc needs gcc for bench/procdriver_hook.c")
    conf = runcbox.write_nvhook_config(work / "cdi.toml", log_file=work / "cdi.log", cache_dir=work / "cache")
    base = make_fixtures.oci_config(str(image), ["PATH=/usr/bin:/bin"])
    base["process"]["args"] = ["/bin/true"]
    specs: dict[str, tuple[dict, list[str]]] = {"no GPU": ({"devices": [], "containerEdits": {}}, [])}
    hook_path = [] if python is None else ["--hook-path", str(system_launcher(work, python))]
    for label, extra in {"nvhook spec + nvhook hook": [], **(extra_nvhook or {})}.items():
        out = work / f"nvhook-{len(specs)}.json"
        r = cdibox.generate(out, config=conf, host=host, extra=[*hook_path, *extra])
        if r.returncode:
            raise SystemExit(f"nvhook cdi generate failed: {r.stderr}")
        specs[label] = (json.loads(out.read_text()), [GPU])
    if python is None:
        hook = cdihookbox.first_stage(work / "first-stage")
    else:  # the .deb's first stage: a set-group-ID copy of the interpreter (docs/cdi-hook.md)
        (work / "first-stage").mkdir()
        interp = work / "first-stage" / "python3"
        shutil.copy2(os.path.realpath(python), interp)
        os.chown(interp, 0, cdihookbox.TEST_GROUP)
        os.chmod(interp, 0o2711)
        plain = system_launcher(work, python, "nvidia-cdi-hook")
        hook = work / "first-stage" / "nvidia-cdi-hook"
        hook.write_text(f"#!{interp} -IS\n" + plain.read_text().split("\n", 1)[1])
        hook.chmod(0o755)
    # the .deb's hook path since issue 26: the shell first stage, one Python process per run of entries
    shell_hook = cdihookbox.shell_first_stage(work / "first-stage", python=python)
    for tag in ("v1.17.0", "v1.18.0"):
        ref = scratch / tag if scratch else None
        if ref is None or not (ref / "nvidia-ctk").exists():
            continue
        for label, path in ((f"NVIDIA {tag} spec + NVIDIA hooks", str(ref / "nvidia-cdi-hook")),
                            (f"NVIDIA {tag} spec + nvhook nvidia-cdi-hook (python first stage)", str(hook)),
                            (f"NVIDIA {tag} spec + nvhook nvidia-cdi-hook (shell first stage)", str(shell_hook))):
            g = cdihookbox.nvidia_ctk_generate(ref, host, path)
            if g.returncode:
                raise SystemExit(f"nvidia-ctk cdi generate failed: {g.stderr}")
            spec = json.loads(g.stdout)
            if path != str(ref / "nvidia-cdi-hook"):
                for h in spec["containerEdits"]["hooks"]:
                    h["args"][1:1] = ["--nvhook-config", str(conf)]
            specs[label] = (spec, [GPU])
    cases = {}
    for k, (label, (spec, devices)) in enumerate(specs.items()):
        case_dir = work / "cases" / f"c{k}"
        cfg = cdirunc.apply_cdi(base, spec, devices)
        # the real-host /proc/driver, for both sides (bench/cdirunc.py's docstring)
        cfg.setdefault("hooks", {})["prestart"] = [
            {"path": str(procdriver),
             "args": ["procdriver-hook", str(host / "proc" / "driver"), str(case_dir / "rootfs")]},
            {"path": str(procdriver), "args": ["procdriver-hook", str(host / "proc" / "driver"), ""]},
            # params on procfs, as on a real host, where nvhook's disable-device-node-modification
            # checks that it mounts over a procfs file
            {"path": str(procdriver), "args": ["procdriver-hook", "/proc/version", str(case_dir / "rootfs"),
                                               "/proc/driver/nvidia/params"]}]
        cases[label] = cdirunc.Case(work / "cases", f"c{k}", image, cfg)
    return cdirunc.run_rounds(cases, n, _children_cpu_ms)


def system_launcher(work: Path, python: str, script: str = "nvhook") -> Path:
    """bin/`script` with `python` (e.g. the distribution's /usr/bin/python3) on its #! line,
    reading nvhook from this checkout's installed tree: the form the Debian package ships
    (`#!/usr/bin/python3 -IS`, nvhook beside it), without building the package."""
    # the editable install's tree (it holds the start-path bundle), else the checkout
    pkg = next(iter(sorted((REPO / "build").glob("__editable__.nvhook-*"))), REPO)
    body = (REPO / "bin" / script).read_text().split("\n", 1)[1]
    out = work / f"{script}-{Path(python).name}"
    out.write_text(f"#!{python} -IS\nimport sys\nsys.path.insert(0, {str(pkg)!r})\n{body}")
    out.chmod(0o755)
    return out


def bench_cdi_generate(work: Path, root: Path, n: int, ref: Path | None, python: str | None) -> dict:
    """`nvhook cdi generate` for host-gpu8 (the venv's launcher, and with `python` the same code
    under that interpreter as the Debian package runs it), the interpreter floors, and with
    `ref` (bench/build_reference_cdi.sh's TAG dir) nvidia-ctk's generate in its /proc wrapper
    and the wrapper alone. CPU is the children's rusage. Returns {"wall": .., "cpu": ..}."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import cdihookbox

    host = root / "host-gpu8"
    conf = work / "gen.toml"
    conf.write_text(f'log_file = "{work / "gen.log"}"\ncache_dir = "{work / "cache"}"\n')
    gen = ["--config", str(conf), "--root", str(host), "cdi", "generate"]
    cmds = {"floor: python -I -c pass (venv)": [str(PY), "-I", "-c", "pass"],
            "floor: python -I -S -c pass (venv)": [str(PY), "-I", "-S", "-c", "pass"],
            "nvhook cdi generate (venv launcher)": [str(NVHOOK), *gen, "--output", str(work / "a.json")]}
    if python:
        cmds[f"floor: {python} -I -S -c pass"] = [python, "-I", "-S", "-c", "pass"]
        launcher = str(system_launcher(work, python))
        cmds[f"nvhook cdi generate ({python} -IS)"] = [launcher, *gen, "--output", str(work / "b.json"),
                                                       "--hook-path", launcher]
    if ref is not None:
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", cdihookbox._PROC, "sh"]
        cmds["nvidia-ctk cdi generate (in its /proc wrapper)"] = [
            *wrap, str(ref / "nvidia-ctk"), "cdi", "generate", "--driver-root", str(host), "--dev-root", str(host),
            "--format", "json", "--output", str(work / "ctk.json")]
        cmds["the /proc wrapper alone"] = [*wrap, "true"]
    env = dict(os.environ, H=str(host))
    env.pop("NVHOOK_CONFIG", None)
    wall: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    order = list(cmds)
    for k in order:  # warm: the inventory cache, the page cache
        subprocess.run(cmds[k], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shuffle = random.Random(11).shuffle
    for _ in range(n):
        shuffle(order)
        for k in order:
            c = _children_cpu_ms()
            t = time.perf_counter()
            p = subprocess.run(cmds[k], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            wall[k].append((time.perf_counter() - t) * 1000)
            cpu[k].append(_children_cpu_ms() - c)
            if p.returncode:
                raise SystemExit(f"{k} failed: {p.stderr.decode()[-1000:]}")
    return {"wall": wall, "cpu": cpu}


def run_floor(py: Path, n: int) -> float:
    """Median CPU ms of `py -I -c pass` over `n` runs."""
    xs = []
    for _ in range(n):
        c = _children_cpu_ms()
        subprocess.run([str(py), "-I", "-c", "pass"], check=True)
        xs.append(_children_cpu_ms() - c)
    return statistics.median(xs)


def print_side_by_side(res: dict, pairs: list[tuple[str, str]]) -> dict:
    """Medians with IQR per case, and for each pair a ratio of medians with a bootstrap 95%
    interval (rounds resampled, pairs kept), wall and CPU."""
    rng = random.Random(3)
    out: dict = {}
    for kind in ("wall", "cpu"):
        print(f"{kind} ms: median [q1..q3]")
        for k, xs in res[kind].items():
            q = statistics.quantiles(xs, n=4)
            print(f"  {k:<58} {statistics.median(xs):7.1f} [{q[0]:6.1f}..{q[2]:6.1f}]")
        for a, b in pairs:
            xa, xb = res[kind][a], res[kind][b]
            m = len(xa)
            boot = sorted(statistics.median([xa[i] for i in idx]) / statistics.median([xb[i] for i in idx])
                          for idx in ([rng.randrange(m) for _ in range(m)] for _ in range(1000)))
            r = statistics.median(xa) / statistics.median(xb)
            out[f"{kind}: {a} / {b}"] = {"ratio": r, "ci95": (boot[25], boot[974])}
            print(f"  ratio {a} / {b}: {r:.2f} x [{boot[25]:.2f}..{boot[974]:.2f}]")
    return out


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

    gpu_cases = start_cases(root)
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


def bench_resident_client(work: Path, root: Path, n: int, nogpu: bool) -> dict:
    """The hook process alone: run directly with an OCI state on stdin (a real process in a
    mount namespace of its own stands for the container, host-gpu1's GPU 0, or no GPU),
    interleaved with the same hook in-process and `python [-IS] -c pass`. CPU: the hook's
    rusage; for the resident case, nvhookd's per-request children apart (reaped, averaged)."""
    rootfs = make_fixtures.build_container("container-debian", work / "images")
    env = [] if nogpu else ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
    bundle = work / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(make_fixtures.oci_config(str(rootfs), ["PATH=/bin", *env])))
    rundir = work / "rundir"
    rundir.mkdir(mode=0o700)
    hook_env = {"PATH": "/usr/bin:/bin", "NVHOOK_RUN_DIR": str(rundir)}  # a hook's environment
    target = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "3600"])
    daemon = None
    try:
        time.sleep(0.3)
        state = json.dumps({"ociVersion": "1.0.2", "id": "bench", "status": "created", "pid": target.pid,
                            "bundle": str(bundle)}).encode()
        cases: dict[str, list[str]] = {}
        for mode in ("off", "required"):
            (work / mode).mkdir(mode=0o700)
            conf = work / mode / "hook.toml"
            conf.write_text(f'log_file = "{work / mode / "log"}"\ncache_dir = "{work / "cache"}"\n[daemon]\n'
                            f'mode = "{mode}"\nsocket = "{work / mode / "s.sock"}"\n')
            cases["in-process" if mode == "off" else "resident (client)"] = [
                str(NVHOOK), "--config", str(conf), "--root", str(root / "host-gpu1"), "prestart"]
            if mode == "required":
                daemon = subprocess.Popen([str(NVHOOKD), "--config", str(conf), "--root", str(root / "host-gpu1"),
                                           "--log-file", str(work / "nvhookd.log")], env=hook_env)
                while not (work / mode / "s.sock").exists():
                    time.sleep(0.05)
        cases["floor: python -c pass"] = [str(PY), "-c", "pass"]
        cases["floor: python -IS -c pass"] = [str(PY), "-IS", "-c", "pass"]
        for cmd in cases.values():  # warm: caches, .pyc
            for _ in range(3):
                subprocess.run(cmd, input=state, env=hook_env, capture_output=True, check=True)
        time.sleep(1.5)
        assert daemon is not None
        d0 = _daemon_children_cpu_ms(daemon.pid)
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        wall: dict[str, list[float]] = {k: [] for k in cases}
        order = list(cases)
        for _ in range(n):
            random.shuffle(order)
            for k in order:
                before = _cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN))
                t = time.perf_counter()
                p = subprocess.run(cases[k], input=state, env=hook_env, capture_output=True)
                wall[k].append((time.perf_counter() - t) * 1000)
                cpu[k].append(_cpu_ms(resource.getrusage(resource.RUSAGE_CHILDREN)) - before)
                if p.returncode != 0:
                    raise SystemExit(f"{k}: exit {p.returncode}: {p.stderr.decode()}")
        time.sleep(1.5)  # nvhookd reaps its request children when idle
        return {"cpu": cpu, "wall": wall, "daemon_child_cpu_ms": (_daemon_children_cpu_ms(daemon.pid) - d0) / n}
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        target.kill()
        target.wait()


def bench_hook_cpu(work: Path, root: Path, n: int, reference: Path | None,
                   compare: Path | None = None) -> dict:
    """Each hook process alone, side by side: per case (1 GPU, 8 GPUs, 8 GPUs with all
    capabilities, 8x7 MIG, no GPU), nvhook (this launcher, --root the fixture host) and, with
    `reference`, NVIDIA's hook (its config.toml naming the same host), each run directly with
    an OCI state on stdin whose pid is a fresh `unshare --mount` process (a new one per run:
    both hooks really mount into its namespace, which dies with it). CPU: the hook process's
    rusage from wait4, children it waited for included (nvidia-container-cli and its ldconfig;
    nvhook's NVML probe when it runs). Shuffled rounds, every hook once per round. With
    `compare` (another nvhook checkout), its hook too, in the same rounds (compare_launcher).
    Returns {"cpu": {label: [ms]}, "cases": [(name, nvhook label, reference label | None,
    compare label | None)]}."""
    cases = start_cases(root)
    rootfs = make_fixtures.build_container("container-debian", work / "images")
    hook_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    runs: dict[str, tuple[list[str], bytes]] = {}
    labels = []
    other = compare_launcher(work, compare)[0] if compare is not None else None
    for k, (name, host, devices, caps) in enumerate(cases):
        env = [] if devices is None else [f"NVIDIA_VISIBLE_DEVICES={devices}", f"NVIDIA_DRIVER_CAPABILITIES={caps}"]
        bundle = work / f"b{k}"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(make_fixtures.oci_config(str(rootfs), ["PATH=/bin", *env])))
        conf = work / f"nvhook{k}.toml"
        conf.write_text(f'log_file = "{work / f"nvhook{k}.log"}"\ncache_dir = "{work / "cache"}"\n'
                        f'[daemon]\nmode = "off"\n')
        runs[f"nvhook: {name}"] = ([str(NVHOOK), "--config", str(conf), "--root", str(root / host), "prestart"],
                                   str(bundle).encode())
        ref_label = None
        if reference is not None:
            ref_label = f"reference: {name}"
            ref_conf = reference_config(work, reference, root / host)
            runs[ref_label] = ([str(reference / "nvidia-container-runtime-hook"), "-config", str(ref_conf), "prestart"],
                               str(bundle).encode())
        cmp_label = None
        if other is not None:  # its own log and cache: the two trees' inventory caches do not evict each other
            cmp_label = f"compare: {name}"
            cmp_conf = work / f"compare{k}.toml"
            cmp_conf.write_text(f'log_file = "{work / f"compare{k}.log"}"\ncache_dir = "{work / "compare-cache"}"\n'
                                f'[daemon]\nmode = "off"\n')
            runs[cmp_label] = ([str(other), "--config", str(cmp_conf), "--root", str(root / host), "prestart"],
                               str(bundle).encode())
        labels.append((name, f"nvhook: {name}", ref_label, cmp_label))

    # The container's stand-in gets a device cgroup of its own: both hooks write their device
    # rules (v1 allow lists, a v2 BPF program) into the process's cgroup, which must not be
    # this benchmark's (a v2 program there would govern every process of the session).
    cg_root = Path("/sys/fs/cgroup/devices") if Path("/sys/fs/cgroup/devices").is_dir() else Path("/sys/fs/cgroup")
    cgroup = cg_root / f"nvhook-bench-{os.getpid()}"
    cgroup.mkdir()

    def once(argv: list[str], bundle: bytes) -> float:
        target = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
        try:
            (cgroup / "cgroup.procs").write_text(str(target.pid))
            own = os.readlink("/proc/self/ns/mnt")
            for _ in range(1000):  # unshare has exec'd sleep in its own namespace
                if os.readlink(f"/proc/{target.pid}/ns/mnt") != own:
                    break
                time.sleep(0.002)
            state = json.dumps({"ociVersion": "1.0.2", "id": "bench", "status": "created", "pid": target.pid,
                                "bundle": bundle.decode()}).encode()
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 env=hook_env)
            assert p.stdin is not None and p.stderr is not None
            p.stdin.write(state)
            p.stdin.close()
            err = p.stderr.read()
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                raise SystemExit(f"{argv[0]}: exit {p.returncode}: {err.decode(errors='replace')}")
            return _cpu_ms(usage)
        finally:
            target.kill()
            target.wait()

    try:
        for argv, bundle in runs.values():  # warm: inventory caches, page cache
            for _ in range(3):
                once(argv, bundle)
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        shuffle = random.Random(5).shuffle
        for _ in range(n):
            shuffle(order)
            for label in order:
                cpu[label].append(once(*runs[label]))
    finally:
        for _ in range(100):  # the last stand-in may still be leaving it
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.05)
    return {"cpu": cpu, "cases": labels}


def main() -> int:
    privaterun.enter("nvhook-bench-run-")  # a /run/nvhook and /var/log/nvhook.log of its own (tests/e2e/privaterun.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=30, help="repetitions per case (default 30)")
    ap.add_argument("--json", metavar="FILE", help="write raw figures as JSON")
    ap.add_argument("--wrapper", action="store_true", help="only nvhook-runtime against runc (bench_wrapper)")
    ap.add_argument("--compare", metavar="TREE",
                    help="an interleaved A/B against another nvhook checkout (e.g. a `git worktree` of main); "
                         "with --hook-cpu, of the hook processes alone")
    ap.add_argument("--reference", metavar="DIR",
                    help="side by side with NVIDIA's nvidia-container-runtime-hook + nvidia-container-cli in DIR")
    ap.add_argument("--cdi", action="store_true", help="only podman with a CDI spec against hook mode (bench_cdi)")
    ap.add_argument("--resident", action="store_true", help="only nvhookd against in-process (bench_resident)")
    ap.add_argument("--cdi-nvidia", metavar="DIR",
                    help="only CDI side by side with NVIDIA's nvidia-ctk/nvidia-cdi-hook in DIR "
                         "(bench/build_reference_cdi.sh SCRATCH: DIR = SCRATCH/v1.17.0; bench_cdi_nvidia)")
    ap.add_argument("--cdi-runc", metavar="SCRATCH", nargs="?", const="",
                    help="only a CDI start under runc without podman, each spec's edits applied to one config.json "
                         "(bench/cdirunc.py): nvhook's spec against nvidia-ctk's from SCRATCH/v1.17.0 and v1.18.0 "
                         "(bench/build_reference_cdi.sh's dir), NVIDIA's hooks and nvhook's nvidia-cdi-hook")
    ap.add_argument("--cdi-generate", action="store_true",
                    help="only `nvhook cdi generate` for host-gpu8 against the interpreter floors (and nvidia-ctk's "
                         "with --reference-cdi)")
    ap.add_argument("--reference-cdi", metavar="DIR", help="with --cdi-generate: nvidia-ctk's TAG dir")
    ap.add_argument("--python", metavar="PATH",
                    help="with --cdi-generate and --cdi-runc: nvhook also (or, for the hooks, only) under this "
                         "interpreter with -IS, as the Debian package runs it (e.g. /usr/bin/python3)")
    ap.add_argument("--launcher", metavar="PATH",
                    help="bench this nvhook launcher instead of the venv's, e.g. an unpacked .deb's usr/bin/nvhook "
                         "(`dpkg-deb -x dist/nvhook_*.deb DIR`): the installed form, with its own interpreter")
    ap.add_argument("--hook-cpu", action="store_true",
                    help="only each hook process's own CPU, run without runc against a process in a mount namespace "
                         "of its own (bench_hook_cpu); with --reference, side by side")
    ap.add_argument("--resident-client", choices=("gpu", "no-gpu"),
                    help="only the hook process, run directly against nvhookd (bench_resident_client)")
    args = ap.parse_args()
    floor_py = PY
    if args.launcher:
        global NVHOOK
        NVHOOK = Path(args.launcher).resolve()
        first = NVHOOK.read_text().split("\n", 1)[0]
        if not first.startswith("#!/"):
            raise SystemExit(f"--launcher {NVHOOK}: not a #! script")
        floor_py = Path(first[2:].split()[0])  # the floor is that interpreter's own start
    if os.geteuid() != 0 or not shutil.which("runc"):
        raise SystemExit("bench needs root and runc")
    root = FIXTURES / "rootfs"
    subprocess.run([sys.executable, str(FIXTURES / "make_fixtures.py")], check=True, stdout=subprocess.DEVNULL)

    if args.cdi_generate:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            res = bench_cdi_generate(Path(tmp), root, args.n, Path(args.reference_cdi).resolve()
                                     if args.reference_cdi else None, args.python)
        load = os.getloadavg()
        print(f"cdi generate, host-gpu8 ({args.n} shuffled rounds, load {load[0]:.2f} {load[1]:.2f})")
        pairs = [(k, "nvidia-ctk cdi generate (in its /proc wrapper)") for k in res["cpu"]
                 if k.startswith("nvhook") and args.reference_cdi]
        summary = print_side_by_side(res, pairs)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(res, summary=summary, load=load), indent=2))
        return 0
    if args.cdi_runc is not None:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            res = bench_cdi_runc(Path(tmp), root, args.n, Path(args.cdi_runc).resolve() if args.cdi_runc else None,
                                 {"nvhook --no-hook spec": ["--no-hook"]}, args.python)
        load = os.getloadavg()
        floor_py = Path(args.python) if args.python else floor_py
        floor = run_floor(floor_py, 30)
        print(f"CDI starts under runc ({args.n} shuffled rounds, load {load[0]:.2f} {load[1]:.2f}; "
              f"{floor_py} -I -c pass CPU {floor:.1f} ms median)")
        none = "no GPU"
        for kind in ("wall", "cpu"):  # what differs: each GPU case less the no-GPU start of its round
            for k in [k for k in res[kind] if k != none and "(over no GPU)" not in k]:
                res[kind][k + " (over no GPU)"] = [x - y for x, y in zip(res[kind][k], res[kind][none])]
        ours = [k for k in res["cpu"] if k.startswith("nvhook") and k.endswith("(over no GPU)")]
        theirs = [k for k in res["cpu"] if k.endswith("NVIDIA hooks (over no GPU)")]
        pairs = [(a, b) for a in ours for b in theirs]
        for b in theirs:
            for stage in ("python", "shell"):
                mixed = b.replace("NVIDIA hooks (", f"nvhook nvidia-cdi-hook ({stage} first stage) (")
                pairs.append((mixed, b))
            pairs.append((b.replace("NVIDIA hooks (", "nvhook nvidia-cdi-hook (shell first stage) ("),
                          b.replace("NVIDIA hooks (", "nvhook nvidia-cdi-hook (python first stage) (")))
        summary = print_side_by_side(res, pairs)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(res, summary=summary, load=load), indent=2))
        return 0
    if args.cdi_nvidia:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            res = bench_cdi_nvidia(Path(tmp), root, args.n, Path(args.cdi_nvidia).resolve())
        print(f"CDI side by side with NVIDIA's ({args.n} shuffled rounds, load {os.getloadavg()[0]:.2f})")
        none = "podman, no GPU"
        for kind in ("wall", "cpu"):  # the start's own cost: each GPU case less the no-GPU run
            for k in [k for k in res[kind] if k.startswith("podman gpu=0")]:
                res[kind][k + " (over no GPU)"] = [x - y for x, y in zip(res[kind][k], res[kind][none])]
        summary = print_side_by_side(res, [
            ("generate 8 GPUs: nvhook", "generate 8 GPUs: nvidia-ctk (in its /proc wrapper)"),
            ("podman gpu=0: nvhook spec + nvhook hook (over no GPU)",
             "podman gpu=0: nvidia-ctk spec + NVIDIA hooks (over no GPU)"),
            ("podman gpu=0: nvidia-ctk spec + nvhook nvidia-cdi-hook (over no GPU)",
             "podman gpu=0: nvidia-ctk spec + NVIDIA hooks (over no GPU)"),
        ])
        if args.json:
            Path(args.json).write_text(json.dumps(dict(res, summary=summary), indent=2))
        return 0
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
            d = statistics.median(x - y for x, y in zip(w[k], w[keys[0]]))
            print(f"  {k}: {d:+.1f} ms")
        d = statistics.median(x - y for x, y in zip(w[keys[1]], w[keys[2]]))
        print(f"  CDI against hook mode: {d:+.1f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps({"cdi_rounds": w}, indent=2))
        return 0
    if args.hook_cpu:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            h = bench_hook_cpu(Path(tmp), root, args.n, Path(args.reference) if args.reference else None,
                               Path(args.compare).resolve() if args.compare else None)
        load = os.getloadavg()
        print(f"hook process CPU, run directly ({args.n} shuffled rounds, load {load[0]:.2f}); ms, median [q1..q3]")
        rng = random.Random(3)
        boot = [[rng.randrange(args.n) for _ in range(args.n)] for _ in range(1000)]
        out = {}

        def versus(a: list[float], b: list[float]) -> tuple[float, tuple[float, float]]:
            """median(a) / median(b) and its bootstrap 95% interval over rounds."""
            rs = sorted(statistics.median([a[i] for i in idx]) / statistics.median([b[i] for i in idx])
                        for idx in boot)
            return statistics.median(a) / statistics.median(b), (rs[25], rs[974])

        for name, mine, ref, cmp in h["cases"]:
            a = h["cpu"][mine]
            qa = statistics.quantiles(a, n=4)
            line = f"  {name:<46} nvhook {statistics.median(a):6.1f} [{qa[0]:5.1f}..{qa[2]:5.1f}]"
            out[name] = {"nvhook": statistics.median(a)}
            for other, key, shown in ((ref, "reference", "NVIDIA"), (cmp, "compare", "compare")):
                if other is None:
                    continue
                b = h["cpu"][other]
                qb = statistics.quantiles(b, n=4)
                r, ci = versus(a, b)
                out[name].update({key: statistics.median(b), f"{key}_ratio": r, f"{key}_ci95": ci})
                if key == "reference":  # the names earlier JSON files used
                    out[name].update(ratio=r, ci95=ci)
                line += (f"  {shown} {statistics.median(b):6.1f} [{qb[0]:5.1f}..{qb[2]:5.1f}]"
                         f"  ratio {r:4.2f} x [{ci[0]:4.2f}..{ci[1]:4.2f}]")
            print(line)
        one, mig = h["cases"][0][1], h["cases"][3][1]
        print(f"  nvhook, 112 MIG cap devices / 1 GPU: "
              f"{statistics.median(h['cpu'][mig]) / statistics.median(h['cpu'][one]):.2f} x (target <= 1.3)")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(h, summary=out, load=load), indent=2))
        return 0
    if args.resident_client:
        with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
            c = bench_resident_client(Path(tmp), root, args.n, args.resident_client == "no-gpu")
        print(f"{'hook run directly, ' + args.resident_client + ' (' + str(args.n) + ' shuffled rounds)':<44} "
              f"{'cpu median':>10} {'q1..q3':>13} {'wall median':>11}  ms")
        for k in c["cpu"]:
            q = statistics.quantiles(c["cpu"][k], n=4)
            print(f"{k:<44} {statistics.median(c['cpu'][k]):10.1f} {q[0]:6.1f}..{q[2]:<6.1f} "
                  f"{statistics.median(c['wall'][k]):11.1f}")
        print(f"  + nvhookd's request child per start: {c['daemon_child_cpu_ms']:.1f} ms CPU")
        if args.json:
            Path(args.json).write_text(json.dumps(c, indent=2))
        return 0
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
                d = sorted(x - b for x, b in zip(xs, bare))
                c = statistics.median(x - b for x, b in zip(r["cpu"][k], bare_cpu))
                label = k.rsplit(": ", 1)[0]
                client = c
                if k.endswith("resident"):
                    c += r["daemon"][label]["cpu_ms_per_request"]
                q = statistics.quantiles(d, n=4)
                over[k] = {"overhead": statistics.median(d), "q1": q[0], "q3": q[2], "cpu": c, "client_cpu": client}
                line += f" {over[k]['overhead']:9.1f} {q[0]:6.1f}..{q[2]:<6.1f} {c:7.1f}"
            print(line)
        print("overhead = median over rounds of (start with hook - bare start of the same round); cpu = median of")
        print("  per-round CPU differences (runc + hook), plus nvhookd's per-request child CPU for resident cases")
        for label, d in r["daemon"].items():
            res, inp = over[f"{label}: resident"], over[f"{label}: in-process"]
            print(f"  {label:<44} resident/in-process: overhead {res['overhead'] / inp['overhead']:.2f} x, "
                  f"cpu {res['cpu'] / inp['cpu']:.2f} x (client {res['client_cpu']:.1f} + nvhookd's child "
                  f"{d['cpu_ms_per_request']:.1f} ms); nvhookd peak RSS {d['daemon_peak_rss_kb'] / 1024:.1f} MB, "
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
            d = statistics.median(x - y for x, y in zip(w[a], w[b]))
            print(f"  {a}: {d:+.1f} ms against {b}")
        if args.json:
            Path(args.json).write_text(json.dumps({"wrapper_rounds": w}, indent=2))
        return 0

    results: dict = {}
    rounds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    bare_label = "baseline: runc run (no hook)"
    pre_label = "real /proc: procdriver hook alone"
    with tempfile.TemporaryDirectory(prefix="nvhook-bench-") as tmp:
        work = Path(tmp)
        migs = mig_uuids(root / "host-mig8x7")
        mig_devices = ",".join(migs)
        # (label, host, NVIDIA_VISIBLE_DEVICES, capabilities, in the side-by-side set)
        workloads = [
            ("1 GPU, compute,utility", "host-gpu1", "0", "compute,utility", True),
            ("8 GPUs, compute,utility", "host-gpu8", "all", "compute,utility", True),
            ("8 GPUs, all capabilities", "host-gpu8", "all", "all", True),
            ("8x7 MIG (112 cap devices), compute,utility", "host-mig8x7", mig_devices, "compute,utility", True),
            ("8x7 MIG, all capabilities", "host-mig8x7", mig_devices, "all", False),
        ]
        nogpu = "not a GPU container (NVIDIA_VISIBLE_DEVICES unset)"
        procdriver = build_procdriver_hook(work)
        if args.reference and procdriver is None:
            raise SystemExit("--reference needs gcc: NVIDIA's hook runs only on the real /proc path, "
                             "which bench/procdriver_hook.c provides")
        ref_configs = {}
        if args.reference:
            for host in sorted({w[1] for w in workloads}):
                ref_configs[host] = reference_config(work, Path(args.reference), root / host)
        # label -> (bundle, nvhook log or None, baseline label)
        bundles: dict[str, tuple[Bundle, Path | None, str | None]] = {}

        def add(label: str, env: list[str], host: str | None, *, pre: bool = False, ref: bool = False,
                hook_true: bool = False, other: tuple[Path, list[str]] | None = None) -> None:
            k = len(bundles)
            log = work / f"nvhook-{k}.log"
            b = Bundle(work, f"c{k}", env, None if host is None else root / host, log,
                       procdriver=procdriver if pre else None,
                       reference=(Path(args.reference), ref_configs[host]) if ref and host else None,
                main_hook=label != pre_label, nvhook=other or (NVHOOK, []))
            if hook_true:  # what runc charges for running any hook (fork/exec, stdin, wait)
                cfg = json.loads((b.dir / "config.json").read_text())
                cfg["hooks"] = {"prestart": [{"path": shutil.which("true"), "args": ["true"]}]}
                (b.dir / "config.json").write_text(json.dumps(cfg))
            nvhook_log = log if host is not None and not ref and label != pre_label else None
            baseline = None if label == bare_label else pre_label if pre and label != pre_label else bare_label
            bundles[label] = (b, nvhook_log, baseline)

        def gpu_env(devices: str, caps: str) -> list[str]:
            return [f"NVIDIA_VISIBLE_DEVICES={devices}", f"NVIDIA_DRIVER_CAPABILITIES={caps}"]

        add(bare_label, [], None)
        add("runc run with /bin/true as prestart hook", [], None, hook_true=True)
        for name, host, devices, caps, _ in workloads:
            add(f"hook: {name}", gpu_env(devices, caps), host)
        add(f"hook: {nogpu}", [], "host-gpu8")
        # The same launcher run by the interpreter with -I -S, as a hook registered with
        # path = the venv's python, args = [that python, "-IS", launcher, ...] (pip drops the
        # flags of the launcher's own #! line; see docs/performance.md).
        flagged = None if args.launcher else (PY, ["-IS", str(NVHOOK)])  # --launcher: its own #! flags
        if flagged:
            add(f"hook -IS: {nogpu}", [], "host-gpu8", other=flagged)
        if args.compare:
            other = compare_launcher(work, Path(args.compare))
            for name, host, devices, caps, side in workloads:
                if side:
                    add(f"compare: {name}", gpu_env(devices, caps), host, other=other)
            add(f"compare: {nogpu}", [], "host-gpu8", other=other)
        if procdriver is not None:
            # The pre-hook alone: the real-/proc cases' baseline (its own cost cancels out).
            add(pre_label, [], "host-gpu8", pre=True)
            for name, host, devices, caps, side in workloads:
                if side:
                    add(f"real /proc, nvhook: {name}", gpu_env(devices, caps), host, pre=True)
                    if flagged:
                        add(f"real /proc, nvhook -IS: {name}", gpu_env(devices, caps), host, pre=True,
                            other=flagged)
                    if args.reference:
                        add(f"real /proc, reference: {name}", gpu_env(devices, caps), host, pre=True, ref=True)
        if args.reference:
            add(f"reference: {nogpu}", [], "host-gpu8", ref=True)
        for b, _log, _base in bundles.values():
            b.measure(3)  # warm: inventory and NVML caches, page cache
        floor_cmd = [str(floor_py), "-I", "-c", "pass"]
        timed(floor_cmd, 3)
        load_before = os.getloadavg()
        # Rounds: every case runs once per round, in a shuffled order, so all of them see the
        # same load on the machine; overheads are medians of per-round differences against the
        # bare start (or, for the real /proc cases, the start with the pre-hook alone).
        order = list(bundles)
        shuffle = random.Random(42).shuffle  # a new order each round: no case always runs first
        floor_label = "floor: python -I -c pass"
        for _ in range(args.n):
            CPU.clear()
            rounds.setdefault(floor_label, []).extend(timed(floor_cmd, 1))
            cpu.setdefault(floor_label, []).extend(CPU)
            shuffle(order)
            for label in order:
                CPU.clear()
                rounds.setdefault(label, []).extend(bundles[label][0].measure(1))
                cpu.setdefault(label, []).extend(CPU)
        load_after = os.getloadavg()
        rounds = {k: rounds[k] for k in [floor_label, *bundles]}
        for label, xs in rounds.items():
            results[label] = stats(xs)
        phases = {}
        for label, (_b, log, _base) in bundles.items():
            if log is not None:
                name = label[len("hook: "):] if label.startswith("hook: ") else label
                phases[name] = median_phases(done_events(log))

        dry = Bundle(work, "dry", ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"], None,
                     work / "dry.log")
        results["dry-run alone (8 GPUs, text)"] = stats(timed(
            [str(NVHOOK), "--root", str(root / "host-gpu8"), "--log-file", "", "--dry-run", "--bundle", str(dry.dir)],
            args.n))

    floor = results[floor_label]["median"]
    base = results[bare_label]["median"]
    print(f"{args.n} shuffled rounds; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{os.cpu_count()} CPUs")
    print(f"nvhook launcher: {NVHOOK} (floor interpreter {floor_py})")
    print(f"{'case':<70} {'min':>7} {'median':>7} {'max':>7} {'cpu':>6}  ms")
    for k, v in results.items():
        c = f"{statistics.median(cpu[k]):6.1f}" if k in cpu else ""
        print(f"{k:<70} {v['min']:7.1f} {v['median']:7.1f} {v['max']:7.1f} {c}")
    print()

    def diffs(label: str, series: dict[str, list[float]]) -> list[float]:
        return [x - b for x, b in zip(series[label], series[bundles[label][2]])]

    any_hook = statistics.median(diffs("runc run with /bin/true as prestart hook", rounds))
    print("overhead = median over rounds of (container with hook - its baseline in the same round) [p25..p75];")
    print("cpu = the same for the CPU time of runc and everything it ran (children's rusage)")
    print(f"  (runc's own cost of running any prestart hook, /bin/true: {any_hook:.1f} ms)")
    overhead: dict[str, dict] = {}
    for k in results:
        if k in bundles and bundles[k][2] is not None and k != "runc run with /bin/true as prestart hook":
            w, c = diffs(k, rounds), diffs(k, cpu)
            o = overhead[k] = {"median": statistics.median(w), "iqr": quartiles(w),
                               "cpu": statistics.median(c), "cpu_iqr": quartiles(c)}
            print(f"  {k:<68} {o['median']:6.1f} ms [{o['iqr'][0]:5.1f}..{o['iqr'][1]:5.1f}]"
                  f"  cpu {o['cpu']:6.1f} [{o['cpu_iqr'][0]:5.1f}..{o['cpu_iqr'][1]:5.1f}]"
                  f"  = {o['median'] / floor:4.2f} x floor")
    print()
    print("nvhook phases (ms, medians over every run of a case, from hook.done; peak RSS in kB, median and")
    print("  largest, the largest being the cold start that builds the inventory cache);")
    print(f"  before them, the interpreter's own start: about the floor, {floor:.1f} ms;")
    print("  apply_imports_ms: the hook's own imports for applying (apply_child_imports_ms instead: a forked")
    print("  worker's, overlapping discover and decide, with a configured ldconfig program):")
    keys = sorted({k for p in phases.values() for k in p})
    for label, p in phases.items():
        print(f"  {label}")
        print("    " + ", ".join(f"{k}={p[k]}" for k in keys if k in p))
    print()

    # Ratios last: what the targets are stated in.
    rng = random.Random(3)
    boot = [[rng.randrange(args.n) for _ in range(args.n)] for _ in range(1000)]

    def ratio(a: str, b: str, series: dict[str, list[float]]) -> dict:
        da, db = diffs(a, series), diffs(b, series)
        pairs = [(statistics.median([da[i] for i in idx]), statistics.median([db[i] for i in idx])) for idx in boot]
        if min(d for _, d in pairs) <= 0:  # a baseline-sized denominator: no interval means anything
            return {"ratio": statistics.median(da) / statistics.median(db), "ci95": None}
        rs = sorted(n / d for n, d in pairs)
        return {"ratio": statistics.median(da) / statistics.median(db), "ci95": (rs[25], rs[974])}

    ratios: dict[str, dict] = {}

    def show_ratio(name: str, a: str, b: str, target: str) -> None:
        if a not in bundles or b not in bundles:
            return
        r = ratios[name] = {"wall": ratio(a, b, rounds), "cpu": ratio(a, b, cpu), "target": target}

        def shown(x: dict) -> str:
            ci = x["ci95"]
            return f"{x['ratio']:5.2f} x " + (f"[{ci[0]:4.2f}..{ci[1]:4.2f}]" if ci else "[denominator ~0]")

        print(f"  {name:<62} {shown(r['wall'])}  cpu {shown(r['cpu'])}  target {target}")

    print("ratios of overheads (bootstrap 95% interval over rounds), wall and CPU:")
    one, mig = "1 GPU, compute,utility", "8x7 MIG (112 cap devices), compute,utility"
    show_ratio("nvhook: 112 MIG cap devices / 1 GPU", f"hook: {mig}", f"hook: {one}", "<= 1.3")
    show_ratio("nvhook, real /proc: 112 MIG cap devices / 1 GPU", f"real /proc, nvhook: {mig}",
               f"real /proc, nvhook: {one}", "<= 1.3")
    if args.compare:
        print(f"this tree / {args.compare} (A/B, same rounds):")
        for name, *_rest, side in workloads:
            if side:
                show_ratio(name, f"hook: {name}", f"compare: {name}", "")
        show_ratio(nogpu.split(" (")[0], f"hook: {nogpu}", f"compare: {nogpu}", "")
    if args.reference:
        show_ratio("reference: 112 MIG cap devices / 1 GPU", f"real /proc, reference: {mig}",
                   f"real /proc, reference: {one}", "")
        print("side by side, nvhook / NVIDIA's hook (same hosts, same rounds):")
        for flags in ("", " -IS"):
            for name, *_rest, side in workloads:
                if side:
                    show_ratio(f"{name}{flags}", f"real /proc, nvhook{flags}: {name}",
                               f"real /proc, reference: {name}", "<= 1.0")
            show_ratio(nogpu.split(" (")[0] + flags, f"hook{flags}: {nogpu}", f"reference: {nogpu}", "<= 1.5")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "overhead_ms": overhead, "ratios": ratios,
                                               "phases": phases, "floor_ms": floor, "baseline_ms": base,
                                               "any_hook_ms": any_hook, "load": [load_before, load_after],
                                               "rounds": rounds, "cpu": cpu}, indent=2))
    return 0


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return (q[0], q[2])


def compare_launcher(work: Path, tree: Path) -> tuple[Path, list[str]]:
    """A launcher for another nvhook checkout `tree` (an interleaved A/B against this one):
    its bin/nvhook under the #! line of this tree's launcher (NVHOOK: the same interpreter and
    the same flags, so that the two sides differ only in their code; pip drops bin/nvhook's
    own -IS, and a B side run with them would skip `site`, several ms of CPU the A side pays),
    importing nvhook from `tree` first; and a config of its own, so that the two trees'
    inventory caches (keyed by the code that wrote them) do not evict each other."""
    lines = (tree / "bin" / "nvhook").read_text().splitlines(keepends=True)
    if not lines[0].startswith("#!python"):
        raise SystemExit(f"--compare {tree}: bin/nvhook does not start with #!python")
    body = "".join(lines[1:])
    at = body.index("import sys\n") + len("import sys\n")  # top level: the tree first on sys.path
    launcher = work / "compare-nvhook"
    shebang = NVHOOK.read_text().split("\n", 1)[0]
    launcher.write_text(f"{shebang}\n" + body[:at] + f"sys.path.insert(0, {str(tree)!r})\n" + body[at:])
    launcher.chmod(0o755)
    (work / "compare-cache").mkdir(mode=0o700)
    conf = work / "compare.toml"
    conf.write_text(f'cache_dir = "{work / "compare-cache"}"\n')
    return launcher, ["--config", str(conf)]


def build_procdriver_hook(work: Path) -> Path | None:
    """Compile bench/procdriver_hook.c; None (the real /proc cases are left out) without gcc."""
    if not shutil.which("gcc"):
        print("no gcc: the real /proc cases are left out", file=sys.stderr)
        return None
    out = work / "procdriver-hook"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(Path(__file__).with_name("procdriver_hook.c"))], check=True)
    return out


def reference_config(work: Path, ref: Path, host: Path) -> Path:
    """NVIDIA's hook config for one fixture host: nvidia-container-cli from `ref`, reading the
    driver under `host` (its --root), running the host's ldconfig in the container as it does
    by default. `mode = "legacy"` skips the auto-detection that would look for NVML and Tegra
    files on this machine (a real GPU host resolves "auto" to legacy too, after that search);
    no debug log."""
    for name in ("nvidia-container-runtime-hook", "nvidia-container-cli"):
        if not os.access(ref / name, os.X_OK):
            raise SystemExit(f"--reference {ref}: no executable {name} there")
    conf = work / f"reference-{host.name}.toml"
    conf.write_text(f'''disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"

[nvidia-container-cli]
path = "{ref / "nvidia-container-cli"}"
root = "{host}"
environment = []
ldconfig = "@/sbin/ldconfig"
load-kmods = false

[nvidia-container-runtime]
mode = "legacy"

[nvidia-container-runtime-hook]
skip-mode-detection = true
''')
    return conf


if __name__ == "__main__":
    sys.exit(main())
