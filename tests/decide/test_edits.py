"""decide.edits.from_plan: the container edits that hook mode, CDI and the runtime wrapper all
deliver, derived from one real plan on the 8-GPU fixture host."""

from __future__ import annotations

from hostfix import bundle, config_dict, fx, private_dir  # noqa: F401

from nvhook.base.log import EventLog
from nvhook.decide import edits
from nvhook.decide.sources import Host, OciBundle
from nvhook.start import pipeline


def _plan(fx, tmp_path, *env):
    b = bundle(tmp_path / "b", fx / "container-debian", env)
    state = {"id": "c", "pid": None, "bundle": str(b), "annotations": {}}
    cfg = config_dict(private_dir(tmp_path / "cache"))
    return pipeline.decide(OciBundle.from_state(state), Host(str(fx / "host-gpu8"), cfg, EventLog("error"))).plan


def test_edits_carry_every_planned_node_bind_link_and_rule(fx, tmp_path):
    plan = _plan(fx, tmp_path, "NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    e = edits.from_plan(plan, env=("NVIDIA_VISIBLE_DEVICES=void",))
    devices = [m for m in plan["mounts"] if m["kind"] == "device"]
    assert [n["path"] for n in e["device_nodes"]] == [m["target"] for m in devices]
    assert "/dev/nvidia1" in {n["path"] for n in e["device_nodes"]}
    assert "/dev/nvidia0" not in {n["path"] for n in e["device_nodes"]}
    assert all(n["major"] == m["node"]["major"] and n["minor"] == m["node"]["minor"]
               for n, m in zip(e["device_nodes"], devices))
    binds = [m for m in plan["mounts"] if m["kind"] in edits.BIND_KINDS]
    assert [(m["host_path"], m["container_path"]) for m in e["mounts"]] == [(m["source"], m["target"]) for m in binds]
    assert all("bind" in m["options"] and "ro" in m["options"] for m in e["mounts"] if m["kind"] != "ipc")
    assert e["symlinks"] == plan["symlinks"]
    assert {(r["major"], r["minor"]) for r in e["cgroup_devices"]} == \
        {(r["major"], r["minor"]) for r in plan["devices_cgroup"]}
    assert e["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert e["in_container"]["gpu_bus_ids"] == [g["bus_id"] for g in plan["gpus"]]
    assert e["in_container"]["ldcache_directories"] == ["/usr/lib/x86_64-linux-gnu"]
    assert e["in_container"]["procfs"] is True


def test_no_gpu_request_gives_no_edits(fx, tmp_path):
    e = edits.from_plan(_plan(fx, tmp_path))
    assert e["device_nodes"] == e["mounts"] == e["symlinks"] == e["cgroup_devices"] == []
    assert e["in_container"]["procfs"] is False
