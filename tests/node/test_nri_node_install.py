"""`nvhook node install --nri` on a node booted by its own systemd 257 (tests/node/sdnode.py), as
the DaemonSet's NRI variant runs it (deploy/kubernetes/daemonset-nri.yaml): containerd 1.7 with
NRI off (its default) before install.

- `node install --runtime containerd --nri --restart-engine`: containerd's config gets NRI on
  (containerd's own `config dump` says so), containerd is restarted through the node's
  systemctl, nvhook-nri.service (the shipped unit, run from /opt/nvhook, with the socket_path
  the node's containerd config names) is enabled and active,
  and a GPU pod with NO runtime class gets its GPU from the plugin; a pod that asked for no GPU
  gets nothing; a pod of the runtime class `nvidia` still gets its GPU from nvhook-runtime, left
  alone by the plugin (both coexist);
- the plugin killed with SIGKILL: systemd brings it back and GPU pods get their GPUs again;
- `node uninstall --restart-engine`: the unit stopped and gone, containerd's config byte for byte
  as before install, pods still start (a GPU pod without runtime class now without its GPU).

Skips with the reason where systemd cannot boot here (sdnode.cannot_boot()).
"""

from __future__ import annotations

import pytest
from cri import device_plugin
from gpuprobe import ALLOWED, CAPS, GPUS, HOST, L, assert_gpus, assert_no_gpu, look
from images import DEBIAN
from node import CONTAINERD_CONFIG, HOST_ROOT, NRI_SOCKET, node_install
from waiting import wait_until

NRI_UNIT = "nvhook-nri.service"
UNIT_PATH = f"/etc/systemd/system/{NRI_UNIT}"
CUDA = f"{HOST.cuda // 1000}.{HOST.cuda % 1000 // 10}"
CUDA_IMAGE_ENV = {"NVIDIA_DRIVER_CAPABILITIES": CAPS, "CUDA_VERSION": f"{CUDA}.0",
                  "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"}
DEADLINE = 60


def _wait(what: str, cond, diag=lambda: "", timeout: float = DEADLINE):
    return wait_until(cond, what, timeout, interval=0.1, show=diag)


def _diag(n) -> str:
    evs = [e for e in n.nvhook_events() if e["event"].startswith("nri.")][-12:]
    return "\n".join(["nvhook:", *map(str, evs), f"{NRI_UNIT}:", n.journal(NRI_UNIT)[-2000:],
                      "containerd:", n.journal("containerd.service")[-2000:]])


def _nri_on(n) -> bool:
    """containerd's own reading of its config: the NRI plugin's `disable`."""
    from nvhook.base import tomlread

    dump = tomlread.loads(n.run(["containerd", "--config", CONTAINERD_CONFIG, "config", "dump"]).stdout)
    return dump["plugins"]["io.containerd.nri.v1.nri"]["disable"] is False


def _synced(n) -> int:
    return len(n.nvhook_events("nri.synchronized"))


@pytest.fixture(scope="module")
def sd_node(machine_untouched, fixtures_root, node_inputs):
    """Booted; containerd's NRI turned off (containerd 1.7's default) and containerd restarted,
    so that install has to turn it on."""
    import sdnode

    reason = sdnode.cannot_boot()
    if reason:
        pytest.skip(f"systemd node: {reason}")
    n = sdnode.start_systemd_node(fixtures_root / "host-gpu8", node_inputs)
    try:
        n.enable_nri(False)
        n.cri.wait_ready(60)
        yield n
    finally:
        problems = n.close()
        assert not problems, problems


