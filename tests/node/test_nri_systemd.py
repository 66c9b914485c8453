"""nvhook's units under a real systemd: a Debian 13 node booted by its own systemd 257 as PID 1
(tests/node/sdnode.py), containerd its containerd.service, nvhook's NRI plugin the shipped
nvhook-nri.service, unchanged. What docs/nri.md ("Faults") and `nvhook node install
--restart-engine` promise, as an operator's node does it:

- `node install --restart-engine` restarts containerd through the node's systemctl;
- a plugin killed with SIGKILL is brought back by systemd at once (Restart=always,
  RestartSec=100ms), containerd registers it again, and GPU pods get their GPUs again;
- a config the plugin cannot load stops the unit, failed, with the reason in its journal,
  instead of a restart loop (exit 78, RestartPreventExitStatus=78);
- a GPU pod created while the plugin is down starts without its GPU, and the restarted plugin
  names it (`nri.gpu_missing`); the plugin is held down by an ExecStartPre gate the test opens,
  so that the pod is created in that window by construction, not by timing;
- restarting containerd restarts the plugin with it (PartOf=) and it registers again.

The shipped units also pass `systemd-analyze verify` in the node's root (which needs no booted
systemd, so it runs wherever the node tests run).

Skips with the reason where systemd cannot boot here (sdnode.cannot_boot()). One node for the
module: booting it takes a few seconds; the systemd layer is built once per machine (apt-get,
well under a minute from a near mirror).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cri import device_plugin, pb
from gpuprobe import ALLOWED, CAPS, GPUS, HOST, assert_no_gpu, look
from images import DEBIAN
from node import HOST_ROOT, NVHOOK, Node, node_install
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent.parent
UNITS = REPO / "nvhook/data/systemd"
NRI_UNIT = "nvhook-nri.service"
CUDA = f"{HOST.cuda // 1000}.{HOST.cuda % 1000 // 10}"
CUDA_IMAGE_ENV = {"NVIDIA_DRIVER_CAPABILITIES": CAPS, "CUDA_VERSION": f"{CUDA}.0",
                  "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"}
GATE = "/run/nvhook-test/nri-may-start"
GATE_DROPIN = f"/etc/systemd/system/{NRI_UNIT}.d/50-test-gate.conf"
DEADLINE = 60


def _wait(what: str, cond, diag=lambda: "", timeout: float = DEADLINE):
    return wait_until(cond, what, timeout, interval=0.1, show=diag)


@pytest.fixture(scope="module")
def sd_node(machine_untouched, fixtures_root, node_inputs):
    import sdnode

    reason = sdnode.cannot_boot()
    if reason:
        pytest.skip(f"systemd node: {reason}")
    n = sdnode.start_systemd_node(fixtures_root / "host-gpu8", node_inputs)
    try:
        yield n
    finally:
        problems = n.close()
        assert not problems, problems


@pytest.fixture(scope="module")
def installed(sd_node):
    """`nvhook node install --restart-engine`, with containerd's unit's invocation before and
    after: (install's result, invocation id before)."""
    before = sd_node.unit("containerd.service", "InvocationID", "MainPID")
    r = node_install(sd_node, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                     "--oci-runtime", sd_node.runc, "--restart-engine")
    assert r.returncode == 0, r.stdout + r.stderr
    sd_node.nvhook_installed = True
    sd_node.cri.wait_ready(60)
    return r, before


@pytest.fixture
def kubelet(sd_node):
    k = sd_node.kubelet
    yield k
    k.remove_all()


def _diag(n) -> str:
    evs = [e for e in n.nvhook_events() if e["event"].startswith("nri.")][-12:]
    return "\n".join(["nvhook:", *map(str, evs), f"{NRI_UNIT}:", n.journal(NRI_UNIT)[-2000:],
                      "containerd:", n.journal("containerd.service")[-2000:]])


def _kill_plugin(n) -> dict:
    """SIGKILL to the plugin's main process, as a crash; its unit's properties before."""
    before = n.unit(NRI_UNIT, "MainPID", "NRestarts", "ActiveState")
    # (MainPID=0, no process: `kill -KILL 0` would kill this test's own process group)
    assert before["ActiveState"] == "active" and int(before["MainPID"]) > 1, before
    n.run(["kill", "-KILL", before["MainPID"]])
    return before


def _synced(n) -> int:
    return len(n.nvhook_events("nri.synchronized"))


@pytest.fixture(scope="module")
def plugin_unit(sd_node, installed):
    """The shipped nvhook-nri.service, byte for byte, where the package puts it; its ExecStart's
    /usr/local/bin/nvhook is the node's nvhook (a link to install's /opt/nvhook, as pip would put
    it). `systemctl enable --now`, as docs/nri.md says; registered and synchronised once."""
    n = sd_node
    n.write(f"/usr/lib/systemd/system/{NRI_UNIT}", (UNITS / NRI_UNIT).read_text())
    n.run(["ln", "-sf", NVHOOK, "/usr/local/bin/nvhook"])
    n.systemctl("daemon-reload")
    n.systemctl("enable", "--now", NRI_UNIT)
    _wait("the plugin's first synchronisation", lambda: _synced(n) >= 1, lambda: _diag(n))
    return n


def test_the_node_runs_systemd(sd_node):
    assert sd_node.boot_state == "running", sd_node.systemctl("--failed", check=False)
    assert sd_node.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert sd_node.run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"]).stdout.strip() == "cgroup2fs"
    assert sd_node.unit("containerd.service", "ActiveState")["ActiveState"] == "active"
    assert sd_node.systemctl("list-units", "--failed", "--plain", "--no-legend").strip() == ""
    # what the node's systemd may not touch on the machine: the hostname it set is the node's
    # own, it has its own network, and the kernel's settings are read-only there
    assert sd_node.run(["hostname"]).stdout.strip() == f"nvhook-sd-{sd_node.id}"
    assert Path("/proc/sys/kernel/hostname").read_text().strip() != f"nvhook-sd-{sd_node.id}"
    for ns in ("uts", "net", "ipc", "cgroup", "pid", "mnt"):
        assert os.readlink(f"/proc/{sd_node.init_pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    w = sd_node.run(["sh", "-c", "echo core > /proc/sys/kernel/core_pattern"], check=False)
    assert w.returncode != 0 and "Read-only file system" in w.stderr, w


def test_install_restart_engine_restarts_containerd(sd_node, installed):
    r, before = installed
    assert "restarted" in r.stdout and "containerd" in r.stdout, r.stdout
    after = sd_node.unit("containerd.service", "InvocationID", "MainPID", "ActiveState")
    assert after["ActiveState"] == "active"
    assert after["InvocationID"] != before["InvocationID"] and after["MainPID"] != before["MainPID"], (before, after)
    # the restarted containerd read install's config: its runtime handler is there
    runtimes = json.loads(sd_node.cri.Status(verbose=True).info["config"])["containerd"]["runtimes"]
    assert "nvidia" in runtimes and runtimes["nvidia"]["options"]["BinaryName"] == f"{NVHOOK}-runtime", runtimes


def test_plugin_killed_is_restarted_by_systemd(plugin_unit, kubelet):
    n = plugin_unit
    synced = _synced(n)
    first = _kill_plugin(n)
    again = _wait("systemd restarting the plugin",
                  lambda: (u := n.unit(NRI_UNIT, "MainPID", "NRestarts", "ActiveState"))["MainPID"] not in
                  ("0", first["MainPID"]) and u["ActiveState"] == "active" and u,
                  lambda: _diag(n))
    assert int(again["NRestarts"]) == int(first["NRestarts"]) + 1, again
    _wait("the restarted plugin's synchronisation", lambda: _synced(n) > synced, lambda: _diag(n))
    registered = n.nvhook_events("nri.registered")
    assert len({e["nvhook_pid"] for e in registered}) >= 2, registered
    assert registered[-1]["nvhook_pid"] == int(again["MainPID"]), (registered[-1], again)
    # containerd's side: the plugin registered again, by its new process
    said = [line for line in n.journal("containerd.service").splitlines() if 'registered as \\"10-nvhook\\"' in line]
    assert len(said) >= 2 and f"external:10-nvhook[{again['MainPID']}]" in said[-1], said
    gpu = GPUS[2]
    pod = kubelet.run_pod("sd-after-restart")
    cid = kubelet.run_container(pod, "app", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    view = look(kubelet, cid)
    assert view.opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, view.out + _diag(n)
    assert [e for e in n.nvhook_events("nri.adjusted") if e.get("container") == cid], _diag(n)


def test_gpu_pod_created_while_the_plugin_is_down_is_named(plugin_unit, kubelet):
    """The plugin killed and held down by an ExecStartPre gate (the unit's own settings as
    shipped): a GPU pod created meanwhile starts without its GPU; once the gate opens, the
    plugin systemd restarted names it at its synchronisation."""
    n = plugin_unit
    n.write(GATE_DROPIN, f"[Service]\nExecStartPre=/bin/sh -c 'while [ ! -e {GATE} ]; do sleep 0.05; done'\n")
    n.run(["rm", "-f", GATE])
    n.systemctl("daemon-reload")
    try:
        synced = _synced(n)
        _kill_plugin(n)
        _wait("the plugin held at its gate",
              lambda: n.unit(NRI_UNIT, "ActiveState", "SubState") == {"ActiveState": "activating",
                                                                       "SubState": "start-pre"}, lambda: _diag(n))
        gpu = GPUS[4]
        pod = kubelet.run_pod("sd-while-down")
        lost = kubelet.run_container(pod, "app", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
        assert kubelet.status(lost).state == pb().CONTAINER_RUNNING
        assert_no_gpu(look(kubelet, lost))
        n.run(["touch", GATE])
        _wait("the plugin's synchronisation after the gate", lambda: _synced(n) > synced, lambda: _diag(n))
        named = [e for e in n.nvhook_events("nri.gpu_missing") if e.get("container") == lost]
        assert named, _diag(n)
        assert (named[-1]["level"], named[-1]["pod"], named[-1]["namespace"], named[-1]["container_name"]) == \
            ("error", "sd-while-down", "default", "app"), named
    finally:
        n.run(["rm", "-f", GATE_DROPIN])
        n.systemctl("daemon-reload")
        n.run(["touch", GATE])


def test_containerd_restart_takes_the_plugin_along(plugin_unit, kubelet):
    """PartOf=containerd.service: `systemctl restart containerd` restarts the plugin too, and it
    registers with the new containerd."""
    n = plugin_unit
    before = n.unit(NRI_UNIT, "InvocationID", "MainPID")
    synced = _synced(n)
    n.restart_containerd()
    after = _wait("the plugin restarted with containerd",
                  lambda: (u := n.unit(NRI_UNIT, "InvocationID", "MainPID", "ActiveState"))["ActiveState"] == "active"
                  and u["InvocationID"] != before["InvocationID"] and u, lambda: _diag(n))
    _wait("its synchronisation with the new containerd", lambda: _synced(n) > synced, lambda: _diag(n))
    assert after["MainPID"] != before["MainPID"]
    gpu = GPUS[5]
    pod = kubelet.run_pod("sd-after-engine-restart")
    cid = kubelet.run_container(pod, "app", DEBIAN, env=CUDA_IMAGE_ENV, gpu=device_plugin("envvar", [gpu.uuid]))
    assert look(kubelet, cid).opens[f"/dev/nvidia{gpu.minor}"] == ALLOWED, _diag(n)


BAD_CONFIG = "/run/nvhook-test/bad-config.toml"
BAD_DROPIN = f"/etc/systemd/system/{NRI_UNIT}.d/50-test-bad-config.conf"


def test_plugin_with_a_bad_config_stops_failed(plugin_unit):
    """A config the plugin cannot load fails the same way at every start: the unit ends
    `failed` with status 78 and the one-line reason in its journal, not restarted again and
    again (it was 35 restarts a second with RestartSec=0 and no exit status kept from
    restarting). Fixed and restarted, the plugin registers again."""
    n = plugin_unit
    n.run(["mkdir", "-p", "/run/nvhook-test"])
    n.write(BAD_CONFIG, "this is = = not toml\n")
    n.write(BAD_DROPIN, f"[Service]\nEnvironment=NVHOOK_CONFIG={BAD_CONFIG}\n")
    n.systemctl("daemon-reload")
    try:
        before = n.unit(NRI_UNIT, "NRestarts")
        n.systemctl("restart", NRI_UNIT, check=False)
        failed = _wait("the unit failed on its config",
                       lambda: (u := n.unit(NRI_UNIT, "ActiveState", "Result", "ExecMainStatus", "NRestarts"))
                       ["ActiveState"] == "failed" and u, lambda: _diag(n))
        assert (failed["Result"], failed["ExecMainStatus"]) == ("exit-code", "78"), failed
        assert failed["NRestarts"] == before["NRestarts"], (before, failed)
        said = [line for line in n.journal(NRI_UNIT).splitlines() if line.startswith("nvhook nri: ")]
        assert said and BAD_CONFIG in said[-1], n.journal(NRI_UNIT)[-2000:]
    finally:
        n.run(["rm", "-f", BAD_DROPIN, BAD_CONFIG])
        n.systemctl("daemon-reload")
        n.systemctl("reset-failed", NRI_UNIT, check=False)
    synced = _synced(n)
    n.systemctl("start", NRI_UNIT)
    _wait("the plugin's synchronisation once its config is fixed", lambda: _synced(n) > synced, lambda: _diag(n))


def test_install_started_the_cdi_refresh_units(sd_node, installed):
    """On a node booted with systemd, install enables and starts nvhook-cdi.path and .timer
    (daemon-reload and `systemctl start` through the node's systemctl), and the path unit
    fires on what a driver install does: ldconfig rewriting /etc/ld.so.cache. (The service
    itself is then skipped by its ConditionPathExists=/proc/driver/nvidia/gpus: the node's /proc
    is the machine's kernel's, with no NVIDIA driver; the fake driver is /nvhook/host.)"""
    n = sd_node
    for name in ("nvhook-cdi.path", "nvhook-cdi.timer"):
        u = n.unit(name, "ActiveState", "UnitFileState")
        assert u == {"ActiveState": "active", "UnitFileState": "enabled"}, (name, u)
    # the timer stopped meanwhile (its OnBootSec= would start the service too): only the path
    # unit can start it below
    n.systemctl("stop", "nvhook-cdi.timer")
    try:
        before = n.unit("nvhook-cdi.service", "ConditionTimestampMonotonic")["ConditionTimestampMonotonic"]
        n.run(["ldconfig"])
        after = _wait("nvhook-cdi.service triggered by nvhook-cdi.path",
                      lambda: (u := n.unit("nvhook-cdi.service", "ConditionTimestampMonotonic", "ConditionResult"))
                      ["ConditionTimestampMonotonic"] != before and u, lambda: n.journal("nvhook-cdi.service"))
    finally:
        n.systemctl("start", "nvhook-cdi.timer")
    assert after["ConditionResult"] == "no", after
    assert "ConditionPathExists=/proc/driver/nvidia/gpus" in n.journal("nvhook-cdi.service")


def test_uninstall_restart_engine(sd_node, installed, plugin_unit):
    """Last on the node: the plugin's unit disabled and stopped (its binary is install's), then
    `node uninstall --restart-engine`: install's units stopped and gone, containerd restarted
    through systemctl and no longer serving the runtime handler."""
    n = sd_node
    n.systemctl("disable", "--now", NRI_UNIT)
    before = n.unit("containerd.service", "InvocationID")
    r = node_install(n, "uninstall", "--restart-engine")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restarted" in r.stdout and "containerd" in r.stdout, r.stdout
    after = n.unit("containerd.service", "InvocationID", "ActiveState")
    assert after["ActiveState"] == "active" and after["InvocationID"] != before["InvocationID"], (before, after)
    n.cri.wait_ready(60)
    runtimes = json.loads(n.cri.Status(verbose=True).info["config"])["containerd"]["runtimes"]
    assert "nvidia" not in runtimes, runtimes
    for name in ("nvhook-cdi.path", "nvhook-cdi.timer", "nvhook-cdi.service"):
        u = n.unit(name, "LoadState", "ActiveState")
        assert u == {"LoadState": "not-found", "ActiveState": "inactive"}, (name, u)


def test_shipped_units_verify(machine_untouched, fixtures_root, node_inputs):
    """`systemd-analyze verify` of every shipped unit in a node's root with nvhook installed (no
    booted systemd needed): their syntax, directives, dependencies and ExecStart paths."""
    import noderoot
    import sdnode

    Node.sweep_stale()
    suite = node_inputs.suite
    n = Node(Path(f"{sdnode.ensure_layer(suite)}:{noderoot.root_path(suite)}"), fixtures_root / "host-gpu8",
             suite=suite)
    try:
        n.start()
        r = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
        units = sorted(p.name for p in UNITS.iterdir() if p.suffix in (".service", ".socket", ".path", ".timer"))
        for name in units:
            n.write(f"/usr/lib/systemd/system/{name}", (UNITS / name).read_text())
        for tool in ("nvhook", "nvhookd"):
            n.run(["ln", "-sf", f"/opt/nvhook/bin/{tool}", f"/usr/local/bin/{tool}"])
        v = n.run(["systemd-analyze", "verify", *(f"/usr/lib/systemd/system/{u}" for u in units)], check=False)
        said = [line for line in (v.stdout + v.stderr).splitlines() if "nvhook" in line]
        assert v.returncode == 0 and not said, v.stdout + v.stderr
    finally:
        problems = n.close()
        assert not problems, problems
