"""Container images with CUDA compat libraries, for test_image/test_compat/test_doctor/test_elf.

The ELF files come from tests/fixtures/make_fixtures.py (build_compat_lib, compile_driver_lib):
real shared objects with the .note.cuda.fwd_compatibility section. This module only lays them
out the way CUDA images do:

    /usr/local/cuda -> cuda-11.3
    /usr/local/cuda-11.3/compat/libcuda.so.465.19.01 (+ .so.1, .so links, ptxjitcompiler)
    /usr/local/cuda-11.3/targets/x86_64-linux/lib/libcudart.so.11.3.109 (+ .so.11.0 link)
    /usr/local/cuda-11.3/lib64 -> targets/x86_64-linux/lib
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

import make_fixtures  # noqa: E402

DATACENTER_DEVICES = make_fixtures.DATACENTER_DEVICES
NOTE_CUDA113 = make_fixtures.NOTE_CUDA113
build_compat_lib = make_fixtures.build_compat_lib

_CACHE: dict = {}


def compat_lib(version: str = "465.19.01", note: dict | None = NOTE_CUDA113, cuda: int = 11030) -> Path:
    """A compat libcuda.so.<version> in a private directory (built once per process)."""
    key = (version, repr(note), cuda)
    if key not in _CACHE:
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="nvhook-compat-"))
        atexit.register(shutil.rmtree, d, True)
        _CACHE[key] = build_compat_lib(d, version, note, cuda)
    return _CACHE[key]


def cudart(version: str) -> Path:
    major = version.split(".")[0]
    return make_fixtures.compile_driver_lib("libcudart", version, f"libcudart.so.{major}.0")


def make_image(root: Path, *, cuda_dir: str = "cuda-11.3", compat: str | None = "465.19.01",
               note: dict | None = NOTE_CUDA113, cudart_version: str | None = "11.3.109",
               cuda_int: int = 11030) -> Path:
    """A rootfs at `root` with a CUDA toolkit layout; returns root."""
    root = Path(root)
    base = root / "usr/local" / cuda_dir
    base.mkdir(parents=True, exist_ok=True)
    (root / "etc").mkdir(exist_ok=True)
    os.symlink(cuda_dir, root / "usr/local/cuda")
    if compat is not None:
        build_compat_lib(base / "compat", compat, note, cuda_int)
    if cudart_version is not None:
        lib = base / "targets/x86_64-linux/lib"
        lib.mkdir(parents=True)
        shutil.copyfile(cudart(cudart_version), lib / f"libcudart.so.{cudart_version}")
        os.symlink(f"libcudart.so.{cudart_version}", lib / f"libcudart.so.{cudart_version.split('.')[0]}.0")
        os.symlink("targets/x86_64-linux/lib", base / "lib64")
    return root


def gpu(index: int, model: str, brand: str | None, brand_id: int | None, source: str = "nvml") -> dict:
    return {"index": index, "minor": index, "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
            "bus_id": f"0000:{index + 1:02x}:00.0", "model": model, "brand": brand, "brand_id": brand_id,
            "cc": None, "source": source}


def rtx2080ti(index: int = 0, nvml: bool = True) -> dict:
    if nvml:
        return gpu(index, "NVIDIA GeForce RTX 2080 Ti", "geforce", 5)
    return gpu(index, "NVIDIA GeForce RTX 2080 Ti", None, None, "procfs")


def t4(index: int = 0, nvml: bool = True) -> dict:
    if nvml:
        return gpu(index, "Tesla T4", "tesla", 2)
    return gpu(index, "Tesla T4", None, None, "procfs")
