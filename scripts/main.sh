#!/usr/bin/env bash
# The main job: asynchronous GRPO on 2-digit addition with a real SGLang server and an FSDP2
# trainer, on the CPU. Installs what is missing, builds the tiny model, makes (and caches) an
# SFT warm start, then runs RL through the local launcher. Extra args are Hydra overrides for
# the GRPO recipe, e.g. `bash scripts/main.sh rollout.max_head_offpolicyness=0`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

bash scripts/install.sh

BASE=.cache/models/tiny-1m
WARM=.cache/models/addition-sft
if [ ! -f "$BASE/config.json" ]; then
  "$PYTHON" -m areal_like.models.tiny --out "$BASE" --size 1m --seed 1
fi
# The warm start is rebuilt when its recipe or the model builder changes.
STAMP=$(cat recipes/conf/sft_addition.yaml areal_like/models/tiny.py | sha256sum | cut -c1-16)
if [ "$(cat "$WARM/.stamp" 2>/dev/null)" != "$STAMP" ]; then
  echo "== SFT warm start (cached in $WARM) =="
  rm -rf .cache/runs/sft_addition "$WARM"
  "$PYTHON" -m recipes.sft model.path="$BASE" logging.log_dir=.cache/runs logging.tensorboard=false
  mkdir -p "$(dirname "$WARM")"
  cp -r .cache/runs/sft_addition/trial0/final "$WARM"
  echo "$STAMP" > "$WARM/.stamp"
fi

echo "== asynchronous GRPO (real SGLang server + FSDP2 trainer) =="
exec "$PYTHON" -m areal_like.launcher.local grpo model.path="$WARM" "$@"
