#!/usr/bin/env bash
# The test command: install what is missing, lint (ruff, import layers, mypy), run the whole suite (real SGLang + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m ruff check .
"$PYTHON" -c "from importlinter.cli import lint_imports_command as c; c(['--no-logo'])"  # layers
"$PYTHON" -m mypy  # types: areal_like, engines, workflows, recipes ([tool.mypy] in pyproject.toml)
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rfEs --durations=25 "$@"  # summary: failures, errors, skips
