"""bench.kernel_compile_cost's variants give every constexpr its kernel declares (one left out
would compile as an int32 argument: the bench broke that way when kernels gained PDL and
balance switches), and compile_cost refuses a variant that does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kernel_compile_cost as cost

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("make", [cost.variants, cost.float32_variants])
def test_every_variant_names_each_constexpr_of_its_kernel(make: object) -> None:
    assert callable(make)
    for v in make():
        declared = set(cost.constexpr_names(v.fn))
        assert "MAX_RANK" in declared
        assert declared == set(v.consts), (v.name, declared ^ set(v.consts))


def test_a_missing_constexpr_is_refused_by_name() -> None:
    v = cost.variants()[0]
    partial = {k: c for k, c in v.consts.items() if k != "TILE"}
    with pytest.raises(ValueError, match="no value for constexpr TILE"):
        cost.compile_cost(v.fn, partial, v.num_warps)


def test_the_tile_kernels_are_listed_at_the_stages_decode_graphs_launch() -> None:
    from slora_core.cuda_graphs import GRAPH_TILE_STAGES
    from slora_kernels.lora import DECODE_TILES

    stages = {v.name: v.num_stages for v in cost.variants() if v.name.startswith("tile_")}
    assert stages["tile_shrink_r64"] == stages["tile_expand_r16"] == DECODE_TILES.num_stages
    assert stages["tile_shrink_r64_one_stage"] == GRAPH_TILE_STAGES
    assert stages["tile_expand_r16_one_stage_forked"] == GRAPH_TILE_STAGES


def test_the_prefill_tile_kernels_are_listed_at_their_stages_and_at_two() -> None:
    from slora_core.cuda_graphs import TWO_STAGES
    from slora_kernels.lora import PREFILL_STAGES, PREFILL_TILES

    listed = {v.name: v for v in cost.variants() if v.name.startswith("prefill_")}
    assert listed["prefill_shrink_r64"].num_stages == PREFILL_STAGES != TWO_STAGES
    assert listed["prefill_expand_r16_two_stages"].num_stages == TWO_STAGES
    assert listed["prefill_shrink_r16"].consts["BLOCK_M"] == PREFILL_TILES.shrink_block_m


def test_a_launch_is_specialized_as_triton_specializes_it() -> None:
    """Unit strides compile as the constant 1 and multiples of 16 as divisible: with them the
    pipeliner stages the shrink's loads (cp.async), so one and two stages compile apart, as
    they launch on the GPU. Without them both compiled to the same PTX. (A child process: the
    kernels compile only when imported with TRITON_INTERPRET=0.)"""
    v = {x.name: x for x in cost.variants()}
    shrink = v["tile_shrink_r16"]
    consts, divisible = cost.launch_specialization(shrink.fn, shrink.consts)
    assert consts["stride_xk"] == 1 and "stride_xk" not in divisible
    assert {"K", "stride_xm", "stride_bm"} <= divisible and "table_stride" not in divisible
    child = ("import json; from bench import kernel_compile_cost as c\n"
             "v = {x.name: x for x in c.variants()}\n"
             "print(json.dumps([v[n].cost()['ptx'].count('cp.async') for n in "
             "('tile_shrink_r16', 'tile_shrink_r16_one_stage')]))")
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    two, one = json.loads(res.stdout.strip().splitlines()[-1])
    assert two > 0 and one == 0


@pytest.mark.parametrize(("registers", "warps", "shared", "programs"), [
    (64, 4, 0, 8),  # 2,048 registers a warp: 32 warps of 64 by registers
    (162, 4, 36864, 3),  # 168 a thread as allocated: 5,376 a warp, 12 warps
    (255, 4, 0, 2),
    (32, 4, 0, 16),  # bound by 64 warps a multiprocessor
    (32, 1, 0, 32),  # bound by 32 programs a multiprocessor
    (40, 4, 100 * 1024, 2),  # bound by 228 KB of shared memory, 1 KB reserved a program
])
def test_programs_per_multiprocessor_follow_sm90s_limits(registers: int, warps: int,
                                                         shared: int, programs: int) -> None:
    assert cost.programs_per_sm(registers, warps, shared) == programs
