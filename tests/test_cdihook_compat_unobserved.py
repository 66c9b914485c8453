"""enable-cuda-compat where nvhook cannot observe the host (issue 35 item 6): a spec gives
`--host-driver-version` (or `--host-cuda-version`), and no driver is visible under nvhook's root
(nvhook's config `root` is an empty directory: a node whose driver lives in a container, a spec
written for another machine). The start never fails there (it failed with "no ld.so.cache at
..."): nvhook decides by NVIDIA's rule from the spec's versions, says so in a warning line and a
`compat.host_unobserved` event, and the container gets what NVIDIA's hook gives it. Where NVIDIA
1.20's build is there (NVHOOK_REFERENCE_CDI), its hook is run on the same image to compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdihookbox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

HOOK = cdihookbox.plain_hook()
COMPAT = mf.CONTAINERS["container-cuda113"].compat  # 465.19.01, note: branches 418-460, CUDA 11.3
COMPAT_DIR = f"/usr/local/{COMPAT.cuda_dir}/compat"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the CDI hook works on a rootfs as root")


class Image:
    """A fixture image's rootfs in a bundle, with nvhook's config pointing at an empty host root."""

    def __init__(self, tmp: Path, image: str, extra: str = ""):
        tmp.mkdir(parents=True, exist_ok=True)
        self.rootfs = mf.build_container(image, tmp / "images")
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        (self.bundle / "config.json").write_text(json.dumps({"root": {"path": str(self.rootfs)},
                                                             "process": {"env": []}, "linux": {}}))
        (tmp / "no-driver-here").mkdir()
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "hook.toml", log_file=self.log, cache_dir=tmp / "cache",
                                             root=tmp / "no-driver-here", extra=extra)
        self.state = json.dumps({"ociVersion": "1.0.2", "id": "compat-test", "pid": os.getpid(),
                                 "bundle": str(self.bundle)})

    def run(self, *args: str, exe: Path = HOOK) -> subprocess.CompletedProcess:
        pre = ["--nvhook-config", str(self.config)] if exe == HOOK else []
        return subprocess.run([str(exe), *pre, "enable-cuda-compat", *args], input=self.state, capture_output=True,
                              text=True, timeout=60, env={"PATH": os.environ["PATH"]})

    def compat_dirs(self) -> list[str]:
        """The directories the 00-compat-*.conf drop-ins name (nvhook's or NVIDIA's)."""
        d = self.rootfs / "etc/ld.so.conf.d"
        return sorted(ln for f in (d.glob("00-compat-*.conf") if d.is_dir() else ())
                      for ln in f.read_text().splitlines() if ln)


# (image, spec's flags, whether the compat directory is used): NVIDIA's rule in each of its branches
CASES = [
    ("container-cuda113", ["--host-driver-version", "460.27.04"], True),    # the note lists 460, newer
    ("container-cuda113", ["--host-driver-version", "470.57.02"], False),   # the note does not list 470
    ("container-cuda113-nonote", ["--host-driver-version", "460.27.04"], True),   # no note: 465 > 460
    ("container-cuda113-nonote", ["--host-driver-version", "465.10.01"], False),  # no note: same major
    ("container-cuda113", ["--host-cuda-version", "11.2"], True),            # the note's CUDA 11.3 > 11.2
    ("container-cuda113", ["--host-cuda-version", "11.4"], False),
    ("container-cuda113-nonote", ["--host-cuda-version", "11.2"], False),    # no note to compare
    ("container-debian", ["--host-driver-version", "460.27.04"], False),     # no compat library
]


@pytest.mark.parametrize("image,flags,used", CASES, ids=[f"{c[0]}{'_'.join(c[1])}" for c in CASES])
def test_no_driver_under_the_root_decides_by_nvidias_rule(tmp_path, image, flags, used):
    img = Image(tmp_path, image)
    p = img.run(*flags)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvidia-cdi-hook (nvhook): warning: nvhook cannot observe "
                                                   "the host driver (no ld.so.cache at "), p.stderr
    assert img.compat_dirs() == ([COMPAT_DIR] if used else [])
    (ev,) = [e for e in rb.read_events(img.log) if e["event"] == "compat.host_unobserved"]
    assert ev["level"] == "warning" and ev["decision"] == ("image" if used else "host")
    ref = cdihookbox.reference("v1.20.0")
    if ref is not None and (ref / "nvidia-cdi-hook").exists():
        theirs = Image(tmp_path / "nvidia", image)
        r = theirs.run(*flags, exe=ref / "nvidia-cdi-hook")
        assert r.returncode == 0, r.stderr
        assert theirs.compat_dirs() == img.compat_dirs()


def test_compat_mode_host_still_rules(tmp_path):
    """The admin's `compat.mode = "host"` holds where NVIDIA's rule would use the library."""
    img = Image(tmp_path, "container-cuda113", extra='[compat]\nmode = "host"\n')
    p = img.run("--host-driver-version", "460.27.04")
    assert p.returncode == 0, p.stderr
    assert "compat mode is host" in p.stderr and img.compat_dirs() == []


def test_an_observable_host_keeps_nvhooks_decision(tmp_path, fixtures_root):
    """With a driver under the root, nvhook's own decision as before (no warning, no fallback):
    host-gpu8's 535 driver is newer than the image's 465 compat libcuda."""
    img = Image(tmp_path, "container-cuda113")
    rb.write_nvhook_config(img.config, log_file=img.log, cache_dir=tmp_path / "cache", root=fixtures_root / "host-gpu8")
    p = img.run("--host-driver-version", "460.27.04")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert img.compat_dirs() == []
    assert not [e for e in rb.read_events(img.log) if e["event"] == "compat.host_unobserved"]


@pytest.mark.runc
@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
def test_the_container_starts_under_runc_and_reads_the_compat_directory(tmp_path):
    """Real runc, the .deb's first stage, NVIDIA's entry with a host driver version and no driver
    under nvhook's root: the container starts and its loader config names the compat directory."""
    img = Image(tmp_path, "container-cuda113-nonote")
    bundle = tmp_path / "runc-bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/sh", "-c", "cat /etc/ld.so.conf.d/00-compat-nvhook.conf"]
    cfg["root"] = {"path": str(img.rootfs), "readonly": False}
    cfg["hooks"] = {"createContainer": [{"path": str(cdihookbox.shell_first_stage(tmp_path)), "args": [
        "nvidia-cdi-hook", "--nvhook-config", str(img.config), "enable-cuda-compat",
        "--host-driver-version", "460.27.04"]}]}
    (bundle / "config.json").write_text(json.dumps(cfg))
    p = rb.runc_run(bundle, tmp_path / "runc-state")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [COMPAT_DIR]
