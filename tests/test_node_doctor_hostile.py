"""`nvhook doctor --node --prefix DIR` on a node tree an attacker planted (a node image, a
DaemonSet's hostPath, a tarball someone asked you to check): FIFOs and device nodes where files
belong, links out of the prefix, files too deep or too big to parse, keys of the wrong type,
escape sequences in names. Every run ends, reads nothing outside the prefix, and says what it
found in its own lines (exit 0 or 5), never a traceback's "internal error".
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from hostfix import nvhook
from test_node_doctor import DRIVER, doctor, make_node, put

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")


@pytest.fixture
def node(tmp_path) -> Path:
    return make_node(tmp_path / "node")


def finished(p) -> str:
    """The report's text, after checking that doctor reported (not crashed)."""
    assert p.returncode in (0, 5), p.stdout + p.stderr
    assert "internal error" not in p.stderr and p.stdout.splitlines()[-1].startswith("nvhook doctor --node"), p.stderr
    return p.stdout


def replace_with_fifo(node: Path, path: str) -> Path:
    p = node / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists():
        p.unlink()
    os.mkfifo(p)
    return p


# Every file doctor reads. No writer ever opens these FIFOs: a read that opened one without
# O_NONBLOCK would wait forever (the timeout below ends the test as a failure).
FIFO_PATHS = ("/etc/nvhook/hook.toml", "/etc/group", "/etc/cdi/nvhook.json", "/etc/docker/daemon.json",
              "/etc/containerd/conf.d/99-nvhook.toml", "/etc/crio/crio.conf", "/etc/crio/crio.conf.d/99-nvhook.conf",
              "/etc/containers/oci/hooks.d/nvhook.json", "/etc/cdi/other.yaml", "/proc/driver/nvidia/version",
              "/etc/systemd/system/nvhook-nri.service")


@pytest.mark.parametrize("path", FIFO_PATHS)
def test_a_planted_fifo_never_blocks_the_check(node, path):
    replace_with_fifo(node, path)
    out = finished(nvhook("doctor", "--node", "--prefix", str(node), timeout=20))
    if path == "/etc/nvhook/hook.toml":
        assert "/etc/nvhook/hook.toml: is a FIFO, not a config file: nvhook cannot read it; fix: replace it" in out
    if path == "/etc/group":
        assert "/etc/group: /etc/group on the node is a FIFO, not a regular file; fix: make it the node" in out
        assert "not nvhook-hook's" not in out  # the group is unknown, not wrong


