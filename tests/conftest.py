"""Shared pytest fixtures for nvhook's tests."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))  # tests may `import make_fixtures`

import make_fixtures  # noqa: E402
from machinestate import MACHINE_ETC, MACHINE_NVHOOK, MACHINE_RUN, changed, snapshot  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
import privaterun  # noqa: E402

# The CDI hook drops its environment (NVHOOK_RUN_DIR included), and a hook that reads no config
# logs to /var/log/nvhook.log: the whole run, and all it starts, sees a /run/nvhook and a
# /var/log/nvhook.log of its own (tests/e2e/privaterun.py). First, before any thread exists.
privaterun.enter()

# Nothing of a test run may land in the host's /run/nvhook: nvhook caches the parsed config in
# NVHOOK_RUN_DIR when it is set (the CDI hook, which drops it, in the run's own /run/nvhook above). Every nvhook the tests start inherits it (runc passes its own
# environment to a hook whose spec sets none; hook specs that set one add it, see runcbox).
# Configs written by the tests put the log and the inventory cache in tmp_path as well.
if "NVHOOK_RUN_DIR" not in os.environ:
    os.environ["NVHOOK_RUN_DIR"] = tempfile.mkdtemp(prefix="nvhook-run-")
    _OWN_RUN_DIR = os.environ["NVHOOK_RUN_DIR"]
else:
    _OWN_RUN_DIR = None


def pytest_sessionfinish(session, exitstatus):
    if _OWN_RUN_DIR:
        shutil.rmtree(_OWN_RUN_DIR, ignore_errors=True)
    privaterun.leave()


def _fixtures_stale(out: Path) -> bool:
    stamp = out / make_fixtures.STAMP
    if not stamp.exists():
        return True
    inputs = [FIXTURES / "make_fixtures.py", *(FIXTURES / "src").glob("*.c")]
    if max(p.stat().st_mtime for p in inputs) > stamp.stat().st_mtime:
        return True
    return any(not (out / name).is_dir() for name in [*make_fixtures.HOSTS, *make_fixtures.CONTAINERS])


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    """tests/fixtures/rootfs, (re)generated first when missing or older than
    its generator and C sources (see tests/fixtures/rootfs/README.md)."""
    out = FIXTURES / "rootfs"
    out.mkdir(exist_ok=True)
    with open(out / ".lock", "w") as lock:  # one generator run at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _fixtures_stale(out):
            proc = subprocess.run([sys.executable, str(FIXTURES / "make_fixtures.py"), "--out", str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.fail(f"make_fixtures.py failed:\n{proc.stdout}{proc.stderr}")
    return out


@pytest.fixture(scope="module", autouse=True)
def machine_etc_untouched(request):
    """No test writes the machine's own /etc (nor nvhook's install paths, nor the CDI spec
    directories under /run, nor /run/nvhook and /var/log/nvhook.log): checked around each module,
    so the change is named with the module that made it (a session-wide check taken at the first
    test that asked for it blamed whichever tests came later, and missed what came before)."""
    tops = MACHINE_ETC + MACHINE_RUN + MACHINE_NVHOOK
    machine = privaterun.machine_root()  # the machine's view, not this run's namespace
    before = snapshot(tops, machine)
    yield
    diff = changed(before, snapshot(tops, machine))
    assert not diff, f"{request.module.__name__} changed the machine's own files: {diff[:20]}"
