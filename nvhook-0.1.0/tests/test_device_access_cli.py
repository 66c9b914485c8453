"""What `--dry-run`, `info` and `doctor` say about device access, and `nvhook system
create-dev-char-links`, through the installed console script.

The cgroup mode is what the hook would see: the same commands run in a private mount
namespace with cgroup2 on /sys/fs/cgroup (runcbox.in_cgroup2) report v2, outside they report
this host's mode.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402

from nvhook.commands import devaccess  # noqa: E402

pytestmark = pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or "")

HOST_MODE = rb.host_cgroup_mode()


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    return rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=tmp_path / "log.jsonl",
                                  cache_dir=tmp_path / "cache")


@pytest.fixture
def host(tmp_path: Path, fixtures_root: Path) -> Path:
    """A private copy of host-gpu8 (device nodes included: cp -a, not a read of each node)."""
    dst = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(dst)], check=True, timeout=120)
    return dst


def errors(r: subprocess.CompletedProcess) -> list[str]:
    """nvhook's own error lines (the console also shows the fixture host's logged warnings)."""
    return [ln for ln in r.stderr.splitlines() if ln.startswith("nvhook:")]


def nvhook(conf: Path, *args: str, cgroup2: bool = False) -> subprocess.CompletedProcess:
    cmd = [str(rb.NVHOOK_BIN), "--config", str(conf), *args]
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run(rb.in_cgroup2(cmd) if cgroup2 else cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("cgroup2", [False, True], ids=["host-mode", "v2"])
def test_dry_run_shows_mode_rules_and_action(conf, fixtures_root, cgroup2):
    mode = "v2" if cgroup2 else HOST_MODE
    host, bundle = fixtures_root / "host-gpu8", fixtures_root / "bundle-container-debian"
    text = nvhook(conf, "--root", str(host), "--dry-run", "--bundle", str(bundle), cgroup2=cgroup2)
    assert text.returncode == 0, text.stderr
    block = text.stdout.split(f"Device cgroup rules (cgroup {mode}):\n", 1)[1].split("\n\n", 1)[0]
    assert "c 195:0 rw" in block and "c 195:255 rw" in block
    # the action's sentence, wrapped to fit ~100 columns
    action = block.split("\n  nvhook ", 1)[1]
    assert " ".join(action.split()) == devaccess.cgroups.ACTIONS[mode]
    js = nvhook(conf, "--root", str(host), "--dry-run", "--bundle", str(bundle), "--format", "json", cgroup2=cgroup2)
    plan = json.loads(js.stdout)
    assert plan["cgroup"] == {"mode": mode, "action": devaccess.cgroups.ACTIONS[mode]}


@pytest.mark.parametrize("cgroup2", [False, True], ids=["host-mode", "v2"])
def test_info_shows_mode_and_action(conf, fixtures_root, cgroup2):
    mode = "v2" if cgroup2 else HOST_MODE
    r = nvhook(conf, "--root", str(fixtures_root / "host-gpu8"), "info", cgroup2=cgroup2)
    assert r.returncode == 0, r.stderr
    tail = r.stdout.split("Device access:  ", 1)[1].splitlines()
    expected = {"v2": "cgroup v2 (unified)", "v1": "cgroup v1 (hybrid: cgroup2 is mounted too, runtimes use v1)"}
    if mode == "v1" and not devaccess.describe()["hybrid"]:
        expected["v1"] = "cgroup v1"
    assert tail[0] == expected[mode]
    assert tail[1] == f"  nvhook {devaccess.cgroups.ACTIONS[mode]}"
    data = json.loads(nvhook(conf, "--root", str(fixtures_root / "host-gpu8"), "info", "--format", "json",
                             cgroup2=cgroup2).stdout)
    assert data["device_access"]["mode"] == mode


def _bundle_with_devices(tmp_path: Path, fixtures_root: Path, carry: bool,
                         cgroups_path: str | None = "system.slice:docker:0123abcd") -> Path:
    """A bundle as Docker with the systemd cgroup driver writes it (cgroups_path), or another driver's."""
    b = tmp_path / "bundle"
    b.mkdir()
    cfg = json.loads((fixtures_root / "bundle-container-debian" / "config.json").read_text())
    if cgroups_path is not None:
        cfg.setdefault("linux", {})["cgroupsPath"] = cgroups_path
    cfg["root"]["path"] = str((fixtures_root / "bundle-container-debian" / cfg["root"]["path"]).resolve()) \
        if not os.path.isabs(cfg["root"]["path"]) else cfg["root"]["path"]
    if carry:
        nodes = [("/dev/nvidiactl", 195, 255), ("/dev/nvidia0", 195, 0)]
        cfg.setdefault("linux", {})["devices"] = [{"path": p, "type": "c", "major": ma, "minor": mi}
                                                  for p, ma, mi in nodes]
        cfg["linux"].setdefault("resources", {})["devices"] = [{"allow": False, "access": "rwm"}] + [
            {"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rw"} for _, ma, mi in nodes]
    (b / "config.json").write_text(json.dumps(cfg))
    return b


