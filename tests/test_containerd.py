"""nvhook-runtime under a real containerd (Debian's 1.6) with `ctr run --runc-binary`.

One private containerd per module (its own root, state and socket in a temp dir, the CRI
plugin off); containers run from the Debian fixture rootfs with `ctr run --rootfs`. The daemon
is stopped and its processes and mounts checked gone whatever the tests did.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from engines import RECORDER  # noqa: E402
from engines import pids_using as _pids_using
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
        self.rec = tmp / "rec"
        for stage in ("before", "after"):
            (self.rec / stage).mkdir(parents=True)
        self.rec_after = tmp / "rec-after"
        self.rec_after.write_text(RECORDER.format(rec=self.rec, stage="after", tail='exec runc "$@"'))
        self.rec_before = tmp / "rec-before"
        self.rec_before.write_text(RECORDER.format(rec=self.rec, stage="before",
                                                   tail=f'NVHOOK_RUNTIME={self.rec_after} exec {WRAPPER} "$@"'))
        self.rec_after.chmod(0o755), self.rec_before.chmod(0o755)
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

    def wait_ready(self, timeout: float = 180) -> None:
        """Until containerd answers (its start is slow on a loaded machine: a generous deadline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError((self.tmp / "containerd.log").read_text()[-2000:])
            try:
                if os.path.exists(self.sock) and self.ctr("version", check=False, timeout=30).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass  # listening, not answering yet
            time.sleep(0.2)
        raise AssertionError(f"containerd not ready after {timeout:g} s: "
                             + (self.tmp / "containerd.log").read_text()[-2000:])

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()
        for pid in _pids_using(self.tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for m in sorted(rb.host_mounts_under(self.tmp), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def containerd(fixtures_root):
    tmp = Path(f"/tmp/nvhook-ctd-{uuid.uuid4().hex[:8]}")  # short: unix socket paths are limited
    tmp.mkdir(mode=0o700)
    d = None
    try:
        d = Containerd(tmp, fixtures_root / "host-gpu8")
        d.wait_ready()
        yield d
    finally:
        if d is not None:
            d.stop()
        leftovers = _pids_using(tmp), rb.host_mounts_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert leftovers == ([], []), leftovers


def test_ctr_run_gpu0_through_the_wrapper(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)


def test_ctr_run_without_gpu_config_json_byte_identical(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {}, script="echo STARTED; ls /dev", runc_binary=containerd.rec_before)
    assert p.returncode == 0 and "STARTED" in p.stdout and "nvidia" not in p.stdout, p.stderr
    before = {f.name: f.read_bytes() for f in (containerd.rec / "before").iterdir()}
    after = {f.name: f.read_bytes() for f in (containerd.rec / "after").iterdir()}
    assert len(before) == 1 and before == after


def test_ctr_run_unknown_device_reports_the_reason(containerd, tmp_path):
    rootfs = mf.build_container("container-debian", tmp_path)
    p = containerd.run(rootfs, {"NVIDIA_VISIBLE_DEVICES": "9"}, script="touch /started; echo STARTED")
    assert p.returncode != 0 and "STARTED" not in p.stdout
    assert not (rootfs / "started").exists()
    assert "nvhook-runtime: unknown device '9' in NVIDIA_VISIBLE_DEVICES" in p.stderr, p.stderr
