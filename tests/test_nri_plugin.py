"""`nvhook nri`'s plugin against a runtime played by the test (tests/nri/fakeruntime.py: NRI's
socket, mux and ttrpc, messages encoded and decoded by protobuf's own code from NRI's field
numbers), on the 8-GPU fixture host: registration, the subscription, the adjustment of a GPU
container, nothing for a container without a GPU, bad messages refused one at a time, and the
synchronisation report. The same plugin in a real containerd: tests/node/test_nri.py."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "nri"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from hostfix import copy_host  # noqa: E402

pytest.importorskip("grpc_tools")
import fakeruntime as fr  # noqa: E402

from nvhook.base import config as config_mod  # noqa: E402
from nvhook.start.nri.plugin import Plugin  # noqa: E402

HOST = mf.HOSTS["host-gpu8"]
CUDA = f"{HOST.cuda // 1000}.{HOST.cuda % 1000 // 10}.0"


def serve(tmp_path: Path, root: Path):
    """The plugin for host `root`, connected to a runtime played by the test; (runtime, log)."""
    cfgfile = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                     cache_dir=tmp_path / "cache")
    cfg = config_mod.load(str(cfgfile), explicit=True)
    sock = tmp_path / "nri.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)
    plugin = Plugin(cfg, str(root), socket_path=str(sock), hook_path=str(rb.NVHOOK_BIN),
                    hook_global_args=["--config", str(cfgfile)])
    stop = threading.Event()
    t = threading.Thread(target=plugin.serve_forever, args=(stop.is_set,), daemon=True)
    t.start()
    srv.settimeout(10)
    conn, _ = srv.accept()
    rt = fr.Runtime(conn)
    req, reg = rt.accept_registration()
    assert (req.service, req.method) == ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin")
    assert (reg.plugin_name, reg.plugin_idx) == ("nvhook", "10")
    try:
        yield rt, tmp_path / "nvhook.jsonl"
    finally:
        stop.set()
        conn.close()
        srv.close()


@pytest.fixture
def setup(tmp_path, fixtures_root):
    yield from serve(tmp_path, fixtures_root / "host-gpu8")


def events(log: Path, name: str) -> list[dict]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == name]


def container(cid: str, env: list[str], state: int = 0, devices=()) -> object:
    p = fr.pb()
    return p.Container(id=cid, pod_sandbox_id="pod1", name="app", state=state, env=env,
                       linux=p.LinuxContainer(devices=[p.LinuxDevice(path=d, type="c", major=195, minor=0)
                                                       for d in devices]))


def create(rt, c):
    p = fr.pb()
    code, msg, payload = rt.call("CreateContainer", p.CreateContainerRequest(pod=p.PodSandbox(id="pod1", name="web"),
                                                                             container=c))
    return code, msg, p.CreateContainerResponse.FromString(payload)


def test_configure_subscribes_to_create_container_only(setup):
    rt, _log = setup
    p = fr.pb()
    code, _, payload = rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
    assert code == 0 and p.ConfigureResponse.FromString(payload).events == 1 << 3


def test_gpu_container_of_a_cuda_image(setup):
    rt, log = setup
    gpu = HOST.gpus[2]
    code, msg, resp = create(rt, container("c1", [f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}", f"CUDA_VERSION={CUDA}",
                                                  "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                                                  "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]))
    assert code == 0, msg
    adj = resp.adjust
    devs = {d.path: d for d in adj.linux.devices}
    assert f"/dev/nvidia{gpu.minor}" in devs and "/dev/nvidiactl" in devs and "/dev/nvidia-uvm" in devs
    assert not any(p.startswith("/dev/nvidia") and p[11:].isdigit() and p != f"/dev/nvidia{gpu.minor}" for p in devs)
    d = devs[f"/dev/nvidia{gpu.minor}"]
    assert (d.type, d.major, d.minor, d.file_mode.value) == ("c", 195, gpu.minor, 0o666)
    rules = {(r.major.value, r.minor.value, r.access) for r in adj.linux.resources.devices}
    assert (195, gpu.minor, "rw") in rules and all(r.allow for r in adj.linux.resources.devices)
    mounts = {m.destination: m for m in adj.mounts}
    lib = mounts["/usr/local/nvidia/lib64/libcuda.so.1"]
    assert lib.type == "bind" and "ro" in lib.options and lib.source.endswith(f"libcuda.so.{HOST.driver}")
    assert not adj.hooks.create_container and not adj.hooks.prestart  # nothing to run in the container
    [ev] = events(log, "nri.adjusted")
    assert ev["container"] == "c1" and ev["gpus"] == [gpu.index] and ev["hook"] is None


def test_gpu_container_of_a_plain_image_gets_the_cdi_hook(setup):
    rt, log = setup
    code, msg, resp = create(rt, container("c2", ["NVIDIA_VISIBLE_DEVICES=1"]))
    assert code == 0, msg
    [h] = resp.adjust.hooks.create_container
    assert h.args[-3] == "--cdi" and set(h.args[-2].split(",")) == {"compute", "utility"}, h.args
    assert h.args[-1] == "createContainer"
    assert "--config" in h.args
    assert events(log, "nri.adjusted")[0]["hook"] == "compat,ldcache"


def test_no_gpu_is_an_empty_answer(setup):
    rt, log = setup
    code, _, resp = create(rt, container("c3", ["PATH=/bin", "NVIDIA_DRIVER_CAPABILITIES=all"]))
    assert code == 0 and not resp.HasField("adjust")
    assert events(log, "nri.adjusted") == []


def test_bad_messages_are_refused_one_at_a_time(setup):
    rt, log = setup
    code, msg, _ = rt.call("CreateContainer", None, raw=b"\x12\xff\xff")  # a length past the end
    assert code == 3 and "malformed CreateContainer" in msg, msg
    code, msg, _ = create(rt, container("c4", ["NVIDIA_VISIBLE_DEVICES=42"]))
    assert code != 0 and "42" in msg, msg
    code, msg, _ = rt.call("Nope", fr.pb().Empty(), service="other.Service")
    assert code == 12, msg
    code, msg, resp = create(rt, container("c5", ["NVIDIA_VISIBLE_DEVICES=0"]))  # the plugin goes on
    assert code == 0 and resp.adjust.linux.devices, msg
    assert [e["error"] for e in events(log, "nri.bad_message")]


def test_synchronize_names_gpu_containers_without_their_gpu(setup):
    rt, log = setup
    p = fr.pb()
    req = p.SynchronizeRequest(pods=[p.PodSandbox(id="pod1", name="web", namespace="ml")], containers=[
        container("lost", ["NVIDIA_VISIBLE_DEVICES=3"], state=3),
        container("fine", ["NVIDIA_VISIBLE_DEVICES=3"], state=3, devices=["/dev/nvidia3"]),
        container("plain", ["PATH=/bin"], state=3),
        container("gone", ["NVIDIA_VISIBLE_DEVICES=3"], state=4)])
    code, msg, _ = rt.call("Synchronize", req)
    assert code == 0, msg
    [ev] = events(log, "nri.gpu_missing")
    assert (ev["container"], ev["pod"], ev["namespace"], ev["level"]) == ("lost", "web", "ml", "error")


@pytest.mark.parametrize(("value", "want"), [
    ("/usr/local/nvidia/lib:/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"),
    ("relative:/opt/x/../lib", "/opt/lib"),
    ("/proc/self:/sys/x:/dev:/", None),
    ("/usr/../../proc/1/root", None),
    ("/" + "n" * 256 + ":/opt/" + "d/" * 1920 + ":/usr/lib", "/usr/lib"),  # ENAMETOOLONG: skipped
    ("", None),
])
def test_loader_dir_from_a_hostile_image(value, want):
    """The image's LD_LIBRARY_PATH picks where host libraries are bound: never under /proc, /sys,
    /dev or at /; the runtime resolves the rest inside the rootfs (a link there stays there)."""
    from nvhook.start.nri.plugin import loader_dir

    assert loader_dir({"LD_LIBRARY_PATH": value}) == want


def test_oversized_message_drops_the_connection_not_the_plugin(setup):
    rt, log = setup
    import struct

    rt.conn.sendall(struct.pack(">II", 1, 10) + struct.pack(">IIBB", 64 << 20, 3, 1, 0))
    rt.conn.settimeout(10)
    assert rt.conn.recv(1) == b""  # the plugin closed this connection ...
    assert [e for e in events(log, "nri.disconnected") if "ttrpc message" in e["error"]]


def test_answers_are_kept_while_the_host_is_unchanged(tmp_path, fixtures_root):
    """The warm plugin keeps a decided answer for the same request and serves it again, but only
    while the host is the one it was decided on: a driver library that goes away, or a GPU that
    leaves /proc/driver/nvidia, is seen at the very next container."""
    import shutil

    root = copy_host(fixtures_root, "host-gpu8", tmp_path / "hosts")
    gen = serve(tmp_path, root)
    rt, log = next(gen)
    try:
        gpu = HOST.gpus[2]
        env = [f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}", f"CUDA_VERSION={CUDA}", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
               "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]
        answers = []
        for cid in ("k1", "k2"):
            code, msg, resp = create(rt, container(cid, [*env, f"HOSTNAME={cid}"]))
            assert code == 0, msg
            answers.append(resp.adjust.SerializeToString())
        assert answers[0] == answers[1]
        assert [e["cached"] for e in events(log, "nri.adjusted")] == [False, True]
        ptx = "/usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1"
        assert ptx in {m.destination for m in fr.pb().ContainerAdjustment.FromString(answers[1]).mounts}

        # a library of the driver goes away: the next answer is decided again, without it
        for f in (root / "usr/lib/x86_64-linux-gnu").glob("libnvidia-ptxjitcompiler.so*"):
            f.unlink()
        code, msg, resp = create(rt, container("k3", env))
        assert code == 0, msg
        assert ptx not in {m.destination for m in resp.adjust.mounts}
        assert events(log, "nri.adjusted")[-1]["cached"] is False

        # the GPU leaves the driver's list: refused, not answered from memory
        bus = next(d for d in (root / "proc/driver/nvidia/gpus").iterdir()
                   if gpu.uuid in (d / "information").read_text())
        shutil.rmtree(bus)
        code, msg, _ = create(rt, container("k4", env))
        assert code != 0 and gpu.uuid in msg, msg
    finally:
        gen.close()


def test_pod_on_a_gpu_runtime_class_is_left_to_its_runtime(setup):
    """runtime class nvhook (nvhook-runtime injects it): an empty answer, an event saying so, and
    no gpu_missing for it at synchronisation; the same request on the default class is answered."""
    rt, log = setup
    p = fr.pb()
    env = ["NVIDIA_VISIBLE_DEVICES=3"]
    pod = p.PodSandbox(id="pod1", name="web", namespace="ml", runtime_handler="nvhook")
    code, msg, payload = rt.call("CreateContainer", p.CreateContainerRequest(pod=pod, container=container("h1", env)))
    assert code == 0, msg
    assert not p.CreateContainerResponse.FromString(payload).HasField("adjust")
    [ev] = events(log, "nri.left_to_runtime")
    assert (ev["container"], ev["runtime_handler"]) == ("h1", "nvhook")
    code, msg, resp = create(rt, container("h2", env))
    assert code == 0 and resp.adjust.linux.devices, msg
    code, msg, _ = rt.call("Synchronize", p.SynchronizeRequest(pods=[pod], containers=[container("h1", env, state=3)]))
    assert code == 0, msg
    assert events(log, "nri.gpu_missing") == []


def test_a_huge_ld_library_path_is_neither_a_bind_target_nor_kept_in_full(tmp_path, fixtures_root):
    """A pod's LD_LIBRARY_PATH is the tenant's: one directory of a megabyte (ttrpc carries up
    to 4 MiB) is no path the kernel can mount on (PATH_MAX). It is not where libraries are bound
    (every bind's destination would repeat it: tens of megabytes per answer, kept in the plugin's
    memory for up to 256 such pods); the container gets the hook instead, as without a usable
    LD_LIBRARY_PATH, and the answer the plugin keeps stays small."""
    root = copy_host(fixtures_root, "host-gpu8", tmp_path / "hosts")
    gen = serve(tmp_path, root)
    rt, log = next(gen)
    try:
        huge = "/" + "d" * (1 << 20)
        env = ["NVIDIA_VISIBLE_DEVICES=0", f"CUDA_VERSION={CUDA}", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
               f"LD_LIBRARY_PATH={huge}:/usr/local/nvidia/lib64"]
        code, msg, resp = create(rt, container("big", env))
        assert code == 0, msg
        dests = [m.destination for m in resp.adjust.mounts]
        assert dests and not [d for d in dests if len(d) >= 4096]
        assert "/usr/local/nvidia/lib64/libcuda.so.1" in dests  # the next entry of the path
        assert len(resp.adjust.SerializeToString()) < 64 << 10
        # the same pod again: answered from memory, and what is kept of it is small
        code, msg, again = create(rt, container("big2", env))
        assert code == 0, msg
        assert events(log, "nri.adjusted")[-1]["cached"] is True
    finally:
        gen.close()


def test_a_config_it_cannot_load_exits_78_with_one_line(tmp_path):
    """Exit 78 (EX_CONFIG) is what nvhook-nri.service does not restart (RestartPreventExitStatus):
    a config error would only fail again. The systemd node test checks the unit's side."""
    import subprocess

    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml\n")
    r = subprocess.run([str(rb.NVHOOK_BIN), "--config", str(bad), "nri", "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvhook nri: ") and str(bad) in lines[0], r.stderr
