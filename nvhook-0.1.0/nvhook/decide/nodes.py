"""Which host device nodes a request needs that the driver did not create. Pure: no I/O.

The kernel modules register their majors (/proc/devices) but leave some nodes to
nvidia-modprobe, which a host without NVIDIA's container stack may never run: nvidia-uvm and
nvidia-uvm-tools (created on first CUDA use), the MIG capability nodes under
/dev/nvidia-caps (created on demand), and IMEX channel nodes (created by `nvidia-modprobe -i`,
one per channel, on GB200 NVL systems). With devices.create_missing_nodes the hook creates
the ones a container asked for, as nvidia-modprobe would (apply/hostnodes.py); this module only
says which, with their numbers and ownership.
"""

from __future__ import annotations

from . import plan

# Majors by the name the module registers in /proc/devices.
UVM_MAJOR = "nvidia-uvm"
CAPS_MAJOR = "nvidia-caps"
IMEX_MAJOR = "nvidia-caps-imex-channels"
# Channels the driver accepts by default (NVreg_ImexChannelCount = 2048).
IMEX_CHANNELS = 2048


def _node(path: str, role: str, major: int, minor: int, owner: tuple[int, int, int], **extra: str) -> dict:
    mode, uid, gid = owner
    return {"path": path, "role": role, "major": major, "minor": minor, "mode": mode, "uid": uid, "gid": gid,
            **extra}


def missing(request: dict, files: dict, capabilities: list[str], selected_migs: list[dict], managed: list[dict],
            majors: dict[str, int], owner: tuple[int, int, int], cap_modes: dict[str, int]) -> list[dict]:
    """The nodes to create: [{path, role, major, minor, mode, uid, gid (, cap_name)}].

    owner: (mode, uid, gid) the driver gives its nodes (DeviceFileMode/UID/GID in
    /proc/driver/nvidia/params); cap_modes: a MIG capability's mode from its procfs file
    (DeviceFileMode), by mig-minors name. A node whose major the host does not list (module
    not loaded) is not created; the plan then says what is missing."""
    have = {d["path"] for d in files["devices"]}
    out: list[dict] = []
    if "compute" in plan.expand_capabilities(capabilities) and UVM_MAJOR in majors:
        for path, role, uvm_minor in (("/dev/nvidia-uvm", "uvm", 0), ("/dev/nvidia-uvm-tools", "uvm-tools", 1)):
            if path not in have:
                out.append(_node(path, role, majors[UVM_MAJOR], uvm_minor, owner))
    if CAPS_MAJOR in majors:
        names = [name for name, _ in plan.mig_access_names(selected_migs)]
        if managed:
            names += [n for key, n in (("mig_config", "config"), ("mig_monitor", "monitor")) if request.get(key)]
        mig_minors: dict[str, int] = files["mig_minors"]
        for name in dict.fromkeys(names):
            minor = mig_minors.get(name)
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            if minor is not None and path not in have:
                out.append(_node(path, "mig-cap", majors[CAPS_MAJOR], minor,
                                 (cap_modes.get(name, 0o444), 0, 0), cap_name=name))
    if IMEX_MAJOR in majors:
        for ch in request.get("imex", []):
            path = f"/dev/nvidia-caps-imex-channels/channel{ch}"
            if ch.isascii() and ch.isdigit() and int(ch) < IMEX_CHANNELS and path not in have:
                out.append(_node(path, "imex", majors[IMEX_MAJOR], int(ch), owner))
    return out
