"""The sole-adapter merge's device time at Llama-2-7B shapes (slora_kernels.weight_merge), by part.

One adapter over every module slice of 32 layers (attention only, as bench.serving's, or all
seven modules), rank 16 or 64, deltas 1% or 10% the spread of the weights (fp16): the merge
(CHECK and its count's sync, ADD, the kept values trimmed) and the restore (SUBTRACT, the kept
values scattered back), timed whole with a sync at each end, and the CHECK and ADD launches
alone over all slices without syncs; beside the bytes floor at copy bandwidth (the merge reads
the weights twice and writes them once, the restore reads and writes them once) and the
exceptions kept. The restore is checked bit for bit against the weights before the merge.

    python -m bench.merge_time --out bench/results/merge-time-h200.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from bench.kernels_timing import DEVICE, copy_bandwidth_gbs
from bench.run_record import add_row, run_record
from slora_kernels.weight_merge import ADD, SUBTRACT, check_round_trip, merge_delta, warm_up

HIDDEN, INTER, LAYERS = 4096, 11008, 32
ATTN = ((HIDDEN, HIDDEN),) * 4  # q, k, v, o: (rows, in_features)
ALL7 = ATTN + ((INTER, HIDDEN),) * 2 + ((HIDDEN, INTER),)  # + gate, up, down
CASES = (("attn", 16, 0.01), ("attn", 16, 0.1), ("all7", 16, 0.01), ("all7", 64, 0.01))


def _slices(modules: tuple[tuple[int, int], ...], layers: int, rank: int, rel: float,
            gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(w, a, b) a module slice, weights ~N(0, 0.02) and B @ A ~ rel of that spread."""
    out = []
    std = (rel * 0.02 / rank**0.5) ** 0.5
    for _ in range(layers):
        for rows, k in modules:
            w = (torch.randn(rows, k, generator=gen, device=DEVICE) * 0.02).half()
            a = (torch.randn(rank, k, generator=gen, device=DEVICE) * std).half()
            b = (torch.randn(rows, rank, generator=gen, device=DEVICE) * std).half()
            out.append((w, a, b))
    return out


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_case(modules: str, rank: int, rel: float, layers: int, copy_gbs: float,
             gen: torch.Generator) -> dict[str, Any]:
    slices = _slices(ATTN if modules == "attn" else ALL7, layers, rank, rel, gen)
    weights = sum(w.numel() for w, _, _ in slices)
    before = [w.clone() for w, _, _ in slices] if DEVICE != "cuda" or layers <= 2 else None
    sums = [int(w.view(torch.int16).to(torch.int64).sum()) for w, _, _ in slices]
    _sync()
    t0 = time.perf_counter()
    kept = []
    for w, a, b in slices:
        positions, values, count = check_round_trip(w, a, b, 1.0, capacity=w.numel() // 8)
        n = int(count)
        if n > w.numel() // 8:
            raise RuntimeError(f"{n} exceptions pass the budget: pick smaller deltas")
        merge_delta(w, a, b, 1.0, ADD)
        kept.append((positions[:n].clone(), values[:n].clone()))
    _sync()
    merge_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for (w, a, b), (positions, values) in zip(slices, kept, strict=True):
        merge_delta(w, a, b, 1.0, SUBTRACT)
        w.view(-1)[positions.long()] = values
    _sync()
    restore_s = time.perf_counter() - t0
    exact = all(int(w.view(torch.int16).to(torch.int64).sum()) == s
                for (w, _, _), s in zip(slices, sums, strict=True))
    if before is not None:
        exact = exact and all(torch.equal(w, w0) for (w, _, _), w0 in zip(slices, before,
                                                                          strict=True))
    # The launches alone, no syncs between slices: what the merge's syncs and trims add.
    _sync()
    t0 = time.perf_counter()
    for w, a, b in slices:
        check_round_trip(w, a, b, 1.0, capacity=w.numel() // 8)
    _sync()
    check_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for w, a, b in slices:
        merge_delta(w, a, b, 1.0, ADD)
    _sync()
    add_s = time.perf_counter() - t0
    nbytes = weights * 2
    return {"modules": modules, "rank": rank, "delta_rel": rel, "layers": layers,
            "slices": len(slices), "weights": weights,
            "exceptions": sum(int(p.numel()) for p, _ in kept),
            "exception_fraction": sum(int(p.numel()) for p, _ in kept) / weights,
            "merge_ms": merge_s * 1e3, "restore_ms": restore_s * 1e3,
            "check_launches_ms": check_s * 1e3, "add_launches_ms": add_s * 1e3,
            "merge_floor_ms": 3 * nbytes / (copy_gbs * 1e6),
            "restore_floor_ms": 2 * nbytes / (copy_gbs * 1e6), "restored_exactly": exact}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--toy", action="store_true", help="CPU smoke sizes (2 layers of 128)")
    args = ap.parse_args(argv)
    global HIDDEN, INTER, ATTN, ALL7
    layers = LAYERS
    if args.toy:
        HIDDEN, INTER, layers = 128, 256, 2
        ATTN = ((HIDDEN, HIDDEN),) * 4
        ALL7 = ATTN + ((INTER, HIDDEN),) * 2 + ((HIDDEN, INTER),)
    copy = copy_bandwidth_gbs(1 << 30 if DEVICE == "cuda" else 1 << 20)
    warm_up(torch.float16, 64, torch.device(DEVICE))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[dict[str, Any]] = []
    result = {**run_record(["bench.merge_time", *(argv or sys.argv[1:])]), "dtype": "float16",
              "copy_gbs": copy, "method": "host wall time between device syncs, one run a "
              "case; floors at the faster copy bandwidth", "rows": rows}
    for modules, rank, rel in CASES:
        add_row(args.out, result, rows,
                run_case(modules, rank, rel, layers, max(copy.values()), gen), len(CASES),
                digits=3)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