@pytest.mark.parametrize("cgroup2", [False, True], ids=["host-mode", "v2"])
def test_doctor_shows_mode_and_action(conf, host, tmp_path, fixtures_root, cgroup2):
    mode = "v2" if cgroup2 else HOST_MODE
    bundle = _bundle_with_devices(tmp_path, fixtures_root, carry=False)
    r = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle), cgroup2=cgroup2)
    assert r.returncode == 0, r.stderr
    access = [ln for ln in r.stdout.splitlines() if ln.startswith("Device access   ")]
    assert len(access) == 1 and access[0].endswith(f"nvhook {devaccess.cgroups.ACTIONS[mode]}"), r.stdout
    assert f"cgroup {mode}" in access[0]
    data = json.loads(nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle), "--format", "json",
                             cgroup2=cgroup2).stdout)
    assert data["device_access"]["mode"] == mode


def test_doctor_explains_daemon_reload_and_dev_char_links(conf, host, tmp_path, fixtures_root):
    bundle = _bundle_with_devices(tmp_path, fixtures_root, carry=False)
    r = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    access = [ln for ln in lines if ln.startswith("Device access   ")]
    assert access and access[0].endswith(f"nvhook {devaccess.cgroups.ACTIONS[HOST_MODE]}")
    notes = [ln for ln in lines if ln.startswith("Note  ")]
    assert any("Failed to initialize NVML: Unknown Error" in n and "daemon-reload" in n for n in notes), notes
    version = devaccess.runc_version()
    needs = devaccess.needs_dev_char_links(version)
    char_note = [n for n in notes if "runc#3671" in n]
    assert bool(char_note) == needs, (version, notes)  # this machine's runc 1.1.5 needs them
    if needs:
        assert "nvhook system create-dev-char-links" in char_note[0]
        made = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
        assert made.returncode == 0, made.stderr
        again = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle))
        assert not [ln for ln in again.stdout.splitlines() if "runc#3671" in ln]


@pytest.mark.parametrize("cgroups_path", ["/docker/0123abcd", None], ids=["cgroupfs", "none"])
def test_doctor_leaves_out_systemd_notes_under_the_cgroupfs_driver(conf, host, tmp_path, fixtures_root,
                                                                   cgroups_path):
    """The daemon-reload and /dev/char notes are about systemd taking access away: not said
    for a container whose engine uses the cgroupfs driver (a path, or no cgroupsPath)."""
    bundle = _bundle_with_devices(tmp_path, fixtures_root, carry=False, cgroups_path=cgroups_path)
    r = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle))
    assert r.returncode == 0, r.stderr
    assert not [ln for ln in r.stdout.splitlines() if "daemon-reload" in ln or "runc#3671" in ln], r.stdout
    data = json.loads(nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle), "--format", "json").stdout)
    assert data["device_access"]["cgroup_driver"] == "cgroupfs" and data["device_access"]["notes"] == []