@pytest.fixture(scope="module")
def installed(sd_node):
    """`node install --runtime containerd --nri --restart-engine`: (its result, containerd's
    config before, containerd's invocation before)."""
    n = sd_node
    assert not _nri_on(n)
    config_before = n.path(CONTAINERD_CONFIG).read_bytes()
    engine_before = n.unit("containerd.service", "InvocationID")
    r = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                     "--oci-runtime", n.runc, "--nri", "--restart-engine")
    assert r.returncode == 0, r.stdout + r.stderr + _diag(n)
    n.nvhook_installed = True
    n.cri.wait_ready(60)
    _wait("the plugin's first synchronisation", lambda: _synced(n) >= 1, lambda: _diag(n))
    return r, config_before, engine_before


@pytest.fixture
def kubelet(sd_node):
    k = sd_node.kubelet
    yield k
    k.remove_all()


def test_install_turns_nri_on_and_starts_the_plugin(sd_node, installed):
    n = sd_node
    r, _config_before, engine_before = installed
    assert f"updated        {CONTAINERD_CONFIG}: containerd: NRI on" in r.stdout, r.stdout
    assert f"created        {UNIT_PATH}: systemd unit" in r.stdout, r.stdout
    assert f"started        {UNIT_PATH}: nvhook's NRI plugin" in r.stdout, r.stdout
    assert "restarted      containerd.service: containerd" in r.stdout, r.stdout
    assert _nri_on(n)
    engine = n.unit("containerd.service", "InvocationID", "ActiveState")
    assert engine["ActiveState"] == "active" and engine["InvocationID"] != engine_before["InvocationID"]
    u = n.unit(NRI_UNIT, "ActiveState", "UnitFileState", "ExecStart", "Restart", "RestartUSec", "PartOf",
               "RestartPreventExitStatus", "FragmentPath")
    assert (u["ActiveState"], u["UnitFileState"], u["FragmentPath"]) == ("active", "enabled", UNIT_PATH), u
    # the socket containerd's config names (the node's socket_path, not the unit's default)
    assert "path=/opt/nvhook/bin/nvhook" in u["ExecStart"] and f"argv[]=/opt/nvhook/bin/nvhook nri --socket " \
        f"{NRI_SOCKET} ;" in u["ExecStart"] and NRI_SOCKET != "/var/run/nri/nri.sock", u
    assert (u["Restart"], u["RestartUSec"], u["PartOf"], u["RestartPreventExitStatus"]) == \
        ("always", "100ms", "containerd.service", "78"), u
    # containerd's side: the plugin registered, by the unit's process
    pid = n.unit(NRI_UNIT, "MainPID")["MainPID"]
    said = [line for line in n.journal("containerd.service").splitlines() if 'registered as \\"10-nvhook\\"' in line]
    assert said and f"external:10-nvhook[{pid}]" in said[-1], said
    again = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                         "--oci-runtime", n.runc, "--nri", "--restart-engine")
    assert again.returncode == 0 and again.stdout.strip() == "nvhook node install: nothing to change", \
        again.stdout + again.stderr
    assert n.unit(NRI_UNIT, "MainPID")["MainPID"] == pid  # left running


