"""Where nvhook's runtime goes in a containerd config, shape by shape, and containerd's own word on
the result.

What containerd does with each shape, read back with `containerd config dump` (1.6, 1.7 and 2.1):
- A file without `version` is version 1 to every containerd. 1.x reads its CRI plugin by the
  short id `plugins.cri`; 2.1 migrates version 1 yet ignores the CRI keys under `plugins.cri`
  ("Ignoring unknown key"), and reads a runtime under `plugins."io.containerd.cri.v1.runtime"`.
- containerd merges an imported file over the main one plugin table by plugin table, and 2.1 reads
  the main file at the highest version among the files: a version 3 drop-in beside a version 2
  file makes 2.1 ignore that file's `io.containerd.grpc.v1.cri` settings. So the drop-in always
  has the main file's version, and only where the main file does not configure the CRI plugin.
- A version 2 file that already uses 2.x's `io.containerd.cri.v1.runtime` (some managed nodes
  ship it): 2.1 drops `io.containerd.grpc.v1.cri` beside it, so the runtime goes under that id.
- No file, or an empty one (comments only): containerd's defaults; the version of the node's
  containerd (3 for 2.x, 2 for 1.x) is written.

So each shape has a list of candidate edits, best first; `runtime configure` writes one, asks
containerd (`config dump`) and keeps it only when containerd reads nvhook's runtime with the
options written, the default where asked, and everything else exactly as before the edit.
Otherwise the files are put back and the next candidate is tried.
"""

from __future__ import annotations

import copy
import os

from ..base.errors import HookError, show
from .engineconfirm import DUMP_CRI, RUNC_V2
from .enginefiles import Change
from .tomledit import deep_set, get_path, parse_toml, set_imports, set_keys, table_text, toml_str, verify

CRI_PLUGIN = {1: ("plugins", "cri"), 2: ("plugins", "io.containerd.grpc.v1.cri"),
              3: ("plugins", "io.containerd.cri.v1.runtime")}
DROPIN_NAME = "99-nvhook.toml"
HEADER = "# Written by `nvhook runtime configure`: nvhook-runtime as an OCI runtime.\n"


class Shape:
    """The config as found: its text (None: no file), parsed, whether it is containerd's defaults
    (no file, or nothing but comments), and the version containerd reads it at."""

    def __init__(self, path: str, old: str | None, node: tuple[int, int] | None):
        self.path, self.old, self.node = path, old, node
        self.parsed = parse_toml(old, path) if old is not None else {}
        self.blank = not self.parsed
        if "version" in self.parsed:
            self.version = self.parsed["version"]
            if self.version not in CRI_PLUGIN:
                raise HookError(f"{show(path)}: containerd config version {self.version!r} is not supported "
                                "(1, 2 or 3); nothing written")
        elif self.blank:
            self.version = 3 if self.v2x else 2
        else:
            self.version = 1  # what every containerd takes a file without `version` for
        self.dropin = os.path.join(os.path.dirname(os.path.abspath(path)), "conf.d", DROPIN_NAME)

    @property
    def v2x(self) -> bool:
        return self.node is not None and self.node[0] >= 2

    def base(self) -> tuple[str, dict]:
        """The text edits start from, and what it parses to (a blank file gets its version)."""
        if self.blank:
            return f"version = {self.version}\n" + (self.old or ""), {"version": self.version}
        return self.old or "", self.parsed

    def cri_plugin(self) -> tuple | None:
        """The CRI runtime plugin table the file itself configures, 2.x's id first (in version 3
        `io.containerd.grpc.v1.cri` is the CRI service, not where runtimes are)."""
        plugins = self.parsed.get("plugins")
        if isinstance(plugins, dict):
            for v in {3: (3,), 2: (3, 2), 1: (1,)}[self.version]:
                if isinstance(plugins.get(CRI_PLUGIN[v][1]), dict):
                    return CRI_PLUGIN[v]
        return None


def wanted(conf: dict, plugin: tuple, runtime_path: str, set_default: bool, name: str) -> list:
    runtimes = (*plugin, "containerd", "runtimes", name)
    out = [(runtimes, {"runtime_type": RUNC_V2}), ((*runtimes, "options"), {"BinaryName": runtime_path})]
    if set_default:
        out.append(((*plugin, "containerd"), {"default_runtime_name": name}))
    if get_path(conf, (*plugin, "containerd", "runtimes")) is None:
        # A `runtimes` table replaces containerd's built-in one (containerd 1.6's `config dump`
        # shows runc gone), and the default runtime "runc" with it: every other pod would then
        # fail. Written beside ours, as containerd's default has it.
        out.insert(0, ((*plugin, "containerd", "runtimes", "runc"), {"runtime_type": RUNC_V2}))
    return out


