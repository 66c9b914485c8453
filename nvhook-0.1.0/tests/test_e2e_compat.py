"""CUDA forward compatibility in real containers (the seed 003 cases: error 804 on GeForce).

The container-cuda113 image carries /usr/local/cuda-11.3/compat/libcuda.so.465.19.01
(cuDriverGetVersion 11030, fwd-compat note: driver branches 418/440/450/460, data center device
brands) and its bundle env has CUDA_VERSION=11.3.1 and NVIDIA_REQUIRE_CUDA. Each test starts a
private copy with runc and the installed nvhook as its prestart hook on a fixture host, and
checks which libcuda a CUDA program in the container really maps (cuda-probe reads
/proc/self/maps), what the container's `ldconfig -p` says, and nvhook's compat.decision event.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402  (tests/conftest.py puts tests/fixtures on sys.path)
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

IMAGE = "container-cuda113"
L = "/usr/lib/x86_64-linux-gnu"
COMPAT = mf.CONTAINERS[IMAGE].compat  # 465.19.01, 11030
COMPAT_FILE = f"{L}/libcuda.so.{COMPAT.version}"

VIEW = (f"/usr/bin/cuda-probe; echo CACHE; /sbin/ldconfig -p; echo END-CACHE; "
        f"echo REALPATH:$(realpath {L}/libcuda.so.1)")


def host_file(host: str) -> tuple[str, int]:
    spec = mf.HOSTS[host]
    return f"{L}/libcuda.so.{spec.driver}", spec.cuda


def start(tmp_path: Path, fixtures_root: Path, host: str, env: dict | None = None,
          config_extra: str = "") -> rb.HookRun:
    r = rb.run_with_nvhook(tmp_path, container=IMAGE, host=fixtures_root / host, env=env,
                           script=VIEW, config_extra=config_extra)
    assert r.proc.returncode == 0, r.proc.stderr
    evs = r.events()
    assert evs[-1]["event"] == "hook.done" and evs[-1]["result"] == "ok"
    return r


def field(out: str, key: str) -> str:
    values = [ln[len(key) + 2:] for ln in out.splitlines() if ln.startswith(key + ": ")]
    assert len(values) == 1, f"expected one {key!r} line in:\n{out}"
    return values[0]


def assert_uses(r: rb.HookRun, path: str, version: int) -> None:
    """A CUDA program maps `path`, and the container's ld.so.cache leads libcuda.so.1 there."""
    out = r.stdout
    assert field(out, "path") == path
    assert field(out, "cuDriverGetVersion") == str(version)
    cache = out.split("CACHE\n", 1)[1].split("END-CACHE", 1)[0]
    entries = [ln.split("=>", 1)[1].strip() for ln in cache.splitlines()
               if ln.strip().startswith("libcuda.so.1 ")]
    assert entries == [f"{L}/libcuda.so.1"], cache
    assert [ln for ln in out.splitlines() if ln.startswith("REALPATH:")] == [f"REALPATH:{path}"]
    done = r.events()[-1]
    assert path in done["mounted"]
    other = COMPAT_FILE if path != COMPAT_FILE else None
    if other:
        assert other not in done["mounted"]


def decision(r: rb.HookRun) -> dict:
    evs = r.events("compat.decision")
    assert len(evs) == 1
    return evs[0]


