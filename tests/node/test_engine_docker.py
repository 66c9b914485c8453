"""Docker 26 on the Debian 13 node (tests/node/node.py, fixture `engines_node`): its own dockerd,
nvhook put there by `nvhook node install --runtime docker` as the DaemonSet does, and what a
user of `docker run` sees: `--runtime nvidia` with NVIDIA_VISIBLE_DEVICES by index or UUID (the
runtime wrapper nvhook-runtime), Docker's CDI (`--device nvidia.com/gpu=N`, CDI turned on in the
operator's daemon.json) with the spec install wrote, a container that asked for no GPU, and
`node uninstall` giving the operator's daemon.json back byte for byte."""

from __future__ import annotations

import json

from conftest import DAEMON_JSON
from gpuprobe import CAPS, GPUS, SCRIPT, View, assert_gpus, assert_no_gpu
from images import DEBIAN
from node import DOCKER_CONFIG, HOST_ROOT, node_install, node_tree

SMI = "nvidia-smi (nvhook fixture, driver 535.261.03)"
PROBE = SCRIPT + 'echo "SMI:$(nvidia-smi 2>&1)"\n'
# apparmor=unconfined: where the machine runs AppArmor, the node's dockerd cannot load its
# docker-default profile (no apparmor_parser in the node), and nothing here is about AppArmor
RUN = ("run", "--rm", "--network", "none", "--security-opt", "apparmor=unconfined")


def docker_look(n, *args: str, env: dict | None = None) -> View:
    envs = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
    p = n.docker(*RUN, *envs, *args, DEBIAN, "sh", "-c", PROBE, check=False)
    assert p.returncode == 0, p.stdout + p.stderr + n.dockerd_log.read_text(errors="replace")[-2000:]
    return View(p.stdout)


def test_runtime_nvidia_by_index(engines_node):
    n = engines_node
    info = json.loads(n.docker("info", "--format", "{{json .Runtimes}}").stdout)
    assert info["nvidia"]["path"] == "/opt/nvhook/bin/nvhook-runtime", info
    gpu = GPUS[5]
    v = docker_look(n, "--runtime", "nvidia", env={"NVIDIA_VISIBLE_DEVICES": str(gpu.index),
                                                   "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, [gpu])
    assert v.one("SMI") == SMI, v.out


def test_runtime_nvidia_by_uuid_two_gpus(engines_node):
    gpus = [GPUS[2], GPUS[7]]
    v = docker_look(engines_node, "--runtime", "nvidia",
                    env={"NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpus), "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, gpus)
    assert v.one("SMI") == SMI, v.out


def test_runtime_nvidia_without_a_gpu_request_is_untouched(engines_node):
    v = docker_look(engines_node, "--runtime", "nvidia")
    assert_no_gpu(v)
    assert v.one("SMI").endswith("not found"), v.out


def test_docker_cdi_device_with_nvhooks_spec(engines_node):
    """Docker's own CDI (default runtime runc, no nvhook-runtime): the spec's edits and nvhook's
    hook in it give the container GPU 1 and the driver."""
    n = engines_node
    assert json.loads(n.docker("info", "--format", "{{json .DefaultRuntime}}").stdout) == "runc"
    gpu = GPUS[1]
    v = docker_look(n, "--device", f"nvidia.com/gpu={gpu.index}", env={"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(v, [gpu])
    v = docker_look(n, "--device", f"nvidia.com/gpu={GPUS[4].uuid}")
    assert_gpus(v, [GPUS[4]])


def test_uninstall_gives_back_daemon_json_byte_identical(engines_node):
    n = engines_node
    r = node_install(n, "uninstall")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"restored       {DOCKER_CONFIG}: as before install" in r.stdout, r.stdout
        assert n.path(DOCKER_CONFIG).read_text() == DAEMON_JSON
        after = node_tree(n.path("/"))
        # but the hook's group, kept on purpose (docs/security.md), its mark and shadow-utils' files
        kept = ("etc/group", "etc/gshadow", "etc/group-", "etc/gshadow-", "etc/.pwd.lock", "var/lib/nvhook",
                "var/lib/nvhook/hook-group")
        assert {k: v for k, v in after.items() if k not in n.before_install and k not in kept} == {}
        assert {k: v for k, v in n.before_install.items() if after.get(k) != v and k not in kept} == {}
        # a reload (SIGHUP) keeps runtimes that daemon.json no longer names: restart, as
        # `node uninstall --restart-engine` does
        n.restart_dockerd()
        assert "nvidia" not in json.loads(n.docker("info", "--format", "{{json .Runtimes}}").stdout)
        p = n.docker(*RUN, "--runtime", "nvidia", DEBIAN, "true", check=False)
        assert p.returncode != 0 and "unknown or invalid runtime name: nvidia" in p.stderr, p.stderr
    finally:  # the other engines' tests of the session still need it
        again = node_install(n, "install", "--runtime", "docker", "--driver-root", HOST_ROOT)
        assert again.returncode == 0, again.stdout + again.stderr
        n.restart_dockerd()
