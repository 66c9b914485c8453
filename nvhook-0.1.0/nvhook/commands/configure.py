"""`nvhook runtime configure`: register nvhook-runtime with Docker, containerd or CRI-O.

Rules, from what goes wrong with such tools: never restart anything (print what to restart);
change nothing when the setting is already there (and say so); keep the user's comments and
every other setting; write nothing when the existing file does not parse; write each file
atomically (a new file renamed over the old one, its mode kept).

- Docker: daemon.json gets `runtimes.nvidia` (or --runtime-name's; and `default-runtime` with --set-as-default).
  JSON has no comments; keys keep their order and the file its indentation.
- containerd (config version 1, 2 or 3): TOML is never round-tripped through a dumper (that
  drops comments). Where the version has `imports` (2 and 3) the runtime goes into a drop-in,
  conf.d/99-nvhook.toml beside the config, and the config gets one `imports` entry. containerd
  1.x replaces a whole plugin section with an imported file's (checked with containerd 1.6's
  `config dump`), so when the config already configures the CRI plugin, a drop-in would wipe
  those settings: then, as for version 1, the lines are added to the config itself (a table
  appended, or a key inserted under its existing header). Every edit is checked by parsing
  the result: it must equal the old configuration plus exactly nvhook's keys.
- CRI-O: its own drop-in, /etc/crio/crio.conf.d/99-nvhook.conf (CRI-O merges drop-ins key by
  key).
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import sys

from ..base.errors import HookError, show
from ..base.rootpath import kind_name

RUNTIME_NAME = "nvidia"
DEFAULT_PATHS = {"docker": "/etc/docker/daemon.json", "containerd": "/etc/containerd/config.toml",
                 "crio": "/etc/crio/crio.conf.d/99-nvhook.conf"}
SERVICES = {"docker": "docker", "containerd": "containerd", "crio": "crio"}
CRI_PLUGIN = {1: ("plugins", "cri"), 2: ("plugins", "io.containerd.grpc.v1.cri"),
              3: ("plugins", "io.containerd.cri.v1.runtime")}
DROPIN_NAME = "99-nvhook.toml"
HEADER = "# Written by `nvhook runtime configure`: nvhook-runtime as an OCI runtime.\n"


def default_runtime_path() -> str:
    """nvhook-runtime beside the interpreter running nvhook (the same bin directory)."""
    return os.path.join(os.path.dirname(sys.executable), "nvhook-runtime")


class Change:
    """One file to write: its path, old text (None: new file) and new text."""

    def __init__(self, path: str, old: str | None, new: str, what: str):
        self.path, self.old, self.new, self.what = path, old, new, what

    def diff(self) -> str:
        a = (self.old or "").splitlines(keepends=True)
        b = self.new.splitlines(keepends=True)
        return "".join(difflib.unified_diff(a, b, fromfile=self.path if self.old is not None else "/dev/null",
                                            tofile=self.path))


def _read(path: str) -> str | None:
    """The file's text, None when there is none. Opened non-blocking and checked on the open
    file: a FIFO, a device or a directory there is refused, never read (a FIFO would hang)."""
    _target(path)  # a dangling or looping link is refused, not taken for "no file yet"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}; nothing written") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise HookError(f"{show(path)} is a {kind_name(mode)}, not a regular file; nothing written: "
                        "give the engine's config file (--config)")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise HookError(f"{show(path)} is not UTF-8 text ({e.reason} at byte {e.start}); "
                            "nothing written") from None
        except OSError as e:
            raise HookError(f"cannot read {show(path)}: {e.strerror}; nothing written") from None


def _target(path: str) -> str:
    """The file to write for `path`: itself, or the file its symbolic links finally name (an
    engine config kept elsewhere, linked from /etc, must get the runtime, the link stay a
    link). A link to nothing, or a loop, is refused."""
    if not os.path.islink(path):
        return path  # links among its directories are fine: the file is replaced in the one they name
    real = os.path.realpath(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise HookError(f"{show(path)} is a symbolic link to {show(real)}, which does not exist; nothing written: "
                        "create that file (it may be empty) or give the real file with --config") from None
    except OSError as e:
        raise HookError(f"cannot follow the symbolic link {show(path)}: {e.strerror}; nothing written") from None
    return real


# -- Docker -----------------------------------------------------------------------------------

def docker(path: str, runtime_path: str, set_default: bool, name: str = RUNTIME_NAME) -> list[Change]:
    old = _read(path)
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
            f"runtime_path = {_toml_str(runtime_path)}\n"
            "runtime_type = \"oci\"\n")
    if set_default:
        text += f"\n[crio.runtime]\ndefault_runtime = \"{name}\"\n"
    old = _read(path)
    if old is not None:
        _parse_toml(old, path)
    if old == text:
        return []
    what = f"crio.runtime.runtimes.{name}" + (", default_runtime" if set_default else "")
    return [Change(path, old, text, what)]


# -- containerd --------------------------------------------------------------------------------

def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a TOML basic string for any path


def _parse_toml(text: str, path: str) -> dict:
    from ..base import tomlread

    try:
        return tomlread.loads(text)
    except tomlread.TOMLDecodeError as e:
        raise HookError(f"{show(path)} is not valid TOML ({e}); nothing written") from None


def _key_text(k: str) -> str:
    bare = k and all(c.isalnum() or c in "-_" for c in k)
    return k if bare else _toml_str(k)


def _header_path(line: str) -> tuple | None:
    """The key path of a `[a."b.c".d]` header line (not an array of tables), else None."""
    s = line.strip()
    if not s.startswith("[") or s.startswith("[["):
        return None
    end = -1
    quote = None
    for i, c in enumerate(s):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "]":
            end = i
            break
    if end < 0:
        return None
    parts, cur, quote = [], "", None
    for c in s[1:end]:
        if quote:
            if c == quote:
                quote = None
            else:
                cur += c
        elif c in "\"'":
            quote = c
        elif c == ".":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    parts.append(cur.strip())
    return tuple(parts)


def _set_keys(text: str, table: tuple, values: dict) -> str:
    """`text` with `values` set in `table`: each key's line replaced or inserted under the
    table's header, or a new table appended. The caller verifies the result by parsing it."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    start = next((i for i, ln in enumerate(lines) if _header_path(ln) == table), None)
    if start is None:
        block = "\n[" + ".".join(_key_text(k) for k in table) + "]\n"
        block += "".join(f"  {_key_text(k)} = {v}\n" for k, v in values.items())
        return "".join(lines) + block
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    for key, value in values.items():
        for i in range(start + 1, end):
            name = lines[i].split("=", 1)[0].strip().strip("\"'") if "=" in lines[i] else None
            if name == key and not lines[i].lstrip().startswith("#"):
                indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
                lines[i] = f"{indent}{_key_text(key)} = {value}\n"
                break
        else:
            body = [ln for ln in lines[start + 1:end] if ln.strip() and not ln.lstrip().startswith("#")]
            head = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
            indent = body[0][:len(body[0]) - len(body[0].lstrip())] if body else head + "  "
            lines.insert(start + 1, f"{indent}{_key_text(key)} = {value}\n")
            end += 1
    return "".join(lines)


