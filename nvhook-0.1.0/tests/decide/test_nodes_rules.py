"""decide.nodes.missing: which device nodes the driver left to nvidia-modprobe that a request
needs, on inventories as data. No I/O."""

from __future__ import annotations

import pytest
from invfix import gpu, inventory, request

from nvhook.decide import nodes

MAJORS = {"nvidia-uvm": 235, "nvidia-caps": 241, "nvidia-caps-imex-channels": 242}
OWNER = (0o666, 0, 44)
CAPS = {"config": 1, "gpu0/gi1/access": 10, "gpu0/gi1/ci0/access": 11}


def inv_without(*paths: str, imex: int = 0) -> dict:
    inv = inventory([gpu(0, migs=[(1, 0)])], mig_caps=CAPS, imex=imex)
    inv["files"]["devices"] = [d for d in inv["files"]["devices"] if d["path"] not in paths]
    return inv


def want(req_kw: dict, inv: dict, majors: dict = MAJORS, caps=("utility", "compute"), migs=False, managed=False):
    req = request(**req_kw)
    g = inv["gpus"][0]
    selected_migs = [{"gpu": g, "mig": g["migs"][0]}] if migs else []
    out = nodes.missing(req, inv["files"], list(caps), selected_migs, [g] if managed else [], majors, OWNER,
                        {"gpu0/gi1/access": 0o444, "config": 0o400})
    return [(n["path"], n["major"], n["minor"], oct(n["mode"]), n["gid"]) for n in out]


CASES = [
    ("nothing_missing_nothing_to_create", {}, inv_without(), {}, []),
    ("missing_uvm_for_compute", {}, inv_without("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"), {},
     [("/dev/nvidia-uvm", 235, 0, "0o666", 44), ("/dev/nvidia-uvm-tools", 235, 1, "0o666", 44)]),
    ("missing_uvm_not_needed_without_compute", {}, inv_without("/dev/nvidia-uvm"), {"caps": ("utility",)}, []),
    ("video_implies_compute_so_uvm", {}, inv_without("/dev/nvidia-uvm"), {"caps": ("video",)},
     [("/dev/nvidia-uvm", 235, 0, "0o666", 44)]),
    ("uvm_module_not_loaded_creates_nothing", {}, inv_without("/dev/nvidia-uvm"), {"majors": {}}, []),
    ("missing_mig_access_caps_with_their_procfs_mode",
     {"devices": ["MIG-0-1-0"]}, inv_without("/dev/nvidia-caps/nvidia-cap10", "/dev/nvidia-caps/nvidia-cap11"),
     {"migs": True}, [("/dev/nvidia-caps/nvidia-cap10", 241, 10, "0o444", 0),
                      ("/dev/nvidia-caps/nvidia-cap11", 241, 11, "0o444", 0)]),
    ("missing_mig_config_cap_when_granted", {"mig_config": True}, inv_without("/dev/nvidia-caps/nvidia-cap1"),
     {"managed": True}, [("/dev/nvidia-caps/nvidia-cap1", 241, 1, "0o400", 0)]),
    ("missing_mig_config_cap_not_created_when_not_granted", {"mig_config": True},
     inv_without("/dev/nvidia-caps/nvidia-cap1"), {}, []),
    ("missing_imex_channel_requested", {"imex": ["3"]}, inv_without(imex=2), {},
     [("/dev/nvidia-caps-imex-channels/channel3", 242, 3, "0o666", 44)]),
    ("existing_imex_channel_not_recreated", {"imex": ["1"]}, inv_without(imex=2), {}, []),
    ("imex_all_creates_nothing", {"imex": ["all"]}, inv_without(), {}, []),
    ("imex_channel_beyond_the_driver_default_count_is_not_created", {"imex": ["2048"]}, inv_without(), {}, []),
    ("imex_module_not_loaded_creates_nothing", {"imex": ["3"]}, inv_without(), {"majors": {"nvidia-uvm": 235}}, []),
]


@pytest.mark.parametrize("name,req,inv,opts,expected", CASES, ids=[c[0] for c in CASES])
def test_missing_node_rule(name, req, inv, opts, expected):
    assert want(req, inv, **opts) == expected, name
