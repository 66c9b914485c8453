"""`create-symlinks --link TARGET::LINK ...`: the links in the rootfs, each resolved inside it
(apply/symlinks.py), as NVIDIA's cmd/nvidia-cdi-hook/create-symlinks."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    from ...apply.symlinks import apply_symlinks
    from ...base.errors import HookError

    links, seen = [], set()
    for spec in opts.get("link") or []:
        if spec in seen:
            continue
        seen.add(spec)
        parts = spec.split("::")
        if len(parts) != 2:
            raise HookError(f"invalid symlink specification {spec}")
        links.append({"path": parts[1], "target": parts[0]})
    apply_symlinks(entry.root, links, entry.log)
