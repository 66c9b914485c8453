"""nvhook's modules' code in one file, read by one finder: fewer system calls and less import
machinery on every container start.

Python imports a module through its path finder: a stat of the directory, the source's stat,
an open, fstat, read and close of the .pyc, its header checked, each step a few Python calls of
importlib's own. For the ~40 modules a GPU container's start imports (hook, apply child, and
the same in nvhookd's client) that is ~3 ms of CPU on our CI machines (an interleaved A/B of
real runc starts, docs/performance.md). This module writes every nvhook module's compiled code
into `nvhook/__pycache__/modbundle.<cache tag>.bundle` (`python -m nvhook.base.modbundle`, run
by `make venv`, the Debian package build and `nvhook setup`) and, in the launchers, puts a
finder first on sys.meta_path that serves those modules from it: one stat of the source (the
same staleness rule as a .pyc: mtime in seconds and size) and one pread per module.

Trust is that of a .pyc: the file is written by root next to the package and read only if it
is a regular file (O_NOFOLLOW) owned by root or by the reader, writable by no one else. A module
whose source changed since, or that the bundle lacks, is imported the usual way; so is
everything when the file is missing, foreign, of another Python, or unreadable, and every module
from the first whose code cannot be read back (damaged, or the descriptor no longer the file
checked: its identity is compared before each read): never an error.

Only `_imp`, `os`, `sys` and `marshal` are used (builtins, or loaded at interpreter start). No
`from __future__ import annotations` here (its import is what the bundle saves the others):
annotations naming what only type checkers import are strings.
"""

import _imp
import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing (nor types)
    import types
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec

HEAD = b"NVHOOK-BUNDLE-1\n"
_EXT = sys.modules["_frozen_importlib_external"]
_ModuleSpec = sys.modules["_frozen_importlib"].ModuleSpec
# Modules loaded before the finder exists (the launcher imports this one through them), and
# the package itself, whose resource reader (importlib.resources: nvhook/data) comes from its
# usual loader.
_NOT_BUNDLED = ("nvhook", "nvhook.base", "nvhook.base.modbundle", "nvhook.__main__")


def bundle_path(package_dir: str) -> str:
    return os.path.join(package_dir, "__pycache__", f"modbundle.{sys.implementation.cache_tag}.bundle")


class Finder:
    """A meta-path finder and loader for the modules in one bundle file (kept open: the apply
    child, forked, reads it too; pread has no shared offset)."""

    def __init__(self, fd: int, index: dict, base: int, package_dir: str, ident: tuple[int, int] = (0, 0)):
        self.fd = fd
        self.ident = ident  # (st_dev, st_ino) of the file opened: what self.fd must still be
        self.index = index  # name -> (is_package, source path in the package, mtime s, size, offset, length)
        self.base = base
        self.parent = os.path.dirname(package_dir)

    def find_spec(self, name: str, path: "Sequence[str] | None" = None,
                  target: "types.ModuleType | None" = None) -> "ModuleSpec | None":
        entry = self.index.get(name)
        if entry is None:
            return None
        is_pkg, _, mtime, size = entry[:4]
        source = self._source(name)
        try:
            st = os.stat(source)
        except OSError:
            return None
        if int(st.st_mtime) != mtime or st.st_size != size:
            return None  # changed since the bundle was written (a .pyc's rule): the usual import
        spec: ModuleSpec = _ModuleSpec(name, self, origin=source, is_package=is_pkg)
        if is_pkg:
            spec.submodule_search_locations = [os.path.dirname(source)]
        spec.has_location = True  # __file__ is the source: tracebacks show its lines
        return spec

    def _source(self, name: str) -> str:
        return f"{self.parent}/{self.index[name][1]}"

    def create_module(self, spec: object) -> None:
        return None

    def exec_module(self, module: "types.ModuleType") -> None:
        name = module.__name__
        code = self._code(name)
        if code is None:
            # Not the bundle it was, or damaged: this module from its source and every later one
            # the usual way (the finder steps aside), never a failed import.
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            loader = _EXT.SourceFileLoader(name, self._source(name))
            module.__loader__ = loader
            if module.__spec__ is not None:
                module.__spec__.loader = loader
            loader.exec_module(module)
            return
        exec(code, module.__dict__)

    def _code(self, name: str) -> "types.CodeType | None":
        offset, length = self.index[name][4:6]
        try:
            # The descriptor may no longer be the bundle (closed and its number reused, or
            # dup2'd over, e.g. by a child redirecting stdio): code is read only from the file
            # install() checked, never from whatever that number names now.
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) != self.ident:
                return None
            data = os.pread(self.fd, length, self.base + offset)
            if len(data) != length:
                return None
            code = marshal.loads(data)
        except (OSError, ValueError, EOFError, TypeError):
            return None
        if type(code) is not type(_fix.__code__):
            return None
        # as importlib does for a .pyc read elsewhere
        _imp._fix_co_filename(code, self._source(name))  # type: ignore[attr-defined]
        return code


def _fix() -> None:
    """Only its __code__'s type is used (the start path imports no `types`)."""


