"""The Debian root filesystems the node tests run their engines from: built once per machine with
debootstrap from the machine's own Debian mirror (read from its apt sources) and kept under
/var/cache/nvhook-tests/node-<key>/rootfs, where <key> hashes the suite, the package lists and
the build steps (change one and the next run builds a new root and removes the old ones).

Two suites, two generations of engines GPU clusters run:
- trixie (Debian 13): containerd 1.7 (CDI, NRI), runc 1.1.15, crun 1.21, podman 5.4, docker.io 26;
- sid (Debian unstable): containerd 2.1 (config version 3, NRI and CDI on by default), runc 1.3,
  crun 1.28, podman 5.8, docker.io 28.5.
They link against their suite's glibc, so they run inside their root, not on the machine itself.

    python tests/node/noderoot.py [--suite trixie|sid] [--rebuild]    builds one (`make node`
    builds both), prints its path

The root is only ever read: each node session mounts it as the lower layer of its own overlay
(tests/node/node.py), so concurrent sessions share one copy and none can change it. Standard
library only.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUITE = "trixie"  # the default root: the one every node test runs on
SUITES = ("trixie", "sid")
CACHE = Path(os.environ.get("NVHOOK_TEST_CACHE", "/var/cache/nvhook-tests"))
# What the node runs: the engines, and python3 with venv for nvhook itself (installed from its
# wheel, as an operator's pip would). minbase keeps debootstrap to about two minutes on two
# cores; nothing in the root is started at build time.
PACKAGES = ("containerd", "runc", "crun", "python3", "python3-venv", "ca-certificates", "procps",
            "iproute2", "kmod")
# podman 5 and Docker 26 (dockerd is docker.io, the `docker` command docker-cli, only a
# Recommends of it): installed in a second step with every service start refused (policy-rc.d),
# since a dockerd started by a package script inside a chroot would share the machine's network
# and rewrite its iptables. The node starts its own dockerd (node.py: Node.start_dockerd).
# uidmap (newuidmap, newgidmap: set-user-ID root, only a Recommends of podman) is what rootless
# podman maps a user's subordinate ids with (tests/node/test_engine_podman_rootless.py); with
# `--network none` it needs no passt or slirp4netns, and its storage is the kernel's overlay in
# the user namespace (no fuse-overlayfs).
EXTRA = ("podman", "docker.io", "docker-cli", "uidmap")
COMPLETE = ".complete"


class NoMirror(Exception):
    """The machine's apt sources name no Debian archive to build from."""


def cache_key(suite: str = SUITE) -> str:
    # The suite, the package lists and the steps that make the root: not the docstrings, so that
    # editing the text around them does not rebuild a root.
    h = hashlib.sha256()
    h.update(f"{suite}\n{' '.join(PACKAGES)}\n{' '.join(EXTRA)}\n{_EXTRA_SCRIPT}\n".encode())
    h.update(inspect.getsource(build).encode())
    return h.hexdigest()[:16]


def root_path(suite: str = SUITE) -> Path:
    return CACHE / f"node-{cache_key(suite)}" / "rootfs"


