"""devices.create_missing_nodes: the hook creates the device nodes the driver left to
nvidia-modprobe (IMEX channels, nvidia-uvm, MIG capabilities), with the numbers /proc/devices
gives, only under the configured host root and without following links. Runs the real
pipeline on private copies of the 8-GPU fixture host."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hostfix import bundle, config_dict, copy_host, fx, private_dir  # noqa: F401

from nvhook.apply import hostnodes
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog
from nvhook.decide.sources import Host, OciBundle
from nvhook.start import pipeline

IMEX_MAJOR = 237
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


@pytest.fixture
def host(fx, tmp_path) -> Path:  # noqa: F811
    """host-gpu8 with the IMEX module loaded (its major in /proc/devices) but no channel node,
    and without the nvidia-uvm nodes and GPU 0's MIG capability nodes."""
    h = copy_host(fx, "host-gpu8", tmp_path / "hosts")
    devices = h / "proc/devices"
    devices.write_text(devices.read_text().replace("\nBlock devices:",
                                                   f"{IMEX_MAJOR} nvidia-caps-imex-channels\n\nBlock devices:"))
    for p in ("dev/nvidia-uvm", "dev/nvidia-uvm-tools"):
        (h / p).unlink()
    return h


def decide(fx, tmp_path, host: Path, env: tuple, *, create: bool = True, mounts=(), log=None):  # noqa: F811
    b = bundle(tmp_path / "b", fx / "container-debian", env, mounts=mounts)
    state = {"id": "c", "pid": None, "bundle": str(b), "annotations": {}}
    cfg = config_dict(private_dir(tmp_path / "cache"))
    cfg["devices"]["create_missing_nodes"] = create
    cfg["devices"]["accept_volume_mounts"] = True
    return pipeline.decide(OciBundle.from_state(state), Host(str(host), cfg, log or EventLog("error"))).plan


def node(path: Path) -> tuple[str, int, int, str, int, int]:
    st = os.lstat(path)
    kind = "chr" if stat.S_ISCHR(st.st_mode) else "other"
    return kind, os.major(st.st_rdev), os.minor(st.st_rdev), oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid


def devices(plan: dict) -> dict:
    return {m["target"]: m for m in plan["mounts"] if m["kind"] == "device"}


IMEX3 = ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=3")


