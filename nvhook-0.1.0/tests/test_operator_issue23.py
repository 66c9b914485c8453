"""Issue 23, what an operator types: `config check` on a root that is not a driver root,
"did you mean" for a misspelled key, doctor on a bad root or bundle, and nvhook's own messages
kept clear of the phrases engines misread. The installed console script runs in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostfix import assert_one_line_error, bundle, config_check, nvhook, scratch_config


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("i23cfg")
    return scratch_config(d)


# --- config check: a root that is not a driver root -----------------------------------------------

def _check(tmp_path: Path, root: Path | str, *args: str):
    f = tmp_path / "hook.toml"
    return f, config_check(f, f"root = {json.dumps(str(root))}\n", *args)


def test_config_check_accepts_a_driver_root(tmp_path, fixtures_root):
    f, p = _check(tmp_path, fixtures_root / "host-gpu8")
    assert (p.returncode, p.stdout, p.stderr) == (0, f"{f}: ok\n", "")


@pytest.mark.parametrize("case", ["missing", "no-procfs", "no-libraries"])
def test_config_check_warns_about_a_root_that_is_not_a_driver_root(tmp_path, case):
    root = tmp_path / "host"
    if case != "missing":
        (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
        if case == "no-procfs":
            (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").write_text("")
        else:
            (root / "proc/driver/nvidia").mkdir(parents=True)
    f, p = _check(tmp_path, root)
    assert p.returncode == 0 and p.stdout == f"{f}: ok (1 warning)\n", (p.stdout, p.stderr)
    (line,) = p.stderr.splitlines()
    want = {"missing": "does not exist or isn't a directory", "no-procfs": "has no proc/driver/nvidia",
            "no-libraries": "no NVIDIA driver library"}[case]
    assert line.startswith(f"warning: root = '{root}' (root in {f}): ") and want in line, line
    # --strict: a warning fails the check; --format json lists them
    _, p = _check(tmp_path, root, "--strict")
    assert p.returncode == 1
    _, p = _check(tmp_path, root, "--format", "json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["ok"] and len(out["warnings"]) == 1 and want in out["warnings"][0]


@pytest.mark.parametrize("text, hint", [
    ('log_levl = "debug"\n', "unknown key 'log_levl'; did you mean 'log_level'?"),
    ("[nvml]\ntimout = 3\n", "unknown key 'nvml.timout'; did you mean 'nvml.timeout'?"),
    ("[nvm]\nenabled = true\n", "unknown section [nvm]; did you mean 'nvml'?"),
    ("accept_volume_mounts = true\n", "did you mean 'devices.accept_volume_mounts'?"),
])
def test_misspelled_key_gets_did_you_mean(tmp_path, text, hint):
    f = tmp_path / "hook.toml"
    assert_one_line_error(config_check(f, text), 1, str(f), hint)


# --- doctor on a bad root or bundle ---------------------------------------------------------------

def test_doctor_bad_root_is_one_line(fixtures_root, conf, tmp_path):
    b = bundle(tmp_path / "b", fixtures_root / "container-debian", ["NVIDIA_VISIBLE_DEVICES=0"])
    p = nvhook("--config", str(conf), "doctor", "--root", "/nonexistent", "--bundle", str(b))
    line = assert_one_line_error(p, 1, "host root /nonexistent")
    assert "internal error" not in line and "not a directory" not in line


@pytest.mark.parametrize("case", ["missing-bundle", "no-config-json", "rootfs-missing", "rootfs-is-a-file"])
def test_doctor_bad_bundle_is_one_line(fixtures_root, conf, tmp_path, case):
    b = tmp_path / "b"
    needle = str(b)
    if case == "no-config-json":
        b.mkdir()
    elif case.startswith("rootfs"):
        rootfs = tmp_path / "rootfs"
        if case == "rootfs-is-a-file":
            rootfs.write_text("")
        bundle(b, rootfs, ["NVIDIA_VISIBLE_DEVICES=0"])
        needle = f"container rootfs {rootfs}"
    p = nvhook("--config", str(conf), "doctor", "--root", str(fixtures_root / "host-gpu8"), "--bundle", str(b))
    line = assert_one_line_error(p, 1, needle)
    assert "internal error" not in line


# --- phrases engines misread ----------------------------------------------------------------------

def test_messages_avoid_phrases_engines_misread(tmp_path, conf, fixtures_root):
    """podman reads "No such file or directory" as a missing runtime; Docker reads "not a
    directory" as a bind mount of a directory onto a file. nvhook says both otherwise."""
    b = bundle(tmp_path / "b", tmp_path / "no-rootfs", ["NVIDIA_VISIBLE_DEVICES=0"])
    said = [
        nvhook("--config", str(conf), "--root", str(tmp_path / "no-root"), "info").stderr,
        nvhook("--config", str(tmp_path / "missing.toml"), "info").stderr,
        nvhook("--config", str(conf), "--root", str(fixtures_root / "host-gpu8"), "--dry-run", "--bundle",
               str(b)).stderr,
        nvhook("--config", str(conf), "--dry-run", "--bundle", str(tmp_path / "no-bundle")).stderr,
    ]
    for s in said:
        assert s.startswith("nvhook: ") and len(s.splitlines()) == 1, s
        assert "no such file or directory" not in s.lower() and "not a directory" not in s.lower(), s
    assert "does not exist" in said[1] and "isn't a directory" in said[0]


