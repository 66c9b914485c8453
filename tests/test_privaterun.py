"""The test run's own /run/nvhook and /var/log/nvhook.log (tests/e2e/privaterun.py): what the
CDI hook (which drops NVHOOK_RUN_DIR with the rest of its environment) and a hook that logs to
the default log write lands in the run's copies, and the machine's stay as they were; on a
machine without /run/nvhook the run makes its mount point on its own /run, not the machine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdihookbox  # noqa: E402
import privaterun  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.base import config as config_mod  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the private namespace is made as root only")

E2E = Path(__file__).resolve().parent / "e2e"


def machine(path: str) -> Path:
    return Path(privaterun.machine_root() + path)


def test_the_cdi_hooks_config_cache_lands_in_the_runs_own_run_dir(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "rootfs/dev").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "linux": {}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "privaterun-test", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "hook.jsonl", cache_dir=tmp_path / "c")
    name = config_mod.cache_file_name("config", str(config))
    p = subprocess.run([str(cdihookbox.plain_hook()), "--nvhook-config", str(config), "update-application-profile"],
                       input=state, capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ["PATH"], "NVHOOK_RUN_DIR": str(tmp_path / "ignored")})
    assert p.returncode == 0, p.stderr
    assert (Path("/run/nvhook") / name).is_file()  # the hook cached it where it always does
    assert not (tmp_path / "ignored").exists()  # its environment dropped, as in production
    assert not (machine("/run/nvhook") / name).exists()  # ... and that /run/nvhook is the run's


def test_a_hook_that_logs_to_the_default_log_writes_the_runs_own(tmp_path):
    before = machine("/var/log/nvhook.log").stat() if machine("/var/log/nvhook.log").exists() else None
    mark = f"privaterun-{os.getpid()}-{tmp_path.name}"
    p = subprocess.run([str(rb.NVHOOK_BIN), "prestart"], input=f"not json {mark}", capture_output=True, text=True,
                       timeout=60, env={"PATH": os.environ["PATH"], "NVHOOK_CONFIG": str(tmp_path / "none.toml")})
    assert p.returncode != 0
    log = Path("/var/log/nvhook.log")
    assert log.is_file() and "error" in log.read_text()
    after = machine("/var/log/nvhook.log").stat() if machine("/var/log/nvhook.log").exists() else None
    assert (before and (before.st_size, before.st_mtime_ns)) == (after and (after.st_size, after.st_mtime_ns))


PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import privaterun
    assert privaterun.enter("nvhook-privaterun-test-")
    open("/run/nvhook/written", "w").close()
    with open("/var/log/nvhook.log", "a") as f:
        f.write("x\\n")
    outer = privaterun.machine_root()
    print(json.dumps([sorted(os.listdir("/run")), sorted(os.listdir(outer + "/run")),
                      os.path.exists("/var/log/kept"), os.path.exists(outer + "/var/log/nvhook.log")]))
""")


def test_a_machine_without_run_nvhook_gets_no_mount_point_made_on_its_run(tmp_path):
    """A /run and a /var/log without nvhook's (tmpfs of a namespace standing for such a machine,
    with an entry of their own): the run's copies are mounted on a /run and /var/log of the run,
    the machine's entries still there, and nothing is made on the machine's."""
    script = ('mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /var/log && mkdir /run/kept && '
              'touch /var/log/kept && "$@"')  # not exec: the sh keeps that namespace alive
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                        sys.executable, "-c", PROBE, str(E2E)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    inner, outer, kept_log, outer_log = json.loads(p.stdout)
    assert "kept" in inner and "nvhook" in inner and kept_log  # the machine's entries bound back
    assert "kept" in outer and "nvhook" not in outer and not outer_log  # nothing made on the machine's