def _set_imports(text: str, parsed: dict, dropin: str) -> str:
    """`text` with `dropin` added to its top-level `imports` (a new key after `version`)."""
    lines = text.splitlines(keepends=True)
    first_table = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")), len(lines))
    current = parsed.get("imports")
    if current is None:
        at = next((i + 1 for i in range(first_table) if lines[i].split("=", 1)[0].strip() == "version"), 0)
        lines.insert(at, f"imports = [{_toml_str(dropin)}]\n")
        return "".join(lines)
    if not isinstance(current, list):
        raise HookError("`imports` in the containerd config is not a list; nothing written")
    start = next((i for i in range(first_table) if lines[i].split("=", 1)[0].strip() == "imports"), None)
    if start is None:
        raise HookError("cannot find the `imports` line of the containerd config; add "
                        f"{_toml_str(dropin)} to it by hand")
    end = start
    while "]" not in lines[end].split("#", 1)[0] and end + 1 < first_table:
        end += 1
    items = ", ".join(_toml_str(x) for x in [*current, dropin])
    lines[start:end + 1] = [f"imports = [{items}]\n"]
    return "".join(lines)


def _deep_set(d: dict, table: tuple, values: dict) -> None:
    for k in table:
        d = d.setdefault(k, {})
    d.update(values)


