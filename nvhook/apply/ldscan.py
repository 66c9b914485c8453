"""The container's /etc/ld.so.cache, written by nvhook itself: no program runs.

`update(root, directories, log)` produces the cache the image's own ldconfig would write once
the driver files are in place (`ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache <dirs>`):

  - directories, in ldconfig's order: the plan's (where nvhook mounted libraries; ldconfig's
    command line comes first), then /etc/ld.so.conf with its `include` globs, then glibc's
    trusted directories for the image's layout (Debian multiarch: /lib/<triplet>,
    /usr/lib/<triplet>, /lib, /usr/lib; otherwise /lib, /lib64, /usr/lib, /usr/lib64 and the
    x32/ilp32 ones); each directory once (by device and inode), each followed by its
    glibc-hwcaps/<name> subdirectories;
  - in each directory the names that look like libraries (lib*.so*, ld-*.so*): their SONAME
    and flags read from the ELF file by a small reader of the program headers and the dynamic
    section (no pyelftools: it stays off the start path), one SONAME per directory (a file
    before a link, then the newest name), the dev link (libfoo.so -> libfoo.so.1) as its own
    entry, as ldconfig does;
  - bytes from nvhook.base.ldformat: glibc 2.36's layout, or the old+new one when the image's
    glibc is older than 2.32 (its cache is in that format, or its libc defines no GLIBC_2.32+).

Nothing the image holds is trusted: every path is resolved with the rootfs as "/" (`Root`,
openat2 RESOLVE_IN_ROOT: absolute links and ".." stay inside); a library is opened O_PATH,
checked to be a regular file on that fd, and only then reopened for reading through it, so a
FIFO or a device node swapped in is never opened; every read is bounded (headers, dynamic
section, strings, config files, include depth and count, directories, files). Include loops
end where a file includes one of its includers (ldconfig recurses until it runs out of file
descriptors; the directories, deduplicated, come out the same).

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
import struct
import time

from ..base import ldformat, sandbox
from ..base.errors import HookError
from .paths import Root

# Bounds on what an image can make nvhook do (real images are far below each).
MAX_CONF_BYTES = 1 << 20  # per ld.so.conf file
MAX_CONF_FILES = 256
MAX_INCLUDE_DEPTH = 16
MAX_DIRS = 1024
MAX_FILES = 200_000  # directory entries looked at, in all
# Path lookups for ld.so.conf lines, includes and glibc-hwcaps subdirectories, and library
# files opened: without these, one 1 MiB ld.so.conf of "/lib" lines cost 16 s, 30,000
# glibc-hwcaps subdirectories 70 s, 50,000 library links 7 s. Real images: tens of
# directories, a few thousand libraries at most (a CUDA devel image: about 1,000).
MAX_LOOKUPS = 4096
MAX_CONF_LINES = 16384  # directory and include lines, in all files
MAX_CONF_TOTAL = 4 << 20  # bytes read from all ld.so.conf files
MAX_LIBRARIES = 16384
MAX_PHNUM = 256
MAX_DYN = 4096  # dynamic entries read per library
MAX_NAME = 4096

_O_PATH = os.O_PATH | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK

_INTERPRETERS = {b"/lib/ld-linux.so.2": 3, b"/lib/ld-linux.so.1": 2, b"/lib64/ld-linux-x86-64.so.2": 3,
                 b"/libx32/ld-linux-x32.so.2": 3, b"/lib/ld-linux-aarch64.so.1": 3,
                 b"/lib64/ld64.so.2": 3}
_KNOWN_LIBS = {b"libc.so.6": 3, b"libm.so.6": 3, b"libc.so.5": 2, b"libm.so.5": 2}
_LIB_TYPES = {"libc4": 0, "libc5": 2, "libc6": 3, "glibc2": 3}

_PH64, _PH32 = struct.Struct("<IIQQQQQQ"), struct.Struct("<IIIIIIII")

EM_386, EM_PPC64, EM_X86_64, EM_AARCH64 = 3, 21, 62, 183
_TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}


def _machine_flags(machine: str, e_machine: int, elf64: bool) -> int | None:
    """ldconfig's per-architecture rule: the flags a library of this machine and class always
    gets (0: the generic ELF/libc5/libc6 guess), or None when ldconfig skips it."""
    if machine == "x86_64":
        if e_machine == EM_X86_64:
            return (ldformat.FLAG_X8664_LIB64 if elf64 else ldformat.FLAG_X8664_LIBX32) | 3
        if e_machine == EM_386 and not elf64:
            return 0
        return None
    if machine == "aarch64":
        return ldformat.FLAG_AARCH64_LIB64 | 3 if e_machine == EM_AARCH64 and elf64 else None
    if machine == "ppc64le":
        return ldformat.FLAG_POWERPC_LIB64 | 3 if e_machine == EM_PPC64 and elf64 else None
    return 0


# -- the ELF reader ---------------------------------------------------------------------------

def _pread(fd: int, n: int, off: int) -> bytes:
    if off < 0 or n <= 0:
        return b""
    return os.pread(fd, n, off)


def _cstring(fd: int, off: int, size: int, head: bytes = b"") -> bytes | None:
    if not 0 <= off < size:
        return None
    if off < len(head):  # most strings are in the first pages, read already
        end = head.find(b"\0", off, off + MAX_NAME + 1)
        if end >= 0:
            return head[off:end]
    data = _pread(fd, min(256, size - off), off)
    end = data.find(b"\0")
    if end < 0:
        data = _pread(fd, min(MAX_NAME + 1, size - off), off)
        end = data.find(b"\0")
        if end < 0:
            return None
    return data[:end]


def read_elf(fd: int, size: int, machine: str) -> tuple[int, bytes | None] | None:
    """(flags, SONAME or None) of the shared library open on `fd`, or None when ldconfig would
    skip it (not ELF, not a shared object, another machine, no dynamic section)."""
    head = _pread(fd, 16384, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[5] != 1:  # little-endian only
        return None
    elf64 = head[4] == 2
    if not elf64 and head[4] != 1:
        return None
    e_type, e_machine = struct.unpack_from("<HH", head, 16)
    base_flag = _machine_flags(machine, e_machine, elf64)
    if base_flag is None or e_type != 3:  # ET_DYN
        return None
    if elf64:
        if len(head) < 64:
            return None
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        ph = _PH64
    else:
        (phoff,) = struct.unpack_from("<I", head, 28)
        phentsize, phnum = struct.unpack_from("<HH", head, 42)
        ph = _PH32
    if phnum > MAX_PHNUM or phoff >= size:
        return None
    phentsize = ph.size  # ldconfig steps by its own struct size, whatever e_phentsize says
    need = phoff + phnum * phentsize
    table = head[phoff:need] if need <= len(head) else _pread(fd, phnum * phentsize, phoff)
    if len(table) < phnum * phentsize:
        return None
    flag = ldformat.FLAG_ELF
    dyn_off = dyn_size = 0
    loads = []
    for f in ph.iter_unpack(table):
        p_type = f[0]
        if elf64:
            p_offset, p_vaddr, p_filesz = f[2], f[3], f[5]
        else:
            p_offset, p_vaddr, p_filesz = f[1], f[2], f[4]
        if p_type == 2:  # PT_DYNAMIC
            dyn_off, dyn_size = p_offset, p_filesz
        elif p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 3:  # PT_INTERP
            interp = _cstring(fd, p_offset, size, head)
            if interp is None:
                return None
            if interp in _INTERPRETERS:
                flag = _INTERPRETERS[interp]
    if dyn_size == 0 or dyn_off >= size:
        return None
    width = 8 if elf64 else 4
    n = min(max(dyn_size, 2 * width), MAX_DYN * 2 * width)
    dyn = head[dyn_off:dyn_off + n] if dyn_off + n <= len(head) else _pread(fd, n, dyn_off)
    words = memoryview(dyn[:len(dyn) - len(dyn) % (2 * width)]).cast("Q" if elf64 else "I").tolist()
    dtags, dvals = words[0::2], words[1::2]
    if 0 in dtags:
        del dtags[dtags.index(0):]
    if 5 not in dtags:  # DT_STRTAB: a virtual address; the PT_LOAD holding it gives the offset
        return None
    val = dvals[dtags.index(5)]
    load = 0
    for vaddr, offset, filesz in loads:
        if vaddr <= val < vaddr + filesz:
            load = vaddr - offset
            break
    strtab = val - load
    if not 0 <= strtab <= size:
        return None
    soname = None
    if base_flag and dtags.count(14) == 1:
        # The architecture fixes the flags, so DT_NEEDED cannot change them, and with one
        # DT_SONAME which entry ldconfig stops at does not matter.
        soname = _cstring(fd, strtab + dvals[dtags.index(14)], size, head)
        if soname is None:
            return None
        return base_flag, soname
    for tag, val in zip(dtags, dvals):  # dvals may be longer (cut at DT_NULL)
        if tag == 1 and flag == ldformat.FLAG_ELF:  # DT_NEEDED
            name = _cstring(fd, strtab + val, size, head)
            if name is None:
                return None
            if name in _KNOWN_LIBS:
                flag = _KNOWN_LIBS[name]
        elif tag == 14:  # DT_SONAME
            name = _cstring(fd, strtab + val, size, head)
            if name is None:
                return None
            soname = name
        if soname is not None and flag != ldformat.FLAG_ELF:
            break
    return (base_flag if base_flag else flag), soname


# -- paths inside the root --------------------------------------------------------------------

def _reopen(fd: int, flags: int) -> int:
    """A readable fd on the object the O_PATH `fd` holds: the same inode, whatever its name
    points at by now."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def _open_dir(root: Root, path: str) -> int | None:
    try:
        pfd = root.lookup(path)
    except OSError:
        return None
    try:
        if not stat.S_ISDIR(os.fstat(pfd).st_mode):
            return None
        return _reopen(pfd, _O_READ | os.O_DIRECTORY)
    except OSError:
        return None
    finally:
        os.close(pfd)