def test_gpu_pod_without_runtime_class_gets_its_gpu_from_the_plugin(sd_node, installed, kubelet):
    """A plain image (no LD_LIBRARY_PATH): the plugin's work at StartContainer through
    /proc/<pid>/root, the pid being containerd's (the node's pid namespace, which the unit runs
    in): the loader cache it wrote lists the host's libcuda, a CUDA program loads it. A CUDA
    image: its GPU by LD_LIBRARY_PATH. A pod that asked for no GPU: nothing."""
    n = sd_node
    gpu = GPUS[1]
    pod = kubelet.run_pod("nri-install-gpu")
    cid = kubelet.run_container(pod, "plain", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                gpu=device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, cid)
    assert {d for d in view.devices if d[6:].isdigit()} == {f"nvidia{gpu.minor}"}, view.out + _diag(n)
    for d in (f"/dev/nvidia{gpu.minor}", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert view.opens[d] == ALLOWED, view.out
    assert view.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1", view.out + _diag(n)
    assert view.one("TOUCH") == "Read-only file system", view.out
    assert view.probe.get("path") == f"{L}/libcuda.so.1", view.out
    assert view.probe.get("cuDriverGetVersion") == str(HOST.cuda), view.out
    [ev] = [e for e in n.nvhook_events("nri.adjusted") if e.get("container") == cid]
    assert ev["hook"] is None and ev["gpus"] == [gpu.index], ev
    [st] = [e for e in n.nvhook_events("nri.started") if e.get("container") == cid]
    assert st["ldcache"] == "written", st

    cuda = kubelet.run_container(pod, "cuda", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, cuda)
    assert view.opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, view.out + _diag(n)
    assert view.probe.get("path") == "/usr/local/nvidia/lib/libcuda.so.1", view.out
    assert view.probe.get("cuDriverGetVersion") == str(HOST.cuda), view.out

    plain = kubelet.run_pod("nri-install-plain")
    other = kubelet.run_container(plain, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_no_gpu(look(kubelet, other))
    assert not [e for e in n.nvhook_events("nri.adjusted") if e.get("container") == other]


def test_runtime_class_pods_are_left_to_the_runtime(sd_node, installed, kubelet):
    """--nri keeps the runtime handler `nvidia`: its pods get their GPU from nvhook-runtime,
    the plugin leaves them alone (no adjustment)."""
    n = sd_node
    gpu = GPUS[6]
    pod = kubelet.run_pod("nri-install-rc", runtime_handler="nvidia")
    cid = kubelet.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_VISIBLE_DEVICES": gpu.uuid,
                                                           "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_gpus(look(kubelet, cid), [gpu])
    assert not [e for e in n.nvhook_events("nri.adjusted") if e.get("container") == cid], _diag(n)


def test_plugin_killed_comes_back(sd_node, installed, kubelet):
    n = sd_node
    before = n.unit(NRI_UNIT, "MainPID", "NRestarts", "ActiveState")
    assert before["ActiveState"] == "active" and int(before["MainPID"]) > 1, before
    synced = _synced(n)
    n.run(["kill", "-KILL", before["MainPID"]])
    again = _wait("systemd restarting the plugin",
                  lambda: (u := n.unit(NRI_UNIT, "MainPID", "NRestarts", "ActiveState"))["MainPID"] not in
                  ("0", before["MainPID"]) and u["ActiveState"] == "active" and u, lambda: _diag(n))
    assert int(again["NRestarts"]) == int(before["NRestarts"]) + 1, again
    _wait("the restarted plugin's synchronisation", lambda: _synced(n) > synced, lambda: _diag(n))
    gpu = GPUS[3]
    pod = kubelet.run_pod("nri-install-after-kill")
    cid = kubelet.run_container(pod, "cuda", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, cid)
    assert view.opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, view.out + _diag(n)


def test_uninstall_takes_the_plugin_and_nri_setting_back(sd_node, installed, kubelet):
    """Last: the unit stopped and gone, containerd's config byte-identical, pods still start."""
    n = sd_node
    _r, config_before, _engine = installed
    r = node_install(n, "uninstall", "--restart-engine")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"restored       {CONTAINERD_CONFIG}: as before install" in r.stdout, r.stdout
    assert f"removed        {UNIT_PATH}" in r.stdout, r.stdout
    n.nvhook_installed = False
    assert n.path(CONTAINERD_CONFIG).read_bytes() == config_before
    assert not n.path(UNIT_PATH).exists()
    assert not n.path(f"/etc/systemd/system/multi-user.target.wants/{NRI_UNIT}", follow=False).is_symlink()
    u = n.unit(NRI_UNIT, "LoadState", "ActiveState")
    assert u == {"LoadState": "not-found", "ActiveState": "inactive"}, u
    n.cri.wait_ready(60)
    assert not _nri_on(n)
    gpu = GPUS[2]
    pod = kubelet.run_pod("nri-uninstalled")
    cid = kubelet.run_container(pod, "app", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    assert_no_gpu(look(kubelet, cid))
