"""nvhook with a real Docker daemon (Debian's docker.io 20.10): `--runtime=nvidia` through
nvhook-runtime, and `--gpus` through nvhook installed as nvidia-container-runtime-hook.

One private dockerd per module: its own --data-root, --exec-root, --pidfile and unix socket in
a temp dir, no iptables, no bridge, no registry (the image is the Debian fixture rootfs, made
with `docker import`), its runtime registered by a daemon.json that `nvhook runtime configure`
wrote, and a PATH whose first directory holds the nvidia-container-runtime-hook link that
dockerd looks for. The daemon is stopped, its mounts and processes checked gone and its
directories removed whatever the tests did. /usr/local/bin/docker on some machines is a newer
client alone; the client of the daemon's own package (/usr/bin/docker) is used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import engines  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from gpuview import SCRIPT, assert_gpu0  # noqa: E402

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"
WRAPPER = Path(sys.executable).with_name("nvhook-runtime")


def _skip() -> str | None:
    if os.geteuid() != 0:
        return "dockerd needs root"
    for p in (DOCKERD, DOCKER):
        if not os.access(p, os.X_OK):
            return f"{p} is missing (Debian's docker.io)"
    if not shutil.which("runc") or not WRAPPER.exists():
        return "runc or nvhook-runtime is missing"
    return None


pytestmark = [pytest.mark.runc, pytest.mark.skipif(_skip() is not None, reason=_skip() or "")]

class Daemon:
    def __init__(self, tmp: Path, host: Path):
        self.tmp = tmp
        self.sock = f"unix://{tmp}/docker.sock"
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "nvhook.toml", log_file=self.log, cache_dir=tmp / "cache", root=host)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        os.symlink(WRAPPER.with_name("nvhook"), self.bin / "nvidia-container-runtime-hook")
        self.rec, before = tmp / "rec", self.bin / "rec-before"
        engines.write_recorders(self.rec, before, self.bin / "rec-after", WRAPPER)
        p = subprocess.run([str(WRAPPER.with_name("nvhook")), "runtime", "configure", "--runtime", "docker",
                            "--config", str(tmp / "daemon.json"), "--runtime-path", str(WRAPPER)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        # Docker 20.10 writes its (deprecated) trust key to /etc/docker/key.json unless told
        # where: the machine's /etc is not this daemon's to write.
        conf = json.loads((tmp / "daemon.json").read_text())
        conf["deprecated-key-path"] = str(tmp / "key.json")
        (tmp / "daemon.json").write_text(json.dumps(conf, indent=2) + "\n")
        self.env = {"PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "NVHOOK_CONFIG": str(self.config),
                    "HOME": str(tmp)}
        self.out = open(tmp / "dockerd.log", "wb")
        self.proc = subprocess.Popen(
            [DOCKERD, "--config-file", str(tmp / "daemon.json"), "--data-root", str(tmp / "data"),
             "--exec-root", str(tmp / "exec"), "--pidfile", str(tmp / "docker.pid"), "-H", self.sock,
             "--iptables=false", "--ip-masq=false", "--bridge=none", "--userland-proxy=false",
             "--exec-opt", "native.cgroupdriver=cgroupfs", "--add-runtime", f"nvhook-rec={before}"],
            env=self.env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        engines.wait_answering("dockerd", self.proc,
                               lambda: self.docker("version", check=False, timeout=30).returncode == 0,
                               self.tmp / "dockerd.log")

    def docker(self, *args: str, check: bool = True, timeout: float = 90, stdin=None) -> subprocess.CompletedProcess:
        p = subprocess.run([DOCKER, "-H", self.sock, *args], capture_output=True, text=True, errors="replace",
                           env={**self.env, "DOCKER_CONFIG": str(self.tmp / "client")}, timeout=timeout,
                           stdin=stdin if stdin is not None else subprocess.DEVNULL)
        if check:
            assert p.returncode == 0, p.stderr
        return p

    def run(self, *args: str, script: str = SCRIPT) -> subprocess.CompletedProcess:
        return self.docker("run", "--rm", "--network", "none", *args, "nvhook-test:debian", "/bin/sh", "-c", script,
                           check=False)

    def stop(self) -> None:
        try:
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=60)
        except Exception:
            pass
        # then dockerd, and anything still running from our directories (containerd, shims: ours)
        engines.stop_daemon(self.proc, self.out, self.tmp)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, fixtures_root):
    with engines.engine_dir("nvhook-dk") as tmp:
        rootfs = mf.build_container("container-debian", tmp / "images")
        d = Daemon(tmp, fixtures_root / "host-gpu8")
        try:
            d.wait_ready()
            tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True, timeout=60)
            p = subprocess.run([DOCKER, "-H", d.sock, "import", "-", "nvhook-test:debian"], input=tar.stdout,
                               capture_output=True, timeout=120, env=d.env)
            assert p.returncode == 0, p.stderr
            yield d
        finally:
            d.stop()


def test_runtime_nvhook_gpu0(daemon):
    p = daemon.run("--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0")
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)


def test_gpus_flag_through_the_hook_name(daemon):
    """`--gpus device=0` with the default runtime (runc): dockerd found
    nvidia-container-runtime-hook in its PATH and runs it as a prestart hook; that is nvhook."""
    p = daemon.run("--gpus", "device=0")
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)


def test_gpus_flag_exact_hook_and_env(daemon):
    """What dockerd 20.10 writes into config.json for --gpus: the hook's path and argv, the
    daemon's own environment as the hook's (so NVHOOK_CONFIG set for dockerd reaches nvhook),
    the request as NVIDIA_VISIBLE_DEVICES; beside it libnetwork's own prestart hook."""
    cid = daemon.docker("run", "-d", "--network", "none", "--gpus", "device=0", "nvhook-test:debian",
                        "sleep", "60").stdout.strip()
    try:
        found = list((daemon.tmp / "exec").rglob(f"{cid}/config.json"))
        assert len(found) == 1, found
        spec = json.loads(found[0].read_text())
        ours = [h for h in spec["hooks"]["prestart"] if h["path"].endswith("/nvidia-container-runtime-hook")]
        assert len(ours) == 1, spec["hooks"]
        assert ours[0]["path"] == str(daemon.bin / "nvidia-container-runtime-hook")
        assert ours[0]["args"] == ["nvidia-container-runtime-hook", "prestart"]
        assert f"NVHOOK_CONFIG={daemon.config}" in ours[0]["env"]
        assert "NVIDIA_VISIBLE_DEVICES=0" in spec["process"]["env"]
        assert not [e for e in spec["process"]["env"] if e.startswith("NVIDIA_DRIVER_CAPABILITIES")]
        # and nvhook ran under that name, as a prestart hook, for this container
        done = [e for e in rb.read_events(daemon.log) if e["event"] == "hook.done" and e.get("container") == cid]
        assert done and done[0]["result"] == "ok"
    finally:
        daemon.docker("rm", "-f", cid, check=False)


