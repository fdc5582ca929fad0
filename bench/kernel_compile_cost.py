"""What compiling each decode LoRA kernel costs, ahead of time for an H100/H200 (sm_90), no GPU
needed: seconds, PTX size, registers a thread (what ptxas allocated, and any spill), shared
memory a program and the programs one multiprocessor holds at once, at the engine's rank
bounds.

A kernel variant met for the first time mid-serving compiles on the step's thread, and every
request waits for it; this shows which variants are expensive. Triton's bundled ptxas does
the work, so the figures hold for this machine's CPU (the device's differs). Each variant is
specialized as a 7B launch specializes it (`launch_ints`); runs before that compiled every
integer argument unspecialized (results up to kernel-compile-cost-440d206-cpu.json), where
the pipeline stages changed nothing in the PTX.

    python -m bench.kernel_compile_cost --out bench/results/kernel-compile-cost-cpu.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

os.environ.setdefault("TRITON_INTERPRET", "0")
# A fresh cache: a variant found in Triton's on-disk cache would time the cache, not ptxas.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-compile-cost-")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.run_record import run_record  # noqa: E402
from slora_kernels import lora_expand, lora_rows, lora_shrink  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
F16, F32, I64, I32 = "*fp16", "*fp32", "*i64", "*i32"
# Pointer arguments' element types; every other non-constexpr argument is an int32 scalar.
POINTERS = {
    "x_ptr": F16, "y_ptr": F16, "arena_ptr": F16, "buf_ptr": F32, "a_off_ptr": I64,
    "b_off_ptr": I64, "ranks_ptr": I32, "scales_ptr": F32, "slots_ptr": I32,
    "seg_starts_ptr": I32, "seg_lens_ptr": I32, "seg_slots_ptr": I32, "tile_segs_ptr": I32,
    "tile_m0_ptr": I32, "rows_ptr": I32,
    # The ride's fused expands (silu_mul_expand_triton, rotary_expand_triton).
    "s_ptr": F16, "b_ptr": F16, "cos_ptr": F16, "sin_ptr": F16,
}


# Triton specializes a launch's integer arguments on their values: one equal to 1 compiles as
# the constant 1 and one divisible by 16 as known to be (so a unit stride vectorizes loads and
# lets the pipeliner stage them: without it every tile kernel compiled to the same PTX at 1, 2
# or 3 stages). The values of a 7B decode step's qkv launch (64 rows, 16 tiles, K split 4,
# q/k/v 4,096 columns each, partial sums rank-bound wide) stand in for the engine's; pointers
# count as 16-byte aligned, as whole torch tensors are.
def launch_ints(rank: int) -> dict[str, int]:
    return {"mod0": 0, "mod1": 1, "mod2": 2, "num_mods": 3, "table_stride": 7, "split_k": 4,
            "num_tiles": 16, "n_tiles": 16, "K": 4096, "k_chunk": 1024, "stride_xm": 4096,
            "stride_xk": 1, "start0": 0, "start1": 4096, "start2": 8192, "size0": 4096,
            "size1": 4096, "size2": 4096, "stride_ym": 12288, "stride_yn": 1,
            "stride_bs": 64 * 3 * rank, "stride_bt": 3 * rank, "stride_bm": rank}


def launch_specialization(fn: Any, consts: dict[str, Any],
                          ) -> tuple[dict[str, Any], set[str]]:
    """The constexprs of a launch of `fn` with `consts` and `launch_ints` (integers equal to 1
    become constants) and the integer arguments Triton marks divisible by 16."""
    ints = launch_ints(int(consts.get("MAX_RANK", 16)))
    out, divisible = dict(consts), set()
    for name in fn.arg_names:
        value = ints.get(name)
        if name in consts or value is None:
            continue
        if value == 1:
            out[name] = 1
        elif value % 16 == 0:
            divisible.add(name)
    return out, divisible


def constexpr_names(fn: Any) -> list[str]:
    """The constexpr parameters a Triton kernel declares (compiled or interpreted alike)."""
    return [name for name, p in inspect.signature(fn.fn).parameters.items()
            if "constexpr" in str(p.annotation)]


class Variant(NamedTuple):
    """One compiled variant of a kernel: its constexprs and launch options."""

    name: str
    fn: Any
    consts: dict[str, Any]
    num_warps: int
    num_stages: int | None = None  # None: Triton's default, as the row kernels launch
    maxnreg: int | None = None  # registers a thread at most (Triton's `maxnreg` option)

    def cost(self, float32: bool = False) -> dict[str, Any]:
        return compile_cost(self.fn, self.consts, self.num_warps, float32=float32,
                            num_stages=self.num_stages, maxnreg=self.maxnreg)


def compile_cost(fn: Any, consts: dict[str, Any], num_warps: int, float32: bool = False,
                 num_stages: int | None = None, maxnreg: int | None = None) -> dict[str, Any]:
    """Compile one variant of `fn` for sm_90: seconds, PTX characters, registers a thread
    (`float32`: activations and arena in float32, as a float32 model runs them;
    `num_stages`: the launch's pipeline stages, None for Triton's default; `maxnreg`: its
    cap on registers a thread, None for none)."""
    missing = [n for n in constexpr_names(fn) if n not in consts]
    if missing:  # else each would compile as an int32 argument, and fail or mislead
        raise ValueError(f"{fn.fn.__name__}: no value for constexpr {', '.join(missing)}")
    consts, divisible = launch_specialization(fn, consts)
    pointers = POINTERS | ({k: F32 for k in ("x_ptr", "y_ptr", "arena_ptr")} if float32 else {})
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n in divisible or sig[n].startswith("*")]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                           for n in aligned})
    t0 = time.perf_counter()
    options: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(src, target=TARGET, options=options)
    seconds = time.perf_counter() - t0
    ptx = kernel.asm.get("ptx", "")
    regs = re.search(r"\.reg \.b32\s+%r<(\d+)>", ptx)
    usage = resource_usage(kernel.asm["cubin"])
    return {"seconds": seconds, "ptx_chars": len(ptx), "ptx": ptx,
            "ptx_b32_registers_declared": int(regs.group(1)) if regs else None,
            "shared_bytes": kernel.metadata.shared, **usage,
            "programs_per_sm": programs_per_sm(usage["registers"], num_warps,
                                               kernel.metadata.shared)}


# sm_90's limits a program's residency is counted against (CUDA occupancy calculator):
# registers are allocated per warp in units of 256, shared memory per program in units of
# 128 bytes plus 1 KB the system reserves, over 228 KB a multiprocessor.
SM90 = {"registers": 65536, "warps": 64, "programs": 32, "shared": 233472,
        "reserved_shared": 1024}


def resource_usage(cubin: bytes) -> dict[str, int]:
    """What ptxas allocated for the kernel in `cubin`, as Triton's bundled cuobjdump reads it:
    registers a thread, stack and local bytes (spills)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{text}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)),
            "local_bytes": int(found.group(3))}


