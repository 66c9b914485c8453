"""Device access on this host, for people: the cgroup mode nvhook would act in, what it does
there, what can take that access away again, and `/dev/char` links for runc 1.1.3-1.1.6.

Used by `nvhook info`, `nvhook doctor` and `nvhook system create-dev-char-links`; nothing here
is on the container-start path (the hook itself uses apply.cgroups).
"""

from __future__ import annotations

import os
import stat
import subprocess

from ..apply import cgroups
from ..base.errors import HookError
from ..base.files import replace_symlink

DAEMON_RELOAD = (
    "access a hook grants is not in config.json: with the systemd cgroup driver, systemd re-applies the "
    "container's device policy on `systemctl daemon-reload` (and some unit changes) and takes it away; "
    "CUDA then fails with \"Failed to initialize NVML: Unknown Error\". Durable: let the runtime carry the "
    "devices (config.json linux.resources.devices and linux.devices), as CDI specs or a runtime wrapper do")
RUNC_DEV_CHAR = (
    "runc {version} (1.1.3 to 1.1.6) hands systemd the device rules of config.json as /dev/char/MAJ:MIN "
    "paths, and the NVIDIA nodes have no such links (they are not made by udev): the GPU rules are lost on "
    "the next daemon-reload (runc#3671). Create the links: `nvhook system create-dev-char-links`")


def _has_cgroup2_mount(mountinfo: str) -> bool:
    return any(line.partition(" - ")[2].startswith("cgroup2 ") for line in mountinfo.splitlines())


def describe(cgroup_root: str = cgroups.CGROUP_ROOT, mountinfo_path: str = "/proc/self/mountinfo") -> dict:
    """{"mode", "hybrid", "action"}: the mode as the hook would decide it in this mount
    namespace, and what nvhook does about device access there."""
    mode = cgroups.cgroup_mode(cgroup_root)
    try:
        with open(mountinfo_path) as f:
            hybrid = mode == "v1" and _has_cgroup2_mount(f.read())
    except OSError:
        hybrid = False
    return {"mode": mode, "hybrid": hybrid, "action": cgroups.ACTIONS[mode]}


def mode_text(d: dict) -> str:
    if d["mode"] == "v2":
        return "cgroup v2 (unified)"
    if d["mode"] == "v1":
        return "cgroup v1 (hybrid: cgroup2 is mounted too, runtimes use v1)" if d["hybrid"] else "cgroup v1"
    return "no cgroup filesystem at /sys/fs/cgroup"


