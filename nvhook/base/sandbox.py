"""A thin layer over the libc calls Python's `os` module lacks (through `ffi`, not ctypes).

Each function is named after its syscall, takes the same arguments, and raises
`OSError(errno, "<call> <path>: <strerror>")` on failure so that messages name the path.
Nothing here decides policy; `paths`, `mounts` and `ldconfig` do.

Only `os` and `ffi` (over the C module `_ctypes`) are imported: this module is loaded on every
container start, and `import ctypes` alone would cost it ~7 ms of CPU (see `ffi`).
"""

from __future__ import annotations

import os

from . import ffi

# mount(2) flags (linux/mount.h)
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19

# umount2(2) flags
MNT_DETACH = 0x2

# namespaces (linux/sched.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# openat2(2) resolve flags (linux/openat2.h)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# statfs f_type values
PROC_SUPER_MAGIC = 0x9FA0
TMPFS_MAGIC = 0x01021994

# openat2 has the same number on every architecture (added after the syscall table unification)
_NR_OPENAT2 = 437

_mount = ffi.libc_function("mount", ffi.c_int, (ffi.c_char_p, ffi.c_char_p, ffi.c_char_p, ffi.c_ulong,
                                                  ffi.c_char_p))
_umount2 = ffi.libc_function("umount2", ffi.c_int, (ffi.c_char_p, ffi.c_int))
_setns = ffi.libc_function("setns", ffi.c_int, (ffi.c_int, ffi.c_int))
_unshare = ffi.libc_function("unshare", ffi.c_int, (ffi.c_int,))
_fstatfs = ffi.libc_function("fstatfs", ffi.c_int, (ffi.c_int, ffi.c_void_p))
_syscall = ffi.libc_function("syscall", ffi.c_long)  # variadic: arguments go in as C-typed values
_prctl_call = ffi.libc_function("prctl", ffi.c_int)  # variadic too
_signal = ffi.libc_function("signal", ffi.c_void_p, (ffi.c_int, ffi.c_void_p))
_setfsuid = ffi.libc_function("setfsuid", ffi.c_int, (ffi.c_uint,))
_setfsgid = ffi.libc_function("setfsgid", ffi.c_int, (ffi.c_uint,))
_renameat2 = ffi.libc_function("renameat2", ffi.c_int, (ffi.c_int, ffi.c_char_p, ffi.c_int, ffi.c_char_p, ffi.c_uint))
_capset = ffi.libc_function("capset", ffi.c_int, (ffi.c_void_p, ffi.c_void_p))

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_GET_SECUREBITS = 27
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_DAC_OVERRIDE = 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SECBIT_NO_SETUID_FIXUP = 1 << 2
SIGKILL = 9  # the number, not `import signal` (which imports enum: milliseconds on slow machines)
SIGPIPE = 13
SIGXFSZ = 25


class _OpenHow(ffi.Structure):
    _fields_ = (("flags", ffi.c_uint64), ("mode", ffi.c_uint64), ("resolve", ffi.c_uint64))


def _fail(call: str, what: object) -> OSError:
    err = ffi.get_errno()
    return OSError(err, f"{call} {what}: {os.strerror(err)}")


def _b(s: str | bytes | None) -> bytes | None:
    if s is None or isinstance(s, bytes):
        return s
    return os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None, *,
          what: str | None = None) -> None:
    """mount(2). `what` names the target in error messages (a container path, say) when
    `target` is a /proc/self/fd/N path that would mean nothing to a user."""
    if _mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        raise _fail("mount", what or target)


def umount2(target: str, flags: int = 0, *, what: str | None = None) -> None:
    if _umount2(_b(target), flags) != 0:
        raise _fail("umount2", what or target)


def setns(fd: int, nstype: int, *, what: str = "namespace") -> None:
    """setns(2); EINVAL for CLONE_NEWNS means the caller has more than one thread."""
    if _setns(fd, nstype) != 0:
        raise _fail("setns", what)


