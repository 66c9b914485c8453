"""Rootless podman 4.3 (runc and crun) as a real unprivileged user with subordinate ids
(tests/e2e/rootlessbox.py: the user exists only in private mount namespaces; the machine's /etc
is never written), giving its containers the fixture host's GPUs:

- through CDI: nvhook's spec, the `--no-hook` spec, NVIDIA's 1.17 spec pointed at nvhook's
  nvidia-cdi-hook (its two-stage copies), with `--userns=keep-id` and `--user 1000`;
- through the OCI hooks file (hook mode): a CUDA image (NVIDIA_VISIBLE_DEVICES=all) without
  `--device` starts, its device cgroup skipped with one warning;
- the hook's events are where the user can read them: the journal where there is one (a
  stand-in socket), else ~/.local/state/nvhook/hook.log.

The nodes are the fixture host's (0666 there, as a udev rule or nvidia's NVreg_DeviceFileMode
would make them): opening one gives ENXIO ("No such device or address") where the container may,
with no driver behind it. The hook is a copy of this checkout's nvhook run by the distribution's
python3 (the .venv's interpreter may be one other users cannot run).
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

import cdibox  # noqa: E402
import cdihookbox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import rootlessbox as rl  # noqa: E402
import runcbox as rb  # noqa: E402
from gpuview import LIBCUDA, L, assert_gpu0, line  # noqa: E402
from gpuview import SCRIPT as USER_VIEW  # noqa: E402

from nvhook.commands import hookreach  # noqa: E402

pytestmark = [pytest.mark.podman, pytest.mark.skipif(rl.skip_reason() is not None, reason=rl.skip_reason() or "")]

ENXIO = "No such device or address"
RUNTIMES = ["runc", "crun"]
# the fixture host has no kernel module: nvhook says so on every start, rootless or not
FIXTURE_WARNINGS = {"procfs.emulated"}
ALL = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}


@pytest.fixture(scope="module")
def user():
    u = rl.User()
    try:
        u.hook = rl.install_hook(u)  # type: ignore[attr-defined]
        u.config, u.log = rl.node_log(u)  # type: ignore[attr-defined]
        yield u
    finally:
        u.close()


class Setup:
    def __init__(self, user: rl.User, host: Path, runtime: str, *, hooks: bool = False, image: str = "container-debian",
                 config_extra: str = ""):
        self.user = user
        self.host = host
        n = len(list((user.dir / "images").glob("*"))) if (user.dir / "images").exists() else 0
        self.rootfs = mf.build_container(image, user.dir / "images" / str(n))
        user.chown_tree(self.rootfs)  # the user's, as podman's own storage would hold it
        config = user.config
        if hooks:  # hook mode names its host root in the config, as `--root` does for cdi generate
            config = rb.write_nvhook_config(user.dir / "node" / f"hook-{n}.toml", log_file=user.log,
                                            cache_dir=user.dir / "node" / "cache", root=host, extra=config_extra)
            config.chmod(0o644)
        self.config = config
        hooks_dir = rl.hooks_dir(user, user.hook, config) if hooks else None
        self.podman = rl.Podman(user, runtime, hooks_dir)
        self.podman.devs = host / "dev"
        self.user_log = user.home / ".local/state/nvhook/hook.log"

    def generate(self, *extra: str, name: str = "nvhook.json") -> None:
        p = cdibox.generate(self.podman.spec_dir / name, config=self.user.config, host=self.host,
                            extra=["--hook-path", str(self.user.hook), *extra])
        assert p.returncode == 0, p.stderr
        assert "warning" not in p.stderr, p.stderr  # the hook is one others can run
        (self.podman.spec_dir / name).chmod(0o644)

    def run(self, script: str, devices=("nvidia.com/gpu=0",), **kw):
        return self.podman.run(self.rootfs, script, tuple(devices), **kw)

    def user_events(self) -> list[dict]:
        return rb.read_events(self.user_log) if self.user_log.exists() else []


@pytest.fixture
def make(user, fixtures_root):
    made: list[Setup] = []

    def _make(runtime: str, **kw) -> Setup:
        s = Setup(user, fixtures_root / "host-gpu8", runtime, **kw)
        made.append(s)
        return s

    yield _make
    for s in made:
        try:
            assert s.podman.leftovers() == []
        finally:
            s.podman.close()
    # nothing of a rootless run reaches root's log: the user cannot write it
    assert user.log.read_bytes() == b""
    ul = user.home / ".local/state/nvhook/hook.log"
    if ul.exists():
        ul.unlink()
    shutil.rmtree(user.home / ".cache/nvhook", ignore_errors=True)  # each test's first start builds it


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_nvhook_spec_gpu0(make, runtime):
    """nvhook's spec: the nodes (ENXIO: usable), the host's libcuda loaded through the cache
    the CDI hook wrote; the hook ran as the user and left its events in the user's log."""
    s = make(runtime)
    s.generate()
    p = s.run(USER_VIEW)
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)
    evs = s.user_events()
    done = [e for e in evs if e["event"] == "hook.done"]
    assert len(done) == 1 and done[0]["result"] == "ok", evs
    assert [e["event"] for e in evs if e["level"] in ("warning", "error")
            and e["event"] not in FIXTURE_WARNINGS] == [], evs


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("extra", [("--userns=keep-id",), ("--user", "1000")], ids=["keep-id", "user1000"])
def test_nvhook_spec_keep_id_and_a_non_root_user(make, runtime, extra):
    s = make(runtime)
    s.generate()
    p = s.run(USER_VIEW + "\necho ID:$(id -u)\n", extra=extra)
    assert p.returncode == 0, p.stderr
    assert_gpu0(p.stdout)
    assert line(p.stdout, "ID:") == (str(s.user.uid) if extra[0] == "--userns=keep-id" else "1000")
    # The CDI hook ran as podman's namespace root, the user (--user 1000), or as the container's
    # root, a subordinate uid, with the user mapped at their own uid (keep-id): either way the
    # user's own log has its events, and the log and its directory are the user's.
    assert [e["result"] for e in s.user_events() if e["event"] == "hook.done"] == ["ok"], s.user_events()
    for p in (s.user_log, s.user_log.parent):
        assert (p.stat().st_uid, p.stat().st_gid) == (s.user.uid, s.user.gid), p


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_keep_id_events_go_to_the_journal(make, runtime):
    """Under keep-id the CDI hook is the container's root, a subordinate uid: where there is a
    journal (open to every uid) it keeps the events, as for every rootless hook (docs/logs.md)."""
    s = make(runtime)
    s.generate()
    journal = rl.Journal(s.user.dir / f"journal-keep-id-{runtime}")
    s.podman.journal = journal.path.parent
    try:
        p = s.run("/usr/bin/cuda-probe", extra=("--userns=keep-id",))
    finally:
        journal.close()
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert [e["result"] for e in journal.events() if e["event"] == "hook.done"] == ["ok"], journal.events()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_no_hook_spec(make, runtime):
    """No hook at all: the nodes and the libraries at their SONAMEs; the loader finds the host's
    libcuda with nothing run in the container."""
    s = make(runtime)
    s.generate("--no-hook")
    p = s.run('echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; /usr/bin/cuda-probe')
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "OPEN0:") == f"head: /dev/nvidia0: {ENXIO}"
    assert line(p.stdout, "path: ") == f"{L}/libcuda.so.1"
    assert s.user_events() == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hook_mode_cuda_image_without_device_starts(make, runtime):
    """The OCI hooks file (rootless podman reads `--hooks-dir` too), a CUDA image asking for every
    GPU, no `--device`: the hook mounts the driver and binds the nodes it found, writes no device
    cgroup (it cannot, in the user namespace; one warning says so), and the container starts."""
    s = make(runtime, hooks=True)
    p = s.run('echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; echo "OPENCTL:$(head -c 1 /dev/nvidiactl 2>&1)"; '
              "echo NODES:$(ls /dev | grep -c '^nvidia[0-9]'); /usr/bin/cuda-probe", devices=(), env=ALL)
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "OPEN0:") == f"head: /dev/nvidia0: {ENXIO}"
    assert line(p.stdout, "OPENCTL:") == f"head: /dev/nvidiactl: {ENXIO}"
    assert line(p.stdout, "NODES:") == str(len(mf.HOSTS["host-gpu8"].gpus))
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    evs = s.user_events()
    skipped = [e for e in evs if e["event"] == "cgroups.skipped"]
    assert len(skipped) == 1 and skipped[0]["level"] == "warning", evs
    assert f"host uid {s.user.uid}" in skipped[0]["message"]
    assert "user namespace" in skipped[0]["message"]
    assert [e["event"] for e in evs if e["level"] == "warning" and e["event"] not in FIXTURE_WARNINGS] == \
        ["cgroups.skipped"], evs
    assert [e for e in evs if e["event"] == "hook.done"][0]["result"] == "ok"
    # the inventory is cached in the user's own ~/.cache/nvhook: built once, then read
    (built,) = [e for e in evs if e["event"] == "inventory.built"]
    cache = s.user.home / ".cache/nvhook"
    assert built["cached"] is True and built["cache_dir"] == str(cache), built
    assert cache.stat().st_uid == s.user.uid and cache.stat().st_mode & 0o777 == 0o700
    assert not [e for e in evs if e["event"] == "inventory.cache_refused"]
    p = s.run("/usr/bin/cuda-probe", devices=(), env=ALL)
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    evs = s.user_events()
    assert len([e for e in evs if e["event"] == "hook.done"]) == 2
    assert len([e for e in evs if e["event"] == "inventory.built"]) == 1, evs  # the second start: from the cache


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hook_mode_driver_root_on_a_read_only_mount(make, runtime):
    """The driver root on a read-only mount (as a node's often is: the test node's fixture host
    is one). A user namespace locks the flags of a mount it did not make, so each bind the hook
    makes from there stays read-only, and its remount must keep ro (it failed every start with
    "cannot remount ... Operation not permitted"); the container starts with its GPUs."""
    s = make(runtime, hooks=True)
    s.podman.readonly = s.host
    p = s.run('echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; /usr/bin/cuda-probe', devices=(), env=ALL)
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "OPEN0:") == f"head: /dev/nvidia0: {ENXIO}"
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    evs = s.user_events()
    assert [e["result"] for e in evs if e["event"] == "hook.done"] == ["ok"], evs
    assert [e["event"] for e in evs if e["level"] == "warning" and e["event"] not in FIXTURE_WARNINGS] == \
        ["cgroups.skipped"], evs


