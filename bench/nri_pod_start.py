#!/usr/bin/env python3
"""Pod start through the CRI on the private node (tests/node/: Debian 13 with containerd 1.7, or
`--suite sid`, Debian unstable with containerd 2.1): nvhook's NRI plugin against NVIDIA's two
Kubernetes paths, the device plugin's cdi-cri strategy (containerd's own CDI applying NVIDIA's
spec) and their runtime handler (nvidia-container-runtime in its cdi mode), and nvhook's runtime
handler (nvhook-runtime), on the same node, in the same rounds.

    sudo NVHOOK_REFERENCE_CDI=DIR .venv/bin/python bench/nri_pod_start.py [-n 15] [--tag v1.20.0]
        [--suite trixie|sid] [--no-gpu-only]

Each round runs, in a shuffled order, one pod per case and times CreateContainer +
StartContainer of its container (the sandbox is made before the clock starts; both are what
kubelet waits for). Cases: a pod without a GPU on runc with NRI on and no plugin connected
(the baseline), the same with the plugin connected, a GPU pod through the plugin (a CUDA image:
nothing left for the start; a plain image: the loader cache and the compat choice, done by the
plugin itself at StartContainer; neither runs a process), and a GPU / no-GPU pod through the runtime handler
"nvidia" (nvhook-runtime, as node install registers it), and a GPU / no-GPU pod through NVIDIA's
runtime handler "nvidia-ref", and a GPU pod on runc whose CreateContainer names the GPU in the
CRI's CDI_devices field (what NVIDIA's device plugin sends under `deviceListStrategy: cdi-cri`),
which containerd's CDI resolves against NVIDIA's spec. Reported per case: median and quartiles of
the added time over the baseline of the same round, and the per-round ratios to NVIDIA's GPU pods
(runtime handler; cdi-cri) (median [quartiles]); the machine's load average before and after.

NVIDIA's runtime, nvidia-ctk and nvidia-cdi-hook are built from NVIDIA's public sources outside
the repo by bench/build_reference_cdi.sh (NVHOOK_REFERENCE_CDI=DIR, DIR/TAG/...); their runtime
reads a spec nvidia-ctk generated for the fixture host (Node.install_nvidia_reference). Without
them the NVIDIA cases are left out and the ratio is to nvhook's runtime handler. The cdi-cri
case's spec is the one NVIDIA's device plugin would have the node hold: nvidia-ctk's, devices
named by UUID (the plugin's default deviceIDStrategy), its hooks their nvidia-cdi-hook, in
/var/run/cdi (/run/cdi) where the device plugin writes its spec. It is generated under the vendor
"ref.nvidia.com" so that it does not clash with nvhook's own nvidia.com/gpu spec in /etc/cdi (the
name is all that differs: the same edits and hooks).

The runtime handlers' pods run while the plugin is disconnected, so that a GPU pod there is
injected once (by the handler).

--no-gpu-only: the baseline and the plugin's no-GPU pod alone (what the plugin costs a pod that
asks for no GPU: its CreateContainer and StartContainer round trips), for more rounds in the
same time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests/node"), str(REPO / "tests/fixtures"), str(REPO / "tests/e2e"), str(REPO / "tests")]

import cdihookbox  # noqa: E402
import images  # noqa: E402
import noderoot  # noqa: E402
import privaterun  # noqa: E402
from cri import Allocation, device_plugin  # noqa: E402
from gpuprobe import CAPS, GPUS  # noqa: E402
from node import HOST_ROOT, RUNTIME_HANDLER, start_node  # noqa: E402
from test_nri import CUDA_IMAGE_ENV, NRIPlugin  # noqa: E402

BASE = "baseline: no GPU, NRI on, no plugin"
PLAIN = "plugin: GPU, plain image (start work)"
NV_RUNTIME = "NVIDIA runtime: GPU"
NV_CDI_CRI = "NVIDIA cdi-cri (containerd CDI): GPU"
REF_VENDOR = "ref.nvidia.com"


def quart(xs: list[float], unit: str = " ms") -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):7.2f}{unit}  [{q[0]:.2f} .. {q[2]:.2f}]"


def reference(tag: str) -> Path | None:
    base = os.environ.get("NVHOOK_REFERENCE_CDI")
    ref = Path(base) / tag if base else None
    return ref if ref and (ref / "nvidia-container-runtime").exists() else None


def install_nvidia_cdi_cri(node, ref: Path, ctk_env: dict[str, str]) -> None:
    """NVIDIA's spec for the cdi-cri case, where containerd's CDI reads it (see the docstring)."""
    p = cdihookbox.nvidia_ctk_generate(ref, node.host_fixture, "/nvhook/nvidia-ref/nvidia-cdi-hook",
                                       "--vendor", REF_VENDOR, "--device-name-strategy", "uuid", env=ctk_env)
    if p.returncode:
        sys.exit(f"nvidia-ctk cdi generate failed: {p.stderr[-2000:]}")
    spec = p.stdout
    for machine_path in {str(node.host_fixture.resolve()), str(node.host_fixture)}:
        spec = spec.replace(machine_path, HOST_ROOT)
    # /run, not /var/run: that is a link to /run, which node.write would follow on the machine
    node.write("/run/cdi/ref-nvidia.json", spec)


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median (order statistics n/2 -+
    0.98 sqrt(n), the sign test's normal approximation): what the rounds can resolve."""
    ys = sorted(xs)
    n = len(ys)
    d = 0.98 * n ** 0.5
    return ys[max(0, int(n / 2 - d))], ys[min(n - 1, int(n / 2 + d + 0.999))]


