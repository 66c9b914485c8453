"""MIG selection and management rules in the plan (libnvidia-container's select_devices,
select_mig_config_devices, select_mig_monitor_devices), on inventories as data. No I/O."""

from __future__ import annotations

import pytest
from invfix import CONFIG, DEBIAN, HOST_DECISION, gpu, inventory, request

from nvhook.base.errors import HookError
from nvhook.decide import plan

C = {"id": "c", "pid": None, "rootfs": "/r"}
CAPS = {"config": 1, "monitor": 2,
        "gpu0/gi1/access": 10, "gpu0/gi1/ci0/access": 11, "gpu0/gi2/access": 20, "gpu0/gi2/ci0/access": 21,
        "gpu1/gi1/access": 30, "gpu1/gi1/ci0/access": 31}
LIVE = ["gpu0/gi1", "gpu0/gi1/ci0", "gpu0/gi2", "gpu0/gi2/ci0", "gpu1/gi1", "gpu1/gi1/ci0"]


def host(capable: tuple[bool, ...] = (True, True, False)) -> dict:
    gs = [gpu(0, migs=[(1, 0), (2, 0)]), gpu(1, migs=[(1, 0)]), gpu(2)]
    for g, ok in zip(gs, capable):
        g["mig_mode"] = g["mig_mode"] if ok and g["migs"] else (False if ok else None)
    inv = inventory(gs, mig_caps=CAPS)
    inv["mig_instances"] = LIVE
    return inv


def build(req: dict, inv: dict, instances: list[str] = LIVE) -> dict:
    selected, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"], instances)
    return plan.build(C, req, inv, DEBIAN, CONFIG, HOST_DECISION, selected, migs)


def caps(p: dict) -> list[int]:
    return sorted(int(m["target"].rsplit("cap", 1)[1]) for m in p["mounts"]
                  if m["kind"] == "device" and "/nvidia-caps/" in m["target"])


def procfs(p: dict) -> list[str]:
    prefix = "/proc/driver/nvidia/capabilities/"
    return sorted(m["target"][len(prefix):] for m in p["mounts"] if m["target"].startswith(prefix))


CASES = [
    # (name, request kwargs, capable GPUs, expected cap minors, expected procfs files)
    ("all_brings_every_live_mig_device", {"devices": ["all"]}, (True, True, False),
     [10, 11, 20, 21, 30, 31], ["gpu0/mig/gi1/access", "gpu0/mig/gi1/ci0/access", "gpu0/mig/gi2/access",
                                "gpu0/mig/gi2/ci0/access", "gpu1/mig/gi1/access", "gpu1/mig/gi1/ci0/access"]),
    ("one_mig_device_brings_its_two_access_caps", {"devices": ["MIG-0-2-0"]}, (True, True, False),
     [20, 21], ["gpu0/mig/gi2/access", "gpu0/mig/gi2/ci0/access"]),
    ("a_whole_gpu_brings_no_mig_caps", {"devices": ["0"]}, (True, True, False), [], []),
    ("mig_config_grants_the_visible_capable_gpu_its_every_cap", {"devices": ["0"], "mig_config": True},
     (True, True, False), [1, 10, 11, 20, 21],
     ["gpu0/mig/gi1/access", "gpu0/mig/gi1/ci0/access", "gpu0/mig/gi2/access", "gpu0/mig/gi2/ci0/access",
      "mig/config"]),
    ("mig_monitor_grants_the_monitor_cap", {"devices": ["1"], "mig_monitor": True}, (True, True, False),
     [2, 30, 31], ["gpu1/mig/gi1/access", "gpu1/mig/gi1/ci0/access", "mig/monitor"]),
    ("mig_config_on_a_gpu_that_cannot_do_mig_grants_nothing", {"devices": ["2"], "mig_config": True},
     (True, True, False), [], []),
    ("mig_config_on_a_capable_gpu_with_mig_disabled_grants_the_config_cap", {"devices": ["2"], "mig_config": True},
     (True, True, True), [1], ["mig/config"]),
    ("mig_config_with_all_grants_every_capable_gpu", {"devices": ["all"], "mig_config": True}, (True, False, False),
     [1, 10, 11, 20, 21, 30, 31],
     ["gpu0/mig/gi1/access", "gpu0/mig/gi1/ci0/access", "gpu0/mig/gi2/access", "gpu0/mig/gi2/ci0/access",
      "gpu1/mig/gi1/access", "gpu1/mig/gi1/ci0/access", "mig/config"]),
]


@pytest.mark.parametrize("name,req,capable,want_caps,want_procfs", CASES, ids=[c[0] for c in CASES])
def test_mig_rule(name, req, capable, want_caps, want_procfs):
    p = build(request(**req), host(capable))
    assert caps(p) == want_caps, name
    assert procfs(p) == want_procfs, name
    rules = {(r["major"], r["minor"]) for r in p["devices_cgroup"]}
    assert {(241, n) for n in want_caps} <= rules


def test_mig_config_beside_a_specific_mig_device_is_refused():
    with pytest.raises(HookError, match="cannot be combined with specific MIG devices"):
        build(request(devices=["MIG-0-1-0"], mig_config=True), host())


def test_mig_config_copies_only_live_instances_procfs_files():
    """gpu0/gi2 was destroyed: its node stays (the driver keeps it), its procfs file is gone."""
    inv = host()
    inv["mig_instances"] = ["gpu0/gi1", "gpu0/gi1/ci0"]
    p = build(request(devices=["0"], mig_config=True), inv, inv["mig_instances"])
    assert caps(p) == [1, 10, 11, 20, 21]
    assert procfs(p) == ["gpu0/mig/gi1/access", "gpu0/mig/gi1/ci0/access", "mig/config"]


def test_instances_without_a_compute_instance_are_no_mig_device():
    inv = host()
    instances = ["gpu0/gi1", "gpu9/gi1/ci0", "gpux/gi1/ci0"]
    selected, migs = plan.select(request(devices=["all"]), inv["gpus"], {}, instances)
    assert migs == [] and len(selected) == 3