def test_hook_mode_keep_id_logs_to_the_users_own_log(make):
    """The hooks file's prestart hook runs in podman's namespace, whose root is the user, even
    under keep-id (unlike a CDI spec's createContainer hook): its events are in the user's log."""
    s = make("runc", hooks=True)
    p = s.run("/usr/bin/cuda-probe; echo ID:$(id -u)", devices=(), env=ALL, extra=("--userns=keep-id",))
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert line(p.stdout, "ID:") == str(s.user.uid)
    evs = s.user_events()
    assert [e["result"] for e in evs if e["event"] == "hook.done"] == ["ok"], evs
    assert len([e for e in evs if e["event"] == "cgroups.skipped"]) == 1


def test_hook_mode_with_nvhookd_required_runs_in_process(make):
    """nvhookd serves the host's root only (its socket is root's, 0600): with `[daemon] mode =
    "required"` and nvhookd listening, a rootless hook does not ask it (it would be refused)
    and runs the start itself, without a warning."""
    import socket

    s0 = make("runc")
    d = s0.user.dir / "node" / "daemon"
    d.mkdir(mode=0o700)
    path = d / "nvhookd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    os.chmod(path, 0o600)
    try:
        s = make("runc", hooks=True, config_extra=f'[daemon]\nmode = "required"\nsocket = "{path}"\n')
        p = s.run("/usr/bin/cuda-probe", devices=(), env=ALL)
    finally:
        listener.close()
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    evs = s.user_events()
    assert not [e for e in evs if e["event"].startswith("daemon.")], evs
    assert [e["event"] for e in evs if e["level"] == "warning" and e["event"] not in FIXTURE_WARNINGS] == \
        ["cgroups.skipped"], evs


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hook_mode_events_go_to_the_journal_where_there_is_one(make, runtime):
    s = make(runtime, hooks=True)
    journal = rl.Journal(s.user.dir / f"journal-{runtime}")
    s.podman.journal = journal.path.parent
    try:
        p = s.run("/usr/bin/cuda-probe", devices=(), env=ALL)
    finally:
        journal.close()
    assert p.returncode == 0, p.stderr
    evs = journal.events()
    assert [e["event"] for e in evs if e["event"] in ("hook.start", "cgroups.skipped", "hook.done")] == \
        ["hook.start", "cgroups.skipped", "hook.done"], evs
    assert s.user_events() == []


