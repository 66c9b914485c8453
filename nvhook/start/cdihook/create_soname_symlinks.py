"""`create-soname-symlinks --folder DIR ...` (NVIDIA 1.18.0-rc.1's hook, and the first half of
update-ldcache): for every shared library in the folders, a link from its SONAME to it (what
`ldconfig -n` makes), read by nvhook's own ELF reader; an image's file at the name stays."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookargs import Out
    from .hookstate import Entry


def run(opts: dict, entry: Entry, out: Out) -> None:
    soname_links(opts, entry.root, entry.log)


def soname_links(opts: dict, root, log) -> None:
    import stat

    from ...apply import ldscan
    from ...apply.paths import reopen_dir
    from ...apply.symlinks import apply_symlinks
    from ...base.errors import HookError

    if not opts.get("ldconfig-path"):
        raise HookError("ldconfig-path must be specified")
    machine = os.uname().machine
    links = []
    for folder in opts.get("folder") or []:
        try:
            dfd = root.lookup(folder)
        except OSError:
            log.debug("soname.folder_missing", folder=folder)
            continue
        try:
            d = reopen_dir(dfd)
        except OSError:
            os.close(dfd)
            continue
        try:
            for name in sorted(os.listdir(d)):
                if ".so" not in name:
                    continue
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=d)
                except OSError:
                    continue  # a link or something unreadable: ldconfig -n skips links too
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    elf = ldscan.read_elf(fd, st.st_size, machine)
                finally:
                    os.close(fd)
                soname = elf[1].decode(errors="replace") if elf and elf[1] else None
                if soname and soname != name and "/" not in soname:
                    links.append({"path": folder.rstrip("/") + "/" + soname, "target": name})
        finally:
            os.close(d)
            os.close(dfd)
    apply_symlinks(root, links, log)
