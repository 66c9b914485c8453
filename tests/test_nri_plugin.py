"""`nvhook nri`'s plugin against a runtime played by the test (tests/nri/fakeruntime.py: NRI's
socket, mux and ttrpc, messages encoded and decoded by protobuf's own code from NRI's field
numbers), on the 8-GPU fixture host: registration, the subscription, the adjustment of a GPU
container, nothing for a container without a GPU, bad messages refused one at a time, and the
synchronisation report. The same plugin in a real containerd: tests/node/test_nri.py."""

from __future__ import annotations

import json
import os
import socket
import stat
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
from nvhook.base.files import temp_name  # noqa: E402
from nvhook.start.nri.plugin import Plugin  # noqa: E402

HOST = mf.HOSTS["host-gpu8"]
CUDA = f"{HOST.cuda // 1000}.{HOST.cuda % 1000 // 10}.0"


def serve(tmp_path: Path, root: Path, config: str = "", **kw):
    """The plugin for host `root`, connected to a runtime played by the test; (runtime, log)."""
    cfgfile = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                     cache_dir=tmp_path / "cache", extra=config)
    cfg = config_mod.load(str(cfgfile), explicit=True)
    sock = tmp_path / "nri.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)
    plugin = Plugin(cfg, str(root), socket_path=str(sock), hook_path=str(rb.NVHOOK_BIN),
                    hook_global_args=["--config", str(cfgfile)], **kw)
    plugin.warm()  # as `nvhook nri` does before it serves
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


def test_configure_subscribes_to_create_and_start_container(setup):
    rt, _log = setup
    p = fr.pb()
    code, _, payload = rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
    # api.Event CREATE_CONTAINER = 4 and START_CONTAINER = 6: bits (event - 1)
    assert code == 0 and p.ConfigureResponse.FromString(payload).events == (1 << 3) | (1 << 5)


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


def test_gpu_container_of_a_plain_image_gets_no_hook(setup):
    """No CUDA_VERSION and no LD_LIBRARY_PATH: no hook; each library bound at its SONAME (and
    its file name) in the host's library directory and both glibc families' default
    directories, the cache and compat choice left to the plugin's StartContainer."""
    rt, log = setup
    code, msg, resp = create(rt, container("c2", ["NVIDIA_VISIBLE_DEVICES=1"]))
    assert code == 0, msg
    assert not resp.adjust.hooks.create_container and not resp.adjust.hooks.prestart
    dests = {m.destination: m for m in resp.adjust.mounts}
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64"):
        lib = dests[f"{d}/libcuda.so.1"]
        assert lib.source.endswith(f"libcuda.so.{HOST.driver}") and "ro" in lib.options, lib
    [ev] = events(log, "nri.adjusted")
    assert ev["hook"] is None and ev["at_start"] == "compat,ldcache", ev


def test_procfs_masking_still_takes_the_cdi_hook(tmp_path, fixtures_root):
    """--mask-procfs is work the plugin cannot do from outside (a mount in the container): the
    hook does all of it, the loader cache included, as before."""
    gen = serve(tmp_path, fixtures_root / "host-gpu8", mask_procfs=True)
    rt, log = next(gen)
    try:
        code, msg, resp = create(rt, container("c2", ["NVIDIA_VISIBLE_DEVICES=1"]))
        assert code == 0, msg
        [h] = resp.adjust.hooks.create_container
        assert h.args[-3] == "--cdi" and set(h.args[-2].split(",")) == {"compute", "utility"}, h.args
        assert h.args[-1] == "createContainer" and "--config" in h.args
        [ev] = events(log, "nri.adjusted")
        assert set(ev["hook"].split(",")) == {"procfs", "compat", "ldcache"} and ev["at_start"] is None, ev
    finally:
        gen.close()


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
    from nvhook.decide.nriwork import loader_dir

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


# -- StartContainer: the plugin's work inside a container created by runc -------------------------

def start_event(c, *, event: int = 6, handler: str = "") -> object:
    p = fr.pb()
    return p.StateChangeEvent(event=event, pod=p.PodSandbox(id="pod1", name="web", runtime_handler=handler),
                              container=c)


class Created:
    """A container created by the real runc (`runc create`: its init waits to be started, its root
    pivoted, the spec's mounts in place), as containerd has it when it sends NRI StartContainer:
    a copy of fixture image `image` with `plant(rootfs)` applied, the plugin's answer's binds as
    spec mounts (and `edit(config)` applied), running `script` once started (its output in
    /out.txt of the rootfs)."""

    def __init__(self, tmp_path: Path, fixtures_root: Path, image: str, mounts, script: str, plant=None,
                 edit=None):
        import shutil
        import subprocess
        import uuid

        self.sp = subprocess
        self.rootfs = tmp_path / "rootfs"
        shutil.copytree(fixtures_root / image, self.rootfs, symlinks=True)
        if plant is not None:
            plant(self.rootfs)
        bundle = tmp_path / "bundle"
        bundle.mkdir()
        subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
        cfg = json.loads((bundle / "config.json").read_text())
        cfg["process"].pop("rlimits", None)
        cfg["process"].update(terminal=False, args=["/bin/sh", "-c", script])
        cfg["root"] = {"path": str(self.rootfs), "readonly": False}
        cfg["mounts"] += [{"destination": m.destination, "type": "bind", "source": m.source,
                           "options": list(m.options)} for m in mounts]
        if edit is not None:  # more of the answer (its devices, its hook), as the engine applies it
            edit(cfg)
        (bundle / "config.json").write_text(json.dumps(cfg))
        self.state = tmp_path / "runc-state"
        self.id = f"nvhook-nri-test-{uuid.uuid4().hex[:12]}"
        with open(tmp_path / "runc.err", "w") as err:  # the init keeps runc's stdio: not a pipe
            p = subprocess.run(self.runc("create", "--bundle", str(bundle), self.id), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=err, timeout=60)
        assert p.returncode == 0, (tmp_path / "runc.err").read_text()
        self.pid = self.status()["pid"]

    def runc(self, *args: str) -> list[str]:
        return ["runc", "--root", str(self.state), *args]

    def status(self) -> dict:
        return json.loads(self.sp.run(self.runc("state", self.id), check=True, capture_output=True, timeout=30).stdout)

    def start_and_wait(self, out: Path | None = None) -> str:
        """Start the container, wait for its script to end, and what it wrote (/out.txt of the
        rootfs, or `out`: a file of the host its script wrote through a bind)."""
        import time

        self.sp.run(self.runc("start", self.id), check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while self.status()["status"] != "stopped":
            assert time.monotonic() < deadline, "the container did not finish"
            time.sleep(0.05)
        return (out or self.rootfs / "out.txt").read_text()

    def delete(self) -> None:
        self.sp.run(self.runc("delete", "-f", self.id), capture_output=True, timeout=30)


PROBE = "/sbin/ldconfig -p > /out.txt 2>&1; /usr/bin/cuda-probe >> /out.txt 2>&1"
PLAIN_ENV = ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


@pytest.fixture
def runc_ready():
    why = rb.skip_reason()
    if why:
        pytest.skip(why)


def created(rt, tmp_path, fixtures_root, env=PLAIN_ENV, image="container-debian", plant=None, script=PROBE):
    """The plugin's answer for a container of `image` with `env`, and that container created by
    runc with it; (Created, the NRI Container message StartContainer carries)."""
    p = fr.pb()
    code, msg, resp = create(rt, container("ignored", env))
    assert code == 0, msg
    box = Created(tmp_path, fixtures_root, image, resp.adjust.mounts, script, plant)
    devices = [p.LinuxDevice(path=d.path, type=d.type, major=d.major, minor=d.minor) for d in resp.adjust.linux.devices]
    c = p.Container(id=box.id, pod_sandbox_id="pod1", name="app", env=env, pid=box.pid,
                    mounts=[p.Mount(destination=m.destination, type="bind", source=m.source) for m in resp.adjust.mounts],
                    linux=p.LinuxContainer(devices=devices))
    return box, c


def no_process_started(monkeypatch):
    """Every way Python starts a process, made to fail while the block runs: an answer that
    needed one fails (the start is refused), so a passing answer started none."""
    import contextlib
    import subprocess

    def refuse(*_a, **_k):
        raise AssertionError("the plugin started a process")

    @contextlib.contextmanager
    def block():
        with monkeypatch.context() as m:
            for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "system"):
                if hasattr(os, name):
                    m.setattr(os, name, refuse)
            m.setattr(subprocess.Popen, "_execute_child", refuse)
            yield
    return block()


