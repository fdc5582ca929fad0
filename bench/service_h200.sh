#!/usr/bin/env bash
# Device calls for the service path (issue 11), each under the 10-minute limit of one call. Run
# from the root of a clean export of the commit measured (SLORA_COMMIT set), with the wheels of
# what the image lacks in .whl and the generated protos in slora/v1. Results land under $OUT.
#   1: service overhead at Llama-2-7B shapes, 64 and 256 streams, 3 interleaved repeats
#      (in-process, worker hop alone, gateway gRPC, gateway HTTP); the core's step profile
#   2: asynchronous steps: GPU correctness check, the same service overhead and step profile
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/service-out}
mkdir -p "$OUT"
SO=(--device cuda --dtype float16 --shape llama2-7b --num-pages 2400 --max-model-len 256
    --concurrency 64,256 --requests-per-stream 2 --new-tokens 64 --client-procs 4 --http)
PC=(--shape llama2-7b --device cuda --dtype float16 --batch 64 --context 512 --adapters)
case "${1:-1}" in
1)  timeout 300 python3 -m bench.service_overhead "${SO[@]}" --repeats 3 \
        --out "$OUT/service-overhead-7b-h200.json" 2>&1 | grep -v "it/s]\|s/it]" \
        | tee "$OUT/service-overhead.log" | grep -v "^  File\|^    " | tail -30
    for mode in sync async; do
        flag=(); [ $mode = async ] && flag=(--async-steps)
        timeout 90 python3 -m bench.profile_core "${PC[@]}" "${flag[@]}" \
            --out "$OUT/profile-core-$mode-h200.json" 2>&1 | tail -2
    done ;;
2)  timeout 100 python3 -m bench.gpu_engine_check --out "$OUT/engine-gpu-check.json" 2>&1 \
        | tail -12
    timeout 120 python3 -m bench.profile_core "${PC[@]}" --async-steps \
        --out "$OUT/profile-core-async-h200.json" 2>&1 | tail -3
    timeout 330 python3 -m bench.service_overhead "${SO[@]}" --repeats 3 --async-steps \
        --out "$OUT/service-overhead-7b-async-h200.json" 2>&1 | grep -v "it/s]\|s/it]" \
        | tail -20 ;;
esac
