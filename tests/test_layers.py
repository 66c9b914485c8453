"""The layers contract: data flows observe -> decide -> act, the front doors sit above them, and
the imports say so.

Every import in every module (function-level ones included: most of nvhook imports lazily to
keep the container-start path light) is resolved to a module name and checked against what
its layer may use. A crossing fails here with the file, the line and the rule it breaks.

The folders answer "what runs as root on every container start?": nvhook/start (and the layers
under it) is that code, and it never imports a command module, click or structlog;
nvhook/commands is what an operator types, and may use everything. No two modules import each
other, directly or through others (a cycle hides which one is the lower layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "nvhook"

# layer -> what it may import from nvhook. The modules at the top (nvhook.entry, the program's
# router between start and commands) may import every layer.
LAYERS = ("nvhook.base", "nvhook.observe", "nvhook.decide", "nvhook.apply")
ALLOWED = {
    "base": ("nvhook.base",),
    "observe": ("nvhook.base", "nvhook.observe"),
    "decide": ("nvhook.base", "nvhook.decide"),
    # The act layer takes the plan and edits as data; their types are the one thing of decide's
    # it may name.
    "apply": ("nvhook.base", "nvhook.apply", "nvhook.decide.types", "nvhook.decide.edits"),
    # The container-start path: the layers, and `nvhook` itself (only the package: __version__).
    "start": ("nvhook", *LAYERS, "nvhook.start"),
    "commands": ("nvhook", *LAYERS, "nvhook.start", "nvhook.commands"),
}
# Third-party modules a layer must never import, lazily or not: the CLI's own, whose imports
# cost more than a whole hook run.
CLI_ONLY = ("click", "structlog")
FORBIDDEN = {layer: CLI_ONLY for layer in ("base", "observe", "decide", "apply", "start")}


def _module_name(path: Path) -> str:
    return _module_name_in(PKG, path)


def _module_name_in(pkg: Path, path: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    return _imports_in(PKG, path)


def _imports_in(pkg: Path, path: Path):
    """(line, module or name imported) for every import; names outside nvhook as written."""
    mod = _module_name_in(pkg, path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("nvhook"):
                yield node.lineno, target
                continue
            # `from . import x` names submodules: check each of them.
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_module = (pkg.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (pkg.parent / Path(*sub.split("."))).is_dir()
                yield node.lineno, sub if is_module else target


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_respects_its_layer(path):
    rel = path.relative_to(PKG)
    layer = rel.parts[0] if len(rel.parts) > 1 else None
    if layer not in ALLOWED:
        return  # entry points
    allowed = ALLOWED[layer]
    imports = list(_imports(path))
    bad = [f"{rel}:{line}: imports {name}" for line, name in imports
           if _ours(name) and not any(name == a or a != "nvhook" and name.startswith(a + ".") for a in allowed)]
    assert not bad, f"layer {layer!r} may import only {allowed}:\n" + "\n".join(bad)
    forbidden = FORBIDDEN.get(layer, ())
    bad = [f"{rel}:{line}: imports {name}" for line, name in imports
           if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not bad, f"layer {layer!r} runs on the container-start path and may not import {forbidden}:\n" + \
        "\n".join(bad)


def _ours(name: str) -> bool:
    return name == "nvhook" or name.startswith("nvhook.")


def _graph(pkg: Path) -> dict:
    """module -> the nvhook modules it imports (a name inside a module, `from .x import f`,
    counts as the module)."""
    def existing(name: str) -> str:
        while name:
            p = pkg.parent / Path(*name.split("."))
            if p.with_suffix(".py").exists() or (p / "__init__.py").exists():
                return name
            name = name.rpartition(".")[0]
        return name

    graph: dict = {}
    for path in sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts):
        mod = _module_name_in(pkg, path)
        graph[mod] = {existing(n) for _, n in _imports_in(pkg, path) if _ours(n)} - {mod, ""}
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_imports_itself_through_others():
    cycles = _cycles(_graph(PKG))
    assert not cycles, "import cycles (break each by moving what both need below them):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """tmp_path/nvhook holding `files` (path under the package: text), for the checkers to
    be shown a violation."""
    fake = tmp_path / "nvhook"
    for rel, text in files.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    return fake


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """Three modules in a ring, one of the imports lazy and one only for type checkers."""
    fake = _fake_package(tmp_path, {"__init__.py": "", "start/__init__.py": "", "start/a.py": "from .b import f\n",
                                     "start/b.py": "def f():\n    from . import c\n",
                                     "start/c.py": "if False:\n    from .a import f\n",
                                     "start/d.py": "from . import a\n"})
    assert _cycles(_graph(fake)) == [["nvhook.start.a", "nvhook.start.b", "nvhook.start.c"]]


def test_the_checker_sees_the_cli_on_the_start_path(tmp_path, monkeypatch):
    fake = _fake_package(tmp_path, {"commands/cli.py": "", "start/hook.py": "def f():\n    import structlog\n",
                                     "start/client.py": "def f():\n    from ..commands import cli\n"})
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with pytest.raises(AssertionError, match=r"start/hook.py:2: imports structlog"):
        test_module_respects_its_layer(fake / "start" / "hook.py")
    with pytest.raises(AssertionError, match=r"start/client.py:2: imports nvhook.commands.cli"):
        test_module_respects_its_layer(fake / "start" / "client.py")


def test_the_checker_sees_a_crossing(tmp_path, monkeypatch):
    """The contract test must be able to fail: a decide module importing observe is caught."""
    fake = _fake_package(tmp_path, {"observe/oci.py": "", "decide/bad.py": "def f():\n    from ..observe import oci\n"})
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with pytest.raises(AssertionError, match=r"decide/bad.py:2: imports nvhook.observe.oci"):
        test_module_respects_its_layer(fake / "decide" / "bad.py")
