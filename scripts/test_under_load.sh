#!/usr/bin/env bash
# The test command while two CPU-bound processes run beside it (a busy machine, as on shared
# CI). Extra args go to pytest, e.g. `bash scripts/test_under_load.sh -x tests/test_launcher.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOAD_PIDS=()
stop_load() { for pid in "${LOAD_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_load EXIT INT TERM
for _ in 1 2; do
  "$PYTHON" -c 'while True: pass' &
  LOAD_PIDS+=("$!")
done
echo "== load: ${LOAD_PIDS[*]} (two busy-loop processes) =="
bash scripts/test.sh "$@"
