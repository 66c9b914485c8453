"""ldconfig's list of library directories in an image, as glibc 2.36's ldconfig makes it.

In ldconfig's order: the directories it is given (where nvhook mounted libraries: ldconfig's
command line comes first), then /etc/ld.so.conf with its `include` globs, then glibc's trusted
directories for the image's layout (Debian multiarch: /lib/<triplet>, /usr/lib/<triplet>, /lib,
/usr/lib; otherwise /lib, /lib64, /usr/lib, /usr/lib64 and the x32/ilp32 ones); each directory
once (by device and inode), each followed by its glibc-hwcaps/<name> subdirectories.

Nothing the image holds is trusted: every path is resolved with the rootfs as "/" (`Root`,
openat2 RESOLVE_IN_ROOT: absolute links and ".." stay inside); a file is opened O_PATH, checked
on that fd to be what is wanted (a directory, a regular file), and only then reopened for
reading through it, so a FIFO or a device node swapped in is never opened; every read is
bounded (config files, include depth and count, lines, lookups, directories, entries). Include
loops end where a file includes one of its includers (ldconfig recurses until it runs out of
file descriptors; the directories, deduplicated, come out the same). Globs are matched here
(`re` and `fnmatch` stay off the start path).
"""

from __future__ import annotations

import os
import stat

from ..base import sandbox
from ..base.errors import HookError
from .paths import Root

# Bounds on what an image can make nvhook do (real images are far below each).
MAX_CONF_BYTES = 1 << 20  # per ld.so.conf file
MAX_CONF_FILES = 256
MAX_INCLUDE_DEPTH = 16
MAX_DIRS = 1024
MAX_FILES = 200_000  # directory entries looked at, in all (here and by the library scan)
# Path lookups for ld.so.conf lines, includes and glibc-hwcaps subdirectories, and library
# files opened: without these, one 1 MiB ld.so.conf of "/lib" lines cost 16 s, 30,000
# glibc-hwcaps subdirectories 70 s, 50,000 library links 7 s. Real images: tens of
# directories, a few thousand libraries at most (a CUDA devel image: about 1,000).
MAX_LOOKUPS = 4096
MAX_CONF_LINES = 16384  # directory and include lines, in all files
MAX_CONF_TOTAL = 4 << 20  # bytes read from all ld.so.conf files

O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK

_LIB_TYPES = {"libc4": 0, "libc5": 2, "libc6": 3, "glibc2": 3}
TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}


# -- paths inside the root --------------------------------------------------------------------

def reopen(fd: int, flags: int) -> int:
    """A readable fd on the object the O_PATH `fd` holds: the same inode, whatever its name
    points at by now."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def open_dir(root: Root, path: str) -> int | None:
    try:
        pfd = root.lookup(path)
    except OSError:
        return None
    try:
        if not stat.S_ISDIR(os.fstat(pfd).st_mode):
            return None
        return reopen(pfd, O_READ | os.O_DIRECTORY)
    except OSError:
        return None
    finally:
        os.close(pfd)


def kernel_file(fd: int) -> bool:
    """Whether `fd` is on procfs or sysfs: "regular" files there are the kernel's, read as the
    reader (nvhook: root, in the host's namespaces), and some reads take something away
    (/proc/kmsg, which runtimes do not mask, hands its kernel messages to one reader only).
    No image keeps its loader's files there; a link to one is never read."""
    return sandbox.fstatfs_type(fd) in (sandbox.PROC_SUPER_MAGIC, SYSFS_MAGIC)


SYSFS_MAGIC = 0x62656572


def open_regular(root: Root, path: str) -> tuple[int, os.stat_result] | None:
    """(a read fd, its stat) for the regular file at `path` (in the root), or None: missing,
    not a regular file (a FIFO or device planted there is never opened), or a file of procfs
    or sysfs (`kernel_file`)."""
    try:
        pfd = root.lookup(path)
    except OSError:
        return None
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode) or kernel_file(pfd):
            return None
        return reopen(pfd, O_READ), st
    except OSError:
        return None
    finally:
        os.close(pfd)


