"""Inventories as plain data, for testing decide/ rules without a host: what observe.host
would report for a driver install, built from a few arguments. No I/O."""

from __future__ import annotations

from nvhook.base import catalog

ROOT = "/host"
DRIVER = "535.261.03"


def _lib(name: str, cap: str, kind: str = "library") -> dict:
    d = "/usr/lib/x86_64-linux-gnu" if kind == "library" else "/usr/lib/i386-linux-gnu"
    file = name + "." + DRIVER
    soname = name + ".1"
    return {"name": name, "cap": cap, "arch": "x86_64" if kind == "library" else "i386", "kind": kind,
            "path": f"{d}/{file}", "source": f"{ROOT}{d}/{file}", "file": file, "soname": soname}


def _node(path: str, major: int, minor: int, role: str, **extra) -> dict:
    return {"path": path, "source": ROOT + path, "major": major, "minor": minor, "mode": 0o666,
            "uid": 0, "gid": 0, "role": role, **extra}


def gpu(index: int, *, migs: list[tuple[int, int]] = (), brand: str | None = None, model: str = "NVIDIA A100") -> dict:
    bus = f"0000:{index + 7:02x}:00.0"
    return {"index": index, "minor": index, "uuid": f"GPU-{index:08d}", "bus_id": bus,
            "proc_dir": f"/proc/driver/nvidia/gpus/{bus}", "model": model, "brand": brand, "brand_id": None,
            "cc": None, "mig_mode": "enabled" if migs else None, "source": "procfs",
            "migs": [{"index": i, "uuid": f"MIG-{index}-{gi}-{ci}", "gi": gi, "ci": ci} for i, (gi, ci) in enumerate(migs)],
            "device": _node(f"/dev/nvidia{index}", 195, index, "gpu")}


def inventory(gpus: int | list[dict] = 2, *, libs32: bool = False, imex: int = 0, procfs=("version", "params", "registry"),
              mig_caps: dict[str, int] | None = None) -> dict:
    gs = [gpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    libraries = [_lib(name, cap) for name, cap, _ in catalog.LIBRARY_ROWS]
    if libs32:
        libraries += [_lib(name, cap, "library32") for name, cap, _ in catalog.LIBRARY_ROWS]
    devices = [_node("/dev/nvidiactl", 195, 255, "control"), _node("/dev/nvidia-uvm", 235, 0, "uvm"),
               _node("/dev/nvidia-uvm-tools", 235, 1, "uvm-tools"), _node("/dev/nvidia-modeset", 195, 254, "modeset")]
    for name, minor in sorted((mig_caps or {}).items(), key=lambda kv: kv[1]):
        devices.append(_node(f"/dev/nvidia-caps/nvidia-cap{minor}", 241, minor, "mig-cap", cap_name=name))
    devices += [_node(f"/dev/nvidia-caps-imex-channels/channel{n}", 242, n, "imex") for n in range(imex)]
    files = {
        "root": ROOT, "driver": {"version": DRIVER, "source": "procfs"}, "libraries": libraries,
        "binaries": [{"name": n, "cap": c, "path": f"/usr/bin/{n}", "source": f"{ROOT}/usr/bin/{n}"}
                     for n, c, _ in catalog.BINARY_ROWS],
        "devices": devices,
        "ipc": [{"path": p, "source": ROOT + p, "cap": c, "socket": p.endswith("/socket")}
                for p, c, _ in catalog.IPC_ROWS],
        "firmware": [{"path": f"/lib/firmware/nvidia/{DRIVER}/gsp_ga10x.bin",
                      "source": f"{ROOT}/lib/firmware/nvidia/{DRIVER}/gsp_ga10x.bin"}],
        "configs": [{"path": p, "source": ROOT + p, "cap": c} for p, c, _ in catalog.CONFIG_ROWS],
        "procfs": list(procfs), "mig_minors": dict(mig_caps or {}), "problems": [],
    }
    return {"root": ROOT, "files": files, "gpus": gs, "driver": {"version": DRIVER, "cuda": "12.2"}}


def request(devices=("0",), capabilities=("utility", "compute"), kind: str = "devices", **extra) -> dict:
    return {"kind": kind, "devices": list(devices), "capabilities": list(capabilities), "requirements": [],
            "requirement_sources": [], "devices_source": "env", "privileged": False, "reason": None, **extra}


DEBIAN = {"debian": True, "compat_libs": []}
RHEL = {"debian": False, "compat_libs": []}
HOST_DECISION = {"decision": "host", "reason": "test", "libraries": []}
CONFIG = {"ldconfig": {"path": "builtin"}}