def test_container_that_asks_for_no_gpu_starts_and_is_logged(make):
    s = make("runc", hooks=True)
    p = s.run("echo STARTED; echo DEV:$(ls /dev | grep -c nvidia)", devices=())
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "DEV:") == "0"
    evs = s.user_events()
    assert [e["event"] for e in evs][-1] == "hook.done"
    assert not [e for e in evs if e["level"] not in ("info", "debug")], evs


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_nvidia_117_spec_with_nvhooks_cdi_hook(make, runtime):
    """NVIDIA 1.17's spec (nvidia-ctk, built by bench/build_reference_cdi.sh) pointed at nvhook's
    nvidia-cdi-hook in the .deb's layout: the shell first stage and the python stage, each a
    set-group-ID copy (mode 2711: runnable by the rootless user), the python the distribution's.
    Every entry's work done; its events in the user's log."""
    ref = cdihookbox.reference("v1.17.0")
    if ref is None:
        pytest.skip("NVIDIA's nvidia-ctk v1.17.0 is not built: run bench/build_reference_cdi.sh DIR and set "
                    "NVHOOK_REFERENCE_CDI=DIR")
    s = make(runtime)
    d = s.user.dir / f"stage-{runtime}"
    d.mkdir()
    hook = cdihookbox.shell_first_stage(d, python=rl.PY)
    subprocess.run(["chmod", "-R", "a+rX", str(d)], check=True)
    for sub in ("libexec/sh", "libexec/python3"):
        os.chmod(hook.parent.parent / sub, 0o2711)  # chmod a+rX above kept the mode; as the .deb's
    assert hookreach.path_problems(str(hook)) == []
    p = cdihookbox.nvidia_ctk_generate(ref, s.host, str(hook))
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    hooks = spec["containerEdits"]["hooks"]
    for h in hooks:
        h["args"][1:1] = ["--nvhook-config", str(s.user.config)]
    spec["cdiVersion"] = min(spec["cdiVersion"], "0.5.0")  # what podman 4.3 reads
    (s.podman.spec_dir / "nvidia.json").write_text(json.dumps(spec))
    p = s.run(f"/usr/bin/cuda-probe; echo LINK:$(readlink {L}/libcuda.so); /sbin/ldconfig -p | grep 'libcuda.so.1 '; "
              'echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"')
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "path: ") == f"{L}/{LIBCUDA}"
    assert line(p.stdout, "LINK:") == "libcuda.so.1"  # create-symlinks
    assert f"=> {L}/libcuda.so.1" in p.stdout  # update-ldcache
    assert line(p.stdout, "OPEN0:") == f"head: /dev/nvidia0: {ENXIO}"
    done = [e for e in s.user_events() if e["event"] == "cdi_hook.done"]
    assert [e["cdi_hook"] for e in done] == [h["args"][3] for h in hooks], s.user_events()


