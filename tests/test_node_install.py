"""`nvhook node install|uninstall --host-root DIR` against a node's root built in tmp_path.

The node: this machine's /usr bind-mounted read-only (so the node's own python3 runs chrooted,
as it does on a real node) in a private mount namespace, its own etc/ (containerd's config as
containerd 1.7 writes it, Docker's daemon.json, a CRI-O drop-in directory), var/run -> /run as
an absolute link, and the GPU Operator's driver-container layout (a fixture host at
run/nvidia/driver). What is asserted is what the node sees: the engines' own reading of their
configs, the installed nvhook run by the node's python3 in the node's root, every file and link
of the tree before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvhook.base import tomlread as tomllib

REPO = Path(__file__).resolve().parent.parent
NVHOOK = os.path.join(os.path.dirname(sys.executable), "nvhook")  # the venv's, as `make fixtures` installs it
FIXTURE = REPO / "tests" / "fixtures" / "rootfs" / "host-gpu1"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot and a private mount namespace need root"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)"),
    pytest.mark.skipif(not FIXTURE.is_dir(), reason="run `make fixtures` first"),
]

# An excerpt of `containerd config default` of containerd 1.7 (version 2, the CRI plugin and
# its runc runtime configured): install must edit it in place (an import would replace the
# whole CRI section in containerd 1.x).
CONTAINERD_17 = """disabled_plugins = []
imports = []
oom_score = 0
plugin_dir = ""
required_plugins = []
root = "/var/lib/containerd"
state = "/run/containerd"
temp = ""
version = 2

[cgroup]
  path = ""

[grpc]
  address = "/run/containerd/containerd.sock"
  gid = 0
  uid = 0

[plugins]

  [plugins."io.containerd.grpc.v1.cri"]
    cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
    enable_cdi = false
    sandbox_image = "registry.k8s.io/pause:3.8"

    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      snapshotter = "overlayfs"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"

          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            BinaryName = ""
            SystemdCgroup = true