# --- nvhook config set ------------------------------------------------------------------------

def test_config_set_keeps_comments_types_values_and_keeps_owner_mode(tmp_path):
    import os

    shipped = (Path(__file__).resolve().parents[1] / "config" / "hook.toml").read_text()
    f = tmp_path / "hook.toml"
    f.write_text(shipped)
    os.chmod(f, 0o640)
    os.chown(f, 4321, 4322)
    p = nvhook("config", "set", "--config", str(f), "daemon.mode=off", "log_level=debug", "nvml.timeout=2.5",
               "devices.accept_volume_mounts=true", "root=/srv/host")
    assert p.returncode == 0 and p.stdout == (f"{f}: set daemon.mode, log_level, nvml.timeout, "
                                              "devices.accept_volume_mounts, root\n"), p.stderr
    new = f.read_text()
    changed = [(a, b) for a, b in zip(shipped.splitlines(), new.splitlines()) if a != b]
    assert len(shipped.splitlines()) == len(new.splitlines())
    assert changed == [('root = "/"', 'root = "/srv/host"'),
                       ('log_level = "info"            # debug | info | warning | error',
                        'log_level = "debug"            # debug | info | warning | error'),
                       ("accept_volume_mounts = false", "accept_volume_mounts = true"),
                       ("timeout = 5.0", "timeout = 2.5"), ('mode = "auto"', 'mode = "off"')], changed
    st = f.stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, 4321, 4322)
    cfg = json.loads(nvhook("config", "check", "--format", "json", str(f)).stdout)["config"]
    assert cfg["daemon"]["mode"] == "off" and cfg["nvml"]["timeout"] == 2.5 and cfg["devices"]["accept_volume_mounts"]
    again = nvhook("config", "set", "--config", str(f), "daemon.mode=off")
    assert again.returncode == 0 and again.stdout == f"{f}: unchanged\n"


def test_config_set_adds_keys_and_tables_and_reads_nvhook_config(tmp_path):
    f = tmp_path / "hook.toml"
    f.write_text('# mine\nlog_level = "info"\n\n[nvml]\nenabled = true  # keep\n')
    p = nvhook("config", "set", "cache_dir=/run/x", "nvml.timeout=3", "daemon.socket=/run/s.sock",
               env={"NVHOOK_CONFIG": str(f)})
    assert p.returncode == 0, p.stderr
    assert f.read_text() == ('# mine\nlog_level = "info"\ncache_dir = "/run/x"\n\n[nvml]\nenabled = true  # keep\n'
                             'timeout = 3\n\n[daemon]\nsocket = "/run/s.sock"\n')


@pytest.mark.parametrize("arg, needle", [
    ("daemon.mod=off", "unknown key 'daemon.mod'; did you mean 'daemon.mode'?"),
    ("log_level=loud", "log_level must be one of debug, info, warning, error, not 'loud'"),
    ("nvml.timeout=soon", "nvml.timeout must be a number, not 'soon'"),
    ("nvml.enabled=maybe", "nvml.enabled must be true or false, not 'maybe'"),
    ("root=relative/dir", "root must be an absolute path"),
    ("log_level", "is not KEY=VALUE"),
])
def test_config_set_refuses_and_writes_nothing(tmp_path, arg, needle):
    f = tmp_path / "hook.toml"
    f.write_text('log_level = "info"\n')
    assert_one_line_error(nvhook("config", "set", "--config", str(f), arg), 1, needle)
    assert f.read_text() == 'log_level = "info"\n' and [p.name for p in tmp_path.iterdir()] == ["hook.toml"]


