# Shared by the device rounds (sourced): install the carried wheels, then run named steps, each
# under its own time limit and all under one deadline (BUDGET_S from the start; a step that
# would not fit is skipped and logged), results packed into one archive at the end (the device
# returns a few files only). Expects OUT, and SLORA_COMMIT exported (the copy has no .git).
# shellcheck shell=bash
OUT=${OUT:-/tmp/round}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export SLORA_COMMIT=${SLORA_COMMIT:?export SLORA_COMMIT (the device copy has no .git)}
STEP_LOG=$OUT/steps.log
DEADLINE=$((SECONDS + ${BUDGET_S:-500}))
step() {  # step NAME LIMIT CMD...: CMD under min(LIMIT, time to the deadline), logged
    local name=$1 limit=$2 t0=$SECONDS left=$((DEADLINE - SECONDS - 15))
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "$name skipped: named in SKIP" >>"$STEP_LOG"
        return
    fi
    if [ "$left" -lt 30 ]; then
        echo "$name skipped: ${left}s left before the deadline" >>"$STEP_LOG"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? limit=${limit}s at=${SECONDS}s took=$((SECONDS - t0))s" >>"$STEP_LOG"
}
engine_arm() {  # engine_arm NAME [bench.serving flags]
    step "engine-$1" "${ENGINE_S:-120}" python3 -m bench.serving --shape llama2-7b \
        --device cuda --dtype float16 --scenarios overhead,floor --requests 100 \
        --overhead-repeats "${OVERHEAD_REPEATS:-3}" "${@:2}" --out "$OUT/engine-speed-$1-h200.json"
}
engine_floor() {  # engine_floor NAME [bench.serving flags]: the decode-step floor alone
    step "floor-$1" "${FLOOR_S:-90}" python3 -m bench.serving --shape llama2-7b \
        --device cuda --dtype float16 --scenarios floor --async-steps "${@:2}" \
        --out "$OUT/engine-floor-$1-h200.json"
}

pack() {  # the step log and the last lines of each log printed, everything in round.tgz
    cat "$STEP_LOG"
    grep -h "^== " "$OUT"/*.log | cut -c1-400 | tail -20
    tar czf /tmp/round.tgz -C "$OUT" . && mv /tmp/round.tgz "$OUT/round.tgz"
    find "$OUT" -mindepth 1 -not -name round.tgz -not -name steps.log -delete
}
