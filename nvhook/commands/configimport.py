"""`nvhook config import [FILE]`: NVIDIA Container Toolkit's config.toml (1.17 to 1.20) as an
nvhook config. Each key of NVIDIA's that has a meaning here becomes nvhook's key; each one that
has none is left out with one line saying why (docs/migrating-from-nvidia-toolkit.md lists both).
The text printed is checked as `nvhook config check` checks a file before it is printed.
"""

from __future__ import annotations

import shutil

from ..base import config as config_mod
from ..base.errors import HookError, short, show
from .configset import toml_value

NVIDIA_DEFAULT_PATH = "/etc/nvidia-container-runtime/config.toml"

# NVIDIA's keys (dotted by table) that nvhook has a key for, and that key.
SAME_MEANING = {
    "accept-nvidia-visible-devices-envvar-when-unprivileged": "devices.accept_envvar_unprivileged",
    "accept-nvidia-visible-devices-as-volume-mounts": "devices.accept_volume_mounts",
    "disable-require": "request.disable_require",
    "supported-driver-capabilities": "request.supported_driver_capabilities",
    "swarm-resource": "request.swarm_resource",
    "nvidia-container-cli.root": "root",
    "nvidia-container-runtime.log-level": "log_level",
    "nvidia-container-runtime.runtimes": "runtime.path",
    "nvidia-container-runtime.modes.legacy.cuda-compat-mode": "compat.mode",
    "features.disable-cuda-compat-lib-hook": "compat.mode",
    "features.allow-cuda-compat-libs-from-container": "compat.mode",
    "features.ignore-imex-channel-requests": "request.ignore_imex_channel_requests",
}

# NVIDIA's keys nvhook has nothing for, and why.
NO_MEANING = {
    "nvidia-container-cli.load-kmods": "nvhook never loads kernel modules: load the driver's on the host "
                                       "(its systemd units or nvidia-persistenced do)",
    "nvidia-container-cli.user": "nvhook runs as the runtime runs it and switches to no other user",
    "nvidia-container-cli.no-cgroups": "it is for rootless engines, where a hook cannot write device cgroups; "
                                       "nvhook does not support GPU containers there, and through CDI or "
                                       "nvhook-runtime the runtime sets the device cgroup itself",
    "nvidia-container-cli.no-pivot": "nvhook never pivots into the container's root: it works in it by fd",
    "nvidia-container-cli.path": "nvhook has no nvidia-container-cli: it injects the driver itself",
    "nvidia-container-cli.environment": "nvhook has no nvidia-container-cli to pass an environment to",
    "nvidia-container-cli.debug": "nvhook's one log, for every door, is log_file (/var/log/nvhook.log by "
                                  "default), always on, as JSON lines",
    "nvidia-container-cli.ldcache": "nvhook writes each container's /etc/ld.so.cache itself",
    "nvidia-container-cli.ldconfig": "nvhook writes the container's ld.so.cache itself and runs no program "
                                     "(ldconfig.path = \"builtin\"); set ldconfig.path to this value only to "
                                     "run that ldconfig instead",
    "nvidia-container-runtime.debug": "nvhook's one log, for every door, is log_file (/var/log/nvhook.log by "
                                      "default), always on, as JSON lines",
    "nvidia-container-runtime.mode": "nvhook has no runtime modes: the hook, nvhook-runtime and NRI all inject "
                                     "from NVIDIA_VISIBLE_DEVICES and CDI names; specs come from `nvhook cdi "
                                     "generate`",
    "nvidia-container-runtime.modes.cdi.spec-dirs": "nvhook's runtime reads no CDI spec directories (the engine "
                                                    "does); nvhook's own spec is cdi.spec",
    "nvidia-container-runtime.modes.cdi.default-kind": "nvhook serves the kinds nvidia.com/gpu and "
                                                       "runtime.nvidia.com/gpu only",
    "nvidia-container-runtime.modes.cdi.annotation-prefixes": "nvhook reads the cdi.k8s.io/ annotations only",
    "nvidia-container-runtime.modes.csv.mount-spec-path": "Jetson (CSV mode) is not supported by nvhook",
    "nvidia-container-runtime.modes.csv.compat-container-root": "Jetson (CSV mode) is not supported by nvhook",
    "nvidia-container-runtime.modes.jit-cdi.nvcdi-feature-flags": "nvhook generates no spec at container start: "
                                                                  "it injects directly",
    "nvidia-container-runtime.modes.jit-cdi.nvcdi-disable-hooks": "nvhook generates no spec at container start: "
                                                                  "it injects directly",
    "nvidia-container-runtime-hook.path": "nvhook's hook is `nvhook` itself (`nvhook setup` installs it)",
    "nvidia-container-runtime-hook.skip-mode-detection": "nvhook has no runtime modes to detect",
    "nvidia-ctk.path": "nvhook's CDI specs run nvhook's own hook (`nvhook cdi generate --hook-path`)",
    "features.allow-ldconfig-from-container": "nvhook never runs the container's ldconfig",
    "features.allow-unknown-oci-spec-fields": "nvhook-runtime keeps every config.json field it does not change",
    "features.disable-imex-channel-creation": "nvhook creates no device node (IMEX channels included) unless "
                                              "devices.create_missing_nodes = true",
    "features.no-additional-gids-for-device-nodes": "nvhook's CDI specs carry additionalGids only where a "
                                                    "non-root user needs them; `nvhook cdi generate "
                                                    "--cdi-version 0.6.0` leaves them out",
}

