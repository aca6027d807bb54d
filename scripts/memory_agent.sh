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

WARM=.cache/models/memory-sft
bash scripts/warm_start.sh recipes/conf/sft_memory.yaml sft_memory "$WARM" \
  recipes/conf/sft_addition.yaml areal_like/data/memory_episodes.py

echo "== memory agent: GRPO on per-action rewards (real SGLang server + FSDP2 trainer) =="
exec "$PYTHON" -m areal_like.launcher.local agent model.path="$WARM" "$@"