def _get(d: dict, table: tuple):
    for k in table:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def containerd(path: str, runtime_path: str, set_default: bool, name: str = RUNTIME_NAME) -> list[Change]:
    old = _read(path)
    parsed = _parse_toml(old, path) if old is not None else {}
    version = parsed.get("version", 1 if old is not None else 2)
    if version not in CRI_PLUGIN:
        raise HookError(f"{show(path)}: containerd config version {version!r} is not supported (1, 2 or 3); "
                        "nothing written")
    plugin = CRI_PLUGIN[version]
    runtimes = (*plugin, "containerd", "runtimes", name)
    wanted = [(runtimes, {"runtime_type": "io.containerd.runc.v2"}),
              ((*runtimes, "options"), {"BinaryName": runtime_path})]
    if set_default:
        wanted.append(((*plugin, "containerd"), {"default_runtime_name": name}))
    if _get(parsed, (*plugin, "containerd", "runtimes")) is None:
        # A `runtimes` table replaces containerd's built-in one (containerd 1.6's `config dump`
        # shows runc gone), and the default runtime "runc" with it: every other pod would then
        # fail. Written beside ours, as containerd's default has it.
        wanted.insert(0, ((*plugin, "containerd", "runtimes", "runc"), {"runtime_type": "io.containerd.runc.v2"}))
    wanted_toml = [(t, {k: _toml_str(v) for k, v in vals.items()}) for t, vals in wanted]

    dropin = os.path.join(os.path.dirname(os.path.abspath(path)), "conf.d", DROPIN_NAME)
    dropin_old = _read(dropin) if version >= 2 else None
    dropin_parsed = _parse_toml(dropin_old, dropin) if dropin_old is not None else {}
    imported = dropin in (parsed.get("imports") or [])

    def holds(conf: dict) -> bool:
        return all(_get(conf, t) is not None and all(_get(conf, t).get(k) == v for k, v in vals.items())
                   for t, vals in wanted)

    if holds(parsed) or (imported and holds(dropin_parsed)):
        return []

    # A drop-in only where containerd's imports merge cannot wipe the user's plugin settings.
    use_dropin = version >= 2 and _get(parsed, plugin) is None
    changes = []
    if use_dropin:
        text = HEADER + f"version = {version}\n"
        for table, vals in wanted_toml:
            text = _set_keys(text, table, vals)
        check = _parse_toml(text, dropin)
        expect: dict = {"version": version}
        for table, vals in wanted:
            _deep_set(expect, table, vals)
        if check != expect:  # pragma: no cover - our own text
            raise HookError("internal error: the containerd drop-in does not parse to what was meant")
        if dropin_old != text:
            changes.append(Change(dropin, dropin_old, text, f"{'.'.join(runtimes)} (drop-in)"))
        if not imported:
            new_main = _set_imports(old or f"version = {version}\n", parsed, dropin)
            _verify(new_main, parsed if old is not None else {"version": version}, [], path, extra_import=dropin)
            changes.append(Change(path, old, new_main, f"imports += {dropin}"))
        return changes
    new_main = old or f"version = {version}\n"
    for table, vals in wanted_toml:
        new_main = _set_keys(new_main, table, vals)
    _verify(new_main, parsed, wanted, path)
    return [Change(path, old, new_main, ".".join(runtimes) + (", default_runtime_name" if set_default else ""))]


# -- NRI -----------------------------------------------------------------------------------------

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
    table = _get(dump, NRI_PLUGIN[2])
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
    old = _read(path)
    parsed = _parse_toml(old, path) if old is not None else {}
    version = parsed.get("version", 1 if old is not None else 2)
    if version not in NRI_PLUGIN:
        raise HookError(f"{show(path)}: containerd config version {version!r} is not supported (1, 2 or 3); "
                        "nothing written")
    table = NRI_PLUGIN[version]
    _check_not_disabled(parsed, path)
    if enabled is None:
        have = _get(parsed, table)
        said = have.get("disable") if isinstance(have, dict) else None
        enabled = not said if isinstance(said, bool) else version >= 3
    if enabled:
        return []
    new = _set_keys(old or f"version = {version}\n", table, {"disable": "false"})
    _verify(new, parsed if old is not None else {"version": version}, [(table, {"disable": False})], path)
    return [Change(path, old, new, f"[{'.'.join(_key_text(k) for k in table)}] disable = false (NRI on)")]


