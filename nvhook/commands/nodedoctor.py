"""`nvhook doctor --node [--prefix DIR]`: what on this node stops nvhook from doing its work, one
line per problem with its fix, for a person or (`--format json`) for fleet tooling.

Every check reads files only, under `prefix` (the node's root; "/" by default): nvhook's config,
its log file (can the hook write it), each engine's registration of nvhook-runtime and the name
pods use (leftovers.py: Docker, containerd with its drop-ins, CRI-O and the order of its
drop-ins), NVIDIA's OCI hooks file beside nvhook's, CDI specs (nvhook's against the driver, a
second spec of nvhook's kind), the NRI plugin's registration, and the owner and modes of
nvidia-cdi-hook's set-group-ID stages. Nothing is changed, no engine or daemon is asked.
"""

from __future__ import annotations

import copy
import os
import posixpath
import stat

from ..base import config as config_mod
from ..base.errors import HookError, show
from ..base.rootpath import kind_name
from . import leftovers
from .hookgroup import STAGE_DIRS
from .leftovers import problem, under

# Exit status of `doctor --node` when it found a problem (0: none; 1: it could not tell).
NODE_PROBLEMS = 5
# nvidia-cdi-hook's set-group-ID first stages, as node install and the .deb make them.
# the .deb's, node install's and `nvhook setup`'s copies
STAGES = tuple(f"{d}/{n}" for d in STAGE_DIRS for n in ("python3", "sh"))
NRI_UNITS = ("/etc/systemd/system/nvhook-nri.service", "/usr/lib/systemd/system/nvhook-nri.service",
             "/lib/systemd/system/nvhook-nri.service")
NRI_SOCKET = "/var/run/nri/nri.sock"


def config_of(prefix: str, config_path: str | None) -> tuple[dict, list[dict], str]:
    """(the config, its problems, its node path); a config that cannot be read leaves the
    defaults with the log_file a line scan of it finds, as the hook does."""
    from ..base.configscan import scan_key

    shown = config_path or config_mod.DEFAULT_PATH
    path = under(prefix, shown)
    cfg = copy.deepcopy(config_mod.DEFAULTS)
    try:
        st = os.lstat(path)  # `path`'s links are resolved (under): what is there, never opened if odd
    except OSError:
        if config_path:
            return cfg, [problem("config", shown, "does not exist", "nvhook setup writes the default one")], shown
        return cfg, [], shown
    if not stat.S_ISREG(st.st_mode) or st.st_size > leftovers.MAX_READ:
        what = f"a {kind_name(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else f"{st.st_size} bytes long"
        return cfg, [problem("config", shown, f"is {what}, not a config file: nvhook cannot read it",
                             f"replace it with nvhook's config (nvhook config default > {shown})")], shown
    try:
        return config_mod.check_file(path), [], shown
    except HookError as e:
        found = scan_key(path, "", "log_file")
        if found is not None:
            cfg["log_file"] = found
        text = e.message.replace(path, shown)
        return cfg, [problem("config", shown, text + ": GPU containers are refused, the others start with a "
                             "warning", f"fix it, then `nvhook config check {shown}`")], shown


def log_problems(log_file: str, prefix: str = "/", where: str = "log_file") -> list[dict]:
    """Whether nvhook, as root, can append to `log_file` (the node's path) the way it opens it
    (base/log.py open_log): never through a link at its name, a regular file of root's, created
    when missing. What it cannot write is lost silently in hook mode (runc drops the hook's
    stderr): the audit trail of every container start."""
    if not log_file:
        return []
    lost = "every container start's events are lost"
    if not posixpath.isabs(log_file):
        return [problem("log", log_file, f"{where} is not an absolute path", "give log_file an absolute path")]
    parent, name = posixpath.split(log_file)
    here = os.path.join(under(prefix, parent), name)
    try:
        st = os.lstat(here)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return [problem("log", log_file, f"cannot be looked at ({e.strerror}): {lost}", "fix its directory")]
    if st is None:
        d = under(prefix, parent)
        if not os.path.isdir(d):
            return [problem("log", log_file, f"its directory {parent} does not exist, so nvhook cannot create it: "
                            f"{lost}", f"mkdir -p {parent}, or point log_file elsewhere")]
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return [problem("log", log_file, f"its directory {parent} is on a read-only file system: {lost}",
                            "point log_file at a writable directory")]
        return []
    fix_owner = f"chown root:root {log_file} && chmod 640 {log_file}"
    if stat.S_ISLNK(st.st_mode):
        return [problem("log", log_file, f"is a symbolic link (to {show(os.readlink(here))}): nvhook never writes "
                        f"through one (it could be planted), so {lost}",
                        "remove the link (nvhook creates the file), or point log_file at the file itself")]
    if not stat.S_ISREG(st.st_mode):
        return [problem("log", log_file, f"is a {kind_name(st.st_mode)}, not a regular file: {lost}",
                        "remove it, or point log_file elsewhere")]
    out = []
    if st.st_uid != 0:
        out.append(problem("log", log_file, f"is owned by uid {st.st_uid}, not root: nvhook refuses it (its owner "
                           f"could swap, truncate or read it), so {lost}", fix_owner))
    if st.st_mode & 0o022:
        out.append(problem("log", log_file, f"is writable by others (mode {stat.S_IMODE(st.st_mode):o}): anyone "
                           "can forge or erase events", fix_owner))
    if os.statvfs(here).f_flag & os.ST_RDONLY:
        out.append(problem("log", log_file, f"is on a read-only file system: {lost}",
                           "point log_file at a writable directory"))
    return out


