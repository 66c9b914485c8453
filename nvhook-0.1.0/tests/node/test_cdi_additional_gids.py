"""additionalGids (CDI 0.7.0) read by a real engine: podman 5.4 of the Debian 13 node (CDI
library 0.8) runs a container as user 1000 with nvhook's spec for a host whose /dev/nvidia0 is
0660 root:video (gid 44). The spec (made in the node by its installed nvhook, cdiVersion 0.7.0:
no engine under that host root reads less) gives device 0 the group; podman puts it into the
process's groups, and the user opens the node (ENXIO: allowed, no driver behind it). The same
spec with the group taken out gives EACCES: the group is what does it.

podman reads only this test's spec directory (bind-mounted on /etc/cdi in a private mount
namespace inside the node), its state is under the node's /tmp, and it runs the node's runc
(through a copy of the config.json it hands runc) with cgroupfs.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import make_fixtures as mf  # noqa: E402
from node import HOST_ROOT, NVHOOK, NVHOOK_CONFIG  # noqa: E402

BASE = "/tmp/nvhook-gids"
SCRIPT = 'echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; echo "GROUPS:$(id -G)"'


def _podman(node, script: str, user: str = "1000:1000"):
    cmd = ["podman", "--root", f"{BASE}/storage", "--runroot", f"{BASE}/run", "--tmpdir", f"{BASE}/libpod",
           "--runtime", f"{BASE}/rt/runc", "--runtime-flag", f"root={BASE}/runc", "--cgroup-manager", "cgroupfs",
           "--events-backend", "none", "run", "--rm", "--network", "none",
           "--user", user, "--device", "nvidia.com/gpu=0", "--rootfs", f"{BASE}/rootfs", "/bin/sh", "-c", script]
    # podman reads only this test's spec: a private mount namespace in the node where the spec
    # directory is /etc/cdi and /var/run/cdi is empty (the node's own spec stays for containerd)
    pre = (f"mkdir -p {BASE}/empty && mount --bind {BASE}/cdi /etc/cdi && "
           f"{{ [ ! -d /var/run/cdi ] || mount --bind {BASE}/empty /var/run/cdi; }} && "
           "PODMAN_IGNORE_CGROUPSV1_WARNING=1 exec ")
    return node.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", pre + shlex.join(cmd)],
                    check=False, timeout=180)


def _line(out: str, key: str) -> str:
    (value,) = [ln[len(key):] for ln in out.splitlines() if ln.startswith(key)]
    return value


def test_podman5_non_root_container_opens_a_0660_node_through_additional_gids(node):
    node.sh(f"rm -rf {BASE} && mkdir -p {BASE}/cdi && cp -a {HOST_ROOT} {BASE}/host && "
            f"chmod 0660 {BASE}/host/dev/nvidia0 && chown 0:44 {BASE}/host/dev/nvidia0")
    # podman's runtime: runc, after a copy of the config.json podman hands it (what the test reads)
    node.write(f"{BASE}/rt/runc", "#!/bin/sh\nprev=\nfor a in \"$@\"; do\n"
               f"  if [ \"$prev\" = --bundle ]; then cp \"$a/config.json\" {BASE}/config.json; fi\n"
               "  prev=$a\ndone\nexec /usr/bin/runc \"$@\"\n", mode=0o755)
    mf.build_container("container-debian", node.path(BASE))
    node.sh(f"mv {BASE}/container-debian {BASE}/rootfs")
    p = node.run([NVHOOK, "--config", NVHOOK_CONFIG, "--root", f"{BASE}/host", "cdi", "generate",
                  "--output", f"{BASE}/cdi/nvhook.json"], check=False)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[-1].endswith("cdiVersion 0.7.0"), p.stderr
    spec = json.loads(node.read(f"{BASE}/cdi/nvhook.json"))
    dev0 = next(d for d in spec["devices"] if d["name"] == "0")
    assert dev0["containerEdits"]["additionalGids"] == [44]

    p = _podman(node, SCRIPT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _line(p.stdout, "OPEN0:") == "head: /dev/nvidia0: No such device or address", p.stdout
    assert "44" in _line(p.stdout, "GROUPS:").split()
    given = json.loads(node.read(f"{BASE}/config.json"))  # what podman handed runc
    assert 44 in given["process"]["user"]["additionalGids"]
    (dev,) = [d for d in given["linux"]["devices"] if d["path"] == "/dev/nvidia0"]
    assert (dev["fileMode"], dev["gid"]) == (0o660, 44)

    # the control: the same spec without the group, the same user
    for d in spec["devices"]:
        d["containerEdits"].pop("additionalGids", None)
    node.write(f"{BASE}/cdi/nvhook.json", json.dumps(spec))
    p = _podman(node, SCRIPT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _line(p.stdout, "OPEN0:") == "head: /dev/nvidia0: Permission denied", p.stdout
    node.sh(f"rm -rf {BASE}", check=False)
