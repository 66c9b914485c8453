"""The Debian package (`make deb`, packaging/build-deb) installed with dpkg on the Debian 13 node
(python3 3.13, the node's own dpkg, adduser and systemd-tmpfiles), run there, and purged: what
an operator of a Debian or Ubuntu node does. The node is a private overlay of the cached root
(tests/node/node.py): the cached root itself is never written, which the test checks too."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import noderoot
import pytest
from node import HOST_ROOT, Node

REPO = Path(__file__).resolve().parents[2]
WATCHED = ("etc", "usr", "var", "opt", "run")
# dpkg's own database and logs, written by every install and purge (not the package's files)
DPKG_OWN = ("var/lib/dpkg", "var/log/dpkg.log", "var/log/alternatives.log", "var/cache/debconf",
            "run/nvhook-node")


def tree(root: Path) -> dict:
    """Every path under WATCHED: kind, mode, owner, size (content hash for /etc and /run)."""
    out = {}
    for top in WATCHED:
        for dirpath, dirnames, filenames in os.walk(root / top):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if not os.path.join(rel_dir, d).startswith(DPKG_OWN)]
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                rel = os.path.relpath(p, root)
                if rel.startswith(DPKG_OWN):
                    continue
                st = p.lstat()
                if p.is_symlink():
                    out[rel] = ("link", os.readlink(p))
                elif p.is_file():
                    digest = hashlib.sha256(p.read_bytes()).hexdigest() if rel.startswith(("etc", "run")) else ""
                    out[rel] = ("file", st.st_mode, st.st_uid, st.st_gid, st.st_size, digest)
                else:
                    out[rel] = ("other", st.st_mode, st.st_uid, st.st_gid)
    return out


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    if not shutil.which("fakeroot") or not shutil.which("dpkg-deb"):
        pytest.skip("make deb needs fakeroot and dpkg-deb (.ci/deps deb)")
    out = tmp_path_factory.mktemp("deb")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("nvhook-*.whl")
    r = subprocess.run([str(REPO / "packaging/build-deb"), str(wheel), str(out)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = out.glob("nvhook_*_all.deb")
    return path


@pytest.fixture
def plain_node(machine_untouched, fixtures_root, node_inputs):
    if node_inputs.suite != "trixie":
        pytest.skip("the package test is Debian 13's: nvhook runs on Python 3.9-3.13 "
                    "(docs/python-versions.md), sid's python3 is 3.14")
    Node.sweep_stale()
    n = Node(noderoot.ensure(), fixtures_root / "host-gpu8")
    try:
        n.start()
        yield n
    finally:
        problems = n.close()
        assert not problems, problems


def test_deb_installs_runs_and_purges_on_debian_13(plain_node, deb, fixtures_root):
    n = plain_node
    lower = noderoot.ensure()
    status_before = hashlib.sha256((lower / "var/lib/dpkg/status").read_bytes()).hexdigest()
    assert n.run(["python3", "-c", "import sys; print(sys.version_info[:2])"]).stdout.strip() == "(3, 13)"
    shutil.copy2(deb, n.dir / "share/nvhook.deb")
    for name in ("bundle-container-debian", "container-debian"):  # the bundle names ../container-debian
        shutil.copytree(fixtures_root / name, n.dir / "share" / name, symlinks=True)
    root = n.path("/")
    before = tree(root)

    r = n.run(["dpkg", "-i", "/nvhook/nvhook.deb"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert n.run(["dpkg-query", "-W", "-f", "${Status}", "nvhook"]).stdout == "install ok installed"
    v = n.run(["nvhook", "--version"])
    assert v.stdout.startswith("nvhook, version"), v.stdout
    # postinst compiled for the node's python3: its bundle, its .pyc files, nothing else
    lib = n.path("/usr/lib/nvhook")
    assert [p.name for p in lib.glob("nvhook/__pycache__/*.bundle")] == ["modbundle.cpython-313.bundle"]
    assert {p.name.split(".")[-2] for p in lib.rglob("*.pyc")} == {"cpython-313"}
    served = n.run(["python3", "-IS", "-v", "/usr/bin/nvhook", "--version"]).stderr
    assert "import 'nvhook.start.client' # <nvhook.base.modbundle.Finder" in served
    group = n.run(["getent", "group", "nvhook-hook"]).stdout.strip().split(":")
    hook_gid = int(group[2])
    for copy in ("python3", "sh"):  # nvidia-cdi-hook's two set-group-ID stages
        st = n.path(f"/usr/lib/nvhook/libexec/{copy}").stat()
        # executable by others: a user-namespaced container's root is an unprivileged host uid
        assert oct(st.st_mode & 0o7777) == "0o2711", (copy, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (0, hook_gid)
    # a node user who runs a copy gets nvhook-hook as effective gid, and with it nothing: no
    # members, nobody's primary group, no file of the node's but the copies in that group
    assert group == ["nvhook-hook", "x", str(hook_gid), ""], group
    assert not [u for u in n.run(["getent", "passwd"]).stdout.splitlines() if u.split(":")[3] == str(hook_gid)]
    owned = n.run(["find", "/", "-xdev", "-group", str(hook_gid)], check=False).stdout.split()
    assert sorted(owned) == ["/usr/lib/nvhook/libexec/python3", "/usr/lib/nvhook/libexec/sh"], owned
    r = n.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/lib/nvhook/libexec/python3",
               "-c", "import os; print(os.getuid(), os.getegid(), os.getgroups())"])
    assert r.stdout.strip() == f"65534 {hook_gid} []", r.stdout + r.stderr
    assert n.path("/usr/lib/nvhook/libexec/sh").read_bytes() == n.path("/usr/bin/dash").read_bytes()
    # the hook path NVIDIA's tools are pointed at: through the shell copy into the python copy
    v = n.run(["/usr/lib/nvhook/bin/nvidia-cdi-hook", "--version"])
    assert v.stdout.startswith("nvidia-cdi-hook (nvhook) version"), v.stdout + v.stderr
    n.write("/tmp/hook.toml", 'log_file = ""\ncache_dir = "/tmp/nvhook-cache"\n')
    plan = n.run(["nvhook", "--config", "/tmp/hook.toml", "--root", HOST_ROOT, "--dry-run", "--bundle",
                  "/nvhook/bundle-container-debian", "--format", "json"])
    assert json.loads(plan.stdout)["mounts"], plan.stdout
    # the package's config as shipped, checked by the package's own nvhook
    assert n.run(["nvhook", "config", "check", "/etc/nvhook/hook.toml"]).stdout.startswith("/etc/nvhook/hook.toml: ok")

    r = n.run(["dpkg", "--purge", "nvhook"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not empty" not in r.stdout + r.stderr, r.stdout + r.stderr  # no directory left behind
    assert n.run(["dpkg-query", "-W", "nvhook"], check=False).returncode != 0
    after = tree(root)
    # the hook's group stays, on purpose (docs/security.md: a file anyone made set-group-ID to it
    # may remain; a later groupadd must never get its gid), marked as nvhook's; groupadd leaves
    # the group files' backups and glibc's lock file
    assert n.run(["getent", "group", "nvhook-hook"]).stdout.strip() == f"nvhook-hook:x:{hook_gid}:"
    assert n.path("/var/lib/nvhook/hook-group").read_text().startswith(f"nvhook-hook {hook_gid}\n")
    theirs = ("etc/group", "etc/gshadow", "etc/group-", "etc/gshadow-", "etc/.pwd.lock", "var/lib/nvhook",
              "var/lib/nvhook/hook-group")
    added = {k: v for k, v in after.items() if k not in before and k not in theirs}
    assert added == {}, sorted(added)[:20]
    changed = {k for k, v in before.items() if after.get(k) != v and k not in theirs}
    assert changed == set(), sorted(changed)[:20]
    # installed again: the same group, without looking through the node's files again
    r = n.run(["dpkg", "-i", "/nvhook/nvhook.deb"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert n.path("/usr/lib/nvhook/libexec/sh").stat().st_gid == hook_gid
    assert n.run(["dpkg", "--purge", "nvhook"], check=False).returncode == 0
    # the cached root below the node's overlay: never written
    assert hashlib.sha256((lower / "var/lib/dpkg/status").read_bytes()).hexdigest() == status_before
    assert not (lower / "usr/lib/nvhook").exists() and not (lower / "usr/bin/nvhook").exists()


def test_deb_refuses_a_hook_group_someone_is_in(plain_node, deb):
    """An nvhook-hook on the node with a member: postinst refuses it in one line (its copies,
    executable by everyone, would hand that group to every local user), makes no copy, and
    the package stays unconfigured until the group is renamed; nothing of the group changes."""
    n = plain_node
    n.run(["groupadd", "--system", "--gid", "990", "nvhook-hook"])
    n.run(["usermod", "-aG", "nvhook-hook", "daemon"])
    group_before = n.path("/etc/group").read_text()
    shutil.copy2(deb, n.dir / "share/nvhook.deb")
    r = n.run(["dpkg", "-i", "/nvhook/nvhook.deb"], check=False)
    assert r.returncode != 0
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("nvhook: ")]
    assert said == ["nvhook: the group nvhook-hook cannot be nvidia-cdi-hook's: it has members (daemon); its "
                    "set-group-ID stages hand their group to every local user (docs/security.md): give that group "
                    "another name (groupmod -n NAME nvhook-hook), then install again"], r.stdout + r.stderr
    assert not n.path("/usr/lib/nvhook/libexec/sh").exists() and not n.path("/usr/lib/nvhook/libexec/python3").exists()
    assert n.path("/etc/group").read_text() == group_before
    n.run(["groupmod", "-n", "other-hook", "nvhook-hook"])
    r = n.run(["dpkg", "--configure", "nvhook"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    gid = int(n.run(["getent", "group", "nvhook-hook"]).stdout.split(":")[2])
    assert gid != 990 and n.path("/usr/lib/nvhook/libexec/sh").stat().st_gid == gid
    assert n.run(["dpkg", "--purge", "nvhook"], check=False).returncode == 0
