#!/usr/bin/env bash
# Idempotent set-up of a fresh checkout: .venv with a CPU torch, the package, generated protos.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# A plain `torch` requirement would pull a multi-GB CUDA build; the pinned CPU build lies on disk.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
.venv/bin/python -m services.codegen
