"""Images whose loader is musl's (Alpine-style), in real runc containers with nvhook's hook, and
under nvidia-cdi-hook's update-ldcache.

musl's loader reads no /etc/ld.so.cache: nvhook writes the driver directories into
/etc/ld-musl-x86_64.path instead (keeping musl's default path first), writes no cache, and the
container starts. musl-probe (linked against musl, tests/e2e/muslimage.py) then dlopen()s
libcuda.so.1 through musl's loader: found in the injected directory and mapped. (The fixture's
libcuda needs only libc.so.6, a name musl's loader answers with itself; NVIDIA's real libcuda
also calls glibc-only functions, which no test here can show: docs/container-files.md says what
runs in a musl image.) Without the path file, musl does not find libcuda.so.1 at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import muslimage  # noqa: E402
import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc,
              pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or ""),
              pytest.mark.skipif(muslimage.skip_reason() is not None, reason=muslimage.skip_reason() or "")]

PATH_FILE = "/etc/ld-musl-x86_64.path"
VIEW = (f"echo PATHFILE; cat {PATH_FILE}; echo END; /usr/bin/musl-probe; "
        "echo CACHE:$(ls /etc/ld.so.cache 2>&1); echo LIBCUDA:$(readlink /usr/lib64/libcuda.so.1)")


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


def path_file(out: str) -> list[str]:
    return out.split("PATHFILE\n", 1)[1].split("END\n", 1)[0].splitlines()


def line(out: str, key: str) -> str:
    (value,) = [ln[len(key):] for ln in out.splitlines() if ln.startswith(key)]
    return value


def test_musl_image_gets_the_driver_in_its_loader_path(tmp_path, gpu8):
    r = rb.run_with_nvhook(tmp_path, container="container-rhel", host=gpu8, script=VIEW,
                           env={"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=muslimage.make_musl)
    assert r.proc.returncode == 0, r.proc.stderr
    out = r.stdout
    # musl's default path kept first (the file replaces it), the driver's directory after it
    assert path_file(out) == ["/lib", "/usr/local/lib", "/usr/lib", "/usr/lib64"]
    # musl's loader finds libcuda.so.1 there (the control test below: not without the file)
    assert line(out, "DLOPEN: ") == "ok", out
    assert line(out, "CACHE:").endswith("No such file or directory")  # no glibc cache written
    assert line(out, "LIBCUDA:").startswith("libcuda.so.")
    (ev,) = r.events("ldcache.musl_path")
    assert ev["added"] == ["/usr/lib64"] and ev["created"] is True
    assert r.events("ldcache.written") == []


def test_without_nvhooks_path_file_musl_does_not_find_libcuda(tmp_path, gpu8):
    """The control: the same container, the path file removed before the probe runs."""
    r = rb.run_with_nvhook(tmp_path, container="container-rhel", host=gpu8,
                           script=f"rm {PATH_FILE}; /usr/bin/musl-probe", env={"NVIDIA_VISIBLE_DEVICES": "0"},
                           prepare=muslimage.make_musl)
    assert r.proc.returncode == 0, r.proc.stderr
    assert line(r.stdout, "DLOPEN: ") == "Error loading shared library libcuda.so.1: No such file or directory"


def test_an_images_own_path_file_is_kept_and_a_planted_link_not_followed(tmp_path, gpu8):
    """The image's entries stay first and in order, nothing is added twice; a path file that
    is an absolute link to a host file is replaced inside the rootfs, the host file untouched."""
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")

    def own(root: Path) -> None:
        muslimage.make_musl(root)
        (root / PATH_FILE.lstrip("/")).write_text("/opt/app/lib:/lib\n/usr/lib\n")

    r = rb.run_with_nvhook(tmp_path / "own", container="container-rhel", host=gpu8, script=VIEW,
                           env={"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=own)
    assert r.proc.returncode == 0, r.proc.stderr
    assert path_file(r.stdout) == ["/opt/app/lib", "/lib", "/usr/lib", "/usr/lib64"]
    assert line(r.stdout, "DLOPEN: ") == "ok"

    def planted(root: Path) -> None:
        muslimage.make_musl(root)
        (root / PATH_FILE.lstrip("/")).symlink_to(host_file)

    r = rb.run_with_nvhook(tmp_path / "link", container="container-rhel", host=gpu8, script=VIEW,
                           env={"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=planted)
    assert r.proc.returncode == 0, r.proc.stderr
    assert path_file(r.stdout) == ["/lib", "/usr/local/lib", "/usr/lib", "/usr/lib64"]
    assert host_file.read_text() == "host\n"
    assert not (r.rootfs / PATH_FILE.lstrip("/")).is_symlink()


def test_a_path_file_nvhook_cannot_replace_never_stops_the_container(tmp_path, gpu8):
    """/etc/ld-musl-x86_64.path is a directory in this image: one warning, the container starts."""
    def odd(root: Path) -> None:
        muslimage.make_musl(root)
        (root / PATH_FILE.lstrip("/")).mkdir()

    r = rb.run_with_nvhook(tmp_path, container="container-rhel", host=gpu8, script="/usr/bin/musl-probe",
                           env={"NVIDIA_VISIBLE_DEVICES": "0"}, prepare=odd)
    assert r.proc.returncode == 0, r.proc.stderr
    (ev,) = r.events("ldcache.musl_path_failed")
    assert "LD_LIBRARY_PATH=/usr/lib64" in ev["reason"], ev
    assert (r.rootfs / PATH_FILE.lstrip("/")).is_dir()


def test_musl_image_without_a_gpu_starts_untouched(tmp_path, gpu8):
    r = rb.run_with_nvhook(tmp_path, container="container-rhel", host=gpu8,
                           script=f"ls {PATH_FILE} 2>&1; /usr/bin/musl-probe",
                           env={"NVIDIA_VISIBLE_DEVICES": "void"}, prepare=muslimage.make_musl)
    assert r.proc.returncode == 0, r.proc.stderr
    assert "No such file or directory" in r.stdout.splitlines()[0]
    assert r.stdout.splitlines()[1] == "DLOPEN: Error loading shared library libcuda.so.1: No such file or directory"


def test_nvidia_cdi_hook_update_ldcache_on_a_musl_image(tmp_path, fixtures_root):
    """nvidia-cdi-hook update-ldcache (as NVIDIA's specs call it) on a musl rootfs: every
    folder goes into the path file (NVIDIA 1.19+ appends there too), no ld.so.cache, no
    ld.so.conf.d drop-in; musl's loader then finds libcuda.so.1 in the folder."""
    import make_fixtures as mf

    rootfs = mf.build_container("container-rhel", tmp_path / "images")
    muslimage.make_musl(rootfs)
    libdir = rootfs / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    host = fixtures_root / "host-gpu8"
    driver = mf.HOSTS["host-gpu8"].driver
    (libdir / f"libcuda.so.{driver}").write_bytes(
        (host / f"usr/lib/x86_64-linux-gnu/libcuda.so.{driver}").read_bytes())
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"root": {"path": str(rootfs)}, "linux": {}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "musl", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})
    conf = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "log", cache_dir=tmp_path / "cache")
    import cdihookbox

    hook = cdihookbox.plain_hook()
    p = subprocess.run([str(hook), "--nvhook-config", str(conf), "update-ldcache", "--folder",
                        "/usr/lib/x86_64-linux-gnu"], input=state, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (rootfs / PATH_FILE.lstrip("/")).read_text() == "/lib\n/usr/local/lib\n/usr/lib\n/usr/lib/x86_64-linux-gnu\n"
    assert not (rootfs / "etc/ld.so.cache").exists()
    assert not list((rootfs / "etc/ld.so.conf.d").glob("00-nvcr-*"))
    assert (libdir / "libcuda.so.1").is_symlink()  # the SONAME link, as ldconfig would make
    out = subprocess.run(["chroot", str(rootfs), "/usr/bin/musl-probe"], capture_output=True, text=True, timeout=30)
    assert out.stdout == "DLOPEN: ok\n", out
