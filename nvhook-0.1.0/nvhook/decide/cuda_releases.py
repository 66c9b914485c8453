"""CUDA toolkit releases and the Linux x86_64 drivers they need (NVIDIA's CUDA release notes,
"CUDA Toolkit and Corresponding Driver Versions" and "...Minimum Required Driver Version for
CUDA Minor Version Compatibility"; seed 003 reproduces the 7.0-11.2 rows).

Two minimums per release:
  - full: the driver the release shipped with; every feature of the runtime works from there.
  - minor: the lowest driver the runtime starts on at all. From CUDA 11 on, minor version
    compatibility lets a runtime run on any driver of its major family's baseline (11.x on
    450.80.02, 12.x on 525.60.13, 13.x on 580), minus features that need the newer driver
    (and PTX newer than the driver cannot be JIT-compiled). Before CUDA 11 there was no such
    thing: minor == full.

Keys are "X.Y" with the minimum of the release's first (GA) build. A few updates needed a newer
driver than their GA; `UPDATES` lists those by toolkit version "X.Y.Z", consulted only when
`min_driver` is given that exact three-part toolkit version (CUDA_VERSION=11.2.2). A libcudart
file version such as 11.3.109 is not a toolkit version and maps to its "X.Y" row.
"""

from __future__ import annotations

from ..base import versions

# release: (minor-version-compatibility minimum, full-feature minimum)
RELEASES: dict[str, tuple[str, str]] = {
    "7.0": ("346.46", "346.46"),
    "7.5": ("352.31", "352.31"),
    "8.0": ("367.48", "367.48"),       # 8.0.61 GA2: 375.26
    "9.0": ("384.81", "384.81"),
    "9.1": ("390.46", "390.46"),
    "9.2": ("396.26", "396.26"),       # 9.2.148 update 1: 396.37
    "10.0": ("410.48", "410.48"),
    "10.1": ("418.39", "418.39"),
    "10.2": ("440.33", "440.33"),
    "11.0": ("450.36.06", "450.36.06"),  # 11.0.2 GA: 450.51.05, 11.0.3: 450.51.06
    "11.1": ("450.80.02", "455.23"),
    "11.2": ("450.80.02", "460.27.03"),
    "11.3": ("450.80.02", "465.19.01"),
    "11.4": ("450.80.02", "470.42.01"),
    "11.5": ("450.80.02", "495.29.05"),
    "11.6": ("450.80.02", "510.39.01"),
    "11.7": ("450.80.02", "515.43.04"),
    "11.8": ("450.80.02", "520.61.05"),
    "12.0": ("525.60.13", "525.60.13"),
    "12.1": ("525.60.13", "530.30.02"),
    "12.2": ("525.60.13", "535.54.03"),
    "12.3": ("525.60.13", "545.23.06"),
    "12.4": ("525.60.13", "550.54.14"),
    "12.5": ("525.60.13", "555.42.02"),
    "12.6": ("525.60.13", "560.28.03"),
    "12.8": ("525.60.13", "570.26"),
    "12.9": ("525.60.13", "575.51.03"),
    "13.0": ("580", "580.65.06"),
    "13.1": ("580", "590.44.01"),
}

# Toolkit updates whose full-feature minimum is above their release's GA row.
UPDATES: dict[str, str] = {
    "8.0.61": "375.26",
    "9.2.148": "396.37",
    "11.0.2": "450.51.05",
    "11.0.3": "450.51.06",
    "11.1.1": "455.32",
    "11.2.1": "460.32.03",
    "11.2.2": "460.32.03",
    "11.4.1": "470.57.02",
    "11.4.2": "470.57.02",
    "11.4.3": "470.82.01",
    "11.4.4": "470.82.01",
    "11.6.1": "510.47.03",
    "11.6.2": "510.47.03",
    "11.7.1": "515.65.01",
    "12.0.1": "525.85.12",
    "12.2.1": "535.86.09",
    "12.2.2": "535.104.05",
    "12.3.1": "545.23.08",
    "12.3.2": "545.23.08",
    "12.4.1": "550.54.15",
    "12.5.1": "555.42.06",
    "12.6.1": "560.35.03",
    "12.6.2": "560.35.03",
    "12.6.3": "560.35.05",
    "12.8.1": "570.124.06",
    "12.9.1": "575.57.08",
    "13.0.1": "580.82.07",
    "13.0.2": "580.95.05",
}

# Sorted once, newest first, for max_cuda_for_driver.
_BY_FULL = sorted(RELEASES.items(), key=lambda kv: versions.parse_version(kv[0]), reverse=True)


def release_of(cuda_version: str) -> str:
    """'11.3.109' -> '11.3'; ValueError for a non-version."""
    parts = versions.parse_version(cuda_version)
    if len(parts) < 2:
        parts = parts + (0,)
    return f"{parts[0]}.{parts[1]}"


def min_driver(cuda_version: str) -> tuple[str, str] | None:
    """(minor-compat minimum, full-feature minimum) drivers for a CUDA version, or None for a
    release not in the table (too old, or newer than this table: see `known_newest`)."""
    try:
        rel = release_of(cuda_version)
    except ValueError:
        return None
    row = RELEASES.get(rel)
    if row is None:
        return None
    full = UPDATES.get(cuda_version.strip(), row[1])
    return row[0], full


def max_cuda_for_driver(driver_version: str) -> str | None:
    """The newest CUDA release whose full-feature minimum the driver meets: '460.80' -> '11.2'.
    None for a driver older than CUDA 7.0's minimum or not a version."""
    try:
        versions.parse_version(driver_version)
    except (ValueError, AttributeError):
        return None
    for rel, (_minor, full) in _BY_FULL:
        if versions.compare(driver_version, full) >= 0:
            return rel
    return None


def known_newest() -> str:
    return _BY_FULL[0][0]
