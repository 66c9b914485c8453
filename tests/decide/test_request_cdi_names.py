"""CDI device names in NVIDIA_VISIBLE_DEVICES (`nvidia.com/gpu=1`, what NVIDIA's runtime takes in
its cdi and jit-cdi modes): each name a CDI spec of this host carries - nvhook's own names, in
every naming strategy, which are NVIDIA's nvidia-ctk names too - selects the same GPUs and MIG
devices as that spec's device would. docs/request-rules.md, "CDI device names"."""

from __future__ import annotations

import copy

import pytest
from invfix import gpu, inventory

from nvhook.base import config
from nvhook.base.errors import HookError
from nvhook.decide import cdimodel, plan, request


def parse(value: str, var: str = "NVIDIA_VISIBLE_DEVICES", **req_cfg) -> dict:
    c = copy.deepcopy(config.DEFAULTS)
    c["request"].update(req_cfg)
    return request.parse({var: value}, privileged=False, mounts=[], config=c)


def chosen(req: dict, inv: dict) -> tuple[list[int], list[str]]:
    gpus, migs = plan.select(req, inv["gpus"], inv["files"]["mig_minors"])
    return [g["index"] for g in gpus], [m["mig"]["uuid"] for m in migs]


INV = inventory([gpu(0, migs=[(1, 0), (2, 0)]), gpu(1), gpu(2, migs=[(3, 1)])])
NAMES = [(name, token) for names, token in cdimodel.device_names(INV, cdimodel.STRATEGIES) for name in names]


@pytest.mark.parametrize("kind", request.CDI_GPU_KINDS)
@pytest.mark.parametrize("name, token", NAMES, ids=[n for n, _ in NAMES])
def test_every_spec_device_name_selects_what_the_spec_device_gives(kind, name, token):
    by_name = parse(f"{kind}={name}")
    by_token = parse(token)
    assert by_name["kind"] == "devices"
    assert chosen(by_name, INV) == chosen(by_token, INV)
    assert chosen(by_name, INV) != ([], [])


def test_a_comma_list_mixes_names_indexes_and_uuids():
    r = parse("nvidia.com/gpu=1, 2 ,nvidia.com/gpu=mig0:1,GPU-00000001,nvidia.com/gpu=MIG-2-3-1")
    assert chosen(r, INV) == ([1, 2], ["MIG-0-2-0", "MIG-2-3-1"])
    assert parse("0,nvidia.com/gpu=all")["devices"] == ["all"]


def test_the_swarm_resource_variable_takes_names_too():
    r = parse("nvidia.com/gpu=gpu2", var="DOCKER_RESOURCE_GPU", swarm_resource="DOCKER_RESOURCE_GPU")
    assert chosen(r, INV) == ([2], [])


@pytest.mark.parametrize("value, named", [
    ("amd.com/gpu=0", "'amd.com/gpu=0'"),
    ("nvidia.com/nic=0", "'nvidia.com/nic=0'"),
    ("0,management.nvidia.com/gpu=all", "'management.nvidia.com/gpu=all'"),
    ("=0", "'=0'"),
])
def test_an_unknown_vendor_or_class_is_one_line_naming_the_variable(value, named):
    with pytest.raises(HookError) as e:
        parse(value)
    msg = str(e.value)
    assert msg.startswith(f"NVIDIA_VISIBLE_DEVICES: {named} is not a CDI device nvhook serves")
    assert "nvidia.com/gpu=<index|UUID|all>" in msg and "\n" not in msg


@pytest.mark.parametrize("value", ["nvidia.com/gpu=", "nvidia.com/gpu=none", "nvidia.com/gpu=void"])
def test_a_cdi_name_without_a_device_is_refused(value):
    with pytest.raises(HookError, match=r"^NVIDIA_VISIBLE_DEVICES: .* names no device"):
        parse(value)


def test_void_beside_a_bad_name_still_means_nothing():
    """A container that asked for nothing starts, whatever else the list holds."""
    assert parse("void,amd.com/gpu=0")["kind"] == "skip"


def test_an_unknown_device_by_name_is_the_plan_s_unknown_device():
    with pytest.raises(HookError, match="unknown device '7'"):
        chosen(parse("nvidia.com/gpu=7"), INV)
    with pytest.raises(HookError, match="unknown MIG device '1:5'"):
        chosen(parse("nvidia.com/gpu=1:5"), INV)


def test_names_are_case_sensitive_as_cdi_has_them():
    with pytest.raises(HookError, match="is not a CDI device"):
        parse("NVIDIA.com/gpu=0")


def test_a_name_from_an_unprivileged_image_obeys_the_policy():
    """A hostile image cannot get around devices.accept_envvar_unprivileged by naming a CDI
    device instead of an index: the name is the image's request like any other."""
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"]["accept_envvar_unprivileged"] = False
    r = request.parse({"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=all"}, privileged=False, mounts=[], config=c)
    assert r["kind"] == "skip" and "accept_envvar_unprivileged" in r["reason"]
    r = request.parse({"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=0"}, privileged=True, mounts=[], config=c)
    assert r["devices"] == ["0"]


def test_a_huge_name_is_refused_by_the_list_bounds_not_echoed():
    with pytest.raises(HookError, match="is 70017 characters long") as e:
        parse("nvidia.com/gpu=" + "9" * 70002)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("entry, want", [("cdi/nvidia.com/gpu/1", ([1], [])), ("cdi/nvidia.com/gpu=gpu2", ([2], [])),
                                         ("cdi/nvidia.com/gpu/MIG-0-2-0", ([], ["MIG-0-2-0"]))])
def test_the_device_plugin_s_cdi_volume_mounts(entry, want):
    """`/var/run/nvidia-container-devices/cdi/<vendor>/<class>/<device>` (or `...=<device>`)."""
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"]["accept_volume_mounts"] = True
    mounts = [{"destination": f"/var/run/nvidia-container-devices/{entry}", "source": "/dev/null"}]
    r = request.parse({"NVIDIA_VISIBLE_DEVICES": "all"}, privileged=False, mounts=mounts, config=c)
    assert r["devices_source"] == "volume-mounts" and chosen(r, INV) == want


def test_a_cdi_volume_mount_of_another_vendor_is_one_line():
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"]["accept_volume_mounts"] = True
    mounts = [{"destination": "/var/run/nvidia-container-devices/cdi/amd.com/gpu/0", "source": "/dev/null"}]
    with pytest.raises(HookError, match=r"^volume-mounts: 'amd.com/gpu=0' is not a CDI device nvhook serves"):
        request.parse({}, privileged=False, mounts=mounts, config=c)


def test_cdi_annotations_take_the_type_index_names_too():
    c = copy.deepcopy(config.DEFAULTS)
    r = request.parse({}, privileged=False, mounts=[], config=c,
                      annotations={"cdi.k8s.io/devices": "nvidia.com/gpu=gpu2,nvidia.com/gpu=mig0:1"})
    assert r["devices_source"] == "cdi-annotations" and chosen(r, INV) == ([2], ["MIG-0-2-0"])
