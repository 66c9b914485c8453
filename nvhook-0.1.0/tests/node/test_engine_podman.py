"""podman 5 on the Debian 13 node (tests/node/node.py, fixture `engines_node`): rootful, all its
state the node's, network none. nvhook as `node install` put it on the node (/opt/nvhook, the
node's python3), reached two ways: its OCI hook (the hooks file `nvhook setup` writes, given to
podman with --hooks-dir) with NVIDIA_VISIBLE_DEVICES by index or UUID, and its CDI spec
(`--device nvidia.com/gpu=N`, from /etc/cdi). A container that asked for no GPU is untouched
with the hook registered."""

from __future__ import annotations

import json

import pytest
from gpuprobe import CAPS, GPUS, SCRIPT, View, assert_gpus, assert_no_gpu
from images import DEBIAN

SMI = "nvidia-smi (nvhook fixture, driver 535.261.03)"
PROBE = SCRIPT + 'echo "SMI:$(nvidia-smi 2>&1)"\n'
SETUP = "/run/nvhook-test/podman-setup"  # node /run: not a file of the node's /etc
HOOKS_DIR = f"{SETUP}/etc/containers/oci/hooks.d"
RUN = ("run", "--rm", "--network", "none", "--security-opt", "apparmor=unconfined")


@pytest.fixture(scope="module")
def hooks(engines_node):
    """nvhook's hooks file for the node's install, as `nvhook setup` writes it (under a prefix,
    so the node's own /etc stays install's alone)."""
    engines_node.run(["/opt/nvhook/bin/nvhook", "setup", "--prefix", SETUP, "--hook-path", "/opt/nvhook/bin/nvhook"])
    spec = json.loads(engines_node.read(f"{HOOKS_DIR}/nvhook.json"))
    assert spec["hook"]["path"] == "/opt/nvhook/bin/nvhook" and spec["hook"]["args"][-1] == "prestart", spec
    return HOOKS_DIR


def podman_look(n, *args: str, env: dict | None = None) -> View:
    envs = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
    p = n.podman(*RUN, "--cgroup-parent", f"{n.cgroup_parent}/podman", *envs, *args, DEBIAN, "sh", "-c", PROBE,
                 check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return View(p.stdout)


def test_oci_hook_by_index(engines_node, hooks):
    gpu = GPUS[6]
    v = podman_look(engines_node, "--hooks-dir", hooks,
                    env={"NVIDIA_VISIBLE_DEVICES": str(gpu.index), "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, [gpu])
    assert v.one("SMI") == SMI, v.out


def test_oci_hook_by_uuid(engines_node, hooks):
    gpu = GPUS[3]
    v = podman_look(engines_node, "--hooks-dir", hooks,
                    env={"NVIDIA_VISIBLE_DEVICES": gpu.uuid, "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, [gpu])


def test_oci_hook_leaves_a_container_without_a_gpu_request_alone(engines_node, hooks):
    v = podman_look(engines_node, "--hooks-dir", hooks)
    assert_no_gpu(v)
    assert v.one("SMI").endswith("not found"), v.out


def test_cdi_device_with_nvhooks_spec(engines_node):
    gpu = GPUS[0]
    v = podman_look(engines_node, "--device", "nvidia.com/gpu=0", env={"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, [gpu])
    assert v.one("SMI") == SMI, v.out
