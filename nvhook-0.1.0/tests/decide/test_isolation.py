"""Issue 14, step 1: the two isolation bypasses and NVIDIA_VISIBLE_DEVICES=all on a MIG host.
Pure: requests from environments as data, plans from inventories as data (invfix)."""

from __future__ import annotations

import copy

from invfix import CONFIG, DEBIAN, HOST_DECISION, gpu, inventory

from nvhook.base import config
from nvhook.decide import plan, request

C = {"id": "c", "pid": None, "rootfs": "/r"}
VOLUME_ROOT = "/var/run/nvidia-container-devices"


def cfg(**devices: object) -> dict:
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"].update(devices)
    return c


SHARED_CLUSTER = cfg(accept_envvar_unprivileged=False, accept_volume_mounts=True)


def parse(env: dict, *, privileged: bool = False, mounts: list | None = None, c: dict = SHARED_CLUSTER) -> dict:
    return request.parse(env, privileged=privileged, mounts=mounts or [], config=c)


def volume(*names: str) -> list[dict]:
    return [{"destination": f"{VOLUME_ROOT}/{n}", "source": "/dev/null"} for n in names]


def test_legacy_cuda_version_image_is_an_env_request_the_policy_refuses():
    """Any image can add ENV CUDA_VERSION=1; under accept_envvar_unprivileged=false its implied
    `all` must be refused like NVIDIA_VISIBLE_DEVICES=all."""
    r = parse({"CUDA_VERSION": "11.8.0"})
    assert r["kind"] == "skip"
    assert "CUDA_VERSION" in r["reason"] and "accept_envvar_unprivileged" in r["reason"]


def test_legacy_image_still_gets_all_when_privileged_or_policy_allows():
    assert parse({"CUDA_VERSION": "11.8.0"}, privileged=True)["devices"] == ["all"]
    assert parse({"CUDA_VERSION": "11.8.0"}, c=cfg())["devices"] == ["all"]


def test_imex_channels_from_env_are_refused_with_the_env():
    """The GPU comes from the orchestrator's volume mounts; NVIDIA_IMEX_CHANNELS comes from the
    image and must not reach the channels that keep NVLink tenants apart."""
    r = parse({"NVIDIA_IMEX_CHANNELS": "all"}, mounts=volume("0"))
    assert r["kind"] == "devices" and r["devices"] == ["0"]
    assert r["imex"] == []
    r = parse({"NVIDIA_IMEX_CHANNELS": "3"}, mounts=volume("0"))
    assert r["imex"] == []


def test_imex_channels_from_volume_mounts_are_honoured_under_the_policy():
    r = parse({"NVIDIA_IMEX_CHANNELS": "7"}, mounts=volume("0", "imex/3"))
    assert r["devices"] == ["0"] and r["imex"] == ["3"]


def _mig_host() -> dict:
    inv = inventory([gpu(0, migs=[(1, 0), (2, 0)]), gpu(1)],
                    mig_caps={"gpu0/gi1/access": 10, "gpu0/gi1/ci0/access": 11,
                              "gpu0/gi2/access": 20, "gpu0/gi2/ci0/access": 21})
    return inv


INSTANCES = ["gpu0/gi1", "gpu0/gi1/ci0", "gpu0/gi2", "gpu0/gi2/ci0"]


def test_all_on_a_mig_host_selects_every_mig_device_with_its_access_caps():
    inv = _mig_host()
    req = parse({"NVIDIA_VISIBLE_DEVICES": "all"}, privileged=True)
    selected, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"], INSTANCES)
    assert [g["index"] for g in selected] == [0, 1]
    assert sorted((m["gpu"]["index"], m["mig"]["gi"], m["mig"]["ci"]) for m in migs) == [(0, 1, 0), (0, 2, 0)]
    p = plan.build(C, req, inv, DEBIAN, CONFIG, HOST_DECISION, selected, migs)
    nodes = [m["target"] for m in p["mounts"] if m["kind"] == "device"]
    assert {f"/dev/nvidia-caps/nvidia-cap{n}" for n in (10, 11, 20, 21)} <= set(nodes)
    assert {"/dev/nvidia0", "/dev/nvidia1"} <= set(nodes)
    procfs = [m["target"] for m in p["mounts"] if m["kind"] == "procfs"]
    assert "/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access" in procfs


def test_all_on_a_host_without_mig_instances_selects_gpus_only():
    inv = _mig_host()
    req = parse({"NVIDIA_VISIBLE_DEVICES": "all"}, privileged=True)
    selected, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"], [])
    assert len(selected) == 2 and migs == []