def programs_per_sm(registers: int, num_warps: int, shared: int) -> int:
    """Programs of `num_warps` warps resident on one sm_90 multiprocessor at once."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90["registers"] // (per_warp * num_warps)
    by_warps = SM90["warps"] // num_warps
    by_shared = SM90["shared"] // (-(-shared // 128) * 128 + SM90["reserved_shared"])
    return min(by_registers, by_warps, by_shared, SM90["programs"])


def variants() -> list[Variant]:
    """The row and the tile kernels at rank bounds 16 and 64 with their default tiles
    (RowTiles(), DECODE_TILES), launched with programmatic dependent launch and rank-balanced
    row programs above rank 16; the row expand uncapped and with its register tile capped at
    4096 elements (RowTiles.expand_sub_tile, the default); the tile kernels at their tiles'
    two pipeline stages (as eager steps launch them) and at decode graphs' one
    (GRAPH_TILE_STAGES): in line on the short list, and forked (no PDL) past it; the 64-row
    tile kernels of prompt chunks and mixed steps (PREFILL_TILES) at their stages
    (PREFILL_STAGES) and at two, as before them, their expand over four column tiles a
    program (PREFILL_TILES.expand_cols) and, as before, over one."""
    from slora_core.cuda_graphs import GRAPH_TILE_STAGES, TWO_STAGES
    from slora_kernels.lora import DECODE_TILES, PREFILL_TILES

    rows = lora_rows.RowTiles()
    stages = DECODE_TILES.num_stages
    out: list[Variant] = []
    for bound in (16, 64):
        balanced = bound > 16
        out += [
            Variant(f"rows_shrink_r{bound}", lora_rows._rows_shrink_kernel,
             {"MAX_RANK": bound, "BLOCK_R": bound, "TILE": rows.tile,
              "LAUNCH_DEPENDENTS": True, "BALANCED": balanced}, rows.num_warps),
            Variant(f"rows_expand_r{bound}", lora_rows._rows_expand_kernel,
             {"MAX_RANK": bound, "BLOCK_R": bound, "BLOCK_N": rows.block_n,
              **lora_rows.expand_sub_tiles(rows.block_n, bound, 0), "USE_PDL": True,
              "BALANCED": balanced}, rows.num_warps),
            Variant(f"rows_expand_r{bound}_sub4096", lora_rows._rows_expand_kernel,
             {"MAX_RANK": bound, "BLOCK_R": bound, "BLOCK_N": rows.block_n,
              **lora_rows.expand_sub_tiles(rows.block_n, bound, 4096), "USE_PDL": True,
              "BALANCED": balanced}, rows.num_warps),
        ]
        shrink = {"MAX_RANK": bound, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_R": bound,
                  "BLOCK_K": 256, "RANK_BUCKETS": True, "GATHER_ROWS": False}
        expand = {"MAX_RANK": bound, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 256,
                  "BLOCK_R": bound, "RANK_BUCKETS": True, "GATHER_ROWS": False,
                  "EARLY_LOADS": False, "COLS": 1}
        for suffix, pdl, n in (("", True, stages), ("_one_stage", True, GRAPH_TILE_STAGES),
                               ("_one_stage_forked", False, GRAPH_TILE_STAGES)):
            out += [
                Variant(f"tile_shrink_r{bound}{suffix}", lora_shrink._lora_shrink_kernel,
                        {**shrink, "LAUNCH_DEPENDENTS": pdl}, 4, n),
                Variant(f"tile_expand_r{bound}{suffix}", lora_expand._lora_expand_kernel,
                        {**expand, "USE_PDL": pdl}, 4, n),
            ]
        # The forked one-stage pair with more programs resident (bench.lora_distinct_layer's
        # tiles_graph_s1_k128 and, until f979e18, tiles_graph_s1_reg*): a shrink K tile of
        # 128, registers capped at 168 or 128; and the expand as decode graphs' many-adapter
        # lists launch it, four 128-column tiles a program (LoraTiles.expand_cols).
        out.append(Variant(f"tile_expand_r{bound}_one_stage_forked_n128_cols4",
                           lora_expand._lora_expand_kernel,
                           {**expand, "BLOCK_N": 128, "USE_PDL": False, "COLS": 4}, 4,
                           GRAPH_TILE_STAGES))
        out.append(Variant(f"tile_shrink_r{bound}_one_stage_forked_k128",
                           lora_shrink._lora_shrink_kernel,
                           {**shrink, "BLOCK_K": 128, "LAUNCH_DEPENDENTS": False}, 4,
                           GRAPH_TILE_STAGES))
        for cap in (168, 128):
            out += [Variant(f"tile_shrink_r{bound}_one_stage_forked_reg{cap}",
                            lora_shrink._lora_shrink_kernel,
                            {**shrink, "LAUNCH_DEPENDENTS": False}, 4, GRAPH_TILE_STAGES, cap),
                    Variant(f"tile_expand_r{bound}_one_stage_forked_reg{cap}",
                            lora_expand._lora_expand_kernel,
                            {**expand, "USE_PDL": False}, 4, GRAPH_TILE_STAGES, cap)]
        p = PREFILL_TILES
        for suffix, n in (("", p.num_stages), ("_two_stages", TWO_STAGES)):
            out += [
                Variant(f"prefill_shrink_r{bound}{suffix}", lora_shrink._lora_shrink_kernel,
                        {**shrink, "BLOCK_M": p.shrink_block_m, "BLOCK_K": p.shrink_block_k,
                         "LAUNCH_DEPENDENTS": p.pdl}, p.num_warps, n),
                Variant(f"prefill_expand_r{bound}{suffix}", lora_expand._lora_expand_kernel,
                        {**expand, "BLOCK_M": p.expand_block_m, "BLOCK_N": p.expand_block_n,
                         "USE_PDL": p.pdl, "COLS": p.expand_cols}, p.num_warps, n),
            ]
        # The 64-row expand on one column tile a program, as before PREFILL_TILES took
        # several (bench.distinct_adapters' mixed_cols1, MixedGraphs.tile_overrides).
        out.append(Variant(f"prefill_expand_r{bound}_cols1", lora_expand._lora_expand_kernel,
                           {**expand, "BLOCK_M": p.expand_block_m, "BLOCK_N": p.expand_block_n,
                            "USE_PDL": p.pdl, "COLS": 1}, p.num_warps, p.num_stages))
    return out


def float32_variants() -> list[Variant]:
    """The tile kernels of a float32 model (exact dots) at rank bound 64, with the 16-bit
    models' tile table and with float32's own (slora_kernels.lora.*_TILES_F32)."""
    from slora_kernels import lora

    common = {"MAX_RANK": 64, "DOT_PRECISION": "ieee", "BLOCK_R": 64, "RANK_BUCKETS": True,
              "GATHER_ROWS": False}
    out: list[Variant] = []
    for name, tiles in (("decode_16bit_tiles", lora.DECODE_TILES),
                        ("decode_f32_tiles", lora.DECODE_TILES_F32),
                        ("prefill_16bit_tiles", lora.PREFILL_TILES),
                        ("prefill_f32_tiles", lora.PREFILL_TILES_F32)):
        out += [Variant(f"{name}_shrink", lora_shrink._lora_shrink_kernel,
                        {**common, "BLOCK_M": tiles.shrink_block_m,
                         "BLOCK_K": tiles.shrink_block_k, "LAUNCH_DEPENDENTS": False},
                        tiles.num_warps, tiles.num_stages),
                Variant(f"{name}_expand", lora_expand._lora_expand_kernel,
                        {**common, "BLOCK_M": tiles.expand_block_m,
                         "BLOCK_N": tiles.expand_block_n, "EARLY_LOADS": False, "COLS": 1,

                         "USE_PDL": False},
                        tiles.num_warps, tiles.num_stages)]
    return out


def threads_round(kernels: list[Variant], threads: int, float32: bool) -> dict[str, float]:
    """Compile `kernels` once one after another and once on `threads` threads, each round in a
    fresh Triton cache (so both compile): the wall seconds of each, as slora_core.precompile
    compiles a start-up's kernels (Triton's passes and ptxas run outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(k: Variant) -> float:
        return float(k.cost(float32)["seconds"])

    out: dict[str, float] = {}
    for name, workers in (("sequential_s", 1), ("threads_s", threads)):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-compile-cost-")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            out[name.replace("_s", "_sum_s")] = sum(pool.map(compile_one, kernels))
        out[name] = time.perf_counter() - t0
    out["ratio"] = out["threads_s"] / out["sequential_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--float32", action="store_true",
                    help="the tile kernels of a float32 model, at both tile tables")
    ap.add_argument("--threads", type=int, default=0,
                    help="instead: the variants compiled one after another, then on N threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        kernels = float32_variants() if args.float32 else variants()
        timing = threads_round(kernels, args.threads, args.float32)
        print(timing, flush=True)
        result = {**run_record(["bench.kernel_compile_cost", *(argv or sys.argv[1:])]),
                  "target": "cuda sm_90 (ahead of time, this machine's CPU)",
                  "triton": triton.__version__, "cpus": os.cpu_count(),
                  "kernels": [k.name for k in kernels], "threads": args.threads, **timing}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    rows: dict[str, Any] = {}
    for v in float32_variants() if args.float32 else variants():
        cost = v.cost(args.float32)
        del cost["ptx"]
        rows[v.name] = {"num_warps": v.num_warps, "num_stages": v.num_stages, **cost}
        print(f"{v.name}: {rows[v.name]}", flush=True)
    result = {**run_record(["bench.kernel_compile_cost", *(argv or sys.argv[1:])]),
              "target": "cuda sm_90 (ahead of time, this machine's CPU)",
              "triton": triton.__version__, "variants": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
