#!/usr/bin/env bash
# `make test`: set up (idempotent), then the whole pytest suite. Fixtures start their own
# Redis, engines and Ray; nothing reaches a model hub (HF_HUB_OFFLINE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
exec "${VENV:-.venv}/bin/python" -m pytest -ra "$@"
