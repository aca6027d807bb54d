#!/usr/bin/env bash
# Install the project into the current Python (CPU torch first, so nothing pulls a CUDA build),
# then the SGLang and vLLM server environments. Idempotent: quick when everything is already
# there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==2.13.0"
fi
if ! "$PYTHON" -c "import areal_like, ruff, pytest_asyncio, pebble, importlinter, ray, openai, colorama, random_order, xdist, torchdata, mypy, peft" 2>/dev/null; then
  "$PYTHON" -m pip install -e ".[dev,ray]"
fi
if [ -f scripts/install_sglang.sh ]; then
  bash scripts/install_sglang.sh "${SGLANG_VENV:-.venv-sglang}"
fi
if [ -f scripts/install_vllm.sh ]; then
  bash scripts/install_vllm.sh "${VLLM_VENV:-.venv-vllm}"
fi