def _as_toml(want: list) -> list:
    return [(t, {k: toml_str(v) for k, v in vals.items()}) for t, vals in want]


def holds(conf: dict, want: list) -> bool:
    return all(isinstance(get_path(conf, t), dict) and all(get_path(conf, t).get(k) == v for k, v in vals.items())
               for t, vals in want)


def inline(shape: Shape, plugin: tuple, runtime_path: str, set_default: bool, name: str) -> list:
    """The runtime's tables in the config itself, under `plugin`."""
    text, before = shape.base()
    want = wanted(shape.parsed, plugin, runtime_path, set_default, name)
    for table, vals in _as_toml(want):
        text = set_keys(text, table, vals)
    verify(text, before, want, shape.path)
    what = ".".join((*plugin, "containerd", "runtimes", name)) + (", default_runtime_name" if set_default else "")
    return [Change(shape.path, shape.old, text, what)]


def dropin(shape: Shape, version: int, runtime_path: str, set_default: bool, name: str,
           dropin_old: str | None) -> list:
    """The runtime in conf.d/99-nvhook.toml (at `version`), and the config's `imports` naming it."""
    plugin = CRI_PLUGIN[version]
    want = wanted({}, plugin, runtime_path, set_default, name)
    text = HEADER + f"version = {version}\n"
    for table, vals in _as_toml(want):
        text = set_keys(text, table, vals)
    expect: dict = {"version": version}
    for table, vals in want:
        deep_set(expect, table, vals)
    if parse_toml(text, shape.dropin) != expect:  # pragma: no cover - our own text
        raise HookError("internal error: the containerd drop-in does not parse to what was meant")
    changes = []
    if dropin_old != text:
        what = f"{'.'.join((*plugin, 'containerd', 'runtimes', name))} (drop-in)"
        changes.append(Change(shape.dropin, dropin_old, text, what))
    if shape.dropin not in (shape.parsed.get("imports") or []):
        base, before = shape.base()
        new_main = set_imports(base, before, shape.dropin)
        verify(new_main, before, [], shape.path, extra_import=shape.dropin)
        changes.append(Change(shape.path, shape.old, new_main, f"imports += {shape.dropin}"))
    return changes


def candidates(shape: Shape, runtime_path: str, set_default: bool, name: str, dropin_old: str | None) -> list:
    """[(what, make changes)] to try in order: first the edit the file's own shape calls for,
    then the ones that other containerd versions read (see the module's docstring); each is
    kept only when containerd confirms it."""
    args = (runtime_path, set_default, name)
    file_plugin = shape.cri_plugin()
    order: list = []
    if shape.version == 1:
        order += [("inline", CRI_PLUGIN[3])] if shape.v2x else []
        order += [("inline", CRI_PLUGIN[1])]
    else:
        order += [("inline", file_plugin)] if file_plugin else [("dropin", shape.version)]
        order += [("inline", CRI_PLUGIN[3])] if shape.v2x else []
        order += [("inline", CRI_PLUGIN[shape.version]), ("dropin", shape.version)]
    out, seen = [], set()
    for kind, what in order:
        if (kind, what) in seen:
            continue
        seen.add((kind, what))
        if kind == "inline":
            out.append((f"under {what[1]}", lambda p=what: inline(shape, p, *args)))
        else:
            out.append((f"a version {what} drop-in", lambda v=what: dropin(shape, v, *args, dropin_old)))
    return out


def _normal(dump: dict, name: str, set_default: bool) -> dict:
    d = copy.deepcopy(dump)
    for k in ("version", "imports"):
        d.pop(k, None)
    for cri in DUMP_CRI:
        c = get_path(d, (*cri, "containerd"))
        if isinstance(c, dict):
            got = c.get("runtimes")
            rts: dict = got if isinstance(got, dict) else {}
            c["runtimes"] = {k: (v.get("runtime_type") if isinstance(v, dict) else v)
                             for k, v in rts.items() if k != name}
            if set_default:
                c.pop("default_runtime_name", None)
    return d


def _first_difference(a, b, at: tuple = ()) -> tuple:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), (*at, k))
    return at


def changed_besides(before: dict, after: dict, name: str, set_default: bool) -> str | None:
    """What containerd reads differently after the edit, nvhook's runtime aside (None: nothing)."""
    a, b = _normal(before, name, set_default), _normal(after, name, set_default)
    if a == b:
        return None
    return f"it also reads [{table_text(_first_difference(a, b)) or '(top)'}] differently"
