"""The wheel's documented install: `nvhook setup` makes nvidia-cdi-hook's two set-group-ID
stages in /usr/local/lib/nvhook (the .deb's layout), and the venv's own bin/nvidia-cdi-hook is
their shell first stage, never a script of the venv's dynamically linked python (issue 35 item
5). Everything happens under a private root (`--prefix`) whose /usr is this machine's, read-only,
but for /usr/local, a temporary directory: the machine's own /usr/local and /etc are never
written. The runc test then binds that directory over /usr/local in a private mount namespace,
so that the stages are at their final paths for runc's hooks there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdihookbox  # noqa: E402
import runcbox as rb  # noqa: E402

NVHOOK = str(Path(sys.executable).with_name("nvhook"))
VENV_HOOK = Path(sys.executable).with_name("nvidia-cdi-hook")  # the wheel's script, as pip installed it
LX = "usr/local/lib/nvhook/libexec"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root (set-group-ID copies, mount namespaces)")


@pytest.fixture
def root(tmp_path):
    """A private root with Debian's account files; its /usr/local lives in tmp_path/local.
    Removed after the test with the set-group-ID copies it holds."""
    r = tmp_path / "root"
    for d in ("usr", "etc", "var/lib", "tmp", "dev", "proc", "run"):
        (r / d).mkdir(parents=True)
    for name, target in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin"), ("sbin", "usr/sbin")):
        os.symlink(target, r / name)
    (r / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/:/usr/sbin/nologin\n")
    (r / "etc/group").write_text("root:x:0:\nshadow:x:42:\nnogroup:x:65534:\n")
    (r / "etc/gshadow").write_text("root:*::\nshadow:*::\nnogroup:*::\n")
    (tmp_path / "local").mkdir()
    yield r
    shutil.rmtree(tmp_path, ignore_errors=True)


def in_root(root: Path, script: str, check: bool = True) -> subprocess.CompletedProcess:
    """`script` in a private mount namespace where `root` has this machine's /usr (read-only)
    with the test's own /usr/local, /dev and a /proc; $NVHOOK, $ROOT."""
    local = root.parent / "local"
    base = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))  # this venv's python's own tree
    setup = (f"mount --bind /usr {root}/usr && mount -o remount,bind,ro {root}/usr && "
             f"mkdir -p {root}{base} && mount --bind {base} {root}{base} && "
             f"mount --bind {local} {root}/usr/local && mount --bind /dev {root}/dev && "
             f"mount -t proc proc {root}/proc && ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")}
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", setup + script],
                       env={**env, "NVHOOK": NVHOOK, "ROOT": str(root)}, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_setup_makes_the_debs_two_stages_and_the_venvs_hook_is_their_first(root):
    r = in_root(root, "$NVHOOK setup --prefix $ROOT")
    for path in ("usr/local/lib/nvhook/bin/nvidia-cdi-hook", f"{LX}/nvidia-cdi-hook.py", f"{LX}/python3", f"{LX}/sh",
                 f"{LX}/pyvenv.cfg"):
        assert f"created                {root}/{path}\n" in r.stdout, r.stdout
    group = [g.split(":") for g in (root / "etc/group").read_text().splitlines() if g.startswith("nvhook-hook:")]
    assert len(group) == 1 and group[0][3] == ""
    gid = int(group[0][2])
    local = root.parent / "local/lib/nvhook"
    for copy, src in (("python3", os.path.realpath(sys.executable)), ("sh", os.path.realpath("/bin/sh"))):
        st = (local / "libexec" / copy).lstat()
        assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(0o2711), 0, gid)
        assert (local / "libexec" / copy).read_bytes() == Path(src).read_bytes()
    # the venv's bin/nvidia-cdi-hook is the first stage setup wrote, naming those copies
    first = (local / "bin/nvidia-cdi-hook").read_text()
    assert VENV_HOOK.read_text() == first and first.startswith("#!/usr/local/lib/nvhook/libexec/sh\n")
    stage2 = (local / "libexec/nvidia-cdi-hook.py").read_text()
    assert stage2.startswith("#!/usr/local/lib/nvhook/libexec/python3 -IS\n")
    # what the root-run stage imports from: nvhook's own directory and this venv's site-packages only
    paths = eval(stage2.split("\n")[2].split(" = ", 1)[1])  # noqa: S307 (setup's own repr of a list)
    assert os.path.isfile(os.path.join(paths[0], "nvhook/start/__init__.py")), paths
    assert all(p.startswith(sys.prefix + "/") for p in paths[1:]) and paths[1:], paths
    # run as the node would: the venv's hook through both copies (their #! lines resolved in `root`)
    v = in_root(root, f"mount --bind {root}/usr/local /usr/local && {VENV_HOOK} --version")
    assert v.stdout.startswith("nvidia-cdi-hook (nvhook) version"), v.stdout + v.stderr
    again = in_root(root, "$NVHOOK setup --prefix $ROOT")
    assert "created" not in again.stdout and f"unchanged              {root}/{LX}/sh" in again.stdout
    gone = in_root(root, "$NVHOOK setup --prefix $ROOT --uninstall")
    assert f"removed                {root}/{LX}/python3" in gone.stdout
    assert f"group nvhook-hook (gid {gid}), on purpose" in gone.stdout  # kept: docs/security.md
    assert not (root.parent / "local/lib/nvhook").exists()


