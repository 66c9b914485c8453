"""Graphics in real containers: each GPU's own DRM nodes (/dev/dri/cardN, renderDN) with the
fixture host's numbers, udev's /dev/dri/by-path links for them, and the loader files (OpenCL
ICD, OptiX), through nvhook's CDI spec applied by podman 4.3.1 and through hook mode under
runc; the same view both ways. And the attack: a /dev/dri/by-path planted in the container's
/dev as a link to a host directory must not get nvhook's links written through it.

Opening a node tells the device cgroup's answer without a GPU: ENXIO = allowed, no driver
behind it; EPERM = denied.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdibox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

HOST = "host-gpu8"
SPEC = mf.HOSTS[HOST]
GPU1 = SPEC.gpus[1]
ENXIO = "No such device or address"
# What the container sees: its DRM nodes with their numbers, the by-path links, the loader files.
VIEW = r"""
for d in /dev/dri/*; do [ -c "$d" ] && echo "DRI $d $(stat -c '%t:%T' "$d")"; done
for l in /dev/dri/by-path/*; do [ -L "$l" ] && echo "BYPATH $l $(readlink "$l") $(readlink -f "$l")"; done
echo "ICD:$(cat /etc/OpenCL/vendors/nvidia.icd)"
echo "OPTIX:$(head -c 11 /usr/share/nvidia/nvoptix.bin)"
echo "OPEN:$(cat /dev/dri/renderD129 2>&1 | head -n 1)"
echo "OPENCARD:$(cat /dev/dri/card2 2>&1 | head -n 1)"
echo "DRIMODE:$(stat -c %a /dev/dri)"
"""


def view(out: str) -> tuple[dict, dict, dict]:
    nodes, links, other = {}, {}, {}
    for ln in out.splitlines():
        if ln.startswith("DRI "):
            _, path, num = ln.split(" ")
            ma, mi = num.split(":")
            nodes[path] = (int(ma, 16), int(mi, 16))
        elif ln.startswith("BYPATH "):
            _, path, content, resolved = ln.split(" ")
            links[path] = (content, resolved)
        elif ":" in ln:
            key, _, value = ln.partition(":")
            other[key] = value
    return nodes, links, other


def assert_gpu1_graphics(out: str) -> None:
    nodes, links, other = view(out)
    (card, card_minor), (render, render_minor) = mf.drm_nodes(SPEC, GPU1)
    assert nodes == {f"/dev/dri/{card}": (226, card_minor), f"/dev/dri/{render}": (226, render_minor)}, out
    assert links == {f"/dev/dri/by-path/pci-{GPU1.bus_id}-card": (f"../{card}", f"/dev/dri/{card}"),
                     f"/dev/dri/by-path/pci-{GPU1.bus_id}-render": (f"../{render}", f"/dev/dri/{render}")}, out
    assert other["ICD"] == "libnvidia-opencl.so.1"
    assert other["OPTIX"] == "nvoptix.bin"
    assert ENXIO in other["OPEN"] and ENXIO in other["OPENCARD"], out  # the cgroup lets them through
    assert other["DRIMODE"] == "755"  # what crun #1047 was about: others can reach the nodes


@pytest.mark.podman
@pytest.mark.skipif(cdibox.skip_reason() is not None, reason=cdibox.skip_reason() or "")
def test_cdi_spec_with_graphics_through_podman(tmp_path, fixtures_root):
    tmp_path.mkdir(exist_ok=True)
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                    cache_dir=tmp_path / "cache")
    podman = cdibox.CdiPodman(tmp_path)
    try:
        p = cdibox.generate(podman.spec_dir / "nvhook.json", config=config, host=fixtures_root / HOST,
                            extra=["--capabilities", "compute,utility,graphics"])
        assert p.returncode == 0, p.stderr
        rootfs = mf.build_container("container-debian", tmp_path / "images")
        r = podman.run(rootfs, VIEW, ["nvidia.com/gpu=1"])
        assert r.returncode == 0, r.stderr
        assert_gpu1_graphics(r.stdout)
        spec = podman.captured()  # what podman handed runc: GPU 1's DRM nodes and their rules
        dri = sorted((d["path"], d["major"], d["minor"]) for d in spec["linux"]["devices"]
                     if d["path"].startswith("/dev/dri/"))
        assert dri == [("/dev/dri/card2", 226, 2), ("/dev/dri/renderD129", 226, 129)]
        allowed = {(r["major"], r["minor"]) for r in spec["linux"]["resources"]["devices"] if r.get("allow")}
        assert {(226, 2), (226, 129)} <= allowed and (226, 1) not in allowed and (226, 0) not in allowed
        assert podman.leftovers() == []
    finally:
        podman.close()


def hook_mode_view(tmp_path: Path, fixtures_root: Path, capabilities: str) -> str:
    """VIEW of a container given GPU 1 with `capabilities` by nvhook in hook mode under runc."""
    r = rb.run_with_nvhook(tmp_path, host=fixtures_root / HOST, script=VIEW,
                           env={"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": capabilities})
    assert r.proc.returncode == 0, r.proc.stderr
    return r.stdout


NEEDS_NVHOOK = pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or "")


@pytest.mark.runc
@NEEDS_NVHOOK
def test_hook_mode_gives_the_same_graphics_view(tmp_path, fixtures_root):
    assert_gpu1_graphics(hook_mode_view(tmp_path, fixtures_root, "graphics,compute,utility"))


@pytest.mark.runc
@NEEDS_NVHOOK
def test_compute_container_gets_no_drm_node(tmp_path, fixtures_root):
    nodes, links, other = view(hook_mode_view(tmp_path, fixtures_root, "compute,utility"))
    assert nodes == {} and links == {}
    assert other["ICD"] == "libnvidia-opencl.so.1"  # the OpenCL ICD file comes with compute


# A prestart hook that runs before nvhook's and, in the container's mount namespace, plants
# <rootfs>/dev/dri/by-path as a link to a directory on the host (what a second container
# sharing this /dev, or a process racing the start, could do).
PLANT = r"""
pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p')
exec nsenter -t "$pid" -m sh -c 'mkdir -p "$1/dev/dri" && ln -s "$2" "$1/dev/dri/by-path"' sh "$ROOTFS" "$VICTIM"
"""


@pytest.mark.runc
@NEEDS_NVHOOK
def test_by_path_planted_as_a_link_to_the_host_writes_nothing_outside(tmp_path, fixtures_root):
    victim = tmp_path / "victim"
    victim.mkdir(parents=True)
    images = tmp_path / "images"
    rootfs = images / "container-debian"  # where run_with_nvhook builds the image
    hook = {"path": "/bin/sh", "args": ["sh", "-c", PLANT],
            "env": [f"ROOTFS={rootfs}", f"VICTIM={victim}", "PATH=/usr/bin:/bin:/usr/sbin:/sbin"], "timeout": 30}
    r = rb.run_with_nvhook(tmp_path, host=fixtures_root / HOST,
                           script=VIEW + "echo PLANTED:$(readlink /dev/dri/by-path)\n",
                           env={"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "graphics,compute,utility"},
                           hooks_before=[hook])
    assert list(victim.iterdir()) == [], "nvhook wrote through a planted link onto the host"
    assert r.proc.returncode == 0, r.proc.stderr
    _, _, other = view(r.stdout)
    assert other["PLANTED"] == str(victim), r.stdout  # the plant was there when nvhook ran
    # resolved inside the rootfs, the links landed under <rootfs><victim>
    inside = rootfs / str(victim).lstrip("/")
    assert sorted(p.name for p in inside.iterdir()) == [f"pci-{GPU1.bus_id}-card", f"pci-{GPU1.bus_id}-render"]