def spec_shape(spec: dict) -> str:
    """Mounts, device nodes and hooks (processes runc runs) of an OCI spec, in a few words."""
    hooks = spec.get("hooks") or {}
    n_hooks = sum(len(v) for v in hooks.values())
    return (f"{len(spec.get('mounts') or [])} mounts, {len((spec.get('linux') or {}).get('devices') or [])} devices, "
            f"{n_hooks} hooks")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--tag", default="v1.20.0", help="NVIDIA's toolkit build under $NVHOOK_REFERENCE_CDI")
    ap.add_argument("--suite", default=noderoot.SUITE, choices=noderoot.SUITES,
                    help="the node root: trixie (containerd 1.7) or sid (containerd 2.1)")
    ap.add_argument("--cold", action="store_true",
                    help="time each plugin pod as the first of its kind since the plugin started (no kept "
                         "answer); by default one untimed pod per plugin case goes first, as on a node whose "
                         "plugin has been up")
    ap.add_argument("--mask-procfs", action="store_true",
                    help="run the plugin with --mask-procfs (the operator's choice that adds nvhook's hook, a "
                         "process, to every GPU container for /proc/driver/nvidia): its cost against the default")
    ap.add_argument("--no-gpu-only", action="store_true",
                    help="only the baseline and the plugin's no-GPU pod (the plugin's cost to pods without a GPU)")
    return ap.parse_args()


def report(node, times: dict[str, list[float]], againsts: list[str], shape: dict[str, str]) -> None:
    """Each case's added time and ratios, what runc was given, and the plugin's own figures."""
    base = times[BASE]
    print("added time over the baseline of the same round, median [quartiles]; ratio per round to "
          + "; ".join(f"'{a}'" for a in againsts) + " (rounds where that one's added time is > 0)")
    print(f"  {'baseline (absolute)':40s} {quart(base)}")
    against_added = {a: [t - b for t, b in zip(times[a], base)] for a in againsts}
    for c, ts in times.items():
        if c == BASE:
            continue
        added = [t - b for t, b in zip(ts, base)]
        cols = []
        for a in againsts:
            ratio = [x / rr for x, rr in zip(added, against_added[a]) if rr > 0] if c != a else []
            cols.append(quart(ratio, "") if ratio else "-")
        print(f"  {c:40s} {quart(added)}   x " + "   x ".join(cols))
    print("what runc was given (the bundle's config.json, round 0): "
          + "; ".join(f"{c}: {v}" for c, v in shape.items()))
    nogpu = [t - b for t, b in zip(times["plugin: no GPU"], base)]
    lo, hi = median_interval(nogpu)
    print(f"plugin, no GPU: faster than the baseline in {sum(a < 0 for a in nogpu)} of {len(nogpu)} rounds; "
          f"median added time {statistics.median(nogpu):.2f} ms, "
          f"95% interval of that median {lo:.2f} .. {hi:.2f} ms")
    decided = [e for e in node.nvhook_events("nri.adjusted") if "ms" in e]
    for kept in (False, True):
        ms = [e["ms"] for e in decided if bool(e.get("cached")) is kept]
        if len(ms) > 1:
            print(f"plugin's own decision ({'kept answer' if kept else 'decided afresh'}, nri.adjusted ms, "
                  f"{len(ms)} containers): {quart(ms)}")
    started = [e["ms"] for e in node.nvhook_events("nri.started") if "ms" in e]
    if len(started) > 1:
        print(f"plugin's start work (nri.started ms: cache written through the container's root, "
              f"{len(started)} containers): {quart(started)}")


