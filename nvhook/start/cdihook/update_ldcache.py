"""`update-ldcache --folder DIR ... [--ldconfig-path P]`: the rootfs's ld.so.cache, written by
nvhook (apply/ldscan.py), as NVIDIA's cmd/nvidia-cdi-hook/update-ldcache leaves it; no host
ldconfig runs (docs/cdi-hook.md)."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    from ...apply import ldscan, muslpath
    from ...apply.ldconfdropin import write_conf
    from ...base.errors import HookError
    from .create_soname_symlinks import soname_links

    root, log = entry.root, entry.log
    if not opts.get("ldconfig-path"):
        raise HookError("ldconfig-path must be specified")
    # ldconfig (which NVIDIA's hook runs) also makes the SONAME links of the folders it
    # scans: the spec mounts only the versioned files (libcuda.so.535.261.03), and
    # libcuda.so.1 is what programs load.
    soname_links(opts, root, log)
    folders = [d.rstrip("/") for d in opts.get("folder") or [] if d.startswith("/")]
    if muslpath.musl_arch(root) is not None:
        # musl's loader reads neither ld.so.conf nor ld.so.cache: every folder goes into its
        # path file (NVIDIA 1.19+ appends there too, for images with /etc/alpine-release).
        ldscan.update(root, folders, log)
        return
    # As NVIDIA's hook: folders the image's loader config or its system directories already
    # cover stay where that config puts them (so a 00-compat-*.conf written by
    # enable-cuda-compat comes first), the others go into a drop-in that also keeps them for
    # an ldconfig run inside the container later.
    extra = [d for d in dict.fromkeys(folders) if d not in known_dirs(root)]
    if extra:
        write_conf(root, "/etc/ld.so.conf.d", "00-nvcr-nvhook.conf", "".join(d + "\n" for d in extra))
    known = known_dirs(root)
    ldscan.update(root, [d for d in extra if d not in known], log)


def known_dirs(root) -> set[str]:
    """The directories the image's /etc/ld.so.conf (includes followed) and the loader's own
    defaults name."""
    from ...apply import ldscan

    scan = ldscan.Scan(root)
    scan.parse_conf("/etc/ld.so.conf")
    return set(scan.paths_seen) | set(scan.system_dirs())
