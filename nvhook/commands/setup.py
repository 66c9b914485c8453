"""`nvhook setup`: install (or with --uninstall, remove) the files a host needs to run nvhook
as an OCI hook: the default config, the OCI hooks file for podman and CRI-O, a
systemd-tmpfiles entry for /run/nvhook and a logrotate entry for the log.

Idempotent: a file that already holds what would be written is left alone. An existing config
the operator changed is never overwritten or removed; a hooks file, tmpfiles or logrotate
entry that differs from nvhook's is replaced by setup (it is nvhook's file) but removed by
--uninstall only when it is still nvhook's. `prefix` puts everything under another root, as
DESTDIR does for packages (the paths written inside the files are the final ones).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from importlib import resources

from ..base.config import DEFAULT_PATH
from ..base.errors import HookError, show

HOOKS_DIR = "/etc/containers/oci/hooks.d"  # local admin hooks (podman, CRI-O); /usr/share is the packages'
TMPFILES = "/etc/tmpfiles.d/nvhook.conf"
LOGROTATE = "/etc/logrotate.d/nvhook"


def data(name: str) -> str:
    """A file shipped in the package (nvhook/data): the default config, the hooks file, snippets."""
    return (resources.files("nvhook") / "data" / name).read_text()


def default_hook_path() -> str:
    """The nvhook beside the running interpreter (a venv's bin/), else /usr/local/bin/nvhook."""
    here = os.path.join(os.path.dirname(sys.executable), "nvhook")
    return here if os.path.isfile(here) else "/usr/local/bin/nvhook"


def hooks_json(hook_path: str, config_path: str = DEFAULT_PATH) -> str:
    from ..base.launch import registration

    spec = json.loads(data("nvhook.json"))
    spec["hook"]["path"], argv0 = registration(hook_path)
    spec["hook"]["args"] = [*argv0, *spec["hook"]["args"][1:]]
    spec["hook"]["env"] = [e for e in spec["hook"]["env"] if not e.startswith("NVHOOK_CONFIG=")] + \
        [f"NVHOOK_CONFIG={config_path}"]
    return json.dumps(spec, indent=2) + "\n"


def files(hook_path: str, hooks_dir: str, config_path: str = DEFAULT_PATH) -> list[tuple[str, str, str]]:
    """(final path, content, kind); kind "config" is the operator's once installed."""
    return [
        (config_path, data("hook.toml"), "config"),
        (os.path.join(hooks_dir, "nvhook.json"), hooks_json(hook_path, config_path), "nvhook"),
        (TMPFILES, data("tmpfiles.conf"), "nvhook"),
        (LOGROTATE, data("logrotate"), "nvhook"),
    ]


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}") from None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read()


