#!/usr/bin/env bash
# The oracle's mutation check (issue 12): switch off one mechanism at a time and run the oracle; each run
# must fail, and its message names the broken invariant and the scenario's seed.
# Usage: scripts/oracle_mutations.sh [EXAMPLES] (default 60); logs under runs/mutations/.
set -u
cd "$(dirname "$0")/.."
n=${1:-60}
mkdir -p runs/mutations
status=0
for m in rearm framer drain first_wins; do
  log=runs/mutations/$m.log
  PDGATE_MUTATION=$m ORACLE_EXAMPLES=$n timeout 900 .venv/bin/python -m pytest -q -x -p no:randomly \
    tests/pdgate/test_oracle.py > "$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "$m: NOT CAUGHT in $n scenarios"; status=1
  else
    echo "$m: caught: $(grep -m1 -A1 'the promise broke:' "$log" | tail -1 | sed 's/^E *//' | cut -c1-300)"
  fi
done
exit $status
