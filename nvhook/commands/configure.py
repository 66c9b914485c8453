"""`nvhook runtime configure`: register nvhook-runtime with Docker, containerd or CRI-O.

Rules, from what goes wrong with such tools: never restart anything (print what to restart);
change nothing when the setting is already there (and say so); keep the user's comments and
every other setting; write nothing when the existing file does not parse; write each file
atomically (a new file renamed over the old one, its mode kept); say an edit worked only when
the engine itself reads it so; keep what each file was, for `runtime unconfigure`.

- Docker: daemon.json gets `runtimes.nvidia` (or --runtime-name's; and `default-runtime` with --set-as-default).
  JSON has no comments; keys keep their order and the file its indentation. Confirmed by
  `dockerd --validate --config-file`.
- containerd (config version 1, 2 or 3, or none): the shapes and where the runtime goes in each
  are containerdedit's; every edit is checked by parsing the result (the old configuration plus
  exactly nvhook's keys), then by containerd's own `config dump` (engineconfirm).
- CRI-O: its own drop-in, /etc/crio/crio.conf.d/99-nvhook.conf (CRI-O merges drop-ins key by
  key).

On an edit the engine does not accept, every file is put back byte for byte and one line says
what the engine did not accept and what to do.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from ..base.errors import HookError, show
from . import engineconfirm
from .configrecord import ConfigureRecord, default_record, read_bytes
from .containerdedit import CRI_PLUGIN, HEADER, Shape, candidates, changed_besides, holds, wanted
from .enginefiles import Change, read_text, target_of, write
from .tomledit import parse_toml, toml_str

RUNTIME_NAME = "nvidia"
DEFAULT_PATHS = {"docker": "/etc/docker/daemon.json", "containerd": "/etc/containerd/config.toml",
                 "crio": "/etc/crio/crio.conf.d/99-nvhook.conf"}
SERVICES = {"docker": "docker", "containerd": "containerd", "crio": "crio"}


def default_runtime_path() -> str:
    """nvhook-runtime beside the interpreter running nvhook (the same bin directory)."""
    return os.path.join(os.path.dirname(sys.executable), "nvhook-runtime")


# -- Docker -----------------------------------------------------------------------------------

def docker(path: str, runtime_path: str, set_default: bool, name: str = RUNTIME_NAME) -> list[Change]:
    old = read_text(path)
    from ..apply.ocispec import serialize, style

    if old is None or not old.strip():
        data: dict = {}
        how = {"indent": "    ", "separators": (",", ": "), "ensure_ascii": False, "final_newline": True}
    else:
        try:
            data = json.loads(old)
        except ValueError as e:
            raise HookError(f"{show(path)} is not valid JSON ({e}); nothing written") from None
        if not isinstance(data, dict):
            raise HookError(f"{show(path)} is not a JSON object; nothing written")
        how = style(old.encode())
    runtimes = data.get("runtimes")
    if runtimes is None:
        runtimes = data["runtimes"] = {}
    if not isinstance(runtimes, dict):
        raise HookError(f"{show(path)}: \"runtimes\" is not a JSON object; nothing written")
    want = {"path": runtime_path}
    if runtimes.get(name) != want:
        runtimes[name] = want
    if set_default:
        data["default-runtime"] = name
    new = serialize(data, how).decode("utf-8")
    if old is not None and old.strip() and json.loads(old) == data:
        return []
    return [Change(path, old, new, f"runtimes.{name}" + (", default-runtime" if set_default else ""))]


# -- CRI-O -------------------------------------------------------------------------------------

def crio(path: str, runtime_path: str, set_default: bool, name: str = RUNTIME_NAME) -> list[Change]:
    text = (HEADER + f"[crio.runtime.runtimes.{name}]\n"
            f"runtime_path = {toml_str(runtime_path)}\n"
            "runtime_type = \"oci\"\n")
    if set_default:
        text += f"\n[crio.runtime]\ndefault_runtime = \"{name}\"\n"
    old = read_text(path)
    if old is not None:
        parse_toml(old, path)
    if old == text:
        return []
    what = f"crio.runtime.runtimes.{name}" + (", default_runtime" if set_default else "")
    return [Change(path, old, text, what)]


def check_name(name: str) -> str:
    """A runtime name every engine accepts: a Kubernetes RuntimeClass `handler` is a DNS label
    (containerd's runtime and CRI-O's runtime are found by it), Docker's `--runtime` any word."""
    ok = 0 < len(name) <= 63 and all(c.islower() or c.isdigit() or c == "-" for c in name) \
        and name[0] != "-" and name[-1] != "-" and name.isascii()
    if not ok:
        raise HookError(f"runtime name {name!r} must be a DNS label (lowercase letters, digits and '-', at most "
                        "63, not starting or ending with '-'), as a Kubernetes RuntimeClass handler; e.g. nvidia")
    return name




