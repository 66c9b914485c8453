"""What a hook does differently in a user namespace (a rootless engine's), each next to what the
host's root still does: the device cgroup (skipped with one warning, refused as before by a
rootful hook), where its events go (the journal, else the user's own log), and why the inventory
cache is not used. The rootless engine itself: tests/test_rootless_podman.py.

The namespaces are made with `unshare --user --map-root-user` (the kernel's own, no setuid
helper), as root (uid 0 inside is root outside: this interpreter can be run) or after setpriv to
an unprivileged uid (the distribution's python3 then, which any uid can run, on this checkout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nvhook.apply import cgroups
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog

REPO = Path(__file__).resolve().parents[1]
PY = "/usr/bin/python3"
UID = 59321  # a uid with no entry, for the unprivileged runs

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                                reason="needs root, unshare and setpriv")


def _devices_cgroup() -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "devices" in controllers.split(","):
                return path
    return None


@pytest.fixture
def v1(tmp_path):
    """A v1 devices controller as the hook would find it: a mountinfo line naming a directory
    of ours as its mount, where this process's cgroup path (from /proc/self/cgroup) holds
    devices.allow."""
    path = _devices_cgroup()
    if path is None:
        pytest.skip("no v1 devices controller line in /proc/self/cgroup (a cgroup v2 host)")
    mnt = tmp_path / "devices"
    cg = mnt / path.strip("/")
    cg.mkdir(parents=True)
    info = tmp_path / "mountinfo"
    info.write_text(f"40 30 0:35 / {mnt} rw,nosuid - cgroup cgroup rw,devices\n")
    return mnt, cg, info


RULES = [{"type": "c", "major": 195, "minor": 0, "access": "rw"}]


def test_rootful_hook_still_refuses_when_it_cannot_allow_the_devices(v1, tmp_path):
    _, cg, info = v1
    log = EventLog("debug")
    with pytest.raises(HookError) as e:
        cgroups.apply_devices(RULES, os.getpid(), log, mountinfo_path=str(info), cgroup_root=str(tmp_path))
    assert e.value.message == f"cannot open {cg}/devices.allow to allow the GPU devices: does not exist"
    assert [ev["event"] for ev in log.events] == []


def test_rootful_hook_writes_the_rule(v1, tmp_path):
    _, cg, info = v1
    (cg / "devices.allow").write_text("")
    log = EventLog("debug")
    assert cgroups.apply_devices(RULES, os.getpid(), log, mountinfo_path=str(info), cgroup_root=str(tmp_path)) == 1
    assert (cg / "devices.allow").read_text() == "c 195:0 rw"


CHILD = """
import json, os, sys
from nvhook.apply import cgroups
from nvhook.base.log import EventLog
log = EventLog("debug")
n = cgroups.apply_devices(json.loads(sys.argv[1]), int(sys.argv[2]), log, mountinfo_path=sys.argv[3],
                          cgroup_root=sys.argv[4])
print(json.dumps({"n": n, "events": log.events, "uid_map": open("/proc/self/uid_map").read()}))
"""


@pytest.mark.parametrize("allow", ["missing", "writable"])
def test_hook_in_a_user_namespace_skips_the_cgroup_with_one_warning(v1, tmp_path, allow):
    """Whether or not devices.allow could be opened: nothing is written, nothing refused, one
    warning that names the namespace and the uid."""
    _, cg, info = v1
    if allow == "writable":
        (cg / "devices.allow").write_text("")
    p = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", CHILD, json.dumps(RULES),
                        str(os.getpid()), str(info), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["uid_map"].split() == ["0", "0", "1"]
    assert out["n"] == 0
    (ev,) = out["events"]
    assert ev["event"] == "cgroups.skipped" and ev["level"] == "warning"
    assert ev["rules"] == ["c 195:0 rw"]
    assert ev["reason"].startswith("this hook runs in a user namespace (a rootless engine, host uid 0)")
    if allow == "writable":
        assert (cg / "devices.allow").read_text() == ""


def _as_user(code: str, *args: str, namespace: bool = True, pre: str = "", env: dict | None = None):
    """`code` run by the distribution's python3 on this checkout as UID, in a user namespace of
    its own (uid 0 there) with a mount namespace and a /run of its own, unless not `namespace`."""
    if not os.access(PY, os.X_OK):
        pytest.skip(f"no {PY}")
    cmd = [PY, "-c", code, *args]
    if namespace:
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f"mount -t tmpfs tmpfs /run && {pre or 'true'} && exec \"$@\"", "sh", *cmd]
    return subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **(env or {})})


@pytest.fixture
def shared():
    """A directory under /tmp that the unprivileged uid can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="nvhook-rlh-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