def engine_problems(prefix: str, name: str) -> list[dict]:
    return (leftovers.docker(under(prefix, "/etc/docker/daemon.json"), name, prefix)
            + leftovers.containerd(under(prefix, "/etc/containerd/config.toml"), name, prefix)
            + leftovers.crio(under(prefix, "/etc/crio/crio.conf.d"), name, prefix))


def _reach(spec: dict, prefix: str, cfg: dict) -> tuple[list[dict], bool]:
    """hookreach's lines for nvhook's own spec, and whether its walk still waited on a path at
    cdi.check_timeout (a network mount that does not answer): then one more line naming it."""
    from ..start.cdispecs import stuck
    from .hookreach import within

    own, timeout = cfg["cdi"]["spec"], cfg["cdi"]["check_timeout"]
    try:
        lines, at = within(spec, prefix, timeout)
    except (AttributeError, TypeError):  # a hook entry of the wrong type: cdi_stale's own line says so
        return [], False
    except HookError as e:  # the walk's child failed: nothing known, said as a problem, never "fine"
        return [problem("cdi", own, f"its hooks were not checked for other users: {e.message}",
                        "run nvhook doctor --node again; if it stays, report it with this line")], True
    out = [problem("cdi", own, line, "make the hook, its interpreter and every directory above them "
                   "executable by others (a venv under /root: install nvhook where others can run it, e.g. "
                   "nvhook node install or the .deb), then nvhook cdi generate again") for line in lines]
    if at is not None:
        out.append(problem("cdi", own, *stuck(at, timeout, "its hooks were not checked for other users")))
    return out, at is not None


def cdi_stale(cfg: dict, prefix: str) -> list[dict]:
    """nvhook's own spec against the driver it was made for and the files it names."""
    from ..decide import cdicheck
    from ..observe.host import procfs
    from ..start.cdispecs import missing_within, stuck

    own = cfg["cdi"]["spec"]
    if not own:
        return []
    text = leftovers.read_text(under(prefix, own))
    if text is None:
        return []
    fix = f"nvhook cdi generate --output {own} (nvhook-cdi.service does it when installed)"
    try:
        spec = leftovers.parse_json(text)
    except ValueError as e:
        return [problem("cdi", own, f"is not valid JSON ({e}): engines refuse every device in it", fix)]
    if not isinstance(spec, dict):
        return [problem("cdi", own, "is not a CDI spec (not a JSON object)", fix)]
    out, hung = _reach(spec, prefix, cfg)
    # The node's driver version file, read inside the prefix like every other file (procfs'
    # own reader would follow a planted link out of it).
    version = leftovers.read_text(under(prefix, posixpath.join(cfg["root"], procfs.NVIDIA.lstrip("/"), "version")))
    have = procfs.version_in(version or "")
    try:
        made = cdicheck.driver_version(spec)
        named = cdicheck.host_paths(spec)
    except (AttributeError, TypeError):  # a list or a number where CDI has a table
        return [problem("cdi", own, "is not a CDI spec (a field has the wrong type): engines refuse it", fix)]
    if have and made and have != made:
        out.append(problem("cdi", own, f"is stale: made for driver {made}, the node has {have}; containers given "
                           "its devices fail to start or load the old libraries", fix))
    if hung:  # its files would be looked at there again: one line for that path is enough
        return out
    looked = [p for p in named if isinstance(p, str) and posixpath.isabs(p)]
    timeout = cfg["cdi"]["check_timeout"]
    try:
        absent, at = missing_within([under(prefix, p) for p in looked], timeout)
    except HookError as e:
        return out + [problem("cdi", own, f"the files it names were not checked: {e.message}",
                              "run nvhook doctor --node again; if it stays, report it with this line")]
    gone = frozenset(absent)
    if at is not None:
        out.append(problem("cdi", own, *stuck(at, timeout, "the files it names were not checked")))
    missing = [p for p in looked if under(prefix, p) in gone]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        out.append(problem("cdi", own, f"is stale: it names {missing[0]}{more}, which the node no longer has; "
                           "containers given its devices fail to start", fix))
    return out