def machine_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 .sources or one-line lists), so that
    the build fetches from where the machine already may. No fallback: a machine whose apt has
    no Debian archive raises NoMirror, and the build says so in one line."""
    candidates = []
    d = Path("/etc/apt/sources.list.d")
    files = sorted(d.glob("*.sources")) + sorted(d.glob("*.list")) if d.is_dir() else []
    files.append(Path("/etc/apt/sources.list"))
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        candidates += re.findall(r"^URIs:\s*(\S+)", text, re.M)
        candidates += re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M)
    for uri in candidates:
        if uri.rstrip("/").endswith("/debian") and "security" not in uri:
            return uri
    raise NoMirror("the machine's apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d) name no "
                   "Debian archive (a URI ending in /debian): add one, or build the root elsewhere")


def cannot_build(suite: str = SUITE) -> str | None:
    """Why this machine cannot build or run the node (None when it can)."""
    if os.geteuid() != 0:
        return "the node tests need root (debootstrap, mount namespaces, containerd)"
    for tool in ("unshare", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} is missing (util-linux)"
    if (root_path(suite) / COMPLETE).exists():
        return None
    if not shutil.which("debootstrap"):
        return "debootstrap is not installed (.ci/deps test installs it; apt-get install debootstrap)"
    if not Path(f"/usr/share/debootstrap/scripts/{suite}").exists():
        return f"this debootstrap has no script for {suite} (a newer debootstrap has)"
    try:
        machine_mirror()
    except NoMirror as e:
        return str(e)
    return None


def _run(cmd: list[str], log, **kw) -> None:
    log.write(f"$ {' '.join(cmd)}\n".encode())
    log.flush()
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=True, **kw)


# Runs inside a private mount namespace (unshare -m): /proc and /dev for the package scripts are
# mounted there, never on the machine's own mount table.
_EXTRA_SCRIPT = """set -eu
root=$1; shift
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
printf '#!/bin/sh\\nexit 101\\n' > "$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
export DEBIAN_FRONTEND=noninteractive
chroot "$root" apt-get -o Acquire::Retries=3 install -y -q --no-install-recommends "$@"
chroot "$root" apt-get clean
rm -f "$root/usr/sbin/policy-rc.d"
"""


def build(suite: str, dest: Path, log) -> None:
    mirror = machine_mirror()
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(dest), mirror], log,
         timeout=1200)
    if EXTRA:
        _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _EXTRA_SCRIPT, "sh", str(dest), *EXTRA],
             log, timeout=1200)
    # Nothing of the build may start in the node: units are never run there (no systemd), and
    # the engines' default configs are replaced per session; the apt caches only cost space.
    for p in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (dest / p).glob("*"):
            if f.is_file():
                f.unlink()
    (dest / "etc/hostname").write_text("nvhook-node\n")


def build_log(suite: str = SUITE) -> Path:
    return CACHE / f"build-{cache_key(suite)}.log"


def ensure(log_to: Path | None = None, suite: str = SUITE) -> Path:
    """The cached root's path, built first when missing (one builder at a time per machine;
    others wait on the lock). Raises CalledProcessError with the build log's tail on failure."""
    CACHE.mkdir(parents=True, exist_ok=True)
    final = root_path(suite)
    key = cache_key(suite)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / COMPLETE).exists():
            (final.parent / "last-used").touch()
            return final
        top = final.parent
        work = CACHE / f"building-{key}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        log_path = log_to or build_log(suite)
        started = time.monotonic()
        with open(log_path, "wb") as log:
            # twice at most: a mirror's hiccup during two hundred downloads should not fail a run
            for attempt in (1, 2):
                try:
                    build(suite, work / "rootfs", log)
                    break
                except subprocess.CalledProcessError:
                    shutil.rmtree(work / "rootfs", ignore_errors=True)
                    if attempt == 2:
                        shutil.rmtree(work, ignore_errors=True)
                        raise
                    log.write(b"build failed: trying once more\n")
                except BaseException:
                    shutil.rmtree(work, ignore_errors=True)
                    raise
            log.write(f"built in {time.monotonic() - started:.0f}s\n".encode())
        (work / "rootfs" / COMPLETE).write_text(f"{key}\n")
        shutil.rmtree(top, ignore_errors=True)
        os.rename(work, top)
        (top / "last-used").touch()
        # Roots of other keys (another package list or builder: an older checkout) go once no
        # session has used them for a day: one still in use is some session's overlay layer.
        current = {CACHE / f"node-{cache_key(s)}" for s in SUITES}
        for old in CACHE.glob("node-*"):
            used = old / "last-used"
            if old not in current and old.is_dir() and used.exists() and time.time() - used.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        return final


def main(argv: list[str]) -> int:
    suite = argv[argv.index("--suite") + 1] if "--suite" in argv[:-1] else SUITE
    if suite not in SUITES:
        print(f"noderoot: unknown suite {suite!r}: one of {', '.join(SUITES)}", file=sys.stderr)
        return 2
    reason = cannot_build(suite)
    if reason:
        print(f"noderoot: cannot build the {suite} node root here: {reason}", file=sys.stderr)
        return 1
    if "--rebuild" in argv:
        shutil.rmtree(root_path(suite).parent, ignore_errors=True)
    try:
        print(ensure(Path("/dev/stderr") if "-v" in argv else None, suite))
    except subprocess.CalledProcessError as e:
        print(f"noderoot: {' '.join(map(str, e.cmd))[:200]} failed (exit {e.returncode}); "
              f"log: {build_log(suite)}", file=sys.stderr)
        return 1
    except NoMirror as e:
        print(f"noderoot: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
