#!/usr/bin/env bash
# End to end with a real container engine: build the image, start the compose stack (cpu profile)
# with fresh secrets, read the tenant key publish-demo prints, call the gateway over gRPC and HTTP
# and the control plane with `slora admin` as that output says, then tear everything down.
# Needs docker and docker-compose 1.29+ (COMPOSE="docker compose" for v2) and the base images
# (pulled, or offline stand-ins as ../shared/tools/compose_offline.sh makes). A few minutes.
#   bash deploy/compose_e2e.sh [LOG_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE=${COMPOSE:-docker-compose}
LOG=${1:-$(mktemp -d)}; mkdir -p "$LOG"
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-slora-e2e}
secret() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
for v in SLORA_ADMIN_KEY SLORA_CLUSTER_TOKEN SLORA_DB_PASSWORD SLORA_WORKER_CREDENTIAL \
         SLORA_GATEWAY_TOKEN; do export "$v=$(secret)"; done
t() { echo "== $(date +%T) $*"; }
cleanup() { $COMPOSE --profile cpu logs --no-color >"$LOG/compose.log" 2>&1 || true
            $COMPOSE --profile cpu down -v >/dev/null 2>&1 || true; }
trap cleanup EXIT

t "compose refuses to start without a secret"
if env -u SLORA_ADMIN_KEY $COMPOSE --profile cpu config >/dev/null 2>"$LOG/refused.txt"; then
  echo "FAIL: compose accepted a missing SLORA_ADMIN_KEY"; exit 1
fi
grep -q "set SLORA_ADMIN_KEY" "$LOG/refused.txt"

t "build the image"
$COMPOSE --profile cpu build >"$LOG/build.log" 2>&1
docker run --rm slora:latest sh -c 'test "$(id -u)" != 0 && command -v gcc >/dev/null'

t "up"
$COMPOSE --profile cpu up -d >"$LOG/up.log" 2>&1
publish=$($COMPOSE --profile cpu ps -q publish-demo)
for _ in $(seq 200); do
  state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$publish")
  [ "${state%% *}" = exited ] && break; sleep 3
done
$COMPOSE --profile cpu ps
$COMPOSE --profile cpu logs --no-color publish-demo | tee "$LOG/publish-demo.log"
[ "$state" = "exited 0" ] || { echo "FAIL: publish-demo $state"; exit 1; }
TOKEN=$(sed -n 's/.*tenant API key (shown once): \([^ ]*\).*/\1/p' "$LOG/publish-demo.log" | tr -d '\r')

t "call it as printed: gRPC, HTTP, admin"
docker run --rm --network host -e SLORA_API_KEY="$TOKEN" slora:latest \
  slora generate --gateway 127.0.0.1:50071 --adapter qv-r4 --max-new-tokens 8 "The quick brown fox" \
  2>&1 | tee "$LOG/generate.txt"
curl -sf http://127.0.0.1:8080/v1/completions -H "Authorization: Bearer $TOKEN" \
  -H 'Content-Type: application/json' \
  -d '{"model": "qv-r4", "prompt": "The quick brown fox", "max_tokens": 8}' | tee "$LOG/http.json"
echo
docker run --rm --network host -e SLORA_KEY="$SLORA_ADMIN_KEY" slora:latest \
  slora admin --target 127.0.0.1:50051 list | tee "$LOG/admin-list.txt"
grep -q "qv-r4@v1" "$LOG/generate.txt" && grep -q '"completion_tokens":8' "$LOG/http.json" \
  && grep -q "^qv-r4 " "$LOG/admin-list.txt"
t "PASS (logs in $LOG)"
