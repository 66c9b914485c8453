"""nvhook.apply.paths: container paths resolve and get created inside the rootfs, never
outside, with the kernel's openat2(RESOLVE_IN_ROOT) and with nvhook's own walk alike."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from fuzzscale import examples
from hostfix import have_openat2 as _have_openat2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvhook.apply import paths
from nvhook.apply.paths import Root
from nvhook.base import sandbox

MODES = [pytest.param(False, id="walk"),
         pytest.param(True, id="openat2", marks=pytest.mark.skipif(not _have_openat2(), reason="no openat2"))]


@pytest.fixture
def tree(tmp_path: Path):
    """rootfs/ plus host/ beside it: a host directory hostile links aim at."""
    root = tmp_path / "rootfs"
    host = tmp_path / "host"
    (root / "usr/lib").mkdir(parents=True)
    (root / "etc").mkdir()
    host.mkdir()
    (host / "secret").write_text("host secret")
    return root, host


_OPENED: list[int] = []


@pytest.fixture(autouse=True)
def _close_roots():
    yield
    while _OPENED:
        os.close(_OPENED.pop())


def _root(path: Path, use_openat2: bool) -> Root:
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    _OPENED.append(fd)  # Root does not own its fd
    return Root(fd, use_openat2)


def _where(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize("use_openat2", MODES)
def test_absolute_and_climbing_links_clamp_at_rootfs(tree, use_openat2):
    root_dir, host = tree
    (root_dir / "etc/secret").write_text("image secret")
    os.symlink(str(host), root_dir / "abs")  # absolute: the host dir's path, read inside the rootfs
    os.symlink("../../../../../../" + str(host).lstrip("/"), root_dir / "usr/climb")
    os.symlink("/../../etc", root_dir / "usr/lib/etc-link")
    r = _root(root_dir, use_openat2)
    with pytest.raises(FileNotFoundError):
        r.lookup("/abs/secret")  # <rootfs>/<host path>/secret does not exist
    with pytest.raises(FileNotFoundError):
        r.lookup("/usr/climb/secret")
    fd = r.lookup("/usr/lib/etc-link/secret")
    assert _where(fd) == str(root_dir / "etc/secret")
    fd = r.lookup("/../../../etc/secret")
    assert _where(fd) == str(root_dir / "etc/secret")


@pytest.mark.parametrize("use_openat2", MODES)
def test_ensure_creates_inside_through_hostile_links(tree, use_openat2):
    root_dir, host = tree
    lib = root_dir / "usr/lib/x86_64-linux-gnu"
    os.symlink("/../../" + str(host).lstrip("/"), lib)
    r = _root(root_dir, use_openat2)
    t = r.ensure("/usr/lib/x86_64-linux-gnu/libcuda.so.1", False)
    assert t.created and stat.S_ISREG(t.mode)
    inside = root_dir / str(host).lstrip("/") / "libcuda.so.1"
    assert _where(t.fd) == str(inside)
    assert sorted(os.listdir(host)) == ["secret"]
    # a directory target through the same link
    t = r.ensure("/usr/lib/x86_64-linux-gnu/sub/dir", True)
    assert stat.S_ISDIR(t.mode) and _where(t.fd).startswith(str(root_dir) + "/")
    assert sorted(os.listdir(host)) == ["secret"]


@pytest.mark.parametrize("use_openat2", MODES)
def test_final_symlink_followed_inside(tree, use_openat2):
    root_dir, _ = tree
    os.symlink("/etc/shadow", root_dir / "usr/lib/libnvidia-ml.so.1")
    r = _root(root_dir, use_openat2)
    t = r.ensure("/usr/lib/libnvidia-ml.so.1", False)
    assert t.link == "/etc/shadow"
    assert _where(t.fd) == str(root_dir / "etc/shadow")  # the placeholder, inside the rootfs
    assert (root_dir / "etc/shadow").read_text() == ""
    # existing: returned as is, not created
    t2 = r.ensure("/usr/lib/libnvidia-ml.so.1", False)
    assert not t2.created and t2.link == "/etc/shadow"


@pytest.mark.parametrize("use_openat2", MODES)
def test_existing_objects_are_reported_not_replaced(tree, use_openat2):
    root_dir, _ = tree
    (root_dir / "usr/lib/libcuda.so.1").write_text("bundled")
    (root_dir / "usr/lib/dir.so").mkdir()
    r = _root(root_dir, use_openat2)
    t = r.ensure("/usr/lib/libcuda.so.1", False)
    assert not t.created and stat.S_ISREG(t.mode)
    t = r.ensure("/usr/lib/dir.so", False)
    assert not t.created and stat.S_ISDIR(t.mode)  # the caller decides that this is an error
    assert (root_dir / "usr/lib/libcuda.so.1").read_text() == "bundled"


@pytest.mark.parametrize("use_openat2", MODES)
def test_loops_and_non_directories(tree, use_openat2):
    root_dir, _ = tree
    os.symlink("loop2", root_dir / "loop1")
    os.symlink("loop1", root_dir / "loop2")
    (root_dir / "file").write_text("x")
    r = _root(root_dir, use_openat2)
    with pytest.raises(OSError) as e:
        r.lookup("/loop1/x")
    assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError) as e:
        r.ensure("/file/x", False)
    assert e.value.errno == errno.ENOTDIR
    with pytest.raises(OSError) as e:
        r.ensure("/loop1/x", False)
    assert e.value.errno == errno.ELOOP


def test_magic_links_refused(tmp_path):
    """A link through /proc/self/root must not reach the host's root: openat2 refuses magic
    links; the walk reads the link's text and resolves it inside the rootfs."""
    root_dir = tmp_path / "rootfs"
    root_dir.mkdir()
    os.symlink("/proc/self/root/etc", root_dir / "escape")
    (root_dir / "proc").symlink_to("/proc")  # as if the image had host's procfs at /proc
    for use in ([False, True] if _have_openat2() else [False]):
        r = _root(root_dir, use)
        try:
            fd = r.lookup("/escape/passwd")
        except OSError:
            continue
        assert _where(fd).startswith(str(root_dir) + "/")