def test_doctor_when_the_runtime_carries_the_devices(conf, host, tmp_path, fixtures_root):
    bundle = _bundle_with_devices(tmp_path, fixtures_root, carry=True)
    r = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle), "--format", "json")
    assert r.returncode == 0, r.stderr
    da = json.loads(r.stdout)["device_access"]
    assert da["runtime_carries"] is True
    assert devaccess.DAEMON_RELOAD not in da["notes"]
    text = nvhook(conf, "--root", str(host), "doctor", "--bundle", str(bundle)).stdout
    assert "survives a daemon-reload" in text


# -- nvhook system create-dev-char-links ---------------------------------------------------

def _nvidia_nodes(host: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _, files in os.walk(host / "dev"):
        for name in files:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISCHR(st.st_mode) and name.startswith("nvidia"):
                out[str(p.relative_to(host / "dev"))] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return out


def test_create_dev_char_links_links_every_device_once(conf, host):
    nodes = _nvidia_nodes(host)
    assert len(nodes) >= 10
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
    assert r.returncode == 0, r.stderr
    char = host / "dev" / "char"
    for rel, (ma, mi) in nodes.items():
        link = char / f"{ma}:{mi}"
        assert os.readlink(link) == f"../{rel}", rel
        st = os.stat(link)  # resolves to the node itself
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (ma, mi)
    assert all(ln.startswith("created ") for ln in r.stdout.splitlines()), r.stdout
    before = {p.name: p.lstat().st_ino for p in char.iterdir()}
    again = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
    assert again.returncode == 0, again.stderr
    assert all(ln.startswith("unchanged ") for ln in again.stdout.splitlines()), again.stdout
    assert {p.name: p.lstat().st_ino for p in char.iterdir()} == before  # nothing rewritten


def test_create_dev_char_links_into_another_dev_root(conf, host, tmp_path):
    dev_root = tmp_path / "devroot"
    dev_root.mkdir()
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links", "--dev-root", str(dev_root))
    assert r.returncode == 0, r.stderr
    assert os.readlink(dev_root / "char" / "195:0") == "../nvidia0"
    assert not (host / "dev" / "char").exists()


def test_create_dev_char_links_refuses_a_planted_char_directory_link(conf, host, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (host / "dev" / "char").symlink_to(victim)
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
    assert r.returncode != 0
    assert errors(r) == [f"nvhook: cannot open {host}/dev/char: it is a symbolic link (refused: links are made "
                         f"only in a real directory)"], r.stderr
    assert list(victim.iterdir()) == []


def test_create_dev_char_links_replaces_planted_links_without_following_them(conf, host, tmp_path):
    victim = tmp_path / "victim-file"
    victim.write_text("secret\n")
    char = host / "dev" / "char"
    char.mkdir()
    (char / "195:0").symlink_to(victim)         # a link to somewhere else: replaced
    (char / "195:1").write_text("not a link\n")  # a regular file: replaced
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
    assert r.returncode == 0, r.stderr
    assert os.readlink(char / "195:0") == "../nvidia0" and os.readlink(char / "195:1") == "../nvidia1"
    assert victim.read_text() == "secret\n" and not victim.is_symlink()
    said = [ln for ln in r.stdout.splitlines() if ln.endswith(f"{char}/195:0 -> ../nvidia0")]
    assert said == [f"replaced (was {victim}) {char}/195:0 -> ../nvidia0"], r.stdout  # says what it was


def test_create_dev_char_links_stops_at_a_directory_in_the_way(conf, host):
    char = host / "dev" / "char"
    (char / "195:0").mkdir(parents=True)
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links")
    assert r.returncode != 0
    assert errors(r) == [f"nvhook: cannot create {char}/195:0: Is a directory"], r.stderr
    assert (char / "195:0").is_dir() and not [p for p in char.iterdir() if p.name.startswith(".")]


def test_create_dev_char_links_refuses_a_dev_root_that_is_a_link(conf, host, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "devlink").symlink_to(victim)
    r = nvhook(conf, "--root", str(host), "system", "create-dev-char-links", "--dev-root", str(tmp_path / "devlink"))
    assert r.returncode != 0
    assert errors(r) == [f"nvhook: cannot open {tmp_path / 'devlink'}: it is a symbolic link (refused: links are "
                         f"made only in a real directory)"], r.stderr
    assert list(victim.iterdir()) == []
