#!/usr/bin/env bash
# Every GPU claim re-verified in one device call, on the commit under test:
#   - the GPU-only pytest tests: kernels at full size with TRITON_INTERPRET=0 (the whole
#     tests/kernels suite runs compiled instead of interpreted), the CUDA model and ops tests,
#     and the CPU guard tests;
#   - bench.gpu_numerics (fp16/bf16 with massive activations, the non-finite guard);
#   - bench.gpu_suite (Llama-2-7B / Llama-3-8B shapes under eviction and preemption).
# The three run side by side on the one GPU (correctness only; nothing here is timed against
# anything else). Writes under $OUT (default bench/results): gpu-numerics-h200.json,
# gpu-suite-h200.json, gpu-pytest.xml, their logs, and gpu-run-h200.json (commit, hardware,
# each part's exit status, the pytest counts).
#
#   SLORA_COMMIT=$(git rev-parse HEAD) OUT=/tmp/out bash bench/gpu_suite.sh
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export SLORA_COMMIT=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
LIMIT=${SUITE_LIMIT_S:-540}  # run the call with timeout_s 600
# Overrides for a CPU smoke run of this script (defaults: the full GPU run).
PYTEST_PATHS=${PYTEST_PATHS:-tests/kernels tests/slora_core/test_ops.py \
tests/slora_core/test_model.py tests/slora_core/test_nonfinite_guard.py}

# shellcheck disable=SC2086  # PYTEST_PATHS, NUMERICS_ARGS, SUITE_ARGS are word lists
(TRITON_INTERPRET=${TRITON_INTERPRET:-0} timeout "$LIMIT" python3 -m pytest -q \
    -p no:cacheprovider $PYTEST_PATHS --junitxml="$OUT/gpu-pytest.xml" \
    >"$OUT/gpu-pytest.log" 2>&1; echo $? >"$OUT/.rc-pytest") &
(timeout "$LIMIT" python3 -m bench.gpu_numerics ${NUMERICS_ARGS:-} --out "$OUT/gpu-numerics-h200.json" \
    >"$OUT/gpu-numerics.log" 2>&1; echo $? >"$OUT/.rc-numerics") &
(timeout "$LIMIT" python3 -m bench.gpu_suite ${SUITE_ARGS:-} --out "$OUT/gpu-suite-h200.json" \
    >"$OUT/gpu-suite.log" 2>&1; echo $? >"$OUT/.rc-suite") &
wait

python3 - "$OUT" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
def rc(name):
    try:
        return int(open(f"{out}/.rc-{name}").read())
    except (OSError, ValueError):
        return None
tests = {}
try:
    suite = ET.parse(f"{out}/gpu-pytest.xml").getroot().find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    tests["failed"] = [c.get("classname", "") + "::" + c.get("name", "")
                       for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError, AttributeError) as e:
    tests = {"unreadable": str(e)}
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
report = {"commit": os.environ["SLORA_COMMIT"], "hardware": gpu,
          "torch": torch.__version__, "command": "bash bench/gpu_suite.sh",
          "exit_status": {n: rc(n) for n in ("pytest", "numerics", "suite")},
          "pytest": tests}
json.dump(report, open(f"{out}/gpu-run-h200.json", "w"), indent=1)
print(json.dumps(report, indent=1))
EOF
rm -f "$OUT"/.rc-*
