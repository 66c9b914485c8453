"""The layers contract: data flows observe -> decide -> act, and the imports say so.

Every import in every module (function-level ones included: most of nvhook imports lazily to
keep the container-start path light) is resolved to a module name and checked against what
its layer may use. A crossing fails here with the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "nvhook"

# layer -> what it may import from nvhook. Entry points (main, cli, doctor, render, pipeline,
# and anything else at the top) may import every layer.
ALLOWED = {
    "base": ("nvhook.base",),
    "observe": ("nvhook.base", "nvhook.observe"),
    "decide": ("nvhook.base", "nvhook.decide"),
    # The act layer takes the plan and edits as data; their types are the one thing of decide's
    # it may name.
    "apply": ("nvhook.base", "nvhook.apply", "nvhook.decide.types", "nvhook.decide.edits"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    mod = _module_name(path)
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
                continue
            # `from . import x` names submodules: check each of them.
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_module = (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PKG.parent / Path(*sub.split("."))).is_dir()
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
    bad = [f"{rel}:{line}: imports {name}" for line, name in _imports(path)
           if name.startswith("nvhook") and not any(name == a or name.startswith(a + ".") for a in allowed)]
    assert not bad, f"layer {layer!r} may import only {allowed}:\n" + "\n".join(bad)


def test_the_checker_sees_a_crossing(tmp_path, monkeypatch):
    """The contract test must be able to fail: a decide module importing observe is caught."""
    fake = tmp_path / "nvhook"
    (fake / "decide").mkdir(parents=True)
    (fake / "observe").mkdir()
    (fake / "observe" / "oci.py").write_text("")
    (fake / "decide" / "bad.py").write_text("def f():\n    from ..observe import oci\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with pytest.raises(AssertionError, match=r"decide/bad.py:2: imports nvhook.observe.oci"):
        test_module_respects_its_layer(fake / "decide" / "bad.py")
