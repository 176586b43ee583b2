#!/usr/bin/env bash
# Where pdgate's CPU goes on the closed loop (BENCHMARKS.md, "The closed loop's CPU, profiled"): pdgate on its
# defaults in front of the zero-cost fake workers, 16 connections of non-streaming requests from loadtest.gen.
#   scripts/profile_hotpath.sh perf        perf record -g of the gateway for 4 s (needs perf)
#   scripts/profile_hotpath.sh strace-gw   strace -c of the gateway for a whole 3 s load run (syscalls a request)
#   scripts/profile_hotpath.sh strace-dec  the same of the decode worker
#   scripts/profile_hotpath.sh cprofile    the gateway under cProfile for a 6 s run (calls a request)
# Every process it starts is stopped by PID at the end. Output in ${OUT:-/tmp/pdgate-prof}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/pdgate-prof}; mkdir -p "$OUT"
mode=${1:?perf, strace-gw, strace-dec or cprofile}
port() { $PY -c 'from loadtest.procs import free_port; print(free_port())'; }
pp=$(port); dp=$(port); gp=$(port); ap=$(port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
$PY -m loadtest.fakeworker --role prefill --port "$pp" > "$OUT/prefill.log" 2>&1 & pids+=($!)
$PY -m loadtest.fakeworker --role decode --port "$dp" > "$OUT/decode.log" 2>&1 & pids+=($!); dec=$!
sleep 1.5
gw=(-m pdgate serve --port "$gp" --admin-port "$ap" --prefill "http://127.0.0.1:$pp" 8998
    --decode "http://127.0.0.1:$dp" --log-level WARNING)
if [ "$mode" = cprofile ]; then $PY -m cProfile -o "$OUT/gateway.prof" "${gw[@]}" > "$OUT/gateway.log" 2>&1 &
else $PY "${gw[@]}" > "$OUT/gateway.log" 2>&1 & fi
g=$!; pids+=("$g")
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$gp/readiness" > /dev/null && break; sleep 0.2; done
load() { $PY -m loadtest.gen --url "http://127.0.0.1:$gp" --concurrency 16 --warmup 0 --duration "$1" > "$OUT/gen.json"; }
case "$mode" in
  perf) load 8 & l=$!; sleep 2; perf record -o "$OUT/gateway.perf" -g -p "$g" -- sleep 4 > /dev/null 2>&1; wait "$l"
        perf report -i "$OUT/gateway.perf" --stdio --no-children --sort dso -g none 2>/dev/null | grep '%' | head -8 ;;
  strace-gw|strace-dec) t=$g; [ "$mode" = strace-dec ] && t=$dec
        strace -c -f -p "$t" -o "$OUT/$mode.txt" & s=$!; sleep 1; load 3; sleep 0.5; kill -INT "$s"; wait "$s" || true
        head -8 "$OUT/$mode.txt" ;;
  cprofile) load 6; kill -INT "$g"; wait "$g" || true
        echo "pstats in $OUT/gateway.prof (requests: ok in $OUT/gen.json)" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
tail -1 "$OUT/gen.json" | cut -c1-80
