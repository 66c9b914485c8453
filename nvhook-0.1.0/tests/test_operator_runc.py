"""Operator promises checked with real runc containers (issue 15): a broken config never stops
a container that asked for no GPU and stops a GPU container with one line; the container's
/proc/driver/nvidia/params says ModifyDeviceFiles: 0 while registry is the host's; the hook's
events all carry the container id and a readable message, and a container asking for compute
hears nothing about missing video or graphics files; a hook run leaves nothing in the host's
/run/nvhook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

STARTED = "touch /started; echo STARTED"


def start(tmp: Path, host: Path, *, env: dict, nvhook_config: str, script: str = STARTED):
    """runc run with nvhook registered as the shipped hooks file does it: no --config, the
    config named by NVHOOK_CONFIG in the hook's own environment."""
    rootfs = mf.build_container("container-debian", tmp / "images")
    log = tmp / "nvhook.jsonl"
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", env))
    oci["process"]["args"] = ["/bin/sh", "-c", script]
    bundle = rb.nvhook_bundle(tmp / "bundle", oci, ["--root", str(host), "--log-file", str(log), "prestart"])
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["hooks"]["prestart"][0]["env"] = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", f"NVHOOK_CONFIG={nvhook_config}",
                                          f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    proc = rb.runc_run(bundle, tmp / "runc-state")
    return proc, rootfs, rb.read_events(log)


BROKEN = {
    "missing": None,
    "mistyped": 'log_level = 3\n',
    "not TOML": '[devices\n',
    "relative log_file": 'log_file = "nvhook.log"\n',
}


@pytest.mark.parametrize("state", list(BROKEN))
def test_broken_config_never_stops_a_container_without_gpu(tmp_path, fixtures_root, state):
    conf = tmp_path / "hook.toml"
    if BROKEN[state] is not None:
        conf.write_text(BROKEN[state])
    host = fixtures_root / "host-gpu8"
    # asks for no GPU: starts, and says why the config was not used
    proc, rootfs, evs = start(tmp_path / "plain", host, env={"NVIDIA_VISIBLE_DEVICES": None},
                              nvhook_config=str(conf))
    assert proc.returncode == 0, proc.stderr
    assert "STARTED" in proc.stdout and (rootfs / "started").exists()
    (ev,) = [e for e in evs if e["event"] == "config.unusable"]
    assert ev["level"] == "warning" and str(conf) in ev["error"] and ev["container"]
    # asks for a GPU: refused with one line naming the config's problem
    proc, rootfs, evs = start(tmp_path / "gpu", host, env={"NVIDIA_VISIBLE_DEVICES": "0"},
                              nvhook_config=str(conf))
    assert proc.returncode != 0 and not (rootfs / "started").exists()
    (line,) = rb.hook_stderr_lines(proc.stderr)
    assert line.startswith("nvhook: ") and str(conf) in line, line
    assert evs[-1]["event"] == "hook.failed" and f"nvhook: {evs[-1]['error']}" == line


def test_void_and_legacy_images_under_a_broken_config(tmp_path, fixtures_root):
    """void asks for nothing (starts); a legacy CUDA image asks for every GPU (refused)."""
    conf = tmp_path / "hook.toml"
    conf.write_text("log_level = 3\n")
    host = fixtures_root / "host-gpu8"
    proc, rootfs, _ = start(tmp_path / "void", host, env={"NVIDIA_VISIBLE_DEVICES": "void"}, nvhook_config=str(conf))
    assert proc.returncode == 0 and (rootfs / "started").exists(), proc.stderr
    proc, rootfs, _ = start(tmp_path / "legacy", host, env={"NVIDIA_VISIBLE_DEVICES": None, "CUDA_VERSION": "12.2.0"},
                            nvhook_config=str(conf))
    assert proc.returncode != 0 and not (rootfs / "started").exists()
    assert "log_level must be a string, not number 3" in rb.hook_stderr_lines(proc.stderr)[0]


