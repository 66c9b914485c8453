"""NVML facts (brand, compute capability, MIG devices, CUDA version), asked in a child process.

NVML can take seconds to initialise without persistence mode, and a wedged driver can make
it hang for good (toolkit issues #202, #2102). The query runs in a forked child that writes
one JSON document to a pipe; the parent waits at most `timeout` seconds, then kills it and
the caller falls back to procfs. The child also keeps pynvml's import (~35 ms) and the
driver's own threads out of the hook process, which must stay single-threaded to setns.

The library is loaded from the host root (the ld.so.cache entry for libnvidia-ml.so.1), so a
fixture host's fake NVML is what tests exercise through the real pynvml bindings.
"""

from __future__ import annotations

import os

from ...base import jsonfast as json
from ...base import process


class NvmlUnavailable(Exception):
    pass


def _query(lib_path: str) -> dict:
    import ctypes

    import pynvml

    pynvml.nvmlLib = ctypes.CDLL(lib_path)
    pynvml.nvmlInit()
    try:
        def text(v):
            return v.decode() if isinstance(v, bytes) else v

        out = {"driver": text(pynvml.nvmlSystemGetDriverVersion()), "cuda": None, "gpus": []}
        try:
            c = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            out["cuda"] = f"{c // 1000}.{(c % 1000) // 10}"
        except pynvml.NVMLError:
            pass
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            g = {"index": i, "uuid": text(pynvml.nvmlDeviceGetUUID(h)), "model": text(pynvml.nvmlDeviceGetName(h)),
                 "bus_id": text(pci.busId).lower(), "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                 "brand_id": pynvml.nvmlDeviceGetBrand(h), "cc": None, "mig_mode": None, "migs": []}
            if len(g["bus_id"]) == 16:  # NVML's 8-digit domain: 00000000:07:00.0
                g["bus_id"] = g["bus_id"][4:]
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                g["cc"] = f"{major}.{minor}"
            except pynvml.NVMLError:
                pass
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(h)
                g["mig_mode"] = bool(current)
            except pynvml.NVMLError:
                g["mig_mode"] = None
            if g["mig_mode"]:
                for m in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                    try:
                        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, m)
                    except pynvml.NVMLError:
                        continue
                    g["migs"].append({"index": m, "uuid": text(pynvml.nvmlDeviceGetUUID(mh)),
                                      "gi": pynvml.nvmlDeviceGetGpuInstanceId(mh),
                                      "ci": pynvml.nvmlDeviceGetComputeInstanceId(mh)})
            out["gpus"].append(g)
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _detach_from_hook(parent: int) -> None:
    """A wedged NVML must not outlive the hook: if the runtime kills the hook on its own
    timeout, this child dies with it (and holds none of the hook's stdout/stderr pipes, which
    the runtime waits on)."""
    process.die_with_parent(parent)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def probe(lib_path: str, timeout: float) -> dict:
    """Run _query in a child; raise NvmlUnavailable with the reason on failure or timeout."""
    parent = os.getpid()
    pid, ((r, w),) = process.fork_with_pipes(1)
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            _detach_from_hook(parent)
            doc: dict
            try:
                doc = {"ok": _query(lib_path)}
            except BaseException as e:  # report every failure to the parent, then exit
                doc = {"error": f"{type(e).__name__}: {e}"}
                code = 1
            data = json.dumps(doc).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    try:
        answered = process.read_until_eof(r, process.deadline(timeout), chunks.append)
    finally:
        os.close(r)
        process.kill_and_reap(pid)  # it exits after writing; a hung one is stopped here
    if not answered:
        raise NvmlUnavailable(f"NVML did not answer within {timeout:g} s")
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError:
        raise NvmlUnavailable("NVML query process died without an answer") from None
    if "error" in doc:
        raise NvmlUnavailable(doc["error"])
    return doc["ok"]


def library_path(files: dict) -> str | None:
    for lib in files["libraries"]:
        if lib["name"] == "libnvidia-ml.so" and lib["kind"] == "library":
            return lib["source"]
    return None
