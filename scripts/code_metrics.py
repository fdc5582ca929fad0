"""Code-shape figures of the repository, measured with `ast` (issue 17's review figures).

    python scripts/code_metrics.py [--json]

Prints, per top-level package, the number of functions and the median and longest function
length (lines from `def` to the last line of the body, nested functions counted on their own),
and which of slora_core's modules slora_core/engine.py imports (at any depth of the file).
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("slora_core", "kernels", "services", "bench")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    engine = ROOT / "slora_core" / "engine.py"
    packages = {p: package_figures(p) for p in PACKAGES if (ROOT / p).is_dir()}
    imports = core_imports(engine)
    lines = len(engine.read_text().splitlines())
    if args.json:
        print(json.dumps({"packages": packages, "core_modules": len(core_modules()),
                          "engine_core_imports": imports, "engine_lines": lines}, indent=1))
        return
    for name, f in packages.items():
        print(f"{name:12s} functions {f['functions']:5d}  median {f.get('median_lines')} lines"
              f"  max {f.get('max_lines')} ({f.get('longest')})")
    print(f"slora_core/engine.py ({lines} lines) imports {len(imports)} of slora_core's "
          f"{len(core_modules())} modules: {', '.join(imports)}")


if __name__ == "__main__":
    main()
