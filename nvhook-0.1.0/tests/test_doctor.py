"""nvhook doctor: the report and its text, one test per predicted outcome; and the CUDA release
table it relies on."""

from __future__ import annotations

import json

import pytest
from imagefix import NOTE_CUDA113, gpu, make_image, rtx2080ti, t4

from nvhook.commands import doctor
from nvhook.decide import cuda_releases


def host(version, cuda=None):
    return {"driver": {"version": version, "cuda": cuda, "cuda_source": "nvml" if cuda else None}}


@pytest.fixture
def cuda113(tmp_path):
    return str(make_image(tmp_path / "rootfs"))


def run(h, rootfs, gpus, mode="auto", env=None, **kw):
    report = doctor.diagnose(h, rootfs, env if env is not None else {"CUDA_VERSION": "11.3.1"}, gpus, mode, **kw)
    json.dumps(report)  # --format json prints the dict as is
    return report, doctor.render_text(report)


def test_seed_geforce_460_works_through_minor_version_compat(cuda113):
    r, text = run(host("460.80", "11.2"), cuda113, [rtx2080ti(0), rtx2080ti(1)])
    assert r["decision"]["decision"] == "host" and r["decision"]["reason_code"] == "gpu-not-supported"
    assert [p["outcome"] for p in r["gpus"]] == ["works", "works"]
    assert [p["via"] for p in r["gpus"]] == ["minor-version-compat"] * 2
    assert r["host"] == {"driver": "460.80", "cuda": "11.2", "cuda_source": "nvml", "max_cuda": "11.2"}
    assert r["image"]["cuda_runtime"] == "11.3.109"
    assert r["image"]["min_driver"] == {"minor_compat": "450.80.02", "full": "465.19.01"}
    assert "Host driver     460.80 (supports CUDA up to 11.2 by nvhook's release table; NVML reports CUDA 11.2)" in text
    assert "CUDA runtime    11.3.109 (/usr/local/cuda-11.3/targets/x86_64-linux/lib/libcudart.so.11.3.109)" in text
    assert "driver >= 465.19.01 for all CUDA 11.3 features, >= 450.80.02 at least" in text
    assert "/usr/local/cuda-11.3/compat/libcuda.so.465.19.01  (newer than host)" in text
    assert "Decision        host [gpu-not-supported]" in text
    assert "would fail with CUDA error 804 (cudaErrorCompatNotSupportedOnDevice) on NVIDIA GeForce RTX 2080 Ti" in text
    assert text.count("-> works: CUDA 11.3 runs on host driver 460.80 through minor version compatibility") == 2
    assert "Summary         CUDA should work on every selected GPU (through minor version compatibility" in text


def test_seed_t4_450_works_through_forward_compat(cuda113):
    r, text = run(host("450.102.04", "11.0"), cuda113, [t4(0), t4(1)])
    assert r["decision"]["decision"] == "image"
    assert r["libcuda"] == {"from": "image compat", "version": "465.19.01",
                            "path": "/usr/local/cuda-11.3/compat/libcuda.so.465.19.01"}
    assert [p["outcome"] for p in r["gpus"]] == ["works", "works"]
    assert "libcuda.so.1    /usr/local/cuda-11.3/compat/libcuda.so.465.19.01 (image compat)" in text
    assert "-> works: forward compatibility: compat libcuda 465.19.01 (CUDA 11.3) on kernel module 450.102.04" in text
    assert "(through forward compatibility)" in text


def test_error_804_when_compat_is_forced_on_geforce(cuda113):
    r, text = run(host("460.80"), cuda113, [rtx2080ti(0)], env={"NVHOOK_COMPAT_MODE": "image"})
    assert r["mode"] == {"mode": "image", "configured": "auto", "source": "env NVHOOK_COMPAT_MODE"}
    (p,) = r["gpus"]
    assert p["outcome"] == "error-804"
    assert "-> error 804 (cudaErrorCompatNotSupportedOnDevice): compat libcuda 465.19.01 (chosen by nvhook)" in text
    assert "fix: run with NVHOOK_COMPAT_MODE=auto or host" in text
    assert "fix: upgrade the host driver to >= 465.19.01" in text
    assert "fix: use a data-center GPU" in text
    assert "1 of 1 GPU(s) will fail: error 804" in text


