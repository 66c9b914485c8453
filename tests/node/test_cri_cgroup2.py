"""GPU pods on a node whose cgroup hierarchy is cgroup v2: there the device cgroup is a BPF
program runc attaches per container, built from the spec's device rules, so nvhook's rules must
be in the spec (nvhook-runtime and CDI both put them there)."""

from __future__ import annotations

import pytest
from cri import device_plugin
from gpuprobe import CAPS, DENIED, GPUS, assert_gpus, assert_no_gpu, look
from images import DEBIAN


@pytest.fixture
def kubelet2(node_v2):
    k = node_v2.kubelet
    yield k
    k.remove_all()


def test_the_node_runs_cgroup_v2(node_v2):
    assert node_v2.run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"]).stdout.strip() == "cgroup2fs"


@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
def test_gpu_pod_on_cgroup_v2(kubelet2, node_v2, strategy):
    gpu, other = GPUS[2], GPUS[3]
    pod = kubelet2.run_pod(f"v2-{strategy}", runtime_handler="nvidia")
    cid = kubelet2.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                 gpu=device_plugin(strategy, [gpu.uuid]))
    assert_gpus(look(kubelet2, cid), [gpu])
    # the container's own cgroup in the v2 tree (the v1 device controller plays no part: the
    # refusal below is runc's BPF program)
    procs = node_v2.run(["cat", f"/sys/fs/cgroup{node_v2.cgroup_parent}/pod{pod.uid}/{cid}/cgroup.procs"]).stdout
    assert procs.split(), procs
    code, out, err = kubelet2.exec(cid, f"busybox mknod /tmp/other c 195 {other.minor} && "
                                        "head -c 1 /tmp/other 2>&1 | busybox sed 's/.*: //'")
    assert code == 0 and out.strip() == DENIED, (out, err)


def test_no_gpu_pod_on_cgroup_v2(kubelet2):
    pod = kubelet2.run_pod("v2-none", runtime_handler="nvidia")
    cid = kubelet2.run_container(pod, "app", DEBIAN)
    assert_no_gpu(look(kubelet2, cid))


def test_cdi_on_the_crun_handler(kubelet2):
    """crun 1.21 as the pod's runtime (its own handler), the GPU from nvhook's CDI spec, whose
    hooks run under crun. (On the v2 node: crun refuses a hybrid hierarchy whose cgroup2 holds
    a controller, as this machine kind's does.)"""
    gpu, other = GPUS[6], GPUS[7]
    pod = kubelet2.run_pod("crun-cdi", runtime_handler="crun")
    cid = kubelet2.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                 gpu=device_plugin("cdi-cri", [gpu.uuid]))
    assert_gpus(look(kubelet2, cid), [gpu])
    code, out, err = kubelet2.exec(cid, f"busybox mknod /tmp/other c 195 {other.minor} && "
                                        "head -c 1 /tmp/other 2>&1 | busybox sed 's/.*: //'")
    assert code == 0 and out.strip() == DENIED, (out, err)
