"""nvhook.base.ffi, the foreign-function layer on `_ctypes` that replaced ctypes on the start
path, checked through the calls built on it (nvhook.base.sandbox) against what the kernel does:
errno reaches the exception with the path named, openat2 still confines a lookup to its root,
fstatfs reads the superblock magic, and the structures handed to the kernel have its layouts.
The C types are compared with ctypes' own (this test may import ctypes; the start path may not:
tests/test_e2e_runc.py checks the hook's import log)."""

from __future__ import annotations

import _ctypes
import ctypes
import errno
import os
import subprocess
import sys

import pytest
from hostfix import have_openat2 as _have_openat2

from nvhook.base import ffi, sandbox

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount)")
needs_openat2 = pytest.mark.skipif(not _have_openat2(), reason="kernel without openat2")


def test_sandbox_and_bpf_do_not_import_ctypes():
    code = ("import sys\nimport nvhook.base.sandbox, nvhook.base.bpf\n"
            "print('ctypes' in sys.modules, '_ctypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("name", ["c_int", "c_uint", "c_long", "c_ulong", "c_uint64", "c_char", "c_char_p",
                                  "c_void_p", "c_uint32", "c_size_t"])
def test_c_types_match_ctypes(name):
    ours, theirs = getattr(ffi, name), getattr(ctypes, name)
    assert ffi.sizeof(ours) == ctypes.sizeof(theirs)
    assert _ctypes.alignment(ours) == ctypes.alignment(theirs)
    if name not in ("c_char", "c_char_p", "c_void_p"):  # same width and signedness: -1 and 2**64 wrap alike
        assert ours(-1).value == theirs(-1).value and ours(2**64 + 5).value == theirs(2**64 + 5).value


def test_struct_layouts_are_the_kernels():
    # struct open_how: three __u64 (linux/openat2.h); openat2 refuses any other size it does not know
    assert ffi.sizeof(sandbox._OpenHow) == 24
    assert [getattr(sandbox._OpenHow, f).offset for f in ("flags", "mode", "resolve")] == [0, 8, 16]
    # struct __user_cap_header_struct {__u32 version; int pid;}, __user_cap_data_struct: three __u32
    assert ffi.sizeof(sandbox._CapHeader) == 8
    assert ffi.sizeof(sandbox._CapData) == 12 and ffi.sizeof(sandbox._CapData * 2) == 24
    how = sandbox._OpenHow(os.O_PATH, 0o644, sandbox.RESOLVE_IN_ROOT)
    assert bytes(how) == os.O_PATH.to_bytes(8, sys.byteorder) + (0o644).to_bytes(8, sys.byteorder) \
        + sandbox.RESOLVE_IN_ROOT.to_bytes(8, sys.byteorder)
    assert (how.flags, how.mode, how.resolve) == (os.O_PATH, 0o644, sandbox.RESOLVE_IN_ROOT)  # plain ints


def test_char_buffer():
    buf = ffi.char_buffer(8, b"ab\0c")
    assert buf.raw == b"ab\0c\0\0\0\0" and buf.value == b"ab" and len(buf) == 8
    assert ffi.char_buffer(4).raw == b"\0" * 4
    with pytest.raises(ValueError):
        ffi.char_buffer(2, b"abc")


@needs_root
def test_mount_of_missing_path_is_enoent_naming_it(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError) as e:
        sandbox.mount(str(tmp_path), str(missing), None, sandbox.MS_BIND)
    assert e.value.errno == errno.ENOENT
    assert str(e.value) == f"[Errno 2] mount {missing}: No such file or directory"
    with pytest.raises(FileNotFoundError, match=r"mount /inside/the/container: No such file"):
        sandbox.mount(str(tmp_path), str(missing), None, sandbox.MS_BIND, what="/inside/the/container")
    with pytest.raises(OSError) as e:
        sandbox.umount2(str(tmp_path))  # a directory that is no mount point
    assert e.value.errno == errno.EINVAL and str(tmp_path) in str(e.value)


def test_errno_is_the_calls_not_a_later_one():
    # FUNCFLAG_USE_ERRNO: the value is saved right after the C call, so Python's own failing
    # calls in between (here a stat setting errno to ENOENT) do not change what get_errno says.
    r, w = os.pipe()
    os.close(r), os.close(w)
    setns = ffi.libc_function("setns", ffi.c_int, (ffi.c_int, ffi.c_int))
    assert setns(r, 0) == -1
    with pytest.raises(FileNotFoundError):
        os.stat("/no/such/file/anywhere")
    assert ffi.get_errno() == errno.EBADF
    with pytest.raises(OSError) as e:
        sandbox.setns(r, sandbox.CLONE_NEWNS, what="the container's mount namespace")
    assert e.value.errno == errno.EBADF
    assert str(e.value) == "[Errno 9] setns the container's mount namespace: Bad file descriptor"