# -- the walk and openat2 agree on arbitrary trees ------------------------------------------

NAMES = ["a", "b", "c"]
LINKS = ["/", "..", "../..", "/a", "a/b", "../../../x", "/../b/c", "c", "/x", "./a/../b", "b/..", "/a/b/c", "a/", "c/.",
         "/proc/self/root"]
node = st.recursive(
    st.one_of(st.just("file"), st.sampled_from(LINKS).map(lambda t: ("link", t))),
    lambda children: st.dictionaries(st.sampled_from(NAMES), children, max_size=3),
    max_leaves=8,
)


def _build(path: Path, spec) -> None:
    for name, child in spec.items():
        p = path / name
        if child == "file":
            p.write_text(name)
        elif isinstance(child, tuple):
            os.symlink(child[1], p)
        else:
            p.mkdir()
            _build(p, child)


def _resolve(r: Root, path: str):
    try:
        fd = r.lookup(path)
    except OSError as e:
        return ("error", e.errno)
    try:
        st_ = os.fstat(fd)
        return ("ok", st_.st_dev, st_.st_ino, _where(fd))
    finally:
        os.close(fd)


@pytest.mark.skipif(not _have_openat2(), reason="no openat2 to compare with")
@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=st.dictionaries(st.sampled_from(NAMES), node, max_size=3),
       path=st.lists(st.sampled_from(NAMES + ["..", ".", "x"]), min_size=1, max_size=5))
def test_walk_matches_openat2(tree, path):
    base = Path(tempfile.mkdtemp())
    try:
        root_dir = base / "root"
        root_dir.mkdir()
        (base / "x").mkdir()  # outside: "../x" must never reach it
        _build(root_dir, tree)
        p = "/" + "/".join(path)
        walk = _resolve(_root(root_dir, False), p)
        kernel = _resolve(_root(root_dir, True), p)
        assert walk == kernel
        if walk[0] == "ok":
            assert walk[3] == str(root_dir) or walk[3].startswith(str(root_dir) + "/")
    finally:
        while _OPENED:  # hypothesis runs hundreds of examples in one test
            os.close(_OPENED.pop())
        shutil.rmtree(base)


def test_openat2_probe_falls_back(monkeypatch, tree):
    root_dir, _ = tree
    (root_dir / "etc/f").write_text("x")

    def enosys(*a, **k):
        raise OSError(errno.ENOSYS, "openat2: Function not implemented")

    monkeypatch.setattr(sandbox, "openat2", enosys)
    monkeypatch.setattr(paths, "_have_openat2", None)
    r = _root(root_dir, None)
    assert _where(r.lookup("/etc/f")) == str(root_dir / "etc/f")
    assert paths._have_openat2 is False
