"""How nvhook registers itself as a hook: its launcher, or the launcher's interpreter with -IS.

bin/nvhook asks for `#!python -IS` (see its comments: no PYTHON* variables, no `site`, ~4 ms
of every container start), but pip writes `#!/path/to/python` in its place when it installs
the script, dropping the flags; a registration can pass them back only by naming the
interpreter itself: path = that python, args = [python, "-IS", launcher, ...] (Python finds
its venv from that path; bin/nvhook then finds the venv's site-packages itself). The
registrations nvhook writes (`nvhook setup`'s OCI hooks file, nvhook-runtime's hook in
config.json) do that for a launcher of nvhook's whose #! line has lost its flags, and keep a
launcher that states its own (the Debian package's `#!/usr/bin/python3 -IS`) or that is not
nvhook's (a wrapper someone wrote: it may need `site`).
"""

from __future__ import annotations

import os

MARK = b"nvhook's launcher"  # in bin/nvhook's first comment line: a launcher that runs under -IS
FLAGS = "-IS"


def registration(launcher: str) -> tuple[str, list[str]]:
    """(path, argv before nvhook's own arguments) that run `launcher`."""
    plain = (launcher, [os.path.basename(launcher)])
    try:
        with open(launcher, "rb") as f:
            head = f.read(512)
    except OSError:
        return plain
    first, _, rest = head.partition(b"\n")
    if not first.startswith(b"#!/") or MARK not in rest:
        return plain
    interpreter = first[2:].strip()
    if b" " in interpreter or b"\t" in interpreter:  # flags of its own, or `env python`: as it is
        return plain
    python = os.fsdecode(interpreter)
    if not os.path.basename(python).startswith("python") or not os.access(python, os.X_OK):
        return plain
    return python, [python, FLAGS, launcher]


def names_launcher(path: str, args: list) -> str:
    """The launcher a registration runs: `path` itself, or for the interpreter form (python,
    -flags, launcher) the launcher."""
    if (len(args) >= 3 and isinstance(args[1], str) and args[1].startswith("-") and isinstance(args[2], str)
            and os.path.basename(path).startswith("python")):
        return args[2]
    return path
