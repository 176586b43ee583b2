#!/usr/bin/env bash
# The seed's storm on real SGLang PD on this CPU (config/cluster.sglang-cpu.toml), through pdgate and through SMG 1.13
# on the same engines, with fixes A/B/C and without (PDGATE_FIXES=none): four verdicts and their timelines under
# benchmarks/<date>-sglang-cpu-storm-*.json/.png, the machine's load before each. Needs `bash engine/sglang/install.sh`
# and `bash loadtest/install_smg.sh`. Usage: scripts/sglang_cpu_storms.sh [ITERATIONS] [INSTANCES]
set -euo pipefail
cd "$(dirname "$0")/.."
it=${1:-4}
inst=${2:-3}
day=$(date +%Y-%m-%d)
smg="${PDGATE_PEERS_DIR:-$HOME/.cache/pdgate/peers}/smg/bin/smg"
work=$(mktemp -d)
up_pid=""
smg_pid=""
stop() {
    [ -n "$smg_pid" ] && kill -TERM "$smg_pid" 2>/dev/null && wait "$smg_pid" 2>/dev/null || true
    [ -n "$up_pid" ] && kill -INT "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null || true
    smg_pid=""; up_pid=""
}
trap stop EXIT
for fixes in A,B,C none; do
    tag=$([ "$fixes" = none ] && echo nofix || echo fixes)
    (cd "$work" && PDGATE_FIXES=$fixes exec "$OLDPWD/.venv/bin/pdgate" up --cluster "$OLDPWD/config/cluster.sglang-cpu.toml" \
        --port 30400 --admin-port 30401 > "$work/up-$tag.log" 2>&1) &
    up_pid=$!
    for _ in $(seq 1 240); do curl -sf http://127.0.0.1:30400/readiness >/dev/null && break; sleep 1; done
    curl -sf http://127.0.0.1:30400/readiness >/dev/null || { tail -20 "$work/up-$tag.log"; exit 1; }
    "$smg" launch --pd-disaggregation --host 127.0.0.1 --port 30402 --prefill http://127.0.0.1:30410 30411 \
        --decode http://127.0.0.1:30420 --prometheus-host 127.0.0.1 --prometheus-port 30403 --log-level warn \
        > "$work/smg-$tag.log" 2>&1 &
    smg_pid=$!
    for _ in $(seq 1 60); do curl -sf http://127.0.0.1:30402/readiness >/dev/null && break; sleep 1; done
    for via in pdgate smg; do
        gw=$([ $via = pdgate ] && echo http://127.0.0.1:30400 || echo http://127.0.0.1:30402)
        echo "== storm through $via, fixes $fixes; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
        (cd "$work" && "$OLDPWD/.venv/bin/python" -m loadtest storm --gateway "$gw" \
            --prefill-metrics http://127.0.0.1:30410/metrics --model tiny-llama --iterations "$it" --instances "$inst" \
            --watchdog 60 --grace 5 --window 75 --request-timeout 60 \
            --out "$OLDPWD/benchmarks/$day-sglang-cpu-storm-$via-$tag.json") || true
    done
    stop
done
