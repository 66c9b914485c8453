"""The [request] keys and devices.create_missing_nodes in the config: the shipped file shows
every default, bad values are one-line errors, and a config cached by an older nvhook (the
file unchanged by the upgrade) gets the new keys' defaults instead of crashing the hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# -- `nvhook config import`: NVIDIA Container Toolkit's config.toml as nvhook's ----------------

# A typical /etc/nvidia-container-runtime/config.toml of a 1.18-1.20 node, written by hand from
# the keys of NVIDIA's config struct (api/config/v1), with the operator's usual changes.
NVIDIA_TOML = """\
accept-nvidia-visible-devices-as-volume-mounts = true
accept-nvidia-visible-devices-envvar-when-unprivileged = false
disable-require = true
supported-driver-capabilities = "compute,utility,video"
swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig.real"
load-kmods = true
no-cgroups = true
root = "/run/nvidia/driver"
user = "root:video"

[nvidia-container-runtime]
log-level = "warn"
mode = "cdi"
runtimes = ["no-such-runtime-here", "/usr/bin/crun"]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]

[nvidia-container-runtime.modes.legacy]
cuda-compat-mode = "disabled"

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false

[nvidia-ctk]
path = "nvidia-ctk"

[features]
ignore-imex-channel-requests = true
"""



def nvhook_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("nvhook")
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, env=env)


def test_import_carries_every_key_with_a_meaning_and_names_each_other_one(tmp_path):
    src = tmp_path / "config.toml"
    src.write_text(NVIDIA_TOML)
    p = nvhook_cli("config", "import", str(src))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "hook.toml"
    out.write_text(p.stdout)
    with open(out, "rb") as f:
        raw = tomlread.load(f)
    assert raw == {
        "root": "/run/nvidia/driver", "log_level": "warning",
        "devices": {"accept_volume_mounts": True, "accept_envvar_unprivileged": False},
        "request": {"disable_require": True, "supported_driver_capabilities": "compute,utility,video",
                    "swarm_resource": "DOCKER_RESOURCE_GPU", "ignore_imex_channel_requests": True},
        "compat": {"mode": "host"},
        "runtime": {"path": "/usr/bin/crun"} if os.access("/usr/bin/crun", os.X_OK)
        else {"path": "no-such-runtime-here"},
    }
    # `config check` accepts it (a driver root missing here is a warning, exit 0)
    check = nvhook_cli("config", "check", str(out))
    assert check.returncode == 0, check.stderr
    # one stderr line per key that is not carried over, naming it and why; the keys whose value
    # is what nvhook does anyway (default-kind, annotation-prefixes, environment = []) say nothing
    lines = p.stderr.splitlines()
    left_out = [ln.split(":", 2)[1].strip() for ln in lines]
    assert sorted(left_out) == sorted([
        "nvidia-container-cli.ldconfig", "nvidia-container-cli.load-kmods", "nvidia-container-cli.no-cgroups",
        "nvidia-container-cli.user", "nvidia-container-runtime.mode", "nvidia-container-runtime.modes.cdi.spec-dirs",
        "nvidia-container-runtime-hook.path", "nvidia-ctk.path"])
    assert all(ln.startswith("nvhook: ") and ": not carried over: " in ln for ln in lines)
    assert any("load-kmods: not carried over: nvhook never loads kernel modules" in ln for ln in lines)


@pytest.mark.parametrize("mode, want", [("disabled", "host"), ("ldconfig", "auto"), ("mount", "auto"),
                                        ("hook", "auto")])
def test_import_cuda_compat_mode(tmp_path, mode, want):
    src = tmp_path / "config.toml"
    src.write_text(f'[nvidia-container-runtime.modes.legacy]\ncuda-compat-mode = "{mode}"\n')
    p = nvhook_cli("config", "import", str(src))
    assert p.returncode == 0 and p.stderr == ""
    assert tomlread.loads(p.stdout) == {"compat": {"mode": want}}


@pytest.mark.parametrize("text, line", [
    ('[nvidia-container-runtime]\nlog-level = "verbose"\n',
     "nvhook: nvidia-container-runtime.log-level = 'verbose': not carried over: is not a log level"),
    ('[nvidia-container-cli]\nroot = "run/nvidia/driver"\n', "nvhook: nvidia-container-cli.root: not carried over: root"),
    ('supported-driver-capabilities = "compute,gaming"\n',
     "nvhook: supported-driver-capabilities: not carried over: request.supported_driver_capabilities must be"),
    ('[nvidia-container-runtime.modes.legacy]\ncuda-compat-mode = "magic"\n',
     "nvhook: nvidia-container-runtime.modes.legacy.cuda-compat-mode = 'magic': not carried over: is not one of"),
    ('gpus = 8\n', "nvhook: gpus: not carried over: not a key of NVIDIA's config.toml"),
    ('"a\\nb\\u001b[2J" = 1\n', "nvhook: 'a\\nb\\x1b[2J': not carried over: not a key"),
    ('[nvidia-container-runtime]\nlog-level = "\\u001b[2J\\r"\n',
     "nvhook: nvidia-container-runtime.log-level = '\\x1b[2J\\r': not carried over: is not a log level"),
], ids=["log-level", "relative-root", "unknown-capability", "compat-mode", "unknown-key", "hostile-key",
        "hostile-value"])
def test_import_leaves_a_bad_value_out_in_one_line(tmp_path, text, line):
    src = tmp_path / "config.toml"
    src.write_text(text)
    p = nvhook_cli("config", "import", str(src))
    assert p.returncode == 0
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(line), p.stderr
    config.merge(tomlread.loads(p.stdout), "imported")  # what is printed is still a valid config


def test_import_of_a_missing_or_broken_file_is_one_line(tmp_path):
    p = nvhook_cli("config", "import", str(tmp_path / "none.toml"))
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == f"nvhook: no NVIDIA config at {tmp_path / 'none.toml'} (name the file: nvhook config import FILE)\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("[nvidia-container-cli\n")
    p = nvhook_cli("config", "import", str(bad))
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.splitlines()) == 1
    assert p.stderr.startswith(f"nvhook: {bad} is not valid TOML")


@pytest.mark.parametrize("text, hint", [
    ("disable-require = true\n", "(disable-require is NVIDIA's key: nvhook's is request.disable_require;"),
    ('[nvidia-container-cli]\nroot = "/run/nvidia/driver"\n',
     "(nvidia-container-cli.root is NVIDIA's key: nvhook's is root;"),
    ('[nvidia-container-runtime]\nlog-level = "info"\n',
     "(nvidia-container-runtime.log-level is NVIDIA's key: nvhook's is log_level;"),
    ("[nvidia-container-cli]\nload-kmods = true\n",
     "(nvidia-container-cli.load-kmods is NVIDIA's key, which nvhook has no counterpart for: nvhook never loads"),
], ids=["top-level", "cli-root", "log-level", "no-counterpart"])
def test_config_check_on_nvidia_s_file_names_the_nvhook_key(tmp_path, text, hint):
    f = tmp_path / "config.toml"
    f.write_text(text)
    p = nvhook_cli("config", "check", str(f))
    assert p.returncode == 1 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and hint in p.stderr
    assert "`nvhook config import FILE` converts NVIDIA's whole config.toml)" in p.stderr


def test_import_of_nvidia_s_own_default_config(tmp_path):
    """NVIDIA's `nvidia-ctk config default` (1.20.0, built by bench/build_reference_cdi.sh)."""
    base = os.environ.get("NVHOOK_REFERENCE_CDI")
    ctk = Path(base or "/nonexistent") / "v1.20.0" / "nvidia-ctk"
    if not ctk.is_file():
        pytest.skip("NVIDIA's nvidia-ctk v1.20.0 is not built: run bench/build_reference_cdi.sh DIR TOOLKIT_GIT "
                    "and set NVHOOK_REFERENCE_CDI=DIR")
    src = tmp_path / "config.toml"
    src.write_bytes(subprocess.run([str(ctk), "config", "default"], capture_output=True, check=True,
                                   timeout=60).stdout)
    p = nvhook_cli("config", "import", str(src))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "hook.toml"
    out.write_text(p.stdout)
    assert nvhook_cli("config", "check", str(out)).returncode == 0
    got = tomlread.loads(p.stdout)
    assert got["compat"] == {"mode": "auto"} and got["request"]["disable_require"] is False
    left_out = sorted(ln.split(":", 2)[1].strip() for ln in p.stderr.splitlines())
    assert "nvidia-container-cli.load-kmods" in left_out and "nvidia-container-runtime.mode" in left_out
    assert "nvidia-container-runtime.modes.cdi.default-kind" not in left_out
