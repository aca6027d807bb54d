#!/usr/bin/env bash
# Shared by the job scripts: build the tiny base model if missing, then make (and cache) an
# SFT warm start of it. Rebuilt when the SFT config or any of the listed files changes.
#   bash scripts/warm_start.sh SFT_CONFIG RUN_NAME OUT_DIR [FILES_THE_WARM_START_DEPENDS_ON...]
# TINY_ARCH=qwen3_moe: of the tiny mixture of experts instead of the dense model.
# TINY_SIZE=10m: of a larger tiny model (1m by default). SFT_OVERRIDES="key=value ...": more
# Hydra overrides for the SFT run (e.g. train_dataset.task_kwargs.worked_fraction=0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONFIG=$1 NAME=$2 WARM=$3
shift 3
ARCH="${TINY_ARCH:-qwen2}"
SIZE="${TINY_SIZE:-1m}"
read -r -a OVERRIDES <<<"${SFT_OVERRIDES:-}"
BASE=".cache/models/tiny-$SIZE"
if [ "$ARCH" != qwen2 ]; then BASE=".cache/models/tiny-$ARCH-$SIZE"; fi
if [ ! -f "$BASE/config.json" ]; then
  "$PYTHON" -m areal_like.models.tiny --out "$BASE" --size "$SIZE" --seed 1 --arch "$ARCH"
fi
# (the size and overrides enter the stamp only when set: the default warm starts keep theirs)
STAMP=$( { cat "$CONFIG" "$@" areal_like/models/tiny.py
           if [ "$SIZE" != 1m ] || [ -n "${SFT_OVERRIDES:-}" ]; then
             echo "$SIZE ${SFT_OVERRIDES:-}"; fi; } | sha256sum | cut -c1-16)
if [ "$(cat "$WARM/.stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "== SFT warm start (cached in $WARM) =="
  rm -rf ".cache/runs/$NAME" "$WARM"
  "$PYTHON" -m recipes.sft --config "$CONFIG" model.path="$BASE" \
    logging.log_dir=.cache/runs logging.tensorboard=false logging.experiment_name="$NAME" \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"}
  mkdir -p "$(dirname "$WARM")"
  cp -r ".cache/runs/$NAME/trial0/final" "$WARM"
  echo "$STAMP" > "$WARM/.stamp"
fi
