"""Code-shape figures of the repository, measured with `ast` (issue 17's review figures).

    python scripts/code_metrics.py [--json]

Prints, per top-level package, the number of functions and the median and longest function
length (lines from `def` to the last line of the body, nested functions counted on their own),
which of slora_core's modules slora_core/engine.py imports (at any depth of the file), the
import cycles among the repository's modules (every import statement counts, function-level and
`if TYPE_CHECKING:` ones included, as an import-graph reader would draw them), and the folders
holding the most Python files.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("slora_core", "slora_kernels", "services", "bench")
GRAPH_PACKAGES = (*PACKAGES, "devtools")


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(qualified-ish name, line count) of every function and method in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno or node.lineno
            out.append((f"{path.relative_to(ROOT)}:{node.name}", end - node.lineno + 1))
    return out


def package_figures(package: str) -> dict[str, object]:
    lengths: list[tuple[str, int]] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_pb2" in path.name:
            continue  # generated code
        lengths += function_lengths(path)
    if not lengths:
        return {"functions": 0}
    longest = max(lengths, key=lambda item: item[1])
    return {"functions": len(lengths),
            "median_lines": statistics.median(n for _, n in lengths),
            "max_lines": longest[1], "longest": longest[0]}


def core_modules() -> list[str]:
    """slora_core's top-level modules and subpackages."""
    core = ROOT / "slora_core"
    names = [p.stem for p in core.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in core.iterdir() if (p / "__init__.py").exists()]
    return sorted(names)


def core_imports(path: Path) -> list[str]:
    """The slora_core modules (top level) a file imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "slora_core" and len(parts) > 1:
                found.add(parts[1])
    return sorted(found)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for the repository's own (not generated) modules."""
    out: dict[str, Path] = {}
    for package in GRAPH_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules a file imports anywhere in it (`from p import m` counts as p.m)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_cycles() -> list[list[str]]:
    """The strongly connected components (two or more modules) of the import graph."""
    known = module_files()
    graph = {m: imported_modules(p, known) - {m} for m, p in known.items()}
    cycles = []
    for component in _components(graph):
        if len(component) > 1:
            cycles.append(sorted(component))
    return sorted(cycles)


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (module graphs are deep enough to hit recursion limits)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


def largest_folders(top: int = 5) -> list[tuple[str, int]]:
    """The folders holding the most Python files (generated and migration files not counted)."""
    counts: dict[str, int] = {}
    for path in module_files().values():
        if "migrations" in path.parts:
            continue
        folder = str(path.parent.relative_to(ROOT))
        counts[folder] = counts.get(folder, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    engine = ROOT / "slora_core" / "engine.py"
    packages = {p: package_figures(p) for p in PACKAGES if (ROOT / p).is_dir()}
    imports = core_imports(engine)
    lines = len(engine.read_text().splitlines())
    cycles, folders = import_cycles(), largest_folders()
    if args.json:
        print(json.dumps({"packages": packages, "core_modules": len(core_modules()),
                          "engine_core_imports": imports, "engine_lines": lines,
                          "import_cycles": cycles, "largest_folders": folders}, indent=1))
        return
    for name, f in packages.items():
        print(f"{name:12s} functions {f['functions']:5d}  median {f.get('median_lines')} lines"
              f"  max {f.get('max_lines')} ({f.get('longest')})")
    print(f"slora_core/engine.py ({lines} lines) imports {len(imports)} of slora_core's "
          f"{len(core_modules())} modules: {', '.join(imports)}")
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print(f"  {' <-> '.join(cycle)}")
    print("largest folders: " + ", ".join(f"{f} ({n} files)" for f, n in folders))


if __name__ == "__main__":
    main()
