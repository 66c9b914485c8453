"""Configuration: defaults, the TOML file, and validation.

tomllib costs ~12 ms to import here (it pulls in re, typing and enum), half of the hook's whole
overhead, so the parsed and validated config is cached as JSON, keyed by the file's identity
(path, device, inode, size, mtime, ctime); a changed file is always re-read. That cache must
be found before the file is read, so it is always in /run/nvhook (the default cache_dir), one
file per config path, whatever cache_dir the file names; cache_dir = "" turns it off with
every other cache.
NVHOOK_RUN_DIR in nvhook's own environment (never the container's) moves that directory: the
tests use it so that nothing lands in the host's /run/nvhook. nvidia-cdi-hook drops it with the
rest of its environment (it may be the container's), so the tests run it in a mount namespace
with a /run/nvhook of their own (tests/e2e/privaterun.py).
"""

from __future__ import annotations

import os
import stat

from . import jsonfast as json
from .errors import HookError, short, show

DEFAULT_PATH = "/etc/nvhook/hook.toml"
# The `ldconfig.path` that means nvhook's own ld.so.cache writer (the default): no program runs.
LDCONFIG_BUILTIN = "builtin"


def ldconfig_is_builtin(path: object) -> bool:
    """Whether an `ldconfig.path` (or a plan's ldconfig binary) means nvhook's own writer."""
    return path in (None, "", LDCONFIG_BUILTIN)


DEFAULTS: dict = {
    "root": "/",
    "log_file": "/var/log/nvhook.log",
    "log_level": "info",
    "log_journal": False,
    "cache_dir": "/run/nvhook",
    "devices": {
        "accept_envvar_unprivileged": True,
        "accept_volume_mounts": False,
        "volume_mounts_root": "/var/run/nvidia-container-devices",
        "create_missing_nodes": False,
    },
    "request": {
        "supported_driver_capabilities": "all",
        "disable_require": False,
        "swarm_resource": "",
        "ignore_imex_channel_requests": False,
    },
    "nvml": {"enabled": True, "timeout": 5.0},
    "compat": {"mode": "auto", "allow_env_override": True},
    "ldconfig": {"path": LDCONFIG_BUILTIN, "timeout": 10.0},
    "runtime": {"path": "runc"},
    "cdi": {"spec": "/etc/cdi/nvhook.json", "check_timeout": 10.0},
    "daemon": {"mode": "auto", "socket": "/run/nvhook/nvhookd.sock", "timeout": 2.0, "cdi_refresh_interval": 10.0},
    "nri": {"cdi_annotation_namespaces": ""},
}

TYPES: dict[str, type | tuple[type, ...]] = {
    "root": str, "log_file": str, "log_level": str, "cache_dir": str, "log_journal": bool,
    "devices.accept_envvar_unprivileged": bool, "devices.accept_volume_mounts": bool,
    "devices.volume_mounts_root": str, "devices.create_missing_nodes": bool,
    "request.supported_driver_capabilities": str, "request.disable_require": bool,
    "request.swarm_resource": str, "request.ignore_imex_channel_requests": bool,
    "nvml.enabled": bool, "nvml.timeout": (int, float),
    "compat.mode": str, "compat.allow_env_override": bool,
    "ldconfig.path": str, "ldconfig.timeout": (int, float),
    "runtime.path": str,
    "cdi.spec": str, "cdi.check_timeout": (int, float),
    "daemon.mode": str, "daemon.socket": str, "daemon.timeout": (int, float),
    "daemon.cdi_refresh_interval": (int, float),
    "nri.cdi_annotation_namespaces": str,
}
# Keys that name files or directories: they must be absolute. A relative one would be resolved
# against the runtime's working directory, which for podman is the container's bundle (a
# relative log_file was seen landing there and being deleted with the container).
TIMEOUT_MAX_S = 600.0  # the most any `*.timeout` may be (nvhookd bounds its request children by it)
_PATHS = ("root", "log_file", "cache_dir", "devices.volume_mounts_root", "daemon.socket")
_TYPE_NAMES = {str: "a string", bool: "true or false", (int, float): "a number"}
_CHOICES = {
    "log_level": ("debug", "info", "warning", "error"),
    "compat.mode": ("auto", "image", "host"),
    "daemon.mode": ("auto", "off", "required"),
}


