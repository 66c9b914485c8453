"""CDI device names from a hostile image (docs/request-rules.md, "CDI device names"): digits
that are not ASCII, signs, padding and names built to alias another device select nothing (one
line naming the variable and the device), never a GPU they do not name; a MIG name brings that
MIG device's nodes and its GPU's, never another GPU's; an unprivileged image's name obeys
devices.accept_envvar_unprivileged whatever its spelling; escape sequences never reach the
message. Requests as data, plans as data: no I/O."""

from __future__ import annotations

import copy

import pytest
from invfix import CONFIG, DEBIAN, HOST_DECISION
from test_mig_rules import LIVE, build, caps, host

from nvhook.base import config
from nvhook.base.errors import HookError, short
from nvhook.decide import plan, request


def parse(env: dict, *, privileged: bool = True, accept: bool = True, **kw) -> dict:
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"]["accept_envvar_unprivileged"] = accept
    return request.parse(env, privileged=privileged, mounts=kw.pop("mounts", []), config=c, **kw)


def nodes(p: dict) -> list[str]:
    return sorted(m["target"] for m in p["mounts"] if m["kind"] == "device" and "/nvidia-caps/" not in m["target"]
                  and m["target"][len("/dev/nvidia"):].isdigit())


@pytest.mark.parametrize("name", [
    "nvidia.com/gpu=\uff10",  # fullwidth 0: int() reads it as 0
    "nvidia.com/gpu=\u0660",  # Arabic-Indic 0
    "nvidia.com/gpu=gpu\u0660", "nvidia.com/gpu=mig\u0660:0",
    "nvidia.com/gpu=-1",  # Python's last item
    "nvidia.com/gpu=+0", "nvidia.com/gpu=00", "nvidia.com/gpu=0_0", "nvidia.com/gpu=0x0",
    "nvidia.com/gpu=gpu00", "nvidia.com/gpu=gpu0:0", "nvidia.com/gpu=mig00:0", "nvidia.com/gpu=mig0:0:0",
    "nvidia.com/gpu=0=0", "nvidia.com/gpu=gpu", "nvidia.com/gpu=mig", "nvidia.com/gpu=\u00b2",
])
def test_a_name_that_only_looks_like_a_device_selects_nothing(name):
    inv = host()
    r = parse({"NVIDIA_VISIBLE_DEVICES": name})
    with pytest.raises(HookError, match=r"unknown (MIG )?device") as e:
        plan.select(r, inv["gpus"], inv["files"]["mig_minors"], LIVE)
    assert str(e.value).isprintable()


@pytest.mark.parametrize("name, want_nodes, want_caps", [
    ("nvidia.com/gpu=mig1:0", ["/dev/nvidia1"], [30, 31]),
    ("runtime.nvidia.com/gpu=mig0:1", ["/dev/nvidia0"], [20, 21]),
    ("nvidia.com/gpu=MIG-0-2-0", ["/dev/nvidia0"], [20, 21]),
    ("nvidia.com/gpu=mig0:1,nvidia.com/gpu=MIG-0-2-0,0:1", ["/dev/nvidia0"], [20, 21]),  # one device, thrice
])
def test_a_mig_name_brings_its_own_nodes_only(name, want_nodes, want_caps):
    """A MIG device's access caps and its GPU's node (which CUDA needs for it), never a
    sibling instance's caps or another GPU's node."""
    p = build(parse({"NVIDIA_VISIBLE_DEVICES": name}), host())
    assert nodes(p) == want_nodes and caps(p) == want_caps


@pytest.mark.parametrize("value", [
    "nvidia.com/gpu=0", "runtime.nvidia.com/gpu=all", "nvidia.com/gpu=gpu1", "nvidia.com/gpu=mig0:0",
    "nvidia.com/gpu=MIG-0-2-0", "all,nvidia.com/gpu=0", "nvidia.com/gpu=0,none", "none",
    "amd.com/gpu=0",  # another vendor's name: not even an error, the request is ignored first
    "nvidia.com/gpu=" + "9" * 70000,  # too long to read: still ignored, not refused
])
def test_an_unprivileged_image_s_name_is_ignored_by_the_policy_whatever_its_spelling(value):
    for env in ({"NVIDIA_VISIBLE_DEVICES": value}, {"DOCKER_RESOURCE_GPU": value}):
        c = copy.deepcopy(config.DEFAULTS)
        c["devices"]["accept_envvar_unprivileged"] = False
        try:
            r = request.parse(env, privileged=False, mounts=[], config=c)
        except HookError as e:
            pytest.fail(f"{short(env)}: refused instead of ignored: {e}")
        if "DOCKER_RESOURCE_GPU" in env:
            continue  # not the swarm variable under the default config: not a request at all
        assert r["kind"] == "skip" and "accept_envvar_unprivileged is false" in r["reason"], r


def test_escape_sequences_in_a_name_never_reach_the_message():
    with pytest.raises(HookError) as e:
        parse({"NVIDIA_VISIBLE_DEVICES": "\x1b[2J\x1b]0;owned\x07=0"})
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value) and str(e.value).isprintable()
    with pytest.raises(HookError) as e:
        plan.select(parse({"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=\x1b[31m0"}), host()["gpus"], {}, LIVE)
    assert str(e.value).isprintable()


@pytest.mark.parametrize("annotations", [
    {"cdi.k8s.io/x": "amd.com/gpu=0"}, {"cdi.k8s.io/x": "nvidia.com/gpu"}, {"cdi.k8s.io/x": ""},
    {"cdi.k8s.io/x": 5}, {"other/x": "nvidia.com/gpu=0"}, {"cdi.k8s.io/x": ",,, ,"},
    {"cdi.k8s.io/x": "runtime.nvidia.com/gpu=0"}, {5: "nvidia.com/gpu=0"},
], ids=["other-vendor", "no-name", "empty", "not-a-string", "other-prefix", "commas", "jit-kind", "key-not-a-string"])
def test_a_container_without_a_gpu_request_starts_whatever_its_annotations(annotations):
    """No NVIDIA_VISIBLE_DEVICES, annotations that name no GPU of nvhook's kind: not a GPU
    container (the no-GPU path, never an error)."""
    r = parse({}, privileged=False, accept=False, annotations=annotations)
    assert r["kind"] == "skip" and r["reason"] == "not a GPU container: NVIDIA_VISIBLE_DEVICES is not set", r


def test_a_hostile_annotation_count_is_bounded():
    many = ",".join(f"nvidia.com/gpu={i}" for i in range(request.MAX_TOKENS + 1))
    with pytest.raises(HookError, match=f"CDI annotations name more than {request.MAX_TOKENS} GPUs"):
        parse({}, annotations={"cdi.k8s.io/x": many})


assert CONFIG and DEBIAN and HOST_DECISION  # the plan's fixtures, imported for build()