def read_regular(root: Root, path: str, limit: int) -> bytes | None:
    """The first `limit` bytes of the regular file at `path` (in the root), or None (also for a
    file of procfs or sysfs: `kernel_file`)."""
    opened = open_regular(root, path)
    if opened is None:
        return None
    fd = opened[0]
    try:
        chunks, n = [], 0
        while n < limit:
            b = os.read(fd, min(65536, limit - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _fnmatch(name: str, pat: str) -> bool:
    """glob(3)'s match of one component: * ? [...] ([!...] and [^...] negate), a leading
    "." only matched by a literal one; `re` and `fnmatch` stay off the start path."""
    if name.startswith(".") and not pat.startswith("."):
        return False
    # iterative matcher with backtracking on the last *
    i = j = 0
    star_i, star_j = -1, 0
    while i < len(name):
        if j < len(pat):
            c = pat[j]
            if c == "*":
                star_i, star_j = j, i
                j += 1
                continue
            if c == "?":
                i += 1
                j += 1
                continue
            if c == "[":
                end = pat.find("]", j + 2)
                if end > 0:
                    body = pat[j + 1:end]
                    neg = body[:1] in ("!", "^")
                    if neg:
                        body = body[1:]
                    hit, k = False, 0
                    while k < len(body):
                        if k + 2 < len(body) and body[k + 1] == "-":
                            hit = hit or body[k] <= name[i] <= body[k + 2]
                            k += 3
                        else:
                            hit = hit or body[k] == name[i]
                            k += 1
                    if hit != neg:
                        i += 1
                        j = end + 1
                        continue
                elif name[i] == "[":
                    i += 1
                    j += 1
                    continue
            elif c == "\\" and j + 1 < len(pat) and pat[j + 1] == name[i]:
                i += 1
                j += 2
                continue
            elif c == name[i]:
                i += 1
                j += 1
                continue
        if star_i < 0:
            return False
        star_j += 1
        i, j = star_j, star_i + 1
    while j < len(pat) and pat[j] == "*":
        j += 1
    return j == len(pat)


def _glob(root: Root, pattern: str, budget: list) -> list[str]:
    """glob(3) inside the root, sorted as the C locale sorts. `budget`: [directory entries,
    lookups] left, both counted down."""
    parts = [p for p in pattern.split("/") if p]
    found = ["/"] if pattern.startswith("/") else [""]
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        nxt = []
        wild = any(ch in part for ch in "*?[")
        for base in found:
            prefix = base if base.endswith("/") or not base else base + "/"
            if not wild:
                cand = prefix + part.replace("\\", "")
                if last:
                    _spend_lookup(budget)
                    try:
                        os.close(root.lookup(cand))
                    except OSError:
                        continue
                nxt.append(cand)
                continue
            _spend_lookup(budget)
            dfd = open_dir(root, base or "/")
            if dfd is None:
                continue
            try:
                names = os.listdir(dfd)
            except OSError:
                names = []
            finally:
                os.close(dfd)
            budget[0] -= len(names)
            if budget[0] < 0:
                raise HookError("the image's ld.so.conf includes match too many files")
            for n in sorted(names, key=os.fsencode):
                if _fnmatch(n, part):
                    nxt.append(prefix + n)
        found = nxt
        if not found:
            break
    return found


def _spend_lookup(budget: list) -> None:
    budget[1] -= 1
    if budget[1] < 0:
        raise HookError(f"the image's ld.so.conf makes nvhook look up more than {MAX_LOOKUPS} paths "
                        f"(directories, includes, glibc-hwcaps subdirectories)")


# -- the directory list -----------------------------------------------------------------------

class Dir:
    __slots__ = ("path", "flag", "hwcaps")

    def __init__(self, path: str, flag: int, hwcaps: str | None):
        self.path, self.flag, self.hwcaps = path, flag, hwcaps


class DirList:
    """The directories one cache build searches (`collect`), in order."""

    def __init__(self, root: Root, machine: str | None = None):
        self.root = root
        self.machine = machine or os.uname().machine
        self.dirs: list[Dir] = []
        self.seen: set[tuple[int, int]] = set()
        self.hwcaps_seen: list[bytes] = []
        self.hwcaps_names: set[bytes] = set()
        self.conf_files = 0
        self.paths_seen: set[str] = set()
        self.conf_lines = 0
        self.conf_bytes = 0
        self.budget = [MAX_FILES, MAX_LOOKUPS]

    def add_dir(self, line: str) -> None:
        flag = 0
        path = line
        if "=" in path:
            path, kind = path.split("=", 1)
            flag = _LIB_TYPES.get(kind, 0)
        path = path.rstrip(" \t\n\v\f\r").rstrip("/")
        if not path or path in self.paths_seen:
            return  # the same line again: what it names is in already (or missing)
        self.paths_seen.add(path)
        _spend_lookup(self.budget)
        try:
            fd = self.root.lookup(path)
        except OSError:
            return
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            return
        if len(self.dirs) >= MAX_DIRS:
            raise HookError(f"the image's ld.so.conf names more than {MAX_DIRS} library directories")
        self.seen.add(key)
        self.dirs.append(Dir(path, flag, None))
        self._add_hwcaps(path, flag)

    def _add_hwcaps(self, path: str, flag: int) -> None:
        _spend_lookup(self.budget)
        dfd = open_dir(self.root, path + "/glibc-hwcaps")
        if dfd is None:
            return
        try:
            with os.scandir(dfd) as it:
                names = [(e.name, e.is_file(follow_symlinks=False)) for e in it]
        except OSError:
            return
        finally:
            os.close(dfd)
        self.budget[0] -= len(names)
        if self.budget[0] < 0:
            raise HookError(f"the image's library directories hold more than {MAX_FILES} entries")
        for name, is_reg in names:
            if name.startswith(".") or is_reg or ":" in name:
                continue
            sub = f"{path}/glibc-hwcaps/{name}"
            _spend_lookup(self.budget)
            try:
                fd = self.root.lookup(sub)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if not stat.S_ISDIR(st.st_mode):
                continue
            bname = os.fsencode(name)
            if bname not in self.hwcaps_names:
                self.hwcaps_names.add(bname)
                self.hwcaps_seen.append(bname)
            key = (st.st_dev, st.st_ino)
            if key in self.seen or len(self.dirs) >= MAX_DIRS:
                continue
            self.seen.add(key)
            self.dirs.append(Dir(sub, flag, name))

    def parse_conf(self, path: str, stack: tuple = ()) -> None:
        if len(stack) >= MAX_INCLUDE_DEPTH or path in stack:
            return
        self.conf_files += 1
        if self.conf_files > MAX_CONF_FILES:
            raise HookError(f"the image's ld.so.conf includes more than {MAX_CONF_FILES} files")
        data = read_regular(self.root, path, MAX_CONF_BYTES + 1)
        if data is None:
            return
        if len(data) > MAX_CONF_BYTES:
            raise HookError(f"the image's {path} is larger than {MAX_CONF_BYTES} bytes")
        self.conf_bytes += len(data)
        if self.conf_bytes > MAX_CONF_TOTAL:
            raise HookError(f"the image's ld.so.conf and its includes are larger than {MAX_CONF_TOTAL} bytes")
        stack = stack + (path,)
        for raw in data.split(b"\n"):
            line = raw.split(b"\0", 1)[0].split(b"#", 1)[0].decode("utf-8", "surrogateescape")
            line = line.lstrip(" \t\n\v\f\r")
            if not line:
                continue
            self.conf_lines += 1
            if self.conf_lines > MAX_CONF_LINES:
                raise HookError(f"the image's ld.so.conf and its includes have more than {MAX_CONF_LINES} lines")
            if line.startswith("include") and line[7:8] in (" ", "\t"):
                for pat in line[8:].replace("\t", " ").split(" "):
                    if pat:
                        if not pat.startswith("/"):
                            pat = path.rsplit("/", 1)[0] + "/" + pat
                        for inc in _glob(self.root, pat, self.budget):
                            self.parse_conf(inc, stack)
            elif line[:5].lower() == "hwcap" and line[5:6] in (" ", "\t"):
                continue
            else:
                self.add_dir(line)

    def libc_dir(self) -> str | None:
        """The directory of the image's libc.so.6 (resolved inside the root), of those a glibc
        build keeps it in (multiarch, lib64, lib), or None: what tells where its loader looks
        by default (decide.nriwork.loader_defaults). One on a volume the pod mounted there is
        not the image's (and would teach the image's other pods what this one showed)."""
        triplet = TRIPLETS.get(self.machine)
        dirs = ([f"/lib/{triplet}", f"/usr/lib/{triplet}"] if triplet else []) + ["/lib64", "/usr/lib64", "/lib",
                                                                                 "/usr/lib"]
        for d in dirs:
            try:
                fd = self.root.lookup(f"{d}/libc.so.6")
            except OSError:
                continue
            try:
                if self.root.same_mount(fd):
                    return d
            finally:
                os.close(fd)
        return None

    def system_dirs(self) -> list[str]:
        triplet = TRIPLETS.get(self.machine)
        if triplet and any(self.root.exists(f"{d}/{triplet}/libc.so.6") for d in ("/lib", "/usr/lib")):
            return [f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib"]
        extra = {"x86_64": "x32", "aarch64": "ilp32"}.get(self.machine)
        out = []
        for top in ("/lib", "/usr/lib"):
            out += [top, top + "64"] + ([top + extra] if extra else [])
        return out

    def collect(self, directories: list[str], conf: str = "/etc/ld.so.conf") -> list[Dir]:
        for d in directories:
            if d.startswith("/"):
                self.add_dir(d)
        self.parse_conf(conf)
        for d in self.system_dirs():
            self.add_dir(d)
        return self.dirs
