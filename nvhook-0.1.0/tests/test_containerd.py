"""nvhook-runtime under a real containerd (Debian's 1.6) with `ctr run --runc-binary`.

One private containerd per module (its own root, state and socket in a temp dir, the CRI
plugin off); containers run from the Debian fixture rootfs with `ctr run --rootfs`. The daemon
is stopped and its processes and mounts checked gone whatever the tests did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import engines  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from gpuview import SCRIPT, assert_gpu0  # noqa: E402

WRAPPER = Path(sys.executable).with_name("nvhook-runtime")


def _skip() -> str | None:
    if os.geteuid() != 0:
        return "containerd needs root"
    for b in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        if not shutil.which(b):
            return f"{b} is not installed (Debian's containerd)"
    if not WRAPPER.exists():
        return "nvhook-runtime is not installed"
    return None


pytestmark = [pytest.mark.runc, pytest.mark.skipif(_skip() is not None, reason=_skip() or "")]


class Containerd:
    def __init__(self, tmp: Path, host: Path):
        self.tmp = tmp
        self.sock = str(tmp / "c.sock")
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "nvhook.toml", log_file=self.log, cache_dir=tmp / "cache", root=host)
        (tmp / "config.toml").write_text(
            f'version = 2\nroot = "{tmp}/root"\nstate = "{tmp}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.sock}"\n[ttrpc]\n  address = "{self.sock}.ttrpc"\n')
        self.rec, self.rec_before = tmp / "rec", tmp / "rec-before"
        engines.write_recorders(self.rec, self.rec_before, tmp / "rec-after", WRAPPER)
        self.env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NVHOOK_CONFIG": str(self.config), "HOME": str(tmp)}
        self.out = open(tmp / "containerd.log", "wb")
        self.proc = subprocess.Popen(["containerd", "--config", str(tmp / "config.toml")], env=self.env,
                                     stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def ctr(self, *args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
        p = subprocess.run(["ctr", "-a", self.sock, "-n", "nvhook-test", *args], capture_output=True, text=True,
                           errors="replace", env=self.env, timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert p.returncode == 0, p.stderr
        return p

    def wait_ready(self) -> None:
        engines.wait_answering(
            "containerd", self.proc,
            lambda: os.path.exists(self.sock) and self.ctr("version", check=False, timeout=30).returncode == 0,
            self.tmp / "containerd.log")

    def run(self, rootfs: Path, env: dict, script: str = SCRIPT, runc_binary: Path = WRAPPER):
        cid = f"c{uuid.uuid4().hex[:10]}"
        args = ["run", "--rm", "--rootfs", "--runc-binary", str(runc_binary)]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        try:
            return self.ctr(*args, str(rootfs), cid, "/bin/sh", "-c", script, check=False)
        finally:
            self.ctr("task", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
            self.ctr("container", "rm", cid, check=False, timeout=30)

    def stop(self) -> None:
        engines.stop_daemon(self.proc, self.out, self.tmp)


@pytest.fixture(scope="module")
def containerd(fixtures_root):
    with engines.engine_dir("nvhook-ctd") as tmp:
        d = Containerd(tmp, fixtures_root / "host-gpu8")
        try:
            d.wait_ready()
            yield d
        finally:
            d.stop()


def test_ctr_run_gpu0_through_the_wrapper(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)


def test_ctr_run_without_gpu_config_json_byte_identical(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {}, script="echo STARTED; ls /dev", runc_binary=containerd.rec_before)
    assert p.returncode == 0 and "STARTED" in p.stdout and "nvidia" not in p.stdout, p.stderr
    before, after = engines.recorded(containerd.rec)
    assert len(before) == 1 and before == after


def test_ctr_run_unknown_device_reports_the_reason(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {"NVIDIA_VISIBLE_DEVICES": "9"}, script="touch /started; echo STARTED")
    assert p.returncode != 0 and "STARTED" not in p.stdout
    assert not (rootfs / "started").exists()
    assert "nvhook-runtime: unknown device '9' in NVIDIA_VISIBLE_DEVICES" in p.stderr, p.stderr
