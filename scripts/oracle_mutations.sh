#!/usr/bin/env bash
# The oracle's mutation check: switch off one mechanism at a time (tests/pdgate/mutations.py) and run the oracle
# at its default scenario count; each run must fail with a message that names the broken invariant (a collection
# error, a timeout or any other failure does not count as caught).
# Usage: scripts/oracle_mutations.sh [EXAMPLES] (default 25, the oracle's own); logs under runs/mutations/.
set -u
cd "$(dirname "$0")/.."
n=${1:-25}
mkdir -p runs/mutations
status=0
for m in rearm framer drain first_wins one_leg rid_instance wrong_header responses_cut; do
  log=runs/mutations/$m.log
  start=$(date +%s)
  PDGATE_MUTATION=$m ORACLE_EXAMPLES=$n timeout 900 .venv/bin/python -m pytest -q -x -p no:randomly \
    tests/pdgate/test_oracle.py > "$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  # the first broken invariant: the line after "the promise broke:", as "<invariant>: <what>"
  line=$(grep -m1 -A1 'AssertionError: the promise broke:' "$log" | tail -1 | sed -E 's/^E +//')
  invariant=$(printf '%s' "$line" | grep -oE '^[a-z][a-z-]+:' | tr -d :)
  if [ $rc -ne 0 ] && [ -n "$invariant" ]; then
    echo "$m: caught by $invariant in ${took}s: $(printf '%s' "$line" | cut -c1-200)"
  else
    echo "$m: NOT CAUGHT (rc $rc, ${took}s, $n scenarios): $(tail -1 "$log" | cut -c1-200)"; status=1
  fi
done
exit $status
