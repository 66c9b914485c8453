"""`nvhook node install` on the Debian 13 node (tests/node/node.py): a fresh node with containerd
1.7 and no nvhook, installed as the DaemonSet installs it (the node's root at a path of the
installer, here /proc/<node init>/root; the node's own python3, trixie's, runs nvhook), a GPU pod
run through the CRI with the runtime handler `nvidia` and the device plugin's volume-mounts
answer, then `node uninstall` leaves every file of the node's /etc, /opt and /var as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cri import CRIError, device_plugin
from gpuprobe import CAPS, GPUS, assert_gpus, look
from images import DEBIAN
from node import CONTAINERD_CONFIG, ENGINES, HOST_ROOT, node_install, node_tree, start_node


@pytest.fixture(scope="module")
def bare_node(machine_untouched, fixtures_root, node_inputs):
    """A node with containerd and the images, without the suite's own nvhook install."""
    n = start_node(fixtures_root / "host-gpu8", node_inputs, install=False)
    try:
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
    assert f"nvhook for the node's Python {ENGINES[n.suite]['python3']} (/usr/bin/python3)" in r.stdout, r.stdout
    assert f"{CONTAINERD_CONFIG}: containerd: runtime nvidia" in r.stdout
    assert "created        /etc/cdi/nvhook.json: CDI spec" in r.stdout, r.stdout
    # every library in the spec (each is reopened through /proc/self/fd when checked, in the
    # node's /proc: the installer is in a child of the node's pid namespace, as a pod is)
    spec = json.loads(n.read("/etc/cdi/nvhook.json"))
    assert f"{HOST_ROOT}/usr/lib/x86_64-linux-gnu/libcuda.so.535.261.03" in \
        {m["hostPath"] for m in spec["containerEdits"]["mounts"]}, spec["containerEdits"]["mounts"]
    # nvidia-cdi-hook's copies: set-group-ID to the system group install made with the node's own
    # groupadd (no members), executable by others (user-namespaced containers run the hook)
    group = [g for g in n.run(["getent", "group", "nvhook-hook"]).stdout.splitlines()]
    assert len(group) == 1 and group[0].split(":")[3] == "", group
    for copy in ("python3", "sh"):
        st = n.path(f"/opt/nvhook/libexec/{copy}", follow=False).lstat()
        assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(0o2711), 0, int(group[0].split(":")[2]))
    again = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT,
                    "--device-list-strategy", "volume-mounts")
    # nothing to change; containerd still has not read the runtime (no --restart-engine), and install says so
    assert again.stdout.splitlines()[0] == "nvhook node install: nothing to change", again.stdout + again.stderr
    assert f"note           {CONTAINERD_CONFIG}: containerd has not read the runtime yet: restart it" in again.stdout
    handler = n.cri_runtimes()["runtimes"]["nvidia"]  # as the node's containerd reads its config
    assert handler["options"]["BinaryName"] == "/opt/nvhook/bin/nvhook-runtime", handler
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
    gid = group[0].split(":")[2]
    assert f"kept           /etc/group: group nvhook-hook (gid {gid}), on purpose" in r.stdout, r.stdout
    n.restart_containerd()
    assert n.path(CONTAINERD_CONFIG).read_bytes() == config_before
    # all as it was but the hook's group, never deleted (docs/security.md), its mark and the
    # files shadow-utils' groupadd writes with it
    kept = ("etc/group", "etc/gshadow", "etc/group-", "etc/gshadow-", "etc/.pwd.lock", "var/lib/nvhook",
            "var/lib/nvhook/hook-group")
    after = node_tree(root)
    assert {k: v for k, v in after.items() if k not in before and k not in kept} == {}
    assert {k: v for k, v in before.items() if after.get(k) != v and k not in kept} == {}
    assert n.run(["getent", "group", "nvhook-hook"]).stdout.strip() == group[0]
    assert not n.path("/run/nvhook").exists()


def test_an_installer_the_nodes_proc_does_not_show_is_refused(bare_node):
    """From the machine's pid namespace (the node's parent: as an admin reaching a kind node's
    root through /proc/PID/root) the node's /proc/self names no process, and the CDI spec would
    lose every library: one line, exit 1, nothing written."""
    n = bare_node
    before = node_tree(n.path("/"))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "nvhook"), "node", "install", "--host-root",
                        f"/proc/{n.init_pid}/root", "--runtime", "containerd", "--driver-root", HOST_ROOT],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")})
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"nvhook: the node's /proc (under --host-root /proc/{n.init_pid}/root) does not show this "
                        "process: run it in the node's pid namespace or one of its children (a pod; from the "
                        "machine: nsenter --target <a node process> --pid)\n")
    assert node_tree(n.path("/")) == before