# NVIDIA's keys nvhook has nothing for, at the value that means what nvhook does anyway: carried
# over without a word.
AS_NVHOOK_DOES = {
    "nvidia-container-cli.environment": [],
    "nvidia-container-cli.no-cgroups": False,
    "nvidia-container-cli.no-pivot": False,
    "nvidia-container-runtime.modes.cdi.default-kind": "nvidia.com/gpu",
    "nvidia-container-runtime.modes.cdi.annotation-prefixes": ["cdi.k8s.io/"],
    "nvidia-container-runtime-hook.skip-mode-detection": False,
    "features.allow-ldconfig-from-container": False,
    "features.allow-unknown-oci-spec-fields": True,
    "features.disable-imex-channel-creation": True,
    "features.no-additional-gids-for-device-nodes": False,
}

# NVIDIA's tables (whose keys are listed above one by one).
TABLES = ("nvidia-container-cli", "nvidia-container-runtime", "nvidia-container-runtime.modes",
          "nvidia-container-runtime.modes.cdi", "nvidia-container-runtime.modes.csv",
          "nvidia-container-runtime.modes.jit-cdi", "nvidia-container-runtime.modes.legacy",
          "nvidia-container-runtime-hook", "nvidia-ctk", "features")

# NVIDIA's log levels (logrus) as nvhook's.
_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warning", "warning": "warning",
           "error": "error", "fatal": "error", "panic": "error"}
_COMPAT = {"disabled": "host", "ldconfig": "auto", "mount": "auto", "hook": "auto"}


class _Skip(Exception):
    """A key whose value cannot be carried over: the reason."""


# NVIDIA's deepest key is 4 tables down (nvidia-container-runtime.modes.cdi.spec-dirs): a table
# deeper than this is no key of NVIDIA's, reported whole, and no file's nesting can exhaust the
# interpreter's stack.
MAX_DEPTH = 8


def flatten(table: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, object]]:
    """(dotted key, value) for every key of `table` that is not itself a table, in file order
    (a table nested past MAX_DEPTH counts as a value)."""
    out: list[tuple[str, object]] = []
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth < MAX_DEPTH:
            out += flatten(value, name + ".", depth + 1)
        else:
            out.append((name, value))
    return out


def _table(raw: dict, *keys: str) -> dict:
    """raw[k1][k2]..., {} where a step is missing or is not a table."""
    found: object = raw
    for k in keys:
        found = found.get(k) if isinstance(found, dict) else None
    return found if isinstance(found, dict) else {}


def _runtime_path(value: object) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _Skip("is not a list of runtime names")
    # nvhook-runtime wraps one runtime: the first of NVIDIA's candidates this host has, as
    # NVIDIA's runtime would pick it here.
    return next((v for v in value if shutil.which(v)), value[0])


def _convert(key: str, value: object, raw: dict) -> object:
    """nvhook's value for NVIDIA's `key` = `value` (`raw`: the whole file, for keys that
    depend on another)."""
    if key == "nvidia-container-runtime.log-level":
        if not isinstance(value, str) or value.lower() not in _LEVELS:
            raise _Skip(f"is not a log level ({', '.join(_LEVELS)})")
        return _LEVELS[value.lower()]
    if key == "nvidia-container-runtime.runtimes":
        return _runtime_path(value)
    if key == "nvidia-container-runtime.modes.legacy.cuda-compat-mode":
        if value not in _COMPAT:
            raise _Skip(f"is not one of {', '.join(_COMPAT)}")
        return _COMPAT[str(value)]
    if key.startswith("features.") and key in SAME_MEANING and not isinstance(value, bool):
        raise _Skip("is not true or false")
    legacy_mode = _table(raw, "nvidia-container-runtime", "modes", "legacy")
    if key == "features.disable-cuda-compat-lib-hook":
        if "cuda-compat-mode" in legacy_mode:
            raise _Skip("is decided by nvidia-container-runtime.modes.legacy.cuda-compat-mode")
        return "host" if value else "auto"
    if key == "features.allow-cuda-compat-libs-from-container":
        if "cuda-compat-mode" in legacy_mode or _table(raw, "features").get("disable-cuda-compat-lib-hook") is not None:
            raise _Skip("is decided by the cuda-compat-mode or disable-cuda-compat-lib-hook set beside it")
        return "auto" if value else "host"
    if key == "nvidia-container-cli.root" and value in ("", "/"):
        return "/"
    return value


