"""Specs written by NVIDIA's own nvidia-ctk (1.17.0, 1.18.0), their hook path pointed at the
nvidia-cdi-hook that `nvhook node install` put on the Debian 13 node (/opt/nvhook/bin, run by
the node's python3), applied by the node's three CDI engines: containerd 1.7 through the CRI
(the CDI_devices field, and the cdi.k8s.io annotation the device plugin writes), Docker 26
(`--device`) and podman 5 (`--device`). The container says what it sees: its GPU's device
nodes, the links and loader cache NVIDIA's create-symlinks and update-ldcache hooks asked for,
which libcuda a CUDA program's loader resolves, nvidia-smi. On a GeForce host with a CUDA 11.3
compat image, NVIDIA 1.18's enable-cuda-compat would put the image's compat libcuda first
(error 804 on that GPU); nvhook's per-GPU decision keeps the host's.

nvidia-ctk is built from NVIDIA's sources outside the repo (bench/build_reference_cdi.sh); these
tests run where NVHOOK_REFERENCE_CDI names that directory and skip with the reason elsewhere.
Each spec is generated on the machine for a fixture host, and three things are changed in it:
the host's path (the machine's fixture directory, the node's /nvhook/host or /nvhook/fixtures/..),
its kind (so it sits beside nvhook's own nvidia.com/gpu spec in the node), and
`--nvhook-config` added to each hook's arguments (the test's config: that host as root, a
private log). Nothing else: device nodes, mounts, hooks and their order are NVIDIA's.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import cdihookbox
import make_fixtures as mf
import pytest
from cri import Allocation
from gpuprobe import ALLOWED, SCRIPT, View
from images import CUDA113, DEBIAN
from node import FIXTURES, HOST_ROOT

HOOK = "/opt/nvhook/bin/nvidia-cdi-hook"
L = "/usr/lib/x86_64-linux-gnu"
ENGINES = ("containerd", "docker", "podman")
CASES = {("v1.17.0", "host-gpu8"), ("v1.18.0", "host-gpu8"), ("v1.18.0", "host-geforce-460")}
SH_HOOK = "/run/nvhook-test/sh-cdi-hook"  # the control: a dynamically linked first stage
PROBE = SCRIPT + 'echo "SMI:$(nvidia-smi 2>&1)"\necho "CONFD:$(ls /etc/ld.so.conf.d | busybox tr \'\\n\' \' \')"\n'


class Spec:
    def __init__(self, n, fixtures_root: Path, tag: str, host: str, *, hook: str = HOOK, suffix: str = ""):
        ref = cdihookbox.reference(tag)
        if ref is None:
            pytest.skip(f"NVIDIA's nvidia-ctk {tag} is not built: run bench/build_reference_cdi.sh DIR TOOLKIT_GIT and set "
                        "NVHOOK_REFERENCE_CDI=DIR")
        self.n, self.host = n, mf.HOSTS[host]
        self.name = f"ctk{tag[1:].replace('.', '')}-{host}{suffix}"
        node_host = HOST_ROOT if host == "host-gpu8" else f"{FIXTURES}/{host}"
        p = cdihookbox.nvidia_ctk_generate(ref, fixtures_root / host, HOOK)
        assert p.returncode == 0, p.stderr
        spec = json.loads(json.dumps(json.loads(p.stdout)).replace(str(fixtures_root / host), node_host))
        self.kind = spec["kind"] = f"{self.name}.nvidia.com/gpu"
        self.config = f"/run/nvhook-test/{self.name}.toml"
        self.log = n.dir / "run/nvhook-test" / f"{self.name}.jsonl"
        n.write(self.config, f'root = "{node_host}"\nlog_file = "/run/nvhook-test/{self.name}.jsonl"\n'
                             f'cache_dir = "/run/nvhook-test/{self.name}-cache"\n')
        self.hooks = spec["containerEdits"]["hooks"]
        for h in self.hooks:
            assert h["path"] == HOOK, h
            h["path"] = hook
            h["args"][1:1] = ["--nvhook-config", self.config]
        self.file = f"/run/cdi/{self.name}.json"  # /var/run/cdi, a directory every engine reads
        n.write(self.file, json.dumps(spec))

    def events(self, name: str) -> list[dict]:
        if not self.log.exists():
            return []
        return [e for e in map(json.loads, self.log.read_text().splitlines()) if e.get("event") == name]


@pytest.fixture(scope="module")
def ctk(request, fixtures_root):
    """{(tag, host): Spec} in the node (`ctk["node"]`); skips before the node is built where
    NVIDIA's build is missing."""
    if cdihookbox.reference("v1.17.0") is None and cdihookbox.reference("v1.18.0") is None:
        pytest.skip("NVIDIA's nvidia-ctk is not built: run bench/build_reference_cdi.sh DIR TOOLKIT_GIT and set "
                    "NVHOOK_REFERENCE_CDI=DIR")
    n = request.getfixturevalue("engines_node")
    assert n.path(HOOK).is_file(), "node install put no nvidia-cdi-hook on the node"
    specs: dict = {"node": n}
    try:
        for tag, host in sorted(CASES):
            if cdihookbox.reference(tag) is not None:
                specs[tag, host] = Spec(n, fixtures_root, tag, host)
        if cdihookbox.reference("v1.17.0") is not None:  # its hooks carry no env
            n.write(SH_HOOK, f'#!/bin/sh\nexec {HOOK} "$@"\n', 0o755)
            specs["sh"] = Spec(n, fixtures_root, "v1.17.0", "host-gpu8", hook=SH_HOOK, suffix="-sh")
        n.restart_dockerd()  # Docker reads the spec directories at its start (then by inotify)
        yield specs
    finally:
        for s in specs.values():
            if isinstance(s, Spec):
                n.remove(s.file)


