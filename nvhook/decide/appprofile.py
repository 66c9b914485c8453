"""The driver application profile that limits EGL and Vulkan to the container's GPUs (pure).

The driver's EGL and Vulkan enumerate every GPU of the machine, whatever device nodes the
container has, and fail or pick a GPU the container cannot open. The driver reads application
profiles from /etc/nvidia/nvidia-application-profiles-rc.d/ (each file a JSON document); the
setting EGLVisibleDGPUDevices is a bit mask of the /dev/nvidiaN minors EGL may use. NVIDIA
1.20's `nvidia-cdi-hook update-application-profile` writes 10-container.conf there with one
bit per /dev/nvidiaN character device in the container; nvhook writes the same bytes
(apply/profilefile.py), from its nvidia-cdi-hook subcommand and, beyond NVIDIA, from its own
doors for a container that asks for graphics or display (docs/container-files.md).

A node is (container path, is a character device, minor), so that the listing of a container's
/dev (the nvidia-cdi-hook), the plan's device nodes (hook mode, nvhook's CDI spec) and an NRI
adjustment's devices are decided alike: `for_container(capabilities, nodes)`.
"""

from __future__ import annotations

# The capabilities whose libraries (EGL, Vulkan, GLX) read the setting.
GRAPHICS = ("graphics", "display")
MASK_BITS = 64  # the setting is a 64-bit mask: minors 0-63

_DIGITS = frozenset("0123456789")
_HEAD = '{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",'
_TAIL = ']}],"rules":[{"pattern":[],"profile":"_container_"}]}'


def is_gpu_node(path: str) -> bool:
    """/dev/nvidiaN (N decimal digits): a GPU's node, not nvidiactl, nvidia-uvm, nvidia-caps/..."""
    if not path.startswith("/dev/nvidia"):
        return False
    digits = path[len("/dev/nvidia"):]
    return bool(digits) and _DIGITS.issuperset(digits)


def gpu_minors(nodes: list[tuple[str, bool, int]]) -> list[int]:
    """The minors of the nodes that are GPU character devices, in the nodes' order (the minor
    is the node's own, whatever its name says)."""
    return [minor for path, is_char, minor in nodes if is_char and is_gpu_node(path)]


def profile_text(minors: list[int]) -> tuple[str | None, list[int]]:
    """(the file's content, the minors left out because the mask has no bit for them). No
    content (None) when no bit is set: no file is written then."""
    mask = 0
    dropped = []
    for minor in minors:
        if 0 <= minor < MASK_BITS:
            mask |= 1 << minor
        else:
            dropped.append(minor)
    if not mask:
        return None, dropped
    # The format NVIDIA's hook writes (its buildApplicationProfileConfig): one line, no newline,
    # the mask in lower-case hexadecimal.
    return _HEAD + f"0x{mask:x}" + _TAIL, dropped


def wanted(capabilities: list[str]) -> bool:
    """Whether nvhook's own doors write the profile: the container asked for graphics or display."""
    return any(c in GRAPHICS for c in capabilities)


def for_container(capabilities: list[str], nodes: list[tuple[str, bool, int]]) -> tuple[str | None, list[int]]:
    """nvhook's own doors (hook mode, its CDI spec's hook, the NRI plugin): the profile for a
    container with these capabilities and device nodes, and the minors left out; (None, [])
    when it asks for neither graphics nor display."""
    if not wanted(capabilities):
        return None, []
    return profile_text(gpu_minors(nodes))
