"""nvhook.decide.compat: the forward-compatibility decision (pure), for the cases of seed 003 and the
issue, each mode and the per-container override."""

from __future__ import annotations

import pytest
from imagefix import DATACENTER_DEVICES, NOTE_CUDA113, gpu, rtx2080ti, t4

from nvhook.base.errors import HookError
from nvhook.decide import compat

COMPUTE = ["compute", "utility"]
DIR = "/usr/local/cuda-11.3/compat"


def cands(version="465.19.01", note=NOTE_CUDA113, host="460.80", note_error=None, d=DIR):
    from nvhook.base import versions

    newer = versions.compare(version, host) > 0
    return [
        {"name": f"libcuda.so.{version}", "container_path": f"{d}/libcuda.so.{version}",
         "host_path": f"/rootfs{d}/libcuda.so.{version}", "library": "libcuda", "version": version,
         "newer_than_host": newer, "note": note if newer else None,
         "note_error": note_error if newer else None, "skipped": None},
        {"name": f"libnvidia-ptxjitcompiler.so.{version}",
         "container_path": f"{d}/libnvidia-ptxjitcompiler.so.{version}",
         "host_path": f"/rootfs{d}/libnvidia-ptxjitcompiler.so.{version}",
         "library": "libnvidia-ptxjitcompiler", "version": version, "newer_than_host": newer,
         "note": None, "note_error": None, "skipped": None},
    ]


LIBS_113 = [f"{DIR}/libcuda.so.465.19.01", f"{DIR}/libnvidia-ptxjitcompiler.so.465.19.01"]


# --- the seed-003 cases ---------------------------------------------------------------------

def test_seed_geforce_2080ti_host_460_gets_host_libcuda():
    d = compat.decide(COMPUTE, "460.80", [rtx2080ti(0), rtx2080ti(1)], cands(host="460.80"), "auto")
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported"
    assert d["libraries"] == []
    assert len(d["warnings"]) == 1
    w = d["warnings"][0]
    assert ("would fail with CUDA error 804 (cudaErrorCompatNotSupportedOnDevice) on "
            "NVIDIA GeForce RTX 2080 Ti") in w
    assert "GPUs 0, 1" in w and "465.19.01" in w and "460.80" in w
    ev = d["event"]
    assert ev["host_driver"] == "460.80" and ev["compat_version"] == "465.19.01"
    assert ev["note"] == NOTE_CUDA113 and ev["decision"] == "host" and ev["reason_code"] == "gpu-not-supported"
    assert ev["gpus"] == [
        {"index": 0, "model": "NVIDIA GeForce RTX 2080 Ti", "brand": "geforce", "brand_source": "nvml",
         "supported": False},
        {"index": 1, "model": "NVIDIA GeForce RTX 2080 Ti", "brand": "geforce", "brand_source": "nvml",
         "supported": False},
    ]


def test_seed_same_image_on_tesla_t4_450_gets_image_compat():
    d = compat.decide(COMPUTE, "450.102.04", [t4(0), t4(1)], cands(host="450.102.04"), "auto")
    assert d["decision"] == "image" and d["reason_code"] == "all-gpus-supported"
    assert d["libraries"] == LIBS_113
    assert [c["host_path"] for c in d["selected"]] == [f"/rootfs{p}" for p in LIBS_113]
    assert d["warnings"] == [] and d["guessed"] is False
    assert d["event"]["gpus"][0]["brand"] == "tesla"


@pytest.mark.parametrize("host", ["465.19.01", "470.57.02", "510.47.03"])
def test_compat_equal_or_older_than_host_is_never_used(host):
    for mode in ("auto", "image"):
        d = compat.decide(COMPUTE, host, [t4()], cands(host=host), mode)
        assert d["decision"] == "host" and d["reason_code"] == "compat-not-newer", mode
        assert d["libraries"] == [] and d["warnings"] == []


def test_note_branch_excluding_host_gets_host():
    note = dict(NOTE_CUDA113, Driver=[470])
    d = compat.decide(COMPUTE, "450.102.04", [t4()], cands(note=note, host="450.102.04"), "auto")
    assert d["decision"] == "host" and d["reason_code"] == "driver-branch-not-in-note"
    assert "450" in d["reason"] and "470" in d["reason"]
    assert "CUDA error 803" in d["warnings"][0]


def test_mixed_t4_and_geforce_gets_host():
    gpus = [t4(0), rtx2080ti(1)]
    d = compat.decide(COMPUTE, "450.102.04", gpus, cands(host="450.102.04"), "auto")
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported"
    assert "on NVIDIA GeForce RTX 2080 Ti (GPU 1;" in d["warnings"][0]
    assert "Tesla T4" not in d["warnings"][0]
    assert [g["supported"] for g in d["gpus"]] == [True, False]


