#!python -IS
# nvhook's `nvidia-cdi-hook`: NVIDIA's CDI hook command line (nvhook/start/cdihook/), run as
# root by runc/crun as a createContainer hook of specs written by NVIDIA's tools. The flags are
# bin/nvhook's (see its comments: -I no PYTHON* variables, no user site; -S no `site`).
#
# The python stage: run by the shell first stage (nvhook/data/nvidia-cdi-hook.sh), or directly,
# under a set-group-ID copy of python3 (this #! line as each install path writes it: the .deb's
# /usr/lib/nvhook/libexec/python3, node install's /opt/nvhook/libexec/python3, `nvhook setup`'s
# /usr/local/lib/nvhook/libexec/python3). When the spec's hook entry has no `env`, runc runs the
# hook with the container's environment: its LD_PRELOAD would be loaded into a dynamically linked
# interpreter before a line of this file runs (CVE-2025-23266 in NVIDIA's hook). Executing a
# set-group-ID file that changes the effective gid makes the kernel set AT_SECURE for the new
# program, root or not; glibc's loader then ignores LD_PRELOAD (and LD_LIBRARY_PATH, LD_AUDIT...)
# and removes them from the environment. The first thing done here is to take back the real gid
# (root's), so files nvhook creates in the container belong to root as before. Why everyone may
# have the copies' group: nvhook/commands/hookgroup.py. bin/nvidia-cdi-hook of the source tree is
# this file (the wheel installs the shell first stage under that name instead).
import os
import sys

_g = os.getgid()
if os.getegid() != _g:
    os.setresgid(_g, _g, _g)
del _g

_v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
_here = os.path.dirname(os.path.realpath(__file__))
# nvhook's modules: next to this file in the .deb (/usr/lib/nvhook/bin -> /usr/lib/nvhook), or
# the site-packages of the venv this file is in (pip), or of the interpreter's prefix.
_lib = [os.path.dirname(_here), f"{os.path.dirname(_here)}/lib/{_v}/site-packages",
        f"{sys.prefix}/lib/{_v}/site-packages"]
sys.path += [d for d in _lib if os.path.isdir(d)]


def _main():
    import nvhook
    from nvhook.base import modbundle

    modbundle.install(nvhook.__path__[0])
    from nvhook.start.cdihook import main

    return main


try:
    main = _main()
except ImportError:
    for d in _lib:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".pth"))
        except OSError:
            continue
        for n in names:
            with open(f"{d}/{n}", encoding="utf-8") as f:
                sys.path += [ln.rstrip() for ln in f if ln.startswith("/") and os.path.isdir(ln.rstrip())]
    main = _main()

sys.exit(main())
