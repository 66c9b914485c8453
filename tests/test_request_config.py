"""The [request] keys and devices.create_missing_nodes in the config: the shipped file shows
every default, bad values are one-line errors, and a config cached by an older nvhook (the
file unchanged by the upgrade) gets the new keys' defaults instead of crashing the hook."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nvhook.base import config, tomlread
from nvhook.base.errors import HookError

SHIPPED = Path(__file__).resolve().parent.parent / "config" / "hook.toml"


def test_shipped_hook_toml_is_every_default():
    with open(SHIPPED, "rb") as f:
        assert config.merge(tomlread.load(f), str(SHIPPED)) == config.DEFAULTS


@pytest.mark.parametrize("text", ['nvml = {\n  enabled = false,\n}\n', 'log_file = "/var/log/\\xe9.log"\n',
                                  'nvml = { enabled = false, }\n'],
                         ids=["multi-line-inline-table", "escape-x", "trailing-comma-inline-table"])
def test_toml_1_1_is_refused_on_every_python(tmp_path, monkeypatch, text):
    """One config file means the same on every node whatever its python3: TOML 1.0 as tomllib
    reads it (3.11 to 3.13), and so tomli where it stands in (before 3.11: a release before
    2.4, which reads TOML 1.1). The same key in TOML 1.0 is read."""
    monkeypatch.setenv("NVHOOK_RUN_DIR", str(tmp_path / "run"))
    f = tmp_path / "hook.toml"
    f.write_text(text)
    with pytest.raises(HookError, match=r"^config .*hook.toml is not valid TOML: "):
        config.load(str(f), explicit=True)
    f.write_text('nvml = { enabled = false }\nlog_file = "/var/log/\\u00e9.log"\n')
    cfg = config.load(str(f), explicit=True)
    assert cfg["nvml"]["enabled"] is False and cfg["log_file"] == "/var/log/\xe9.log"


@pytest.mark.parametrize("raw, needle", [
    ({"request": {"supported_driver_capabilities": "compute,gaming"}}, "supported_driver_capabilities must be"),
    ({"request": {"supported_driver_capabilities": ""}}, "supported_driver_capabilities must be"),
    ({"request": {"swarm_resource": "DOCKER RESOURCE"}}, "swarm_resource must list environment variable names"),
    ({"request": {"disable_require": "yes"}}, "disable_require must be true or false"),
    ({"devices": {"create_missing_nodes": 1}}, "create_missing_nodes must be true or false"),
    ({"request": {"load_kmods": True}}, "unknown key 'request.load_kmods'"),
], ids=["unknown-capability", "empty-capabilities", "bad-swarm-name", "bool-as-string", "int-as-bool", "unknown-key"])
def test_bad_values_are_one_line_errors(raw, needle):
    with pytest.raises(HookError, match=needle) as e:
        config.merge(raw, "hook.toml")
    assert "\n" not in str(e.value)


def test_config_cached_by_an_older_nvhook_gets_the_new_keys(tmp_path, monkeypatch):
    cache = tmp_path / "run"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NVHOOK_RUN_DIR", str(cache))
    f = tmp_path / "hook.toml"
    f.write_text('log_level = "debug"\n')
    st = os.stat(f)
    old = json.loads(json.dumps(config.DEFAULTS))
    old["log_level"] = "warning"  # differs from the file: proves the cache answered
    del old["request"], old["devices"]["create_missing_nodes"]  # what the previous release cached
    ident = config._ident(str(f), st)
    (cache / config._cache_name(ident)).write_text(json.dumps({"ident": ident, "config": old}))
    cfg = config.load(str(f), explicit=True)
    assert cfg["log_level"] == "warning"  # read from the cache, not the file
    assert cfg["request"] == config.DEFAULTS["request"]
    assert cfg["devices"]["create_missing_nodes"] is False


def test_config_edited_in_place_with_its_mtime_set_back_is_read_again(tmp_path, monkeypatch):
    """The resident client learns nvhookd's mode and socket from the config's cache entry only:
    a config rewritten in place (same inode) to the same size with its mtime restored (cp -p,
    rsync -t --inplace, deployments that pin mtimes) must not keep answering the old config."""
    cache = tmp_path / "run"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("NVHOOK_RUN_DIR", str(cache))
    f = tmp_path / "hook.toml"
    f.write_text('[daemon]\nsocket = "/run/a/nvhookd.sock"\n')
    assert config.load(str(f), explicit=True)["daemon"]["socket"] == "/run/a/nvhookd.sock"
    assert config.load_cached(str(f))["daemon"]["socket"] == "/run/a/nvhookd.sock"  # cached
    before = os.stat(f)
    with open(f, "r+b") as fh:
        fh.write(b'[daemon]\nsocket = "/run/b/nvhookd.sock"\n')
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(f)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert config.load_cached(str(f)) is None  # nvhook.start.hook reads the file again
    assert config.load(str(f), explicit=True)["daemon"]["socket"] == "/run/b/nvhookd.sock"