def _defaults() -> dict:
    """A deep copy of DEFAULTS (plain JSON data) to fill in."""
    cfg: dict = json.loads(json.dumps(DEFAULTS))
    return cfg


def merge(raw: dict, path: str) -> dict:
    cfg = _defaults()
    for key, value in raw.items():
        section = isinstance(DEFAULTS.get(key), dict)
        if section and not isinstance(value, dict):
            raise HookError(f"config {path}: {key} must be a table ([{key}]), not {_toml_type(value)} {short(value)}")
        if isinstance(value, dict):
            if key in DEFAULTS and not section:
                _check(key, value, path)
            if key not in DEFAULTS:
                sections = [k for k, v in DEFAULTS.items() if isinstance(v, dict)]
                raise HookError(f"config {path}: unknown section [{show(key)}]{did_you_mean(key, sections)}")
            for sub, v in value.items():
                _check(f"{key}.{sub}", v, path)
                cfg[key][sub] = v
        else:
            _check(key, value, path)
            cfg[key] = value
    return cfg


def _check(name: str, value: object, path: str) -> None:
    want = TYPES.get(name)
    if want is None:
        raise HookError(f"config {path}: unknown key {name!r}{did_you_mean(name)}")
    wrong_bool = isinstance(value, bool) and want is not bool
    if wrong_bool or not isinstance(value, want):
        raise HookError(f"config {path}: {name} must be {_TYPE_NAMES[want]}, not {_toml_type(value)} {short(value)}")
    if isinstance(value, str) and any(ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029" for c in value):
        # A NUL makes every os call on the path raise; newlines would break one-line messages.
        raise HookError(f"config {path}: {name} contains control characters: {short(value)}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise HookError(f"config {path}: {name} must be one of {', '.join(_CHOICES[name])}, not {short(value)}")
    if name == "request.supported_driver_capabilities" and isinstance(value, str):
        _check_capability_list(path, name, value)
    if name == "request.swarm_resource" and isinstance(value, str):
        for var in (v.strip() for v in value.split(",")):
            if var and not all(c.isascii() and (c.isalnum() or c in "_-.") for c in var):
                raise HookError(f"config {path}: {name} must list environment variable names, not {short(var)}")
    if name.endswith("timeout") and isinstance(value, (int, float)) and not 0 < value <= TIMEOUT_MAX_S:
        raise HookError(f"config {path}: {name} must be between 0 and {TIMEOUT_MAX_S:g} seconds, not {short(value)}")
    if name == "daemon.cdi_refresh_interval" and isinstance(value, (int, float)) and not 0 <= value <= 86400:
        raise HookError(f"config {path}: {name} must be between 0 (off) and 86400 seconds, not {short(value)}")
    if isinstance(value, str) and value:
        relative = name in _PATHS and not value.startswith("/")
        if name == "ldconfig.path" and not ldconfig_is_builtin(value):
            relative = not value.lstrip("@").startswith("/")
        if name == "runtime.path" and "/" in value and not value.startswith("/"):
            relative = True  # a bare name is looked up in PATH; a relative path is not
        if relative:
            raise HookError(f"config {path}: {name} must be an absolute path, not {short(value)}")


def did_you_mean(name: str, choices: list[str] | None = None) -> str:
    """"; did you mean 'x'?" for a misspelled key (dotted, or a bare key that belongs in a
    section), or "". Only on the error path: difflib is not imported by a good start."""
    import difflib

    keys = list(TYPES) if choices is None else choices
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    if not close and "." not in name:  # `timeout` at the top level, or under the wrong table
        close = [k for k in keys if k.rsplit(".", 1)[-1] == name][:1]
    if not close and "." in name:
        leaf = name.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1, cutoff=0.6)
        close = [k for k in keys if close and k.rsplit(".", 1)[-1] == close[0]][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


def root_problems(root: str) -> list[str]:
    """Why `root` does not look like the root of a host with the NVIDIA driver: missing, no
    /proc/driver/nvidia (the kernel module is not loaded there), no driver library in the usual
    library directories. Empty when it does. For `nvhook config check`, never the start path."""
    path = os.path.abspath(root or "/")
    if not os.path.isdir(path):
        return [f"{show(path)} does not exist or isn't a directory"]
    problems = []
    if not os.path.isdir(os.path.join(path, "proc/driver/nvidia")):
        problems.append(f"{show(path)} has no proc/driver/nvidia (the NVIDIA kernel module is not loaded there)")
    libdirs = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib64",
               "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu", "usr/local/nvidia/lib64")
    found = False
    for d in libdirs:
        try:
            names = os.listdir(os.path.join(path, d))
        except OSError:
            continue
        if any(n.startswith(("libcuda.so", "libnvidia-ml.so")) for n in names):
            found = True
            break
    if not found:
        problems.append(f"no NVIDIA driver library (libcuda.so, libnvidia-ml.so) under {show(path)} in "
                        f"{', '.join('/' + d for d in libdirs)}")
    return problems


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


def _check_capability_list(path: str, name: str, value: str) -> None:
    from .catalog import CAPABILITIES

    tokens = [t.strip().lower() for t in value.split(",") if t.strip()]
    unknown = [t for t in tokens if t not in CAPABILITIES and t != "all"]
    if unknown or not tokens:
        raise HookError(f"config {path}: {name} must be \"all\" or a comma-separated list of "
                        f"{', '.join(CAPABILITIES)}, not {short(value)}")


def _parse(path: str, stdin_ok: bool = False) -> dict:
    from . import tomlread
    from .configscan import NotAConfigFile, read_config

    try:
        raw = tomlread.loads(read_config(path, stdin_ok).decode())
    except NotAConfigFile as e:
        raise HookError(f"config {show(path)}{link_note(path)} {e}: {e.hint}") from None
    except tomlread.TOMLDecodeError as e:
        raise HookError(f"config {show(path)} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise HookError(f"config {show(path)} is not valid TOML: not UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:  # integers too long for int(), nesting too deep
        raise HookError(f"config {show(path)} is not valid TOML: {type(e).__name__}: {e}") from None
    except OSError as e:
        raise HookError(f"cannot read config {show(path)}: {e.strerror}") from None
    return merge(raw, show(path))


def link_note(path: str) -> str:
    """" (-> WHERE)" when `path`'s links lead elsewhere, for a message about what is there."""
    real = os.path.realpath(path)
    return f" (-> {show(real)})" if real != os.path.abspath(path) else ""


def cache_usable(directory: str) -> bool:
    """Whether caches in `directory` can be trusted (see `cache_problem`)."""
    return cache_problem(directory) is None


def cache_problem(directory: str) -> str | None:
    """Why caches in `directory` cannot be trusted, or None when they can: the directory and
    every directory above it must be owned by root (or by whoever runs nvhook) and writable by
    nobody else, so that no one else can swap a cache file or a directory on the way (a forged
    inventory would choose what is mounted into containers). A sticky world-writable directory
    on the way (/tmp) is accepted: others cannot rename or remove what they do not own in it. A
    symlink on the way must be owned by root (or nvhook's user) too, and where it leads is
    checked the same way. In a user namespace (a rootless engine's hook, which serves only its
    user's own containers with that user's rights) the directories above the cache may show the
    overflow uid: the host's root, whom the namespace cannot name (base/userns.py)."""
    if not directory:
        return "no cache_dir"
    try:
        path = os.path.abspath(directory)
        problem, linked = _chain_problem(path)
        if problem is None and linked:
            problem, _ = _chain_problem(os.path.realpath(path))
        return problem
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or str(e)


def _chain_problem(path: str) -> tuple[str | None, bool]:
    """(what is wrong with a component of the absolute `path`, or None; whether one of them is
    a symlink, so that the caller checks where it leads)."""
    me = os.geteuid()
    parts = [p for p in path.split("/") if p]
    cur = ""
    linked = False
    for i, part in enumerate(parts):
        cur += "/" + part
        st = os.lstat(cur)
        if st.st_uid not in (0, me) and not (i < len(parts) - 1 and st.st_uid == _overflow_uid()):
            return f"{show(cur)} is owned by uid {st.st_uid}", linked
        if stat.S_ISLNK(st.st_mode):
            linked = True  # its mode means nothing; its directory was checked one step up
            continue
        if i == len(parts) - 1:
            if not stat.S_ISDIR(st.st_mode):
                return f"{show(cur)} is not a directory", linked
            if st.st_uid != me:  # root's, and this is not root: it could not write the cache either
                return f"{show(cur)} is root's, not this process's (uid {me})", linked
            if st.st_mode & 0o022:
                return f"{show(cur)} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})", linked
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{show(cur)} (above the cache) is writable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o})"), linked
    return None, linked


