"""`nvhook node install` on the Debian 13 node (tests/node/node.py): a fresh node with containerd
1.7 and no nvhook, installed as the DaemonSet installs it (the node's root at a path of the
installer, here /proc/<node init>/root; the node's own python3, trixie's, runs nvhook), a GPU pod
run through the CRI with the runtime handler `nvidia` and the device plugin's volume-mounts
answer, then `node uninstall` leaves every file of the node's /etc, /opt and /var as it was."""

from __future__ import annotations

import noderoot
import pytest
from cri import device_plugin
from gpuprobe import CAPS, GPUS, assert_gpus, look
from images import DEBIAN
from node import CONTAINERD_CONFIG, HOST_ROOT, Node, node_install, node_tree


@pytest.fixture(scope="module")
def bare_node(machine_untouched, fixtures_root, node_inputs):
    """A node with containerd and the images, without the suite's own nvhook install."""
    images, _wheels = node_inputs
    Node.sweep_stale()
    n = Node(noderoot.ensure(), fixtures_root / "host-gpu8")
    try:
        n.start()
        n.start_containerd()
        n.import_images(images)
        yield n
    finally:
        problems = n.close()
        assert not problems, problems


def test_node_install_runs_a_gpu_pod_and_uninstall_leaves_the_node_as_it_was(bare_node):
    n = bare_node
    root = n.path("/")
    config_before = n.path(CONTAINERD_CONFIG).read_bytes()
    before = node_tree(root)
    r = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                "--device-list-strategy", "volume-mounts")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvhook for the node's Python 3.13 (/usr/bin/python3)" in r.stdout, r.stdout
    assert f"{CONTAINERD_CONFIG}: containerd: runtime nvidia" in r.stdout
    assert "created        /etc/cdi/nvhook.json: CDI spec" in r.stdout, r.stdout
    again = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                    "--device-list-strategy", "volume-mounts")
    assert again.stdout.strip() == "nvhook node install: nothing to change", again.stdout + again.stderr
    dump = n.run(["containerd", "--config", CONTAINERD_CONFIG, "config", "dump"]).stdout
    assert 'BinaryName = "/opt/nvhook/bin/nvhook-runtime"' in dump
    assert '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]' in dump
    n.restart_containerd()  # the node runs no systemd: the restart --restart-engine would do

    k = n.kubelet
    try:
        gpu = GPUS[3]
        pod = k.run_pod("node-install-gpu", runtime_handler="nvidia")
        cid = k.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                              gpu=device_plugin("volume-mounts", [gpu.uuid]))
        assert_gpus(look(k, cid), [gpu])
    finally:
        k.remove_all()

    r = node_install(n, "uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"restored       {CONTAINERD_CONFIG}: as before install" in r.stdout, r.stdout
    n.restart_containerd()
    assert n.path(CONTAINERD_CONFIG).read_bytes() == config_before
    after = node_tree(root)
    assert {k: v for k, v in after.items() if k not in before} == {}
    assert {k: v for k, v in before.items() if after.get(k) != v} == {}
    assert not n.path("/run/nvhook").exists()
