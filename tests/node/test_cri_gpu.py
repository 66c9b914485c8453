"""kubelet's side of GPU pods on a Debian 13 node (containerd 1.7 through its CRI, nvhook's runtime
handler, the 8-GPU fixture host as the driver): what a user sees inside each container
(ExecSync), and the container as the CRI reports it (ContainerStatus).

The GPUs are requested the way NVIDIA's device plugin answers kubelet, for each of its
deviceListStrategy values and both deviceIDStrategy values (cri.device_plugin)."""

from __future__ import annotations

import make_fixtures as mf
import pytest
from cri import STRATEGIES, CRIError, device_plugin, pb
from gpuprobe import ALLOWED, CAPS, DENIED, GPUS, assert_gpus, assert_no_gpu, look
from images import CUDA113, DEBIAN, PAUSE
from node import CONTAINERD_CONFIG, ENGINES, NVHOOK_RUNTIME

HANDLER = "nvidia"
GPU_ENV = {"NVIDIA_DRIVER_CAPABILITIES": CAPS}  # as CUDA images set it


def _id(gpu, by: str) -> str:
    return gpu.uuid if by == "uuid" else str(gpu.index)


def _gpu_pod(kubelet, name: str, strategy: str, ids: list[str], *, handler: str = HANDLER, image: str = DEBIAN):
    pod = kubelet.run_pod(name, runtime_handler=handler)
    cid = kubelet.run_container(pod, "cuda", image, env=GPU_ENV, gpu=device_plugin(strategy, ids))
    return pod, cid


def test_node_runs_containerd_with_cdi_and_the_nvhook_handler(node):
    """containerd 1.7 on the trixie root, 2.1 on the sid one (each with runc, crun, podman and
    Docker of its suite); CDI on; nvhook's handler as `node install` registered it."""
    want = ENGINES[node.suite]
    v = node.cri.Version()
    assert v.runtime_name == "containerd" and v.runtime_version.startswith(want["containerd"]), v
    assert v.runtime_api_version == "v1"
    for tool in ("runc", "crun", "podman", "dockerd"):
        assert node.run([tool, "--version"]).stdout.startswith(want[tool]), tool
    dump = node.containerd_dump()
    assert (dump["plugins"].get("io.containerd.cri.v1.runtime") or dump["plugins"]["io.containerd.grpc.v1.cri"])[
        "enable_cdi"] is True
    handler = node.cri_runtimes(dump)["runtimes"]["nvidia"]
    assert handler["options"]["BinaryName"] == "/opt/nvhook/bin/nvhook-runtime"
    assert handler["runtime_type"] == "io.containerd.runc.v2"
    # the sandbox image is local and present: no pull is ever tried
    images = {t: i for i in node.cri.ListImages().images for t in i.repo_tags}
    assert PAUSE in images and images[PAUSE].pinned


