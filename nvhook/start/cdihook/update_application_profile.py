"""`update-application-profile` (NVIDIA 1.20): the driver application profile that shows EGL
and Vulkan only the container's GPUs, as NVIDIA's cmd/nvidia-cdi-hook/update-application-profile:
one bit per /dev/nvidiaN character device in the container's /dev (decide/appprofile.py), written
to /etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf by fd inside the root
(apply/profilefile.py); nothing when the container has no such node. Whatever the container's
capabilities, as NVIDIA's: the spec's author put the entry there."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    from ...apply import profilefile
    from ...decide import appprofile

    text, dropped = appprofile.profile_text(appprofile.gpu_minors(profilefile.gpu_nodes(entry.root)))
    for minor in dropped:
        out.say("warning", f"dropping invalid minor number {minor}: must be in range [0, {appprofile.MASK_BITS - 1}]")
    if text is None:
        entry.log.debug("app_profile.none", reason="no /dev/nvidiaN character device in the container")
        return
    why = profilefile.write_profile(entry.root, text, entry.log)
    if why is not None:
        out.say("warning", why)