@pytest.mark.parametrize("pidfd", [True, False])
def test_start_writes_the_loader_cache_the_containers_ldconfig_reads(setup, tmp_path, fixtures_root, runc_ready,
                                                                     monkeypatch, pidfd):
    """The plugin's StartContainer, no process: the container's own ldconfig lists libcuda from
    the cache nvhook wrote, once, and a CUDA program loads the host's libcuda from its bind.
    Without pidfd_open (kernels before 5.3: taken away here) the pid is held by its start time."""
    rt, log = setup
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    box, c = created(rt, tmp_path, fixtures_root)
    try:
        with no_process_started(monkeypatch):  # the plugin's thread is in this process
            code, msg, _ = rt.call("StateChange", start_event(c))
        assert code == 0, msg
        out = box.start_and_wait()
    finally:
        box.delete()
    lib = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert f"libcuda.so.1 (libc6,x86-64) => {lib}" in out and out.count("libcuda.so.1 (") == 1, out
    assert f"path: {lib}" in out and f"cuDriverGetVersion: {HOST.cuda}" in out, out
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    assert (ev["work"], ev["ldcache"], ev["compat"]) == ("compat,ldcache", "written", "host"), ev


def test_start_events_without_work_need_no_process_and_no_pid(setup):
    """Other events are ignored; StartContainer of a container without a GPU, of a GPU container
    whose image needs nothing (CUDA image), or on a GPU runtime class: nothing done, not even
    the pid looked at (0 here)."""
    rt, log = setup
    cuda = ["NVIDIA_VISIBLE_DEVICES=0", f"CUDA_VERSION={CUDA}", "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]
    for ev in (start_event(container("a", PLAIN_ENV), event=7), start_event(container("b", ["PATH=/bin"])),
               start_event(container("c", cuda)), start_event(container("d", PLAIN_ENV), handler="nvhook")):
        code, msg, _ = rt.call("StateChange", ev)
        assert code == 0, msg
    assert events(log, "nri.started") == [] and events(log, "nri.start_refused") == []


def test_start_of_a_container_created_without_the_plugin_is_left_alone(setup):
    """A GPU container whose spec has none of the plugin's binds (created while the plugin was
    down): a warning, and its start goes on (Synchronize names it)."""
    rt, log = setup
    code, msg, _ = rt.call("StateChange", start_event(container("lost", PLAIN_ENV)))
    assert code == 0, msg
    [ev] = events(log, "nri.start_not_adjusted")
    assert ev["container"] == "lost" and ev["level"] == "warning"


def test_start_refuses_a_pid_that_is_not_the_container(setup, tmp_path):
    """The pid is checked to be the container's before anything is opened under it: this test's
    own process (the host's root), no pid, and a pid that has exited are each refused with one
    line, nothing written, and the plugin goes on."""
    import subprocess

    rt, log = setup
    p = fr.pb()
    code, msg, resp = create(rt, container("x", PLAIN_ENV))
    assert code == 0, msg
    mounts = [p.Mount(destination=m.destination, type="bind", source=m.source) for m in resp.adjust.mounts]
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid, words in ((os.getpid(), "is not container"), (0, "gave no process"), (dead.pid, "is gone")):
        c = p.Container(id="f00dfeed", name="app", env=PLAIN_ENV, pid=pid, mounts=mounts)
        code, msg, _ = rt.call("StateChange", start_event(c))
        assert code != 0 and words in msg and "\n" not in msg, msg
    assert len(events(log, "nri.start_refused")) == 3
    code, msg, resp = create(rt, container("after", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


@pytest.mark.parametrize("cut", ["prefix", "suffix", "middle"])
def test_start_refuses_a_process_whose_cgroup_only_contains_the_id(setup, tmp_path, fixtures_root, runc_ready, cut):
    """A real container's init, given with an id that is only part of that container's (the
    start of a longer id, its end, its middle): its cgroup path contains the id as a substring
    but is not that container's, so nothing is written into its root and the start is refused
    with one line."""
    rt, log = setup
    box, c = created(rt, tmp_path, fixtures_root)
    before = (box.rootfs / "etc/ld.so.cache").read_bytes()
    c.id = {"prefix": box.id[:-6], "suffix": box.id[7:], "middle": box.id[3:-3]}[cut]
    try:
        code, msg, _ = rt.call("StateChange", start_event(c))
    finally:
        box.delete()
    assert code != 0 and "is not container" in msg and "\n" not in msg, msg
    assert (box.rootfs / "etc/ld.so.cache").read_bytes() == before
    code, msg, resp = create(rt, container("after", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


def test_names_container_accepts_the_engines_cgroup_layouts():
    from nvhook.apply.nriroot import names_container

    cid = "0123456789abcdef" * 4
    for line in (f"0::/{cid}", f"0::/kubepods/besteffort/pod1/{cid}",
                 f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{cid}.scope",
                 f"0::/system.slice/docker-{cid}.scope", f"0::/machine.slice/libpod-{cid}.scope/container",
                 f"12:pids:/x\n0::/kubepods/pod1/{cid}\n"):
        assert names_container(line, cid), line
    for line in (f"0::/{cid}0", f"0::/a{cid}", f"0::/{cid[1:]}", "0::/", f"0::/x/{cid}-sub.scope",
                 f"0::/x/y-{cid}"):
        assert not names_container(line, cid), line
    assert not names_container(f"0::/{cid}", "") and not names_container("0::/a/b", "a/b")


def test_malformed_state_change_is_refused_alone(setup):
    rt, log = setup
    code, msg, _ = rt.call("StateChange", None, raw=b"\x08\x06\x1a\xff\xff")  # START, a container past the end
    assert code == 3 and "malformed StateChange" in msg, msg
    code, msg, resp = create(rt, container("after", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


def _plant_cache_link(target: Path):
    def plant(rootfs: Path) -> None:
        (rootfs / "etc/ld.so.cache").unlink()
        (rootfs / "etc/ld.so.cache").symlink_to(target)
    return plant


def _plant_fifo(rootfs: Path) -> None:
    (rootfs / "etc/ld.so.cache").unlink()
    os.mkfifo(rootfs / "etc/ld.so.cache")


def _plant_include_loop(rootfs: Path) -> None:
    conf = rootfs / "etc/ld.so.conf.d"
    for i in range(400):
        (conf / f"loop{i:03}.conf").write_text("include /etc/ld.so.conf\ninclude /etc/ld.so.conf.d/*.conf\n")


@pytest.mark.parametrize("attack", ["cache-link", "cache-link-relative", "fifo", "include-loop"])
def test_a_hostile_image_gets_its_cache_and_nothing_outside(setup, tmp_path, fixtures_root, runc_ready, attack):
    """The image plants /etc/ld.so.cache as a link to a host file (absolute, or climbing out with
    ..), a FIFO there, or an ld.so.conf whose includes loop 400 ways: the cache is written inside
    the container's root (a link is replaced, never followed; a FIFO is never opened) or the
    start is refused with one line (the include loop: past ldconf.py's bound on included files);
    nothing outside the root changes; the plugin goes on."""
    rt, log = setup
    host_file = tmp_path / "host-secret"
    host_file.write_text("host\n")
    plant = {"cache-link": _plant_cache_link(host_file),
             "cache-link-relative": _plant_cache_link(Path("../" * 12 + str(host_file).lstrip("/"))),
             "fifo": _plant_fifo, "include-loop": _plant_include_loop}[attack]
    box, c = created(rt, tmp_path, fixtures_root, plant=plant)
    try:
        code, msg, _ = rt.call("StateChange", start_event(c))
        if attack == "include-loop":  # bounded (ldconf.py): refused, the image's own doing
            assert code != 0 and "ld.so.conf includes more than" in msg and "\n" not in msg, msg
            assert not [p for p in (box.rootfs / "etc").iterdir() if ".nvhook-" in p.name]
        else:
            assert code == 0, msg
            out = box.start_and_wait()
            assert "libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out, out
            cache = box.rootfs / "etc/ld.so.cache"
            assert cache.is_file() and not cache.is_symlink()
    finally:
        box.delete()
    assert host_file.read_text() == "host\n" and not host_file.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "cache", "hook.toml", "host-secret", "nri.sock",
                                                         "nvhook.jsonl", "rootfs", "runc-state", "runc.err"]
    code, msg, resp = create(rt, container("after", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


def test_a_start_scan_past_its_time_share_is_refused_not_dropped(setup, tmp_path, fixtures_root, runc_ready,
                                                                 monkeypatch):
    """An image whose library directories are slow to read (thousands of libraries read cold:
    13 s measured for 16,000) must not hold StartContainer past containerd's timeout, which would
    drop the plugin and start every GPU container created meanwhile without its GPU. The scan's
    clock is made to pass a second at every reading (no timer is raced): that start is refused
    with one line, no cache or temporary file is written, and the plugin answers the next one."""
    from nvhook.apply import ldscan

    rt, log = setup
    box, c = created(rt, tmp_path, fixtures_root)
    before = (box.rootfs / "etc/ld.so.cache").read_bytes()
    ticks = iter(range(10**6))
    monkeypatch.setattr(ldscan, "clock", lambda: float(next(ticks)))
    try:
        code, msg, _ = rt.call("StateChange", start_event(c))
    finally:
        box.delete()
    assert code != 0 and "took too long" in msg and "refused this start" in msg and "\n" not in msg, msg
    assert (box.rootfs / "etc/ld.so.cache").read_bytes() == before
    assert not [p for p in (box.rootfs / "etc").iterdir() if ".nvhook-" in p.name]
    [ev] = events(log, "nri.start_refused")
    assert ev["container"] == box.id
    code, msg, resp = create(rt, container("after", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


@pytest.mark.parametrize("target", ["/proc/cmdline", "/proc/1/status", "/sys/kernel/uevent_seqnum"])
def test_links_into_the_containers_procfs_or_sysfs_are_not_read(setup, tmp_path, fixtures_root, runc_ready, target):
    """The container's /proc and /sys show the kernel's files, which the plugin would read as
    root in the host's namespaces (and some, /proc/kmsg, unmasked by runtimes, give each kernel
    message to one reader only). An image whose loader files (/etc/ld.so.cache, an ld.so.conf
    include) are links there: the plugin reads none of them, through the real container's root,
    and its start still writes the cache."""
    from nvhook.apply import ldconf
    from nvhook.apply.nriroot import cache_tail, open_container_root
    from nvhook.apply.paths import Root

    rt, log = setup

    def plant(rootfs: Path) -> None:
        (rootfs / "etc/ld.so.cache").unlink()
        (rootfs / "etc/ld.so.cache").symlink_to(target)
        (rootfs / "etc/ld.so.conf.d/kernel.conf").symlink_to(target)

    box, c = created(rt, tmp_path, fixtures_root, plant=plant)
    try:
        fd, owner = open_container_root(box.pid, box.id)
        try:
            root = Root(fd, owner=owner)
            assert os.path.isfile(f"/proc/self/fd/{fd}{target}")  # it is there, and a regular file
            assert ldconf.read_regular(root, target, 4096) is None
            assert ldconf.read_regular(root, "/etc/ld.so.conf.d/kernel.conf", 4096) is None
            assert cache_tail(root, 1) is None
        finally:
            os.close(fd)
        code, msg, _ = rt.call("StateChange", start_event(c))
        assert code == 0, msg
        out = box.start_and_wait()
    finally:
        box.delete()
    assert "libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out, out


def test_a_container_whose_etc_is_the_nodes_own_gets_no_cache_written_there(tmp_path, fixtures_root, runc_ready):
    """A GPU pod with the node's /etc as a hostPath volume on its /etc (the plugin's host root's
    /etc here: a copy of the fixture host): the node's loader cache is not replaced by one built
    from the image (a warning, the container starts, its libraries load from their binds), and
    at Synchronize the container is not named for what its start could not do either."""
    import subprocess

    node = tmp_path / "node"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(node)], check=True, timeout=60)  # device nodes too
    gen = serve(tmp_path, node)
    rt, log = next(gen)
    try:
        p = fr.pb()
        code, msg, resp = create(rt, container("ignored", PLAIN_ENV))
        assert code == 0, msg
        host_etc = node / "etc"
        before = {f.name: f.read_bytes() for f in host_etc.rglob("*") if f.is_file()}
        box = Created(tmp_path, fixtures_root, "container-debian",
                      [*resp.adjust.mounts, p.Mount(destination="/etc", source=str(host_etc), options=["rbind", "rw"])],
                      PROBE)
        c = p.Container(id=box.id, name="app", env=PLAIN_ENV, pid=box.pid,
                        mounts=[p.Mount(destination=m.destination, type="bind", source=m.source)
                                for m in resp.adjust.mounts],
                        linux=p.LinuxContainer(devices=[p.LinuxDevice(path=d.path, type=d.type, major=d.major,
                                                                      minor=d.minor)
                                                        for d in resp.adjust.linux.devices]))
        try:
            code, msg, _ = rt.call("StateChange", start_event(c))
            assert code == 0, msg
            synchronize(rt, c)
        finally:
            box.delete()
    finally:
        gen.close()
    assert {f.name: f.read_bytes() for f in host_etc.rglob("*") if f.is_file()} == before
    [ev] = events(log, "nri.start_node_etc")
    assert ev["container"] == box.id and ev["level"] == "warning"
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    assert ev["ldcache"] == "node-etc", ev
    assert events(log, "nri.start_work_missing") == [] and events(log, "nri.start_work_check_failed") == []
    [ev] = events(log, "nri.synchronized")
    assert ev["start_work_checked"] == 1, ev


def test_an_etc_link_to_a_host_directory_stays_inside(setup, tmp_path, fixtures_root, runc_ready):
    """/etc is a link to a host directory: resolved inside the container's root, where it goes
    nowhere, so the start is refused with one line and the host directory is untouched."""
    import shutil

    rt, log = setup
    host_etc = tmp_path / "host-etc"
    host_etc.mkdir()

    def plant(rootfs: Path) -> None:
        shutil.rmtree(rootfs / "etc")
        (rootfs / "etc").symlink_to(host_etc)

    box, c = created(rt, tmp_path, fixtures_root, plant=plant)
    try:
        code, msg, _ = rt.call("StateChange", start_event(c))
    finally:
        box.delete()
    assert code != 0 and "ld.so.cache" in msg and "\n" not in msg, msg
    assert list(host_etc.iterdir()) == []
    [ev] = events(log, "nri.start_refused")
    assert ev["container"] == box.id


# -- the application profile of a graphics or display container ---------------------------------

PROFILE = "etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf"
CAT_PROFILE = f"cat /{PROFILE} > /out.txt 2>&1; echo '<end>' >> /out.txt"


def no_drm_node(tmp_path: Path, fixtures_root: Path) -> Path:
    """A copy of the 8-GPU host without DRM nodes (no nvidia-drm, as on many compute nodes): a
    graphics container's answer then needs no /dev/dri/by-path link, so no hook, and its profile
    is the plugin's to write at the start. With them, nvhook's CDI hook writes it
    (test_a_graphics_container_with_drm_nodes_gets_the_profile_from_the_hook)."""
    import shutil
    import subprocess

    node = tmp_path / "node"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(node)], check=True, timeout=60)  # device nodes too
    shutil.rmtree(node / "dev/dri")
    return node


@pytest.fixture
def nodrm(tmp_path, fixtures_root):
    yield from serve(tmp_path, no_drm_node(tmp_path, fixtures_root))


def profile_bytes(minors) -> bytes:
    """The file NVIDIA 1.20's hook writes for these minors (one line, no newline, the mask in
    lower-case hexadecimal): tests/test_app_profile.py compares it with NVIDIA's own build."""
    mask = sum(1 << m for m in set(minors))
    return ('{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",'
            f'0x{mask:x}' ']}],"rules":[{"pattern":[],"profile":"_container_"}]}').encode()


@pytest.mark.parametrize(("env", "work"), [
    # no compute, the loader finds the libraries in LD_LIBRARY_PATH: the profile is the start's only work
    (["NVIDIA_VISIBLE_DEVICES=1,5", "NVIDIA_DRIVER_CAPABILITIES=graphics,utility", "LD_LIBRARY_PATH=/opt/gl"],
     "profile"),
    (["NVIDIA_VISIBLE_DEVICES=1,5", "NVIDIA_DRIVER_CAPABILITIES=compute,display,utility"], "compat,ldcache,profile"),
    (["NVIDIA_VISIBLE_DEVICES=1,5", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"], "compat,ldcache"),
])
def test_start_writes_the_application_profile_of_a_graphics_container(nodrm, tmp_path, fixtures_root, runc_ready,
                                                                      monkeypatch, env, work):
    """A container that asks for graphics or display gets hook mode's
    /etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf at its StartContainer, no
    process: one bit per GPU node its answer gave it (GPUs 1 and 5), the directories 0555, the
    file 0444, read by the container itself; a compute-only container gets none."""
    rt, log = nodrm
    box, c = created(rt, tmp_path, fixtures_root, env=env, script=CAT_PROFILE)
    try:
        with no_process_started(monkeypatch):
            code, msg, _ = rt.call("StateChange", start_event(c))
        assert code == 0, msg
        out = box.start_and_wait()
    finally:
        box.delete()
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    assert ev["work"] == work, ev
    if "profile" not in work:
        assert not (box.rootfs / "etc/nvidia").exists() and "app_profile" not in ev
        assert "No such file" in out, out
        return
    want = profile_bytes([HOST.gpus[1].minor, HOST.gpus[5].minor])
    assert out == want.decode() + "<end>\n", out
    assert (box.rootfs / PROFILE).read_bytes() == want and ev["app_profile"] == "written"
    modes = {rel: stat.S_IMODE(os.lstat(box.rootfs / rel).st_mode)
             for rel in ("etc/nvidia", "etc/nvidia/nvidia-application-profiles-rc.d", PROFILE)}
    assert modes == {"etc/nvidia": 0o555, "etc/nvidia/nvidia-application-profiles-rc.d": 0o555, PROFILE: 0o444}
    assert os.listdir(box.rootfs / PROFILE.rsplit("/", 1)[0]) == ["10-container.conf"]
    if "ldcache" in work:  # the loader work still done after it
        assert ev["ldcache"] == "written", ev


GRAPHICS_ENV = ["NVIDIA_VISIBLE_DEVICES=2", "NVIDIA_DRIVER_CAPABILITIES=graphics,utility", "LD_LIBRARY_PATH=/opt/gl"]


@pytest.mark.parametrize("attack", ["dir-link-out", "dir-link-dotdot", "etc-nvidia-link-out", "file-link-out"])
def test_a_hostile_image_gets_no_profile_outside_its_root(nodrm, tmp_path, fixtures_root, runc_ready, attack):
    """The image plants a link at the profile's directory (to a host directory, absolute or
    climbing out with ..), at /etc/nvidia, or at the file itself: resolved inside the container's
    root, so the host directory is untouched; a link that names nothing inside the root is no
    profile (a warning, not followed out, nothing made for it) and the container still starts;
    a link at the file is replaced."""
    rt, log = nodrm
    victim = tmp_path / "host-victim"
    victim.mkdir()
    (victim / "host-file").write_text("host secret\n")

    def plant(rootfs: Path) -> None:
        rc_d = rootfs / PROFILE.rsplit("/", 1)[0]
        if attack == "etc-nvidia-link-out":
            (rootfs / "etc/nvidia").symlink_to(victim)
            return
        rc_d.parent.mkdir(parents=True)
        if attack == "file-link-out":
            rc_d.mkdir()
            (rc_d / "10-container.conf").symlink_to(victim / "host-file")
        else:
            rc_d.symlink_to(victim if attack == "dir-link-out" else Path("../" * 12 + str(victim).lstrip("/")))

    box, c = created(rt, tmp_path, fixtures_root, env=GRAPHICS_ENV, plant=plant, script="echo ok > /out.txt")
    try:
        code, msg, _ = rt.call("StateChange", start_event(c))
        assert code == 0, msg
        assert box.start_and_wait() == "ok\n"
    finally:
        box.delete()
    assert sorted(os.listdir(victim)) == ["host-file"] and (victim / "host-file").read_text() == "host secret\n"
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    want = profile_bytes([HOST.gpus[2].minor])
    if attack == "file-link-out":  # replaced inside the root, never followed
        f = box.rootfs / PROFILE
        assert not f.is_symlink() and f.read_bytes() == want and ev["app_profile"] == "written"
    else:  # every link resolves inside the root, where its target does not exist: nothing made
        assert not (box.rootfs / str(victim).lstrip("/")).exists()
        assert ev["app_profile"] == "not-written", ev
        [warn] = [e for e in events(log, "app_profile.not_written") if e.get("container") == box.id]
        assert warn["level"] == "warning" and "application profiles directory" in warn["error"], warn


def test_a_graphics_container_with_drm_nodes_gets_the_profile_from_the_hook(tmp_path, fixtures_root, runc_ready):
    """With DRM nodes the answer's /dev/dri/by-path links take nvhook's CDI hook, which writes
    the same profile (its GPUs: the NVIDIA nodes the engine wrote into linux.devices from the
    answer): runc runs the answer's hook with its devices; the container reads the file."""
    host = fixtures_root / "host-gpu8"
    gen = serve(tmp_path, host, config=f"root = {json.dumps(str(host))}\n")
    rt, log = next(gen)
    env = ["NVIDIA_VISIBLE_DEVICES=1,5", "NVIDIA_DRIVER_CAPABILITIES=graphics,utility"]
    try:
        code, msg, resp = create(rt, container("ignored", env))
        assert code == 0, msg
        [h] = resp.adjust.hooks.create_container
        assert "graphics" in h.args[-2].split(","), h.args

        def edit(cfg: dict) -> None:
            cfg["linux"]["devices"] = [{"path": d.path, "type": d.type, "major": d.major, "minor": d.minor,
                                        "fileMode": 0o666, "uid": 0, "gid": 0} for d in resp.adjust.linux.devices]
            cfg["hooks"] = {"createContainer": [{"path": h.path, "args": list(h.args), "env": list(h.env)}]}

        box = Created(tmp_path, fixtures_root, "container-debian", resp.adjust.mounts, CAT_PROFILE, edit=edit)
        try:
            out = box.start_and_wait()
        finally:
            box.delete()
    finally:
        gen.close()
    assert out == profile_bytes([HOST.gpus[1].minor, HOST.gpus[5].minor]).decode() + "<end>\n", out
    assert stat.S_IMODE(os.lstat(box.rootfs / PROFILE).st_mode) == 0o444


def test_a_graphics_container_whose_etc_is_the_nodes_own_gets_no_profile_there(tmp_path, fixtures_root, runc_ready):
    """The node's /etc as a hostPath volume on the container's /etc: nothing made in it (not
    even a directory), a warning naming the volume, the container starts."""
    node = no_drm_node(tmp_path, fixtures_root)
    gen = serve(tmp_path, node)
    rt, log = next(gen)
    try:
        p = fr.pb()
        code, msg, resp = create(rt, container("ignored", GRAPHICS_ENV))
        assert code == 0, msg
        host_etc = node / "etc"
        before = sorted(str(f) for f in host_etc.rglob("*"))
        box = Created(tmp_path, fixtures_root, "container-debian",
                      [*resp.adjust.mounts, p.Mount(destination="/etc", source=str(host_etc), options=["rbind", "rw"])],
                      "echo ok > /out.txt")
        c = p.Container(id=box.id, name="app", env=GRAPHICS_ENV, pid=box.pid,
                        mounts=[p.Mount(destination=m.destination, type="bind", source=m.source)
                                for m in resp.adjust.mounts],
                        linux=p.LinuxContainer(devices=[p.LinuxDevice(path=d.path, type=d.type, major=d.major,
                                                                      minor=d.minor)
                                                        for d in resp.adjust.linux.devices]))
        try:
            code, msg, _ = rt.call("StateChange", start_event(c))
            assert code == 0, msg
            assert box.start_and_wait() == "ok\n"
        finally:
            box.delete()
    finally:
        gen.close()
    assert sorted(str(f) for f in host_etc.rglob("*")) == before
    [ev] = [e for e in events(log, "app_profile.not_written") if e.get("container") == box.id]
    assert ev["level"] == "warning" and ev["reason"].startswith("the container's /etc is on a volume"), ev


@pytest.mark.parametrize(("host", "chosen"), [("host-t4-450", True), ("host-geforce-460", False)])
def test_start_chooses_the_compat_libcuda_by_the_gpus(tmp_path, fixtures_root, runc_ready, monkeypatch, host, chosen):
    """A CUDA 11.3 image (CUDA_VERSION=11.3.1, its 465 compat libcuda) on a 450 driver with a T4:
    the image's libcuda first in the cache and in the loader config, and a CUDA program loads it;
    on a 460 driver with GeForce GPUs (no forward compatibility: error 804) the host's. No
    process either way (NVML, for the GPU brands, is a library in the plugin's process)."""
    fixture = mf.HOSTS[host]
    gen = serve(tmp_path, fixtures_root / host)
    rt, log = next(gen)
    try:
        env = [f"NVIDIA_VISIBLE_DEVICES={fixture.gpus[0].uuid}", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
               *mf.CONTAINERS["container-cuda113"].env]
        box, c = created(rt, tmp_path, fixtures_root, env=env, image="container-cuda113")
        try:
            with no_process_started(monkeypatch):
                code, msg, _ = rt.call("StateChange", start_event(c))
            assert code == 0, msg
            out = box.start_and_wait()
        finally:
            box.delete()
    finally:
        gen.close()
    compat, lib = "/usr/local/cuda-11.3/compat", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    first = next(line.strip() for line in out.splitlines() if "libcuda.so.1 (" in line)
    [ev] = events(tmp_path / "nvhook.jsonl", "nri.started")
    if chosen:
        assert first == f"libcuda.so.1 (libc6,x86-64) => {compat}/libcuda.so.1", out
        assert f"path: {compat}/libcuda.so.465.19.01" in out and "cuDriverGetVersion: 11030" in out, out
        assert (box.rootfs / "etc/ld.so.conf.d/00-compat-nvhook.conf").read_text() == compat + "\n"
        assert (ev["compat"], ev["compat_dir"]) == ("image", compat), ev
    else:
        assert first == f"libcuda.so.1 (libc6,x86-64) => {lib}" and out.count("libcuda.so.1 (") == 1, out
        assert f"path: {lib}" in out and f"cuDriverGetVersion: {fixture.cuda}" in out, out
        assert not (box.rootfs / "etc/ld.so.conf.d/00-compat-nvhook.conf").exists()
        assert ev["compat"] == "host", ev
        [d] = events(tmp_path / "nvhook.jsonl", "compat.decision")[-1:]
        assert d["reason_code"] == "gpu-not-supported", d


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_stale_compat_conf_temporary_file_does_not_refuse_later_starts(tmp_path, fixtures_root, runc_ready, kind):
    """The plugin is one process for the node's life: a temporary compat conf with its pid in a
    container's /etc/ld.so.conf.d (left by a write that failed, e.g. a full /etc volume a pod
    reuses, or planted as a link to a host file) is removed and the write goes on, inside the
    root; nothing outside changes."""
    gen = serve(tmp_path, fixtures_root / "host-t4-450")
    rt, log = next(gen)
    host_file = tmp_path / "host-secret"
    host_file.write_text("host\n")

    def plant(rootfs: Path) -> None:
        # base.files' temporary name, with the pid of the plugin (a thread of this test)
        stale = rootfs / "etc/ld.so.conf.d" / temp_name("00-compat-nvhook.conf")
        if kind == "file":
            stale.write_text("/stale\n")
        else:
            stale.symlink_to(host_file)

    try:
        env = [f"NVIDIA_VISIBLE_DEVICES={mf.HOSTS['host-t4-450'].gpus[0].uuid}",
               "NVIDIA_DRIVER_CAPABILITIES=compute,utility", *mf.CONTAINERS["container-cuda113"].env]
        box, c = created(rt, tmp_path, fixtures_root, env=env, image="container-cuda113", plant=plant)
        try:
            code, msg, _ = rt.call("StateChange", start_event(c))
        finally:
            box.delete()
    finally:
        gen.close()
    assert code == 0, msg
    conf = box.rootfs / "etc/ld.so.conf.d"
    assert (conf / "00-compat-nvhook.conf").read_text() == "/usr/local/cuda-11.3/compat\n"
    assert [p.name for p in conf.iterdir() if p.name.startswith(".")] == []
    assert host_file.read_text() == "host\n"


def test_a_compat_start_never_writes_into_the_nodes_own_ld_so_conf_d(tmp_path, fixtures_root, runc_ready):
    """The node's /etc/ld.so.conf.d (a copy of the fixture host's, as the plugin's host root) as a
    hostPath volume on a CUDA 11.3 container's that needs its compat libcuda (T4, driver 450):
    the compat conf is not written there; the start is refused with one line."""
    import subprocess

    node = tmp_path / "node"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-t4-450"), str(node)], check=True, timeout=60)
    (node / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    before = sorted(p.name for p in (node / "etc/ld.so.conf.d").iterdir())
    gen = serve(tmp_path, node)
    rt, log = next(gen)
    try:
        p = fr.pb()
        env = [f"NVIDIA_VISIBLE_DEVICES={mf.HOSTS['host-t4-450'].gpus[0].uuid}",
               "NVIDIA_DRIVER_CAPABILITIES=compute,utility", *mf.CONTAINERS["container-cuda113"].env]
        code, msg, resp = create(rt, container("ignored", env))
        assert code == 0, msg
        box = Created(tmp_path, fixtures_root, "container-cuda113",
                      [*resp.adjust.mounts, p.Mount(destination="/etc/ld.so.conf.d",
                                                    source=str(node / "etc/ld.so.conf.d"), options=["rbind", "rw"])],
                      PROBE)
        c = p.Container(id=box.id, name="app", env=env, pid=box.pid,
                        mounts=[p.Mount(destination=m.destination, type="bind", source=m.source)
                                for m in resp.adjust.mounts])
        try:
            code, msg, _ = rt.call("StateChange", start_event(c))
        finally:
            box.delete()
    finally:
        gen.close()
    assert code != 0 and "/etc/ld.so.conf.d is this node's own" in msg and "\n" not in msg, msg
    assert sorted(p.name for p in (node / "etc/ld.so.conf.d").iterdir()) == before


# -- Synchronize: running containers that missed their StartContainer work ---------------------

def synchronize(rt, *containers) -> None:
    """The engine's Synchronize with `containers`, in pod web/ml, running (state 3) unless
    their state is set."""
    p = fr.pb()
    for c in containers:
        c.state, c.pod_sandbox_id = c.state or 3, "pod1"
    code, msg, _ = rt.call("Synchronize", p.SynchronizeRequest(
        pods=[p.PodSandbox(id="pod1", name="web", namespace="ml")], containers=list(containers)))
    assert code == 0, msg


def _files(root: Path) -> dict:
    """Every file below `root` and its bytes (links as their target)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            out[path] = os.readlink(path) if os.path.islink(path) else Path(path).read_bytes()
    return out


@pytest.mark.parametrize(("host", "image", "missing"), [
    ("host-gpu8", "container-debian", ["ldcache"]),
    ("host-t4-450", "container-cuda113", ["ldcache", "compat"])])
def test_synchronize_names_a_running_container_that_missed_its_start_work(tmp_path, fixtures_root, runc_ready,
                                                                         host, image, missing):
    """A GPU container that got the plugin's answer at its creation but whose StartContainer the
    plugin never saw (down, or held past containerd's timeout) is named at the next Synchronize:
    container, pod, namespace, what is missing (the loader cache; on a 450 driver with a T4, also
    the image's compat libcuda it needed) and the fix. Only read: nothing in its root changes.
    Once the work is done (StartContainer, here after the fact), Synchronize names it no more."""
    fixture = mf.HOSTS[host]
    gen = serve(tmp_path, fixtures_root / host)
    rt, log = next(gen)
    try:
        env = PLAIN_ENV if image == "container-debian" else [
            f"NVIDIA_VISIBLE_DEVICES={fixture.gpus[0].uuid}", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            *mf.CONTAINERS[image].env]
        box, c = created(rt, tmp_path, fixtures_root, env=env, image=image)
        try:
            before = _files(box.rootfs)
            synchronize(rt, c)
            assert _files(box.rootfs) == before
            [ev] = events(log, "nri.start_work_missing")
            assert (ev["container"], ev["container_name"], ev["pod"], ev["namespace"], ev["level"]) == \
                (box.id, "app", "web", "ml", "error"), ev
            assert ev["missing"] == missing and ev["pid"] == box.pid, ev
            assert "delete the pod" in ev["message"] and "ldconfig -p" in ev["message"], ev
            if "compat" in missing:
                assert ev["compat"] == "image" and "driver too old" in ev["message"], ev
            [sync] = events(log, "nri.synchronized")
            assert (sync["start_work_checked"], sync["start_work_missing"], sync["gpu_missing"],
                    sync["start_work_unchecked"]) == (1, 1, 0, 0), sync

            code, msg, _ = rt.call("StateChange", start_event(c))
            assert code == 0, msg
            synchronize(rt, c)
            assert len(events(log, "nri.start_work_missing")) == 1
            sync = events(log, "nri.synchronized")[-1]
            assert (sync["start_work_checked"], sync["start_work_missing"]) == (1, 0), sync
        finally:
            box.delete()
    finally:
        gen.close()


def test_synchronize_checks_only_the_containers_own_root(tmp_path, fixtures_root, runc_ready, monkeypatch):
    """The pid Synchronize carries is checked as at StartContainer before anything is read: this
    test's own process (the host's root) and a pid that has exited are skipped with a debug event,
    nothing written anywhere; a check that fails with a bug is logged for that container alone; a
    container that needs nothing at its start (a CUDA image), or one created and not started, is
    not looked at; the others are still checked and named. With no time left for checks, the containers are named unchecked."""
    import subprocess

    import nvhook.apply.nriroot as nriroot_mod
    import nvhook.start.nri.nrisync as nrisync_mod

    gen = serve(tmp_path, fixtures_root / "host-gpu8", config='log_level = "debug"\n')
    rt, log = next(gen)
    try:
        box, c = created(rt, tmp_path, fixtures_root)
        try:
            p = fr.pb()
            dead = subprocess.Popen(["true"])
            dead.wait()

            def like(cid: str, pid: int) -> object:
                o = p.Container()
                o.CopyFrom(c)
                o.id, o.pid = cid, pid
                return o

            cuda = container("cuda", ["NVIDIA_VISIBLE_DEVICES=1", f"CUDA_VERSION={CUDA}",
                                      "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"], devices=["/dev/nvidia1"])
            cuda.pid = os.getpid()
            host_cache = Path("/etc/ld.so.cache").stat() if Path("/etc/ld.so.cache").exists() else None
            before = _files(box.rootfs)
            not_started = like(box.id, box.pid)
            not_started.state = 1  # created: its StartContainer is still to come
            synchronize(rt, like("not-this-host", os.getpid()), like("exited", dead.pid), cuda, not_started, c)
            assert _files(box.rootfs) == before
            if host_cache is not None:
                after = Path("/etc/ld.so.cache").stat()
                assert (after.st_ino, after.st_mtime_ns) == (host_cache.st_ino, host_cache.st_mtime_ns)
            skipped = {e["container"]: e for e in events(log, "nri.start_work_unchecked")}
            assert set(skipped) == {"not-this-host", "exited"}, skipped
            assert "is not container" in skipped["not-this-host"]["error"], skipped
            assert "is gone" in skipped["exited"]["error"] and skipped["exited"]["level"] == "debug", skipped
            assert [e["container"] for e in events(log, "nri.start_work_missing")] == [box.id]
            assert events(log, "nri.synchronized")[-1]["start_work_checked"] == 1  # the CUDA image: nothing to check

            real = nriroot_mod.start_work_missing

            def flaky(root, work, compat_dir):
                if flaky.calls == 0:
                    flaky.calls += 1
                    raise RuntimeError("a bug")
                return real(root, work, compat_dir)
            flaky.calls = 0
            monkeypatch.setattr(nriroot_mod, "start_work_missing", flaky)
            synchronize(rt, c, like(box.id, box.pid))  # the first check meets the bug, the second names it
            [bug] = events(log, "nri.start_work_check_failed")
            assert bug["container"] == box.id and bug["level"] == "error" and "RuntimeError: a bug" in bug["error"], bug
            assert [e["container"] for e in events(log, "nri.start_work_missing")] == [box.id, box.id]

            monkeypatch.setattr(nrisync_mod, "SYNC_CHECK_SHARE", 0)  # no time at all for checks
            synchronize(rt, c)
            [late] = events(log, "nri.start_work_unchecked")[-1:]
            assert late["containers"] == [box.id] and late["level"] == "warning", late
            assert events(log, "nri.synchronized")[-1]["start_work_unchecked"] == 1
        finally:
            box.delete()
    finally:
        gen.close()


def _host_cache_that_looks_done(tmp_path: Path) -> Path:
    """A cache on the host that would pass the check (nvhook's generator, libcuda listed)."""
    from nvhook.apply import ldscan
    from nvhook.base import ldformat

    path = tmp_path / "host-ld.so.cache"
    path.write_bytes(ldformat.build([ldformat.Entry(b"libcuda.so.1", b"/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                                                    0x303)], generator=ldscan.GENERATOR))
    return path


def _plant_big_cache(rootfs: Path) -> None:
    """A cache of the image's own over the parse bound, naming libcuda (so it would be parsed)."""
    from nvhook.base import ldformat

    entries = [ldformat.Entry(f"libx{i:06}.so.1".encode(), f"/l/libx{i:06}.so.1".encode(), 0x303)
               for i in range(30000)]
    entries.append(ldformat.Entry(b"libcuda.so.1", b"/usr/lib/x86_64-linux-gnu/libcuda.so.1", 0x303))
    (rootfs / "etc/ld.so.cache").unlink()
    (rootfs / "etc/ld.so.cache").write_bytes(ldformat.build(entries, generator=b"ldconfig (hostile)"))


@pytest.mark.parametrize("attack", ["link-to-host", "fifo", "big"])
def test_synchronize_reads_a_hostile_containers_cache_inside_it(setup, tmp_path, fixtures_root, runc_ready, attack):
    """A running container chooses what its /etc/ld.so.cache is. A link to a host file that would
    pass the check (absolute path) resolves inside the container, where it leads nowhere: named.
    A FIFO is never opened for reading (Synchronize is not held): named. A cache of its own over
    the parse bound (1 MiB, naming libcuda) is not parsed: a warning for that container, not
    named, and Synchronize answers. Nothing in the container's root changes."""
    rt, log = setup
    plant = {"link-to-host": lambda r: _plant_cache_link(_host_cache_that_looks_done(tmp_path))(r),
             "fifo": _plant_fifo, "big": _plant_big_cache}[attack]
    box, c = created(rt, tmp_path, fixtures_root, plant=plant)
    try:
        before = _files(box.rootfs) if attack != "fifo" else None
        synchronize(rt, c)
        if before is not None:
            assert _files(box.rootfs) == before
        named = events(log, "nri.start_work_missing")
        if attack == "big":
            assert named == [], named
            [ev] = events(log, "nri.start_work_check_failed")
            assert ev["level"] == "warning" and "over 1 MiB" in ev["error"] and ev["container"] == box.id, ev
        else:
            assert [(e["container"], e["missing"]) for e in named] == [(box.id, ["ldcache"])], named
        assert events(log, "nri.synchronized")[-1]["containers"] == 1
    finally:
        box.delete()


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


# -- one container's work never holds another's answer (issue 35) ---------------------------------

def _plant_compat_links(n: int, source: Path):
    """/usr/local/cuda/compat with `n` hard links libcuda.so.999.<i>.1 to one real ELF libcuda:
    each newer than the host's driver, so each is an ELF file to parse for its note."""
    def plant(rootfs: Path) -> None:
        compat = rootfs / "usr/local/cuda/compat"
        compat.mkdir(parents=True)
        first = compat / "libcuda.so.999.0.1"
        first.write_bytes(source.read_bytes())
        for i in range(1, n):
            os.link(first, compat / f"libcuda.so.999.{i}.1")
    return plant


def test_a_hostile_compat_scan_holds_no_other_pods_answer(setup, tmp_path, fixtures_root, runc_ready):
    """A GPU image without CUDA_VERSION and 4,095 hard links libcuda.so.999.N.1 in
    /usr/local/cuda/compat (44 s of ELF parsing before the deadline existed): while its
    StartContainer's compat scan runs, another pod's CreateContainer and StartContainer (a real
    runc container) are answered within 100 ms; the hostile start is refused in one line once its
    share of the request timeout (here 6 s: 3 s) is spent, its root unchanged; the plugin goes on."""
    import time

    rt, log = setup
    p = fr.pb()
    code, _, _ = rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", request_timeout=6000))
    assert code == 0
    lib = fixtures_root / "container-cuda113/usr/local/cuda-11.3/compat/libcuda.so.465.19.01"
    (tmp_path / "hostile").mkdir()
    (tmp_path / "other").mkdir()
    hostile, hc = created(rt, tmp_path / "hostile", fixtures_root, plant=_plant_compat_links(4095, lib))
    other, oc = created(rt, tmp_path / "other", fixtures_root)
    try:
        before = sorted(os.listdir(hostile.rootfs / "etc"))
        t0 = time.monotonic()
        slow = rt.send("StateChange", start_event(hc))
        t1 = time.monotonic()
        code, msg, resp = create(rt, container("third", PLAIN_ENV))
        create_s = time.monotonic() - t1
        assert code == 0 and resp.adjust.linux.devices, msg
        t2 = time.monotonic()
        code, msg, _ = rt.call("StateChange", start_event(oc))
        start_s = time.monotonic() - t2
        assert code == 0, msg
        assert slow not in rt.answers, "the hostile start was answered before the other pod's"
        code, msg, _ = rt.answer(slow)
        hostile_s = time.monotonic() - t0
        out = other.start_and_wait()
    finally:
        hostile.delete()
        other.delete()
    print(f"other pod: CreateContainer {create_s * 1000:.1f} ms, StartContainer {start_s * 1000:.1f} ms; "
          f"hostile start refused after {hostile_s:.2f} s")
    assert create_s < 0.1 and start_s < 0.1, (create_s, start_s)
    assert code != 0 and "compat libraries" in msg and "took too long" in msg and "\n" not in msg, msg
    assert 2.9 < hostile_s < 5, hostile_s
    assert sorted(os.listdir(hostile.rootfs / "etc")) == before
    assert "libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out, out
    assert [e["container"] for e in events(log, "nri.start_refused")] == [hostile.id]
    assert [e["container"] for e in events(log, "nri.started")] == [other.id]


def test_a_malformed_frame_from_the_engine_is_logged_and_the_plugin_reconnects(tmp_path, fixtures_root):
    """The engine answers RegisterPlugin with bytes that are not protobuf: the plugin says so
    (nri.disconnected, level error, the reason) and dials again, registering on the new
    connection; it never ends silently."""
    cfgfile = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                     cache_dir=tmp_path / "cache")
    sock = tmp_path / "nri.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(2)
    srv.settimeout(10)
    plugin = Plugin(config_mod.load(str(cfgfile), explicit=True), str(fixtures_root / "host-gpu8"),
                    socket_path=str(sock), hook_path=str(rb.NVHOOK_BIN))
    stop = threading.Event()
    t = threading.Thread(target=plugin.serve_forever, args=(stop.is_set,), daemon=True)
    t.start()
    try:
        conn, _ = srv.accept()
        rt = fr.Runtime(conn)
        stream, _typ, _body = rt.read(2)
        rt.send_raw(2, stream, 2, b"\x0a\xff\xff")  # field 1, a length past the end
        conn2, _ = srv.accept()  # dialled again
        rt2 = fr.Runtime(conn2)
        req, reg = rt2.accept_registration()
        assert reg.plugin_name == "nvhook"
        code, _, _ = rt2.call("Configure", fr.pb().ConfigureRequest(runtime_name="containerd"))
        assert code == 0
        assert t.is_alive()
    finally:
        stop.set()
        srv.close()
    [ev] = events(tmp_path / "nvhook.jsonl", "nri.disconnected")
    assert ev["level"] == "error" and "malformed" in ev["error"] and "truncated varint" in ev["error"], ev


# -- NVIDIA's nvidia.cdi.k8s.io annotation (management CDI devices, issue 33) ---------------------

def pod_create(rt, pod, c):
    p = fr.pb()
    code, msg, payload = rt.call("CreateContainer", p.CreateContainerRequest(pod=pod, container=c))
    return code, msg, p.CreateContainerResponse.FromString(payload)


def test_cdi_annotation_is_honoured_only_in_the_named_namespaces(tmp_path, fixtures_root):
    """NVIDIA's annotation on a pod in a namespace the operator named: the engine is told the CDI
    devices (container-specific key first, then /pod, then the bare key, as NRI's effective
    annotation); the same pod in another namespace gets nothing (the container as made) and an
    event saying why; a GPU container gets both its GPU and the devices."""
    gen = serve(tmp_path, fixtures_root / "host-gpu8", config='[nri]\ncdi_annotation_namespaces = "gpu-operator, dcgm"\n')
    rt, log = next(gen)
    p = fr.pb()
    try:
        rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", runtime_version="v2.1.9"))
        ann = {"nvidia.cdi.k8s.io/container.app": "management.nvidia.com/gpu=all",
               "nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0", "nvidia.cdi.k8s.io": "nvidia.com/gpu=1"}
        inside = p.PodSandbox(id="pod1", name="validator", namespace="gpu-operator", annotations=ann)
        code, msg, resp = pod_create(rt, inside, container("c1", []))
        assert code == 0, msg
        assert [d.name for d in resp.adjust.CDI_devices] == ["management.nvidia.com/gpu=all"]
        assert not resp.adjust.mounts and not resp.adjust.linux.devices
        code, msg, resp = pod_create(rt, inside, p.Container(id="c2", pod_sandbox_id="pod1", name="sidecar"))
        assert code == 0 and [d.name for d in resp.adjust.CDI_devices] == ["nvidia.com/gpu=0"], msg
        bare = p.PodSandbox(id="pod1", name="v", namespace="dcgm", annotations={"nvidia.cdi.k8s.io": "nvidia.com/gpu=1"})
        code, msg, resp = pod_create(rt, bare, container("c3", PLAIN_ENV))
        assert code == 0 and [d.name for d in resp.adjust.CDI_devices] == ["nvidia.com/gpu=1"], msg
        assert resp.adjust.linux.devices and resp.adjust.mounts  # its own GPU too
        outside = p.PodSandbox(id="pod2", name="app", namespace="default", annotations=ann)
        code, msg, resp = pod_create(rt, outside, container("c4", []))
        assert code == 0 and not resp.HasField("adjust"), msg
        [ev] = events(log, "nri.cdi_annotation_ignored")
        assert ev["container"] == "c4" and ev["namespace"] == "default" and "gpu-operator, dcgm" in ev["message"], ev
        assert [e.get("cdi_devices") for e in events(log, "nri.adjusted")] == [
            ["management.nvidia.com/gpu=all"], ["nvidia.com/gpu=0"], ["nvidia.com/gpu=1"]]
    finally:
        gen.close()


def test_cdi_annotation_the_engine_would_drop_or_a_bad_name_is_refused(tmp_path, fixtures_root):
    """containerd 1.7 drops the CDI devices of an NRI adjustment unread: a management pod would
    start without them, so it is refused with one line; so is a value that is no CDI name. No
    namespace is named by default: the annotation is ignored there."""
    gen = serve(tmp_path, fixtures_root / "host-gpu8", cdi_namespaces=("gpu-operator",))
    rt, log = next(gen)
    p = fr.pb()
    try:
        pod = p.PodSandbox(id="pod1", name="v", namespace="gpu-operator",
                           annotations={"nvidia.cdi.k8s.io/container.app": "management.nvidia.com/gpu=all"})
        rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24~ds1"))
        code, msg, _ = pod_create(rt, pod, container("c1", []))
        assert code != 0 and "containerd 1.7.24~ds1 does not apply the CDI devices" in msg and "\n" not in msg, msg
        rt.call("Configure", p.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
        pod.annotations["nvidia.cdi.k8s.io/container.app"] = "management.nvidia.com/gpu=all,/etc/passwd"
        code, msg, _ = pod_create(rt, pod, container("c2", []))
        assert code != 0 and "'/etc/passwd' is not a CDI device name" in msg, msg
        assert [e["container"] for e in events(log, "nri.refused")] == ["c1", "c2"]
    finally:
        gen.close()
    (tmp_path / "default").mkdir()
    gen = serve(tmp_path / "default", fixtures_root / "host-gpu8")
    rt, log = next(gen)
    try:
        code, msg, resp = pod_create(rt, pod, container("c3", []))
        assert code == 0 and not resp.HasField("adjust"), msg
        assert events(log, "nri.cdi_annotation_ignored")[0]["message"].endswith("none), not in gpu-operator")
    finally:
        gen.close()


@pytest.mark.parametrize(("env", "said"), [
    (["NVIDIA_VISIBLE_DEVICES=example.com/gpu=0"], "NVIDIA_VISIBLE_DEVICES: 'example.com/gpu=0' is not a CDI device"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,warp"], "unknown capability 'warp'"),
    (["NVIDIA_VISIBLE_DEVICES=gpu7x"], "gpu7x"),
])
def test_a_bad_request_is_refused_and_logged_with_its_line(setup, env, said):
    """A request that is itself wrong (a CDI name of another vendor, an unknown capability, a
    device no GPU is) fails the container with one line in the engine's error, and nvhook's own
    log has it too: one nri.refused event naming the container, level error. The plugin goes on."""
    rt, log = setup
    code, msg, _ = create(rt, container("bad1", env))
    assert code != 0 and said in msg and "\n" not in msg, msg
    [ev] = events(log, "nri.refused")
    assert (ev["container"], ev["container_name"], ev["level"]) == ("bad1", "app", "error"), ev
    assert "nvhook: " + ev["error"] == msg, ev
    code, msg, resp = create(rt, container("good", PLAIN_ENV))
    assert code == 0 and resp.adjust.linux.devices, msg


def test_a_bad_request_at_a_start_this_process_did_not_answer_is_logged(setup):
    """A start of a container this process did not answer (it restarted since) whose request is
    wrong: refused with the line, and the nri.start_refused event says it."""
    rt, log = setup
    code, msg, _ = rt.call("StateChange", start_event(container("bad2", ["NVIDIA_VISIBLE_DEVICES=0",
                                                                        "NVIDIA_DRIVER_CAPABILITIES=warp"])))
    assert code != 0 and "unknown capability 'warp'" in msg, msg
    [ev] = events(log, "nri.start_refused")
    assert (ev["container"], ev["level"]) == ("bad2", "error") and "unknown capability 'warp'" in ev["error"], ev