def make_cases(args: argparse.Namespace, with_ref: bool) -> tuple[dict[str, tuple], list[str]]:
    """{case: (runtime handler, environment, allocation, with the plugin)}, and the cases the
    ratios are to."""
    gpu = device_plugin("envvar", [GPUS[2].uuid])  # not MIG-enabled: NVIDIA lists a whole-GPU device for it
    cases = {
        BASE: ("", {}, None, False),
        "plugin: no GPU": ("", {}, None, True),
        "plugin: GPU, CUDA image (no hook)": ("", CUDA_IMAGE_ENV, gpu, True),
        PLAIN: ("", {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, gpu, True),
        "runtime handler: no GPU": (RUNTIME_HANDLER, {}, None, False),
        "runtime handler: GPU": (RUNTIME_HANDLER, {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, gpu, False),
    }
    if args.no_gpu_only:
        cases = {c: v for c, v in cases.items() if c in (BASE, "plugin: no GPU")}
    if with_ref:
        cases["NVIDIA runtime: no GPU"] = ("nvidia-ref", {}, None, False)
        cases[NV_RUNTIME] = ("nvidia-ref", {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, gpu, False)
        cases[NV_CDI_CRI] = ("", {}, Allocation(cdi_devices=[f"{REF_VENDOR}/gpu={GPUS[2].uuid}"]), False)
    againsts = [NV_RUNTIME, NV_CDI_CRI] if with_ref else ["runtime handler: GPU"]
    if againsts[0] not in cases:
        againsts = ["plugin: no GPU"]
    return cases, againsts


def main() -> int:
    privaterun.enter("nvhook-bench-run-")  # a /run/nvhook and /var/log/nvhook.log of its own (tests/e2e/privaterun.py)
    args = parse_args()
    ref = None if args.no_gpu_only else reference(args.tag)
    if ref is None and not args.no_gpu_only:
        print(f"NVIDIA's nvidia-container-runtime {args.tag} is not built (bench/build_reference_cdi.sh DIR "
              "TOOLKIT_GIT, NVHOOK_REFERENCE_CDI=DIR): its cases are left out", file=sys.stderr)
    out = Path(tempfile.mkdtemp(prefix="nvhook-nri-bench-"))
    fixtures = REPO / "tests/fixtures/rootfs"
    if not (fixtures / "host-gpu8").is_dir():
        sys.exit("run `make fixtures` first")
    node = start_node(fixtures / "host-gpu8", images.build_all(out / "images"), suite=args.suite)
    try:
        node.run(["mkdir", "-p", "/run/nvhook-test"])
        if ref is not None:
            ctk_env = cdihookbox.nvml_without_mig(node.host_fixture, out)
            install_nvidia_cdi_cri(node, ref, ctk_env)  # before the reference's containerd restart, which reads it
            node.install_nvidia_reference(ref, ctk_env=ctk_env)
        node.enable_nri()
        k = node.kubelet
        plugin = NRIPlugin(node)
        cases, againsts = make_cases(args, ref is not None)
        load0 = os.getloadavg()
        loads: list[float] = []  # the 1-minute load average at each round's start
        times: dict[str, list[float]] = {c: [] for c in cases}
        shape: dict[str, str] = {}
        for r in range(args.n + 1):  # round 0 warms caches and is dropped
            loads.append(os.getloadavg()[0])
            order = list(cases)
            random.shuffle(order)
            order.sort(key=lambda c: cases[c][3])  # plugin-less cases first, then connect
            plugin.kill()
            for c in order:
                handler, env, alloc, with_plugin = cases[c]
                if with_plugin and plugin.pid is None:
                    plugin.start(*(["--mask-procfs"] if args.mask_procfs else []))
                    if not args.cold:
                        for w_env, w_alloc in [(e, a) for _h, e, a, wp in cases.values() if wp]:
                            wpod = k.run_pod(f"w{r}", runtime_handler="")
                            k.run_container(wpod, "app", images.DEBIAN, env=w_env, gpu=w_alloc)
                            k.remove_pod(wpod)
                pod = k.run_pod(f"b{r}", runtime_handler=handler)
                t0 = time.perf_counter()
                cid = k.run_container(pod, "app", images.DEBIAN, env=env, gpu=alloc)
                dt = (time.perf_counter() - t0) * 1000
                if r == 0:  # where the time goes: what runc was given to do for each case, off the clock
                    shape[c] = spec_shape(node.specs(cid)[1])
                if r == 0 and alloc is not None:  # each GPU case really injects: checked once, off the clock
                    code, out, err = k.exec(cid, f"test -c /dev/nvidia{GPUS[2].minor} && echo GPU")
                    assert out.strip() == "GPU", (c, code, out, err)
                    if c == PLAIN:  # the cache the plugin wrote at the start, as the image's ldconfig reads it
                        code, out, err = k.exec(cid, "/sbin/ldconfig -p | grep -c 'libcuda.so.1 '")
                        assert out.strip() == "1", (c, code, out, err)
                k.remove_pod(pod)
                if r:
                    times[c].append(dt)
        load1 = os.getloadavg()
        print(f"node root {args.suite}: {node.run(['containerd', '--version']).stdout.strip()}; "
              f"{node.run([node.runc, '--version']).stdout.splitlines()[0]}")
        print(f"{args.n} rounds (+1 warm-up dropped), plugin {'cold' if args.cold else 'warm'}"
              f"{' with --mask-procfs' if args.mask_procfs else ''}; "
              "CreateContainer+StartContainer; load average "
              f"{load0[0]:.2f} before, {load1[0]:.2f} after, at the rounds' starts {min(loads):.2f} to "
              f"{max(loads):.2f} (median {statistics.median(loads):.2f}) ({os.cpu_count()} CPUs); NVIDIA: "
              f"{ref or 'not built'}")
        report(node, times, againsts, shape)
        plugin.kill()
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
