"""nvhook's `nvidia-cdi-hook`: NVIDIA's CDI hook command line, run for real.

The installed bin/nvidia-cdi-hook (the wheel's) is run with an OCI state on stdin, as runc
runs it, against a rootfs in tmp: exit codes and messages as NVIDIA's hook gives them, the
work it does inside the rootfs (links, the loader cache ldconfig reads, modes), and what an
image's planted links cannot make it do outside. The runc test proves the first stage: a spec
hook entry without `env` gets the container's LD_PRELOAD from runc, and the setgid interpreter
(docs/cdi-hook.md) keeps the loader from loading it.
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
import runcbox as rb  # noqa: E402

HOOK = cdihookbox.plain_hook()
NVHOOK = Path(sys.executable).with_name("nvhook")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the CDI hook works on a rootfs as root")


class Box:
    """A bundle (config.json with root.path) and its rootfs, the state that names it, and a
    private nvhook config (log file, cache)."""

    def __init__(self, tmp: Path, rel_root: bool = True):
        self.tmp = tmp
        self.bundle = tmp / "bundle"
        self.rootfs = self.bundle / "rootfs"
        for d in ("usr/lib", "etc", "dev", "proc"):
            (self.rootfs / d).mkdir(parents=True, exist_ok=True)
        root_path = "rootfs" if rel_root else str(self.rootfs)
        (self.bundle / "config.json").write_text(json.dumps({"root": {"path": root_path}, "linux": {}}))
        self.state = json.dumps({"ociVersion": "1.0.2", "id": "cdihook-test", "status": "creating", "pid": os.getpid(),
                                 "bundle": str(self.bundle)})
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "hook.toml", log_file=self.log, cache_dir=tmp / "cache")

    def run(self, *args: str, exe: Path | list = HOOK, env: dict | None = None, config: bool = True):
        cmd = [str(exe)] if isinstance(exe, Path) else list(exe)
        pre = ["--nvhook-config", str(self.config)] if config else []
        return subprocess.run(cmd + pre + list(args), input=self.state, capture_output=True, text=True, timeout=60,
                              env=env if env is not None else {"PATH": os.environ["PATH"]})


@pytest.fixture
def box(tmp_path):
    return Box(tmp_path)


# -- NVIDIA's command line -------------------------------------------------------------------

@pytest.mark.parametrize("args,code,message", [
    (["no-such-hook"], 0, "warning: Unsupported CDI hook: no-such-hook"),
    (["update-application-profile"], 0, None),  # NVIDIA 1.20's: no GPU node, nothing to write
    ([], 0, "warning: No CDI hook specified"),
    (["--bogus", "no-such-hook"], 0, "warning: Unsupported CDI hook: no-such-hook"),
    (["chmod", "--bogus", "x"], 1, "error: flag provided but not defined: -bogus"),
    (["--bogus", "chmod"], 1, "error: flag provided but not defined: -bogus"),
    (["create-symlinks", "--link"], 1, "error: flag needs an argument: -link"),
    (["chmod", "--path", "/x"], 1, "error: a non-empty mode must be specified"),
    (["chmod", "--mode", "rwx", "--path", "/x"], 1, "error: failed to parse mode as octal"),
    (["update-ldcache", "--ldconfig-path", ""], 1, "error: ldconfig-path must be specified"),
    (["create-symlinks", "--link", "a::b::c"], 1, "error: invalid symlink specification a::b::c"),
    (["noop"], 0, None),
])
def test_exit_codes_and_messages_are_nvidias(box, args, code, message):
    p = box.run(*args)
    assert p.returncode == code, p.stderr
    if message is None:
        assert p.stderr == ""
    else:
        assert p.stderr.startswith(f"nvidia-cdi-hook (nvhook): {message}"), p.stderr
        assert len(p.stderr.splitlines()) == 1


def test_same_as_nvhook_cdi_hook(box):
    p = box.run("create-symlinks", "--link", "libx.so.1::/usr/lib/libx.so", exe=[str(NVHOOK), "cdi-hook"])
    assert p.returncode == 0, p.stderr
    assert os.readlink(box.rootfs / "usr/lib/libx.so") == "libx.so.1"
    assert box.run("bogus", exe=[str(NVHOOK), "cdi-hook"]).returncode == 0


def test_help_and_version(box):
    p = box.run("--help")
    assert p.returncode == 0 and "create-symlinks --link V ..." in p.stdout
    p = box.run("--version")
    assert p.returncode == 0 and p.stdout.startswith("nvidia-cdi-hook (nvhook) version ")


# -- the work ----------------------------------------------------------------------------------

def test_create_symlinks_in_the_rootfs_only(box, tmp_path):
    outside = tmp_path / "host-dir"
    outside.mkdir()
    # the image's /usr/lib64 is an absolute link to a host path: inside the rootfs it means
    # <rootfs><that path>, never the host's directory
    os.symlink(str(outside), box.rootfs / "usr/lib64")
    (box.rootfs / "usr/lib/libcuda.so.535.1").write_bytes(b"")
    p = box.run("create-symlinks", "--link", "libcuda.so.535.1::/usr/lib/libcuda.so.1",
                "--link", "libcuda.so.1::/usr/lib64/libcuda.so", "--link", "libcuda.so.535.1::/usr/lib/libcuda.so.1")
    assert p.returncode == 0, p.stderr
    assert os.readlink(box.rootfs / "usr/lib/libcuda.so.1") == "libcuda.so.535.1"
    assert os.listdir(outside) == []
    assert os.readlink(box.rootfs / str(outside).lstrip("/") / "libcuda.so") == "libcuda.so.1"


def test_container_root_from_an_absolute_root_path(tmp_path):
    box = Box(tmp_path, rel_root=False)
    p = box.run("create-symlinks", "--link", "t::/usr/lib/l")
    assert p.returncode == 0, p.stderr
    assert os.readlink(box.rootfs / "usr/lib/l") == "t"


def test_state_errors_are_one_line_and_exit_1(box):
    (box.bundle / "config.json").write_text("{}")
    p = box.run("create-symlinks", "--link", "a::/b")
    assert p.returncode == 1
    assert "failed to determine container root" in p.stderr and len(p.stderr.splitlines()) == 1


def test_update_ldcache_writes_the_cache_ldconfig_reads(box):
    libdir = box.rootfs / "usr/lib/nvidia-cdi"
    libdir.mkdir()
    rb.build_elf_library(libdir / "libnvtest.so.535.1", "libnvtest.so.1")
    os.symlink("libnvtest.so.535.1", libdir / "libnvtest.so.1")
    p = box.run("update-ldcache", "--folder", "/usr/lib/nvidia-cdi", "--ldconfig-path", "/sbin/ldconfig")
    assert p.returncode == 0, p.stderr
    listing = subprocess.run(["/sbin/ldconfig", "-p", "-C", str(box.rootfs / "etc/ld.so.cache")],
                             capture_output=True, text=True, timeout=30)
    assert "libnvtest.so.1 (libc6,x86-64) => /usr/lib/nvidia-cdi/libnvtest.so.1" in listing.stdout, listing


def test_create_soname_symlinks(box):
    libdir = box.rootfs / "usr/lib/x"
    libdir.mkdir()
    rb.build_elf_library(libdir / "libnvtest.so.535.1", "libnvtest.so.1")
    p = box.run("create-soname-symlinks", "--folder", "/usr/lib/x")
    assert p.returncode == 0, p.stderr
    assert os.readlink(libdir / "libnvtest.so.1") == "libnvtest.so.535.1"


def test_chmod_changes_modes_inside_the_rootfs(box):
    f = box.rootfs / "dev/dri-card"
    f.write_bytes(b"")
    os.chmod(f, 0o600)
    p = box.run("chmod", "--mode", "755", "--path", "/dev/dri-card", "--path", "/does/not/exist")
    assert p.returncode == 0, p.stderr
    assert f.stat().st_mode & 0o7777 == 0o755


@pytest.mark.parametrize("link", ["absolute", "dotdot"])
def test_chmod_never_changes_a_host_file_through_a_planted_link(box, tmp_path, link):
    host_file = tmp_path / "host-secret"
    host_file.write_text("x")
    os.chmod(host_file, 0o600)
    target = str(host_file) if link == "absolute" else "../" * 12 + str(host_file).lstrip("/")
    os.symlink(target, box.rootfs / "dev/dri")
    p = box.run("chmod", "--mode", "777", "--path", "/dev/dri")
    assert p.returncode == 0, p.stderr
    assert host_file.stat().st_mode & 0o7777 == 0o600
    # NVIDIA's own chmod (1.17, 1.18) follows that link out of the rootfs: the test would see it
    ref = reference_hook()
    if ref is not None:
        p = box.run("chmod", "--mode", "777", "--path", "/dev/dri", exe=ref, config=False)
        assert host_file.stat().st_mode & 0o7777 == 0o777, "NVIDIA's hook no longer follows the link"


def reference_hook() -> Path | None:
    ref = cdihookbox.reference("v1.17.0")
    return ref / "nvidia-cdi-hook" if ref else None


def test_params_rewrite():
    from nvhook.apply.paramsmask import modified_params

    assert modified_params(b"Foo: 1\nModifyDeviceFiles: 1\nBar: 2\n") == b"Foo: 1\nModifyDeviceFiles: 0\nBar: 2\n"
    assert modified_params(b"ModifyDeviceFiles: 0\n") is None
    assert modified_params(b"Foo: 1\n") is None


def test_disable_device_node_modification_masks_a_procfs_params(box, tmp_path):
    """On a host with ModifyDeviceFiles: 1, the container's /proc/driver/nvidia/params (on
    procfs, as a driver host's is: here a procfs file bound there) reads ModifyDeviceFiles: 0
    afterwards, read-only, while the procfs mount beneath keeps its flags (a remount through
    the target's fd from before the bind made the container's /proc read-only and noexec),
    and nothing is left in the image (bench --cdi-runc found both on a driver host's path)."""
    host = Path(__file__).resolve().parent / "fixtures" / "rootfs" / "host-gpu8"
    assert b"ModifyDeviceFiles: 1" in (host / "proc/driver/nvidia/params").read_bytes()
    rb.write_nvhook_config(box.config, log_file=box.log, cache_dir=tmp_path / "cache", root=host)
    params = box.rootfs / "proc/driver/nvidia/params"
    params.parent.mkdir(parents=True)
    params.write_bytes(b"")
    script = ('mount --bind /proc/version "$1" || exit 99; "$2" --nvhook-config "$3" disable-device-node-modification'
              ' < "$4" || exit $?; cat "$1"; echo ---; grep -F " $1 " /proc/self/mountinfo')
    state = tmp_path / "state.json"
    state.write_text(box.state)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(params),
                        str(HOOK), str(box.config), str(state)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    content, mountinfo = p.stdout.split("---\n")
    assert "ModifyDeviceFiles: 0" in content and "ModifyDeviceFiles: 1" not in content
    lines = [ln.split() for ln in mountinfo.splitlines()]
    assert [ln[8] for ln in lines] == ["proc", "tmpfs"], mountinfo  # procfs's file, nvhook's copy over it
    assert lines[1][5].startswith("ro,"), mountinfo
    # the remount is the copy's alone: procfs's mount under it (the container's /proc on a
    # driver host) keeps its flags
    assert lines[0][5].startswith("rw,"), mountinfo
    assert sorted(os.listdir(box.rootfs)) == ["dev", "etc", "proc", "usr"]
    assert params.read_bytes() == b""  # outside that namespace: the image's file, untouched


def test_container_environment_is_not_read(box, tmp_path):
    """NVHOOK_CONFIG from the (container's) environment would let an image choose nvhook's config."""
    evil = tmp_path / "evil.toml"
    evil_log = tmp_path / "evil.jsonl"
    rb.write_nvhook_config(evil, log_file=evil_log, cache_dir=tmp_path / "c2")
    env = {"PATH": os.environ["PATH"], "NVHOOK_CONFIG": str(evil)}
    p = box.run("create-symlinks", "--link", "a::/usr/lib/b", env=env)
    assert p.returncode == 0, p.stderr
    assert not evil_log.exists()
    assert box.log.exists()


# -- the first stage, under runc ---------------------------------------------------------------

PRELOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    const char *m = getenv("NVHOOK_TEST_MARKER");
    FILE *f = m ? fopen(m, "a") : NULL;
    if (f) { fputs("preloaded\n", f); fclose(f); }
}
"""


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
@pytest.mark.parametrize("stage", ["python", "shell", "shell-bash"])
@pytest.mark.parametrize("secure", [True, False])
def test_container_ld_preload_never_reaches_the_hook(tmp_path, secure, stage):
    """`python`: the set-group-ID python3 runs the hook file (a pip install made as
    docs/cdi-hook.md says). `shell`: the .deb's and node install's layout, a set-group-ID copy
    of /bin/sh runs the hook file and execs the set-group-ID python3 for the first entry; the
    second entry ends in that shell. `shell-bash`: the same with bash as the copied shell (the
    RHEL family's /bin/sh). Not `secure`: the same files run by the plain shell and python,
    which load the preload (so the test can fail)."""
    rootfs = rb.make_rootfs(tmp_path / "rootfs")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(rootfs / "usr/lib/preload.so"), "-x", "c", "-"],
                   input=PRELOAD_C, text=True, check=True, capture_output=True, timeout=60)
    marker = tmp_path / "marker"
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=log, cache_dir=tmp_path / "cache")
    hook = cdihookbox.first_stage(tmp_path, secure) if stage == "python" else \
        cdihookbox.shell_first_stage(tmp_path, secure, shell="/bin/bash" if stage == "shell-bash" else "/bin/sh")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/sh", "-c", "readlink /usr/lib/libdemo.so"]
    # The image's environment: what runc hands a hook entry that has no env. The preload path is
    # the host's name of the image's file (the hook runs before pivot_root).
    cfg["process"]["env"] = [f"LD_PRELOAD={rootfs}/usr/lib/preload.so", f"NVHOOK_TEST_MARKER={marker}",
                             "PATH=/bin:/usr/bin"]
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    cfg["hooks"] = {"createContainer": [{"path": str(hook), "args": [
        "nvidia-cdi-hook", "--nvhook-config", str(config), "create-symlinks", "--link", f"libdemo.so.1::/usr/lib/{name}"]}
        for name in ("libdemo.so", "libdemo2.so")]}
    cfg["process"]["args"] = ["/bin/sh", "-c", "readlink /usr/lib/libdemo.so; readlink /usr/lib/libdemo2.so"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    p = rb.runc_run(bundle, tmp_path / "runc-state")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["libdemo.so.1", "libdemo.so.1"]  # nvhook's hook did its work
    done = [json.loads(x) for x in log.read_text().splitlines() if '"cdi_hook.done"' in x]
    assert len(done) == 2
    # the shell stage: one Python process did both entries, the second ended in the shell
    assert len({e["nvhook_pid"] for e in done}) == (2 if stage == "python" else 1)
    reached = [e for e in rb.read_events(log) if e["event"] == "cdi_hook.loader_env_reached"]
    if secure:
        assert not marker.exists(), "the container's LD_PRELOAD was loaded into the hook"
        assert reached == []
    else:
        # and the log says so, naming the variable (the entries' python processes: the first
        # only, behind the shell)
        assert [e["variables"] for e in reached] == [["LD_PRELOAD"]] * (2 if stage == "python" else 1)
        # the control: a dynamically linked first stage loads it (so the test can fail): with
        # the shell, into the shell of both entries and the python of the first
        assert marker.read_text() == "preloaded\n" * (2 if stage == "python" else 3)


_PARAMS_IN_A_MOUNT_NS = r"""
import json, os, subprocess, sys
from nvhook.apply import paramsmask
from nvhook.start.cdihook import disable_device_node_modification, hookstate

tmp, target, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
rootfs, host = f"{tmp}/rootfs", f"{tmp}/host"
subprocess.run(["mount", "-t", "proc", "proc", f"{rootfs}/proc"], check=True)
paramsmask.PARAMS = target  # a procfs file every kernel has, standing in for the driver's

class Log:
    def __init__(self): self.events = []
    def debug(self, event, **kw): self.events.append(event)
    info = debug

log = Log()
root = hookstate.open_root(rootfs)
try:
    for _ in range(times):
        disable_device_node_modification.mask(root, {"root": host}, log)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
with open(rootfs + target) as f:
    seen = f.read()
try:
    with open(rootfs + target, "w") as f:
        f.write("x")
    writable = True
except OSError:
    writable = False
print(json.dumps({"error": error, "seen": seen, "writable": writable, "events": log.events,
                  "left": sorted(os.listdir(rootfs))}))
"""


@pytest.mark.parametrize("times", [1, 2])
def test_disable_device_node_modification_binds_the_rewritten_params_over_procfs(tmp_path, times):
    """What a real driver's /proc/driver/nvidia/params goes through (this machine has none: a
    procfs file of every kernel stands in, in a private mount namespace with the container's
    procfs mounted in its rootfs): the container reads ModifyDeviceFiles 0, cannot write it,
    and nothing nvhook made is left in the image. Found on a real H200: the tmpfs was reached
    through a magic link, which lands beneath the new mount, and the hook failed.

    Twice: the entry run again for the same container (the shell stage not taking off an entry
    that the python stage did: another container with the same id writing its marker, a spec
    that names the hook in two phases) finds its own copy in place and succeeds, as NVIDIA's
    hook run twice does; it failed with "not on procfs; refusing to mount over it"."""
    target = "/proc/version"
    (tmp_path / "rootfs/proc").mkdir(parents=True)
    (tmp_path / f"host{os.path.dirname(target)}").mkdir(parents=True)
    (tmp_path / f"host{target}").write_text("Foo: 1\nModifyDeviceFiles: 1\n")
    real = Path(target).read_text()
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                        _PARAMS_IN_A_MOUNT_NS, str(tmp_path), target, str(times)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["error"] is None, got
    assert got["seen"] == "Foo: 1\nModifyDeviceFiles: 0\n"
    assert not got["writable"]
    assert got["events"].count("params.masked") == 1
    assert got["events"].count("params.already_masked") == times - 1
    assert got["left"] == ["proc"], got  # no .nvhook-params-* directory left in the image
    assert Path(target).read_text() == real  # the machine's own procfs untouched


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
def test_on_a_nosuid_mount_the_preload_reaches_the_hook_and_the_log_says_so(tmp_path):
    """The documented limit: the .deb's set-group-ID copies on a `nosuid` mount run without
    the gid change, so without AT_SECURE, and the image's LD_PRELOAD is loaded into the hook
    (the copies made, then their directory bound nosuid; runc runs in that mount namespace).
    What nvhook can still do: the python stage finds LD_PRELOAD in its environment (the loader
    would have removed it) and writes cdi_hook.loader_env_reached, so the operator finds it."""
    rootfs = rb.make_rootfs(tmp_path / "rootfs")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(rootfs / "usr/lib/preload.so"), "-x", "c", "-"],
                   input=PRELOAD_C, text=True, check=True, capture_output=True, timeout=60)
    marker = tmp_path / "marker"
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=log, cache_dir=tmp_path / "cache")
    hook = cdihookbox.shell_first_stage(tmp_path)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    cfg["process"]["env"] = [f"LD_PRELOAD={rootfs}/usr/lib/preload.so", f"NVHOOK_TEST_MARKER={marker}",
                             "PATH=/bin:/usr/bin"]
    cfg["process"]["args"] = ["/bin/sh", "-c", "readlink /usr/lib/libdemo.so"]
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    cfg["hooks"] = {"createContainer": [{"path": str(hook), "args": [
        "nvidia-cdi-hook", "--nvhook-config", str(config), "create-symlinks", "--link", "libdemo.so.1::/usr/lib/libdemo.so"]}]}
    (bundle / "config.json").write_text(json.dumps(cfg))
    libexec = hook.parent.parent / "libexec"
    cid = f"nvhook-test-nosuid-{os.getpid()}"
    state = tmp_path / "runc-state"
    script = (f'mount --bind "{libexec}" "{libexec}" && mount -o remount,bind,nosuid "{libexec}" || exit 125; '
              f'runc --root "{state}" run --bundle "{bundle}" {cid}; rc=$?; runc --root "{state}" delete -f {cid}; '
              'exit $rc')
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["libdemo.so.1"]
    assert marker.read_text() == "preloaded\n" * 2  # the shell and the python stage loaded it
    reached = [e for e in rb.read_events(log) if e["event"] == "cdi_hook.loader_env_reached"]
    assert [e["variables"] for e in reached] == [["LD_PRELOAD"]]
