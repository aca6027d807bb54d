#!/usr/bin/env bash
# The test command: install what is missing, lint (ruff, import layers), run the whole suite (real SGLang + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m ruff check .
"$PYTHON" -c "from importlinter.cli import lint_imports_command as c; c(['--no-logo'])"  # layers
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rs --durations=25 "$@"
