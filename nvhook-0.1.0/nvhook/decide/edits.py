"""Container edits: the one description of what nvhook changes in a container, whichever way
it is delivered.

Three delivery modes share it, so they cannot disagree:
  - hook mode applies the plan's mounts, device nodes and symlinks itself (apply/);
  - CDI writes the same edits into a spec, and the runtime applies the device nodes, mounts
    and cgroup rules while nvhook's createContainer hook does the in-container part;
  - the runtime wrapper writes them into the bundle's config.json before `create`.

`from_plan` is the only producer. Pure: it reads nothing and changes nothing.

Shape (plain dicts and lists, JSON- and marshal-ready):

    {"env": ["KEY=VALUE"],
     "device_nodes": [{"path", "host_path", "type": "c", "major", "minor",
                       "file_mode", "uid", "gid", "permissions": "rw"}],
     "mounts": [{"kind", "host_path", "container_path", "options"}],   # read-only binds
     "symlinks": [{"path", "target"}],
     "cgroup_devices": [{"allow": True, "type": "c", "major", "minor", "access": "rw"}],
     "in_container": {"ldcache_directories": [container-path],
                      "procfs": bool,            # /proc/driver/nvidia for the selected GPUs
                      "gpu_bus_ids": [str],
                      "compat": {"decision", "reason", "libraries"}}}

Device nodes and cgroup rules carry the host's numbers as observed this run; a runtime that
creates the node from them (CDI, config.json `linux.devices`) needs no bind of /dev.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Mapping

    from .types import Plan

# Mount kinds that are read-only binds of a host (or image) file into the container; the
# others (device, procfs, tmpfs) are made differently in each mode.
BIND_KINDS = ("library", "library32", "binary", "firmware", "ipc", "compat")


# Bind options as OCI runtimes spell them (runc, crun and the CDI spec all take these).
def bind_options(options: list[str]) -> list[str]:
    opts = [o for o in options if o in ("ro", "rw", "nosuid", "nodev", "noexec")]
    return opts + ["bind"] if "bind" not in opts else opts


def from_plan(plan: Plan, env: tuple[str, ...] = ()) -> dict:
    """The container edits that the plan describes. `env` adds variables (CDI sets
    NVIDIA_VISIBLE_DEVICES=void so that a legacy hook beside it injects nothing twice)."""
    nodes, mounts = [], []
    procfs = False
    for m in plan["mounts"]:
        kind = m["kind"]
        if kind == "device":
            n: Mapping[str, object] = m.get("node") or {}
            nodes.append({"path": m["target"], "host_path": m["source"], "type": "c",
                          "major": n.get("major"), "minor": n.get("minor"),
                          "file_mode": n.get("mode"), "uid": n.get("uid"), "gid": n.get("gid"),
                          "permissions": "rw"})
        elif kind in BIND_KINDS:
            mounts.append({"kind": kind, "host_path": m["source"], "container_path": m["target"],
                           "options": bind_options(m["options"])})
        elif kind in ("procfs", "tmpfs"):
            procfs = True
    rules = [{"allow": True, "type": r["type"], "major": r["major"], "minor": r["minor"],
              "access": r["access"]} for r in plan["devices_cgroup"]]
    ld = plan.get("ldconfig")
    return {
        "env": list(env),
        "device_nodes": nodes,
        "mounts": mounts,
        "symlinks": [dict(s) for s in plan["symlinks"]],
        "cgroup_devices": rules,
        "in_container": {
            "ldcache_directories": list(ld.get("directories") or []) if ld else [],
            "procfs": procfs,
            "gpu_bus_ids": [g["bus_id"] for g in plan["gpus"]],
            "compat": dict(plan["compat"]),
        },
    }


# What the runtime wrapper writes into config.json: the runtime makes these binds itself. Compat
# libraries stay with nvhook's hook: they come from the image, and the hook opens them inside
# the rootfs by fd (RESOLVE_IN_ROOT), where the runtime would follow a path that a second
# container sharing the rootfs could swap for a symlink to a host file between the wrapper's
# decision and the mount.
SPEC_BIND_KINDS = ("library", "library32", "binary", "firmware", "ipc")


def spec_mounts(edits: dict) -> list[dict]:
    """The binds that go into the container spec (see SPEC_BIND_KINDS)."""
    return [m for m in edits["mounts"] if m["kind"] in SPEC_BIND_KINDS]


def in_container_plan(plan: Plan) -> Plan:
    """The part of `plan` left to nvhook's hook when the spec already carries the device nodes,
    their cgroup rules and the binds of `spec_mounts`: compat binds, symlinks,
    /proc/driver/nvidia and ldconfig. Nothing is applied twice."""
    out = plan.copy()
    out["mounts"] = [m for m in plan["mounts"] if m["kind"] != "device" and m["kind"] not in SPEC_BIND_KINDS]
    out["devices_cgroup"] = []
    return out
