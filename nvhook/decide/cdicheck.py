"""Check a CDI spec that is on disk against the host and against what nvhook would write now
(`nvhook cdi check`, nvhookd's spec refresh, doctor): the options it was generated with, read
back from it; the host paths it names; one line per difference; hooks nvhook did not put
there. Pure: the caller reads the files and the host (start/cdispecs.py).

The spec's own shape is decide/cdimodel.py's, which builds it.
"""

from __future__ import annotations

from .cdimodel import CAPS_OPTION, KIND, NO_HOOK_ENV, nvhook_hook


def spec_options(spec: dict) -> dict:
    """The generate options a spec was written with, read back from it: capabilities from its
    hook's arguments, the naming strategies from its device names, its hook path."""
    caps: list[str] = []
    hook_path = None
    for h in (spec.get("containerEdits") or {}).get("hooks") or []:
        args = h.get("args") or []
        if CAPS_OPTION in args and args.index(CAPS_OPTION) + 1 < len(args):
            caps = [c for c in args[args.index(CAPS_OPTION) + 1].split(",") if c]
            hook_path = h.get("path")
    no_hook = False
    if not caps:
        for v in (spec.get("containerEdits") or {}).get("env") or []:
            if isinstance(v, str) and v.startswith(NO_HOOK_ENV + "="):
                caps, no_hook = [c for c in v.split("=", 1)[1].split(",") if c], True
    names = [d.get("name", "") for d in spec.get("devices") or []]
    strategies = []
    if any(n[:1].isdigit() for n in names):
        strategies.append("index")
    if any(n.startswith(("GPU-", "MIG-")) for n in names):
        strategies.append("uuid")
    if any(n.startswith(("gpu", "mig")) and n[3:4].isdigit() for n in names):
        strategies.append("type-index")
    return {"capabilities": caps, "strategies": tuple(strategies), "hook_path": hook_path, "no_hook": no_hook}


def driver_version(spec: dict) -> str | None:
    """The driver version a spec was made for: the version in its libcuda or libnvidia-ml file name."""
    for m in (spec.get("containerEdits") or {}).get("mounts") or []:
        name = str(m.get("containerPath", "")).rsplit("/", 1)[-1]
        for stem in ("libnvidia-ml.so.", "libcuda.so."):
            if name.startswith(stem) and name[len(stem):][:1].isdigit():
                return name[len(stem):]
    return None


def host_paths(spec: dict) -> list[str]:
    """Every host path the spec names: mount sources, device nodes, the hook."""
    out: list[str] = []
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]
    for e in edits:
        for m in e.get("mounts") or []:
            out.append(m.get("hostPath"))
        for n in e.get("deviceNodes") or []:
            out.append(n.get("hostPath") or n.get("path"))
        for h in e.get("hooks") or []:
            out.append(h.get("path"))
    return list(dict.fromkeys(p for p in out if isinstance(p, str)))


def _nodes_by_path(edits: dict) -> dict:
    return {n.get("path"): n for n in edits.get("deviceNodes") or [] if isinstance(n, dict)}