def nri_problems(prefix: str) -> list[dict]:
    """nvhook's NRI plugin, where its unit is installed: enabled, and an engine with NRI on
    listening on the socket it connects to."""
    unit = next((u for u in NRI_UNITS if os.path.isfile(under(prefix, u))), None)
    if unit is None:
        return []
    out = []
    text = leftovers.read_text(under(prefix, unit)) or ""
    words = " ".join(ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("ExecStart=")).split()
    socket = words[words.index("--socket") + 1] if "--socket" in words[:-1] else NRI_SOCKET
    wants = [posixpath.join(d, "multi-user.target.wants", "nvhook-nri.service")
             for d in ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")]
    if not any(os.path.lexists(under(prefix, w)) for w in wants):
        out.append(problem("nri", unit, "is not enabled: after a reboot no plugin runs and GPU pods without a "
                           "runtime class get no GPU", "systemctl enable --now nvhook-nri.service"))
    engines = [e for e in (_containerd_nri(prefix), _crio_nri(prefix)) if e is not None]
    if not engines:
        out.append(problem("nri", unit, "no containerd or CRI-O config on the node: the plugin has no engine",
                           "install the engine, or remove the plugin (node uninstall)"))
    for engine, path, on, listens in engines:
        if not on:
            out.append(problem("nri", path, f"{engine} has NRI off: nvhook's plugin never sees a container",
                               f"nvhook runtime enable-nri --runtime {engine}, then systemctl restart {engine}"))
        elif isinstance(listens, str) and listens.replace("/var/run/", "/run/") != socket.replace("/var/run/", "/run/"):
            out.append(problem("nri", path, f"{engine} listens for NRI plugins on {listens}, the plugin connects "
                               f"to {socket} ({unit})", f"nvhook node install --nri again (it reads the socket), or "
                               f"set --socket {listens} in the unit"))
    return out


def _containerd_nri(prefix: str):
    """("containerd", its config, NRI on, its socket) from the files alone (no daemon asked):
    version 3 (containerd 2.x) has NRI on unless told, 1.7's version 2 and 1 have it off."""
    path = under(prefix, "/etc/containerd/config.toml")
    files = leftovers.containerd_files(path, prefix)
    if not files:
        return None
    main = files[0][1] or {}
    version = main.get("version", 1)
    on, listens = isinstance(version, int) and version >= 3, None
    for _f, conf in files:
        for table in (("plugins", "nri"), ("plugins", "io.containerd.nri.v1.nri")):
            t = leftovers.get_path(conf or {}, table)
            if isinstance(t, dict):
                if isinstance(t.get("disable"), bool):
                    on = not t["disable"]
                listens = t.get("socket_path") or listens
        disabled = (conf or {}).get("disabled_plugins") or []
        if isinstance(disabled, list) and {"nri", "io.containerd.nri.v1.nri"} & {d for d in disabled
                                                                                if isinstance(d, str)}:
            on = False
    return "containerd", "/etc/containerd/config.toml", on, listens or NRI_SOCKET


def _crio_nri(prefix: str):
    """("crio", its drop-in directory, NRI on, its socket): on by default since CRI-O 1.30."""
    d = under(prefix, "/etc/crio/crio.conf.d")
    files = [f for f in (leftovers.inside(prefix, f) for f in leftovers.crio_files(d)) if os.path.isfile(f)]
    if not files:
        return None
    on, listens = True, None
    for f in files:
        conf = leftovers.parse_toml(leftovers.read_text(f) or "") or {}
        t = leftovers.get_path(conf, ("crio", "nri"))
        if isinstance(t, dict):
            on = t.get("enable_nri", on)
            listens = t.get("nri_listen") or listens
    return "crio", "/etc/crio/crio.conf.d", bool(on), listens or NRI_SOCKET


def stage_problems(prefix: str) -> list[dict]:
    """nvidia-cdi-hook's first stages (docs/cdi-hook.md): root's, set-group-ID to a group that
    owns nothing and has no members (nvhook-hook; 65534 mode 2710 where the node cannot have
    one), never writable by anyone else."""
    from .hookgroup import FALLBACK_GID, HOOK_GROUP
    from .hookgroup import group_state as hook_group_state
    from .nodehost import Host

    out: list[dict] = []
    fix = "nvhook node install again (the .deb's: dpkg-reconfigure nvhook) remakes it"
    gid = why = None
    for path in STAGES:
        try:
            st = os.lstat(under(prefix, path))
        except OSError:
            continue
        if gid is None and why is None:
            try:
                gid, why = hook_group_state(Host(prefix))
            except HookError as e:  # a FIFO or a device node planted as /etc/group: named, not read
                gid, why = -1, ""  # the group is not known: no stage is said to have the wrong one
                out.append(problem("stages", "/etc/group", e.message, "make it the node's group file again"))
            if why:
                out.append(problem("stages", "/etc/group", f"the group {HOOK_GROUP} {why}: whoever is in it gets "
                                   "what the set-group-ID hook stages give",
                                   f"take them out: gpasswd -d USER {HOOK_GROUP}"))
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            out.append(problem("stages", path, f"is a {kind_name(st.st_mode)}, not the hook's copy", fix))
            continue
        if st.st_uid != 0:
            out.append(problem("stages", path, f"is owned by uid {st.st_uid}, not root: that user can replace what "
                               "runs as root at every container start", fix))
        if mode & 0o022:
            out.append(problem("stages", path, f"is writable by others (mode {mode:o})", fix))
        if not mode & 0o2000:
            out.append(problem("stages", path, f"is not set-group-ID (mode {mode:o}): an image's LD_PRELOAD reaches "
                               "the hook for specs whose hook entries carry no env (CVE-2025-23266)", fix))
        elif st.st_gid == 0:
            out.append(problem("stages", path, "is set-group-ID root: anyone who runs it gets gid 0", fix))
        elif st.st_gid == FALLBACK_GID and mode & 0o001:
            out.append(problem("stages", path, f"is set-group-ID {FALLBACK_GID} and executable by everyone: any "
                               f"user gets the overflow group, which owns files (mode 2710 there)", fix))
        elif st.st_gid not in (gid, FALLBACK_GID) and gid != -1:
            out.append(problem("stages", path, f"is set-group-ID gid {st.st_gid}, not {HOOK_GROUP}'s "
                               f"({gid if gid is not None else 'no such group'})", fix))
    return out


def diagnose(prefix: str = "/", config_path: str | None = None, runtime_name: str = "nvidia") -> dict:
    """Every check, as a JSON-able dict: {"prefix", "runtime_name", "config", "problems"}."""
    prefix = os.path.abspath(prefix)
    if not os.path.isdir(prefix):
        raise HookError(f"--prefix {prefix} is not a directory")
    cfg, problems, shown = config_of(prefix, config_path)
    problems += log_problems(cfg["log_file"], prefix)
    problems += engine_problems(prefix, runtime_name)
    problems += leftovers.hooks_problems(prefix, nvhook_here=True)
    if cfg["cdi"]["spec"]:
        problems += leftovers.cdi_problems(cfg["cdi"]["spec"], prefix)
        problems += cdi_stale(cfg, prefix)
    problems += nri_problems(prefix)
    problems += stage_problems(prefix)
    return {"prefix": prefix, "runtime_name": runtime_name, "config": shown, "problems": problems}


def render_text(report: dict) -> str:
    lines = [f"{p['path']}: {p['problem']}; fix: {p['fix']}" for p in report["problems"]]
    n = len(report["problems"])
    where = "" if report["prefix"] == "/" else f" under {report['prefix']}"
    said = f"{n} problem{'s' if n > 1 else ''}" if n else "no problems found"
    lines.append(f"nvhook doctor --node{where}: {said}")
    return "\n".join(lines) + "\n"


def run(prefix: str, config_path: str | None, runtime_name: str, fmt: str, container: str | None) -> int:
    """`nvhook doctor --node`: the report on stdout, the exit status."""
    import click

    from .clikit import emit

    if container:
        raise click.UsageError("--node checks the node: give it without --bundle and --rootfs")
    report = diagnose(prefix, config_path, runtime_name)
    emit(fmt, report, render_text)
    return NODE_PROBLEMS if report["problems"] else 0
