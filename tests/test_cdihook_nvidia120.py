"""NVIDIA Container Toolkit 1.20.0's CDI spec, run once by NVIDIA's own nvidia-cdi-hook and once
by nvhook's, through real podman: the two containers must be the same where NVIDIA's hooks
decide them (the links create-symlinks asks for, the names `ldconfig -p` lists after
update-ldcache, and the EGL application profile update-application-profile writes).

nvidia-ctk and nvidia-cdi-hook 1.20.0 are built from NVIDIA's public sources by
bench/build_reference_cdi.sh (Go 1.26 from Debian unstable, unpacked in the scratch directory);
these tests run only where NVHOOK_REFERENCE_CDI names that directory. tests/test_cdihook_nvidia.py
does the same for 1.17 and 1.18 specs with nvhook's hook alone.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdibox  # noqa: E402
import cdihookbox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.podman, pytest.mark.skipif(cdibox.skip_reason() is not None,
                                                     reason=cdibox.skip_reason() or "")]

TAG = "v1.20.0"
HOST = "host-gpu1"
PROFILE_DIR = "etc/nvidia/nvidia-application-profiles-rc.d"


def nvhook_has(subcommand: str) -> bool:
    """Whether nvhook's nvidia-cdi-hook knows `subcommand` (its argument table, wherever the
    cdihook package keeps it)."""
    for name in ("nvhook.start.cdihook.hookargs", "nvhook.start.cdihookargs"):
        try:
            return subcommand in importlib.import_module(name).COMMANDS
        except ImportError:
            continue
    return False


def spec_links(spec: dict, device: str) -> list[tuple[str, str]]:
    """(target, link) of every create-symlinks --link of the spec-wide edits and `device`'s."""
    edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"] if d["name"] == device]
    return [tuple(a.split("::", 1)) for e in edits for h in e.get("hooks") or [] if "create-symlinks" in h["args"]
            for a in h["args"] if "::" in a]


class Side:
    """One container of the fixture image with GPU 0 from NVIDIA 1.20.0's spec, whose hooks run
    `hook` (NVIDIA's binary or nvhook's first stage); what it saw."""

    def __init__(self, tmp: Path, fixtures_root: Path, ref: Path, hook: Path, nvhook_config: Path | None):
        tmp.mkdir(parents=True)
        p = cdihookbox.nvidia_ctk_generate(ref, fixtures_root / HOST, str(hook), sysfs=True)
        assert p.returncode == 0, p.stderr
        self.spec = json.loads(p.stdout)
        for e in [self.spec["containerEdits"]] + [d["containerEdits"] for d in self.spec["devices"]]:
            for h in e.get("hooks") or []:
                assert h["path"] == str(hook)
                if nvhook_config is not None:
                    h["args"][1:1] = ["--nvhook-config", str(nvhook_config)]
        self.spec["cdiVersion"] = "0.5.0"  # podman 4.3.1 reads up to 0.5.0; nothing here needs more
        self.links = spec_links(self.spec, "0")
        script = "; ".join(f'echo "LINK {link} $(readlink {link})"' for _, link in self.links)
        script += "; echo CACHE; /sbin/ldconfig -p; echo END-CACHE"
        podman = cdibox.CdiPodman(tmp)
        try:
            (podman.spec_dir / "nvidia.json").write_text(json.dumps(self.spec))
            self.rootfs = mf.build_container("container-debian", tmp / "images")
            self.proc = podman.run(self.rootfs, script, ["nvidia.com/gpu=0"])
            assert podman.leftovers() == []
        finally:
            podman.close()
        assert self.proc.returncode == 0, self.proc.stderr
        self.out = self.proc.stdout

    def link_targets(self) -> dict[str, str]:
        return {ln.split()[1]: " ".join(ln.split()[2:]) for ln in self.out.splitlines() if ln.startswith("LINK ")}

    def cache_names(self) -> list[str]:
        """`ldconfig -p`'s entries: name and its (arch, flags) part, without where they lead."""
        cache = self.out.split("\nCACHE\n", 1)[1].split("END-CACHE", 1)[0]
        return sorted(ln.strip().split(" => ")[0] for ln in cache.splitlines() if " => " in ln)

    def profile(self) -> dict[str, object]:
        d = self.rootfs / PROFILE_DIR
        f = d / "10-container.conf"
        return {"dir_mode": oct(d.stat().st_mode & 0o7777) if d.is_dir() else None,
                "file_mode": oct(f.stat().st_mode & 0o7777) if f.is_file() else None,
                "content": f.read_bytes() if f.is_file() else None}


@pytest.fixture(scope="module")
def sides(tmp_path_factory, fixtures_root):
    ref = cdihookbox.reference(TAG)
    if ref is None or not (ref / "nvidia-cdi-hook").exists():
        pytest.skip(f"NVIDIA's nvidia-ctk and nvidia-cdi-hook {TAG} are not built: run "
                    "bench/build_reference_cdi.sh DIR TOOLKIT_GIT and set NVHOOK_REFERENCE_CDI=DIR")
    tmp = tmp_path_factory.mktemp("nvidia120")
    theirs = Side(tmp / "nvidia", fixtures_root, ref, ref / "nvidia-cdi-hook", None)
    log = tmp / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp / "hook.toml", log_file=log, cache_dir=tmp / "cache",
                                    root=fixtures_root / HOST)
    ours = Side(tmp / "nvhook", fixtures_root, ref, cdihookbox.shell_first_stage(tmp), config)
    return theirs, ours, log


def test_the_spec_has_nvidia_120_s_hooks(sides):
    theirs, _ours, _log = sides
    subs = [h["args"][1] for h in theirs.spec["containerEdits"]["hooks"]]
    assert subs[0] == "create-symlinks" and {"update-ldcache", "enable-cuda-compat", "disable-device-node-modification",
                                             "update-application-profile"} <= set(subs)


def test_links_are_nvidia_s(sides):
    theirs, ours, _log = sides
    assert theirs.links == ours.links and len(theirs.links) >= 20
    assert theirs.link_targets() == ours.link_targets()
    assert ours.link_targets()["/usr/lib/x86_64-linux-gnu/libcuda.so"] == "libcuda.so.1"
    assert all(v for v in ours.link_targets().values())  # every link is there


def test_ldconfig_lists_the_same_names(sides):
    theirs, ours, _log = sides
    assert ours.cache_names() == theirs.cache_names()
    assert any(n.startswith("libcuda.so.1 ") for n in ours.cache_names())


def test_application_profile_is_nvidia_s_byte_for_byte(sides):
    theirs, ours, log = sides
    if not nvhook_has("update-application-profile"):
        pytest.skip("nvhook's nvidia-cdi-hook has no update-application-profile on this branch yet (issue 33 "
                    "item 2, the cdihook work); NVIDIA's hook wrote "
                    f"{theirs.profile()['content']!r}")
    want = theirs.profile()
    assert want["content"] and want["dir_mode"] == "0o555" and want["file_mode"] == "0o444"
    assert ours.profile() == want
    assert not [e for e in rb.read_events(log) if e["level"] in ("warning", "error")]
