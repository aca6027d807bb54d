#!/usr/bin/env bash
# Install Hugging Face TRL into its own virtual environment (default .venv-trl), for
# `benchmarks/vs_trl.py` only: the framework a user would pick instead, measured beside ours.
# Never installed into the project's environment, never by the test command.
#
#   bash scripts/install_trl.sh [VENV]
#
# CPU torch first (the project's pin), then TRL with the project's transformers / datasets /
# accelerate pins, so both sides run the same model code; the check at the end fails the
# install if a CUDA torch came in anyway.
# Idempotent: a stamp file holds the hash of this script + the pins + the Python version.
set -euo pipefail

TRL_VERSION="1.16.0"
TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.25.0"
DATASETS_VERSION="5.2.0"
ACCELERATE_VERSION="1.16.0"
VENV="${1:-.venv-trl}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.areal_like_install_stamp"

WANT_HASH="$({ cat "${BASH_SOURCE[0]}"; "$PYTHON" --version 2>&1; } | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_HASH" ] && [ -x "$VENV/bin/python" ]; then
    echo "[install_trl] $VENV is up to date (trl $TRL_VERSION)"
    exit 0
fi

echo "[install_trl] installing trl $TRL_VERSION into $VENV"
START=$(date +%s)
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar off)
"${PIP[@]}" -q --upgrade pip
"${PIP[@]}" -q "torch==$TORCH_VERSION"
"${PIP[@]}" -q "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    "datasets==$DATASETS_VERSION" "accelerate==$ACCELERATE_VERSION" "torch==$TORCH_VERSION"
"$VPY" - <<'EOF'
import sys

import torch
import trl

if torch.version.cuda is not None:
    sys.exit(f"[install_trl] a CUDA torch ({torch.__version__}) was installed; expected CPU")
print(f"[install_trl] trl {trl.__version__}, torch {torch.__version__}")
EOF
echo "$WANT_HASH" >"$STAMP"
echo "[install_trl] done: $VENV ($(( $(date +%s) - START )) s)"
