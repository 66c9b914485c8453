"""Human-readable text for plans, host info and the host listing (JSON is the data as is)."""

from __future__ import annotations

import json


def to_json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


def _table(rows: list[list[object]], header: list[str]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(header[i]), *(len(str(r[i])) for r in rows)) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))] + \
        [fmt.format(*map(str, r)).rstrip() for r in rows]


def plan_text(plan: dict, root: str = "/") -> str:
    """The plan for a person at a terminal, about 100 columns wide: mounts in their order, in
    runs of the same kind and options (one header for the run), each from the same path under
    the host root `root` unless "<-" names its source."""
    c, r, d = plan["container"], plan["request"], plan["driver"]
    out = [f"nvhook plan for container {c['id'] or '?'} (pid {c['pid'] if c['pid'] is not None else '-'})",
           f"  rootfs:       {c['rootfs']}",
           f"  devices:      {', '.join(r['devices']) or '-'}",
           f"  capabilities: {', '.join(r['capabilities']) or '-'}",
           f"  requirements: {'; '.join(r['requirements']) or '-'}",
           f"  host driver:  {d['version'] or 'unknown'} (CUDA {d['cuda'] or 'unknown'})",
           f"  host root:    {root}"]
    if not plan["mounts"] and not plan["symlinks"]:
        out += ["", f"Nothing to inject: {plan['compat']['reason']}"]
        return "\n".join(out) + "\n"
    out += ["", "GPUs:"]
    out += _table([[g["index"], g["minor"], g["bus_id"], g["model"], _brand(g), g["uuid"]] for g in plan["gpus"]],
                  ["index", "minor", "bus", "model", "brand", "uuid"])
    if any(g.get("brand_source") == "guessed" for g in plan["gpus"]):
        out.append("  * brand guessed from the model name (NVML was not asked)")
    out += ["", f"Mounts ({len(plan['mounts'])}), each from the same path under the host root unless <- names "
                "its source:"]
    out += _mount_lines(plan["mounts"], root)
    out += ["", f"Symlinks ({len(plan['symlinks'])}):"]
    out += _table([[s["path"], s["target"]] for s in plan["symlinks"]], ["path", "-> target"])
    cg = plan.get("cgroup")
    out += ["", f"Device cgroup rules (cgroup {cg['mode']}):" if cg else "Device cgroup rules:"]
    out += _table([[f"{x['type']} {x['major']}:{x['minor']} {x['access']}"] for x in plan["devices_cgroup"]], ["rule"])
    if cg:
        import textwrap

        out += textwrap.wrap(f"nvhook {cg['action']}", width=98, initial_indent="  ", subsequent_indent="    ")
    cp = plan["compat"]
    out += ["", f"Forward compat: {cp['decision']} - {cp['reason']}"]
    for lib in cp["libraries"]:
        out.append(f"  uses {lib}")
    ld = plan["ldconfig"]
    if not ld:
        out += ["", "ldconfig: not run (no libraries)"]
    elif ld["binary"] in ("", "builtin"):
        out += ["", "ldconfig: builtin (nvhook writes /etc/ld.so.cache, no program runs) on "
                    + ", ".join(ld["directories"])]
    else:
        out += ["", f"ldconfig: {ld['binary']} on {', '.join(ld['directories'])}"]
    return "\n".join(out) + "\n"


def _brand(g: dict) -> str:
    if g.get("brand_source") == "guessed":
        return f"{g['brand']}*"
    return g["brand"] or "?"


def _mount_lines(mounts: list[dict], root: str) -> list[str]:
    if not mounts:
        return ["  (none)"]
    out: list[str] = []
    run = None
    prefix = root.rstrip("/")
    for m in mounts:
        opts = ",".join(m["options"])
        if (m["kind"], opts) != run:
            run = (m["kind"], opts)
            out.append(f"  {m['kind']:<9} {opts}")
        extra = _node(m)
        src = m["source"]
        if src != prefix + m["target"]:
            extra += f"  <- {src[len(prefix):] if prefix and src.startswith(prefix + '/') else src}"
        out.append(f"            {m['target']}{extra}")
    return out


def _node(m: dict) -> str:
    n = m.get("node")
    return f"  (node c {n['major']}:{n['minor']} {n['mode']:04o} {n['uid']}:{n['gid']})" if n else ""


def info_text(info: dict) -> str:
    d = info["driver"]
    out = [f"Driver version: {d['version']} (from {d['source']})",
           f"CUDA version:   {d['cuda'] or 'unknown'} (from {d['cuda_source'] or '-'})",
           f"GPU facts from: {info['gpu_source']}" + (f" ({info['nvml_note']})" if info.get("nvml_note") else ""),
           ""]
    out += _table([[g["index"], g["minor"], g["model"], g["brand"] or "?", g["uuid"], g["bus_id"], g["cc"] or "?",
                     {True: "enabled", False: "disabled", None: "?"}[g["mig_mode"]], len(g.get("migs", [])),
                     g["source"]]
                   for g in info["gpus"]],
                  ["index", "minor", "model", "brand", "uuid", "bus", "cc", "mig", "migs", "source"])
    da = info.get("device_access")
    if da:
        out += ["", f"Device access:  {da['mode_text']}", f"  nvhook {da['action']}"]
    return "\n".join(out) + "\n"


def list_text(items: list[dict]) -> str:
    rows = [[i["capability"], i["kind"], i["container_path"], i["host_path"],
             f"c {i['major']}:{i['minor']}" if i["major"] is not None else ""] for i in items]
    return "\n".join(_table(rows, ["capability", "kind", "container path", "host path", "device"])) + "\n"