@pytest.mark.parametrize("plant", ["dir", "link", "others"])
def test_a_stage_directory_someone_else_can_change_is_refused(root, plant):
    """A local user who could write /usr/local/lib (a workstation's /usr/local chowned to its
    user) made /usr/local/lib/nvhook before setup ran, or a link there to a directory of theirs,
    or the directory is writable by others: root would run whatever that user puts in libexec/
    at every container start. setup refuses in one line, exit 1, and writes no copy there."""
    local = root.parent / "local"
    mine = local / "lib/nvhook"
    if plant == "link":
        (root / "tmp/u").mkdir()
        os.chown(root / "tmp/u", 1000, 1000)
        (local / "lib").mkdir()
        os.symlink("/tmp/u", mine)
    else:
        mine.mkdir(parents=True)
        if plant == "dir":
            os.chown(mine, 1000, 1000)
        else:
            os.chmod(mine, 0o777)
    r = in_root(root, "$NVHOOK setup --prefix $ROOT", check=False)
    where = "/tmp/u" if plant == "link" else "/usr/local/lib/nvhook"
    says = "is owned by uid 1000" if plant != "others" else "is writable by others (mode 777)"
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert f"{where} {says}: whoever can change it can replace what nvidia-cdi-hook runs as root" in r.stderr, r.stderr
    made = [str(p) for d in (mine, root / "tmp/u") if d.is_dir() for p in d.rglob("*") if p.is_file()]
    assert made == []


def test_a_venv_another_user_owns_is_refused(root):
    """The python stage imports nvhook from the venv that ran setup, as root, at every container
    start: a venv in a user's home (or chowned to them) is that user's root. setup refuses it in
    one line. The host's view of this venv is made in the private root: owned by uid 1000."""
    venv = Path(sys.prefix)
    (root / venv.relative_to("/")).mkdir(parents=True)
    os.chown(root / venv.relative_to("/"), 1000, 1000)
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix + "/"))
    (root / site.lstrip("/")).mkdir(parents=True)
    r = in_root(root, "$NVHOOK setup --prefix $ROOT", check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert f"{venv} is owned by uid 1000: whoever can change it can replace what nvidia-cdi-hook runs as root; " \
        "install nvhook" in r.stderr, r.stderr
    assert not (root.parent / "local/lib/nvhook/libexec/python3").exists()


def test_before_setup_the_venvs_hook_runs_nothing(tmp_path):
    """Before `nvhook setup` has made the copies, the kernel finds no interpreter for the venv's
    bin/nvidia-cdi-hook: nothing runs, not even with a preload in the environment."""
    if Path("/usr/local/lib/nvhook/libexec/sh").exists():
        pytest.skip("this machine ran `nvhook setup`")
    marker = tmp_path / "marker"
    lib = tmp_path / "preload.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), "-x", "c", "-"], input=PRELOAD_C, text=True,
                   check=True, capture_output=True, timeout=60)
    with pytest.raises(FileNotFoundError):
        subprocess.run([str(VENV_HOOK), "--version"], env={"LD_PRELOAD": str(lib), "NVHOOK_TEST_MARKER": str(marker)})
    assert not marker.exists()


PRELOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    const char *m = getenv("NVHOOK_TEST_MARKER");
    FILE *f = m ? fopen(m, "a") : NULL;
    if (f) { fputs("preloaded\n", f); fclose(f); }
}
"""


def nvidia_bundle(tmp: Path, fixtures_root: Path, hook: Path, config: Path, marker: Path) -> tuple[Path, int]:
    """A runc bundle with NVIDIA 1.17.0's spec for host-gpu8 applied (its mounts as binds, its
    createContainer entries, which carry no env, pointed at `hook` with the test's config), and
    an image whose LD_PRELOAD and PYTHONHOME point into its rootfs. (bundle, number of entries)"""
    ref = cdihookbox.reference("v1.17.0")
    if ref is None:
        pytest.skip("NVIDIA's nvidia-ctk v1.17.0 is not built: bench/build_reference_cdi.sh DIR, "
                    "NVHOOK_REFERENCE_CDI=DIR")
    host = fixtures_root / "host-gpu8"
    p = cdihookbox.nvidia_ctk_generate(ref, host, str(hook))
    assert p.returncode == 0, p.stderr[-2000:]
    edits = json.loads(p.stdout)["containerEdits"]
    entries = [h for h in edits["hooks"] if h["hookName"] == "createContainer"]
    assert entries and not any("env" in h for h in entries)  # 1.17.0: the container's environment reaches them
    rootfs = rb.make_rootfs(tmp / "rootfs")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(rootfs / "usr/lib/preload.so"), "-x", "c", "-"],
                   input=PRELOAD_C, text=True, check=True, capture_output=True, timeout=60)
    (rootfs / "usr/lib/python3.11").mkdir(parents=True)  # a PYTHONHOME with no standard library
    bundle = tmp / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    lib = "/usr/lib/x86_64-linux-gnu"
    cfg["process"]["args"] = ["/bin/sh", "-c", f"readlink {lib}/libcuda.so; readlink {lib}/gbm/nvidia-drm_gbm.so; "
                              "ls /etc/ld.so.cache"]
    cfg["process"]["env"] = [f"LD_PRELOAD={rootfs}/usr/lib/preload.so", f"PYTHONHOME={rootfs}/usr",
                             f"NVHOOK_TEST_MARKER={marker}", "PATH=/bin:/usr/bin"]
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    cfg["mounts"] += [{"destination": m["containerPath"], "source": m["hostPath"], "type": "bind",
                       "options": [o for o in m["options"] if o != "bind"] + ["rbind"]} for m in edits["mounts"]]
    cfg["hooks"] = {"createContainer": [{"path": h["path"], "args": [h["args"][0], "--nvhook-config", str(config),
                                                                     *h["args"][1:]]} for h in entries]}
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle, len(entries)


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
@pytest.mark.parametrize("hook", ["setup", "plain"])
def test_nvidia_117_spec_through_the_venvs_hook_under_runc(root, fixtures_root, hook):
    """`setup`: the venv's bin/nvidia-cdi-hook after `nvhook setup`: the container starts with
    every entry's work done, in one Python process for the run, and the image's LD_PRELOAD never
    ran. `plain`: the same spec through a script of the venv's python (what the wheel installed
    before): the preload runs in the hook (so the test can fail)."""
    tmp = root.parent
    marker = tmp / "marker"
    log = tmp / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp / "hook.toml", log_file=log, cache_dir=tmp / "cache",
                                    root=fixtures_root / "host-gpu8")
    path = VENV_HOOK if hook == "setup" else cdihookbox.plain_hook()
    bundle, n = nvidia_bundle(tmp, fixtures_root, path, config, marker)
    if hook == "setup":
        in_root(root, "$NVHOOK setup --prefix $ROOT")
    state = tmp / "runc-state"
    cid = f"nvhook-setup-{os.getpid()}"
    # the stages at their final paths, the markers on a private /run/nvhook
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f"mount --bind {tmp}/local /usr/local && mount -t tmpfs -o mode=0700 tmpfs /run/nvhook && "
                        f"runc --root {state} run --bundle {bundle} {cid}; rc=$?; "
                        f"runc --root {state} delete -f {cid} 2>/dev/null; exit $rc"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # create-symlinks' links, update-ldcache's cache
    assert r.stdout.split() == ["libcuda.so.1", "../libnvidia-allocator.so.1", "/etc/ld.so.cache"], r.stdout
    done = [e for e in rb.read_events(log) if e["event"] == "cdi_hook.done"]
    assert len(done) == n
    if hook == "setup":
        assert not marker.exists(), "the container's LD_PRELOAD was loaded into the hook"
        assert len({e["nvhook_pid"] for e in done}) == 1  # the run of entries in one Python process
    else:
        assert marker.read_text().count("preloaded") == n
