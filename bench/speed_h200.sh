#!/usr/bin/env bash
# Issue 15 in one device call (~6 min): the decode LoRA variants on the GPU against float64,
# the decode LoRA grid (bench.kernels_lora_grid), adapter cold-load latency (bench.cold_load),
# and the churn / cold-vs-warm TTFT / disk-churn serving scenarios at Llama-2-7B shapes. Each
# step has its own time limit and writes its JSON under $OUT as it goes. STEPS picks steps
# (default tests,grid,cold,engine,serve); `engine` is one adapter vs base in 5 interleaved pairs
# and the batch-64 decode step against its bytes floor. Run from the repository root with SLORA_COMMIT set to the
# commit under test (the device copy has no .git).
set -o pipefail
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/speed-out}
STEPS=",${STEPS:-tests,grid,cold,engine,serve},"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
[[ $STEPS == *,tests,* ]] && timeout "${TEST_S:-40}" python3 -m pytest -q -p no:cacheprovider \
    -x tests/kernels/test_lora_variants.py 2>&1 | tail -4 | tee "$OUT/tests.log"
[[ $STEPS == *,grid,* ]] && timeout "${GRID_S:-120}" python3 -m bench.kernels_lora_grid \
    --out "$OUT/lora-grid-h200.json" 2>&1 | tee "$OUT/grid.log" | tail -50
[[ $STEPS == *,cold,* ]] && timeout "${COLD_S:-60}" python3 -m bench.cold_load --tmp /tmp \
    --out "$OUT/cold-load-h200.json" 2>&1 | tail -8
# `engine` twice: LoRA in line after each base GEMM, then on a second stream beside it.
if [[ $STEPS == *,engine,* ]]; then
    for variant in inline overlap; do
        flag=(); [ $variant = overlap ] && flag=(--lora-overlap)
        timeout "${ENGINE_S:-150}" python3 -m bench.serving --shape llama2-7b --device cuda \
            --dtype float16 --scenarios overhead,floor --requests "${OVERHEAD_REQ:-150}" \
            "${flag[@]}" --out "$OUT/engine-speed-$variant-h200.json" 2>&1 \
            | grep -v "it/s]\|s/it]" | grep "^==" | tail -2
    done
fi
# The disk-tier churn last: its first run hit an illegal memory access (fixed since; git log).
[[ $STEPS == *,serve,* ]] && timeout "${SERVE_S:-200}" python3 -m bench.serving \
    --shape llama2-7b --device cuda --dtype float16 --arena-gb "${ARENA_GB:-32}" \
    --scenarios "${SCENARIOS:-churn,coldttft,churndisk}" --many-adapters 2000 \
    --churn-requests "${CHURN_REQ:-800}" --churn-rate 60 --churn-disk-dir /tmp \
    --out "$OUT/churn-h200.json" 2>&1 | grep -v "it/s]\|s/it]" | tail -12
ls -la "$OUT"
