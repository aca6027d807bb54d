#!/usr/bin/env bash
# Install `verifiers` (prime-rl's environment layer) into its own virtual environment
# (default .venv-verifiers): it pins openai<3, the project keeps openai 3 as a test client.
#
#   bash scripts/install_verifiers.sh [VENV]
#
# workflows/verifiers_runner.py runs in it (workflows/verifiers_env.py starts it per episode).
# No torch: verifiers needs none (`pip install --dry-run verifiers==0.4.0`: 96 packages,
# no torch, no CUDA); the check at the end fails the install if one came in anyway.
# `uv` is installed beside it: verifiers' own chat harness (`null`) runs its chat loop as a
# PEP 723 script through `uv sync --script`. That script's environment is prepared here, once,
# by verifiers' own runtime code, and locked, so an episode finds it ready without a network.
#
# Idempotent: a stamp file holds the hash of this script + the pins + the Python version.
set -euo pipefail

VERIFIERS_VERSION="0.4.0"
UV_VERSION="0.13.9"
VENV="${1:-.venv-verifiers}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.areal_like_install_stamp"

WANT_HASH="$({ cat "${BASH_SOURCE[0]}"
               echo "$VERIFIERS_VERSION $UV_VERSION $("$PYTHON" --version 2>&1)"; } \
             | sha256sum | cut -d' ' -f1)"
# the chat harness's locked script lives in verifiers' cache (~/.cache/verifiers), not the venv
LOCKED="$HOME/.cache/verifiers/runtimes/scripts/*.py.lock"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_HASH" ] && [ -x "$VENV/bin/python" ] \
   && compgen -G "$LOCKED" >/dev/null; then
    echo "[install_verifiers] $VENV is up to date (verifiers $VERIFIERS_VERSION)"
    exit 0
fi

echo "[install_verifiers] installing verifiers $VERIFIERS_VERSION into $VENV"
START=$(date +%s)
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar off)
"${PIP[@]}" -q --upgrade pip
"${PIP[@]}" -q "verifiers==$VERIFIERS_VERSION" "uv==$UV_VERSION"

# The chat harness's script environment (uv finds the venv's own uv and python first on PATH;
# it must never download a Python).
PATH="$(cd "$VENV/bin" && pwd):$PATH" UV_PYTHON_DOWNLOADS=never "$VPY" - <<'EOF'
import asyncio
import importlib.util
import subprocess
import sys

import verifiers.v1 as vf
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

if importlib.util.find_spec("torch") is not None:
    sys.exit("[install_verifiers] torch was installed into the verifiers venv; it needs none")


async def prepare() -> list[str]:
    runtime = SubprocessRuntime(vf.SubprocessConfig())
    await runtime.start()
    try:
        return await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)
    finally:
        await runtime.stop()


script = asyncio.run(prepare())[-1]
# Locked, an episode's `uv sync --script` needs no package index (0.05 s, offline too).
for step in ("lock", "sync"):
    subprocess.run(["uv", step, "--script", script, "-q", "--no-config"], check=True)
print(f"[install_verifiers] chat harness script ready and locked: {script}")
EOF
N_PACKAGES="$("$VPY" -m pip list --format=freeze 2>/dev/null | wc -l)"
echo "$WANT_HASH" >"$STAMP"
echo "[install_verifiers] done: $VENV ($N_PACKAGES packages, $(( $(date +%s) - START )) s)"