def test_imex_channel_and_uvm_are_created_with_the_drivers_numbers(fx, tmp_path, host):  # noqa: F811
    plan = decide(fx, tmp_path, host, IMEX3)
    # /proc/devices gives the majors; params DeviceFileMode 438 (0666), UID/GID 0.
    assert node(host / "dev/nvidia-caps-imex-channels/channel3") == ("chr", IMEX_MAJOR, 3, "0o666", 0, 0)
    assert node(host / "dev/nvidia-uvm") == ("chr", 235, 0, "0o666", 0, 0)
    assert node(host / "dev/nvidia-uvm-tools") == ("chr", 235, 1, "0o666", 0, 0)
    assert oct(stat.S_IMODE(os.stat(host / "dev/nvidia-caps-imex-channels").st_mode)) == "0o755"
    d = devices(plan)
    assert d["/dev/nvidia-caps-imex-channels/channel3"]["node"]["major"] == IMEX_MAJOR
    assert {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= set(d)
    assert {"type": "c", "major": IMEX_MAJOR, "minor": 3, "access": "rw"} in plan["devices_cgroup"]
    assert sorted(os.listdir(host / "dev/nvidia-caps-imex-channels")) == ["channel3"]  # only what was asked


def test_mig_capability_nodes_are_created_with_their_procfs_mode(fx, tmp_path, host):  # noqa: F811
    minors = dict(ln.split() for ln in (host / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    gi, ci = minors["gpu0/gi1/access"], minors["gpu0/gi1/ci0/access"]
    for m in (gi, ci):
        (host / f"dev/nvidia-caps/nvidia-cap{m}").unlink()
    plan = decide(fx, tmp_path, host, ("NVIDIA_VISIBLE_DEVICES=all",))
    assert node(host / f"dev/nvidia-caps/nvidia-cap{gi}") == ("chr", 236, int(gi), "0o444", 0, 0)
    assert node(host / f"dev/nvidia-caps/nvidia-cap{ci}") == ("chr", 236, int(ci), "0o444", 0, 0)
    assert f"/dev/nvidia-caps/nvidia-cap{gi}" in devices(plan)


def test_switch_off_creates_nothing_and_says_which_switch(fx, tmp_path, host):  # noqa: F811
    with pytest.raises(HookError, match="unknown IMEX channel '3'.*devices.create_missing_nodes"):
        decide(fx, tmp_path, host, IMEX3, create=False)
    assert not (host / "dev/nvidia-caps-imex-channels").exists()
    assert not (host / "dev/nvidia-uvm").exists()


def test_planted_directory_link_is_not_followed(fx, tmp_path, host):  # noqa: F811
    """A container sharing the host's /dev plants the channel directory as a link to a
    directory of its choice: no node appears there, and the container does not start."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (host / "dev/nvidia-caps-imex-channels").symlink_to(target)
    log = EventLog("debug")
    with pytest.raises(HookError, match="unknown IMEX channel '3'"):
        decide(fx, tmp_path, host, IMEX3, log=log)
    assert os.listdir(target) == []
    failed = [e for e in map(__import__("json").loads, log.lines()) if e["event"] == "device.create_failed"]
    assert failed and "symbolic link" in failed[0]["error"]


def test_planted_node_link_is_not_used(fx, tmp_path, host):  # noqa: F811
    """channel3 planted as a link to GPU 7's node: mknod does not follow it, and the plan does
    not hand the container /dev/nvidia7 as its IMEX channel."""
    (host / "dev/nvidia-caps-imex-channels").mkdir()
    (host / "dev/nvidia-caps-imex-channels/channel3").symlink_to("/dev/nvidia7")
    with pytest.raises(HookError, match="unknown IMEX channel '3'"):
        decide(fx, tmp_path, host, IMEX3)
    assert os.path.islink(host / "dev/nvidia-caps-imex-channels/channel3")


def test_dev_itself_a_link_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "real-dev").mkdir()
    (root / "dev").symlink_to(tmp_path / "real-dev")
    out = hostnodes.create(str(root), [{"path": "/dev/nvidia-uvm", "major": 235, "minor": 0, "mode": 0o666,
                                        "uid": 0, "gid": 0}])
    assert out[0]["result"] == "error" and os.listdir(tmp_path / "real-dev") == []


@pytest.mark.parametrize("path", ["/dev/../etc/x", "/etc/x", "/dev/a/../../x", "/dev/"])
def test_paths_outside_dev_are_refused(tmp_path, path):
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    out = hostnodes.create(str(root), [{"path": path, "major": 1, "minor": 3, "mode": 0o666, "uid": 0, "gid": 0}])
    assert out[0]["result"] == "error"
    assert sorted(p.name for p in root.rglob("*")) == ["dev"]


def test_existing_node_is_left_alone(tmp_path):
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    os.mknod(root / "dev/nvidia-uvm", 0o020600, os.makedev(235, 0))
    out = hostnodes.create(str(root), [{"path": "/dev/nvidia-uvm", "major": 235, "minor": 0, "mode": 0o666,
                                        "uid": 0, "gid": 0}])
    assert out == [{"path": "/dev/nvidia-uvm", "result": "exists"}]
    assert oct(stat.S_IMODE(os.stat(root / "dev/nvidia-uvm").st_mode)) == "0o600"


def test_dry_run_and_doctor_create_no_node(fx, tmp_path, host):  # noqa: F811
    """--dry-run and doctor change nothing on the host, whatever create_missing_nodes says."""
    import subprocess
    import sys

    b = bundle(tmp_path / "b", fx / "container-debian", IMEX3)
    cfg = tmp_path / "hook.toml"
    cfg.write_text(f'cache_dir = "{private_dir(tmp_path / "cache")}"\nlog_file = ""\n'
                   "[devices]\ncreate_missing_nodes = true\n")
    for args in (["--dry-run", "--bundle", str(b)], ["doctor", "--bundle", str(b)]):
        subprocess.run([sys.executable, "-m", "nvhook", "--config", str(cfg), "--root", str(host), *args],
                       capture_output=True, text=True, timeout=120)
        assert not (host / "dev/nvidia-caps-imex-channels").exists(), args
        assert not (host / "dev/nvidia-uvm").exists(), args
