"""`nvhook cdi generate --no-hook` consumed by real podman 4.3.1 + runc: a spec whose libraries
the loader finds with nothing done inside the container (each library also bound at its
SONAME in /usr/lib/<multiarch> and /usr/lib64), so no hook process runs at all.

What is checked is what the container's own loader does: cuda-probe dlopen()s libcuda.so.1
through the image's ld.so and prints the file it mapped and the library's label; the mapped
file must be the host's libcuda (same device and inode as with nvhook's default spec), for a
Debian-style and a RHEL-style image. Then an image that plants links at the bind targets or
makes its library directory a link out of the rootfs: the runtime resolves every target inside
the rootfs, nothing on the host changes (the fixture's teardown also fails on any mount left
under the test's directory on the host).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cdibox  # noqa: E402
from gpuview import LIBCUDA, L, line  # noqa: E402
from test_e2e_cdi import make  # noqa: E402,F401  (the fixture)

pytestmark = [pytest.mark.podman, pytest.mark.skipif(cdibox.skip_reason() is not None,
                                                     reason=cdibox.skip_reason() or "")]

PROBE = 'set -e; /usr/bin/cuda-probe; p=$(/usr/bin/cuda-probe | sed -n "s/^path: //p"); echo "ID:$(stat -L -c %d:%i "$p")"'


def _host_id(s) -> str:
    st = os.stat(s.host / L.lstrip("/") / LIBCUDA)
    return f"{st.st_dev}:{st.st_ino}"


@pytest.mark.parametrize("image", ["container-debian", "container-rhel"])
def test_no_hook_spec_loader_finds_the_hosts_libcuda(make, image):
    """The same libcuda through the loader as with the default spec (nvhook's hook: links and
    ld.so.cache), with no hook process: podman hands runc no hook, nvhook logs nothing."""
    lean = make(image=image, generate_args=["--no-hook"])
    p = lean.run(PROBE)
    assert p.returncode == 0, p.stderr
    assert "hooks" not in lean.podman.captured() or not lean.podman.captured()["hooks"].get("createContainer")
    assert lean.events() == []
    default = make(image=image)
    q = default.run(PROBE)
    assert q.returncode == 0, q.stderr
    assert line(p.stdout, "label: ") == line(q.stdout, "label: ")
    assert line(p.stdout, "ID:") == line(q.stdout, "ID:") == _host_id(lean)
    # found by its SONAME in a default directory, without a cache entry
    assert line(p.stdout, "path: ") == f"{L}/libcuda.so.1"


def test_no_hook_lib64_name_is_what_a_rhel_loader_finds(make):
    """The fixture images carry Debian's glibc loader, whose default directories are the
    multiarch ones; a RHEL-family loader's are /lib64 and /usr/lib64 (`ld.so --list-diagnostics`:
    path.system_dirs). That loader's search is run here by hand: the cache off, /usr/lib64 the
    directory searched. It must map the host's libcuda under /usr/lib64."""
    s = make(image="container-rhel", generate_args=["--no-hook"])
    p = s.run("/lib64/ld-linux-x86-64.so.2 --inhibit-cache --library-path /usr/lib64 /usr/bin/cuda-probe; "
              'echo "ID:$(stat -L -c %d:%i /usr/lib64/libcuda.so.1)"')
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == "/usr/lib64/libcuda.so.1"
    assert line(p.stdout, "ID:") == _host_id(s)


def test_no_hook_image_links_at_the_bind_targets_stay_inside(make, tmp_path):
    """A hostile image: /usr/lib64 is an absolute link to a host directory, and its
    /usr/lib/<multiarch>/libcuda.so.1 an absolute link to a host file. The runtime resolves
    both inside the rootfs: the host directory stays empty, the host file unchanged and
    unmounted, and the container's loader still maps the host's libcuda."""
    s = make(generate_args=["--no-hook"])
    host_dir = s.tmp / "host-dir"
    host_dir.mkdir()
    host_file = s.tmp / "host-file"
    host_file.write_text("host secret\n")
    lib64 = s.rootfs / "usr/lib64"
    if lib64.is_dir() and not lib64.is_symlink():
        for n in os.listdir(lib64):
            os.unlink(lib64 / n)
        lib64.rmdir()
    elif lib64.is_symlink():
        lib64.unlink()
    os.symlink(str(host_dir), lib64)
    planted = s.rootfs / L.lstrip("/") / "libcuda.so.1"
    os.symlink(str(host_file), planted)
    p = s.run(PROBE + '; echo "LIB64:$(cat /usr/lib64/libcuda.so.1 | head -c 4 | od -An -c | tr -d " ")"')
    assert p.returncode == 0, p.stderr
    assert os.listdir(host_dir) == []
    assert host_file.read_text() == "host secret\n"
    assert line(p.stdout, "ID:") == _host_id(s)
    assert line(p.stdout, "LIB64:") == "177ELF"
    # what the binds made stayed in the image's tree, at the in-root resolution of the links
    assert (s.rootfs / str(host_dir).lstrip("/") / "libcuda.so.1").exists()
    assert (s.rootfs / str(host_file).lstrip("/")).exists()


def test_no_hook_spec_checks_and_refuses_the_management_mode(make):
    """`cdi check` reads the options back from the spec's NVHOOK_CDI_NO_HOOK variable; a hook
    someone added to such a spec is reported; --mode management keeps its hook."""
    import json
    import subprocess

    import runcbox as rb

    s = make(generate_args=["--no-hook"])
    spec = json.loads(s.spec_file.read_text())
    assert "hooks" not in spec["containerEdits"]
    assert "NVHOOK_CDI_NO_HOOK=compute,utility" in spec["containerEdits"]["env"]
    check = [str(rb.NVHOOK_BIN), "--config", str(s.config), "--root", str(s.host), "cdi", "check", str(s.spec_file)]
    p = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "matches the host" in p.stdout + p.stderr, p.stdout + p.stderr
    spec["containerEdits"]["hooks"] = [{"hookName": "createContainer", "path": "/usr/bin/true"}]
    s.spec_file.write_text(json.dumps(spec))
    p = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "hooks differ" in p.stdout + p.stderr, p.stdout + p.stderr
    p = subprocess.run([str(rb.NVHOOK_BIN), "--config", str(s.config), "--root", str(s.host), "cdi", "generate",
                        "--no-hook", "--mode", "management"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--no-hook is for the GPU spec" in p.stderr


def test_no_hook_by_path_nodes_open_like_the_gpus_own(make):
    """With graphics, a GPU's /dev/dri/by-path names (links the default spec's hook makes) are
    nodes of their own in a spec without a hook: the same numbers as the GPU's card and render
    nodes, let through by the device cgroup (ENXIO: allowed, no driver behind it here)."""
    s = make(generate_args=["--no-hook", "--capabilities", "all"])
    p = s.run('for f in /dev/dri/card* /dev/dri/renderD* /dev/dri/by-path/*; do '
              'echo "NODE $f $(stat -c %t:%T "$f") $(head -c 1 "$f" 2>&1)"; done')
    assert p.returncode == 0, p.stderr
    nodes = {ln.split()[1]: ln.split()[2] for ln in p.stdout.splitlines() if ln.startswith("NODE ")}
    by_path = {k: v for k, v in nodes.items() if "/by-path/" in k}
    assert sorted(k.rsplit("-", 1)[1] for k in by_path) == ["card", "render"], p.stdout
    own = {v for k, v in nodes.items() if "/by-path/" not in k}
    assert set(by_path.values()) == own, p.stdout
    assert all("No such device or address" in ln for ln in p.stdout.splitlines() if ln.startswith("NODE ")), p.stdout
