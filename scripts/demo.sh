#!/usr/bin/env bash
# Offline demo on generated assets: a tiny Llama-family model and a dozen PEFT adapters, one mixed
# multi-LoRA batch through the engine on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=${DEMO_DIR:-demo}
[ -f "$DEMO/manifest.json" ] || .venv/bin/slora demo-assets "$DEMO"
ARGS=()
for d in "$DEMO"/adapters/*/; do n=$(basename "$d"); ARGS+=(--adapter "$n=$d"); done
.venv/bin/python - "$DEMO" > "$DEMO/requests.jsonl" <<'PY'
import json, pathlib, sys
names = sorted(p.name for p in (pathlib.Path(sys.argv[1]) / "adapters").iterdir())
prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
for i, name in enumerate([None, *names]):
    line = {"prompt": prompts[i % 3], "max_new_tokens": 16, "temperature": 0}
    if name:
        line["adapter"] = name
    print(json.dumps(line))
PY
.venv/bin/slora batch --model "$DEMO/model" "${ARGS[@]}" --input "$DEMO/requests.jsonl" \
    --output "$DEMO/outputs.jsonl"
.venv/bin/python -c "
import json,sys
for q, a in zip(open('$DEMO/requests.jsonl'), open('$DEMO/outputs.jsonl')):
    q, a = json.loads(q), json.loads(a)
    print(f\"{q.get('adapter') or '(base)':>14}  {q['prompt']!r} -> {a['text']!r} [{a['finish_reason']}]\")
"
