"""The CDI readers installed on the host (podman, containerd, Docker, CRI-O) and the newest CDI
spec version each one's CDI library accepts, read from the binary itself.

Every engine compiles in its own copy of the CDI library (container-device-interface), and a
spec labelled with a version that copy does not know is refused whole: podman 4.3.1 (library
0.5) refuses cdiVersion 0.6.0 and later, so no GPU device of the spec resolves. A version
string or `--version` says nothing about which library was vendored, so the binary is read:

- libraries from 0.6 on name one function per spec version that needs a check
  (`requiresV060` ... `requiresV080`, kept in the symbol table of every Go binary): the newest
  one is the newest version that library knows;
- older libraries list their known versions as one run of string constants
  ("0.1.0" "0.2.0" ... "0.5.0", adjacent in the binary's read-only data).

Measured on Debian's builds: podman 4.3.1 -> 0.5.0; Debian 13's podman 5.4 and containerd
1.7.24 (system library 0.8.0) -> 0.8.0; Docker 26.1.5 (vendored 0.7) -> 0.7.0.

This reads tens of MiB per engine, so `cdi generate` does it only when the spec it is about to
write needs a version above 0.5.0 (which every engine with CDI takes) or when asked.
"""

from __future__ import annotations

import mmap
import os

from ...base import rootpath

# Where the engines that read CDI specs are installed, under the host root: the distributions'
# and the static tarballs' locations. k3s and RKE2 keep a containerd of their own elsewhere
# (/var/lib/rancher/...): not looked for; `--cdi-version` serves those hosts.
BIN_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin")
ENGINES = (("podman", "podman"), ("containerd", "containerd"), ("docker", "dockerd"), ("cri-o", "crio"))

_CDI = b"container-device-interface"
_REQUIRES = b".requiresV0"  # pkg/cdi.requiresV070 (0.6, 0.7) or specs-go.requiresV080 (0.8 on)
_OLD_RUN = b"0.1.00.2.00.3.0"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def max_cdi_version(path: str) -> str | None:
    """The newest cdiVersion the CDI library compiled into the binary at `path` accepts, or None
    when the binary has no CDI library (or cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            if m.find(_CDI) < 0:
                return None
            found = set()
            at = m.find(_REQUIRES)
            while at >= 0:
                digits = m[at + len(_REQUIRES):at + len(_REQUIRES) + 2]
                if digits.isdigit():
                    found.add(f"0.{digits[0] - 48}.{digits[1] - 48}")
                at = m.find(_REQUIRES, at + 1)
            if found:
                return max(found, key=_version_key)
            at = m.find(_OLD_RUN)
            if at < 0:
                return "0.3.0"
            best = "0.3.0"
            pos = at
            while True:  # "0.1.0" "0.2.0" ... adjacent, up to the first string that is no 0.x.y
                v = m[pos:pos + 5].decode("ascii", "replace")
                if not (v[:2] == "0." and v[2].isdigit() and v[3] == "." and v[4].isdigit()):
                    break
                if _version_key(v) > _version_key(best):
                    best = v
                pos += 5
            return best
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def cdi_readers(root: str) -> list[dict]:
    """[{"engine", "path" (on the host), "max_version"}] for each CDI reader installed under
    `root`, the first binary of each name found in BIN_DIRS (links followed inside the root)."""
    out = []
    for engine, binary in ENGINES:
        for d in BIN_DIRS:
            inside = rootpath.resolve(root, f"{d}/{binary}")
            if inside is None:
                continue
            host = rootpath.join(root, inside)
            if not os.path.isfile(host):
                continue
            version = max_cdi_version(host)
            if version is not None:
                out.append({"engine": engine, "path": rootpath.join(root, f"{d}/{binary}"), "max_version": version})
            break
    return out