@pytest.mark.parametrize("by", ["uuid", "index"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_device_plugin_strategy(kubelet, node, strategy, by):
    gpu = GPUS[2]
    pod, cid = _gpu_pod(kubelet, f"gpu-{strategy}-{by}", strategy, [_id(gpu, by)])
    assert_gpus(look(kubelet, cid), [gpu])
    st = kubelet.status(cid)
    assert st.state == pb().CONTAINER_RUNNING, st
    assert st.image.image == DEBIAN and st.image_ref.startswith("sha256:"), st
    assert kubelet.cri.PodSandboxStatus(pod_sandbox_id=pod.id).status.runtime_handler == HANDLER
    paths = {m.container_path for m in st.mounts}
    assert {"/etc/hosts", "/dev/termination-log", "/var/run/secrets/kubernetes.io/serviceaccount"} <= paths
    if strategy == "volume-mounts":
        assert f"/var/run/nvidia-container-devices/{_id(gpu, by)}" in paths
    # kubelet's files are the ones it mounted, untouched by the GPU edits
    code, out, _ = kubelet.exec(cid, "cat /var/run/secrets/kubernetes.io/serviceaccount/namespace; "
                                     "head -1 /etc/hosts; test -f /dev/termination-log && echo TERM-OK")
    assert code == 0 and out.startswith("default127.0.0.1") and "TERM-OK" in out, out


@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
@pytest.mark.parametrize("by", ["uuid", "index"])
def test_mig_device(kubelet, strategy, by):
    """A MIG device (GPU 0, GPU instance 1, compute instance 0) as the device plugin's mixed
    strategy names it: its MIG UUID, or "0:0"."""
    gpu = GPUS[0]
    mig = gpu.migs[0]
    ident = mig.uuid if by == "uuid" else f"{gpu.index}:{mig.slot}"
    _pod, cid = _gpu_pod(kubelet, f"mig-{strategy}-{by}", strategy, [ident])
    caps = {f"nvidia-cap{mf.mig_minor(gpu.minor, mig.gi)}", f"nvidia-cap{mf.mig_minor(gpu.minor, mig.gi, mig.ci)}"}
    view = look(kubelet, cid)
    assert_gpus(view, [gpu], mig_caps=caps)
    code, out, _ = kubelet.exec(cid, f"ls /proc/driver/nvidia/capabilities/gpu{gpu.minor}/mig")
    assert code == 0 and out.split() == [f"gi{mig.gi}"], out  # GPU 0's other instance stays hidden


def test_two_pods_on_two_gpus_are_isolated(kubelet):
    a, b = GPUS[4], GPUS[5]
    _pa, ca = _gpu_pod(kubelet, "iso-a", "envvar", [a.uuid])
    _pb, cb = _gpu_pod(kubelet, "iso-b", "cdi-cri", [b.uuid])
    assert_gpus(look(kubelet, ca), [a])
    assert_gpus(look(kubelet, cb), [b])
    # a node made for the other pod's GPU inside this one: the device cgroup refuses it
    for cid, other in ((ca, b), (cb, a)):
        code, out, err = kubelet.exec(cid, f"busybox mknod /tmp/other c 195 {other.minor} && "
                                           "head -c 1 /tmp/other 2>&1 | busybox sed 's/.*: //'")
        assert code == 0 and out.strip() == DENIED, (out, err)


def test_pod_without_gpu_is_untouched(kubelet, node):
    before = len(node.nvhook_events("runtime.edited"))
    pod = kubelet.run_pod("no-gpu", runtime_handler=HANDLER)
    cid = kubelet.run_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_no_gpu(look(kubelet, cid))
    st = kubelet.status(cid)
    assert st.state == pb().CONTAINER_RUNNING
    assert {m.container_path for m in st.mounts} == {"/etc/hosts", "/dev/termination-log",
                                                       "/var/run/secrets/kubernetes.io/serviceaccount"}
    assert len(node.nvhook_events("runtime.edited")) == before
    engine, given = node.specs(cid)
    assert given == engine  # the spec reached runc exactly as containerd made it


def test_gpu_pod_spec_carries_the_edits(kubelet, node):
    """The other side of the check above: nvhook-runtime's edits are in the spec runc got (the
    device, its cgroup rule, nvhook's hook), not in the one containerd keeps."""
    gpu = GPUS[1]
    _pod, cid = _gpu_pod(kubelet, "edited", "envvar", [gpu.uuid])
    engine, given = node.specs(cid)
    assert given != engine
    paths = [d["path"] for d in given["linux"]["devices"]]
    assert f"/dev/nvidia{gpu.minor}" in paths and not any(p.startswith("/dev/nvidia") for p in
                                                          [d["path"] for d in engine["linux"].get("devices") or []])
    rules = given["linux"]["resources"]["devices"]
    assert {"allow": True, "type": "c", "major": 195, "minor": gpu.minor, "access": "rw"} in rules, rules


def test_unknown_gpu_fails_create_with_nvhooks_reason(kubelet):
    pod = kubelet.run_pod("bad-gpu", runtime_handler=HANDLER)
    with pytest.raises(CRIError) as e:
        kubelet.run_container(pod, "cuda", DEBIAN, env=GPU_ENV, gpu=device_plugin("envvar", ["GPU-no-such-gpu"]))
    assert "GPU-no-such-gpu" in e.value.details, e.value.details


def test_update_container_resources_keeps_the_gpu(kubelet, node):
    """kubelet resizes a running container (UpdateContainerResources): runc rewrites its cgroup,
    and the GPU must still open afterwards."""
    gpu = GPUS[3]
    _pod, cid = _gpu_pod(kubelet, "resize", "envvar", [gpu.uuid])
    node.cri.UpdateContainerResources(container_id=cid, linux=pb().LinuxContainerResources(
        cpu_shares=512, cpu_period=100000, cpu_quota=50000, memory_limit_in_bytes=256 << 20))
    st = kubelet.status(cid)
    assert st.resources.linux.memory_limit_in_bytes == 256 << 20, st.resources
    view = look(kubelet, cid)
    assert view.opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, view.out
    code, out, _ = kubelet.exec(cid, f"busybox mknod /tmp/other c 195 {GPUS[6].minor} && "
                                     "head -c 1 /tmp/other 2>&1 | busybox sed 's/.*: //'")
    assert out.strip() == DENIED, out


def test_containerd_restarted_under_a_running_gpu_pod(kubelet, node):
    gpu = GPUS[6]
    pod, cid = _gpu_pod(kubelet, "restart", "cdi-annotations", [gpu.uuid])
    assert_gpus(look(kubelet, cid), [gpu])
    node.restart_containerd()
    st = kubelet.status(cid)
    assert st.state == pb().CONTAINER_RUNNING, st
    assert_gpus(look(kubelet, cid), [gpu])  # the running container kept its GPU
    # and the restarted engine starts the next container of the same pod with nvhook
    cid2 = kubelet.run_container(pod, "second", DEBIAN, env=GPU_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    assert_gpus(look(kubelet, cid2), [gpu])


def test_cuda_image_with_forward_compat(kubelet):
    """A CUDA 11.3 image on the 535 driver (CUDA 12.2): the host's libcuda, not the image's
    compat one, since the driver is newer."""
    gpu = GPUS[7]
    _pod, cid = _gpu_pod(kubelet, "cuda113", "envvar", [gpu.uuid], image=CUDA113)
    assert_gpus(look(kubelet, cid), [gpu])


def test_machine_cgroup_hierarchy_is_the_nodes(node, kubelet):
    """The node runs on the machine's own cgroup hierarchy: the pod's container is in a cgroup
    under the node's parent, and its device rules are the machine kernel's."""
    gpu = GPUS[1]
    _pod, cid = _gpu_pod(kubelet, "cgroup", "envvar", [gpu.uuid])
    code, out, _ = kubelet.exec(cid, "cat /proc/self/cgroup")
    assert code == 0 and node.cgroup_parent in out, out


@pytest.mark.parametrize("strategy", ["cdi-annotations", "cdi-cri"])
def test_cdi_strategies_need_no_runtime_handler(kubelet, strategy):
    """With CDI, containerd itself applies nvhook's spec (/etc/cdi/nvhook.json): a pod on the
    default runc handler gets its GPU, with the loader cache from the spec's nvhook hook."""
    gpu = GPUS[5]
    _pod, cid = _gpu_pod(kubelet, f"plain-{strategy}", strategy, [str(gpu.index)], handler="")
    assert_gpus(look(kubelet, cid), [gpu])


def test_envvar_on_the_plain_runc_handler_gets_nothing(kubelet):
    """Without nvhook's handler (and with no CDI request) NVIDIA_VISIBLE_DEVICES is just a
    variable: what a pod without the RuntimeClass sees."""
    _pod, cid = _gpu_pod(kubelet, "plain-envvar", "envvar", [GPUS[5].uuid], handler="")
    assert_no_gpu(look(kubelet, cid))


def test_default_runtime_setting(node, kubelet):
    """`nvhook runtime configure --set-as-default`: pods that name no runtime handler (no
    RuntimeClass) get nvhook-runtime; undone, they get plain runc again."""
    gpu = GPUS[3]
    before = node.read(CONTAINERD_CONFIG)
    try:
        node.nvhook("runtime", "configure", "--runtime", "containerd", "--config", CONTAINERD_CONFIG,
                    "--runtime-path", NVHOOK_RUNTIME, "--set-as-default")
        assert node.cri_runtimes()["default_runtime_name"] == "nvidia"
        node.restart_containerd()
        pod, cid = _gpu_pod(kubelet, "default-nvhook", "envvar", [gpu.uuid], handler="")
        assert_gpus(look(kubelet, cid), [gpu])
        kubelet.remove_pod(pod)
    finally:
        node.write(CONTAINERD_CONFIG, before)
        node.restart_containerd()
    _pod, cid = _gpu_pod(kubelet, "default-runc", "envvar", [gpu.uuid], handler="")
    assert_no_gpu(look(kubelet, cid))


def test_nri_can_be_enabled(node, kubelet):
    """What the NRI plugin tests start from: containerd's NRI switched on, its socket on the
    machine; GPU pods through nvhook's handler work the same with it on."""
    from pathlib import Path

    node.enable_nri()
    try:
        assert Path(node.nri_socket).is_socket()
        gpu = GPUS[4]
        _pod, cid = _gpu_pod(kubelet, "nri-on", "envvar", [gpu.uuid])
        assert_gpus(look(kubelet, cid), [gpu])
    finally:
        node.enable_nri(False)
    assert 'disable = true' in node.read(CONTAINERD_CONFIG)


def test_gpu_pod_stop_and_remove_leave_nothing(kubelet, node):
    """kubelet deleting a GPU pod: StopContainer, RemoveContainer, StopPodSandbox,
    RemovePodSandbox; the engine lists neither afterwards and the task's bundle is gone."""
    gpu = GPUS[7]
    pod, cid = _gpu_pod(kubelet, "delete-me", "volume-mounts", [gpu.uuid])
    tasks = "/run/containerd/io.containerd.runtime.v2.task/k8s.io"
    assert cid in node.run(["ls", tasks]).stdout.split()
    kubelet.remove_pod(pod)
    assert cid not in {c.id for c in node.cri.ListContainers().containers}
    assert pod.id not in {p.id for p in node.cri.ListPodSandbox().items}
    left = node.run(["ls", tasks]).stdout.split()
    assert cid not in left and pod.id not in left, left


@pytest.mark.parametrize("strategy", ["volume-mounts", "cdi-annotations"])
def test_pod_with_four_gpus(kubelet, strategy):
    """A training pod's share of an 8-GPU node: four GPUs in one container, by index."""
    gpus = [GPUS[i] for i in (2, 3, 6, 7)]
    _pod, cid = _gpu_pod(kubelet, f"four-{strategy}", strategy, [str(g.index) for g in gpus])
    assert_gpus(look(kubelet, cid), gpus)
