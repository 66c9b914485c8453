"""The start-path bundle (nvhook/base/modbundle.py): nvhook's modules served from one file, and
every way it must step aside (a changed source, a file someone else could write, a planted
link, garbage, another Python) with imports that still work. Each case runs a fresh interpreter
under -IS, as the launcher does, on a copy of the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nvhook
from nvhook.base import modbundle

PKG = Path(nvhook.__path__[0])
REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import nvhook
from nvhook.base import modbundle
finder = modbundle.install(nvhook.__path__[0])
import nvhook.start.hook, nvhook.start.pipeline, nvhook.apply.child, nvhook.observe.host.discover
names = [n for n in sys.modules if n.startswith("nvhook.") and n not in ("nvhook.base", "nvhook.base.modbundle")]
print(json.dumps({"installed": finder is not None,
                  "bundled": sorted(n for n in names if isinstance(sys.modules[n].__spec__.loader, modbundle.Finder)),
                  "usual": sorted(n for n in names if not isinstance(sys.modules[n].__spec__.loader, modbundle.Finder)),
                  "file": nvhook.start.hook.__file__}))
"""


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    lib = tmp_path / "lib"
    shutil.copytree(PKG, lib / "nvhook", symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    return lib


def probe(lib: Path, python: str = sys.executable) -> dict:
    p = subprocess.run([python, "-IS", "-c", PROBE, str(lib)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_modules_come_from_the_bundle(lib):
    path, n = modbundle.write(str(lib / "nvhook"))
    assert path == str(lib / "nvhook" / "__pycache__" / f"modbundle.{sys.implementation.cache_tag}.bundle")
    assert n > 40 and oct(os.stat(path).st_mode & 0o777) == "0o644"
    r = probe(lib)
    assert r["installed"] and r["usual"] == []
    assert {"nvhook.start.hook", "nvhook.start.pipeline", "nvhook.apply.child", "nvhook.base.sandbox"} <= set(r["bundled"])
    assert r["file"] == str(lib / "nvhook" / "start" / "hook.py")


def test_without_a_bundle_the_usual_imports(lib):
    r = probe(lib)
    assert not r["installed"] and r["bundled"] == [] and "nvhook.start.hook" in r["usual"]


def test_a_changed_source_is_imported_the_usual_way(lib):
    modbundle.write(str(lib / "nvhook"))
    with open(lib / "nvhook" / "start" / "pipeline.py", "a") as f:
        f.write("\nCHANGED = True\n")
    r = probe(lib)
    assert "nvhook.start.pipeline" in r["usual"] and "nvhook.start.hook" in r["bundled"]


@pytest.mark.parametrize("spoil", ["group-writable", "other-owner", "symlink", "garbage", "truncated",
                                   "other-python"])
def test_a_bundle_it_cannot_trust_is_not_used(lib, tmp_path, spoil):
    path, _ = modbundle.write(str(lib / "nvhook"))
    data = Path(path).read_bytes()
    if spoil == "group-writable":
        os.chmod(path, 0o664)
    elif spoil == "other-owner":
        os.chown(path, 12345, 12345)
    elif spoil == "symlink":  # a bundle planted elsewhere and linked in: never followed
        elsewhere = tmp_path / "elsewhere.bundle"
        os.rename(path, elsewhere)
        os.symlink(elsewhere, path)
    elif spoil == "garbage":
        Path(path).write_bytes(b"NVHOOK-BUNDLE-1\n" + b"\xff" * 64)
    elif spoil == "truncated":
        Path(path).write_bytes(data[: len(data) // 2])
    elif spoil == "other-python":
        Path(path).write_bytes(data.replace(sys.implementation.cache_tag.encode(), b"cpython-0"))
    r = probe(lib)
    assert not r["installed"] and r["bundled"] == [] and "nvhook.start.hook" in r["usual"], spoil


def _other_python() -> str | None:
    """An interpreter nvhook supports of another version than this one (pyenv's builds, the
    system's python3), or None."""
    import glob

    for cand in [*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))), "/usr/bin/python3"]:
        try:
            p = subprocess.run([cand, "-c", "import sys; print(sys.version_info >= (3, 9), sys.implementation.cache_tag)"],
                               capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if p.returncode == 0 and p.stdout.split() and p.stdout.split()[0] == "True" \
                and p.stdout.split()[1] != sys.implementation.cache_tag:
            return cand
    return None


def test_each_python_reads_only_its_own_bundle(lib):
    """nvhook runs on the host's python3, 3.9 to 3.13 (docs/python-versions.md), and a host's
    python3 changes version with the distribution: each Python writes the bundle named by its
    cache tag and reads only that one; another Python's bundle under this Python's name (its
    code compiled for another interpreter) is never used, the imports stay the usual ones."""
    other = _other_python()
    if other is None:
        pytest.skip("no second Python (3.9 or later) on this machine")
    theirs = subprocess.run([other, "-IS", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import nvhook;"
                             "from nvhook.base import modbundle; print(modbundle.write(nvhook.__path__[0])[0])",
                             str(lib)], capture_output=True, text=True, timeout=120)
    assert theirs.returncode == 0, theirs.stderr
    theirs_path = Path(theirs.stdout.strip())
    ours_path = Path(modbundle.write(str(lib / "nvhook"))[0])
    assert theirs_path.parent == ours_path.parent and theirs_path != ours_path
    # side by side, each Python serves the modules from its own
    assert probe(lib)["installed"] and probe(lib, other)["installed"]
    assert probe(lib)["usual"] == [] and probe(lib, other)["usual"] == []
    # the other Python's bundle where this one looks: refused (magic number and cache tag)
    os.replace(theirs_path, ours_path)
    r = probe(lib)
    assert not r["installed"] and r["bundled"] == [] and r["usual"], r
    assert modbundle.status(str(lib / "nvhook"))["reason"] == "written by another Python"


def test_tracebacks_name_the_source(lib):
    modbundle.write(str(lib / "nvhook"))
    code = (f"import sys; sys.path.insert(0, {str(lib)!r}); import nvhook; from nvhook.base import modbundle;"
            "modbundle.install(nvhook.__path__[0]); from nvhook.base import jsonfast; jsonfast.loads(b'{')")
    p = subprocess.run([sys.executable, "-IS", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert f'File "{lib / "nvhook" / "base" / "jsonfast.py"}"' in p.stderr


def test_bundled_code_is_lean_and_keeps_what_users_see(lib):
    """The bundle leaves out docstrings and the runtime import of __future__ (less to
    unmarshal on every start) but keeps what anyone sees: the annotations' deferred
    evaluation, the source's line numbers in tracebacks, and the CLI's help text (click reads
    it from docstrings)."""
    modbundle.write(str(lib / "nvhook"))
    setup = (f"import sys; sys.path.insert(0, {str(lib)!r}); import nvhook; from nvhook.base import modbundle;"
             "f = modbundle.install(nvhook.__path__[0]);")
    code = setup + (
        "from nvhook.apply import child; from nvhook.start import pipeline;"
        "print(repr(child.__doc__), repr(child.run_plan.__doc__), repr(pipeline.decide.__doc__),"
        "     '__future__' in sys.modules, 'annotations' in vars(pipeline),"
        "     pipeline.decide.__annotations__['return'],"
        "     all(isinstance(m.__spec__.loader, modbundle.Finder) for m in (child, pipeline)));"
        "child.run_plan(None, None, 0)")
    p = subprocess.run([sys.executable, "-IS", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["None", "None", "None", "False", "False", "Decision", "True"], p.stderr
    # the traceback points at the source line that failed, as without the bundle
    src = (lib / "nvhook" / "apply" / "child.py").read_text().splitlines()
    line = next(i for i, t in enumerate(src, 1) if 'container = plan["container"]' in t)
    assert f'File "{lib / "nvhook" / "apply" / "child.py"}", line {line}, in run_plan' in p.stderr
    # the CLI's module keeps its docstrings (with site: click is there)
    code = setup + "from nvhook.commands import cli; print(type(cli.__spec__.loader).__name__, bool(cli.cli.help))"
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["Finder", "True"], p.stderr


def test_the_launcher_uses_it_in_hook_mode(tmp_path):
    """The installed launcher, in hook mode for a container that asks for no GPU, imports
    nvhook's modules through the bundle's finder (python -v names each module's loader)."""
    launcher = Path(sys.executable).with_name("nvhook")
    # this checkout's current sources, in the package the launcher imports (the venv's)
    w = subprocess.run([sys.executable, "-I", "-m", "nvhook.base.modbundle"], capture_output=True, text=True,
                       timeout=60)
    assert w.returncode == 0 and w.stdout.startswith("wrote "), w.stderr
    b = tmp_path / "bundle"
    (b / "rootfs").mkdir(parents=True)
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                               "process": {"env": ["PATH=/bin"]}}))
    conf = tmp_path / "hook.toml"
    conf.write_text(f'log_file = ""\ncache_dir = "{tmp_path / "cache"}"\n[daemon]\nmode = "off"\n')
    state = json.dumps({"ociVersion": "1.0.2", "id": "sp", "status": "created", "pid": os.getpid(),
                        "bundle": str(b)})
    p = subprocess.run([sys.executable, "-v", "-IS", str(launcher), "--config", str(conf), "prestart"], input=state,
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = [ln for ln in p.stderr.splitlines() if ln.startswith("import 'nvhook.")]
    assert any(ln.startswith("import 'nvhook.start.hook' # <nvhook.base.modbundle.Finder") for ln in loaded), loaded
    assert not [ln for ln in loaded if "Finder" not in ln and "'nvhook.base'" not in ln
                and "'nvhook.base.modbundle'" not in ln], loaded


def test_write_never_changes_a_file_linked_in_at_the_tmp_name(lib, tmp_path, monkeypatch):
    """Someone who can write __pycache__ swaps the new file for a link between its write and
    its chmod: the mode goes to the file written (fchmod), never to the link's target."""
    victim = tmp_path / "victim"
    victim.write_text("secret")
    os.chmod(victim, 0o600)
    bundle = modbundle.bundle_path(str(lib / "nvhook"))
    tmp = f"{os.path.dirname(bundle)}/.{os.path.basename(bundle)}.nvhook-{os.getpid()}"  # base.files' temp name
    real_fsync = os.fsync

    def fsync_then_swap(fd: int) -> None:
        real_fsync(fd)
        os.rename(tmp, tmp + ".moved")
        os.symlink(victim, tmp)

    monkeypatch.setattr(modbundle.os, "fsync", fsync_then_swap)
    modbundle.write(str(lib / "nvhook"))
    assert oct(os.stat(victim).st_mode & 0o777) == "0o600"


def _blob(path: str, name: str) -> tuple[int, int]:
    """(file offset, length) of module `name`'s code in the bundle at `path`."""
    import marshal

    data = Path(path).read_bytes()
    head = len(modbundle.HEAD) + 8
    n = int.from_bytes(data[len(modbundle.HEAD):head], "little")
    entry = marshal.loads(data[head:head + n])["modules"][name]
    return head + n + entry[4], entry[5]


def test_a_corrupt_module_in_the_bundle_is_imported_the_usual_way(lib):
    """A bundle of the right size whose bytes for one module are damaged (a bad disk block):
    that module from its source, never a failed hook."""
    path, _ = modbundle.write(str(lib / "nvhook"))
    off, length = _blob(path, "nvhook.start.pipeline")
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\xff" * length)
    r = probe(lib)
    assert r["installed"] and "nvhook.start.pipeline" in r["usual"], r


def test_the_finder_reads_only_its_own_file(lib, tmp_path):
    """Should the finder's descriptor number ever name another file (closed and reused, dup2'd
    over), code is never read from that file: the module comes from its source."""
    path, _ = modbundle.write(str(lib / "nvhook"))
    off, length = _blob(path, "nvhook.start.pipeline")
    import marshal

    flag = tmp_path / "pwned"
    evil = marshal.dumps(compile(f"open({str(flag)!r}, 'w').close()", "evil", "exec"))
    assert len(evil) <= length
    other = bytearray(Path(path).read_bytes())
    other[off:off + length] = evil + b"\0" * (length - len(evil))
    (tmp_path / "other").write_bytes(bytes(other))
    code = (f"import os, sys; sys.path.insert(0, {str(lib)!r}); import nvhook; from nvhook.base import modbundle\n"
            "f = modbundle.install(nvhook.__path__[0]); assert f is not None\n"
            f"fd = os.open({str(tmp_path / 'other')!r}, os.O_RDONLY); os.dup2(fd, f.fd)\n"
            "import nvhook.start.pipeline; print(type(nvhook.start.pipeline.__spec__.loader).__name__)")
    p = subprocess.run([sys.executable, "-IS", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not flag.exists()
    assert p.stdout.strip() != "Finder"


def test_a_source_changed_while_the_bundle_is_written_is_not_served_stale(lib, monkeypatch):
    """A source edited (or upgraded) between write()'s read of it and its stat: the bundle
    must not record the new time and size beside the old code, which every start would then
    run instead of the file on disk."""
    import builtins

    target = str(lib / "nvhook" / "start" / "pipeline.py")

    class ChangedAfterRead:  # the file as write() opens it; the source changes once it is read
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def read(self):
            data = self.f.read()
            if self.f.name == target:
                with builtins.open(target, "a") as g:
                    g.write("\nCHANGED = True\n")
            return data

    monkeypatch.setattr(modbundle, "open", lambda path, mode: ChangedAfterRead(builtins.open(path, mode)),
                        raising=False)
    modbundle.write(str(lib / "nvhook"))
    r = probe(lib)
    assert "nvhook.start.pipeline" in r["usual"] and "nvhook.start.hook" in r["bundled"], r


def test_status_says_whether_starts_use_it(lib):
    """What `nvhook doctor` reports: missing, current, stale (which modules), unusable (why)."""
    pkg = str(lib / "nvhook")
    assert modbundle.status(pkg)["state"] == "missing"
    path, n = modbundle.write(pkg)
    st = modbundle.status(pkg)
    assert st == {"bundle": path, "state": "current", "modules": n, "stale": []}
    with open(lib / "nvhook" / "commands" / "render.py", "a") as f:
        f.write("\n# edited\n")
    st = modbundle.status(pkg)
    assert st["state"] == "stale" and st["stale"] == ["nvhook.commands.render"]
    os.chmod(path, 0o666)
    st = modbundle.status(pkg)
    assert st["state"] == "unusable" and st["reason"] == "not a file only its owner (root or this user) can write"


def test_setup_writes_and_uninstall_removes_it():
    """`nvhook setup` (prefix /) writes the installation's bundle, --dry-run says so and
    writes nothing, --uninstall removes it."""
    from nvhook.commands import setup as setup_mod

    path = modbundle.bundle_path(str(PKG))
    if os.path.exists(path):
        os.unlink(path)
    assert setup_mod._bundle(uninstall=False, dry_run=True) == {"path": path, "action": "created"}
    assert not os.path.exists(path)
    assert setup_mod._bundle(uninstall=False, dry_run=False) == {"path": path, "action": "created"}
    assert modbundle.status(str(PKG))["state"] == "current"
    assert setup_mod._bundle(uninstall=False, dry_run=False)["action"] == "replaced"
    assert setup_mod._bundle(uninstall=True, dry_run=False) == {"path": path, "action": "removed"}
    assert not os.path.exists(path)
    assert setup_mod._bundle(uninstall=True, dry_run=False) == {"path": path, "action": "absent"}
