#!/usr/bin/env bash
# The main job's SFT warm start, of the tiny mixture of experts (Qwen3-MoE, 8 experts, top-2):
#   bash scripts/moe_warm_start.sh && \
#     bash scripts/main.sh model.path=.cache/models/addition-sft-moe actor.moe.router_replay=true
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
TINY_ARCH=qwen3_moe bash scripts/warm_start.sh recipes/conf/sft_addition.yaml sft_addition_moe \
  .cache/models/addition-sft-moe areal_like/models/tiny_moe.py
echo "warm start: .cache/models/addition-sft-moe"
