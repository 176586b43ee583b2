#!/usr/bin/env bash
# BENCHMARKS.md's headline runs (run Y; since run AF the streams three times and the h1lite floor beside the peers),
# each with the machine's load before it and the three busiest other processes.
set -uo pipefail
cd "$(dirname "$0")/.."
stamp() { echo "== $1: load $(cut -d' ' -f1-3 /proc/loadavg) at $(date +%H:%M:%S); top others:"; ps -eo pcpu,comm --sort=-pcpu | sed -n 2,4p; }
D=${1:-benchmarks/$(date +%F)-headline}
PY=.venv/bin/python
stamp overload; $PY -m loadtest bench --overload --loads 3 --duration 10 --out "$D-overload-3x.json"
stamp streams; $PY -m loadtest bench --streams-workload --streams 2000 --decodes 1 --duration 10 --repeats 3 \
    --streams-targets pdgate sglang-router smg h1lite-floor --out "$D-streams-2000-x3.json"
stamp compare; $PY -m loadtest bench --compare --workers fake --duration 8 --repeats 3 --workloads ns16 ns64 --floor --out "$D-compare.json"
stamp storm; $PY -m loadtest storm --compare --repeats 2 --iterations 10 --instances 3 --watchdog 5 --grace 5 --window 20 \
    --request-timeout 20 --probe-timeout 10 --out "$D-storm-compare.json"
stamp end
