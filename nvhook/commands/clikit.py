"""What every nvhook command shares: the context (config, root, log), the --format and
global options, and the one-line failure."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import click

from ..base import config as config_mod
from ..base.errors import HookError, clean
from ..base.log import LEVELS, EventLog, message

FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default=None,
                      help="Output format [default: nvhook --format, else text].")


def fmt_of(fmt: str | None) -> str:
    """A subcommand's --format, else the one given before the subcommand, else text."""
    if fmt:
        return fmt
    parent = click.get_current_context().find_root()
    return parent.params.get("fmt") or "text"



class Ctx:
    def __init__(self, config_path, root, log_file, log_level):
        self.root_opt, self.log_file, self.log_level = root, log_file, log_level
        self._config_path = config_path
        self._cfg = None

    @property
    def config_path(self):
        return self._config_path

    @config_path.setter
    def config_path(self, value) -> None:
        self._config_path, self._cfg = value, None

    @property
    def cfg(self) -> dict:
        if self._cfg is None:
            self._cfg = config_mod.load(self.config_path, explicit=self.config_path is not None)
        return self._cfg

    @property
    def root(self) -> str:
        from ..start.pipeline import root_from

        return root_from(self.root_opt, self.cfg)

    def observe(self, log: EventLog) -> dict:
        """The host inventory under --root, through the configured cache."""
        from ..observe import host

        return host.observe(self.root, self.cfg["cache_dir"], log)

    def log(self) -> EventLog:
        """Interactive commands log to stderr only: a --dry-run or doctor run at a terminal must
        not land in the production log among real container starts. --log-file asks for a file."""
        level = self.log_level or self.cfg["log_level"]
        log = EventLog(level, self.log_file or None)
        log.bind(interactive=True)
        log.sinks.append(_console_sink(level))
        return log


def _console_sink(level: str):
    """Echo warnings (or everything at debug level) to stderr through structlog's console renderer."""
    import structlog

    # https://no-color.org: a set, non-empty NO_COLOR turns colours off.
    colors = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    render = structlog.dev.ConsoleRenderer(colors=colors)
    # a person at a terminal sees warnings and errors, and everything when debugging
    threshold = LEVELS["debug"] if level == "debug" else max(LEVELS[level], LEVELS["warning"])

    def sink(ev: dict) -> None:
        if LEVELS.get(ev["level"], 20) >= threshold:
            if level == "debug":
                fields = {k: v for k, v in ev.items() if k not in ("ts", "interactive")}
            else:  # a person reads the sentence; the fields are in --log-file or at debug level
                fields = {"level": ev["level"], "event": ev["event"], "message": message(ev)}
            sys.stderr.write(render(None, ev["level"], fields) + "\n")
    return sink


def global_options(f):
    """--config, --root, --log-file, --log-level (and --format) accepted after the subcommand
    too: `nvhook info --root X` means `nvhook --root X info`."""
    def store(name: str):
        def callback(ctx: click.Context, _param: click.Parameter, value):
            if value is not None and ctx.obj is not None:
                setattr(ctx.obj, name, value)
            return value
        return callback

    opts = [
        click.option("--config", "_config", metavar="FILE", expose_value=False, callback=store("config_path"),
                     help="As nvhook --config."),
        click.option("--root", "_root", metavar="DIR", expose_value=False, callback=store("root_opt"),
                     help="As nvhook --root."),
        click.option("--log-file", "_log_file", metavar="FILE", expose_value=False, callback=store("log_file"),
                     help="As nvhook --log-file."),
        click.option("--log-level", "_log_level", type=click.Choice(list(LEVELS)), expose_value=False,
                     callback=store("log_level"), help="As nvhook --log-level."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f
def printable(text: str) -> str:
    """Text output for a terminal: image paths, link targets and reasons quoted in it carry no
    control characters (each line cleaned; the newlines between them kept)."""
    if text.isprintable():
        return text
    # A name's bytes that are not UTF-8 come as lone surrogates, written back as those bytes:
    # 0x9b is CSI to a terminal that reads C1 controls as 8-bit bytes. Each one is a "?".
    return "\n".join(clean(line) for line in text.split("\n")).encode("utf-8", "replace").decode("utf-8")


def emit(fmt: str, data, text: Callable[[Any], str]) -> None:
    """A command's result on stdout: one JSON document, or `text(data)` (which ends in its own
    newline) cleaned for a terminal."""
    from .render import to_json

    click.echo(to_json(data) if fmt == "json" else printable(text(data)), nl=fmt == "json")


def fail(e: HookError):
    click.echo(f"nvhook: {e.message}", err=True)
    sys.exit(e.code)


class Interrupted(Exception):
    """Ctrl-C, carried past click (which would print a blank line first) to main's one line."""

def cdi_global_args(c: Ctx) -> list[str]:
    from ..start.cdispecs import global_args

    return global_args(c.config_path, c.root_opt)
