"""nvhook through podman's hooks dir, the way the shipped oci-hooks.d/nvhook.json installs it.

The hooks dir is a temp copy of oci-hooks.d/nvhook.json with only its "path" changed to the
installed console script and NVHOOK_CONFIG pointing at a temp config (host root = a fixture
host, private log file and cache). podman runs `--rootfs` on a private copy of the
container-debian fixture, with runc, cgroupfs, no network and every piece of its state (storage,
run root, libpod tmp dir, runc state) under tmp_path; each container is `--rm` and removed
again whatever happens, and runs bounded by a timeout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402  (tests/conftest.py puts tests/fixtures on sys.path)
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.podman, pytest.mark.skipif(rb.podman_skip_reason() is not None,
                                                     reason=rb.podman_skip_reason() or "")]

DRIVER = mf.HOSTS["host-gpu8"].driver
L = "/usr/lib/x86_64-linux-gnu"
LIBCUDA = f"libcuda.so.{DRIVER}"


class Setup:
    def __init__(self, tmp: Path, host: Path):
        self.log_file = tmp / "nvhook.jsonl"
        config = rb.write_nvhook_config(tmp / "hook.toml", root=host, log_file=self.log_file,
                                        cache_dir=tmp / "cache")
        self.hooks_dir = rb.podman_hooks_dir(tmp / "hooks.d", config)
        self.podman = rb.Podman(tmp / "podman", self.hooks_dir)
        self.rootfs = mf.build_container("container-debian", tmp / "images")

    def run(self, script: str, env: dict | None = None):
        return self.podman.run(self.rootfs, ["/bin/sh", "-c", script], env=env)

    def events(self) -> list[dict]:
        return rb.read_events(self.log_file)


@pytest.fixture
def setup(tmp_path, fixtures_root):
    s = Setup(tmp_path, fixtures_root / "host-gpu8")
    try:
        yield s
        assert s.podman.leftovers() == []
        assert rb.host_mounts_under(tmp_path, s.podman.runroot) == []
    finally:
        s.podman.close()


def test_hooks_dir_is_the_shipped_file_with_two_changes(setup):
    shipped = json.loads(rb.SHIPPED_HOOK_JSON.read_text())
    ours = json.loads((setup.hooks_dir / "nvhook.json").read_text())
    assert ours["hook"]["path"] == str(rb.NVHOOK_BIN)
    assert ours["hook"]["args"] == shipped["hook"]["args"] == ["nvhook", "prestart"]
    assert ours["when"] == shipped["when"] and ours["stages"] == shipped["stages"]
    assert [e for e in ours["hook"]["env"] if not e.startswith(("NVHOOK_CONFIG=", "NVHOOK_RUN_DIR="))] == \
        [e for e in shipped["hook"]["env"] if not e.startswith(("NVHOOK_CONFIG=", "NVHOOK_RUN_DIR="))]


def test_gpu0_through_podman(setup):
    proc = setup.run("cuda-probe; /sbin/ldconfig -p | grep 'libcuda.so.1 '; "
                     f"echo TOUCH:$(touch {L}/{LIBCUDA} 2>&1); ls /dev; "
                     "test -e /dev/nvidia1 && echo HAS-NVIDIA1 || echo NO-NVIDIA1",
                     env={"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"path: {L}/{LIBCUDA}\n" in out
    assert "cuDriverGetVersion: 12020\n" in out
    assert f"=> {L}/libcuda.so.1" in out
    assert f"TOUCH:touch: {L}/{LIBCUDA}: Read-only file system" in out
    assert "nvidia0" in out.split() and "nvidiactl" in out.split()
    assert "NO-NVIDIA1" in out and "HAS-NVIDIA1" not in out
    evs = setup.events()
    done = evs[-1]
    assert done["event"] == "hook.done" and done["result"] == "ok"
    assert f"{L}/{LIBCUDA}" in done["mounted"] and "/dev/nvidia0" in done["mounted"]
    assert "/dev/nvidia1" not in done["mounted"]
    assert evs[0]["event"] == "hook.start" and evs[0]["stage"] == "prestart"


def test_unknown_device_fails_with_nvhooks_line(setup):
    proc = setup.run("touch /started; echo STARTED", env={"NVIDIA_VISIBLE_DEVICES": "42"})
    assert proc.returncode != 0
    assert "STARTED" not in proc.stdout
    assert not (setup.rootfs / "started").exists()
    failed = setup.events()[-1]
    assert failed["event"] == "hook.failed"
    assert failed["error"].startswith("unknown device '42' in NVIDIA_VISIBLE_DEVICES")
    output = proc.stdout + proc.stderr
    assert f"nvhook: {failed['error']}" in output
    assert rb.hook_stderr_lines(proc.stderr) == [f"nvhook: {failed['error']}"]


def test_not_a_gpu_container_gets_nothing(setup):
    proc = setup.run(f"echo LIBS:$(ls -A {L}); echo DEV:$(ls /dev)")
    assert proc.returncode == 0, proc.stderr
    assert "LIBS:\n" in proc.stdout
    assert "nvidia" not in proc.stdout
    evs = setup.events()
    request = [e for e in evs if e["event"] == "request"]
    assert request and request[0]["kind"] == "skip"
    done = evs[-1]
    assert done["event"] == "hook.done" and done["result"] == "ok" and done["mounted"] == []
    assert done["reason"] == "not a GPU container: NVIDIA_VISIBLE_DEVICES is not set"
