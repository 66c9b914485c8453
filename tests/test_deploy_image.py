"""The DaemonSet's image, built from local files by deploy/image/build-oci.py, loaded with
podman (private storage) and run as kubelet runs daemonset.yaml's container: privileged, the
node's root bind-mounted at /host, its command and readiness probe taken from the manifest;
then stopped (SIGTERM, as when the DaemonSet is deleted), which must leave the node as it was.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_node_install import make_node, snapshot

yaml = pytest.importorskip("yaml")
REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.podman,  # runs the image in a podman container: a container test
              pytest.mark.skipif(any(shutil.which(t) is None for t in ("podman", "runc", "unshare", "ldd")),
                                 reason="needs podman, runc, unshare and ldd"),
              pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3")]


def test_image_installs_on_a_node_and_its_sigterm_uninstalls(tmp_path):
    image = tmp_path / "image.tar"
    subprocess.run([sys.executable, "-I", str(REPO / "deploy/image/build-oci.py"), str(image)], check=True,
                   capture_output=True, timeout=600)
    node = make_node(tmp_path / "node")
    before = snapshot(node)
    groups_before = (node / "etc/group").read_text().splitlines()
    ds = yaml.safe_load((REPO / "deploy/kubernetes/daemonset.yaml").read_text())
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    # the GPU Operator's driver layout of the node fixture; Docker registered (no engine restart here)
    command = [a for a in c["command"] if a not in ("--restart-engine", "--driver-root=/")]
    command += ["--driver-root=/run/nvidia/driver", "--runtime=docker"]
    probe = shlex.join(c["readinessProbe"]["exec"]["command"])
    s = tmp_path / "podman"
    runroot = tempfile.mkdtemp(prefix="nvhook-pm-")  # podman wants it short
    pm = (f"podman --root {s}/root --runroot {runroot} --tmpdir {s}/tmp --runtime runc --runtime-flag root={s}/runc "
          "--storage-driver vfs --cgroup-manager cgroupfs --events-backend none")
    script = f"""set -e
mount --bind /usr {node}/usr && mount -o remount,bind,ro {node}/usr
mount -t proc proc {node}/proc  # a node has its /proc: what install runs in its root reads /proc/self
{pm} load -i {image} >/dev/null
{pm} run -d --name nvhook-node --privileged --network none --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \\
    -v {node}:/host:rslave {c['image']} {shlex.join(command)} >/dev/null
ready=
for i in $(seq 1 120); do
    if {pm} exec nvhook-node {probe}; then ready=yes; break; fi
    sleep 1
done
echo "ready=$ready"
cp {node}/etc/docker/daemon.json {tmp_path}/daemon.json
{pm} stop -t 120 nvhook-node >/dev/null
{pm} logs nvhook-node
{pm} rm nvhook-node >/dev/null
"""
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                           text=True, timeout=600)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready=yes" in r.stdout, r.stdout + r.stderr
    assert '"path": "/opt/nvhook/bin/nvhook-runtime"' in (tmp_path / "daemon.json").read_text()
    assert "created        /etc/cdi/nvhook.json: CDI spec" in r.stdout
    assert "nvhook node install: SIGTERM: uninstalling" in r.stdout
    # everything back as it was but the hook's group, kept on purpose (docs/security.md: its gid
    # is never handed to another group), its mark, and shadow-utils' backups of the group files
    after = snapshot(node)
    kept = ("etc/group", "etc/gshadow", "etc/group-", "etc/gshadow-", "etc/.pwd.lock", "var/lib/nvhook",
            "var/lib/nvhook/hook-group")
    assert {k: v for k, v in after.items() if before.get(k) != v and k not in kept} == {}
    assert {k: v for k, v in before.items() if after.get(k) != v and k not in kept} == {}
    added = [ln for ln in (node / "etc/group").read_text().splitlines() if ln not in groups_before]
    assert [ln.split(":")[0] for ln in added] == ["nvhook-hook"], added
    assert (node / "var/lib/nvhook/hook-group").read_text().startswith("nvhook-hook ")
