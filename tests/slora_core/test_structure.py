"""The engine's shape (issue 36): no import circle among slora_core's modules (a circle makes
every module in it load with the others, and hides which one is the lower layer), and
engine.py small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "slora_core"
MAX_ENGINE_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """slora_core modules `path` imports, at any depth of its code (a function-level import
    closes a circle as surely as a top-level one)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c`: c may be a module (a.b.c) or a name in a.b.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in package.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_circle_in_slora_core() -> None:
    graph = import_graph()
    assert "slora_core.engine" in graph and "slora_core.tp.engine" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_circle(tmp_path: Path) -> None:
    """The check can fail: the circle engine.py, tp/launch.py and tp/engine.py once made
    (engine.py's import of the launcher inside a function) is found."""
    graph = {"slora_core.engine": {"slora_core.tp.launch"},
             "slora_core.tp.launch": {"slora_core.tp.engine"},
             "slora_core.tp.engine": {"slora_core.engine"},
             "slora_core.tp": set()}
    assert find_cycle(graph) == ["slora_core.engine", "slora_core.tp.launch",
                                 "slora_core.tp.engine", "slora_core.engine"]
    src = tmp_path / "probe.py"
    src.write_text("def f():\n    from slora_core.tp.launch import start_tp_engine\n")
    assert _imports(src, set(import_graph())) == {"slora_core.tp.launch"}


def test_engine_py_is_at_most_300_lines() -> None:
    lines = len((PACKAGE / "engine.py").read_text().splitlines())
    assert lines <= MAX_ENGINE_LINES, f"slora_core/engine.py has {lines} lines"
