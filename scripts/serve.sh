#!/usr/bin/env bash
# `make serve`: set up (idempotent), start a local Redis when REDIS_URL is unset, then
# `serve run config.yaml` in the foreground. Ctrl-C stops the service and the local Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash scripts/setup.sh  # scripts/serve_gpu.sh sets up its own environment
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Serve's proxy loads the connection bounds uvicorn lacks (header deadline, per-address cap): serve_app/ingress/proxy_guard.py
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-serve_app.ingress.proxy_guard:install}
CONFIG=${CONFIG:-config.yaml}
VENV=${VENV:-.venv}
if [ -z "${REDIS_URL:-}" ]; then
  mkdir -p .cache/redis
  "$VENV/bin/python" -m devtools.local_redis --dir .cache/redis > .cache/redis/url 2> .cache/redis/log &
  REDIS_PID=$!
  trap 'kill $REDIS_PID 2>/dev/null || true' EXIT
  for _ in $(seq 600); do [ -s .cache/redis/url ] && break; sleep 0.1; done  # up to 60 s on a busy machine
  REDIS_URL=$(head -1 .cache/redis/url)
  [ -n "$REDIS_URL" ] || { echo "local Redis did not start: $(cat .cache/redis/log)" >&2; exit 1; }
  export REDIS_URL
  echo "local Redis at $REDIS_URL"
fi
# `serve run` says only that it submitted the config; this says when the app answers /health
"$VENV/bin/python" -m devtools.announce_ready --config "$CONFIG" &
ANNOUNCER_PID=$!
trap 'kill $ANNOUNCER_PID ${REDIS_PID:-} 2>/dev/null || true' EXIT
"$VENV/bin/serve" run "$CONFIG"
