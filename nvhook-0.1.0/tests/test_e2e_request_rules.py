"""Issue 14 in real runc containers: the request rules as users meet them. The installed nvhook
is the prestart hook, `--root` a fixture host; what is checked is what the container sees
(/dev, its libraries, /proc/driver/nvidia) and nvhook's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402  (tests/conftest.py puts tests/fixtures on sys.path)
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

SHARED_CLUSTER = "[devices]\naccept_envvar_unprivileged = false\naccept_volume_mounts = true\n"
IMEX_MAJOR = 237
VIEW = ("echo STARTED; echo DEV:$(ls /dev | grep nvidia); "
        "echo IMEX:$(ls /dev/nvidia-caps-imex-channels 2>/dev/null); echo CAPS:$(ls /dev/nvidia-caps 2>/dev/null); "
        "cuda-probe >/dev/null 2>&1 && echo HAS-LIBCUDA || echo NO-LIBCUDA")


def line(out: str, prefix: str) -> list[str]:
    found = [ln[len(prefix):] for ln in out.splitlines() if ln.startswith(prefix)]
    assert len(found) == 1, out
    return found[0].split()


def imex_host(fixtures_root: Path, tmp: Path, channels: int = 4) -> Path:
    """host-gpu8 with IMEX channel nodes, as a GB200 host has them (major from /proc/devices)."""
    host = tmp / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(host)], check=True)  # device nodes too
    devices = host / "proc/devices"
    text = devices.read_text().replace("\nBlock devices:", f"{IMEX_MAJOR} nvidia-caps-imex-channels\n\nBlock devices:")
    devices.write_text(text)
    (host / "dev/nvidia-caps-imex-channels").mkdir()
    for n in range(channels):
        os.mknod(host / f"dev/nvidia-caps-imex-channels/channel{n}", 0o020666, os.makedev(IMEX_MAJOR, n))
    return host


def run(tmp: Path, host: Path, env: dict, *, config_extra: str = "", volume: tuple[str, ...] = (),
        script: str = VIEW, privileged: bool = False) -> rb.HookRun:
    """A private copy of container-debian with `env` over the image's, `volume` as /dev/null
    mounts under /var/run/nvidia-container-devices (the device plugin's volume-mounts list)."""
    tmp.mkdir(parents=True, exist_ok=True)
    rootfs = mf.build_container("container-debian", tmp / "images")
    log_file = tmp / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp / "nvhook.toml", log_file=log_file, cache_dir=tmp / "cache",
                                    extra=config_extra)
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", env))
    oci["process"]["args"] = ["/bin/sh", "-c", script]
    if privileged:  # what nvhook (and NVIDIA's hook) take for --privileged: CAP_SYS_ADMIN in the bounding set
        oci["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    for name in volume:
        oci["mounts"].append({"destination": f"/var/run/nvidia-container-devices/{name}", "type": "bind",
                              "source": "/dev/null", "options": ["bind", "ro"]})
    bundle = rb.nvhook_bundle(tmp / "bundle", oci, ["--config", str(config), "--root", str(host), "prestart"])
    proc = rb.runc_run(bundle, tmp / "runc-state")
    return rb.HookRun(proc, rootfs, bundle, log_file)


def gpu_nodes(out: str) -> list[str]:
    return sorted(n for n in line(out, "DEV:") if n[6:].isdigit())


LEGACY = {"NVIDIA_VISIBLE_DEVICES": None, "NVIDIA_DRIVER_CAPABILITIES": None, "CUDA_VERSION": "11.8.0"}


def test_legacy_cuda_version_image_gets_no_gpu_on_a_shared_cluster(tmp_path, fixtures_root):
    """Bypass 1: an image with only ENV CUDA_VERSION got every GPU despite the policy."""
    gpu8 = fixtures_root / "host-gpu8"
    r = run(tmp_path / "policy", gpu8, LEGACY, config_extra=SHARED_CLUSTER)
    assert r.proc.returncode == 0, r.proc.stderr
    assert "STARTED" in r.stdout and "NO-LIBCUDA" in r.stdout
    assert gpu_nodes(r.stdout) == []
    req = r.event("request")
    assert req["kind"] == "skip" and "CUDA_VERSION" in req["reason"] and "accept_envvar_unprivileged" in req["reason"]
    # The same image where the policy allows the environment: every GPU, as before.
    r = run(tmp_path / "open", gpu8, LEGACY)
    assert r.proc.returncode == 0, r.proc.stderr
    assert gpu_nodes(r.stdout) == [f"nvidia{g.minor}" for g in mf.HOSTS["host-gpu8"].gpus]
    assert "HAS-LIBCUDA" in r.stdout


def test_imex_channels_from_the_image_env_are_not_injected(tmp_path, fixtures_root):
    """Bypass 2: the GPU from the orchestrator's volume mounts, NVIDIA_IMEX_CHANNELS=all from
    the image: the container gets its GPU and no IMEX channel; the log says why."""
    host = imex_host(fixtures_root, tmp_path)
    r = run(tmp_path / "c", host, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_IMEX_CHANNELS": "all"},
            config_extra=SHARED_CLUSTER, volume=("1",))
    assert r.proc.returncode == 0, r.proc.stderr
    assert gpu_nodes(r.stdout) == ["nvidia1"]
    assert line(r.stdout, "IMEX:") == []
    ignored = r.events("request.ignored")
    assert len(ignored) == 1 and ignored[0]["level"] == "warning"
    assert "NVIDIA_IMEX_CHANNELS='all' ignored" in ignored[0]["message"]


def test_imex_channel_by_volume_mount(tmp_path, fixtures_root):
    """The orchestrator's imex/<n> entry: that channel only (not a device named 'imex/2')."""
    host = imex_host(fixtures_root, tmp_path)
    r = run(tmp_path / "c", host, {"NVIDIA_VISIBLE_DEVICES": None}, config_extra=SHARED_CLUSTER,
            volume=("0", "imex/2"))
    assert r.proc.returncode == 0, r.proc.stderr
    assert gpu_nodes(r.stdout) == ["nvidia0"]
    assert line(r.stdout, "IMEX:") == ["channel2"]


def test_ignore_imex_channel_requests_switch(tmp_path, fixtures_root):
    host = imex_host(fixtures_root, tmp_path)
    r = run(tmp_path / "c", host, {"NVIDIA_VISIBLE_DEVICES": None},
            config_extra=SHARED_CLUSTER + "[request]\nignore_imex_channel_requests = true\n", volume=("0", "imex/2"))
    assert r.proc.returncode == 0, r.proc.stderr
    assert gpu_nodes(r.stdout) == ["nvidia0"] and line(r.stdout, "IMEX:") == []


def test_all_on_a_mig_host_brings_every_mig_device(tmp_path, fixtures_root):
    """NVIDIA_VISIBLE_DEVICES=all where GPUs 0 and 1 run MIG: every GPU node, and every MIG
    device's GPU-instance and compute-instance access nodes with the procfs files CUDA reads."""
    gpu8 = fixtures_root / "host-gpu8"
    minors = dict(ln.split() for ln in (gpu8 / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    script = VIEW + ("; echo PROC:$(cd /proc/driver/nvidia/capabilities && find . -name access | sort)")
    r = run(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "all"}, script=script)
    assert r.proc.returncode == 0, r.proc.stderr
    assert len(gpu_nodes(r.stdout)) == 8
    access = [k for k in minors if k.endswith("/access")]
    assert len(access) == 7  # gpu0: gi1, gi1/ci0, gi2, gi2/ci0; gpu1: gi1, gi1/ci0, gi1/ci1
    assert sorted(line(r.stdout, "CAPS:")) == sorted(f"nvidia-cap{minors[k]}" for k in access)
    assert sorted(line(r.stdout, "PROC:")) == sorted("./" + k.replace("/", "/mig/", 1) for k in access)
    assert json.dumps(r.event("plan")["gpus"]) == json.dumps(list(range(8)))


def test_missing_imex_channel_node_is_created_when_the_switch_is_on(tmp_path, fixtures_root):
    """The orchestrator asks for IMEX channel 5 the driver has no node for yet (GB200 before
    nvidia-modprobe -i ran): with devices.create_missing_nodes the hook makes it on the host
    (the major /proc/devices gives) and the container gets it; without the switch the
    container does not start and the error names the switch."""
    host = imex_host(fixtures_root, tmp_path, channels=0)
    r = run(tmp_path / "off", host, {"NVIDIA_VISIBLE_DEVICES": None}, config_extra=SHARED_CLUSTER,
            volume=("0", "imex/5"))
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert "unknown IMEX channel '5'" in r.proc.stderr and "devices.create_missing_nodes" in r.proc.stderr
    assert not (host / "dev/nvidia-caps-imex-channels/channel5").exists()

    on = SHARED_CLUSTER.replace("[devices]\n", "[devices]\ncreate_missing_nodes = true\n")
    r = run(tmp_path / "on", host, {"NVIDIA_VISIBLE_DEVICES": None}, config_extra=on, volume=("0", "imex/5"),
            script=VIEW + "; echo NODE:$(stat -c '%t:%T %a' /dev/nvidia-caps-imex-channels/channel5)")
    assert r.proc.returncode == 0, r.proc.stderr
    assert line(r.stdout, "IMEX:") == ["channel5"]
    assert line(r.stdout, "NODE:") == [f"{IMEX_MAJOR:x}:5", "666"]
    st = os.stat(host / "dev/nvidia-caps-imex-channels/channel5")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (IMEX_MAJOR, 5)
    assert r.event("device.created")["device"] == "/dev/nvidia-caps-imex-channels/channel5"


def test_mig_config_all_grants_the_mig_capable_gpus_capabilities(tmp_path, fixtures_root):
    """NVIDIA_MIG_CONFIG_DEVICES=all in a privileged container with GPUs 0 (MIG on) and 2 (MIG
    capable, off): the config capability and GPU 0's every MIG capability node and procfs
    file; GPU 1's stay hidden. Unprivileged, the container does not start."""
    gpu8 = fixtures_root / "host-gpu8"
    minors = dict(ln.split() for ln in (gpu8 / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    env = {"NVIDIA_VISIBLE_DEVICES": "0,2", "NVIDIA_MIG_CONFIG_DEVICES": "all"}
    script = VIEW + "; echo PROC:$(cd /proc/driver/nvidia/capabilities && find . -type f | sort)"
    r = run(tmp_path / "priv", gpu8, env, script=script, privileged=True)
    assert r.proc.returncode == 0, r.proc.stderr
    gpu0 = [k for k in minors if k.startswith("gpu0/")]
    assert sorted(line(r.stdout, "CAPS:")) == sorted(f"nvidia-cap{minors[k]}" for k in ["config", *gpu0])
    want_proc = ["./mig/config", *("./" + k.replace("/", "/mig/", 1) for k in gpu0)]
    assert sorted(line(r.stdout, "PROC:")) == sorted(want_proc)
    r = run(tmp_path / "unpriv", gpu8, env)
    assert r.proc.returncode != 0
    assert "NVIDIA_MIG_CONFIG_DEVICES is set but the container is not privileged" in r.proc.stderr


def test_all_on_eight_gpus_with_seven_mig_instances_each(tmp_path, fixtures_root):
    """At DGX scale: 8 GPUs x 7 MIG instances, every one with its GPU-instance and
    compute-instance access node (112) and procfs file, in one start."""
    host = fixtures_root / "host-mig8x7"
    minors = dict(ln.split() for ln in (host / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    access = [k for k in minors if k.endswith("/access")]
    assert len(access) == 112
    script = VIEW + "; echo PROC:$(cd /proc/driver/nvidia/capabilities && find . -name access | wc -l)"
    r = run(tmp_path, host, {"NVIDIA_VISIBLE_DEVICES": "all"}, script=script)
    assert r.proc.returncode == 0, r.proc.stderr
    assert sorted(line(r.stdout, "CAPS:")) == sorted(f"nvidia-cap{minors[k]}" for k in access)
    assert line(r.stdout, "PROC:") == ["112"]
    assert len(gpu_nodes(r.stdout)) == 8
