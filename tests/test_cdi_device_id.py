"""`nvhook cdi generate --device-id ID... --no-all-device`, as nvidia-ctk 1.19 has them: a spec
with only the devices named (by index, UUID, <gpu>:<mig> or MIG UUID; repeatable and comma
lists), an `all` device with only their nodes, none with --no-all-device, and `none`: one device
`none` that gives no GPU. On the fixture hosts (tests/fixtures/rootfs)."""

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

GPUS = mf.HOSTS["host-gpu8"].gpus


def nvhook(*args: str, config: Path, root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run([str(rb.NVHOOK_BIN), "--config", str(config), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                  cache_dir=tmp_path / "cache")


def names(spec: dict) -> list[str]:
    return [d["name"] for d in spec["devices"]]


def generate(cfg: Path, host: Path, *args: str) -> tuple[dict, str]:
    p = nvhook("cdi", "generate", *args, config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def nodes(spec: dict, name: str) -> list[str]:
    d = next(d for d in spec["devices"] if d["name"] == name)
    return [n["path"] for n in d["containerEdits"]["deviceNodes"]]


def test_device_ids_give_only_those_devices_and_an_all_of_them(cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    g0, g5 = GPUS[0], GPUS[5]
    mig = g0.migs[1]
    spec, _ = generate(cfg, host, "--device-id", "5", "--device-id", f"{g0.uuid.lower()},{mig.uuid}")
    assert names(spec) == ["0", g0.uuid, f"0:{mig.slot}", mig.uuid, "5", g5.uuid, "all"]
    assert nodes(spec, "5") == [f"/dev/nvidia{g5.minor}"]
    mig_nodes = nodes(spec, mig.uuid)
    assert mig_nodes[0] == f"/dev/nvidia{g0.minor}" and len(mig_nodes) == 3
    # `all`: the union of the chosen devices' nodes, not every GPU of the host
    assert sorted(nodes(spec, "all")) == sorted({f"/dev/nvidia{g0.minor}", f"/dev/nvidia{g5.minor}", *mig_nodes})
    full, _ = generate(cfg, host)
    assert spec["containerEdits"] == full["containerEdits"]  # the spec-wide edits do not change


def test_a_mig_index_and_the_type_index_names(cfg, fixtures_root):
    g1 = GPUS[1]
    m = g1.migs[0]
    spec, _ = generate(cfg, fixtures_root / "host-gpu8", "--device-id", f"1:{m.slot}",
                       "--device-name-strategy", "type-index", "--no-all-device")
    assert names(spec) == [f"mig1:{m.slot}"]


def test_no_all_device_keeps_every_device_but_all(cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    spec, _ = generate(cfg, host, "--no-all-device")
    full, _ = generate(cfg, host)
    assert names(spec) == names(full)[:-1] and names(full)[-1] == "all"


def test_all_among_the_ids_is_every_device(cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    spec, _ = generate(cfg, host, "--device-id", "3,all")
    full, _ = generate(cfg, host)
    assert spec == full


def test_none_is_one_device_without_a_gpu(cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    spec, _ = generate(cfg, host, "--device-id", "none")
    assert names(spec) == ["none"]
    assert spec["devices"][0]["containerEdits"] == {"env": ["NVHOOK_CDI_NO_GPU="]}
    full, _ = generate(cfg, host)
    assert spec["containerEdits"] == full["containerEdits"]


@pytest.mark.parametrize("ident", ["8", "GPU-nope", "0:9", "x"])
def test_an_id_that_names_no_device_is_one_line(cfg, fixtures_root, ident):
    p = nvhook("cdi", "generate", "--device-id", ident, config=cfg, root=fixtures_root / "host-gpu8")
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1] == (
        f"nvhook: --device-id {ident!r} names no device on this host (GPU indexes 0-7, GPU or MIG UUIDs, "
        "<gpu>:<mig>)")


def test_the_management_spec_takes_no_device_ids(cfg, fixtures_root):
    p = nvhook("cdi", "generate", "--mode", "management", "--device-id", "0", config=cfg,
               root=fixtures_root / "host-gpu8")
    assert p.returncode == 2 and "--device-id and --no-all-device are for the GPU spec" in p.stderr