PROC_VIEW = """
echo PARAMS; cat /proc/driver/nvidia/params; echo END
echo REGISTRY; cat /proc/driver/nvidia/registry; echo END
echo "INFO:$(grep -c . /proc/driver/nvidia/gpus/*/information)"
"""


def _section(out: str, name: str) -> str:
    return out.split(f"{name}\n", 1)[1].split("END\n", 1)[0]


def test_params_rewritten_registry_copied(tmp_path, fixtures_root):
    """Real drivers show ModifyDeviceFiles in params: that copy says 0, every other line as the
    host's; registry is the host's as it is."""
    host = fixtures_root / "host-gpu8"
    r = rb.run_with_nvhook(tmp_path, host=host, script=PROC_VIEW)
    assert r.proc.returncode == 0, r.proc.stderr
    params = _section(r.stdout, "PARAMS")
    host_params = (host / "proc/driver/nvidia/params").read_text()
    assert "ModifyDeviceFiles: 1\n" in host_params
    assert params == host_params.replace("ModifyDeviceFiles: 1\n", "ModifyDeviceFiles: 0\n")
    assert _section(r.stdout, "REGISTRY") == (host / "proc/driver/nvidia/registry").read_text()


def test_hook_events_carry_container_and_message_and_only_requested_absences(tmp_path, fixtures_root):
    """A compute,utility container on a host without the video and graphics libraries: the log
    names no missing video/graphics file; every event has the container id and a message."""
    tmp_path.mkdir(exist_ok=True)
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(tmp_path / "host")], check=True)
    host = tmp_path / "host"
    lib = host / "usr/lib/x86_64-linux-gnu"
    for f in list(lib.iterdir()):
        if f.name.startswith(("libnvcuvid", "libnvidia-encode", "libnvidia-glcore", "libnvidia-eglcore")):
            f.unlink()
    cid = f"operator-events-{uuid.uuid4().hex[:8]}"  # runc's cgroup is named by it: unique on the machine
    r = rb.run_with_nvhook(tmp_path / "run", host=host, script=STARTED, config_extra='log_level = "debug"\n',
                           cid=cid)
    assert r.proc.returncode == 0, r.proc.stderr
    evs = r.events()
    assert evs[0]["event"] == "hook.start"
    assert all(e["container"] == cid for e in evs), {e["event"]: e.get("container") for e in evs}
    assert all(isinstance(e["message"], str) and e["message"] for e in evs)
    missing = [e for e in evs if e["event"].endswith(".missing") or e["event"] == "library.skipped"]
    assert not [e for e in missing if e.get("capability") in ("video", "graphics", "display")], missing
    assert all(e["level"] == "debug" for e in missing if e["event"] == "library.missing"), missing
    # the same host, a container that asks for video: now its absence is a warning
    r = rb.run_with_nvhook(tmp_path / "video", host=host, script=STARTED,
                           env={"NVIDIA_DRIVER_CAPABILITIES": "compute,utility,video"})
    assert r.proc.returncode == 0, r.proc.stderr
    warned = {e["library"] for e in r.events() if e["level"] == "warning"
              and e["event"] in ("library.missing", "library.skipped")}
    assert {"libnvcuvid.so", "libnvidia-encode.so"} <= warned


def test_hook_leaves_nothing_in_the_hosts_run_nvhook(tmp_path, fixtures_root):
    """The tests' hooks cache their parsed config in NVHOOK_RUN_DIR, never in /run/nvhook."""
    from nvhook.base import config

    r = rb.run_with_nvhook(tmp_path, host=fixtures_root / "host-gpu8", script=STARTED)
    assert r.proc.returncode == 0, r.proc.stderr
    name = config.cache_file_name("config", str(tmp_path / "nvhook.toml"))
    assert (Path(os.environ["NVHOOK_RUN_DIR"]) / name).exists()
    assert not (Path("/run/nvhook") / name).exists()
