"""The driver application profile that shows EGL and Vulkan only the container's GPUs
(/etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf, decide/appprofile.py).

`nvidia-cdi-hook update-application-profile`, NVIDIA 1.20's subcommand: run by real runc from a
spec-style createContainer entry, the file's bytes and modes as the container reads them, its
bits those of the /dev/nvidiaN character devices the container has (runc made them from
config.json); byte for byte what NVIDIA's own 1.20 hook writes where its build is there
(NVHOOK_REFERENCE_CDI, bench/build_reference_cdi.sh). Then hostile roots: links out of the root
at the directory or the file, a FIFO, a volume at the directory, a /dev that is a link to a
host directory: nothing is ever written outside the root, and nothing hangs.

Beyond NVIDIA: nvhook's own doors write the same file for a container that asks for graphics
or display: hook mode under runc, and nvhook's CDI spec's createContainer hook under podman.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdihookbox  # noqa: E402
import runcbox as rb  # noqa: E402

HOOK = cdihookbox.plain_hook()
PROFILE = "etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf"
NVIDIA_120 = "v1.20.0"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the CDI hook works on a rootfs as root")


def expected(minors) -> bytes:
    """The file NVIDIA 1.20's hook writes for these minors (its buildApplicationProfileConfig:
    one line, no newline, the mask in lower-case hexadecimal)."""
    mask = sum(1 << m for m in set(minors) if 0 <= m < 64)
    return ('{"profiles":[{"name":"_container_","settings":["EGLVisibleDGPUDevices",'
            f'0x{mask:x}' ']}],"rules":[{"pattern":[],"profile":"_container_"}]}').encode()


def chardev(path: Path, minor: int, major: int = 195) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def reference_hook() -> Path | None:
    ref = cdihookbox.reference(NVIDIA_120)
    return ref / "nvidia-cdi-hook" if ref and (ref / "nvidia-cdi-hook").exists() else None


class Box:
    """A bundle whose rootfs has /dev and /etc, its state, a private nvhook config."""

    def __init__(self, tmp: Path, name: str = "bundle"):
        self.bundle = tmp / name
        self.rootfs = self.bundle / "rootfs"
        for d in ("dev", "etc", "usr/lib"):
            (self.rootfs / d).mkdir(parents=True, exist_ok=True)
        (self.bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "linux": {}}))
        self.state = json.dumps({"ociVersion": "1.0.2", "id": "profile-test", "status": "creating",
                                 "pid": os.getpid(), "bundle": str(self.bundle)})
        self.config = rb.write_nvhook_config(tmp / f"{name}.toml", log_file=tmp / f"{name}.jsonl",
                                             cache_dir=tmp / "cache")

    def run(self, exe: Path = HOOK, timeout: float = 30) -> subprocess.CompletedProcess:
        pre = [] if exe != HOOK else ["--nvhook-config", str(self.config)]
        return subprocess.run([str(exe), *pre, "update-application-profile"], input=self.state, capture_output=True,
                              text=True, timeout=timeout, env={"PATH": os.environ["PATH"]})

    @property
    def profile(self) -> Path:
        return self.rootfs / PROFILE


def populate_dev(dev: Path) -> None:
    """GPU nodes whose names and minors differ, the nodes that are not GPUs, and names that look
    like GPU nodes but are not character devices."""
    chardev(dev / "nvidia0", 1)
    chardev(dev / "nvidia3", 15)
    chardev(dev / "nvidiactl", 255)
    chardev(dev / "nvidia-uvm", 0, major=508)
    chardev(dev / "nvidia-modeset", 254)
    (dev / "nvidia7").write_text("a regular file\n")
    os.symlink("nvidia0", dev / "nvidia8")
    os.mkfifo(dev / "nvidia9")
    (dev / "nvidia-caps").mkdir()
    chardev(dev / "nvidia-caps/nvidia-cap1", 1, major=237)


def test_the_bits_are_the_containers_gpu_nodes_byte_for_byte_nvidias(tmp_path):
    box = Box(tmp_path)
    populate_dev(box.rootfs / "dev")
    chardev(box.rootfs / "dev/nvidia70", 70)  # no bit for it: NVIDIA's warning, the others written
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert p.stderr == "nvidia-cdi-hook (nvhook): warning: dropping invalid minor number 70: must be in range [0, 63]\n"
    assert box.profile.read_bytes() == expected([1, 15])
    modes = {rel: stat.S_IMODE(os.lstat(box.rootfs / rel).st_mode)
             for rel in ("etc/nvidia", "etc/nvidia/nvidia-application-profiles-rc.d", PROFILE)}
    assert modes == {"etc/nvidia": 0o555, "etc/nvidia/nvidia-application-profiles-rc.d": 0o555, PROFILE: 0o444}
    assert os.listdir(box.profile.parent) == ["10-container.conf"]  # no temporary file left
    ref = reference_hook()
    if ref is not None:
        theirs = Box(tmp_path, "reference")
        populate_dev(theirs.rootfs / "dev")
        chardev(theirs.rootfs / "dev/nvidia70", 70)
        r = theirs.run(ref)
        assert r.returncode == 0, r.stderr
        assert theirs.profile.read_bytes() == box.profile.read_bytes()
        assert {rel: stat.S_IMODE(os.lstat(theirs.rootfs / rel).st_mode) for rel in modes} == modes


@pytest.mark.parametrize("dev", ["none", "no-gpu", "no-dev"])
def test_no_gpu_node_writes_nothing(tmp_path, dev):
    box = Box(tmp_path)
    if dev == "no-gpu":
        chardev(box.rootfs / "dev/nvidiactl", 255)
        os.symlink("/dev/null", box.rootfs / "dev/nvidia0")
    elif dev == "no-dev":
        os.rmdir(box.rootfs / "dev")
    p = box.run()
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert not (box.rootfs / "etc/nvidia").exists()


# -- hostile roots -----------------------------------------------------------------------------

def plant(box: Box, case: str, victim: Path) -> None:
    """The image's layout for `case`; `victim` is a host directory holding a host file."""
    d = box.rootfs / "etc/nvidia/nvidia-application-profiles-rc.d"
    if case.startswith("file-") or case == "conf-is-dir":
        d.mkdir(parents=True)
    if case == "file-link-out":
        os.symlink(str(victim / "host-file"), d / "10-container.conf")
    elif case == "file-link-dotdot":
        os.symlink("../" * 20 + str(victim / "host-file").lstrip("/"), d / "10-container.conf")
    elif case in ("file-link-in", "file-link-in-relative"):
        (box.rootfs / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
        os.symlink("/etc/passwd" if case == "file-link-in" else "../../passwd", d / "10-container.conf")
    elif case == "file-fifo":
        os.mkfifo(d / "10-container.conf")
    elif case == "conf-is-dir":
        (d / "10-container.conf").mkdir()
    elif case == "dir-link-out":
        (box.rootfs / "etc/nvidia").mkdir()
        os.symlink(str(victim), d)
    elif case == "dir-link-dotdot":
        (box.rootfs / "etc/nvidia").mkdir()
        os.symlink("../../" * 10 + str(victim).lstrip("/"), d)
    elif case == "etc-nvidia-link-out":
        os.symlink(str(victim), box.rootfs / "etc/nvidia")
    elif case == "etc-nvidia-fifo":
        os.mkfifo(box.rootfs / "etc/nvidia")
    elif case == "etc-nvidia-file":
        (box.rootfs / "etc/nvidia").write_text("x\n")


# case -> (exit code, where the file lands inside the rootfs, or None)
HOSTILE = {
    "file-link-out": (0, PROFILE),            # the link is replaced, never followed
    "file-link-dotdot": (0, PROFILE),
    "file-link-in": (0, PROFILE),             # NVIDIA's fails on an absolute link
    "file-link-in-relative": (0, PROFILE),    # NVIDIA's overwrites the image's /etc/passwd
    "file-fifo": (0, PROFILE),                # replaced, never opened: no hang
    "conf-is-dir": (1, None),
    "dir-link-out": (1, None),                # resolved inside the root, where there is nothing
    "dir-link-dotdot": (1, None),
    "etc-nvidia-link-out": (0, "VICTIM/nvidia-application-profiles-rc.d/10-container.conf"),
    "etc-nvidia-fifo": (1, None),
    "etc-nvidia-file": (1, None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_root_never_gets_a_write_outside(tmp_path, case):
    victim = tmp_path / "host-victim"
    victim.mkdir()
    (victim / "host-file").write_text("host secret\n")
    before = sorted(os.listdir(victim))
    box = Box(tmp_path)
    chardev(box.rootfs / "dev/nvidia2", 2)
    plant(box, case, victim)
    if case == "etc-nvidia-link-out":  # the link's target as the image has it, inside the root
        (box.rootfs / str(victim).lstrip("/")).mkdir(parents=True)
    p = box.run(timeout=20)
    code, lands = HOSTILE[case]
    assert p.returncode == code, p.stderr
    assert sorted(os.listdir(victim)) == before and (victim / "host-file").read_text() == "host secret\n"
    if code:
        assert len(p.stderr.splitlines()) == 1 and "error: failed to " in p.stderr, p.stderr
        return
    inside = box.rootfs / lands.replace("VICTIM", str(victim).lstrip("/"))
    assert not inside.is_symlink() and stat.S_ISREG(os.lstat(inside).st_mode)
    assert inside.read_bytes() == expected([2])
    if case.startswith("file-link-in"):
        assert (box.rootfs / "etc/passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    ref = reference_hook()
    if ref is not None and case == "file-link-in-relative":  # the difference, shown (so the test can fail)
        theirs = Box(tmp_path, "reference")
        chardev(theirs.rootfs / "dev/nvidia2", 2)
        plant(theirs, case, victim)
        assert theirs.run(ref).returncode == 0
        assert (theirs.rootfs / "etc/passwd").read_bytes() == expected([2]), "NVIDIA's no longer follows the link"


def test_a_dev_that_links_to_a_host_directory_counts_nothing_there(tmp_path):
    """The image's /dev is an absolute link to a host directory holding GPU nodes: resolved
    inside the root it names nothing, so no node is counted and nothing is written."""
    host_dev = tmp_path / "host-dev"
    chardev(host_dev / "nvidia5", 5)
    box = Box(tmp_path)
    os.rmdir(box.rootfs / "dev")
    os.symlink(str(host_dev), box.rootfs / "dev")
    p = box.run()
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert not (box.rootfs / "etc/nvidia").exists()
    assert os.listdir(host_dev) == ["nvidia5"]


def test_a_volume_at_the_directory_is_not_written_and_the_container_starts(tmp_path):
    """A hostPath of the node's /etc/nvidia mounted into the container: a write there would change
    the node's own EGL settings. A warning, exit 0, the volume untouched."""
    box = Box(tmp_path)
    chardev(box.rootfs / "dev/nvidia0", 0)
    (box.rootfs / "etc/nvidia/nvidia-application-profiles-rc.d").mkdir(parents=True)
    volume = tmp_path / "node-etc-nvidia-profiles"
    volume.mkdir()
    state = tmp_path / "state.json"
    state.write_text(box.state)
    script = ('mount --bind "$1" "$2" || exit 99; "$3" --nvhook-config "$4" update-application-profile < "$5"')
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(volume),
                        str(box.rootfs / "etc/nvidia/nvidia-application-profiles-rc.d"), str(HOOK), str(box.config),
                        str(state)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "warning: the container's /etc/nvidia/nvidia-application-profiles-rc.d is on a volume" in p.stderr
    assert os.listdir(volume) == []


# -- real runc ---------------------------------------------------------------------------------

# What the container sees: its GPU nodes' numbers (hex, as stat prints them), the file, the modes.
VIEW = r"""
for d in /dev/nvidia*; do [ -c "$d" ] && echo "NODE $d $(stat -c '%t:%T' "$d")"; done
f=/etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf
if [ -e "$f" ]; then echo "PROFILE $(cat "$f")"; echo "MODES $(stat -c '%a' /etc/nvidia "${f%/*}" "$f" | tr '\n' ' ')"; fi
"""


def read_view(out: str) -> tuple[dict, str | None, str | None]:
    nodes, profile, modes = {}, None, None
    for ln in out.splitlines():
        if ln.startswith("NODE "):
            _, path, num = ln.split(" ")
            ma, mi = num.split(":")
            nodes[path] = (int(ma, 16), int(mi, 16))
        elif ln.startswith("PROFILE "):
            profile = ln[len("PROFILE "):]
        elif ln.startswith("MODES "):
            modes = ln[len("MODES "):].strip()
    return nodes, profile, modes


def gpu_minors(nodes: dict) -> list[int]:
    return [mi for path, (_ma, mi) in nodes.items() if re.fullmatch(r"/dev/nvidia[0-9]+", path)]


def runc_container(tmp: Path, hook: Path, extra_args: list[str]) -> subprocess.CompletedProcess:
    rootfs = rb.make_rootfs(tmp / "rootfs")
    bundle = tmp / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/sh", "-c", VIEW]
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    # The nodes runc makes from the spec (as a CDI spec's deviceNodes put them there); the names
    # and minors differ on purpose: the minor counts.
    cfg["linux"]["devices"] = [{"path": p, "type": "c", "major": 195, "minor": mi, "fileMode": 0o666}
                               for p, mi in (("/dev/nvidia0", 2), ("/dev/nvidia1", 5), ("/dev/nvidiactl", 255))]
    entry = {"path": str(hook), "args": ["nvidia-cdi-hook", *extra_args]}
    cfg["hooks"] = {"createContainer": [
        {**entry, "args": [*entry["args"], "create-symlinks", "--link", "libdemo.so.1::/usr/lib/libdemo.so"]},
        {**entry, "args": [*entry["args"], "update-application-profile"]}]}
    (bundle / "config.json").write_text(json.dumps(cfg))
    return rb.runc_run(bundle, tmp / "runc-state")


@pytest.mark.runc
@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
def test_runc_container_reads_the_profile_of_its_own_nodes(tmp_path):
    """The .deb's first stage (the shell, then one python for both entries): the container's own
    /dev/nvidiaN minors (2 and 5, not the names' 0 and 1) are the bits; NVIDIA 1.20's hook, where
    built, gives the container the same bytes."""
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                    cache_dir=tmp_path / "cache")
    ours = tmp_path / "nvhook"
    p = runc_container(ours, cdihookbox.shell_first_stage(tmp_path), ["--nvhook-config", str(config)])
    assert p.returncode == 0, p.stderr
    nodes, profile, modes = read_view(p.stdout)
    assert sorted(gpu_minors(nodes)) == [2, 5], p.stdout
    assert profile is not None and profile.encode() == expected(gpu_minors(nodes)), p.stdout
    assert modes == "555 555 444"
    done = [e for e in rb.read_events(tmp_path / "nvhook.jsonl") if e["event"] == "cdi_hook.done"]
    assert len(done) == 2 and done[1].get("coalesced"), done  # the second entry done by the first's process
    ref = reference_hook()
    if ref is not None:
        r = runc_container(tmp_path / "nvidia", ref, [])
        assert r.returncode == 0, r.stderr
        assert read_view(r.stdout)[1:] == (profile, modes)


# -- nvhook's own doors ------------------------------------------------------------------------

NEEDS_NVHOOK = pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or "")


@pytest.mark.runc
@NEEDS_NVHOOK
@pytest.mark.parametrize("caps,written", [("graphics,compute,utility", True), ("display", True),
                                          ("compute,utility", False)])
def test_hook_mode_writes_it_for_graphics_and_display(tmp_path, fixtures_root, caps, written):
    r = rb.run_with_nvhook(tmp_path, host=fixtures_root / "host-gpu8", script=VIEW,
                           env={"NVIDIA_VISIBLE_DEVICES": "1,3", "NVIDIA_DRIVER_CAPABILITIES": caps})
    assert r.proc.returncode == 0, r.proc.stderr
    nodes, profile, modes = read_view(r.stdout)
    minors = gpu_minors(nodes)
    assert len(minors) == 2, r.stdout
    if not written:
        assert profile is None and r.events("app_profile.written") == []
        return
    assert profile is not None and profile.encode() == expected(minors), r.stdout
    assert modes == "555 555 444"


@pytest.mark.podman
def test_nvhooks_cdi_spec_writes_it_for_graphics(tmp_path, fixtures_root):
    import cdibox
    import make_fixtures as mf

    if cdibox.skip_reason() is not None:
        pytest.skip(cdibox.skip_reason())
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                    cache_dir=tmp_path / "cache")
    podman = cdibox.CdiPodman(tmp_path)
    try:
        p = cdibox.generate(podman.spec_dir / "nvhook.json", config=config, host=fixtures_root / "host-gpu8",
                            extra=["--capabilities", "compute,utility,graphics"])
        assert p.returncode == 0, p.stderr
        rootfs = mf.build_container("container-debian", tmp_path / "images")
        r = podman.run(rootfs, VIEW, ["nvidia.com/gpu=1", "nvidia.com/gpu=2"])
        assert r.returncode == 0, r.stderr
        nodes, profile, modes = read_view(r.stdout)
        minors = gpu_minors(nodes)
        assert len(minors) == 2, r.stdout
        assert profile is not None and profile.encode() == expected(minors), r.stdout
        assert modes == "555 555 444"
    finally:
        podman.close()


@pytest.mark.runc
@NEEDS_NVHOOK
@pytest.mark.parametrize("layout", ["etc-nvidia-file", "dir-link-out", "file-link-out"])
def test_hook_mode_with_a_hostile_image_starts_and_writes_nothing_outside(tmp_path, fixtures_root, layout):
    """nvhook's own doors never fail a start over the profile: an image whose layout keeps it
    out gets the warning app_profile.not_written; a link at the file is replaced; nothing is
    written through a link to the host."""
    victim = tmp_path / "host-victim"
    victim.mkdir()
    (victim / "host-file").write_text("host secret\n")

    def prepare(rootfs: Path) -> None:
        d = rootfs / "etc/nvidia/nvidia-application-profiles-rc.d"
        if layout == "etc-nvidia-file":
            (rootfs / "etc/nvidia").write_text("x\n")
        elif layout == "dir-link-out":
            d.parent.mkdir(parents=True)
            os.symlink(str(victim), d)
        else:
            d.mkdir(parents=True)
            os.symlink(str(victim / "host-file"), d / "10-container.conf")

    r = rb.run_with_nvhook(tmp_path, host=fixtures_root / "host-gpu8", script=VIEW, prepare=prepare,
                           env={"NVIDIA_VISIBLE_DEVICES": "2", "NVIDIA_DRIVER_CAPABILITIES": "graphics,utility"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert sorted(os.listdir(victim)) == ["host-file"] and (victim / "host-file").read_text() == "host secret\n"
    nodes, profile, _modes = read_view(r.stdout)
    if layout == "file-link-out":
        assert profile is not None and profile.encode() == expected(gpu_minors(nodes)), r.stdout
    else:
        assert profile is None
        (ev,) = r.events("app_profile.not_written")
        assert ev["level"] == "warning" and "failed to create application profiles directory" in ev["error"]
