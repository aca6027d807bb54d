#!/usr/bin/env bash
# The memory agent (Mem-alpha) on the CPU: builds the tiny model, makes (and caches) an SFT warm
# start that writes memory in the tool-call format but stores a random line of each chunk, then
# trains it with GRPO on per-action rewards through the local launcher (real SGLang server +
# FSDP2 trainer). Extra args are Hydra overrides for recipes/conf/agent_memory.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

bash scripts/install.sh

BASE=.cache/models/tiny-1m
WARM=.cache/models/memory-sft
if [ ! -f "$BASE/config.json" ]; then
  "$PYTHON" -m areal_like.models.tiny --out "$BASE" --size 1m --seed 1
fi
# The warm start is rebuilt when its recipe, the demos or the model builder change.
STAMP=$(cat recipes/conf/sft_memory.yaml recipes/conf/sft_addition.yaml \
  areal_like/data/memory_episodes.py areal_like/models/tiny.py | sha256sum | cut -c1-16)
if [ "$(cat "$WARM/.stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "== SFT warm start (cached in $WARM) =="
  rm -rf .cache/runs/sft_memory "$WARM"
  "$PYTHON" -m recipes.sft --config recipes/conf/sft_memory.yaml model.path="$BASE" \
    logging.log_dir=.cache/runs logging.tensorboard=false
  mkdir -p "$(dirname "$WARM")"
  cp -r .cache/runs/sft_memory/trial0/final "$WARM"
  echo "$STAMP" > "$WARM/.stamp"
fi

echo "== memory agent: GRPO on per-action rewards (real SGLang server + FSDP2 trainer) =="
exec "$PYTHON" -m areal_like.launcher.local agent model.path="$WARM" "$@"
