#!/usr/bin/env bash
# The main job: asynchronous GRPO on 2-digit addition with a real SGLang server and an FSDP2
# trainer, on the CPU. Installs what is missing, builds the tiny model, makes (and caches) an
# SFT warm start, then runs RL through the local launcher. Extra args are Hydra overrides for
# the GRPO recipe, e.g. `bash scripts/main.sh rollout.staleness.max_head_offpolicyness=0`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

bash scripts/install.sh

WARM=.cache/models/addition-sft
bash scripts/warm_start.sh recipes/conf/sft_addition.yaml sft_addition "$WARM"

echo "== asynchronous GRPO (real SGLang server + FSDP2 trainer) =="
exec "$PYTHON" -m areal_like.launcher.local grpo model.path="$WARM" "$@"
