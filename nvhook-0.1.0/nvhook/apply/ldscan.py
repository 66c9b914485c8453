"""The container's /etc/ld.so.cache, written by nvhook itself: no program runs.

`update(root, directories, log)` produces the cache the image's own ldconfig would write once
the driver files are in place (`ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache <dirs>`):

  - the directories, in ldconfig's order (ldconf.py: the plan's, /etc/ld.so.conf and its
    includes, glibc's trusted directories, each with its glibc-hwcaps subdirectories);
  - in each directory the names that look like libraries (lib*.so*, ld-*.so*): their SONAME
    and flags read from the ELF file (ldelf.py), one SONAME per directory (a file before a
    link, then the newest name), the dev link (libfoo.so -> libfoo.so.1) as its own entry, as
    ldconfig does (`Scan`);
  - bytes from nvhook.base.ldformat: glibc 2.36's layout, or the old+new one when the image's
    glibc is older than 2.32 (its cache is in that format, or its libc defines no GLIBC_2.32+).

Nothing the image holds is trusted (see ldconf.py): a library is opened O_PATH, checked to be a
regular file on that fd, and only then reopened for reading through it, so a FIFO or a device
node swapped in is never opened; the entries looked at and the libraries read are bounded.

The cache is written to a temporary file created with O_EXCL|O_NOFOLLOW in the container's
/etc (a directory fd resolved in the root), as the container's root, and swapped in for
ld.so.cache (`_replace`): a reader sees the old cache or the new one, and a symlink planted at
either name is replaced, never followed.

Not reproduced (glibc 2.36 features no current image uses for the libraries nvhook adds):
legacy hwcap subdirectories (tls/, haswell/, ...: removed from glibc in 2.37), the x86 ISA level
of glibc-hwcaps entries built with -mneeded, and ldconfig's removal of dangling `.so.` links.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..base import ldformat, sandbox
from ..base.errors import HookError

# muslpath at load time too: update() runs in the container's mount namespace, where nothing
# may be imported (the image would choose the file).
from . import ldconf, muslpath
from .ldconf import O_READ, Dir, DirList, open_dir, read_regular, reopen
from .ldelf import read_elf
from .paths import Root

# Bounds on what an image can make nvhook do (the others, on directories and config files, are
# in ldconf.py; MAX_FILES there counts the entries this scan looks at too).
MAX_LIBRARIES = 16384

_O_PATH = os.O_PATH | os.O_CLOEXEC


class ScanTooSlow(HookError):
    """A scan still running past its deadline."""


# The clock a scan's deadline is read on (a module attribute, so that a test can make time pass).
clock = time.monotonic


class Scan(DirList):
    """One cache build: the directory list (ldconf.DirList), then the libraries in it. With a
    `deadline` (on `clock`), a scan still running past it is a HookError: the bounds above cap
    the work, not its time, and an image's files read cold (or a slow disk) can take seconds,
    longer than the NRI plugin's request may (docs/nri.md, "A hostile image")."""

    def __init__(self, root: Root, machine: str | None = None, deadline: float | None = None):
        super().__init__(root, machine)
        self.files = 0
        self.libraries = 0
        self.deadline = deadline

    def check_time(self) -> None:
        if self.deadline is not None and clock() > self.deadline:
            raise ScanTooSlow(f"scanning the image's library directories took too long ({self.files} entries, "
                            f"{self.libraries} libraries looked at so far)")

    def search(self, d: Dir, memo: dict) -> list[ldformat.Entry]:
        self.check_time()
        dfd = open_dir(self.root, d.path)
        if dfd is None:
            return []
        most = ldconf.MAX_FILES
        try:
            with os.scandir(dfd) as it:
                listing = []
                for e in it:
                    self.files += 1
                    if not self.files & 255:
                        self.check_time()
                    if self.files > most:
                        raise HookError(f"the image's library directories hold more than {most} entries")
                    name = e.name
                    if not (name.startswith("lib") or name.startswith("ld-")) or ".so" not in name:
                        continue
                    if name.endswith(".#prelink#") or ".#prelink#." in name[-17:]:
                        continue
                    try:
                        is_link = e.is_symlink()
                        is_reg = e.is_file(follow_symlinks=False)
                    except OSError:
                        continue
                    if is_link or is_reg:
                        self.libraries += 1
                        if self.libraries > MAX_LIBRARIES:
                            raise HookError(f"the image's library directories hold more than {MAX_LIBRARIES} "
                                            f"libraries")
                        listing.append((name, is_link))
        except OSError:
            os.close(dfd)
            return []
        except HookError:
            os.close(dfd)
            raise
        dlibs: dict[bytes, list] = {}  # soname -> [name, is_link, flag]; order: first seen first
        regular = {name for name, is_link in listing if not is_link}
        local: dict = {}  # name -> result, for the regular files of this directory
        try:
            for name, is_link in listing:
                got = self._library(dfd, d.path, name, is_link, memo, regular, local)
                if got is None:
                    continue
                flag, soname = got
                bname = os.fsencode(name)
                if soname is None:
                    soname = bname
                if is_link and bname != soname and not (bname.endswith(b".so") and soname.startswith(bname)):
                    is_link = False
                if is_link:
                    soname = bname
                if flag == ldformat.FLAG_ELF and d.flag in (2, 3):
                    flag = d.flag
                old = dlibs.get(soname)
                if old is None:
                    dlibs[soname] = [bname, is_link, flag]
                elif (not is_link and old[1]) or (is_link == old[1] and ldformat.libcmp(old[0], bname) < 0):
                    if old[2] != flag and ((old[2] == 1 and flag in (2, 3)) or (old[2] in (2, 3) and flag == 1)):
                        old[2] = flag
                    old[0], old[1] = bname, is_link
        finally:
            os.close(dfd)
        bpath = os.fsencode(d.path)
        hw = None if d.hwcaps is None else os.fsencode(d.hwcaps)
        out = []
        for soname, (bname, _link, flag) in reversed(dlibs.items()):  # ldconfig adds at the head
            out.append(ldformat.Entry(soname, bpath + b"/" + (soname if hw is None else bname), flag, hw))
        return out

    def _library(self, dfd: int, dpath: str, name: str, is_link: bool, memo: dict, regular: set,
                 local: dict):
        try:
            if is_link:
                # The usual link names a regular file beside it: read that one (once), without
                # resolving a path; anything else is resolved inside the root.
                target = os.readlink(name, dir_fd=dfd)
                if "/" not in target and target in regular:
                    return self._library(dfd, dpath, target, False, memo, regular, local)
                pfd = self.root.lookup(f"{dpath}/{name}")
            else:
                if name in local:
                    return local[name]
                pfd = os.open(name, _O_PATH | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError:
            return None
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                return None
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key in memo:
                got = memo[key]
                if not is_link:
                    local[name] = got
                return got
            got = None
            if st.st_size >= 64:
                self.check_time()
                fd = reopen(pfd, O_READ)
                try:
                    got = read_elf(fd, st.st_size, self.machine)
                finally:
                    os.close(fd)
            memo[key] = got
            if not is_link:
                local[name] = got
            return got
        except OSError:
            return None
        finally:
            os.close(pfd)

    def entries(self, directories: list[str], conf: str = "/etc/ld.so.conf") -> list[ldformat.Entry]:
        memo: dict = {}
        out: list[ldformat.Entry] = []
        for entry in self.collect(directories, conf):
            out += self.search(entry, memo)
        return ldformat.sort_entries(out)


def old_format_wanted(root: Root) -> bool:
    """Whether the image's ldconfig writes the old+new layout (glibc < 2.32): what its current
    cache is, or else whether its libc defines a symbol version of 2.32 or later."""
    head = read_regular(root, "/etc/ld.so.cache", 32)
    if head:
        if head.startswith(ldformat.OLD_MAGIC):
            return True
        if head.startswith(ldformat.NEW_MAGIC):
            return False
    triplet = ldconf.TRIPLETS.get(os.uname().machine, "-")
    for d in ("/lib/" + triplet, "/usr/lib/" + triplet, "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        data = read_regular(root, d + "/libc.so.6", 8 << 20)
        if data:
            best = 0
            at = data.find(b"GLIBC_2.")
            while at >= 0:
                num = b""
                k = at + 8
                while k < len(data) and data[k:k + 1].isdigit():
                    num += data[k:k + 1]
                    k += 1
                if num:
                    best = max(best, int(num))
                at = data.find(b"GLIBC_2.", k)
            return 0 < best < 32  # no version found at all: nothing says the image is old
    return False


GENERATOR = b"nvhook (built-in ld.so.cache writer)"


def build(root: Root, directories: list[str], *, generator: bytes = GENERATOR,
          old_format: bool | None = None, machine: str | None = None,
          deadline: float | None = None) -> tuple[bytes, int]:
    """The cache bytes and the number of entries."""
    scan = Scan(root, machine, deadline)
    entries = scan.entries(directories)
    if old_format is None:
        old_format = old_format_wanted(root)
    return ldformat.build(entries, hwcaps_seen=scan.hwcaps_seen, generator=generator,
                          old_format=old_format), len(entries)


class EtcIsAVolume(HookError):
    """The container's /etc is not on its root filesystem's mount (see `Root.same_mount`)."""


def write(root: Root, data: bytes, name: str = "ld.so.cache") -> None:
    """Replace the container's /etc/`name` (ld.so.cache; musl's ld-musl-ARCH.path) with `data`,
    atomically, through an fd on /etc resolved inside the root."""
    try:
        etc = root.lookup("/etc")
    except OSError as e:
        raise HookError(f"cannot write the container's {name}: /etc: {e.strerror}") from None
    try:
        if not stat.S_ISDIR(os.fstat(etc).st_mode):
            raise HookError(f"cannot write the container's {name}: /etc is not a directory")
        if not root.same_mount(etc):
            raise EtcIsAVolume(f"the container's /etc is a volume mounted into it (a hostPath or a shared "
                               f"directory), not its image's: nvhook does not write its {name} there, where "
                               f"it would land outside the container's root filesystem")
        tmp = f".{name}.nvhook-{os.getpid()}"
        with root.as_owner():
            for _ in range(2):
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o644, dir_fd=etc)
                    break
                except FileExistsError:  # left by a killed run with our pid: ours to remove
                    os.unlink(tmp, dir_fd=etc)
            else:
                raise HookError(f"cannot write the container's {name}: temporary file keeps reappearing")
        try:
            try:
                os.fchmod(fd, 0o644)  # the umask does not decide what every user may read
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            _replace(etc, tmp, name)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=etc)
            except OSError:
                pass
            raise
    except OSError as e:
        raise HookError(f"cannot write the container's /etc/{name}: {e.strerror or e}") from None
    finally:
        os.close(etc)


