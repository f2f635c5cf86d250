"""textrl's modules import each other at module top only, and in layers: read from the source with
``ast``, so a cycle cannot hide behind an import inside a function and nothing needs importing."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "textrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The textrl modules an import statement loads: ``from textrl.games import express`` loads the
    module ``textrl.games.express``, ``from textrl.config import X`` loads ``textrl.config``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    found = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return found or ([base] if base in MODULES else [])


def imports(name: str) -> list[tuple[ast.Import | ast.ImportFrom, str | None, list[str]]]:
    """Every import statement of a module that loads a textrl module: (statement, the function or class
    it sits in or None at module level, the modules it loads)."""
    found = []

    def walk(node: ast.AST, scope: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (targets := imported(child, name)):
                found.append((child, scope, targets))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
            walk(child, inner)

    walk(ast.parse(MODULES[name].read_text(), str(MODULES[name])), None)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path that ends where it starts, or [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_every_textrl_import_is_at_module_top():
    hidden = [f"{MODULES[name].relative_to(PACKAGE.parent)}:{node.lineno} in {scope}: {ast.unparse(node)}"
              for name in MODULES for node, scope, _ in imports(name) if scope is not None]
    assert not hidden, "imports of textrl modules inside a function or class:\n" + "\n".join(hidden)


def test_textrl_modules_import_each_other_without_a_cycle():
    graph = {name: {target for _, _, targets in imports(name) for target in targets if target != name}
             for name in MODULES}
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle_and_accepts_layers():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
