#!/usr/bin/env bash
# The test command: install what is missing, lint, run the whole suite (real SGLang + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m ruff check .
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rs "$@"