"""
# A Debian node's account files (as debootstrap leaves them, shortened): install makes the hook's
# group there with the node's own groupadd.
PASSWD = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n" \
         "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\ndaemon:x:1:\nshadow:x:42:\nnogroup:x:65534:\n"
GSHADOW = "root:*::\ndaemon:*::\nshadow:*::\nnogroup:*::\n"
DAEMON_JSON = '{\n  "log-driver": "journald",\n  "storage-driver": "overlay2"\n}\n'


def make_node(root: Path) -> Path:
    for d in ("usr", "etc/containerd", "etc/docker", "etc/crio/crio.conf.d", "run/nvidia", "var/lib", "var/log",
              "tmp", "dev", "proc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for name, target in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin"), ("sbin", "usr/sbin")):
        os.symlink(target, root / name)
    os.symlink("/run", root / "var" / "run")  # as most nodes have it: absolute
    (root / "etc/containerd/config.toml").write_text(CONTAINERD_17)
    (root / "etc/docker/daemon.json").write_text(DAEMON_JSON)
    (root / "etc/crio/crio.conf.d/10-site.conf").write_text("[crio.runtime]\nlog_level = \"info\"\n")
    for name, text, mode, gid in (("passwd", PASSWD, 0o644, 0), ("group", GROUP, 0o644, 0),
                                  ("gshadow", GSHADOW, 0o640, 42), ("group-", GROUP, 0o644, 0),
                                  ("gshadow-", GSHADOW, 0o600, 0)):
        (root / "etc" / name).write_text(text)
        os.chown(root / "etc" / name, 0, gid)
        os.chmod(root / "etc" / name, mode)
    subprocess.run(["cp", "-a", str(FIXTURE), str(root / "run/nvidia/driver")], check=True)  # device nodes too
    return root


def snapshot(root: Path) -> dict:
    """Every path under the node's root but its /usr (this machine's, read-only): kind, mode,
    content hash or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d != "usr"]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", oct(st.st_mode))
            elif not p.is_file():
                out[rel] = ("special", oct(st.st_mode), st.st_rdev)
            else:
                out[rel] = ("file", oct(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# What install leaves on purpose: the hook's group, never deleted (docs/security.md), the files
# shadow-utils' groupadd writes with it, and the mark saying the group is nvhook's.
GROUP_KEPT = ("etc/group", "etc/gshadow", "etc/group-", "etc/gshadow-", "etc/.pwd.lock", "var/lib/nvhook")


def same_but_the_group(after: dict, before: dict) -> bool:
    """Whether `after` is `before` but for what GROUP_KEPT names (the mark wherever the node's
    /var/lib leads, with the directories made on the way to it)."""
    mark = [k for k in after if k.endswith("nvhook/hook-group")]

    def drop(k: str) -> bool:
        return k.startswith(GROUP_KEPT) or any(m == k or (m.startswith(k + "/") and k not in before) for m in mark)
    return {k: v for k, v in after.items() if not drop(k)} == {k: v for k, v in before.items() if not drop(k)}


def on_node(root: Path, script: str, check: bool = True, *, more_setup: str = "",
            net: bool = False) -> subprocess.CompletedProcess:
    """`script` (sh) in a private mount namespace where the node's /usr is this machine's,
    read-only; $NVHOOK is the nvhook under test, $NODE the node's root. `more_setup`: sh run
    first (ending in "&& "); `net`: a private network namespace too."""
    setup = (f"mount --bind /usr {root}/usr && mount -o remount,bind,ro {root}/usr && "
             f"mount --bind /dev {root}/dev && mount -t proc proc {root}/proc && ")  # as a node has them
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")}  # the suite's: not the node's
    r = subprocess.run(["unshare", "-m", *(["-n"] if net else []), "--propagation", "private", "sh", "-c",
                        setup + more_setup + script],
                       env={**env, "NVHOOK": NVHOOK, "NODE": str(root)}, capture_output=True, text=True,
                       timeout=300)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture
def node(tmp_path):
    """A private node root; removed after the test with whatever set-group-ID copies and files
    it made (pytest would otherwise keep them among its last runs' temporary directories)."""
    yield make_node(tmp_path / "node")
    shutil.rmtree(tmp_path / "node", ignore_errors=True)


INSTALL = "$NVHOOK node install --host-root $NODE --runtime containerd --runtime docker --runtime crio " \
          "--driver-root /run/nvidia/driver"


def test_install_twice_then_uninstall_leaves_the_node_as_it_was(node):
    before = snapshot(node)
    r = on_node(node, f"{INSTALL} && echo == && {INSTALL} --format json")
    first, second = r.stdout.split("==\n")
    lines = first.splitlines()
    assert any(ln.startswith("installed") and "/opt/nvhook" in ln for ln in lines), first
    assert any("/etc/containerd/config.toml: containerd: runtime nvidia" in ln for ln in lines), first
    assert any("/etc/docker/daemon.json: docker: runtime nvidia" in ln for ln in lines), first
    assert any(ln.startswith("created") and "/etc/cdi/nvhook.json: CDI spec" in ln for ln in lines), first
    assert json.loads(second)["changed"] is False and json.loads(second)["changes"] == [], second
    installed = snapshot(node)

    # containerd reads the runtime from the file install edited (its own merge of the config)
    if shutil.which("containerd"):
        dump = subprocess.run(["containerd", "--config", str(node / "etc/containerd/config.toml"), "config", "dump"],
                              capture_output=True, text=True, check=True).stdout
        runtimes = tomllib.loads(dump)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
        assert runtimes["nvidia"]["options"]["BinaryName"] == "/opt/nvhook/bin/nvhook-runtime"
        assert runtimes["runc"]["options"]["SystemdCgroup"] is True  # the node's own settings kept
    daemon = json.loads(subprocess.run([sys.executable, "-m", "json.tool", str(node / "etc/docker/daemon.json")],
                                       capture_output=True, text=True, check=True).stdout)
    assert daemon == {"log-driver": "journald", "storage-driver": "overlay2",
                      "runtimes": {"nvidia": {"path": "/opt/nvhook/bin/nvhook-runtime"}}}
    crio = tomllib.loads((node / "etc/crio/crio.conf.d/99-nvhook.conf").read_text())
    assert crio["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == "/opt/nvhook/bin/nvhook-runtime"

    # the config and the CDI spec say the node's paths
    assert 'root = "/run/nvidia/driver"' in (node / "etc/nvhook/hook.toml").read_text()
    spec = json.loads((node / "etc/cdi/nvhook.json").read_text())
    host_paths = [n["hostPath"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    assert host_paths and all(p.startswith("/run/nvidia/driver/dev/") for p in host_paths), host_paths
    assert str(node) not in (node / "etc/cdi/nvhook.json").read_text()
    unit = (node / "etc/systemd/system/nvhook-cdi.service").read_text()
    assert "ExecStart=/opt/nvhook/bin/nvhook cdi generate" in unit
    assert os.readlink(node / "etc/systemd/system/timers.target.wants/nvhook-cdi.timer") == \
        "/etc/systemd/system/nvhook-cdi.timer"

    # the installed nvhook, run by the node's python3 in the node's root, sees the driver
    launcher = (node / "opt/nvhook/bin/nvhook").read_text().splitlines()[0]
    assert launcher == "#!/usr/bin/python3 -IS"
    r = on_node(node, "chroot $NODE /opt/nvhook/bin/nvhook --version && "
                "chroot $NODE /opt/nvhook/bin/nvhook list --format json && "
                "chroot $NODE /opt/nvhook/bin/nvhook-runtime --version")
    assert "nvhook" in r.stdout.splitlines()[0]
    items = json.loads(r.stdout[r.stdout.index("["):r.stdout.rindex("]") + 1])
    assert any(i["kind"] == "device" and i["host_path"] == "/run/nvidia/driver/dev/nvidia0" for i in items)
    # nvidia-cdi-hook's first stage: the node's python3, set-group-ID to nvhook-hook (AT_SECURE: a
    # container's LD_PRELOAD handed over by runc is ignored), a system group install made with the
    # node's groupadd, with no members; executable by others (a user-namespaced container's root
    # is an unprivileged host uid), finding the node's standard library
    group = [ln.split(":") for ln in (node / "etc/group").read_text().splitlines()]
    hook_group = [g for g in group if g[0] == "nvhook-hook"]
    assert len(hook_group) == 1 and hook_group[0][3] == "", hook_group
    gid = int(hook_group[0][2])
    assert 0 < gid < 1000 and gid not in {int(g[2]) for g in group if g[0] != "nvhook-hook"}
    assert (node / "etc/gshadow").read_text().splitlines()[-1] == "nvhook-hook:!::"
    interp = node / "opt/nvhook/libexec/python3"
    st = interp.lstat()
    assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(0o2711), 0, gid)
    assert interp.read_bytes() == Path(os.path.realpath("/usr/bin/python3")).read_bytes()
    assert (node / "opt/nvhook/libexec/pyvenv.cfg").read_text() == \
        f"home = {os.path.dirname(os.path.realpath('/usr/bin/python3'))}\n"
    # and the node's /bin/sh the same way: bin/nvidia-cdi-hook is the shell first stage, which
    # hands its python stage (libexec/nvidia-cdi-hook.py) to that interpreter
    sh = node / "opt/nvhook/libexec/sh"
    st = sh.lstat()
    assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(0o2711), 0, gid)
    # a node user who runs a copy gets the group as effective gid, and with it nothing: on the
    # node, the copies are the only files of that group, and nobody is in it
    r = on_node(node, "chroot $NODE setpriv --reuid 65534 --regid 65534 --clear-groups "
                "/opt/nvhook/libexec/python3 -c 'import os; print(os.getuid(), os.getegid(), os.getgroups())'")
    assert r.stdout.split("\n")[0] == f"65534 {gid} []", r.stdout + r.stderr
    owned = sorted(str(p.relative_to(node)) for p in node.rglob("*")
                   if p.parts[len(node.parts)] not in ("usr", "proc", "dev") and p.lstat().st_gid == gid)
    assert owned == ["opt/nvhook/libexec/python3", "opt/nvhook/libexec/sh"]
    assert not [u for u in (node / "etc/passwd").read_text().splitlines() if u.split(":")[3] == str(gid)]
    assert sh.read_bytes() == Path(os.path.realpath("/bin/sh")).read_bytes()
    assert (node / "opt/nvhook/bin/nvidia-cdi-hook").read_text().startswith("#!/opt/nvhook/libexec/sh\n")
    assert (node / "opt/nvhook/libexec/nvidia-cdi-hook.py").read_text().startswith(
        "#!/opt/nvhook/libexec/python3 -IS\n")
    r = on_node(node, "chroot $NODE /opt/nvhook/bin/nvidia-cdi-hook --version")
    assert r.stderr == "" and r.stdout.strip(), r.stdout + r.stderr
    # the start-path bundle was written by the node's python, for its version
    tag = subprocess.run(["/usr/bin/python3", "-I", "-c", "import sys; print(sys.implementation.cache_tag)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert (node / f"opt/nvhook/lib/nvhook/__pycache__/modbundle.{tag}.bundle").is_file()

    after_runs = snapshot(node)
    assert {k: v for k, v in after_runs.items() if not k.startswith(("run/nvhook", "var/log/nvhook"))} == \
        {k: v for k, v in installed.items() if not k.startswith(("run/nvhook", "var/log/nvhook"))}

    r = on_node(node, "$NVHOOK node uninstall --host-root $NODE && $NVHOOK node uninstall --host-root $NODE")
    assert "restored       /etc/containerd/config.toml: as before install" in r.stdout
    assert f"kept           /etc/group: group nvhook-hook (gid {gid}), on purpose" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("nvhook node uninstall: nothing to change")
    # everything back as it was, but the group (kept, never to be given to another group) and its mark
    assert same_but_the_group(snapshot(node), before)
    assert (node / "var/lib/nvhook/hook-group").read_text().startswith(f"nvhook-hook {gid}\n")
    assert f"nvhook-hook:x:{gid}:" in (node / "etc/group").read_text().splitlines()
    assert (node / "etc/containerd/config.toml").read_text() == CONTAINERD_17


def test_where_the_node_has_no_groupadd_the_copies_are_root_only(node):
    """The node's groupadd cannot run (a node image without shadow-utils): the copies are
    root:65534 mode 2710 (no one else executes them, so no gid is handed out), and install says
    that user-namespaced containers cannot run the hook."""
    before = snapshot(node)
    r = on_node(node, "mount --bind /dev/null $NODE/usr/sbin/groupadd && " + INSTALL)
    why = "groupadd --system nvhook-hook failed (exit 126)"
    assert f"note           /opt/nvhook/libexec/python3: {why}" in r.stdout, r.stdout
    assert "user-namespaced containers (hostUsers: false, podman --userns=auto) cannot execute" in r.stdout
    for copy in ("python3", "sh"):
        st = (node / "opt/nvhook/libexec" / copy).lstat()
        assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == (oct(0o2710), 0, 65534)
    r = on_node(node, "$NVHOOK node uninstall --host-root $NODE")
    assert "nvhook-hook" not in r.stdout
    assert snapshot(node) == before


@pytest.mark.parametrize("group, passwd, says", [
    ("nvhook-hook:x:990:daemon", "", "it has members (daemon)"),
    ("nvhook-hook:x:990:", "svc:x:990:990::/:/usr/sbin/nologin", "it is the primary group of svc"),
    ("nvhook-hook:x:990:", "", "(gid 990) owns /srv/shared/report"),
    # made with groupadd -o on a group with members that owns no file yet (a GPU's render node
    # appears later, root:render 0660): everyone would be in it through the copies
    ("render:x:990:alice\nnvhook-hook:x:990:", "", "its gid 990 is also the group render's"),
])
def test_an_nvhook_hook_group_that_someone_is_in_is_refused(node, group, passwd, says):
    """An nvhook-hook already on the node that has a member, is someone's primary group, or
    whose gid a file carries (a group of that name made for something else, or a gid that
    another group had): the set-group-ID copies would hand it to every local user. Refused in
    one line, before anything is written."""
    with open(node / "etc/group", "a") as f:
        f.write(group + "\n")
    if passwd:
        with open(node / "etc/passwd", "a") as f:
            f.write(passwd + "\n")
    (node / "srv/shared").mkdir(parents=True)
    (node / "srv/shared/report").write_text("the group's own\n")
    os.chown(node / "srv/shared/report", 0, 990 if "owns" in says else 0)
    before = snapshot(node)
    r = on_node(node, INSTALL, check=False)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and says in r.stderr and "groupmod -n NAME nvhook-hook" in r.stderr, r.stderr
    assert snapshot(node) == before


def test_a_mark_a_user_could_write_does_not_spare_the_file_scan(node):
    """/var/lib/nvhook/hook-group lets install skip looking for files of nvhook-hook's gid. A
    user who owns /var/lib/nvhook (made by something else before) writes a mark naming the gid
    of an nvhook-hook that owns a file: install still looks, and refuses the group."""
    with open(node / "etc/group", "a") as f:
        f.write("nvhook-hook:x:990:\n")
    (node / "srv/shared").mkdir(parents=True)
    (node / "srv/shared/report").write_text("the group's own\n")
    os.chown(node / "srv/shared/report", 0, 990)
    (node / "var/lib/nvhook").mkdir()
    (node / "var/lib/nvhook/hook-group").write_text("nvhook-hook 990\n")
    for p in (node / "var/lib/nvhook", node / "var/lib/nvhook/hook-group"):
        os.chown(p, 1000, 1000)
    before = snapshot(node)
    r = on_node(node, INSTALL, check=False)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert "the group nvhook-hook (gid 990) owns /srv/shared/report" in r.stderr, r.stderr
    assert snapshot(node) == before


def test_a_new_group_never_gets_a_gid_that_a_file_carries(node):
    """groupadd would pick the highest free system gid, 999; a file on the node still carries it
    (a group deleted before, its files left): install gives nvhook-hook the next one instead."""
    (node / "var/lib/old-service").mkdir(parents=True)
    os.chown(node / "var/lib/old-service", 0, 999)
    on_node(node, INSTALL)
    gid = next(int(g.split(":")[2]) for g in (node / "etc/group").read_text().splitlines()
               if g.startswith("nvhook-hook:"))
    assert gid == 998


ATTACK = """set -e
cd /tmp
cp /usr/bin/cat ./cat-g
chmod 2755 ./cat-g
stat -c '%g %a' ./cat-g
"""


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_a_node_user_gains_nothing_from_the_hook_group_not_even_after_uninstall(node, shell):
    """The attack of issue 35: a node user runs the shell copy with -p (dash's and bash's
    privileged mode keeps the set-group-ID gid), and from it makes a set-group-ID program of
    that gid in a directory they can write. Install gave the gid to no one else, and uninstall
    keeps the group, so the next `groupadd --system` (docker, here) gets another gid: the
    program reads none of docker's files. With bash as /bin/sh too (the RHEL family's)."""
    os.chmod(node / "tmp", 0o1777)
    as_bash = "mount --bind /usr/bin/bash $NODE/usr/bin/dash && " if shell == "bash" else ""
    on_node(node, as_bash + INSTALL)
    assert ((node / "opt/nvhook/libexec/sh").read_bytes() ==
            Path(os.path.realpath(f"/usr/bin/{shell}")).read_bytes())
    gid = next(int(g.split(":")[2]) for g in (node / "etc/group").read_text().splitlines()
               if g.startswith("nvhook-hook:"))
    user = "chroot $NODE setpriv --reuid 65534 --regid 65534 --clear-groups"
    r = on_node(node, f"{user} /opt/nvhook/libexec/sh -p -c {shlex.quote(ATTACK)}")
    assert r.stdout.split() == [str(gid), "2755"], r.stdout + r.stderr  # the gid, kept in a file
    r = on_node(node, "$NVHOOK node uninstall --host-root $NODE && chroot $NODE groupadd --system docker && "
                "chroot $NODE sh -c 'echo secret > /srv-docker && chgrp docker /srv-docker && chmod 0640 /srv-docker'"
                f" && {user} /tmp/cat-g /srv-docker", check=False)
    docker = next(int(g.split(":")[2]) for g in (node / "etc/group").read_text().splitlines()
                  if g.startswith("docker:"))
    assert docker != gid and f"nvhook-hook:x:{gid}:" in (node / "etc/group").read_text().splitlines()
    assert r.returncode == 1 and "secret" not in r.stdout and "Permission denied" in r.stderr, r.stdout + r.stderr
    # installed again: the group is nvhook's (its mark), the user's file of that gid no reason to refuse it
    r = on_node(node, INSTALL)
    assert f"root:{gid}" == "root:" + str((node / "opt/nvhook/libexec/sh").lstat().st_gid)
    on_node(node, "$NVHOOK node uninstall --host-root $NODE")
    (node / "tmp/cat-g").unlink()


def test_every_path_is_resolved_inside_the_node_root(node, tmp_path):
    """The node's /var/lib is an absolute link to a directory that also exists in the
    installer's own filesystem: the record goes under the node's root, never there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(node / "var/lib")
    os.symlink(str(outside), node / "var/lib")
    inside = node / str(outside).lstrip("/")
    before = snapshot(node)
    on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --driver-root /run/nvidia/driver")
    assert list(outside.iterdir()) == []
    assert (inside / "nvhook" / "node-install.json").is_file()
    on_node(node, "$NVHOOK node uninstall --host-root $NODE")
    assert list(outside.iterdir()) == [] and same_but_the_group(snapshot(node), before)


def test_a_config_changed_after_install_is_kept(node):
    on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --driver-root /run/nvidia/driver")
    daemon = node / "etc/docker/daemon.json"
    daemon.write_text(daemon.read_text().replace("journald", "local"))
    r = on_node(node, "$NVHOOK node uninstall --host-root $NODE")
    assert "kept           /etc/docker/daemon.json: changed since install; put it back by hand" in r.stdout
    assert "local" in daemon.read_text() and not (node / "opt/nvhook").exists()


@pytest.mark.parametrize("python, says", [
    ("/usr/bin/python-none", "the node has no /usr/bin/python-none: nvhook runs on the node's own python"),
    ("/opt/oldpy/python3", "the node's /opt/oldpy/python3 is Python 3.8; nvhook needs"),
])
def test_a_node_without_a_usable_python(node, python, says):
    old = node / "opt/oldpy/python3"
    old.parent.mkdir(parents=True)
    old.write_text("#!/bin/sh\necho 3.8\n")
    old.chmod(0o755)
    before = snapshot(node)
    r = on_node(node, f"$NVHOOK node install --host-root $NODE --runtime docker --host-python {python} "
                "--ready-file $NODE/ready", check=False)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert snapshot(node) == before  # nothing written, no ready file


def test_ready_file_and_runtime_name(node, tmp_path):
    ready = tmp_path / "ready"
    r = on_node(node, f"$NVHOOK node install --host-root $NODE --runtime docker --runtime-name gpu "
                f"--ready-file {ready} && test -f {ready}")
    assert json.loads((node / "etc/docker/daemon.json").read_text())["runtimes"] == \
        {"gpu": {"path": "/opt/nvhook/bin/nvhook-runtime"}}
    assert "accept_volume_mounts = false" in (node / "etc/nvhook/hook.toml").read_text()
    r = on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --runtime-name gpu "
                "--device-list-strategy volume-mounts")
    assert [ln for ln in r.stdout.splitlines() if not ln.startswith("note")] == \
        ["updated        /etc/nvhook/hook.toml: config, root = /, device list: volume-mounts"]
    config = tomllib.loads((node / "etc/nvhook/hook.toml").read_text())
    assert config["devices"]["accept_volume_mounts"] is True
    assert config["devices"]["accept_envvar_unprivileged"] is False
    r = on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --runtime-name Bad_Name", check=False)
    assert r.returncode == 1 and "must be a DNS label" in r.stderr


def test_device_list_strategies_and_oci_runtime_go_into_the_config(node):
    """Several strategies at once, as the device plugin takes them (a cluster moving from one to
    another); the OCI runtime nvhook-runtime hands containers to (only `[runtime] path`: the
    other `path` keys of the file untouched)."""
    r = on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --device-list-strategy "
                "envvar,volume-mounts --device-list-strategy cdi-cri --oci-runtime /usr/bin/crun")
    assert "device list: envvar,volume-mounts,cdi-cri, OCI runtime /usr/bin/crun" in r.stdout, r.stdout
    config = tomllib.loads((node / "etc/nvhook/hook.toml").read_text())
    assert config["devices"]["accept_volume_mounts"] is True
    assert config["devices"]["accept_envvar_unprivileged"] is True
    assert config["runtime"]["path"] == "/usr/bin/crun"
    assert config["ldconfig"]["path"] == "builtin"
    # the node's own nvhook accepts the file and reads the runtime from it
    r = on_node(node, "chroot $NODE /opt/nvhook/bin/nvhook config check /etc/nvhook/hook.toml --format json",
                check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["config"]["runtime"]["path"] == "/usr/bin/crun", \
        r.stdout + r.stderr


@pytest.mark.parametrize("args, says", [
    ("--oci-runtime /usr/sbin/no-such-runc", "the node has no executable /usr/sbin/no-such-runc: install it, or name"),
    ("--oci-runtime no-such-runc", "the node has no executable no-such-runc on its PATH"),
    ("--oci-runtime sbin/runc", "--oci-runtime sbin/runc must be a name on the node's PATH or an absolute path"),
    ("--device-list-strategy envvar,mounts", "--device-list-strategy mounts: not a strategy of the device plugin"),
])
def test_a_runtime_or_strategy_the_node_cannot_use_writes_nothing(node, args, says):
    before = snapshot(node)
    r = on_node(node, f"$NVHOOK node install --host-root $NODE --runtime docker {args}", check=False)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert snapshot(node) == before


def test_restart_engine_on_a_node_without_systemd_fails_and_says_so(node, tmp_path):
    """No /run/systemd/system on the node: nothing nvhook can ask to restart the engine, and
    killing it would leave the node without one. install writes everything, says what, then one
    line and exit 1 (a DaemonSet's pod never turns Ready); a retry still owes the restart; the
    same without the flag is a success. tests/node/test_cri_restart_engine.py does this with a
    running containerd."""
    before = snapshot(node)
    ready = tmp_path / "ready"
    r = on_node(node, f"$NVHOOK node install --host-root $NODE --runtime docker --restart-engine "
                f"--ready-file {ready}", check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr == ("nvhook: --restart-engine: cannot restart docker: the node was not booted with systemd "
                        "(no /run/systemd/system); restart docker with the node's own init system, and leave "
                        "--restart-engine out on such nodes\n")
    assert "updated        /etc/docker/daemon.json: docker: runtime nvidia" in r.stdout, r.stdout
    assert "not restarted  docker: --restart-engine: cannot restart docker" in r.stdout, r.stdout
    assert not ready.exists()
    assert json.loads((node / "var/lib/nvhook/node-install.json").read_text())["restart_pending"] == ["docker"]
    again = on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker --restart-engine", check=False)
    assert again.returncode == 1 and "cannot restart docker" in again.stderr, again.stdout + again.stderr
    plain = on_node(node, "$NVHOOK node install --host-root $NODE --runtime docker")
    assert plain.stdout.splitlines()[0] == "nvhook node install: nothing to change", plain.stdout
    r = on_node(node, "$NVHOOK node uninstall --host-root $NODE --restart-engine", check=False)
    assert r.returncode == 1 and "cannot restart docker" in r.stderr, r.stdout + r.stderr
    assert "restored       /etc/docker/daemon.json: as before install" in r.stdout
    assert same_but_the_group(snapshot(node), before)


@pytest.mark.parametrize("runtime, says", [
    ("containerd", "nvhook: --nri: the node was not booted with systemd (no /run/systemd/system), and the NRI plugin "
     "runs as its systemd unit nvhook-nri.service; nothing installed: leave --nri out (the runtime class), or run "
     "`/opt/nvhook/bin/nvhook nri` under the node's own init system (docs/nri.md)\n"),
    ("docker", "nvhook: --nri: docker has no NRI (containerd 1.7+ and CRI-O have); name the engine with --runtime, "
     "or leave --nri out and use the runtime class\n"),
])
def test_nri_where_the_plugin_cannot_run_installs_nothing(node, tmp_path, runtime, says):
    """--nri on a node not booted with systemd (nothing to run the plugin in the node's pid
    namespace), or with an engine without NRI: refused before anything is written, one line,
    exit 1, no ready file (tests/node/test_cri_node_install.py: the same on the Debian 13 node)."""
    before = snapshot(node)
    ready = tmp_path / "ready"
    r = on_node(node, f"$NVHOOK node install --host-root $NODE --runtime {runtime} --driver-root /run/nvidia/driver "
                f"--nri --restart-engine --ready-file {ready}", check=False)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", says)
    assert not ready.exists()
    assert snapshot(node) == before


def test_a_host_root_without_proc_is_refused_and_nothing_written(node):
    """The host root given without its /proc (a plain `mount --bind /` leaves the node's submounts
    out): what install runs as the node would miss /proc/self (the CDI spec written without a
    library, pointing at the very root it was given). One line, exit 1, nothing written."""
    before = snapshot(node)
    setup = f"mount --bind /usr {node}/usr && mount -o remount,bind,ro {node}/usr && mount --bind /dev {node}/dev && "
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")}
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", setup + INSTALL],
                       env={**env, "NVHOOK": NVHOOK, "NODE": str(node)}, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr == (f"nvhook: --host-root {node} has no /proc mounted: mount the node's / with its submounts "
                        "(hostPath / as Kubernetes mounts it, or mount --rbind), or mount proc on "
                        f"{node}/proc; nothing installed\n")
    assert snapshot(node) == before


def test_install_without_restart_engine_says_what_is_left_to_do(node):
    """Without --restart-engine, each engine whose config changed is named with what to run;
    an install that changes nothing more still says it (the engine has still not read it)."""
    r = on_node(node, "$NVHOOK node install --host-root $NODE --runtime containerd --runtime docker")
    for engine, path in (("containerd", "/etc/containerd/config.toml"), ("docker", "/etc/docker/daemon.json")):
        assert (f"note           {path}: {engine} has not read the runtime yet: restart it (systemctl restart "
                f"{engine} on the node), or install again with --restart-engine; until then no GPU container gets "
                "its GPU through nvhook there") in r.stdout, r.stdout
    again = on_node(node, "$NVHOOK node install --host-root $NODE --runtime containerd --runtime docker")
    assert again.stdout.splitlines()[0] == "nvhook node install: nothing to change"
    assert "containerd has not read the runtime yet" in again.stdout


def test_a_host_root_given_as_a_link_is_judged_by_its_directory(node, tmp_path):
    """`--host-root /proc/<pid>/root` (as the node tests and an operator with nsenter give it) is a
    link whose own mode is 777: the stage directories' check judges the directory it names
    (0755 root's here), so the install goes through; a node root that really is 777 is refused."""
    link = tmp_path / "node-link"
    link.symlink_to(node)
    r = on_node(node, f"$NVHOOK node install --host-root {link} --runtime containerd")
    assert r.stdout.startswith("installed      /opt/nvhook: nvhook for the node's Python"), r.stdout
    on_node(node, f"$NVHOOK node uninstall --host-root {link}")
    node.chmod(0o777)
    try:
        r = on_node(node, f"$NVHOOK node install --host-root {link} --runtime containerd", check=False)
    finally:
        node.chmod(0o755)
    assert r.returncode == 1 and r.stderr.startswith("nvhook: / is writable by others (mode 777)"), r.stdout + r.stderr
