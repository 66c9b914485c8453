"""Configuration: defaults, the TOML file, and validation.

tomllib costs ~12 ms to import here (it pulls in re, typing and enum), half of the hook's whole
overhead, so the parsed and validated config is cached as JSON, keyed by the file's identity
(path, inode, size, mtime); a changed file is always re-read. That cache must be found before
the file is read, so it is always in /run/nvhook (the default cache_dir), one file per config
path, whatever cache_dir the file names; cache_dir = "" turns it off with every other cache.
"""

from __future__ import annotations

from . import jsonfast as json
import os

from .errors import HookError, short, show

DEFAULT_PATH = "/etc/nvhook/hook.toml"

DEFAULTS: dict = {
    "root": "/",
    "log_file": "/var/log/nvhook.log",
    "log_level": "info",
    "cache_dir": "/run/nvhook",
    "devices": {
        "accept_envvar_unprivileged": True,
        "accept_volume_mounts": False,
        "volume_mounts_root": "/var/run/nvidia-container-devices",
    },
    "nvml": {"enabled": True, "timeout": 5.0},
    "compat": {"mode": "auto", "allow_env_override": True},
    "ldconfig": {"path": "builtin", "timeout": 10.0},
    "runtime": {"path": "runc"},
    "daemon": {"mode": "auto", "socket": "/run/nvhook/nvhookd.sock", "timeout": 2.0},
}

_TYPES = {
    "root": str, "log_file": str, "log_level": str, "cache_dir": str,
    "devices.accept_envvar_unprivileged": bool, "devices.accept_volume_mounts": bool,
    "devices.volume_mounts_root": str,
    "nvml.enabled": bool, "nvml.timeout": (int, float),
    "compat.mode": str, "compat.allow_env_override": bool,
    "ldconfig.path": str, "ldconfig.timeout": (int, float),
    "runtime.path": str,
    "daemon.mode": str, "daemon.socket": str, "daemon.timeout": (int, float),
}
_CHOICES = {
    "log_level": ("debug", "info", "warning", "error"),
    "compat.mode": ("auto", "image", "host"),
    "daemon.mode": ("auto", "off", "required"),
}


def _defaults() -> dict:
    """A deep copy of DEFAULTS (plain JSON data) to fill in."""
    return json.loads(json.dumps(DEFAULTS))


def _merge(raw: dict, path: str) -> dict:
    cfg = _defaults()
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in DEFAULTS or not isinstance(DEFAULTS[key], dict):
                raise HookError(f"config {path}: unknown section [{show(key)}]")
            for sub, v in value.items():
                _check(f"{key}.{sub}", v, path)
                cfg[key][sub] = v
        else:
            _check(key, value, path)
            cfg[key] = value
    return cfg


def _check(name: str, value, path: str) -> None:
    want = _TYPES.get(name)
    if want is None:
        raise HookError(f"config {path}: unknown key {name!r}")
    if isinstance(value, bool) and want is not bool and bool not in (want if isinstance(want, tuple) else (want,)):
        raise HookError(f"config {path}: {name} must be a number, not {short(value)}")
    if not isinstance(value, want):
        raise HookError(f"config {path}: {name} has the wrong type: {short(value)}")
    if isinstance(value, str) and any(ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029" for c in value):
        # A NUL makes every os call on the path raise; newlines would break one-line messages.
        raise HookError(f"config {path}: {name} contains control characters: {short(value)}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise HookError(f"config {path}: {name} must be one of {', '.join(_CHOICES[name])}, not {short(value)}")
    if name == "daemon.socket" and not value.startswith("/"):
        raise HookError(f"config {path}: daemon.socket must be an absolute path, not {short(value)}")
    if name.endswith("timeout") and not 0 < value <= 600:
        raise HookError(f"config {path}: {name} must be between 0 and 600 seconds, not {short(value)}")


def _parse(path: str) -> dict:
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise HookError(f"config {show(path)} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise HookError(f"config {show(path)} is not valid TOML: not UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:  # integers too long for int(), nesting too deep
        raise HookError(f"config {show(path)} is not valid TOML: {type(e).__name__}: {e}") from None
    except OSError as e:
        raise HookError(f"cannot read config {show(path)}: {e.strerror}") from None
    return _merge(raw, show(path))


def cache_usable(directory: str) -> bool:
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def load(path: str | None, explicit: bool) -> dict:
    """The effective config. A missing default file means defaults; a missing explicit one is an error."""
    if path is None:
        path = os.environ.get("NVHOOK_CONFIG") or DEFAULT_PATH
        explicit = explicit or "NVHOOK_CONFIG" in os.environ
    try:
        st = os.stat(path)
    except OSError as e:
        if explicit:
            raise HookError(f"cannot read config {show(path)}: {e.strerror}") from None
        return _defaults()
    ident = [os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns]
    cache_dir = DEFAULTS["cache_dir"]
    cached = _read_cache(cache_dir, ident)
    if cached is not None:
        return cached
    cfg = _parse(path)
    if cfg["cache_dir"]:  # "" means no caches at all
        _write_cache(cache_dir, ident, cfg)
    return cfg


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
        if data.get("ident") == ident and _complete(data["config"]):
            return data["config"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _complete(cfg: dict) -> bool:
    """A cached config written by an older nvhook may lack keys added since: parse again."""
    return all(k in cfg and (not isinstance(v, dict) or all(sub in cfg[k] for sub in v)) for k, v in DEFAULTS.items())


def _write_cache(cache_dir: str, ident: list, cfg: dict) -> None:
    write_json_atomic(cache_dir, _cache_name(ident), {"ident": ident, "config": cfg})


def write_json_atomic(directory: str, name: str, data) -> bool:
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
