"""`nvhook runtime enable-nri` (what `nvhook node install --nri` runs in the node): NRI turned on
in containerd's config where containerd has it off, the rest of the file kept byte for byte.
containerd's own reading (`config dump`) is checked with the Debian 13 node's containerd 1.7 in
tests/node/test_nri_node_install.py; here the file's own rules (no containerd answering), and a
containerd without NRI (this machine's 1.6, where it has one) refused.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvhook.base import tomlread
from nvhook.base.errors import HookError
from nvhook.commands.enginenri import CRIO_NRI_DROPIN, containerd_nri, crio_nri

NVHOOK = os.path.join(os.path.dirname(sys.executable), "nvhook")
NRI = ("plugins", "io.containerd.nri.v1.nri")

V2_OFF = """# site settings
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = true

[plugins."io.containerd.nri.v1.nri"]
  disable = true   # off until the plugin ships
  socket_path = "/var/run/nri/nri.sock"
  plugin_registration_timeout = "5s"
"""


def _nri(text: str, version_table=NRI) -> dict:
    d = tomlread.loads(text)
    for k in version_table:
        d = d[k]
    return d


def edit(tmp_path, text: str | None, enabled=None) -> tuple[str | None, str]:
    p = tmp_path / "config.toml"
    if text is not None:
        p.write_text(text)
    changes = containerd_nri(str(p), enabled)
    assert len(changes) <= 1
    return (changes[0].new if changes else None), str(p)


def test_disable_true_is_turned_off_in_place_keeping_the_rest(tmp_path):
    new, _ = edit(tmp_path, V2_OFF)
    assert new == V2_OFF.replace("  disable = true   # off until the plugin ships\n", "  disable = false\n")
    assert _nri(new) == {"disable": False, "socket_path": "/var/run/nri/nri.sock",
                         "plugin_registration_timeout": "5s"}


def test_containerd_17_config_without_the_table_gets_it_appended(tmp_path):
    """containerd 1.7's default is off: a version-2 config without the table gets one, in the
    config itself (a drop-in would replace the whole table in containerd 1.x)."""
    old = "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  enable_cdi = true\n"
    new, _ = edit(tmp_path, old)
    assert new == old + "\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = false\n"
    before, after = tomlread.loads(old), tomlread.loads(new)
    after["plugins"].pop("io.containerd.nri.v1.nri")
    assert after == before


def test_version_1_uses_the_short_plugin_name(tmp_path):
    old = "[plugins.cri]\n  sandbox_image = \"pause:3.8\"\n"
    new, _ = edit(tmp_path, old)
    assert new == old + "\n[plugins.nri]\n  disable = false\n"


def test_containerd_2_default_is_on(tmp_path):
    """A version-3 config (containerd 2.x) without the table: NRI is on, nothing to write; one
    that says `disable = true` is turned on."""
    assert edit(tmp_path, "version = 3\n")[0] is None
    new, _ = edit(tmp_path, "version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n")
    assert new is not None and _nri(new)["disable"] is False


def test_containerds_own_answer_wins(tmp_path):
    """`enabled` is containerd's `config dump` reading (its defaults, imports): on means nothing
    to write even where the file has no table; off means the edit even where the file says
    nothing (an old default)."""
    assert edit(tmp_path, "version = 2\n", enabled=True)[0] is None
    new, _ = edit(tmp_path, "version = 3\n", enabled=False)
    assert new == "version = 3\n\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = false\n"


def test_already_on_is_nothing_to_change(tmp_path):
    assert edit(tmp_path, V2_OFF.replace("disable = true", "disable = false"))[0] is None


def test_no_config_at_all(tmp_path):
    """containerd 1.7 on its built-in defaults: a version-2 config with the table."""
    new, _ = edit(tmp_path, None)
    assert new == "version = 2\n\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = false\n"


@pytest.mark.parametrize("text, says", [
    ("version = 2\nplugins = { \"io.containerd.nri.v1.nri\" = { disable = true } }\n",
     "cannot edit @P safely (its layout is unusual); nothing written; add by hand: "
     "[plugins.\"io.containerd.nri.v1.nri\"] disable = false"),
    ("version = 4\n", "@P: containerd config version 4 is not supported (1, 2 or 3); nothing written"),
    ("version = 2\n[plugins\n", "@P is not valid TOML"),
])
def test_a_config_it_cannot_edit_safely_is_refused(tmp_path, text, says):
    with pytest.raises(HookError) as e:
        edit(tmp_path, text)
    assert says.replace("@P", str(tmp_path / "config.toml")) in str(e.value)


def test_crio_dropin(tmp_path):
    p = tmp_path / "99-nvhook-nri.conf"
    [c] = crio_nri(str(p))
    assert tomlread.loads(c.new) == {"crio": {"nri": {"enable_nri": True}}}
    p.write_text(c.new)
    assert crio_nri(str(p)) == []
    assert CRIO_NRI_DROPIN == "/etc/crio/crio.conf.d/99-nvhook-nri.conf"


def test_cli_writes_keeps_mode_and_says_what_to_restart(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(V2_OFF)
    os.chmod(p, 0o600)
    env = {**os.environ, "PATH": "/nonexistent"}  # no containerd to ask: the file decides
    r = subprocess.run([NVHOOK, "runtime", "enable-nri", "--runtime", "containerd", "--config", str(p), "--dry-run"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "+  disable = false" in r.stdout and p.read_text() == V2_OFF, r.stdout + r.stderr
    r = subprocess.run([NVHOOK, "runtime", "enable-nri", "--runtime", "containerd", "--config", str(p)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"containerd: updated {p}: [plugins.\"io.containerd.nri.v1.nri\"] disable = false (NRI on)\n"
                        "containerd: restart the service to apply (nvhook restarts nothing): "
                        "systemctl restart containerd\n")
    assert _nri(p.read_text())["disable"] is False and os.stat(p).st_mode & 0o777 == 0o600
    r = subprocess.run([NVHOOK, "runtime", "enable-nri", "--runtime", "containerd", "--config", str(p)],
                       capture_output=True, text=True, env=env)
    assert r.stdout == f"containerd: nothing to change: NRI is on with {p}\n", r.stdout + r.stderr


def _containerd_version() -> str:
    if shutil.which("containerd") is None:
        return ""
    return subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout


@pytest.mark.skipif(" 1.6." not in _containerd_version(), reason="needs this machine's containerd 1.6 (no NRI)")
def test_a_containerd_without_nri_is_refused(tmp_path):
    """containerd 1.6's `config dump` has no NRI plugin: one line naming the fix, nothing written."""
    p = tmp_path / "config.toml"
    p.write_text("version = 2\n")
    r = subprocess.run([NVHOOK, "runtime", "enable-nri", "--runtime", "containerd", "--config", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == ("nvhook: the node's containerd has no NRI plugin (`containerd config dump` shows no "
                        "[plugins.\"io.containerd.nri.v1.nri\"]): NRI needs containerd 1.7 or newer; upgrade "
                        "containerd, or use the runtime class (leave --nri out)\n")
    assert p.read_text() == "version = 2\n"


def test_disabled_plugins_naming_nri_is_refused(tmp_path):
    """disabled_plugins wins over the table's `disable = false`: the edit would not turn NRI on."""
    with pytest.raises(HookError, match="disabled_plugins names 'io.containerd.nri.v1.nri', which turns NRI off"):
        edit(tmp_path, 'version = 2\ndisabled_plugins = ["io.containerd.nri.v1.nri"]\n')


@pytest.mark.parametrize("said, version", [
    ("containerd github.com/containerd/containerd 1.7.24~ds1 1.7.24~ds1-6+deb13u1\n", (1, 7)),
    ("containerd containerd.io 1.6.28 ae07eda36dd25f8a1b98dfbf587313b99c0190bb\n", (1, 6)),
    ("containerd github.com/containerd/containerd/v2 v2.0.4 1a43cb6a1035441f9aca8f5666a9b3ef9e70ab20\n", (2, 0)),
    ("something else\n", None),
])
def test_node_install_reads_containerds_version(said, version):
    """`node install --nri` refuses a containerd before 1.7 (no NRI) by its `--version`:
    upstream's, Docker's containerd.io and a distribution's spelling."""
    from nvhook.commands.nodesteps import containerd_version as _version

    assert _version(said) == version


def test_the_plugins_unit_names_the_engines_socket():
    """node install --nri writes the shipped unit run from /opt/nvhook, with the socket the
    node's containerd reads from its config where a site moved it; a socket path systemd would
    split or expand is refused."""
    from nvhook.commands.nodehost import unit_text

    shipped = (Path(__file__).resolve().parent.parent / "nvhook/data/systemd/nvhook-nri.service").read_text()
    default = unit_text("nvhook-nri.service").decode()
    assert default == shipped.replace("/usr/local/bin/nvhook", "/opt/nvhook/bin/nvhook")
    assert "ExecStart=/opt/nvhook/bin/nvhook nri --socket /var/run/nri/nri.sock\n" in default
    moved = unit_text("nvhook-nri.service", "/run/containerd/nri.sock").decode()
    assert moved == default.replace("--socket /var/run/nri/nri.sock", "--socket /run/containerd/nri.sock")
    for bad in ("/run/nri sock", "/run/%n.sock", "run/nri.sock", "/run/$X"):
        with pytest.raises(HookError, match="is not a plain absolute path"):
            unit_text("nvhook-nri.service", bad)