def test_argument_conversion_follows_argtypes():
    setns = ffi.libc_function("setns", ffi.c_int, (ffi.c_int, ffi.c_int))
    with pytest.raises(ctypes.ArgumentError):  # _ctypes' class, the one ctypes re-exports
        setns("3", 0)
    mount = ffi.libc_function("mount", ffi.c_int, (ffi.c_char_p, ffi.c_char_p, ffi.c_char_p, ffi.c_ulong,
                                                   ffi.c_char_p))
    with pytest.raises(ctypes.ArgumentError):
        mount("/a", b"/b", None, 0, None)  # c_char_p takes bytes, not str (sandbox encodes)
    with pytest.raises(AttributeError, match="undefined symbol: no_such_function_in_libc"):
        ffi.libc_function("no_such_function_in_libc", ffi.c_int)


def test_variadic_call_with_typed_arguments():
    """prctl through the variadic path (no argtypes): PR_SET_NAME then PR_GET_NAME into a buffer."""
    prctl = ffi.libc_function("prctl", ffi.c_int)
    PR_SET_NAME, PR_GET_NAME = 15, 16
    before = ffi.char_buffer(16)
    assert prctl(PR_GET_NAME, ffi.byref(before), ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0)) == 0
    try:
        assert prctl(PR_SET_NAME, ffi.c_char_p(b"ffi-test"), ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0)) == 0
        got = ffi.char_buffer(16)
        assert prctl(PR_GET_NAME, got, ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0)) == 0
        assert got.value == b"ffi-test"
        with open(f"/proc/self/task/{os.getpid()}/comm", "rb") as f:  # what the kernel holds
            assert f.read().rstrip(b"\n") == b"ffi-test"
    finally:
        prctl(PR_SET_NAME, before, ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0))


def test_fstatfs_reads_the_magic(tmp_path):
    fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sandbox.fstatfs_type(fd) == sandbox.PROC_SUPER_MAGIC
    finally:
        os.close(fd)
    if os.path.ismount("/dev/shm"):
        fd = os.open("/dev/shm", os.O_PATH)
        try:
            assert sandbox.fstatfs_type(fd) == sandbox.TMPFS_MAGIC
        finally:
            os.close(fd)
    r, w = os.pipe()
    os.close(r), os.close(w)
    with pytest.raises(OSError, match=rf"^\[Errno 9\] fstatfs fd {r}: Bad file descriptor$"):
        sandbox.fstatfs_type(r)


@needs_openat2
def test_openat2_in_root_does_not_follow_a_link_out(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.write_text("host\n")
    (root / "abs").symlink_to(outside)               # absolute: resolved under root, not the host's /
    (root / "climb").symlink_to("../../../../secret")  # ".." stops at root
    (root / "etc" / "hostname").write_text("inside\n")
    (root / "to-inside").symlink_to("/etc/hostname")
    rfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for name in ("abs", "climb"):
            with pytest.raises(FileNotFoundError, match=rf"openat2 {name}: No such file"):
                sandbox.openat2(rfd, name, os.O_RDONLY, 0, sandbox.RESOLVE_IN_ROOT)
        fd = sandbox.openat2(rfd, "to-inside", os.O_RDONLY, 0, sandbox.RESOLVE_IN_ROOT)
        with os.fdopen(fd) as f:
            assert f.read() == "inside\n"
        # RESOLVE_BENEATH refuses outright; RESOLVE_NO_SYMLINKS refuses any link
        with pytest.raises(OSError) as e:
            sandbox.openat2(rfd, "climb", os.O_RDONLY, 0, sandbox.RESOLVE_BENEATH)
        assert e.value.errno == errno.EXDEV
        with pytest.raises(OSError) as e:
            sandbox.openat2(rfd, "to-inside", os.O_RDONLY, 0, sandbox.RESOLVE_NO_SYMLINKS)
        assert e.value.errno == errno.ELOOP
        with pytest.raises(OSError) as e:  # unknown resolve bits: the kernel checks the struct it got
            sandbox.openat2(rfd, "etc", os.O_PATH, 0, 1 << 40)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(rfd)


def test_default_signals_resets_an_ignored_signal():
    """signal(sig, NULL): the kernel's SigIgn mask loses the bit (None passes as a NULL pointer)."""
    code = ("import signal, nvhook.base.sandbox as s\n"
            "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
            "def ignored():\n"
            "    st = dict(ln.split(':\\t', 1) for ln in open('/proc/self/status') if ':\\t' in ln)\n"
            "    return int(st['SigIgn'], 16) >> (signal.SIGUSR1 - 1) & 1\n"
            "before = ignored()\n"
            "s.default_signals(signal.SIGUSR1)\n"
            "print(before, ignored())")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0"]
