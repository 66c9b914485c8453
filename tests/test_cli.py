"""The `nvhook` command as users run it (the installed console script, in a subprocess): hook
mode, --dry-run, info, list, the global options, and what every error looks like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostfix import (  # noqa: F401
    NVHOOK,
    assert_one_line_error,
    assert_schema,
    bundle,
    copy_host,
    events,
    fx,
    mf,
    named,
    nvhook,
    private_dir,
    processes,
    scratch_config,
    spec,
    state,
    tree_snapshot,
    write_config,
)

DRIVER = "535.261.03"
GPU8 = spec("host-gpu8").gpus


def _no_such_pid() -> int:
    """A pid no process can have: hook mode needs one, and nothing must ever be applied to it."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


NO_PID = _no_such_pid()


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("clicfg")
    return scratch_config(d)


@pytest.fixture
def run(fx, conf):
    """run(*args, host=, stdin=, env=) with --config and --root set."""
    def go(*args, host="host-gpu1", root=None, config=None, **kw):
        return nvhook("--config", str(config or conf), "--root", str(root or fx / host), *args, **kw)
    return go


@pytest.fixture
def ctr(fx, tmp_path):
    """ctr(*env) -> a bundle for container-debian with that environment."""
    n = [0]

    def make(*env, container="container-debian", **kw):
        n[0] += 1
        return bundle(tmp_path / f"bundle{n[0]}", fx / container, env, **kw)
    return make


# --- errors: one line, the offending value, exit 1; never a traceback --------------------------

@pytest.mark.parametrize("text", ['{"id": "x", "bundle": ', "{bad", "{'id': 'x'}", '{"id": "x"} trailing'])
def test_malformed_state_json(run, text):
    # --log-file '': the state is read before the config, so its error would go to the default
    # log, the machine's /var/log/nvhook.log
    for mode in (["--dry-run"], ["prestart"], []):
        assert_one_line_error(run("--log-file", "", *mode, stdin=text), 1, "malformed OCI state on stdin")


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"id": "x"}', "no bundle path"),
    ('{"id": "x", "bundle": "/b", "pid": "abc"}', "'abc'"),
    ('{"id": "x", "bundle": "/b", "pid": -5}', "-5"),
    ('{"id": 7, "bundle": "/b"}', "id must be a string, got 7"),
    ("", "no OCI state on stdin"),
    ("\xff\xfe{", "malformed OCI state"),
])
def test_bad_states(run, text, needle):
    for mode in (["--dry-run"], ["createRuntime"]):
        assert_one_line_error(run("--log-file", "", *mode, stdin=text), 1, needle)  # not /var/log's


def test_missing_bundle_config(run, tmp_path):
    missing = tmp_path / "nothing-here"
    assert_one_line_error(run("--dry-run", "--bundle", str(missing)), 1, f"{missing}/config.json",
                          "does not exist")
    assert_one_line_error(run("prestart", stdin=state(missing, pid=NO_PID)), 1, f"{missing}/config.json")


@pytest.mark.parametrize("content, needle", [
    ("{not json", "malformed bundle config"),
    ("[]", "expected a JSON object"),
    ('{"process": {}}', "root.path is missing"),
    ('{"root": {"path": "no-such-rootfs"}}', "no-such-rootfs"),
    ('{"root": {"path": "/"}, "process": {"env": "PATH=/bin"}}', "process.env must be a list"),
    ('{"root": {"path": "/"}, "process": {"env": [1]}}', "process.env entry 1"),
])
def test_malformed_bundle_config(run, tmp_path, content, needle):
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text(content)
    line = assert_one_line_error(run("--dry-run", "--bundle", str(b)), 1, needle)
    if "rootfs" not in needle and "no-such" not in needle:
        assert str(b / "config.json") in line
    assert_one_line_error(run(stdin=state(b, pid=NO_PID)), 1, needle)


@pytest.mark.parametrize("env, needles", [
    (("NVIDIA_VISIBLE_DEVICES=0,7",), ("unknown device '7'", "NVIDIA_VISIBLE_DEVICES")),
    (("NVIDIA_VISIBLE_DEVICES=GPU-12345678-aaaa-bbbb-cccc-000000000000",), ("'GPU-12345678-aaaa-bbbb-cccc-000000000000'",)),
    (("NVIDIA_VISIBLE_DEVICES=0000:99:00.0",), ("unknown device '0000:99:00.0'",)),
    (("NVIDIA_VISIBLE_DEVICES=none,0",), ("'none' cannot be combined",)),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,telepathy"),
     ("unknown capability 'telepathy'", "NVIDIA_DRIVER_CAPABILITIES")),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=13.0"),
     ("unsatisfied requirement NVIDIA_REQUIRE_CUDA='cuda>=13.0'", DRIVER, "CUDA 12.2")),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_DRIVER=driver>=999"),
     ("unsatisfied requirement NVIDIA_REQUIRE_DRIVER='driver>=999'",)),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_X=brand=geforce"),
     ("NVIDIA_REQUIRE_X='brand=geforce'", "brand=tesla")),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda~12"), ("malformed requirement 'cuda~12'",)),
    (("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=color=blue"), ("unknown requirement key 'color'",)),
])
def test_request_errors_in_dry_run_and_hook_mode(run, ctr, env, needles):
    b = ctr(*env)
    assert_one_line_error(run("--dry-run", "--bundle", str(b)), 1, *needles)
    assert_one_line_error(run("prestart", stdin=state(b, pid=NO_PID)), 1, *needles)
    assert_one_line_error(run("--dry-run", stdin=state(b)), 1, *needles)


