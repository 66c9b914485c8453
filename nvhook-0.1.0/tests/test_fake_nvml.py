"""The fixture hosts' fake NVML (tests/fixtures/src/fake_nvml.c), driven
through the real pynvml bindings of nvidia-ml-py."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time
from pathlib import Path

import make_fixtures as mf
import pynvml
import pytest


def load(path: Path) -> None:
    """Make pynvml use the library at `path` (and forget the previous one)."""
    pynvml.nvmlLib = ctypes.CDLL(str(path))
    pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def nvml():
    """pynvml, pointed at a library with nvml(path); shut down afterwards."""
    started = []

    def use(path: Path):
        load(path)
        pynvml.nvmlInit()
        started.append(path)
        return pynvml

    yield use
    for _ in started:
        pynvml.nvmlShutdown()
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def text(value: str | bytes) -> str:  # pynvml versions differ on char arrays
    return value.decode() if isinstance(value, bytes) else value


def address(handle) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value


def host_lib(fixtures_root: Path, host: str) -> Path:
    return fixtures_root / host / mf.nvml_lib_path(mf.HOSTS[host])


@pytest.mark.parametrize("host", sorted(mf.HOSTS))
def test_every_host_answers_its_spec(fixtures_root, nvml, host):
    spec = mf.HOSTS[host]
    n = nvml(host_lib(fixtures_root, host))
    assert n.nvmlSystemGetDriverVersion() == spec.driver
    assert n.nvmlSystemGetCudaDriverVersion_v2() == spec.cuda
    assert n.nvmlSystemGetCudaDriverVersion() == spec.cuda
    assert n.nvmlDeviceGetCount() == len(spec.gpus)
    for gpu in spec.gpus:
        h = n.nvmlDeviceGetHandleByIndex(gpu.index)
        assert n.nvmlDeviceGetName(h) == gpu.name
        assert n.nvmlDeviceGetBrand(h) == gpu.brand
        assert n.nvmlDeviceGetUUID(h) == gpu.uuid
        assert n.nvmlDeviceGetMinorNumber(h) == gpu.minor
        assert n.nvmlDeviceGetCudaComputeCapability(h) == gpu.cc
        pci = n.nvmlDeviceGetPciInfo(h)
        domain, bus, rest = gpu.bus_id.split(":")
        assert text(pci.busId) == f"0000{gpu.bus_id}".upper()  # 8-digit domain
        assert text(pci.busIdLegacy) == gpu.bus_id.upper()
        assert (pci.domain, pci.bus, pci.device) == (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
        assert n.nvmlDeviceIsMigDeviceHandle(h).value == 0



def test_pci_info_first_entry_point(fixtures_root, nvml):
    """nvmlDeviceGetPciInfo (no suffix), which NVIDIA's libnvidia-container calls by that name:
    the first 36 bytes of the v3 layout (busId with a 4-digit domain, domain, bus, device,
    ids), four zeroed reserved words, and nothing written past its 52 bytes."""
    spec = mf.HOSTS["host-gpu8"]
    n = nvml(host_lib(fixtures_root, "host-gpu8"))
    fn = pynvml.nvmlLib.nvmlDeviceGetPciInfo
    for gpu in spec.gpus:
        buf = (ctypes.c_ubyte * 64)(*([0xAB] * 64))
        assert fn(n.nvmlDeviceGetHandleByIndex(gpu.index), buf) == 0
        raw = bytes(buf)
        domain, bus, rest = gpu.bus_id.split(":")
        assert raw[:16].rstrip(b"\0").decode() == gpu.bus_id.upper()
        words = [int.from_bytes(raw[16 + 4 * i:20 + 4 * i], "little") for i in range(9)]
        assert words[:3] == [int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)]
        assert words[3] == 0x10DE and words[5:] == [0, 0, 0, 0]
        assert raw[52:] == bytes([0xAB] * 12)

def test_mig_devices(fixtures_root, nvml):
    spec = mf.HOSTS["host-gpu8"]
    n = nvml(host_lib(fixtures_root, "host-gpu8"))
    for gpu in spec.gpus:
        h = n.nvmlDeviceGetHandleByIndex(gpu.index)
        if gpu.mig_mode == "na":
            with pytest.raises(pynvml.NVMLError_NotSupported):
                n.nvmlDeviceGetMigMode(h)
            continue
        assert n.nvmlDeviceGetMigMode(h) == [int(gpu.mig_mode)] * 2
        if gpu.mig_mode == "0":
            assert n.nvmlDeviceGetMaxMigDeviceCount(h) == 0
            continue
        assert n.nvmlDeviceGetMaxMigDeviceCount(h) == 7
        for slot in range(7):
            mig = next((m for m in gpu.migs if m.slot == slot), None)
            if mig is None:
                with pytest.raises(pynvml.NVMLError_NotFound):
                    n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
                continue
            mh = n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            assert n.nvmlDeviceIsMigDeviceHandle(mh).value == 1
            assert n.nvmlDeviceGetUUID(mh) == mig.uuid and mig.uuid.startswith("MIG-")
            assert n.nvmlDeviceGetName(mh) == mig.name
            assert n.nvmlDeviceGetGpuInstanceId(mh) == mig.gi
            assert n.nvmlDeviceGetComputeInstanceId(mh) == mig.ci
            assert address(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh)) == address(h)
            assert n.nvmlDeviceGetMinorNumber(mh) == gpu.minor
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            n.nvmlDeviceGetMigDeviceHandleByIndex(h, 7)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            n.nvmlDeviceGetGpuInstanceId(h)  # not a MIG device handle


def test_mig8x7_has_56_mig_devices(fixtures_root, nvml):
    n = nvml(host_lib(fixtures_root, "host-mig8x7"))
    uuids = set()
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        for slot in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
            uuids.add(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)))
    assert len(uuids) == 56


def test_debian_host_finds_its_config_beside_the_real_file(fixtures_root, nvml):
    lib = host_lib(fixtures_root, "host-debian")
    assert lib.parent.name == "current"
    assert nvml(lib).nvmlSystemGetDriverVersion() == "525.147.05"


def test_error_strings_and_shutdown(fixtures_root, nvml):
    n = nvml(host_lib(fixtures_root, "host-gpu1"))
    assert n.nvmlErrorString(pynvml.NVML_ERROR_NOT_SUPPORTED) == "Not Supported"
    assert n.nvmlErrorString(pynvml.NVML_ERROR_DRIVER_NOT_LOADED) == "Driver Not Loaded"
    assert n.nvmlErrorString(12345) == "Unknown Error"
    n.nvmlInit()  # reference counted
    n.nvmlShutdown()
    assert n.nvmlDeviceGetCount() == 1


@pytest.fixture
def private_nvml(fixtures_root, tmp_path):
    """A copy of a fake NVML in tmp_path and a writer for its fake-nvml.conf."""
    lib = tmp_path / "libnvidia-ml.so.535.261.03"
    shutil.copyfile(host_lib(fixtures_root, "host-gpu1"), lib)

    def configure(text: str) -> Path:
        (tmp_path / "fake-nvml.conf").write_text(text)
        return lib

    yield configure
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def test_init_fail(private_nvml):
    load(private_nvml("driver 535.261.03\ncuda 12020\ninit fail\n"))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_init_fail_with_code(private_nvml):
    load(private_nvml("init fail 999\n"))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()


def test_missing_or_malformed_config(private_nvml, tmp_path):
    lib = private_nvml("gpu 0 0 GPU-x\n")
    load(lib)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    (tmp_path / "fake-nvml.conf").unlink()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_config_reread_and_env_override(private_nvml, tmp_path, monkeypatch):
    lib = private_nvml("driver 1.2.3\ncuda 12000\ngpu 0 3 GPU-abc 0000:01:00.0 2 7 5 na Tesla T4\n")
    load(lib)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert (pynvml.nvmlDeviceGetMinorNumber(h), pynvml.nvmlDeviceGetName(h)) == (3, "Tesla T4")
    pynvml.nvmlShutdown()
    other = tmp_path / "other.conf"
    other.write_text("driver 9.9.9\ncuda 13000\n")
    monkeypatch.setenv("NVHOOK_FAKE_NVML_CONF", str(other))
    pynvml.nvmlInit()
    assert pynvml.nvmlSystemGetDriverVersion() == "9.9.9" and pynvml.nvmlDeviceGetCount() == 0
    pynvml.nvmlShutdown()


HANG_SCRIPT = """
import ctypes, sys, pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
print("returned")
"""


def test_init_hang_and_delay(private_nvml):
    lib = private_nvml("init hang\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", HANG_SCRIPT, str(lib)], capture_output=True, timeout=0.5)
    private_nvml("delay 300\ndriver 1\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HANG_SCRIPT, str(lib)], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out == "returned\n" and time.monotonic() - start >= 0.3
