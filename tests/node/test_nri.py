"""`nvhook nri` on the Debian 13 node: containerd 1.7 with NRI on, nvhook's plugin connected to its
socket, pods through the CRI with no runtime class (runc as containerd runs it). What a user
sees inside each container (ExecSync), the spec runc was given, and nvhook's log.

Processes per container start: the plugin answers CreateContainer and does its StartContainer
work (the loader cache, the compat choice) from its own process, so the only processes nvhook can
add to a container's start are the hooks in the spec the runtime gets (the runtime itself is
runc here, not nvhook-runtime). Each test counts them there, and checks that no nvhook process
logged anything for the container (every nvhook start-path run logs its `request`). That the
plugin itself starts no process for that work is tested in tests/test_nri_plugin.py (every way
Python starts one made to fail while it answers)."""

from __future__ import annotations

import time

import make_fixtures as mf
import pytest
from cri import device_plugin, pb
from gpuprobe import ALLOWED, CAPS, DENIED, GPUS, HOST, L, assert_gpus, assert_no_gpu, look
from images import CUDA113, DEBIAN
from node import CONTAINERD_CONFIG, FIXTURES, NRI_SOCKET, NVHOOK, NVHOOK_CONFIG, NVHOOK_LOG
from nrigate import NRIGate

CUDA = f"{HOST.cuda // 1000}.{HOST.cuda % 1000 // 10}"
LIBDIR = "/usr/local/nvidia/lib"
# What a CUDA base image declares: its CUDA and the loader path the driver is expected in.
CUDA_IMAGE_ENV = {"NVIDIA_DRIVER_CAPABILITIES": CAPS, "CUDA_VERSION": f"{CUDA}.0",
                  "LD_LIBRARY_PATH": f"{LIBDIR}:/usr/local/nvidia/lib64"}
PLUGIN_OUT = "/run/nvhook-test/nri.out"


class NRIPlugin:
    def __init__(self, node):
        self.node, self.pid = node, None

    def start(self, *args: str, socket: str = NRI_SOCKET, config: str = NVHOOK_CONFIG) -> None:
        before = len(self.node.nvhook_events("nri.synchronized"))
        self.pid = self.node.sh(f"{NVHOOK} --config {config} nri --socket {socket} {' '.join(args)} "
                                f">>{PLUGIN_OUT} 2>&1 </dev/null & echo $!").stdout.strip()
        deadline = time.monotonic() + 30
        while len(self.node.nvhook_events("nri.synchronized")) <= before:
            assert time.monotonic() < deadline, self.node.read(PLUGIN_OUT)[-3000:]
            time.sleep(0.1)

    def kill(self) -> None:
        if self.pid:
            self.node.run(["kill", "-KILL", self.pid], check=False)
            self.node.run(["sh", "-c", f"while kill -0 {self.pid} 2>/dev/null; do sleep 0.05; done"], check=False)
            self.pid = None


@pytest.fixture(scope="module")
def plugin(node):
    node.run(["mkdir", "-p", "/run/nvhook-test"])
    node.enable_nri()
    p = NRIPlugin(node)
    p.start()
    try:
        yield p
    finally:
        p.kill()
        node.enable_nri(False)


def _pod(kubelet, name: str, env: dict, gpu=None):
    pod = kubelet.run_pod(name)  # no runtime class: runc, as containerd runs it
    return pod, kubelet.run_container(pod, "app", DEBIAN, env=env, gpu=gpu)


def _diag(node) -> str:
    """What the plugin and containerd said, for a failure's message."""
    evs = [e for e in node.nvhook_events() if e["event"].startswith("nri.")][-15:]
    log = node.containerd_log.read_text(errors="replace")
    nri = [line[:600] for line in log.splitlines() if "level=info" not in line or "nri" in line.lower()][-25:]
    return "\n".join(["nvhook:", *map(str, evs), "plugin:", node.read(PLUGIN_OUT)[-1500:], "containerd:", *nri])


def _nvhook_processes(node, cid: str) -> int:
    """nvhook processes the runtime starts for `cid`: the hooks naming nvhook in its spec."""
    _engine, given = node.specs(cid)
    hooks = [h for stage in (given.get("hooks") or {}).values() for h in stage]
    return sum(1 for h in hooks if "nvhook" in h["path"] or any("nvhook" in a for a in h.get("args", [])))


def _hook_events(node, cid: str) -> list[dict]:
    """Events about `cid` logged by an nvhook process other than the plugin (whose own decision
    logs `request`, `plan`, ... for the container too)."""
    events = node.nvhook_events()
    plugins = {e["nvhook_pid"] for e in events if e["event"] == "nri.start"}
    assert plugins and all(plugins)
    return [e for e in events if e.get("container") == cid and e.get("nvhook_pid") not in plugins]