def _open(package_dir: str) -> tuple[int, dict, int, tuple[int, int]]:
    """(fd, index, where the code starts, (st_dev, st_ino)) of a bundle that may be used;
    ValueError (its reason) or OSError otherwise."""
    fd = os.open(bundle_path(package_dir), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if (not (st.st_mode & 0o170000 == 0o100000) or st.st_mode & 0o022
                or st.st_uid not in (0, os.geteuid())):
            raise ValueError("not a file only its owner (root or this user) can write")
        head = os.pread(fd, len(HEAD) + 8, 0)
        if not head.startswith(HEAD) or len(head) != len(HEAD) + 8:
            raise ValueError("not a bundle")
        n = int.from_bytes(head[len(HEAD):], "little")
        if not 0 < n <= st.st_size - len(HEAD) - 8:
            raise ValueError("index size")
        try:
            meta = marshal.loads(os.pread(fd, n, len(HEAD) + 8))
            if meta.get("magic") != _EXT.MAGIC_NUMBER or meta.get("cache_tag") != sys.implementation.cache_tag:
                raise ValueError("written by another Python")
            end = max((e[4] + e[5] for e in meta["modules"].values()), default=0)
        except (EOFError, TypeError, AttributeError, IndexError, KeyError, OverflowError) as e:
            raise ValueError(f"not a bundle ({type(e).__name__})") from None
        if len(HEAD) + 8 + n + end != st.st_size:
            raise ValueError("truncated or extended")
    except BaseException:
        os.close(fd)
        raise
    return fd, meta["modules"], len(HEAD) + 8 + n, (st.st_dev, st.st_ino)


def install(package_dir: str) -> "Finder | None":
    """Put the bundle's finder first on sys.meta_path; None (nothing changed) when there is no
    usable bundle."""
    if any(isinstance(f, Finder) for f in sys.meta_path):
        return None
    try:
        fd, index, base, ident = _open(package_dir)
    except (OSError, ValueError):
        return None
    finder = Finder(fd, index, base, os.path.abspath(package_dir), ident)
    sys.meta_path.insert(0, finder)
    return finder


def status(package_dir: str) -> dict:
    """For `nvhook doctor`: whether container starts get nvhook's modules from the bundle.
    {"bundle": path, "state": "current" | "stale" | "missing" | "unusable", "modules": n,
    "stale": [modules whose source changed since], "reason": why unusable}."""
    path = bundle_path(package_dir)
    try:
        fd, index, _, _ = _open(package_dir)
    except FileNotFoundError:
        return {"bundle": path, "state": "missing", "modules": 0, "stale": []}
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return {"bundle": path, "state": "unusable", "modules": 0, "stale": [], "reason": reason}
    os.close(fd)
    parent = os.path.dirname(os.path.abspath(package_dir))
    stale = []
    for name, entry in sorted(index.items()):
        try:
            st = os.stat(f"{parent}/{entry[1]}")
            if int(st.st_mtime) != entry[2] or st.st_size != entry[3]:
                stale.append(name)
        except OSError:
            stale.append(name)
    return {"bundle": path, "state": "stale" if stale else "current", "modules": len(index), "stale": stale}


def _compile(text: bytes, source: str) -> "types.CodeType":
    """The module's code as every start needs it, ~15% smaller than a .pyc's (and so that much
    less to unmarshal, the larger part of an import's cost): without docstrings, which only
    click's help text reads (modules that use click keep theirs), and without the runtime
    import that `from __future__ import annotations` costs (~0.1 ms: its effect is a compiler
    flag, kept). Line numbers are those of the source: tracebacks are unchanged."""
    import __future__

    import ast

    tree = ast.parse(text, source)
    flags = 0
    body = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
            continue
        body.append(node)
    tree.body = body
    if b"import click" not in text and b"from click" not in text:
        for scope in ast.walk(tree):
            if isinstance(scope, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = scope.body[0] if scope.body else None
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)):
                    scope.body = scope.body[1:] or [ast.copy_location(ast.Pass(), first)]
    code: types.CodeType = compile(tree, source, "exec", flags=flags, dont_inherit=True)
    return code


def write(package_dir: str) -> tuple[str, int]:
    """Compile every module of the package in `package_dir` into its bundle, atomically (a
    new file renamed over the old one). (path, number of modules)."""
    package_dir = os.path.abspath(package_dir)
    parent = os.path.dirname(package_dir)
    blobs: list[bytes] = []
    modules: dict = {}
    offset = 0
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            source = os.path.join(dirpath, fn)
            relpath = os.path.relpath(source, parent)
            rel = relpath[:-3].split(os.sep)
            is_pkg = rel[-1] == "__init__"
            name = ".".join(rel[:-1] if is_pkg else rel)
            if name in _NOT_BUNDLED:
                continue
            with open(source, "rb") as f:
                # The time and size before the read: a source changed while this runs is then
                # stale in the bundle (imported the usual way), never new-looking old code.
                st = os.fstat(f.fileno())
                text = f.read()
            blob = marshal.dumps(_compile(text, source))
            # The path relative to the package's parent: a package built in one place (the
            # Debian build's staging tree) is read in another.
            # Whole seconds, as a .pyc records them: a package archive (dpkg) keeps no more.
            modules[name] = (is_pkg, relpath, int(st.st_mtime), st.st_size, offset, len(blob))
            blobs.append(blob)
            offset += len(blob)
    meta = marshal.dumps({"magic": _EXT.MAGIC_NUMBER, "cache_tag": sys.implementation.cache_tag,
                          "modules": modules})
    path = bundle_path(package_dir)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    from .files import replace_file  # only here: install() is on every start, write() is not

    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_file(dir_fd, os.path.basename(path), HEAD + len(meta).to_bytes(8, "little") + meta + b"".join(blobs),
                     0o644, path)
    finally:
        os.close(dir_fd)
    return path, len(modules)


if __name__ == "__main__":
    # The package this file belongs to, as imported (an editable install's links not resolved).
    where, count = write(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(f"wrote {where}: {count} modules")
