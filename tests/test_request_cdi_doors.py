"""CDI device names in NVIDIA_VISIBLE_DEVICES (`nvidia.com/gpu=1`, as NVIDIA's runtime takes them
in its cdi and jit-cdi modes) at every front door, on the 8-GPU fixture host: the OCI hook in a
real runc container, nvhook-runtime's config.json, `--dry-run`, `doctor` and the NRI plugin's
adjustment. decide.request reads them for all doors (tests/decide/test_request_cdi_names.py has
every name form); here each door shows the same GPUs for a name as for its plain id, and the
same one-line refusal for a vendor or class nvhook does not serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

HOST = mf.HOSTS["host-gpu8"]
BAD = "nvidia.com/gpu=1,amd.com/gpu=0"
REFUSAL = ("NVIDIA_VISIBLE_DEVICES: 'amd.com/gpu=0' is not a CDI device nvhook serves (vendor/class 'amd.com/gpu'; "
           "use nvidia.com/gpu=<index|UUID|all>, e.g. nvidia.com/gpu=0)")
needs_runc = pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or "")


def bundle(tmp: Path, fixtures_root: Path, value: str) -> Path:
    """A bundle of the Debian fixture image (read only: --dry-run and doctor write nothing)
    asking for `value`; the same path each time, so that plans differ only by the request."""
    b = tmp / "bundle"
    b.mkdir(exist_ok=True)
    oci = json.loads((fixtures_root / "bundle-container-debian" / "config.json").read_text())
    oci["root"]["path"] = str(fixtures_root / "container-debian")
    oci["process"]["env"] = [e for e in oci["process"]["env"] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    oci["process"]["env"].append(f"NVIDIA_VISIBLE_DEVICES={value}")
    (b / "config.json").write_text(json.dumps(oci))
    return b


def cli(tmp: Path, host: Path, *args: str) -> subprocess.CompletedProcess:
    cfg = rb.write_nvhook_config(tmp / "hook.toml", log_file=tmp / "nvhook.jsonl", cache_dir=tmp / "cache")
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run([str(rb.NVHOOK_BIN), "--config", str(cfg), "--root", str(host), *args],
                          capture_output=True, text=True, timeout=120, env=env)


# -- --dry-run and doctor -----------------------------------------------------------------------

def test_dry_run_plans_a_name_as_its_id(tmp_path, fixtures_root):
    host = fixtures_root / "host-gpu8"
    g3, mig = HOST.gpus[3], HOST.gpus[0].migs[1]
    plans = []
    for value in (f"nvidia.com/gpu={g3.uuid},nvidia.com/gpu=mig0:{mig.slot}", f"{g3.uuid},0:{mig.slot}"):
        p = cli(tmp_path, host, "--dry-run", "--format", "json", "--bundle", str(bundle(tmp_path, fixtures_root, value)))
        assert p.returncode == 0, p.stderr
        plans.append(json.loads(p.stdout))
    assert plans[0] == plans[1]
    assert sorted(g["index"] for g in plans[0]["gpus"]) == [0, 3]


def test_dry_run_and_doctor_refuse_another_vendor_in_one_line(tmp_path, fixtures_root):
    host = fixtures_root / "host-gpu8"
    b = bundle(tmp_path, fixtures_root, BAD)
    p = cli(tmp_path, host, "--dry-run", "--bundle", str(b))
    assert p.returncode == 1 and p.stdout == "" and p.stderr == f"nvhook: {REFUSAL}\n"
    p = cli(tmp_path, host, "doctor", "--bundle", str(b))
    hook = [ln for ln in p.stdout.splitlines() if ln.startswith("Hook ")]
    assert hook == [f"Hook            refuses the container: nvhook: {REFUSAL}"], p.stdout


def test_doctor_reads_the_name(tmp_path, fixtures_root):
    p = cli(tmp_path, fixtures_root / "host-gpu8", "doctor", "--bundle",
            str(bundle(tmp_path, fixtures_root, "nvidia.com/gpu=gpu5")))
    assert p.returncode == 0, p.stderr
    gpus = p.stdout.split("\nGPUs\n", 1)[1].split("\nDevice access", 1)[0]
    assert [ln.split()[:1] for ln in gpus.splitlines() if not ln.strip().startswith("->")] == [["5"]]


# -- the hook, in a real runc container ---------------------------------------------------------

@needs_runc
@pytest.mark.runc
def test_hook_gives_the_named_gpus_and_mig_device(tmp_path, fixtures_root):
    from test_e2e_request_rules import gpu_nodes, line, run

    host = fixtures_root / "host-gpu8"
    mig = HOST.gpus[1].migs[0]
    r = run(tmp_path / "c", host, {"NVIDIA_VISIBLE_DEVICES": f"nvidia.com/gpu=6, 2,nvidia.com/gpu={mig.uuid}"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert "HAS-LIBCUDA" in r.stdout
    assert gpu_nodes(r.stdout) == sorted(f"nvidia{HOST.gpus[i].minor}" for i in (1, 2, 6))
    assert len(line(r.stdout, "CAPS:")) == 2  # the MIG device's GI and CI access nodes
    r = run(tmp_path / "all", host, {"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=all"})
    assert gpu_nodes(r.stdout) == sorted(f"nvidia{g.minor}" for g in HOST.gpus)


@needs_runc
@pytest.mark.runc
def test_hook_refuses_another_vendor_and_the_container_does_not_start(tmp_path, fixtures_root):
    from test_e2e_request_rules import run

    r = run(tmp_path / "c", fixtures_root / "host-gpu8", {"NVIDIA_VISIBLE_DEVICES": BAD})
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert f"nvhook: {REFUSAL}" in r.proc.stderr
    assert [e["error"] for e in r.events() if e["level"] == "error"][-1] == REFUSAL


# -- nvhook-runtime -----------------------------------------------------------------------------

@needs_runc
@pytest.mark.runc
def test_runtime_wrapper_puts_the_named_gpu_into_config_json(tmp_path, fixtures_root):
    from gpuview import SCRIPT, assert_gpu0
    from test_runtime_wrapper import Box

    box = Box(tmp_path, fixtures_root / "host-gpu8", {"NVIDIA_VISIBLE_DEVICES": f"nvidia.com/gpu={HOST.gpus[0].uuid}"},
              SCRIPT)
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)
    gpu_nodes = [d["path"] for d in box.spec()["linux"]["devices"] if d["path"][11:].isdigit()]
    assert gpu_nodes == [f"/dev/nvidia{HOST.gpus[0].minor}"]


@needs_runc
@pytest.mark.runc
def test_runtime_wrapper_refuses_another_vendor_config_json_untouched(tmp_path, fixtures_root):
    from test_runtime_wrapper import Box

    box = Box(tmp_path, fixtures_root / "host-gpu8", {"NVIDIA_VISIBLE_DEVICES": BAD}, "touch /started")
    p = box.run()
    assert p.returncode == 1 and p.stderr == f"nvhook-runtime: {REFUSAL}\n"
    assert (box.bundle / "config.json").read_bytes() == box.original and not (box.rootfs / "started").exists()


# -- the NRI plugin, through tests/test_nri_plugin.py's fake runtime ----------------------------

@pytest.fixture
def nri(tmp_path, fixtures_root):
    pytest.importorskip("grpc_tools")
    from test_nri_plugin import serve

    yield from serve(tmp_path, fixtures_root / "host-gpu8")


def test_nri_adjustment_gives_the_named_gpus(nri):
    from test_nri_plugin import container, create

    rt, _log = nri
    g4, g7 = HOST.gpus[4], HOST.gpus[7]
    code, msg, resp = create(rt, container("c1", [f"NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=4,{g7.uuid}"]))
    assert code == 0, msg
    gpus = sorted(d.path for d in resp.adjust.linux.devices if d.path[11:].isdigit())
    assert gpus == sorted(f"/dev/nvidia{g.minor}" for g in (g4, g7))


def test_nri_refuses_another_vendor_in_one_line(nri):
    """The engine's error for the container (what `kubectl describe pod` shows) is the line."""
    from test_nri_plugin import container, create

    rt, _log = nri
    code, msg, _resp = create(rt, container("c1", [f"NVIDIA_VISIBLE_DEVICES={BAD}"]))
    assert code != 0 and REFUSAL in msg and "\n" not in msg