@as_root
@pytest.mark.parametrize("path", ["/etc/nvhook/hook.toml", "/etc/group"])
def test_a_planted_device_node_is_named_not_read(node, path):
    """/dev/zero's numbers where the config is: reading it would never end."""
    p = node / path.lstrip("/")
    p.unlink()
    os.mknod(p, 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    out = finished(nvhook("doctor", "--node", "--prefix", str(node), timeout=20))
    assert f"{path}: " in out and "character device" in out and "not a" in out, out


def test_a_sparse_giant_config_is_named_not_read(node):
    with open(node / "etc/nvhook/hook.toml", "wb") as f:
        f.truncate(64 << 30)  # 64 GiB of nothing, on disk in no time
    with open(node / "etc/docker/daemon.json", "wb") as f:
        f.truncate(64 << 30)
    out = finished(nvhook("doctor", "--node", "--prefix", str(node), timeout=20))
    assert f"/etc/nvhook/hook.toml: is {64 << 30} bytes long, not a config file" in out


def test_the_driver_version_is_read_inside_the_prefix(node, tmp_path):
    """A node's /proc that is an absolute link is the node's path: the version file behind it
    on this machine is never read (it would call nvhook's spec stale)."""
    outside = tmp_path / "outside"
    put(outside, "/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  999.99.99  x\n")
    shutil.rmtree(node / "proc")
    (node / "proc").symlink_to(f"{outside}/proc")
    out = finished(doctor(node))
    assert "999.99.99" not in out and out.startswith("nvhook doctor --node"), out
    # and inside, the same file is read: the check itself still works
    put(node, f"{outside}/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  x\n")
    assert f"made for driver {DRIVER}, the node has 550.54.15" in finished(doctor(node))


DEEP = "[" * 100000 + "]" * 100000
HOSTILE = {
    "daemon.json nested too deep": ("/etc/docker/daemon.json", DEEP,
                                    "/etc/docker/daemon.json: is not valid JSON (nested too deeply)"),
    "spec nested too deep": ("/etc/cdi/nvhook.json", DEEP,
                             "/etc/cdi/nvhook.json: is not valid JSON (nested too deeply)"),
    "hooks file nested too deep": ("/etc/containers/oci/hooks.d/x.json", DEEP, None),
    "containerd config nested too deep": ("/etc/containerd/config.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n",
                                          "/etc/containerd/config.toml: is not valid TOML"),
    "spec with numbers for tables": ("/etc/cdi/nvhook.json", json.dumps(
        {"kind": "nvidia.com/gpu", "containerEdits": {"mounts": [5]}, "devices": [{"containerEdits": 7}]}),
        "/etc/cdi/nvhook.json: is not a CDI spec (a field has the wrong type)"),
    "spec with a number for its edits": ("/etc/cdi/nvhook.json", json.dumps({"kind": "nvidia.com/gpu",
                                                                             "containerEdits": 5}),
                                         "/etc/cdi/nvhook.json: is not a CDI spec (a field has the wrong type)"),
    "containerd runtimes a list": ("/etc/containerd/config.toml",
                                   'version = 2\n[plugins.cri.containerd]\nruntimes = [1]\n', None),
    "containerd imports a number": ("/etc/containerd/config.toml", "version = 2\nimports = 5\n", None),
    "containerd imports a directory": ("/etc/containerd/config.toml",
                                       'version = 2\nimports = ["/etc/containerd/conf.d"]\n', None),
    "crio runtimes a list": ("/etc/crio/crio.conf.d/50-x.conf", "[crio.runtime]\nruntimes = [1]\n", None),
    "containerd NRI socket a number": ("/etc/containerd/config.toml", "version = 3\n[plugins.nri]\nsocket_path = 5\n",
                                       None),
    "crio NRI socket a number": ("/etc/crio/crio.conf.d/50-x.conf", "[crio.nri]\nnri_listen = 5\n", None),
    "containerd disabled_plugins of lists": ("/etc/containerd/config.toml", "version = 3\ndisabled_plugins = [[1]]\n",
                                             None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_file_is_reported_never_a_crash(node, case):
    path, text, says = HOSTILE[case]
    put(node, path, text)
    # the NRI checks read containerd's and CRI-O's NRI tables only where nvhook's plugin is installed
    put(node, "/etc/systemd/system/nvhook-nri.service", "[Service]\nExecStart=/opt/nvhook/bin/nvhook nri\n")
    out = finished(doctor(node))
    if says:
        assert says in out, out


def test_escape_sequences_in_a_node_s_files_never_reach_the_terminal(node, tmp_path):
    """A runtime path and a file name carrying escape sequences (clear the screen, recolour) are
    printed with each control character as '?', by doctor and by runtime configure's warning."""
    evil = "/usr/bin/nvidia-container-runtime\x1b[2J\x1b[31mEVIL"
    put(node, "/etc/docker/daemon.json", json.dumps({"runtimes": {"nvidia": {"path": evil}}}))
    put(node, "/etc/containers/oci/hooks.d/\x1b[2Jx.json",
        json.dumps({"hook": {"path": "/usr/bin/nvidia-container-toolkit"}}))
    p = doctor(node)
    assert p.returncode == 5 and "\x1b" not in p.stdout and "nvidia-container-runtime?[2J?[31mEVIL" in p.stdout
    daemon = put(tmp_path, "/daemon.json", json.dumps({"runtimes": {"nvidia-legacy": {"path": evil}}}))
    p = nvhook("runtime", "configure", "--runtime", "docker", "--config", str(daemon), "--runtime-path",
               "/opt/nvhook/bin/nvhook-runtime")
    assert p.returncode == 0 and "NVIDIA's runtime 'nvidia-legacy'" in p.stderr, p.stderr
    assert "\x1b" not in p.stderr and "?[2J?[31mEVIL" in p.stderr, p.stderr


def at_a_terminal(*args: str) -> str:
    """nvhook's stdout and stderr as a terminal gets them (click strips escape sequences only
    where the output is not one)."""
    import pty
    import subprocess

    from hostfix import NVHOOK

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    p = subprocess.Popen([*NVHOOK, *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    try:
        while b := os.read(master, 1 << 16):
            chunks.append(b)
    except OSError:  # EIO: the last writer closed the terminal
        pass
    finally:
        os.close(master)
    p.wait(timeout=60)
    return b"".join(chunks).decode()


def test_a_planted_log_link_s_target_never_drives_the_terminal(tmp_path):
    """Whoever can write the log's directory (group syslog's /var/log on Ubuntu) can make the
    log file a link whose target holds escape sequences: config check names the link quoted."""
    (tmp_path / "nvhook.log").symlink_to("/tmp/\x1b[2J\x1b]0;owned\x07x")
    cfg = put(tmp_path, "/hook.toml", f'log_file = "{tmp_path}/nvhook.log"\n')
    out = at_a_terminal("config", "check", str(cfg))
    assert "is a symbolic link (to '/tmp/\\x1b[2J\\x1b]0;owned\\x07x')" in out, out
    assert "\x1b" not in out and "\x07" not in out


def test_a_file_name_s_bytes_that_are_not_utf8_print_as_question_marks(node):
    """0x9b is CSI where a terminal reads 8-bit C1 controls: a hooks file named b"\\x9b2J\\xff.json"
    is printed with each of those bytes as '?'."""
    name = os.path.join(os.fsencode(node), b"etc/containers/oci/hooks.d/\x9b2J\xff.json")
    with open(name, "w") as f:
        f.write(json.dumps({"hook": {"path": "/usr/bin/nvidia-container-toolkit"}}))
    import subprocess

    from hostfix import NVHOOK

    p = subprocess.run([*NVHOOK, "doctor", "--node", "--prefix", str(node)], capture_output=True, timeout=60)
    assert p.returncode == 5 and b"/etc/containers/oci/hooks.d/?2J?.json: NVIDIA's OCI hook" in p.stdout, p.stdout
    assert b"\x9b" not in p.stdout and b"\xff" not in p.stdout
