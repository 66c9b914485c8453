"""What on a node conflicts with nvhook, NVIDIA's Container Toolkit's leftovers first: its runtime
still registered (or registered under nvhook's name by a file that wins), its OCI hooks file
beside nvhook's (both inject the driver), a second CDI spec of nvhook's kind (the engine
refuses a device name defined twice), and nvhook-runtime registered under another name than the
one the node's pods ask for.

Each check reads files only, under `prefix` (the node's root: `nvhook doctor --node --prefix`,
a test's fake node; "/" otherwise): absolute paths named inside a file (an `imports` entry, a
hook's path) are resolved under it too, never followed out of it. Each returns problems as
{"check", "path", "problem", "fix"}; `nvhook doctor --node` lists them, and `setup`, `runtime
configure` and `cdi generate` print the ones their change would meet as one warning line each
(`warn`).
"""

from __future__ import annotations

import json
import os
import posixpath
import sys

from ..base import rootpath

OURS = "nvhook-runtime"
HOOKS_DIRS = ("/etc/containers/oci/hooks.d", "/usr/share/containers/oci/hooks.d")
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_KIND = "nvidia.com/gpu"
NVIDIA_HOOKS = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")


def problem(check: str, path: str, text: str, fix: str) -> dict:
    return {"check": check, "path": path, "problem": text, "fix": fix}


MISSING = ".nvhook-doctor-no-such-path"


def under(prefix: str, path: str) -> str:
    """This machine's path for the node's `path`, its links resolved inside `prefix` (an
    absolute link is the node's path, never this machine's). A path the node does not have:
    its parent's, resolved, with its name when nothing is there (not even a link); else a path
    under `prefix` that does not exist, so that nothing is read through a link out of it."""
    if prefix in ("", "/"):
        return path
    inside = rootpath.resolve(prefix, path)
    if inside is not None:
        return rootpath.join(prefix, inside)
    parent, name = posixpath.split(posixpath.normpath("/" + path))
    up = rootpath.resolve(prefix, parent)
    if up is not None and name and not os.path.lexists(rootpath.join(prefix, posixpath.join(up, name))):
        return rootpath.join(prefix, posixpath.join(up, name))
    return os.path.join(prefix, MISSING, path.lstrip("/"))


def inside(prefix: str, found: str) -> str:
    """`found` (a path under `prefix` that a listing or glob gave) with its links resolved inside."""
    return under(prefix, node_path(prefix, found))


def node_path(prefix: str, path: str) -> str:
    """The node's own name for this machine's `path` (the form a person on the node types)."""
    if prefix in ("", "/"):
        return path
    rel = os.path.relpath(path, prefix)
    return "/" + ("" if rel == "." else rel)