def _overflow_uid() -> int | None:
    """base/userns.py's, imported only for a directory someone else owns: the resident
    client reads its config cache through cache_problem and imports nothing more."""
    from .userns import overflow_uid

    return overflow_uid()


def located(path: str | None, explicit: bool) -> tuple[str, bool]:
    if path is None:
        path = os.environ.get("NVHOOK_CONFIG") or DEFAULT_PATH
        # The shipped hooks file names the default path: absent, it means the defaults there too.
        explicit = explicit or path != DEFAULT_PATH
    return path, explicit


def load_cached(path: str | None) -> dict | None:
    """The effective config when knowing it costs no parsing: the defaults (no file at the
    default path) or the file's valid cache entry; None when `load` has more to do (parse the
    file, or report it missing or broken). For the resident client (nvhook/start/client.py)."""
    path, explicit = located(path, path is not None)
    try:
        st = os.stat(path)
    except OSError:
        return None if explicit else _defaults()
    return _read_cache(run_dir(), _ident(path, st))


def load(path: str | None, explicit: bool) -> dict:
    """The effective config. A missing default file means defaults; a missing explicit one is an error."""
    path, explicit = located(path, explicit)
    try:
        st = os.stat(path)
    except OSError as e:
        if explicit:
            raise HookError(f"cannot read config {show(path)}: {e.strerror}") from None
        return _defaults()
    ident = _ident(path, st)
    cache_dir = run_dir()
    cached = _read_cache(cache_dir, ident)
    if cached is not None:
        return cached
    cfg = _parse(path)
    if cfg["cache_dir"]:  # "" means no caches at all
        _write_cache(cache_dir, ident, cfg)
    return cfg


