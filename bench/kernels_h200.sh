#!/usr/bin/env bash
# The one device call for the kernels: full-size tests on the GPU against float64 references,
# then the benchmark. Run from the repository root on the GPU machine; writes under $OUT.
set -o pipefail
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/kernels tests/slora_core/test_ops.py 2>&1 | tee "$OUT/tests.log" | tail -40
timeout "${BENCH_TIMEOUT:-320}" python3 -m bench.kernels --out "$OUT/kernels-h200.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
