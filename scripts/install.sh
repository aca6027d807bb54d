#!/usr/bin/env bash
# Install the project into the current Python (CPU torch first, so nothing pulls a CUDA build),
# and the SGLang and vLLM server environments beside it: three independent pip runs (separate
# environments), so they run at once, each with its own log, and a failure of any fails this
# script with its log's tail. Idempotent: quick when everything is already there.
# pip's byte-compilation stays (where PYTHONDONTWRITEBYTECODE is set, a module without its .pyc
# is compiled again by every process that imports it: a server's imports take 24 s, not 11).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOGS="$(mktemp -d)"
PIDS=()
NAMES=()
start_env() {  # name script venv
  bash "$2" "$3" >"$LOGS/$1.log" 2>&1 &
  PIDS+=("$!")
  NAMES+=("$1")
  echo "[install] $1: $3 (in the background, log $LOGS/$1.log)"
}
# Stopped with this script: a background install must not outlive it.
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
[ -f scripts/install_sglang.sh ] && start_env sglang scripts/install_sglang.sh "${SGLANG_VENV:-.venv-sglang}"
[ -f scripts/install_vllm.sh ] && start_env vllm scripts/install_vllm.sh "${VLLM_VENV:-.venv-vllm}"
[ -f scripts/install_verifiers.sh ] && start_env verifiers scripts/install_verifiers.sh "${VERIFIERS_VENV:-.venv-verifiers}"

# the code sandbox's isolation tool (areal_like/utils/sandbox.py): Debian's bubblewrap
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] bubblewrap (the code sandbox)"
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
  else
    echo "[install] bubblewrap is missing (apt-get install bubblewrap): the code sandbox" \
         "and its tests need it"
  fi
fi

# Debian's Slurm and munge: the Slurm launcher's tests run a real two-node Slurm on this
# machine (scripts/slurm_test_cluster.sh)
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[install] slurm-wlm and munge (the Slurm launcher's tests)"
    # only the tests need it: a failure here leaves the main job installable (the Slurm
    # test's own script tries again and names what failed)
    apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; } \
      || echo "[install] could not install slurm-wlm and munge with apt-get"
  else
    echo "[install] slurm-wlm is missing (apt-get install slurm-wlm munge): the Slurm" \
         "launcher's tests need it"
  fi
fi

PIP=("$PYTHON" -m pip install --progress-bar off)
# what is there is looked up, not imported (importing torch, ray, mlflow, wandb, ... only to
# learn that they are installed took seconds of every warm run); torch's version from its
# metadata
installed() {  # module names: found without importing them
  "$PYTHON" -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)" "$@" 2>/dev/null
}
if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('torch').startswith('2.13.0') else 1)" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
if ! installed areal_like ruff pytest_asyncio pebble importlinter ray openai colorama random_order xdist torchdata mypy peft anthropic gymnasium zstandard tinker google.protobuf chz termcolor pylatexenc wandb mlflow trackio hypothesis; then
  "${PIP[@]}" -e ".[dev,ray]"
fi
# the Tinker Cookbook, a test client of our Tinker API (tests/test_tinker_api.py): without its
# pins (tml-renderers>=0.4.1 is not on the index); what its recipes import comes with [dev]
if ! installed tinker_cookbook.recipes.sl_loop tinker_cookbook.recipes.rl_basic; then
  "${PIP[@]}" --no-deps "tinker-cookbook==0.6.1"
fi

status=0
for i in "${!PIDS[@]}"; do
  name="${NAMES[$i]}"
  log="$LOGS/$name.log"
  # never silent for long: the server environments take minutes on a fresh machine
  # (a look every 0.2 s: an environment already up to date ends in a second, and a 5-s sleep
  # made every warm install wait 5 s for it)
  ticks=0
  while kill -0 "${PIDS[$i]}" 2>/dev/null; do
    if [ $((ticks % 300)) -eq 0 ]; then
      echo "[install] waiting for $name: $(grep '^\[install_' "$log" | tail -n 1)"
    fi
    ticks=$((ticks + 1))
    sleep 0.2
  done
  if wait "${PIDS[$i]}"; then
    grep '^\[install_' "$log" || true
  else
    echo "[install] $name failed; the end of its log ($log):" >&2
    tail -n 60 "$log" >&2
    status=1
  fi
done
trap - EXIT
[ "$status" -eq 0 ] && rm -rf "$LOGS"
exit "$status"