def unshare(flags: int) -> None:
    if _unshare(flags) != 0:
        raise _fail("unshare", hex(flags))


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2) through syscall(2) (glibc 2.36 has no wrapper). ENOSYS on kernels before 5.6."""
    how = _OpenHow(flags, mode, resolve)
    fd: int = _syscall(ffi.c_long(_NR_OPENAT2), ffi.c_int(dirfd), ffi.c_char_p(_b(path)),
                       ffi.byref(how), ffi.c_size_t(ffi.sizeof(how)))
    if fd < 0:
        raise _fail("openat2", path)
    return fd


RENAME_EXCHANGE = 2


def renameat2(olddirfd: int, old: str, newdirfd: int, new: str, flags: int) -> None:
    """renameat2(2): with RENAME_EXCHANGE, swap two names atomically."""
    if _renameat2(olddirfd, _b(old), newdirfd, _b(new), flags) != 0:
        raise _fail("renameat2", new)


def fstatfs_type(fd: int) -> int:
    """The f_type of the filesystem holding `fd` (struct statfs starts with it, a long)."""
    buf = ffi.char_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _fstatfs(fd, buf) != 0:
        raise _fail("fstatfs", f"fd {fd}")
    f_type: int = ffi.c_long.from_buffer(buf).value
    return f_type & 0xFFFFFFFF


def _prctl(option: int, arg: int, what: str) -> None:
    if _prctl_call(option, ffi.c_ulong(arg), ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0)) != 0:
        raise _fail("prctl", what)


# The parent-death signal this process armed and the parent it was armed against: the kernel
# clears the signal whenever the effective or filesystem ids (or the capability sets) change,
# so every such change re-arms it (`rearm_pdeathsig`).
_death = [0, 0]


def set_pdeathsig(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG): get `sig` when the parent (thread) dies."""
    _prctl(PR_SET_PDEATHSIG, sig, "PR_SET_PDEATHSIG")
    _death[0], _death[1] = sig, os.getppid()


def rearm_pdeathsig() -> None:
    """Arm the parent-death signal again after a credential change cleared it; if the parent
    died meanwhile (this process was reparented), deliver the signal now."""
    sig, parent = _death
    if not sig:
        return
    _prctl(PR_SET_PDEATHSIG, sig, "PR_SET_PDEATHSIG")
    if parent > 1 and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def setfsids(uid: int, gid: int) -> None:
    """setfsgid + setfsuid (the ids file creation uses). Changing the fsuid from 0 to another
    id drops the file capabilities from the effective set; changing it back restores them.
    Either change clears the parent-death signal, which is re-armed."""
    _setfsgid(gid)
    _setfsuid(uid)
    # both calls return the previous id and cannot report failure: ask again to check
    ok = _setfsuid(uid) == uid and _setfsgid(gid) == gid
    rearm_pdeathsig()
    if not ok:
        raise OSError(1, f"setfsuid/setfsgid {uid}:{gid}: {os.strerror(1)}")


class FsIds:
    """`with FsIds((uid, gid)):` what is created inside belongs to those ids (setfsids to them,
    then back to root's); a no-op for (0, 0), where nvhook creates as itself."""

    __slots__ = ("ids",)

    def __init__(self, ids: tuple[int, int]):
        self.ids = ids

    def __enter__(self) -> None:
        if self.ids != (0, 0):
            setfsids(*self.ids)

    def __exit__(self, *exc: object) -> None:
        if self.ids != (0, 0):
            setfsids(0, 0)


class _CapHeader(ffi.Structure):
    _fields_ = (("version", ffi.c_uint32), ("pid", ffi.c_int))


class _CapData(ffi.Structure):
    _fields_ = (("effective", ffi.c_uint32), ("permitted", ffi.c_uint32), ("inheritable", ffi.c_uint32))