CACHE = "import sys; from nvhook.observe.host import cache; print(cache.refusal(sys.argv[1]))"


def test_cache_in_a_user_namespace_is_the_users_own(shared):
    """The user's own directory is trusted there: the directories above it, the host root's,
    show as the overflow uid (65534) and are taken as root's; root's own cache dir (as
    /run/nvhook) is refused with the reason, not a mode."""
    own = shared / "own"
    own.mkdir(mode=0o700)
    os.chown(own, UID, UID)
    p = _as_user(CACHE, str(own))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "None"
    roots = shared / "roots"
    roots.mkdir(mode=0o700)
    p = _as_user(CACHE, str(roots))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(("info", f"this hook runs in a user namespace (a rootless engine, host uid {UID}) "
                                            f"and cannot use {roots} ({roots} is owned by uid 65534): each start "
                                            f"scans the host's driver files again"))
    # outside a namespace the same directory is trusted as before: its own, under root's
    p = _as_user(CACHE, str(own), namespace=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "None"
    # a directory above the user's, writable by others, is refused in the namespace too
    os.chmod(shared, 0o777)
    p = _as_user(CACHE, str(own))
    assert "(above the cache) is writable by group or others (mode 0777)" in p.stdout, p.stdout


def test_cache_problem_of_a_root_dir_for_another_uid_names_the_owner_not_a_mode(shared):
    """Was: "writable by group or others (mode 0700)" for a directory only root can write."""
    cache = shared / "cache"
    cache.mkdir(mode=0o700)
    p = _as_user("import sys; from nvhook.base.config import cache_problem; print(cache_problem(sys.argv[1]))",
                 str(cache), namespace=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{cache} is root's, not this process's (uid {UID})"


LOG_TARGET = "import json, sys; from nvhook.base import log, userns; print(json.dumps(userns.log_target(sys.argv[1], log.JOURNAL_SOCKET)[:2]))"
STANDIN = ("mkdir -p /run/systemd/journal && python3 -c \"import socket, os; s = socket.socket(socket.AF_UNIX, "
           "socket.SOCK_DGRAM); s.bind('/run/systemd/journal/socket')\"")


def test_log_of_a_rootless_hook_is_the_users_own_without_a_journal(shared):
    log = shared / "log" / "nvhook.jsonl"  # root's, as on a node
    log.parent.mkdir()
    log.touch(mode=0o640)
    state = shared / "state"
    state.mkdir()
    os.chown(state, UID, UID)
    p = _as_user(LOG_TARGET, str(log), env={"XDG_STATE_HOME": str(state)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [f"{state}/nvhook/hook.log", False]
    assert (state / "nvhook").stat().st_uid == UID and (state / "nvhook").stat().st_mode & 0o777 == 0o700
    # the journal where there is one (its socket open to every uid)
    p = _as_user(LOG_TARGET, str(log), env={"XDG_STATE_HOME": str(state)}, pre=STANDIN)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [None, True]
    # a log it can write stays its log
    os.chown(log, UID, UID)
    p = _as_user(LOG_TARGET, str(log))
    assert json.loads(p.stdout) == [str(log), False]


CDI_HOOK = "import sys; from nvhook.start.cdihook import main; sys.exit(main(sys.argv[1:]))"


def test_an_images_xdg_state_home_does_not_choose_where_a_cdi_hooks_log_goes(shared):
    """runc runs a spec's hook entry that has no `env` (NVIDIA's specs before 1.17.8) with the
    container's environment: an image's XDG_STATE_HOME would choose the directory in which the
    user's hook log is made and appended to (a /tmp directory another user made, a link into
    the user's ~/.ssh). The CDI hook clears its environment before anything reads it
    (hookargs.scrub_environment): here the user has no home, so the events stay where they were
    (root's file it cannot write: its stderr line), and the image's directory is untouched."""
    log = shared / "log" / "nvhook.jsonl"  # root's, as on a node
    log.parent.mkdir()
    log.touch(mode=0o640)
    config = shared / "hook.toml"
    config.write_text(f'log_file = "{log}"\n')
    planted = shared / "planted"
    planted.mkdir()
    os.chown(planted, UID, UID)
    p = _as_user(CDI_HOOK, "--nvhook-config", str(config), "update-ldcache", "--folder", "/usr/lib",
                 env={"XDG_STATE_HOME": str(planted)})
    assert p.returncode != 0 and "nvhook" in p.stderr, p.stdout + p.stderr
    assert list(planted.iterdir()) == [], list(planted.rglob("*"))
    assert log.read_bytes() == b""
