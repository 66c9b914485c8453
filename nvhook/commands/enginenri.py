"""`nvhook runtime enable-nri`: NRI turned on in containerd's or CRI-O's config, for `nvhook nri`
(docs/nri.md). containerd's own reading (`config dump`) decides whether NRI is off, and confirms
the edit; the file alone decides where no containerd answers.
"""

from __future__ import annotations

import os
import sys

from ..base.errors import HookError, show
from .configure import DEFAULT_PATHS, SERVICES
from .enginefiles import Change, read_text, write
from .tomledit import get_path, key_text, parse_toml, set_keys, verify

# containerd's NRI plugin table: a version-1 config names plugins by their short id (as
# `containerd config dump` of containerd 1.7 shows it), versions 2 and 3 by their full URI.
NRI_PLUGIN = {1: ("plugins", "nri"), 2: ("plugins", "io.containerd.nri.v1.nri"),
              3: ("plugins", "io.containerd.nri.v1.nri")}
CRIO_NRI_DROPIN = "/etc/crio/crio.conf.d/99-nvhook-nri.conf"
NRI_HEADER = "# Written by `nvhook runtime enable-nri`: NRI on, for nvhook's NRI plugin.\n"


class NoNRI(HookError):
    """The node's containerd has no NRI plugin at all (before 1.7)."""


def containerd_nri_state(path: str) -> bool | None:
    """Whether containerd, reading `path`, runs NRI: its own answer (`containerd config dump`:
    its defaults, which differ between 1.7 and 2.x, the imported files, version 1's short
    names). None where no containerd binary answers here (the file alone decides then)."""
    import subprocess

    from ..base import tomlread

    try:
        r = subprocess.run(["containerd", "--config", path, "config", "dump"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    try:
        dump = tomlread.loads(r.stdout)
    except tomlread.TOMLDecodeError:
        return None
    _check_not_disabled(dump, path)
    table = get_path(dump, NRI_PLUGIN[2])
    if not isinstance(table, dict):
        raise NoNRI("the node's containerd has no NRI plugin (`containerd config dump` shows no "
                    "[plugins.\"io.containerd.nri.v1.nri\"]): NRI needs containerd 1.7 or newer; upgrade "
                    "containerd, or use the runtime class (leave --nri out)")
    return not table.get("disable", False)


def _check_not_disabled(conf: dict, path: str) -> None:
    """`disabled_plugins` naming NRI wins over its `disable = false`: refused, for the operator."""
    names = conf.get("disabled_plugins") or []
    hit = [n for n in names if n in ("io.containerd.nri.v1.nri", "nri")] if isinstance(names, list) else []
    if hit:
        raise HookError(f"{show(path)}: containerd's disabled_plugins names {hit[0]!r}, which turns NRI off whatever "
                        "its table says; nothing written: take it out of disabled_plugins")


def containerd_nri(path: str, enabled: bool | None) -> list[Change]:
    """`disable = false` in containerd's NRI table, where containerd (`enabled`, from
    containerd_nri_state; None: unknown) does not run NRI yet. Set in the main config, under its
    NRI table when it has one, else as a table appended: never in a drop-in, which containerd
    1.7 would merge by replacing the whole table (its socket_path and timeouts with it).
    Without containerd's answer, the file decides: containerd 2.x's version-3 config has NRI on
    unless it says otherwise, 1.7's off."""
    old = read_text(path)
    parsed = parse_toml(old, path) if old is not None else {}
    version = parsed.get("version", 1 if old is not None else 2)
    if version not in NRI_PLUGIN:
        raise HookError(f"{show(path)}: containerd config version {version!r} is not supported (1, 2 or 3); "
                        "nothing written")
    table = NRI_PLUGIN[version]
    _check_not_disabled(parsed, path)
    if enabled is None:
        have = get_path(parsed, table)
        said = have.get("disable") if isinstance(have, dict) else None
        enabled = not said if isinstance(said, bool) else version >= 3
    if enabled:
        return []
    new = set_keys(old or f"version = {version}\n", table, {"disable": "false"})
    verify(new, parsed if old is not None else {"version": version}, [(table, {"disable": False})], path)
    return [Change(path, old, new, f"[{'.'.join(key_text(k) for k in table)}] disable = false (NRI on)")]


def crio_nri(path: str = CRIO_NRI_DROPIN) -> list[Change]:
    """CRI-O's own drop-in: `[crio.nri] enable_nri = true` (CRI-O merges drop-ins key by key;
    on by default since 1.30, said anyway for older ones)."""
    text = NRI_HEADER + "[crio.nri]\nenable_nri = true\n"
    old = read_text(path)
    if old is not None:
        parse_toml(old, path)
    return [] if old == text else [Change(path, old, text, "crio.nri.enable_nri = true")]


def enable_nri(engine: str, path: str | None, dry_run: bool, out=None) -> int:
    """`nvhook runtime enable-nri`: NRI on in the engine's config; restarts nothing."""
    out = out or sys.stdout
    if engine == "containerd":
        path = path or DEFAULT_PATHS["containerd"]
        state = containerd_nri_state(path)
        changes = containerd_nri(path, state)
    else:
        path = path or CRIO_NRI_DROPIN
        state, changes = None, crio_nri(path)
    if not changes:
        out.write(f"{engine}: nothing to change: NRI is on with {path}\n")
        return 0
    if dry_run:
        for c in changes:
            out.write(c.diff())
        out.write(f"{engine}: dry run, nothing written\n")
        return 0
    for c in changes:
        target = write(c)
        if engine == "containerd" and state is not None and containerd_nri_state(path) is not True:
            # containerd still reads NRI as off: an imported file says `disable = true` after ours
            write(Change(c.path, c.new, c.old or "", "put back"))
            if c.old is None:
                os.unlink(target)
            raise HookError(f"{show(path)}: containerd still has NRI off after `disable = false` was set there "
                            "(an imported file turns it off?); put back, nothing changed: set "
                            "[plugins.\"io.containerd.nri.v1.nri\"] disable = false where containerd reads it last")
        via = f" (the file {c.path} links to)" if target != c.path else ""
        out.write(f"{engine}: {'updated' if c.old is not None else 'created'} {target}{via}: {c.what}\n")
    out.write(f"{engine}: restart the service to apply (nvhook restarts nothing): "
              f"systemctl restart {SERVICES[engine]}\n")
    return 0
