#!/usr/bin/env bash
# Idempotent set-up of a fresh checkout: .venv with a CPU torch, the package, generated protos.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# --no-compile: pip would byte-compile every installed module up front (torch alone has
# thousands); Python compiles the few a run imports on first use instead.
PIP=(.venv/bin/pip install -q --no-compile --disable-pip-version-check)
# A plain `torch` requirement would pull a multi-GB CUDA build; the pinned CPU build lies on disk.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
# The editable install again only when what it reads changed (a re-run takes seconds, not a
# minute of dependency resolution): the stamp holds the digest of pyproject.toml and setup.py.
stamp=.venv/.slora-install-stamp
digest=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ] || ! .venv/bin/python -c "import services" \
    2>/dev/null; then
    "${PIP[@]}" -e ".[test]"
    echo "$digest" >"$stamp"
fi
.venv/bin/python -m services.codegen