def test_only_the_t4_of_a_mixed_host_gets_image():
    d = compat.decide(COMPUTE, "450.102.04", [t4(0)], cands(host="450.102.04"), "auto")
    assert d["decision"] == "image" and d["libraries"] == LIBS_113


# --- modes ----------------------------------------------------------------------------------

def test_mode_host_never_uses_compat():
    d = compat.decide(COMPUTE, "450.102.04", [t4()], cands(host="450.102.04"), "host")
    assert d["decision"] == "host" and d["reason_code"] == "mode-host" and d["libraries"] == []
    assert "465.19.01" in d["reason"]


def test_mode_image_is_the_old_behaviour_and_warns():
    d = compat.decide(COMPUTE, "460.80", [rtx2080ti()], cands(host="460.80"), "image")
    assert d["decision"] == "image" and d["reason_code"] == "mode-image"
    assert d["libraries"] == LIBS_113
    assert "CUDA error 804" in d["warnings"][0] and "NVIDIA GeForce RTX 2080 Ti" in d["warnings"][0]


def test_mode_image_ignores_the_note_branch_but_says_so():
    note = dict(NOTE_CUDA113, Driver=[470])
    d = compat.decide(COMPUTE, "450.102.04", [t4()], cands(note=note, host="450.102.04"), "image")
    assert d["decision"] == "image" and any("CUDA error 803" in w for w in d["warnings"])


def test_unknown_mode_is_an_error():
    with pytest.raises(HookError, match="compat mode"):
        compat.decide(COMPUTE, "460.80", [], [], "always")


@pytest.mark.parametrize("env, allow, want", [
    ({}, True, ("auto", "config", None)),
    ({"NVHOOK_COMPAT_MODE": ""}, True, ("auto", "config", None)),
    ({"NVHOOK_COMPAT_MODE": "host"}, True, ("host", "env NVHOOK_COMPAT_MODE", None)),
    ({"NVHOOK_COMPAT_MODE": " Image "}, True, ("image", "env NVHOOK_COMPAT_MODE", None)),
    ({"NVHOOK_COMPAT_MODE": "auto"}, True, ("auto", "env NVHOOK_COMPAT_MODE", None)),
])
def test_mode_from_env(env, allow, want):
    assert compat.mode_from_env(env, "auto", allow) == want


def test_mode_override_forbidden_is_ignored_with_a_warning():
    mode, source, warning = compat.mode_from_env({"NVHOOK_COMPAT_MODE": "image"}, "host", False)
    assert (mode, source) == ("host", "config")
    assert "NVHOOK_COMPAT_MODE=image ignored" in warning and "allow_env_override" in warning


def test_mode_override_bad_value():
    with pytest.raises(HookError, match="NVHOOK_COMPAT_MODE must be one of auto, image, host"):
        compat.mode_from_env({"NVHOOK_COMPAT_MODE": "yes"}, "auto", True)
    with pytest.raises(HookError, match="compat.mode"):
        compat.mode_from_env({}, "never", True)


@pytest.mark.parametrize("env_mode, want", [("host", "host"), ("image", "image"), ("auto", "host")])
def test_each_override_changes_the_decision_for_a_geforce(env_mode, want):
    mode, _, _ = compat.mode_from_env({"NVHOOK_COMPAT_MODE": env_mode}, "auto", True)
    d = compat.decide(COMPUTE, "460.80", [rtx2080ti()], cands(host="460.80"), mode)
    assert d["decision"] == want and d["event"]["mode"] == env_mode


@pytest.mark.parametrize("env_mode, want", [("host", "host"), ("image", "image"), ("auto", "image")])
def test_each_override_changes_the_decision_for_a_t4(env_mode, want):
    mode, _, _ = compat.mode_from_env({"NVHOOK_COMPAT_MODE": env_mode}, "host", True)
    d = compat.decide(COMPUTE, "450.102.04", [t4()], cands(host="450.102.04"), mode)
    assert d["decision"] == want


# --- other rules ----------------------------------------------------------------------------

def test_versions_compare_numerically_not_as_strings():
    # "465.19.01" < "465.9" as strings; 465.19 > 465.9 as numbers.
    d = compat.decide(COMPUTE, "465.9", [t4()], cands(host="465.9", note=None), "auto")
    assert d["decision"] == "image"
    d = compat.decide(COMPUTE, "999.9", [t4()], cands("1000.1", host="999.9", note=None), "auto")
    assert d["decision"] == "image"
    d = compat.decide(COMPUTE, "1000.1", [t4()], cands("999.9", host="1000.1"), "image")
    assert d["reason_code"] == "compat-not-newer"