def runc_version() -> str | None:
    """`runc --version`'s number, or None when there is no runc on PATH."""
    try:
        out = subprocess.run(["runc", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.split("\n", 1)[0].split()
    return first[2] if len(first) >= 3 and first[:2] == ["runc", "version"] else None


def needs_dev_char_links(version: str | None) -> bool:
    """runc 1.1.3 to 1.1.6 (Debian 12's 1.1.5+ds1 included)."""
    if not version:
        return False
    nums = []
    for part in version.split("+")[0].split("-")[0].split(".")[:3]:
        if not part.isdigit():
            return False
        nums.append(int(part))
    return len(nums) == 3 and (1, 1, 3) <= tuple(nums) <= (1, 1, 6)


def runtime_carries(config: dict, nvidia: list[tuple[int, int]]) -> bool:
    """Whether config.json gives the container its NVIDIA devices itself: it lists at least one
    of the host's NVIDIA device numbers `nvidia` in linux.devices, and linux.resources.devices
    allows (rw) every NVIDIA node it lists. Such access is the runtime's own: it survives a
    daemon-reload."""
    linux = config.get("linux") if isinstance(config, dict) else None
    if not isinstance(linux, dict):
        return False
    res = linux.get("resources")
    if not isinstance(res, dict):
        res = {}
    rules = [r for r in res.get("devices") or [] if isinstance(r, dict)]
    known = set(nvidia)
    listed = [(d.get("major"), d.get("minor")) for d in linux.get("devices") or [] if isinstance(d, dict)]
    numbers = [(ma, mi) for ma, mi in known if (ma, mi) in listed]
    if not numbers:
        return False

    def allowed(major: int, minor: int) -> bool:
        verdict = False  # the last matching rule wins, as runtimes apply them
        for r in rules:
            if r.get("type", "a") not in ("a", "c") or "r" not in (r.get("access") or "rwm") \
                    or "w" not in (r.get("access") or "rwm"):
                continue
            if r.get("major") not in (None, -1, major) or r.get("minor") not in (None, -1, minor):
                continue
            verdict = bool(r.get("allow"))
        return verdict

    return all(allowed(ma, mi) for ma, mi in numbers)


def host_devices(inv: dict) -> list[dict]:
    """The NVIDIA device nodes of the inventory: {"path", "major", "minor"} (host paths under /dev)."""
    out = [d for d in inv["files"]["devices"]]
    out += [g["device"] for g in inv["gpus"] if g.get("device")]
    return sorted(({"path": d["path"], "major": d["major"], "minor": d["minor"]} for d in out),
                  key=lambda d: (d["major"], d["minor"]))


def missing_dev_char_links(dev_root: str, devices: list[dict]) -> list[str]:
    missing = []
    for d in devices:
        link = os.path.join(dev_root, "char", f"{d['major']}:{d['minor']}")
        try:
            st = os.stat(link)
        except OSError:
            missing.append(link)
            continue
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (d["major"], d["minor"]):
            missing.append(link)
    return missing


def cgroup_driver(bundle_config: dict | None) -> str | None:
    """The engine's cgroup driver as the bundle shows it: runc's systemd driver takes
    linux.cgroupsPath as "slice:prefix:name", the cgroupfs driver a path (or none). None
    without a bundle (doctor --rootfs): not known."""
    if bundle_config is None:
        return None
    linux = bundle_config.get("linux")
    path = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    if isinstance(path, str) and path.count(":") == 2 and not path.startswith("/"):
        return "systemd"
    return "cgroupfs"


def report(inv: dict, root: str, bundle_config: dict | None = None) -> dict:
    """doctor's device-access section. The notes about systemd taking device access away
    (daemon-reload, runc's /dev/char paths) only where they can apply: the systemd cgroup
    driver, or a driver the bundle does not show (doctor --rootfs)."""
    d = describe()
    devices = host_devices(inv)
    version = runc_version()
    notes = []
    carried = None
    if bundle_config is not None:
        carried = runtime_carries(bundle_config, [(x["major"], x["minor"]) for x in devices])
    driver = cgroup_driver(bundle_config)
    systemd = driver != "cgroupfs"
    if d["mode"] != "none" and not carried and systemd:
        notes.append(DAEMON_RELOAD)
    missing = []
    if needs_dev_char_links(version) and systemd:
        missing = missing_dev_char_links(os.path.join(root, "dev"), devices)
        if missing:
            notes.append(RUNC_DEV_CHAR.format(version=version) + f" ({len(missing)} missing, e.g. {missing[0]})")
    return dict(d, runc=version, runtime_carries=carried, dev_char_missing=missing, notes=notes,
                cgroup_driver=driver)


# -- nvhook system create-dev-char-links ----------------------------------------------------

def _open_error(path: str, e: OSError) -> str:
    # O_NOFOLLOW|O_DIRECTORY on a link fails with ELOOP or ENOTDIR depending on the kernel
    if os.path.islink(path):
        return f"cannot open {path}: it is a symbolic link (refused: links are made only in a real directory)"
    return f"cannot open {path}: {e.strerror}"


def create_dev_char_links(devices: list[dict], dev_root: str) -> list[dict]:
    """Make `<dev_root>/char/MAJ:MIN -> ../<node>` for each device, as udev names them.

    Idempotent: a correct link is left alone. Safe where the directory is hostile: dev_root's
    last component and `char` are opened without following links (a planted `char -> /etc` is
    refused, not written through), and a wrong entry is replaced by rename(2), which replaces a
    planted link itself and never follows it. Returns {"link", "target", "action"} each."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dev_fd = os.open(dev_root, flags)
    except OSError as e:
        raise HookError(_open_error(dev_root, e)) from None
    done = []
    try:
        try:
            os.mkdir("char", 0o755, dir_fd=dev_fd)
        except FileExistsError:
            pass
        try:
            char_fd = os.open("char", flags, dir_fd=dev_fd)
        except OSError as e:
            raise HookError(_open_error(f"{dev_root.rstrip('/')}/char", e)) from None
        try:
            for d in devices:
                if not d["path"].startswith("/dev/"):
                    continue
                name = f"{d['major']}:{d['minor']}"
                target = "../" + d["path"][len("/dev/"):]
                link = f"{dev_root.rstrip('/')}/char/{name}"
                try:
                    current = os.readlink(name, dir_fd=char_fd)
                except FileNotFoundError:
                    current = None
                except OSError as e:
                    if e.errno != 22:  # EINVAL: there, but not a link (a directory, a file)
                        raise HookError(f"cannot read {link}: {e.strerror}") from None
                    current = ""
                if current == target:
                    done.append({"link": link, "target": target, "action": "unchanged"})
                    continue
                replace_symlink(char_fd, name, target, link)
                done.append({"link": link, "target": target,
                             "action": "created" if current is None else f"replaced (was {current or 'not a link'})"})
        finally:
            os.close(char_fd)
    finally:
        os.close(dev_fd)
    return done
