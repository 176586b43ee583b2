#!/bin/bash
# A/B of the gateway's closed-loop CPU per request at saturation (BENCHMARKS.md run J):
#   scripts/ab_hotpath.sh DIR BASEPORT   (DIR: a checkout, e.g. a worktree at another commit)
# Zero-cost fake workers, one `pdgate serve`, 64 connections for 12 s; prints req/s and the gateway's CPU
# (from /proc) per request. Run it alternately for the two checkouts: single runs vary by about 10% here.
# FLOOR=1: the same with benchmarks/h1lite_floor.py (a bare PD relay on h1lite) in pdgate's place.
# KNOCK=metrics,traces,...: pdgate with those features knocked out (scripts/knockout_serve.py): what they cost.
set -euo pipefail
dir=$1; base=$2
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
cd "$dir"
export PYTHONPATH="$PWD"  # DIR's own pdgate and h1lite, whatever the environment's editable install points at
$PY -m loadtest.fakeworker --role prefill --port $((base+1)) > /dev/null 2>&1 & p1=$!
$PY -m loadtest.fakeworker --role decode --port $((base+2)) > /dev/null 2>&1 & p2=$!
trap 'kill $p1 $p2 ${g:-} 2>/dev/null || true' EXIT
sleep 1
if [ "${FLOOR:-}" = 1 ]; then
    $PY benchmarks/h1lite_floor.py --port $((base+3)) --prefill http://127.0.0.1:$((base+1)) --bootstrap-port 8998 \
        --decode http://127.0.0.1:$((base+2)) > /tmp/ab-$base.log 2>&1 & g=$!
else
    serve=(-m pdgate); [ -n "${KNOCK:-}" ] && serve=(scripts/knockout_serve.py)
    KNOCK=${KNOCK:-} $PY "${serve[@]}" serve --port $((base+3)) --admin-port $((base+4)) --prefill http://127.0.0.1:$((base+1)) 8998 \
        --decode http://127.0.0.1:$((base+2)) --log-level WARNING > /tmp/ab-$base.log 2>&1 & g=$!
fi
sleep 2
kill -0 $g 2>/dev/null || { echo "the gateway exited at start: $(tail -1 /tmp/ab-$base.log)" >&2; exit 1; }
t0=$(awk '{print $14+$15}' /proc/$g/stat)
timeout 60 $PY -m loadtest bench --target http://127.0.0.1:$((base+3)) --concurrency 64 --duration 12 \
    --out /tmp/ab-$base.json > /dev/null 2>&1
t1=$(awk '{print $14+$15}' /proc/$g/stat)
python3 -c "
import json, os
o = json.load(open('/tmp/ab-$base.json'))
r = list(list(o['results'].values())[0].values())[0]
tick = os.sysconf('SC_CLK_TCK')
print('$dir' + (' (floor)' if '${FLOOR:-}' == '1' else '') + (' (knocked out: ${KNOCK:-})' if '${KNOCK:-}' else ''), 'rps', round(r['rps']), 'gateway cpu us/req', round(($t1 - $t0) / tick * 1e6 / r['ok'], 1))
"
