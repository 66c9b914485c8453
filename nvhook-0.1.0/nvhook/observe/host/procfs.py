"""Read the driver's procfs files under the host root: /proc/driver/nvidia and /proc/devices."""

from __future__ import annotations

import os

from ...base.rootpath import join

NVIDIA = "/proc/driver/nvidia"


def _read(path: str) -> str | None:
    # O_NONBLOCK: under --root a FIFO in place of a procfs file must not block the hook.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    chunks: list[bytes] = []
    size = 0
    try:
        # Plain reads, not os.fdopen: a directory in a file's place made fdopen raise with the
        # fd still open, one leaked fd per read.
        while size < 1 << 16 and (b := os.read(fd, (1 << 16) - size)):
            chunks.append(b)
            size += len(b)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def read_small(path: str) -> str | None:
    """A small file (procfs, sysfs) read without blocking on a FIFO, None when unreadable."""
    return _read(path)


def unreadable(path: str) -> str | None:
    """Why `path` cannot be read now when that is no fact about the driver (EMFILE, EACCES,
    EIO: the reader's situation), else None (read fine, or absent: the module not loaded)."""
    from ...base.rootpath import FACT_ERRNOS

    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError as e:
        if e.errno not in FACT_ERRNOS:
            return f"cannot read {path}: {e.strerror}"
    return None


def _number(text: str) -> int | None:
    """A device number: ASCII digits only (str.isdigit() also accepts '²', which int() refuses)
    and short enough for int() (it refuses more than 4300 digits)."""
    if text.isascii() and text.isdigit() and len(text) <= 10:
        return int(text)
    return None


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def version_line(root: str) -> str | None:
    """The module's version line, which changes with every module build: part of the cache
    stamp (procfs inodes' own identities are not stable)."""
    text = _read(join(root, NVIDIA + "/version"))
    return text.split("\n", 1)[0] if text is not None else None


def driver_version(root: str) -> str | None:
    """From 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  <date>' (also the
    open module's '... Open Kernel Module for x86_64  580.65.06  Release Build ...')."""
    return version_in(_read(join(root, NVIDIA + "/version")) or "")


def version_in(text: str) -> str | None:
    """The driver version in the text of /proc/driver/nvidia/version (driver_version)."""
    first = text.splitlines()[0] if text.splitlines() else ""
    for token in first.split():
        parts = token.split(".")
        if len(parts) >= 2 and all(p.isascii() and p.isdigit() for p in parts):
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
    out: list[dict] = []
    for bus in buses:
        text = _read(f"{base}/{bus}/information")
        if text is None:
            problems.append(f"{NVIDIA}/gpus/{bus}/information is missing or unreadable")
            continue
        f = _fields(text)
        minor = _number(f.get("Device Minor", ""))
        if minor is None:
            problems.append(f"{NVIDIA}/gpus/{bus}/information has no Device Minor; GPU skipped")
            continue
        if (f.get("GPU Excluded") or f.get("Blacklisted") or "No").lower().startswith("yes"):  # before 460: Blacklisted
            problems.append(f"GPU {bus} is excluded by the driver; skipped")
            continue
        if "Bus Location" not in f:
            problems.append(f"{NVIDIA}/gpus/{bus}/information has no Bus Location; using the directory name")
        out.append({
            "index": len(out),
            "minor": minor,
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
        major = _number(parts[0]) if in_char and len(parts) == 2 else None
        if major is not None:
            majors.setdefault(parts[1], major)
    return majors


def mig_minors(root: str) -> dict[str, int]:
    """'gpu0/gi1/ci0/access' -> minor of /dev/nvidia-caps/nvidia-cap<minor>."""
    text = _read(join(root, "/proc/driver/nvidia-caps/mig-minors")) or ""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        minor = _number(parts[1]) if len(parts) == 2 else None
        if minor is not None:
            out[parts[0]] = minor
    return out


def mig_instances(root: str) -> list[str]:
    """The MIG instances that exist now: 'gpu0/gi1', 'gpu0/gi1/ci0', ... from
    /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<N>/ci<M> (the driver creates these
    directories with the GPU and compute instances)."""
    base = join(root, NVIDIA + "/capabilities")
    out: list[str] = []
    try:
        gpus = [n for n in os.listdir(base) if n.startswith("gpu")]
    except OSError:
        return out
    for gpu in sorted(gpus):
        try:
            gis = [n for n in os.listdir(f"{base}/{gpu}/mig") if n.startswith("gi")]
        except OSError:
            continue
        for gi in sorted(gis):
            out.append(f"{gpu}/{gi}")
            try:
                cis = [n for n in os.listdir(f"{base}/{gpu}/mig/{gi}") if n.startswith("ci")]
            except OSError:
                continue
            out.extend(f"{gpu}/{gi}/{ci}" for ci in sorted(cis))
    return out


def device_file_owner(root: str) -> tuple[int, int, int]:
    """(mode, uid, gid) the driver gives its device nodes: DeviceFileMode/UID/GID in params
    (decimal), 0666 root:root when absent, as nvidia-modprobe assumes."""
    f = _fields(_read(join(root, NVIDIA + "/params")) or "")
    mode, uid, gid = (_number(f.get(k, "")) for k in ("DeviceFileMode", "DeviceFileUID", "DeviceFileGID"))
    return (mode & 0o777 if mode is not None else 0o666, uid if uid is not None else 0, gid if gid is not None else 0)


def capability_modes(root: str, names: list[str]) -> dict[str, int]:
    """A MIG capability's node mode (DeviceFileMode, decimal) from its file under
    /proc/driver/nvidia/capabilities, by mig-minors name (gpu0/gi1/access -> gpu0/mig/gi1/access)."""
    out: dict[str, int] = {}
    for name in names:
        rel = name.replace("/", "/mig/", 1) if name.startswith("gpu") else f"mig/{name}"
        mode = _number(_fields(_read(join(root, f"{NVIDIA}/capabilities/{rel}")) or "").get("DeviceFileMode", ""))
        if mode is not None:
            out[name] = mode & 0o777
    return out