def crio_nri(path: str = CRIO_NRI_DROPIN) -> list[Change]:
    """CRI-O's own drop-in: `[crio.nri] enable_nri = true` (CRI-O merges drop-ins key by key;
    on by default since 1.30, said anyway for older ones)."""
    text = NRI_HEADER + "[crio.nri]\nenable_nri = true\n"
    old = _read(path)
    if old is not None:
        _parse_toml(old, path)
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


def _verify(text: str, before: dict, wanted: list, path: str, extra_import: str | None = None) -> None:
    """The edited config must parse to the old one plus exactly what nvhook sets."""
    from ..base import tomlread

    expect = json.loads(json.dumps(before))
    for table, vals in wanted:
        _deep_set(expect, table, vals)
    if extra_import:
        expect["imports"] = [*expect.get("imports", []), extra_import]
    try:
        ok = tomlread.loads(text) == expect
    except tomlread.TOMLDecodeError:
        ok = False
    if not ok:
        lines = "; ".join(f"[{'.'.join(_key_text(k) for k in t)}] "
                          + ", ".join(f"{k} = {_toml_str(v)}" for k, v in vals.items())
                          for t, vals in wanted) or f"imports += {_toml_str(extra_import or '')}"
        raise HookError(f"cannot edit {show(path)} safely (its layout is unusual); nothing written; "
                        f"add by hand: {lines}")


# -- writing -------------------------------------------------------------------------------------

def write(change: Change) -> str:
    """Atomically (base.files.replace_file: a temp file in the same directory, renamed over the
    target), through symbolic links to the file they name (returned), the old file's mode,
    owner and group kept (a root:docker 0640 daemon.json stays so)."""
    from ..base.files import replace_file

    target = _target(change.path)
    directory = os.path.dirname(os.path.abspath(target))
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        owner = None
        try:
            st = os.stat(target)
        except FileNotFoundError:
            mode = 0o644
        else:
            if not stat.S_ISREG(st.st_mode):  # it was one when read; replaced since
                raise HookError(f"{show(target)} is a {kind_name(st.st_mode)}, not a regular file; nothing written")
            mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot write {show(target)}: {e.strerror}") from None
    try:
        replace_file(dir_fd, os.path.basename(target), change.new.encode("utf-8"), mode, show(target), owner)
    finally:
        os.close(dir_fd)
    return target


def check_name(name: str) -> str:
    """A runtime name every engine accepts: a Kubernetes RuntimeClass `handler` is a DNS label
    (containerd's runtime and CRI-O's runtime are found by it), Docker's `--runtime` any word."""
    ok = 0 < len(name) <= 63 and all(c.islower() or c.isdigit() or c == "-" for c in name) \
        and name[0] != "-" and name[-1] != "-" and name.isascii()
    if not ok:
        raise HookError(f"runtime name {name!r} must be a DNS label (lowercase letters, digits and '-', at most "
                        "63, not starting or ending with '-'), as a Kubernetes RuntimeClass handler; e.g. nvidia")
    return name


def configure(engine: str, path: str | None, runtime_path: str | None, set_default: bool, dry_run: bool,
              out=None, name: str = RUNTIME_NAME) -> int:
    out = out or sys.stdout
    path = path or DEFAULT_PATHS[engine]
    runtime_path = runtime_path or default_runtime_path()
    name = check_name(name)
    changes = {"docker": docker, "containerd": containerd, "crio": crio}[engine](path, runtime_path, set_default,
                                                                                  name)
    from .leftovers import for_engine, warn

    warn(for_engine(engine, path, name))  # NVIDIA's leftovers this registration still meets
    if not changes:
        out.write(f"{engine}: nothing to change: {path} already registers {name} ({runtime_path})\n")
        return 0
    if dry_run:
        for c in changes:
            out.write(c.diff())
        out.write(f"{engine}: dry run, nothing written\n")
        return 0
    for c in changes:
        target = write(c)
        via = f" (the file {c.path} links to)" if target != c.path else ""
        out.write(f"{engine}: {'updated' if c.old is not None else 'created'} {target}{via}: {c.what}\n")
    out.write(f"{engine}: restart the service to apply (nvhook restarts nothing): "
              f"systemctl restart {SERVICES[engine]}\n")
    return 0