def test_config_set_a_missing_file_starts_from_the_default(tmp_path):
    f = tmp_path / "etc" / "hook.toml"
    p = nvhook("config", "set", "--config", str(f), "daemon.mode=off")
    assert p.returncode == 0 and p.stdout == f"{f}: created with daemon.mode\n", p.stderr
    assert "# nvhook configuration." in f.read_text() and 'mode = "off"' in f.read_text()
    assert nvhook("config", "check", str(f)).returncode == 0


# --- cdi: options after the subcommand ------------------------------------------------------------

def test_cdi_takes_global_options_after_the_subcommand(tmp_path, fixtures_root, conf):
    host = fixtures_root / "host-gpu8"
    before = nvhook("--config", str(conf), "--root", str(host), "cdi", "generate")
    after = nvhook("cdi", "generate", "--config", str(conf), "--root", str(host))
    assert after.returncode == 0, after.stderr
    assert after.stdout == before.stdout
    spec = json.loads(after.stdout)
    assert spec["containerEdits"]["hooks"][0]["args"][1:5] == ["--config", str(conf), "--root", str(host)]
    out = tmp_path / "spec.json"
    out.write_text(after.stdout)
    assert nvhook("cdi", "check", str(out), "--config", str(conf), "--root", str(host)).returncode == 0
    listed = nvhook("cdi", "list", "--root", str(host), "--config", str(conf), "--format", "json", str(out))
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["name"] == "nvidia.com/gpu=0"


# --- setup: --dry-run says what it would do; --config is the config the hooks file names ----------

def test_setup_dry_run_says_would_and_changes_nothing(tmp_path):
    pfx = tmp_path / "root"
    p = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/usr/bin/nvhook", "--dry-run")
    assert p.returncode == 0, p.stderr
    actions = [line.split("  ", 1)[0] for line in p.stdout.splitlines()]
    assert actions == ["would create"] * 4 and not pfx.exists(), p.stdout
    assert nvhook("setup", "--prefix", str(pfx), "--hook-path", "/usr/bin/nvhook").returncode == 0
    p = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/usr/bin/nvhook", "--uninstall", "--dry-run")
    assert [line.split("  ", 1)[0] for line in p.stdout.splitlines()] == ["would remove"] * 4, p.stdout
    assert (pfx / "etc/nvhook/hook.toml").exists()
    p = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/usr/bin/nvhook", "--dry-run", "--format", "json")
    assert {d["action"] for d in json.loads(p.stdout)} == {"unchanged"}


@pytest.mark.parametrize("where", ["before", "after"])
def test_setup_honours_config(tmp_path, where):
    pfx = tmp_path / "root"
    opt = ["--config", "/etc/nvhook/gpu-nodes.toml"]
    args = ["setup", "--prefix", str(pfx), "--hook-path", "/usr/bin/nvhook"]
    p = nvhook(*(opt + args if where == "before" else args + opt))
    assert p.returncode == 0, p.stderr
    hooks = json.loads((pfx / "etc/containers/oci/hooks.d/nvhook.json").read_text())
    assert "NVHOOK_CONFIG=/etc/nvhook/gpu-nodes.toml" in hooks["hook"]["env"]
    assert (pfx / "etc/nvhook/gpu-nodes.toml").exists() and not (pfx / "etc/nvhook/hook.toml").exists()


def test_a_guessed_brand_is_never_reported_as_nvmls():
    """doctor's GPU lines and the compat decision name where a brand came from: one guessed
    from the procfs model name stays a guess, whoever carried it."""
    from nvhook.decide import compat

    guessed = compat.gpu_support({"index": 0, "model": "NVIDIA GeForce RTX 4090", "brand": "geforce",
                                  "brand_source": "guessed"}, None)
    assert (guessed["brand_source"], guessed["guessed"]) == ("procfs-guess", True)
    known = compat.gpu_support({"index": 0, "model": "Tesla T4", "brand": "tesla", "brand_id": 2}, None)
    assert (known["brand_source"], known["guessed"]) == ("nvml", False)
