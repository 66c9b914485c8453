"""Apply a CDI spec's edits for named devices to an OCI config.json, as a CDI-aware engine
(podman, containerd, Docker) does before it runs the runtime. Used where no such engine exists:
the GPU machine of tests/device/real_gpu_cdi.sh has runc but no podman or containerd.

    python3 cdi_apply.py SPEC CONFIG_JSON DEVICE [DEVICE ...]

DEVICE is the spec's device name (`0`, `all`, `GPU-...`). Follows the CDI spec's rules: the
spec-wide edits then each device's; env entries replace a variable of the same name; a device
node without major/minor takes them from its host path; each node gets a cgroup allow rule."""

from __future__ import annotations

import json
import os
import stat
import sys


def _node(dn: dict) -> tuple[dict, dict]:
    host = dn.get("hostPath") or dn["path"]
    major, minor, kind = dn.get("major"), dn.get("minor"), dn.get("type")
    if major is None or minor is None or kind is None:
        st = os.stat(host)
        major = os.major(st.st_rdev) if major is None else major
        minor = os.minor(st.st_rdev) if minor is None else minor
        kind = kind or ("b" if stat.S_ISBLK(st.st_mode) else "c")
    dev = {"path": dn["path"], "type": kind, "major": major, "minor": minor}
    for k in ("fileMode", "uid", "gid"):
        if k in dn:
            dev[k] = dn[k]
    rule = {"allow": True, "type": kind, "major": major, "minor": minor, "access": dn.get("permissions") or "rwm"}
    return dev, rule


def apply(spec: dict, config: dict, names: list[str]) -> None:
    by_name = {d["name"]: d for d in spec.get("devices", [])}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"cdi_apply: {', '.join(missing)} not in the spec (it has {', '.join(sorted(by_name))})")
    edits = [spec.get("containerEdits") or {}] + [by_name[n].get("containerEdits") or {} for n in names]
    proc = config.setdefault("process", {})
    linux = config.setdefault("linux", {})
    for e in edits:
        for var in e.get("env") or []:
            key = var.split("=", 1)[0]
            proc["env"] = [v for v in proc.get("env", []) if v.split("=", 1)[0] != key] + [var]
        for dn in e.get("deviceNodes") or []:
            dev, rule = _node(dn)
            linux.setdefault("devices", []).append(dev)
            linux.setdefault("resources", {}).setdefault("devices", []).append(rule)
        for m in e.get("mounts") or []:
            entry = {"destination": m["containerPath"], "source": m["hostPath"], "options": m.get("options", [])}
            if m.get("type"):
                entry["type"] = m["type"]
            config.setdefault("mounts", []).append(entry)
        for h in e.get("hooks") or []:
            entry = {k: h[k] for k in ("path", "args", "env", "timeout") if k in h}
            config.setdefault("hooks", {}).setdefault(h["hookName"], []).append(entry)
        if e.get("additionalGids"):
            user = proc.setdefault("user", {})
            user["additionalGids"] = sorted(set(user.get("additionalGids", [])) | set(e["additionalGids"]))


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    spec_path, config_path, names = argv[0], argv[1], argv[2:]
    with open(spec_path) as f:
        text = f.read()
    try:
        spec = json.loads(text)
    except ValueError:
        import yaml  # nvidia-ctk writes YAML unless told otherwise: generate with --format json

        spec = yaml.safe_load(text)
    with open(config_path) as f:
        config = json.load(f)
    apply(spec, config, names)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