VIDEO = 44  # Debian's video group, which nvidia's nodes often have (0660 root:video)
OPEN = 'echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; echo GROUPS:$(id -G)'


@pytest.mark.parametrize(("runtime", "extra", "opens"), [
    ("crun", ("--group-add", "keep-groups"), True),  # crun keeps the user's own groups in the container
    ("runc", ("--group-add", "keep-groups"), False),  # podman 4.3 with runc: ignored, silently
    ("crun", ("--group-add", str(VIDEO)), False),  # 44 in the container is a subordinate gid, not video
    ("crun", (), False),
], ids=["crun-keep-groups", "runc-keep-groups", "crun-group-add-44", "crun-plain"])
def test_0660_video_nodes_rootless(make, runtime, extra, opens):
    """docs/podman-crio-cdi.md's advice for 0660 root:video nodes, for a user in group video:
    crun with --group-add keep-groups opens them; --group-add 44 (as the spec's
    additionalGids) and runc do not (EACCES from the node's mode, not the device cgroup)."""
    s = make(runtime)
    s.generate()
    s.podman.node_mode = f"0660:{VIDEO}"
    p = s.run(OPEN, extra=extra, groups=(VIDEO,))
    assert p.returncode == 0, p.stderr
    want = ENXIO if opens else "Permission denied"
    assert line(p.stdout, "OPEN0:") == f"head: /dev/nvidia0: {want}"