# -- containerd --------------------------------------------------------------------------------

class Plan:
    """What configure will do for one engine: the candidate edits (each [Change] or the HookError
    why it cannot be made), and how to ask the engine (None: nothing to ask here)."""

    def __init__(self, tries: list, confirm=None, why_unconfirmed: str | None = ""):
        self.tries, self.confirm, self.why_unconfirmed = tries, confirm, why_unconfirmed


def containerd(path: str, runtime_path: str, set_default: bool, name: str = RUNTIME_NAME) -> Plan:
    """The candidate edits for containerd, best first, and containerd's own check of each: None
    when containerd already reads the runtime (nothing to change)."""
    node = engineconfirm.containerd_version()
    shape = Shape(path, read_text(path), node)
    dropin_old = read_text(shape.dropin) if shape.version >= 2 or shape.v2x else None
    before, why = _dump_before(shape) if node is not None else (None, "no containerd binary here")
    if node is not None and before is None:
        raise HookError(f"the containerd here cannot read {show(path)} as it is ({why}); nothing written: "
                        "fix the config (or give the one this containerd reads with --config) first")
    if before is not None and engineconfirm.containerd_runtime_missing(before, name, runtime_path, set_default) is None:
        return Plan([])
    if before is None:
        # no containerd's word: the file decides, as it says (the main file, or its drop-in)
        want = wanted(shape.parsed, shape.cri_plugin() or _plugin_for(shape), runtime_path,
                      set_default, name)
        imported = shape.dropin in (shape.parsed.get("imports") or [])
        dropin_parsed = parse_toml(dropin_old, shape.dropin) if dropin_old is not None else {}
        if holds(shape.parsed, want) or (imported and holds(dropin_parsed, _dropin_want(shape, runtime_path,
                                                                                        set_default, name))):
            return Plan([])

    def confirm() -> str | None:
        after, problem = engineconfirm.containerd_dump(path)
        if after is None:
            return f"`containerd config dump` fails: {problem}"
        return (engineconfirm.containerd_runtime_missing(after, name, runtime_path, set_default)
                or changed_besides(before or {}, after, name, set_default))

    tries = candidates(shape, runtime_path, set_default, name, dropin_old)
    if before is None:
        tries = tries[:1]  # unconfirmed: only the edit the file's own shape calls for
    return Plan(tries, confirm if before is not None else None, why)


def _plugin_for(shape: Shape) -> tuple:
    return CRI_PLUGIN[shape.version]


def _dropin_want(shape: Shape, runtime_path: str, set_default: bool, name: str) -> list:
    return wanted({}, _plugin_for(shape), runtime_path, set_default, name)


def _dump_before(shape: Shape) -> tuple[dict | None, str]:
    """containerd's reading of the config as it is (of an empty one where there is none yet)."""
    if shape.old is not None:
        dump, why = engineconfirm.containerd_dump(shape.path)
        return dump, why
    with tempfile.TemporaryDirectory(prefix="nvhook-configure-") as d:
        empty = os.path.join(d, "config.toml")
        open(empty, "w").close()
        dump, why = engineconfirm.containerd_dump(empty)
        return dump, (f"`containerd config dump` fails: {why}" if dump is None else "")


# -- applying, confirming, recording -----------------------------------------------------------

def _docker_plan(path: str, runtime_path: str, set_default: bool, name: str) -> Plan:
    changes = docker(path, runtime_path, set_default, name)
    if not changes:
        return Plan([])
    tries = [("daemon.json", lambda: changes)]
    if not engineconfirm.shutil.which("dockerd"):
        return Plan(tries, None, "no dockerd binary here")
    if changes[0].old is not None and changes[0].old.strip():
        ok, why = engineconfirm.docker_validate(path)
        if ok is False:
            raise HookError(f"the dockerd here does not accept {show(path)} as it is ({why}); nothing written: "
                            "fix the file first (dockerd --validate --config-file FILE)")
    plan = Plan(tries)

    def confirm() -> str | None:
        ok, why = engineconfirm.docker_validate(path)
        if ok is None:  # this dockerd cannot say: the edit stands, unconfirmed
            plan.confirm, plan.why_unconfirmed = None, why
        return why if ok is False else None

    plan.confirm = confirm
    return plan


def put_back(saved: dict) -> None:
    """Each file as it was before this run: its bytes and mode, or no file."""
    for path, was in saved.items():
        if was is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        else:
            write(Change(path, None, was[0].decode("utf-8"), "put back"))


def apply_plan(engine: str, plan: Plan, record: ConfigureRecord | None, out) -> None:
    """Write the first candidate the engine accepts (all of them tried where it answers), record
    what each file was, print what was done; a HookError when none is accepted."""
    problems: list[str] = []
    asked = False
    for how, make in plan.tries:
        try:
            changes = make()
        except HookError as e:
            problems.append(str(e))
            continue
        saved = {target_of(c.path): read_bytes(target_of(c.path)) for c in changes}
        targets = [write(c) for c in changes]
        asked = plan.confirm is not None
        problem = plan.confirm() if asked else None
        if problem:
            put_back(saved)
            problems.append(f"{how}: {problem}")
            continue
        if record is not None:
            for c, t in zip(changes, targets):
                if not record.node_install_owns(c.path) and not record.node_install_owns(t):
                    record.before_write(t, engine, saved[t])
                    record.after_write(t, c.new.encode("utf-8"))
            record.save()
        for c, t in zip(changes, targets):
            via = f" (the file {c.path} links to)" if t != c.path else ""
            out.write(f"{engine}: {'updated' if c.old is not None else 'created'} {t}{via}: {c.what}\n")
        if plan.confirm is not None:
            out.write(f"{engine}: confirmed: {engine} reads it as written (`{_asked(engine)}`)\n")
        elif plan.why_unconfirmed is not None:
            out.write(engineconfirm.unconfirmed_line(engine, path_of(changes), plan.why_unconfirmed))
        return
    if not asked:
        raise HookError(problems[-1])
    raise HookError(f"{engine} does not read the runtime as written ({'; '.join(problems)}); every file put back, "
                    f"nothing changed: check the config with `{_asked(engine)}`, or add the runtime by hand")


def path_of(changes: list) -> str:
    """The engine's own config among the changes (the last: a drop-in is written before it)."""
    return changes[-1].path


def _asked(engine: str) -> str:
    return {"containerd": "containerd config dump", "docker": "dockerd --validate"}.get(engine, engine)


def configure(engine: str, path: str | None, runtime_path: str | None, set_default: bool, dry_run: bool,
              out=None, name: str = RUNTIME_NAME, record_path: str | None = None) -> int:
    out = out or sys.stdout
    path = path or DEFAULT_PATHS[engine]
    runtime_path = runtime_path or default_runtime_path()
    name = check_name(name)
    if engine == "containerd":
        plan = containerd(path, runtime_path, set_default, name)
    elif engine == "docker":
        plan = _docker_plan(path, runtime_path, set_default, name)
    else:
        changes = crio(path, runtime_path, set_default, name)
        plan = Plan([("drop-in", lambda: changes)] if changes else [], None, None)
    from .leftovers import for_engine, warn

    warn(for_engine(engine, path, name))  # NVIDIA's leftovers this registration still meets
    if not plan.tries:
        out.write(f"{engine}: nothing to change: {path} already registers {name} ({runtime_path})\n")
        return 0
    if dry_run:
        changes = plan.tries[0][1]()
        for c in changes:
            out.write(c.diff())
        out.write(f"{engine}: dry run, nothing written\n")
        return 0
    apply_plan(engine, plan, ConfigureRecord(record_path or default_record()), out)
    out.write(f"{engine}: restart the service to apply (nvhook restarts nothing): "
              f"systemctl restart {SERVICES[engine]}\n")
    return 0
