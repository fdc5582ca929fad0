"""What every result JSON records about its run: the commit and the hardware."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import tokenizers
import torch

V = TypeVar("V")


def commit_id() -> str:
    """The commit measured: $SLORA_COMMIT (the device copy of the tree has no .git), else git."""
    found = os.environ.get("SLORA_COMMIT")
    if found:
        return found
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host_cpu() -> dict[str, object]:
    """The host's CPU: its model and how many cores this process may use. Host-bound figures
    (a service's hops, a step's launch) move with it: on two H100 hosts the same stack took
    73 and 107-111 s to become routable, and late admission won on one and not the other."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return {"model": model, "cores": len(os.sched_getaffinity(0))}


def run_record(argv: list[str]) -> dict[str, object]:
    """command, commit and hardware of this process, for the top of a result JSON."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"command": " ".join(["python", "-m", *argv]), "commit": commit_id(),
            "hardware": gpu, "host_cpu": host_cpu(), "torch": torch.__version__,
            # The worker front's text window runs in Rust from tokenizers 0.22 on.
            "tokenizers": tokenizers.__version__, "python": sys.version.split()[0]}


def save_rows(out: str | None, result: dict[str, Any], rows: list[Any], total: int) -> None:
    """Write `result` (holding `rows`) to `out`, marked complete once all `total` rows are in:
    called after every row, so a run cut short keeps the rows it finished."""
    if out:
        with open(out, "w") as f:
            json.dump({**result, "complete": len(rows) == total}, f, indent=1)


def add_row(out: str | None, result: dict[str, Any], rows: list[Any], row: dict[str, Any],
            total: int, digits: int = 2) -> None:
    """Append `row` to `rows`, print it as one JSON line (floats to `digits`), and save the
    result so far (`save_rows`)."""
    rows.append(row)
    print(json.dumps({k: round(v, digits) if isinstance(v, float) else v
                      for k, v in row.items()}), flush=True)
    save_rows(out, result, rows, total)


def run_interleaved(out: str | None, result: dict[str, Any], variants: Sequence[V], repeats: int,
                    run: Callable[[V], dict[str, Any]], say: Callable[[dict[str, Any]], str],
                    ) -> None:
    """Every variant once a repeat, `repeats` times: each `run(variant)` becomes a row of
    `result["rows"]` (with its repeat), saved as it comes (`add_row`), and `say(row)` printed."""
    rows: list[dict[str, Any]] = []
    result["rows"] = rows
    for r in range(repeats):
        for variant in variants:
            row = {"repeat": r + 1, **run(variant)}
            add_row(out, result, rows, row, len(variants) * repeats)
            print(say(row), flush=True)
