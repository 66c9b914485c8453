"""Each GPU's DRM nodes (/dev/dri/cardN, renderDN) and their by-path links, found through the
GPU's PCI device in sysfs under the host root (observe.host.inventory.gpu_drm), and the loader
configuration files (OpenCL ICD, OptiX, X server) the catalog adds."""

from __future__ import annotations

import os
from pathlib import Path

from hostfix import copy_host, fx, mf, named, spec  # noqa: F401

from nvhook.base.log import EventLog
from nvhook.observe import host


def observe(root: Path, capabilities=None) -> tuple[dict, EventLog]:
    log = EventLog("debug")
    return host.observe(str(root), "", log, capabilities=capabilities), log


def drm(inv: dict) -> dict[int, list[tuple[str, int, int, str | None]]]:
    return {g["index"]: [(d["path"], d["major"], d["minor"], d.get("by_path")) for d in g["drm"]]
            for g in inv["gpus"]}


def test_each_gpu_gets_its_own_nodes_by_pci_address(fx):
    inv, log = observe(fx / "host-gpu8")
    got = drm(inv)
    for g in spec("host-gpu8").gpus:
        want = []
        for name, minor in mf.drm_nodes(spec("host-gpu8"), g):
            kind = "card" if name.startswith("card") else "render"
            want.append((f"/dev/dri/{name}", 226, minor, f"/dev/dri/by-path/pci-{g.bus_id}-{kind}"))
        assert got[g.index] == want
    everyone = [n for nodes in got.values() for n in nodes]
    assert "/dev/dri/card0" not in {n[0] for n in everyone}  # the BMC's VGA: no NVIDIA GPU's
    assert not named(log.events, "device.unexpected") and not named(log.events, "gpu.drm_missing")


def test_minors_that_differ_from_indices_do_not_matter(fx):
    # host-mixed-450: GPU 0 (bus 3b) has minor 1; its DRM nodes follow its PCI address
    inv, _ = observe(fx / "host-mixed-450")
    assert [n[0] for n in drm(inv)[0]] == ["/dev/dri/card1", "/dev/dri/renderD128"]
    assert [n[0] for n in drm(inv)[1]] == ["/dev/dri/card2", "/dev/dri/renderD129"]


def test_host_without_udev_has_nodes_but_no_by_path_links(fx):
    inv, _ = observe(fx / "host-debian")
    assert [n[3] for nodes in drm(inv).values() for n in nodes] == [None] * 4
    assert drm(inv)[1][0][:3] == ("/dev/dri/card2", 226, 2)


def test_not_read_for_a_container_without_graphics(fx):
    inv, _ = observe(fx / "host-gpu8", capabilities=["compute", "utility"])
    assert all("drm" not in g for g in inv["gpus"])
    inv, _ = observe(fx / "host-gpu8", capabilities=["graphics", "compute", "utility"])
    assert all(len(g["drm"]) == 2 for g in inv["gpus"])


def test_node_whose_number_is_not_the_one_sysfs_lists_is_never_given(fx, tmp_path):
    """Two GPUs' card nodes swapped (or a node made by hand): /dev/dri/card1 would open the
    second GPU. Neither is handed out under the wrong GPU; each is reported."""
    root = copy_host(fx, "host-debian", tmp_path)
    for name, minor in (("card1", 2), ("card2", 1)):
        (root / f"dev/dri/{name}").unlink()
        os.mknod(root / f"dev/dri/{name}", 0o020660, os.makedev(226, minor))
    inv, log = observe(root)
    assert [n[0] for n in drm(inv)[0]] == ["/dev/dri/renderD128"]
    assert [n[0] for n in drm(inv)[1]] == ["/dev/dri/renderD129"]
    ev = {e["device"]: e for e in named(log.events, "device.unexpected")}
    assert ev["/dev/dri/card1"]["found"] == "226:2" and ev["/dev/dri/card1"]["want"] == "226:1"
    assert ev["/dev/dri/card1"]["level"] == "warning" and ev["/dev/dri/card1"]["gpu"] == 0


def test_by_path_link_to_another_gpus_node_is_not_copied(fx, tmp_path):
    root = copy_host(fx, "host-gpu8", tmp_path)
    bus0 = spec("host-gpu8").gpus[0].bus_id
    link = root / f"dev/dri/by-path/pci-{bus0}-card"
    link.unlink()
    link.symlink_to("../card2")  # GPU 1's node under GPU 0's address
    inv, _ = observe(root)
    assert drm(inv)[0][0] == ("/dev/dri/card1", 226, 1, None)
    assert drm(inv)[0][1][3] == f"/dev/dri/by-path/pci-{bus0}-render"


def test_crafted_names_in_sysfs_become_no_paths(fx, tmp_path):
    """Only card<N> and renderD<N> entries name nodes; anything else there (an old kernel's
    controlD64, a name that climbs out of /dev/dri) is ignored."""
    root = copy_host(fx, "host-gpu1", tmp_path)
    bus = spec("host-gpu1").gpus[0].bus_id
    sysdrm = root / "sys/devices/pci0000:00" / bus / "drm"
    for name in ("controlD64", "card1..", "renderD", "card-1"):
        (sysdrm / name).mkdir()
        (sysdrm / name / "dev").write_text("226:64\n")
    inv, _ = observe(root)
    assert [n[0] for n in drm(inv)[0]] == ["/dev/dri/card1", "/dev/dri/renderD128"]


def test_gpu_without_drm_directory_is_quiet(fx, tmp_path):
    """nvidia-drm not loaded (most compute hosts): no nodes, a debug event, no warning."""
    root = copy_host(fx, "host-gpu1", tmp_path)
    bus = spec("host-gpu1").gpus[0].bus_id
    for entry in (root / "sys/devices/pci0000:00" / bus / "drm").iterdir():
        (entry / "dev").unlink()
        entry.rmdir()
    (root / "sys/devices/pci0000:00" / bus / "drm").rmdir()
    inv, log = observe(root)
    assert inv["gpus"][0]["drm"] == []
    ev = named(log.events, "gpu.drm_missing")
    assert len(ev) == 1 and ev[0]["level"] == "debug" and ev[0]["bus_id"] == bus


def test_loader_configs_carry_their_capability(fx):
    inv, _ = observe(fx / "host-gpu8")
    caps = {c["path"]: c["cap"] for c in inv["files"]["configs"]}
    assert caps["/etc/OpenCL/vendors/nvidia.icd"] == "compute"
    assert caps["/usr/share/nvidia/nvoptix.bin"] == "graphics"
    assert caps["/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"] == "display"
    assert caps["/usr/share/vulkan/icd.d/nvidia_icd.json"] == "graphics"