def test_no_compat_libs():
    d = compat.decide(COMPUTE, "460.80", [t4()], [], "auto")
    assert d["decision"] == "host" and d["reason_code"] == "no-compat-libs" and d["event"]["compat_version"] is None


def test_compute_not_requested():
    d = compat.decide(["utility"], "450.102.04", [t4()], cands(host="450.102.04"), "auto")
    assert d["decision"] == "none" and d["reason_code"] == "compute-not-requested"
    d = compat.decide(["video", "utility"], "450.102.04", [t4()], cands(host="450.102.04"), "image")
    assert d["decision"] == "host" and d["reason_code"] == "compute-not-requested"
    d = compat.decide(["all"], "450.102.04", [t4()], cands(host="450.102.04"), "auto")
    assert d["decision"] == "image"


def test_no_gpu_selected():
    d = compat.decide(COMPUTE, "450.102.04", [], cands(host="450.102.04"), "auto")
    assert d["decision"] == "host" and d["reason_code"] == "no-gpu-selected"


def test_unknown_host_driver():
    d = compat.decide(COMPUTE, None, [t4()], cands(host="1.0"), "auto")
    assert d["decision"] == "host" and d["reason_code"] == "host-driver-unknown"


def test_malformed_note_is_refused():
    c = cands(host="450.102.04", note=None, note_error="malformed .note.cuda.fwd_compatibility note")
    d = compat.decide(COMPUTE, "450.102.04", [t4()], c, "auto")
    assert d["decision"] == "host" and d["reason_code"] == "compat-note-invalid"
    assert "malformed" in d["warnings"][0]


def test_without_note_data_center_brands_decide():
    c = cands(host="450.102.04", note=None)
    assert compat.decide(COMPUTE, "450.102.04", [t4()], c, "auto")["decision"] == "image"
    l4 = gpu(0, "NVIDIA L4", "nvidia", 14)
    assert compat.decide(COMPUTE, "450.102.04", [l4], c, "auto")["decision"] == "image"
    d = compat.decide(COMPUTE, "450.102.04", [rtx2080ti()], c, "auto")
    assert d["decision"] == "host" and "data center/professional brands" in d["reason"]


def test_note_device_list_decides_over_the_default_set():
    # A note that lists GeForce (5) lets a GeForce use it; one without Tesla (2) refuses a T4.
    c = cands(host="460.80", note=dict(NOTE_CUDA113, Device=[5]))
    assert compat.decide(COMPUTE, "460.80", [rtx2080ti()], c, "auto")["decision"] == "image"
    c = cands(host="460.80", note=dict(NOTE_CUDA113, Device=[14]))
    d = compat.decide(COMPUTE, "460.80", [t4()], c, "auto")
    assert d["decision"] == "host" and "the note's Device list" in d["reason"]


def test_without_nvml_brand_is_guessed_from_procfs():
    c = cands(host="450.102.04")
    d = compat.decide(COMPUTE, "450.102.04", [t4(nvml=False)], c, "auto")
    assert d["decision"] == "image" and d["reason_code"] == "gpu-brand-guessed" and d["guessed"]
    assert "guess" in d["reason"]
    assert d["event"]["gpus"][0]["brand_source"] == "procfs-guess"
    d = compat.decide(COMPUTE, "450.102.04", [rtx2080ti(nvml=False)], c, "auto")
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported"
    assert "guessed" in d["reason"] and "guessed from the procfs model name" in d["warnings"][0]


def test_unknown_model_is_not_trusted():
    d = compat.decide(COMPUTE, "450.102.04", [gpu(0, "NVIDIA Graphics Device", None, None, "procfs")],
                      cands(host="450.102.04"), "auto")
    assert d["decision"] == "host" and d["gpus"][0]["brand"] == "unknown"


def test_skipped_entries_are_ignored_and_logged():
    c = cands(host="450.102.04")
    c.insert(0, {"name": "libcuda.so.999.1", "container_path": f"{DIR}/libcuda.so.999.1", "host_path": None,
                 "library": "libcuda", "version": "999.1", "newer_than_host": True, "note": None,
                 "note_error": None, "skipped": "a symbolic link to /etc/shadow; compat libraries must be regular files"})
    d = compat.decide(COMPUTE, "450.102.04", [t4()], c, "auto")
    assert d["decision"] == "image" and d["compat_version"] == "465.19.01"
    assert d["event"]["skipped"][0]["path"] == f"{DIR}/libcuda.so.999.1"


def test_newest_compat_and_its_own_companions():
    c = cands("465.19.01", host="450.102.04") + cands("470.57.02", host="450.102.04", d="/usr/local/cuda/compat")
    d = compat.decide(COMPUTE, "450.102.04", [t4()], c, "auto")
    assert d["libraries"] == ["/usr/local/cuda/compat/libcuda.so.470.57.02",
                              "/usr/local/cuda/compat/libnvidia-ptxjitcompiler.so.470.57.02"]