def _ident(path: str, st: os.stat_result) -> list:
    """The cache key of the config file `path`. Its ctime too, not only its mtime: an edit in
    place (same inode) to the same size with the mtime set back (cp -p, rsync -t --inplace,
    tools that pin every mtime for reproducibility) would otherwise leave the old config,
    [daemon] mode and socket included, cached until reboot; no program can set a ctime."""
    return [os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def run_dir() -> str:
    """Where the parsed config is cached: /run/nvhook, or NVHOOK_RUN_DIR (tests)."""
    return os.environ.get("NVHOOK_RUN_DIR") or DEFAULTS["cache_dir"]


def check_file(path: str) -> dict:
    """Parse and validate `path` without any cache (`nvhook config check`; its standard input
    piped in, as /dev/stdin, too)."""
    return _parse(path, stdin_ok=True)


def cache_file_name(prefix: str, path: str) -> str:
    """The cache file in cache_dir for what `path` names (a config file, a host root): one
    file per path, its name made of the path's letters and digits."""
    safe = "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))[-100:]
    return f"{prefix}{safe}.json"


def _cache_name(ident: list) -> str:
    # One file per config path: hosts where runc and podman name different configs would
    # otherwise take turns overwriting a single entry and both re-parse every time.
    return cache_file_name("config", ident[0])


def _read_cache(cache_dir: str, ident: list) -> dict | None:
    if not cache_dir or not cache_usable(cache_dir):
        return None
    try:
        with open(os.path.join(cache_dir, _cache_name(ident)), "rb") as f:
            data = json.loads(f.read())
        if data.get("ident") == ident:
            cfg: dict = _with_new_keys(data["config"])
            return cfg
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _with_new_keys(cfg: dict) -> dict:
    """A config cached by an older nvhook lacks the keys added since (the file, and so the
    cache's key, did not change with the upgrade): their defaults."""
    for key, value in DEFAULTS.items():
        if isinstance(value, dict):
            section = cfg.setdefault(key, {})
            for sub, v in value.items():
                section.setdefault(sub, v)
        else:
            cfg.setdefault(key, value)
    return cfg


def _write_cache(cache_dir: str, ident: list, cfg: dict) -> None:
    write_json_atomic(cache_dir, _cache_name(ident), {"ident": ident, "config": cfg})


def write_json_atomic(directory: str, name: str, data: object) -> bool:
    """Best effort: a cache that cannot be written only costs time."""
    if not directory:
        return False
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not cache_usable(directory):
            return False
        tmp = os.path.join(directory, f".{name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.rename(tmp, os.path.join(directory, name))
        return True
    except OSError:
        return False
