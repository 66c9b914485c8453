"""`nvhook runtime configure --runtime containerd` on the config shapes real nodes have, on both
roots (containerd 1.7 and 2.1), each read back by the node's own `containerd config dump`, run
inside the node as `node install` runs it: the runtime there with the options written and the
default where asked, or, where that containerd cannot read the runtime in that file, the file
put back byte for byte with one line. The tricky shapes (no `version` line, 2.x's plugin id in a
version 2 file) also run a GPU pod through the handler on a config of that shape.

The shapes (issue 36, and ones found on the way): no file; an empty file; comments only;
`version = 2` only; `version = 3` only; Debian's packaged config of the root's suite; no
`version` with the CRI registry under its full id; no `version` with `[plugins.cri.containerd]`;
`version = 2` with 2.x's `io.containerd.cri.v1.runtime`; `version = 2` with CRI settings;
`version = 3` with CRI runtime settings; `version = 2` importing a site file. The pods: the
node's own config without a `version` line (1.7: short plugin ids; 2.1: its own ids in a
version 1 file) and, on 2.1, its version 3 layout under `version = 2`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cri import device_plugin
from gpuprobe import CAPS, GPUS, assert_gpus, look
from images import DEBIAN
from node import CONTAINERD_CONFIG, ENGINES, NVHOOK, NVHOOK_RUNTIME, Node, containerd_config

DIR = "/etc/containerd/shapes"
REGISTRY_V1 = '[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "/etc/containerd/certs.d"\n'
CRI_V1 = "[plugins.cri.containerd]\n  snapshotter = \"overlayfs\"\n"
V2_2X_IDS = ('version = 2\n[plugins."io.containerd.cri.v1.runtime".containerd]\n'
             '  default_runtime_name = "runc"\n')
V2_CRI = ('version = 2\n# site settings\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n'
          '  [plugins."io.containerd.grpc.v1.cri".containerd]\n    default_runtime_name = "runc"\n')
V3_CRI = ('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n  enable_cdi = true\n'
          '[plugins."io.containerd.cri.v1.runtime".containerd]\n  default_runtime_name = "runc"\n')
V2_IMPORTS = f'version = 2\nimports = ["{DIR}/site/site.toml"]\n'

SHAPES = {
    "absent": None, "empty": "", "comments-only": "# nothing here yet\n", "v2-only": "version = 2\n",
    "v3-only": "version = 3\n", "debian": "DEBIAN", "no-version-registry": REGISTRY_V1,
    "no-version-cri": CRI_V1, "v2-with-2x-ids": V2_2X_IDS, "v2-cri-settings": V2_CRI, "v3-cri-settings": V3_CRI,
    "v2-imports": V2_IMPORTS,
}
# What a containerd of each root cannot read as it is: nothing written, one line.
UNREADABLE = {"trixie": {"v3-only", "v3-cri-settings"}, "sid": set()}


def _text(node: Node, shape: str) -> str | None:
    text = SHAPES[shape]
    if text == "DEBIAN":  # the packaged file of the root's containerd, as apt installed it
        return (Path(node.lower) / "etc/containerd/config.toml").read_text()
    return text


def _configure(node: Node, shape: str, *args: str):
    path = f"{DIR}/{shape}/config.toml"
    node.run(["rm", "-rf", f"{DIR}/{shape}"])
    node.run(["mkdir", "-p", f"{DIR}/{shape}", f"{DIR}/site"])
    node.write(f"{DIR}/site/site.toml", "version = 2\n")
    text = _text(node, shape)
    if text is not None:
        node.write(path, text)
    r = node.run([NVHOOK, "runtime", "configure", "--runtime",
                  "containerd", "--config", path, "--runtime-path", NVHOOK_RUNTIME, "--runtime-name", "shaped",
                  "--record", f"/run/nvhook-test/shape-{shape}.json", *args], check=False)
    return path, text, r


@pytest.mark.parametrize("shape", list(SHAPES))
def test_containerd_reads_the_runtime_in_every_shape(node, shape):
    path, text, r = _configure(node, shape, "--set-as-default")
    if shape in UNREADABLE[node.suite]:
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stdout + r.stderr
        assert "cannot read" in r.stderr and "nothing written" in r.stderr
        assert node.read(path) == text
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "containerd: confirmed: containerd reads it as written" in r.stdout, r.stdout
    cri = node.cri_runtimes(node.containerd_dump(path))
    assert cri["runtimes"]["shaped"]["options"]["BinaryName"] == NVHOOK_RUNTIME
    assert cri["runtimes"]["shaped"]["runtime_type"] == "io.containerd.runc.v2"
    assert cri["default_runtime_name"] == "shaped"
    assert cri["runtimes"]["runc"]["runtime_type"] == "io.containerd.runc.v2"
    if text:
        for line in text.splitlines():
            if line.strip().startswith("#"):
                assert line in node.read(path)
    # a second run changes nothing; unconfigure puts the file back byte for byte
    again = node.run([NVHOOK, "runtime", "configure", "--runtime",
                      "containerd", "--config", path, "--runtime-path", NVHOOK_RUNTIME, "--runtime-name", "shaped",
                      "--set-as-default", "--record", f"/run/nvhook-test/shape-{shape}.json"])
    assert again.stdout.startswith("containerd: nothing to change: "), again.stdout
    back = node.run([NVHOOK, "runtime", "unconfigure", "--runtime",
                     "containerd", "--config", path, "--record", f"/run/nvhook-test/shape-{shape}.json"])
    assert back.returncode == 0, back.stdout
    if text is None:
        assert not node.path(path).exists()
    else:
        assert node.read(path) == text
    assert not node.path(f"{DIR}/{shape}/conf.d/99-nvhook.toml").exists()


def _servable(node: Node, shape: str) -> str | None:
    """The node's own containerd config (sockets, state, sandbox image, runc and crun) before
    nvhook, laid out in `shape`; None where that containerd cannot serve pods from it."""
    text = containerd_config(runc_binary="" if node.runc == "runc" else node.runc, suite=node.suite)
    if shape == "no-version" and node.suite == "trixie":
        # version 1: 1.7 reads plugins by their short ids
        return text.replace("version = 2\n", "").replace('"io.containerd.grpc.v1.cri"', "cri") \
            .replace('"io.containerd.nri.v1.nri"', "nri")
    if shape == "no-version":  # 2.1 reads its own plugin ids in a version 1 file
        return text.replace("version = 3\n", "")
    if shape == "v2-with-2x-ids" and node.suite == "sid":
        return text.replace("version = 3\n", "version = 2\n")
    return None  # 1.7 has no io.containerd.cri.v1.* plugins: no pod from that file


@pytest.mark.parametrize("shape", ["no-version", "v2-with-2x-ids"])
def test_gpu_pod_through_the_handler_in_a_tricky_shape(node, kubelet, shape):
    """The node's own config in the shape, configured by nvhook (confirmed by its containerd),
    and containerd restarted on it: a GPU pod through the handler gets its GPU."""
    text = _servable(node, shape)
    if text is None:
        pytest.skip(f"containerd {ENGINES[node.suite]['containerd']}x serves no pod from a {shape} config")
    own = node.read(CONTAINERD_CONFIG)
    try:
        node.write(CONTAINERD_CONFIG, text)
        r = node.run([NVHOOK, "runtime", "configure", "--runtime", "containerd", "--config", CONTAINERD_CONFIG,
                      "--runtime-path", NVHOOK_RUNTIME, "--runtime-name", "shaped", "--record",
                      f"/run/nvhook-test/pod-{shape}.json"], check=False)
        assert r.returncode == 0 and "containerd: confirmed:" in r.stdout, r.stdout + r.stderr
        node.restart_containerd()
        gpu = GPUS[6]
        pod = kubelet.run_pod(f"shape-{shape}", runtime_handler="shaped")
        cid = kubelet.run_container(pod, "cuda", DEBIAN, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS},
                                    gpu=device_plugin("envvar", [gpu.uuid]))
        assert_gpus(look(kubelet, cid), [gpu])
    finally:
        kubelet.remove_all()
        node.write(CONTAINERD_CONFIG, own)
        node.restart_containerd()
