"""nvidia-cdi-hook's command line, parsed as NVIDIA's hook parses it (urfave/cli: flags before
and after the subcommand, Go's boolean spellings, the same messages and exit codes), and the
environment it is allowed to see: hookmain.py runs what is parsed here."""

from __future__ import annotations

import os
import sys

NAME = "nvidia-cdi-hook"
LIST, STR, BOOL = "list", "str", "bool"
_SPEC = {"container-spec": STR}
COMMANDS: dict[str, dict[str, str]] = {
    "create-symlinks": {"link": LIST, **_SPEC},
    "update-ldcache": {"folder": LIST, "ldconfig-path": STR, **_SPEC},
    "enable-cuda-compat": {"host-driver-version": STR, "host-cuda-version": STR,
                           "cuda-compat-container-root": STR, **_SPEC},
    "disable-device-node-modification": dict(_SPEC),
    "chmod": {"path": LIST, "mode": STR, **_SPEC},
    "update-application-profile": dict(_SPEC),
    "create-soname-symlinks": {"folder": LIST, "ldconfig-path": STR, **_SPEC},
    "noop": {},
}
DEFAULTS = {"ldconfig-path": "/sbin/ldconfig", "cuda-compat-container-root": "/usr/local/cuda/compat"}
GLOBAL = {"debug": BOOL, "d": BOOL, "quiet": BOOL, "help": BOOL, "h": BOOL, "version": BOOL, "v": BOOL,
          "nvhook-config": STR}
_TRUE = ("1", "t", "T", "true", "TRUE", "True")  # Go's strconv.ParseBool
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class UsageError(Exception):
    """A bad command line for a known subcommand: NVIDIA's hook fails it with exit 1."""


class Unsupported(Exception):
    """No subcommand, or one this hook does not have: a warning, exit 0."""


def env_switches() -> tuple[bool, bool]:
    env = os.environ
    debug = any(env.get(k, "") in _TRUE for k in ("NVIDIA_CTK_DEBUG", "NVIDIA_CDI_DEBUG"))
    quiet = any(env.get(k, "") in _TRUE for k in ("NVIDIA_CTK_QUIET", "NVIDIA_CDI_QUIET"))
    return debug, quiet


def scrub_environment() -> None:
    """Drop everything the container could have put in this process's environment."""
    os.environ.clear()
    os.environ["PATH"] = SAFE_PATH


def _flags(args: list[str], known: dict[str, str], stop_at_positional: bool) -> tuple[dict, list[str]]:
    """Go flag-package parsing (what urfave/cli uses): -name or --name, a value as `=V` or the
    next argument, bool flags take only `=V`; parsing stops at `--` or, when asked, at the
    first argument that is not a flag."""
    values: dict = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return values, args[i + 1:]
        if not a.startswith("-") or a == "-":
            if stop_at_positional:
                return values, args[i:]
            i += 1
            continue
        body = a[2:] if a.startswith("--") else a[1:]
        name, eq, value = body.partition("=")
        kind = known.get(name)
        if kind is None or not name:
            raise UsageError(f"flag provided but not defined: -{name}")
        if kind == BOOL:
            if eq and value not in _TRUE + ("0", "f", "F", "false", "FALSE", "False"):
                raise UsageError(f'invalid boolean value "{value}" for -{name}')
            values[name] = (value in _TRUE) if eq else True
        else:
            if not eq:
                i += 1
                if i >= len(args):
                    raise UsageError(f"flag needs an argument: -{name}")
                value = args[i]
            if kind == LIST:
                values.setdefault(name, []).extend(value.split(","))  # urfave/cli splits slices on ","
            else:
                values[name] = value
        i += 1
    return values, []


def parse(argv: list[str]) -> tuple[dict, str, dict]:
    """(global flags, subcommand, its flags). Unsupported for NVIDIA's warning cases,
    UsageError for its error cases."""
    try:
        glob, rest = _flags(argv, GLOBAL, True)
    except UsageError as e:
        # NVIDIA's OnUsageError: an unknown flag before a recognised subcommand is an error,
        # before anything else (an unknown hook, none) the unsupported-hook warning.
        sub = _first_positional(argv)
        if sub in COMMANDS:
            raise
        raise Unsupported(sub) from e
    if glob.get("help") or glob.get("h") or glob.get("version") or glob.get("v"):
        return glob, "", {}
    if not rest:
        raise Unsupported("")
    sub, sub_args = rest[0], rest[1:]
    if sub not in COMMANDS:
        raise Unsupported(sub)
    opts, _ = _flags(sub_args, {**COMMANDS[sub], "help": BOOL, "h": BOOL}, True)
    for k, v in DEFAULTS.items():
        if k in COMMANDS[sub]:
            opts.setdefault(k, v)
    return glob, sub, opts


def _first_positional(argv: list[str]) -> str:
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("-"):
            name = a.lstrip("-")
            skip = GLOBAL.get(name) == STR  # its value follows ("--name=V" has no "=" match here)
        else:
            return a
    return ""


def usage() -> str:
    lines = [f"{NAME} (nvhook): NVIDIA's CDI hook command line, run by nvhook",
             f"usage: {NAME} [--debug] [--quiet] SUBCOMMAND [FLAGS]  (the OCI state on stdin)", "subcommands:"]
    for sub, flags in COMMANDS.items():
        shown = " ".join(f"--{f} V" + (" ..." if k == LIST else "") for f, k in flags.items() if f != "container-spec")
        lines.append(f"  {sub} {shown}".rstrip())
    return "\n".join(lines) + "\n"


class Out:
    """NVIDIA's hook logs to stderr at info (debug with --debug, errors only with --quiet);
    nvhook's events also go to its log file (config log_file)."""

    def __init__(self, debug: bool, quiet: bool):
        self.debug = debug and not quiet
        self.quiet = quiet

    def say(self, level: str, message: str) -> None:
        if level == "debug" and not self.debug:
            return
        if level in ("info", "warning") and self.quiet:
            return
        from ...base.errors import clean

        try:
            sys.stderr.write(f"{NAME} (nvhook): {level}: {clean(message)}\n")
            sys.stderr.flush()
        except OSError:
            pass
