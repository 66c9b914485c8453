"""`nvhook runtime configure`: the files it writes (golden files in tests/golden/configure/),
what it prints, idempotence, --dry-run, bad input, and containerd 1.6's own reading of the
result (`containerd config dump`, which merges imports as the daemon does).

Golden files: tests/golden/configure/<case>/<file>, the temp dir written as @TMP@. After a
deliberate change, NVHOOK_UPDATE_GOLDEN=1 rewrites them; review the diff.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hostfix import nvhook

from nvhook.base import tomlread

GOLDEN = Path(__file__).resolve().parent / "golden" / "configure"
RT = "/usr/local/bin/nvhook-runtime"

DOCKER_EXISTING = """{
  "runtimes": {
    "nvidia": {
      "path": "nvidia-container-runtime",
      "runtimeArgs": []
    }
  },
  "log-driver": "journald",
  "data-root": "/srv/docker"
}
"""

CONTAINERD_V1 = """# containerd 1.x, config version 1 (no version key)
root = "/var/lib/containerd"

[plugins.cri]
  # the pause image of this cluster
  sandbox_image = "registry.example/pause:3.9"

[plugins.cri.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[plugins.cri.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"""

CONTAINERD_V2_PLAIN = """version = 2
# keep this comment
root = "/var/lib/containerd"

[plugins."io.containerd.internal.v1.opt"]
  path = "/opt/containerd"
"""

CONTAINERD_V2_IMPORTS = """version = 2
imports = ["/etc/containerd/site.toml"]  # site settings

[grpc]
  address = "/run/containerd/containerd.sock"
"""

CONTAINERD_V2_CRI = """version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    # kept across the edit
    sandbox_image = "registry.example/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
"""

CONTAINERD_V3 = """version = 3
# containerd 2.x
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
"""

# (case, engine, config file name, its text (None: absent), extra args)
CASES = [
    ("docker-absent", "docker", "daemon.json", None, []),
    ("docker-empty", "docker", "daemon.json", "", []),
    ("docker-existing-default", "docker", "daemon.json", DOCKER_EXISTING, ["--set-as-default"]),
    ("docker-one-line", "docker", "daemon.json", '{"debug": true}', []),
    ("containerd-absent", "containerd", "config.toml", None, []),
    ("containerd-v1-default", "containerd", "config.toml", CONTAINERD_V1, ["--set-as-default"]),
    ("containerd-v2-dropin", "containerd", "config.toml", CONTAINERD_V2_PLAIN, []),
    ("containerd-v2-imports-default", "containerd", "config.toml", CONTAINERD_V2_IMPORTS, ["--set-as-default"]),
    ("containerd-v2-cri-settings", "containerd", "config.toml", CONTAINERD_V2_CRI, ["--set-as-default"]),
    ("containerd-v3-dropin", "containerd", "config.toml", CONTAINERD_V3, ["--set-as-default"]),
    ("crio", "crio", "99-nvhook.conf", None, []),
    ("crio-default", "crio", "99-nvhook.conf", None, ["--set-as-default"]),
]


# No engine binary on PATH: what the file alone says (the engines' own word is tested below with
# this machine's containerd and in tests/node/ with the nodes' containerd 1.7 and 2.1 and Docker).
NO_ENGINES = {"PATH": "/nonexistent"}
WITH_ENGINES: dict = {}  # the machine's PATH


def record_of(tmp: Path) -> str:
    return f"{tmp}.record.json"  # beside the test's directory: its file list stays the engine's


def configure(tmp: Path, engine: str, name: str, *args: str, env: dict | None = None):
    return nvhook("runtime", "configure", "--runtime", engine, "--config", str(tmp / name), "--runtime-path", RT,
                  "--record", record_of(tmp), *args, env=NO_ENGINES if env is None else env)


def unconfigure(tmp: Path, engine: str, name: str):
    return nvhook("runtime", "unconfigure", "--runtime", engine, "--config", str(tmp / name),
                  "--record", record_of(tmp), env=NO_ENGINES)


def files(tmp: Path) -> dict:
    out = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(tmp))] = p.read_text().replace(str(tmp), "@TMP@")
    return out


def snapshot(tmp: Path) -> dict:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in tmp.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case, engine, name, text, args", CASES, ids=[c[0] for c in CASES])
def test_golden_and_idempotent(tmp_path, case, engine, name, text, args):
    if text is not None:
        (tmp_path / name).write_text(text)
    p = configure(tmp_path, engine, name, *args)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    got = files(tmp_path)
    got["stdout"] = p.stdout.replace(str(tmp_path), "@TMP@")
    want_dir = GOLDEN / case
    if os.environ.get("NVHOOK_UPDATE_GOLDEN"):
        shutil.rmtree(want_dir, ignore_errors=True)
        for rel, content in got.items():
            (want_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (want_dir / rel).write_text(content)
    want = {str(f.relative_to(want_dir)): f.read_text() for f in sorted(want_dir.rglob("*")) if f.is_file()}
    assert got == want
    assert p.stdout.splitlines()[-1].endswith(f"systemctl restart {engine}")
    # every file it wrote parses, and the user's settings and comments are still there
    for rel, content in got.items():
        if rel.endswith(".toml") or rel.endswith(".conf"):
            tomlread.loads(content)
    if text:
        for ln in text.splitlines():
            if ln.strip().startswith("#"):
                assert ln in got[name], ln
    # a second run changes nothing and says so
    before = snapshot(tmp_path)
    again = configure(tmp_path, engine, name, *args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"{engine}: nothing to change: "), again.stdout
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("engine, name, text, error", [
    ("docker", "daemon.json", '{"runtimes": {', "is not valid JSON (Expecting"),
    ("docker", "daemon.json", '["not", "an", "object"]', "is not a JSON object"),
    ("docker", "daemon.json", '{"runtimes": []}', '"runtimes" is not a JSON object'),
    ("containerd", "config.toml", 'version = 2\n[plugins\n', "is not valid TOML"),
    ("containerd", "config.toml", 'version = 7\n', "containerd config version 7 is not supported"),
    ("crio", "99-nvhook.conf", '[crio\n', "is not valid TOML"),
])
def test_invalid_config_one_line_nothing_written(tmp_path, engine, name, text, error):
    (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    p = configure(tmp_path, engine, name)
    assert p.returncode == 1
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(f"nvhook: {tmp_path / name}"), p.stderr
    assert error in p.stderr
    assert p.stderr.rstrip().endswith("nothing written")
    assert snapshot(tmp_path) == before  # no temp files, no drop-in


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path):
    (tmp_path / "config.toml").write_text(CONTAINERD_V2_PLAIN)
    before = snapshot(tmp_path)
    p = configure(tmp_path, "containerd", "config.toml", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert snapshot(tmp_path) == before
    assert f"+++ {tmp_path}/conf.d/99-nvhook.toml" in p.stdout
    assert f'+  BinaryName = "{RT}"' in p.stdout
    assert f'+imports = ["{tmp_path}/conf.d/99-nvhook.toml"]' in p.stdout
    assert p.stdout.rstrip().endswith("containerd: dry run, nothing written")


def test_containerd_default_runtime_name_replaced_in_place(tmp_path):
    """v1 with an existing default_runtime_name: the line is replaced, not duplicated."""
    (tmp_path / "config.toml").write_text(CONTAINERD_V1)
    assert configure(tmp_path, "containerd", "config.toml", "--set-as-default").returncode == 0
    text = (tmp_path / "config.toml").read_text()
    assert text.count("default_runtime_name") == 1
    assert tomlread.loads(text)["plugins"]["cri"]["containerd"]["default_runtime_name"] == "nvidia"


containerd_bin = pytest.mark.skipif(not shutil.which("containerd"), reason="containerd is not installed")


def dump(config: Path) -> dict:
    p = subprocess.run(["containerd", "--config", str(config), "config", "dump"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return tomlread.loads(p.stdout)


@containerd_bin
@pytest.mark.parametrize("text", [CONTAINERD_V2_PLAIN, CONTAINERD_V2_CRI, CONTAINERD_V2_IMPORTS, None],
                         ids=["v2-dropin", "v2-cri-settings", "v2-imports", "absent"])
def test_containerd_reads_the_runtime_and_keeps_the_users_settings(tmp_path, text):
    if text is not None:
        (tmp_path / "config.toml").write_text(text.replace("/etc/containerd/site.toml", str(tmp_path / "site.toml")))
    (tmp_path / "site.toml").write_text("version = 2\n")
    before = dump(tmp_path / "config.toml") if text is not None else None
    p = configure(tmp_path, "containerd", "config.toml", "--set-as-default", env=WITH_ENGINES)
    assert p.returncode == 0, p.stderr
    assert "containerd: confirmed: containerd reads it as written (`containerd config dump`)\n" in p.stdout
    after = dump(tmp_path / "config.toml")
    cri = after["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["containerd"]["runtimes"]["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == RT
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    if before is not None:
        # everything else containerd sees is what it saw before (imports aside)
        b, a = dict(before), dict(after)
        b.pop("imports", None), a.pop("imports", None)
        bc = b["plugins"]["io.containerd.grpc.v1.cri"]
        bc["containerd"]["default_runtime_name"] = "nvidia"
        bc["containerd"]["runtimes"]["nvidia"] = cri["containerd"]["runtimes"]["nvidia"]
        # runc is still there (written explicitly where containerd's built-in table would be
        # replaced); its options table is then empty instead of listing the defaults
        runc = a["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"]
        assert runc["runtime_type"] == "io.containerd.runc.v2"
        runc.pop("options"), bc["containerd"]["runtimes"]["runc"].pop("options")
        assert a == b


@containerd_bin
def test_containerd_v1_config_read_by_containerd(tmp_path):
    (tmp_path / "config.toml").write_text(CONTAINERD_V1)
    assert configure(tmp_path, "containerd", "config.toml", env=WITH_ENGINES).returncode == 0
    cri = dump(tmp_path / "config.toml")["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == RT
    assert cri["sandbox_image"] == "registry.example/pause:3.9"


# -- the file itself: links, owner, mode, what is not a regular file ---------------------------

def test_symlinked_config_is_written_through(tmp_path):
    """daemon.json kept elsewhere (configuration management) and linked from the engine's
    path: the file the link names gets the runtime, the link stays a link."""
    real = tmp_path / "managed" / "docker.json"
    real.parent.mkdir()
    real.write_text(DOCKER_EXISTING)
    link = tmp_path / "daemon.json"
    link.symlink_to("managed/docker.json")
    p = configure(tmp_path, "docker", "daemon.json")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"docker: updated {real} (the file {link} links to): runtimes.nvidia")
    assert link.is_symlink() and os.readlink(link) == "managed/docker.json"
    data = json.loads(real.read_text())
    assert data["runtimes"]["nvidia"] == {"path": RT} and data["data-root"] == "/srv/docker"
    assert configure(tmp_path, "docker", "daemon.json").stdout.startswith("docker: nothing to change: ")


def test_dangling_symlink_is_refused(tmp_path):
    link = tmp_path / "daemon.json"
    link.symlink_to(tmp_path / "gone" / "docker.json")
    p = configure(tmp_path, "docker", "daemon.json")
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"nvhook: {link} is a symbolic link to {tmp_path / 'gone' / 'docker.json'}, which does "
                           "not exist; nothing written")
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["daemon.json"]


@pytest.mark.parametrize("engine, name, text", [("docker", "daemon.json", DOCKER_EXISTING),
                                                ("containerd", "config.toml", CONTAINERD_V1)])
def test_owner_group_and_mode_are_kept(tmp_path, engine, name, text):
    """A root:docker 0640 daemon.json stays root:docker 0640 (here a group nobody else uses)."""
    path = tmp_path / name
    path.write_text(text)
    os.chown(path, 0, 4242)
    os.chmod(path, 0o640)
    ino = path.stat().st_ino
    p = configure(tmp_path, engine, name)
    assert p.returncode == 0, p.stderr
    st = path.stat()
    assert st.st_ino != ino  # replaced (atomically), not rewritten in place
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 4242, 0o640)


@pytest.mark.parametrize("kind", ["fifo", "directory", "fifo behind a link"])
def test_what_is_not_a_regular_file_is_refused_without_hanging(tmp_path, kind):
    path = tmp_path / "daemon.json"
    if kind == "directory":
        path.mkdir()
        what = "directory"
    else:
        fifo = tmp_path / "pipe" if kind == "fifo behind a link" else path
        os.mkfifo(fifo)
        if fifo != path:
            path.symlink_to(fifo)
        what = "FIFO"
    p = configure(tmp_path, "docker", "daemon.json")  # hostfix.nvhook's timeout: a hang fails the test
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith("nvhook: ") and f"is a {what}, not a regular file; nothing written" in line
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp file left


# --- --runtime-name: configs written for NVIDIA's Container Toolkit keep working ------------------

def test_runtime_name_nvidia_docker(tmp_path):
    (tmp_path / "daemon.json").write_text(DOCKER_EXISTING)
    p = configure(tmp_path, "docker", "daemon.json", "--runtime-name", "nvidia", "--set-as-default")
    assert p.returncode == 0, p.stderr
    data = json.loads((tmp_path / "daemon.json").read_text())  # what dockerd reads: JSON
    assert data["runtimes"] == {"nvidia": {"path": RT}} and data["default-runtime"] == "nvidia"
    assert data["log-driver"] == "journald" and data["data-root"] == "/srv/docker"
    assert "runtimes.nvidia, default-runtime" in p.stdout
    again = configure(tmp_path, "docker", "daemon.json", "--runtime-name", "nvidia", "--set-as-default")
    assert again.returncode == 0 and "nothing to change" in again.stdout and "registers nvidia" in again.stdout


def test_runtime_name_nvidia_crio(tmp_path):
    p = configure(tmp_path, "crio", "99-nvhook.conf", "--runtime-name", "nvidia")
    assert p.returncode == 0, p.stderr
    conf = tomlread.loads((tmp_path / "99-nvhook.conf").read_text())
    assert conf["crio"]["runtime"]["runtimes"] == {"nvidia": {"runtime_path": RT, "runtime_type": "oci"}}


def test_runtime_name_nvidia_containerd_v3(tmp_path):
    """containerd 2.x (config version 3): the handler a RuntimeClass names is the runtime's key
    under the CRI runtime plugin (read as TOML: this machine's containerd reads version 2 at most)."""
    (tmp_path / "config.toml").write_text(CONTAINERD_V3)
    assert configure(tmp_path, "containerd", "config.toml", "--runtime-name", "nvidia").returncode == 0
    drop = tomlread.loads((tmp_path / "conf.d" / "99-nvhook.toml").read_text())
    rts = drop["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert rts["nvidia"] == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": RT}}
    assert "nvhook" not in rts


@containerd_bin
@pytest.mark.parametrize("text", [CONTAINERD_V2_PLAIN, CONTAINERD_V2_CRI, None], ids=["v2-dropin", "v2-cri", "absent"])
def test_runtime_name_nvidia_containerd_reads_it(tmp_path, text):
    """containerd's own `config dump`: the runtime handler `nvidia` (a RuntimeClass's handler:
    nvidia) runs nvhook-runtime."""
    if text is not None:
        (tmp_path / "config.toml").write_text(text.replace("/etc/containerd/site.toml", str(tmp_path / "site.toml")))
    (tmp_path / "site.toml").write_text("version = 2\n")
    p = configure(tmp_path, "containerd", "config.toml", "--runtime-name", "nvidia", "--set-as-default")
    assert p.returncode == 0, p.stderr
    cri = dump(tmp_path / "config.toml")["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["runtimes"]["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert cri["runtimes"]["nvidia"]["options"]["BinaryName"] == RT
    assert cri["default_runtime_name"] == "nvidia" and "nvhook" not in cri["runtimes"]


@pytest.mark.parametrize("bad", ["NVIDIA", "nv_idia", "-nvidia", "a" * 64, ""])
def test_runtime_name_must_be_a_dns_label(tmp_path, bad):
    p = configure(tmp_path, "docker", "daemon.json", "--runtime-name", bad)
    assert p.returncode == 1 and p.stderr.startswith("nvhook: runtime name") and "DNS label" in p.stderr, p.stderr
    assert not (tmp_path / "daemon.json").exists()


# -- the engine's own word: containerd's `config dump` -----------------------------------------

V2_WITH_2X_IDS = """version = 2
# containerd 2.x's plugin ids in a version 2 file, as some managed nodes ship it
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
"""


@containerd_bin
def test_an_edit_containerd_does_not_read_is_put_back(tmp_path):
    """The CRI plugin configured in an imported site file: containerd 1.x merges imports a whole
    plugin table at a time, so a runtime in the main file is replaced by the site's table, and a
    drop-in of nvhook's would replace the site's settings. containerd's `config dump` says so for
    each: the files are put back byte for byte, one line says what containerd did not read and
    what to do, exit 1."""
    site = tmp_path / "site.toml"
    site.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "site/pause:1"\n')
    cfg = tmp_path / "config.toml"
    text = f'version = 2\nimports = ["{site}"]\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_selinux = false\n'
    cfg.write_text(text)
    os.chmod(cfg, 0o640)
    p = configure(tmp_path, "containerd", "config.toml", env=WITH_ENGINES)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1, p.stderr
    assert "containerd does not read the runtime as written" in p.stderr
    assert "no runtime 'nvidia'" in p.stderr and "every file put back, nothing changed" in p.stderr
    assert cfg.read_bytes() == text.encode() and stat.S_IMODE(cfg.stat().st_mode) == 0o640
    assert sorted(x.name for x in tmp_path.rglob("*") if x.is_file()) == ["config.toml", "site.toml"]
    assert not os.path.exists(record_of(tmp_path))  # nothing written: nothing to undo


@containerd_bin
def test_a_2x_layout_on_containerd_1x_gets_what_1x_reads(tmp_path):
    """A version 2 file with 2.x's plugin id on containerd 1.6: the runtime under that id is
    not what 1.6 reads (its dump says so, and it is put back); under 1.x's id it is."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(V2_WITH_2X_IDS)
    p = configure(tmp_path, "containerd", "config.toml", env=WITH_ENGINES)
    assert p.returncode == 0, p.stderr
    assert "plugins.io.containerd.grpc.v1.cri.containerd.runtimes.nvidia" in p.stdout
    assert "containerd: confirmed:" in p.stdout
    rt = dump(cfg)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    assert rt["options"]["BinaryName"] == RT


@containerd_bin
def test_confirmed_edit_changes_nothing_else_containerd_reads(tmp_path):
    """A version-less (version 1) config with a registry setting under the full plugin id:
    1.6 takes it for version 1, so the runtime goes under `plugins.cri`, and containerd's
    reading is its old one plus the runtime."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "/etc/containerd/certs.d"\n')
    before = dump(cfg)
    p = configure(tmp_path, "containerd", "config.toml", env=WITH_ENGINES)
    assert p.returncode == 0, p.stderr
    assert "plugins.cri.containerd.runtimes.nvidia" in p.stdout and "containerd: confirmed:" in p.stdout
    after = dump(cfg)
    runtimes = after["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes.pop("nvidia")["options"]["BinaryName"] == RT
    for d in (before, after):
        d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"].pop("options")
    assert after == before


# -- runtime unconfigure -------------------------------------------------------------------------

@pytest.mark.parametrize("engine, name, text", [
    ("docker", "daemon.json", DOCKER_EXISTING),
    ("docker", "daemon.json", None),
    ("containerd", "config.toml", CONTAINERD_V2_PLAIN),
    ("containerd", "config.toml", CONTAINERD_V1),
    ("containerd", "config.toml", None),
    ("crio", "99-nvhook.conf", None),
], ids=["docker", "docker-absent", "containerd-dropin", "containerd-v1", "containerd-absent", "crio"])
def test_unconfigure_puts_every_file_back_byte_for_byte(tmp_path, engine, name, text):
    if text is not None:
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o640)
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.rglob("*") if p.is_file()}
    assert configure(tmp_path, engine, name, "--set-as-default").returncode == 0
    assert files(tmp_path) != {str(p.relative_to(tmp_path)): b.decode() for p, (b, _) in before.items()}
    p = unconfigure(tmp_path, engine, name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.rglob("*") if p.is_file()} == before
    said = "put back" if text is not None else "removed"
    assert f"{engine}: {said} {tmp_path / name}" in p.stdout, p.stdout
    assert p.stdout.splitlines()[-1].endswith(f"systemctl restart {engine}")
    assert not os.path.exists(record_of(tmp_path))  # nothing left to undo: the record goes
    again = unconfigure(tmp_path, engine, name)
    assert again.returncode == 1
    assert again.stdout == f"{engine}: nothing to put back: {record_of(tmp_path)} has no record of " \
                           f"`runtime configure` for {tmp_path / name}\n"


def test_unconfigure_leaves_a_file_changed_since_alone(tmp_path):
    (tmp_path / "daemon.json").write_text(DOCKER_EXISTING)
    assert configure(tmp_path, "docker", "daemon.json").returncode == 0
    edited = (tmp_path / "daemon.json").read_text().replace('"journald"', '"local"')
    (tmp_path / "daemon.json").write_text(edited)
    p = unconfigure(tmp_path, "docker", "daemon.json")
    assert p.returncode == 1
    assert p.stdout == (f"docker: left alone: {tmp_path / 'daemon.json'} changed since `runtime configure` wrote it; "
                        "put it back by hand (or run `runtime configure` again and then unconfigure)\n")
    assert (tmp_path / "daemon.json").read_text() == edited


def test_a_second_configure_keeps_the_first_original(tmp_path):
    """configure twice (another runtime name): unconfigure goes back to the file before the
    first, not to the first's result."""
    (tmp_path / "daemon.json").write_text(DOCKER_EXISTING)
    assert configure(tmp_path, "docker", "daemon.json").returncode == 0
    assert configure(tmp_path, "docker", "daemon.json", "--runtime-name", "gpu").returncode == 0
    assert unconfigure(tmp_path, "docker", "daemon.json").returncode == 0
    assert (tmp_path / "daemon.json").read_text() == DOCKER_EXISTING


def test_a_file_node_install_recorded_is_left_to_node_uninstall(tmp_path):
    """`node install` runs configure with its own record (node-install.json beside configure's):
    configure keeps no second record of that file, and unconfigure points at node uninstall."""
    state = tmp_path.parent / f"{tmp_path.name}-state"
    state.mkdir()
    (state / "node-install.json").write_text(json.dumps({"version": 1, "paths": {str(tmp_path / "daemon.json"): {
        "kind": "file", "before": None}}}))
    rec = str(state / "runtime-configure.json")
    args = ("runtime", "configure", "--runtime", "docker", "--config", str(tmp_path / "daemon.json"),
            "--runtime-path", RT, "--record", rec)
    assert nvhook(*args, env=NO_ENGINES).returncode == 0
    assert not os.path.exists(rec)
    p = nvhook("runtime", "unconfigure", "--runtime", "docker", "--config", str(tmp_path / "daemon.json"),
               "--record", rec, env=NO_ENGINES)
    assert p.returncode == 1 and "`nvhook node uninstall` puts it back" in p.stdout
    assert (tmp_path / "daemon.json").exists()


def test_a_record_that_is_not_ours_is_refused(tmp_path):
    Path(record_of(tmp_path)).write_text("not json")
    p = configure(tmp_path, "docker", "daemon.json")
    assert p.returncode == 1 and "is not a record nvhook wrote" in p.stderr
    assert not (tmp_path / "daemon.json").exists()


@pytest.mark.parametrize("text", ["", "\n", "# managed by hand; nothing set yet\n"], ids=["empty", "newline", "comments"])
def test_an_empty_containerd_config_is_the_defaults(tmp_path, text):
    """An empty config.toml (or one with only comments) is containerd's defaults, not an unusual
    layout: it gets a version line (containerd's own: 2 where none answers here), the imports
    entry and the drop-in; its comments stay."""
    (tmp_path / "config.toml").write_text(text)
    p = configure(tmp_path, "containerd", "config.toml")
    assert p.returncode == 0, p.stderr
    got = (tmp_path / "config.toml").read_text()
    assert tomlread.loads(got) == {"version": 2, "imports": [str(tmp_path / "conf.d" / "99-nvhook.toml")]}
    assert got.startswith("version = 2\n") and text.strip() in got
    rt = tomlread.loads((tmp_path / "conf.d" / "99-nvhook.toml").read_text())
    assert rt["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]["options"] == {
        "BinaryName": RT}


@pytest.mark.parametrize("how", ["world-writable", "link"])
def test_a_record_another_user_could_write_is_refused(tmp_path, how):
    """The record says which bytes go back into an engine's config: one that is writable by
    others, or a link to elsewhere, is refused and nothing is put back."""
    (tmp_path / "daemon.json").write_text(DOCKER_EXISTING)
    assert configure(tmp_path, "docker", "daemon.json").returncode == 0
    rec = Path(record_of(tmp_path))
    if how == "link":
        real = tmp_path.parent / f"{tmp_path.name}-elsewhere.json"
        rec.rename(real)
        rec.symlink_to(real)
    else:
        os.chmod(rec, 0o666)
    configured = (tmp_path / "daemon.json").read_text()
    p = unconfigure(tmp_path, "docker", "daemon.json")
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert "is not a private record of this user" in p.stderr, p.stderr
    assert (tmp_path / "daemon.json").read_text() == configured