def differences(old: dict, new: dict, missing: list[str], host_driver: str | None = None) -> list[str]:
    """One line per way `old` (a spec file) no longer matches `new` (the spec generated now
    with the same options) or the host (`missing`: host paths it names that are gone;
    `host_driver`: the driver version the host reports, else the one `new` was made for)."""
    out: list[str] = []
    if old.get("kind") != new["kind"]:
        out.append(f"kind: the spec has {old.get('kind')!r}, nvhook writes {new['kind']!r}")
    if old.get("cdiVersion") != new["cdiVersion"]:
        out.append(f"cdiVersion: the spec has {old.get('cdiVersion')!r}, nvhook writes {new['cdiVersion']!r}")
    v_old, v_new = driver_version(old), host_driver or driver_version(new)
    if v_old != v_new:
        out.append(f"driver version: the spec was made for {v_old or 'unknown'}, the host has {v_new or 'unknown'}")
    for p in missing:
        out.append(f"missing on the host: {p}")
    old_devs = {d.get("name"): d for d in old.get("devices") or [] if isinstance(d, dict)}
    new_devs = {d["name"]: d for d in new["devices"]}
    for name in new_devs:
        if name not in old_devs:
            out.append(f"device added on the host: {KIND}={name} is not in the spec")
    for name in old_devs:
        if name not in new_devs:
            out.append(f"device gone from the host: {KIND}={name} is in the spec")
    pairs = [("spec-wide", old.get("containerEdits") or {}, new["containerEdits"])]
    pairs += [(f"{KIND}={n}", old_devs[n].get("containerEdits") or {}, new_devs[n]["containerEdits"])
              for n in new_devs if n in old_devs]
    for where, eo, en in pairs:
        no, nn = _nodes_by_path(eo), _nodes_by_path(en)
        for path in nn:
            if path not in no:
                out.append(f"device node added: {path} ({where}) is not in the spec")
                continue
            a, b = no[path], nn[path]
            if (a.get("major"), a.get("minor")) != (b["major"], b["minor"]):
                out.append(f"device numbers: {path} ({where}) is {a.get('major')}:{a.get('minor')} in the spec, "
                           f"{b['major']}:{b['minor']} on the host")
            elif a != b:
                out.append(f"device node {path} ({where}) differs: the spec has {_short(a)}, the host {_short(b)}")
        for path in no:
            if path not in nn and (no[path].get("hostPath") or path) not in missing:
                out.append(f"device node gone: {path} ({where}) is in the spec, not on the host")
    old_mounts = (old.get("containerEdits") or {}).get("mounts") or []
    mo = {m.get("containerPath"): m for m in old_mounts if isinstance(m, dict)}
    mn = {m["containerPath"]: m for m in new["containerEdits"]["mounts"]}
    for path in mn:
        if path not in mo:
            out.append(f"mount added on the host: {path} ({mn[path]['hostPath']}) is not in the spec")
        elif mo[path] != mn[path]:
            out.append(f"mount {path} differs: the spec has {_short(mo[path])}, now {_short(mn[path])}")
    for path in mo:
        if path not in mn and mo[path].get("hostPath") not in missing:
            out.append(f"mount gone: {path} is in the spec, not on the host")
    # Everything else an edit holds, spec-wide and per device: the hooks above all (path and
    # argv, as nvhook writes them now, never as the file says), env, and anything nvhook never
    # writes (a device's own hook or mount, additionalGIDs).
    for where, eo, en in pairs:
        compared = {"deviceNodes", "mounts"} if where == "spec-wide" else {"deviceNodes"}
        for key in sorted({*eo, *en} - compared, key=str):
            a, b = eo.get(key), en.get(key)
            if a != b and (a or b):
                place = "" if where == "spec-wide" else f" ({where})"
                out.append(f"{key}{place} differ: the spec has {_short(a)}, nvhook writes {_short(b)}")
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def foreign_hooks(spec: dict, hook_path: str, global_args: list[str]) -> list[str]:
    """One line per hook in `spec` (spec-wide or a device's) that is not the one nvhook writes
    for the spec's capabilities with `hook_path` and `global_args`: what a runtime would run
    that nvhook did not put there."""
    opts = spec_options(spec)
    caps = opts["capabilities"]
    if not caps:
        return []  # not nvhook's spec (no nvhook hook at all): not nvhook's to judge
    want = None if opts["no_hook"] else nvhook_hook(caps, hook_path, global_args)
    out = []
    edits = [("spec-wide", spec.get("containerEdits") or {})]
    edits += [(f"{KIND}={d.get('name')}", d.get("containerEdits") or {})
              for d in spec.get("devices") or [] if isinstance(d, dict)]
    for where, e in edits:
        for h in (e.get("hooks") if isinstance(e, dict) else None) or []:
            if want is None:
                path = h.get("path") if isinstance(h, dict) else h
                out.append(f"hook {_short(path)} ({where}) in a spec nvhook wrote without a hook")
            elif where != "spec-wide" or h != want:
                path = h.get("path") if isinstance(h, dict) else h
                out.append(f"hook {_short(path)} ({where}) is not the one nvhook writes ({_short(want['path'])} "
                           f"{_short(' '.join(want['args']))})")
    return out
