#!/usr/bin/env bash
# Tensor parallelism on 2 H200s (issue 16) in one device call (kind nvidia-h200-x2, timeout_s
# 600): each part is its own process under its own limit and writes its JSON under $OUT as soon
# as it finishes (bench/tensor_parallel.py says what each holds):
#   70b : tp-70b-h200.json (Llama-3-70B-shaped random model, 1,000 r16 adapters, Poisson);
#   7b  : tp-correctness-h200.json (TP=2 = TP=1 tokens, both against HF + peft, fp16 greedy) and
#         tp-throughput-h200.json (TP=1 eager, TP=1 CUDA graphs, TP=2 eager, TP=2 graphs).
# Then tp-run-h200.json: commit, GPUs, each part's exit status. Logs: $OUT/tp-<part>.log.
#
#   SLORA_COMMIT=$(git rev-parse HEAD) OUT=/tmp/out bash bench/tp_h200.sh
#   PARTS=70b LIMIT_70B=540 bash bench/tp_h200.sh      # one part alone, all the call's time
#   SMOKE=1 OUT=/tmp/tp bash bench/tp_h200.sh            # CPU, gloo, tiny shapes (the test)
#   SHORT=1 bash bench/tp_h200.sh   # 240 s in all: 7b = TP=2 then TP=1, eager only, 32 timed
#                                   # requests; 70b = 120 requests (see the SHORT defaults)
# Each part logs a timestamped line per phase; every JSON is written as its phase ends.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=${TRITON_INTERPRET:-0}
export SLORA_COMMIT=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
if [ "${SHORT:-0}" = 1 ]; then
    # TP=2 first, before a TP=1 engine or a timed run used the GPU; a stuck collective ends
    # the part through NCCL's watchdog, with a message, instead of its time limit.
    PARTS=${PARTS:-7b 70b}
    # One adapter weight set: each set is made on rank 0 before the run and again on rank 1
    # inside the first step (the 300-request run spent 49 s adding 1,000 adapters over four
    # sets); the kernels' speed does not depend on the values.
    LIMIT_7B=${LIMIT_7B:-100}
    LIMIT_70B=${LIMIT_70B:-135}
    # The 7b part once stalled after 'engine ready' (rank 0 in the adapter loader's casts for
    # over 80 s with torch's 32 threads in each rank's process; 1.5 s since each rank takes its
    # share, slora_core.process.share_cpu_threads): a 30 s collective timeout and 20 s stall
    # dumps fire well inside its limit, with every rank's stacks and (SLORA_TP_DEBUG) every
    # adapter/arena message logged.
    export SLORA_TP_DEBUG=${SLORA_TP_DEBUG:-1}
    ARGS_7B=${ARGS_7B:---engines tp2 tp1_eager --requests 32 --max-output 128 \
--collective-timeout 30 --stall-dump 20}
    ARGS_70B=${ARGS_70B:---big-requests 120 --weight-sets 1 --collective-timeout 90}
fi
# 70b first: its JSON is written once its run ends, while the 7b part writes as it goes (a 7b
# part cut short loses only its last runs, TP=2 with CUDA graphs first).
PARTS=${PARTS:-70b 7b}
LIMIT_70B=${LIMIT_70B:-250}  # + LIMIT_7B stays under the call's 540 s
LIMIT_7B=${LIMIT_7B:-280}
ARGS_7B=${ARGS_7B:-}          # e.g. "--layers 16" if the full depth does not fit
ARGS_70B=${ARGS_70B:-}
SMOKE_FLAG=""
[ "${SMOKE:-0}" = 1 ] && SMOKE_FLAG="--smoke"
# NVLink multicast stays off (the device notes: it can take the shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

for part in $PARTS; do
    case $part in
        7b) limit=$LIMIT_7B; extra=$ARGS_7B ;;
        70b) limit=$LIMIT_70B; extra=$ARGS_70B ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
    start=$(date +%s)
    # shellcheck disable=SC2086  # SMOKE_FLAG and extra are word lists
    # SIGTERM at the limit, SIGKILL 5 s later if NCCL keeps the process from dying; the rank
    # processes die with it (PR_SET_PDEATHSIG, slora_core/tp/launch.py).
    timeout -k 5 "$limit" "$PY" -m bench.tensor_parallel $SMOKE_FLAG --part "$part" \
        --out-dir "$OUT" $extra >"$OUT/tp-$part.log" 2>&1
    echo "$? $(( $(date +%s) - start ))" >"$OUT/.rc-$part"
    tr "\r" "\n" <"$OUT/tp-$part.log" | grep -v "it/s]\|s/it]\|Warning\|warnings.warn" | tail -8
done

"$PY" - "$OUT" "$PARTS" "${SMOKE:-0}" <<'PYEOF'
import json, os, sys
out, parts, smoke = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "1"
import torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
status = {}
for p in parts:
    try:
        rc, secs = open(f"{out}/.rc-{p}").read().split()
        status[p] = {"rc": int(rc), "seconds": int(secs)}
    except (OSError, ValueError):
        status[p] = {"rc": None}
nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else None
command = ("SHORT=1 " if os.environ.get("SHORT") == "1" else "") + "bash bench/tp_h200.sh"
report = {"commit": os.environ.get("SLORA_COMMIT"), "command": command,
          "parts": status, "gpus": gpus, "gpu_count": len(gpus), "torch": torch.__version__,
          "nccl": nccl, "smoke": smoke}
name = "tp-run-smoke.json" if smoke else "tp-run-h200.json"
open(f"{out}/{name}", "w").write(json.dumps(report, indent=1))
print(json.dumps(report))
PYEOF
