#!/usr/bin/env bash
# The last device call of a session on 2 H200s (kind nvidia-h200-x2): every step under its own
# time limit and all under one deadline (BUDGET_S from the start; a step that would not fit is
# skipped and logged), results packed into one archive (the device returns a few files only).
#   0. bench.host_probe (CPU counts, threads, the loader's host work);
#   1. tensor parallelism (both GPUs): bench/tp_h200.sh with $TP_ENV (issue 16);
#   2. two lanes side by side, one GPU each, nothing else on that GPU, in priority order:
#      GPU 0: gpu_suite part A (GPU-only tests, numerics; issue 13), then bench.gpu_numerics
#             alone ($NUMERICS_ARGS);
#      GPU 1: the decode LoRA kernel grid (grid) and adapter cold loads (cold; issue 15),
#             gpu_suite part B (7B/8B shapes vs HF under churn; issue 13), the service path
#             at 64 and 256 streams with a 4-process gateway (issue 12), adapter churn
#             (coldttft, churndisk, churn; issue 15), then one adapter vs base and the
#             decode-step floor with LoRA in line, then with LoRA on a second stream (issue 15;
#             $OVERHEAD_REPEATS interleaved pairs).
# Run from the root of a clean export with the wheels in .whl and SLORA_COMMIT exported:
#   SLORA_COMMIT=<sha> OUT=$OUT TP_ENV="PARTS=7b ..." bash bench/h200_round.sh
# SKIP="engine-inline service ..." leaves those steps out (logged).
set -u
# shellcheck source=bench/round_lib.sh
source "$(dirname "$0")/round_lib.sh"
step probe 90 python3 -m bench.host_probe --out "$OUT/host-probe-h200.json"
# shellcheck disable=SC2086  # TP_ENV is a list of VAR=value words
[ -n "${TP_ENV+x}" ] && step tp "${TP_S:-230}" env $TP_ENV OUT="$OUT/tp" bash bench/tp_h200.sh

lane0() {
    export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=8
    step suite-A "${SUITE_A_S:-190}" env OMP_NUM_THREADS=2 PART_LIMIT_S="${SUITE_A_PART_S:-160}" OUT="$OUT/A" \
        NUMERICS_ARGS="--modes eager all_graphs all_graphs_async" \
        bash bench/gpu_suite.sh A
    # The numerics part alone (suite-A runs it beside 8 pytest shards), for a re-run.
    # shellcheck disable=SC2086  # NUMERICS_ARGS is a word list
    step numerics "${NUMERICS_S:-330}" python3 -m bench.gpu_numerics ${NUMERICS_ARGS:-} \
        --budget-s "$((${NUMERICS_S:-330} - 30))" --out "$OUT/gpu-numerics-h200.json"
}
lane1() {
    export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=8
    step grid "${GRID_S:-120}" python3 -m bench.kernels_lora_grid --out "$OUT/lora-grid-h200.json"
    step cold "${COLD_S:-90}" python3 -m bench.cold_load --tmp /tmp \
        --out "$OUT/cold-load-h200.json"
    step suite-B "${SUITE_B_S:-180}" env PART_LIMIT_S="${SUITE_B_PART_S:-160}" OUT="$OUT/B" \
        bash bench/gpu_suite.sh B
    step service "${SERVICE_S:-190}" python3 -m bench.service_overhead --device cuda \
        --dtype float16 --shape llama2-7b --num-pages 2400 --max-model-len 256 \
        --concurrency 64,256 --requests-per-stream 2 --new-tokens 64 --client-procs 4 --http \
        --repeats 2 --gateway-procs 4 --client-channels 8 \
        --out "$OUT/service-overhead-7b-gw4-h200.json"
    step churn "${CHURN_S:-210}" python3 -m bench.serving --shape llama2-7b --device cuda \
        --dtype float16 --arena-gb 32 --scenarios coldttft,churndisk,churn \
        --many-adapters 2000 --churn-requests 600 --churn-disk-requests 200 --churn-rate 60 \
        --churn-disk-dir /tmp --out "$OUT/churn-h200.json"
    engine_arm inline
    engine_arm overlap --lora-overlap
}
lane0 &
lane1 &
wait
pack