def spec_for(ctk, tag: str, host: str) -> Spec:
    if (tag, host) not in ctk:
        pytest.skip(f"NVIDIA's nvidia-ctk {tag} is not built (NVHOOK_REFERENCE_CDI)")
    return ctk[tag, host]


def run(n, engine: str, device: str, image: str, *, annotation: bool = False) -> View:
    if engine == "containerd":
        k = n.kubelet
        pod = k.run_pod(f"ctk-{uuid.uuid4().hex[:8]}")
        try:
            gpu = Allocation(annotations={"cdi.k8s.io/nvidia-device-plugin_test": device}) if annotation \
                else Allocation(cdi_devices=[device])
            cid = k.run_container(pod, "cuda", image, gpu=gpu)
            code, out, err = k.exec(cid, PROBE)
            assert code == 0, out + err
        finally:
            k.remove_pod(pod)
        return View(out)
    common = ("run", "--rm", "--network", "none", "--security-opt", "apparmor=unconfined", "--device", device)
    if engine == "docker":
        p = n.docker(*common, image, "sh", "-c", PROBE, check=False)
    else:
        p = n.podman(*common, "--cgroup-parent", f"{n.cgroup_parent}/podman", image, "sh", "-c", PROBE, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return View(p.stdout)


def assert_driver(v: View, host, gpu) -> None:
    """The GPU's node and the control nodes, open through the device cgroup; the loader cache and
    a CUDA program's libcuda the host's; nvidia-smi there."""
    assert {d for d in v.devices if d[len("nvidia"):].isdigit()} == {f"nvidia{gpu.minor}"}, v.out
    for name in (f"nvidia{gpu.minor}", "nvidiactl", "nvidia-uvm"):
        assert v.opens[f"/dev/{name}"] == ALLOWED, v.out
    assert v.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1", v.out
    assert v.probe.get("path") == f"{L}/libcuda.so.{host.driver}", v.out
    assert v.probe.get("cuDriverGetVersion") == str(host.cuda), v.out
    assert v.one("SMI") == f"nvidia-smi (nvhook fixture, driver {host.driver})", v.out


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tag", ["v1.17.0", "v1.18.0"])
def test_nvidia_spec_with_nvhooks_hook(ctk, tag, engine):
    s = spec_for(ctk, tag, "host-gpu8")
    gpu = s.host.gpus[4]
    done = len(s.events("cdi_hook.done"))
    # containerd: 1.17's spec through the CRI's CDI_devices field, 1.18's through the
    # cdi.k8s.io annotation (the device plugin's two CDI strategies)
    v = run(ctk["node"], engine, f"{s.kind}={gpu.index}", DEBIAN, annotation=tag == "v1.18.0")
    assert_driver(v, s.host, gpu)
    new = s.events("cdi_hook.done")[done:]
    assert len(new) == len(s.hooks), s.log.read_text()[-3000:]
    # the shell first stage: the first entry's Python process did the whole run, the other
    # entries ended in the shell (each engine's runtime runs the entries from one process)
    assert len({e["nvhook_pid"] for e in new}) == 1, new


@pytest.mark.parametrize("engine", ENGINES)
def test_geforce_host_with_compat_image_keeps_the_hosts_libcuda(ctk, engine):
    """NVIDIA 1.18's spec runs enable-cuda-compat --host-driver-version 460.80: NVIDIA's hook
    would put the image's 465 compat libcuda first, which a GeForce GPU cannot use (804)."""
    s = spec_for(ctk, "v1.18.0", "host-geforce-460")
    assert any(h["args"][3] == "enable-cuda-compat" for h in s.hooks), s.hooks
    gpu = s.host.gpus[0]
    decided = len(s.events("compat.decision"))
    v = run(ctk["node"], engine, f"{s.kind}={gpu.index}", CUDA113)
    assert_driver(v, s.host, gpu)
    assert "00-compat-nvhook.conf" not in v.one("CONFD"), v.out
    d = s.events("compat.decision")[decided:]
    assert [(e["decision"], e["reason_code"]) for e in d] == [("host", "gpu-not-supported")], d


POC = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void poc(void) {
    const char *m = getenv("POC_MARKER");
    FILE *f = m ? fopen(m, "a") : NULL;
    if (f) { fputs("preloaded\n", f); fclose(f); }
}
"""


def test_a_hostile_images_ld_preload_never_reaches_the_hook(ctk):
    """CVE-2025-23266's image (`ENV LD_PRELOAD=/proc/self/cwd/poc.so`, the library at its root)
    under NVIDIA 1.17.0's spec, whose hook entries carry no env, so runc starts them with the
    container's environment. nvhook's nvidia-cdi-hook as node install put it (the set-group-ID
    copy of the node's python3 as its interpreter): the library is never loaded into the hook,
    which runs as root on the node. The control, the same spec through a /bin/sh wrapper (a
    dynamically linked first stage), loads it: the test can fail."""
    s = spec_for(ctk, "v1.17.0", "host-gpu8")
    assert all("env" not in h for h in s.hooks), s.hooks
    n = ctk["node"]
    ctx = n.dir / "share/poc"
    ctx.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(ctx / "poc.so"), "-x", "c", "-"], input=POC, text=True,
                   check=True, capture_output=True, timeout=120)
    marker = "/run/nvhook-test/poc-marker"
    (ctx / "Containerfile").write_text(f"FROM {DEBIAN}\nCOPY poc.so /poc.so\n"
                                       f"ENV POC_MARKER={marker} LD_PRELOAD=/proc/self/cwd/poc.so\n")
    n.podman("build", "-q", "--network", "none", "-t", "nvhook.test/poc:1", "/nvhook/poc", timeout=300)
    gpu = s.host.gpus[4]
    on_node = n.path(marker)
    v = run(n, "podman", f"{s.kind}={gpu.index}", "nvhook.test/poc:1")
    assert_driver(v, s.host, gpu)  # the hooks ran, with their work done
    assert not on_node.exists(), "the container's LD_PRELOAD was loaded into nvhook's nvidia-cdi-hook"
    control = ctk["sh"]
    run(n, "podman", f"{control.kind}={gpu.index}", "nvhook.test/poc:1")
    assert on_node.read_text().startswith("preloaded"), "the control did not load the image's library"
    n.remove(marker)


def test_a_user_namespaced_podman_container_and_its_bundle(ctk):
    """podman run as root with the container's root mapped to host uid 100000 (--uidmap, as
    --userns=auto does): runc runs the spec's createContainer entries in that user namespace, as
    that unprivileged uid. nvhook's nvidia-cdi-hook as node install put it (set-group-ID copies,
    mode 2711) is executed there now (it was "fork/exec ...: permission denied" at mode 2710),
    but the container still does not start: the hook reads the container's root from the
    bundle's config.json, which podman keeps root's alone (/var/lib/containers/storage/
    overlay-containers/<id>/userdata), and that uid cannot open it. NVIDIA's hook reads the same
    file the same way (internal/oci/state.go, LoadSpec; not run here), so this is a limit shared
    with it, pinned here (docs/cdi-hook.md, "Limits"); with a bundle the uid can read (runc's
    own test in tests/test_cdihook_coalesce.py) the container starts. In a user namespace runc
    cannot mknod: it bind-mounts each device node from its container path on the node, so the
    fixture host's nodes are made at /dev for this container (a real node has them there)."""
    s = spec_for(ctk, "v1.17.0", "host-gpu8")
    n = ctk["node"]
    for copy in ("python3", "sh"):
        assert oct(n.path(f"/opt/nvhook/libexec/{copy}").stat().st_mode & 0o7777) == "0o2711"
    gpu = s.host.gpus[2]
    spec = json.loads(n.read(s.file))
    made = []
    for d in [*spec["containerEdits"].get("deviceNodes", []),
              *(e for dev in spec["devices"] for e in dev["containerEdits"].get("deviceNodes", []))]:
        if not n.path(d["path"]).exists():
            st = n.path(d.get("hostPath", d["path"])).stat()
            if not n.path(os.path.dirname(d["path"])).exists():
                n.run(["mkdir", os.path.dirname(d["path"])])
                made.append(os.path.dirname(d["path"]))
            n.run(["mknod", "-m", "666", d["path"], "c", str(os.major(st.st_rdev)), str(os.minor(st.st_rdev))])
            made.append(d["path"])
    try:
        p = n.podman("run", "--rm", "--network", "none", "--security-opt", "apparmor=unconfined",
                     "--uidmap", "0:100000:65536", "--gidmap", "0:100000:65536",
                     "--device", f"{s.kind}={gpu.index}", "--cgroup-parent", f"{n.cgroup_parent}/podman", DEBIAN,
                     "sh", "-c", 'echo "UIDMAP:$(cat /proc/self/uid_map | busybox tr -s \' \')"\n' + PROBE,
                     check=False, timeout=300)
    finally:
        if made:
            n.run(["rm", "-rf", *reversed(made)])
    assert p.returncode != 0, p.stdout
    assert "error running hook #0" in p.stderr and "permission denied" not in p.stderr.split("hook #0")[1][:80], \
        p.stderr  # executed: not runc's fork/exec refusal
    assert "nvidia-cdi-hook (nvhook): error: failed to determine container root from bundle" in p.stderr, p.stderr
    assert "/userdata/config.json'" in p.stderr and "Permission denied" in p.stderr, p.stderr
