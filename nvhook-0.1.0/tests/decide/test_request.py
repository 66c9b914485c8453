"""NVIDIA_* environment rules (reference section 2) -> request."""

import copy

import pytest

from nvhook.base import config
from nvhook.base.errors import HookError
from nvhook.decide import request


def cfg(**devices):
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"].update(devices)
    return c


def parse(env, privileged=False, mounts=(), **devices):
    return request.parse(env, privileged=privileged, mounts=list(mounts), config=cfg(**devices))


def test_unset_is_not_a_gpu_container():
    r = parse({"PATH": "/bin"})
    assert r["kind"] == "skip" and "not set" in r["reason"]


def test_legacy_cuda_image_gets_all_gpus_and_all_capabilities():
    r = parse({"CUDA_VERSION": "10.2.89"})
    assert r["kind"] == "devices" and r["devices"] == ["all"]
    assert set(r["capabilities"]) == set(request.CAPABILITIES)
    assert r["requirements"] == ["cuda>=10.2"] and r["requirement_sources"] == ["CUDA_VERSION"]


def test_cuda_image_with_require_is_not_legacy():
    r = parse({"CUDA_VERSION": "12.2.0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.2"})
    assert r["kind"] == "skip"


@pytest.mark.parametrize("value", ["", "void", " void ", ","])
def test_void_and_empty_do_nothing(value):
    assert parse({"NVIDIA_VISIBLE_DEVICES": value})["kind"] == "skip"


def test_none_means_driver_without_gpus():
    r = parse({"NVIDIA_VISIBLE_DEVICES": "none"})
    assert r["kind"] == "none" and r["devices"] == []
    assert r["capabilities"] == ["utility", "compute"]


def test_device_list_is_trimmed_and_deduplicated():
    r = parse({"NVIDIA_VISIBLE_DEVICES": " 0, GPU-abc ,0,MIG-x, 1:2 "})
    assert r["devices"] == ["0", "GPU-abc", "MIG-x", "1:2"]


@pytest.mark.parametrize("value", ["none,1", "0,none", "none,all"])
def test_none_does_not_mix_with_ids(value):
    with pytest.raises(HookError, match="cannot be combined"):
        parse({"NVIDIA_VISIBLE_DEVICES": value})


def test_all_with_ids_is_all_and_void_with_ids_is_nothing():
    """As NVIDIA's hook and libnvidia-container read them (tests/decide/test_request_rules.py)."""
    assert parse({"NVIDIA_VISIBLE_DEVICES": "0,all"})["devices"] == ["all"]
    assert parse({"NVIDIA_VISIBLE_DEVICES": "void,0"})["kind"] == "skip"


def test_capabilities_default_all_and_unknown():
    assert parse({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": ""})["capabilities"] == ["utility", "compute"]
    assert len(parse({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"})["capabilities"]) == 7
    assert parse({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "Video, utility"})["capabilities"] == ["video", "utility"]
    with pytest.raises(HookError, match="unknown capability 'gaming'"):
        parse({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,gaming"})


def test_volume_mounts_win_over_env_when_enabled():
    mounts = [{"destination": "/var/run/nvidia-container-devices/GPU-1", "source": "/dev/null"},
              {"destination": "/var/run/nvidia-container-devices/3", "source": "/dev/null"},
              {"destination": "/data", "source": "/srv"}]
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    r = parse(env, mounts=mounts, accept_volume_mounts=True)
    assert r["devices"] == ["GPU-1", "3"] and r["devices_source"] == "volume-mounts"
    assert parse(env, mounts=mounts)["devices"] == ["all"]  # switch off: env decides


def test_unprivileged_policy():
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    r = parse(env, accept_envvar_unprivileged=False)
    assert r["kind"] == "skip" and "unprivileged" in r["reason"]
    assert parse(env, privileged=True, accept_envvar_unprivileged=False)["devices"] == ["all"]


def test_requirements_collected_unless_disabled():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=11.0", "NVIDIA_REQUIRE_ARCH": "arch>=7.0"}
    assert parse(env)["requirements"] == ["arch>=7.0", "cuda>=11.0"]
    assert parse(dict(env, NVIDIA_DISABLE_REQUIRE="true"))["requirements"] == []


def test_mig_config_needs_privileges():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_CONFIG_DEVICES": "all"}
    with pytest.raises(HookError, match="not privileged"):
        parse(env)
    assert parse(env, privileged=True)["mig_config"] is True


def cdi(env, annotations, privileged=False, **devices):
    return request.parse(env, privileged=privileged, mounts=[], config=cfg(**devices),
                         annotations=annotations)


def test_cdi_annotations_name_nvidia_gpus_only():
    r = cdi({}, {"cdi.k8s.io/a": "nvidia.com/gpu=1, vendor.example/fpga=0",
                 "cdi.k8s.io/b": "nvidia.com/gpu=0,nvidia.com/gpu=1", "other.io/x": "nvidia.com/gpu=7"})
    assert r["kind"] == "devices" and r["devices"] == ["1", "0"] and r["devices_source"] == "cdi-annotations"
    assert cdi({}, {"cdi.k8s.io/a": "vendor.example/fpga=0"})["kind"] == "skip"
    assert cdi({}, {"cdi.k8s.io/a": "nvidia.com/gpu=all"})["devices"] == ["all"]


def test_cdi_annotations_win_over_the_image_env_and_its_policy():
    """Set by the orchestrator, not the image: an image's NVIDIA_VISIBLE_DEVICES=all does not
    widen them, and accept_envvar_unprivileged=false does not drop them."""
    r = cdi({"NVIDIA_VISIBLE_DEVICES": "all"}, {"cdi.k8s.io/a": "nvidia.com/gpu=0"},
            accept_envvar_unprivileged=False)
    assert r["kind"] == "devices" and r["devices"] == ["0"]


def test_cdi_annotations_beside_void_were_already_injected_by_the_runtime():
    assert cdi({"NVIDIA_VISIBLE_DEVICES": "void"}, {"cdi.k8s.io/a": "nvidia.com/gpu=0"})["kind"] == "skip"
