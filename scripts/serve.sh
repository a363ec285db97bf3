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
# `serve run`, with Ctrl-C's default restored: a script's background job ignores SIGINT, and Python
# keeps an ignored SIGINT ignored, so without this Ctrl-C would not reach it
"$VENV/bin/python" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
  "$VENV/bin/serve" run "$CONFIG" &
SERVE_PID=$!
# `serve run` says only that it submitted the config; this says when the app answers /health, or,
# when the application failed to deploy (a memory plan that does not fit the card, ...), prints
# Serve's message and stops `serve run` (exit 2): a start that cannot succeed ends instead of idling
"$VENV/bin/python" -m devtools.announce_ready --config "$CONFIG" --serve-pid "$SERVE_PID" &
ANNOUNCER_PID=$!
trap 'kill -0 $SERVE_PID 2>/dev/null && kill -INT $SERVE_PID && wait $SERVE_PID; kill $ANNOUNCER_PID ${REDIS_PID:-} 2>/dev/null || true' EXIT
trap 'wait $SERVE_PID; exit 130' INT  # Ctrl-C reached serve run too: let its own shutdown finish
rc=0
wait "$SERVE_PID" || rc=$?
if ! kill -0 "$ANNOUNCER_PID" 2>/dev/null; then  # the announcer ended: healthy (0), failed to deploy (2)
  arc=0
  wait "$ANNOUNCER_PID" || arc=$?
  [ "$arc" -eq 0 ] || rc=$arc
fi
exit "$rc"
