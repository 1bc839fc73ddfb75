"""The project's import graph, read from the source (module-level and function-level imports
alike, and `importlib.import_module` of a literal name): wise_core at the ground, importing no package of the project but itself; the frameworks
never import each other; nothing imports the `wise` application; no circle of imports in any
package. The checker is shown to fail on a planted up-import and a planted circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wise", "wise_core", "wise_torch", "wise_jax", "wise_serve", "parity")
# package -> the project packages it may import (besides itself)
ALLOWED = {
    "wise_core": set(),
    "wise_torch": {"wise_core"},
    "wise_jax": {"wise_core"},
    "parity": {"wise_core", "wise_torch", "wise_jax"},
    "wise_serve": {"wise_core", "wise_torch", "wise_jax"},
    "wise": {"wise_core", "wise_torch", "wise_jax", "wise_serve", "parity"},
}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages under root."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def is_literal_import_module(node: ast.AST) -> bool:
    """`importlib.import_module("a.b")`: an import that a plain import statement would not show."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib" and len(node.args) >= 1
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source."""
    mods = modules(root)
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                               for alias in node.names)
            elif is_literal_import_module(node):
                targets.add(node.args[0].value)
        deps = set()
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def up_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs that cross to a package its package may not import."""
    bad = []
    for name, deps in graph.items():
        package = name.split(".")[0]
        bad += [(name, dep) for dep in sorted(deps)
                if dep.split(".")[0] != package and dep.split(".")[0] not in ALLOWED[package]]
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_project_imports_downward_only():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "wise_core.model_config" in graph["wise_torch.model"]
    assert up_imports(graph) == []


def test_no_package_has_a_circle_of_imports():
    assert circles(import_graph(ROOT)) == []


def test_the_checker_finds_a_planted_up_import_and_circle(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "wise_core" / "spec.py").write_text("def f():\n    from wise_torch import model\n")
    (tmp_path / "wise_torch" / "model.py").write_text("from wise_torch.kernels import k\n")
    (tmp_path / "wise_torch" / "kernels").mkdir()
    (tmp_path / "wise_torch" / "kernels" / "__init__.py").write_text("")
    (tmp_path / "wise_torch" / "kernels" / "k.py").write_text("from ..model import x\n")
    (tmp_path / "wise_jax" / "a.py").write_text("import importlib\nB = importlib.import_module('wise_jax.b')\n")
    (tmp_path / "wise_jax" / "b.py").write_text("from wise_jax.a import B\n")
    graph = import_graph(tmp_path)
    assert up_imports(graph) == [("wise_core.spec", "wise_torch.model")]
    assert sorted(circles(graph)) == [["wise_jax.a", "wise_jax.b"], ["wise_torch.kernels.k", "wise_torch.model"]]