def _adjusted(node, cid: str) -> list[dict]:
    return [e for e in node.nvhook_events("nri.adjusted") if e.get("container") == cid]


def test_gpu_pod_of_a_cuda_image_needs_no_process(plugin, node, kubelet):
    gpu = GPUS[2]
    _pod_, cid = _pod(kubelet, "nri-fast", CUDA_IMAGE_ENV, device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, cid)
    want = {f"nvidia{gpu.minor}"}
    assert {d for d in view.devices if d[6:].isdigit()} == want, view.out + _diag(node)
    assert {"nvidiactl", "nvidia-uvm"} <= view.devices, view.out
    for d in (f"/dev/nvidia{gpu.minor}", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert view.opens[d] == ALLOWED, view.out
    # the loader finds the host's libcuda by LD_LIBRARY_PATH: no cache entry, no link, no hook
    assert view.probe.get("path") == f"{LIBDIR}/libcuda.so.1", view.out
    assert view.probe.get("cuDriverGetVersion") == str(HOST.cuda), view.out
    assert view.one("LDCONFIG") == "", view.out
    code, out, _ = kubelet.exec(cid, f"touch {LIBDIR}/libcuda.so.1 2>&1 | busybox sed 's/.*: //'")
    assert out.strip() == "Read-only file system", out
    assert _nvhook_processes(node, cid) == 0
    assert _hook_events(node, cid) == []
    [ev] = _adjusted(node, cid)
    assert ev["hook"] is None and ev["gpus"] == [gpu.index], ev


def test_same_request_again_is_a_kept_answer(plugin, node, kubelet):
    """Two pods asking for the same GPU the same way: the second answer is the kept one (no
    decision), and its container sees exactly what the first one's does."""
    gpu = GPUS[3]
    views = []
    for name in ("nri-kept-1", "nri-kept-2"):
        _pod_, cid = _pod(kubelet, name, CUDA_IMAGE_ENV, device_plugin("envvar", [gpu.uuid]))
        view = look(kubelet, cid)
        views.append((set(view.devices), view.probe.get("path"), view.opens[f"/dev/nvidia{gpu.minor}"]))
        [ev] = _adjusted(node, cid)
        kept = ev["cached"]
    assert kept is True
    assert views[0] == views[1] and views[1][2] == ALLOWED, views


def _assert_plain_image_gpus(node, view, gpus: list, host=HOST) -> None:
    """What a container of an image without LD_LIBRARY_PATH sees when the plugin did its start
    work: its GPUs' nodes open, the driver read-only, the cache nvhook wrote listing libcuda
    once (at the image family's own directory), and a CUDA program loading it from the bind at
    its SONAME. /proc/driver/nvidia is the runtime's (not masked without --mask-procfs)."""
    assert {d for d in view.devices if d[6:].isdigit()} == {f"nvidia{g.minor}" for g in gpus}, \
        view.out + _diag(node)
    for d in (*(f"/dev/nvidia{g.minor}" for g in gpus), "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert view.opens[d] == ALLOWED, view.out
    assert view.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1", view.out + _diag(node)
    assert view.out.count("libcuda.so.1 (") == 1, view.out  # one entry, not one per bind directory
    if host is HOST:  # the probe touches this host's versioned libcuda
        assert view.one("TOUCH") == "Read-only file system", view.out
    assert view.probe.get("path") == f"{L}/libcuda.so.1", view.out  # the bind at the SONAME
    assert view.probe.get("cuDriverGetVersion") == str(host.cuda), view.out


def _started(node, cid: str) -> list[dict]:
    return [e for e in node.nvhook_events("nri.started") if e.get("container") == cid]


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts"])
def test_gpu_pod_of_a_plain_image_needs_no_process(plugin, node, kubelet, strategy):
    """No CUDA_VERSION and no LD_LIBRARY_PATH: the libraries are bound at their names in the
    loader's default directories, and the loader cache and the compat choice are done by the
    plugin itself at StartContainer, through the container's root: no process. The container's
    own ldconfig reads the cache nvhook wrote, and a CUDA program loads the host's libcuda."""
    gpu = GPUS[3]
    _pod_, cid = _pod(kubelet, f"nri-plain-{strategy}", {"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                      device_plugin(strategy, [gpu.uuid]))
    view = look(kubelet, cid)
    _assert_plain_image_gpus(node, view, [gpu])
    # the cache is the one nvhook wrote (its generator string), read above by the image's ldconfig
    code, out, _ = kubelet.exec(cid, "busybox grep -c 'nvhook (built-in ld.so.cache writer)' /etc/ld.so.cache; "
                                     "ls /etc/ld.so.conf.d")
    assert out.startswith("1\n"), out
    assert "00-compat-nvhook.conf" not in out, out  # nothing of the image is used on this host
    assert _nvhook_processes(node, cid) == 0
    assert _hook_events(node, cid) == []
    [ev] = _adjusted(node, cid)
    assert ev["hook"] is None and set(ev["at_start"].split(",")) == {"compat", "ldcache"}, ev
    [st] = _started(node, cid)
    assert st["ldcache"] == "written" and st["compat"] != "image", st


def test_an_images_next_pod_is_bound_once_where_its_loader_looks(plugin, node, kubelet):
    """containerd names each container's image (io.kubernetes.cri.image-name); once a start of
    the image showed the plugin where its loader looks (a Debian image: /usr/lib/<multiarch>),
    the next pod of that image gets each library bound once, there: the spec runc was given has
    none in /usr/lib64, and the container loads the host's libcuda as before."""
    gpu = GPUS[5]
    for name in ("nri-once-1", "nri-once-2"):
        _pod_, cid = _pod(kubelet, name, {"NVIDIA_DRIVER_CAPABILITIES": CAPS}, device_plugin("envvar", [gpu.uuid]))
        _assert_plain_image_gpus(node, look(kubelet, cid), [gpu])
    _engine, given = node.specs(cid)
    dests = {m["destination"] for m in given["mounts"]}
    assert f"{L}/libcuda.so.1" in dests and not any(d.startswith("/usr/lib64/") for d in dests), sorted(dests)
    [st] = _started(node, cid)
    assert st["lib_dirs"] == L and st["ldcache"] == "written", st
    assert _nvhook_processes(node, cid) == 0


def test_cuda_image_without_ld_library_path(plugin, node, kubelet):
    """A CUDA 11.3 image (CUDA_VERSION=11.3.1, its 465 compat libcuda in
    /usr/local/cuda-11.3/compat) without LD_LIBRARY_PATH, on the 535 driver (CUDA 12.2): the
    driver supports its CUDA, so only the loader cache is left, written by the plugin at the
    start; the host's libcuda; no process."""
    gpu = GPUS[4]
    pod = kubelet.run_pod("nri-cuda113")
    cid = kubelet.run_container(pod, "app", CUDA113, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                gpu=device_plugin("envvar", [gpu.uuid]))
    _assert_plain_image_gpus(node, look(kubelet, cid), [gpu])
    assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == []
    [st] = _started(node, cid)
    assert (st["work"], st["compat"], st["ldcache"]) == ("ldcache", None, "written"), st


def test_plugin_restarted_between_create_and_start(plugin, node, kubelet):
    """The start's work is recomputed from what StartContainer carries (nothing kept from the
    creation is needed): a plugin restarted in between writes the cache all the same."""
    gpu = GPUS[1]
    pod = kubelet.run_pod("nri-restart-between")
    cid = kubelet.create_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                   gpu=device_plugin("envvar", [gpu.uuid]))
    plugin.kill()
    plugin.start()
    kubelet.start(cid)
    _assert_plain_image_gpus(node, look(kubelet, cid), [gpu])
    [st] = _started(node, cid)
    assert st["ldcache"] == "written", st
    assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == []


def test_read_only_root_filesystem(plugin, node, kubelet):
    """readOnlyRootFilesystem: no loader cache can be written. A plain image whose libcuda is the
    host's starts, with a warning: the libraries load from their binds at their SONAMEs (only
    `ldconfig -p` does not list them)."""
    gpu = GPUS[2]
    pod = kubelet.run_pod("nri-readonly")
    cid = kubelet.run_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                gpu=device_plugin("envvar", [gpu.uuid]), readonly_rootfs=True)
    view = look(kubelet, cid)
    assert view.one("LDCONFIG") == "", view.out  # the image's own cache, without the driver
    assert view.probe.get("path") == f"{L}/libcuda.so.1", view.out + _diag(node)
    assert view.probe.get("cuDriverGetVersion") == str(HOST.cuda), view.out
    [st] = _started(node, cid)
    assert st["ldcache"] == "read-only", st
    [warn] = [e for e in node.nvhook_events("nri.start_read_only") if e.get("container") == cid]
    assert warn["level"] == "warning" and "ldconfig -p" in warn["message"], warn
    assert _nvhook_processes(node, cid) == 0


def _fixture_config(node, host: str) -> str:
    """A config for the plugin with fixture host `host` as its driver root (the node's copy), its
    events in the node's nvhook log."""
    path = f"/run/nvhook-test/nri-{host}.toml"
    node.write(path, f'root = "{FIXTURES}/{host}"\nlog_file = "{NVHOOK_LOG}"\n'
                     f'cache_dir = "/run/nvhook-test/nri-{host}-cache"\n')
    return path


@pytest.mark.parametrize(("host", "chosen"), [("host-t4-450", True), ("host-geforce-460", False)])
def test_compat_libcuda_chosen_at_start_by_the_gpu(plugin, node, kubelet, host, chosen):
    """The CUDA 11.3 image (465 compat libcuda, CUDA_VERSION=11.3.1, no LD_LIBRARY_PATH) on a
    450 driver (CUDA 11.0) with a T4: a CUDA the driver does not support, so the plugin reads the
    image at the start, puts its compat libcuda first in the loader cache, and a CUDA program
    loads it (CUDA 11.3 on an 11.0 driver). On a 460 driver (CUDA 11.2) with GeForce GPUs, which
    cannot use forward compatibility (error 804), the host's stays: no process either way."""
    fixture = mf.HOSTS[host]
    plugin.kill()
    plugin.start(config=_fixture_config(node, host))
    try:
        gpu = fixture.gpus[0]
        pod = kubelet.run_pod(f"nri-compat-{host}")
        cid = kubelet.run_container(pod, "app", CUDA113, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                    gpu=device_plugin("envvar", [gpu.uuid]))
        view = look(kubelet, cid)
        compat = "/usr/local/cuda-11.3/compat"
        if chosen:
            # the compat libcuda first, the driver's next (what the image's own ldconfig lists)
            assert view.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {compat}/libcuda.so.1", \
                view.out + _diag(node)
            assert f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1" in view.out, view.out
            assert view.probe.get("path") == f"{compat}/libcuda.so.465.19.01", view.out
            assert view.probe.get("cuDriverGetVersion") == "11030", view.out
            code, out, _ = kubelet.exec(cid, "cat /etc/ld.so.conf.d/00-compat-nvhook.conf")
            assert out.strip() == compat, out
        else:
            _assert_plain_image_gpus(node, view, [gpu], fixture)
        assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == []
        [st] = _started(node, cid)
        assert st["compat"] == ("image" if chosen else "host"), st
        if chosen:
            # read-only root: the cache cannot put the compat libcuda first, so the start fails,
            # with nvhook's line naming the problem and the fix
            from cri import CRIError

            ro = kubelet.create_container(pod, "readonly", CUDA113, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                          gpu=device_plugin("envvar", [gpu.uuid]), readonly_rootfs=True)
            with pytest.raises(CRIError) as e:
                kubelet.start(ro)
            assert "NRI container start failed" in e.value.details, e.value.details
            assert "read-only" in e.value.details and "readOnlyRootFilesystem" in e.value.details, e.value.details
            assert kubelet.status(ro).state != pb().CONTAINER_RUNNING
        decisions = [e for e in node.nvhook_events("compat.decision") if e.get("container") == cid]
        if not chosen:
            assert decisions[-1]["reason_code"] == "gpu-not-supported", decisions
        # the GPUs' brands came from the NVML facts the plugin kept when it started: NVML's
        # probe (a forked child) did not run for this start
        assert [e for e in node.nvhook_events("nvml.queried") if e.get("container") == cid] == []
        assert [e for e in node.nvhook_events("gpus.nvml") if e.get("container") == cid][-1]["cached"] is True
    finally:
        plugin.kill()
        plugin.start()


def test_pod_without_gpu_is_untouched(plugin, node, kubelet):
    _pod_, cid = _pod(kubelet, "nri-none", {"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert_no_gpu(look(kubelet, cid))
    assert kubelet.status(cid).state == pb().CONTAINER_RUNNING
    _engine, given = node.specs(cid)
    assert not any(d["path"].startswith("/dev/nvidia") for d in given["linux"].get("devices") or [])
    assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == [] and _adjusted(node, cid) == []


def test_two_pods_on_two_gpus_are_isolated(plugin, kubelet):
    a, b = GPUS[4], GPUS[5]
    _pa, ca = _pod(kubelet, "nri-a", CUDA_IMAGE_ENV, device_plugin("envvar", [a.uuid]))
    _pb, cb = _pod(kubelet, "nri-b", CUDA_IMAGE_ENV, device_plugin("envvar", [str(b.index)]))
    for cid, mine, other in ((ca, a, b), (cb, b, a)):
        view = look(kubelet, cid)
        assert {d for d in view.devices if d[6:].isdigit()} == {f"nvidia{mine.minor}"}, view.out
        code, out, err = kubelet.exec(cid, f"busybox mknod /tmp/other c 195 {other.minor} && "
                                           "head -c 1 /tmp/other 2>&1 | busybox sed 's/.*: //'")
        assert code == 0 and out.strip() == DENIED, (out, err)


def test_bad_gpu_request_is_refused_and_the_plugin_goes_on(plugin, node, kubelet):
    from cri import CRIError

    pod = kubelet.run_pod("nri-bad")
    with pytest.raises(CRIError) as e:
        kubelet.create_container(pod, "app", DEBIAN, env={"NVIDIA_VISIBLE_DEVICES": "42"})
    assert "nvhook" in e.value.details and "42" in e.value.details, e.value.details
    # a request that is itself bad: the engine's error and nvhook's log say the same line
    with pytest.raises(CRIError) as e:
        kubelet.create_container(pod, "caps", DEBIAN, env={"NVIDIA_VISIBLE_DEVICES": "0",
                                                           "NVIDIA_DRIVER_CAPABILITIES": "compute,warp"})
    assert "unknown capability 'warp'" in e.value.details, e.value.details
    refused = [ev for ev in node.nvhook_events("nri.refused") if ev.get("container_name") == "caps"]
    assert refused and refused[-1]["level"] == "error" and refused[-1]["error"] in e.value.details, refused
    _pod_, cid = _pod(kubelet, "nri-after-bad", {})
    assert kubelet.status(cid).state == pb().CONTAINER_RUNNING
    _p2, cg = _pod(kubelet, "nri-gpu-after-bad", CUDA_IMAGE_ENV, device_plugin("envvar", [GPUS[1].uuid]))
    assert look(kubelet, cg).opens[f"/dev/nvidia{GPUS[1].minor}"] == ALLOWED


def test_plugin_killed_then_restarted(plugin, node, kubelet):
    """Killed: a pod without a GPU still starts (containerd creates it unadjusted), and so does a
    GPU pod, without its GPU; restarted: that pod is named at the synchronisation, and GPU pods
    get their GPUs again."""
    plugin.kill()
    _p1, plain = _pod(kubelet, "nri-down-plain", {})
    assert kubelet.status(plain).state == pb().CONTAINER_RUNNING
    gpu = GPUS[6]
    _p2, lost = _pod(kubelet, "nri-down-gpu", CUDA_IMAGE_ENV, device_plugin("envvar", [gpu.uuid]))
    assert_no_gpu(look(kubelet, lost))
    plugin.start()
    named = [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == lost]
    assert named and named[-1]["container_name"] == "app" and named[-1]["pod"] == "nri-down-gpu", named
    assert not [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == plain]
    _p3, back = _pod(kubelet, "nri-back", CUDA_IMAGE_ENV, device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, back)
    assert view.opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, view.out


@pytest.mark.parametrize("strategy", ["cdi-annotations", "cdi-cri"])
def test_cdi_strategies_beside_the_plugin(plugin, node, kubelet, strategy):
    """The device plugin's CDI strategies: containerd applies nvhook's CDI spec itself, and the
    plugin's answer for the same GPU adds nothing twice (the same device path and mount
    destinations replace the spec's)."""
    gpu = GPUS[7]
    _pod_, cid = _pod(kubelet, f"nri-{strategy}", {"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                      device_plugin(strategy, [gpu.uuid]))
    assert_gpus(look(kubelet, cid), [gpu])
    _engine, given = node.specs(cid)
    paths = [d["path"] for d in given["linux"]["devices"]]
    assert len(paths) == len(set(paths)), paths
    dests = [m["destination"] for m in given["mounts"]]
    assert len(dests) == len(set(dests)), sorted(d for d in dests if dests.count(d) > 1)


def test_mig_device_by_envvar(plugin, node, kubelet):
    import make_fixtures as mf

    gpu = GPUS[0]
    mig = gpu.migs[0]
    _pod_, cid = _pod(kubelet, "nri-mig", {"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                      device_plugin("envvar", [mig.uuid]))
    caps = {f"nvidia-cap{mf.mig_minor(gpu.minor, mig.gi)}", f"nvidia-cap{mf.mig_minor(gpu.minor, mig.gi, mig.ci)}"}
    view = look(kubelet, cid)
    _assert_plain_image_gpus(node, view, [gpu])
    assert view.caps == caps, view.out
    assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == []


# containerd's plugin_request_timeout for the slow-plugin test (default 2 s): only the gate
# decides that the plugin's answer comes after it, so its length races nothing.
REQUEST_TIMEOUT = "1s"
GATE = "/run/nvhook-test/nri-gate.sock"
# containerd 1.7's words when a plugin's answer comes too late (it drops the plugin)
DROPPED = "closing plugin 10-nvhook, failed to handle CreateContainer request: context deadline exceeded"


@pytest.fixture
def slow_plugin(plugin, node):
    """The module's plugin again, behind a gate (tests/node/nrigate.py) that holds its answers
    while the test keeps it shut, with containerd's NRI request timeout lowered."""
    plugin.kill()
    text = node.read(CONTAINERD_CONFIG)
    line = f'  socket_path = "{NRI_SOCKET}"\n'
    assert line in text, text
    node.write(CONTAINERD_CONFIG, text.replace(line, f'{line}  plugin_request_timeout = "{REQUEST_TIMEOUT}"\n'))
    node.restart_containerd()
    gate = NRIGate(str(node.dir / "run" / GATE[len("/run/"):]), node.nri_socket)
    try:
        plugin.start(socket=GATE)
        yield gate
    finally:
        plugin.kill()
        gate.close()
        node.write(CONTAINERD_CONFIG, text)
        node.restart_containerd()
        plugin.start()


def _containerd_said(node, since: int) -> str:
    with open(node.containerd_log, "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace")


def _resynced(node, gate, synced: int) -> None:
    """Let the plugin's new connection through and wait for its synchronisation."""
    gate.wait_accepted(len(gate.connections) + 1)
    gate.admit_new()
    deadline = time.monotonic() + 30
    while len(node.nvhook_events("nri.synchronized")) <= synced:
        assert time.monotonic() < deadline, _diag(node)
        time.sleep(0.1)


def test_slow_plugin(slow_plugin, node, kubelet):
    """A plugin that answers after containerd's plugin_request_timeout: the container is created
    by the timeout, unadjusted, and the plugin dropped. A pod without a GPU starts as ever; a GPU
    pod starts *without its GPU* (what its user sees), and nvhook names it, pod and namespace,
    at the synchronisation of its reconnection (which it makes by itself). A pod on nvhook's
    runtime handler gets its GPU from there whatever the plugin does (the fallback)."""
    gate = slow_plugin
    ready = pb().CONTAINER_RUNNING
    dropped = len(node.nvhook_events("nri.disconnected"))

    # 1. a pod without a GPU meets the slow plugin
    since, synced = node.containerd_log.stat().st_size, len(node.nvhook_events("nri.synchronized"))
    gate.current.shut()
    gate.hold_new()
    _p1, plain = _pod(kubelet, "nri-slow-plain", {})
    assert kubelet.status(plain).state == ready
    said = _containerd_said(node, since)
    assert DROPPED in said, said[-3000:]
    _resynced(node, gate, synced)
    assert not [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == plain]

    # 2. a GPU pod meets it: created by the timeout, without its GPU; named at the resync
    gpu = GPUS[6]
    since, synced = node.containerd_log.stat().st_size, len(node.nvhook_events("nri.synchronized"))
    gate.current.shut()
    gate.hold_new()
    _p2, lost = _pod(kubelet, "nri-slow-gpu", CUDA_IMAGE_ENV, device_plugin("envvar", [gpu.uuid]))
    assert kubelet.status(lost).state == ready
    view = look(kubelet, lost)
    assert_no_gpu(view)
    assert DROPPED in _containerd_said(node, since)
    _resynced(node, gate, synced)
    # the plugin did decide (its answer came too late), so its own `nri.adjusted` is no proof
    assert _adjusted(node, lost), _diag(node)
    assert len(node.nvhook_events("nri.disconnected")) == dropped + 2  # dropped twice, back by itself twice
    named = [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == lost]
    assert named, _diag(node)
    assert (named[-1]["level"], named[-1]["pod"], named[-1]["namespace"], named[-1]["container_name"]) == \
        ("error", "nri-slow-gpu", "default", "app"), named
    assert "delete it" in named[-1]["message"]

    # 3. the fallback: a GPU pod on nvhook's runtime handler, the plugin slow again; the plugin
    # leaves such pods to their runtime, so the resync does not name it
    synced = len(node.nvhook_events("nri.synchronized"))
    gate.current.shut()
    gate.hold_new()
    pod = kubelet.run_pod("nri-slow-handler", runtime_handler="nvidia")
    safe = kubelet.run_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                 gpu=device_plugin("envvar", [gpu.uuid]))
    assert_gpus(look(kubelet, safe), [gpu])
    _resynced(node, gate, synced)
    assert not [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == safe]
    assert [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") == lost]  # still named


def test_plugin_too_slow_at_start(slow_plugin, node, kubelet):
    """The plugin answered a GPU container's creation, then is held at its StartContainer past
    containerd's timeout (the gate holds the request itself, so the plugin never does the work):
    containerd drops the plugin and starts the container anyway. It has its GPU and its libraries
    at their SONAMEs (a CUDA program loads the host's libcuda), but not nvhook's loader cache: its
    own `ldconfig -p` does not list libcuda. The plugin reconnects by itself, and the
    synchronisation names the container (`nri.start_work_missing`, level error: pod, namespace,
    "ldcache" missing, "delete the pod"). Nothing is written into the running container: its
    `ldconfig -p` still misses libcuda afterwards. A GPU container of the same image whose start
    work was done, running beside it, is checked too and not named."""
    gate = slow_plugin
    gpu = GPUS[5]
    _p, done = _pod(kubelet, "nri-start-done", {"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                    device_plugin("envvar", [GPUS[4].uuid]))
    [st] = _started(node, done)
    assert st["ldcache"] == "written", st
    pod = kubelet.run_pod("nri-slow-start")
    cid = kubelet.create_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                   gpu=device_plugin("envvar", [gpu.uuid]))
    [ev] = _adjusted(node, cid)
    assert set(ev["at_start"].split(",")) == {"compat", "ldcache"}, ev
    since, synced = node.containerd_log.stat().st_size, len(node.nvhook_events("nri.synchronized"))
    named_before = {e.get("container") for e in node.nvhook_events("nri.start_work_missing")}
    gate.current.shut(requests=True)
    gate.hold_new()
    kubelet.start(cid)  # returns once containerd gave up on the plugin and started the task
    assert kubelet.status(cid).state == pb().CONTAINER_RUNNING
    said = _containerd_said(node, since)
    assert "closing plugin 10-nvhook, failed to handle event 6: context deadline exceeded" in said, said[-3000:]
    assert _started(node, cid) == [], _diag(node)  # the plugin never saw the start
    view = look(kubelet, cid)
    assert view.one("LDCONFIG") == "", view.out  # what pip's Triton reads: no libcuda
    assert view.probe.get("path") == f"{L}/libcuda.so.1", view.out  # the GPU and its bound libraries are there
    assert {f"nvidia{gpu.minor}"} <= view.devices, view.out

    gate.current.close()  # the plugin sees its (dropped) connection close and dials again
    _resynced(node, gate, synced)
    named = [e for e in node.nvhook_events("nri.start_work_missing") if e.get("container") == cid]
    assert len(named) == 1, _diag(node)
    assert (named[0]["level"], named[0]["pod"], named[0]["namespace"], named[0]["container_name"],
            named[0]["missing"]) == ("error", "nri-slow-start", "default", "app", ["ldcache"]), named
    assert "delete the pod" in named[0]["message"], named
    others = {e.get("container") for e in node.nvhook_events("nri.start_work_missing")} - named_before - {cid}
    assert others == set(), others  # `done` among them
    assert not [e for e in node.nvhook_events("nri.gpu_missing") if e.get("container") in (cid, done)]
    [sync] = node.nvhook_events("nri.synchronized")[-1:]
    assert (sync["start_work_checked"], sync["start_work_missing"], sync["start_work_unchecked"]) == (2, 1, 0), sync
    assert look(kubelet, cid).one("LDCONFIG") == ""  # reported, not repaired


def test_pod_on_nvhooks_runtime_handler_is_left_to_it(plugin, node, kubelet):
    """The plugin up and a GPU pod on runtime class "nvidia": nvhook-runtime injects it, the
    plugin adds nothing (one injection, not two) and says so."""
    gpu = GPUS[5]
    pod = kubelet.run_pod("nri-handler", runtime_handler="nvidia")
    cid = kubelet.run_container(pod, "app", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                gpu=device_plugin("envvar", [gpu.uuid]))
    assert_gpus(look(kubelet, cid), [gpu])
    assert _adjusted(node, cid) == []
    [left] = [e for e in node.nvhook_events("nri.left_to_runtime") if e.get("container") == cid]
    assert left["runtime_handler"] == "nvidia", left
    engine, _given = node.specs(cid)
    assert not any(d["path"].startswith("/dev/nvidia") for d in engine["linux"].get("devices") or [])


def test_management_cdi_annotation_in_and_outside_the_named_namespaces(plugin, node, kubelet):
    """NVIDIA's pod annotation nvidia.cdi.k8s.io/container.<name> (the GPU Operator's management
    pods), the plugin told to honour it in namespace gpu-operator. On containerd 1.7, which drops
    the CDI devices of an NRI adjustment unread, the pod there is refused at its creation with
    nvhook's line (never a management pod started without its devices); containerd 2.1 applies
    them: the pod starts with the edits of the management spec (a stand-in spec of that kind on
    the node). The same pod in namespace default starts as it is, no NVIDIA device, the
    annotation ignored with an event."""
    import json

    from cri import CRIError
    from node import ENGINES

    plugin.kill()
    applies = node.suite != "trixie"
    if applies:  # the stand-in management spec, read by containerd at its start
        node.write("/etc/cdi/nvhook-test-management.json", json.dumps({
            "cdiVersion": "0.6.0", "kind": "management.nvidia.com/gpu",
            "devices": [{"name": "all", "containerEdits": {"env": ["NVHOOK_TEST_MANAGEMENT=all"]}}]}))
        node.restart_containerd()
    plugin.start("--cdi-annotation-namespace", "gpu-operator")
    try:
        ann = {"nvidia.cdi.k8s.io/container.app": "management.nvidia.com/gpu=all"}
        inside = kubelet.run_pod("nri-mgmt-in", namespace="gpu-operator", annotations=ann)
        if applies:
            cid = kubelet.run_container(inside, "app", DEBIAN)
            assert kubelet.exec(cid, ["sh", "-c", "echo $NVHOOK_TEST_MANAGEMENT"])[1].strip() == "all"
        else:
            with pytest.raises(CRIError) as e:
                kubelet.create_container(inside, "app", DEBIAN)
            assert "does not apply the CDI devices an NRI plugin names (containerd 2.1 does)" in e.value.details, \
                e.value.details + _diag(node)
        outside = kubelet.run_pod("nri-mgmt-out", namespace="default", annotations=ann)
        cid = kubelet.run_container(outside, "app", DEBIAN)
        assert kubelet.status(cid).state == pb().CONTAINER_RUNNING
        assert_no_gpu(look(kubelet, cid))
        [ev] = [e for e in node.nvhook_events("nri.cdi_annotation_ignored") if e.get("container") == cid]
        assert ev["namespace"] == "default" and "gpu-operator" in ev["message"], ev
        [conf] = [e for e in node.nvhook_events("nri.configured")][-1:]
        assert conf["runtime"] == "containerd", conf
        assert conf["runtime_version"].lstrip("v").startswith(ENGINES[node.suite]["containerd"]), conf
    finally:
        plugin.kill()
        if applies:
            node.run(["rm", "-f", "/etc/cdi/nvhook-test-management.json"])
            node.restart_containerd()
        plugin.start()  # the module's later tests get the plugin as they expect it: default flags


PROFILE_DIR = "/etc/nvidia/nvidia-application-profiles-rc.d"
PROFILE_VIEW = (f"cat {PROFILE_DIR}/10-container.conf 2>/dev/null; echo; echo MODES "
                f"$(busybox stat -c %a /etc/nvidia {PROFILE_DIR} {PROFILE_DIR}/10-container.conf 2>/dev/null)")


def _profile(minors) -> str:
    """NVIDIA 1.20's file for these minors (tests/test_app_profile.py compares it with NVIDIA's)."""
    mask = sum(1 << m for m in minors)
    return ('{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",'
            f'0x{mask:x}' ']}],"rules":[{"pattern":[],"profile":"_container_"}]}')


@pytest.mark.parametrize("drm", [True, False])
def test_graphics_pod_gets_the_application_profile(plugin, node, kubelet, drm):
    """A pod that asks for graphics gets the application profile of hook mode: one bit per GPU
    its answer gave it, read inside the container, modes 555/555/444. On a node with DRM nodes
    the answer's /dev/dri/by-path links take nvhook's CDI hook, which writes it; without (a copy
    of the fixture host with no /dev/dri) the plugin writes it at StartContainer, no process. A
    compute pod on the same node gets no /etc/nvidia."""
    host = "/run/nvhook-test/host-nodrm"
    if not drm:
        node.sh(f"rm -rf {host} && cp -a {FIXTURES}/host-gpu8 {host} && rm -rf {host}/dev/dri")
        node.write("/run/nvhook-test/nri-nodrm.toml", f'root = "{host}"\nlog_file = "{NVHOOK_LOG}"\n'
                                                       f'cache_dir = "/run/nvhook-test/nri-nodrm-cache"\n')
        plugin.kill()
        plugin.start(config="/run/nvhook-test/nri-nodrm.toml")
    try:
        gpus = [GPUS[1], GPUS[6]]
        _pod_, cid = _pod(kubelet, f"nri-graphics-{drm}", {"NVIDIA_DRIVER_CAPABILITIES": "graphics,utility"},
                          device_plugin("envvar", [g.uuid for g in gpus]))
        code, out, _ = kubelet.exec(cid, PROFILE_VIEW)
        assert code == 0 and out == f"{_profile(g.minor for g in gpus)}\nMODES 555 555 444\n", out + _diag(node)
        [ev] = _adjusted(node, cid)
        if drm:
            assert "links" in ev["hook"] and _nvhook_processes(node, cid) == 1, ev
            assert [e for e in _hook_events(node, cid) if e["event"] == "app_profile.written"], _diag(node)
        else:
            # the image has no LD_LIBRARY_PATH: the loader cache too, after the profile
            assert ev["hook"] is None and ev["at_start"] == "ldcache,profile", ev
            [st] = _started(node, cid)
            assert (st["app_profile"], st["ldcache"]) == ("written", "written"), st
            assert _nvhook_processes(node, cid) == 0 and _hook_events(node, cid) == []
        _pod2, c2 = _pod(kubelet, f"nri-compute-{drm}", {"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                         device_plugin("envvar", [GPUS[2].uuid]))
        code, out, _ = kubelet.exec(c2, "ls -d /etc/nvidia 2>&1 | busybox sed 's/.*: //'")
        assert out.strip() == "No such file or directory", out
    finally:
        if not drm:
            plugin.kill()
            plugin.start()