def test_error_804_when_the_image_puts_compat_in_ld_library_path(cuda113):
    env = {"LD_LIBRARY_PATH": "/usr/local/cuda/compat:/usr/local/nvidia/lib64"}
    r, text = run(host("460.80"), cuda113, [rtx2080ti(0)], env=env)
    assert r["decision"]["decision"] == "host"  # nvhook refuses, but the image loads it anyway
    assert r["libcuda"]["from"] == "LD_LIBRARY_PATH"
    assert r["gpus"][0]["outcome"] == "error-804"
    assert "loaded through LD_LIBRARY_PATH" in text
    assert "fix: remove /usr/local/cuda/compat from the image's LD_LIBRARY_PATH" in text


def test_error_803_compat_older_than_kernel_module(cuda113):
    r, text = run(host("470.57.02"), cuda113, [t4(0)], env={"LD_LIBRARY_PATH": "/usr/local/cuda-11.3/compat"})
    assert r["decision"]["reason_code"] == "compat-not-newer"
    assert r["gpus"][0]["outcome"] == "error-803"
    assert ("-> error 803 (cudaErrorSystemDriverMismatch): compat libcuda 465.19.01 (loaded through "
            "LD_LIBRARY_PATH) is older than the kernel module 470.57.02") in text


def test_error_803_compat_for_other_driver_branches(tmp_path):
    rootfs = str(make_image(tmp_path / "r", note=dict(NOTE_CUDA113, Driver=[470])))
    r, text = run(host("450.102.04"), rootfs, [t4(0)], mode="image")
    assert r["gpus"][0]["outcome"] == "error-803"
    assert "-> error 803 (cudaErrorSystemDriverMismatch): compat libcuda 465.19.01 (chosen by nvhook) supports " \
           "driver branches 470, not 450" in text
    # In auto mode nvhook refuses it and the host's 450 runs CUDA 11.3 through minor version compatibility.
    r, text = run(host("450.102.04"), rootfs, [t4(0)])
    assert r["decision"]["reason_code"] == "driver-branch-not-in-note" and r["gpus"][0]["outcome"] == "works"


def test_runtime_needs_newer_driver_and_geforce_cannot_use_forward_compat(cuda113):
    r, text = run(host("418.67"), cuda113, [rtx2080ti(0)])
    (p,) = r["gpus"]
    assert p["outcome"] == "needs-newer-driver"
    assert "-> runtime needs a newer driver and this GPU cannot use forward compat: CUDA 11.3 needs driver " \
           ">= 450.80.02" in text
    assert "CUDA error 35 (cudaErrorInsufficientDriver)" in text
    assert "fix: upgrade the host driver to >= 465.19.01 (>= 450.80.02 is the least that runs CUDA 11.3)" in text
    assert "fix: use an image with CUDA <= 10.1" in text
    assert "fix: use a data-center GPU (forward compatibility)" in text


def test_runtime_needs_newer_driver_on_t4_without_compat_package(tmp_path):
    rootfs = str(make_image(tmp_path / "r", compat=None))
    r, text = run(host("418.67"), rootfs, [t4(0)])
    assert r["gpus"][0]["outcome"] == "needs-newer-driver"
    assert "this GPU could use forward compat" in text
    assert "fix: add NVIDIA's cuda-compat package for CUDA 11.3 to the image" in text


def test_runtime_needs_newer_driver_when_mode_host_refuses_compat(cuda113):
    r, text = run(host("418.67"), cuda113, [t4(0)], mode="host")
    assert r["gpus"][0]["outcome"] == "needs-newer-driver"
    assert "the image's compat libcuda could provide it but is not used" in text
    assert "fix: allow forward compatibility: NVHOOK_COMPAT_MODE=auto" in text
    # The same T4 in auto mode gets the compat lib and works.
    r, text = run(host("418.67"), cuda113, [t4(0)])
    assert r["gpus"][0]["outcome"] == "works" and r["decision"]["decision"] == "image"


def test_mixed_gpus(tmp_path):
    rootfs = str(make_image(tmp_path / "r"))
    r, text = run(host("450.102.04"), rootfs, [t4(0), rtx2080ti(1)])
    assert r["decision"]["decision"] == "host"
    assert [p["outcome"] for p in r["gpus"]] == ["works", "works"]
    assert "(brand tesla, NVML; forward compat: yes)" in text
    assert "(brand geforce, NVML; forward compat: no)" in text


def test_procfs_guess_is_shown(cuda113):
    r, text = run(host("450.102.04"), cuda113, [t4(0, nvml=False)])
    assert r["decision"]["reason_code"] == "gpu-brand-guessed"
    assert "(brand tesla, guessed from procfs; forward compat: yes)" in text


