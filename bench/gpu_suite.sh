#!/usr/bin/env bash
# Every GPU claim re-verified on the commit under test, in two device calls (run each with
# timeout_s 540; a part stops its processes at PART_LIMIT_S, 450 s by default, and then writes
# its summary):
#   A  the GPU-only pytest tests (the ones a CPU skips: full-size kernels, CUDA model and ops,
#      the compiled-variant count) and the rest of tests/kernels compiled (TRITON_INTERPRET=0),
#      split over $SHARDS pytest processes, beside bench.gpu_numerics (massive activations,
#      fp16/bf16 vs HF, the non-finite guard). Triton compiles each kernel variant in the
#      calling process, one at a time; one process ran 114 of the ~150 tests in 250 s.
#   B  bench.gpu_suite, one process per shape (Llama-2-7B, Llama-3-8B widths) side by side.
# Every process writes its JSON as it goes (a process stopped at the limit keeps what it
# finished; the scripts also skip, and record, a mode that would not end before the limit).
# Each part then writes $OUT/gpu-part-<A|B>-h200.json: commit ($SLORA_COMMIT: the device copy
# has no .git), command, hardware, limits, each process's exit status and seconds, the pytest
# counts, failures and slowest tests, and the verdicts of the scripts' JSONs. The device sends
# back a limited number of files, so each part ends with two in $OUT: that summary, and
# gpu-part-<A|B>.tgz holding everything the part wrote (logs, JUnit XML, the scripts' JSONs,
# the summary); the loose copies are removed (tar xzf gpu-part-A.tgz gives them back).
#
#   export SLORA_COMMIT=$(git rev-parse HEAD)
#   OUT=/tmp/out bash bench/gpu_suite.sh A      # then: bash bench/gpu_suite.sh B
#
# CPU smoke run (toy sizes; kernel tests in the Triton interpreter):
#   PYTHON=.venv/bin/python TRITON_INTERPRET=1 SHARDS=2 DEVICE_ARGS="--device cpu --tiny" \
#   PYTEST_PATHS="tests/kernels/test_fused.py tests/slora_core/test_ops.py" \
#   SHAPES="tiny-mha tiny-gqa" OUT=/tmp/out bash bench/gpu_suite.sh A B
set -u
[ $# -ge 1 ] || { echo "usage: bash bench/gpu_suite.sh A|B ..." >&2; exit 2; }
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export SLORA_COMMIT=${SLORA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
LIMIT=${PART_LIMIT_S:-450}
BUDGET=$((LIMIT - 45))  # the scripts start no mode that would end past this
SHARDS=${SHARDS:-8}
PYTEST_PATHS=${PYTEST_PATHS:-tests/kernels tests/slora_core/test_ops.py \
tests/slora_core/test_model.py tests/slora_core/test_nonfinite_guard.py \
tests/slora_core/test_graph_capture.py tests/slora_core/test_lora_merge.py}
SHAPES=${SHAPES:-llama2-7b llama3-8b}
DEVICE_ARGS=${DEVICE_ARGS:-}

# OMP_NUM_THREADS for N processes side by side: the cores shared out. torch's default (every
# core per process) oversubscribes them, and its spinning threads then slow host-side ops many
# times over (the engine run of one toy suite shape on a busy 2-core host: 1.8 s with one
# thread, 52-122 s with the default).
USER_THREADS=${OMP_NUM_THREADS:-}
threads() { local n=$(( $(nproc) / $1 )); echo "${USER_THREADS:-$(( n > 0 ? n : 1 ))}"; }

# timed NAME CMD...: CMD under the part's limit (SIGINT first: pytest then still writes its
# XML), its exit status and seconds in $OUT/.status-NAME.
timed() {
    local name=$1 t0=$SECONDS
    shift
    timeout -s INT -k 20 "$LIMIT" "$@" >"$OUT/gpu-$name.log" 2>&1
    echo "$? $((SECONDS - t0))" >"$OUT/.status-$name"
}

part_a() {
    rm -f "$OUT"/gpu-pytest-*.xml "$OUT"/.shard-*
    # shellcheck disable=SC2086  # PYTEST_PATHS is a word list
    TRITON_INTERPRET=${TRITON_INTERPRET:-0} "$PY" - "$OUT" "$SHARDS" $PYTEST_PATHS <<'EOF'
# Split the collected tests over shards: one test function's cases stay together (they share
# compiled variants), the GPU-only cases (skipif with a GPU/CUDA reason) count three and run
# first in their shard, big functions are cut so the shards come out even.
import sys, pytest
out, shards, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
class Plan:
    items = []
    def pytest_collection_modifyitems(self, items):
        Plan.items = list(items)
pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *paths], plugins=[Plan()])
def gpu_only(item):
    return any(w in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")
               for w in ("GPU", "CUDA"))
groups = {}
for item in Plan.items:
    groups.setdefault(item.nodeid.split("[")[0], []).append(item)
weight = {i.nodeid: 3 if gpu_only(i) else 1 for i in Plan.items}
cap = max(3, sum(weight.values()) // shards)
pieces = []
for items in groups.values():
    piece, w = [], 0
    for i in items:
        if piece and w + weight[i.nodeid] > cap:
            pieces.append((w, piece)); piece, w = [], 0
        piece.append(i.nodeid); w += weight[i.nodeid]
    pieces.append((w, piece))
load, plan = [0] * shards, [[] for _ in range(shards)]
for w, piece in sorted(pieces, key=lambda p: -p[0]):
    k = load.index(min(load)); load[k] += w; plan[k] += piece
for k, ids in enumerate(plan):
    ids.sort(key=lambda n: weight[n] != 3)
    if ids:
        open(f"{out}/.shard-{k}", "w").write("\n".join(ids) + "\n")
print(f"{len(Plan.items)} tests, {sum(w == 3 for w in weight.values())} GPU-only, "
      f"shard weights {load}")
EOF
    local shards=("$OUT"/.shard-*)
    OMP_NUM_THREADS=$(threads $(( ${#shards[@]} + 1 )))
    export OMP_NUM_THREADS
    for shard in "${shards[@]}"; do
        [ -e "$shard" ] || continue
        k=${shard##*-}
        mapfile -t ids <"$shard"
        (TRITON_INTERPRET=${TRITON_INTERPRET:-0} timed "pytest-$k" "$PY" -m pytest -q \
            -p no:cacheprovider --durations=10 --junitxml="$OUT/gpu-pytest-$k.xml" \
            "${ids[@]}") &
    done
    # shellcheck disable=SC2086  # DEVICE_ARGS, NUMERICS_ARGS are word lists
    (timed numerics "$PY" -m bench.gpu_numerics $DEVICE_ARGS ${NUMERICS_ARGS:-} \
        --budget-s "$BUDGET" --out "$OUT/gpu-numerics-h200.json") &
    wait
}

part_b() {
    local shapes
    read -ra shapes <<<"$SHAPES"
    OMP_NUM_THREADS=$(threads ${#shapes[@]})
    export OMP_NUM_THREADS
    for shape in "${shapes[@]}"; do
        # shellcheck disable=SC2086  # DEVICE_ARGS, SUITE_ARGS are word lists
        (timed "suite-$shape" "$PY" -m bench.gpu_suite $DEVICE_ARGS ${SUITE_ARGS:-} \
            --shapes "$shape" --budget-s "$BUDGET" --out "$OUT/gpu-suite-$shape-h200.json") &
    done
    wait
}

# pack PART FILE...: the part's summary and FILEs (names in $OUT) into $OUT/gpu-part-PART.tgz;
# the FILEs are removed once the tarball is written, the summary stays beside it.
pack() {
    local part=$1
    shift
    local files=("gpu-part-$part-h200.json" "$@")
    tar czf "$OUT/gpu-part-$part.tgz" -C "$OUT" "${files[@]}" \
        && (cd "$OUT" && rm -f -- "${files[@]:1}")
}

for part in "$@"; do
    start=$SECONDS
    case $part in
        A) part_a ;;
        B) part_b ;;
        *) echo "unknown part $part (A or B)" >&2; exit 2 ;;
    esac
    "$PY" - "$OUT" "$part" "$LIMIT" "$((SECONDS - start))" <<'EOF'
import glob, json, os, sys, xml.etree.ElementTree as ET
out, part, limit, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
procs = {}
for path in sorted(glob.glob(f"{out}/.status-*")):
    rc, secs = open(path).read().split()
    procs[path.split(".status-", 1)[1]] = {"exit_status": int(rc), "seconds": int(secs),
                                           "cut_by_limit": int(rc) in (124, 130, 137)}
report = {"part": part, "commit": os.environ["SLORA_COMMIT"],
          "command": f"bash bench/gpu_suite.sh {part}", "hardware": None, "torch": None,
          "limit_s": limit, "seconds": seconds, "processes": procs}
try:
    import torch
    report["hardware"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report["torch"] = torch.__version__
except ImportError:
    pass
if part == "A":
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, slowest = [], []
    for path in sorted(glob.glob(f"{out}/gpu-pytest-*.xml")):
        try:
            for suite in ET.parse(path).getroot().iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
                for case in suite.iter("testcase"):
                    name = case.get("classname", "") + "::" + case.get("name", "")
                    slowest.append((float(case.get("time", 0)), name))
                    if case.find("failure") is not None or case.find("error") is not None:
                        failed.append(name)
        except ET.ParseError as e:
            failed.append(f"{path}: unreadable ({e})")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["planned"] = sum(len(open(p).read().split()) for p in glob.glob(f"{out}/.shard-*"))
    report["pytest"] = counts | {"failed": failed, "slowest": [
        {"test": n, "seconds": round(t, 1)} for t, n in sorted(slowest, reverse=True)[:15]]}
scripts = {}
for path in sorted(glob.glob(f"{out}/gpu-numerics-h200.json" if part == "A"
                             else f"{out}/gpu-suite-*-h200.json")):
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        scripts[os.path.basename(path)] = {"unreadable": str(e)}
        continue
    keys = ("ok", "seconds", "skipped", "guard_ok", "faithful_ok",
            "tokens_from_nonfinite_rows_total")
    summary = {k: d[k] for k in keys if k in d}
    for s in d.get("shapes", []):
        summary[s.get("shape", {}).get("name", "?")] = {
            m: {k: r.get(k) for k in ("ok", "skipped", "agreement", "max_rel_err_vs_hf_fp32",
                                      "max_hf_same_dtype_rel_err_vs_fp32",
                                      "greedy_agreement_with_hf_fp32",
                                      "hf_same_dtype_agreement_with_hf_fp32", "stats")
                if k in r} for m, r in s.get("modes", {}).items()}
    scripts[os.path.basename(path)] = summary
report["results"] = scripts
report["ok"] = (bool(procs) and all(p["exit_status"] == 0 for p in procs.values())
                and all(s.get("ok") for s in scripts.values()))
json.dump(report, open(f"{out}/gpu-part-{part}-h200.json", "w"), indent=1)
print(json.dumps(report, indent=1))
EOF
    rm -f "$OUT"/.status-* "$OUT"/.shard-*
    # shellcheck disable=SC2046  # the part's file names (no spaces), one word each
    case $part in
        A) pack A $(cd "$OUT" && ls -d gpu-pytest-* gpu-numerics* 2>/dev/null) ;;
        B) pack B $(cd "$OUT" && ls -d gpu-suite-* 2>/dev/null) ;;
    esac
done
