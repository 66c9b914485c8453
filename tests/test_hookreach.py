"""`nvhook/commands/hookreach.py`: the lines `cdi generate`, `cdi check` (and `doctor`) print
when other users cannot run a spec's hook. Real files and modes under /tmp; the check is
by mode bits, so it answers the same whoever runs it. The rootless container that such a hook
fails to start: tests/test_rootless_podman.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nvhook.commands import hookreach

WHY = "(rootless engines and user-namespaced containers run it as an unprivileged uid)"


@pytest.fixture
def base():
    """A 0755 directory under /tmp: every directory above it is open to others (pytest's
    tmp_path is under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="nvhook-reach-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _tree(tmp_path, interp_mode: int = 0o755):
    """`tmp_path` / tools / python3 (a file standing in for an interpreter) and a hook script
    naming it."""
    tools = tmp_path / "tools"
    tools.mkdir()
    interp = tools / "python3"
    interp.write_bytes(b"\x7fELF")
    interp.chmod(interp_mode)
    hook = tmp_path / "nvhook"
    hook.write_text(f"#!{interp} -IS\nprint()\n")
    hook.chmod(0o755)
    return tools, interp, hook


def test_all_open_says_nothing(base):
    _, _, hook = _tree(base)
    assert hookreach.path_problems(str(hook)) == []
    assert hookreach.spec_problems({"containerEdits": {"hooks": [{"path": str(hook)}]}}) == []


def test_interpreter_under_a_0700_directory(base):
    tools, interp, hook = _tree(base)
    tools.chmod(0o700)
    lines = [ln for ln in hookreach.path_problems(str(hook)) if "interpreter" in ln]
    assert lines == [f"hook {hook}: its interpreter {interp} cannot be run by other users: {tools} is mode 0700, "
                     f"closed to other users {WHY}"]


def test_interpreter_link_into_a_0700_directory_names_where_it_leads(base):
    tools, interp, hook = _tree(base)
    tools.chmod(0o700)
    link = base / "python3"
    link.symlink_to(interp)
    hook.write_text(f"#!{link}\n")
    lines = [ln for ln in hookreach.path_problems(str(hook)) if "interpreter" in ln]
    assert lines == [f"hook {hook}: its interpreter {link} cannot be run by other users: {tools} is mode 0700, "
                     f"closed to other users {WHY}"]


def test_a_script_others_cannot_read(base):
    _, _, hook = _tree(base)
    hook.chmod(0o711)  # executable, but the interpreter (run as that user) cannot read it
    lines = [ln for ln in hookreach.path_problems(str(hook)) if ln.startswith(f"hook {hook} cannot")]
    assert lines == [f"hook {hook} cannot be run by other users: {hook} is mode 0711, not readable and "
                     f"executable by other users {WHY}"]


def test_a_binary_needs_only_execute(base):
    _, interp, _ = _tree(base, interp_mode=0o711)
    assert hookreach.path_problems(str(interp)) == []
    interp.chmod(0o700)
    assert hookreach.path_problems(str(interp)) == [
        f"hook {interp} cannot be run by other users: {interp} is mode 0700, not executable by other users {WHY}"]


def test_spec_hook_paths_from_every_edit_once():
    spec = {"containerEdits": {"hooks": [{"hookName": "createContainer", "path": "/a"}]},
            "devices": [{"name": "0", "containerEdits": {"hooks": [{"path": "/b"}, {"path": "/a"}]}},
                        {"name": "1"}, "junk"]}
    assert hookreach.spec_hook_paths(spec) == ["/a", "/b"]


def test_a_fifo_at_the_hook_path_is_not_waited_on(base):
    """A planted FIFO where the hook should be: the #! read never blocks (a plain open would
    wait for a writer for ever), and the mode is reported."""
    fifo = base / "hook"
    os.mkfifo(fifo, 0o644)
    p = subprocess.run([sys.executable, "-c", "import sys; from nvhook.commands import hookreach; "
                        "print(hookreach.path_problems(sys.argv[1]))", str(fifo)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"{fifo} is mode 0644, not executable by other users" in p.stdout


def test_a_loop_of_links_on_the_hook_path_is_one_line_not_a_crash(base):
    """a -> b -> a: was a RecursionError out of cdi check, cdi generate and doctor."""
    os.symlink(base / "b", base / "a")
    os.symlink(base / "a", base / "b")
    (line,) = hookreach.path_problems(str(base / "a" / "nvidia-cdi-hook"))
    assert "too many levels of symbolic links" in line, line


def test_a_hook_path_that_is_not_a_file_is_never_opened(base):
    """Opening a device or FIFO acts (a watchdog armed, a FIFO's writer released): the #! line
    is read from regular files only. Here a writer waits on a FIFO at the hook path; the check
    must not release it."""
    fifo = base / "hook"
    os.mkfifo(fifo, 0o755)
    writer = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'w'); print('released')",
                               str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        wchan = Path(f"/proc/{writer.pid}/wchan")
        while wchan.read_text() != "wait_for_partner":  # the writer's open waits for a reader
            assert writer.poll() is None
            os.sched_yield()
        assert hookreach.interpreter(str(fifo)) is None
        with pytest.raises(subprocess.TimeoutExpired):
            writer.wait(timeout=5)  # a reader's open releases it at once: it would print and exit
    finally:
        writer.kill()
        writer.wait()


# -- a node's root (`doctor --node --prefix`): links and ".." resolved inside it -----------------

def _node(base: Path) -> Path:
    """A node root under `base` with /usr/bin (0755) and an interpreter there; a hook naming it."""
    node = base / "node"
    (node / "usr/bin").mkdir(parents=True)
    for d in (node, node / "usr", node / "usr/bin"):
        d.chmod(0o755)
    py = node / "usr/bin/python3"
    py.write_bytes(b"\x7fELF")
    py.chmod(0o755)
    (node / "opt").mkdir(mode=0o755)
    hook = node / "opt/hook"
    hook.write_text("#!/usr/bin/python3\n")
    hook.chmod(0o755)
    return node


def test_in_a_node_root_every_way_out_lands_inside_it(base):
    """An absolute link, a climbing link and ".." past the top all stay at the node's root: the
    host's /usr/bin/python3 (open to all) is never what is checked, the node's (0700) is."""
    node = _node(base)
    (node / "usr/bin/python3").chmod(0o700)
    (node / "opt/abs").symlink_to("/usr/bin/python3")
    (node / "opt/climb").symlink_to("../../../../../../usr/bin/python3")
    for interp in ("/opt/abs", "/opt/climb", "/../../usr/bin/python3", "/usr/../../usr/bin/python3"):
        (node / "opt/hook").write_text(f"#!{interp}\n")
        assert hookreach.spec_problems({"containerEdits": {"hooks": [{"path": "/opt/hook"}]}}, str(node)) == [
            f"hook /opt/hook: its interpreter {interp} cannot be run by other users: /usr/bin/python3 is mode "
            f"0700, not executable by other users {WHY}"], interp


def test_in_a_node_root_a_link_to_a_0700_directory_names_the_directory(base):
    node = _node(base)
    (node / "root/venv/bin").mkdir(parents=True)
    (node / "root").chmod(0o700)
    (node / "opt/hook").unlink()
    (node / "opt/hook").symlink_to("../root/venv/bin/nvhook")
    assert hookreach.spec_problems({"containerEdits": {"hooks": [{"path": "/opt/hook"}]}}, str(node)) == [
        f"hook /opt/hook cannot be run by other users: /root is mode 0700, closed to other users {WHY}"]


def test_in_a_node_root_a_loop_of_links_is_one_line(base):
    node = _node(base)
    (node / "opt/a").symlink_to("/opt/b")
    (node / "opt/b").symlink_to("a")
    (line,) = hookreach.spec_problems({"containerEdits": {"hooks": [{"path": "/opt/a/hook"}]}}, str(node))
    assert line.startswith("hook /opt/a/hook cannot be run by other users: /opt/") and line.endswith(
        f": too many levels of symbolic links {WHY}"), line


@pytest.mark.parametrize("prefix", [False, True])
def test_a_relative_hook_path_is_named(base, prefix):
    node = _node(base)
    spec = {"containerEdits": {"hooks": [{"path": "opt/hook"}]}}
    assert hookreach.spec_problems(spec, str(node) if prefix else "/") == [
        f"hook opt/hook cannot be run by other users: opt/hook is not an absolute path {WHY}"]


@pytest.mark.parametrize("prefix", [False, True])
def test_a_hook_in_a_closed_directory_still_has_its_interpreter_checked(base, prefix):
    """Both lines: the hook's directory is closed to others, and so is its interpreter's (the
    #! line is read as root, through the closed directory)."""
    node = _node(base)
    (node / "opt").chmod(0o700)
    (node / "usr/bin").chmod(0o700)
    top = "" if prefix else str(node)
    (node / "opt/hook").write_text(f"#!{top}/usr/bin/python3\n")
    lines = hookreach.path_problems(f"{top}/opt/hook", str(node) if prefix else "")
    assert lines == [f"hook {top}/opt/hook cannot be run by other users: {top}/opt is mode 0700, closed to other "
                     f"users {WHY}",
                     f"hook {top}/opt/hook: its interpreter {top}/usr/bin/python3 cannot be run by other users: "
                     f"{top}/usr/bin is mode 0700, closed to other users {WHY}"]


@pytest.mark.parametrize("prefix", [False, True])
def test_dot_dot_after_a_file_is_not_a_directory(base, prefix):
    node = _node(base)
    top = "" if prefix else str(node)
    assert hookreach.path_problems(f"{top}/opt/hook/../hook", str(node) if prefix else "") == [
        f"hook {top}/opt/hook/../hook cannot be run by other users: {top}/opt/hook/..: Not a directory {WHY}"]


@pytest.mark.parametrize("prefix", [False, True])
def test_a_fifo_at_a_hook_path_is_never_opened(base, prefix):
    """As test_a_hook_path_that_is_not_a_file_is_never_opened, through the whole check, on this
    machine and in a node's root (`doctor --node --prefix`)."""
    node = _node(base)
    (node / "opt/hook").unlink()
    os.mkfifo(node / "opt/hook", 0o755)
    writer = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'w'); print('released')",
                               str(node / "opt/hook")], stdout=subprocess.PIPE, text=True)
    try:
        wchan = Path(f"/proc/{writer.pid}/wchan")
        while wchan.read_text() != "wait_for_partner":  # the writer's open waits for a reader
            assert writer.poll() is None
            os.sched_yield()
        path = "/opt/hook" if prefix else str(node / "opt/hook")
        assert hookreach.path_problems(path, str(node) if prefix else "") == []
        with pytest.raises(subprocess.TimeoutExpired):
            writer.wait(timeout=5)  # a reader's open releases it at once: it would print and exit
    finally:
        writer.kill()
        writer.wait()
