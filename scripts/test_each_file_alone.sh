#!/usr/bin/env bash
# Runs every test file in its own pytest process, so a file that passes only after another file
# set something up (a fleet, a cache, a global) fails here. Prints one line per file and a summary;
# exits non-zero if any file failed. Extra args go to each pytest call.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
failed=()
start_all=$(date +%s)
for file in tests/test_*.py; do
  start=$(date +%s)
  OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:cacheprovider "$@" "$file" >"/tmp/alone.$$.log" 2>&1
  rc=$?
  summary=$(tail -n 1 "/tmp/alone.$$.log")
  # rc 5: the file's tests were all deselected by the extra args (e.g. -m quick)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    failed+=("$file")
    tail -n 40 "/tmp/alone.$$.log"
  fi
  printf '%-45s rc=%d %4ds  %s\n' "$file" "$rc" "$(( $(date +%s) - start ))" "$summary"
done
rm -f "/tmp/alone.$$.log"
echo "== $(ls tests/test_*.py | wc -l) files in $(( ($(date +%s) - start_all) / 60 )) min; failed: ${#failed[@]} ${failed[*]:-}"
[ "${#failed[@]}" -eq 0 ]
