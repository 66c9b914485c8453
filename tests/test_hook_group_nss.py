"""The hook's group and the groups of name-service sources that do not list their groups.

`nvhook-hook`'s gid must be no one's (docs/security.md, "The hook's group"). A group of LDAP or
sssd with `enumerate = false` is not in /etc/group and not in what getgrent lists; only a
lookup by gid or name finds it. Here such a source is real: glibc's `hesiod` module, which
answers getgrgid/getgrnam from DNS and cannot enumerate, listed after `files` in the node's own
etc/nsswitch.conf and answered by tests/hesiodns.py in a private network namespace. Nothing of
the machine's /etc is touched: the node is a private root (tests/test_node_install.py's), and
install reaches its name service in the two ways it can be run:

- `--host-root NODE` from the machine: the node's NSS is not this process's, so install asks
  the node's own getent, chrooted into the node (as it runs the node's groupadd);
- chrooted into the node with `--host-root /` (the machine nvhook runs on, as the .deb's
  postinst and `nvhook setup` run): install asks through its own process (getgrgid/getgrnam).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import hesiodns
import pytest
import test_node_install as node_install
from test_node_install import FIXTURE, make_node, snapshot

REPO = Path(__file__).resolve().parent.parent
HESIODNS = Path(__file__).resolve().parent / "hesiodns.py"
LIBNSS_HESIOD = [p for p in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64",
                             "/usr/lib/aarch64-linux-gnu") if os.path.exists(f"{p}/libnss_hesiod.so.2")]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot and private mount and network namespaces need root"),
    pytest.mark.skipif(not FIXTURE.is_dir(), reason="run `make fixtures` first"),
    pytest.mark.skipif(not LIBNSS_HESIOD, reason="needs glibc's libnss_hesiod.so.2 (a source that does not enumerate)"),
]

INSTALL = "node install --runtime containerd --driver-root /run/nvidia/driver"
# What this machine's python and this checkout are at, bound at the same paths into the node so that
# nvhook runs chrooted there (the node's /usr is this machine's already).
OUTSIDE_USR = [p for p in dict.fromkeys((sys.base_prefix, str(REPO))) if not p.startswith("/usr/")]


def on_node(root: Path, groups: list[str], script: str, check: bool = True) -> subprocess.CompletedProcess:
    """test_node_install's on_node, in a private network namespace too, where its name service
    lists hesiod after files and `groups` (group lines) are what that source alone knows."""
    binds = "".join(f"mkdir -p {shlex.quote(str(root) + p)} && mount --bind -o ro {shlex.quote(p)} "
                    f"{shlex.quote(str(root) + p)} && " for p in OUTSIDE_USR)
    dns = (f"{binds}DNS=$({shlex.join([sys.executable, str(HESIODNS), *hesiodns.records(groups)])}) && "
           "trap 'kill $DNS' EXIT && ")
    return node_install.on_node(root, script, check, more_setup=dns, net=True)


@pytest.fixture
def node(tmp_path):
    """tests/test_node_install.py's node, whose name service asks hesiod after its files."""
    root = make_node(tmp_path / "node")
    (root / "etc/nsswitch.conf").write_text(hesiodns.NSSWITCH)
    (root / "etc/hesiod.conf").write_text(hesiodns.HESIOD_CONF)
    (root / "etc/resolv.conf").write_text(hesiodns.RESOLV_CONF)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# The node's own view: what nvhook runs in each case.
WHERE = {"--host-root NODE": "$NVHOOK " + INSTALL + " --host-root $NODE",
         "chrooted, --host-root /": "chroot $NODE $NVHOOK " + INSTALL + " --host-root /"}
LDAP_GROUPS = ["ldap-gpu:*:999:alice", "ldap-render:*:998:bob"]


@pytest.mark.parametrize("where", list(WHERE))
def test_a_new_group_never_gets_a_gid_that_a_source_which_does_not_enumerate_knows(node, where):
    """groupadd's choice, 999, and the next one, 998, are groups of the node's directory that
    getgrent does not list (the test proves that first): install gives nvhook-hook 997. Before,
    it picked 999 from /etc/group and the files alone, the node's groupadd refused it ("GID
    '999' already exists"), and the copies fell back to root only."""
    r = on_node(node, LDAP_GROUPS, "chroot $NODE getent group; echo listed=$?; chroot $NODE getent group 999 998; "
                + WHERE[where])
    listed, found = r.stdout.split("listed=0\n", 1)
    assert ":999:" not in listed and ":998:" not in listed, listed  # the source does not enumerate
    assert found.startswith("ldap-gpu:*:999:alice\nldap-render:*:998:bob\n"), found  # and yet knows them
    assert "root only" not in r.stdout, r.stdout
    line = next(g for g in (node / "etc/group").read_text().splitlines() if g.startswith("nvhook-hook:"))
    assert line == "nvhook-hook:x:997:", line
    assert (node / "var/lib/nvhook/hook-group").read_text().startswith("nvhook-hook 997\n")


@pytest.mark.parametrize("where", list(WHERE))
def test_a_hook_group_that_only_the_name_service_knows_is_refused(node, where):
    """The directory has a group named nvhook-hook, with a member: /etc/group has none, so
    install would make a local one of the same name, and the stages would hand out a name
    that resolves to the directory's group. Refused in one line, before anything is written."""
    before = snapshot(node)
    r = on_node(node, ["nvhook-hook:*:4242:alice"], WHERE[where], check=False)
    assert (r.returncode, r.stdout) == (1, ""), r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("nvhook: the group nvhook-hook is not in /etc/group but the host's name service "
                               "knows it (nvhook-hook:*:4242:alice; "), r.stderr
    assert r.stderr.rstrip().endswith("rename or remove it there, then install again"), r.stderr
    after = snapshot(node)
    for p in OUTSIDE_USR:  # the mount points the chrooted run needed, made by this test
        for part in Path(p.lstrip("/")).parents:
            after.pop(str(part), None)
            before.pop(str(part), None)
        after.pop(p.lstrip("/"), None)
    assert after == before


@pytest.mark.parametrize("where", list(WHERE))
def test_an_existing_hook_group_whose_gid_a_source_asked_first_has_is_refused(node, where):
    """nsswitch.conf asks the directory before the files: the node's nvhook-hook (gid 990, made
    by hand, not marked as nvhook's) is, by number, the directory's ldap-gpu, whose members and
    files would become everyone's. Refused in one line, before anything is written."""
    (node / "etc/nsswitch.conf").write_text(hesiodns.NSSWITCH.replace("files hesiod", "hesiod files"))
    with open(node / "etc/group", "a") as f:
        f.write("nvhook-hook:x:990:\n")
    r = on_node(node, ["ldap-gpu:*:990:alice"], "chroot $NODE getent group 990; " + WHERE[where], check=False)
    assert r.stdout == "ldap-gpu:*:990:alice\n" and r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("nvhook: the group nvhook-hook cannot be nvidia-cdi-hook's: its gid 990 is also the "
                               "group ldap-gpu's in the host's name service; "), r.stderr
    assert not (node / "opt/nvhook").exists() and not (node / "var/lib/nvhook").exists()
