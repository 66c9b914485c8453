"""`disable-device-node-modification`: the container's /proc/driver/nvidia/params reads
ModifyDeviceFiles 0 (apply/paramsmask.py does it by fd), as NVIDIA's
cmd/nvidia-cdi-hook/disable-device-node-modification."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    mask(entry.root, entry.cfg, entry.log)


def mask(root, cfg: dict, log) -> None:
    """The host's params (under nvhook's configured root) with ModifyDeviceFiles 0, over the
    container's."""
    from ...apply.paramsmask import mask_params

    mask_params(root, cfg.get("root") or "/", log)
