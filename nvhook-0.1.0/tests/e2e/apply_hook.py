"""A prestart hook for the apply tests: applies a prepared plan to the container being started.

    <python> apply_hook.py PLAN.json [--log EVENTS.jsonl] [--ldconfig-timeout S]
                                     [--cgroup-out FILE] [--result-out FILE]

Reads the OCI state from stdin, loads the plan, fills in the container's pid and rootfs (from
the bundle's config.json root.path), calls nvhook.apply.apply_plan, and exits 1 with one
"nvhook: <reason>" line on stderr when it raises HookError (what runc shows the user).
--cgroup-out writes the container's v1 devices.list after apply (to check the rules; empty in v2);
--result-out writes apply_plan's summary as JSON.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from nvhook.apply import apply_plan  # noqa: E402
from nvhook.base.errors import HookError  # noqa: E402
from nvhook.base.log import EventLog, stderr_line  # noqa: E402


def _devices_list(pid: int) -> str:
    from nvhook.apply.cgroups import cgroup_mode

    if cgroup_mode() != "v1":  # v2 has no devices.list: its rules are a BPF program
        return ""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "devices" in controllers.split(","):
                with open(f"/sys/fs/cgroup/devices{path}/devices.list") as g:
                    return g.read()
    return ""


def main(argv: list[str]) -> int:
    plan_path = argv[0]
    opts = dict(zip(argv[1::2], argv[2::2]))
    state = json.loads(sys.stdin.read())
    bundle = state.get("bundle") or state.get("bundlePath")
    with open(os.path.join(bundle, "config.json")) as f:
        config = json.load(f)
    root = config["root"]["path"]
    rootfs = os.path.realpath(root if os.path.isabs(root) else os.path.join(bundle, root))
    with open(plan_path) as f:
        plan = json.load(f)
    plan["container"]["pid"] = state["pid"]
    plan["container"]["rootfs"] = rootfs
    plan["container"]["id"] = state.get("id")
    log = EventLog("debug", opts.get("--log"))
    try:
        result = apply_plan(plan, log, ldconfig_timeout=float(opts.get("--ldconfig-timeout", 10)))
        if "--cgroup-out" in opts:
            with open(opts["--cgroup-out"], "w") as f:
                f.write(_devices_list(state["pid"]))
        if "--result-out" in opts:
            with open(opts["--result-out"], "w") as f:
                json.dump(result, f)
    except HookError as e:
        stderr_line(e.message)
        return 1
    finally:
        log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
