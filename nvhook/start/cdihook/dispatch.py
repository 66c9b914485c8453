"""Which module does an nvidia-cdi-hook subcommand: one per subcommand, named after it, as
NVIDIA's cmd/nvidia-cdi-hook/<name>/. Each has `run(opts, entry, out)`."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def step(sub: str, opts: dict, entry: Entry, out: Out) -> None:
    """Do subcommand `sub` (parsed by hookargs.parse) on the entry's container. `noop` and an
    unknown name do nothing (the caller warned about the unknown one)."""
    if sub == "create-symlinks":
        from . import create_symlinks as mod
    elif sub == "update-ldcache":
        from . import update_ldcache as mod  # type: ignore[no-redef]
    elif sub == "create-soname-symlinks":
        from . import create_soname_symlinks as mod  # type: ignore[no-redef]
    elif sub == "chmod":
        from . import chmod as mod  # type: ignore[no-redef]
    elif sub == "enable-cuda-compat":
        from . import enable_cuda_compat as mod  # type: ignore[no-redef]
    elif sub == "disable-device-node-modification":
        from . import disable_device_node_modification as mod  # type: ignore[no-redef]
    elif sub == "update-application-profile":
        from . import update_application_profile as mod  # type: ignore[no-redef]
    else:
        return
    mod.run(opts, entry, out)