def test_geforce_gets_host_libcuda_not_804(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-geforce-460")
    assert_uses(r, *host_file("host-geforce-460"))
    d = decision(r)
    assert d["level"] == "warning"
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported"
    assert any("CUDA error 804" in w for w in d["warnings"])
    assert [g["brand"] for g in d["gpus"]] == ["geforce"] and d["gpus"][0]["brand_source"] == "nvml"
    assert "GeForce RTX 2080 Ti" in d["reason"]


def test_tesla_t4_gets_the_compat_libcuda(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-t4-450")
    assert_uses(r, COMPAT_FILE, COMPAT.cuda)
    assert field(r.stdout, "label") == f"compat libcuda {COMPAT.version}"
    d = decision(r)
    assert d["level"] == "info" and d["decision"] == "image"
    assert d["reason_code"] == "all-gpus-supported"
    assert d["compat_path"] == f"/usr/local/cuda-11.3/compat/libcuda.so.{COMPAT.version}"


def test_mixed_t4_and_geforce_gets_host_libcuda(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-mixed-450", env={"NVIDIA_VISIBLE_DEVICES": "0,1"})
    assert_uses(r, *host_file("host-mixed-450"))
    d = decision(r)
    assert d["level"] == "warning" and d["decision"] == "host"
    assert {g["brand"]: g["supported"] for g in d["gpus"]} == {"tesla": True, "geforce": False}
    assert any("CUDA error 804" in w for w in d["warnings"])


def test_mixed_host_t4_only_gets_compat(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-mixed-450", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert_uses(r, COMPAT_FILE, COMPAT.cuda)
    d = decision(r)
    assert d["decision"] == "image" and [g["model"] for g in d["gpus"]] == ["Tesla T4"]
    # NVML index 0 is the T4, whose device minor is 1
    assert "/dev/nvidia1" in r.events()[-1]["mounted"] and "/dev/nvidia0" not in r.events()[-1]["mounted"]


def test_env_mode_host_on_t4(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-t4-450", env={"NVHOOK_COMPAT_MODE": "host"})
    assert_uses(r, *host_file("host-t4-450"))
    d = decision(r)
    assert d["decision"] == "host" and d["reason_code"] == "mode-host"
    assert d["mode"] == "host" and d["mode_source"] == "env NVHOOK_COMPAT_MODE"
    assert d["compat_version"] == COMPAT.version  # it was there, and not used


def test_env_mode_image_on_geforce_warns(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-geforce-460", env={"NVHOOK_COMPAT_MODE": "image"})
    assert_uses(r, COMPAT_FILE, COMPAT.cuda)
    d = decision(r)
    assert d["level"] == "warning"
    assert d["decision"] == "image" and d["reason_code"] == "mode-image"
    assert d["mode_source"] == "env NVHOOK_COMPAT_MODE"
    assert any("CUDA error 804" in w and "compat mode is image" in w for w in d["warnings"])


def test_env_override_refused_by_config(tmp_path, fixtures_root):
    r = start(tmp_path, fixtures_root, "host-geforce-460", env={"NVHOOK_COMPAT_MODE": "image"},
              config_extra="[compat]\nallow_env_override = false\n")
    assert_uses(r, *host_file("host-geforce-460"))
    refused = r.events("compat.override_refused")
    assert len(refused) == 1 and refused[0]["level"] == "warning"
    assert "NVHOOK_COMPAT_MODE=image ignored" in refused[0]["message"]
    d = decision(r)
    assert d["mode"] == "auto" and d["mode_source"] == "config"
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported"


def test_image_listing_its_compat_dir_in_ld_so_conf_still_gets_host_libcuda(tmp_path, fixtures_root):
    """Some images put the compat dir in ld.so.conf.d themselves; on GeForce the host's libcuda
    must still be the one libcuda.so.1 resolves to first."""

    def prepare(rootfs: Path) -> None:
        (rootfs / "etc/ld.so.conf.d/000-cuda-compat.conf").write_text("/usr/local/cuda/compat\n")
        mf.run_ldconfig(rootfs)

    r = rb.run_with_nvhook(tmp_path, container=IMAGE, host=fixtures_root / "host-geforce-460",
                           prepare=prepare, script="/usr/bin/cuda-probe; /sbin/ldconfig -p")
    assert r.proc.returncode == 0, r.proc.stderr
    path, version = host_file("host-geforce-460")
    assert field(r.stdout, "path") == path
    assert field(r.stdout, "cuDriverGetVersion") == str(version)
    entries = [ln.split("=>", 1)[1].strip() for ln in r.stdout.splitlines()
               if ln.strip().startswith("libcuda.so.1 ")]
    assert entries[0] == f"{L}/libcuda.so.1"  # the image's compat entry may follow; it is not used
    assert decision(r)["decision"] == "host"
