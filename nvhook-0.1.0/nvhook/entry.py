"""The `nvhook` program's front door: which code a command line runs.

bin/nvhook (run as root by runc, crun and podman on every container start, and by people at a
shell) enters here. Hook mode, the only form an engine uses, goes to nvhook.start: first the
resident client (a start nvhookd serves imports nothing more), then the hook in this process.
Every other command line is a person's command and goes to nvhook.commands, whose click and
structlog imports the start path never pays for (tests/test_layers.py keeps it so).
"""

import os
import sys


def main(argv: "list[str] | None" = None) -> int:
    exit_now = argv is None  # bin/nvhook: skip the interpreter's teardown once the hook is done
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cdi-hook"]:
        # NVIDIA's CDI hook command line (what bin/nvidia-cdi-hook runs), before anything reads
        # the environment: it may be the container's.
        from .start import cdihook

        return cdihook.main(argv[1:])
    from .start import client

    # Shell completion (`_NVHOOK_COMPLETE=bash_source nvhook`) runs with no arguments, which
    # would otherwise be hook mode.
    opts = None if "_NVHOOK_COMPLETE" in os.environ else client.parse_hook_argv(argv)
    if opts is None:
        if "cdi" in argv and "generate" in argv:
            from .commands import cdifast  # without click and structlog (~3/4 of its time)

            code = cdifast.main(argv)
            if code is not None:
                return code
        from .commands.cli import run

        try:
            return run(argv)
        except KeyboardInterrupt:
            sys.stderr.write("nvhook: interrupted\n")
            return 130
    handoff = None
    if client.servable(opts):
        code, handoff = client.serve(opts)
        if code is not None:
            if not exit_now:
                return code
            try:  # no interpreter teardown for the container to wait for
                sys.stderr.flush()
            finally:
                os._exit(code)
    from .start import hook

    return hook.run(opts, handoff, exit_now)
