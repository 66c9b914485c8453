"""bin/nvhook, the launcher runc and podman execute on every container start: it must find
nvhook however the interpreter was started, and run without Python's `site` module when the
hook is registered as `python -IS launcher` (see docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER = Path(sys.executable).with_name("nvhook")  # the installed copy of bin/nvhook
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not LAUNCHER.exists(), reason="nvhook is not installed in this venv")


def run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    # A hook's environment: only what the runtime config gives it; a directory of its own.
    return subprocess.run(argv, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)


def imported(stderr: str) -> set[str]:
    return {ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


@pytest.mark.parametrize("flags", [[], ["-I"], ["-IS"]], ids=["plain", "isolated", "isolated-no-site"])
def test_hook_mode_runs_under_each_registration(tmp_path, flags):
    """The hook's own error for a missing OCI state (exit 1, one line) proves nvhook was
    imported and ran; under -S the launcher found the install's site-packages (this venv's editable
    install: through its .pth file) without the site module."""
    proc = run([sys.executable, *flags, "-X", "importtime", str(LAUNCHER), "--root", str(tmp_path / "missing"),
                "--log-file", "", "prestart"], tmp_path)  # no log: the default is the machine's /var/log
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert proc.returncode == 1, proc.stderr
    assert lines == ["nvhook: no OCI state on stdin (nvhook runs as a prestart hook; "
                     "use --dry-run --bundle DIR to try it by hand)"]
    mods = imported(proc.stderr)
    assert "nvhook.start.hook" in mods
    assert ("site" in mods) == ("-IS" not in flags)


def test_commands_for_people_work_without_site(tmp_path):
    """`python -IS launcher --help` reaches the click CLI (imported from site-packages)."""
    proc = run([sys.executable, "-IS", str(LAUNCHER), "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: nvhook" in proc.stdout


def test_pythonpath_cannot_reach_an_isolated_hook(tmp_path):
    """Under -I, a PYTHONPATH in the hook's environment (a planted nvhook package) is ignored."""
    fake = tmp_path / "planted" / "nvhook"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('planted nvhook imported')\n")
    (fake / "main.py").write_text("raise SystemExit('planted nvhook imported')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "planted")}
    proc = subprocess.run([sys.executable, "-IS", str(LAUNCHER), "--root", str(tmp_path / "missing"), "--log-file", "",
                           "prestart"],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert "planted" not in proc.stderr
    assert proc.returncode == 1 and "no OCI state on stdin" in proc.stderr


def test_launcher_turns_the_cyclic_gc_off_only_for_hook_mode(tmp_path):
    """Hook mode runs without the cyclic collector (bin/nvhook); the CLI turns it back on."""
    for argv, want in ((["prestart"], "False"), (["--version"], "True")):
        probe = tmp_path / "probe.py"
        probe.write_text(
            "import gc, sys, runpy\n"
            "import nvhook.start.hook as m\n"
            "from nvhook.commands import cli\n"
            "def report(*a, **kw):\n"
            "    print('gc', gc.isenabled(), flush=True)\n"
            "    return 0\n"
            "m.run_hook = report\n"
            "owner = next(c for c in type(cli.cli).__mro__ if 'main' in vars(c))\n"
            "owner.main = report\n"
            f"sys.argv = [{str(LAUNCHER)!r}, *{argv!r}]\n"
            f"runpy.run_path({str(LAUNCHER)!r}, run_name='__main__')\n")
        proc = run([sys.executable, str(probe)], tmp_path)
        assert f"gc {want}" in proc.stdout.splitlines(), (argv, proc.stdout, proc.stderr)


USAGE_PROBE = """
import os, sys, time
from nvhook.start import hook as main
from nvhook.base import process
t = time.process_time()
while time.process_time() - t < 0.05:
    pass
rss, cpu = main._usage()
alone = "resource" in sys.modules
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0].split()[1]
import resource
me = resource.getrusage(resource.RUSAGE_SELF)
print(alone, rss, hwm, cpu, round((me.ru_utime + me.ru_stime) * 1000, 1))
pid, pipes = process.fork_with_pipes(0)
if pid == 0:
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print(*main._usage())
"""


def test_the_hook_summary_counts_cpu_and_memory_without_loading_resource():
    """hook.done's peak_rss_kb and cpu_ms: without a child, from the clock and
    /proc/self/status (no `resource`, a shared library, on the start path), the same figures
    getrusage gives (its peak RSS is this program's own: getrusage's also counts the image
    before exec, runc's); once the hook has forked (an apply worker, the NVML probe), its
    children's CPU time counts too."""
    p = subprocess.run([sys.executable, "-IS", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + USAGE_PROBE],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    alone, rss, hwm, cpu, ru_cpu = first.split()
    assert alone == "False"
    assert 0 < int(rss) <= int(hwm) <= int(rss) + 512 and 50 <= float(cpu) <= float(ru_cpu)
    rss2, cpu2 = second.split()
    assert int(rss2) > 0 and float(cpu2) >= float(cpu) + 190  # the child's 200 ms