def _read_regular(root: Root, path: str, limit: int) -> bytes | None:
    """The first `limit` bytes of the regular file at `path` (in the root), or None."""
    try:
        pfd = root.lookup(path)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            return None
        fd = _reopen(pfd, _O_READ)
    except OSError:
        return None
    finally:
        os.close(pfd)
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
            dfd = _open_dir(root, base or "/")
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


# -- ldconfig's directory list ----------------------------------------------------------------

class _Dir:
    __slots__ = ("path", "flag", "hwcaps")

    def __init__(self, path: str, flag: int, hwcaps: str | None):
        self.path, self.flag, self.hwcaps = path, flag, hwcaps


class Scan:
    """One cache build: the directory list, then the libraries in it."""

    def __init__(self, root: Root, machine: str | None = None):
        self.root = root
        self.machine = machine or os.uname().machine
        self.dirs: list[_Dir] = []
        self.seen: set[tuple[int, int]] = set()
        self.hwcaps_seen: list[bytes] = []
        self.hwcaps_names: set[bytes] = set()
        self.conf_files = 0
        self.files = 0
        self.libraries = 0
        self.paths_seen: set[str] = set()
        self.conf_lines = 0
        self.conf_bytes = 0
        self.budget = [MAX_FILES, MAX_LOOKUPS]

    # ld.so.conf ----------------------------------------------------------------------
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
        self.dirs.append(_Dir(path, flag, None))
        self._add_hwcaps(path, flag)

    def _add_hwcaps(self, path: str, flag: int) -> None:
        _spend_lookup(self.budget)
        dfd = _open_dir(self.root, path + "/glibc-hwcaps")
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
            self.dirs.append(_Dir(sub, flag, name))

    def parse_conf(self, path: str, stack: tuple = ()) -> None:
        if len(stack) >= MAX_INCLUDE_DEPTH or path in stack:
            return
        self.conf_files += 1
        if self.conf_files > MAX_CONF_FILES:
            raise HookError(f"the image's ld.so.conf includes more than {MAX_CONF_FILES} files")
        data = _read_regular(self.root, path, MAX_CONF_BYTES + 1)
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

    def system_dirs(self) -> list[str]:
        triplet = _TRIPLETS.get(self.machine)
        if triplet and any(self.root.exists(f"{d}/{triplet}/libc.so.6") for d in ("/lib", "/usr/lib")):
            return [f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib"]
        extra = {"x86_64": "x32", "aarch64": "ilp32"}.get(self.machine)
        out = []
        for top in ("/lib", "/usr/lib"):
            out += [top, top + "64"] + ([top + extra] if extra else [])
        return out

    # the libraries -------------------------------------------------------------------
    def search(self, d: _Dir, memo: dict) -> list[ldformat.Entry]:
        dfd = _open_dir(self.root, d.path)
        if dfd is None:
            return []
        try:
            with os.scandir(dfd) as it:
                listing = []
                for e in it:
                    self.files += 1
                    if self.files > MAX_FILES:
                        raise HookError(f"the image's library directories hold more than {MAX_FILES} entries")
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
                fd = _reopen(pfd, _O_READ)
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
        for d in directories:
            if d.startswith("/"):
                self.add_dir(d)
        self.parse_conf(conf)
        for d in self.system_dirs():
            self.add_dir(d)
        memo: dict = {}
        out: list[ldformat.Entry] = []
        for entry in self.dirs:
            out += self.search(entry, memo)
        return ldformat.sort_entries(out)


def old_format_wanted(root: Root) -> bool:
    """Whether the image's ldconfig writes the old+new layout (glibc < 2.32): what its current
    cache is, or else whether its libc defines a symbol version of 2.32 or later."""
    head = _read_regular(root, "/etc/ld.so.cache", 32)
    if head:
        if head.startswith(ldformat.OLD_MAGIC):
            return True
        if head.startswith(ldformat.NEW_MAGIC):
            return False
    for d in ("/lib/" + _TRIPLETS.get(os.uname().machine, "-"), "/usr/lib/" + _TRIPLETS.get(os.uname().machine, "-"),
              "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        data = _read_regular(root, d + "/libc.so.6", 8 << 20)
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
          old_format: bool | None = None, machine: str | None = None) -> tuple[bytes, int]:
    """The cache bytes and the number of entries."""
    scan = Scan(root, machine)
    entries = scan.entries(directories)
    if old_format is None:
        old_format = old_format_wanted(root)
    return ldformat.build(entries, hwcaps_seen=scan.hwcaps_seen, generator=generator,
                          old_format=old_format), len(entries)


def write(root: Root, data: bytes) -> None:
    """Replace the container's /etc/ld.so.cache with `data`, atomically, through an fd on /etc
    resolved inside the root."""
    try:
        etc = root.lookup("/etc")
    except OSError as e:
        raise HookError(f"cannot write the container's ld.so.cache: /etc: {e.strerror}") from None
    try:
        if not stat.S_ISDIR(os.fstat(etc).st_mode):
            raise HookError("cannot write the container's ld.so.cache: /etc is not a directory")
        tmp = f".ld.so.cache.nvhook-{os.getpid()}"
        with root.as_owner():
            for _ in range(2):
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o644, dir_fd=etc)
                    break
                except FileExistsError:  # left by a killed run with our pid: ours to remove
                    os.unlink(tmp, dir_fd=etc)
            else:
                raise HookError("cannot write the container's ld.so.cache: temporary file keeps reappearing")
        try:
            try:
                os.fchmod(fd, 0o644)  # the umask does not decide what every user may read
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            _replace(etc, tmp)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=etc)
            except OSError:
                pass
            raise
    except OSError as e:
        raise HookError(f"cannot write the container's /etc/ld.so.cache: {e.strerror or e}") from None
    finally:
        os.close(etc)


