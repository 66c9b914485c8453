"""nvhookd keeps nvhook's CDI spec current ([daemon] cdi_refresh_interval): a real nvhookd on a
copy of the 8-GPU fixture host, the spec written by `nvhook cdi generate`, then the host changed
the way it happens (a GPU gone, the driver upgraded); `nvhook cdi check`, run as a user runs it,
says whether the spec on disk matches the host afterwards. A spec nvhook did not write is never
touched, and none is created."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

NVHOOK = rb.NVHOOK_BIN
NVHOOKD = Path(sys.executable).with_name("nvhookd")


@pytest.fixture
def setup(tmp_path: Path, fixtures_root: Path):
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(host)], check=True)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    spec = tmp_path / "etc-cdi" / "nvhook.json"
    cfg = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                 cache_dir=tmp_path / "cache",
                                 extra=f'log_level = "debug"\n[cdi]\nspec = "{spec}"\n[daemon]\n'
                                       f'socket = "{run / "nvhookd.sock"}"\ncdi_refresh_interval = 0.2\n')
    procs: list[subprocess.Popen] = []

    def start() -> Path:
        log = tmp_path / "nvhookd.jsonl"
        p = subprocess.Popen([str(NVHOOKD), "--config", str(cfg), "--root", str(host), "--log-file", str(log)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
        procs.append(p)
        return log

    start.procs = procs  # type: ignore[attr-defined]

    yield host, cfg, spec, start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def nvhook(cfg: Path, host: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run([str(NVHOOK), "--config", str(cfg), "--root", str(host), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def wait_event(log: Path, name: str, count: int = 1, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        evs = [e for e in rb.read_events(log) if e["event"] == name]
        if len(evs) >= count:
            return evs
        assert time.monotonic() < deadline, f"no {name} event within {timeout} s: {rb.read_events(log)[-5:]}"
        time.sleep(0.1)


def test_gpu_gone_regenerates_the_spec_and_a_driver_without_its_libraries_does_not(setup):
    host, cfg, spec, start = setup
    p = nvhook(cfg, host, "cdi", "generate", "--output", str(spec))
    assert p.returncode == 0, p.stderr
    log = start()
    wait_event(log, "daemon.cdi_current")  # the first look after start: nothing to do
    assert [e["event"] for e in rb.read_events(log) if e["event"].startswith("daemon.cdi_refresh")] == []

    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    ev = wait_event(log, "daemon.cdi_refreshed")[0]
    assert ev["level"] == "info" and ev["spec"] == str(spec)
    assert "device gone from the host: nvidia.com/gpu=7 is in the spec" in ev["differences"]
    names = [d["name"] for d in json.loads(spec.read_text())["devices"]]
    assert "7" not in names and "6" in names and g7.uuid not in names
    p = nvhook(cfg, host, "cdi", "check", str(spec))
    assert p.returncode == 0, p.stdout + p.stderr

    # The kernel module upgraded (its user-space files not yet): no spec of device nodes
    # without a driver is written; the one there stays, and the log says why, once per change
    # of the host (the loader cache the installer rebuilds is one: then it tries again).
    before = spec.read_bytes()
    version = host / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace(mf.DRIVER_535, "550.54.15"))
    ev = wait_event(log, "daemon.cdi_refresh_failed")[0]
    assert ev["level"] == "error" and ev["spec"] == str(spec)
    assert "libcuda.so and libnvidia-ml.so of driver 550.54.15 not found under" in ev["error"], ev
    assert spec.read_bytes() == before
    # The regenerated spec kept the hook the old one had (path, --config/--root, capabilities).
    hook = json.loads(spec.read_text())["containerEdits"]["hooks"][0]
    assert hook["args"][1:5] == ["--config", str(cfg), "--root", str(host)]


def test_yaml_spec_stays_yaml(setup):
    host, cfg, spec, start = setup
    spec = spec.with_suffix(".yaml")
    cfg.write_text(cfg.read_text().replace("nvhook.json", "nvhook.yaml"))
    assert nvhook(cfg, host, "cdi", "generate", "--output", str(spec)).returncode == 0
    log = start()
    wait_event(log, "daemon.cdi_current")
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    wait_event(log, "daemon.cdi_refreshed")
    assert spec.read_text().startswith("---\ncdiVersion: ")
    assert nvhook(cfg, host, "cdi", "check", str(spec)).returncode == 0


def test_a_spec_nvhook_did_not_write_is_left_alone_and_none_is_created(setup):
    host, cfg, spec, start = setup
    log = start()
    time.sleep(1.0)  # several intervals: no spec file, nothing done
    assert not spec.exists()
    spec.parent.mkdir()
    foreign = json.dumps({"cdiVersion": "0.5.0", "kind": "example.com/gpu", "devices": []}) + "\n"
    spec.write_text(foreign)
    wait_event(log, "daemon.cdi_not_ours")
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    wait_event(log, "daemon.cdi_not_ours", 2)
    assert spec.read_text() == foreign
    assert not [e for e in rb.read_events(log) if e["event"].startswith("daemon.cdi_refresh")]


def test_interval_zero_turns_it_off(setup):
    host, cfg, spec, start = setup
    cfg.write_text(cfg.read_text().replace("cdi_refresh_interval = 0.2", "cdi_refresh_interval = 0"))
    assert nvhook(cfg, host, "cdi", "generate", "--output", str(spec)).returncode == 0
    before = spec.read_bytes()
    log = start()
    wait_event(log, "daemon.start")
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    time.sleep(1.5)
    assert spec.read_bytes() == before
    assert not [e for e in rb.read_events(log) if e["event"].startswith("daemon.cdi")]


def test_bad_interval_is_one_line(tmp_path):
    cfg = tmp_path / "hook.toml"
    cfg.write_text("[daemon]\ncdi_refresh_interval = -1\n")
    p = subprocess.run([str(NVHOOK), "--config", str(cfg), "info"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].endswith(
        "daemon.cdi_refresh_interval must be between 0 (off) and 86400 seconds, not -1")


def test_a_malformed_spec_is_an_error_event_not_the_end_of_nvhookd(setup):
    """A spec of nvhook's that someone edited into a shape nvhook never writes (a hook entry
    that is no object): nvhookd logs it and keeps serving."""
    host, cfg, spec, start = setup
    assert nvhook(cfg, host, "cdi", "generate", "--output", str(spec)).returncode == 0
    doc = json.loads(spec.read_text())
    doc["containerEdits"]["hooks"].insert(0, "not-a-hook")
    spec.write_text(json.dumps(doc))
    log = start()
    ev = wait_event(log, "daemon.cdi_refresh_failed")[0]
    assert ev["level"] == "error" and str(spec) in ev["message"]
    time.sleep(0.5)
    assert start.procs[0].poll() is None, start.procs[0].stderr.read().decode()[-2000:]
    assert json.loads(spec.read_text()) == doc


@pytest.mark.parametrize("spoil", ["file-writable", "other-owner", "dir-writable", "symlink"])
def test_a_spec_others_could_have_written_is_never_regenerated(setup, tmp_path, spoil):
    """nvhookd (root) regenerates the spec with its old hook path and arguments: from a file
    someone other than root could have written, that would be root re-issuing their hook as
    its own, in a root-owned 0644 file. Such a spec is an error event and left as it is."""
    host, cfg, spec, start = setup
    assert nvhook(cfg, host, "cdi", "generate", "--output", str(spec)).returncode == 0
    if spoil == "file-writable":
        os.chmod(spec, 0o666)
    elif spoil == "other-owner":
        os.chown(spec, 12345, 12345)
    elif spoil == "dir-writable":
        os.chmod(spec.parent, 0o777)
    elif spoil == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        os.rename(spec, elsewhere)
        os.symlink(elsewhere, spec)
    before = spec.read_bytes()
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    log = start()
    ev = wait_event(log, "daemon.cdi_refresh_failed")[0]
    assert "not regenerated" in ev["message"], ev
    assert spec.read_bytes() == before
    assert not [e for e in rb.read_events(log) if e["event"] == "daemon.cdi_refreshed"]
