#!/usr/bin/env bash
# Install the SGLang server into its own virtual environment (default .venv-sglang).
#
#   bash scripts/install_sglang.sh [VENV]        (or: make sglang SGLANG_VENV=...)
#
# GPU machine (nvidia-smi present): stock `pip install sglang==$SGLANG_VERSION`.
# CPU machine: sglang is installed with --no-deps (its pins want CUDA torch), then its other
# requirements minus the CUDA-only ones, all against a torch==$TORCH_VERSION constraint so pip
# can never pull a CUDA torch (the CPU wheel comes from the pip config's find-links). The
# workarounds the CPU engine needs are the project's own shims (engines/sglang/shim/, see its
# README), copied into this venv only: an import shim for the CUDA-only `sgl_kernel`, an
# import hook that lets PyPI's CUDA torchvision import on CPU torch, and the CPU pieces of
# SGLang's deterministic inference.
#
# Idempotent: a stamp file holds the hash of this script + the shim + the pins; when it matches,
# the script exits at once. Delete the venv (or the stamp) to force a reinstall.
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIM_DIR="$REPO_ROOT/engines/sglang/shim"
STAMP="$VENV/.areal_like_install_stamp"

# CUDA-only requirements of sglang (kernels, CUDA bindings) and torch-family packages pinned to
# other torch builds (torchaudio/torchcodec), plus timm (vision models only). torch itself is
# installed first from the pinned CPU wheel. torchvision stays: sglang imports it at start-up;
# the torch==$TORCH_VERSION constraint makes pip pick the release built for that torch.
CPU_SKIP="cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl \
nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla \
sglang-kernel sgl-kernel tilelang torch-memory-saver torch torchaudio torchcodec timm"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    MODE="cuda"
else
    MODE="cpu"
fi

hash_inputs() {
    {
        cat "${BASH_SOURCE[0]}"
        echo "$MODE $SGLANG_VERSION $TORCH_VERSION $("$PYTHON" --version 2>&1)"
        if [ -d "$SHIM_DIR" ]; then
            find "$SHIM_DIR" -type f \( -name '*.py' -o -name '*.md' -o -name '*.pth' \) \
                | LC_ALL=C sort \
                | xargs cat
        fi
    } | sha256sum | cut -d' ' -f1
}
WANT_HASH="$(hash_inputs)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_HASH" ] && [ -x "$VENV/bin/python" ]; then
    echo "[install_sglang] $VENV is up to date ($MODE, sglang $SGLANG_VERSION)"
    exit 0
fi

echo "[install_sglang] installing sglang $SGLANG_VERSION ($MODE) into $VENV"
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar off)
"${PIP[@]}" -q --upgrade pip wheel setuptools packaging

if [ "$MODE" = "cuda" ]; then
    "${PIP[@]}" "sglang==$SGLANG_VERSION"
else
    CONSTRAINTS="$VENV/areal_like_constraints.txt"
    echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
    "${PIP[@]}" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

    # sglang's own requirement list (markers evaluated here) minus the CUDA-only ones.
    REQS="$VENV/areal_like_sglang_requirements.txt"
    CPU_SKIP="$CPU_SKIP" "$VPY" - "$REQS" <<'EOF'
import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {canonicalize_name(n) for n in os.environ["CPU_SKIP"].split()}
kept, dropped = [], []
for line in md.requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    (dropped if canonicalize_name(req.name) in skip else kept).append(req)
with open(sys.argv[1], "w") as f:
    f.writelines(f"{r}\n" for r in kept)
print(f"[install_sglang] {len(kept)} requirements kept, skipped (CUDA-only/torch-pinned): "
      + ", ".join(sorted(r.name for r in dropped)))
EOF
    # pip's resolver then reports sglang's unmet CUDA pins (torch==2.14.1, sglang-kernel, ...):
    # expected, those are exactly the packages left out above.
    "${PIP[@]}" -q -r "$REQS" -c "$CONSTRAINTS"

    # The shims (engines/sglang/shim/README.md), venv-local: a stand-in `sgl_kernel` package,
    # and the torchvision import hook, loaded at start-up by its .pth file.
    SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$SITE/sgl_kernel"
    cp -r "$SHIM_DIR/sgl_kernel" "$SITE/sgl_kernel"
    find "$SITE/sgl_kernel" -name '__pycache__' -prune -exec rm -rf {} +
    cp "$SHIM_DIR/areal_like_sglang_shim.py" "$SHIM_DIR/areal_like_sglang_shim.pth" \
        "$SHIM_DIR/areal_like_sglang_deterministic.py" \
        "$SHIM_DIR/areal_like_sglang_lora.py" "$SHIM_DIR/areal_like_sglang_vision.py" \
        "$SHIM_DIR/areal_like_sglang_moe.py" "$SHIM_DIR/areal_like_sglang_attention.py" \
        "$SHIM_DIR/areal_like_sglang_zygote.py" "$SITE/"

    # Guard rails: the CPU torch stayed, and no CUDA torchvision slipped in.
    "$VPY" - "$TORCH_VERSION" <<'EOF'
import importlib.metadata as md
import sys

import torch

want = sys.argv[1]
if not torch.__version__.startswith(want) or torch.version.cuda is not None:
    sys.exit(f"[install_sglang] torch {torch.__version__} (cuda={torch.version.cuda}) was "
             f"installed; expected the CPU build of {want}")
for name in ("torchaudio", "sglang-kernel", "sgl-kernel"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"[install_sglang] {name} got installed as a dependency; it breaks CPU torch")
tv = md.version("torchvision")
import torchvision  # noqa: E402  (fails here, not at server start, if the hook is broken)
print(f"[install_sglang] torch {torch.__version__}, torchvision {tv} (C++ ops shimmed)")
EOF
fi

# Smoke test: the modules a server start-up imports (where a missing shim name would fail).
# the delta transport's receiving end (engines/weight_transport/delta/) decompresses with it
"${PIP[@]}" -q "zstandard>=0.22"
if [ "$MODE" = "cpu" ]; then export SGLANG_USE_CPU_ENGINE=1; fi
"$VPY" -W ignore -c "import sglang, sglang.launch_server, sglang.srt.configs, \
sglang.srt.mem_cache.memory_pool, sglang.srt.managers.scheduler, zstandard; \
print('[install_sglang] sglang', sglang.__version__, 'imports')"
echo "$WANT_HASH" >"$STAMP"
echo "[install_sglang] done: $VENV"
