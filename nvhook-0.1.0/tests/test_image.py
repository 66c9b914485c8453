"""nvhook.observe.image: compat libraries and the CUDA runtime version read from a container rootfs,
with real ELF compat libraries (make_fixtures.build_compat_lib) and hostile layouts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import imagefix
import pytest
from imagefix import NOTE_CUDA113, make_image, rtx2080ti, t4

from nvhook.decide import compat
from nvhook.observe import image

COMPAT = "/usr/local/cuda-11.3/compat"
REPO = Path(__file__).resolve().parent.parent


def usable(entries):
    return [e for e in entries if not e["skipped"]]


# --- resolve_in_rootfs ----------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr/lib").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc/shadow").write_text("container's own\n")
    (root / "usr/lib/libx.so.1").write_text("x")
    os.symlink("/etc/shadow", root / "usr/lib/abs")
    os.symlink("../../../../../../../etc/shadow", root / "usr/lib/dotdot")
    os.symlink("loop2", root / "usr/lib/loop1")
    os.symlink("loop1", root / "usr/lib/loop2")
    os.symlink("libx.so.1", root / "usr/lib/rel")
    os.symlink("/usr/lib/libx.so.1/child", root / "usr/lib/through-file")
    (tmp_path / "outside").mkdir()
    return root


def test_resolve_clamps_absolute_links_and_dotdot(tree):
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/abs") == f"{tree}/etc/shadow"
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/dotdot") == f"{tree}/etc/shadow"
    assert image.resolve_in_rootfs(str(tree), "/../../etc/shadow") == f"{tree}/etc/shadow"
    assert image.resolve_in_rootfs(str(tree), "usr/lib/rel") == f"{tree}/usr/lib/libx.so.1"


def test_resolve_missing_loop_and_non_directory(tree):
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/missing") is None
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/loop1") is None
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/through-file") is None
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/libx.so.1/x") is None


def test_resolve_link_chain_limit(tree):
    d = tree / "usr/lib"
    for i in range(45):
        os.symlink(f"c{i + 1}", d / f"c{i}")
    (d / "c45").write_text("end")
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/c10") == f"{tree}/usr/lib/c45"  # 35 links
    assert image.resolve_in_rootfs(str(tree), "/usr/lib/c0") is None  # 45 links


# --- find_compat_libs -----------------------------------------------------------------------

@pytest.fixture
def cuda113(tmp_path):
    return make_image(tmp_path / "rootfs")


def test_cuda113_compat_libs_newer_than_host(cuda113):
    found = image.find_compat_libs(str(cuda113), "460.80")
    assert [(e["name"], e["library"], e["version"], e["newer_than_host"]) for e in found] == [
        ("libcuda.so.465.19.01", "libcuda", "465.19.01", True),
        ("libnvidia-ptxjitcompiler.so.465.19.01", "libnvidia-ptxjitcompiler", "465.19.01", True),
    ]
    cuda, ptx = found
    assert cuda["container_path"] == f"{COMPAT}/libcuda.so.465.19.01"
    assert cuda["host_path"] == f"{cuda113}{COMPAT}/libcuda.so.465.19.01"
    assert cuda["note"] == NOTE_CUDA113 and cuda["note_error"] is None and cuda["skipped"] is None
    assert ptx["note"] is None  # notes are read for libcuda only
    json.dumps(found)


def test_compat_libs_older_than_host_have_no_note_read(cuda113):
    found = image.find_compat_libs(str(cuda113), "470.57.02")
    assert [e["newer_than_host"] for e in found] == [False, False]
    assert all(e["note"] is None for e in found)


def test_both_compat_paths_are_deduplicated(tmp_path):
    root = make_image(tmp_path / "r")
    # /usr/local/cuda/compat also reachable through an absolute alternatives-style chain.
    os.unlink(root / "usr/local/cuda")
    (root / "etc/alternatives").mkdir(parents=True)
    os.symlink("/usr/local/cuda-11.3", root / "etc/alternatives/cuda")
    os.symlink("/etc/alternatives/cuda", root / "usr/local/cuda")
    found = image.find_compat_libs(str(root), "460.80")
    assert [e["container_path"] for e in found] == [f"{COMPAT}/libcuda.so.465.19.01",
                                                     f"{COMPAT}/libnvidia-ptxjitcompiler.so.465.19.01"]


def test_no_cuda_at_all(tmp_path):
    (tmp_path / "r/usr/lib").mkdir(parents=True)
    assert image.find_compat_libs(str(tmp_path / "r"), "460.80") == []


def test_compat_dir_link_outside_the_rootfs_is_not_followed(tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(imagefix.compat_lib().parent, outside)  # a "host" dir with a newer libcuda
    root = make_image(tmp_path / "r", compat=None)
    os.symlink(str(outside), root / "usr/local/cuda-11.3/compat")
    found = image.find_compat_libs(str(root), "460.80")
    assert usable(found) == []
    assert len(found) == 1 and found[0]["container_path"] == "/usr/local/cuda/compat"
    assert str(outside) in found[0]["skipped"] and "does not resolve inside" in found[0]["skipped"]
    # The relative way out is clamped at the rootfs too.
    os.unlink(root / "usr/local/cuda-11.3/compat")
    os.symlink("../../../../../../../../" + str(outside).lstrip("/"), root / "usr/local/cuda-11.3/compat")
    assert usable(image.find_compat_libs(str(root), "460.80")) == []


def test_compat_dir_that_is_a_file(tmp_path):
    root = make_image(tmp_path / "r", compat=None)
    (root / "usr/local/cuda-11.3/compat").write_text("not a dir")
    found = image.find_compat_libs(str(root), "460.80")
    assert [e["skipped"] for e in found] == [
        "compat directory resolves to /usr/local/cuda-11.3/compat, a regular file, not a directory"]


def test_hostile_files_in_compat_dir_are_skipped_with_a_reason(tmp_path):
    root = make_image(tmp_path / "r")
    d = root / "usr/local/cuda-11.3/compat"
    os.symlink("/etc/shadow", d / "libcuda.so.999.1")
    os.mkfifo(d / "libnvidia-ptxjitcompiler.so.999.1")
    (d / "libnvidia-nvvm.so.999.1").mkdir()
    try:
        os.mknod(d / "libcudadebugger.so.999.1", 0o600 | 0o020000, os.makedev(1, 3))
        device = True
    except PermissionError:
        device = False
    found = image.find_compat_libs(str(root), "460.80")
    skipped = {e["name"]: e["skipped"] for e in found if e["skipped"]}
    assert skipped["libcuda.so.999.1"].startswith("a symbolic link to /etc/shadow")
    assert "must be regular files" in skipped["libcuda.so.999.1"]
    assert skipped["libnvidia-ptxjitcompiler.so.999.1"].startswith("a FIFO")
    assert skipped["libnvidia-nvvm.so.999.1"].startswith("a directory")
    if device:
        assert skipped["libcudadebugger.so.999.1"].startswith("a character device")
    assert all(e["host_path"] is None for e in found if e["skipped"])
    # The decision ignores them: the real 465.19.01 lib is what a T4 gets.
    d = compat.decide(["compute"], "450.102.04", [t4()], found, "auto")
    assert d["compat_version"] == "465.19.01" and d["decision"] == "image"


def test_malformed_note_is_reported_not_raised(tmp_path):
    root = make_image(tmp_path / "r", compat=None)
    d = root / "usr/local/cuda-11.3/compat"
    d.mkdir()
    (d / "libcuda.so.999.1").write_bytes(b"\x7fELF garbage")
    (found,) = image.find_compat_libs(str(root), "460.80")
    assert found["skipped"] is None and found["note"] is None and "not an ELF file" in found["note_error"]
    dec = compat.decide(["compute"], "460.80", [t4()], [found], "auto")
    assert dec["decision"] == "host" and dec["reason_code"] == "compat-note-invalid"


def _imports(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout)


def test_common_cases_never_import_pyelftools(tmp_path):
    plain = tmp_path / "plain"
    (plain / "usr/lib").mkdir(parents=True)
    old = make_image(tmp_path / "old")
    new = make_image(tmp_path / "new")
    code = ("import json, sys\nfrom nvhook.observe import image\nr = []\n"
            f"image.find_compat_libs({str(plain)!r}, '460.80'); r.append('elftools' in sys.modules)\n"
            f"image.find_compat_libs({str(old)!r}, '470.57.02'); r.append('elftools' in sys.modules)\n"
            f"image.find_compat_libs({str(new)!r}, '460.80'); r.append('elftools' in sys.modules)\n"
            "print(json.dumps(r))")
    assert _imports(code) == [False, False, True]


def test_compat_and_image_modules_import_nothing_heavy():
    code = ("import json, sys\nbefore = set(sys.modules)\nimport nvhook.decide.compat, nvhook.observe.image\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    new = _imports(code)
    assert {"re", "dataclasses", "typing", "pathlib", "elftools", "json"}.isdisjoint(new), new


# --- decisions on real images ---------------------------------------------------------------

def test_seed_cases_end_to_end(cuda113):
    found = image.find_compat_libs(str(cuda113), "460.80")
    d = compat.decide(["compute", "utility"], "460.80", [rtx2080ti(0), rtx2080ti(1)], found, "auto")
    assert d["decision"] == "host" and "CUDA error 804" in d["warnings"][0]
    found = image.find_compat_libs(str(cuda113), "450.102.04")
    d = compat.decide(["compute", "utility"], "450.102.04", [t4(0), t4(1)], found, "auto")
    assert d["decision"] == "image"
    assert d["libraries"] == [f"{COMPAT}/libcuda.so.465.19.01", f"{COMPAT}/libnvidia-ptxjitcompiler.so.465.19.01"]
    assert all(os.path.isfile(c["host_path"]) for c in d["selected"])


def test_branch_and_nonote_images(tmp_path):
    branch = make_image(tmp_path / "b", note=dict(NOTE_CUDA113, Driver=[470]))
    d = compat.decide(["compute"], "450.102.04", [t4()], image.find_compat_libs(str(branch), "450.102.04"), "auto")
    assert d["reason_code"] == "driver-branch-not-in-note"
    nonote = make_image(tmp_path / "n", note=None)
    found = image.find_compat_libs(str(nonote), "450.102.04")
    assert found[0]["note"] is None and found[0]["note_error"] is None
    assert compat.decide(["compute"], "450.102.04", [t4()], found, "auto")["decision"] == "image"
    assert compat.decide(["compute"], "450.102.04", [rtx2080ti()], found, "auto")["decision"] == "host"


@pytest.mark.parametrize("container, host, gpus, want", [
    ("container-cuda113", "460.80", [rtx2080ti(0), rtx2080ti(1)], ("host", "gpu-not-supported")),
    ("container-cuda113", "450.102.04", [t4(0), t4(1)], ("image", "all-gpus-supported")),
    ("container-cuda113", "450.102.04", [t4(0), rtx2080ti(1)], ("host", "gpu-not-supported")),
    ("container-cuda113-branch470", "450.102.04", [t4(0)], ("host", "driver-branch-not-in-note")),
    ("container-cuda113-nonote", "450.102.04", [t4(0)], ("image", "all-gpus-supported")),
    ("container-cuda113-nonote", "460.80", [rtx2080ti(0)], ("host", "gpu-not-supported")),
    ("container-cuda-old", "450.102.04", [t4(0)], ("host", "compat-not-newer")),
    ("container-debian", "450.102.04", [t4(0)], ("host", "no-compat-libs")),
])
def test_shared_container_fixtures(fixtures_root, container, host, gpus, want):
    rootfs = str(fixtures_root / container)
    d = compat.decide(["compute", "utility"], host, gpus, image.find_compat_libs(rootfs, host), "auto")
    assert (d["decision"], d["reason_code"]) == want
    if d["decision"] == "image":
        assert all(os.path.isfile(c["host_path"]) and c["host_path"].startswith(rootfs) for c in d["selected"])


# --- cuda_runtime_version -------------------------------------------------------------------

def test_runtime_from_libcudart(cuda113):
    assert image.cuda_runtime_version(str(cuda113), {"CUDA_VERSION": "11.3.1"}) == (
        "11.3.109", "file:/usr/local/cuda-11.3/targets/x86_64-linux/lib/libcudart.so.11.3.109")


def test_runtime_from_env_without_libcudart(tmp_path):
    root = make_image(tmp_path / "r", cudart_version=None)
    assert image.cuda_runtime_version(str(root), {"CUDA_VERSION": "12.2.2"}) == ("12.2.2", "env:CUDA_VERSION")
    assert image.cuda_runtime_version(str(root), {"CUDA_VERSION": "latest"}) == (None, "none")
    assert image.cuda_runtime_version(str(root), {}) == (None, "none")


def test_runtime_soname_link_alone_does_not_count(tmp_path):
    root = make_image(tmp_path / "r", cudart_version="11.3.109")
    os.unlink(root / "usr/local/cuda-11.3/targets/x86_64-linux/lib/libcudart.so.11.3.109")
    # Only the dangling SONAME link libcudart.so.11.0 remains.
    assert image.cuda_runtime_version(str(root), {"CUDA_VERSION": "11.3.1"}) == ("11.3.1", "env:CUDA_VERSION")


def test_runtime_in_lib64_only(tmp_path):
    root = tmp_path / "r"
    lib = root / "usr/local/cuda-10.2/lib64"
    lib.mkdir(parents=True)
    os.symlink("cuda-10.2", root / "usr/local/cuda")
    (lib / "libcudart.so.10.2.89").write_bytes(b"")
    assert image.cuda_runtime_version(str(root), {}) == ("10.2.89", "file:/usr/local/cuda-10.2/lib64/libcudart.so.10.2.89")