def _replace(etc: int, tmp: str) -> None:
    """Put `tmp` in place of ld.so.cache atomically. An existing file (or link) is swapped
    with RENAME_EXCHANGE and then removed under the temporary name: a plain rename over an
    existing file makes ext4 start writing the new data back at once (its replace-by-rename
    heuristic), which costs milliseconds on a busy disk; the swap does not. Anything else
    (nothing there, a filesystem without the swap) gets a plain rename."""
    try:
        st = os.stat("ld.so.cache", dir_fd=etc, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        try:
            sandbox.renameat2(etc, tmp, etc, "ld.so.cache", sandbox.RENAME_EXCHANGE)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOENT, errno.EXDEV):
                raise
        else:
            os.unlink(tmp, dir_fd=etc)  # the old cache now has the temporary name
            return
    os.rename(tmp, "ld.so.cache", src_dir_fd=etc, dst_dir_fd=etc)


def update(root: Root, directories: list[str], log) -> str:
    """Build and write the container's cache; logs `ldcache.written`. Returns "written"."""
    t0 = time.perf_counter()
    data, n = build(root, directories)
    t1 = time.perf_counter()
    write(root, data)
    log.info("ldcache.written", entries=n, bytes=len(data), directories=directories,
             build_ms=round((t1 - t0) * 1000, 2), write_ms=round((time.perf_counter() - t1) * 1000, 2))
    return "written"