def test_gpus_flag_and_runtime_nvhook_inject_once(daemon):
    p = daemon.run("--runtime=nvidia", "--gpus", "device=0")
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)  # MOUNTS-LIBCUDA == 1: Docker's hook was replaced, not added to


def test_no_gpu_request_config_json_byte_identical(daemon):
    p = daemon.run("--runtime=nvhook-rec", script="echo STARTED; ls /dev")
    assert p.returncode == 0 and "STARTED" in p.stdout and "nvidia" not in p.stdout, p.stderr
    p = daemon.run("--runtime=nvhook-rec", "-e", "NVIDIA_VISIBLE_DEVICES=0")
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)
    before, after = engines.recorded(daemon.rec)
    assert set(before) == set(after) and len(before) == 2
    plain = [n for n in before if b"NVIDIA_VISIBLE_DEVICES" not in before[n]]
    gpu = [n for n in before if n not in plain]
    assert len(plain) == len(gpu) == 1
    assert after[plain[0]] == before[plain[0]]
    assert after[gpu[0]] != before[gpu[0]] and b"--in-container-only" in after[gpu[0]]


def test_unknown_device_stops_the_container_with_one_line(daemon):
    p = daemon.run("--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=9", script="echo STARTED")
    assert p.returncode != 0
    assert "STARTED" not in p.stdout
    assert "nvhook-runtime: unknown device '9' in NVIDIA_VISIBLE_DEVICES" in p.stderr, p.stderr


def _logs_of(daemon, *args: str, script: str) -> tuple[str, str, str]:
    """(stdout, stderr of `docker logs`, id) of a container run detached to its end."""
    cid = daemon.docker("run", "-d", "--network", "none", *args, "nvhook-test:debian", "/bin/sh", "-c",
                        script).stdout.strip()
    try:
        assert daemon.docker("wait", cid).stdout.strip() == "0"
        logs = daemon.docker("logs", cid)
        return logs.stdout, logs.stderr, cid
    finally:
        daemon.docker("rm", "-f", cid, check=False)


def test_runtime_warnings_stay_out_of_the_containers_log(daemon):
    """Under containerd's shim, nvhook-runtime's stderr during create is the container's own
    stderr: `docker logs` showed "nvhook-runtime: warning: config ... is not valid TOML" at the
    top of every container's output on a node with a broken config. The warning goes to nvhook's
    log instead; the container's log holds only what the container wrote. The same for a GPU
    container whose nvhook log cannot be written (it still gets its GPU)."""
    good = daemon.config.read_text()
    try:
        daemon.config.write_text(good + "[devices\n")  # not TOML; its log_file line still found
        out, err, cid = _logs_of(daemon, "--runtime=nvidia", script="echo STARTED; echo TO-STDERR >&2")
        assert (out, err) == ("STARTED\n", "TO-STDERR\n")
        said = [e for e in rb.read_events(daemon.log) if e["event"] == "config.unusable" and e["container"] == cid]
        assert len(said) == 1 and "is not valid TOML" in said[0]["error"], rb.read_events(daemon.log)[-3:]
        assert said[0]["level"] == "warning" and "asks for no GPU" in said[0]["message"]

        (daemon.tmp / "a-file").write_text("")
        daemon.config.write_text(good.replace(f"log_file = {json.dumps(str(daemon.log))}",
                                              f"log_file = {json.dumps(str(daemon.tmp / 'a-file' / 'log'))}"))
        assert "a-file" in daemon.config.read_text()
        out, err, cid = _logs_of(daemon, "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0", script=SCRIPT)
        assert err == "", err
        assert_gpu0(out)
    finally:
        daemon.config.write_text(good)
        (daemon.tmp / "a-file").unlink(missing_ok=True)


def test_the_daemon_keeps_its_trust_key_in_its_own_directory(daemon):
    """Docker 20.10 writes a trust key at start: into the test's directory (daemon.json's
    deprecated-key-path), never the machine's /etc/docker/key.json (tests/conftest.py checks the
    machine's /etc around every module)."""
    assert (daemon.tmp / "key.json").is_file()