def test_cdi_generate_and_check_say_when_others_cannot_run_the_hook(make):
    """A hook whose #! interpreter sits under a 0700 directory: generate and check each say so in
    one line (a warning: the spec is right for a rootful engine), and a rootless container with
    that spec does not start (what the line warns of); opened up, it says nothing and starts."""
    s = make("runc")
    user = s.user
    closed = user.dir / "closed"
    (closed / "bin").mkdir(parents=True)
    os.chmod(closed, 0o700)
    interp = closed / "bin" / "python3"
    os.symlink(rl.PY, interp)
    hook = user.dir / "hook-closed" / "nvhook"
    hook.parent.mkdir()
    hook.write_text(Path(user.hook).read_text().replace(rl.PY, str(interp), 1))
    hook.chmod(0o755)
    spec = s.podman.spec_dir / "nvhook.json"
    p = cdibox.generate(spec, config=user.config, host=s.host, extra=["--hook-path", str(hook)])
    assert p.returncode == 0, p.stderr
    spec.chmod(0o644)
    want = (f"nvhook: warning: hook {hook}: its interpreter {interp} cannot be run by other users: {closed} is mode "
            f"0700, closed to other users (rootless engines and user-namespaced containers run it as an "
            f"unprivileged uid)")
    assert [ln for ln in p.stderr.splitlines() if "warning" in ln] == [want]
    check = [str(rb.NVHOOK_BIN), "--config", str(user.config), "--root", str(s.host), "cdi", "check",
             "--hook-path", str(hook), str(spec)]
    c = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stdout + c.stderr  # it matches the host
    assert [ln for ln in c.stderr.splitlines() if "warning" in ln] == [want]
    r = s.run("echo STARTED")
    assert r.returncode != 0 and "STARTED" not in r.stdout
    assert "permission denied" in r.stderr.lower(), r.stderr
    os.chmod(closed, 0o755)  # opened: nothing to say, and it starts
    c = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert c.returncode == 0 and "warning" not in c.stderr, c.stderr
    r = s.run("echo STARTED")
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr
