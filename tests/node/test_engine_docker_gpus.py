"""`docker run --gpus` on the node's Docker (26 on trixie, 28.5 on sid): dockerd handles `--gpus`
only where a binary named nvidia-container-runtime-hook is on its PATH at start, and runs it as
the container's prestart hook with the request in NVIDIA_VISIBLE_DEVICES; nvhook's hook mode
takes exactly that, so a link to nvhook is all it needs (docs/docker.md). Without it dockerd
refuses `--gpus` with its own error: that is checked too, so the test can fail."""

from __future__ import annotations

from gpuprobe import GPUS, assert_gpus
from images import DEBIAN
from test_engine_docker import RUN, SMI, docker_look

HOOK_LINK = "/usr/local/bin/nvidia-container-runtime-hook"


def test_gpus_through_nvhook_as_dockers_hook(engines_node):
    n = engines_node
    p = n.docker(*RUN, "--gpus", "device=1", DEBIAN, "true", check=False)
    assert p.returncode != 0 and 'could not select device driver "" with capabilities: [[gpu]]' in p.stderr, \
        p.stdout + p.stderr
    n.run(["ln", "-s", "/opt/nvhook/bin/nvhook", HOOK_LINK])
    try:
        n.restart_dockerd()  # dockerd looks for the hook once, at start
        gpu = GPUS[1]
        v = docker_look(n, "--gpus", f"device={gpu.index}")
        assert_gpus(v, [gpu])
        assert v.one("SMI") == SMI, v.out
        both = [GPUS[3], GPUS[6]]
        v = docker_look(n, "--gpus", f'"device={both[0].uuid},{both[1].uuid}"')
        assert_gpus(v, both)
    finally:
        n.run(["rm", "-f", HOOK_LINK])
        n.restart_dockerd()