def _replace(etc: int, tmp: str, name: str = "ld.so.cache") -> None:
    """Put `tmp` in place of `name` atomically. An existing file (or link) is swapped
    with RENAME_EXCHANGE and then removed under the temporary name: a plain rename over an
    existing file makes ext4 start writing the new data back at once (its replace-by-rename
    heuristic), which costs milliseconds on a busy disk; the swap does not. Anything else
    (nothing there, a filesystem without the swap) gets a plain rename."""
    try:
        st = os.stat(name, dir_fd=etc, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        try:
            sandbox.renameat2(etc, tmp, etc, name, sandbox.RENAME_EXCHANGE)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOENT, errno.EXDEV):
                raise
        else:
            os.unlink(tmp, dir_fd=etc)  # the old cache now has the temporary name
            return
    os.rename(tmp, name, src_dir_fd=etc, dst_dir_fd=etc)


def update(root: Root, directories: list[str], log, deadline: float | None = None) -> str:
    """Build and write the container's cache; logs `ldcache.written`. Returns "written". An
    image whose loader is musl's reads no ld.so.cache: its path file gets the directories
    instead (apply/muslpath.py) and "musl-path" is returned. A container whose /etc is a volume
    (`Root.same_mount`) gets nothing written there: `ldcache.skipped` (a warning), "skipped"."""
    try:
        arch = muslpath.musl_arch(root)
        if arch is not None:
            return muslpath.update(root, arch, directories, log, write)
        t0 = time.perf_counter()
        data, n = build(root, directories, deadline=deadline)
        t1 = time.perf_counter()
        write(root, data)
    except EtcIsAVolume as e:
        # The libraries are mounted where the image's loader searches or names them; only the
        # cache's listing (ldconfig -p) is missing, which the message says.
        log.warning("ldcache.skipped", reason="etc-volume", directories=directories,
                    message=f"{e.message}; the driver's libraries are mounted but `ldconfig -p` does not list "
                            f"them: mount that volume elsewhere than /etc")
        return "skipped"
    log.info("ldcache.written", entries=n, bytes=len(data), directories=directories,
             build_ms=round((t1 - t0) * 1000, 2), write_ms=round((time.perf_counter() - t1) * 1000, 2))
    return "written"
