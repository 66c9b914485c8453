"""The engine's own reading of a config nvhook edited: containerd's `config dump` (its defaults,
the imported drop-ins and its version migrations applied, as the daemon will start) and Docker's
`dockerd --validate`. nvhook says an edit worked only when the engine reads it so; where the
engine's binary is not here (a config prepared for another machine) it says the edit is not
confirmed and how to check it there.

The binaries are the ones on PATH: `node install` runs `runtime configure` inside the node, so
that is the node's own containerd or dockerd.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from ..base.errors import show
from .tomledit import get_path

RUNC_V2 = "io.containerd.runc.v2"
# Where `config dump` shows the CRI runtimes: containerd 2.x (config version 3) and 1.x (2).
DUMP_CRI = (("plugins", "io.containerd.cri.v1.runtime"), ("plugins", "io.containerd.grpc.v1.cri"))


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def version_of(text: str) -> tuple[int, int] | None:
    """(major, minor) from `containerd --version` ("containerd github.com/containerd/containerd/v2
    v2.1.4 <commit>", a distribution's "1.7.24~ds1 1.7.24~ds1-6") or `dockerd --version`."""
    m = re.search(r"\sv?(\d+)\.(\d+)\.\d+", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def containerd_version() -> tuple[int, int] | None:
    """The version of the containerd on PATH; None where there is none (or it does not say)."""
    if not shutil.which("containerd"):
        return None
    r = _run(["containerd", "--version"])
    return version_of(r.stdout) if r is not None and r.returncode == 0 else None


def containerd_dump(path: str) -> tuple[dict | None, str]:
    """(containerd's merged config for `path`, "") or (None, why not): its first error line, or
    "" where no containerd is here to ask."""
    from ..base import tomlread

    if not shutil.which("containerd"):
        return None, ""
    r = _run(["containerd", "--config", path, "config", "dump"])
    if r is None:
        return None, "`containerd config dump` did not run"
    if r.returncode != 0:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f"`containerd config dump` exited {r.returncode}")[:300]
    try:
        return tomlread.loads(r.stdout), ""
    except tomlread.TOMLDecodeError as e:
        return None, f"`containerd config dump` printed no TOML ({e})"


def containerd_runtime_missing(dump: dict, name: str, runtime_path: str, set_default: bool) -> str | None:
    """What of nvhook's runtime containerd's dump lacks (None: all of it is there)."""
    for cri in DUMP_CRI:
        runtime = get_path(dump, (*cri, "containerd", "runtimes", name))
        if runtime is None:
            continue
        if runtime.get("runtime_type") != RUNC_V2:
            return f"runtime {name!r} has runtime_type {runtime.get('runtime_type')!r}, not {RUNC_V2!r}"
        binary = get_path(runtime, ("options", "BinaryName"))
        if binary != runtime_path:
            return f"runtime {name!r} has BinaryName {binary!r}, not {runtime_path!r}"
        default = get_path(dump, (*cri, "containerd", "default_runtime_name"))
        if set_default and default != name:
            return f"the default runtime is {default!r}, not {name!r}"
        return None
    return f"no runtime {name!r}"


def docker_validate(path: str) -> tuple[bool | None, str]:
    """(True, "") when `dockerd --validate` accepts `path`, (False, its complaint), or (None, why
    it could not be asked: no dockerd here, or one before 23.0 without --validate)."""
    if not shutil.which("dockerd"):
        return None, "no dockerd here"
    r = _run(["dockerd", "--validate", "--config-file", path])
    if r is None:
        return None, "`dockerd --validate` did not run"
    out = (r.stderr + r.stdout).strip()
    if r.returncode != 0 and "unknown flag: --validate" in out:
        return None, "this dockerd has no --validate (Docker 23.0 and later have)"
    if r.returncode != 0:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        return False, (lines[-1] if lines else f"exit {r.returncode}")[:300]
    return True, ""


def unconfirmed_line(engine: str, path: str, why: str) -> str:
    check = {"containerd": f"containerd --config {path} config dump",
             "docker": f"dockerd --validate --config-file {path}"}[engine]
    return f"{engine}: not confirmed by the engine ({why}): check on the node with `{show(check)}`\n"