def test_no_runtime_found(tmp_path):
    rootfs = str(make_image(tmp_path / "r", compat=None, cudart_version=None))
    r, text = run(host("535.104.05"), rootfs, [gpu(0, "NVIDIA A100-SXM4-80GB", "tesla", 2)], env={})
    assert r["gpus"][0]["outcome"] == "unknown"
    assert "CUDA runtime    not found" in text and "Compat libs     none in the image" in text


def test_runtime_newer_than_the_table(tmp_path):
    rootfs = str(make_image(tmp_path / "r", compat=None, cudart_version=None))
    r, text = run(host("590.44.01"), rootfs, [t4(0)], env={"CUDA_VERSION": "99.1.0"})
    assert r["gpus"][0]["outcome"] == "unknown" and "newer than nvhook's release table" in text


def test_no_gpu_and_no_compute(cuda113):
    r, text = run(host("460.80"), cuda113, [])
    assert r["gpus"] == [] and "Summary         no GPU selected" in text
    r, text = run(host("460.80"), cuda113, [rtx2080ti()], capabilities=["utility"])
    assert r["decision"]["decision"] == "none" and "libcuda is not involved" in text


def test_override_forbidden_is_a_note(cuda113):
    r, text = run(host("460.80"), cuda113, [rtx2080ti()], env={"NVHOOK_COMPAT_MODE": "image"},
                  allow_override=False)
    assert r["mode"]["mode"] == "auto" and "NVHOOK_COMPAT_MODE=image ignored" in text


def test_skipped_files_are_listed(cuda113):
    import os

    os.symlink("/etc/shadow", f"{cuda113}/usr/local/cuda-11.3/compat/libcuda.so.999.1")
    r, text = run(host("460.80"), cuda113, [rtx2080ti()])
    assert "libcuda.so.999.1  SKIPPED: a symbolic link to /etc/shadow" in text


def test_text_fits_one_screen(cuda113):
    _, text = run(host("460.80", "11.2"), cuda113, [rtx2080ti(0), rtx2080ti(1)])
    assert len(text.splitlines()) <= 30


# --- the CUDA release table -----------------------------------------------------------------

@pytest.mark.parametrize("cuda, minor, full", [
    ("7.0", "346.46", "346.46"),
    ("10.2", "440.33", "440.33"),
    ("11.0", "450.36.06", "450.36.06"),
    ("11.1", "450.80.02", "455.23"),
    ("11.2", "450.80.02", "460.27.03"),
    ("11.2.2", "450.80.02", "460.32.03"),
    ("11.3", "450.80.02", "465.19.01"),
    ("11.3.109", "450.80.02", "465.19.01"),
    ("11.8", "450.80.02", "520.61.05"),
    ("12.0", "525.60.13", "525.60.13"),
    ("12.2", "525.60.13", "535.54.03"),
    ("12.4", "525.60.13", "550.54.14"),
    ("12.8", "525.60.13", "570.26"),
    ("13.0", "580", "580.65.06"),
])
def test_min_driver(cuda, minor, full):
    assert cuda_releases.min_driver(cuda) == (minor, full)


def test_min_driver_unknown():
    assert cuda_releases.min_driver("6.5") is None
    assert cuda_releases.min_driver("99.0") is None
    assert cuda_releases.min_driver("latest") is None


@pytest.mark.parametrize("driver, cuda", [
    ("460.80", "11.2"), ("450.102.04", "11.0"), ("465.19.01", "11.3"), ("418.67", "10.1"),
    ("535.261.03", "12.2"), ("550.54.14", "12.4"), ("570.26", "12.8"), ("580.65.06", "13.0"),
    ("345.0", None), ("not-a-version", None),
])
def test_max_cuda_for_driver(driver, cuda):
    assert cuda_releases.max_cuda_for_driver(driver) == cuda


def test_table_is_consistent():
    from nvhook.base import versions

    prev = None
    for rel in sorted(cuda_releases.RELEASES, key=versions.parse_version):
        minor, full = cuda_releases.RELEASES[rel]
        assert versions.compare(minor, full) <= 0, rel
        if prev is not None:
            assert versions.compare(full, cuda_releases.RELEASES[prev][1]) > 0, rel
        prev = rel
    for update, full in cuda_releases.UPDATES.items():
        assert versions.compare(full, cuda_releases.RELEASES[cuda_releases.release_of(update)][1]) > 0, update