def _write(path: str, content: str) -> None:
    """A new file beside the target (never through a planted link), renamed over it."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.nvhook-new"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.rename(tmp, path)


def setup(prefix: str = "/", hook_path: str | None = None, hooks_dir: str = HOOKS_DIR,
          uninstall: bool = False, dry_run: bool = False, config_path: str | None = None) -> list[dict]:
    """What was done (with `dry_run`: what would be), one {"path", "action"} per file.
    `config_path` (nvhook --config): where the config goes, and what the hooks file's
    NVHOOK_CONFIG names."""
    prefix = os.path.abspath(prefix)
    hook_path = hook_path or default_hook_path()
    config_path = config_path or DEFAULT_PATH
    if not os.path.isabs(hook_path) or not os.path.isabs(hooks_dir) or not os.path.isabs(config_path):
        raise HookError("--hook-path, --hooks-dir and --config must be absolute paths")
    done = cdi_hook_stages(prefix, uninstall, dry_run)  # first: a group it refuses leaves all else as it was
    for final, content, kind in files(hook_path, hooks_dir, config_path):
        path = os.path.join(prefix, final.lstrip("/"))
        have = _read(path)
        if uninstall:
            if have is None:
                action = "absent"
            elif have != content and (kind == "config" or "nvhook" not in have):
                action = "kept (changed by you)" if kind == "config" else "kept (not nvhook's)"
            else:
                action = "removed"
                if not dry_run:
                    os.unlink(path)
                    if kind == "config":
                        try:
                            os.rmdir(os.path.dirname(path))
                        except OSError:
                            pass
        elif have == content:
            action = "unchanged"
        elif have is not None and kind == "config":
            action = "kept (yours)"
        else:
            action = "created" if have is None else "replaced"
            if not dry_run:
                _write(path, content)
        done.append({"path": path, "action": _would(action) if dry_run else action})
    if not uninstall:
        from .leftovers import HOOKS_DIRS, hooks_problems, warn

        warn(hooks_problems(prefix, tuple(dict.fromkeys((hooks_dir, *HOOKS_DIRS))), nvhook_here=True))
    if prefix == "/":
        b = _bundle(uninstall, dry_run)
        done.append(dict(b, action=_would(b["action"])) if dry_run else b)
    return done


def cdi_hook_stages(prefix: str, uninstall: bool, dry_run: bool) -> list[dict]:
    """nvidia-cdi-hook's two stages in SETUP_DIR (nvhook/commands/hookstages.py): the copies of
    /bin/sh and this interpreter set-group-ID to the hook group (made, or refused, by
    hookgroup.ensure), the python stage reading nvhook from this install, and the first stage
    that the wheel's own bin/nvidia-cdi-hook also is. The group stays on --uninstall."""
    import nvhook

    from . import hookgroup, hookstages
    from .nodehost import Host, in_node

    lx = f"{hookstages.SETUP_DIR}/libexec"
    python = os.path.realpath(sys.executable)
    host = Host(prefix) if os.path.isdir(prefix) else None
    if host is None or host.resolved(python) is None or host.resolved("/bin/sh") is None:
        return []  # a --prefix that is a staging tree, not a root: nothing there to copy (docs/install.md)
    # nvhook's own directory and this install's site-packages only (never a user's site directory
    # that a non-isolated run of setup would have on sys.path: the stage runs as root)
    prefix_sites = (p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix.rstrip("/") + "/"))
    site = [os.path.dirname(nvhook.__path__[0]), *sorted(set(prefix_sites) - {os.path.dirname(nvhook.__path__[0])})]
    stages = {f"{hookstages.SETUP_DIR}/bin/nvidia-cdi-hook": (hookstages.setup_first_stage().encode(), 0o755),
              f"{lx}/nvidia-cdi-hook.py": (hookstages.python_stage(f"{lx}/python3", site).encode(), 0o644),
              **hookstages.copies(host, python, lx)}
    if uninstall:
        done = []
        for path in stages:
            gone = host.exists(path)
            if gone and not dry_run:
                host.remove(path)
            done.append({"path": rootjoin(prefix, path), "action": _would("removed") if dry_run and gone
                         else "removed" if gone else "absent"})
        if not dry_run:
            for d in (lx, f"{hookstages.SETUP_DIR}/bin", hookstages.SETUP_DIR):
                host.rmdir_empty(d)
        return done + [{"path": rootjoin(prefix, "/etc/group"), "action": n["what"]} for n in hookgroup.kept_note(host)]
    if dry_run:
        return [{"path": rootjoin(prefix, p), "action": "unchanged" if host.read(p) == want else
                 _would("replaced" if host.exists(p) else "created")} for p, want in stages.items()]
    # what the python stage imports from, run as root at every container start: this install's
    # directories and the interpreter's standard library (a venv or pyenv in a user's home is theirs)
    for d in (*site, sysconfig.get_paths()["stdlib"]):
        real = host.resolved(d)
        if real is not None:
            hookstages.root_only(host, real, real, "install nvhook (pip install, then nvhook setup) with a "
                                 "python and a venv only root can change")
    gid, no_group = hookgroup.ensure(host, lambda h, argv: in_node(h, argv, check=False))
    hookstages.own_dirs(host, hookstages.SETUP_DIR, [lx, f"{hookstages.SETUP_DIR}/bin"])
    done = []
    for path, want in stages.items():
        had = host.exists(path)
        if hookstages.write_copies(host, {path: want}, gid, bool(no_group)):
            done.append({"path": rootjoin(prefix, path), "action": "replaced" if had else "created"})
        else:
            done.append({"path": rootjoin(prefix, path), "action": "unchanged"})
    if no_group:
        done.append({"path": rootjoin(prefix, lx), "action": f"root only (mode 2710): {no_group}; user-namespaced "
                     "containers cannot run nvidia-cdi-hook"})
    return done


def rootjoin(prefix: str, path: str) -> str:
    return os.path.join(prefix, path.lstrip("/"))


def _would(action: str) -> str:
    """A dry run's action: what a real run would do ("would create"), or the state left as it is."""
    verbs = {"created": "would create", "replaced": "would replace", "removed": "would remove"}
    return verbs.get(action, action)


def _bundle(uninstall: bool, dry_run: bool) -> dict:
    """The start-path bundle of this installation (nvhook/base/modbundle.py), written with the
    rest: a pip install cannot run code, and the hook, run as root, never writes it itself."""
    import nvhook

    from ..base import modbundle

    path = modbundle.bundle_path(nvhook.__path__[0])
    if uninstall:
        if not os.path.exists(path):
            return {"path": path, "action": "absent"}
        if not dry_run:
            os.unlink(path)
        return {"path": path, "action": "removed"}
    if dry_run:
        return {"path": path, "action": "replaced" if os.path.exists(path) else "created"}
    existed = os.path.exists(path)
    try:
        modbundle.write(nvhook.__path__[0])
    except (OSError, HookError) as e:  # a read-only install: the usual imports, a few ms slower
        return {"path": path, "action": f"not written ({e.message if isinstance(e, HookError) else e.strerror})"}
    return {"path": path, "action": "replaced" if existed else "created"}