def capset(effective: int, permitted: int, inheritable: int = 0) -> None:
    """capset(2) for this thread, each set a bit mask of capability numbers (64 bits)."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        data[i].effective = (effective >> (32 * i)) & 0xFFFFFFFF
        data[i].permitted = (permitted >> (32 * i)) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> (32 * i)) & 0xFFFFFFFF
    if _capset(ffi.byref(header), data) != 0:
        raise _fail("capset", hex(permitted))


def drop_bounding_set(keep: int = 0) -> None:
    """Drop every capability not in the mask `keep` from the bounding set (needs CAP_SETPCAP:
    do it before capset) and clear the ambient set."""
    for cap in range(64):
        if keep >> cap & 1:
            continue
        if _prctl_call(PR_CAPBSET_DROP, ffi.c_ulong(cap), ffi.c_ulong(0), ffi.c_ulong(0),
                       ffi.c_ulong(0)) != 0:
            if ffi.get_errno() == 22:  # EINVAL: past the kernel's last capability
                break
            raise _fail("prctl", f"PR_CAPBSET_DROP {cap}")
    if _prctl_call(PR_CAP_AMBIENT, ffi.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ffi.c_ulong(0),
                   ffi.c_ulong(0), ffi.c_ulong(0)) != 0 and ffi.get_errno() != 22:
        raise _fail("prctl", "PR_CAP_AMBIENT_CLEAR_ALL")


def set_no_new_privs() -> None:
    """prctl(PR_SET_NO_NEW_PRIVS, 1): exec can never grant privileges (setuid bits, file caps)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")


def set_securebits(bits: int) -> None:
    """prctl(PR_SET_SECUREBITS); needs CAP_SETPCAP."""
    _prctl(PR_SET_SECUREBITS, bits, "PR_SET_SECUREBITS")


def get_securebits() -> int:
    bits: int = _prctl_call(PR_GET_SECUREBITS, ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0), ffi.c_ulong(0))
    if bits < 0:
        raise _fail("prctl", "PR_GET_SECUREBITS")
    return bits


def fsids() -> tuple[int, int]:
    """(fsuid, fsgid): setfsuid/setfsgid with an invalid id change nothing and return the
    current one."""
    return _setfsuid(0xFFFFFFFF) & 0xFFFFFFFF, _setfsgid(0xFFFFFFFF) & 0xFFFFFFFF


def kill_timer(seconds: int) -> int | None:
    """A POSIX timer that sends this process SIGKILL in `seconds`: the one limit that also ends
    a wait only a fatal signal interrupts (a FUSE request its server never answers). Its handle
    for `cancel_timer`, or None where libc has no timer_create (glibc < 2.34 keeps it in librt)."""
    try:
        create = ffi.libc_function("timer_create", ffi.c_int, (ffi.c_int, ffi.c_void_p, ffi.c_void_p))
        settime = ffi.libc_function("timer_settime", ffi.c_int, (ffi.c_void_p, ffi.c_int, ffi.c_void_p, ffi.c_void_p))
    except AttributeError:
        return None
    event = ffi.char_buffer(64)  # struct sigevent: sigev_value (8 bytes), sigev_signo, sigev_notify
    ffi.c_int.from_buffer(event, 8).value = SIGKILL
    ffi.c_int.from_buffer(event, 12).value = 0  # SIGEV_SIGNAL
    timer = ffi.c_void_p()
    if create(1, event, ffi.byref(timer)) != 0:  # CLOCK_MONOTONIC
        raise _fail("timer_create", "SIGKILL")
    spec = ffi.char_buffer(32)  # struct itimerspec: it_interval (0: once), it_value
    ffi.c_long.from_buffer(spec, 16).value = seconds
    handle: int = timer.value or 0
    if settime(timer, 0, spec, None) != 0:
        err = _fail("timer_settime", "SIGKILL")
        cancel_timer(handle)
        raise err
    return handle


def cancel_timer(handle: int) -> None:
    ffi.libc_function("timer_delete", ffi.c_int, (ffi.c_void_p,))(handle)


def default_signals(*signums: int) -> None:
    """Reset signals to SIG_DFL before an exec: Python ignores SIGPIPE and SIGXFSZ, and ignored
    signals stay ignored across execve."""
    for sig in signums:
        _signal(sig, None)  # None is NULL: SIG_DFL
