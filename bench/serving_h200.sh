#!/usr/bin/env bash
# The device calls for issue 6, each under the 10-minute limit of one call. Run from the repo root
# on the GPU machine: `bash bench/serving_h200.sh 1` then `bash bench/serving_h200.sh 2`; results
# land under $OUT. Engines warm up (kernel compilation, every decode graph) outside the timed
# windows; the first engine of a fresh machine spends about a minute compiling.
# Call 2 starts real gateway/worker/control-plane processes: carry the generated protobuf
# package (`carry: ["slora/v1", ".whl"]`) and wheels of what the image lacks (check KINDS.md:
# grpcio-health-checking, grpcio-reflection, sqlalchemy, alembic, fsspec, prometheus-client).
set -o pipefail
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/serving-out}
mkdir -p "$OUT"
COMMON=(--shape llama2-7b --device cuda --dtype float16 --arena-gb 90)
case "${1:-1}" in
1)  # throughput against the base model, many adapters, adapter reuse
    timeout 560 python3 -m bench.serving "${COMMON[@]}" --scenarios overhead,reuse,scale \
        --requests 300 --rate 25 --many-adapters 2000 --out "$OUT/serving-h200.json" 2>&1 \
        | grep -v "it/s]\|s/it]" | tee "$OUT/serving.log" ;;
2)  # the 32 x 32 batch against HF PEFT, the decode floor, GPU correctness, gRPC overhead
    timeout 300 python3 -m bench.serving "${COMMON[@]}" --scenarios peft32,floor --hf \
        --hf-max-time 60 --out "$OUT/serving-peft-h200.json" 2>&1 | grep -v "it/s]\|s/it]"
    timeout 100 python3 -m bench.gpu_engine_check --out "$OUT/engine-gpu-check.json" 2>&1 | tail -20
    timeout 150 python3 -m bench.service_overhead --device cuda --dtype float16 \
        --out "$OUT/service-overhead-h200.json" 2>&1 | tail -20 ;;
esac