def test_hook_mode_refuses_a_state_without_pid(run, ctr):
    b = ctr("NVIDIA_VISIBLE_DEVICES=0")
    for stage in ("prestart", "createRuntime"):
        assert_one_line_error(run(stage, stdin=state(b, pid=None)), 1, "no pid")


def test_corrupt_host_cache_is_one_line(run, ctr, fx):
    b = ctr("NVIDIA_VISIBLE_DEVICES=0")
    cache = str(fx / "host-badcache/etc/ld.so.cache")
    for args, stdin in ((["info"], None), (["list"], None), (["--dry-run", "--bundle", str(b)], None),
                        (["prestart"], state(b, pid=NO_PID))):
        assert_one_line_error(run(*args, host="host-badcache", stdin=stdin), 1, "corrupt ld.so.cache", cache)


def _controls(value: object) -> set[str]:
    """The control characters in every string a decoded JSON value holds (what `jq -r` prints)."""
    if isinstance(value, str):
        return {c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0}
    if isinstance(value, list):
        return set().union(*map(_controls, value)) if value else set()
    if isinstance(value, dict):
        return _controls(list(value)) | _controls(list(value.values()))
    return set()


def test_log_fields_carry_no_control_characters_container_id_included(run, ctr, tmp_path):
    """A runtime hands the hook an id with an escape sequence: in the log every field, the
    container id included, has it as "?" (`jq -r .container` must not drive the terminal)."""
    evil = "ctr\x1b]0;owned\x07\x1b[2J\r\x9b31m"
    log = tmp_path / "hook.log"
    b = ctr("NVIDIA_VISIBLE_DEVICES=void")
    gpu = ctr("NVIDIA_VISIBLE_DEVICES=0")
    assert run("--log-file", str(log), "prestart", stdin=state(b, pid=NO_PID, cid=evil)).returncode == 0
    assert run("--log-file", str(log), "prestart", stdin=state(gpu, pid=NO_PID, cid=evil)).returncode == 1
    evs = events(log)
    assert len({e["event"] for e in evs}) > 1 and named(evs, "hook.failed")
    for e in evs:
        assert e["container"] == "ctr?]0;owned??[2J??31m", e
        assert not _controls(e), e


def test_host_root_that_is_not_a_directory(run, tmp_path):
    assert_one_line_error(run("info", root=tmp_path / "nope"), 1, str(tmp_path / "nope"), "isn't a directory")


