"""nvhook's CDI spec consumed by real podman 4.3.1 (`podman run --device nvidia.com/gpu=0`), with
runc as podman's runtime through a script that keeps a copy of the config.json podman hands it.

The spec is made by the installed `nvhook cdi generate` for a fixture host and put where
podman 4.3.1 reads specs (/run/cdi, in a private mount namespace: tests/e2e/cdibox.py). podman
creates the device nodes and mounts and the cgroup rules from the spec; nvhook's
createContainer hook does the in-container part for the GPUs it finds in config.json's
linux.devices. Opening a node tells the device cgroup's answer without a GPU: ENXIO = allowed,
no driver behind it; EPERM = denied.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdibox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from gpuview import (  # noqa: E402
    LIBCUDA,
    L,
    assert_gpu0,  # noqa: E402
    line,
)
from gpuview import SCRIPT as USER_VIEW  # noqa: E402

pytestmark = [pytest.mark.podman, pytest.mark.skipif(cdibox.skip_reason() is not None,
                                                     reason=cdibox.skip_reason() or "")]

ENXIO = "No such device or address"
EPERM = "Operation not permitted"
DEVS = 'for d in /dev/nvidia*; do echo "NODE $d $(stat -c "%t:%T" $d)"; done'


class Setup:
    def __init__(self, tmp: Path, host: Path, *, image: str = "container-debian", cgroup2: bool = False,
                 generate_args: list[str] | None = None):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.log_file = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "hook.toml", log_file=self.log_file, cache_dir=tmp / "cache")
        self.podman = cdibox.CdiPodman(tmp, cgroup2=cgroup2)
        self.spec_file = self.podman.spec_dir / "nvhook.json"
        if generate_args is not None and any(a.endswith(".yaml") for a in generate_args):
            self.spec_file = self.podman.spec_dir / "nvhook.yaml"
            generate_args = [a for a in generate_args if not a.endswith(".yaml")]
        p = cdibox.generate(self.spec_file, config=self.config, host=host, extra=generate_args)
        assert p.returncode == 0, p.stderr
        self.rootfs = mf.build_container(image, tmp / "images")

    def run(self, script: str, devices=("nvidia.com/gpu=0",), env: dict | None = None, **kw):
        return self.podman.run(self.rootfs, script, list(devices), env=env, **kw)

    def events(self, name: str | None = None) -> list[dict]:
        evs = rb.read_events(self.log_file)
        return evs if name is None else [e for e in evs if e["event"] == name]


@pytest.fixture
def make(tmp_path, fixtures_root):
    made = []

    def _make(host: str = "host-gpu8", **kw) -> Setup:
        s = Setup(tmp_path / f"s{len(made)}", fixtures_root / host, **kw)
        made.append(s)
        return s

    yield _make
    for s in made:
        try:
            assert s.podman.leftovers() == []
            assert rb.host_mounts_under(s.tmp, s.podman.runroot) == []
        finally:
            s.podman.close()


def node_numbers(out: str) -> dict[str, tuple[int, int]]:
    res = {}
    for ln in out.splitlines():
        if ln.startswith("NODE "):
            _, path, num = ln.split(" ")
            ma, mi = num.split(":")
            res[path] = (int(ma, 16), int(mi, 16))
    return res


def test_gpu0_through_podman_and_cdi(make):
    s = make()
    p = s.run(USER_VIEW + f"\n{DEVS}\necho ENV:$NVIDIA_VISIBLE_DEVICES\n")
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)  # ENXIO on nvidia0 and nvidiactl, no nvidia1, ro libcuda, ldconfig, cuda-probe
    nodes = node_numbers(p.stdout)
    host0 = os.stat(s.host / "dev/nvidia0")
    assert nodes["/dev/nvidia0"] == (os.major(host0.st_rdev), os.minor(host0.st_rdev)) == (195, 0)
    assert sorted(nodes) == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl"]
    assert line(p.stdout, "ENV:") == "void"
    # what podman handed runc: the nodes and one allow rule per node, after its deny-all
    spec = s.podman.captured()
    devs = {d["path"]: d for d in spec["linux"]["devices"]}
    assert {k: devs["/dev/nvidia0"][k] for k in ("type", "major", "minor")} == {"type": "c", "major": 195, "minor": 0}
    assert "/dev/nvidia1" not in devs
    rules = spec["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    nvidia_rules = [r for r in rules if r.get("major") in (195, 235)]
    assert sorted((r["major"], r["minor"]) for r in nvidia_rules) == [(195, 0), (195, 255), (235, 0), (235, 1)]
    assert all(r["allow"] is True and r["type"] == "c" and r["access"] == "rw" for r in nvidia_rules)
    binds = {m["destination"]: m for m in spec["mounts"]}
    assert binds[f"{L}/{LIBCUDA}"]["source"] == str(s.host) + f"{L}/{LIBCUDA}"
    assert "ro" in binds[f"{L}/{LIBCUDA}"]["options"]
    hooks = spec["hooks"]["createContainer"]
    assert [h["path"] for h in hooks] == [str(rb.NVHOOK_BIN)]
    # the hook: the GPU from linux.devices, only the in-container part, the log as in hook mode
    start = s.events("hook.start")[0]
    assert start["stage"] == "createContainer" and start["cdi"] == "compute,utility"
    req = s.events("request")[0]
    assert req["source"] == "cdi linux.devices" and req["devices"] == ["0"]
    assert s.events("compat.decision")[0]["decision"] == "host"
    done = s.events("hook.done")[0]
    assert done["result"] == "ok"
    assert not [t for t in done["mounted"] if t.startswith(("/dev/", L, "/usr/bin/"))], done["mounted"]
    assert s.events("apply.done")[0]["devices"] == 0 and s.events("ldcache.written")


def test_second_gpu_and_a_mig_device(make):
    s = make()
    g = mf.HOSTS["host-gpu8"].gpus
    p = s.run(f"{DEVS}; echo GPUS:$(ls /proc/driver/nvidia/gpus); "
              "echo CAPS:$(find /proc/driver/nvidia/capabilities -type f | sort | tr '\\n' ' ')",
              devices=("nvidia.com/gpu=3", "nvidia.com/gpu=0:1"))
    assert p.returncode == 0, p.stderr
    nodes = node_numbers(p.stdout)
    assert nodes["/dev/nvidia3"] == (195, 3) and nodes["/dev/nvidia0"] == (195, 0)
    assert "/dev/nvidia1" not in nodes
    assert sorted(line(p.stdout, "GPUS:").split()) == sorted([g[0].bus_id, g[3].bus_id])
    assert line(p.stdout, "CAPS:").split() == ["/proc/driver/nvidia/capabilities/gpu0/mig/gi2/access",
                                               "/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access"]
    req = s.events("request")[0]
    assert req["devices"] == [g[0].migs[1].uuid, "3"]


def test_cgroup_v2_nodes_give_enxio_not_eperm(make):
    """runc in real cgroup v2 mode (its BPF device program from linux.resources.devices)."""
    s = make(cgroup2=True)

    def probes(rootfs: Path) -> None:
        (rootfs / "probe").mkdir()
        os.mknod(rootfs / "probe/nvidia1", 0o666 | 0o020000, os.makedev(195, 1))

    probes(s.rootfs)
    p = s.run("grep ' /sys/fs/cgroup ' /proc/self/mountinfo; "
              "for d in /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /probe/nvidia1; do "
              "echo \"OPEN $d: $( (: <>$d) 2>&1)\"; done")
    assert p.returncode == 0, p.stderr
    assert " - cgroup2 " in p.stdout, p.stdout  # runc ran in v2 mode
    opened = {ln.split(": ", 1)[0][5:]: ln.split(": ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("OPEN ")}
    for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert ENXIO in opened[d], (d, opened)
    assert EPERM in opened["/probe/nvidia1"], opened


@pytest.mark.parametrize("host, expect", [("host-geforce-460", "host"), ("host-t4-450", "image")])
def test_forward_compat_decision_per_gpu(make, host, expect):
    """Seed 003: on GeForce the image's compat libcuda would fail with 804, so the host's is used;
    on a T4 the compat one is. The spec is the same kind for both; the hook decides."""
    s = make(host, image="container-cuda113")
    p = s.run("/usr/bin/cuda-probe; echo REAL:$(realpath /usr/lib/x86_64-linux-gnu/libcuda.so.1); "
              "/sbin/ldconfig -p | grep 'libcuda.so.1 '")
    assert p.returncode == 0, p.stderr
    compat = mf.CONTAINERS["container-cuda113"].compat
    spec = mf.HOSTS[host]
    want = (f"{L}/libcuda.so.{compat.version}", compat.cuda) if expect == "image" else \
        (f"{L}/libcuda.so.{spec.driver}", spec.cuda)
    assert line(p.stdout, "path: ") == want[0]
    assert line(p.stdout, "cuDriverGetVersion: ") == str(want[1])
    assert line(p.stdout, "REAL:") == want[0]
    assert f"=> {L}/libcuda.so.1" in p.stdout
    d = s.events("compat.decision")[0]
    assert d["decision"] == expect
    if expect == "host":
        assert d["reason_code"] == "gpu-not-supported" and any("CUDA error 804" in w for w in d["warnings"])


def test_hook_takes_nothing_from_the_containers_environment(make, tmp_path):
    """CVE-2025-23266 was a hook that inherited the container's LD_PRELOAD. The container sets
    LD_PRELOAD to a host library that would leave a marker if any process loaded it, and asks
    for GPU 5 in NVIDIA_VISIBLE_DEVICES: the hook must load nothing and select what the runtime
    gave (GPU 0)."""
    marker = tmp_path / "preloaded"
    evil = tmp_path / "evil.so"
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void f(void) {\n'
                   f'  FILE *o = fopen("{marker}", "a"); if (o) {{ fputs("loaded\\n", o); fclose(o); }}\n}}\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(evil), str(src)], check=True, timeout=60)
    # the test can fail: the library really leaves its marker when preloaded
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(evil)}, check=True)
    assert marker.read_text() == "loaded\n"
    marker.unlink()
    s = make()
    p = s.run("echo GPUS:$(ls /proc/driver/nvidia/gpus); echo ENV:$NVIDIA_VISIBLE_DEVICES",
              env={"LD_PRELOAD": str(evil), "NVIDIA_VISIBLE_DEVICES": "5", "NVIDIA_DRIVER_CAPABILITIES": "all"})
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    assert line(p.stdout, "GPUS:") == mf.HOSTS["host-gpu8"].gpus[0].bus_id
    req = s.events("request")[0]
    assert req["devices"] == ["0"] and req["capabilities"] == ["compute", "utility"]
    assert s.events("hook.done")[0]["result"] == "ok"


def test_yaml_spec(make):
    s = make(generate_args=["x.yaml"])
    assert s.spec_file.suffix == ".yaml" and s.spec_file.read_text().startswith("---\n")
    p = s.run(USER_VIEW)
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)


def test_cdi_version_is_what_podman_accepts(make):
    """nvhook writes 0.5.0 (the lowest with index names and hostPath); podman 4.3.1 takes it and
    rejects the same spec labelled 0.6.0."""
    s = make()
    spec = json.loads(s.spec_file.read_text())
    assert spec["cdiVersion"] == "0.5.0"
    assert s.run("echo OK").stdout == "OK\n"
    s.spec_file.write_text(json.dumps(dict(spec, cdiVersion="0.6.0")))
    p = s.run("echo OK")
    assert p.returncode != 0 and "unresolvable CDI devices nvidia.com/gpu=0" in p.stderr


def test_container_without_a_cdi_device_gets_nothing(make):
    s = make()
    p = s.run("echo DEV:$(ls /dev | grep -c nvidia); echo ENV:$NVIDIA_VISIBLE_DEVICES", devices=())
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "DEV:") == "0" and line(p.stdout, "ENV:") == ""
    assert s.events("hook.start") == []  # the hook is the spec's: not run at all


def test_cdi_hook_imports_only_what_it_uses(make):
    """Python's import log (PYTHONPROFILEIMPORTTIME) of the spec's hook on a warm inventory cache:
    the CDI hook is on the container-start path like hook mode, with the same budget."""
    from test_e2e_runc import NOT_ON_START_PATH

    s = make()
    errs = s.tmp / "hook-stderr"
    spec = json.loads(s.spec_file.read_text())
    hook = spec["containerEdits"]["hooks"][0]
    quoted = " ".join(shlex.quote(a) for a in [hook["path"], *hook["args"][1:]])
    hook.update(path="/bin/sh", args=["sh", "-c", f"exec {quoted} 2>>{shlex.quote(str(errs))}"],
                env=[*hook["env"], "PYTHONPROFILEIMPORTTIME=1"])
    s.spec_file.write_text(json.dumps(spec))
    for _ in range(2):  # the first start builds the inventory and config caches
        errs.write_text("")
        p = s.run("true")
        assert p.returncode == 0, p.stderr
    imported = {ln.split("|")[-1].strip() for ln in errs.read_text().splitlines() if ln.startswith("import time:")}
    assert "nvhook.apply.child" in imported and "nvhook.decide.cdimodel" in imported  # the log is real
    assert {m for m in imported if m.split(".")[0] in NOT_ON_START_PATH} == set()


def test_legacy_hook_beside_the_spec_injects_nothing_twice(make):
    """nvhook's OCI hooks dir registered as well (`when: always`): the spec's
    NVIDIA_VISIBLE_DEVICES=void makes hook mode skip the container, so every library is mounted
    once and the createContainer hook alone does the in-container part."""
    s = make()
    hook_log = s.tmp / "hook-mode.jsonl"
    conf = rb.write_nvhook_config(s.tmp / "hook-mode.toml", log_file=hook_log, cache_dir=s.tmp / "cache-hm",
                                  root=s.host)
    s.podman.base += ["--hooks-dir", str(rb.podman_hooks_dir(s.tmp / "hooks.d", conf))]
    p = s.run(USER_VIEW)
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)  # includes MOUNTS-LIBCUDA:1
    hm = rb.read_events(hook_log)
    assert [e["kind"] for e in hm if e["event"] == "request"] == ["skip"]
    assert [e["mounted"] for e in hm if e["event"] == "hook.done"] == [[]]
    assert s.events("hook.done")[0]["result"] == "ok"


@pytest.mark.skipif(not shutil.which("crun"), reason="crun is not installed")
def test_crun_as_podmans_runtime(make):
    """crun runs createContainer hooks in the container's namespaces too, and hands them a
    state whose pid is 0. crun refuses this machine's hybrid cgroups and cannot load a device
    program in this sandbox, so it runs in cgroup2 mode with cgroups off: the nodes, mounts and
    the hook's in-container part are what is checked (device access is runc's, above)."""
    s = make()
    s.podman.close()
    s.podman = cdibox.CdiPodman(s.tmp / "crun", cgroup2=True, runtime="crun")
    s.podman.spec_dir.rmdir()
    s.podman.spec_dir.symlink_to(s.spec_file.parent)
    p = s.run(USER_VIEW, extra=["--cgroups", "disabled"])
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)
    assert s.events("hook.start")[0]["stage"] == "createContainer"
    assert s.events("request")[0]["devices"] == ["0"]


def test_rhel_image_and_all_capabilities(make):
    """One spec serves every image: a RHEL-layout image (lib64, no multiarch directories) gets
    the libraries in the host's directory, which the hook puts first in its ld.so.cache; with
    --capabilities all the 32-bit libraries and the modeset node come too."""
    s = make(image="container-rhel", generate_args=["--capabilities", "all"])
    p = s.run("/usr/bin/cuda-probe; /sbin/ldconfig -p | grep -E 'libcuda.so.1 |libnvidia-glcore'; "
              "ls /dev | grep -c nvidia-modeset")
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1" in p.stdout
    assert "libcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1" in p.stdout
    assert f"libnvidia-glcore.so.{mf.DRIVER_535} (libc6,x86-64) => {L}/libnvidia-glcore.so.{mf.DRIVER_535}" in p.stdout
    assert p.stdout.splitlines()[-1] == "1"
    assert s.events("request")[0]["capabilities"] == ["compute", "compat32", "graphics", "utility", "video",
                                                      "display", "ngx"]


def test_gbm_backend_link_as_nvidia_ctk_makes_it(make):
    """Mesa's libgbm loads <libdir>/gbm/nvidia-drm_gbm.so for the nvidia-drm device; nvidia-ctk's
    spec links it to libnvidia-allocator; nvhook's hook makes the same link, inside the rootfs."""
    s = make(generate_args=["--capabilities", "all"])
    p = s.run(f"readlink {L}/gbm/nvidia-drm_gbm.so; test -e {L}/gbm/nvidia-drm_gbm.so && echo RESOLVES")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["../libnvidia-allocator.so.1", "RESOLVES"]


def test_management_spec_gives_every_node(make):
    """`cdi generate --mode management`: kind management.nvidia.com/gpu, device all, as NVIDIA's
    toolkit names it for monitoring containers: every GPU node, the MIG config/monitor nodes,
    the driver's files; nvhook's hook does the in-container part for all of them."""
    s = make("host-gpu8", generate_args=["--mode", "management"])
    spec = json.loads(s.spec_file.read_text())
    assert spec["kind"] == "management.nvidia.com/gpu" and [d["name"] for d in spec["devices"]] == ["all"]
    p = s.run(f"{DEVS}\nls /dev/nvidia-caps; ls /usr/bin/nvidia-smi; readlink {L}/libcuda.so",
              devices=("management.nvidia.com/gpu=all",))
    assert p.returncode == 0, p.stderr
    nodes = node_numbers(p.stdout)
    assert {f"/dev/nvidia{i}" for i in range(8)} <= set(nodes)
    assert "nvidia-cap1" in p.stdout.split() and "nvidia-cap2" in p.stdout.split()
    assert "/usr/bin/nvidia-smi" in p.stdout and "libcuda.so.1" in p.stdout
    assert s.events("hook.done")[-1]["result"] == "ok"
