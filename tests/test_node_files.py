"""The node tests' file helpers (tests/node/node.py: Node.write, read, remove, path) never follow
a node's links onto the machine.

No node root is needed: the "node" is a child process chrooted into a directory of the test, so
/proc/<pid>/root is what a node's init gives the helpers. The node's links point at absolute
paths that exist on the machine too (a directory of the test standing for the machine's /etc):
followed by the machine's kernel they would write, read or remove the machine's file; resolved
inside the node they name the node's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "node"))

from node import Node  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root")


@pytest.fixture
def node(tmp_path):
    """(Node whose init is chrooted into tmp_path/root, the node root, the "machine" directory)."""
    root = tmp_path / "root"
    machine = tmp_path / "machine"  # stands for the machine's files: an absolute path outside the root
    (machine / "etc").mkdir(parents=True)
    root.mkdir()
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the node's init: chrooted, says so, waits for the pipe to close
        try:
            os.close(w)
            os.close(ready_r)
            os.chroot(root)
            os.write(ready_w, b"r")
            os.read(r, 1)
        finally:
            os._exit(0)
    os.close(r)
    os.close(ready_w)
    try:
        # until the child has chrooted, /proc/<pid>/root is the machine's "/"
        assert os.read(ready_r, 1) == b"r", "the node's init did not chroot"
        assert os.stat(f"/proc/{pid}/root").st_ino == root.stat().st_ino
        n = Node.__new__(Node)
        n.init_pid = pid
        yield n, root, machine
    finally:
        os.close(ready_r)
        os.close(w)
        os.waitpid(pid, 0)


def inside(root: Path, machine: Path) -> Path:
    """Where a node link to `machine` (an absolute path) leads inside the node."""
    return root / str(machine).lstrip("/")


def test_write_through_an_absolute_directory_link_stays_in_the_node(node):
    n, root, machine = node
    (root / "etc").symlink_to(machine / "etc")  # the node's /etc -> "the machine's /etc"
    n.write("/etc/foo", "node's\n")
    assert not (machine / "etc" / "foo").exists(), "the node's link led the write onto the machine"
    assert (inside(root, machine) / "etc" / "foo").read_text() == "node's\n"
    assert n.read("/etc/foo") == "node's\n"
    assert n.path("/etc/foo") == n.root / str(machine / "etc" / "foo").lstrip("/")


def test_write_through_a_climbing_link_stays_in_the_node(node):
    n, root, machine = node
    (root / "up").symlink_to("../../../../../../.." + str(machine))
    n.write("/up/etc/bar", "x", 0o600)
    assert not (machine / "etc" / "bar").exists()
    made = inside(root, machine) / "etc" / "bar"
    assert made.read_text() == "x" and made.stat().st_mode & 0o777 == 0o600


def test_write_replaces_a_link_at_the_path_itself(node):
    n, root, machine = node
    (machine / "etc" / "conf").write_text("machine's\n")
    (root / "conf").symlink_to(machine / "etc" / "conf")
    n.write("/conf", "node's\n")
    assert (machine / "etc" / "conf").read_text() == "machine's\n"
    assert not (root / "conf").is_symlink() and (root / "conf").read_text() == "node's\n"


def test_read_and_path_follow_links_inside_the_node(node):
    n, root, machine = node
    (machine / "etc" / "secret").write_text("machine's\n")
    (root / "data").mkdir()
    (root / "data" / "r").symlink_to(machine / "etc" / "secret")
    inside(root, machine / "etc").mkdir(parents=True)
    (inside(root, machine) / "etc" / "secret").write_text("node's\n")
    assert n.read("/data/r") == "node's\n"
    assert n.path("/data/r").read_text() == "node's\n"
    assert n.path("/data/r", follow=False).is_symlink()


def test_remove_through_a_link_stays_in_the_node(node):
    n, root, machine = node
    (machine / "etc" / "keep").write_text("machine's\n")
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to(machine / "etc")  # as Debian's /var/run -> /run
    n.remove("/var/run/keep")
    assert (machine / "etc" / "keep").read_text() == "machine's\n"
    inside(root, machine / "etc").mkdir(parents=True)
    (inside(root, machine) / "etc" / "keep").write_text("node's\n")
    n.remove("/var/run/keep")
    assert not (inside(root, machine) / "etc" / "keep").exists()
    assert (machine / "etc" / "keep").read_text() == "machine's\n"


def test_a_file_on_the_way_is_refused(node):
    n, root, machine = node
    (root / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        n.write("/f/x", "x")
    assert (root / "f").read_text() == ""
