#!/usr/bin/env bash
# A device call on one H200, steps one after another (nothing shares the GPU with a timed
# step), in the order STEPS names them (default: grid engine-async engine-sync sweep async churn
# suites):
#   grid    the decode LoRA kernel grid (bench.kernels_lora_grid), the paths decode graphs
#           replay and the tiles before 015e6a7 beside them (GRID_VARIANTS=all: every variant;
#           earlier grids hold the rejected ones);
#   engine-async / engine-sync
#           one adapter vs base and the decode-step floor (bench.serving overhead,floor),
#           with and without asynchronous steps; engine-overlap the same with LoRA on a
#           second stream (asynchronous steps); since bdfe3de the sole-adapter merge is on by
#           default, so their one-adapter runs merge, with the unmerged arm beside them;
#   rows    row-kernel tiles beside the tile kernels on the decode cases (kernels_lora_rows);
#   floor-rows / floor-tiles  the decode-step floor alone (asynchronous steps), decode graphs
#           with the row kernels' graph / on 16-row tiles only;
#   churn-rows  the churn step (alpha 1.0) with the row kernels on, under bench.stall_probe
#           (the runs cut at 34c58cb and fd01907 looked stalled: a cold-cache warm-up);
#   one-adapter  decode LoRA with one adapter on every row: shrink and expand times apart,
#           K splits and tiles on the short list (bench.lora_one_adapter);
#   gcpause the start-up heap frozen vs not, interleaved (bench.serving gcpause);
#   gemm    the base decode GEMMs under cuBLAS and cuBLASLt (bench.gemm_decode);
#   engine-pdl / engine-nopdl  engine-async with the LoRA expands launched as programmatic
#           dependents of their shrinks (EngineConfig.lora_pdl) and without;
#   engine-dot16  engine-async with the expands' 16-bit dot (EngineConfig.lora_expand_dot_16bit,
#           off by default; time it beside engine-async in one call);
#   tests   pytest on the GPU (TESTS, default tests/kernels/test_lora_pdl.py);
#   engine-merge  one adapter vs base with merge_sole_adapter, the unmerged arm beside it (5
#           interleaved repeats);
#   floor-async  engine-async's decode-step floor alone (its JSON without the one-adapter runs,
#           which engine-merge measures);
#   merge-time  the merge's and the restore's device time at 7B shapes (bench.merge_time);
#   sweep   decode attention tiles at the default and the previous default (block_n 128);
#   core    the engine core's host time per decode step, asynchronous steps (profile_core);
#   async   the floor scenario's step: graph replay vs engine steps, sync and async, profiled
#           (bench.profile_async);
#   lora-sweep  decode LoRA tiles and K splits at r16 B64 U64, B256 U256, B64 U1;
#   churn   2,000 adapters under churn at 50 arrivals/s, alpha 1.0 and 0.5;
#   grid-split  part of the grid: the one-adapter cells and a few full lists, the 16-bit expand
#           dot and the one-wave K split (LoraTiles.wave_split) beside the default;
#   numerics  bench.gpu_numerics against HF + peft (NUMERICS_ARGS, e.g. --modes all_graphs);
#   suites  gpu_suite parts A and B side by side (every GPU-only and compiled kernel test, and
#           numerics; 7B/8B shapes against HF under churn).
# Run from the root of a clean export with the wheels in .whl:
#   SLORA_COMMIT=<sha> OUT=$OUT BUDGET_S=560 STEPS="grid suites" bash bench/h200_one.sh
set -u
# shellcheck source=bench/round_lib.sh
source "$(dirname "$0")/round_lib.sh"
export OMP_NUM_THREADS=8
suites() {
    OMP_NUM_THREADS=4 PART_LIMIT_S="${SUITE_PART_S:-290}" OUT="$OUT/A" SHARDS=6 \
        NUMERICS_ARGS="--modes eager all_graphs all_graphs_async" bash bench/gpu_suite.sh A &
    OMP_NUM_THREADS=4 PART_LIMIT_S="${SUITE_PART_S:-290}" OUT="$OUT/B" bash bench/gpu_suite.sh B &
    wait
}
for s in ${STEPS:-grid engine-async engine-sync sweep async churn suites}; do
    case $s in
        grid) step grid "${GRID_S:-150}" python3 -m bench.kernels_lora_grid \
            --variants "${GRID_VARIANTS:-graph_capture_split,graph_short_list,exact,rows,graph_dot16,short_list_dot16,\
graph_before,short_list_before}" --out "$OUT/lora-grid-h200.json" ;;
        grid-split) step grid-split "${GRID_S:-150}" python3 -m bench.kernels_lora_grid \
            --cases "8x1x1,8x16x1,8x64x1,8x256x1,16x1x1,16x16x1,16x64x1,16x256x1,64x1x1,\
64x16x1,64x64x1,64x256x1,16x16x16,16x64x64,16x256x256,64x16x16,64x256x256" \
            --variants "graph_capture_split,graph_short_list,graph_dot16,short_list_dot16,\
graph_wave,short_list_wave,graph_wave_dot16,short_list_wave_dot16" \
            --out "$OUT/lora-grid-split-h200.json" ;;
        numerics) step numerics "${NUMERICS_S:-200}" python3 -m bench.gpu_numerics \
            ${NUMERICS_ARGS:-} --budget-s "$((${NUMERICS_S:-200} - 30))" \
            --out "$OUT/gpu-numerics-h200.json" ;;
        engine-async) engine_arm async --async-steps ;;
        engine-sync) engine_arm sync --no-async-steps ;;
        floor-async) engine_arm async --async-steps --scenarios floor ;;
        engine-overlap) engine_arm overlap --async-steps --lora-overlap ;;
        engine-pdl) engine_arm pdl --async-steps --lora-pdl ;;
        engine-dot16) engine_arm dot16 --async-steps --lora-expand-dot-16bit ;;
        engine-nopdl) engine_arm nopdl --async-steps --no-lora-pdl ;;
        tests) step tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider \
            ${TESTS:-tests/kernels/test_lora_pdl.py} ;;
        rows) step rows "${ROWS_S:-200}" python3 -m bench.kernels_lora_rows \
            --out "$OUT/lora-rows-h200.json" ;;
        floor-rows) engine_floor rows --lora-row-kernels ;;
        one-adapter) step one-adapter "${ONE_S:-150}" python3 -m bench.lora_one_adapter \
            --out "$OUT/lora-one-adapter-h200.json" ;;
        churn-rows) step churn-rows "${CHURN_S:-200}" python3 -m bench.stall_probe \
            --log "$OUT/churn-rows-run.log" --probe "$OUT/churn-rows-probe.log" \
            --limit $((${CHURN_S:-200} - 15)) -- python3 -m bench.serving \
            --shape llama2-7b --device cuda --dtype float16 --arena-gb 32 --scenarios churn \
            --many-adapters 2000 --churn-requests 600 --churn-rate 50 --churn-alphas 1.0 \
            --lora-row-kernels --out "$OUT/churn-rows-h200.json" ;;
        floor-tiles) engine_floor tiles --no-lora-row-kernels ;;
        gcpause) step gcpause "${GCPAUSE_S:-150}" python3 -m bench.serving --shape llama2-7b \
            --device cuda --dtype float16 --scenarios gcpause --requests 100 \
            --overhead-repeats 3 --out "$OUT/gc-pauses-h200.json" ;;
        gemm) step gemm "${GEMM_S:-120}" python3 -m bench.gemm_decode \
            --out "$OUT/gemm-decode-h200.json" ;;
        engine-merge) OVERHEAD_REPEATS=${OVERHEAD_REPEATS:-5} engine_arm merge --async-steps \
            --merge-sole-adapter --scenarios overhead ;;
        merge-time) step merge-time "${MERGE_TIME_S:-120}" python3 -m bench.merge_time \
            --out "$OUT/merge-time-h200.json" ;;
        sweep) step sweep "${SWEEP_S:-90}" python3 -m bench.decode_sweep --parts attention_wide \
            --attn-wide 128,4,2 --out "$OUT/decode-sweep-wide-h200.json" ;;
        core) step core "${CORE_S:-150}" python3 -m bench.profile_core --shape llama2-7b \
            --device cuda --dtype float16 --batch 64 --context 512 --adapters --async-steps \
            --out "$OUT/profile-core-async-h200.json" ;;
        async) step async "${ASYNC_S:-240}" python3 -m bench.profile_async --shape llama2-7b \
            --out "$OUT/profile-async-h200.json" ;;
        lora-sweep) step lora-sweep "${LORA_SWEEP_S:-200}" python3 -m bench.decode_sweep \
            --parts lora --lora-cases 16,64,64 16,256,256 16,64,1 \
            --out "$OUT/decode-sweep-lora-h200.json" ;;
        churn) step churn "${CHURN_S:-200}" python3 -m bench.serving --shape llama2-7b \
            --device cuda --dtype float16 --arena-gb 32 --scenarios churn --many-adapters 2000 \
            --churn-requests 600 --churn-rate 50 --churn-alphas "${CHURN_ALPHAS:-1.0,0.5}" \
            --out "$OUT/churn-rate50-h200.json" ;;
        suites) step suites "${SUITES_S:-330}" bash -c "$(declare -f suites); OUT=$OUT suites" ;;
        *) echo "$s skipped: no such step" >>"$STEP_LOG" ;;
    esac
done
pack