@pytest.mark.parametrize("text, needle", [
    ("log_level = [\n", "not valid TOML"),
    ("bogus = 1\n", "unknown key 'bogus'"),
    ("[nvml]\ntimeout = -1\n", "nvml.timeout"),
    ("[nvml]\ntimeout = true\n", "nvml.timeout"),
    ("log_level = \"loud\"\n", "'loud'"),
    ("[gpu]\nx = 1\n", "unknown section [gpu]"),
])
def test_malformed_config_is_one_line(run, ctr, tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    b = ctr("NVIDIA_VISIBLE_DEVICES=void")
    gpu = ctr("NVIDIA_VISIBLE_DEVICES=0")
    log = tmp_path / "hook.log"  # without the config, the hook logs to --log-file (else /var/log/nvhook.log)
    for args, stdin in ((["info"], None), (["--dry-run", "--bundle", str(b)], None),
                        (["--log-file", str(log), "prestart"], state(gpu, pid=NO_PID))):
        assert_one_line_error(run(*args, config=cfg, stdin=stdin), 1, str(cfg), needle)
    (failed,) = named(events(log), "hook.failed")
    assert failed["container"] == "test" and str(cfg) in failed["error"]
    # a container that asks for no GPU starts whatever the config's state (one warning line)
    p = run("--log-file", str(log), "prestart", config=cfg, stdin=state(b, pid=NO_PID))
    assert p.returncode == 0 and p.stderr.startswith("nvhook: warning: ") and needle in p.stderr
    assert len(p.stderr.splitlines()) == 1
    assert named(events(log), "config.unusable")


def test_missing_config_file_named_explicitly(fx, tmp_path):
    missing = tmp_path / "missing.toml"
    root = str(fx / "host-gpu1")
    assert_one_line_error(nvhook("--config", str(missing), "--root", root, "info"), 1, str(missing))
    assert_one_line_error(nvhook("--root", root, "info", env={"NVHOOK_CONFIG": str(missing)}), 1, str(missing))


@pytest.mark.parametrize("args", [
    ["--dry-run", "--format", "xml"],
    ["no-such-command"],
    ["--bundle", "/tmp"],
    ["prestart", "extra"],
    ["--log-level", "loud", "info"],
    ["doctor"],
])
def test_usage_errors_exit_2_without_traceback(run, args):
    p = run(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("args, needle", [
    (["--dry-run", "--format", "xml"], "'xml'"),
    (["no-such-command"], "no-such-command"),
])
def test_usage_errors_are_one_line(run, args, needle):
    assert_one_line_error(run(*args), 2, needle)


# --- --dry-run ---------------------------------------------------------------------------------

def test_dry_run_from_bundle_and_from_stdin_state(run, ctr):
    b = ctr("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    a = run("--dry-run", "--bundle", str(b), "--format", "json", host="host-gpu8")
    s = run("--dry-run", "--format", "json", host="host-gpu8", stdin=state(b, pid=4321, cid="from-stdin"))
    assert a.returncode == 0 and s.returncode == 0, (a.stderr, s.stderr)
    pa, ps = json.loads(a.stdout), json.loads(s.stdout)
    assert pa["container"]["pid"] is None and pa["container"]["id"] == b.name
    assert ps["container"] == {"id": "from-stdin", "pid": 4321, "rootfs": pa["container"]["rootfs"]}
    assert {k: v for k, v in pa.items() if k != "container"} == {k: v for k, v in ps.items() if k != "container"}
    assert [g["uuid"] for g in pa["gpus"]] == [GPU8[0].uuid]
    # the stale libcuda 470 beside this driver's own: an info event, not a warning at a terminal
    assert "library.skipped" not in a.stderr and a.stderr == ""


def test_dry_run_json_schema(run, ctr):
    b = ctr("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all")
    p = run("--dry-run", "--bundle", str(b), "--format", "json", host="host-gpu8")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert_schema(plan)
    assert len(plan["gpus"]) == 8


def test_dry_run_text_is_a_readable_table(run, ctr):
    b = ctr("NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    j = json.loads(run("--dry-run", "--bundle", str(b), "--format", "json", host="host-gpu8").stdout)
    p = run("--dry-run", "--bundle", str(b), host="host-gpu8")
    assert p.returncode == 0
    out = p.stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"nvhook plan for container {b.name}")
    assert f"host driver:  {DRIVER} (CUDA 12.2)" in out
    assert f"Mounts ({len(j['mounts'])}), each from the same path under the host root unless <- names its source:" \
        in lines and f"Symlinks ({len(j['symlinks'])}):" in lines
    # mounts in the plan's order, in runs of one kind and option list under a header
    start = lines.index(next(line for line in lines if line.startswith("Mounts (")))
    rows = lines[start + 1:lines.index("", start)]
    header, seen = None, []
    for line in rows:
        if not line.startswith("            "):
            header = line.split()
            continue
        seen.append((header[0], header[1], line.split()[0]))
    assert seen == [(m["kind"], ",".join(m["options"]), m["target"]) for m in j["mounts"]]
    assert max(len(line) for line in lines) <= 102, max(lines, key=len)
    gpu_rows = [line for line in lines if GPU8[1].uuid in line]
    assert len(gpu_rows) == 1 and GPU8[1].bus_id in gpu_rows[0] and "NVIDIA A100-SXM4-80GB" in gpu_rows[0]
    for r in j["devices_cgroup"]:
        assert f"c {r['major']}:{r['minor']} rw" in out
    assert "c 195:1 rw" in out and "c 195:0 rw" not in out
    assert "ldconfig: builtin (nvhook writes /etc/ld.so.cache, no program runs) on /usr/lib/x86_64-linux-gnu" in out


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_dry_run_void_prints_an_empty_plan_with_the_reason(run, ctr, fmt):
    b = ctr("NVIDIA_VISIBLE_DEVICES=void")
    p = run("--dry-run", "--bundle", str(b), "--format", fmt)
    assert p.returncode == 0 and p.stderr == ""
    if fmt == "json":
        plan = json.loads(p.stdout)
        assert plan["mounts"] == [] and plan["gpus"] == [] and plan["devices_cgroup"] == []
        assert plan["compat"]["reason"] == "NVIDIA_VISIBLE_DEVICES='void': nothing requested"
    else:
        assert "Nothing to inject: NVIDIA_VISIBLE_DEVICES='void': nothing requested" in p.stdout
        assert "Mounts" not in p.stdout


def test_dry_run_changes_nothing(run, ctr, fx, tmp_path):
    host = copy_host(fx, "host-gpu8", tmp_path / "h")
    rootfs = fx / "container-debian"
    b = ctr("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all")
    before = (tree_snapshot(host), tree_snapshot(rootfs), tree_snapshot(b))
    for fmt in ("text", "json"):
        p = run("--dry-run", "--bundle", str(b), "--format", fmt, root=host)
        assert p.returncode == 0, p.stderr
    assert (tree_snapshot(host), tree_snapshot(rootfs), tree_snapshot(b)) == before


# --- hook mode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [[], ["prestart"], ["createRuntime"]])
def test_hook_mode_with_nothing_to_do(run, ctr, tmp_path, stage):
    log = tmp_path / "hook.log"
    b = ctr("NVIDIA_VISIBLE_DEVICES=void")
    p = run(*stage, "--log-file", str(log), stdin=state(b, pid=NO_PID, cid="hooked"))
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")
    evs = events(log)
    assert named(evs, "hook.start")[0]["stage"] == (stage[0] if stage else "prestart")
    done = named(evs, "hook.done")[0]
    assert done["result"] == "ok" and done["mounted"] == [] and done["container"] == "hooked"
    assert "nothing requested" in done["reason"]


# --- global options ----------------------------------------------------------------------------

def test_config_from_nvhook_config_and_from_the_option(fx, tmp_path):
    cache = private_dir(tmp_path / "cache")
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = write_config(tmp_path / "a.toml", cache_dir=cache, log_file=str(log_a), root=str(fx / "host-debian"))
    b = write_config(tmp_path / "b.toml", cache_dir=cache, log_file=str(log_b), root=str(fx / "host-gpu1"))
    p = nvhook("info", "--format", "json", env={"NVHOOK_CONFIG": str(a)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["driver"]["version"] == spec("host-debian").driver
    # an interactive command logs to stderr only, never into the config's (production) log
    assert not log_a.exists() and not log_b.exists()
    p = nvhook("--config", str(b), "info", "--format", "json", env={"NVHOOK_CONFIG": str(a)})
    assert json.loads(p.stdout)["driver"]["version"] == spec("host-gpu1").driver
    assert not log_b.exists()
    p = nvhook("--config", str(b), "--log-file", str(log_b), "info", env={"NVHOOK_CONFIG": str(a)})
    assert named(events(log_b), "gpus.procfs") and all(e["interactive"] is True for e in events(log_b))
    # --root beats the config's root; --log-file '' means no log at all
    p = nvhook("--root", str(fx / "host-t4-450"), "--log-file", "", "info", "--format", "json",
               env={"NVHOOK_CONFIG": str(a)})
    assert json.loads(p.stdout)["driver"]["version"] == spec("host-t4-450").driver
    assert not log_a.exists()


def test_default_config_path(tmp_path, monkeypatch):
    from nvhook.base import config

    assert config.DEFAULT_PATH == "/etc/nvhook/hook.toml"
    monkeypatch.setitem(config.DEFAULTS, "cache_dir", str(tmp_path / "cc"))  # config cache: not /run
    monkeypatch.delenv("NVHOOK_CONFIG", raising=False)
    f = write_config(tmp_path / "hook.toml", cache_dir=tmp_path / "c", log_level="debug")
    monkeypatch.setattr(config, "DEFAULT_PATH", str(f))
    assert config.load(None, explicit=False)["log_level"] == "debug"
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    assert config.load(None, explicit=False) == config.DEFAULTS  # a missing default file: defaults
    monkeypatch.setenv("NVHOOK_CONFIG", str(f))
    assert config.load(None, explicit=False)["log_level"] == "debug"


def test_parsed_config_cached_whatever_cache_dir_says(tmp_path, monkeypatch):
    """The parsed config is looked up before the file is read, so it is always cached in the
    default directory; a config that moves cache_dir elsewhere must not pay tomllib (12 ms)
    on every start. cache_dir = "" turns it off."""
    from nvhook.base import config

    cc = tmp_path / "cc"
    monkeypatch.setenv("NVHOOK_RUN_DIR", str(cc))  # tests never use the host's /run/nvhook
    f = write_config(tmp_path / "hook.toml", cache_dir=tmp_path / "elsewhere", log_level="debug")
    assert config.load(str(f), explicit=True)["log_level"] == "debug"
    (cached_file,) = cc.glob("config*.json")
    cached = json.loads(cached_file.read_text())
    assert cached["config"]["cache_dir"] == str(tmp_path / "elsewhere")
    assert cached["ident"][0] == str(f)
    other = write_config(tmp_path / "other.toml", cache_dir=tmp_path / "c2", log_level="warning")
    assert config.load(str(other), explicit=True)["log_level"] == "warning"
    assert len(list(cc.glob("config*.json"))) == 2  # one per config file: no turns at one entry
    for p in cc.glob("config*.json"):
        p.unlink()
    off = write_config(tmp_path / "off.toml", cache_dir="", log_level="debug")
    assert config.load(str(off), explicit=True)["cache_dir"] == ""
    assert not list(cc.glob("config*.json"))
    # in a fresh process, the cached form is used: no TOML reader (tomllib, or tomli before 3.11)
    code = ("import sys; from nvhook.base import config; config.DEFAULTS['cache_dir'] = sys.argv[1]; "
            "c = config.load(sys.argv[2], explicit=True); "
            "print(c['log_level'], bool({'tomllib', 'tomli', 'nvhook.base.tomlread'} & set(sys.modules)))")
    for expected in ("debug True", "debug False"):
        out = subprocess.run([sys.executable, "-c", code, str(cc), str(f)], capture_output=True, text=True)
        assert out.stdout.split() == expected.split(), out.stderr


@pytest.mark.parametrize("level, debug_seen", [("debug", True), ("info", False)])
def test_log_level_and_log_file(run, tmp_path, level, debug_seen):
    log = tmp_path / "x.log"
    p = run("--log-file", str(log), "--log-level", level, "list", "--format", "json")
    assert p.returncode == 0
    evs = events(log)  # every line is one complete JSON object
    assert evs and all({"ts", "level", "event", "nvhook_pid"} <= set(e) for e in evs)
    assert any(e["level"] == "debug" for e in evs) is debug_seen


def test_log_level_error_silences_warnings_on_stderr(run, ctr):
    b = ctr("NVIDIA_VISIBLE_DEVICES=0")
    noisy = run("--dry-run", "--bundle", str(b), host="host-broken")
    quiet = run("--log-level", "error", "--dry-run", "--bundle", str(b), host="host-broken")
    assert "library.missing" in noisy.stderr and quiet.stderr == ""  # libraries this host lacks
    assert noisy.stdout == quiet.stdout


# --- info --------------------------------------------------------------------------------------

def test_info_json_with_nvml(run, tmp_path):
    log = tmp_path / "i.log"
    p = run("--log-file", str(log), "info", "--format", "json", host="host-gpu8")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["driver"] == {"version": DRIVER, "source": "procfs", "cuda": "12.2", "cuda_source": "nvml"}
    assert info["gpu_source"] == "nvml" and info["nvml_note"] is None
    assert len(info["gpus"]) == len(GPU8)
    for g, s in zip(info["gpus"], GPU8):
        assert (g["index"], g["minor"], g["model"], g["uuid"], g["bus_id"]) == (s.index, s.minor, s.name, s.uuid, s.bus_id)
        assert g["brand_id"] == s.brand and g["cc"] == f"{s.cc[0]}.{s.cc[1]}" and g["source"] == "nvml"
        assert g["mig_mode"] == {"1": True, "0": False, "na": None}[s.mig_mode]
        assert [m["uuid"] for m in g["migs"]] == [m.uuid for m in s.migs]
    assert [g["brand"] for g in info["gpus"]] == ["tesla"] * 4 + ["nvidia"] * 2 + ["geforcertx"] * 2
    assert named(events(log), "gpus.nvml")[0]["source"] == "nvml"


def test_info_text_with_nvml(run):
    p = run("info", host="host-gpu8")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert lines[0] == f"Driver version: {DRIVER} (from procfs)"
    assert lines[1] == "CUDA version:   12.2 (from nvml)"
    assert lines[2] == "GPU facts from: nvml"
    header = next(line for line in lines if line.strip().startswith("index"))
    for col in ("minor", "model", "brand", "uuid", "bus", "cc", "mig", "source"):
        assert col in header.split()
    for s in GPU8:
        row = next(line for line in lines if s.uuid in line)
        cells = row.split()
        assert cells[0] == str(s.index) and cells[1] == str(s.minor) and s.bus_id in cells
        assert f"{s.cc[0]}.{s.cc[1]}" in cells and cells[-1] == "nvml"
        assert {"1": "enabled", "0": "disabled", "na": "?"}[s.mig_mode] in cells
    assert "tesla" in next(line for line in lines if GPU8[0].uuid in line)


def _nvml_host(fx, tmp_path, mode: str) -> tuple[Path, Path]:
    root = copy_host(fx, "host-gpu8", tmp_path / "h")
    conf = root / "usr/lib/x86_64-linux-gnu/fake-nvml.conf"
    conf.write_text(conf.read_text().replace("\ninit ok\n", f"\ninit {mode}\n"))
    cfg = write_config(tmp_path / "nvml.toml", cache_dir=private_dir(tmp_path / "cache"), nvml_timeout=1)
    return root, cfg


def _session_members(sid: int) -> list[int]:
    return [pid for pid, fields in processes().items() if int(fields[3]) == sid]  # stat field 6: session


@pytest.mark.parametrize("mode, warning, max_s", [
    ("fail", "Driver Not Loaded", 30),
    ("hang", "NVML did not answer within 1 s", 30),  # the fake's hang lasts for good
])
def test_info_falls_back_to_procfs(fx, tmp_path, mode, warning, max_s):
    root, cfg = _nvml_host(fx, tmp_path, mode)
    log = tmp_path / "n.log"
    t = time.monotonic()
    proc = subprocess.Popen([*NVHOOK, "--config", str(cfg), "--root", str(root), "--log-file", str(log),
                             "info", "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={k: v for k, v in os.environ.items()
                                                                    if k != "NVHOOK_CONFIG"})
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # a leftover child keeps the pipes open
        proc.kill()
        out, err = proc.communicate()
    elapsed = time.monotonic() - t
    left = _session_members(proc.pid)
    for pid in left:  # don't leave them to the next test either
        os.kill(pid, 9)
    assert left == [], "nvhook left a process behind"
    assert proc.returncode == 0, err
    assert elapsed < max_s, f"nvhook info took {elapsed:.1f} s"
    if mode == "hang":
        assert elapsed >= 1
    info = json.loads(out)
    assert info["gpu_source"] == "procfs" and "NVML failed" in info["nvml_note"]
    assert [g["uuid"] for g in info["gpus"]] == [g.uuid for g in GPU8]
    assert all(g["source"] == "procfs" and g["brand"] is None and g["cc"] is None and g["mig_mode"] is None
               for g in info["gpus"])
    assert info["driver"]["cuda"] == "12.2" and info["driver"]["cuda_source"] == "release table"
    assert "Traceback" not in err
    warn = [line for line in err.splitlines() if "nvml.unavailable" in line]
    assert len(warn) == 1 and warning in warn[0] and "GPU facts from procfs" in warn[0]
    ev = named(events(log), "nvml.unavailable")
    assert len(ev) == 1 and ev[0]["level"] == "warning" and warning in ev[0]["error"]
    assert named(events(log), "gpus.procfs") and not named(events(log), "gpus.nvml")


def test_info_text_says_nvml_failed(fx, tmp_path):
    root, cfg = _nvml_host(fx, tmp_path, "fail")
    p = nvhook("--config", str(cfg), "--root", str(root), "info")
    assert p.returncode == 0
    assert "GPU facts from: procfs (NVML failed: " in p.stdout
    assert all(line.split()[-1] == "procfs" for line in p.stdout.splitlines() if "GPU-" in line)


# --- list --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def listing(fx, conf) -> list[dict]:
    p = nvhook("--config", str(conf), "--root", str(fx / "host-gpu8"), "list", "--format", "json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_list_covers_every_library_with_its_capability(listing):
    libs = {(i["kind"], i["container_path"]): i for i in listing if i["kind"] in ("library", "library32")}
    want = {}
    for lib in mf.LIBRARIES:
        want[("library", f"/usr/lib/x86_64-linux-gnu/{lib.real_name(DRIVER)}")] = lib.capability
        if lib.lib32:
            want[("library32", f"/usr/lib/i386-linux-gnu/{lib.real_name(DRIVER)}")] = "compat32"
    assert {k: v["capability"] for k, v in libs.items()} == want
    assert all(os.path.isfile(i["host_path"]) and i["host_path"].endswith(i["container_path"]) for i in libs.values())
    assert libs[("library32", f"/usr/lib/i386-linux-gnu/libcuda.so.{DRIVER}")]["also_for"] == "compute"


def test_list_covers_binaries_ipc_firmware(listing):
    caps = {(i["kind"], i["container_path"]): i["capability"] for i in listing}
    for b in mf.BINARIES:
        assert caps[("binary", f"/usr/bin/{b}")] == ("compute" if "mps" in b else "utility")
    assert caps[("ipc", "/run/nvidia-persistenced/socket")] == "utility"
    assert caps[("ipc", "/tmp/nvidia-mps")] == "compute"
    fw = [i["container_path"] for i in listing if i["kind"] == "firmware"]
    assert fw == [f"/lib/firmware/nvidia/{DRIVER}/gsp_ga10x.bin", f"/lib/firmware/nvidia/{DRIVER}/gsp_tu10x.bin"]


def test_list_covers_devices_of_all_gpus(listing):
    devs = {i["container_path"]: i for i in listing if i["kind"] == "device"}
    num = {p: (i["major"], i["minor"]) for p, i in devs.items()}
    assert devs["/dev/nvidiactl"]["capability"] == "all" and num["/dev/nvidiactl"] == (195, 255)
    assert devs["/dev/nvidia-uvm"]["capability"] == "compute" and num["/dev/nvidia-uvm"] == (235, 0)
    assert num["/dev/nvidia-uvm-tools"] == (235, 1)
    # paths are paths: the device numbers are not folded into them
    assert all(os.path.exists(i["host_path"]) and "(" not in i["host_path"] for i in devs.values())
    assert devs["/dev/nvidia-modeset"]["capability"] == "display"
    for g in GPU8:
        d = devs[f"/dev/nvidia{g.minor}"]
        assert d["capability"] == f"gpu {g.index}" and num[f"/dev/nvidia{g.minor}"] == (195, g.minor)
    mig = {p for p, i in devs.items() if i["capability"] == "MIG"}
    want = {f"/dev/nvidia-caps/nvidia-cap{m}" for m in (1, 2)} | {
        f"/dev/nvidia-caps/nvidia-cap{m}" for g in GPU8 for x in g.migs
        for m in (mf.mig_minor(g.minor, x.gi), mf.mig_minor(g.minor, x.gi, x.ci))}
    assert mig == want
    procs = [i["container_path"] for i in listing if i["kind"] == "procfs" and i["capability"].startswith("gpu")]
    assert procs == [f"/proc/driver/nvidia/gpus/{g.bus_id}" for g in GPU8]


def test_list_procfs_sources_are_host_paths(listing, fx):
    for i in listing:
        if i["kind"] == "procfs":
            assert i["host_path"].startswith(str(fx / "host-gpu8") + "/")


def test_list_text(fx, conf, listing):
    p = nvhook("--config", str(conf), "--root", str(fx / "host-gpu8"), "list")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["capability", "kind", "container", "path", "host", "path", "device"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    rows = lines[2:]
    assert len(rows) == len(listing)
    for row, item in zip(rows, listing):
        assert row.strip().startswith(item["capability"] + " ")
        assert f" {item['kind']} " in row and f" {item['container_path']} " in row
        if item["major"] is None:
            assert row.endswith(item["host_path"])
        else:
            assert f" {item['host_path']} " in row and row.endswith(f"c {item['major']}:{item['minor']}")


def test_hook_mode_rejects_an_unknown_log_level(run):
    assert_one_line_error(run("--log-level", "loud", "prestart"), 2, "'loud'")


# --- cached NVML facts and MIG instances that come and go --------------------------------------

def test_mig_instances_created_and_destroyed_after_the_cache(fx, tmp_path, ctr):
    """NVML's answer is cached; an instance created later is found by asking NVML again when a
    container names it, and an index request sees the instances that exist now."""
    root = copy_host(fx, "host-gpu8", tmp_path / "h")
    conf = scratch_config(tmp_path)
    nvml_conf = next(root.rglob("fake-nvml.conf"))
    full = nvml_conf.read_text()
    ci1 = next(ln for ln in full.splitlines() if ln.startswith("mig 1 1 "))  # gpu1/gi1/ci1
    ci1_uuid, ci1_dir = ci1.split()[3], root / "proc/driver/nvidia/capabilities/gpu1/mig/gi1/ci1"
    gpu0_uuid = next(ln for ln in full.splitlines() if ln.startswith("mig 0 0 ")).split()[3]
    saved = tmp_path / "ci1"
    ci1_dir.rename(saved)
    nvml_conf.write_text(full.replace(ci1 + "\n", ""))

    def dry(devices: str, n: int):
        log = tmp_path / f"log{n}"
        p = nvhook("--config", str(conf), "--root", str(root), "--log-file", str(log), "--dry-run",
                   "--format", "json", "--bundle",
                   str(ctr(f"NVIDIA_VISIBLE_DEVICES={devices}", "NVIDIA_DRIVER_CAPABILITIES=utility")))
        return p, events(log)

    p, ev = dry(gpu0_uuid, 1)
    assert p.returncode == 0, p.stderr
    assert [e["reason"] for e in named(ev, "nvml.queried")] == ["MIG device requested"]
    # ci1 is created: the cache does not know it; requests by other UUIDs still need no NVML.
    saved.rename(ci1_dir)
    nvml_conf.write_text(full)
    p, ev = dry(gpu0_uuid, 2)
    assert p.returncode == 0 and not named(ev, "nvml.queried")
    assert [e["cached"] for e in named(ev, "gpus.nvml")] == [True]
    p, ev = dry(ci1_uuid, 3)
    assert p.returncode == 0, p.stderr
    assert [e["reason"] for e in named(ev, "nvml.queried")] == ["MIG device not in the cached NVML facts"]
    targets = [m["target"] for m in json.loads(p.stdout)["mounts"]]
    assert "/dev/nvidia-caps/nvidia-cap149" in targets
    assert "/proc/driver/nvidia/capabilities/gpu1/mig/gi1/ci1/access" in targets
    # ci1 is destroyed again: "1:1" (GPU 1's second MIG device) no longer exists; the index
    # request sees that, where the cache would still have answered ci1.
    ci1_dir.rename(saved)
    nvml_conf.write_text(full.replace(ci1 + "\n", ""))
    p, ev = dry("1:1", 4)
    assert [e["reason"] for e in named(ev, "nvml.queried")] == ["MIG device requested"]
    assert p.returncode == 1 and "unknown MIG device '1:1'" in p.stderr
    p, ev = dry("1:0", 5)
    assert p.returncode == 0 and not named(ev, "nvml.queried")
    assert [e["cached"] for e in named(ev, "gpus.nvml")] == [True]


def test_unknown_mig_uuid_asks_nvml_once_then_fails(fx, tmp_path, ctr):
    conf = scratch_config(tmp_path)
    log = tmp_path / "log"
    args = ("--config", str(conf), "--root", str(fx / "host-gpu8"), "--log-file", str(log), "--dry-run", "--bundle")
    env = ("NVIDIA_DRIVER_CAPABILITIES=utility",)
    gpu0 = next(m.uuid for g in GPU8 for m in g.migs)
    assert nvhook(*args, str(ctr(f"NVIDIA_VISIBLE_DEVICES={gpu0}", *env))).returncode == 0
    log.unlink()
    p = nvhook(*args, str(ctr("NVIDIA_VISIBLE_DEVICES=MIG-00000000-0000-0000-0000-000000000000", *env)))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[-1].startswith("nvhook: unknown MIG device 'MIG-00000000-0000-0000-0000-000000000000'")
    assert len(named(events(log), "nvml.queried")) == 1  # the refresh; the cache hit asked nothing


def test_apply_worker_is_stopped_when_the_decision_fails(fx, tmp_path, ctr):
    """Hook mode forks its apply worker as soon as the container asks for GPUs; a request that
    then fails (an unknown GPU) must not leave it behind."""
    sleeper = subprocess.Popen(["sleep", "60"])  # a live pid: the state is a real container's
    marker = tmp_path / f"log-{os.getpid()}-{time.monotonic_ns()}"
    try:
        p = nvhook("--config", str(write_config(tmp_path / "hook.toml", cache_dir=private_dir(tmp_path / "c"))),
                   "--root", str(fx / "host-gpu1"), "--log-file", str(marker), "prestart",
                   stdin=state(ctr("NVIDIA_VISIBLE_DEVICES=7"), pid=sleeper.pid))
        assert_one_line_error(p, 1, "unknown device '7'")
        left = [pid for pid, cmd in _cmdlines().items() if str(marker) in cmd]
        assert left == []
    finally:
        sleeper.kill()
        sleeper.wait()


def _cmdlines() -> dict[int, str]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def test_device_node_mode_change_reaches_the_plan(fx, tmp_path, ctr):
    """The plan gives each device node the host node's mode and owner, from the cached
    inventory: a chmod or chown on the host must show in the next plan."""
    root = copy_host(fx, "host-gpu1", tmp_path / "h")
    conf = scratch_config(tmp_path)
    b = ctr("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")

    def node(n: int) -> dict:
        log = tmp_path / f"log{n}"
        p = nvhook("--config", str(conf), "--root", str(root), "--log-file", str(log), "--dry-run", "--format",
                   "json", "--bundle", str(b))
        assert p.returncode == 0, p.stderr
        built = bool(named(events(log), "inventory.built"))
        return next(m["node"] for m in json.loads(p.stdout)["mounts"] if m["target"] == "/dev/nvidia-uvm"), built

    uvm = root / "dev/nvidia-uvm"
    st = uvm.stat()
    first, built = node(1)
    assert built and (first["mode"], first["uid"], first["gid"]) == (st.st_mode & 0o7777, st.st_uid, st.st_gid)
    assert node(2) == (first, False)  # cached
    os.chmod(uvm, 0o600)
    os.chown(uvm, 0, 33)
    changed, built = node(3)
    assert built and (changed["mode"], changed["uid"], changed["gid"]) == (0o600, 0, 33)
    assert (changed["major"], changed["minor"]) == (first["major"], first["minor"])


def test_dry_run_text_carries_no_control_characters_from_the_image(run, fx, tmp_path):  # noqa: F811
    """An image whose CUDA directory name holds an escape sequence (it shows up in the compat
    libraries' paths, the decision's reason, the warnings): nothing that reaches the terminal,
    stdout or stderr, carries a control character."""
    import shutil

    rootfs = tmp_path / "rootfs"
    shutil.copytree(fx / "container-debian", rootfs, symlinks=True)
    evil = "cuda-12.2\x1b]0;owned\x07\x1b[2J\r"
    compat = rootfs / "usr/local" / evil / "compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.999.1.1").write_bytes(b"\x7fELF not really")
    os.symlink("libcuda.so.999.1.1", compat / "libnvidia-ptxjitcompiler.so.999.1.1")
    (rootfs / "usr/local/cuda").unlink(missing_ok=True)
    os.symlink(evil, rootfs / "usr/local/cuda")
    b = bundle(tmp_path / "bundle", rootfs, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"])
    p = run("--dry-run", "--bundle", str(b), host="host-gpu8")
    assert p.returncode == 0, p.stderr
    assert "owned" in p.stdout + p.stderr  # the path is shown, cleaned
    for text in (p.stdout, p.stderr):
        bad = {c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0}
        assert not bad, repr(text)


def test_an_elf_program_wins_over_a_wrapper_script(fx, tmp_path):
    """Seen on a real H200 host: /usr/bin/nvidia-smi is a shell wrapper that execs
    /usr/local/nvidia/bin/nvidia-smi. Mounting the wrapper gives the container `nvidia-smi: not
    found`; the ELF program beside the driver's libraries is mounted instead (and one found
    later in the search path wins too), with an info event naming what was skipped. A host
    whose only nvidia-smi is a script keeps it."""
    host = copy_host(fx, "host-gpu1", tmp_path / "hosts")
    elf = Path("/bin/true").resolve().read_bytes()
    assert elf[:4] == b"\x7fELF"
    wrapper = '#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi "$@"\n'
    (host / "usr/bin/nvidia-smi").write_text(wrapper)
    beside = host / "usr/lib/bin"  # the `bin` beside /usr/lib/x86_64-linux-gnu, where the libraries are
    beside.mkdir(parents=True)
    (beside / "nvidia-smi").write_bytes(elf)
    (beside / "nvidia-smi").chmod(0o755)
    (host / "usr/local/bin").mkdir(parents=True, exist_ok=True)
    (host / "usr/local/bin/nvidia-debugdump").write_bytes(elf)
    conf = scratch_config(tmp_path)
    log = tmp_path / "log.jsonl"
    p = nvhook("--config", str(conf), "--root", str(host), "--log-file", str(log), "--log-level", "info",
               "list", "--format", "json")
    assert p.returncode == 0, p.stderr
    bins = {i["container_path"]: i["host_path"] for i in json.loads(p.stdout) if i["kind"] == "binary"}
    assert bins["/usr/bin/nvidia-smi"] == str(host / "usr/lib/bin/nvidia-smi")
    assert bins["/usr/bin/nvidia-debugdump"] == str(host / "usr/local/bin/nvidia-debugdump")
    assert bins["/usr/bin/nvidia-persistenced"] == str(host / "usr/bin/nvidia-persistenced")  # a script, alone
    skipped = {e["binary"]: e for e in events(log) if e["event"] == "binary.wrapper_skipped"}
    assert skipped["nvidia-smi"]["skipped"] == "/usr/bin/nvidia-smi"
    assert skipped["nvidia-smi"]["chosen"] == "/usr/lib/bin/nvidia-smi"


def test_a_reader_that_goes_away_is_no_internal_error(fx, tmp_path):
    """`nvhook list | head -1`: the pipe closes under nvhook (here before it writes at all, so
    the write fails every time); no traceback, no 'internal error' (click's quiet exit 1)."""
    conf = scratch_config(tmp_path)
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([*NVHOOK, "--config", str(conf), "--root", str(fx / "host-gpu8"), "--log-file", "", "list"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 1 and p.stderr == "", p.stderr
