"""The two small files the container start writes into the container's /etc by fd: the driver
application profile (apply/profilefile.py: hook mode, the CDI hook's update-application-profile,
the NRI plugin) and the loader drop-in (apply/ldconfdropin.py: update-ldcache,
enable-cuda-compat, the NRI plugin's compat choice). What the container then has: the bytes, the
mode whatever the writer's umask, the owner in a user-namespaced root, a link the image has at
the name replaced and never followed, nothing left under a temporary name, the one-line error;
and that the start path does not fsync them (strace sees the process's calls). Each write runs
in a process of its own, as each start does, so that its umask and credentials are its own."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = "etc/nvidia/nvidia-application-profiles-rc.d"
PROFILE = f"{PROFILE_DIR}/10-container.conf"
DROPIN_DIR = "etc/ld.so.conf.d"
DROPIN = f"{DROPIN_DIR}/00-compat-nvhook.conf"
USERNS_ROOT = (100000, 100000)  # the host ids of a user-namespaced container's root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writes as the container's root (setfsuid, chown)")

_WRITE = r"""
import json, os, sys
from nvhook.apply import ldconfdropin, profilefile
from nvhook.apply.paths import Root
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog

which, rootfs, owner, umask, text = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4], 8), sys.argv[5]
os.umask(umask)
if sys.argv[6:]:  # the image's entry at this process's temporary name: a link to argv[6], or a file
    from nvhook.base.files import temp_name
    d, name = os.path.split(rootfs + ("/etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf"
                                      if which == "profile" else "/etc/ld.so.conf.d/00-compat-nvhook.conf"))
    if sys.argv[6]:
        os.symlink(sys.argv[6], os.path.join(d, temp_name(name)))
    else:
        with open(os.path.join(d, temp_name(name)), "x") as f:
            f.write("stale\n")
log = EventLog(level="debug")
root = Root(os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), owner=tuple(owner))
try:
    if which == "profile":
        profilefile.write_profile(root, text, log)
    else:
        ldconfdropin.write_conf(root, "/etc/ld.so.conf.d", "00-compat-nvhook.conf", text)
    error = None
except HookError as e:
    error = e.message
print(json.dumps({"error": error, "warnings": [w["event"] for w in log.warnings()]}))
"""


def write(which: str, rootfs: Path, text: str, owner=(0, 0), umask: int = 0o022,
          strace: Path | None = None, plant: str | None = None) -> dict:
    """`which` ("profile", "dropin") written into `rootfs` by a process of its own (`plant`: a
    link to that path at its temporary name first, "" a file); its error line (None) and
    warning events."""
    cmd = [sys.executable, "-c", _WRITE, which, str(rootfs), json.dumps(owner), oct(umask), text,
           *([] if plant is None else [plant])]
    if strace is not None:
        cmd = ["strace", "-f", "-qq", "-e", "signal=none", "-o", str(strace),
               "-e", "trace=fsync,fdatasync,sync,syncfs,sync_file_range",
               *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def rootfs_of(tmp_path: Path, owner=(0, 0), dirs=("etc",)) -> Path:
    """An image's rootfs with `dirs` (mode 0755), all owned by `owner`, as the runtime has it."""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    for d in dirs:
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for dirpath, _dirs, _files in os.walk(rootfs):
        os.chown(dirpath, *owner)
    return rootfs


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


@pytest.mark.parametrize("umask", [0o022, 0o777])
def test_the_profile_is_0444_its_directories_0555_whatever_the_umask(tmp_path, umask):
    rootfs = rootfs_of(tmp_path)
    out = write("profile", rootfs, '{"profiles":[]}', umask=umask)
    assert out == {"error": None, "warnings": []}
    assert (rootfs / PROFILE).read_text() == '{"profiles":[]}'
    modes = {p: stat.S_IMODE(os.lstat(rootfs / p).st_mode) for p in ("etc/nvidia", PROFILE_DIR, PROFILE)}
    assert modes == {"etc/nvidia": 0o555, PROFILE_DIR: 0o555, PROFILE: 0o444}
    assert leftovers(rootfs / PROFILE_DIR) == []


@pytest.mark.parametrize("umask", [0o022, 0o777])
def test_the_dropin_is_0644_and_ld_so_conf_includes_it_whatever_the_umask(tmp_path, umask):
    rootfs = rootfs_of(tmp_path)
    assert write("dropin", rootfs, "/usr/local/cuda/compat\n", umask=umask)["error"] is None
    assert (rootfs / DROPIN).read_text() == "/usr/local/cuda/compat\n"
    assert stat.S_IMODE(os.lstat(rootfs / DROPIN).st_mode) == 0o644
    assert (rootfs / "etc/ld.so.conf").read_text() == "include /etc/ld.so.conf.d/*.conf\n"
    assert leftovers(rootfs / DROPIN_DIR) == []


def test_an_images_own_ld_so_conf_is_left_as_it_is(tmp_path):
    rootfs = rootfs_of(tmp_path)
    (rootfs / "etc/ld.so.conf").write_text("/opt/lib\n")
    assert write("dropin", rootfs, "/usr/local/cuda/compat\n")["error"] is None
    assert (rootfs / "etc/ld.so.conf").read_text() == "/opt/lib\n"


