#!/usr/bin/env bash
# GPU validation, for a node with the GPUs of the cluster file and sglang installed:
# bring up real SGLang PD workers (with pdgate's fixes) and the gateway, run the seed's
# storm and the agent sessions, collect both verdicts under runs/gpu-<date>/.
# Usage: scripts/gpu_validate.sh [CLUSTER_FILE] [MODEL_NAME]
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=${1:-config/cluster.sm120-8gpu.toml}
model=${2:-deepseek-v4-flash}
out=runs/gpu-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
python -m engine.sglang plan --cluster "$cluster" | tee "$out/plan.txt"
python -m pdgate up --cluster "$cluster" --port 30001 > "$out/up.log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
echo "waiting for the stack (model load can take many minutes)..."
for _ in $(seq 1 360); do
  curl -sf http://127.0.0.1:30001/readiness >/dev/null && break
  kill -0 $up 2>/dev/null || { echo "pdgate up exited; see $out/up.log"; exit 1; }
  sleep 5
done
curl -sf http://127.0.0.1:30001/readiness >/dev/null || { echo "not ready after 30 min"; exit 1; }
for w in $(python -c "import json,urllib.request;print(' '.join(w['url'] for w in json.load(urllib.request.urlopen('http://127.0.0.1:30001/v1/workers'))['workers']))"); do
  curl -s "$w/pdgate/v1/info" | tee -a "$out/fixes.json"; echo
done
set +e
python -m loadtest storm --gateway http://127.0.0.1:30001 --model "$model" --iterations 30 --instances 3 \
  --watchdog 60 --window 90 --restart-decode --out "$out/storm.json"
storm=$?
python -m loadtest agents --gateway http://127.0.0.1:30001 --model "$model" --sessions 16 --rounds 8 --growth 2000 \
  --deadline 300 --out "$out/agents.json"
agents=$?
echo "storm exit $storm, agents exit $agents; results in $out"
exit $(( storm != 0 || agents != 0 ))
