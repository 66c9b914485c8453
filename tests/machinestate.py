"""The machine's own files that no test may change: tests write under private roots, prefixes
and temp dirs only (a private dockerd, containerd or node, `nvhook setup --prefix`...)."""

from __future__ import annotations

import hashlib
import os

# What the engines, nvhook and the package tools of this machine read: checked around every
# test module (tests/conftest.py), so a write is named with the module that made it.
MACHINE_ETC = ("/etc/docker", "/etc/containerd", "/etc/containers", "/etc/crio", "/etc/cdi", "/etc/nvhook",
               "/etc/nvidia-container-runtime", "/etc/nvidia-container-toolkit", "/etc/systemd/system",
               "/etc/tmpfiles.d", "/etc/logrotate.d", "/etc/group", "/etc/gshadow", "/etc/passwd", "/etc/shadow",
               "/etc/subuid", "/etc/subgid", "/etc/ld.so.conf.d", "/usr/lib/nvhook", "/opt/nvhook",
               "/usr/local/lib/nvhook")

# The CDI spec directories under /run that engines read (/var/run is a link to /run on most
# machines, checked under both names for those where it is not): a test's spec goes in a private
# mount namespace's /run (tests/e2e/cdibox.py, rootlessbox.py), and even an empty directory left
# here is a change, so an absent one must stay absent.
MACHINE_RUN = ("/run/cdi", "/var/run/cdi")

# nvhook's own run directory (its config and inventory caches, the CDI hook's marks, nvhookd's
# socket) and its default log: a test's hooks cache in NVHOOK_RUN_DIR or in a private mount
# namespace's /run/nvhook (tests/e2e/runcbox.py), and log to a file of the test. What a machine
# already holds there (an nvhook of its own, an earlier run's leftovers) is compared, not refused:
# a file created, changed or removed is the change.
MACHINE_NVHOOK = ("/run/nvhook", "/var/log/nvhook.log")


def snapshot(tops: tuple[str, ...], root: str = "/") -> dict:
    """{path: (mode, uid, gid, size, mtime_ns, sha256 of a file's first MiB) or None when absent} of
    each top and what lies two levels below it (enough to see any config, unit or state written).
    A top that is absent is recorded as absent: creating it is a change too. `root`: the machine's
    / as seen from a private mount namespace (tests/e2e/privaterun.py); the paths are named as on
    the machine."""
    base = root.rstrip("/")
    snap = _walk(tuple(base + t for t in tops))
    return {p[len(base):]: v for p, v in snap.items()}


def _walk(tops: tuple[str, ...]) -> dict:
    snap: dict = {}
    for top in tops:
        if not os.path.lexists(top):
            snap[top] = None
            continue
        if not os.path.isdir(top) or os.path.islink(top):
            snap[top] = _entry(top)
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            if dirpath.count("/") - top.count("/") >= 2:
                dirnames[:] = []
            for name in [".", *filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
                p = dirpath if name == "." else os.path.join(dirpath, name)
                snap[p] = _entry(p)
    return snap


def _entry(p: str) -> tuple | None:
    try:
        st = os.lstat(p)
        digest = ""
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                digest = hashlib.sha256(f.read(1 << 20)).hexdigest()
        return (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, digest)
    except OSError:
        return None


def changed(before: dict, after: dict) -> list[str]:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
