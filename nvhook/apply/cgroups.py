"""Device cgroup rules for the container, written from the host side.

cgroup v1: the devices controller's mount is found in the hook's own /proc/self/mountinfo (the
host's view, read before anything enters the container's namespaces), the container's cgroup in
/proc/<pid>/cgroup (`N:devices:/path`, relative to the mount's root), and each rule
`c MAJ:MIN rw` is written with its own write(2) to `<mount>/<path>/devices.allow` (the kernel
parses one rule per write). One `cgroups.allowed` event lists the rules written.

cgroup v2 (unified hierarchy only): device access is an eBPF program the runtime (runc, crun)
attaches to the container's cgroup, built from config.json `linux.resources.devices`. nvhook does
not load BPF programs: it changes nothing and logs `cgroups.v2_not_managed` telling the user to
list the devices in config.json (or use CDI, whose spec edits do exactly that). A runtime whose
default device policy is "allow all" is unaffected either way.

A plan with no devices_cgroup entries touches nothing here.
"""

from __future__ import annotations

import os

from ..base.errors import HookError


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, str | None]:
    """((root, mount point) of the v1 devices controller or None, a cgroup2 mount point or None)."""
    devices = None
    unified = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        post_f = post.split(" ")
        if len(post_f) < 3:
            continue
        fstype = post_f[0]
        if fstype == "cgroup":
            if "devices" in post_f[2].split(","):
                f = pre.split(" ")
                devices = (_unescape(f[3]), _unescape(f[4]))
        elif fstype == "cgroup2" and unified is None:
            unified = _unescape(pre.split(" ")[4])
    return devices, unified


def container_cgroup(pid: int) -> tuple[str | None, str | None]:
    """(v1 devices cgroup path, v2 path) of process `pid`, from /proc/<pid>/cgroup."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except FileNotFoundError:
        raise HookError(f"container process {pid} is gone") from None
    v1 = v2 = None
    for line in text.splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if num == "0" and controllers == "":
            v2 = path
        elif "devices" in controllers.split(","):
            v1 = path
    return v1, v2


def rule_text(rule: dict) -> str:
    kind = rule.get("type", "c")
    access = rule.get("access", "rw")
    major, minor = rule.get("major"), rule.get("minor")
    if kind not in ("c", "b", "a") or not access or set(access) - set("rwm") or major is None or minor is None:
        raise HookError(f"invalid device cgroup rule in the plan: {rule}")
    return f"{kind} {major}:{minor} {access}"


def apply_devices(rules: list, pid: int, log, mountinfo_path: str = "/proc/self/mountinfo") -> int:
    """Allow `rules` for the container's cgroup; returns how many were written."""
    if not rules:
        return 0
    texts = [rule_text(r) for r in rules]
    with open(mountinfo_path) as f:
        devices, unified = find_mounts(f.read())
    v1_path, v2_path = container_cgroup(pid)
    if devices is None or v1_path is None:
        if unified is not None and v2_path is not None:
            log.warning(
                "cgroups.v2_not_managed", rules=texts, cgroup=v2_path,
                reason="this host uses cgroup v2, where device access is an eBPF program the "
                       "runtime builds from config.json linux.resources.devices; nvhook did not "
                       "change it. If the container cannot open the GPU devices, list them in "
                       "linux.resources.devices (or inject them with CDI)")
        else:
            log.warning("cgroups.not_found", rules=texts,
                        reason="no devices cgroup controller found for the container; "
                               "nvhook wrote no device rules")
        return 0
    mount_root, mount_point = devices
    rel = v1_path
    if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root + "/")):
        rel = rel[len(mount_root):]
    directory = (mount_point.rstrip("/") + "/" + rel.strip("/")).rstrip("/") or "/"
    allow = directory.rstrip("/") + "/devices.allow"
    try:
        fd = os.open(allow, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open {allow} to allow the GPU devices: {e.strerror}") from None
    done = 0
    try:
        for text in texts:
            os.write(fd, text.encode())
            done += 1
    except OSError as e:
        raise HookError(f"cannot allow '{texts[done]}' in {allow}: {e.strerror} "
                        f"({done} of {len(texts)} rules written)") from None
    finally:
        os.close(fd)
        # One event for all rules: a MIG container has over a hundred, and a line each made
        # the log's biggest part. A failure still says which rules made it in.
        if done:
            log.info("cgroups.allowed", rules=texts[:done], cgroup=directory)
    return done
