"""decide.plan's per-kind rules on inventories built as data (tests/decide/invfix.py): no host,
no I/O, each case named for what it proves."""

from __future__ import annotations

import pytest
from invfix import CONFIG, DEBIAN, HOST_DECISION, RHEL, gpu, inventory, request
from waiting import cpu_seconds

from nvhook.base import catalog
from nvhook.base.errors import HookError
from nvhook.decide import plan

C = {"id": "c", "pid": None, "rootfs": "/r"}


def build(req, inv, image=DEBIAN, decision=HOST_DECISION):
    selected, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
    return plan.build(C, req, inv, image, CONFIG, decision, selected, migs)


def targets(p, kind):
    return [m["target"] for m in p["mounts"] if m["kind"] == kind]


CASES = [
    # (name, request kwargs, inventory kwargs, check)
    ("utility_brings_nvml_and_smi_not_libcuda", {"capabilities": ["utility"]}, {},
     lambda p: "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.261.03" in targets(p, "library")
     and not any("libcuda" in t for t in targets(p, "library")) and "/usr/bin/nvidia-smi" in targets(p, "binary")),
    ("compute_brings_uvm_nodes", {"capabilities": ["compute"]}, {},
     lambda p: {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= set(targets(p, "device"))),
    ("modeset_only_with_display", {"capabilities": ["compute", "utility"]}, {},
     lambda p: "/dev/nvidia-modeset" not in targets(p, "device")),
    ("display_brings_modeset_and_graphics", {"capabilities": ["display"]}, {},
     lambda p: "/dev/nvidia-modeset" in targets(p, "device")
     and any("libGLX_nvidia" in t for t in targets(p, "library"))),
    ("video_implies_compute_libraries", {"capabilities": ["video"]}, {},
     lambda p: any("libcuda.so" in t for t in targets(p, "library"))),
    ("control_node_always", {"capabilities": ["graphics"]}, {},
     lambda p: "/dev/nvidiactl" in targets(p, "device")),
    ("only_the_selected_gpu_node", {"devices": ["1"]}, {"gpus": 4},
     lambda p: [t for t in targets(p, "device") if t[-1].isdigit()] == ["/dev/nvidia1"]),
    ("none_means_driver_without_gpu", {"kind": "none", "devices": []}, {},
     lambda p: p["gpus"] == [] and "/dev/nvidiactl" in targets(p, "device")
     and not any(t[-1].isdigit() for t in targets(p, "device"))),
    ("compat32_mounts_i386_libraries", {"capabilities": ["compute", "compat32"]}, {"libs32": True},
     lambda p: any(t.startswith("/usr/lib/i386-linux-gnu/") for t in targets(p, "library32"))),
    ("no_compat32_no_i386_libraries", {"capabilities": ["compute"]}, {"libs32": True},
     lambda p: targets(p, "library32") == []),
    ("imex_all_brings_every_channel", {"imex": ["all"]}, {"imex": 3},
     lambda p: [t for t in targets(p, "device") if "imex" in t]
     == [f"/dev/nvidia-caps-imex-channels/channel{n}" for n in range(3)]),
    ("one_cgroup_rule_per_device_number", {"devices": ["0", "1"]}, {"gpus": 2},
     lambda p: len(p["devices_cgroup"]) == len({(r["major"], r["minor"]) for r in p["devices_cgroup"]})
     == len(targets(p, "device"))),
    ("params_copy_rewrites_modify_device_files", {}, {},
     lambda p: any(m["target"] == "/proc/driver/nvidia/params" and "set:ModifyDeviceFiles=0" in m["options"]
                   for m in p["mounts"])),
    ("procfs_dir_only_for_selected_gpus", {"devices": ["1"]}, {"gpus": 3},
     lambda p: [t for t in targets(p, "procfs") if "/gpus/" in t] == ["/proc/driver/nvidia/gpus/0000:08:00.0"]),
    ("no_procfs_files_no_tmpfs", {}, {"procfs": ()}, lambda p: targets(p, "tmpfs") == []),
    ("ld_cache_covers_the_library_directory", {}, {},
     lambda p: p["ldconfig"]["directories"] == ["/usr/lib/x86_64-linux-gnu"]),
    ("dev_link_libcuda_so_points_to_soname", {}, {},
     lambda p: {"path": "/usr/lib/x86_64-linux-gnu/libcuda.so", "target": "libcuda.so.1"} in p["symlinks"]),
]


@pytest.mark.parametrize("name,req,inv,check", CASES, ids=[c[0] for c in CASES])
def test_rule(name, req, inv, check):
    p = build(request(**req), inventory(**inv))
    assert check(p), name


def test_rhel_family_uses_lib64():
    p = build(request(), inventory(), image=RHEL)
    assert all(t.startswith("/usr/lib64/") for t in targets(p, "library") if t not in catalog.CONFIGS)


def test_unknown_imex_channel_is_refused():
    with pytest.raises(HookError, match="unknown IMEX channel '7'"):
        build(request(imex=["7"]), inventory(imex=2))


def test_mig_device_brings_its_two_capability_nodes_and_files():
    g = gpu(0, migs=[(1, 0)])
    inv = inventory([g], mig_caps={"gpu0/gi1/access": 12, "gpu0/gi1/ci0/access": 13})
    p = build(request(devices=["MIG-0-1-0"]), inv)
    assert {"/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13", "/dev/nvidia0"} <= set(targets(p, "device"))
    assert "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access" in targets(p, "procfs")


def test_mig_device_without_its_capability_node_is_refused():
    g = gpu(0, migs=[(1, 0)])
    with pytest.raises(HookError, match="no /dev/nvidia-caps node for gpu0/gi1/access"):
        build(request(devices=["MIG-0-1-0"]), inventory([g]))


def test_a_rule_runs_in_well_under_a_millisecond():
    inv = inventory(8)
    req = request(devices=["all"])
    with cpu_seconds() as took:
        for _ in range(100):
            build(req, inv)
    assert took.seconds / 100 < 0.001, f"{took.seconds * 10:.2f} ms of CPU per plan"
