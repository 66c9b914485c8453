"""Read the driver's procfs files under the host root: /proc/driver/nvidia and /proc/devices."""

from __future__ import annotations

import os

from ..rootpath import join

NVIDIA = "/proc/driver/nvidia"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def driver_version(root: str) -> str | None:
    """From 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  <date>' (also the
    open module's '... Open Kernel Module for x86_64  580.65.06  Release Build ...')."""
    text = _read(join(root, NVIDIA + "/version"))
    if not text:
        return None
    first = text.splitlines()[0] if text.splitlines() else ""
    for token in first.split():
        parts = token.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return token
    return None


def gpus(root: str) -> tuple[list[dict], list[str]]:
    """GPUs in PCI bus order (NVML's default index order), and problems found."""
    base = join(root, NVIDIA + "/gpus")
    problems: list[str] = []
    try:
        buses = sorted(os.listdir(base))
    except OSError:
        return [], []
    out = []
    for bus in buses:
        text = _read(f"{base}/{bus}/information")
        if text is None:
            problems.append(f"{NVIDIA}/gpus/{bus}/information is missing or unreadable")
            continue
        f = _fields(text)
        minor = f.get("Device Minor", "")
        if not minor.isdigit():
            problems.append(f"{NVIDIA}/gpus/{bus}/information has no Device Minor; GPU skipped")
            continue
        if f.get("GPU Excluded", "No").lower().startswith("yes"):
            problems.append(f"GPU {bus} is excluded by the driver; skipped")
            continue
        if "Bus Location" not in f:
            problems.append(f"{NVIDIA}/gpus/{bus}/information has no Bus Location; using the directory name")
        out.append({
            "index": len(out),
            "minor": int(minor),
            "uuid": f.get("GPU UUID", ""),
            "bus_id": f.get("Bus Location", bus).lower(),
            "proc_dir": f"{NVIDIA}/gpus/{bus}",
            "model": f.get("Model", "unknown"),
            "brand": None, "brand_id": None, "cc": None, "mig_mode": None, "migs": [],
            "source": "procfs",
        })
    return out, problems


def char_majors(root: str) -> dict[str, int]:
    text = _read(join(root, "/proc/devices")) or ""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def mig_minors(root: str) -> dict[str, int]:
    """'gpu0/gi1/ci0/access' -> minor of /dev/nvidia-caps/nvidia-cap<minor>."""
    text = _read(join(root, "/proc/driver/nvidia-caps/mig-minors")) or ""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out
