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
uv_install() {
    "${PIP[@]}" uv==0.13.9 >/dev/null 2>&1 || return 1
    local args=(--python .venv/bin/python --index-strategy unsafe-best-match) key val v
    while IFS= read -r line; do
        key=${line%%=*} val=${line#*=} val=${val//\'/}
        case $key in
            *.extra-index-url) for v in $val; do args+=(--extra-index-url "$v"); done ;;
            *.index-url) args+=(--index-url "$val") ;;
            *.find-links) for v in $val; do args+=(--find-links "$v"); done ;;
            *.constraint) for v in $val; do args+=(--constraint "$v"); done ;;
        esac
    done < <(.venv/bin/pip config list 2>/dev/null)
    .venv/bin/uv pip install -q "${args[@]}" -e ".[test]"
}
# The editable install again only when what it reads changed (a re-run takes seconds, not a
# minute of dependency resolution): the stamp holds the digest of pyproject.toml and setup.py.
stamp=.venv/.slora-install-stamp
digest=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ] || ! .venv/bin/python -c "import services" \
    2>/dev/null; then
    # uv installs the ~200 wheels in about 20 s where pip takes about 2 minutes on 2 cores; it
    # reads pip's configuration (indexes, find-links, constraints) passed on below. Should uv
    # be unavailable or fail, pip installs as before.
    if uv_install; then :; else
        echo "setup: uv unavailable or failed; installing with pip" >&2
        "${PIP[@]}" -e ".[test]"
    fi
    echo "$digest" >"$stamp"
fi
.venv/bin/python -m services.codegen
