"""Plots of committed benchmark results (matplotlib PNG next to each JSON).

    python -m bench.plot bench/results/serving-h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def runs_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every replayed run (they carry a 'label') found in any scenario."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "label" in node and "output_tok_per_s" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(results)
    return found


def plot(path: Path) -> Path:
    results = json.loads(path.read_text())
    runs = runs_of(results)
    if not runs:
        raise SystemExit(f"{path}: no runs with a label and a throughput")
    labels = [r["label"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(labels, [r["output_tok_per_s"] for r in runs], color="tab:blue")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput")
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
        ax2.plot(labels, [r["tpot_s"].get(q, float("nan")) * 1e3 for r in runs], style,
                 label=f"TPOT {q}")
    ax2.set_ylabel("ms per output token")
    ax2.set_title("time per output token")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{path.name}: {results.get('hardware', '')}")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