@pytest.mark.parametrize("which, path", [("profile", PROFILE), ("dropin", DROPIN)])
def test_a_link_the_image_has_at_the_name_is_replaced_never_followed(tmp_path, which, path):
    """The image's link at the file's name to a file outside the root (absolute: the kernel
    would follow it from the host's /) and to one inside: each is replaced by the file, its
    target unchanged."""
    rootfs = rootfs_of(tmp_path, dirs=("etc", os.path.dirname(path)))
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")
    (rootfs / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    for target in (str(host_file), "../passwd" if which == "dropin" else "../../passwd"):
        (rootfs / path).unlink(missing_ok=True)
        os.symlink(target, rootfs / path)
        assert write(which, rootfs, "/new\n")["error"] is None
        assert not (rootfs / path).is_symlink() and (rootfs / path).read_text() == "/new\n"
    assert host_file.read_text() == "host\n"
    assert (rootfs / "etc/passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"


@pytest.mark.parametrize("kind", ["link-out", "link-in", "file"])
@pytest.mark.parametrize("which, path", [("profile", PROFILE), ("dropin", DROPIN)])
def test_what_the_image_has_at_the_temporary_name_is_removed_never_followed(tmp_path, which, path, kind):
    """An entry at the writer's temporary name (an image can guess the NRI plugin's pid, one
    for the node's life; or a run killed mid-write left it): removed, never opened or followed,
    and the file written; nothing outside the root or elsewhere in it changes."""
    rootfs = rootfs_of(tmp_path, dirs=("etc", os.path.dirname(path)))
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")
    (rootfs / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    plant = {"link-out": str(host_file), "link-in": "/etc/passwd", "file": ""}[kind]
    assert write(which, rootfs, "/new\n", plant=plant)["error"] is None
    assert not (rootfs / path).is_symlink() and (rootfs / path).read_text() == "/new\n"
    assert stat.S_IMODE(os.lstat(rootfs / path).st_mode) == (0o444 if which == "profile" else 0o644)
    assert leftovers(rootfs / os.path.dirname(path)) == []
    assert host_file.read_text() == "host\n" and stat.S_IMODE(host_file.stat().st_mode) == 0o644
    assert (rootfs / "etc/passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"


@pytest.mark.parametrize("which, path, words", [
    ("profile", PROFILE, "failed to write application profile /etc/nvidia/nvidia-application-profiles-rc.d/"
                         "10-container.conf in the container: "),
    ("dropin", DROPIN, "cannot write /etc/ld.so.conf.d/00-compat-nvhook.conf in the container: ")])
def test_a_directory_at_the_name_is_one_line_and_nothing_is_left(tmp_path, which, path, words):
    rootfs = rootfs_of(tmp_path, dirs=("etc", path))
    (rootfs / path / "kept").write_text("the image's\n")
    out = write(which, rootfs, "/new\n")
    assert out["error"] == words + "Is a directory"
    assert os.listdir(rootfs / path) == ["kept"]
    assert leftovers(rootfs / os.path.dirname(path)) == []


def test_the_profile_in_a_user_namespaced_root_is_the_containers_roots(tmp_path):
    """The container's root is host uid 100000: the file it reads is its root's, as the image's
    own files are (a file of host root's shows as `nobody` inside, and a filesystem mounted in
    the container's namespace refuses one)."""
    rootfs = rootfs_of(tmp_path, USERNS_ROOT, dirs=("etc", PROFILE_DIR))
    assert write("profile", rootfs, "{}", owner=USERNS_ROOT) == {"error": None, "warnings": []}
    st = os.lstat(rootfs / PROFILE)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*USERNS_ROOT, 0o444)


def test_the_dropin_in_a_user_namespaced_root_is_the_containers_roots(tmp_path):
    """The NRI plugin's compat conf for a pod with its own user namespace: the drop-in, and an
    ld.so.conf made for it, are the container's root's, as its loader cache is (a file of host
    root's shows as `nobody` inside, and a filesystem mounted in the container's namespace
    refuses one)."""
    rootfs = rootfs_of(tmp_path, USERNS_ROOT)
    assert write("dropin", rootfs, "/usr/local/cuda/compat\n", owner=USERNS_ROOT)["error"] is None
    for path, mode in ((DROPIN_DIR, 0o755), (DROPIN, 0o644), ("etc/ld.so.conf", 0o644)):
        st = os.lstat(rootfs / path)
        assert (path, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (path, *USERNS_ROOT, mode)
    assert (rootfs / DROPIN).read_text() == "/usr/local/cuda/compat\n"


@pytest.mark.skipif(not os.path.exists("/usr/bin/strace"), reason="needs strace")
@pytest.mark.parametrize("which", ["profile", "dropin"])
def test_the_start_path_does_not_fsync_them(tmp_path, which):
    """A container's writable layer need not outlive a crash of the node (the container does
    not either), and an fsync on a busy disk costs the start milliseconds."""
    rootfs = rootfs_of(tmp_path)
    trace = tmp_path / "trace"
    assert write(which, rootfs, "/new\n", strace=trace)["error"] is None
    assert (rootfs / (PROFILE if which == "profile" else DROPIN)).read_text() == "/new\n"
    assert [ln for ln in trace.read_text().splitlines() if "sync" in ln] == []