def read_text(path: str) -> str | None:
    """A regular file's text, None when there is none (or it cannot be read: not our check)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not os.path.isfile(path):
            return None
        return f.read().decode("utf-8", "replace")


def parse_toml(text: str) -> dict | None:
    from ..base import tomlread

    try:
        return tomlread.loads(text)
    except tomlread.TOMLDecodeError:
        return None


def _base(path) -> str:
    return posixpath.basename(path) if isinstance(path, str) else ""


def is_nvidias(path) -> bool:
    return _base(path).startswith("nvidia-container-runtime")


def _names(found) -> str:
    return ", ".join(sorted(found))


# -- Docker ---------------------------------------------------------------------------------------

def docker(path: str, name: str, prefix: str = "/", keep: str | None = None) -> list[dict]:
    """daemon.json (`path`, this machine's): NVIDIA's runtime entries, nvhook's under another
    name than `name`. `keep`: a name `runtime configure` is about to rewrite (not reported)."""
    text = read_text(path)
    shown = node_path(prefix, path)
    if text is None or not text.strip():
        return []
    try:
        data = json.loads(text)
    except ValueError as e:
        return [problem("docker", shown, f"is not valid JSON ({e}): dockerd does not start",
                        "fix the file (`python3 -m json.tool` shows where)")]
    runtimes = data.get("runtimes") if isinstance(data, dict) else None
    if not isinstance(runtimes, dict):
        return []
    paths = {n: r.get("path") for n, r in runtimes.items() if isinstance(r, dict)}
    return _runtime_table("docker", shown, paths, name, keep, prefix,
                          fix_ours="nvhook runtime configure --runtime docker",
                          remove=lambda n: f"remove runtimes.{n} from {shown}")


def _runtime_table(engine: str, shown: str, paths: dict, name: str, keep: str | None, prefix: str,
                   fix_ours: str, remove) -> list[dict]:
    """The problems of one engine's runtimes (name -> binary): shared by the three engines."""
    ours = {n for n, p in paths.items() if _base(p) == OURS} | ({keep} if keep else set())
    out = []
    for n, p in sorted(paths.items()):
        if not is_nvidias(p) or n == keep:
            continue
        if n == name:
            out.append(problem(engine, shown, f"the runtime {n!r} runs NVIDIA's {p}, not nvhook-runtime",
                               f"`{fix_ours}` makes {n!r} run nvhook-runtime"))
        elif ours:
            out.append(problem(engine, shown, f"NVIDIA's runtime {n!r} ({p}) is still registered beside nvhook's "
                               f"({_names(ours)}): pods or containers that name it get NVIDIA's injection",
                               remove(n)))
    if ours and name not in ours:
        out.append(problem(engine, shown, f"nvhook-runtime is registered as {_names(ours)!s}, not {name!r}: "
                           f"`--runtime={name}` and RuntimeClass handler {name!r} fail with the engine's own error",
                           f"`{fix_ours}` (registers {name!r}; --runtime-name chooses another)"))
    for n in sorted(ours - {keep}):
        p = paths[n]
        if isinstance(p, str) and posixpath.isabs(p) and not os.path.exists(under(prefix, p)):
            out.append(problem(engine, shown, f"the runtime {n!r} names {p}, which does not exist",
                               f"`{fix_ours} --runtime-path PATH` with nvhook-runtime's path"))
    return out


# -- containerd -----------------------------------------------------------------------------------

CRI_TABLES = (("plugins", "cri", "containerd", "runtimes"),
              ("plugins", "io.containerd.grpc.v1.cri", "containerd", "runtimes"),
              ("plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes"))


def get_path(d, keys):
    """d[k1][k2]... or None where a step is missing or not a table."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def containerd_files(path: str, prefix: str = "/") -> list[tuple[str, dict | None]]:
    """(this machine's path, parsed or None when it does not parse) of the config and each file
    its `imports` name (globs, relative to the config's directory), in containerd's order."""
    import glob

    text = read_text(path)
    if text is None:
        return []
    conf = parse_toml(text)
    out = [(path, conf)]
    base = posixpath.dirname(node_path(prefix, path))
    for pattern in (conf or {}).get("imports") or []:
        if not isinstance(pattern, str):
            continue
        full = pattern if posixpath.isabs(pattern) else posixpath.join(base, pattern)
        for hit in sorted(glob.glob(under(prefix, posixpath.dirname(full)) + "/" + posixpath.basename(full))):
            t = read_text(inside(prefix, hit))
            if t is not None:
                out.append((hit, parse_toml(t)))
    return out


def containerd(path: str, name: str, prefix: str = "/", keep: str | None = None) -> list[dict]:
    """containerd's config and its drop-ins: a file that does not parse, NVIDIA's runtimes,
    nvhook's under another name."""
    out = []
    paths: dict = {}
    for f, conf in containerd_files(path, prefix):
        if conf is None:
            out.append(problem("containerd", node_path(prefix, f), "is not valid TOML: containerd does not start",
                               "fix the file (`containerd config dump` shows where)"))
            continue
        for table in CRI_TABLES:
            for n, r in (get_path(conf, table) or {}).items():
                binary = get_path(r, ("options", "BinaryName"))
                if binary:
                    paths[n] = binary
    return out + _runtime_table("containerd", node_path(prefix, path), paths, name, keep, prefix,
                                fix_ours="nvhook runtime configure --runtime containerd",
                                remove=lambda n: f"remove the runtime {n!r} from containerd's config or drop-in")


# -- CRI-O ----------------------------------------------------------------------------------------

def crio_files(dropin_dir: str) -> list[str]:
    """crio.conf, then the drop-ins in name order: CRI-O's order (a later file wins key by key)."""
    main = os.path.join(os.path.dirname(dropin_dir.rstrip("/")), "crio.conf")
    try:
        names = sorted(n for n in os.listdir(dropin_dir) if n.endswith(".conf"))
    except OSError:
        names = []
    return [main] + [os.path.join(dropin_dir, n) for n in names]


def crio(dropin_dir: str, name: str, prefix: str = "/", keep: str | None = None,
         ours_file: str | None = None) -> list[dict]:
    """CRI-O's drop-ins: which file sets each runtime last (NVIDIA's 99-nvidia.conf sorts after
    nvhook's 99-nvhook.conf and wins), NVIDIA's runtimes, nvhook's under another name.
    `ours_file`: the drop-in `runtime configure` writes `keep` into (there or not yet)."""
    out: list[dict] = []
    paths: dict = {}
    setter: dict = {}
    ours_in: dict = {}
    files = crio_files(dropin_dir)
    if ours_file and ours_file not in files:
        files = [files[0], *sorted([*files[1:], ours_file])]
    for f in files:
        if f == ours_file and keep:
            ours_in[keep], paths[keep], setter[keep] = f, OURS, f
            continue
        text = read_text(inside(prefix, f))
        if text is None:
            continue
        conf = parse_toml(text)
        if conf is None:
            out.append(problem("crio", node_path(prefix, f), "is not valid TOML: CRI-O does not start",
                               "fix the file"))
            continue
        for n, r in (get_path(conf, ("crio", "runtime", "runtimes")) or {}).items():
            p = get_path(r, ("runtime_path",))
            if p:
                if _base(p) == OURS:
                    ours_in[n] = f
                elif n in ours_in:
                    out.append(problem("crio", node_path(prefix, f), f"sorts after {posixpath.basename(ours_in[n])} "
                                       f"and sets the runtime {n!r} to {p}: CRI-O runs that, not nvhook-runtime",
                                       f"remove {node_path(prefix, f)}" + (" (NVIDIA's drop-in)" if is_nvidias(p)
                                                                           else "")))
                paths[n], setter[n] = p, f
    for n, f in ours_in.items():
        if setter[n] != f:
            paths[n] = OURS  # reported above as the later file's; not again as NVIDIA's runtime
    shown = node_path(prefix, dropin_dir)
    return out + _runtime_table("crio", shown, paths, name, keep, prefix,
                                fix_ours="nvhook runtime configure --runtime crio",
                                remove=lambda n: f"remove NVIDIA's [crio.runtime.runtimes.{n}] ({shown})")


# -- OCI hooks files ------------------------------------------------------------------------------

def _hook_of(path: str) -> tuple[str, list]:
    try:
        spec = json.loads(read_text(path) or "")
    except ValueError:
        return "", []
    hook = spec.get("hook") if isinstance(spec, dict) else None
    if not isinstance(hook, dict):
        return "", []
    args = hook.get("args")
    return str(hook.get("path") or ""), [str(a) for a in args] if isinstance(args, list) else []


def hooks_files(prefix: str = "/", dirs=HOOKS_DIRS) -> tuple[list[str], list[str]]:
    """(nvhook's hooks files, NVIDIA's) in the OCI hooks dirs, as the node names them. A file
    naming nvidia-container-runtime-hook that is a link to nvhook (Docker's --gpus way) is ours."""
    ours, theirs = [], []
    for d in dirs:
        here = under(prefix, d)
        try:
            names = sorted(n for n in os.listdir(here) if n.endswith(".json"))
        except OSError:
            continue
        for n in names:
            hook, args = _hook_of(inside(prefix, os.path.join(here, n)))
            real = rootpath.resolve(prefix, hook) if posixpath.isabs(hook) and prefix not in ("", "/") \
                else (os.path.realpath(hook) if hook else "")
            words = {_base(hook), _base(real or ""), *(_base(a) for a in args[:1])}
            if "nvhook" in words or any(_base(a) == "nvhook" for a in args):
                ours.append(posixpath.join(d, n))
            elif words & set(NVIDIA_HOOKS):
                theirs.append(posixpath.join(d, n))
    return ours, theirs


def hooks_problems(prefix: str = "/", dirs=HOOKS_DIRS, nvhook_here: bool = False) -> list[dict]:
    ours, theirs = hooks_files(prefix, dirs)
    if not theirs or not (ours or nvhook_here):
        return []
    beside = f"beside nvhook's {ours[0]}" if ours else "on a node that runs nvhook"
    return [problem("hooks", t, f"NVIDIA's OCI hook is still installed {beside}: podman and CRI-O run both, "
                    "and both inject the driver", f"remove {t}") for t in theirs]


# -- CDI specs ------------------------------------------------------------------------------------

def spec_kind(path: str) -> str | None:
    """A spec's kind: JSON parsed, YAML's top-level `kind:` line read (no YAML parser here)."""
    import re

    text = read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        m = re.search(r"""^kind:\s*["']?([^"'\s#]+)""", text, re.M)
        return m.group(1) if m else None
    return data.get("kind") if isinstance(data, dict) else None


def cdi_problems(own: str, prefix: str = "/", dirs=CDI_DIRS) -> list[dict]:
    """Specs other than `own` (nvhook's, as the node names it) that declare nvhook's kind;
    none where `own` is not there (nothing of nvhook's to conflict with)."""
    if not os.path.isfile(under(prefix, own)):
        return []
    out, seen = [], set()
    for d in dirs:
        here = under(prefix, d)
        try:
            names = sorted(n for n in os.listdir(here) if n.endswith((".json", ".yaml", ".yml")))
        except OSError:
            continue
        for n in names:
            full = inside(prefix, os.path.join(here, n))
            real = os.path.realpath(full)
            if real in seen or posixpath.join(d, n) == own or real == os.path.realpath(under(prefix, own)):
                continue
            seen.add(real)
            if spec_kind(full) == CDI_KIND:
                shown = posixpath.join(d, n)
                out.append(problem("cdi", shown, f"declares {CDI_KIND} as nvhook's {own} does: engines refuse a "
                                   "device name defined twice (or take either spec's)",
                                   f"remove {shown}, and stop what writes it (nvidia-ctk cdi generate, the "
                                   "toolkit's nvidia-cdi-refresh)"))
    return out


def warn(problems: list[dict], out=None) -> None:
    """One line on stderr per problem, for a command whose change would meet it."""
    out = out or sys.stderr
    for p in problems:
        out.write(f"nvhook: warning: {p['path']}: {p['problem']}; fix: {p['fix']}\n")


def for_engine(engine: str, path: str, name: str) -> list[dict]:
    """What `runtime configure` of `engine`'s `path` as `name` still meets: NVIDIA's runtimes
    left under other names, a CRI-O drop-in that sorts after its own and wins."""
    if engine == "docker":
        return docker(path, name, keep=name)
    if engine == "containerd":
        return containerd(path, name, keep=name)
    return crio(os.path.dirname(os.path.abspath(path)), name, keep=name, ours_file=os.path.abspath(path))


def for_spec(output: str) -> list[dict]:
    """Specs beside `output` (and in the directories engines read, when it is in one) that
    declare the kind nvhook's spec declares."""
    here = os.path.dirname(os.path.abspath(output))
    dirs = (here, *CDI_DIRS, "/run/cdi") if here in (*CDI_DIRS, "/run/cdi") else (here,)
    return cdi_problems(os.path.abspath(output), "/", tuple(dict.fromkeys(dirs)))