def test_needs_gpu_brands():
    c = cands(host="450.102.04")
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", c, "auto") is True
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", c, "image") is False
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", c, "host") is False
    assert compat.needs_gpu_brands(["utility"], "450.102.04", c, "auto") is False
    assert compat.needs_gpu_brands(COMPUTE, "470.57.02", cands(host="470.57.02"), "auto") is False
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", [], "auto") is False
    branch = cands(host="450.102.04", note=dict(NOTE_CUDA113, Driver=[470]))
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", branch, "auto") is False
    bad = cands(host="450.102.04", note=None, note_error="malformed")
    assert compat.needs_gpu_brands(COMPUTE, "450.102.04", bad, "auto") is False


@pytest.mark.parametrize("model, brand", [
    ("NVIDIA GeForce RTX 2080 Ti", "geforce"),  # what NVML reports for it
    ("GeForce GTX 1080", "geforce"),
    ("Tesla T4", "tesla"),
    ("Tesla V100-SXM2-16GB", "tesla"),
    ("NVIDIA A100-SXM4-80GB", "nvidia"),
    ("NVIDIA H100 80GB HBM3", "nvidia"),
    ("NVIDIA L4", "nvidia"),
    ("NVIDIA GH200 480GB", "nvidia"),
    ("NVIDIA RTX A6000", "nvidiartx"),
    ("Quadro RTX 8000", "quadrortx"),
    ("Quadro P4000", "quadro"),
    ("NVIDIA TITAN RTX", "titan"),
    ("NVIDIA TITAN V", "titan"),
    ("GRID K520", "grid"),
    ("NVIDIA Graphics Device", "unknown"),
    ("", "unknown"),
    (None, "unknown"),
])
def test_brand_from_model(model, brand):
    assert compat.brand_from_model(model) == (brand, True)


def test_brand_table_matches_nvml_and_host():
    from nvhook.observe import host

    assert compat.BRANDS == host.BRAND_NAMES
    assert {compat.BRAND_IDS[b] for b in compat.DATACENTER_BRANDS} == set(DATACENTER_DEVICES)
    assert {"geforce", "geforcertx", "titan", "titanrtx", "nvs", "grid"}.isdisjoint(compat.DATACENTER_BRANDS)


def test_decide_is_pure():
    import json

    c = cands(host="450.102.04")
    before = json.dumps(c)
    gpus = [t4()]
    compat.decide(COMPUTE, "450.102.04", gpus, c, "auto")
    assert json.dumps(c) == before and gpus == [t4()]


# --- NVIDIA's rule, where the host cannot be observed (decide_by_versions) ---------------------

@pytest.mark.parametrize("driver,cuda,note,used", [
    ("460.80", None, NOTE_CUDA113, True),          # the note lists 460 and 465.19.01 is newer
    ("470.57.02", None, NOTE_CUDA113, False),      # 470 is not in the note
    ("460.80", None, {**NOTE_CUDA113, "Driver": []}, False),  # a note without the branch: not used
    ("460.80", None, None, True),                  # no note: 465 > 460
    ("465.10", None, None, False),                 # no note: same major (nvhook's "newer" would say yes)
    (None, "11.2", NOTE_CUDA113, True),            # only the CUDA version: the note's 11.3 is newer
    (None, "11.3", NOTE_CUDA113, False),
    (None, "11.2", None, False),                   # no note to compare with
    ("460.80", "11.2", None, False),               # a CUDA version given and no note: NVIDIA's "false"
])
def test_nvidias_rule(driver, cuda, note, used):
    d = compat.decide_by_versions(driver, cuda, cands(note=note, host="0"), "auto")
    assert d["decision"] == ("image" if used else "host"), d["reason"]
    assert d["libraries"] == ([f"{DIR}/libcuda.so.465.19.01"] if used else [])
    assert d["event"]["rule"] == "nvidia" and d["event"]["decision"] == d["decision"]


def test_nvidias_rule_other_cases():
    # the admin's mode host holds; a malformed note is no note; two libcudas: none (NVIDIA's)
    assert compat.decide_by_versions("460.80", None, cands(host="0"), "host")["reason_code"] == "mode-host"
    d = compat.decide_by_versions("460.80", None, cands(note=None, note_error="bad", host="0"), "auto")
    assert d["decision"] == "image" and d["reason_code"] == "nvidia-rule-major"
    two = cands(host="0") + cands(version="470.1", host="0", d="/usr/local/cuda-11.4/compat")
    assert compat.decide_by_versions("460.80", None, two, "auto")["reason_code"] == "no-compat-libs"
    assert compat.decide_by_versions("bogus", None, cands(note=None, host="0"), "auto")["decision"] == "host"
