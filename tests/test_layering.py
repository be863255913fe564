"""The package's layering, read from its import statements (no imports are executed):

- no import cycles between modules (a function-level import counts too: it is still a dependency);
- `core/` imports no torch and nothing from engine/, models/, kernels/ or entrypoints/;
- `kernels/` imports nothing from models/, engine/ or entrypoints/;
- `models/` imports nothing from engine/ or entrypoints/ (the runner picks execution paths, the model
  does not);
- `engine/` and `sampling/` import nothing from entrypoints/;
- no module imports another module's `_private` name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tinyvllm

ROOT = Path(tinyvllm.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, names in _imports(path):
            for candidate in [f"{target}.{n}" for n in names] + [target]:
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
                    break
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _edges(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    return [f"{a} -> {b}" for a, deps in graph.items() for b in deps if a.startswith(src) and b.startswith(dst)]


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_layers_import_only_downwards():
    forbidden = [
        ("tinyvllm.core", "tinyvllm.engine"),
        ("tinyvllm.core", "tinyvllm.models"),
        ("tinyvllm.core", "tinyvllm.kernels"),
        ("tinyvllm.core", "tinyvllm.entrypoints"),
        ("tinyvllm.kernels", "tinyvllm.models"),
        ("tinyvllm.kernels", "tinyvllm.engine"),
        ("tinyvllm.kernels", "tinyvllm.entrypoints"),
        ("tinyvllm.models", "tinyvllm.engine"),
        ("tinyvllm.models", "tinyvllm.entrypoints"),
        ("tinyvllm.engine", "tinyvllm.entrypoints"),
        ("tinyvllm.sampling", "tinyvllm.entrypoints"),
        ("tinyvllm.sampling", "tinyvllm.engine"),
    ]
    graph = _graph()
    bad = [edge for src, dst in forbidden for edge in _edges(graph, src, dst)]
    assert not bad, bad


def test_core_imports_no_torch():
    bad = [
        str(p)
        for p in (ROOT / "core").rglob("*.py")
        for target, _ in _imports(p)
        if target == "torch" or target.startswith("torch.")
    ]
    assert not bad, bad


def test_no_cross_module_private_imports():
    bad = []
    for path in ROOT.rglob("*.py"):
        for target, names in _imports(path):
            if not target.startswith("tinyvllm"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private_module = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
            if private or private_module:
                bad.append(f"{_module_name(path)}: from {target} import {', '.join(names)}")
    assert not bad, bad
