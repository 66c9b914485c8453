"""nvhook(1), written from the click commands themselves, so the man page says what `--help`
says and cannot go stale: every command, its usage, its help text and its options.

    python3 packaging/manpage.py [LIBDIR] [VERSION] > nvhook.1

LIBDIR is put first on sys.path (packaging/build-deb passes the package's /usr/lib/nvhook, which
holds nvhook and click). Plain man(7) macros, nothing of a man page generator package.
"""

from __future__ import annotations

import sys


def roff(text: str) -> str:
    """Text as roff input: backslashes escaped, hyphens as minus signs (so options can be
    searched and copied), no line starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def paragraphs(text: str) -> str:
    """click's help text (blank-line separated paragraphs) as .PP paragraphs."""
    import inspect

    out = []
    for para in inspect.cleandoc(text or "").split("\n\n"):
        para = " ".join(line.strip() for line in para.split("\n") if line.strip())
        if para:
            out.append(".PP\n" + roff(para))
    return "\n".join(out)


def options(ctx, command) -> str:
    import click

    out = []
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or param.name == "help":
            continue  # every command has --help; saying so each time is noise
        record = param.get_help_record(ctx)
        if record is None:
            continue
        opts, help_text = record
        out.append(f".TP\n\\fB{roff(opts)}\\fR\n{roff(help_text) or '.'}")
    return "\n".join(out)


def commands(ctx, group, prefix: str) -> list[str]:
    """One section per command, depth first, in the order `--help` lists them."""
    import click

    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        sub = click.Context(cmd, info_name=name, parent=ctx)
        path = f"{prefix} {name}"
        usage = " ".join(cmd.collect_usage_pieces(sub))
        body = [f'.SS "{roff(path)}"', f".B {roff(path)}", roff(usage), paragraphs(cmd.help or "")]
        opts = options(sub, cmd)
        if opts:
            body += [".RS", opts, ".RE"]
        out.append("\n".join(b for b in body if b))
        if isinstance(cmd, click.Group):
            out += commands(sub, cmd, path)
    return out


def manpage(version: str) -> str:
    import click

    from nvhook.commands.cli import cli

    ctx = click.Context(cli, info_name="nvhook")
    parts = [
        f'.TH NVHOOK 1 "" "nvhook {roff(version)}" "User Commands"',
        ".SH NAME",
        "nvhook \\- OCI runtime hook, CDI spec generator and operator commands that give "
        "containers the host's NVIDIA driver",
        ".SH SYNOPSIS",
        ".B nvhook\n[\\fIOPTIONS\\fR] [\\fBprestart\\fR|\\fBcreateRuntime\\fR] < \\fIOCI state\\fR",
        ".br\n.B nvhook\n[\\fIOPTIONS\\fR] \\fB\\-\\-dry\\-run\\fR \\fB\\-\\-bundle\\fR \\fIDIR\\fR",
        ".br\n.B nvhook\n[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".br\n.B nvhook\\-runtime\n[\\fIRUNTIME OPTIONS\\fR] \\fICOMMAND\\fR ...",
        ".br\n.B nvhookd\n[\\fIOPTIONS\\fR]",
        ".SH DESCRIPTION",
        paragraphs(cli.help or ""),
        paragraphs(
            "Registered with runc, crun or podman as a prestart hook, nvhook reads the container's "
            "state on stdin, finds the host driver's libraries, binaries, device nodes, IPC sockets "
            "and firmware, keeps what the container asked for (NVIDIA_VISIBLE_DEVICES, "
            "NVIDIA_DRIVER_CAPABILITIES), mounts it read-only into the container and writes the "
            "container's ld.so.cache. nvhook-runtime does the same for Docker, containerd and CRI-O "
            "as an OCI runtime wrapper; nvhookd keeps it resident. Errors are one line on stderr."),
        ".SH OPTIONS",
        options(ctx, cli),
        ".SH COMMANDS",
        *commands(ctx, cli, "nvhook"),
        ".SH EXIT STATUS",
        paragraphs("0 on success, 1 for an error (one line on stderr), 2 for a usage error, 130 when "
                   "interrupted. nvhook doctor: 0 the container should work or asks for no GPU, 3 the "
                   "hook would refuse it, 4 it starts but CUDA is predicted to fail, 1 doctor cannot tell."),
        ".SH ENVIRONMENT",
        ".TP\n.B NVHOOK_CONFIG\nThe config file, when \\-\\-config is not given.",
        ".TP\n.B NVHOOK_RUNTIME\nThe runtime nvhook\\-runtime runs (else runtime.path of the config).",
        ".TP\n.B NVHOOK_COMPAT_MODE\nIn a container: auto, image or host, where the config allows it.",
        ".SH FILES",
        ".TP\n.I /etc/nvhook/hook.toml\nThe config: every key, its default and why you would change it.",
        ".TP\n.I /var/log/nvhook.log\nOne JSON event per line for every decision.",
        ".TP\n.I /etc/cdi/nvhook.json\nThe CDI spec nvhook cdi generate usually writes.",
        ".TP\n.I /usr/share/containers/oci/hooks.d/nvhook.json\nThe OCI hooks file podman and CRI-O read.",
        ".SH SEE ALSO",
        paragraphs("/usr/share/doc/nvhook/README.md and /usr/share/doc/nvhook/docs/: install, every "
                   "engine, configuration, troubleshooting (docs/troubleshooting.md), migrating from "
                   "NVIDIA's Container Toolkit. runc(8), podman(1), docker(1)."),
    ]
    return "\n".join(p for p in parts if p) + "\n"


def main() -> int:
    if len(sys.argv) > 1:
        sys.path.insert(0, sys.argv[1])
    version = sys.argv[2] if len(sys.argv) > 2 else None
    if version is None:
        from nvhook import __version__ as version
    sys.stdout.write(manpage(version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