def translate(raw: dict) -> tuple[dict[str, tuple[object, str]], list[str]]:
    """({nvhook key: (value, NVIDIA's key it came from)}, one line per NVIDIA key left out)."""
    out: dict[str, tuple[object, str]] = {}
    dropped: list[str] = []
    for key, value in flatten(raw):
        if key in AS_NVHOOK_DOES and AS_NVHOOK_DOES[key] == value and type(value) is type(AS_NVHOOK_DOES[key]):
            continue
        if key in NO_MEANING:
            dropped.append(f"{key}: not carried over: {NO_MEANING[key]}")
            continue
        target = SAME_MEANING.get(key)
        if target is None:
            dropped.append(f"{show(key) if len(key) <= 200 else short(key)}: not carried over: not a key of "
                           "NVIDIA's config.toml (1.17 to 1.20)")
            continue
        try:
            new = _convert(key, value, raw)
            section, _, name = target.rpartition(".")
            config_mod.merge({section: {name: new}} if section else {name: new}, "the import")
        except _Skip as e:
            shown = toml_value(value) if isinstance(value, (bool, int, float)) else short(value)
            dropped.append(f"{key} = {shown}: not carried over: {e}")
            continue
        except HookError as e:
            dropped.append(f"{key}: not carried over: {e.message.replace('config the import: ', '')}")
            continue
        out[target] = (new, key)
    return out, dropped


def render(keys: dict[str, tuple[object, str]], source: str) -> str:
    """The nvhook config text: top-level keys, then each table, each key with the NVIDIA key it
    came from."""
    lines = [f"# nvhook config imported from NVIDIA Container Toolkit's {source} by `nvhook config import`.",
             "# Every key not named here keeps nvhook's default (`nvhook config default` explains each).", ""]
    sections: dict[str, list[str]] = {}
    for target, (value, origin) in keys.items():
        section, _, name = target.rpartition(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}  # {origin}")
    lines += sections.pop("", [])
    for section in sorted(sections, key=list(config_mod.DEFAULTS).index):
        lines += ["", f"[{section}]", *sections[section]]
    return "\n".join(lines).rstrip("\n") + "\n"


def import_file(path: str) -> tuple[str, list[str]]:
    """(the nvhook config for NVIDIA's config.toml at `path`, the lines for what was left out)."""
    from ..base import tomlread as tomllib
    from ..base.configscan import NotAConfigFile, read_config

    try:
        raw = tomllib.loads(read_config(path, stdin_ok=True).decode())
    except FileNotFoundError:
        raise HookError(f"no NVIDIA config at {show(path)} (name the file: nvhook config import FILE)") from None
    except NotAConfigFile as e:
        raise HookError(f"{show(path)}{config_mod.link_note(path)} {e}: name NVIDIA's config.toml "
                        "(nvhook config import FILE)") from None
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HookError(f"{show(path)} is not valid TOML: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer too long for int(), nesting too deep
        raise HookError(f"{show(path)} is not valid TOML: {type(e).__name__}: {e}") from None
    keys, dropped = translate(raw)
    text = render(keys, path)
    config_mod.merge(tomllib.loads(text), "the imported config")  # what config check accepts, or a bug
    return text, dropped


def check_hint(raw: dict, message: str) -> str:
    """For `config check` on a file in NVIDIA's layout: what to use instead of the NVIDIA key or
    table its error names, or "" when the error is about no NVIDIA key."""
    named = [k for k, _ in flatten(raw) if f"'{k}'" in message or f"'{k.split('.')[-1]}'" in message
             or f"[{k.split('.')[0]}]" in message]
    for key in named:
        if key in SAME_MEANING:
            return (f" ({key} is NVIDIA's key: nvhook's is {SAME_MEANING[key]}; `nvhook config import FILE` "
                    "converts NVIDIA's whole config.toml)")
        if key in NO_MEANING:
            return (f" ({key} is NVIDIA's key, which nvhook has no counterpart for: {NO_MEANING[key]}; "
                    "`nvhook config import FILE` converts NVIDIA's whole config.toml)")
    return ""


def nvidia_key_hint(path: str, message: str) -> str:
    """For `config check`'s error on `path`: when the key or table it names is NVIDIA Container
    Toolkit's (a config.toml of NVIDIA's checked as nvhook's), the nvhook key to use instead, as
    a clause to append; else ""."""
    from ..base import tomlread as tomllib
    from ..base.configscan import read_config

    try:
        raw = tomllib.loads(read_config(path, stdin_ok=True).decode())
    except (OSError, ValueError, RecursionError):  # NotAConfigFile and UnicodeDecodeError too
        return ""
    return check_hint(raw, message)
