"""nvhook's nvidia-cdi-hook as the .deb lays it out, for tests: a venv-shaped directory whose
bin/nvidia-cdi-hook names, on its #! line, a set-group-ID copy of this venv's python (the
first stage the .deb's postinst makes; docs/cdi-hook.md), or this venv's python itself (the
control: a dynamically linked first stage). NVIDIA's own tools, when bench/build_reference_cdi.sh
built them: NVHOOK_REFERENCE_CDI=<its scratch dir>.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Any group but root's: executing the copy changes the effective gid, which is what makes the
# kernel set AT_SECURE. nogroup exists on every Debian. The copies are mode 2711 as the .deb's
# and node install's (user-namespaced containers execute them), which is sound there only
# because their group (nvhook-hook) owns nothing else; these test copies live in a temporary
# directory for a test's length, so nogroup will do here.
TEST_GROUP = 65534


def plain_hook() -> Path:
    """The python stage under this venv's python, in the suite's run directory: what the tests of
    the hook's work run. (The wheel's own bin/nvidia-cdi-hook is the shell first stage naming the
    set-group-ID copies that `nvhook setup` makes in /usr/local/lib/nvhook, which no test makes on
    the machine.)"""
    import tempfile

    d = Path(os.environ.get("NVHOOK_RUN_DIR") or tempfile.mkdtemp(prefix="nvhook-plain-")) / "plain-cdi-hook"
    return first_stage(d, secure=False)


def first_stage(tmp: Path, secure: bool = True) -> Path:
    d = tmp / ("secure" if secure else "plain")
    (d / "bin").mkdir(parents=True, exist_ok=True)
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (d / "lib" / v).mkdir(parents=True, exist_ok=True)
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and str(p).startswith(sys.prefix))
    if not (d / "lib" / v / "site-packages").exists():
        os.symlink(site, d / "lib" / v / "site-packages")
    if secure:
        interp = d / "bin/python3"
        shutil.copy2(os.path.realpath(sys.executable), interp)
        os.chown(interp, 0, TEST_GROUP)
        os.chmod(interp, 0o2711)
    else:
        interp = Path(sys.executable)
    body = (REPO / "nvhook/data/nvidia-cdi-hook.py").read_text().split("\n", 1)[1]
    script = d / "bin/nvidia-cdi-hook"
    script.write_text(f"#!{interp} -IS\n{body}")
    script.chmod(0o755)
    return script


def shell_first_stage(tmp: Path, secure: bool = True, python: str | None = None, shell: str = "/bin/sh") -> Path:
    """The .deb's layout with the shell first stage (nvhook/data/nvidia-cdi-hook.sh): a
    set-group-ID copy of /bin/sh runs the hook file, which ends in the shell for the entries an
    earlier one did, else execs the set-group-ID copy of `python` (this venv's by default) on
    libexec/nvidia-cdi-hook.py; the markers in `marks/`. Not `secure`: the shell and python as
    they are (the control). `shell`: the distribution's shell to copy (bash for the RHEL
    family's /bin/sh)."""
    d = tmp / (("shell-secure" if secure else "shell-plain") + ("" if shell == "/bin/sh" else "-" + Path(shell).name))
    for sub in ("bin", "libexec"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (d / "lib" / v).mkdir(parents=True, exist_ok=True)
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and str(p).startswith(sys.prefix))
    if not (d / "lib" / v / "site-packages").exists():
        os.symlink(site, d / "lib" / v / "site-packages")
    py = python or sys.executable
    if secure:
        sh, interp = d / "libexec/sh", d / "libexec/python3"
        for src, dst in ((shell, sh), (py, interp)):
            shutil.copy2(os.path.realpath(src), dst)
            os.chown(dst, 0, TEST_GROUP)
            os.chmod(dst, 0o2711)
    else:
        sh, interp = Path(shell), Path(py)
    stage2 = d / "libexec/nvidia-cdi-hook.py"
    body = (REPO / "nvhook/data/nvidia-cdi-hook.py").read_text().split("\n", 1)[1]
    if python is not None:  # the checkout's installed tree, as bench.system_launcher reads it
        pkg = next(iter(sorted((REPO / "build").glob("__editable__.nvhook-*"))), REPO)
        body = f"import sys\nsys.path.insert(0, {str(pkg)!r})\n{body}"
    stage2.write_text(f"#!{interp} -IS\n{body}")
    script = d / "bin/nvidia-cdi-hook"
    script.write_text(render_shell_stage(str(sh), str(interp), str(stage2), str(d / "marks")))
    script.chmod(0o755)
    return script


def render_shell_stage(sh: str, python: str, stage2: str, marks: str) -> str:
    text = (REPO / "nvhook/data/nvidia-cdi-hook.sh").read_text()
    for k, v in (("@SH@", sh), ("@PYTHON@", python), ("@STAGE2@", stage2), ("@MARKS@", marks)):
        text = text.replace(k, v)
    return text


def reference(tag: str = "v1.17.0") -> Path | None:
    """NVIDIA's build dir for `tag` (nvidia-ctk, nvidia-cdi-hook), or None."""
    base = os.environ.get("NVHOOK_REFERENCE_CDI")
    if not base:
        return None
    p = Path(base) / tag
    return p if (p / "nvidia-ctk").exists() else None


# nvidia-ctk reads the MIG capability minors from the host's /proc/driver/nvidia-caps whatever
# --driver-root says: it runs in a private mount namespace whose /proc/driver is a tmpfs holding
# the fixture host's nvidia and nvidia-caps directories.
_PROC = ('mount -t tmpfs -o mode=0555 none /proc/driver && mkdir /proc/driver/nvidia /proc/driver/nvidia-caps && '
         'mount --bind "$H/proc/driver/nvidia" /proc/driver/nvidia && '
         '{ [ ! -d "$H/proc/driver/nvidia-caps" ] || mount --bind "$H/proc/driver/nvidia-caps" /proc/driver/nvidia-caps; } '
         '|| exit 125; exec "$@"')


# nvidia-ctk finds a GPU's DRM nodes in the host's /sys/bus/pci/devices/<bus id>/drm whatever
# --driver-root says: with `sysfs`, the fixture host's sys/ is bound over /sys there too.
_SYSFS = ' && mount --bind "$H/sys" /sys'


def nvml_without_mig(host: Path, out: Path) -> dict[str, str]:
    """nvidia-ctk from 1.19 on asks NVML for each MIG-capable GPU's MIG profiles (memory, GPU and
    compute instance profiles), which the fixture's fake NVML does not model: their generator
    reads a copy of the host's fake NVML configuration with every GPU not MIG-capable and no MIG
    devices. Their spec then lists all 8 GPUs as whole GPUs and none of the 4 MIG devices: a
    lighter spec than the host's, so their side is, if anything, favoured."""
    conf = next(host.glob("usr/lib/*/fake-nvml.conf"))
    lines = []
    for line in conf.read_text().splitlines():
        f = line.split()
        if f[:1] == ["mig"]:
            continue
        if f[:1] == ["gpu"]:
            f[8] = "na"
            line = " ".join(f)
        lines.append(line)
    (out / "fake-nvml.conf").write_text("\n".join(lines) + "\n")
    return {"NVHOOK_FAKE_NVML_CONF": str(out / "fake-nvml.conf")}


def nvidia_ctk_generate(ref: Path, host: Path, hook_path: str, *extra: str, sysfs: bool = False,
                        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`nvidia-ctk cdi generate` for a fixture host, the spec (JSON) on stdout; `sysfs`: with the
    host's sysfs, so that the spec has each GPU's DRM nodes and by-path links; `env`: more
    variables for it (e.g. NVHOOK_FAKE_NVML_CONF)."""
    cmd = [str(ref / "nvidia-ctk"), "cdi", "generate", "--driver-root", str(host), "--dev-root", str(host),
           "--nvidia-cdi-hook-path", hook_path, "--format", "json", *extra]
    prep = _PROC.replace(" || exit 125", (_SYSFS if sysfs else "") + " || exit 125", 1)
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", prep, "sh", *cmd],
                          capture_output=True, text=True, timeout=120, env={"H": str(host), "PATH": os.environ["PATH"], **(env or {})})
