"""nvhook.1, the manual page, made from the click commands themselves (their usage, help and
options), so that it cannot drift from what `nvhook --help` says. No dependency beyond click:

    python -m nvhook.commands.manpage [FILE]      (stdout without FILE)

packaging/build-deb installs it as /usr/share/man/man1/nvhook.1.gz.
"""

from __future__ import annotations

import sys
import time

import click

from .. import __version__


def _esc(text: str) -> str:
    """Text for roff: backslashes and option dashes escaped, no line starting with a control
    character ('.' or "'")."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in text.split("\n"):
        lines.append("\\&" + line if line[:1] in (".", "'") else line)
    return "\n".join(lines)


def _paragraphs(text: str) -> list[str]:
    """click's help text as paragraphs (a blank line separates them; the \\b marker of a
    paragraph click keeps as written is dropped)."""
    out = []
    for block in (text or "").strip().split("\n\n"):
        block = block.replace("\b\n", "").strip()
        if block:
            out.append(" ".join(line.strip() for line in block.split("\n")))
    return out


def _options(ctx: click.Context, command: click.Command) -> list[str]:
    lines = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        lines += [".TP", f"\\fB{_esc(names)}\\fR", _esc(help_text or "")]
    return lines


def _command(ctx: click.Context, command: click.Command, path: str, level: int) -> list[str]:
    lines = []
    if level:
        lines += [".SS" if level == 1 else ".TP", f"\\fB{_esc(path)}\\fR"]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += [".PP", f"\\fB{_esc(path)}\\fR {_esc(usage)}"]
    for para in _paragraphs(command.help or ""):
        lines += [".PP", _esc(para)]
    opts = _options(ctx, command)
    if opts:
        lines += [".PP", "Options:", ".RS", *opts, ".RE"]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            with click.Context(sub, info_name=name, parent=ctx) as sub_ctx:
                lines += _command(sub_ctx, sub, f"{path} {name}", level + 1)
    return lines


def render(date: str | None = None) -> str:
    from .cli import cli

    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    with click.Context(cli, info_name="nvhook") as ctx:
        summary = _paragraphs(cli.help or "")
        lines = [
            f'.TH NVHOOK 1 "{date}" "nvhook {__version__}" "User Commands"',
            ".SH NAME",
            "nvhook \\- give containers the host's NVIDIA driver (OCI hook, CDI specs, runtime wrapper)",
            ".SH SYNOPSIS",
            f"\\fBnvhook\\fR {_esc(' '.join(cli.collect_usage_pieces(ctx)))}",
            ".SH DESCRIPTION",
        ]
        for para in summary:
            lines += [".PP", _esc(para)]
        lines += [".SH OPTIONS", *_options(ctx, cli), ".SH COMMANDS"]
        for name in cli.list_commands(ctx):
            sub = cli.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            with click.Context(sub, info_name=name, parent=ctx) as sub_ctx:
                lines += _command(sub_ctx, sub, f"nvhook {name}", 1)
    lines += [
        ".SH FILES",
        ".TP", "\\fI/etc/nvhook/hook.toml\\fR",
        "The configuration (NVHOOK_CONFIG or \\-\\-config names another); \\fBnvhook config default\\fR "
        "prints every key with its default and why to change it.",
        ".TP", "\\fI/var/log/nvhook.log\\fR", "One JSON event per line.",
        ".SH SEE ALSO",
        "\\fBnvhook\\-runtime\\fR (the OCI runtime wrapper: \\fBnvhook\\-runtime \\-\\-help\\fR), "
        "\\fBnvhookd\\fR(8) (resident mode: \\fBnvhookd \\-\\-help\\fR), /usr/share/doc/nvhook/.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import os

    # SOURCE_DATE_EPOCH: a reproducible package build dates the page by its sources
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    date = time.strftime("%Y-%m-%d", time.gmtime(int(epoch))) if epoch and epoch.isdigit() else None
    text = render(date)
    if argv:
        with open(argv[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
