"""The application profile decision (decide/appprofile.py): which nodes are GPUs, the file's
content as NVIDIA 1.20's hook writes it, and when nvhook's own doors want it; then the plan that
hook mode and nvhook's CDI hook apply (pipeline.decide -> plan.build) on the fixture hosts."""

from __future__ import annotations

import json

import pytest
from hostfix import assert_schema, bundle, config_dict, fx, private_dir, spec  # noqa: F401

from nvhook.base.log import EventLog
from nvhook.decide import appprofile
from nvhook.start import pipeline

GPU8 = spec("host-gpu8").gpus
HEAD = '{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",'
TAIL = ']}],"rules":[{"pattern":[],"profile":"_container_"}]}'


@pytest.mark.parametrize("path,gpu", [
    ("/dev/nvidia0", True), ("/dev/nvidia12", True), ("/dev/nvidiactl", False), ("/dev/nvidia-uvm", False),
    ("/dev/nvidia-modeset", False), ("/dev/nvidia-caps/nvidia-cap1", False), ("/dev/nvidia", False),
    ("/dev/nvidia1a", False), ("/dev/nvidia\u0661", False), ("/dev/dri/nvidia0", False), ("/dev/nvidia0\n", False),
])
def test_which_nodes_are_gpus(path, gpu):
    assert appprofile.is_gpu_node(path) is gpu


def test_the_minor_counts_and_only_character_devices():
    nodes = [("/dev/nvidia0", True, 1), ("/dev/nvidia1", True, 0), ("/dev/nvidia2", False, 2),
             ("/dev/nvidiactl", True, 255), ("/dev/nvidia10", True, 10)]
    assert appprofile.gpu_minors(nodes) == [1, 0, 10]


@pytest.mark.parametrize("minors,mask,dropped", [
    ([0], "0x1", []), ([8], "0x100", []), ([0, 15], "0x8001", []), ([63], "0x8000000000000000", []),
    ([3, 3], "0x8", []), ([64, 2, -1], "0x4", [64, -1]),
])
def test_content_is_nvidias(minors, mask, dropped):
    text, left_out = appprofile.profile_text(minors)
    assert text == HEAD + mask + TAIL and left_out == dropped
    json.loads(text.replace(mask, str(int(mask, 16))))  # JSON once the driver's hex number is read


@pytest.mark.parametrize("minors", [[], [64], [70, 255]])
def test_no_bit_no_file(minors):
    assert appprofile.profile_text(minors) == (None, [m for m in minors])


@pytest.mark.parametrize("caps,wanted", [(["graphics"], True), (["display", "graphics"], True), (["display"], True),
                                         (["compute", "utility"], False), ([], False), (["video", "compute"], False)])
def test_own_doors_want_it_for_graphics_or_display(caps, wanted):
    text, _ = appprofile.for_container(caps, [("/dev/nvidia0", True, 0)])
    assert (text is not None) is wanted


@pytest.fixture
def decide(fx, tmp_path, tmp_path_factory):
    cfg = config_dict(private_dir(tmp_path_factory.mktemp("profilecache")))
    n = [0]

    def run(*env, host="host-gpu8"):
        n[0] += 1
        b = bundle(tmp_path / f"bundle{n[0]}", fx / "container-debian", env)
        state = {"id": f"c{n[0]}", "pid": None, "bundle": str(b), "annotations": {}}
        p = pipeline.decide(state, cfg, str(fx / host), EventLog("debug"), {})
        assert json.loads(json.dumps(p)) == p
        assert_schema(p)
        return p
    return run


def test_the_plan_carries_the_profile_of_the_selected_gpus_nodes(decide):
    p = decide("NVIDIA_VISIBLE_DEVICES=1,6", "NVIDIA_DRIVER_CAPABILITIES=graphics,utility")
    minors = sorted(m["node"]["minor"] for m in p["mounts"]
                    if m["kind"] == "device" and appprofile.is_gpu_node(m["target"]))
    assert minors == sorted([GPU8[1].minor, GPU8[6].minor])
    assert p["app_profile"] == appprofile.profile_text(minors)[0]


@pytest.mark.parametrize("env", [("NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"),
                                 ("NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_DRIVER_CAPABILITIES=graphics"),
                                 ("NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_DRIVER_CAPABILITIES=graphics")])
def test_no_profile_without_graphics_or_without_a_gpu(decide, env):
    assert "app_profile" not in decide(*env)
