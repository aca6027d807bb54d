#!/usr/bin/env bash
# The test command: install what is missing, lint (ruff, import layers, mypy), run the whole suite (real SGLang + torchrun).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# every start (servers, trainers, Ray nodes, Slurm, this install) appends a line here; the
# suite's summary sums them by kind (areal_like/utils/start_costs.py, tests/conftest.py)
if [ -z "${AREAL_LIKE_START_LOG:-}" ]; then
  AREAL_LIKE_START_LOG="$(mktemp --suffix=.starts.jsonl)"
  OWN_START_LOG="$AREAL_LIKE_START_LOG"
fi
export AREAL_LIKE_START_LOG
INSTALL_BEGAN="$(date +%s.%N)"
bash scripts/install.sh
"$PYTHON" -c "import sys, time; from areal_like.utils.start_costs import record_start; record_start('install', time.time() - float(sys.argv[1]), 'scripts/install.sh')" "$INSTALL_BEGAN"
"$PYTHON" -m ruff check .
"$PYTHON" -c "from importlinter.cli import lint_imports_command as c; c(['--no-logo'])"  # layers
# types: areal_like, engines, workflows, recipes ([tool.mypy] in pyproject.toml). mypy (~40 s
# of one core) runs beside the suite, whose in-process tests leave the other core idle; its
# report is printed after the suite's and a type error fails the command all the same.
MYPY_LOG="$(mktemp)"
"$PYTHON" -m mypy >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
trap 'kill "$MYPY_PID" 2>/dev/null || true; rm -f "$MYPY_LOG" ${OWN_START_LOG:+"$OWN_START_LOG"}' EXIT
# two lanes (pytest-xdist, tests/conftest.py): the tests of servers, torchrun jobs and Ray in
# one worker, in order; the in-process tests in the other, beside them. TEST_LANES=1: one process.
LANES=(-n 2 --dist loadgroup)
if [ "${TEST_LANES:-2}" = 1 ]; then LANES=(); fi
status=0
OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -rfEs --durations=25 "${LANES[@]}" "$@" || status=$?  # summary: failures, errors, skips
mypy_status=0
wait "$MYPY_PID" || mypy_status=$?
cat "$MYPY_LOG"
if [ "$mypy_status" -ne 0 ]; then
  echo "mypy found type errors (above)" >&2
  status=1
fi
exit "$status"