def test_nri_on_the_node_without_systemd_installs_nothing(bare_node):
    """--nri on a node not booted with systemd (this one's init is the suite's): nothing there
    could run the plugin in the node's namespaces and restart it, so install refuses before
    writing anything (no half install: no /opt/nvhook, containerd's config untouched, containerd
    not signalled), one line, exit 1, no ready file (tests/node/test_nri_node_install.py: the
    same on a systemd node, where it installs)."""
    n = bare_node
    before = node_tree(n.path("/"))
    ready = n.dir / "ready-nri"
    pid = n.path("/run/containerd.pid").read_text().strip()
    r = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT, "--nri", "--restart-engine",
                     "--ready-file", str(ready))
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr == ("nvhook: --nri: the node was not booted with systemd (no /run/systemd/system), and the NRI "
                        "plugin runs as its systemd unit nvhook-nri.service; nothing installed: leave --nri out (the "
                        "runtime class), or run `/opt/nvhook/bin/nvhook nri` under the node's own init system "
                        "(docs/nri.md)\n")
    assert not ready.exists()
    assert node_tree(n.path("/")) == before
    assert n.path("/run/containerd.pid").read_text().strip() == pid
    assert n.run(["kill", "-0", pid], check=False).returncode == 0


def test_restart_engine_on_the_node_without_systemd(bare_node):
    """--restart-engine against the node's real containerd on a node not booted with systemd
    (this one: its init is the suite's, see node.py). install writes and registers everything,
    then says in one line that it cannot restart containerd, exits 1 and writes no ready file:
    the running containerd is left alone (same process, still serving pods) and, not having read
    its config, has no runtime `nvidia` yet. Once the node's own init restarts it (here the
    suite, as OpenRC or runit would), a GPU pod runs with the handler; a plain install then
    finds nothing to change. uninstall --restart-engine puts the config back and fails the same
    way."""
    n = bare_node
    ready = n.dir / "ready"
    pid = n.path("/run/containerd.pid").read_text().strip()
    r = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT, "--restart-engine",
                "--ready-file", str(ready))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr == ("nvhook: --restart-engine: cannot restart containerd: the node was not booted with systemd "
                        "(no /run/systemd/system); restart containerd with the node's own init system, and leave "
                        "--restart-engine out on such nodes\n")
    assert f"updated        {CONTAINERD_CONFIG}: containerd: runtime nvidia" in r.stdout, r.stdout
    assert "not restarted  containerd: --restart-engine: cannot restart containerd" in r.stdout, r.stdout
    assert not ready.exists()
    assert n.path("/run/containerd.pid").read_text().strip() == pid
    assert n.run(["kill", "-0", pid], check=False).returncode == 0  # not signalled
    k = n.kubelet
    try:
        with pytest.raises(CRIError, match="no runtime for \"nvidia\" is configured"):
            k.run_pod("not-yet-read", runtime_handler="nvidia")
        k.remove_all()
        n.restart_containerd()  # the node's own init system's restart
        again = node_install(n, "install", "--runtime", "containerd", "--driver-root", HOST_ROOT)
        assert again.returncode == 0 and again.stdout.splitlines()[0] == "nvhook node install: nothing to change", \
            again.stdout + again.stderr
        gpu = GPUS[5]
        pod = k.run_pod("restarted-gpu", runtime_handler="nvidia")
        cid = k.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_VISIBLE_DEVICES": gpu.uuid,
                                                         "NVIDIA_DRIVER_CAPABILITIES": CAPS})
        assert_gpus(look(k, cid), [gpu])
    finally:
        k.remove_all()
    r = node_install(n, "uninstall", "--restart-engine")
    assert r.returncode == 1 and "cannot restart containerd" in r.stderr, r.stdout + r.stderr
    assert f"restored       {CONTAINERD_CONFIG}: as before install" in r.stdout, r.stdout
    n.restart_containerd()
    assert not n.path("/opt/nvhook").exists() and not n.path("/etc/nvhook").exists()
