"""Version strings compared the way drivers and CUDA releases are numbered.

The reference compares version strings as digit strings, which orders "465.19.01" before
"470" only by accident; here every dot component is compared as an integer.
"""

from __future__ import annotations


def parse_version(text: str) -> tuple[int, ...]:
    """'535.261.03' -> (535, 261, 3). Raises ValueError on anything else."""
    text = text.strip()
    if not text:
        raise ValueError("empty version")
    parts = text.split(".")
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"not a dotted numeric version: {text!r}")
    return tuple(int(p) for p in parts)


def compare(a: str | tuple[int, ...], b: str | tuple[int, ...]) -> int:
    """-1, 0 or 1; missing trailing components count as zero (12.2 == 12.2.0)."""
    ta = parse_version(a) if isinstance(a, str) else a
    tb = parse_version(b) if isinstance(b, str) else b
    n = max(len(ta), len(tb))
    ta = ta + (0,) * (n - len(ta))
    tb = tb + (0,) * (n - len(tb))
    return (ta > tb) - (ta < tb)


def branch(version: str) -> int:
    """The driver branch (major): '535.261.03' -> 535."""
    return parse_version(version)[0]


def cuda_from_int(value: int) -> str:
    """NVML/CUDA encode 12.2 as 12020."""
    return f"{value // 1000}.{(value % 1000) // 10}"
